//! What the lock core reports: `tracing` events and `metrics` counters and histograms.
//!
//! Nothing here installs a subscriber or a recorder: an application that has none pays
//! almost nothing, and one that has them sees every outcome below.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `turnstile_lock_acquired_total` | counter | `via` = `store` or `handover` |
//! | `turnstile_lock_acquire_wait_seconds` | histogram | — (from the call to the lock) |
//! | `turnstile_lock_not_acquired_total` | counter | `reason` = `timeout` or `error` |
//! | `turnstile_lock_released_total` | counter | `outcome` = `released`, `expired`, `held_by_other`, `handed_over` |
//! | `turnstile_lock_held_seconds` | histogram | — (from acquiring to releasing; not for detached locks) |
//! | `turnstile_lock_detached_extended_total` | counter | `outcome` = `extended` or `lost` (a [`Locker::extend_detached`](super::Locker::extend_detached)) |
//! | `turnstile_lock_renewal_failures_total` | counter | — (a renewal that could not reach the store) |
//! | `turnstile_lease_suspensions_total` | counter | `kind` = `lock` or `idempotency claim` (a renewal unanswered for a sixth of the TTL; see [`LockGuard::is_suspended`](super::LockGuard::is_suspended)) |
//! | `turnstile_lock_lost_total` | counter | `reason` = see [`LossReason`] |

use std::time::Duration;

use super::{ExtendOutcome, LockName, LossReason, ReleaseOutcome};

/// What kind of lease a report is about: a lock's, or an idempotency claim's (which
/// runs on the same lease keeper).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeaseKind {
    Lock,
    Claim,
}
use crate::error::Error;

pub(crate) fn acquired(name: &LockName, token: Option<u64>, waited: Duration, handed_over: bool) {
    let via = if handed_over { "handover" } else { "store" };
    metrics::counter!("turnstile_lock_acquired_total", "via" => via).increment(1);
    metrics::histogram!("turnstile_lock_acquire_wait_seconds").record(waited.as_secs_f64());
    match token {
        Some(token) => tracing::debug!(lock = %name, token, waited = ?waited, via, "lock acquired"),
        None => {
            tracing::debug!(lock = %name, fenced = false, waited = ?waited, via, "lock acquired unfenced")
        }
    }
}

pub(crate) fn not_acquired(name: &LockName, error: &Error, waited: Duration) {
    let reason = if error.kind() == crate::ErrorKind::AcquireTimeout {
        "timeout"
    } else {
        "error"
    };
    metrics::counter!("turnstile_lock_not_acquired_total", "reason" => reason).increment(1);
    tracing::debug!(lock = %name, waited = ?waited, %error, "lock not acquired");
}

pub(crate) fn released(
    name: &LockName,
    outcome: ReleaseOutcome,
    handed_over: bool,
    held: Option<Duration>,
) {
    let label = match (handed_over, outcome) {
        (true, _) => "handed_over",
        (false, ReleaseOutcome::Released) => "released",
        (false, ReleaseOutcome::AlreadyExpired) => "expired",
        (false, ReleaseOutcome::HeldByOther) => "held_by_other",
    };
    metrics::counter!("turnstile_lock_released_total", "outcome" => label).increment(1);
    // A detached lock's holding time is its client's to know.
    if let Some(held) = held {
        metrics::histogram!("turnstile_lock_held_seconds").record(held.as_secs_f64());
    }
    if matches!(outcome, ReleaseOutcome::Released) {
        tracing::debug!(lock = %name, held = ?held, outcome = label, "lock released");
    } else {
        tracing::warn!(lock = %name, held = ?held, outcome = label, "lock released after its lease had ended");
    }
}

/// A detached lock's holder asked for more time.
pub(crate) fn extended_detached(name: &LockName, outcome: ExtendOutcome) {
    let label = match outcome {
        ExtendOutcome::Extended => "extended",
        ExtendOutcome::Lost(_) => "lost",
    };
    metrics::counter!("turnstile_lock_detached_extended_total", "outcome" => label).increment(1);
    if let ExtendOutcome::Lost(reason) = outcome {
        lost(LeaseKind::Lock, name.as_str(), reason, Duration::ZERO);
    } else {
        tracing::debug!(lock = %name, "detached lock extended");
    }
}

pub(crate) fn renewal_failed(kind: LeaseKind, name: &str, error: &Error) {
    match kind {
        LeaseKind::Lock => {
            metrics::counter!("turnstile_lock_renewal_failures_total").increment(1);
            tracing::warn!(lock = %name, %error, "lock renewal failed; retrying until the lease's deadline");
        }
        LeaseKind::Claim => {
            metrics::counter!("turnstile_idempotency_renewal_failures_total").increment(1);
            tracing::warn!(key = %name, %error, "idempotency claim renewal failed; retrying until the lease's deadline");
        }
    }
}

/// A renewal has had no answer for a sixth of the TTL: the lease is suspended.
pub(crate) fn renewal_slow(kind: LeaseKind, name: &str, waited: Duration) {
    let noun = match kind {
        LeaseKind::Lock => "lock",
        LeaseKind::Claim => "idempotency claim",
    };
    metrics::counter!("turnstile_lease_suspensions_total", "kind" => noun).increment(1);
    tracing::warn!(name = %name, ?waited, "{noun} renewal unanswered; the lease is suspended until a renewal gets through or its deadline passes");
}

pub(crate) fn lost(kind: LeaseKind, name: &str, reason: LossReason, held: Duration) {
    let label = reason.as_label();
    match kind {
        LeaseKind::Lock => {
            metrics::counter!("turnstile_lock_lost_total", "reason" => label).increment(1);
            tracing::warn!(lock = %name, held = ?held, reason = label, "lock lost: {reason}");
        }
        LeaseKind::Claim => {
            metrics::counter!("turnstile_idempotency_lease_lost_total", "reason" => label)
                .increment(1);
            tracing::warn!(key = %name, held = ?held, reason = label, "idempotency claim lost: {reason}");
        }
    }
}
