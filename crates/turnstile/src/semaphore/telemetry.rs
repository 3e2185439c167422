//! What semaphores report: `tracing` events and `metrics` counters and histograms.
//!
//! Nothing here installs a subscriber or a recorder. A permit is a lock of the lock
//! core, so the lock core's metrics ([`crate::lock::telemetry`]) count its acquisition,
//! renewals and loss too (`turnstile_lock_lost_total`); these say what it meant for the
//! semaphore.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `turnstile_semaphore_acquired_total` | counter | — (a permit taken) |
//! | `turnstile_semaphore_acquire_wait_seconds` | histogram | — (from the call to the permit) |
//! | `turnstile_semaphore_not_acquired_total` | counter | `reason` = `all_held` (a try), `timeout` or `error` |
//! | `turnstile_semaphore_released_total` | counter | `outcome` = `released`, `expired`, `held_by_other` |

use std::time::Duration;

use crate::lock::{LockName, ReleaseOutcome};

pub(crate) fn acquired(name: &LockName, slot: u32, waited: Duration) {
    metrics::counter!("turnstile_semaphore_acquired_total").increment(1);
    metrics::histogram!("turnstile_semaphore_acquire_wait_seconds").record(waited.as_secs_f64());
    tracing::debug!(semaphore = %name, slot, waited = ?waited, "permit acquired");
}

pub(crate) fn not_acquired(name: &LockName, reason: &'static str, waited: Duration) {
    metrics::counter!("turnstile_semaphore_not_acquired_total", "reason" => reason).increment(1);
    tracing::debug!(semaphore = %name, reason, waited = ?waited, "permit not acquired");
}

pub(crate) fn released(name: &LockName, slot: u32, outcome: ReleaseOutcome) {
    let label = match outcome {
        ReleaseOutcome::Released => "released",
        ReleaseOutcome::AlreadyExpired => "expired",
        ReleaseOutcome::HeldByOther => "held_by_other",
    };
    metrics::counter!("turnstile_semaphore_released_total", "outcome" => label).increment(1);
    tracing::debug!(semaphore = %name, slot, outcome = label, "permit released");
}
