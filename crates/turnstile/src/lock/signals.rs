//! A table of release notifications, keyed by channel, with subscriber counts.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::watch;

use super::ReleaseWatch;

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
