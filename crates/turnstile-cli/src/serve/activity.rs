//! What this instance has seen, for the dashboard: the locks it handed out (until their
//! lease ends or they are released), the elections campaigned through it with their
//! recent terms, waiters in its long-polls, recent losses, breaks and leases that ran
//! out, idempotency outcomes per second, outbox samples and store latencies.
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
/// Terms kept per election, the current one included.
const TERMS: usize = 10;
/// The most of a leader's value that is kept for the dashboard, in bytes (values may
/// be 16 KiB; a thousand elections of ten terms would keep 160 MiB).
const VALUE_SHOWN: usize = 256;

#[derive(Default)]
pub(crate) struct Activity {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    held: BTreeMap<String, Held>,
    elections: BTreeMap<String, ElectionRecord>,
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
        let mut ran_out = Vec::new();
        for record in self.elections.values_mut() {
            let ElectionRecord {
                tenant,
                name,
                terms,
            } = record;
            let current = terms.back_mut().filter(|term| term.ended.is_none());
            if let Some(term) = current.filter(|term| term.until <= now) {
                term.ended = Some((unix_ms(), "expired"));
                ran_out.push((
                    tenant.clone(),
                    name.clone(),
                    format!(
                        "epoch {}: the lease ran out without an extend or a resign (leader {}…)",
                        term.epoch, term.holder
                    ),
                ));
            }
        }
        for (tenant, name, detail) in ran_out {
            self.event("deposed", tenant.as_deref(), &name, detail);
        }
    }
}

/// An election campaigned through this instance.
struct ElectionRecord {
    tenant: Option<String>,
    name: String,
    /// Oldest first; the last may be the current term.
    terms: VecDeque<Term>,
}

impl ElectionRecord {
    fn current_mut(&mut self) -> Option<&mut Term> {
        self.terms.back_mut().filter(|term| term.ended.is_none())
    }
}

struct Term {
    holder: String,
    epoch: u64,
    value: String,
    since_ms: u64,
    until: Instant,
    /// When it ended (Unix ms) and how.
    ended: Option<(u64, &'static str)>,
}

impl Term {
    fn view(&self, now: Instant) -> TermView {
        TermView {
            holder: self.holder.clone(),
            epoch: self.epoch,
            value: self.value.clone(),
            since_ms: self.since_ms,
            lease_left_ms: self
                .ended
                .is_none()
                .then(|| self.until.saturating_duration_since(now).as_millis() as u64),
            ended_ms: self.ended.map(|(at, _)| at),
            ended: self.ended.map(|(_, how)| how),
        }
    }
}

/// At most [`VALUE_SHOWN`] bytes of `value`, cut at a character boundary.
fn shown_value(value: &str) -> String {
    if value.len() <= VALUE_SHOWN {
        return value.to_owned();
    }
    let mut end = VALUE_SHOWN;
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &value[..end])
}

/// An election campaigned through this instance, as the dashboard shows it.
#[derive(Serialize, ToSchema)]
pub(crate) struct ElectionView {
    /// The name as its tenant sees it.
    name: String,
    /// The tenant (absent for names outside any tenant).
    tenant: Option<String>,
    /// The name to use in this caller's requests (`/v1/elections/{address}`).
    address: String,
    /// The term going on, if its leader campaigned through this instance and it has
    /// not ended.
    leader: Option<TermView>,
    /// Candidates waiting in this instance's long-polls.
    candidates: u32,
    /// Earlier terms through this instance, newest first (at most 9).
    history: Vec<TermView>,
}

/// One leader's term.
#[derive(Serialize, ToSchema)]
pub(crate) struct TermView {
    /// The first 8 hex digits of the leader's owner id.
    holder: String,
    /// The leader's epoch (its fencing token).
    epoch: u64,
    /// What it advertised last (at most 256 bytes of it).
    value: String,
    /// Unix time in milliseconds when it was elected.
    since_ms: u64,
    /// How long its lease has left, by this instance's clock (current term only).
    lease_left_ms: Option<u64>,
    /// Unix time in milliseconds when it ended.
    ended_ms: Option<u64>,
    /// How it ended: `resigned`, `deposed` (an extend found it lost), `expired` (its
    /// lease ran out without an extend), `broken` (by `DELETE /v1/locks/{name}`) or
    /// `replaced` (a later leader was elected through this instance before this one's
    /// end was seen here).
    ended: Option<&'static str>,
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
    /// `lost`, `broken`, `expired` (a lease that ran out without a release),
    /// `released_late`; for elections `elected`, `resigned` and `deposed`.
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

    /// A leader elected through this instance: a new term of the election at `key`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn elected(
        &self,
        key: &str,
        tenant: Option<&str>,
        name: &str,
        owner: &str,
        epoch: u64,
        value: &str,
        ttl: Duration,
    ) {
        let mut state = self.state();
        let now = Instant::now();
        state.expire(now);
        let shown = state
            .elections
            .values()
            .filter(|record| record.tenant.as_deref() == tenant)
            .count();
        if shown >= HELD_PER_TENANT && !state.elections.contains_key(key) {
            return;
        }
        let record = state
            .elections
            .entry(key.to_owned())
            .or_insert_with(|| ElectionRecord {
                tenant: tenant.map(str::to_owned),
                name: name.to_owned(),
                terms: VecDeque::new(),
            });
        if let Some(earlier) = record.current_mut() {
            earlier.ended = Some((unix_ms(), "replaced"));
        }
        if record.terms.len() == TERMS {
            record.terms.pop_front();
        }
        let holder: String = owner.chars().take(8).collect();
        record.terms.push_back(Term {
            holder: holder.clone(),
            epoch,
            value: shown_value(value),
            since_ms: unix_ms(),
            until: now + ttl,
            ended: None,
        });
        state.event(
            "elected",
            tenant,
            name,
            format!("epoch {epoch}, leader {holder}…"),
        );
    }

    /// The current term of the election at `key`, if `owner` leads it.
    fn term_of<'a>(state: &'a mut State, key: &str, owner: &str) -> Option<&'a mut Term> {
        state
            .elections
            .get_mut(key)?
            .current_mut()
            .filter(|term| owner.starts_with(term.holder.as_str()))
    }

    /// `owner`'s leadership at `key` was extended for `ttl`.
    pub(crate) fn term_extended(&self, key: &str, owner: &str, ttl: Duration) {
        if let Some(term) = Self::term_of(&mut self.state(), key, owner) {
            term.until = Instant::now() + ttl;
        }
    }

    /// `owner`, leading at `key`, advertises `value`.
    pub(crate) fn proclaimed(&self, key: &str, owner: &str, value: &str) {
        if let Some(term) = Self::term_of(&mut self.state(), key, owner) {
            term.value = shown_value(value);
        }
    }

    /// `owner`'s term at `key` ended (`None`: whoever's, for a break): `how` is
    /// `resigned`, `deposed` or `broken`.
    pub(crate) fn term_ended(&self, key: &str, owner: Option<&str>, how: &'static str) {
        let mut state = self.state();
        let Some(record) = state.elections.get_mut(key) else {
            return;
        };
        let Some(term) = record
            .current_mut()
            .filter(|term| owner.is_none_or(|owner| owner.starts_with(term.holder.as_str())))
        else {
            return;
        };
        term.ended = Some((unix_ms(), how));
        let detail = format!("epoch {}, leader {}…", term.epoch, term.holder);
        let (tenant, name) = (record.tenant.clone(), record.name.clone());
        if how != "broken" {
            state.event(how, tenant.as_deref(), &name, detail);
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
        let elections = state
            .elections
            .iter()
            .filter(|(_, record)| visible(record.tenant.as_deref()))
            .map(|(key, record)| {
                let mut terms = record.terms.iter().rev();
                let leader = record
                    .terms
                    .back()
                    .filter(|term| term.ended.is_none())
                    .map(|term| term.view(now));
                if leader.is_some() {
                    terms.next();
                }
                ElectionView {
                    address: if tenant.is_some() {
                        record.name.clone()
                    } else {
                        key.clone()
                    },
                    name: record.name.clone(),
                    tenant: record.tenant.clone(),
                    leader,
                    candidates: state.waiting.get(key).copied().unwrap_or(0),
                    history: terms.map(|term| term.view(now)).collect(),
                }
            })
            .collect();
        // Idempotency counts, outbox and latency are instance-wide: shown to callers of
        // every tenant only when they are not confined to one.
        if tenant.is_some() {
            return Snapshot {
                held,
                elections,
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
            elections,
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
    pub(crate) elections: Vec<ElectionView>,
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
