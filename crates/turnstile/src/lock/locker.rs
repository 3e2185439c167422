//! Acquiring: the local queue, waiting for release notifications, timeouts.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::queue::{Handoff, HandoffOffer, LocalQueue};
use super::telemetry;

use super::{
    ExtendOutcome, IntoLockName, LockBackend, LockGuard, LockInfo, LockName, LockOptions, OwnerId,
    ReleaseOutcome, ReleaseWatch, TryAcquire, TryAcquireUnfenced, UnfencedGuard,
};
use crate::error::{Error, ErrorKind, Result};
use crate::fence::FencingToken;

/// How long a waiter sleeps before checking again when the store does not say how long
/// the holder's lease has left.
const DEFAULT_RECHECK: Duration = Duration::from_secs(1);

/// How long an acquire that gave up waits for the store to take its waiter out of line
/// (on stores that keep waiters in line) before leaving that to the background: a
/// busy store must not stretch the caller's wait bound by a whole round of writes.
const LEAVE_LINE_GRACE: Duration = Duration::from_millis(100);

/// The least time a single attempt gets, even from a call that may not wait
/// (`wait(Duration::ZERO)`): one round trip to a store that is up takes far less.
pub const MIN_ATTEMPT_TIME: Duration = Duration::from_secs(1);

/// After the hand-over cap, how long this process stands back when waiters elsewhere
/// are woken by the same notification as this one (they need no poll interval), at
/// most; the store saying it woke some lengthens the pause to this (see
/// [`LockBackend::release_waking_others`](super::LockBackend::release_waking_others)).
const YIELD_TO_NOTIFIED_WAITERS: Duration = Duration::from_millis(20);

/// The shortest pause worth taking (the timer's resolution).
const MIN_PAUSE: Duration = Duration::from_millis(1);

/// The time limit of one `acquire` or `try_acquire` call, applied to every request it
/// makes.
struct Bound<'a> {
    name: &'a LockName,
    /// The store, described only when an error needs it (not on every call).
    backend: &'a dyn LockBackend,
    wait: Option<Duration>,
    /// `None`: wait forever (or a bound so large that it cannot be represented).
    deadline: Option<Instant>,
    /// The deadline for one request: the call's, but at least [`MIN_ATTEMPT_TIME`].
    attempt_deadline: Option<Instant>,
}

impl<'a> Bound<'a> {
    fn new(
        name: &'a LockName,
        locker: &'a Locker,
        options: &LockOptions,
        started: Instant,
    ) -> Self {
        let wait = options.get_wait();
        let deadline = wait.and_then(|wait| started.checked_add(wait));
        let attempt_deadline = deadline.map(|deadline| deadline.max(started + MIN_ATTEMPT_TIME));
        Bound {
            name,
            backend: locker.inner.backend.as_ref(),
            wait,
            deadline,
            attempt_deadline,
        }
    }

    fn timed_out(&self) -> Error {
        Error::new(
            ErrorKind::AcquireTimeout,
            format!(
                "lock \"{}\" is still held after waiting {}",
                self.name,
                describe_wait(self.wait.unwrap_or_default())
            ),
        )
    }

    /// Runs one request to the store within the call's bound.
    async fn run<T>(&self, request: impl Future<Output = Result<T>>) -> Result<T> {
        let Some(deadline) = self.attempt_deadline else {
            return request.await;
        };
        tokio::time::timeout_at(deadline, request)
            .await
            .unwrap_or_else(|_| {
                Err(Error::new(
                    ErrorKind::StoreUnavailable,
                    format!(
                        "lock \"{}\": the store {} did not answer within the wait bound ({})",
                        self.name,
                        self.backend.describe(),
                        describe_wait(self.wait.unwrap_or_default().max(MIN_ATTEMPT_TIME))
                    ),
                ))
            })
    }

    /// Waits for something local (the queue) within the call's own wait bound.
    async fn run_waiting<T>(&self, wait: impl Future<Output = Result<T>>) -> Result<T> {
        match self.deadline {
            Some(deadline) => tokio::time::timeout_at(deadline, wait)
                .await
                .unwrap_or_else(|_| Err(self.timed_out())),
            None => wait.await,
        }
    }
}

/// A duration as people write it: `300ms`, `2s`, `1.5s`.
pub(crate) fn describe_wait(duration: Duration) -> String {
    if duration < Duration::from_secs(1) {
        format!("{}ms", duration.as_millis())
    } else {
        format!("{}s", (duration.as_secs_f64() * 1000.0).round() / 1000.0)
    }
}

/// Hands out locks kept in one store.
///
/// Cheap to clone; clones share the store connection and the local queue. Inside one
/// process, at most one waiter per lock name contends with the store at a time; the
/// others queue locally, first come first served, so a release wakes one waiter, not a
/// herd.
///
/// ```
/// # #[cfg(feature = "sqlite")]
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> turnstile::Result<()> {
/// use std::time::Duration;
/// use turnstile::lock::{Locker, LockOptions};
///
/// let dir = tempfile::tempdir().unwrap();
/// let url = format!("sqlite://{}", dir.path().join("locks.db").display());
/// let locker = Locker::connect(&url).await?;
///
/// let options = LockOptions::new().ttl(Duration::from_secs(10));
/// let guard = locker.acquire("invoice:42", &options).await?;
/// println!("holding with fencing token {}", guard.fencing_token());
/// guard.release().await?;
/// # Ok(())
/// # }
/// # #[cfg(not(feature = "sqlite"))]
/// # fn main() {}
/// ```
#[derive(Clone)]
pub struct Locker {
    inner: Arc<Inner>,
}

struct Inner {
    backend: Arc<dyn LockBackend>,
    queues: Mutex<Queues>,
    /// A moving average of how long one acquisition request to the store takes, in µs
    /// (0 before the first): what a waiter elsewhere needs, once woken, to get in.
    acquire_micros: std::sync::atomic::AtomicU64,
}

impl Inner {
    fn record_acquire_time(&self, took: Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        let sample = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let old = self.acquire_micros.load(Relaxed);
        let new = if old == 0 {
            sample
        } else {
            old.saturating_mul(7).saturating_add(sample) / 8
        };
        self.acquire_micros.store(new, Relaxed);
    }

    fn acquire_time(&self) -> Duration {
        Duration::from_micros(
            self.acquire_micros
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    }
}

#[derive(Default)]
struct Queues {
    by_name: HashMap<LockName, Weak<LocalQueue>>,
    /// Table size after the last sweep of dead entries; the next sweep runs when the
    /// table has doubled, so sweeping costs O(1) per acquire on average.
    swept_at: usize,
}

impl fmt::Debug for Locker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locker")
            .field("store", &self.inner.backend.describe())
            .finish()
    }
}

impl Locker {
    /// A locker over `backend`.
    pub fn new(backend: impl LockBackend) -> Self {
        Locker::from_arc(Arc::new(backend))
    }

    /// A locker over a shared backend.
    pub fn from_arc(backend: Arc<dyn LockBackend>) -> Self {
        Locker {
            inner: Arc::new(Inner {
                backend,
                queues: Mutex::default(),
                acquire_micros: std::sync::atomic::AtomicU64::new(0),
            }),
        }
    }

    /// The store.
    pub fn backend(&self) -> &Arc<dyn LockBackend> {
        &self.inner.backend
    }

    fn queue(&self, name: &LockName) -> Arc<LocalQueue> {
        let mut queues = self.inner.queues.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(queue) = queues.by_name.get(name).and_then(Weak::upgrade) {
            return queue;
        }
        if queues.by_name.len() >= 2 * queues.swept_at.max(32) {
            queues.by_name.retain(|_, queue| queue.strong_count() > 0);
            queues.swept_at = queues.by_name.len();
        }
        let queue = Arc::new(LocalQueue::default());
        queues.by_name.insert(name.clone(), Arc::downgrade(&queue));
        queue
    }

    /// Tries once to take the lock; `Ok(None)` if someone else holds it.
    ///
    /// The store gets up to [`MIN_ATTEMPT_TIME`] to answer; a store that does not is
    /// reported as [`ErrorKind::StoreUnavailable`].
    pub async fn try_acquire<N>(&self, name: N, options: &LockOptions) -> Result<Option<LockGuard>>
    where
        N: IntoLockName,
    {
        self.try_acquire_as(name, options, true).await
    }

    /// Tries once to take the lock **without a fencing token**; `Ok(None)` if someone
    /// else holds it. See [`acquire_unfenced`](Self::acquire_unfenced).
    pub async fn try_acquire_unfenced<N>(
        &self,
        name: N,
        options: &LockOptions,
    ) -> Result<Option<UnfencedGuard>>
    where
        N: IntoLockName,
    {
        Ok(self
            .try_acquire_as(name, options, false)
            .await?
            .map(UnfencedGuard::new))
    }

    async fn try_acquire_as<N>(
        &self,
        name: N,
        options: &LockOptions,
        fenced: bool,
    ) -> Result<Option<LockGuard>>
    where
        N: IntoLockName,
    {
        options.validate()?;
        let name = name.into_lock_name()?;
        let owner = OwnerId::random();
        let started = Instant::now();
        let bound = Bound::new(&name, self, options, started);
        let answer = bound
            .run(self.attempt(&self.queue(&name), &name, &owner, options, fenced))
            .await;
        match answer {
            Ok(Attempt::Acquired(guard)) => {
                telemetry::acquired(&name, guard.held_token(), started.elapsed(), false);
                Ok(Some(guard))
            }
            Ok(Attempt::Held { .. }) => {
                // This call does not wait: leave the line a refused attempt may have
                // joined.
                if self.inner.backend.keeps_waiters_in_line() {
                    self.leave_line(&name, &owner).await;
                }
                Ok(None)
            }
            Err(error) => {
                telemetry::not_acquired(&name, &error, started.elapsed());
                self.undo_uncertain(&name, &owner, &error);
                Err(error)
            }
        }
    }

    /// Takes the lock, waiting up to the options' wait bound.
    ///
    /// The wait is driven by release notifications from the store, with a re-check when
    /// the holder's lease would run out in case a notification is lost; it is not a
    /// sleep-retry loop. Dropping the returned future at any point is safe: a request
    /// already sent that turns out to have taken the lock is released in the background.
    ///
    /// The wait bound covers the whole call, every request to the store included; a
    /// call that may not wait at all (`wait(Duration::ZERO)`) still gives the store up
    /// to [`MIN_ATTEMPT_TIME`] to answer its one attempt. On stores that keep waiters in
    /// line (etcd, ZooKeeper), a call that gives up also gives the store up to 100 ms to
    /// take its waiter out of line, then leaves the rest to the background.
    ///
    /// Errors: [`ErrorKind::AcquireTimeout`] when the wait bound passes while the lock
    /// is held. If the store cannot be reached on the first try, the error comes back
    /// at once; a store that becomes unreachable while this call waits (a restart, a
    /// failover) is retried with a backoff until the wait bound, and
    /// [`ErrorKind::StoreUnavailable`] is returned if that passes first.
    pub async fn acquire<N>(&self, name: N, options: &LockOptions) -> Result<LockGuard>
    where
        N: IntoLockName,
    {
        self.acquire_fenced_or_not(name, options, true).await
    }

    /// Takes the lock **without a fencing token**, waiting up to the options' wait
    /// bound: for locks that only save work (Kleppmann's *efficiency* locks), where a
    /// duplicate run costs time or money, not correctness.
    ///
    /// Everything else is as for [`acquire`](Self::acquire): the owner id, the wait
    /// driven by release notifications, the fair per-process queue, the watchdog, the
    /// lost signal. The guard has no token, so a fenced write cannot be made with it.
    /// An engine that can skip the token's bookkeeping does (Redis: a bare
    /// `SET NX PX`, no script, and a release that announces itself as usual); on the
    /// others ([`LockBackend::unfenced_is_cheaper`] says which) the fenced path is taken
    /// and the token forgotten, so the mode costs nothing there and saves nothing.
    /// Fenced and unfenced acquisitions of one name exclude each other, and a fenced
    /// acquisition after an unfenced one still gets a token larger than every token
    /// issued before.
    pub async fn acquire_unfenced<N>(&self, name: N, options: &LockOptions) -> Result<UnfencedGuard>
    where
        N: IntoLockName,
    {
        self.acquire_fenced_or_not(name, options, false)
            .await
            .map(UnfencedGuard::new)
    }

    async fn acquire_fenced_or_not<N>(
        &self,
        name: N,
        options: &LockOptions,
        fenced: bool,
    ) -> Result<LockGuard>
    where
        N: IntoLockName,
    {
        options.validate()?;
        let name = name.into_lock_name()?;
        let owner = OwnerId::random();
        let started = Instant::now();
        // On a store that keeps waiters in line, a waiter that stops waiting (an error,
        // the wait bound, or this future dropped) must leave the line.
        let keeps_line = self.inner.backend.keeps_waiters_in_line();
        let leave_line = UndoOnDrop {
            backend: Arc::clone(&self.inner.backend),
            name: &name,
            owner: &owner,
            armed: keeps_line,
        };
        let result = self.acquire_as(&name, &owner, options, fenced).await;
        leave_line.disarm();
        match &result {
            Ok((guard, handed_over)) => {
                telemetry::acquired(&name, guard.held_token(), started.elapsed(), *handed_over)
            }
            Err(error) => {
                telemetry::not_acquired(&name, error, started.elapsed());
                if keeps_line {
                    self.leave_line(&name, &owner).await;
                } else {
                    self.undo_uncertain(&name, &owner, error);
                }
            }
        }
        result.map(|(guard, _)| guard)
    }

    /// Takes a waiter that stopped waiting (or a refused attempt) out of the store's
    /// line. The call's wait bound has passed (or the store failed, or the call may not
    /// wait), so the store gets only
    /// [`LEAVE_LINE_GRACE`] to answer before the call returns; the rest goes on in the
    /// background, as when an acquire is dropped.
    async fn leave_line(&self, name: &LockName, owner: &OwnerId) {
        let release = self.inner.backend.release(name, owner);
        if tokio::time::timeout(LEAVE_LINE_GRACE, release)
            .await
            .is_err()
        {
            tokio::spawn(release_until_not_held(
                Arc::clone(&self.inner.backend),
                name.clone(),
                owner.clone(),
            ));
        }
    }

    async fn acquire_as(
        &self,
        name: &LockName,
        owner: &OwnerId,
        options: &LockOptions,
        fenced: bool,
    ) -> Result<(LockGuard, bool)> {
        let started = Instant::now();
        let bound = Bound::new(name, self, options, started);
        let queue = self.queue(name);
        let mut contender = bound
            .run_waiting(async { Ok(queue.contender.lock().await) })
            .await?;
        // While a guard of this locker holds the lock, asking the store is pointless: the
        // holder hands the lock over or announces its release.
        let mut wait_first = queue.held_locally()
            && options.get_wait() != Some(Duration::ZERO)
            && contender.as_ref().is_some_and(|watch| !watch.is_closed());
        // Once the store has answered, a waiter rides out a store that goes away for a
        // while (a restart, a failover) until its wait bound; an unreachable store on
        // the first attempt is reported at once.
        let mut outage = Outage::default();
        loop {
            let remaining_ttl = if std::mem::take(&mut wait_first) {
                Some(options.get_ttl())
            } else {
                match bound
                    .run(self.attempt(&queue, name, owner, options, fenced))
                    .await
                {
                    Ok(Attempt::Acquired(guard)) => return Ok((guard, false)),
                    Ok(Attempt::Held { remaining_ttl }) => {
                        outage.answered();
                        remaining_ttl
                    }
                    Err(error) => {
                        // The wait bound cut off a request to a store that has been
                        // answering (the lock was held at its last answer): the store
                        // is slow, not gone, and the lock was still held when the wait
                        // ran out. Dropping the request undid whatever it may have taken.
                        if outage.answered
                            && outage.failures == 0
                            && error.kind() == ErrorKind::StoreUnavailable
                            && bound
                                .deadline
                                .is_some_and(|deadline| deadline <= Instant::now())
                        {
                            return Err(bound.timed_out());
                        }
                        outage.pause_or_fail(error, bound.deadline).await?;
                        continue;
                    }
                }
            };
            let now = Instant::now();
            if bound.deadline.is_some_and(|deadline| deadline <= now) {
                return Err(bound.timed_out());
            }
            // Subscribe on the first refusal (the uncontended path never does), then
            // try again at once: a release between our attempt and the subscription
            // would otherwise go unnoticed until the re-check.
            if contender.as_ref().is_none_or(ReleaseWatch::is_closed) {
                match bound.run(self.inner.backend.watch_releases(name)).await {
                    Ok(watch) => *contender = Some(watch),
                    Err(error) => outage.pause_or_fail(error, bound.deadline).await?,
                }
                continue;
            }
            let recheck = remaining_ttl
                .map(|ttl| ttl + Duration::from_millis(1))
                .unwrap_or(DEFAULT_RECHECK);
            let limit = match bound.deadline {
                Some(deadline) => recheck.min(deadline - now),
                None => recheck,
            };
            let Some(watch) = contender.as_mut() else {
                continue;
            };
            // Sleep until a release is announced, the re-check is due, or a holder in
            // this process hands the lock over directly.
            let (reply, mut handed) = oneshot::channel();
            queue.offer(HandoffOffer {
                owner: owner.clone(),
                ttl: options.get_ttl(),
                reply,
            });
            // While a task of this process holds the lock, only it can free it (by a
            // hand-over or a release it announces locally), so there is nothing to
            // poll for; polling then would only race the hand-over.
            let poll = !queue.held_locally();
            // `Some` once the offer is answered: a hand-over, or the holder dropping the
            // offer after its hand-over failed (then this waiter tries on its own). The
            // channel must not be awaited again after either.
            let answered = tokio::select! {
                handoff = &mut handed => Some(handoff.ok()),
                _ = watch.wait(limit, poll) => None,
            };
            let handoff = match answered {
                Some(handoff) => handoff,
                None if queue.withdraw(owner) => None,
                // A holder took the offer and is handing over right now: its answer
                // comes within one round trip, unless the store is slow; the wait
                // bound still holds. If this future is dropped or gives up meanwhile,
                // the holder sees the closed channel and undoes the acquisition.
                None => bound.run_waiting(async { Ok(handed.await.ok()) }).await?,
            };
            if let Some(Handoff {
                sent,
                outcome: Ok(TryAcquire::Acquired { token }),
            }) = handoff
            {
                let guard = LockGuard::start(
                    Arc::clone(&self.inner.backend),
                    Arc::clone(&queue),
                    name.clone(),
                    owner.clone(),
                    // A hand-over issues a token (one step on the store); an unfenced
                    // waiter does not keep it.
                    fenced.then_some(token),
                    sent,
                    options,
                );
                return Ok((guard, true));
            }
            // The lock passed between this process's tasks as often as it may in a row
            // and was released to everyone: stand back so that waiters elsewhere can get
            // in. The pause is what they need to notice — a notified waiter a round trip
            // or two, a polling one its longest poll interval and half again — but at
            // most a fraction of the time this process just kept the lock (an eighth
            // when others poll, a sixteenth when they are notified), so a process alone
            // with its lock loses little. With long critical sections the others' polls
            // land in the pause at the first cap; with short ones, within a few runs.
            // A store that keeps waiters in line gives waiters elsewhere their turn
            // itself: the next owner's request joins the line behind them.
            if let Some(run) = queue.take_yield()
                && !self.inner.backend.keeps_waiters_in_line()
            {
                // Never shorter than a waiter elsewhere needs to get in once it looks:
                // four of this store's acquisition times (its wake-up, its request, and
                // slack for a loaded machine), at most a quarter of the run. On a store
                // whose acquisitions are slow (etcd: an fsynced write), a pause by the
                // rules above alone can end before a woken waiter's write arrives.
                let catch_up = (self.inner.acquire_time() * 4).min(run / 4);
                let pause = match watch.poll_max() {
                    Some(max) => (max + max / 2).min(run / 8),
                    None => YIELD_TO_NOTIFIED_WAITERS.min(run / 16),
                }
                .max(catch_up);
                // Tokio's timer counts whole milliseconds: a shorter sleep would last a
                // millisecond anyway, far more than intended (it cost a third of the
                // contended throughput on Redis). Below that, there is no pause: the
                // runs were short, and notified waiters race on equal terms.
                let paused = Instant::now();
                let until = |pause| {
                    bound
                        .deadline
                        .map_or(paused + pause, |deadline| deadline.min(paused + pause))
                };
                if pause >= MIN_PAUSE {
                    tokio::time::sleep_until(until(pause)).await;
                }
                // The store said the release that ended the run woke waiters elsewhere
                // (its answer came back with the release, before this contender was
                // woken): one of them is on its way, so stand back long enough for it
                // to arrive on a loaded machine, where a notification and the request
                // it prompts can take several milliseconds. A third of the run at most:
                // a waiter's mark outlives it by its holder's lease and a second, so a
                // process alone again may still pay this for that long. (The pause
                // cannot end at the next release notification: this process's own
                // release comes back to its listener as one.)
                let woken_need = YIELD_TO_NOTIFIED_WAITERS.min(run / 3);
                if queue.run_woke_others() && woken_need > pause {
                    tokio::time::sleep_until(until(woken_need)).await;
                }
            }
        }
    }

    /// After a failed call whose last request may have run on the store (its reply
    /// was lost or cut off), releases whatever it may have taken. Releasing a lock this
    /// owner does not hold changes nothing on any store.
    fn undo_uncertain(&self, name: &LockName, owner: &OwnerId, error: &Error) {
        if error.kind() != ErrorKind::StoreUnavailable {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let backend = Arc::clone(&self.inner.backend);
            let (name, owner) = (name.clone(), owner.clone());
            runtime.spawn(async move {
                let _ = backend.release(&name, &owner).await;
            });
        }
    }

    /// One try at the store. If this future is dropped while the request is in flight,
    /// a background release undoes a possible success.
    async fn attempt(
        &self,
        queue: &Arc<LocalQueue>,
        name: &LockName,
        owner: &OwnerId,
        options: &LockOptions,
        fenced: bool,
    ) -> Result<Attempt> {
        let backend = &self.inner.backend;
        let sent = Instant::now();
        let undo = UndoOnDrop {
            backend: Arc::clone(backend),
            name,
            owner,
            armed: true,
        };
        let answer = if fenced {
            backend
                .try_acquire(name, owner, options.get_ttl())
                .await
                .map(|answer| match answer {
                    TryAcquire::Acquired { token } => Ok(Some(token)),
                    TryAcquire::Held { remaining_ttl } => Err(remaining_ttl),
                })
        } else {
            backend
                .try_acquire_unfenced(name, owner, options.get_ttl())
                .await
                .map(|answer| match answer {
                    TryAcquireUnfenced::Acquired => Ok(None),
                    TryAcquireUnfenced::Held { remaining_ttl } => Err(remaining_ttl),
                })
        };
        undo.disarm();
        if answer.is_ok() {
            self.inner.record_acquire_time(sent.elapsed());
        }
        match answer? {
            Ok(token) => {
                queue.acquired_from_store();
                Ok(Attempt::Acquired(LockGuard::start(
                    Arc::clone(backend),
                    Arc::clone(queue),
                    name.clone(),
                    owner.clone(),
                    token,
                    sent,
                    options,
                )))
            }
            Err(remaining_ttl) => Ok(Attempt::Held { remaining_ttl }),
        }
    }

    /// Runs `work` while holding the lock, and releases it afterwards.
    ///
    /// `work` gets the fencing token. If the lock is lost while `work` runs, `work` is
    /// cancelled (dropped at its next await point) and the result is an error of kind
    /// [`ErrorKind::LockLost`].
    ///
    /// ```
    /// # #[cfg(feature = "sqlite")]
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> turnstile::Result<()> {
    /// use turnstile::lock::{Locker, LockOptions};
    ///
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    /// let locker = Locker::connect(&url).await?;
    /// let total = locker
    ///     .with_lock("nightly-report", &LockOptions::new(), |token| async move {
    ///         // ... write the report, passing `token` to the store ...
    ///         token.get() > 0
    ///     })
    ///     .await?;
    /// assert!(total);
    /// # Ok(())
    /// # }
    /// # #[cfg(not(feature = "sqlite"))]
    /// # fn main() {}
    /// ```
    pub async fn with_lock<N, F, Fut, T>(
        &self,
        name: N,
        options: &LockOptions,
        work: F,
    ) -> Result<T>
    where
        N: IntoLockName,
        F: FnOnce(FencingToken) -> Fut,
        Fut: Future<Output = T>,
    {
        let guard = self.acquire(name, options).await?;
        let lost = guard.lost();
        let outcome = tokio::select! {
            biased;
            reason = lost => Err(Error::lost(reason)),
            value = work(guard.fencing_token()) => Ok(value),
        };
        match outcome {
            Ok(value) => {
                // The work finished while the lock was certainly held; a failure to
                // release now only means the lease runs out on its own.
                let _ = guard.release().await;
                Ok(value)
            }
            Err(error) => Err(error),
        }
    }

    /// [`with_lock`](Self::with_lock) for work that can fail: one `Result`, whose error
    /// type is the work's own (it must take Turnstile's errors, `From<turnstile::Error>`),
    /// instead of a `Result` inside a `Result`.
    ///
    /// ```
    /// # #[cfg(feature = "sqlite")]
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> turnstile::Result<()> {
    /// use turnstile::lock::{Locker, LockOptions};
    ///
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    /// let locker = Locker::connect(&url).await?;
    /// let rows: u64 = locker
    ///     .try_with_lock("import", &LockOptions::new(), |_token| async move {
    ///         // ... work that returns turnstile::Result (or your own error type) ...
    ///         Ok::<_, turnstile::Error>(42)
    ///     })
    ///     .await?;
    /// assert_eq!(rows, 42);
    /// # Ok(())
    /// # }
    /// # #[cfg(not(feature = "sqlite"))]
    /// # fn main() {}
    /// ```
    pub async fn try_with_lock<N, F, Fut, T, E>(
        &self,
        name: N,
        options: &LockOptions,
        work: F,
    ) -> std::result::Result<T, E>
    where
        N: IntoLockName,
        F: FnOnce(FencingToken) -> Fut,
        Fut: Future<Output = std::result::Result<T, E>>,
        E: From<Error>,
    {
        self.with_lock(name, options, work).await.map_err(E::from)?
    }

    /// Forgets the store's records of lock names that nobody has held for at least
    /// `unused_for` (at least one second), returning how many it forgot: the rows of SQL
    /// stores grow with every name ever used. Held locks are never touched, and the
    /// fencing tokens of a name used again later still increase (the SQL engines floor
    /// them by the store's clock). On Redis there is nothing to do: lock keys go with
    /// their release or lease, fence keys after the fence retention. On etcd and
    /// ZooKeeper neither: nothing stays behind a name, and tokens are the cluster's
    /// revision or zxid, not a clock. On MySQL / MariaDB, the names ever
    /// used with transaction-scoped locks are kept (see the MySQL engine's guarantees).
    ///
    /// Errors: [`ErrorKind::InvalidOptions`] for less than a second.
    pub async fn prune(&self, unused_for: Duration) -> Result<u64> {
        if unused_for < Duration::from_secs(1) {
            return Err(Error::new(
                ErrorKind::InvalidOptions,
                format!(
                    "prune forgets names unused for at least 1s (tokens are floored by the clock \
                     in microseconds, so a younger name could be issued a token again); got {}",
                    describe_wait(unused_for)
                ),
            ));
        }
        let removed = self.inner.backend.prune(unused_for).await?;
        tracing::info!(removed, unused_for = ?unused_for, "pruned unused lock names");
        Ok(removed)
    }

    /// Renews a lock taken by [`LockGuard::detach`] for `ttl` from now, if `owner` still
    /// holds it. A lease that ran out, or that another owner holds now, comes back as
    /// [`ExtendOutcome::Lost`]: the holder must stop, as a guard's lost signal would
    /// tell it to.
    ///
    /// On stores whose locks live in a connection or session of the process that took
    /// them (PostgreSQL and MySQL session locks, etcd, ZooKeeper), extending and
    /// releasing must happen through the same [`Locker`]; on lease stores (SQLite,
    /// Redis, PostgreSQL lease mode) any locker on the same store will do.
    ///
    /// Errors: [`ErrorKind::InvalidOptions`] for a TTL out of range.
    pub async fn extend_detached<N>(
        &self,
        name: N,
        owner: &OwnerId,
        ttl: Duration,
    ) -> Result<ExtendOutcome>
    where
        N: IntoLockName,
    {
        LockOptions::new().ttl(ttl).validate()?;
        let name = name.into_lock_name()?;
        let outcome = self.inner.backend.extend(&name, owner, ttl).await?;
        telemetry::extended_detached(&name, outcome);
        Ok(outcome)
    }

    /// Releases a lock taken by [`LockGuard::detach`], reporting what the store found
    /// (see [`extend_detached`](Self::extend_detached) for which locker may do it).
    pub async fn release_detached<N>(&self, name: N, owner: &OwnerId) -> Result<ReleaseOutcome>
    where
        N: IntoLockName,
    {
        let name = name.into_lock_name()?;
        let outcome = self.inner.backend.release(&name, owner).await?;
        telemetry::released(&name, outcome, false, None);
        Ok(outcome)
    }

    /// The current holder of `name`, if any.
    pub async fn status<N>(&self, name: N) -> Result<Option<LockInfo>>
    where
        N: IntoLockName,
    {
        let name = name.into_lock_name()?;
        self.inner.backend.inspect(&name).await
    }

    /// An operator's forced release, whoever holds the lock. Returns what was held.
    ///
    /// The holder is not told directly: its watchdog notices at the next renewal and its
    /// lost signal fires then. Writes it makes in between are what fencing tokens stop.
    pub async fn force_release<N>(&self, name: N) -> Result<Option<LockInfo>>
    where
        N: IntoLockName,
    {
        let name = name.into_lock_name()?;
        self.inner.backend.force_release(&name).await
    }
}

/// Undoes an acquire whose outcome is unknown (its future was dropped mid-request).
/// The request may still land after a first release — a statement sent on a pooled
/// connection runs on — so the holder is looked at again a few times (50 ms, 250 ms,
/// 1 s, 3 s after), and the lock released whenever this owner turns out to hold it.
/// Releasing a lock this owner does not hold changes nothing on any store.
async fn release_until_not_held(backend: Arc<dyn LockBackend>, name: LockName, owner: OwnerId) {
    let _ = backend.release(&name, &owner).await;
    for after in [50, 200, 750, 2_000] {
        tokio::time::sleep(Duration::from_millis(after)).await;
        match backend.inspect(&name).await {
            Ok(Some(holder)) if holder.owner == owner.as_str() => {
                let _ = backend.release(&name, &owner).await;
            }
            _ => {}
        }
    }
}

/// How a waiter treats store errors: at once before the store first answered; after
/// that, transient ones ([`ErrorKind::StoreUnavailable`]) are retried with a backoff
/// (50 ms doubling to 1 s) until the wait bound.
#[derive(Default)]
struct Outage {
    answered: bool,
    failures: u32,
}

impl Outage {
    fn answered(&mut self) {
        self.answered = true;
        self.failures = 0;
    }

    async fn pause_or_fail(&mut self, error: Error, deadline: Option<Instant>) -> Result<()> {
        if !self.answered || error.kind() != ErrorKind::StoreUnavailable {
            return Err(error);
        }
        let pause = (Duration::from_millis(50) * 2u32.pow(self.failures.min(5)))
            .min(Duration::from_secs(1));
        self.failures += 1;
        let wake = Instant::now() + pause;
        match deadline {
            Some(deadline) if deadline <= wake => Err(error),
            _ => {
                tokio::time::sleep_until(wake).await;
                Ok(())
            }
        }
    }
}

enum Attempt {
    Acquired(LockGuard),
    Held { remaining_ttl: Option<Duration> },
}

struct UndoOnDrop<'a> {
    backend: Arc<dyn LockBackend>,
    name: &'a LockName,
    owner: &'a OwnerId,
    armed: bool,
}

impl UndoOnDrop<'_> {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for UndoOnDrop<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let backend = Arc::clone(&self.backend);
            let name = self.name.clone();
            let owner = self.owner.clone();
            runtime.spawn(release_until_not_held(backend, name, owner));
        }
    }
}
