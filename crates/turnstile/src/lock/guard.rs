//! A held lock: its lease (renewal by the watchdog, the lost signal) and its release.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::lease::{Keeper, Lease, LeaseKind, LostSignal, Renew};
use super::queue::{Handoff, LocalQueue, Successor};
use super::telemetry;
use super::{
    BoxFuture, ExtendOutcome, LockBackend, LockName, LockOptions, LossReason, OwnerId,
    ReleaseOutcome, TryAcquire,
};
use crate::error::{Error, ErrorKind, Result};
use crate::fence::FencingToken;

/// How a lock's lease is renewed: `extend` on its store, for its owner.
struct LockRenewal {
    backend: Arc<dyn LockBackend>,
    name: LockName,
    owner: OwnerId,
}

impl Renew for LockRenewal {
    fn renew(&self, ttl: Duration) -> BoxFuture<'_, Result<ExtendOutcome>> {
        self.backend.extend(&self.name, &self.owner, ttl)
    }
}

/// What a guard shares with the release that may outlive it (a release on drop).
struct Held {
    backend: Arc<dyn LockBackend>,
    /// This name's local queue in the locker that acquired, for direct handoffs.
    queue: Arc<LocalQueue>,
    name: LockName,
    owner: OwnerId,
    /// `None` for an unfenced acquisition.
    token: Option<FencingToken>,
    lease: Arc<Lease>,
    /// Set once this holder stopped counting as a local holder in its queue.
    finished: AtomicBool,
}

impl Held {
    /// Releases, or hands the lock straight to this process's next waiter for the name
    /// when one is sleeping (one atomic step on engines that support it).
    async fn release(&self) -> Result<ReleaseOutcome> {
        self.finish();
        let held_for = self.lease.started.elapsed();
        let offer = match self.queue.take_offer() {
            Successor::Local(offer) => offer,
            to_store => {
                let outcome = if let Successor::StoreAfterRun = to_store {
                    let (outcome, woke_others) = self
                        .backend
                        .release_waking_others(&self.name, &self.owner)
                        .await?;
                    self.queue.run_released(woke_others);
                    outcome
                } else {
                    self.backend.release(&self.name, &self.owner).await?
                };
                telemetry::released(&self.name, outcome, false, Some(held_for));
                return Ok(outcome);
            }
        };
        let sent = Instant::now();
        let (released, acquired) = self
            .backend
            .hand_over(&self.name, &self.owner, &offer.owner, offer.ttl)
            .await?;
        // On error above, dropping the offer wakes the waiter, which retries on its own.
        telemetry::released(&self.name, released, true, Some(held_for));
        let handoff = Handoff {
            sent,
            outcome: Ok(acquired),
        };
        if let Err(unclaimed) = offer.reply.send(handoff) {
            // The waiter gave up meanwhile: undo the acquisition made for it.
            if let Ok(TryAcquire::Acquired { .. }) = unclaimed.outcome {
                let _ = self.backend.release(&self.name, &offer.owner).await;
            }
        }
        Ok(released)
    }

    /// Stops counting as a local holder (once), before the lock is given up.
    fn finish(&self) {
        if !self.finished.swap(true, Ordering::SeqCst) {
            self.queue.holder_finished();
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        // A guard dropped without a runtime to release it still stops counting.
        self.finish();
    }
}

/// Proof of holding a lock, with its fencing token.
///
/// While the guard lives, a watchdog task renews the lease every TTL/3 (unless turned
/// off in [`LockOptions`]). If ownership can no longer be assumed, the lost signal
/// ([`lost`](Self::lost), [`lost_token`](Self::lost_token)) fires at once.
///
/// Release with [`release`](Self::release), which reports what it found. Dropping the
/// guard also releases, **in the background and not immediately**: the watchdog stops
/// at once, but the release request is only sent when the runtime next polls the
/// spawned task, and if no tokio runtime is running the lock is left to expire after
/// its TTL.
///
/// The guard is `Send` and `Sync`; ownership belongs to the acquisition, so the guard
/// can move between tasks and threads.
pub struct LockGuard {
    held: Arc<Held>,
    keeper: Keeper,
    released: bool,
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("name", &self.held.name)
            .field("fencing_token", &self.held.token)
            .field("owner", &self.held.owner)
            .field("lost", &self.held.lease.loss_reason())
            .finish()
    }
}

impl LockGuard {
    /// Starts keeping a lock that was acquired by a request sent at `sent`.
    pub(crate) fn start(
        backend: Arc<dyn LockBackend>,
        queue: Arc<LocalQueue>,
        name: LockName,
        owner: OwnerId,
        token: Option<FencingToken>,
        sent: Instant,
        options: &LockOptions,
    ) -> LockGuard {
        // The simulation's mutant: the deadline counted from the reply (must be caught).
        #[cfg(test)]
        let sent = if super::simulation::deadline_at_reply() {
            Instant::now()
        } else {
            sent
        };
        let lease = Lease::new(
            LockRenewal {
                backend: Arc::clone(&backend),
                name: name.clone(),
                owner: owner.clone(),
            },
            LeaseKind::Lock,
            name.as_str().to_owned(),
            options.get_ttl(),
            options.get_clock_drift(),
            sent,
        );
        queue.holder_started();
        let held = Arc::new(Held {
            backend,
            queue,
            name,
            owner,
            token,
            lease: Arc::clone(&lease),
            finished: AtomicBool::new(false),
        });
        // A lost lease is no longer a local holder that will hand the lock over or
        // announce its release: this process's waiter goes back to the store (which
        // may have freed the lock already) instead of sleeping until the guard drops.
        let weak = Arc::downgrade(&held);
        lease.on_lost(move || {
            if let Some(held) = weak.upgrade() {
                held.finish();
                held.queue.wake_waiter();
            }
        });
        let keeper = Keeper::start(lease, options.get_watchdog(), options.get_max_hold());
        LockGuard {
            held,
            keeper,
            released: false,
        }
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        &self.held.name
    }

    /// This acquisition's fencing token: pass it with every write to the protected
    /// resource (see [`crate::fence`]).
    pub fn fencing_token(&self) -> FencingToken {
        // A `LockGuard` is only handed out for a fenced acquisition; an unfenced one is
        // wrapped in an `UnfencedGuard`, which has no way to ask.
        self.held
            .token
            .expect("a LockGuard is made only for a fenced acquisition")
    }

    /// This acquisition's owner id.
    pub fn owner(&self) -> &OwnerId {
        &self.held.owner
    }

    /// The token, if the acquisition has one (for telemetry).
    pub(crate) fn held_token(&self) -> Option<u64> {
        self.held.token.map(FencingToken::get)
    }

    /// Until when the lease is certainly ours by this host's monotonic clock (the
    /// moment the last successful acquire or renewal was sent, plus the TTL, minus the
    /// drift allowance), as a [`tokio::time::Instant`]: compare it with
    /// `tokio::time::Instant::now()`, or sleep until it with
    /// [`tokio::time::sleep_until`].
    pub fn valid_until(&self) -> Instant {
        self.held.lease.valid_until()
    }

    /// Whether the lock is **suspended**: the watchdog's last renewal failed to reach the
    /// store, or has had no answer for a sixth of the TTL (the store is unreachable or
    /// slow; on ZooKeeper, the connection is lost while the session may live on), and no
    /// renewal has succeeded since. The lock still counts as held
    /// until [`valid_until`](Self::valid_until): if a renewal gets through before then,
    /// the suspension ends; if not, the lost signal fires at that deadline with
    /// [`LossReason::RenewalFailed`]. Work that must not run without a confirmed lock
    /// can pause while this is true. Never true once the lock is lost.
    pub fn is_suspended(&self) -> bool {
        self.held.lease.is_suspended()
    }

    /// Whether the lost signal has fired.
    pub fn is_lost(&self) -> bool {
        self.held.lease.is_lost()
    }

    /// Why the lock was lost, once it has been.
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.held.lease.loss_reason()
    }

    /// A future that completes, with the reason, the moment ownership can no longer be
    /// assumed. It never completes if the lock is released normally.
    pub fn lost(&self) -> LostSignal {
        self.held.lease.lost_signal()
    }

    /// A cancellation token cancelled when the lock is lost; hand it to work that should
    /// stop then. Cancelling it yourself does not release the lock.
    pub fn lost_token(&self) -> CancellationToken {
        self.held.lease.lost_token()
    }

    /// Renews the lease now, for its full TTL. Useful with the watchdog off.
    pub async fn extend(&self) -> Result<()> {
        self.held.lease.extend().await
    }

    /// Stops the watchdog and releases the lock, reporting what the store found.
    ///
    /// The watchdog is stopped before the release is sent, so it sends no renewal after
    /// it; and no store re-creates a lock on renewal, so even a renewal already in
    /// flight cannot bring the lock back.
    ///
    /// If another task of the same [`Locker`](super::Locker) is waiting for this lock,
    /// the lock is handed straight to it in one step with a new fencing token, up to 8
    /// times in a row; the next release then goes through the store and wakes waiters in
    /// other processes too, so they are not starved.
    ///
    /// The call is bounded by the TTL (at least a second): past that the lease has run
    /// out on its own, so waiting longer for a store that does not answer serves
    /// nobody; the error says so.
    pub async fn release(mut self) -> Result<ReleaseOutcome> {
        self.released = true;
        self.keeper.stop();
        let release = bounded_release(Arc::clone(&self.held));
        // In a task of its own, so that a caller that stops waiting (a timeout around
        // this call, a cancelled task) does not leave the lock held until its TTL.
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => runtime.spawn(release).await.unwrap_or_else(|error| {
                Err(Error::new(
                    ErrorKind::Store,
                    format!(
                        "lock \"{}\": the release task failed: {error}",
                        self.held.name
                    ),
                ))
            }),
            Err(_) => release.await,
        }
    }
}

/// Releases, bounded by the TTL (at least a second): past that the lease has run out
/// on its own.
async fn bounded_release(held: Arc<Held>) -> Result<ReleaseOutcome> {
    let limit = held.lease.ttl.max(Duration::from_secs(1));
    match tokio::time::timeout(limit, held.release()).await {
        Ok(outcome) => outcome,
        Err(_) => Err(Error::new(
            ErrorKind::StoreUnavailable,
            format!(
                "lock \"{}\": the store {} did not confirm the release within {limit:?}; \
                 the lease runs out on its own",
                held.name,
                held.backend.describe()
            ),
        )),
    }
}

/// A lock taken by [`LockGuard::detach`]: held in the store with nobody in this process
/// renewing it. Whoever holds these facts (a remote client of a lock service) keeps it
/// with [`Locker::extend_detached`](super::Locker::extend_detached) before the lease
/// runs out and gives it back with
/// [`Locker::release_detached`](super::Locker::release_detached).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DetachedLock {
    /// The lock's name.
    pub name: LockName,
    /// The acquisition's owner id: what extending and releasing need.
    pub owner: OwnerId,
    /// The acquisition's fencing token.
    pub fencing_token: FencingToken,
    /// The lease's length: the store frees the lock this long after the acquire (or
    /// the last extension) unless it is extended.
    pub ttl: Duration,
}

impl LockGuard {
    /// Stops keeping the lock in this process without releasing it: no more renewals,
    /// no release on drop, no lost signal. The lock stays held in the store until its
    /// lease runs out or someone releases it with the returned owner id.
    ///
    /// This is for handing a lease to someone who is not this process (the HTTP lock
    /// service gives it to its client); code that does the work itself keeps the guard.
    ///
    /// ```
    /// # async fn demo(locker: turnstile::lock::Locker) -> turnstile::Result<()> {
    /// use turnstile::lock::LockOptions;
    /// let lease = locker.acquire("report", &LockOptions::new()).await?.detach();
    /// // … later, perhaps from another process on the same store:
    /// locker.release_detached(&lease.name, &lease.owner).await?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn detach(mut self) -> DetachedLock {
        self.released = true;
        self.keeper.stop();
        self.held.finish();
        DetachedLock {
            name: self.held.name.clone(),
            owner: self.held.owner.clone(),
            fencing_token: self.fencing_token(),
            ttl: self.held.lease.ttl,
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        self.keeper.stop();
        // Never block in drop: hand the release to the runtime if there is one.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(bounded_release(Arc::clone(&self.held)));
        }
    }
}

/// Proof of holding a lock taken **without a fencing token**
/// ([`Locker::acquire_unfenced`](super::Locker::acquire_unfenced)): a lock that only saves
/// work (a duplicate run costs time or money, not correctness).
///
/// Everything of a [`LockGuard`] but the token: the owner id, the watchdog, the lost
/// signal, the release and the in-process hand-over. There is no `fencing_token()`, so
/// a fenced write (see [`crate::fence`]) cannot be made with this guard: a holder
/// paused past its lease, or cut off from the store, can act after another has taken
/// the lock, and nothing stops its writes. Use [`Locker::acquire`](super::Locker::acquire)
/// where that matters.
///
/// ```no_run
/// # async fn demo(locker: turnstile::lock::Locker) -> turnstile::Result<()> {
/// use turnstile::lock::LockOptions;
/// let guard = locker.acquire_unfenced("rebuild-cache", &LockOptions::new()).await?;
/// // ... rebuild the cache; another instance would only have done the same work ...
/// guard.release().await?;
/// # Ok(())
/// # }
/// ```
pub struct UnfencedGuard {
    guard: LockGuard,
}

impl fmt::Debug for UnfencedGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnfencedGuard")
            .field("name", &self.guard.held.name)
            .field("owner", &self.guard.held.owner)
            .field("lost", &self.guard.held.lease.loss_reason())
            .finish()
    }
}

impl UnfencedGuard {
    pub(crate) fn new(guard: LockGuard) -> UnfencedGuard {
        UnfencedGuard { guard }
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        self.guard.name()
    }

    /// This acquisition's owner id.
    pub fn owner(&self) -> &OwnerId {
        self.guard.owner()
    }

    /// Until when the lease is certainly ours by this host's monotonic clock (see
    /// [`LockGuard::valid_until`]).
    pub fn valid_until(&self) -> Instant {
        self.guard.valid_until()
    }

    /// Whether the lock is suspended (see [`LockGuard::is_suspended`]).
    pub fn is_suspended(&self) -> bool {
        self.guard.is_suspended()
    }

    /// Whether the lost signal has fired.
    pub fn is_lost(&self) -> bool {
        self.guard.is_lost()
    }

    /// Why the lock was lost, once it has been.
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.guard.loss_reason()
    }

    /// A future that completes, with the reason, the moment ownership can no longer be
    /// assumed (see [`LockGuard::lost`]).
    pub fn lost(&self) -> LostSignal {
        self.guard.lost()
    }

    /// A cancellation token cancelled when the lock is lost.
    pub fn lost_token(&self) -> CancellationToken {
        self.guard.lost_token()
    }

    /// Renews the lease now, for its full TTL.
    pub async fn extend(&self) -> Result<()> {
        self.guard.extend().await
    }

    /// Stops the watchdog and releases the lock (see [`LockGuard::release`]).
    pub async fn release(self) -> Result<ReleaseOutcome> {
        self.guard.release().await
    }
}
