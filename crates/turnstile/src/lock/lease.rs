//! A lease kept alive by a watchdog, with a lost signal: the mechanism a lock guard and
//! an idempotency claim share. What is leased (a lock, a claimed key) and how it is
//! renewed is the owner's business ([`Renew`]); the deadline arithmetic, the renewal
//! loop, the hold cap and the lost signal are written here once.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;

pub(crate) use super::telemetry::LeaseKind;
use super::{BoxFuture, ExtendOutcome, LossReason, telemetry};
use crate::error::{Error, ErrorKind, Result};

/// Renews one lease in its store.
pub(crate) trait Renew: Send + Sync + 'static {
    /// Resets the lease to `ttl` from now if it is still ours.
    fn renew(&self, ttl: Duration) -> BoxFuture<'_, Result<ExtendOutcome>>;
}

/// The state of one lease, shared by its holder and its keeper task.
pub(crate) struct Lease {
    renewer: Box<dyn Renew>,
    pub(crate) kind: LeaseKind,
    /// The leased thing's name, for messages and telemetry.
    pub(crate) name: String,
    pub(crate) ttl: Duration,
    drift: Duration,
    /// Until when, on this host's monotonic clock, the lease is certainly still ours:
    /// the moment the last successful acquire/renewal was *sent*, plus the TTL, minus
    /// the drift allowance.
    valid_until: Mutex<Instant>,
    lost: CancellationToken,
    loss: OnceLock<LossReason>,
    /// The last renewal did not get an answer from the store (unreachable, too slow):
    /// the lease holds until `valid_until` unless a renewal gets through.
    suspended: std::sync::atomic::AtomicBool,
    /// When the request that took the lease was sent.
    pub(crate) started: Instant,
    /// Called once, when the lease is lost.
    on_lost: OnceLock<Box<dyn Fn() + Send + Sync>>,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("kind", &self.kind)
            .field("name", &self.name)
            .field("lost", &self.loss.get())
            .finish()
    }
}

impl Lease {
    /// A lease taken by a request sent at `sent`.
    pub(crate) fn new(
        renewer: impl Renew,
        kind: LeaseKind,
        name: String,
        ttl: Duration,
        drift: Duration,
        sent: Instant,
    ) -> Arc<Lease> {
        Arc::new(Lease {
            renewer: Box::new(renewer),
            kind,
            name,
            ttl,
            drift,
            valid_until: Mutex::new(sent + ttl - drift),
            lost: CancellationToken::new(),
            loss: OnceLock::new(),
            suspended: std::sync::atomic::AtomicBool::new(false),
            started: sent,
            on_lost: OnceLock::new(),
        })
    }

    /// Has `action` run once when the lease is lost (set before the keeper starts).
    pub(crate) fn on_lost(&self, action: impl Fn() + Send + Sync + 'static) {
        let _ = self.on_lost.set(Box::new(action));
    }

    pub(crate) fn valid_until(&self) -> Instant {
        *self.valid_until.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn renewed(&self, sent: Instant) {
        *self.valid_until.lock().unwrap_or_else(|p| p.into_inner()) = sent + self.ttl - self.drift;
        self.suspend(false);
    }

    fn suspend(&self, suspended: bool) {
        self.suspended
            .store(suspended, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether the last renewal failed to reach the store (and no later one succeeded).
    pub(crate) fn is_suspended(&self) -> bool {
        self.suspended.load(std::sync::atomic::Ordering::SeqCst) && !self.is_lost()
    }

    pub(crate) fn mark_lost(&self, reason: LossReason) {
        // The first reason wins; the signal fires once.
        if self.loss.set(reason).is_ok() {
            telemetry::lost(self.kind, &self.name, reason, self.started.elapsed());
            if let Some(action) = self.on_lost.get() {
                action();
            }
        }
        self.lost.cancel();
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.lost.is_cancelled()
    }

    pub(crate) fn loss_reason(&self) -> Option<LossReason> {
        self.loss.get().copied()
    }

    pub(crate) fn lost_signal(self: &Arc<Self>) -> LostSignal {
        let lease = Arc::clone(self);
        LostSignal {
            future: Box::pin(async move {
                lease.lost.cancelled().await;
                lease.loss.get().copied().unwrap_or(LossReason::Expired)
            }),
            fired: None,
        }
    }

    pub(crate) fn lost_token(&self) -> CancellationToken {
        self.lost.child_token()
    }

    /// Renews now, for the full TTL.
    pub(crate) async fn extend(&self) -> Result<()> {
        if let Some(reason) = self.loss_reason() {
            return Err(Error::lost(reason));
        }
        let sent = Instant::now();
        match self.renewer.renew(self.ttl).await? {
            ExtendOutcome::Extended => {
                self.renewed(sent);
                Ok(())
            }
            ExtendOutcome::Lost(reason) => {
                self.mark_lost(reason);
                Err(Error::lost(reason))
            }
        }
    }
}

/// The future returned by [`LockGuard::lost`](super::LockGuard::lost): completes with the
/// reason when the lease is lost. Polled again after that (in a `select!` loop, say), it
/// answers the same reason at once.
pub struct LostSignal {
    future: Pin<Box<dyn Future<Output = LossReason> + Send + Sync>>,
    fired: Option<LossReason>,
}

impl fmt::Debug for LostSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LostSignal")
    }
}

impl Future for LostSignal {
    type Output = LossReason;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<LossReason> {
        // The inner future must not be polled once it has completed.
        if let Some(reason) = self.fired {
            return Poll::Ready(reason);
        }
        let reason = std::task::ready!(self.future.as_mut().poll(cx));
        self.fired = Some(reason);
        Poll::Ready(reason)
    }
}

/// The task that keeps a lease: renews it every TTL/3 (with the watchdog on) and fires
/// the lost signal when the local validity deadline or the hold cap passes, or a renewal
/// finds the lease gone. Stopped (at once, without a last renewal) by [`stop`](Self::stop)
/// or when dropped.
pub(crate) struct Keeper {
    stop: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl Keeper {
    pub(crate) fn start(lease: Arc<Lease>, watchdog: bool, hold_cap: Option<Duration>) -> Keeper {
        let stop = CancellationToken::new();
        // A cap too far off to represent is no cap.
        let cap_at = hold_cap.and_then(|cap| lease.started.checked_add(cap));
        let task = tokio::spawn(keep(lease, watchdog, cap_at, stop.clone()));
        Keeper {
            stop,
            task: Some(task),
        }
    }

    pub(crate) fn stop(&mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        self.stop();
    }
}

/// How long to wait before retrying a renewal that failed with an error.
fn renewal_retry_delay(ttl: Duration) -> Duration {
    (ttl / 10).clamp(Duration::from_millis(5), Duration::from_secs(1))
}

async fn keep(
    lease: Arc<Lease>,
    watchdog: bool,
    hold_cap: Option<Instant>,
    stop: CancellationToken,
) {
    let renew_every = lease.ttl / 3;
    let mut next_renewal = lease.started + renew_every;
    loop {
        let valid_until = lease.valid_until();
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
            let renewing = lease.renewer.renew(lease.ttl);
            tokio::pin!(renewing);
            // A renewal still unanswered after a sixth of the TTL (a store that is down
            // may not answer at all before the deadline) suspends the lease meanwhile.
            let outcome = tokio::select! {
                outcome = &mut renewing => outcome,
                () = sleep_until(sent + lease.ttl / 6) => {
                    lease.suspend(true);
                    telemetry::renewal_slow(lease.kind, &lease.name, lease.ttl / 6);
                    renewing.await
                }
            };
            (sent, outcome)
        };
        tokio::select! {
            biased;
            () = stop.cancelled() => return,
            () = cap => {
                lease.mark_lost(LossReason::MaxHoldReached);
                return;
            }
            () = sleep_until(valid_until) => {
                if lease.valid_until() > valid_until {
                    // Renewed meanwhile by an explicit `extend`.
                    continue;
                }
                lease.mark_lost(if watchdog { LossReason::RenewalFailed } else { LossReason::LeaseElapsed });
                return;
            }
            (sent, outcome) = renewal => match outcome {
                Ok(ExtendOutcome::Extended) => {
                    lease.renewed(sent);
                    next_renewal = sent + renew_every;
                }
                Ok(ExtendOutcome::Lost(reason)) => {
                    lease.mark_lost(reason);
                    return;
                }
                Err(error) if error.kind() == ErrorKind::LockLost => {
                    lease.mark_lost(error.loss_reason().unwrap_or(LossReason::Expired));
                    return;
                }
                // The store is unreachable or slow: keep trying until the deadline.
                Err(error) => {
                    lease.suspend(true);
                    telemetry::renewal_failed(lease.kind, &lease.name, &error);
                    next_renewal = Instant::now() + renewal_retry_delay(lease.ttl);
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    /// A renewal that answers from a script: `Extended` while `ok` lasts, then the
    /// scripted failure. Counts its calls.
    struct Scripted {
        ok: u32,
        then: fn() -> Result<ExtendOutcome>,
        calls: Arc<AtomicU32>,
    }

    impl Renew for Scripted {
        fn renew(&self, _ttl: Duration) -> BoxFuture<'_, Result<ExtendOutcome>> {
            let call = self.calls.fetch_add(1, Ordering::SeqCst);
            let answer = if call < self.ok {
                Ok(ExtendOutcome::Extended)
            } else {
                (self.then)()
            };
            Box::pin(async move { answer })
        }
    }

    const TTL: Duration = Duration::from_secs(3);
    const DRIFT: Duration = Duration::from_millis(32);

    fn lease(ok: u32, then: fn() -> Result<ExtendOutcome>) -> (Arc<Lease>, Arc<AtomicU32>) {
        let calls = Arc::new(AtomicU32::new(0));
        let renewer = Scripted {
            ok,
            then,
            calls: Arc::clone(&calls),
        };
        let lease = Lease::new(
            renewer,
            LeaseKind::Lock,
            "t".into(),
            TTL,
            DRIFT,
            Instant::now(),
        );
        (lease, calls)
    }

    #[tokio::test(start_paused = true)]
    async fn failing_renewals_fire_the_signal_exactly_at_the_local_deadline() {
        let unreachable = || Err(Error::new(ErrorKind::StoreUnavailable, "down"));
        let (lease, calls) = lease(2, unreachable);
        let started = Instant::now();
        let _keeper = Keeper::start(Arc::clone(&lease), true, None);
        // After two good renewals (1 s, 2 s) the third, at 3 s, fails: suspended, not lost.
        sleep_until(started + TTL + Duration::from_millis(1)).await;
        assert!(lease.is_suspended(), "a failed renewal suspends the lease");
        assert!(!lease.is_lost());
        let reason = lease.lost_signal().await;
        assert!(!lease.is_suspended(), "a lost lease is lost, not suspended");
        assert_eq!(reason, LossReason::RenewalFailed);
        // Two renewals succeeded (at 1 s and 2 s), so the deadline is 2 s + TTL - drift.
        assert_eq!(started.elapsed(), 2 * TTL / 3 + TTL - DRIFT);
        assert!(calls.load(Ordering::SeqCst) > 3, "renewals were retried");
    }

    /// A store that never answers a renewal.
    struct Hanging;

    impl Renew for Hanging {
        fn renew(&self, _ttl: Duration) -> BoxFuture<'_, Result<ExtendOutcome>> {
            Box::pin(std::future::pending())
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_unanswered_renewal_suspends_the_lease_until_the_deadline() {
        let started = Instant::now();
        let lease = Lease::new(Hanging, LeaseKind::Lock, "t".into(), TTL, DRIFT, started);
        let _keeper = Keeper::start(Arc::clone(&lease), true, None);
        // The first renewal leaves at TTL/3; a sixth of the TTL later it is overdue.
        sleep_until(started + TTL / 3 + TTL / 6 - Duration::from_millis(1)).await;
        assert!(!lease.is_suspended());
        sleep_until(started + TTL / 3 + TTL / 6 + Duration::from_millis(1)).await;
        assert!(lease.is_suspended());
        assert_eq!(lease.lost_signal().await, LossReason::RenewalFailed);
        assert_eq!(started.elapsed(), TTL - DRIFT);
        assert!(!lease.is_suspended());
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewal_that_finds_the_lease_gone_fires_at_once() {
        let taken = || Ok(ExtendOutcome::Lost(LossReason::TakenOver));
        let (lease, _) = lease(1, taken);
        let started = Instant::now();
        let _keeper = Keeper::start(Arc::clone(&lease), true, None);
        assert_eq!(lease.lost_signal().await, LossReason::TakenOver);
        // The second renewal, at 2 TTL/3, found it.
        assert_eq!(started.elapsed(), 2 * TTL / 3);
    }

    #[tokio::test(start_paused = true)]
    async fn without_the_watchdog_the_signal_fires_at_the_first_deadline() {
        let never = || unreachable!("no renewal without the watchdog");
        let (lease, calls) = lease(0, never);
        let started = Instant::now();
        let _keeper = Keeper::start(Arc::clone(&lease), false, None);
        assert_eq!(lease.lost_signal().await, LossReason::LeaseElapsed);
        assert_eq!(started.elapsed(), TTL - DRIFT);
        assert_eq!(calls.load(Ordering::SeqCst), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_hold_cap_fires_while_renewals_succeed() {
        let (lease, _) = lease(u32::MAX, || unreachable!());
        let started = Instant::now();
        let _keeper = Keeper::start(Arc::clone(&lease), true, Some(Duration::from_secs(10)));
        assert_eq!(lease.lost_signal().await, LossReason::MaxHoldReached);
        assert_eq!(started.elapsed(), Duration::from_secs(10));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stopped_keeper_renews_no_more() {
        let (lease, calls) = lease(u32::MAX, || unreachable!());
        let mut keeper = Keeper::start(Arc::clone(&lease), true, None);
        tokio::time::sleep(TTL / 3 + Duration::from_millis(1)).await;
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        keeper.stop();
        tokio::time::sleep(10 * TTL).await;
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // Stopped is not lost: the holder released on purpose.
        assert!(!lease.is_lost());
    }
}
