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
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::{Offset, TopicPartitionList};

use super::relay::Publisher;
use super::telemetry;
use super::{DEFAULT_MAX_DELIVERIES, DeadLetterNote, Failure, Incoming, Message, Processed};
use crate::error::{Error, ErrorKind, Result};
use crate::future::BoxFuture;

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
            for (name, value) in super::user_headers(message) {
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

    fn reachable(&self) -> BoxFuture<'_, bool> {
        // A metadata round trip to any broker (librdkafka's call blocks).
        Box::pin(async move {
            let producer = self.producer.clone();
            tokio::task::spawn_blocking(move || {
                producer
                    .client()
                    .fetch_metadata(None, super::relay::REACHABLE_WITHIN)
                    .is_ok()
            })
            .await
            .unwrap_or(false)
        })
    }
}

/// A consumer in a Kafka consumer group. A message's offset is committed only after its
/// handler succeeded; after a failure the consumer goes back to it, so it — and what
/// followed it in its partition — is delivered again, in order.
///
/// **Failures and poison messages.** After a failure the message's partition is
/// paused for the `retry_after` of [`process`](Self::process) (the consumer's other
/// partitions go on), then consumed again from the failed message. Kafka keeps no
/// delivery count, so this consumer counts, in memory, the consecutive failures of the
/// message at each partition's offset (a consumer that takes over the partition starts
/// counting again). Once a message's handler has failed on its
/// [`max_deliveries`](Self::max_deliveries)-th delivery ([`DEFAULT_MAX_DELIVERIES`]
/// unless told otherwise), the message is **dead-lettered**: a copy — the same key,
/// payload and headers, plus
/// [`DEAD_LETTER_REASON_HEADER`](super::DEAD_LETTER_REASON_HEADER) and the other
/// `turnstile-dead-letter-*` headers — is produced to the topic `{topic}.dead-letter`
/// by an idempotent producer, and only once Kafka acknowledged it (the delivery
/// report) is the original's offset committed, and its partition goes on. Create the
/// dead-letter topic (or let the brokers create topics): while the copy cannot be
/// stored, the message is retried after the delay, with an error logged.
pub struct KafkaConsumer {
    consumer: StreamConsumer,
    producer: FutureProducer,
    max_deliveries: u32,
    state: std::sync::Mutex<KafkaState>,
}

#[derive(Default)]
struct KafkaState {
    /// By (topic, partition): the offset of the message that failed last there, and
    /// its consecutive failures.
    failures: std::collections::HashMap<(String, i32), (i64, u64)>,
    /// Paused partitions: (topic, partition, the offset to go back to, when).
    paused: Vec<(String, i32, i64, tokio::time::Instant)>,
    /// Deliveries answered "out of order", by message, for the log only: Kafka has no
    /// delivery count, and the failures above leave them out.
    early: super::EarlyDeliveries,
}

impl std::fmt::Debug for KafkaConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaConsumer")
            .field("max_deliveries", &self.max_deliveries)
            .finish()
    }
}

/// The topic a message of `topic` is dead-lettered to: `{topic}.dead-letter`.
pub fn dead_letter_topic(topic: &str) -> String {
    format!("{topic}.dead-letter")
}

impl KafkaConsumer {
    /// Joins consumer group `group` for `topic` at `url`, reading from the earliest
    /// offset the group has not committed.
    pub fn connect(url: &str, topic: &str, group: &str) -> Result<Self> {
        let servers = bootstrap(url)?;
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", &servers)
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .create()
            .map_err(configuration)?;
        consumer.subscribe(&[topic]).map_err(configuration)?;
        let producer = ClientConfig::new()
            .set("bootstrap.servers", &servers)
            .set("enable.idempotence", "true")
            .set(
                "message.timeout.ms",
                DELIVERY_TIMEOUT.as_millis().to_string(),
            )
            .create()
            .map_err(configuration)?;
        Ok(KafkaConsumer {
            consumer,
            producer,
            max_deliveries: DEFAULT_MAX_DELIVERIES,
            state: std::sync::Mutex::new(KafkaState::default()),
        })
    }

    /// Dead-letters a message whose handler failed on its `deliveries`-th delivery (at
    /// least 1; [`DEFAULT_MAX_DELIVERIES`] by default) instead of going back to it.
    pub fn max_deliveries(mut self, deliveries: u32) -> Self {
        self.max_deliveries = deliveries.max(1);
        self
    }

    fn state(&self) -> std::sync::MutexGuard<'_, KafkaState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Resumes the paused partitions whose delay has passed, from the message that
    /// failed.
    fn resume_due(&self) {
        let now = tokio::time::Instant::now();
        let due: Vec<(String, i32, i64)> = {
            let mut state = self.state();
            let (due, waiting) = std::mem::take(&mut state.paused)
                .into_iter()
                .partition(|(_, _, _, at)| *at <= now);
            state.paused = waiting;
            due.into_iter()
                .map(|(topic, partition, offset, _)| (topic, partition, offset))
                .collect()
        };
        for (topic, partition, offset) in due {
            let mut list = TopicPartitionList::new();
            list.add_partition(&topic, partition);
            // A partition this consumer lost in a rebalance is not its to resume: its
            // new owner starts from the committed offset.
            if let Err(error) = self.consumer.resume(&list) {
                tracing::debug!(topic, partition, %error, "cannot resume the partition");
            }
            self.go_back(&topic, partition, offset);
        }
    }

    /// Seeks `partition` back to `offset`.
    fn go_back(&self, topic: &str, partition: i32, offset: i64) {
        let mut position = TopicPartitionList::new();
        let seeked = position
            .add_partition_offset(topic, partition, Offset::Offset(offset))
            .and_then(|()| {
                self.consumer
                    .seek_partitions(position, Duration::from_secs(5))
            });
        match seeked {
            Ok(list) => {
                for element in list.elements() {
                    if let Err(error) = element.error() {
                        tracing::debug!(topic, partition, %error, "cannot seek the partition");
                    }
                }
            }
            Err(error) => tracing::debug!(topic, partition, %error, "cannot seek the partition"),
        }
    }

    /// Pauses `partition` for `delay`, to consume it again from `offset`.
    fn pause(&self, topic: &str, partition: i32, offset: i64, delay: Duration) {
        let mut list = TopicPartitionList::new();
        list.add_partition(topic, partition);
        if let Err(error) = self.consumer.pause(&list) {
            tracing::warn!(topic, partition, %error, "cannot pause the partition");
        }
        self.go_back(topic, partition, offset);
        self.state().paused.push((
            topic.to_owned(),
            partition,
            offset,
            tokio::time::Instant::now() + delay,
        ));
    }

    /// Handles up to `batch` messages, waiting up to `wait` for each; commits a
    /// message's offset once `handle` returns `Ok`. After `Err` its partition is paused
    /// for `retry_after` and then consumed again from the message, or, on the message's
    /// [`max_deliveries`](Self::max_deliveries)-th delivery, the message is
    /// dead-lettered (see [`KafkaConsumer`]).
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
        let unavailable = |error: KafkaError| {
            Error::new(
                ErrorKind::StoreUnavailable,
                format!("the Kafka consumer failed: {error}"),
            )
        };
        let mut processed = Processed::default();
        let mut handled = 0;
        let mut deadline = tokio::time::Instant::now() + wait;
        while handled < batch.max(1) {
            self.resume_due();
            let until = self
                .state()
                .paused
                .iter()
                .map(|(_, _, _, at)| *at)
                .min()
                .map_or(deadline, |at| at.min(deadline));
            let received = tokio::select! {
                received = self.consumer.recv() => received,
                () = tokio::time::sleep_until(until) => {
                    if tokio::time::Instant::now() >= deadline {
                        break;
                    }
                    continue;
                }
            };
            let message = received.map_err(unavailable)?;
            let place = (message.topic().to_owned(), message.partition());
            let failed_before = {
                let state = self.state();
                if state
                    .paused
                    .iter()
                    .any(|(topic, partition, _, _)| (topic, *partition) == (&place.0, place.1))
                {
                    // Fetched before its partition was paused: it comes again, in
                    // order, once the partition resumes.
                    continue;
                }
                match state.failures.get(&place) {
                    Some((offset, failures)) if *offset == message.offset() => *failures,
                    _ => 0,
                }
            };
            handled += 1;
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
            // The relay's own headers come after the application's, so the last one of
            // a name (in any case) is the relay's.
            let header = |name: &str| {
                headers
                    .iter()
                    .rev()
                    .find(|(key, _)| key.eq_ignore_ascii_case(name))
                    .map(|(_, value)| value.clone())
            };
            let deliveries = failed_before + 1;
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
                deliveries,
            };
            match handle(&incoming).await {
                Ok(()) => {
                    self.consumer
                        .commit_message(&message, CommitMode::Sync)
                        .map_err(unavailable)?;
                    let mut state = self.state();
                    state.failures.remove(&place);
                    state
                        .early
                        .forget(&format!("{}/{}/{}", place.0, place.1, message.offset()));
                    drop(state);
                    processed.acked += 1;
                }
                Err(error) if error.kind() == ErrorKind::OutOfOrder => {
                    // Not a failure: the count of failures stays, and the partition
                    // comes back to the message after the delay.
                    let early = {
                        let mut state = self.state();
                        state
                            .early
                            .record(&format!("{}/{}/{}", place.0, place.1, message.offset()))
                    };
                    telemetry::early("kafka", &incoming, early, &error);
                    self.pause(
                        message.topic(),
                        message.partition(),
                        message.offset(),
                        retry_after,
                    );
                    processed.early += 1;
                }
                Err(error) if deliveries >= u64::from(self.max_deliveries) => {
                    let note = DeadLetterNote::new(
                        &error,
                        deliveries,
                        message.topic(),
                        Some(format!("{}/{}", message.partition(), message.offset())),
                    );
                    let destination = dead_letter_topic(message.topic());
                    match self.dead_letter(&message, &note, &destination).await {
                        Ok(()) => {
                            self.consumer
                                .commit_message(&message, CommitMode::Sync)
                                .map_err(unavailable)?;
                            self.state().failures.remove(&place);
                            telemetry::dead_lettered("kafka", &incoming, &note, &destination);
                            processed.dead_lettered += 1;
                        }
                        Err(failure) => {
                            telemetry::dead_letter_failed(
                                "kafka",
                                incoming.id.as_deref(),
                                &note,
                                &destination,
                                &failure,
                            );
                            self.state()
                                .failures
                                .insert(place, (message.offset(), deliveries));
                            self.pause(
                                message.topic(),
                                message.partition(),
                                message.offset(),
                                retry_after,
                            );
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
                        "handler failed; the consumer goes back to the message after the delay"
                    );
                    self.state()
                        .failures
                        .insert(place, (message.offset(), deliveries));
                    self.pause(
                        message.topic(),
                        message.partition(),
                        message.offset(),
                        retry_after,
                    );
                    processed.retried += 1;
                }
            }
            deadline = tokio::time::Instant::now() + wait;
        }
        Ok(processed)
    }

    /// Produces the dead-letter copy of `message` to `destination` and waits for its
    /// delivery report.
    async fn dead_letter(
        &self,
        message: &rdkafka::message::BorrowedMessage<'_>,
        note: &DeadLetterNote,
        destination: &str,
    ) -> std::result::Result<(), String> {
        let mut headers = OwnedHeaders::new();
        if let Some(list) = message.headers() {
            for header in list.iter() {
                headers = headers.insert(header);
            }
        }
        for (name, value) in note.headers() {
            headers = headers.insert(Header {
                key: name,
                value: Some(value.as_str()),
            });
        }
        let mut record = FutureRecord::<[u8], [u8]>::to(destination).headers(headers);
        if let Some(key) = message.key() {
            record = record.key(key);
        }
        if let Some(payload) = message.payload() {
            record = record.payload(payload);
        }
        self.producer
            .send(record, DELIVERY_TIMEOUT)
            .await
            .map(|_| ())
            .map_err(|(error, _)| error.to_string())
    }
}
