//! The outbox on SQLite relayed to Redis Streams, consumed by a consumer group through
//! the inbox: Redis keeps every copy a relay publishes, and the inbox is what makes
//! handling effectively once.

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
    let mut ids = HashSet::new();
    let mut by_key: BTreeMap<String, Vec<(Message, u64)>> = BTreeMap::new();
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
        let seq = outbox.enqueue(&mut transaction, &message).await.unwrap();
        outbox.commit(transaction).await.unwrap();
        ids.insert(message.id().to_owned());
        by_key.entry(account).or_default().push((message, seq));
    }
    // A relay that published the first three messages of every key and died before
    // recording it: the copies are in the stream, and the next relay publishes those
    // messages again.
    for messages in by_key.values() {
        for (message, seq) in &messages[..3] {
            publisher.publish(message, *seq).await.unwrap();
        }
    }
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
