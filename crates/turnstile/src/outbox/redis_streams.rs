//! Publishing to Redis Streams, and a consumer-group consumer (feature `redis`).
//!
//! Each message is appended with `XADD` to the stream named by its topic, with the fields
//! `id`, `key`, `seq`, `headers` (a JSON object) and `payload`. **Redis has no broker-side
//! duplicate detection** (before Redis 8.6): a message the relay publishes again — after
//! a crash between the publish and the settlement, or a lost reply — is appended again,
//! and it is the consumer's [`Inbox`](crate::idempotency::inbox::Inbox) that drops the
//! copy. Durability is Redis's: an appended entry survives a Redis crash only as far as
//! its persistence (AOF, `appendfsync`) does.

use std::time::Duration;

use redis::Value;
use redis::aio::{ConnectionManager, MultiplexedConnection};

use super::relay::Publisher;
use super::{Failure, Incoming, Message, Processed};
use crate::engine::redis::{connect_manager, map_error, open_client};
use crate::error::Result;
use crate::lock::BoxFuture;

/// A Redis Streams publisher.
#[derive(Clone)]
pub struct RedisStreamsPublisher {
    connection: ConnectionManager,
    max_len: Option<u64>,
    url: String,
}

impl std::fmt::Debug for RedisStreamsPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStreamsPublisher")
            .field("url", &self.url)
            .finish()
    }
}

impl RedisStreamsPublisher {
    /// Connects to the Redis server at `url` (`redis://…`, `rediss://…`).
    pub async fn connect(url: &str) -> Result<Self> {
        let client = open_client(url, None)?;
        let timeout = Duration::from_secs(3);
        Ok(RedisStreamsPublisher {
            connection: connect_manager(client, url, timeout, timeout).await?,
            max_len: None,
            url: crate::store::redact(url),
        })
    }

    /// Trims each stream to about `entries` entries as it grows (`XADD … MAXLEN ~`);
    /// unbounded by default. Trim only what every consumer group has read.
    pub fn max_len(mut self, entries: u64) -> Self {
        self.max_len = Some(entries.max(1));
        self
    }
}

impl Publisher for RedisStreamsPublisher {
    fn publish<'a>(
        &'a self,
        message: &'a Message,
        seq: u64,
    ) -> BoxFuture<'a, std::result::Result<(), Failure>> {
        Box::pin(async move {
            let mut command = redis::cmd("XADD");
            command.arg(message.topic());
            if let Some(max_len) = self.max_len {
                command.arg("MAXLEN").arg("~").arg(max_len);
            }
            command
                .arg("*")
                .arg("id")
                .arg(message.id())
                .arg("key")
                .arg(message.key())
                .arg("seq")
                .arg(seq)
                .arg("headers")
                .arg(message.headers_json())
                .arg("payload")
                .arg(message.payload());
            let mut connection = self.connection.clone();
            command
                .query_async::<Value>(&mut connection)
                .await
                .map(|_| ())
                .map_err(|error| Failure {
                    // A wrong type at the key (not a stream) is an operator's fix; the
                    // rest is the connection.
                    permanent: false,
                    reason: error.to_string(),
                })
        })
    }

    fn check<'a>(&'a self, _topic: &'a str, _redelivery: Duration) -> BoxFuture<'a, Result<()>> {
        // There is no duplicate window to check: the inbox removes every copy.
        Box::pin(async { Ok(()) })
    }

    fn describe(&self) -> String {
        self.url.clone()
    }
}

/// A consumer in a Redis Streams consumer group. An entry is acknowledged (`XACK`) only
/// after its handler succeeded; one whose handler failed, or whose consumer died, stays
/// pending and is claimed again (`XAUTOCLAIM`) once it has been idle `retry_after`.
#[derive(Debug)]
pub struct RedisStreamsConsumer {
    connection: MultiplexedConnection,
    stream: String,
    group: String,
    consumer: String,
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(text) => Some(text.clone()),
        _ => None,
    }
}

fn bytes(value: &Value) -> Vec<u8> {
    match value {
        Value::BulkString(bytes) => bytes.clone(),
        Value::SimpleString(text) => text.as_bytes().to_vec(),
        _ => Vec::new(),
    }
}

/// `[[id, [field, value, …]], …]` as (entry id, Incoming).
fn entries(stream: &str, value: &Value, deliveries: u64) -> Vec<(String, Incoming)> {
    let Value::Array(items) = value else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for item in items {
        let Value::Array(pair) = item else { continue };
        let (Some(entry_id), Some(Value::Array(fields))) =
            (pair.first().and_then(text), pair.get(1))
        else {
            continue;
        };
        // An entry without an `id` field has no id: its entry id is not one (a copy
        // appended again gets another).
        let mut incoming = Incoming {
            id: None,
            producer: None,
            key: None,
            seq: None,
            topic: stream.to_owned(),
            headers: Vec::new(),
            payload: Vec::new(),
            deliveries,
        };
        for field in fields.chunks(2) {
            let [name, value] = field else { continue };
            match text(name).as_deref() {
                Some("id") => incoming.id = text(value),
                Some("key") => incoming.key = text(value),
                Some("seq") => incoming.seq = text(value).and_then(|seq| seq.parse().ok()),
                Some("payload") => incoming.payload = bytes(value),
                Some("headers") => {
                    incoming.headers = text(value)
                        .and_then(|json| {
                            serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(
                                &json,
                            )
                            .ok()
                        })
                        .map(|map| {
                            map.into_iter()
                                .filter_map(|(k, v)| v.as_str().map(|v| (k, v.to_owned())))
                                .collect()
                        })
                        .unwrap_or_default();
                }
                _ => {}
            }
        }
        incoming.producer = incoming.header(super::PRODUCER_HEADER).map(str::to_owned);
        found.push((entry_id, incoming));
    }
    found
}

impl RedisStreamsConsumer {
    /// Joins (creating if needed) consumer group `group` on `stream` as `consumer`.
    pub async fn connect(url: &str, stream: &str, group: &str, consumer: &str) -> Result<Self> {
        let client = open_client(url, None)?;
        // Its own connection, without a response timeout shorter than the blocking
        // reads it makes.
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(3)))
            .set_response_timeout(None);
        let mut connection = client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(|error| {
                map_error(
                    error,
                    &format!("cannot connect to Redis at {}", crate::store::redact(url)),
                )
            })?;
        let created = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(stream)
            .arg(group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async::<Value>(&mut connection)
            .await;
        match created {
            Ok(_) => {}
            Err(error) if error.code() == Some("BUSYGROUP") => {}
            Err(error) => return Err(map_error(error, "cannot create the consumer group")),
        }
        Ok(RedisStreamsConsumer {
            connection,
            stream: stream.to_owned(),
            group: group.to_owned(),
            consumer: consumer.to_owned(),
        })
    }

    /// Handles up to `batch` entries: first those pending longer than `retry_after`
    /// (failed, or left by a dead consumer), else new ones (waiting up to `block` for
    /// them). An entry is acknowledged once `handle` returns `Ok`; after `Err` it stays
    /// pending and comes back after `retry_after`.
    pub async fn process<F>(
        &self,
        batch: usize,
        block: Duration,
        retry_after: Duration,
        mut handle: F,
    ) -> Result<Processed>
    where
        F: AsyncFnMut(&Incoming) -> Result<()>,
    {
        let mut connection = self.connection.clone();
        let fail = |error| map_error(error, "cannot read the stream");
        let count = batch.max(1);
        let claimed: Value = redis::cmd("XAUTOCLAIM")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(&self.consumer)
            .arg(u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX))
            .arg("0-0")
            .arg("COUNT")
            .arg(count)
            .query_async(&mut connection)
            .await
            .map_err(fail)?;
        let mut found = match &claimed {
            Value::Array(parts) => parts
                .get(1)
                .map(|list| entries(&self.stream, list, 2))
                .unwrap_or_default(),
            _ => Vec::new(),
        };
        if found.is_empty() {
            let read: Value = redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg(&self.group)
                .arg(&self.consumer)
                .arg("COUNT")
                .arg(count)
                .arg("BLOCK")
                .arg(u64::try_from(block.as_millis()).unwrap_or(u64::MAX).max(1))
                .arg("STREAMS")
                .arg(&self.stream)
                .arg(">")
                .query_async(&mut connection)
                .await
                .map_err(fail)?;
            if let Value::Array(streams) = &read {
                for stream in streams {
                    if let Value::Array(pair) = stream
                        && let Some(list) = pair.get(1)
                    {
                        found.extend(entries(&self.stream, list, 1));
                    }
                }
            }
        }
        let mut processed = Processed::default();
        for (entry_id, incoming) in found {
            match handle(&incoming).await {
                Ok(()) => {
                    redis::cmd("XACK")
                        .arg(&self.stream)
                        .arg(&self.group)
                        .arg(&entry_id)
                        .query_async::<Value>(&mut connection)
                        .await
                        .map_err(|error| map_error(error, "cannot acknowledge the entry"))?;
                    processed.acked += 1;
                }
                Err(error) => {
                    tracing::warn!(id = ?incoming.id, %error, "handler failed; the entry stays pending and comes back");
                    processed.retried += 1;
                }
            }
        }
        Ok(processed)
    }
}
