//! What the outbox reports: `tracing` events and `metrics`.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `turnstile_outbox_enqueued_total` | counter | — |
//! | `turnstile_outbox_published_total` | counter | — |
//! | `turnstile_outbox_publish_seconds` | histogram | — (one publish, to the broker's ack) |
//! | `turnstile_outbox_lag_seconds` | histogram | — (enqueue to publish, by the database clock) |
//! | `turnstile_outbox_failures_total` | counter | `kind` = `transient`, `permanent` |
//! | `turnstile_outbox_parked_total` | counter | — |
//! | `turnstile_outbox_gaps_total` | counter | — (a key whose next message is missing: nothing of it is published) |
//! | `turnstile_outbox_settle_retries_total` | counter | — (a settlement the store failed, tried again within the lease) |
//! | `turnstile_outbox_topics_refused_total` | counter | — (a topic check the broker failed: no stream, a duplicate window too short) |
//! | `turnstile_outbox_skipped_total` | counter | — (head messages an operator moved aside with `outbox skip`) |
//! | `turnstile_outbox_relay_pauses_total` | counter | — (rounds whose every publish failed: the relay paused, backing off) |
//! | `turnstile_outbox_fenced_total` | counter | — (settlements refused: the lease had moved on) |
//! | `turnstile_outbox_pending` | gauge | — (undelivered messages of keys not parked; set by running relays every 5 s) |
//! | `turnstile_outbox_oldest_pending_seconds` | gauge | — (the lag: age of the oldest undelivered message) |
//! | `turnstile_outbox_parked_keys` | gauge | — |
//! | `turnstile_outbox_dead_lettered_total` | counter | `broker` = `nats`, `rabbitmq`, `kafka`, `redis` (messages a consumer dead-lettered after their handler failed on their last allowed delivery) |
//! | `turnstile_outbox_dead_letter_failures_total` | counter | `broker` (dead-letter copies the broker did not take: the message is retried after the delay instead) |

use std::time::Duration;

use super::{Failure, Message};

#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
pub(crate) fn enqueued(message: &Message, seq: u64) {
    metrics::counter!("turnstile_outbox_enqueued_total").increment(1);
    tracing::debug!(
        id = message.id(),
        key = message.key(),
        topic = message.topic(),
        seq,
        "outbox message enqueued"
    );
}

pub(crate) fn published(message: &Message, seq: u64, took: Duration, lag: Duration) {
    metrics::counter!("turnstile_outbox_published_total").increment(1);
    metrics::histogram!("turnstile_outbox_publish_seconds").record(took.as_secs_f64());
    metrics::histogram!("turnstile_outbox_lag_seconds").record(lag.as_secs_f64());
    tracing::debug!(id = message.id(), key = message.key(), seq, took = ?took, "outbox message published");
}

pub(crate) fn failed(message: &Message, seq: u64, failure: &Failure) {
    let kind = if failure.permanent {
        "permanent"
    } else {
        "transient"
    };
    metrics::counter!("turnstile_outbox_failures_total", "kind" => kind).increment(1);
    tracing::warn!(id = message.id(), key = message.key(), seq, kind, reason = %failure.reason, "outbox publish failed");
}

pub(crate) fn parked(key: &str) {
    metrics::counter!("turnstile_outbox_parked_total").increment(1);
    tracing::error!(
        key,
        "outbox key parked: its head message keeps failing; `turnstile outbox redrive` puts it back"
    );
}

pub(crate) fn gap(key: &str, expected: u64, found: Option<u64>) {
    metrics::counter!("turnstile_outbox_gaps_total").increment(1);
    tracing::error!(
        key,
        expected,
        found,
        "outbox sequence gap: the key's next message is missing, so nothing after it is published; \
         the key parks after the relay's attempts, and `turnstile outbox skip` moves past it"
    );
}

pub(crate) fn settle_retried(error: &crate::Error) {
    metrics::counter!("turnstile_outbox_settle_retries_total").increment(1);
    tracing::warn!(%error, "recording an outbox round failed; trying again within its lease");
}

pub(crate) fn topic_refused(topic: &str, error: &crate::Error) {
    metrics::counter!("turnstile_outbox_topics_refused_total").increment(1);
    tracing::error!(topic, %error, "the broker cannot take this topic as promised; its keys stop and park, the others go on");
}

#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
pub(crate) fn skipped(key: &str, seq: u64, moved: bool) {
    metrics::counter!("turnstile_outbox_skipped_total").increment(1);
    tracing::warn!(
        key,
        seq,
        moved,
        "an operator skipped an outbox key's head message; the key goes on after it"
    );
}

pub(crate) fn relay_paused(pause: Duration, failed: usize) {
    metrics::counter!("turnstile_outbox_relay_pauses_total").increment(1);
    tracing::warn!(pause = ?pause, failed, "every publish of a batch failed and the broker cannot be reached; the relay pauses");
}

#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) fn head_read_again(key: &str, seq: u64) {
    metrics::counter!("turnstile_outbox_heads_read_again_total").increment(1);
    tracing::debug!(
        key,
        seq,
        "the claim's snapshot did not hold the key's head message yet; read again"
    );
}

pub(crate) fn fenced(key: &str) {
    metrics::counter!("turnstile_outbox_fenced_total").increment(1);
    tracing::warn!(
        key,
        "outbox settlement refused: the key's lease had passed to another relay"
    );
}

pub(crate) fn status(status: &super::Status) {
    metrics::gauge!("turnstile_outbox_pending").set(status.pending as f64);
    metrics::gauge!("turnstile_outbox_oldest_pending_seconds")
        .set(status.oldest_pending.map_or(0.0, |age| age.as_secs_f64()));
    metrics::gauge!("turnstile_outbox_parked_keys").set(status.parked.len() as f64);
    tracing::trace!(pending = status.pending, parked = status.parked.len(), oldest = ?status.oldest_pending, "outbox status");
}

/// A consumer copied a message its handler kept failing to its dead-letter destination
/// and acknowledged the original.
#[cfg_attr(
    not(any(
        feature = "nats",
        feature = "rabbitmq",
        feature = "kafka",
        feature = "redis"
    )),
    allow(dead_code)
)]
pub(crate) fn dead_lettered(
    broker: &'static str,
    incoming: &super::Incoming,
    note: &super::DeadLetterNote,
    destination: &str,
) {
    metrics::counter!("turnstile_outbox_dead_lettered_total", "broker" => broker).increment(1);
    tracing::error!(
        broker,
        id = incoming.id.as_deref(),
        key = incoming.key.as_deref(),
        seq = incoming.seq,
        source = %note.source,
        position = note.position.as_deref(),
        deliveries = note.deliveries,
        destination,
        reason = %note.reason,
        "the handler failed on the message's last allowed delivery: it was dead-lettered \
         (copied to the destination, then acknowledged), to be seen and replayed there; a \
         consumer that handles its key in order (Inbox::process_in_order) holds the key's \
         later messages back until the copy is replayed or the inbox skips it (Inbox::skip)"
    );
}

/// A consumer's handler answered that a message came before its turn
/// ([`ErrorKind::OutOfOrder`](crate::ErrorKind::OutOfOrder)): it is sent back for later,
/// not counted as a failure.
#[cfg_attr(
    not(any(
        feature = "nats",
        feature = "rabbitmq",
        feature = "kafka",
        feature = "redis"
    )),
    allow(dead_code)
)]
pub(crate) fn early(
    broker: &'static str,
    incoming: &super::Incoming,
    early: u64,
    error: &crate::Error,
) {
    metrics::counter!("turnstile_outbox_consumer_early_total", "broker" => broker).increment(1);
    // Every 20th wait of one message is worth a look: its predecessor may be dead-lettered.
    if early.is_multiple_of(20) {
        tracing::warn!(
            broker,
            id = incoming.id.as_deref(),
            key = incoming.key.as_deref(),
            seq = incoming.seq,
            early,
            %error,
            "a message keeps waiting for its turn; not counted toward max_deliveries"
        );
    } else {
        tracing::debug!(
            broker,
            id = incoming.id.as_deref(),
            key = incoming.key.as_deref(),
            seq = incoming.seq,
            early,
            "message before its turn: sent back for later, not counted as a failure"
        );
    }
}

/// A dead-letter copy was not stored: the message stays at its source and is retried
/// after the delay.
#[cfg_attr(
    not(any(
        feature = "nats",
        feature = "rabbitmq",
        feature = "kafka",
        feature = "redis"
    )),
    allow(dead_code)
)]
pub(crate) fn dead_letter_failed(
    broker: &'static str,
    id: Option<&str>,
    note: &super::DeadLetterNote,
    destination: &str,
    error: &str,
) {
    metrics::counter!("turnstile_outbox_dead_letter_failures_total", "broker" => broker)
        .increment(1);
    tracing::error!(
        broker,
        id,
        source = %note.source,
        deliveries = note.deliveries,
        destination,
        error,
        "cannot dead-letter a message whose handler keeps failing: it stays at its source \
         and is retried after the delay; make the dead-letter destination take it"
    );
}

/// A key that row locks kept out of claims was leased by waiting for its row.
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(crate) fn starved_key_served(key: &str) {
    metrics::counter!("turnstile_outbox_starved_keys_served_total").increment(1);
    tracing::info!(
        key,
        "outbox key passed over by SKIP LOCKED was waited for and leased"
    );
}
