//! The storage-engine trait: only the atomic primitives.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::sync::watch;

use super::{LockName, LossReason, OwnerId};
use crate::error::Result;
use crate::fence::FencingToken;

/// A boxed, sendable future: what [`LockBackend`] methods return, so the trait stays
/// object-safe and a store can be chosen at run time from a URL.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A storage engine for locks.
///
/// An engine implements the atomic primitives and nothing else; each must be a single
/// atomic step in the store. Waiting, the local queue, renewal and loss detection are
/// written once in [`Locker`](super::Locker) and [`LockGuard`](super::LockGuard).
///
/// Contracts every engine keeps (the conformance suite checks them):
/// - `try_acquire` succeeds for exactly one of any number of concurrent callers while
///   the lock is free, and issues a [`FencingToken`] larger than every token issued
///   before for that name.
/// - `extend` and `release` act only when `owner` holds the lock; `extend` never
///   re-creates a lock that has expired or was released.
/// - Expiry is decided by one clock for all clients (the store's, or the host's for a
///   store that lives on one host), never by each client's own clock.
pub trait LockBackend: Send + Sync + fmt::Debug + 'static {
    /// Takes the lock for `owner` for `ttl` if it is free (never held, released or expired).
    fn try_acquire<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<TryAcquire>>;

    /// Takes the lock for `owner` for `ttl` if it is free, **without a fencing token**,
    /// for [`Locker::acquire_unfenced`](super::Locker::acquire_unfenced), whose guard has
    /// none. Exclusion, the lease, renewal and release are those of
    /// [`try_acquire`](Self::try_acquire), and a later fenced acquisition still gets a
    /// token larger than every one issued before. An engine that can skip the token's
    /// bookkeeping does (Redis: `SET NX PX`, no script); the default takes the fenced
    /// path and forgets the token, which saves nothing.
    fn try_acquire_unfenced<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<TryAcquireUnfenced>> {
        Box::pin(async move {
            Ok(match self.try_acquire(name, owner, ttl).await? {
                TryAcquire::Acquired { .. } => TryAcquireUnfenced::Acquired,
                TryAcquire::Held { remaining_ttl } => TryAcquireUnfenced::Held { remaining_ttl },
            })
        })
    }

    /// Whether [`try_acquire_unfenced`](Self::try_acquire_unfenced) is cheaper here than
    /// [`try_acquire`](Self::try_acquire) (`false` unless the engine overrides it).
    fn unfenced_is_cheaper(&self) -> bool {
        false
    }

    /// Resets the lease of a lock `owner` holds to `ttl` from now.
    fn extend<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<ExtendOutcome>>;

    /// Releases the lock if `owner` holds it, and wakes waiters.
    fn release<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
    ) -> BoxFuture<'a, Result<ReleaseOutcome>>;

    /// The current holder, if the lock is held.
    fn inspect<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<LockInfo>>>;

    /// An operator's forced release, whoever holds the lock. Returns what was held.
    fn force_release<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<LockInfo>>>;

    /// Starts listening for releases of `name`. The watch is registered before the
    /// future completes, so a release that happens after it returns is never missed.
    fn watch_releases<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<ReleaseWatch>>;

    /// A short description of the store for messages (its URL without a password).
    fn describe(&self) -> String;

    /// Creates the store's tables if missing; harmless to run again or concurrently.
    /// Stores without a schema (Redis) have nothing to do.
    fn migrate(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async { Ok(()) })
    }

    /// Forgets what the store keeps for lock names that nobody has held for at least
    /// `unused_for` (SQL rows, tokens), and returns how many names it forgot. Locks
    /// held now, or whose lease ended more recently, are left alone. The engines that
    /// keep such records (SQLite, PostgreSQL, MySQL) floor new tokens by a clock, so
    /// a forgotten name's tokens keep increasing as long as that clock does not step
    /// back. [`Locker::prune`](super::Locker::prune) checks `unused_for` first.
    ///
    /// The default forgets nothing: a store whose keys expire on their own (Redis,
    /// whose tokens are floored by the server's clock too), or whose tokens are the
    /// cluster's own write counter and need no record per name (etcd's create
    /// revision, ZooKeeper's creation zxid; they do not come from a clock).
    fn prune(&self, unused_for: Duration) -> BoxFuture<'_, Result<u64>> {
        let _ = unused_for;
        Box::pin(async { Ok(0) })
    }

    /// Whether a refused [`try_acquire`](Self::try_acquire) leaves `owner` waiting in the
    /// store's own line (ZooKeeper: its node stays, so it comes next in order), and a
    /// later `try_acquire` for the same owner checks its place instead of joining again.
    ///
    /// The lock core then calls [`release`](Self::release) for an owner that stops
    /// waiting without the lock (its wait bound passed, an error, its future dropped, a
    /// `try_acquire` that may not wait), and does not stand back after a run of
    /// hand-overs between its own tasks: the line gives waiters elsewhere their turn.
    /// The default is `false`: a refusal leaves nothing behind.
    fn keeps_waiters_in_line(&self) -> bool {
        false
    }

    /// Releases like [`release`](Self::release) and says whether the release woke
    /// waiters in other processes: `Some(true)` when the store told at least one waiter
    /// it marked, `Some(false)` when it knows that nobody elsewhere waits, `None` when it
    /// cannot tell (the default).
    ///
    /// The lock core asks after a run of hand-overs between its own tasks: when waiters
    /// elsewhere were woken it stands back long enough for one of them to get in on a
    /// loaded machine, and otherwise only briefly, so a process alone with its lock
    /// loses little.
    fn release_waking_others<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
    ) -> BoxFuture<'a, Result<(ReleaseOutcome, Option<bool>)>> {
        Box::pin(async move { Ok((self.release(name, owner).await?, None)) })
    }

    /// Releases the lock held by `from` and tries to take it for `to`, used to hand a
    /// lock straight to the next waiter in the same process.
    ///
    /// The default runs [`release`](Self::release) then [`try_acquire`](Self::try_acquire);
    /// an engine that can do both in one atomic step (Redis: one script) should, which
    /// saves a round trip and the wake-up. The acquisition for `to` must follow the
    /// same rules as `try_acquire`, including a fresh, larger fencing token.
    fn hand_over<'a>(
        &'a self,
        name: &'a LockName,
        from: &'a OwnerId,
        to: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(ReleaseOutcome, TryAcquire)>> {
        Box::pin(release_then_acquire(self, name, from, to, ttl))
    }
}

/// The answer to [`LockBackend::try_acquire`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TryAcquire {
    /// The lock is ours, with this fencing token.
    Acquired {
        /// The acquisition's fencing token.
        token: FencingToken,
    },
    /// Someone else holds it.
    Held {
        /// The holder's remaining lease, when the store knows it: when to check again
        /// if no release notification arrives.
        remaining_ttl: Option<Duration>,
    },
}

/// The answer to [`LockBackend::try_acquire_unfenced`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TryAcquireUnfenced {
    /// The lock is ours (no token).
    Acquired,
    /// Someone else holds it.
    Held {
        /// The holder's remaining lease, when the store knows it.
        remaining_ttl: Option<Duration>,
    },
}

/// The answer to [`LockBackend::extend`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ExtendOutcome {
    /// The lease now runs for the full TTL again.
    Extended,
    /// The lock is no longer ours.
    Lost(LossReason),
}

impl ExtendOutcome {
    /// From a store's two answers: whether the renewal applied, and whether another
    /// owner holds the lock (or claim) now.
    #[cfg_attr(
        not(any(
            feature = "sqlite",
            feature = "postgres",
            feature = "redis",
            feature = "etcd",
            feature = "zookeeper"
        )),
        allow(dead_code)
    )]
    pub(crate) fn from_answers(renewed: bool, taken_by_another: bool) -> Self {
        match (renewed, taken_by_another) {
            (true, _) => ExtendOutcome::Extended,
            (false, true) => ExtendOutcome::Lost(LossReason::TakenOver),
            (false, false) => ExtendOutcome::Lost(LossReason::Expired),
        }
    }
}

/// A hand-over's answer when the store moved the lock to its new owner in one step with
/// `token`; without one (the old owner no longer held it), a release followed by an
/// acquire, as [`LockBackend::hand_over`]'s default does.
#[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
pub(crate) async fn moved_or_released<B: LockBackend + ?Sized>(
    backend: &B,
    moved: Option<i64>,
    name: &LockName,
    from: &OwnerId,
    to: &OwnerId,
    ttl: Duration,
) -> Result<(ReleaseOutcome, TryAcquire)> {
    match moved {
        Some(token) => Ok((
            ReleaseOutcome::Released,
            TryAcquire::Acquired {
                token: FencingToken::new(u64::try_from(token).unwrap_or(0)),
            },
        )),
        None => release_then_acquire(backend, name, from, to, ttl).await,
    }
}

/// A hand-over in two steps: `from` releases, then `to` tries to acquire. What
/// [`LockBackend::hand_over`] does by default, and what an engine with a one-step
/// hand-over falls back to when `from` no longer held the lock.
pub(crate) async fn release_then_acquire<B: LockBackend + ?Sized>(
    backend: &B,
    name: &LockName,
    from: &OwnerId,
    to: &OwnerId,
    ttl: Duration,
) -> Result<(ReleaseOutcome, TryAcquire)> {
    let released = backend.release(name, from).await?;
    Ok((released, backend.try_acquire(name, to, ttl).await?))
}

/// What a release found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReleaseOutcome {
    /// We held the lock and it is now free.
    Released,
    /// Our lease had already expired (or been broken); nobody else holds it under our name.
    AlreadyExpired,
    /// Our lease had expired and another acquisition holds the lock now; it was left alone.
    HeldByOther,
}

impl fmt::Display for ReleaseOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReleaseOutcome::Released => "released",
            ReleaseOutcome::AlreadyExpired => "had already expired",
            ReleaseOutcome::HeldByOther => "held by another owner",
        })
    }
}

/// A held lock as the store sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockInfo {
    /// The holder's owner id (32 hex digits).
    pub owner: String,
    /// The holder's fencing token; `None` for a holder that took the lock unfenced
    /// ([`Locker::acquire_unfenced`](super::Locker::acquire_unfenced)) on an engine
    /// that then keeps no token for it.
    pub fencing_token: Option<FencingToken>,
    /// How long the lease has left, by the store's clock.
    pub remaining_ttl: Option<Duration>,
}

/// A subscription to release notifications for one lock name.
///
/// Dropping it unsubscribes. An engine without cross-process notifications sets a poll
/// backoff: waiters then re-check at growing intervals between `min` and `max`.
pub struct ReleaseWatch {
    receiver: Option<watch::Receiver<u64>>,
    poll: Option<(Duration, Duration)>,
    next_poll: Duration,
    _subscription: Option<Box<dyn Send + Sync>>,
}

impl fmt::Debug for ReleaseWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReleaseWatch")
            .field("notified", &self.receiver.is_some())
            .field("poll", &self.poll)
            .finish()
    }
}

impl ReleaseWatch {
    /// A watch fed by `receiver` (each change is a release); `subscription` is dropped
    /// with the watch and should unsubscribe.
    pub fn new(receiver: watch::Receiver<u64>, subscription: impl Send + Sync + 'static) -> Self {
        ReleaseWatch {
            receiver: Some(receiver),
            poll: None,
            next_poll: Duration::ZERO,
            _subscription: Some(Box::new(subscription)),
        }
    }

    /// A watch with no notifications at all: waiters only poll.
    pub fn polling(min: Duration, max: Duration) -> Self {
        ReleaseWatch {
            receiver: None,
            poll: Some((min, max)),
            next_poll: min,
            _subscription: None,
        }
    }

    /// Adds polling between `min` and `max` (doubling) for releases the notifications
    /// cannot see, such as those by other processes.
    pub fn with_poll(mut self, min: Duration, max: Duration) -> Self {
        self.poll = Some((min, max));
        self.next_poll = min;
        self
    }

    /// The longest interval between re-checks, for a watch that polls.
    pub(crate) fn poll_max(&self) -> Option<Duration> {
        self.poll.map(|(_, max)| max)
    }

    /// Whether the notification source is gone (the connection carrying it dropped);
    /// the waiter should subscribe again.
    pub fn is_closed(&self) -> bool {
        self.receiver
            .as_ref()
            .is_some_and(|receiver| receiver.has_changed().is_err())
    }

    /// Waits until a release is announced or `limit` passes, whichever is first, and
    /// (with `poll`) no longer than the poll interval. Returns `true` if a release was
    /// announced.
    pub(crate) async fn wait(&mut self, limit: Duration, poll: bool) -> bool {
        let limit = match self.poll {
            Some((_, max)) if poll => {
                let interval = self.next_poll.min(limit);
                self.next_poll = (self.next_poll * 2).min(max);
                interval
            }
            _ => limit,
        };
        let notified = async {
            match self.receiver.as_mut() {
                // A closed source (the connection carrying notifications dropped, say on
                // a server restart) wakes the waiter too: it re-checks at once and
                // subscribes again, instead of sleeping out the holder's whole TTL.
                Some(receiver) => {
                    let _ = receiver.changed().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        let announced = tokio::select! {
            () = notified => true,
            () = tokio::time::sleep(limit) => false,
        };
        if announced && let Some((min, _)) = self.poll {
            self.next_poll = min;
        }
        announced
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    fn millis(values: &[u64]) -> Vec<Duration> {
        values.iter().map(|&ms| Duration::from_millis(ms)).collect()
    }

    /// The waiters' backoff the engines without cross-process notifications state
    /// (SQLite from 2 ms doubling to 50 ms; MySQL, PostgreSQL session mode and
    /// `turnstile_notify=off` from 5 ms to 100 ms): a waiter re-checks after the
    /// minimum, then twice as long each time up to the maximum, never later than the
    /// caller's limit, and starts again from the minimum once a release was announced.
    /// While a task of the same process holds the lock (`poll` false) it does not poll
    /// at all: it waits for the announcement or the limit.
    #[tokio::test(start_paused = true)]
    async fn polling_backs_off_from_its_minimum_doubling_to_its_maximum() {
        let limit = Duration::from_secs(10);
        for (min, max, intervals) in [
            (2, 50, millis(&[2, 4, 8, 16, 32, 50, 50])),
            (5, 100, millis(&[5, 10, 20, 40, 80, 100, 100])),
        ] {
            let (announce, receiver) = watch::channel(0u64);
            let mut watch = ReleaseWatch::new(receiver, ())
                .with_poll(Duration::from_millis(min), Duration::from_millis(max));
            let mut waited = Vec::new();
            for _ in 0..intervals.len() {
                let started = Instant::now();
                assert!(!watch.wait(limit, true).await);
                waited.push(started.elapsed());
            }
            assert_eq!(waited, intervals, "from {min} ms to {max} ms");

            // A release announced: the waiter wakes at once, and backs off from the
            // minimum again.
            announce.send(1).unwrap();
            let started = Instant::now();
            assert!(watch.wait(limit, true).await);
            assert_eq!(started.elapsed(), Duration::ZERO);
            let started = Instant::now();
            assert!(!watch.wait(limit, true).await);
            assert_eq!(started.elapsed(), Duration::from_millis(min));

            // The caller's limit, when shorter, comes first.
            // (Whole milliseconds: tokio's timers have no finer resolution.)
            let short = Duration::from_millis(min - 1);
            let started = Instant::now();
            assert!(!watch.wait(short, true).await);
            assert_eq!(started.elapsed(), short);

            // No polling: only the limit ends the wait.
            let started = Instant::now();
            assert!(!watch.wait(limit, false).await);
            assert_eq!(started.elapsed(), limit);
        }
    }
}
