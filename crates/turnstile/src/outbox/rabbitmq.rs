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

use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use tokio::sync::Mutex;

use super::relay::Publisher;
use super::{Failure, Incoming, Message, Processed};
use crate::error::{Error, ErrorKind, Result};
use crate::lock::BoxFuture;

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
    /// The connection, dropped after a failure and opened again on the next publish
    /// (lapin does not recover connections by itself).
    connection: Mutex<Option<Connection>>,
    /// Confirming channels with nothing in flight, ready for the next publish.
    idle: std::sync::Mutex<Vec<Channel>>,
    /// Bounds the channels in use (one message in flight each).
    in_flight: tokio::sync::Semaphore,
}

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
            redacted: crate::store::redact(url),
            exchange: exchange.to_owned(),
            connection: Mutex::new(None),
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
        let mut connection = self.connection.lock().await;
        let channel = match connection.as_ref() {
            Some(live) if live.status().connected() => live
                .create_channel()
                .await
                .map_err(|e| self.setup_failed(e))?,
            _ => {
                *connection = None;
                let (opened, channel) = open_channel(&self.url, &self.redacted).await?;
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
                *connection = Some(opened);
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
            for (name, value) in message.headers() {
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
}

/// A consumer of one RabbitMQ queue: a message is acknowledged only after its handler
/// succeeded; after a failure it is returned to the queue (`nack` with requeue) and
/// delivered again.
pub struct RabbitMqConsumer {
    // Kept open for as long as the consumer lives.
    _connection: Connection,
    _channel: Channel,
    deliveries: Mutex<lapin::Consumer>,
}

impl std::fmt::Debug for RabbitMqConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RabbitMqConsumer")
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

impl RabbitMqConsumer {
    /// Consumes `queue` (which must exist) at `url`, with at most `prefetch`
    /// unacknowledged messages in hand.
    pub async fn connect(
        url: &str,
        queue: &str,
        consumer_tag: &str,
        prefetch: u16,
    ) -> Result<Self> {
        let redacted = crate::store::redact(url);
        let (connection, channel) = open_channel(url, &redacted).await?;
        let failed = |error: lapin::Error| {
            Error::new(
                ErrorKind::StoreUnavailable,
                format!("cannot consume queue {queue:?} at {redacted}: {error}"),
            )
        };
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
            _connection: connection,
            _channel: channel,
            deliveries: Mutex::new(deliveries),
        })
    }

    /// Handles up to `batch` messages, waiting up to `wait` for each; acknowledges a
    /// message once `handle` returns `Ok`, and returns it to the queue after `Err`.
    pub async fn process<F>(&self, batch: usize, wait: Duration, mut handle: F) -> Result<Processed>
    where
        F: AsyncFnMut(&Incoming) -> Result<()>,
    {
        let mut deliveries = self.deliveries.lock().await;
        let mut processed = Processed::default();
        let unavailable = |error: lapin::Error| {
            Error::new(
                ErrorKind::StoreUnavailable,
                format!("the RabbitMQ consumer failed: {error}"),
            )
        };
        for _ in 0..batch.max(1) {
            let Ok(next) = tokio::time::timeout(wait, deliveries.next()).await else {
                break;
            };
            let Some(delivery) = next else {
                return Err(Error::new(
                    ErrorKind::StoreUnavailable,
                    "the RabbitMQ consumer was cancelled (connection or channel closed)",
                ));
            };
            let delivery = delivery.map_err(unavailable)?;
            let properties = &delivery.properties;
            let table = properties.headers().clone().unwrap_or_default();
            let mut headers = Vec::new();
            for key in table.inner().keys() {
                if let Some(value) = header_text(&table, key.as_str()) {
                    headers.push((key.as_str().to_owned(), value));
                }
            }
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
                deliveries: if delivery.redelivered { 2 } else { 1 },
            };
            match handle(&incoming).await {
                Ok(()) => {
                    delivery
                        .ack(BasicAckOptions::default())
                        .await
                        .map_err(unavailable)?;
                    processed.acked += 1;
                }
                Err(error) => {
                    tracing::warn!(id = ?incoming.id, %error, "handler failed; the message goes back to the queue");
                    delivery
                        .nack(BasicNackOptions {
                            requeue: true,
                            ..BasicNackOptions::default()
                        })
                        .await
                        .map_err(unavailable)?;
                    processed.retried += 1;
                }
            }
        }
        Ok(processed)
    }
}
