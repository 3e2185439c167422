//! What this instance has seen, for the dashboard: the locks it handed out (until their
//! lease ends or they are released), waiters in its long-polls, recent losses, breaks
//! and leases that ran out, idempotency outcomes per second, outbox samples and store
//! latencies.
//!
//! None of it is needed for correctness (that state lives in the store, shared by every
//! instance); it is a window on this instance's traffic, bounded in size.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use utoipa::ToSchema;

/// How many recent events and samples are kept.
const EVENTS: usize = 100;
const SECONDS: usize = 300;
const LATENCY_SAMPLES: usize = 512;
/// Locks shown at most per tenant (and for callers without one): past it a tenant's
/// newer locks are not shown, and no tenant's count hides another's.
const HELD_PER_TENANT: usize = 1000;

#[derive(Default)]
pub(crate) struct Activity {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    held: BTreeMap<String, Held>,
    waiting: HashMap<String, u32>,
    /// Recent events per tenant (`None`: callers without one), each buffer bounded,
    /// so that no tenant's traffic pushes another's events out.
    events: HashMap<Option<String>, VecDeque<Event>>,
    idempotency: VecDeque<IdempotencySecond>,
    outbox: VecDeque<OutboxSample>,
    latency: BTreeMap<&'static str, VecDeque<Duration>>,
}

impl State {
    fn event(&mut self, kind: &'static str, tenant: Option<&str>, name: &str, detail: String) {
        let events = self.events.entry(tenant.map(str::to_owned)).or_default();
        if events.len() == EVENTS {
            events.pop_front();
        }
        events.push_back(Event {
            at_ms: unix_ms(),
            kind,
            name: name.to_owned(),
            tenant: tenant.map(str::to_owned),
            detail,
        });
    }

    /// Drops the locks whose lease passed without a release: their holder stopped
    /// extending (it crashed, was cut off, or forgot), which an operator wants to see.
    fn expire(&mut self, now: Instant) {
        let (expired, live): (BTreeMap<_, _>, BTreeMap<_, _>) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|(_, held)| held.until <= now);
        self.held = live;
        for held in expired.into_values() {
            metrics::counter!("turnstile_serve_leases_expired_total").increment(1);
            let detail = format!(
                "lease ran out without a release (holder {}…, token {})",
                held.holder, held.token
            );
            self.event("expired", held.tenant.as_deref(), &held.name, detail);
        }
    }
}

struct Held {
    tenant: Option<String>,
    name: String,
    holder: String,
    token: u64,
    until: Instant,
}

/// A lock handed out by this instance.
#[derive(Serialize, ToSchema)]
pub(crate) struct HeldLock {
    /// The name as its tenant sees it.
    name: String,
    /// The tenant (absent for names outside any tenant).
    tenant: Option<String>,
    /// The name to use in this caller's requests (`/v1/locks/{address}`): the name for
    /// a caller confined to the tenant, `tenant/name` for one who sees every tenant.
    address: String,
    /// The first 8 hex digits of the holder's owner id (the whole id is the holder's
    /// capability to release, so it is not shown).
    holder: String,
    /// The fencing token.
    fencing_token: u64,
    /// How long the lease has left, by this instance's clock.
    lease_left_ms: u64,
    /// Requests waiting for it in this instance.
    waiters: u32,
}

/// A lost lock, a break or a late release.
#[derive(Serialize, ToSchema, Clone)]
pub(crate) struct Event {
    /// Unix time in milliseconds.
    at_ms: u64,
    /// `lost`, `broken`, `expired` (a lease that ran out without a release) or
    /// `released_late`.
    kind: &'static str,
    /// The name as its tenant sees it.
    name: String,
    /// The tenant.
    tenant: Option<String>,
    /// Details (the loss reason, who broke it).
    detail: String,
}

/// Idempotency outcomes in one second.
#[derive(Serialize, ToSchema, Clone, Default)]
pub(crate) struct IdempotencySecond {
    /// Unix time in seconds.
    at_s: u64,
    started: u32,
    replayed: u32,
    in_progress: u32,
    mismatched: u32,
    completed: u32,
    fenced: u32,
}

/// One look at the outbox.
#[derive(Serialize, ToSchema, Clone)]
pub(crate) struct OutboxSample {
    /// Unix time in milliseconds.
    at_ms: u64,
    /// Undelivered messages.
    pending: u64,
    /// Age of the oldest undelivered message.
    oldest_pending_ms: Option<u64>,
    /// Parked keys.
    parked: u64,
}

/// Store latency of one operation, from this instance's recent requests.
#[derive(Serialize, ToSchema)]
pub(crate) struct Latency {
    /// The operation (`acquire` counts only attempts that did not wait).
    operation: &'static str,
    /// Requests in the sample.
    count: usize,
    p50_us: u64,
    p99_us: u64,
}

/// An idempotency outcome to count.
#[derive(Clone, Copy)]
pub(crate) enum IdempotencyOutcome {
    Started,
    Replayed,
    InProgress,
    Mismatched,
    Completed,
    Fenced,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as u64)
}

impl Activity {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn held(
        &self,
        key: &str,
        tenant: Option<&str>,
        name: &str,
        owner: &str,
        token: u64,
        ttl: Duration,
    ) {
        let mut state = self.state();
        let now = Instant::now();
        state.expire(now);
        let shown = state
            .held
            .values()
            .filter(|held| held.tenant.as_deref() == tenant)
            .count();
        if shown >= HELD_PER_TENANT {
            return;
        }
        state.held.insert(
            key.to_owned(),
            Held {
                tenant: tenant.map(str::to_owned),
                name: name.to_owned(),
                holder: owner.chars().take(8).collect(),
                token,
                until: now + ttl,
            },
        );
    }

    pub(crate) fn extended(&self, key: &str, ttl: Duration) {
        if let Some(held) = self.state().held.get_mut(key) {
            held.until = Instant::now() + ttl;
        }
    }

    /// The lock at `key` is no longer held by `owner`: its row goes, unless another
    /// owner's lock is shown there (a call with a wrong owner id changes nothing that
    /// is shown).
    pub(crate) fn gone(&self, key: &str, owner: Option<&str>) {
        let mut state = self.state();
        let theirs = state
            .held
            .get(key)
            .is_some_and(|held| owner.is_none_or(|owner| owner.starts_with(held.holder.as_str())));
        if theirs {
            state.held.remove(key);
        }
    }

    /// Counts a waiter until the returned guard drops.
    pub(crate) fn waiting<'a>(&'a self, key: &str) -> Waiting<'a> {
        *self.state().waiting.entry(key.to_owned()).or_default() += 1;
        Waiting {
            activity: self,
            key: key.to_owned(),
        }
    }

    pub(crate) fn event(
        &self,
        kind: &'static str,
        tenant: Option<&str>,
        name: &str,
        detail: String,
    ) {
        self.state().event(kind, tenant, name, detail);
    }

    pub(crate) fn idempotency(&self, outcome: IdempotencyOutcome) {
        let at_s = unix_ms() / 1000;
        let mut state = self.state();
        if state
            .idempotency
            .back()
            .is_none_or(|last| last.at_s != at_s)
        {
            if state.idempotency.len() == SECONDS {
                state.idempotency.pop_front();
            }
            state.idempotency.push_back(IdempotencySecond {
                at_s,
                ..IdempotencySecond::default()
            });
        }
        if let Some(second) = state.idempotency.back_mut() {
            let count = match outcome {
                IdempotencyOutcome::Started => &mut second.started,
                IdempotencyOutcome::Replayed => &mut second.replayed,
                IdempotencyOutcome::InProgress => &mut second.in_progress,
                IdempotencyOutcome::Mismatched => &mut second.mismatched,
                IdempotencyOutcome::Completed => &mut second.completed,
                IdempotencyOutcome::Fenced => &mut second.fenced,
            };
            *count += 1;
        }
    }

    pub(crate) fn outbox(&self, pending: u64, oldest: Option<Duration>, parked: u64) {
        let mut state = self.state();
        if state.outbox.len() == SECONDS {
            state.outbox.pop_front();
        }
        state.outbox.push_back(OutboxSample {
            at_ms: unix_ms(),
            pending,
            oldest_pending_ms: oldest.map(|age| age.as_millis() as u64),
            parked,
        });
    }

    pub(crate) fn latency(&self, operation: &'static str, took: Duration) {
        let mut state = self.state();
        let samples = state.latency.entry(operation).or_default();
        if samples.len() == LATENCY_SAMPLES {
            samples.pop_front();
        }
        samples.push_back(took);
    }

    /// What the dashboard shows to a caller confined to `tenant` (all, for `None`).
    pub(crate) fn snapshot(&self, tenant: Option<&str>) -> Snapshot {
        let mut state = self.state();
        let now = Instant::now();
        state.expire(now);
        let visible = |owner: Option<&str>| tenant.is_none() || owner == tenant;
        let held = state
            .held
            .iter()
            .filter(|(_, held)| visible(held.tenant.as_deref()))
            .map(|(key, held)| HeldLock {
                address: if tenant.is_some() {
                    held.name.clone()
                } else {
                    key.clone()
                },
                name: held.name.clone(),
                tenant: held.tenant.clone(),
                holder: held.holder.clone(),
                fencing_token: held.token,
                lease_left_ms: held.until.saturating_duration_since(now).as_millis() as u64,
                waiters: state.waiting.get(key).copied().unwrap_or(0),
            })
            .collect();
        let mut events: Vec<Event> = state
            .events
            .iter()
            .filter(|(owner, _)| visible(owner.as_deref()))
            .flat_map(|(_, events)| events.iter().cloned())
            .collect();
        events.sort_by_key(|event| std::cmp::Reverse(event.at_ms));
        events.truncate(EVENTS);
        // Idempotency counts, outbox and latency are instance-wide: shown to callers of
        // every tenant only when they are not confined to one.
        if tenant.is_some() {
            return Snapshot {
                held,
                events,
                idempotency: Vec::new(),
                outbox: Vec::new(),
                latency: Vec::new(),
            };
        }
        let latency = state
            .latency
            .iter()
            .map(|(&operation, samples)| {
                let mut sorted: Vec<Duration> = samples.iter().copied().collect();
                sorted.sort();
                let at = |q: f64| {
                    sorted
                        .get(((sorted.len() as f64 - 1.0) * q).round() as usize)
                        .map_or(0, |d| d.as_micros() as u64)
                };
                Latency {
                    operation,
                    count: sorted.len(),
                    p50_us: at(0.5),
                    p99_us: at(0.99),
                }
            })
            .collect();
        Snapshot {
            held,
            events,
            idempotency: state.idempotency.iter().cloned().collect(),
            outbox: state.outbox.iter().cloned().collect(),
            latency,
        }
    }
}

/// What the dashboard shows.
pub(crate) struct Snapshot {
    pub(crate) held: Vec<HeldLock>,
    pub(crate) events: Vec<Event>,
    pub(crate) idempotency: Vec<IdempotencySecond>,
    pub(crate) outbox: Vec<OutboxSample>,
    pub(crate) latency: Vec<Latency>,
}

/// A waiter counted in [`Activity`]; uncounted on drop (the long-poll ended or its
/// client went away).
pub(crate) struct Waiting<'a> {
    activity: &'a Activity,
    key: String,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut state = self.activity.state();
        if let Some(count) = state.waiting.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                state.waiting.remove(&self.key);
            }
        }
    }
}
