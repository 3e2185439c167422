//! Distributed locks with fencing tokens.
//!
//! A [`Locker`] hands out [`LockGuard`]s for named locks kept in a shared store (a
//! [`LockBackend`]). The store implements only the atomic primitives; waiting, the
//! local queue, watchdog renewal and lost-lock detection live here, once, for every
//! engine.

use std::fmt;
use std::time::Duration;

use crate::error::{Error, ErrorKind, Result};

mod backend;
mod guard;
pub(crate) mod lease;
mod locker;
mod queue;
#[cfg(any(feature = "mysql", feature = "postgres"))]
mod session;
#[cfg(test)]
mod simulation;
pub mod telemetry;

#[cfg(feature = "etcd")]
pub mod etcd;
#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "postgres")]
pub mod postgres_session;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "redis")]
pub mod redlock;
#[cfg(feature = "sqlite")]
pub mod sqlite;
#[cfg(feature = "zookeeper")]
pub mod zookeeper;

#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) use crate::clock::ceil_millis;
pub use crate::error::LossReason;
pub use crate::future::BoxFuture;
pub use crate::name::{LockName, MAX_NAME_LEN};
pub use crate::notify::{ReleaseSignals, ReleaseWatch};
pub use backend::{
    ExtendOutcome, HolderAndValue, LockBackend, LockInfo, ReleaseOutcome, TryAcquire,
    TryAcquireUnfenced,
};
pub use guard::{DetachedLock, LockGuard, UnfencedGuard};
pub use lease::LostSignal;
pub(crate) use locker::describe_wait;
pub use locker::{Locker, MIN_ATTEMPT_TIME};

/// The longest wait bound or hold cap accepted: 100 years. Longer ones are refused
/// rather than overflow a clock; use [`LockOptions::wait_forever`] for no bound.
pub const MAX_WAIT: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Anything that names a lock: `&str`, `String`, or an already validated [`LockName`].
/// Text is validated when the lock is used, with an [`ErrorKind::InvalidName`] error.
pub trait IntoLockName {
    /// Validates and converts.
    fn into_lock_name(self) -> Result<LockName>;
}

impl IntoLockName for LockName {
    fn into_lock_name(self) -> Result<LockName> {
        Ok(self)
    }
}

impl IntoLockName for &LockName {
    fn into_lock_name(self) -> Result<LockName> {
        Ok(self.clone())
    }
}

impl IntoLockName for &str {
    fn into_lock_name(self) -> Result<LockName> {
        LockName::new(self)
    }
}

impl IntoLockName for String {
    fn into_lock_name(self) -> Result<LockName> {
        LockName::new(self)
    }
}

impl IntoLockName for &String {
    fn into_lock_name(self) -> Result<LockName> {
        LockName::new(self.as_str())
    }
}

/// Identifies one acquisition: 128 random bits, fresh for every acquire.
///
/// Ownership belongs to the acquisition, never to a thread or a task, so a guard can
/// move between tasks and only the acquisition that took the lock can extend or
/// release it.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct OwnerId {
    // Kept as the 32 hex digits stores compare, so no request formats it again.
    hex: String,
}

impl OwnerId {
    /// A fresh random owner id.
    pub fn random() -> Self {
        OwnerId {
            hex: crate::hex::hex(&rand::random::<u128>().to_be_bytes()),
        }
    }

    /// Parses an id handed out before ([`to_hex`](Self::to_hex)): exactly 32 lowercase
    /// hex digits. This is how a service that gives leases to remote clients
    /// ([`LockGuard::detach`]) takes the owner id back.
    ///
    /// ```
    /// use turnstile::lock::OwnerId;
    /// let owner = OwnerId::random();
    /// assert_eq!(OwnerId::parse(owner.as_str()).unwrap(), owner);
    /// assert!(OwnerId::parse("not-an-owner").is_err());
    /// ```
    pub fn parse(hex: &str) -> Result<Self> {
        if hex.len() != 32 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(Error::new(
                ErrorKind::InvalidOptions,
                format!(
                    "an owner id is 32 lowercase hex digits, as the acquire returned it; got {:?}",
                    hex.chars().take(40).collect::<String>()
                ),
            ));
        }
        Ok(OwnerId {
            hex: hex.to_owned(),
        })
    }

    /// The id as 32 lowercase hex digits, the form stores keep.
    pub fn to_hex(&self) -> String {
        self.hex.clone()
    }

    /// The id as 32 lowercase hex digits, borrowed.
    pub fn as_str(&self) -> &str {
        &self.hex
    }
}

impl fmt::Debug for OwnerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OwnerId({})", self.hex)
    }
}

impl fmt::Display for OwnerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex)
    }
}

/// How a lock is taken and kept.
///
/// ```
/// use std::time::Duration;
/// use turnstile::lock::LockOptions;
///
/// let options = LockOptions::new()
///     .ttl(Duration::from_secs(10))
///     .wait(Duration::from_secs(2))
///     .max_hold(Duration::from_secs(300));
/// assert_eq!(options.get_ttl(), Duration::from_secs(10));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockOptions {
    ttl: Duration,
    wait: Option<Duration>,
    max_hold: Option<Duration>,
    watchdog: bool,
    drift: Option<Duration>,
}

impl Default for LockOptions {
    fn default() -> Self {
        LockOptions {
            ttl: Duration::from_secs(30),
            wait: Some(Duration::from_secs(10)),
            max_hold: None,
            watchdog: true,
            drift: None,
        }
    }
}

impl LockOptions {
    /// Defaults: TTL 30 s, wait up to 10 s, no cap on hold time, watchdog on.
    pub fn new() -> Self {
        LockOptions::default()
    }

    /// The lease length, from 10 ms to one year (the default is 30 s). A holder that
    /// crashes frees the lock after at most this long; while the guard lives the
    /// watchdog renews the lease every TTL/3. Some engines round it or cap it further:
    /// MySQL counts whole seconds, PostgreSQL session mode takes at most 24 days.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How long [`Locker::acquire`] waits for a held lock before giving up with
    /// [`ErrorKind::AcquireTimeout`]; at most [`MAX_WAIT`] (use
    /// [`wait_forever`](Self::wait_forever) for no bound). `Duration::ZERO` tries once.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// Wait as long as it takes.
    pub fn wait_forever(mut self) -> Self {
        self.wait = None;
        self
    }

    /// Cap on how long one acquisition may be held in total, renewals included, at most
    /// [`MAX_WAIT`]. When it is reached the watchdog stops renewing and the lost signal
    /// fires.
    pub fn max_hold(mut self, max_hold: Duration) -> Self {
        self.max_hold = Some(max_hold);
        self
    }

    /// Turns the watchdog on (the default) or off. Without it the lease simply runs out
    /// after one TTL, and the lost signal fires when the local validity deadline passes.
    pub fn watchdog(mut self, on: bool) -> Self {
        self.watchdog = on;
        self
    }

    /// Allowance for clock rate differences between this host and the store, taken off
    /// every lease when computing the local validity deadline. Defaults to 1% of the
    /// TTL plus 2 ms.
    pub fn clock_drift(mut self, drift: Duration) -> Self {
        self.drift = Some(drift);
        self
    }

    /// The lease length.
    pub fn get_ttl(&self) -> Duration {
        self.ttl
    }

    /// How long `acquire` waits; `None` is forever.
    pub fn get_wait(&self) -> Option<Duration> {
        self.wait
    }

    /// The cap on total hold time, if any.
    pub fn get_max_hold(&self) -> Option<Duration> {
        self.max_hold
    }

    /// Whether the watchdog renews the lease.
    pub fn get_watchdog(&self) -> bool {
        self.watchdog
    }

    /// The drift allowance in force.
    pub fn get_clock_drift(&self) -> Duration {
        self.drift
            .unwrap_or(self.ttl / 100 + Duration::from_millis(2))
    }

    /// Checks the options, with an error that says what to change.
    pub fn validate(&self) -> Result<()> {
        if self.ttl.is_zero() {
            return Err(Error::new(
                ErrorKind::InvalidOptions,
                "the lock TTL must be greater than zero",
            ));
        }
        if self.ttl < Duration::from_millis(10) {
            return Err(Error::new(
                ErrorKind::InvalidOptions,
                format!(
                    "the lock TTL must be at least 10ms (stores count in milliseconds); got {:?}",
                    self.ttl
                ),
            ));
        }
        if self.ttl > Duration::from_secs(365 * 24 * 3600) {
            return Err(Error::new(
                ErrorKind::InvalidOptions,
                format!("the lock TTL must be at most a year; got {:?}", self.ttl),
            ));
        }
        if self.get_clock_drift() >= self.ttl {
            return Err(Error::new(
                ErrorKind::InvalidOptions,
                format!(
                    "the clock drift allowance ({:?}) must be smaller than the TTL ({:?})",
                    self.get_clock_drift(),
                    self.ttl
                ),
            ));
        }
        for (what, value) in [("wait", self.wait), ("cap on hold time", self.max_hold)] {
            if value.is_some_and(|value| value > MAX_WAIT) {
                return Err(Error::new(
                    ErrorKind::InvalidOptions,
                    format!(
                        "the {what} must be at most 100 years; got {value:?} (to wait without a bound, use wait_forever)",
                        value = value.unwrap_or_default()
                    ),
                ));
            }
        }
        if self.max_hold.is_some_and(|cap| cap.is_zero()) {
            return Err(Error::new(
                ErrorKind::InvalidOptions,
                "the cap on hold time must be greater than zero",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated() {
        assert_eq!(
            LockName::new("").unwrap_err().kind(),
            ErrorKind::InvalidName
        );
        assert_eq!(
            LockName::new("a\nb").unwrap_err().kind(),
            ErrorKind::InvalidName
        );
        assert_eq!(
            LockName::new("x".repeat(MAX_NAME_LEN + 1))
                .unwrap_err()
                .kind(),
            ErrorKind::InvalidName
        );
        assert!(LockName::new("x".repeat(MAX_NAME_LEN)).is_ok());
        assert!(LockName::new("注文:123/{tag}").is_ok());
    }

    #[test]
    fn options_are_validated() {
        assert!(LockOptions::new().validate().is_ok());
        for bad in [
            LockOptions::new().ttl(Duration::ZERO),
            LockOptions::new().ttl(Duration::from_millis(5)),
            LockOptions::new()
                .ttl(Duration::from_secs(1))
                .clock_drift(Duration::from_secs(1)),
            LockOptions::new().max_hold(Duration::ZERO),
            LockOptions::new().wait(Duration::MAX),
            LockOptions::new().max_hold(Duration::from_secs(10_000_000_000_000_000_000)),
        ] {
            assert_eq!(
                bad.validate().unwrap_err().kind(),
                ErrorKind::InvalidOptions
            );
        }
    }

    #[test]
    fn owner_ids_are_unique_and_hex() {
        let a = OwnerId::random();
        let b = OwnerId::random();
        assert_ne!(a, b);
        assert_eq!(a.to_hex().len(), 32);
    }

    #[test]
    fn millis_round_up() {
        assert_eq!(ceil_millis(Duration::from_micros(1500)), 2);
        assert_eq!(ceil_millis(Duration::from_millis(3)), 3);
    }
}
