//! The storage-engine trait: only the atomic primitives.

use std::fmt;
use std::time::Duration;

use super::{LockName, LossReason, OwnerId};
use crate::error::Result;
use crate::fence::FencingToken;
use crate::future::BoxFuture;
use crate::notify::ReleaseWatch;

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

    /// Records `value` as what `owner`, the holder of `name`, advertises (an
    /// [election](crate::election)'s leader value: an address, an instance id), and wakes
    /// the watchers of `name` ([`watch_releases`](Self::watch_releases)), so observers
    /// see it at once. One atomic step that applies only while `owner` holds the lock,
    /// so a holder that lost it cannot overwrite its successor's value. Returns whether
    /// it applied.
    ///
    /// A value belongs to one acquisition: a new holder starts with none. Engines that
    /// cannot keep one say so with [`keeps_holder_values`](Self::keeps_holder_values);
    /// the default refuses with [`ErrorKind::UnsupportedStore`](crate::ErrorKind).
    fn proclaim<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        value: &'a str,
    ) -> BoxFuture<'a, Result<bool>> {
        let _ = (name, owner, value);
        Box::pin(async move {
            Err(crate::error::Error::new(
                crate::error::ErrorKind::UnsupportedStore,
                format!(
                    "the store {} cannot keep a leader's value (proclaim); campaign with an \
                     empty value there, or use SQLite, Redis or PostgreSQL",
                    self.describe()
                ),
            ))
        })
    }

    /// The holder of `name`, as [`inspect`](Self::inspect) tells it, with the value it
    /// [proclaimed](Self::proclaim) (`None` if it proclaimed none, or the engine keeps
    /// no values). One read, so the value is the holder's own, never a predecessor's.
    fn inspect_with_value<'a>(
        &'a self,
        name: &'a LockName,
    ) -> BoxFuture<'a, Result<Option<HolderAndValue>>> {
        Box::pin(async move { Ok(self.inspect(name).await?.map(|info| (info, None))) })
    }

    /// Whether [`proclaim`](Self::proclaim) is supported (`false` unless the engine
    /// overrides it).
    fn keeps_holder_values(&self) -> bool {
        false
    }

    /// Stores `permits` as the number of permits of the [semaphore](crate::semaphore)
    /// `name`, unless a number is stored for it already, and returns the stored number:
    /// one atomic step, so that of clients that disagree the first to declare wins and
    /// every other learns the number it must use. The number is kept until an operator
    /// forgets it ([`forget_permits`](Self::forget_permits)).
    ///
    /// The default refuses with [`ErrorKind::UnsupportedStore`](crate::ErrorKind): an
    /// engine that cannot keep the number atomically (RedLock, whose nodes are
    /// independent) cannot keep a semaphore's holders from overcommitting.
    fn declare_permits<'a>(
        &'a self,
        name: &'a LockName,
        permits: u32,
    ) -> BoxFuture<'a, Result<u32>> {
        let _ = (name, permits);
        Box::pin(async move { Err(no_semaphores(self.describe())) })
    }

    /// The number of permits stored for the semaphore `name`, if any (a read only).
    fn stored_permits<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<u32>>> {
        let _ = name;
        Box::pin(async move { Err(no_semaphores(self.describe())) })
    }

    /// Forgets the number of permits stored for the semaphore `name` (an operator's
    /// step before declaring another number); returns the number forgotten, if any.
    fn forget_permits<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<u32>>> {
        let _ = name;
        Box::pin(async move { Err(no_semaphores(self.describe())) })
    }

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

/// The refusal of an engine that keeps no semaphores.
fn no_semaphores(store: String) -> crate::error::Error {
    crate::error::Error::new(
        crate::error::ErrorKind::UnsupportedStore,
        format!(
            "the store {store} cannot keep a semaphore's number of permits atomically, so \
             it cannot keep more holders than permits out; use one Redis node (or Sentinel, \
             Cluster), SQLite, PostgreSQL, MySQL, etcd or ZooKeeper"
        ),
    )
}

/// A held lock with the value its holder [proclaimed](LockBackend::proclaim) (`None`:
/// none proclaimed, or an engine that keeps no values), what
/// [`LockBackend::inspect_with_value`] answers.
pub type HolderAndValue = (LockInfo, Option<String>);

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
