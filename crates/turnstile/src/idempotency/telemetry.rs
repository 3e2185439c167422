//! What the idempotency engine reports: `tracing` events and `metrics` counters.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `turnstile_idempotency_outcomes_total` | counter | `outcome` = `started`, `replayed`, `in_progress`, `waited`, `mismatch`, `completed`, `not_stored`, `released`, `fenced_out`, `store_error`, `completion_retried`, `completion_failed` |
//! | `turnstile_idempotency_swept_total` | counter | — (records past their retention deleted by `run_sweeper`) |
//! | `turnstile_idempotency_sweep_failures_total` | counter | — |
//! | `turnstile_idempotency_work_seconds` | histogram | — (from the claim to the stored outcome) |
//! | `turnstile_idempotency_replay_seconds` | histogram | — (from the call to the replayed outcome, waiting included) |
//! | `turnstile_idempotency_lease_lost_total` | counter | `reason` |
//! | `turnstile_idempotency_renewal_failures_total` | counter | — |
//! | `turnstile_idempotency_store_seconds` | histogram | `engine` (`sqlite`, `postgres`, `mysql`, `redis`), `op` (`claim`, `heartbeat`, `complete`, `release`, `get`, `forget`, `sweep`, `stale`, `watch`), `result` (`ok`, `error`) |

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{
    ClaimAnswer, Fingerprint, Finish, IdempotencyKey, IdempotencyStore, Record, Scope, StaleClaim,
};
use crate::error::{Error, Result};
use crate::fence::FencingToken;
use crate::lock::{BoxFuture, ExtendOutcome, ReleaseWatch};

fn count(outcome: &'static str) {
    metrics::counter!("turnstile_idempotency_outcomes_total", "outcome" => outcome).increment(1);
}

pub(crate) fn started(scope: &Scope, key: &IdempotencyKey, token: FencingToken) {
    count("started");
    tracing::debug!(%scope, %key, %token, "idempotency key claimed; running the work");
}

pub(crate) fn replayed(scope: &Scope, key: &IdempotencyKey, took: Duration) {
    count("replayed");
    metrics::histogram!("turnstile_idempotency_replay_seconds").record(took.as_secs_f64());
    tracing::debug!(%scope, %key, took = ?took, "idempotency key replayed its stored outcome");
}

pub(crate) fn in_progress(scope: &Scope, key: &IdempotencyKey) {
    count("in_progress");
    tracing::debug!(%scope, %key, "idempotency key in progress elsewhere");
}

pub(crate) fn waiting(scope: &Scope, key: &IdempotencyKey) {
    count("waited");
    tracing::trace!(%scope, %key, "waiting for the request in flight with this key");
}

pub(crate) fn mismatch(scope: &Scope, key: &IdempotencyKey) {
    count("mismatch");
    tracing::info!(%scope, %key, "idempotency key reused for a different request");
}

pub(crate) fn completed(scope: &Scope, key: &IdempotencyKey, took: Duration) {
    count("completed");
    metrics::histogram!("turnstile_idempotency_work_seconds").record(took.as_secs_f64());
    tracing::debug!(%scope, %key, took = ?took, "idempotency key completed");
}

pub(crate) fn released(scope: &Scope, key: &IdempotencyKey) {
    count("released");
    tracing::debug!(%scope, %key, "the work failed; idempotency key given back for a retry");
}

pub(crate) fn swept(records: u64) {
    metrics::counter!("turnstile_idempotency_swept_total").increment(records);
    if records > 0 {
        tracing::debug!(records, "idempotency records past their retention swept");
    }
}

pub(crate) fn sweep_failed(error: &Error) {
    metrics::counter!("turnstile_idempotency_sweep_failures_total").increment(1);
    tracing::warn!(%error, "cannot sweep idempotency records; trying again at the next interval");
}

pub(crate) fn completion_retried(scope: &Scope, key: &IdempotencyKey, error: &Error) {
    count("completion_retried");
    tracing::warn!(%scope, %key, %error, "storing the outcome failed; renewing the claim and trying again");
}

pub(crate) fn completion_failed(scope: &Scope, key: &IdempotencyKey, error: &Error) {
    count("completion_failed");
    tracing::error!(%scope, %key, %error, "the outcome could not be stored before the claim ran out: a retry after the lease runs the work again");
}

pub(crate) fn not_stored(scope: &Scope, key: &IdempotencyKey, error: &Error) {
    count("not_stored");
    tracing::warn!(%scope, %key, %error, "the outcome cannot be stored; the record says so, and repeats are told instead of running again");
}

pub(crate) fn fenced_out(scope: &Scope, key: &IdempotencyKey, token: FencingToken) {
    count("fenced_out");
    tracing::warn!(%scope, %key, %token, "a stale claim's outcome was refused: a newer claim holds the key");
}

pub(crate) fn store_error(scope: &Scope, key: &IdempotencyKey, error: &Error) {
    count("store_error");
    tracing::warn!(%scope, %key, %error, "the idempotency store failed");
}

/// The engine's label for a store: the scheme of the URL it describes.
pub(crate) fn engine_of(store: &dyn IdempotencyStore) -> &'static str {
    let description = store.describe();
    match description.split_once(':').map(|(scheme, _)| scheme) {
        Some("sqlite") => "sqlite",
        Some("postgres" | "postgresql") => "postgres",
        Some("mysql" | "mariadb") => "mysql",
        Some("redis" | "rediss" | "redis+unix" | "unix") => "redis",
        _ => "other",
    }
}

/// A store whose every call is timed into `turnstile_idempotency_store_seconds`
/// (labels `engine`, `op`, `result` = `ok` | `error`): what the engine uses, so that
/// claims, heartbeats, completions and operators' calls are all measured in one place.
pub(crate) struct TimedStore {
    pub(crate) inner: Arc<dyn IdempotencyStore>,
    pub(crate) engine: &'static str,
}

impl fmt::Debug for TimedStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

impl TimedStore {
    fn timed<'a, T: Send + 'a>(
        &'a self,
        op: &'static str,
        call: BoxFuture<'a, Result<T>>,
    ) -> BoxFuture<'a, Result<T>> {
        Box::pin(async move {
            let started = Instant::now();
            let result = call.await;
            let outcome = if result.is_ok() { "ok" } else { "error" };
            metrics::histogram!(
                "turnstile_idempotency_store_seconds",
                "engine" => self.engine, "op" => op, "result" => outcome
            )
            .record(started.elapsed().as_secs_f64());
            result
        })
    }
}

impl IdempotencyStore for TimedStore {
    fn claim<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        fingerprint: &'a Fingerprint,
        lease: Duration,
        retention: Duration,
    ) -> BoxFuture<'a, Result<ClaimAnswer>> {
        let call = self.inner.claim(scope, key, fingerprint, lease, retention);
        self.timed("claim", call)
    }

    fn heartbeat<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        token: FencingToken,
        lease: Duration,
    ) -> BoxFuture<'a, Result<ExtendOutcome>> {
        self.timed("heartbeat", self.inner.heartbeat(scope, key, token, lease))
    }

    fn complete<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        token: FencingToken,
        outcome: &'a [u8],
        retention: Duration,
    ) -> BoxFuture<'a, Result<Finish>> {
        let call = self.inner.complete(scope, key, token, outcome, retention);
        self.timed("complete", call)
    }

    fn release<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        token: FencingToken,
    ) -> BoxFuture<'a, Result<Finish>> {
        self.timed("release", self.inner.release(scope, key, token))
    }

    fn get<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<Option<Record>>> {
        self.timed("get", self.inner.get(scope, key))
    }

    fn forget<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<bool>> {
        self.timed("forget", self.inner.forget(scope, key))
    }

    fn sweep(&self, limit: u32) -> BoxFuture<'_, Result<u64>> {
        self.timed("sweep", self.inner.sweep(limit))
    }

    fn stale(&self, limit: u32) -> BoxFuture<'_, Result<Vec<StaleClaim>>> {
        self.timed("stale", self.inner.stale(limit))
    }

    fn watch<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<ReleaseWatch>> {
        self.timed("watch", self.inner.watch(scope, key))
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}
