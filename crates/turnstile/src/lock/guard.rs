//! A held lock: renewal by the watchdog, the lost signal, release.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;

use super::queue::{Handoff, LocalQueue};
use super::telemetry;
use super::{
    ExtendOutcome, LockBackend, LockName, LockOptions, LossReason, OwnerId, ReleaseOutcome,
    TryAcquire,
};
use crate::error::{Error, ErrorKind, Result};
use crate::fence::FencingToken;

/// State shared between a guard and its keeper task.
struct Held {
    backend: Arc<dyn LockBackend>,
    /// This name's local queue in the locker that acquired, for direct handoffs.
    queue: Arc<LocalQueue>,
    name: LockName,
    owner: OwnerId,
    token: FencingToken,
    ttl: Duration,
    drift: Duration,
    /// Until when, on this host's monotonic clock, the lease is certainly still ours:
    /// the moment the last successful acquire/extend was *sent*, plus the TTL, minus the
    /// drift allowance.
    valid_until: Mutex<Instant>,
    lost: CancellationToken,
    loss: OnceLock<LossReason>,
    /// Set once this holder stopped counting as a local holder in its queue.
    finished: AtomicBool,
    /// When the acquire request was sent, for how long the lock was held.
    acquired: Instant,
}

impl Held {
    fn valid_until(&self) -> Instant {
        *self.valid_until.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn renewed(&self, sent: Instant) {
        *self.valid_until.lock().unwrap_or_else(|p| p.into_inner()) = sent + self.ttl - self.drift;
    }

    /// Releases, or hands the lock straight to this process's next waiter for the name
    /// when one is sleeping (one atomic step on engines that support it).
    async fn release(&self) -> Result<ReleaseOutcome> {
        self.finish();
        let Some(offer) = self.queue.take_offer() else {
            let outcome = self.backend.release(&self.name, &self.owner).await?;
            telemetry::released(&self.name, outcome, false, self.acquired.elapsed());
            return Ok(outcome);
        };
        let sent = Instant::now();
        let (released, acquired) = self
            .backend
            .hand_over(&self.name, &self.owner, &offer.owner, offer.ttl)
            .await?;
        // On error above, dropping the offer wakes the waiter, which retries on its own.
        telemetry::released(&self.name, released, true, self.acquired.elapsed());
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

    fn mark_lost(&self, reason: LossReason) {
        // The first reason wins; the signal fires once.
        if self.loss.set(reason).is_ok() {
            telemetry::lost(&self.name, reason, self.acquired.elapsed());
        }
        self.lost.cancel();
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
    stop_keeper: CancellationToken,
    keeper: Option<JoinHandle<()>>,
    released: bool,
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("name", &self.held.name)
            .field("fencing_token", &self.held.token)
            .field("owner", &self.held.owner)
            .field("lost", &self.held.loss.get())
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
        token: FencingToken,
        sent: Instant,
        options: &LockOptions,
    ) -> LockGuard {
        let ttl = options.get_ttl();
        let drift = options.get_clock_drift();
        let held = Arc::new(Held {
            backend,
            queue,
            name,
            owner,
            token,
            ttl,
            drift,
            valid_until: Mutex::new(sent + ttl - drift),
            lost: CancellationToken::new(),
            loss: OnceLock::new(),
            finished: AtomicBool::new(false),
            acquired: sent,
        });
        held.queue.holder_started();
        let stop_keeper = CancellationToken::new();
        let keeper = tokio::spawn(keep(
            Arc::clone(&held),
            sent,
            options.get_watchdog(),
            // A cap too far off to represent is no cap.
            options.get_max_hold().and_then(|cap| sent.checked_add(cap)),
            stop_keeper.clone(),
        ));
        LockGuard {
            held,
            stop_keeper,
            keeper: Some(keeper),
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
        self.held.token
    }

    /// This acquisition's owner id.
    pub fn owner(&self) -> &OwnerId {
        &self.held.owner
    }

    /// Until when the lease is certainly ours by this host's monotonic clock (the
    /// moment the last successful acquire or renewal was sent, plus the TTL, minus the
    /// drift allowance), as a [`tokio::time::Instant`]: compare it with
    /// `tokio::time::Instant::now()`, or sleep until it with
    /// [`tokio::time::sleep_until`].
    pub fn valid_until(&self) -> Instant {
        self.held.valid_until()
    }

    /// Whether the lost signal has fired.
    pub fn is_lost(&self) -> bool {
        self.held.lost.is_cancelled()
    }

    /// Why the lock was lost, once it has been.
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.held.loss.get().copied()
    }

    /// A future that completes, with the reason, the moment ownership can no longer be
    /// assumed. It never completes if the lock is released normally.
    pub fn lost(&self) -> LostSignal {
        let held = Arc::clone(&self.held);
        LostSignal {
            future: Box::pin(async move {
                held.lost.cancelled().await;
                held.loss.get().copied().unwrap_or(LossReason::Expired)
            }),
        }
    }

    /// A cancellation token cancelled when the lock is lost; hand it to work that should
    /// stop then. Cancelling it yourself does not release the lock.
    pub fn lost_token(&self) -> CancellationToken {
        self.held.lost.child_token()
    }

    /// Renews the lease now, for its full TTL. Useful with the watchdog off.
    pub async fn extend(&self) -> Result<()> {
        if let Some(reason) = self.loss_reason() {
            return Err(Error::lost(reason));
        }
        let sent = Instant::now();
        match self
            .held
            .backend
            .extend(&self.held.name, &self.held.owner, self.held.ttl)
            .await?
        {
            ExtendOutcome::Extended => {
                self.held.renewed(sent);
                Ok(())
            }
            ExtendOutcome::Lost(reason) => {
                self.held.mark_lost(reason);
                Err(Error::lost(reason))
            }
        }
    }

    /// Stops the watchdog and releases the lock, reporting what the store found.
    ///
    /// The watchdog is stopped before the release is sent, so it sends no renewal after
    /// it; and no store re-creates a lock on renewal, so even a renewal already in
    /// flight cannot bring the lock back.
    ///
    /// If another task of the same [`Locker`](super::Locker) is waiting for this lock,
    /// the lock is handed straight to it (on Redis in one atomic script, with a new
    /// fencing token), up to 8 times in a row; the next release then goes through the
    /// store and wakes waiters in other processes too, so they are not starved.
    ///
    /// The call is bounded by the TTL (at least a second): past that the lease has run
    /// out on its own, so waiting longer for a store that does not answer serves
    /// nobody; the error says so.
    pub async fn release(mut self) -> Result<ReleaseOutcome> {
        self.released = true;
        self.stop_keeper.cancel();
        if let Some(keeper) = self.keeper.take() {
            keeper.abort();
        }
        let limit = self.held.ttl.max(Duration::from_secs(1));
        match tokio::time::timeout(limit, self.held.release()).await {
            Ok(outcome) => outcome,
            Err(_) => Err(Error::new(
                ErrorKind::StoreUnavailable,
                format!(
                    "lock \"{}\": the store {} did not confirm the release within {limit:?}; \
                     the lease runs out on its own",
                    self.held.name,
                    self.held.backend.describe()
                ),
            )),
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        self.stop_keeper.cancel();
        if let Some(keeper) = self.keeper.take() {
            keeper.abort();
        }
        // Never block in drop: hand the release to the runtime if there is one.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let held = Arc::clone(&self.held);
            runtime.spawn(async move {
                let _ = held.release().await;
            });
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        // A guard dropped without a runtime to release it still stops counting.
        self.finish();
    }
}

/// The future returned by [`LockGuard::lost`]: completes with the reason when the lock
/// is lost.
pub struct LostSignal {
    future: Pin<Box<dyn Future<Output = LossReason> + Send + Sync>>,
}

impl fmt::Debug for LostSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LostSignal")
    }
}

impl Future for LostSignal {
    type Output = LossReason;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<LossReason> {
        self.future.as_mut().poll(cx)
    }
}

/// How long to wait before retrying a renewal that failed with an error.
fn renewal_retry_delay(ttl: Duration) -> Duration {
    (ttl / 10).clamp(Duration::from_millis(5), Duration::from_secs(1))
}

/// The keeper task: renews the lease (watchdog on) and fires the lost signal when the
/// local validity deadline or the hold cap passes, or a renewal finds the lock gone.
async fn keep(
    held: Arc<Held>,
    acquired_sent: Instant,
    watchdog: bool,
    hold_cap: Option<Instant>,
    stop: CancellationToken,
) {
    let renew_every = held.ttl / 3;
    let mut next_renewal = acquired_sent + renew_every;
    loop {
        let valid_until = held.valid_until();
        let cap = async {
            match hold_cap {
                Some(at) => sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let renewal = async {
            if !watchdog {
                return std::future::pending().await;
            }
            sleep_until(next_renewal).await;
            let sent = Instant::now();
            let outcome = held.backend.extend(&held.name, &held.owner, held.ttl).await;
            (sent, outcome)
        };
        tokio::select! {
            biased;
            () = stop.cancelled() => return,
            () = cap => {
                held.mark_lost(LossReason::MaxHoldReached);
                return;
            }
            () = sleep_until(valid_until) => {
                if held.valid_until() > valid_until {
                    // Renewed meanwhile by an explicit `extend`.
                    continue;
                }
                held.mark_lost(if watchdog { LossReason::RenewalFailed } else { LossReason::LeaseElapsed });
                return;
            }
            (sent, outcome) = renewal => match outcome {
                Ok(ExtendOutcome::Extended) => {
                    held.renewed(sent);
                    next_renewal = sent + renew_every;
                }
                Ok(ExtendOutcome::Lost(reason)) => {
                    held.mark_lost(reason);
                    return;
                }
                Err(error) if error.kind() == ErrorKind::LockLost => {
                    held.mark_lost(error.loss_reason().unwrap_or(LossReason::Expired));
                    return;
                }
                // The store is unreachable or slow: keep trying until the deadline.
                Err(error) => {
                    telemetry::renewal_failed(&held.name, &error);
                    next_renewal = Instant::now() + renewal_retry_delay(held.ttl);
                }
            },
        }
    }
}
