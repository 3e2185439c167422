//! What elections report: `tracing` events and `metrics` counters and histograms.
//!
//! Nothing here installs a subscriber or a recorder. A campaign is a lock acquisition,
//! so the lock core's own metrics ([`crate::lock::telemetry`]) count it too; these say
//! what it meant for the election.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `turnstile_election_campaigns_total` | counter | — (a campaign started) |
//! | `turnstile_election_elected_total` | counter | — (a campaign won) |
//! | `turnstile_election_campaign_wait_seconds` | histogram | — (from the campaign's start to leading) |
//! | `turnstile_election_resigned_total` | counter | `outcome` = `released`, `expired`, `held_by_other` |
//! | `turnstile_election_deposed_total` | counter | `reason` = see [`LossReason`] (leadership lost, not resigned) |
//! | `turnstile_election_proclaimed_total` | counter | — (a leader changed its value) |
//! | `turnstile_election_leader_changes_total` | counter | `to` = `leader` or `none` (seen by an observer) |

use std::time::Duration;

use crate::fence::FencingToken;
use crate::lock::{LockName, LossReason, ReleaseOutcome};

use super::Leader;

pub(crate) fn campaigning(name: &LockName) {
    metrics::counter!("turnstile_election_campaigns_total").increment(1);
    tracing::debug!(election = %name, "campaigning");
}

pub(crate) fn elected(name: &LockName, epoch: FencingToken, waited: Duration) {
    metrics::counter!("turnstile_election_elected_total").increment(1);
    metrics::histogram!("turnstile_election_campaign_wait_seconds").record(waited.as_secs_f64());
    tracing::info!(election = %name, epoch = epoch.get(), waited = ?waited, "elected leader");
}

pub(crate) fn resigned(name: &LockName, epoch: FencingToken, outcome: ReleaseOutcome) {
    let label = match outcome {
        ReleaseOutcome::Released => "released",
        ReleaseOutcome::AlreadyExpired => "expired",
        ReleaseOutcome::HeldByOther => "held_by_other",
    };
    metrics::counter!("turnstile_election_resigned_total", "outcome" => label).increment(1);
    tracing::info!(election = %name, epoch = epoch.get(), outcome = label, "resigned leadership");
}

pub(crate) fn deposed(name: &LockName, epoch: FencingToken, reason: LossReason) {
    metrics::counter!("turnstile_election_deposed_total", "reason" => reason.as_label())
        .increment(1);
    tracing::warn!(election = %name, epoch = epoch.get(), %reason, "leadership lost");
}

pub(crate) fn proclaimed(name: &LockName, epoch: Option<FencingToken>) {
    metrics::counter!("turnstile_election_proclaimed_total").increment(1);
    tracing::debug!(election = %name, epoch = epoch.map(FencingToken::get), "leader value changed");
}

pub(crate) fn observed_change(name: &LockName, leader: Option<&Leader>) {
    let to = if leader.is_some() { "leader" } else { "none" };
    metrics::counter!("turnstile_election_leader_changes_total", "to" => to).increment(1);
    match leader {
        Some(leader) => tracing::debug!(
            election = %name,
            owner = %leader.owner,
            epoch = leader.epoch.map(FencingToken::get),
            "leader seen"
        ),
        None => tracing::debug!(election = %name, "no leader"),
    }
}
