//! The outbox on SQLite relayed to Redis Streams, consumed by a consumer group through
//! the inbox: Redis keeps every copy a relay publishes, and the inbox is what makes
//! handling effectively once.

mod outbox_in_order;
mod outbox_projection;

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use outbox_projection::Projection;
use tokio_util::sync::CancellationToken;
use turnstile::outbox::redis_streams::{RedisStreamsConsumer, RedisStreamsPublisher};
use turnstile::outbox::relay::{Publisher, Relay, RelayOptions};
use turnstile::outbox::sqlite::SqliteOutbox;
use turnstile::outbox::{Message, OutboxStore};
use turnstile_test_support::shared_redis;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_in_the_stream_are_handled_once_in_key_order() {
    let redis = shared_redis();
    let stream = turnstile_test_support::unique_name("payments");
    let dir = tempfile::tempdir().unwrap();
    let outbox = SqliteOutbox::open(dir.path().join("app.db")).await.unwrap();
    let publisher = RedisStreamsPublisher::connect(&redis.url()).await.unwrap();
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();
    for n in 0..120_i64 {
        let account = format!("acct-{}", n % 8);
        *expected.entry(account.clone()).or_default() += n;
        let message = Message::json(
            stream.as_str(),
            account.as_str(),
            &serde_json::json!({"account": account, "cents": n}),
        )
        .unwrap();
        let mut transaction = outbox.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
        outbox.enqueue(&mut transaction, &message).await.unwrap();
        outbox.commit(transaction).await.unwrap();
    }
    // A relay that published the first three messages of every key, as it read them
    // from the store (with the outbox's identity), and died before recording it: the
    // copies are in the stream, and the next relay publishes those messages again once
    // the lease has run out.
    for leased in outbox
        .claim(8, 3, Duration::from_millis(200))
        .await
        .unwrap()
    {
        for stored in &leased.messages {
            publisher
                .publish(&stored.message, stored.seq)
                .await
                .unwrap();
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let shutdown = CancellationToken::new();
    let mut relays = Vec::new();
    for _ in 0..2 {
        let relay = Relay::new(
            SqliteOutbox::open(dir.path().join("app.db")).await.unwrap(),
            publisher.clone(),
        )
        .with_options(RelayOptions::new().max_keys(3));
        let shutdown = shutdown.clone();
        relays.push(tokio::spawn(async move { relay.run(shutdown).await }));
    }
    for _ in 0..200 {
        if outbox.status(10).await.unwrap().pending == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(outbox.status(10).await.unwrap().pending, 0);
    shutdown.cancel();
    for relay in relays {
        relay.await.unwrap().unwrap();
    }

    let mut projection = Projection::open(&dir.path().join("consumer.db")).await;
    let consumer = RedisStreamsConsumer::connect(&redis.url(), &stream, "projection", "c1")
        .await
        .unwrap();
    let mut crashed = 0;
    for _ in 0..50 {
        let done = consumer
            .process(
                50,
                Duration::from_millis(50),
                Duration::from_millis(100),
                async |incoming| {
                    let cents = projection.apply(incoming).await?;
                    // A consumer that dies between its commit and its XACK: the entry
                    // stays pending and is claimed again.
                    if incoming.deliveries == 1 && cents % 7 == 0 {
                        crashed += 1;
                        return Err(turnstile::Error::new(
                            turnstile::ErrorKind::Store,
                            "crashed before the ack",
                        ));
                    }
                    Ok(())
                },
            )
            .await
            .unwrap();
        if done.acked == 0
            && done.retried == 0
            && projection.handled == 120
            && projection.skipped == 24 + crashed
        {
            break;
        }
    }
    assert_eq!(projection.handled, 120, "each message handled once");
    // Copies of messages that "crashed" before their ack are skipped when claimed again;
    // the copies the dead relay left are acknowledged as duplicates by whichever
    // delivery comes second.
    assert!(crashed > 0);
    assert_eq!(
        projection.skipped,
        24 + crashed,
        "each copy and each redelivery skipped"
    );
    assert_eq!(
        projection.out_of_order, 0,
        "a key's messages were handled out of order"
    );
    let totals = projection.totals().await;
    assert_eq!(totals, expected.into_iter().collect::<Vec<_>>());
}

/// What the outbox reports reaches the application's `metrics` recorder: messages
/// enqueued and published, publish latency and lag, and the status gauges.
#[test]
fn enqueues_publishes_and_lag_reach_the_metrics_recorder() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let dir = tempfile::tempdir().unwrap();
    let url = shared_redis().url();
    metrics::with_local_recorder(&recorder, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let outbox = SqliteOutbox::open(dir.path().join("m.db")).await.unwrap();
            let stream = turnstile_test_support::unique_name("metrics");
            for n in 0..3 {
                let message = Message::json(stream.as_str(), "k", &n).unwrap();
                let mut transaction = outbox.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
                outbox.enqueue(&mut transaction, &message).await.unwrap();
                outbox.commit(transaction).await.unwrap();
            }
            let publisher = RedisStreamsPublisher::connect(&url).await.unwrap();
            let relay = Relay::new(outbox.clone(), publisher);
            // One pass of `run` reports the gauges, then relays everything.
            let shutdown = CancellationToken::new();
            let stop = shutdown.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                stop.cancel();
            });
            relay.run(shutdown).await.unwrap();
            assert_eq!(outbox.status(10).await.unwrap().pending, 0);
        });
    });
    let mut seen = std::collections::BTreeMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let figure = match value {
            DebugValue::Counter(n) => n as f64,
            DebugValue::Gauge(g) => g.into_inner(),
            DebugValue::Histogram(samples) => samples.len() as f64,
        };
        seen.insert(key.key().name().to_owned(), figure);
    }
    assert_eq!(
        seen.get("turnstile_outbox_enqueued_total"),
        Some(&3.0),
        "{seen:?}"
    );
    assert_eq!(
        seen.get("turnstile_outbox_published_total"),
        Some(&3.0),
        "{seen:?}"
    );
    assert_eq!(
        seen.get("turnstile_outbox_publish_seconds"),
        Some(&3.0),
        "{seen:?}"
    );
    assert_eq!(
        seen.get("turnstile_outbox_lag_seconds"),
        Some(&3.0),
        "{seen:?}"
    );
    // The gauges were set before the first round: 3 pending then.
    assert_eq!(seen.get("turnstile_outbox_pending"), Some(&3.0), "{seen:?}");
    assert!(
        seen.contains_key("turnstile_outbox_oldest_pending_seconds"),
        "{seen:?}"
    );
}

/// Redis stops for 10 s (with an append-only file, so what it had is kept): the relay
/// waits it out and every message ends up in the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_is_waited_out_and_nothing_is_lost() {
    let redis = turnstile_test_support::RedisServer::spawn_with_args(&[
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
    ]);
    let dir = tempfile::tempdir().unwrap();
    let outbox = SqliteOutbox::open(dir.path().join("app.db")).await.unwrap();
    let publisher = RedisStreamsPublisher::connect(&redis.url()).await.unwrap();
    let relay = Relay::new(outbox.clone(), publisher).with_options(RelayOptions::new().backoff(
        turnstile::outbox::Backoff {
            base: Duration::from_millis(50),
            max: Duration::from_millis(500),
        },
    ));
    let shutdown = CancellationToken::new();
    let running = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { relay.run(shutdown).await })
    };
    let mut ids = HashSet::new();
    let enqueue = async |ids: &mut HashSet<String>| {
        for n in 0..30 {
            let message = Message::new("ledger", format!("k{}", n % 3), b"z".to_vec()).unwrap();
            ids.insert(message.id().to_owned());
            let mut transaction = outbox.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
            outbox.enqueue(&mut transaction, &message).await.unwrap();
            outbox.commit(transaction).await.unwrap();
        }
    };
    let drained = async || {
        for _ in 0..600 {
            if outbox.status(10).await.unwrap().pending == 0 {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    };
    enqueue(&mut ids).await;
    assert!(drained().await);
    redis.kill();
    enqueue(&mut ids).await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(outbox.status(10).await.unwrap().pending > 0);
    // The same directory: the append-only file brings back what Redis had.
    redis.restart();
    assert!(drained().await, "{:?}", outbox.status(10).await.unwrap());
    shutdown.cancel();
    running.await.unwrap().unwrap();
    let mut connection = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let entries: redis::Value = redis::cmd("XRANGE")
        .arg("ledger")
        .arg("-")
        .arg("+")
        .query_async(&mut connection)
        .await
        .unwrap();
    let mut seen = HashSet::new();
    if let redis::Value::Array(items) = entries {
        for item in items {
            if let redis::Value::Array(pair) = item
                && let Some(redis::Value::Array(fields)) = pair.get(1)
            {
                for field in fields.chunks(2) {
                    if let [
                        redis::Value::BulkString(name),
                        redis::Value::BulkString(value),
                    ] = field
                        && name == b"id"
                    {
                        seen.insert(String::from_utf8(value.clone()).unwrap());
                    }
                }
            }
        }
    }
    assert!(
        seen.is_superset(&ids),
        "lost {} messages",
        ids.difference(&seen).count()
    );
}

/// The fields of a stream entry, by name.
fn fields(entry: &redis::Value) -> BTreeMap<String, Vec<u8>> {
    let mut found = BTreeMap::new();
    if let redis::Value::Array(pair) = entry
        && let Some(redis::Value::Array(fields)) = pair.get(1)
    {
        for field in fields.chunks(2) {
            if let [
                redis::Value::BulkString(name),
                redis::Value::BulkString(value),
            ] = field
            {
                found.insert(String::from_utf8(name.clone()).unwrap(), value.clone());
            }
        }
    }
    found
}

/// An entry whose handler always fails stays pending and comes back only once it has
/// been idle the delay (the others are handled meanwhile), is tried exactly
/// `max_deliveries` times (Redis's delivery count), then is appended once to
/// `{stream}:dead-letter` with its fields and the reason, and acknowledged at once with
/// it; the consumer then has nothing left to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_entry_is_retried_after_a_delay_then_dead_lettered() {
    let redis = shared_redis();
    let stream = turnstile_test_support::unique_name("poison");
    let publisher = RedisStreamsPublisher::connect(&redis.url()).await.unwrap();
    let mut poison_id = String::new();
    for n in 0..10_u64 {
        let message = Message::new(
            stream.as_str(),
            format!("k{}", n % 2),
            format!("m{n}").into_bytes(),
        )
        .unwrap();
        if n == 3 {
            poison_id = message.id().to_owned();
        }
        publisher.publish(&message, n + 1).await.unwrap();
    }
    let consumer = RedisStreamsConsumer::connect(&redis.url(), &stream, "projection", "c1")
        .await
        .unwrap()
        .max_deliveries(3);
    assert_eq!(
        consumer.dead_letter_stream(),
        format!("{stream}:dead-letter")
    );
    let delay = Duration::from_millis(300);
    let mut attempts: Vec<(std::time::Instant, u64)> = Vec::new();
    let mut handled: Vec<Vec<u8>> = Vec::new();
    let mut total = turnstile::outbox::Processed::default();
    let mut calls = 0;
    while calls < 60 && (total.dead_lettered == 0 || handled.len() < 9) {
        calls += 1;
        let done = consumer
            .process(20, Duration::from_millis(100), delay, async |incoming| {
                if incoming.payload == b"m3" {
                    attempts.push((std::time::Instant::now(), incoming.deliveries));
                    return Err(turnstile::Error::new(turnstile::ErrorKind::Store, "poison"));
                }
                handled.push(incoming.payload.clone());
                Ok(())
            })
            .await
            .unwrap();
        total.acked += done.acked;
        total.retried += done.retried;
        total.dead_lettered += done.dead_lettered;
    }
    assert_eq!(
        handled.len(),
        9,
        "each other entry handled once: {handled:?}"
    );
    assert_eq!(
        attempts.iter().map(|(_, n)| *n).collect::<Vec<_>>(),
        [1, 2, 3],
        "the poison entry is tried max_deliveries times, counted"
    );
    for pair in attempts.windows(2) {
        let gap = pair[1].0 - pair[0].0;
        // Idle time is counted from the delivery, a little before the handler ran.
        assert!(
            gap + Duration::from_millis(20) >= delay,
            "retried after {gap:?}, before the delay"
        );
    }
    assert_eq!(
        total,
        turnstile::outbox::Processed {
            acked: 9,
            retried: 2,
            dead_lettered: 1,
            early: 0
        }
    );
    // Nothing comes back: the consumer does not loop.
    tokio::time::sleep(delay).await;
    for _ in 0..3 {
        let done = consumer
            .process(20, Duration::from_millis(100), delay, async |_| {
                panic!("an entry came back")
            })
            .await
            .unwrap();
        assert_eq!(done, turnstile::outbox::Processed::default());
    }
    let mut connection = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let pending: redis::Value = redis::cmd("XPENDING")
        .arg(&stream)
        .arg("projection")
        .query_async(&mut connection)
        .await
        .unwrap();
    let redis::Value::Array(summary) = pending else {
        panic!("{pending:?}")
    };
    assert_eq!(
        summary.first(),
        Some(&redis::Value::Int(0)),
        "nothing pending"
    );
    let dead: redis::Value = redis::cmd("XRANGE")
        .arg(consumer.dead_letter_stream())
        .arg("-")
        .arg("+")
        .query_async(&mut connection)
        .await
        .unwrap();
    let redis::Value::Array(dead) = dead else {
        panic!("{dead:?}")
    };
    assert_eq!(dead.len(), 1, "one copy in the dead-letter stream");
    let copy = fields(&dead[0]);
    assert_eq!(copy["payload"], b"m3");
    assert_eq!(copy["id"], poison_id.as_bytes());
    assert_eq!(copy["key"], b"k1");
    let reason = String::from_utf8(copy[turnstile::outbox::DEAD_LETTER_REASON_HEADER].clone());
    assert!(reason.unwrap().ends_with("poison"));
    assert_eq!(copy[turnstile::outbox::DEAD_LETTER_DELIVERIES_HEADER], b"3");
    assert_eq!(
        copy[turnstile::outbox::DEAD_LETTER_SOURCE_HEADER],
        stream.as_bytes()
    );
    assert!(copy.contains_key(turnstile::outbox::DEAD_LETTER_POSITION_HEADER));
}

impl outbox_in_order::Consumer for RedisStreamsConsumer {
    async fn process_batch<F>(
        &self,
        retry_after: Duration,
        handle: F,
    ) -> turnstile::Result<turnstile::outbox::Processed>
    where
        F: AsyncFnMut(&turnstile::outbox::Incoming) -> turnstile::Result<()>,
    {
        self.process(20, Duration::from_millis(100), retry_after, handle)
            .await
    }
}

/// An entry its handler always fails is dead-lettered; the key's later entries, which
/// come back as out of order meanwhile (Redis's delivery count is put back each time),
/// are never dead-lettered, and go on in order once the inbox skips the dead one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_lettered_message_parks_its_key_until_skipped() {
    let redis = shared_redis();
    let stream = turnstile_test_support::unique_name("parked");
    let publisher = RedisStreamsPublisher::connect(&redis.url()).await.unwrap();
    let consumer = RedisStreamsConsumer::connect(&redis.url(), &stream, "projection", "c1")
        .await
        .unwrap()
        .max_deliveries(3);
    outbox_in_order::a_dead_lettered_message_parks_its_key_until_skipped(
        &publisher, &stream, &consumer, 3,
    )
    .await;
}
