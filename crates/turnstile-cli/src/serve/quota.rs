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

/// Locks held, by holder (tenant, or token name for tokens without one) and lock key:
/// an acquire looks at its own holder's locks only.
pub(crate) struct HeldLocks {
    max_per_holder: usize,
    held: Mutex<HashMap<String, HashMap<String, Held>>>,
}

/// One counted lock.
struct Held {
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

type Holders = HashMap<String, HashMap<String, Held>>;

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

    fn held(&self) -> std::sync::MutexGuard<'_, Holders> {
        self.held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Counts `key` for `holder` for `ttl`, unless the holder is at its limit.
    pub(crate) fn reserve(&self, holder: &str, key: &str, ttl: Duration) -> Reserved {
        let now = Instant::now();
        let mut held = self.held();
        let mine = held.entry(holder.to_owned()).or_default();
        mine.retain(|_, held| held.until > now);
        if mine.contains_key(key) {
            return Reserved::Already;
        }
        if mine.len() >= self.max_per_holder {
            return Reserved::Full;
        }
        mine.insert(
            key.to_owned(),
            Held {
                owner: None,
                until: now + ttl,
            },
        );
        Reserved::New
    }

    /// Which holder counts `key`: `holder` when it does, else whichever holder does (a
    /// lock broken, or released, by another caller).
    fn counted_by(held: &Holders, holder: &str, key: &str) -> Option<String> {
        if held.get(holder).is_some_and(|mine| mine.contains_key(key)) {
            return Some(holder.to_owned());
        }
        held.iter()
            .find(|(_, locks)| locks.contains_key(key))
            .map(|(holder, _)| holder.clone())
    }

    /// The counted entry of `key` (see [`counted_by`](Self::counted_by)).
    fn find<'a>(held: &'a mut Holders, holder: &str, key: &str) -> Option<&'a mut Held> {
        let holder = Self::counted_by(held, holder, key)?;
        held.get_mut(&holder)?.get_mut(key)
    }

    /// `key` was acquired by `owner` for `ttl` from now.
    pub(crate) fn acquired(&self, holder: &str, key: &str, owner: &str, ttl: Duration) {
        if let Some(held) = Self::find(&mut self.held(), holder, key) {
            held.owner = Some(owner.to_owned());
            held.until = Instant::now() + ttl;
        }
    }

    /// The lease of `key` now ends `ttl` from now.
    pub(crate) fn extended(&self, holder: &str, key: &str, ttl: Duration) {
        if let Some(held) = Self::find(&mut self.held(), holder, key) {
            held.until = Instant::now() + ttl;
        }
    }

    /// `key` is no longer held by `owner` (released, lost, or its acquire failed:
    /// `None`, whoever held it). A call with another owner id changes nothing.
    pub(crate) fn released(&self, holder: &str, key: &str, owner: Option<&str>) {
        let mut held = self.held();
        let Some(counter) = Self::counted_by(&held, holder, key) else {
            return;
        };
        let Some(locks) = held.get_mut(&counter) else {
            return;
        };
        let theirs = locks.get(key).is_some_and(|held| {
            owner.is_none_or(|owner| held.owner.as_deref().is_none_or(|held| held == owner))
        });
        if theirs {
            locks.remove(key);
            if locks.is_empty() {
                held.remove(&counter);
            }
        }
    }
}
