//! Deadlines that share one tokio timer: sleeps, timeouts and scheduled actions for the
//! hot paths (a lock's wait bound, its watchdog's first wake-up, a Redis request's
//! response timeout).
//!
//! Why not one `tokio::time::Sleep` each: registering a tokio timer that is due before
//! every timer the runtime had when it last went to sleep wakes the runtime's I/O
//! driver with a system call (an `eventfd` write, then one more `epoll_wait`), even
//! when the registering thread is the one running the runtime (tokio-rs/tokio#5207).
//! A lock cycle that creates and drops its timers makes one of them such a "first"
//! timer every time: measured on the two-core machine of `BENCHMARKS.md`, two to three
//! such wake-ups per acquire and release, plus the watchdog task spawned and aborted
//! for a lock held a few microseconds.
//!
//! Here every deadline of one [`Timers`] is an entry in an ordered map, and one
//! background task (the watcher) keeps a single tokio timer armed at or before the
//! earliest entry. The timer is moved earlier only when an entry is due before it, and
//! moved later only when it fires. Deadlines a caller makes in time order (now plus a
//! fixed timeout, now plus a third of a TTL) are later than the armed one, so they
//! cost a map insert and removal, not a system call; the watcher wakes about once per
//! timeout length while the owner is busy, and not at all once it is idle.
//!
//! Entries fire as precisely as tokio timers do (the watcher's timer is due exactly at
//! the earliest live entry once the armed time has passed). One `Timers` belongs to
//! one runtime's clock: its watcher runs on the runtime that first needed it, and a
//! watcher that went away with its runtime is started again by the next deadline that
//! needs one.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll, Waker};

use tokio::time::Instant;

/// Deadlines sharing one tokio timer (see the module docs). Cheap to clone; clones
/// share the timer.
#[derive(Clone, Default)]
pub(crate) struct Timers {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Timers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.shared.lock();
        f.debug_struct("Timers")
            .field("pending", &state.entries.len())
            .field("armed", &state.armed)
            .finish()
    }
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// An entry's place in the map: its deadline, then a sequence number.
type Key = (Instant, u64);

#[derive(Default)]
struct State {
    entries: BTreeMap<Key, Arc<dyn Fire>>,
    next_sequence: u64,
    /// What the watcher's timer is set to: never later than the earliest entry.
    armed: Option<Instant>,
    watcher: Watcher,
}

#[derive(Default)]
enum Watcher {
    /// None runs (never started, or gone with its runtime).
    #[default]
    Absent,
    /// Spawned; not yet polled.
    Starting,
    /// Waiting; this wakes it to arm its timer earlier.
    Waiting(Waker),
}

/// What an entry does when its deadline passes (called without the lock held).
trait Fire: Send + Sync {
    fn fire(&self);
    /// The watcher went away (its runtime shut down) before the entry fired.
    fn orphaned(&self) {}
}

impl Timers {
    pub(crate) fn new() -> Timers {
        Timers::default()
    }

    /// Completes at `deadline` (at once if it has passed).
    pub(crate) fn sleep_until(&self, deadline: Instant) -> Sleep {
        Sleep {
            timers: self.clone(),
            deadline,
            entry: Arc::new(SleepEntry::default()),
            key: None,
        }
    }

    /// `future`, cut off at `deadline` with `Err(Elapsed)`. The deadline is registered
    /// only if `future` is not ready when first polled.
    pub(crate) async fn timeout_at<F: Future>(
        &self,
        deadline: Instant,
        future: F,
    ) -> Result<F::Output, Elapsed> {
        let mut future = std::pin::pin!(future);
        let mut sleep = self.sleep_until(deadline);
        std::future::poll_fn(|cx| {
            if let Poll::Ready(output) = future.as_mut().poll(cx) {
                return Poll::Ready(Ok(output));
            }
            Pin::new(&mut sleep).poll(cx).map(|()| Err(Elapsed))
        })
        .await
    }

    /// Runs `action` at `deadline` (on the watcher's task: it must be quick), unless the
    /// returned handle is dropped first.
    pub(crate) fn schedule(
        &self,
        deadline: Instant,
        action: impl FnOnce() + Send + 'static,
    ) -> Scheduled {
        let entry = Arc::new(ActionEntry {
            action: Mutex::new(Some(Box::new(action))),
        });
        let key = self.insert(deadline, Arc::clone(&entry) as Arc<dyn Fire>);
        Scheduled {
            timers: self.clone(),
            key,
        }
    }

    fn insert(&self, deadline: Instant, entry: Arc<dyn Fire>) -> Key {
        let mut state = self.shared.lock();
        let key = (deadline, state.next_sequence);
        state.next_sequence += 1;
        state.entries.insert(key, entry);
        let earlier = state.armed.is_none_or(|armed| deadline < armed);
        if earlier {
            state.armed = Some(deadline);
        }
        match std::mem::take(&mut state.watcher) {
            Watcher::Absent => {
                // Entries left by a watcher that went away count too.
                state.armed = state.entries.keys().next().map(|(at, _)| *at);
                state.watcher = Watcher::Starting;
                drop(state);
                tokio::spawn(watch(Arc::downgrade(&self.shared)));
            }
            Watcher::Waiting(waker) if earlier => {
                state.watcher = Watcher::Starting;
                drop(state);
                waker.wake();
            }
            watcher => state.watcher = watcher,
        }
        key
    }

    fn remove(&self, key: &Key) {
        // The armed time stays: the watcher moves it when it fires, which costs less
        // than moving it now and again for the next entry.
        self.shared.lock().entries.remove(key);
    }

    /// Starts a watcher again if the last one went away with its runtime while `key`
    /// was pending.
    fn adopt(&self, key: &Key) {
        let mut state = self.shared.lock();
        if matches!(state.watcher, Watcher::Absent) && state.entries.contains_key(key) {
            state.armed = state.entries.keys().next().map(|(at, _)| *at);
            state.watcher = Watcher::Starting;
            drop(state);
            tokio::spawn(watch(Arc::downgrade(&self.shared)));
        }
    }
}

/// The watcher: fires due entries and keeps one tokio timer at the armed time.
async fn watch(shared: Weak<Shared>) {
    let _gone = WatcherGone(Weak::clone(&shared));
    let mut sleep = Box::pin(tokio::time::sleep_until(Instant::now()));
    let mut sleeping_until: Option<Instant> = None;
    std::future::poll_fn(|cx| {
        loop {
            let Some(shared) = shared.upgrade() else {
                return Poll::Ready(());
            };
            let mut state = shared.lock();
            let now = Instant::now();
            let mut due = Vec::new();
            while let Some(entry) = state.entries.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                due.push(entry.remove());
            }
            if state.armed.is_some_and(|armed| armed <= now) {
                state.armed = state.entries.keys().next().map(|(at, _)| *at);
            }
            let target = state.armed;
            state.watcher = Watcher::Waiting(cx.waker().clone());
            drop(state);
            drop(shared);
            for entry in due {
                entry.fire();
            }
            let Some(target) = target else {
                sleeping_until = None;
                return Poll::Pending;
            };
            if sleeping_until != Some(target) {
                sleep.as_mut().reset(target);
                sleeping_until = Some(target);
            }
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
    })
    .await;
}

/// Marks the watcher gone when its task ends (its runtime shut down), so that the next
/// deadline starts another, and tells the pending entries.
struct WatcherGone(Weak<Shared>);

impl Drop for WatcherGone {
    fn drop(&mut self) {
        let Some(shared) = self.0.upgrade() else {
            return;
        };
        let mut state = shared.lock();
        state.watcher = Watcher::Absent;
        state.armed = None;
        let pending: Vec<Arc<dyn Fire>> = state.entries.values().cloned().collect();
        drop(state);
        for entry in pending {
            entry.orphaned();
        }
    }
}

#[derive(Default)]
struct SleepEntry {
    fired: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl SleepEntry {
    fn waker(&self) -> MutexGuard<'_, Option<Waker>> {
        self.waker
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn wake(&self) {
        let waker = self.waker().take();
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

impl Fire for SleepEntry {
    fn fire(&self) {
        self.fired.store(true, Ordering::Release);
        self.wake();
    }

    fn orphaned(&self) {
        // Polled again, the sleep starts a new watcher.
        self.wake();
    }
}

/// A future that completes at a deadline ([`Timers::sleep_until`]).
#[must_use = "a sleep does nothing unless awaited"]
pub(crate) struct Sleep {
    timers: Timers,
    deadline: Instant,
    entry: Arc<SleepEntry>,
    /// `Some` once registered (first polled before the deadline).
    key: Option<Key>,
}

impl Future for Sleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if this.entry.fired.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        {
            let mut waker = this.entry.waker();
            if !waker
                .as_ref()
                .is_some_and(|known| known.will_wake(cx.waker()))
            {
                *waker = Some(cx.waker().clone());
            }
        }
        match &this.key {
            None => {
                if this.deadline <= Instant::now() {
                    return Poll::Ready(());
                }
                this.key = Some(
                    this.timers
                        .insert(this.deadline, Arc::clone(&this.entry) as Arc<dyn Fire>),
                );
            }
            Some(key) => this.timers.adopt(key),
        }
        // Fired between the check above and now: its wake-up went to the waker just
        // stored, but answering now saves that round.
        if this.entry.fired.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        Poll::Pending
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        if let Some(key) = &self.key
            && !self.entry.fired.load(Ordering::Acquire)
        {
            self.timers.remove(key);
        }
    }
}

/// The deadline of a [`Timers::timeout_at`] passed first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Elapsed;

struct ActionEntry {
    action: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl Fire for ActionEntry {
    fn fire(&self) {
        let action = self
            .action
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(action) = action {
            action();
        }
    }
}

/// An action scheduled with [`Timers::schedule`]; dropping it cancels the action if it
/// has not run (an action already running is not waited for).
#[must_use = "dropping the handle cancels the action"]
pub(crate) struct Scheduled {
    timers: Timers,
    key: Key,
}

impl std::fmt::Debug for Scheduled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduled")
            .field("at", &self.key.0)
            .finish()
    }
}

impl Drop for Scheduled {
    fn drop(&mut self) {
        self.timers.remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[tokio::test(start_paused = true)]
    async fn sleeps_complete_at_their_deadlines_in_any_order() {
        let timers = Timers::new();
        let start = Instant::now();
        let mut tasks = Vec::new();
        for offset in [300u32, 100, 200, 100, 50] {
            let timers = timers.clone();
            tasks.push(tokio::spawn(async move {
                timers.sleep_until(start + offset * MS).await;
                (offset, start.elapsed())
            }));
        }
        for task in tasks {
            let (offset, elapsed) = task.await.unwrap();
            assert_eq!(elapsed, offset * MS, "a sleep of {offset} ms");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_deadline_before_the_armed_one_fires_on_time() {
        let timers = Timers::new();
        let start = Instant::now();
        // Arms the watcher at 5 s; the later, earlier deadline must not wait for it.
        let long = timers.sleep_until(start + Duration::from_secs(5));
        let mut long = Box::pin(long);
        assert!(futures_poll(&mut long).is_pending());
        tokio::task::yield_now().await;
        timers.sleep_until(start + 20 * MS).await;
        assert_eq!(start.elapsed(), 20 * MS);
        long.await;
        assert_eq!(start.elapsed(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn dropped_sleeps_leave_no_entry_and_the_armed_time_moves_on() {
        let timers = Timers::new();
        let start = Instant::now();
        for _ in 0..100 {
            let mut sleep = Box::pin(timers.sleep_until(start + 10 * MS));
            assert!(futures_poll(&mut sleep).is_pending());
        }
        assert_eq!(timers.shared.lock().entries.len(), 0);
        // The watcher's timer (armed at 10 ms) fires, finds nothing, and rests.
        tokio::time::sleep(20 * MS).await;
        tokio::task::yield_now().await;
        assert_eq!(timers.shared.lock().armed, None);
        timers.sleep_until(start + 50 * MS).await;
        assert_eq!(start.elapsed(), 50 * MS);
    }

    #[tokio::test(start_paused = true)]
    async fn a_timeout_passes_a_quick_answer_through_without_registering() {
        let timers = Timers::new();
        let start = Instant::now();
        assert_eq!(timers.timeout_at(start + 10 * MS, async { 7 }).await, Ok(7));
        assert_eq!(
            timers.shared.lock().next_sequence,
            0,
            "nothing was registered"
        );
        let slow = tokio::time::sleep(Duration::from_secs(1));
        assert_eq!(timers.timeout_at(start + 10 * MS, slow).await, Err(Elapsed));
        assert_eq!(start.elapsed(), 10 * MS);
    }

    #[tokio::test(start_paused = true)]
    async fn scheduled_actions_run_once_at_their_time_unless_cancelled() {
        let timers = Timers::new();
        let start = Instant::now();
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = |runs: &Arc<AtomicUsize>| {
            let runs = Arc::clone(runs);
            move || {
                runs.fetch_add(1, Ordering::SeqCst);
            }
        };
        let kept = timers.schedule(start + 30 * MS, counted(&runs));
        let cancelled = timers.schedule(start + 10 * MS, counted(&runs));
        drop(cancelled);
        tokio::time::sleep(29 * MS).await;
        assert_eq!(runs.load(Ordering::SeqCst), 0);
        tokio::time::sleep(2 * MS).await;
        tokio::task::yield_now().await;
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        drop(kept);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_watcher_gone_with_its_runtime_is_replaced() {
        let timers = Timers::new();
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        // A sleep left pending when its runtime shuts down.
        let mut pending = Box::pin(timers.sleep_until(Instant::now() + Duration::from_secs(60)));
        first.block_on(async {
            assert!(futures_poll(&mut pending).is_pending());
            tokio::task::yield_now().await;
        });
        drop(first);
        assert!(matches!(timers.shared.lock().watcher, Watcher::Absent));
        let second = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        second.block_on(async {
            let start = Instant::now();
            timers.sleep_until(start + 20 * MS).await;
            assert!(start.elapsed() >= 20 * MS);
            // The orphaned sleep is adopted by the new watcher when polled.
            assert!(futures_poll(&mut pending).is_pending());
            assert!(!matches!(timers.shared.lock().watcher, Watcher::Absent));
        });
    }

    /// Polls once with a no-op waker.
    fn futures_poll<F: Future + Unpin>(future: &mut F) -> Poll<F::Output> {
        let mut cx = Context::from_waker(Waker::noop());
        Pin::new(future).poll(&mut cx)
    }
}
