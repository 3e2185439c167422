//! Publishing to RabbitMQ, and a queue consumer (feature `rabbitmq`).
//!
//! Messages go to a durable topic exchange (`turnstile` unless chosen), with the topic
//! as the routing key, as **persistent** messages (`delivery_mode = 2`) with their id as
//! `message_id` and the headers `turnstile-key` and `turnstile-seq`, published
//! **mandatory** with **publisher confirms**, each message in flight on a channel of
//! its own (see [`RabbitMqPublisher`]): the relay counts a message as
//! delivered only once the broker confirmed it, and a message no queue is bound for
//! comes back as a failure instead of vanishing. RabbitMQ has no duplicate detection of
//! its own: a message published again after a relay crash is delivered again, and the
//! consumer's [`Inbox`](crate::idempotency::inbox::Inbox) removes the copy (the
//! `message_id` is what it records).

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, BasicRejectOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use tokio::sync::Mutex;

use super::relay::Publisher;
use super::telemetry;
use super::{DEFAULT_MAX_DELIVERIES, DeadLetterNote, Failure, Incoming, Message, Processed};
use crate::error::{Error, ErrorKind, Result};
use crate::future::BoxFuture;

/// How long a publish may wait for its confirm.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);

async fn open_channel(url: &str, redacted: &str) -> Result<(Connection, Channel)> {
    let unavailable = |error: lapin::Error| {
        Error::new(
            ErrorKind::StoreUnavailable,
            format!("cannot reach RabbitMQ at {redacted}: {error}"),
        )
    };
    let connection = tokio::time::timeout(
        Duration::from_secs(5),
        Connection::connect(url, ConnectionProperties::default()),
    )
    .await
    .map_err(|_| {
        Error::new(
            ErrorKind::StoreUnavailable,
            format!("RabbitMQ at {redacted} did not answer within 5 s"),
        )
    })?
    .map_err(unavailable)?;
    let channel = connection.create_channel().await.map_err(unavailable)?;
    Ok((connection, channel))
}

/// How many messages may wait for their confirms at once, each on its own channel: as
/// many as the keys a relay round publishes by default (`RelayOptions::max_keys`), one
/// message of each in flight. (32 relayed 8,800 messages/s in the benchmark, 64 10,900.)
const MAX_IN_FLIGHT: usize = 64;

/// A RabbitMQ publisher with publisher confirms.
///
/// Several messages are in flight at once, but **each on its own channel**: AMQP's
/// `basic.return` (the broker's "unroutable") names no delivery tag, and a client pairs
/// it with the next acknowledged publish of its channel. With several messages in
/// flight on one channel under one batched ack, the return could land on another
/// message, and the unroutable one would count as delivered — lost. (Seen in the
/// "unroutable message parks its key" test, when this publisher used one channel.) On
/// a channel with a single message in flight, the pairing is exact.
pub struct RabbitMqPublisher {
    url: String,
    redacted: String,
    exchange: String,
    /// The connection, dropped after a failure and opened again by a later publish
    /// (lapin does not recover connections by itself), and when opening one last
    /// failed.
    connection: Mutex<Link>,
    /// Confirming channels with nothing in flight, ready for the next publish.
    idle: std::sync::Mutex<Vec<Channel>>,
    /// Bounds the channels in use (one message in flight each).
    in_flight: tokio::sync::Semaphore,
}

/// The publisher's connection, or why there is none.
#[derive(Default)]
struct Link {
    connection: Option<Connection>,
    /// The last failed attempt to connect: when, why, and how long to wait before the
    /// next. Publishes meanwhile fail at once with that reason, instead of each
    /// trying (and, behind a partition, waiting out the connect timeout) in turn.
    failed: Option<(Instant, String, Duration)>,
}

/// Waits between attempts to reconnect to a broker that is down: doubling from the
/// first to the second.
const RECONNECT_BACKOFF: (Duration, Duration) =
    (Duration::from_millis(100), Duration::from_secs(5));

impl std::fmt::Debug for RabbitMqPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitMqPublisher")
            .field("url", &self.redacted)
            .field("exchange", &self.exchange)
            .finish()
    }
}

impl RabbitMqPublisher {
    /// Connects to `url` (`amqp://user:password@host:port/vhost`) and declares the
    /// durable topic exchange `exchange` that messages go to.
    pub async fn connect(url: &str, exchange: &str) -> Result<Self> {
        let publisher = RabbitMqPublisher {
            url: url.to_owned(),
            redacted: crate::url::redact(url),
            exchange: exchange.to_owned(),
            connection: Mutex::new(Link::default()),
            idle: std::sync::Mutex::new(Vec::new()),
            in_flight: tokio::sync::Semaphore::new(MAX_IN_FLIGHT),
        };
        let channel = publisher
            .channel()
            .await
            .map_err(|failure| Error::new(ErrorKind::StoreUnavailable, failure.reason))?;
        publisher.put_back(channel);
        Ok(publisher)
    }

    fn setup_failed(&self, error: lapin::Error) -> Error {
        Error::new(
            ErrorKind::StoreUnavailable,
            format!(
                "cannot set up publishing to RabbitMQ at {}: {error}",
                self.redacted
            ),
        )
    }

    /// A new confirming channel on the live connection; a new connection (which
    /// declares the exchange) if there is none.
    async fn open_channel(&self) -> Result<Channel> {
        let mut link = self.connection.lock().await;
        let channel = match link.connection.as_ref() {
            Some(live) if live.status().connected() => live
                .create_channel()
                .await
                .map_err(|e| self.setup_failed(e))?,
            _ => {
                link.connection = None;
                if let Some((at, reason, wait)) = &link.failed
                    && at.elapsed() < *wait
                {
                    return Err(Error::new(
                        ErrorKind::StoreUnavailable,
                        format!(
                            "{reason} (next attempt in {} ms)",
                            wait.saturating_sub(at.elapsed()).as_millis()
                        ),
                    ));
                }
                let (opened, channel) = match open_channel(&self.url, &self.redacted).await {
                    Ok(opened) => {
                        link.failed = None;
                        opened
                    }
                    Err(error) => {
                        let wait = link
                            .failed
                            .as_ref()
                            .map_or(RECONNECT_BACKOFF.0, |(_, _, last)| {
                                (*last * 2).min(RECONNECT_BACKOFF.1)
                            });
                        link.failed = Some((Instant::now(), error.to_string(), wait));
                        return Err(error);
                    }
                };
                channel
                    .exchange_declare(
                        ShortString::from(self.exchange.as_str()),
                        lapin::ExchangeKind::Topic,
                        ExchangeDeclareOptions {
                            durable: true,
                            ..ExchangeDeclareOptions::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .map_err(|e| self.setup_failed(e))?;
                link.connection = Some(opened);
                channel
            }
        };
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| self.setup_failed(e))?;
        Ok(channel)
    }

    /// An idle channel that is still open, or a new one.
    async fn channel(&self) -> std::result::Result<Channel, Failure> {
        loop {
            let Some(channel) = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop() else {
                break;
            };
            if channel.status().connected() {
                return Ok(channel);
            }
        }
        self.open_channel().await.map_err(|error| Failure {
            permanent: false,
            reason: error.to_string(),
        })
    }

    /// Returns a channel whose message was confirmed (or returned) to the idle ones.
    fn put_back(&self, channel: Channel) {
        if channel.status().connected() {
            self.idle
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(channel);
        }
    }
}

fn long(text: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(text.as_bytes().to_vec()))
}

impl Publisher for RabbitMqPublisher {
    fn publish<'a>(
        &'a self,
        message: &'a Message,
        seq: u64,
    ) -> BoxFuture<'a, std::result::Result<(), Failure>> {
        Box::pin(async move {
            // The semaphore is never closed, so this cannot fail; it is still answered
            // as a transient failure rather than a panic.
            let _slot = self.in_flight.acquire().await.map_err(|_| Failure {
                permanent: false,
                reason: "the publisher is shutting down".to_owned(),
            })?;
            let channel = self.channel().await?;
            let mut headers = FieldTable::default();
            for (name, value) in super::user_headers(message) {
                headers.insert(ShortString::from(name.as_str()), long(value));
            }
            headers.insert(ShortString::from("turnstile-key"), long(message.key()));
            headers.insert(ShortString::from("turnstile-seq"), long(&seq.to_string()));
            let properties = BasicProperties::default()
                .with_message_id(ShortString::from(message.id()))
                .with_delivery_mode(2)
                .with_headers(headers);
            let transient = |reason: String| Failure {
                permanent: false,
                reason,
            };
            let confirm = channel
                .basic_publish(
                    ShortString::from(self.exchange.as_str()),
                    ShortString::from(message.topic()),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    message.payload(),
                    properties,
                )
                .await
                .map_err(|error| transient(error.to_string()))?;
            // A channel whose confirm did not come is closed, not put back: a late
            // confirm or return on it would be paired with the next message.
            let Ok(confirmed) = tokio::time::timeout(CONFIRM_TIMEOUT, confirm).await else {
                tokio::spawn(async move {
                    let _ = channel
                        .close(200, ShortString::from("no confirm in time"))
                        .await;
                });
                return Err(transient(format!("no confirm within {CONFIRM_TIMEOUT:?}")));
            };
            let confirmation = confirmed.map_err(|error| transient(error.to_string()))?;
            self.put_back(channel);
            match confirmation {
                Confirmation::Ack(None) => Ok(()),
                // Mandatory and unroutable: no queue is bound for this routing key. An
                // operator binds one and redrives the key.
                Confirmation::Ack(Some(_)) => Err(Failure {
                    permanent: true,
                    reason: format!(
                        "no queue is bound to exchange {:?} for routing key {:?}",
                        self.exchange,
                        message.topic()
                    ),
                }),
                Confirmation::Nack(_) => Err(transient(
                    "the broker refused the message (nack)".to_owned(),
                )),
                Confirmation::NotRequested => {
                    Err(transient("the channel is not in confirm mode".to_owned()))
                }
            }
        })
    }

    fn check<'a>(&'a self, _topic: &'a str, _redelivery: Duration) -> BoxFuture<'a, Result<()>> {
        // No broker-side duplicate window to check: the inbox removes copies.
        Box::pin(async { Ok(()) })
    }

    fn describe(&self) -> String {
        self.redacted.clone()
    }

    fn reachable(&self) -> BoxFuture<'_, bool> {
        // An idle channel that is still open (lapin's heartbeats notice a broker gone
        // silent), or a new one: put back for the next publish, so the idle channels
        // never outnumber what publishes use.
        Box::pin(async move {
            match tokio::time::timeout(super::relay::REACHABLE_WITHIN, self.channel()).await {
                Ok(Ok(channel)) => {
                    self.put_back(channel);
                    true
                }
                _ => false,
            }
        })
    }
}

/// How many messages a [`RabbitMqConsumer`] keeps failure counts for (classic queues
/// count no deliveries of their own): past that, the count of the message that failed
/// longest ago is forgotten, and that message starts counting again.
pub const MAX_COUNTED_FAILURES: usize = 10_000;

/// A consumer of one RabbitMQ queue: a message is acknowledged only after its handler
/// succeeded.
///
/// **Failures and poison messages.** A message whose handler failed is not returned to
/// the queue at once (a tight loop that would hold up the queue): this consumer keeps
/// it, unacknowledged, for the `retry_after` of [`process`](Self::process) — carrying
/// on with the queue's other messages meanwhile — then returns it (`basic.reject` with
/// requeue) to be delivered again. Its deliveries are counted with the queue's own
/// count where the queue keeps one (a quorum queue's `x-delivery-count`), else by this
/// consumer, in memory, by `message_id` (or, for a message without one, by a digest of
/// its routing key and payload), for up to [`MAX_COUNTED_FAILURES`] messages. Once a
/// message's handler has failed on its [`max_deliveries`](Self::max_deliveries)-th
/// delivery ([`DEFAULT_MAX_DELIVERIES`] unless told otherwise), the message is
/// **dead-lettered**: a copy — the same payload and properties (without an
/// `expiration`), persistent, with [`DEAD_LETTER_REASON_HEADER`](super::DEAD_LETTER_REASON_HEADER)
/// and the other `turnstile-dead-letter-*` headers — is published to the durable
/// queue `{queue}.dead-letter` (declared by [`connect`](Self::connect) when missing),
/// with publisher confirms, and only once the broker confirmed it is the original
/// acknowledged. A copy the broker does not take leaves the original to be retried
/// after the delay, with an error logged.
///
/// A quorum queue's own `x-delivery-limit` (20 by default since RabbitMQ 4.0) drops or
/// dead-letters a message by the queue's policy once reached: keep `max_deliveries`
/// below it.
///
/// Messages held for their delay count toward `prefetch`: with every prefetched
/// message held, the consumer waits for the first delay to pass. A consumer that is
/// dropped (or stops calling `process`) returns what it holds when its channel closes.
pub struct RabbitMqConsumer {
    connection: Connection,
    // Kept open for as long as the consumer lives.
    _channel: Channel,
    queue: String,
    dead_letter_queue: String,
    max_deliveries: u32,
    state: Mutex<ConsumerState>,
}

/// A failed delivery held back until its delay has passed.
struct Held {
    due: tokio::time::Instant,
    delivery: lapin::message::Delivery,
}

struct ConsumerState {
    deliveries: lapin::Consumer,
    held: Vec<Held>,
    /// Deliveries so far of messages whose handler failed, by message.
    failures: std::collections::HashMap<String, (u64, std::time::Instant)>,
    /// Deliveries the handler answered "out of order", by message: the broker's own
    /// count includes them.
    early: super::EarlyDeliveries,
    /// A confirming channel for dead-letter copies, opened again after it closed.
    dead_letters: Option<Channel>,
}

impl ConsumerState {
    /// Records that a message failed on its `deliveries`-th delivery.
    fn failed(&mut self, message: &str, deliveries: u64) {
        if self.failures.len() >= MAX_COUNTED_FAILURES && !self.failures.contains_key(message) {
            let oldest = self
                .failures
                .iter()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(key, _)| key.clone());
            if let Some(oldest) = oldest {
                self.failures.remove(&oldest);
            }
        }
        self.failures
            .insert(message.to_owned(), (deliveries, std::time::Instant::now()));
    }

    /// Returns the held deliveries whose delay has passed to the queue.
    async fn release_due(&mut self) -> std::result::Result<(), lapin::Error> {
        let now = tokio::time::Instant::now();
        let mut index = 0;
        while index < self.held.len() {
            if self.held[index].due <= now {
                let held = self.held.swap_remove(index);
                // basic.reject, not basic.nack: RabbitMQ 4.3+ counts a rejected
                // delivery in a quorum queue's delivery count, not a nacked one.
                held.delivery
                    .reject(BasicRejectOptions { requeue: true })
                    .await?;
            } else {
                index += 1;
            }
        }
        Ok(())
    }
}

impl std::fmt::Debug for RabbitMqConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitMqConsumer")
            .field("queue", &self.queue)
            .field("dead_letter_queue", &self.dead_letter_queue)
            .field("max_deliveries", &self.max_deliveries)
            .finish()
    }
}

fn header_text(table: &FieldTable, name: &str) -> Option<String> {
    table.inner().iter().find_map(|(key, value)| {
        (key.as_str() == name).then(|| match value {
            AMQPValue::LongString(text) => String::from_utf8_lossy(text.as_bytes()).into_owned(),
            AMQPValue::ShortString(text) => text.as_str().to_owned(),
            other => format!("{other:?}"),
        })
    })
}

/// A quorum queue's count of earlier deliveries of a message (`x-delivery-count`).
fn broker_count(table: &FieldTable) -> Option<u64> {
    table.inner().iter().find_map(|(key, value)| {
        if key.as_str() != "x-delivery-count" {
            return None;
        }
        match value {
            AMQPValue::ShortShortInt(n) => u64::try_from(*n).ok(),
            AMQPValue::ShortShortUInt(n) => Some(u64::from(*n)),
            AMQPValue::ShortInt(n) => u64::try_from(*n).ok(),
            AMQPValue::ShortUInt(n) => Some(u64::from(*n)),
            AMQPValue::LongInt(n) => u64::try_from(*n).ok(),
            AMQPValue::LongUInt(n) => Some(u64::from(*n)),
            AMQPValue::LongLongInt(n) => u64::try_from(*n).ok(),
            AMQPValue::Timestamp(n) => Some(*n),
            AMQPValue::LongString(text) => String::from_utf8_lossy(text.as_bytes()).parse().ok(),
            AMQPValue::ShortString(text) => text.as_str().parse().ok(),
            _ => None,
        }
    })
}

/// What this consumer counts a message's failures by: its `message_id`, or a digest of
/// its routing key and payload.
fn failure_key(delivery: &lapin::message::Delivery) -> String {
    if let Some(id) = delivery.properties.message_id() {
        return format!("id:{}", id.as_str());
    }
    use sha2::Digest;
    let mut digest = sha2::Sha256::new();
    digest.update(delivery.routing_key.as_str().as_bytes());
    digest.update([0]);
    digest.update(&delivery.data);
    let hash = digest.finalize();
    let mut key = String::with_capacity(7 + 2 * hash.len());
    key.push_str("sha256:");
    for byte in hash {
        key.push_str(&format!("{byte:02x}"));
    }
    key
}

impl RabbitMqConsumer {
    /// Consumes `queue` (which must exist) at `url`, with at most `prefetch`
    /// unacknowledged messages in hand, and declares its dead-letter queue
    /// `{queue}.dead-letter` (durable) unless it exists.
    pub async fn connect(
        url: &str,
        queue: &str,
        consumer_tag: &str,
        prefetch: u16,
    ) -> Result<Self> {
        let redacted = crate::url::redact(url);
        let (connection, channel) = open_channel(url, &redacted).await?;
        let failed = |error: lapin::Error| {
            Error::new(
                ErrorKind::StoreUnavailable,
                format!("cannot consume queue {queue:?} at {redacted}: {error}"),
            )
        };
        let dead_letter_queue = format!("{queue}.dead-letter");
        let dead_letters = dead_letter_channel(&connection, &dead_letter_queue)
            .await
            .map_err(failed)?;
        channel
            .basic_qos(prefetch.max(1), BasicQosOptions::default())
            .await
            .map_err(failed)?;
        let deliveries = channel
            .basic_consume(
                ShortString::from(queue),
                ShortString::from(consumer_tag),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(failed)?;
        Ok(RabbitMqConsumer {
            connection,
            _channel: channel,
            queue: queue.to_owned(),
            dead_letter_queue,
            max_deliveries: DEFAULT_MAX_DELIVERIES,
            state: Mutex::new(ConsumerState {
                deliveries,
                held: Vec::new(),
                failures: std::collections::HashMap::new(),
                early: super::EarlyDeliveries::default(),
                dead_letters: Some(dead_letters),
            }),
        })
    }

    /// Dead-letters a message whose handler failed on its `deliveries`-th delivery (at
    /// least 1; [`DEFAULT_MAX_DELIVERIES`] by default) instead of returning it.
    pub fn max_deliveries(mut self, deliveries: u32) -> Self {
        self.max_deliveries = deliveries.max(1);
        self
    }

    /// The durable queue dead-lettered messages go to: `{queue}.dead-letter`.
    pub fn dead_letter_queue(&self) -> &str {
        &self.dead_letter_queue
    }

    /// Handles up to `batch` messages, waiting up to `wait` for each; acknowledges a
    /// message once `handle` returns `Ok`. After `Err` the message is returned to the
    /// queue once `retry_after` has passed (this consumer holds it meanwhile and goes
    /// on with others), or, on its [`max_deliveries`](Self::max_deliveries)-th
    /// delivery, dead-lettered (see [`RabbitMqConsumer`]).
    pub async fn process<F>(
        &self,
        batch: usize,
        wait: Duration,
        retry_after: Duration,
        mut handle: F,
    ) -> Result<Processed>
    where
        F: AsyncFnMut(&Incoming) -> Result<()>,
    {
        let mut state = self.state.lock().await;
        let mut processed = Processed::default();
        let unavailable = |error: lapin::Error| {
            Error::new(
                ErrorKind::StoreUnavailable,
                format!("the RabbitMQ consumer failed: {error}"),
            )
        };
        let mut handled = 0;
        let mut deadline = tokio::time::Instant::now() + wait;
        while handled < batch.max(1) {
            state.release_due().await.map_err(unavailable)?;
            let until = state
                .held
                .iter()
                .map(|held| held.due)
                .min()
                .map_or(deadline, |due| due.min(deadline));
            let next = tokio::select! {
                next = state.deliveries.next() => next,
                () = tokio::time::sleep_until(until) => {
                    if tokio::time::Instant::now() >= deadline {
                        break;
                    }
                    continue;
                }
            };
            let Some(delivery) = next else {
                return Err(Error::new(
                    ErrorKind::StoreUnavailable,
                    "the RabbitMQ consumer was cancelled (connection or channel closed)",
                ));
            };
            let delivery = delivery.map_err(unavailable)?;
            handled += 1;
            let properties = &delivery.properties;
            let table = properties.headers().clone().unwrap_or_default();
            let mut headers = Vec::new();
            for key in table.inner().keys() {
                if let Some(value) = header_text(&table, key.as_str()) {
                    headers.push((key.as_str().to_owned(), value));
                }
            }
            let counted_by = failure_key(&delivery);
            let failed_before = state.failures.get(&counted_by).map_or(0, |(n, _)| *n);
            let counted_by_broker = broker_count(&table)
                .map_or(1, |n| n.saturating_add(1))
                .max(if delivery.redelivered { 2 } else { 1 });
            // The broker's count, less the deliveries answered "out of order" here.
            let deliveries =
                (failed_before + 1).max(state.early.failures(&counted_by, counted_by_broker));
            let incoming = Incoming {
                // Without a message_id the message has no id: a delivery tag restarts
                // with every channel, and a redelivery gets a new one.
                id: properties
                    .message_id()
                    .as_ref()
                    .map(|id| id.as_str().to_owned()),
                producer: header_text(&table, super::PRODUCER_HEADER),
                key: header_text(&table, "turnstile-key"),
                seq: header_text(&table, "turnstile-seq").and_then(|seq| seq.parse().ok()),
                topic: delivery.routing_key.as_str().to_owned(),
                headers,
                payload: delivery.data.clone(),
                deliveries,
            };
            match handle(&incoming).await {
                Ok(()) => {
                    delivery
                        .ack(BasicAckOptions::default())
                        .await
                        .map_err(unavailable)?;
                    state.failures.remove(&counted_by);
                    state.early.forget(&counted_by);
                    processed.acked += 1;
                }
                Err(error) if error.kind() == ErrorKind::OutOfOrder => {
                    let early = state.early.record(&counted_by);
                    telemetry::early("rabbitmq", &incoming, early, &error);
                    state.held.push(Held {
                        due: tokio::time::Instant::now() + retry_after,
                        delivery,
                    });
                    processed.early += 1;
                }
                Err(error) if deliveries >= u64::from(self.max_deliveries) => {
                    let note = DeadLetterNote::new(&error, deliveries, self.queue.as_str(), None);
                    match self.dead_letter(&mut state, &delivery, &note).await {
                        Ok(()) => {
                            delivery
                                .ack(BasicAckOptions::default())
                                .await
                                .map_err(unavailable)?;
                            state.failures.remove(&counted_by);
                            state.early.forget(&counted_by);
                            telemetry::dead_lettered(
                                "rabbitmq",
                                &incoming,
                                &note,
                                &self.dead_letter_queue,
                            );
                            processed.dead_lettered += 1;
                        }
                        Err(failure) => {
                            telemetry::dead_letter_failed(
                                "rabbitmq",
                                incoming.id.as_deref(),
                                &note,
                                &self.dead_letter_queue,
                                &failure,
                            );
                            state.failed(&counted_by, deliveries);
                            state.held.push(Held {
                                due: tokio::time::Instant::now() + retry_after,
                                delivery,
                            });
                            processed.retried += 1;
                        }
                    }
                }
                Err(error) => {
                    tracing::warn!(
                        id = ?incoming.id,
                        deliveries,
                        max_deliveries = self.max_deliveries,
                        %error,
                        "handler failed; the message goes back to the queue after the delay"
                    );
                    state.failed(&counted_by, deliveries);
                    state.held.push(Held {
                        due: tokio::time::Instant::now() + retry_after,
                        delivery,
                    });
                    processed.retried += 1;
                }
            }
            deadline = tokio::time::Instant::now() + wait;
        }
        Ok(processed)
    }

    /// Publishes the dead-letter copy of `delivery` and waits for the broker's confirm.
    async fn dead_letter(
        &self,
        state: &mut ConsumerState,
        delivery: &lapin::message::Delivery,
        note: &DeadLetterNote,
    ) -> std::result::Result<(), String> {
        let channel = match state.dead_letters.take() {
            Some(channel) if channel.status().connected() => channel,
            _ => dead_letter_channel(&self.connection, &self.dead_letter_queue)
                .await
                .map_err(|error| error.to_string())?,
        };
        let original = &delivery.properties;
        let mut headers = original.headers().clone().unwrap_or_default();
        for (name, value) in note.headers() {
            headers.insert(ShortString::from(name), long(&value));
        }
        // The same properties but `expiration` (the copy must not expire there) and
        // `user_id` (the broker refuses one that is not this connection's user).
        let mut properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(headers);
        if let Some(value) = original.content_type() {
            properties = properties.with_content_type(value.clone());
        }
        if let Some(value) = original.content_encoding() {
            properties = properties.with_content_encoding(value.clone());
        }
        if let Some(value) = original.priority() {
            properties = properties.with_priority(*value);
        }
        if let Some(value) = original.correlation_id() {
            properties = properties.with_correlation_id(value.clone());
        }
        if let Some(value) = original.reply_to() {
            properties = properties.with_reply_to(value.clone());
        }
        if let Some(value) = original.message_id() {
            properties = properties.with_message_id(value.clone());
        }
        if let Some(value) = original.timestamp() {
            properties = properties.with_timestamp(*value);
        }
        if let Some(value) = original.kind() {
            properties = properties.with_type(value.clone());
        }
        if let Some(value) = original.app_id() {
            properties = properties.with_app_id(value.clone());
        }
        let confirm = channel
            .basic_publish(
                ShortString::from(""),
                ShortString::from(self.dead_letter_queue.as_str()),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &delivery.data,
                properties,
            )
            .await
            .map_err(|error| error.to_string())?;
        // A channel whose confirm did not come is not used again: a late confirm or
        // return on it would be paired with the next copy.
        let Ok(confirmed) = tokio::time::timeout(CONFIRM_TIMEOUT, confirm).await else {
            tokio::spawn(async move {
                let _ = channel
                    .close(200, ShortString::from("no confirm in time"))
                    .await;
            });
            return Err(format!("no confirm within {CONFIRM_TIMEOUT:?}"));
        };
        let confirmation = confirmed.map_err(|error| error.to_string())?;
        state.dead_letters = Some(channel);
        match confirmation {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(_)) => Err(format!(
                "the dead-letter queue {:?} does not exist (the copy was returned)",
                self.dead_letter_queue
            )),
            Confirmation::Nack(_) => Err("the broker refused the copy (nack)".to_owned()),
            Confirmation::NotRequested => Err("the channel is not in confirm mode".to_owned()),
        }
    }
}

/// A confirming channel on `connection`, with `queue` declared (durable) unless it
/// exists (as it is, when an operator made it, say, a quorum queue).
async fn dead_letter_channel(
    connection: &Connection,
    queue: &str,
) -> std::result::Result<Channel, lapin::Error> {
    // A passive declare of a missing queue closes its channel: ask on one of its own.
    let probe = connection.create_channel().await?;
    let exists = probe
        .queue_declare(
            ShortString::from(queue),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .is_ok();
    if probe.status().connected() {
        let _ = probe.close(200, ShortString::from("done")).await;
    }
    let channel = connection.create_channel().await?;
    if !exists {
        channel
            .queue_declare(
                ShortString::from(queue),
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
    }
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}
