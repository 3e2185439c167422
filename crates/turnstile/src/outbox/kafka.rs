//! Publishing to Kafka, and a consumer-group consumer (feature `kafka`, librdkafka).
//!
//! Each message goes to the topic named by its topic with its ordering key as the Kafka
//! key (so a key's messages share a partition and keep their order there), its id in the
//! header `turnstile-id`, and `turnstile-key` / `turnstile-seq`. The producer is
//! **idempotent** (`enable.idempotence`: acks from all in-sync replicas, retries without
//! duplicates or reordering within one producer session); the relay counts a message as
//! delivered once Kafka acknowledged it. Kafka's idempotence does not reach across
//! producer sessions: a message published again by the next relay after a crash is
//! stored again, and the consumer's [`Inbox`](crate::idempotency::inbox::Inbox) removes
//! the copy.
//!
//! Brokers are named `kafka://host:port[,host:port…]`. The tests run against
//! librdkafka's own mock cluster: there is no Kafka server on the test machines.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

use super::relay::Publisher;
use super::{Failure, Incoming, Message, Processed};
use crate::error::{Error, ErrorKind, Result};
use crate::lock::BoxFuture;

/// How long a publish may wait in the producer's queue and for its acknowledgement
/// (`message.timeout.ms`). librdkafka may still deliver a message up to this long after
/// it was handed over, whatever became of the call, so it must end well inside the
/// relay's lease: a copy landing after the lease could follow a later message that the
/// next relay published.
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(10);

/// `kafka://a:9092,b:9092` → `a:9092,b:9092`.
fn bootstrap(url: &str) -> Result<String> {
    let servers = url
        .strip_prefix("kafka://")
        .map(|rest| rest.trim_end_matches('/'))
        .filter(|rest| !rest.is_empty() && !rest.contains(['/', '?', '@']))
        .ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidUrl,
                format!("{url:?} is not a Kafka URL (kafka://host:port[,host:port…])"),
            )
        })?;
    Ok(servers.to_owned())
}

fn configuration(error: KafkaError) -> Error {
    Error::new(
        ErrorKind::Configuration,
        format!("librdkafka refused the configuration: {error}"),
    )
}

/// A Kafka publisher: an idempotent producer.
#[derive(Clone)]
pub struct KafkaPublisher {
    producer: FutureProducer,
    servers: String,
}

impl std::fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("servers", &self.servers)
            .finish()
    }
}

impl KafkaPublisher {
    /// An idempotent producer for the brokers of `url` (`kafka://host:port[,…]`). The
    /// brokers are contacted on the first publish.
    pub fn connect(url: &str) -> Result<Self> {
        let servers = bootstrap(url)?;
        let producer = ClientConfig::new()
            .set("bootstrap.servers", &servers)
            .set("enable.idempotence", "true")
            .set(
                "message.timeout.ms",
                DELIVERY_TIMEOUT.as_millis().to_string(),
            )
            .set("linger.ms", "1")
            .create()
            .map_err(configuration)?;
        Ok(KafkaPublisher { producer, servers })
    }
}

impl Publisher for KafkaPublisher {
    fn publish<'a>(
        &'a self,
        message: &'a Message,
        seq: u64,
    ) -> BoxFuture<'a, std::result::Result<(), Failure>> {
        Box::pin(async move {
            let seq_text = seq.to_string();
            let mut headers = OwnedHeaders::new_with_capacity(message.headers().len() + 3);
            for (name, value) in message.headers() {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(value.as_str()),
                });
            }
            let headers = headers
                .insert(Header {
                    key: "turnstile-id",
                    value: Some(message.id()),
                })
                .insert(Header {
                    key: "turnstile-key",
                    value: Some(message.key()),
                })
                .insert(Header {
                    key: "turnstile-seq",
                    value: Some(seq_text.as_str()),
                });
            let record = FutureRecord::to(message.topic())
                .key(message.key())
                .payload(message.payload())
                .headers(headers);
            match self.producer.send(record, DELIVERY_TIMEOUT).await {
                Ok(_) => Ok(()),
                Err((error, _)) => Err(Failure {
                    permanent: matches!(
                        error.rdkafka_error_code(),
                        Some(
                            RDKafkaErrorCode::MessageSizeTooLarge
                                | RDKafkaErrorCode::InvalidMessageSize
                                | RDKafkaErrorCode::TopicAuthorizationFailed
                                // A topic that does not exist parks its keys (with the
                                // reason) instead of holding them back forever; a
                                // redrive after creating it sends them.
                                | RDKafkaErrorCode::UnknownTopicOrPartition
                                | RDKafkaErrorCode::UnknownTopic
                        )
                    ),
                    reason: error.to_string(),
                }),
            }
        })
    }

    fn longest_publish(&self) -> Option<Duration> {
        Some(DELIVERY_TIMEOUT)
    }

    fn check<'a>(&'a self, _topic: &'a str, _redelivery: Duration) -> BoxFuture<'a, Result<()>> {
        // Kafka keeps no duplicate window across producer sessions: the inbox removes
        // copies, so there is nothing to compare the relay's redelivery window with.
        Box::pin(async { Ok(()) })
    }

    fn describe(&self) -> String {
        format!("kafka://{}", self.servers)
    }
}

/// A consumer in a Kafka consumer group. A message's offset is committed only after its
/// handler succeeded; after a failure the consumer seeks back to it, so it — and what
/// followed it in its partition — is delivered again, in order.
pub struct KafkaConsumer {
    consumer: StreamConsumer,
}

impl std::fmt::Debug for KafkaConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KafkaConsumer")
    }
}

impl KafkaConsumer {
    /// Joins consumer group `group` for `topic` at `url`, reading from the earliest
    /// offset the group has not committed.
    pub fn connect(url: &str, topic: &str, group: &str) -> Result<Self> {
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap(url)?)
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .create()
            .map_err(configuration)?;
        consumer.subscribe(&[topic]).map_err(configuration)?;
        Ok(KafkaConsumer { consumer })
    }

    /// Handles up to `batch` messages, waiting up to `wait` for each; commits a
    /// message's offset once `handle` returns `Ok`; after `Err`, seeks back to the
    /// message and returns (it comes again on the next call).
    pub async fn process<F>(&self, batch: usize, wait: Duration, mut handle: F) -> Result<Processed>
    where
        F: AsyncFnMut(&Incoming) -> Result<()>,
    {
        let unavailable = |error: KafkaError| {
            Error::new(
                ErrorKind::StoreUnavailable,
                format!("the Kafka consumer failed: {error}"),
            )
        };
        let mut processed = Processed::default();
        for _ in 0..batch.max(1) {
            let Ok(received) = tokio::time::timeout(wait, self.consumer.recv()).await else {
                break;
            };
            let message = received.map_err(unavailable)?;
            let mut headers = Vec::new();
            if let Some(list) = message.headers() {
                for header in list.iter() {
                    let value = header
                        .value
                        .map(|bytes| String::from_utf8_lossy(bytes).into_owned())
                        .unwrap_or_default();
                    headers.push((header.key.to_owned(), value));
                }
            }
            let header = |name: &str| {
                headers
                    .iter()
                    .find(|(key, _)| key == name)
                    .map(|(_, value)| value.clone())
            };
            let incoming = Incoming {
                // Without a turnstile-id the message has no id: its offset is not one
                // (a copy published again gets another).
                id: header("turnstile-id"),
                producer: header(super::PRODUCER_HEADER),
                key: header("turnstile-key"),
                seq: header("turnstile-seq").and_then(|seq| seq.parse().ok()),
                topic: message.topic().to_owned(),
                headers: headers.clone(),
                payload: message.payload().unwrap_or_default().to_vec(),
                deliveries: 1,
            };
            match handle(&incoming).await {
                Ok(()) => {
                    self.consumer
                        .commit_message(&message, CommitMode::Sync)
                        .map_err(unavailable)?;
                    processed.acked += 1;
                }
                Err(error) => {
                    tracing::warn!(id = ?incoming.id, %error, "handler failed; the consumer goes back to the message");
                    let mut position = TopicPartitionList::new();
                    position
                        .add_partition_offset(
                            message.topic(),
                            message.partition(),
                            Offset::Offset(message.offset()),
                        )
                        .map_err(unavailable)?;
                    self.consumer
                        .seek_partitions(position, Duration::from_secs(5))
                        .map_err(unavailable)?;
                    processed.retried += 1;
                    break;
                }
            }
        }
        Ok(processed)
    }
}
