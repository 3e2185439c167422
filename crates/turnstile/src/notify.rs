//! Release notifications, which every concept's waiters use: a [`ReleaseWatch`] is one
//! waiter's subscription (woken by the store's notifications, or polling where the
//! engine has none), and [`ReleaseSignals`] the table of them an engine fans its
//! notifications out through, keyed by channel, with subscriber counts.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use std::time::Duration;

use tokio::sync::watch;

type IdleHook = Arc<dyn Fn(&str) + Send + Sync>;

/// The table engines use to fan release notifications out to waiters.
///
/// Each key (a channel or a lock name) has a counter that [`notify`](Self::notify)
/// bumps; [`watch`](Self::watch) hands out a [`ReleaseWatch`] on it. When the last
/// watch of a key is dropped the key is removed and the idle hook runs (an engine
/// unsubscribes there).
#[derive(Clone)]
pub struct ReleaseSignals {
    table: Arc<Mutex<HashMap<String, Slot>>>,
    on_idle: Option<IdleHook>,
}

struct Slot {
    sender: watch::Sender<u64>,
    watchers: usize,
    // Distinguishes a key re-added after `close_all` from the slot a registration joined.
    id: u64,
}

static NEXT_SLOT_ID: AtomicU64 = AtomicU64::new(0);

impl fmt::Debug for ReleaseSignals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReleaseSignals")
            .field("keys", &self.lock_table().len())
            .finish()
    }
}

impl Default for ReleaseSignals {
    fn default() -> Self {
        ReleaseSignals::new()
    }
}

impl ReleaseSignals {
    /// An empty table.
    pub fn new() -> Self {
        ReleaseSignals {
            table: Arc::default(),
            on_idle: None,
        }
    }

    /// An empty table that calls `on_idle(key)` when the last watch of a key is dropped.
    pub fn with_idle_hook(on_idle: impl Fn(&str) + Send + Sync + 'static) -> Self {
        ReleaseSignals {
            table: Arc::default(),
            on_idle: Some(Arc::new(on_idle)),
        }
    }

    fn lock_table(&self) -> MutexGuard<'_, HashMap<String, Slot>> {
        // A panic while holding this lock leaves the map consistent (every operation is
        // a single insert/remove), so a poisoned lock is safe to use.
        self.table
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Registers a watcher of `key`. The second value is `true` when this is the key's
    /// first watcher (the engine subscribes then).
    pub fn watch(&self, key: &str) -> (ReleaseWatch, bool) {
        let mut table = self.lock_table();
        let first = !table.contains_key(key);
        let slot = table.entry(key.to_owned()).or_insert_with(|| Slot {
            sender: watch::Sender::new(0),
            watchers: 0,
            id: NEXT_SLOT_ID.fetch_add(1, Ordering::Relaxed),
        });
        slot.watchers += 1;
        let receiver = slot.sender.subscribe();
        let registration = Registration {
            signals: self.clone(),
            key: key.to_owned(),
            slot_id: slot.id,
        };
        drop(table);
        (ReleaseWatch::new(receiver, registration), first)
    }

    /// Whether anyone watches `key`.
    pub fn is_watched(&self, key: &str) -> bool {
        self.lock_table().contains_key(key)
    }

    /// Announces a release of `key` to its watchers.
    pub fn notify(&self, key: &str) {
        if let Some(slot) = self.lock_table().get(key) {
            slot.sender
                .send_modify(|count| *count = count.wrapping_add(1));
        }
    }

    /// Wakes every watcher of every key, so each re-checks (notifications may have been
    /// lost, say while a connection was re-established).
    pub fn notify_all(&self) {
        for slot in self.lock_table().values() {
            slot.sender
                .send_modify(|count| *count = count.wrapping_add(1));
        }
    }

    /// Closes every watch (the notification source is gone): waiters see
    /// [`ReleaseWatch::is_closed`] and subscribe again.
    pub fn close_all(&self) {
        self.lock_table().clear();
    }
}

struct Registration {
    signals: ReleaseSignals,
    key: String,
    slot_id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut table = self.signals.lock_table();
        let idle = match table.get_mut(&self.key) {
            Some(slot) if slot.id == self.slot_id => {
                slot.watchers -= 1;
                slot.watchers == 0
            }
            // Closed by `close_all` (and maybe re-added since): not ours to count.
            _ => false,
        };
        if idle {
            table.remove(&self.key);
        }
        drop(table);
        if idle && let Some(on_idle) = &self.signals.on_idle {
            on_idle(&self.key);
        }
    }
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
