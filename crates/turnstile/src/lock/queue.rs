//! The per-name local queue: one contender talks to the store, the rest wait here, and
//! a release hands the lock straight to the contender when it can.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::{OwnerId, ReleaseWatch, TryAcquire};
use crate::error::Result;

/// How many times in a row a lock may pass from holder to waiter inside one process
/// before it is released to everyone, so that waiters in other processes (woken by the
/// release notification) get their chance.
pub(crate) const MAX_HANDOFFS_IN_A_ROW: u32 = 8;

#[derive(Default)]
pub(crate) struct LocalQueue {
    /// Whoever holds this is the one waiter talking to the store. It keeps the release
    /// subscription here so that the next contender reuses it instead of subscribing
    /// again.
    pub(crate) contender: tokio::sync::Mutex<Option<ReleaseWatch>>,
    /// The contender, while it sleeps, offers itself here for a direct handoff.
    waiting: Mutex<Option<HandoffOffer>>,
    handoffs_in_a_row: AtomicU32,
    /// Set when the hand-over cap sent a release to the store: how long this process
    /// kept the lock in its run of hand-overs. The next local contender stands back for
    /// a moment (at most an eighth of that) so that waiters elsewhere can get in.
    yield_to_others: Mutex<Option<Duration>>,
    /// What the store said of the release that ended the last run of hand-overs:
    /// whether it woke waiters elsewhere (see `LockBackend::release_waking_others`).
    /// Cleared when a run ends, so the contender never reads an older run's answer.
    woke_others: Mutex<Option<bool>>,
    /// When the current run of hand-overs began (the lock came from the store).
    run_started: Mutex<Option<Instant>>,
    /// Guards of this locker that hold the lock and have not started releasing it.
    local_holders: AtomicUsize,
}

/// Who gets the lock from a releasing holder of this process.
pub(crate) enum Successor {
    /// The sleeping contender, by a direct hand-over.
    Local(HandoffOffer),
    /// Whoever asks the store first: nobody here was waiting.
    Store,
    /// Whoever asks the store first, because the lock passed between this process's
    /// tasks as often as it may in a row.
    StoreAfterRun,
}

/// A sleeping contender's offer to take the lock over from a local holder.
pub(crate) struct HandoffOffer {
    pub(crate) owner: OwnerId,
    pub(crate) ttl: Duration,
    pub(crate) reply: oneshot::Sender<Handoff>,
}

/// What a releasing holder did for the waiter: the acquire attempt made on its behalf,
/// and when that request was sent (the start of the waiter's lease).
pub(crate) struct Handoff {
    pub(crate) sent: Instant,
    pub(crate) outcome: Result<TryAcquire>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl LocalQueue {
    fn waiting(&self) -> std::sync::MutexGuard<'_, Option<HandoffOffer>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The contender goes to sleep and offers itself for a handoff.
    pub(crate) fn offer(&self, offer: HandoffOffer) {
        *self.waiting() = Some(offer);
    }

    /// The contender woke up on its own. `false` means a holder already took the offer
    /// and the contender must wait for its reply.
    pub(crate) fn withdraw(&self, owner: &OwnerId) -> bool {
        let mut waiting = self.waiting();
        match waiting.as_ref() {
            Some(offer) if offer.owner == *owner => {
                *waiting = None;
                true
            }
            _ => false,
        }
    }

    /// A releasing holder takes the waiting contender's offer, unless the lock has
    /// passed between local waiters too many times in a row.
    pub(crate) fn take_offer(&self) -> Successor {
        let mut waiting = self.waiting();
        let Some(offer) = waiting.as_ref() else {
            return Successor::Store;
        };
        // A contender whose acquire was dropped while it slept left its offer behind:
        // handing over to it would only be undone again (a wasted write and token).
        if offer.reply.is_closed() {
            *waiting = None;
            return Successor::Store;
        }
        if self.handoffs_in_a_row.fetch_add(1, Ordering::Relaxed) + 1 > MAX_HANDOFFS_IN_A_ROW {
            self.handoffs_in_a_row.store(0, Ordering::Relaxed);
            let run = lock(&self.run_started).map(|started| started.elapsed());
            *lock(&self.woke_others) = None;
            *lock(&self.yield_to_others) = Some(run.unwrap_or_default());
            return Successor::StoreAfterRun;
        }
        waiting.take().map_or(Successor::Store, Successor::Local)
    }

    /// Whether the contender should stand back once before its next attempt, with
    /// how long this process's run of hand-overs kept the lock (see `yield_to_others`);
    /// clears it.
    pub(crate) fn take_yield(&self) -> Option<Duration> {
        lock(&self.yield_to_others).take()
    }

    /// Records whether the release that ended a run of hand-overs woke waiters
    /// elsewhere, as the store tells it.
    pub(crate) fn run_released(&self, woke_others: Option<bool>) {
        *lock(&self.woke_others) = woke_others;
    }

    /// Whether the release that ended the last run woke waiters elsewhere, if the store
    /// said so and its answer has arrived.
    pub(crate) fn run_woke_others(&self) -> bool {
        lock(&self.woke_others).unwrap_or(false)
    }

    /// Wakes the sleeping contender, if any, to ask the store again: drops its offer,
    /// which closes the channel it waits on.
    pub(crate) fn wake_waiter(&self) {
        drop(self.waiting().take());
    }

    /// A guard of this locker now holds the lock.
    pub(crate) fn holder_started(&self) {
        self.local_holders.fetch_add(1, Ordering::SeqCst);
    }

    /// A guard of this locker is about to release (or hand over) the lock.
    pub(crate) fn holder_finished(&self) {
        self.local_holders.fetch_sub(1, Ordering::SeqCst);
    }

    /// Whether a guard of this locker holds the lock: then a new contender need not ask
    /// the store, since the holder will hand over or announce its release.
    pub(crate) fn held_locally(&self) -> bool {
        self.local_holders.load(Ordering::SeqCst) > 0
    }

    /// The lock was taken through the store rather than handed over.
    pub(crate) fn acquired_from_store(&self) {
        *lock(&self.run_started) = Some(Instant::now());
        self.handoffs_in_a_row.store(0, Ordering::Relaxed);
    }
}
