//! Optimistic locking: no lock at all; check a version at write time and retry on
//! conflict, the notes' alternative to locking first.
//!
//! The caller's attempt reads the row with its version, computes, and writes with
//! `UPDATE … SET …, version = version + 1 WHERE id = ? AND version = ?`. If no row
//! changed, someone else wrote first: the attempt returns [`Attempt::Conflict`] and
//! [`retry`] runs it again after a jittered, growing pause, a bounded number of times.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> turnstile::Result<()> {
//! use turnstile::optimistic::{retry, Attempt, RetryPolicy};
//!
//! let mut tries = 0;
//! let value = retry(&RetryPolicy::new(), |_attempt| {
//!     tries += 1;
//!     let outcome = if tries < 3 { Attempt::Conflict } else { Attempt::Done(tries) };
//!     async move { Ok(outcome) }
//! })
//! .await?;
//! assert_eq!(value, 3);
//! # Ok(())
//! # }
//! ```

use std::future::Future;
use std::time::Duration;

use crate::error::{Error, ErrorKind, Result};

/// What one optimistic attempt found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt<T> {
    /// The version matched and the write applied.
    Done(T),
    /// Someone else changed the row first; try again.
    Conflict,
}

/// How often and how patiently [`retry`] tries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    attempts: u32,
    first_pause: Duration,
    max_pause: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            attempts: 10,
            first_pause: Duration::from_millis(2),
            max_pause: Duration::from_millis(200),
        }
    }
}

impl RetryPolicy {
    /// Defaults: 10 attempts, pauses from 2 ms doubling up to 200 ms, each jittered.
    pub fn new() -> Self {
        RetryPolicy::default()
    }

    /// How many attempts in all (at least 1).
    pub fn attempts(mut self, attempts: u32) -> Self {
        self.attempts = attempts.max(1);
        self
    }

    /// The pause before the second attempt; it doubles after each conflict.
    pub fn first_pause(mut self, pause: Duration) -> Self {
        self.first_pause = pause;
        self
    }

    /// The longest pause between attempts.
    pub fn max_pause(mut self, pause: Duration) -> Self {
        self.max_pause = pause;
        self
    }

    /// The pause after the conflict of attempt `attempt` (0-based): "full jitter", a
    /// random time up to the doubled bound, so that writers who collided do not collide
    /// again in step.
    fn pause(&self, attempt: u32) -> Duration {
        let bound = self
            .first_pause
            .saturating_mul(1u32 << attempt.min(16))
            .min(self.max_pause);
        bound.mul_f64(rand::random::<f64>())
    }
}

/// Runs `attempt` until it returns [`Attempt::Done`], pausing with jitter after each
/// [`Attempt::Conflict`], at most `policy`'s number of attempts; then fails with
/// [`ErrorKind::Conflict`]. Errors from an attempt end the loop at once.
///
/// `attempt` gets the 0-based attempt number.
pub async fn retry<T, F, Fut>(policy: &RetryPolicy, mut attempt: F) -> Result<T>
where
    F: FnMut(u32) -> Fut,
    Fut: Future<Output = Result<Attempt<T>>>,
{
    for number in 0..policy.attempts {
        match attempt(number).await? {
            Attempt::Done(value) => return Ok(value),
            Attempt::Conflict if number + 1 < policy.attempts => {
                tokio::time::sleep(policy.pause(number)).await;
            }
            Attempt::Conflict => {}
        }
    }
    Err(Error::new(
        ErrorKind::Conflict,
        format!(
            "the row kept changing underneath: {} attempts all met a newer version",
            policy.attempts
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn gives_up_after_the_bounded_attempts() {
        let mut calls = 0;
        let error = retry(&RetryPolicy::new().attempts(4), |_| {
            calls += 1;
            async { Ok(Attempt::<()>::Conflict) }
        })
        .await
        .unwrap_err();
        assert_eq!(error.kind(), ErrorKind::Conflict);
        assert_eq!(calls, 4);
    }

    #[test]
    fn pauses_grow_and_stay_bounded() {
        let policy = RetryPolicy::new()
            .first_pause(Duration::from_millis(10))
            .max_pause(Duration::from_millis(50));
        for attempt in 0..40 {
            assert!(policy.pause(attempt) <= Duration::from_millis(50));
        }
        assert!(policy.pause(0) <= Duration::from_millis(10));
    }
}
