//! The transactional outbox: events written in the same database transaction as the
//! business change, then published to a broker by a [`Relay`](relay::Relay), in order per
//! key, effectively once together with a consumer-side
//! [`Inbox`](crate::idempotency::inbox::Inbox).
//!
//! ```no_run
//! # #[cfg(feature = "sqlite")]
//! # async fn demo() -> turnstile::Result<()> {
//! use turnstile::outbox::{Message, sqlite::SqliteOutbox};
//!
//! let outbox = SqliteOutbox::open("app.db").await?;
//! let mut transaction = outbox.pool().begin_with("BEGIN IMMEDIATE").await.map_err(|e| {
//!     turnstile::Error::new(turnstile::ErrorKind::Store, "cannot begin").with_source(e)
//! })?;
//! // … the business change on `transaction` …
//! let message = Message::json("payments.created", "account-42", &serde_json::json!({"cents": 1000}))?;
//! outbox.enqueue(&mut transaction, &message).await?;
//! outbox.commit(transaction).await?; // commits and wakes relays in this process
//! # Ok(())
//! # }
//! ```
//!
//! # The model
//! - Every message has an ordering key (an aggregate id, an account). Each key has a
//!   gapless sequence number, assigned in the enqueue transaction under the key's row
//!   lock, so order per key is commit order. There is no relay cursor over a global
//!   serial id: ids assigned before commit commit out of order, and such a cursor skips
//!   the late ones.
//! - A relay leases keys (a lease with a token, judged by the database's clock), reads
//!   each leased key's next messages, publishes them one key at a time in order and many
//!   keys at once, then settles: delivered messages are deleted, a failure backs the key
//!   off (computed in SQL, with jitter), a permanent failure parks the key after
//!   [`RelayOptions::max_attempts`](relay::RelayOptions::max_attempts) while every other
//!   key flows. A settlement whose lease token is no longer the key's is refused, so a
//!   relay that stalled past its lease cannot mark another relay's work.
//! - Several relays run at once with no leader: a key is leased by one relay at a time.
//! - Delivered messages are deleted as they are recorded, a key's batch at a time; a
//!   store told to keep them (`turnstile_keep_delivered=SECONDS` in its URL, or its
//!   `keep_delivered`) moves them to a `…_outbox_delivered` table instead, and relays
//!   delete those past the retention in bounded batches.

use std::fmt;
use std::time::Duration;

use serde::Serialize;

use crate::error::{Error, ErrorKind, Result};
use crate::future::BoxFuture;

#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis")]
pub mod redis_streams;
pub mod relay;
#[cfg(feature = "sqlite")]
pub mod sqlite;
mod telemetry;

/// The longest ordering key and topic accepted, in bytes.
pub const MAX_KEY_LEN: usize = 255;

/// The largest payload accepted, in bytes (brokers refuse far less: NATS 1 MiB by
/// default).
pub const MAX_PAYLOAD_LEN: usize = 16 * 1024 * 1024;

/// The most header bytes one message carries, names and values together (as stored:
/// JSON). Every store's header column takes this much, so an enqueue never fails on
/// its headers half way through.
pub const MAX_HEADERS_LEN: usize = 16 * 1024;

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
mod sql_store;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) use sql_store::{
    check_key_columns, check_no_audit_copy, check_size, check_skip, keep_delivered_option,
};

/// A message to publish: a topic (subject, routing key, stream, Kafka topic), an
/// ordering key, headers and a payload, with a UUID v7 id that brokers use to drop
/// redeliveries and consumers' inboxes use to skip duplicates.
#[derive(Clone, PartialEq, Eq)]
pub struct Message {
    id: String,
    topic: String,
    key: String,
    headers: Vec<(String, String)>,
    payload: Vec<u8>,
}

impl fmt::Debug for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Message")
            .field("id", &self.id)
            .field("topic", &self.topic)
            .field("key", &self.key)
            .field("headers", &self.headers)
            .field("payload_len", &self.payload.len())
            .finish()
    }
}

fn check_name(what: &str, text: &str) -> Result<()> {
    if text.is_empty() || text.len() > MAX_KEY_LEN {
        return Err(Error::new(
            ErrorKind::InvalidName,
            format!(
                "an outbox {what} is 1 to {MAX_KEY_LEN} bytes; this one has {}",
                text.len()
            ),
        ));
    }
    if let Some(bad) = text.chars().find(|c| c.is_control()) {
        return Err(Error::new(
            ErrorKind::InvalidName,
            format!("an outbox {what} must not contain control characters; found {bad:?}"),
        ));
    }
    Ok(())
}

impl Message {
    /// A message with a new UUID v7 id. With the `opentelemetry` feature it carries the
    /// current `tracing` span's W3C `traceparent` (when the application runs a
    /// `tracing-opentelemetry` layer), so a consumer's trace continues the producer's;
    /// without it, add one with [`Message::header`].
    pub fn new(topic: impl Into<String>, key: impl Into<String>, payload: Vec<u8>) -> Result<Self> {
        let (topic, key) = (topic.into(), key.into());
        check_name("topic", &topic)?;
        check_name("ordering key", &key)?;
        if payload.len() > MAX_PAYLOAD_LEN {
            return Err(Error::new(
                ErrorKind::InvalidOptions,
                format!(
                    "an outbox payload of {} bytes is larger than the {MAX_PAYLOAD_LEN} bytes accepted",
                    payload.len()
                ),
            ));
        }
        #[cfg_attr(not(feature = "opentelemetry"), allow(unused_mut))]
        let mut headers = Vec::new();
        #[cfg(feature = "opentelemetry")]
        if let Some(traceparent) = current_traceparent() {
            headers.push(("traceparent".to_owned(), traceparent));
        }
        Ok(Message {
            id: uuid::Uuid::now_v7().to_string(),
            topic,
            key,
            headers,
            payload,
        })
    }

    /// A message whose payload is `value` as JSON.
    pub fn json<T: Serialize>(
        topic: impl Into<String>,
        key: impl Into<String>,
        value: &T,
    ) -> Result<Self> {
        let payload = serde_json::to_vec(value).map_err(|error| {
            Error::new(
                ErrorKind::InvalidOptions,
                "the payload does not serialise as JSON",
            )
            .with_source(error)
        })?;
        Message::new(topic, key, payload)
    }

    /// Adds a header (for example `traceparent`); names are ASCII tokens, values visible
    /// ASCII.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Result<Self> {
        let (name, value) = (name.into(), value.into());
        let token = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
        if name.eq_ignore_ascii_case(PRODUCER_HEADER) {
            return Err(Error::new(
                ErrorKind::InvalidName,
                format!("the outbox header {PRODUCER_HEADER} is the outbox's own (its identity)"),
            ));
        }
        if is_reserved_header(&name) {
            return Err(Error::new(
                ErrorKind::InvalidName,
                format!(
                    "the outbox header {name} is reserved: names that start with turnstile- \
                     (the relay's id, key, sequence and dead-letter notes) or nats- (NATS's \
                     own, such as Nats-Msg-Id), in any case, are set by the relay and the broker"
                ),
            ));
        }
        if name.is_empty() || !name.chars().all(token) || name.len() > MAX_KEY_LEN {
            return Err(Error::new(
                ErrorKind::InvalidName,
                format!(
                    "an outbox header name is 1 to {MAX_KEY_LEN} of A-Z a-z 0-9 - _ .; got {name:?}"
                ),
            ));
        }
        if value.chars().any(|c| !(' '..='~').contains(&c)) {
            return Err(Error::new(
                ErrorKind::InvalidName,
                format!("the value of outbox header {name} must be visible ASCII"),
            ));
        }
        self.headers.push((name, value));
        let stored = self.headers_json().len();
        if stored > MAX_HEADERS_LEN {
            return Err(Error::new(
                ErrorKind::InvalidOptions,
                format!(
                    "an outbox message's headers take at most {MAX_HEADERS_LEN} bytes; with {:?} they take {stored}",
                    self.headers.last().map_or("", |(name, _)| name.as_str())
                ),
            ));
        }
        Ok(self)
    }

    /// The id (a UUID v7, text).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The ordering key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The headers, in the order added.
    pub fn headers(&self) -> &[(String, String)] {
        &self.headers
    }

    /// The payload.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// The headers as a JSON object of strings.
    fn headers_map(&self) -> serde_json::Map<String, serde_json::Value> {
        self.headers
            .iter()
            .map(|(name, value)| (name.clone(), serde_json::Value::String(value.clone())))
            .collect()
    }

    fn headers_json(&self) -> String {
        serde_json::Value::Object(self.headers_map()).to_string()
    }
}

/// The current span's trace context as a W3C `traceparent`, if it has a valid one.
#[cfg(feature = "opentelemetry")]
fn current_traceparent() -> Option<String> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let context = tracing::Span::current().context();
    let span = context.span();
    let span_context = span.span_context();
    span_context.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            span_context.trace_id(),
            span_context.span_id(),
            span_context.trace_flags().to_u8()
        )
    })
}

/// A message as the relay reads it: its place in its key's sequence, and how long it
/// has waited.
#[derive(Debug, Clone)]
pub struct Stored {
    /// Its number in its key's gapless sequence (1, 2, 3…).
    pub seq: u64,
    /// How long ago it was enqueued, by the database's clock.
    pub age: Duration,
    /// The message.
    pub message: Message,
}

/// One key a relay leased, with its next messages in order.
#[derive(Debug, Clone)]
pub struct LeasedKey {
    /// The ordering key.
    pub key: String,
    /// The lease's token: a settlement must carry it.
    pub token: u64,
    /// Failed attempts so far at its head message.
    pub attempts: u32,
    /// The last sequence number delivered (0: none): the first message must be the
    /// next one, and a relay that finds another reports a gap instead of publishing.
    pub acked: u64,
    /// Its next undelivered messages, in sequence order, as the store holds them.
    pub messages: Vec<Stored>,
    /// The round's byte budget was spent before all of this key's due messages were
    /// read: `messages` holds fewer (perhaps none), which is not a gap.
    pub over_budget: bool,
}

/// What became of a leased key's messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settlement {
    /// The ordering key.
    pub key: String,
    /// The lease token it was leased with.
    pub token: u64,
    /// Every message up to this sequence number was published (0: none).
    pub delivered_through: u64,
    /// Why the next one failed, if one did.
    pub failure: Option<Failure>,
}

/// A failed publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// A permanent failure (the broker refused this message) counts toward parking the
    /// key; a transient one (broker unreachable, timeout) only backs the key off.
    pub permanent: bool,
    /// What went wrong, for `turnstile outbox status`.
    pub reason: String,
}

/// How a settlement landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// Recorded.
    Done,
    /// Recorded, and the key is now parked (too many permanent failures).
    Parked,
    /// Refused: the lease token is no longer the key's (the lease ran out and another
    /// relay has the key).
    Fenced,
}

/// A parked key: its head message failed permanently too often.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParkedKey {
    /// The ordering key.
    pub key: String,
    /// Failed attempts.
    pub attempts: u32,
    /// The last failure's reason.
    pub reason: Option<String>,
    /// Messages waiting behind it.
    pub pending: u64,
}

/// A key with undelivered messages, as `turnstile outbox status` lists the most
/// behind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaggingKey {
    /// The ordering key.
    pub key: String,
    /// Its undelivered messages.
    pub pending: u64,
    /// How long its oldest undelivered message has waited.
    pub oldest: Duration,
}

/// What an outbox holds, for `turnstile outbox status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// Undelivered messages of keys that are not parked.
    pub pending: u64,
    /// Keys with undelivered messages (not parked).
    pub pending_keys: u64,
    /// The age of the oldest undelivered message of a key that is not parked.
    pub oldest_pending: Option<Duration>,
    /// Delivered messages kept for audit (stores told to keep them).
    pub kept: u64,
    /// Parked keys (up to the limit asked for), oldest failure first.
    pub parked: Vec<ParkedKey>,
    /// The keys (not parked) whose oldest undelivered message has waited longest, up
    /// to the limit asked for, most behind first: a key that keeps being passed over
    /// shows here while the totals look healthy.
    pub lagging: Vec<LaggingKey>,
}

/// Whether a header name is the relay's or a broker's own (`turnstile-…`, `nats-…`, in
/// any case): refused at enqueue, and left out when a message from an older version's
/// rows is published, so that a user header never wins over the relay's id, key or
/// sequence (an inbox would drop an unhandled message as a duplicate).
pub(crate) fn is_reserved_header(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    (lower.starts_with("turnstile-") && lower != PRODUCER_HEADER) || lower.starts_with("nats-")
}

/// The headers a publisher sends from `message`: all but the reserved ones, which the
/// publisher sets itself (the producer's identity is kept).
#[cfg_attr(
    not(any(feature = "nats", feature = "kafka", feature = "rabbitmq")),
    allow(dead_code)
)]
pub(crate) fn user_headers(message: &Message) -> impl Iterator<Item = &(String, String)> {
    message
        .headers()
        .iter()
        .filter(|(name, _)| !is_reserved_header(name))
}

/// The header that names the outbox a message came from (its identity, a UUID kept
/// with the outbox's tables): consumers key their per-key cursors and inbox records by
/// it, so two outboxes that use the same keys, or tables recreated from scratch, never
/// pass for one another.
pub const PRODUCER_HEADER: &str = "turnstile-outbox";

/// A message as a consumer receives it.
#[derive(Debug, Clone)]
pub struct Incoming {
    /// The id its producer gave it (an outbox message id; for a message from
    /// elsewhere, its broker's message id property when the producer set one). `None`
    /// when the producer gave none: the broker's own position or delivery tag is no
    /// message id (a republished copy gets another), so nothing is made up.
    pub id: Option<String>,
    /// The outbox it came from ([`PRODUCER_HEADER`]), for messages from a Turnstile
    /// outbox that has an identity.
    pub producer: Option<String>,
    /// The ordering key, for messages from a Turnstile outbox.
    pub key: Option<String>,
    /// The place in its key's sequence.
    pub seq: Option<u64>,
    /// The topic (subject, stream) it was published to.
    pub topic: String,
    /// Every header, in the order received.
    pub headers: Vec<(String, String)>,
    /// The payload.
    pub payload: Vec<u8>,
    /// How many times the broker has delivered it to this consumer (1 the first time;
    /// at least 2 for a redelivery where the broker does not count), less the
    /// deliveries its handler answered [`ErrorKind::OutOfOrder`] in this process: the
    /// count compared with the consumer's `max_deliveries`.
    pub deliveries: u64,
}

impl Incoming {
    /// What an [`Inbox`](crate::idempotency::inbox::Inbox) records for this message:
    /// its producer's identity and its id. A message without a producer-assigned id is
    /// refused ([`ErrorKind::InvalidOptions`]): deduplicating on something made up (a
    /// delivery tag restarts per channel, a stream position differs for a republished
    /// copy) would drop different messages or run a copy twice. Give such messages an
    /// id of your own and pass it to the inbox instead.
    pub fn inbox_id(&self) -> Result<String> {
        let Some(id) = &self.id else {
            return Err(Error::new(
                ErrorKind::InvalidOptions,
                format!(
                    "a message on {:?} carries no id from its producer, so an inbox cannot tell \
                     a redelivery from a new message; have the producer set one, or pass an id \
                     of the application's own",
                    self.topic
                ),
            ));
        };
        Ok(match &self.producer {
            Some(producer) => format!("{producer}/{id}"),
            None => id.clone(),
        })
    }

    /// The key of this message's per-key cursor for
    /// [`Inbox::process_in_order`](crate::idempotency::inbox::Inbox::process_in_order):
    /// the producer's identity and the ordering key (`None` without an ordering key).
    pub fn cursor_key(&self) -> Option<String> {
        let key = self.key.as_ref()?;
        Some(match &self.producer {
            Some(producer) => format!("{producer}/{key}"),
            None => key.clone(),
        })
    }

    /// The value of header `name` (compared without case), if the message has it.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }
}

/// What one call of a consumer's `process` did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Processed {
    /// Messages handled and acknowledged.
    pub acked: usize,
    /// Messages sent back for redelivery after a delay (the handler failed, on a
    /// delivery before the consumer's `max_deliveries`; or on the last one, when the
    /// dead-letter copy could not be stored).
    pub retried: usize,
    /// Messages whose handler failed on their last allowed delivery (the consumer's
    /// `max_deliveries`): copied to the consumer's dead-letter destination, where an
    /// operator can see and replay them, and only then acknowledged at the source.
    pub dead_lettered: usize,
    /// Messages whose handler answered [`ErrorKind::OutOfOrder`] (an earlier message of
    /// their key comes first): sent back for redelivery after the delay, not counted as
    /// failures.
    pub early: usize,
}

/// How many deliveries a consumer gives a message whose handler keeps failing before it
/// dead-letters the message, unless told otherwise (each consumer's `max_deliveries`):
/// the first delivery and four retries, each after the consumer's retry delay.
pub const DEFAULT_MAX_DELIVERIES: u32 = 5;

/// The header (a Redis Streams field) a dead-letter copy carries with the handler's
/// last error, as visible ASCII of at most [`MAX_DEAD_LETTER_REASON_LEN`] bytes.
pub const DEAD_LETTER_REASON_HEADER: &str = "turnstile-dead-letter-reason";

/// The header (a Redis Streams field) a dead-letter copy carries with the number of
/// deliveries the message had when it was dead-lettered, in decimal.
pub const DEAD_LETTER_DELIVERIES_HEADER: &str = "turnstile-dead-letter-deliveries";

/// The header (a Redis Streams field) a dead-letter copy carries with where the
/// original was consumed from, to replay it there: the JetStream subject, the RabbitMQ
/// queue, the Kafka topic or the Redis stream.
pub const DEAD_LETTER_SOURCE_HEADER: &str = "turnstile-dead-letter-source";

/// The header (a Redis Streams field) a dead-letter copy carries with the original's
/// place at its source, where the broker has one: the JetStream stream and sequence
/// (`STREAM/SEQ`), the Kafka partition and offset (`PARTITION/OFFSET`), the Redis
/// entry id. RabbitMQ copies have none.
pub const DEAD_LETTER_POSITION_HEADER: &str = "turnstile-dead-letter-position";

/// The longest handler error a dead-letter copy carries ([`DEAD_LETTER_REASON_HEADER`]),
/// in bytes.
pub const MAX_DEAD_LETTER_REASON_LEN: usize = 1024;

/// Why and from where a consumer dead-letters a message: the headers its copy carries.
#[cfg_attr(
    not(any(
        feature = "nats",
        feature = "rabbitmq",
        feature = "kafka",
        feature = "redis"
    )),
    allow(dead_code)
)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeadLetterNote {
    /// The handler's last error, as visible ASCII, cut to
    /// [`MAX_DEAD_LETTER_REASON_LEN`] bytes.
    pub(crate) reason: String,
    /// Deliveries so far (the last one included).
    pub(crate) deliveries: u64,
    /// Where the original was consumed from ([`DEAD_LETTER_SOURCE_HEADER`]).
    pub(crate) source: String,
    /// Its place there, if the broker has one ([`DEAD_LETTER_POSITION_HEADER`]).
    pub(crate) position: Option<String>,
}

#[cfg_attr(
    not(any(
        feature = "nats",
        feature = "rabbitmq",
        feature = "kafka",
        feature = "redis"
    )),
    allow(dead_code)
)]
impl DeadLetterNote {
    pub(crate) fn new(
        error: &Error,
        deliveries: u64,
        source: impl Into<String>,
        position: Option<String>,
    ) -> Self {
        let mut reason = String::new();
        for c in error.to_string().chars() {
            let c = if (' '..='~').contains(&c) { c } else { ' ' };
            if reason.len() + 1 > MAX_DEAD_LETTER_REASON_LEN {
                break;
            }
            reason.push(c);
        }
        DeadLetterNote {
            reason,
            deliveries,
            source: source.into(),
            position,
        }
    }

    /// The headers (name, value) the copy carries.
    pub(crate) fn headers(&self) -> Vec<(&'static str, String)> {
        let mut headers = vec![
            (DEAD_LETTER_REASON_HEADER, self.reason.clone()),
            (DEAD_LETTER_DELIVERIES_HEADER, self.deliveries.to_string()),
            (DEAD_LETTER_SOURCE_HEADER, self.source.clone()),
        ];
        if let Some(position) = &self.position {
            headers.push((DEAD_LETTER_POSITION_HEADER, position.clone()));
        }
        headers
    }
}

/// How many messages a consumer remembers the early deliveries of
/// ([`ErrorKind::OutOfOrder`]); past it, the one longest unseen is forgotten (its early
/// deliveries then count as failures again, in this process).
pub const MAX_COUNTED_EARLY: usize = 10_000;

/// Deliveries a consumer's handler answered [`ErrorKind::OutOfOrder`], by message:
/// they are taken off the broker's delivery count before it is compared with
/// `max_deliveries`, so that a message that only waited for its turn is never
/// dead-lettered. Kept in memory: after a restart, the early deliveries before it count.
#[cfg_attr(
    not(any(
        feature = "nats",
        feature = "rabbitmq",
        feature = "kafka",
        feature = "redis"
    )),
    allow(dead_code)
)]
#[derive(Debug, Default)]
pub(crate) struct EarlyDeliveries {
    counts: std::collections::HashMap<String, (u64, std::time::Instant)>,
}

#[cfg_attr(
    not(any(
        feature = "nats",
        feature = "rabbitmq",
        feature = "kafka",
        feature = "redis"
    )),
    allow(dead_code)
)]
impl EarlyDeliveries {
    /// The deliveries to count as failures of `message`, which the broker has delivered
    /// `deliveries` times (this one included): never less than 1.
    pub(crate) fn failures(&self, message: &str, deliveries: u64) -> u64 {
        let early = self.counts.get(message).map_or(0, |(early, _)| *early);
        deliveries.saturating_sub(early).max(1)
    }

    /// Records an early delivery of `message` and returns how many it has had.
    pub(crate) fn record(&mut self, message: &str) -> u64 {
        if self.counts.len() >= MAX_COUNTED_EARLY && !self.counts.contains_key(message) {
            let oldest = self
                .counts
                .iter()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(key, _)| key.clone());
            if let Some(oldest) = oldest {
                self.counts.remove(&oldest);
            }
        }
        let entry = self
            .counts
            .entry(message.to_owned())
            .or_insert((0, std::time::Instant::now()));
        entry.0 += 1;
        entry.1 = std::time::Instant::now();
        entry.0
    }

    /// Forgets `message` (acknowledged or dead-lettered).
    pub(crate) fn forget(&mut self, message: &str) {
        self.counts.remove(message);
    }
}

/// Backoff of a failing key: `min(max, base × 2^attempts)`, times a random factor from
/// 0.5 to 1, computed by the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The first delay.
    pub base: Duration,
    /// The longest delay.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base: Duration::from_millis(100),
            max: Duration::from_secs(60),
        }
    }
}

/// Where an outbox's messages live: what a relay needs of a store. Every operation is
/// atomic; the SQL stores implement it.
pub trait OutboxStore: Send + Sync + fmt::Debug + 'static {
    /// Leases up to `max_keys` keys that have undelivered messages and are due (not
    /// leased, not backing off, not parked), for `lease`, and returns up to `per_key`
    /// next messages of each, in order, with no byte budget.
    fn claim(
        &self,
        max_keys: u32,
        per_key: u32,
        lease: Duration,
    ) -> BoxFuture<'_, Result<Vec<LeasedKey>>> {
        self.claim_within(max_keys, per_key, u64::MAX, lease)
    }

    /// [`claim`](Self::claim), returning messages only while their bytes (payload and
    /// headers, counted in key order) stay within `max_bytes`; the first message always
    /// comes, however large. Every leased key is returned, those past the budget with
    /// fewer or no messages (they are due again once settled), so a round's memory is
    /// bounded by the budget and one message, not by keys × messages × size.
    fn claim_within(
        &self,
        max_keys: u32,
        per_key: u32,
        max_bytes: u64,
        lease: Duration,
    ) -> BoxFuture<'_, Result<Vec<LeasedKey>>>;

    /// Records what became of leased keys: deletes delivered messages, backs failing
    /// keys off, parks a key whose permanent failures reach `max_attempts`, and ends
    /// the leases. One answer per settlement, in order.
    fn settle<'a>(
        &'a self,
        settlements: &'a [Settlement],
        max_attempts: u32,
        backoff: Backoff,
    ) -> BoxFuture<'a, Result<Vec<Settled>>>;

    /// Unparks `key` (its head message is tried again); false if it was not parked.
    fn redrive<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool>>;

    /// Moves a parked key's head message `seq` aside — into `…_outbox_skipped`, kept
    /// for audit with the reason it was parked — and unparks the key, which goes on
    /// with `seq + 1`: for a message the broker will never take. `seq` must be the
    /// key's next undelivered number (a gap's missing number included: then nothing
    /// is moved and `false` comes back). A key that is not parked is refused, since
    /// a relay may be publishing its head message.
    fn skip<'a>(&'a self, key: &'a str, seq: u64) -> BoxFuture<'a, Result<bool>> {
        let _ = (key, seq);
        Box::pin(async move {
            Err(Error::new(
                ErrorKind::UnsupportedStore,
                format!("{} cannot skip messages", self.describe()),
            ))
        })
    }

    /// Counts what is pending and lists up to `parked_limit` parked keys.
    fn status(&self, parked_limit: u32) -> BoxFuture<'_, Result<Status>>;

    /// Deletes up to `limit` delivered messages whose audit retention has passed (stores
    /// told to keep delivered messages; the others delete them when they are delivered)
    /// and says how many. Running relays call it now and then.
    fn sweep(&self, limit: u32) -> BoxFuture<'_, Result<u64>> {
        let _ = limit;
        Box::pin(async { Ok(0) })
    }

    /// Resolves when a message may have been committed in this process since the last
    /// call ([`commit`](sqlite::SqliteOutbox::commit) wakes it), or after `timeout`.
    fn committed(&self, timeout: Duration) -> BoxFuture<'_, ()>;

    /// Called when a [`Relay::run`](relay::Relay::run) of this store ends: a store that
    /// marks idle relays so that enqueues wake them (PostgreSQL's `NOTIFY`) drops this
    /// relay's mark, so that no enqueue pays for waking a relay that is gone.
    fn relay_stopped(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }

    /// The store, for messages (URL without password).
    fn describe(&self) -> String;
}
