//! How many locks each tenant holds through this instance, so that no tenant can take
//! them all: on a session-bound store (MySQL, PostgreSQL session mode) every held lock
//! pins a database session, and one tenant holding the pool would answer every other
//! tenant with 503.
//!
//! The count is this instance's: behind N instances a tenant may hold up to N times
//! the limit. A lock whose lease ran out without a release stops counting when its
//! lease ends.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Locks held, by lock key: the holder (tenant, or token name for tokens without one)
/// and when its lease ends.
pub(crate) struct HeldLocks {
    max_per_holder: usize,
    held: Mutex<HashMap<String, Held>>,
}

/// One counted lock.
struct Held {
    holder: String,
    /// The owner id, once the acquire succeeded.
    owner: Option<String>,
    until: Instant,
}

/// What a reservation found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reserved {
    /// Counted now; give it back if the acquire fails.
    New,
    /// The holder holds this lock already (an acquire of a name it holds).
    Already,
    /// The holder is at its limit.
    Full,
}

impl HeldLocks {
    pub(crate) fn new(max_per_holder: usize) -> Self {
        HeldLocks {
            max_per_holder: max_per_holder.max(1),
            held: Mutex::default(),
        }
    }

    /// The most locks one holder may hold.
    pub(crate) fn limit(&self) -> usize {
        self.max_per_holder
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<String, Held>> {
        self.held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Counts `key` for `holder` for `ttl`, unless the holder is at its limit.
    pub(crate) fn reserve(&self, holder: &str, key: &str, ttl: Duration) -> Reserved {
        let now = Instant::now();
        let mut held = self.held();
        held.retain(|_, held| held.until > now);
        if held.get(key).is_some_and(|held| held.holder == holder) {
            return Reserved::Already;
        }
        let count = held.values().filter(|held| held.holder == holder).count();
        if count >= self.max_per_holder {
            return Reserved::Full;
        }
        held.insert(
            key.to_owned(),
            Held {
                holder: holder.to_owned(),
                owner: None,
                until: now + ttl,
            },
        );
        Reserved::New
    }

    /// `key` was acquired by `owner` for `ttl` from now.
    pub(crate) fn acquired(&self, key: &str, owner: &str, ttl: Duration) {
        if let Some(held) = self.held().get_mut(key) {
            held.owner = Some(owner.to_owned());
            held.until = Instant::now() + ttl;
        }
    }

    /// The lease of `key` now ends `ttl` from now.
    pub(crate) fn extended(&self, key: &str, ttl: Duration) {
        if let Some(held) = self.held().get_mut(key) {
            held.until = Instant::now() + ttl;
        }
    }

    /// `key` is no longer held by `owner` (released, lost, or its acquire failed:
    /// `None`, whoever held it). A call with another owner id changes nothing.
    pub(crate) fn released(&self, key: &str, owner: Option<&str>) {
        let mut held = self.held();
        let theirs = held.get(key).is_some_and(|held| {
            owner.is_none_or(|owner| held.owner.as_deref().is_none_or(|held| held == owner))
        });
        if theirs {
            held.remove(key);
        }
    }
}
