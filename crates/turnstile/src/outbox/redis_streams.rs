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
use super::telemetry;
use super::{DEFAULT_MAX_DELIVERIES, DeadLetterNote, Failure, Incoming, Message, Processed};
use crate::engine::redis::{connect_manager, map_error, open_client};
use crate::error::{ErrorKind, Result};
use crate::future::BoxFuture;

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
            url: crate::url::redact(url),
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

    fn reachable(&self) -> BoxFuture<'_, bool> {
        Box::pin(async move {
            let mut connection = self.connection.clone();
            let ping = redis::cmd("PING");
            let answer = ping.query_async::<String>(&mut connection);
            tokio::time::timeout(super::relay::REACHABLE_WITHIN, answer)
                .await
                .is_ok_and(|answer| answer.is_ok())
        })
    }
}

/// A consumer in a Redis Streams consumer group. An entry is acknowledged (`XACK`) only
/// after its handler succeeded; one whose handler failed, or whose consumer died, stays
/// pending and is claimed again (`XCLAIM`) once it has been idle `retry_after`.
///
/// **Poison entries.** The number of deliveries is Redis's own (the pending entry's
/// delivery count, read with `XPENDING` before the claim). Once an entry's handler has
/// failed on its [`max_deliveries`](Self::max_deliveries)-th delivery
/// ([`DEFAULT_MAX_DELIVERIES`] unless told otherwise), the entry is **dead-lettered**:
/// in one Lua script — atomically, and only while the entry is still pending with this
/// consumer — a copy with every field of the original, plus
/// [`DEAD_LETTER_REASON_HEADER`](super::DEAD_LETTER_REASON_HEADER) and the other
/// `turnstile-dead-letter-*` fields, is appended (`XADD`) to the stream
/// `{stream}:dead-letter`, and the original is acknowledged (`XACK`). The dead-letter
/// stream is not trimmed: an operator reads it (`XRANGE`), replays what should be, and
/// deletes it.
///
/// **Order.** A delivery its handler answers [`ErrorKind::OutOfOrder`]
/// ([`Error::out_of_order`](crate::Error::out_of_order), for a message whose key waits for an earlier one) is not
/// counted: Redis's delivery count of the entry is put one back, so a message that only
/// waited for its turn is never dead-lettered.
#[derive(Debug)]
pub struct RedisStreamsConsumer {
    connection: MultiplexedConnection,
    stream: String,
    group: String,
    consumer: String,
    max_deliveries: u32,
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

fn number(value: &Value) -> Option<u64> {
    match value {
        Value::Int(n) => u64::try_from(*n).ok(),
        other => text(other).and_then(|text| text.parse().ok()),
    }
}

/// An entry as read: its id, its fields as stored (for a dead-letter copy), and what
/// the handler gets.
struct Entry {
    id: String,
    fields: Vec<(Vec<u8>, Vec<u8>)>,
    incoming: Incoming,
}

/// `[[id, [field, value, …]], …]` as entries; `deliveries` gives an entry's delivery
/// count by its id.
fn entries(stream: &str, value: &Value, deliveries: impl Fn(&str) -> u64) -> Vec<Entry> {
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
            deliveries: deliveries(&entry_id),
        };
        let mut raw = Vec::new();
        for field in fields.chunks(2) {
            let [name, value] = field else { continue };
            raw.push((bytes(name), bytes(value)));
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
        found.push(Entry {
            id: entry_id,
            fields: raw,
            incoming,
        });
    }
    found
}

/// Appends the copy (ARGV[4…]: fields and values) to the dead-letter stream and
/// acknowledges the original, if it is still pending with this consumer; 1 if so, 0 if
/// not (another consumer claimed it meanwhile, or it was acknowledged).
const DEAD_LETTER_SCRIPT: &str = r"
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2])
if #pending == 0 then
  return 0
end
local fields = {}
for i = 4, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
redis.call('XADD', KEYS[2], '*', unpack(fields))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
return 1
";

/// A delivery the handler answered "out of order" is not counted: Redis's delivery
/// count of the entry (still pending with this consumer) goes one back, and its idle
/// time starts again, so it comes back after the delay. KEYS: stream; ARGV: group,
/// consumer, entry id.
const EARLY_SCRIPT: &str = r"
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2])
if #pending == 0 then
  return 0
end
local count = tonumber(pending[1][4])
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'RETRYCOUNT', math.max(count - 1, 0), 'JUSTID')
return 1
";

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
                    &format!("cannot connect to Redis at {}", crate::url::redact(url)),
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
            max_deliveries: DEFAULT_MAX_DELIVERIES,
        })
    }

    /// Dead-letters an entry whose handler failed on its `deliveries`-th delivery (at
    /// least 1; [`DEFAULT_MAX_DELIVERIES`] by default) instead of leaving it pending.
    pub fn max_deliveries(mut self, deliveries: u32) -> Self {
        self.max_deliveries = deliveries.max(1);
        self
    }

    /// The stream dead-lettered entries go to: `{stream}:dead-letter`.
    pub fn dead_letter_stream(&self) -> String {
        format!("{}:dead-letter", self.stream)
    }

    /// Handles up to `batch` entries: first those pending longer than `retry_after`
    /// (failed, or left by a dead consumer), else new ones (waiting up to `block` for
    /// them). An entry is acknowledged once `handle` returns `Ok`; after `Err` it stays
    /// pending and comes back after `retry_after`, or, on its
    /// [`max_deliveries`](Self::max_deliveries)-th delivery, it is dead-lettered (see
    /// [`RedisStreamsConsumer`]).
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
        let idle = u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX);
        // Entries pending longer than `retry_after`, with Redis's delivery counts.
        let pending: Value = redis::cmd("XPENDING")
            .arg(&self.stream)
            .arg(&self.group)
            .arg("IDLE")
            .arg(idle)
            .arg("-")
            .arg("+")
            .arg(count)
            .query_async(&mut connection)
            .await
            .map_err(fail)?;
        let mut counts = std::collections::HashMap::new();
        if let Value::Array(items) = &pending {
            for item in items {
                if let Value::Array(fields) = item
                    && let (Some(id), Some(deliveries)) = (
                        fields.first().and_then(text),
                        fields.get(3).and_then(number),
                    )
                {
                    counts.insert(id, deliveries);
                }
            }
        }
        let mut found = Vec::new();
        if !counts.is_empty() {
            let mut claim = redis::cmd("XCLAIM");
            claim
                .arg(&self.stream)
                .arg(&self.group)
                .arg(&self.consumer)
                .arg(idle);
            for id in counts.keys() {
                claim.arg(id);
            }
            let claimed: Value = claim.query_async(&mut connection).await.map_err(fail)?;
            // The claim is one more delivery. Claimed in stream order, as XCLAIM
            // answers in the order asked; sort to keep the stream's.
            found = entries(&self.stream, &claimed, |id| {
                counts.get(id).map_or(2, |n| n.saturating_add(1))
            });
            found.sort_by_key(|entry| stream_order(&entry.id));
        }
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
                        found.extend(entries(&self.stream, list, |_| 1));
                    }
                }
            }
        }
        let mut processed = Processed::default();
        for entry in found {
            let incoming = &entry.incoming;
            match handle(incoming).await {
                Ok(()) => {
                    redis::cmd("XACK")
                        .arg(&self.stream)
                        .arg(&self.group)
                        .arg(&entry.id)
                        .query_async::<Value>(&mut connection)
                        .await
                        .map_err(|error| map_error(error, "cannot acknowledge the entry"))?;
                    processed.acked += 1;
                }
                Err(error) if error.kind() == ErrorKind::OutOfOrder => {
                    // Redis keeps the count: this delivery is taken off it, for every
                    // consumer of the group, restarts included.
                    redis::Script::new(EARLY_SCRIPT)
                        .key(&self.stream)
                        .arg(&self.group)
                        .arg(&self.consumer)
                        .arg(&entry.id)
                        .invoke_async::<i64>(&mut connection)
                        .await
                        .map_err(|error| map_error(error, "cannot send the entry back"))?;
                    // Redis does not keep how often it waited: logged at debug level.
                    telemetry::early("redis", incoming, 1, &error);
                    processed.early += 1;
                }
                Err(error) if incoming.deliveries >= u64::from(self.max_deliveries) => {
                    let note = DeadLetterNote::new(
                        &error,
                        incoming.deliveries,
                        self.stream.as_str(),
                        Some(entry.id.clone()),
                    );
                    let destination = self.dead_letter_stream();
                    let script = redis::Script::new(DEAD_LETTER_SCRIPT);
                    let mut script = script.prepare_invoke();
                    script
                        .key(&self.stream)
                        .key(&destination)
                        .arg(&self.group)
                        .arg(&self.consumer)
                        .arg(&entry.id);
                    for (name, value) in &entry.fields {
                        script.arg(name.as_slice()).arg(value.as_slice());
                    }
                    for (name, value) in note.headers() {
                        script.arg(name).arg(value);
                    }
                    match script.invoke_async::<i64>(&mut connection).await {
                        Ok(1) => {
                            telemetry::dead_lettered("redis", incoming, &note, &destination);
                            processed.dead_lettered += 1;
                        }
                        Ok(_) => {
                            // Claimed by another consumer, or acknowledged, meanwhile:
                            // it is theirs now.
                            tracing::warn!(
                                id = ?incoming.id,
                                entry = entry.id,
                                "the entry to dead-letter is no longer pending with this consumer; left to the one that has it"
                            );
                            processed.retried += 1;
                        }
                        Err(error) => {
                            telemetry::dead_letter_failed(
                                "redis",
                                incoming.id.as_deref(),
                                &note,
                                &destination,
                                &error.to_string(),
                            );
                            processed.retried += 1;
                        }
                    }
                }
                Err(error) => {
                    tracing::warn!(
                        id = ?incoming.id,
                        deliveries = incoming.deliveries,
                        max_deliveries = self.max_deliveries,
                        %error,
                        "handler failed; the entry stays pending and comes back after the delay"
                    );
                    processed.retried += 1;
                }
            }
        }
        Ok(processed)
    }
}

/// An entry id (`MS-SEQ`) as a sortable pair; ids that do not parse sort last.
fn stream_order(id: &str) -> (u64, u64) {
    id.split_once('-')
        .and_then(|(ms, seq)| Some((ms.parse().ok()?, seq.parse().ok()?)))
        .unwrap_or((u64::MAX, u64::MAX))
}
