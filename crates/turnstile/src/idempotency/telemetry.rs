//! What the idempotency engine reports: `tracing` events and `metrics` counters.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `turnstile_idempotency_outcomes_total` | counter | `outcome` = `started`, `replayed`, `in_progress`, `waited`, `mismatch`, `completed`, `released`, `fenced_out`, `store_error` |
//! | `turnstile_idempotency_work_seconds` | histogram | — (from the claim to the stored outcome) |
//! | `turnstile_idempotency_replay_seconds` | histogram | — (from the call to the replayed outcome, waiting included) |
//! | `turnstile_idempotency_lease_lost_total` | counter | `reason` |
//! | `turnstile_idempotency_renewal_failures_total` | counter | — |

use std::time::Duration;

use super::{IdempotencyKey, Scope};
use crate::error::Error;
use crate::fence::FencingToken;

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

pub(crate) fn fenced_out(scope: &Scope, key: &IdempotencyKey, token: FencingToken) {
    count("fenced_out");
    tracing::warn!(%scope, %key, %token, "a stale claim's outcome was refused: a newer claim holds the key");
}

pub(crate) fn store_error(scope: &Scope, key: &IdempotencyKey, error: &Error) {
    count("store_error");
    tracing::warn!(%scope, %key, %error, "the idempotency store failed");
}
