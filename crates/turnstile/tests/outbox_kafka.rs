//! The outbox on SQLite relayed to Kafka — librdkafka's mock cluster, since there is no
//! Kafka server on these machines — and a consumer group reading it through the inbox:
//! copies from a dead relay and redeliveries after a failed handler are skipped, every
//! key is handled in order, and a broker outage loses nothing.

mod outbox_projection;

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use outbox_projection::Projection;
use rdkafka::mocking::MockCluster;
use tokio_util::sync::CancellationToken;
use turnstile::outbox::kafka::{KafkaConsumer, KafkaPublisher};
use turnstile::outbox::relay::{Publisher, Relay, RelayOptions};
use turnstile::outbox::sqlite::SqliteOutbox;
use turnstile::outbox::{Backoff, Message, OutboxStore};

async fn enqueue(outbox: &SqliteOutbox, message: &Message) -> u64 {
    let mut transaction = outbox.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    let seq = outbox.enqueue(&mut transaction, message).await.unwrap();
    outbox.commit(transaction).await.unwrap();
    seq
}

async fn drain(outbox: &SqliteOutbox) {
    for _ in 0..1200 {
        if outbox.status(10).await.unwrap().pending == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "the outbox did not drain: {:?}",
        outbox.status(10).await.unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_and_redeliveries_are_handled_once_in_key_order() {
    let cluster = MockCluster::new(1).unwrap();
    cluster.create_topic("payments", 4, 1).unwrap();
    let url = format!("kafka://{}", cluster.bootstrap_servers());
    let dir = tempfile::tempdir().unwrap();
    let outbox = SqliteOutbox::open(dir.path().join("app.db")).await.unwrap();
    let publisher = KafkaPublisher::connect(&url).unwrap();
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();
    for n in 0..96_i64 {
        let account = format!("acct-{}", n % 8);
        *expected.entry(account.clone()).or_default() += n;
        let message = Message::json(
            "payments",
            account.as_str(),
            &serde_json::json!({"account": account, "cents": n}),
        )
        .unwrap();
        enqueue(&outbox, &message).await;
    }
    // A relay that published the first two messages of every key, as it read them from
    // the store, then died without recording them (its lease runs out).
    for leased in outbox
        .claim(8, 2, Duration::from_millis(200))
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
    let relay = Relay::new(outbox.clone(), publisher).with_options(RelayOptions::new().max_keys(3));
    while relay.run_once().await.unwrap().keys > 0 {}
    drain(&outbox).await;

    let mut projection = Projection::open(&dir.path().join("consumer.db")).await;
    let consumer = KafkaConsumer::connect(&url, "payments", "projection").unwrap();

    let mut crashed: HashSet<String> = HashSet::new();
    for _ in 0..400 {
        consumer
            .process(
                50,
                Duration::from_millis(500),
                Duration::from_millis(10),
                async |incoming| {
                    let cents = projection.apply(incoming).await?;
                    // Dies between its commit and its offset commit, once per such message.
                    if cents % 7 == 0 && crashed.insert(incoming.inbox_id().unwrap()) {
                        return Err(turnstile::Error::new(
                            turnstile::ErrorKind::Store,
                            "crashed before the commit",
                        ));
                    }
                    Ok(())
                },
            )
            .await
            .unwrap();
        if projection.handled == 96 && projection.skipped >= 16 + crashed.len() {
            break;
        }
    }
    assert_eq!(projection.handled, 96, "each message handled once");
    assert!(!crashed.is_empty());
    assert_eq!(
        projection.skipped,
        16 + crashed.len(),
        "each copy and each redelivery skipped"
    );
    assert_eq!(
        projection.out_of_order, 0,
        "a key's messages were handled out of order"
    );
    let totals = projection.totals().await;
    assert_eq!(totals, expected.into_iter().collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_is_waited_out_and_nothing_is_lost() {
    let cluster = MockCluster::new(1).unwrap();
    cluster.create_topic("ledger", 2, 1).unwrap();
    let url = format!("kafka://{}", cluster.bootstrap_servers());
    let dir = tempfile::tempdir().unwrap();
    let outbox = SqliteOutbox::open(dir.path().join("app.db")).await.unwrap();
    let relay = Relay::new(outbox.clone(), KafkaPublisher::connect(&url).unwrap()).with_options(
        RelayOptions::new().backoff(Backoff {
            base: Duration::from_millis(50),
            max: Duration::from_millis(500),
        }),
    );
    let shutdown = CancellationToken::new();
    let running = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { relay.run(shutdown).await })
    };
    let mut ids = HashSet::new();
    for n in 0..30 {
        let message = Message::new("ledger", format!("k{}", n % 3), b"z".to_vec()).unwrap();
        ids.insert(message.id().to_owned());
        enqueue(&outbox, &message).await;
    }
    drain(&outbox).await;
    cluster.broker_down(1).unwrap();
    for n in 0..30 {
        let message = Message::new("ledger", format!("k{}", n % 3), b"z".to_vec()).unwrap();
        ids.insert(message.id().to_owned());
        enqueue(&outbox, &message).await;
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(outbox.status(10).await.unwrap().pending > 0);
    cluster.broker_up(1).unwrap();
    drain(&outbox).await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    assert!(outbox.status(10).await.unwrap().parked.is_empty());
    // Every message is in the topic.
    let consumer = KafkaConsumer::connect(&url, "ledger", "check").unwrap();
    let mut seen = HashSet::new();
    for _ in 0..100 {
        consumer
            .process(
                100,
                Duration::from_millis(500),
                Duration::from_millis(10),
                async |incoming| {
                    seen.insert(incoming.id.clone().unwrap());
                    Ok(())
                },
            )
            .await
            .unwrap();
        if seen.is_superset(&ids) {
            break;
        }
    }
    assert!(
        seen.is_superset(&ids),
        "lost {} messages",
        ids.difference(&seen).count()
    );
}

/// librdkafka keeps delivering a message for up to its `message.timeout.ms` after the
/// publish began, whatever became of the call: a relay whose lease cannot hold that
/// with a margin refuses to run (a late copy would land after the next relay's later
/// messages), and nothing is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_too_short_for_the_producers_delivery_timeout_is_refused() {
    let cluster = MockCluster::new(1).unwrap();
    cluster.create_topic("late", 1, 1).unwrap();
    let url = format!("kafka://{}", cluster.bootstrap_servers());
    let dir = tempfile::tempdir().unwrap();
    let outbox = SqliteOutbox::open(dir.path().join("app.db")).await.unwrap();
    enqueue(&outbox, &Message::new("late", "k", b"x".to_vec()).unwrap()).await;
    let publisher = KafkaPublisher::connect(&url).unwrap();
    let longest = publisher.longest_publish().unwrap();
    let short = Relay::new(outbox.clone(), publisher.clone())
        .with_options(RelayOptions::new().lease(longest));
    let error = short.run_once().await.unwrap_err();
    assert_eq!(error.kind(), turnstile::ErrorKind::Configuration, "{error}");
    assert_eq!(outbox.status(10).await.unwrap().pending, 1);
    // With room for the delivery timeout and a margin, the same message goes out.
    let roomy =
        Relay::new(outbox.clone(), publisher).with_options(RelayOptions::new().lease(longest * 2));
    assert_eq!(roomy.run_once().await.unwrap().published, 1);
}

/// A message whose handler always fails no longer makes the consumer loop on it: its
/// partition is paused for the delay, the message is
/// tried exactly `max_deliveries` times, then produced once to `{topic}.dead-letter`
/// with its key, payload and headers, its offset committed, and the messages behind it
/// in its partition handled in order; the consumer then has nothing left to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_is_retried_after_a_delay_then_dead_lettered() {
    let cluster = MockCluster::new(1).unwrap();
    cluster.create_topic("orders", 2, 1).unwrap();
    cluster.create_topic("orders.dead-letter", 1, 1).unwrap();
    let url = format!("kafka://{}", cluster.bootstrap_servers());
    let publisher = KafkaPublisher::connect(&url).unwrap();
    let mut poison_id = String::new();
    for n in 0..12_u64 {
        let message = Message::new(
            "orders",
            format!("k{}", n % 2),
            format!("m{n}").into_bytes(),
        )
        .unwrap();
        if n == 2 {
            poison_id = message.id().to_owned();
        }
        publisher.publish(&message, n / 2 + 1).await.unwrap();
    }
    let consumer = KafkaConsumer::connect(&url, "orders", "poison")
        .unwrap()
        .max_deliveries(3);
    // Longer than librdkafka takes to fetch a partition again after a seek (up to
    // `fetch.wait.max.ms`, 500 ms), so that a retry without the pause would show.
    let delay = Duration::from_millis(1500);
    let mut attempts: Vec<(std::time::Instant, u64)> = Vec::new();
    let mut handled: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut total = turnstile::outbox::Processed::default();
    let mut calls = 0;
    while calls < 100 && (total.dead_lettered == 0 || total.acked < 11) {
        calls += 1;
        let done = consumer
            .process(20, Duration::from_millis(500), delay, async |incoming| {
                if incoming.payload == b"m2" {
                    attempts.push((std::time::Instant::now(), incoming.deliveries));
                    return Err(turnstile::Error::new(turnstile::ErrorKind::Store, "poison"));
                }
                handled
                    .entry(incoming.key.clone().unwrap())
                    .or_default()
                    .push(incoming.seq.unwrap());
                Ok(())
            })
            .await
            .unwrap();
        total.acked += done.acked;
        total.retried += done.retried;
        total.dead_lettered += done.dead_lettered;
    }
    assert_eq!(
        attempts.iter().map(|(_, n)| *n).collect::<Vec<_>>(),
        [1, 2, 3],
        "the poison message is tried max_deliveries times, counted"
    );
    for pair in attempts.windows(2) {
        let gap = pair[1].0 - pair[0].0;
        assert!(gap >= delay, "retried after {gap:?}, before the delay");
    }
    // Every other message once, in order: k0's messages behind the poison one (its
    // seq 2) after it was dead-lettered.
    assert_eq!(handled["k0"], [1, 3, 4, 5, 6]);
    assert_eq!(handled["k1"], [1, 2, 3, 4, 5, 6]);
    assert_eq!(
        total,
        turnstile::outbox::Processed {
            acked: 11,
            retried: 2,
            dead_lettered: 1,
            early: 0
        }
    );
    // Nothing comes back: the consumer does not loop.
    for _ in 0..3 {
        let done = consumer
            .process(20, Duration::from_millis(300), delay, async |_| {
                panic!("a message came back")
            })
            .await
            .unwrap();
        assert_eq!(done, turnstile::outbox::Processed::default());
    }
    // One copy in the dead-letter topic, with the original's key, payload and headers.
    let check = KafkaConsumer::connect(&url, "orders.dead-letter", "check").unwrap();
    let mut copies = Vec::new();
    for _ in 0..40 {
        check
            .process(10, Duration::from_millis(500), delay, async |incoming| {
                copies.push(incoming.clone());
                Ok(())
            })
            .await
            .unwrap();
        if !copies.is_empty() {
            break;
        }
    }
    check
        .process(10, Duration::from_millis(500), delay, async |incoming| {
            copies.push(incoming.clone());
            Ok(())
        })
        .await
        .unwrap();
    assert_eq!(copies.len(), 1, "one copy in the dead-letter topic");
    let copy = &copies[0];
    assert_eq!(copy.payload, b"m2");
    assert_eq!(copy.id.as_deref(), Some(poison_id.as_str()));
    assert_eq!(copy.key.as_deref(), Some("k0"));
    assert_eq!(copy.seq, Some(2));
    assert_eq!(
        copy.header(turnstile::outbox::DEAD_LETTER_DELIVERIES_HEADER),
        Some("3")
    );
    assert_eq!(
        copy.header(turnstile::outbox::DEAD_LETTER_SOURCE_HEADER),
        Some("orders")
    );
    assert!(
        copy.header(turnstile::outbox::DEAD_LETTER_REASON_HEADER)
            .unwrap()
            .ends_with("poison")
    );
    assert!(
        copy.header(turnstile::outbox::DEAD_LETTER_POSITION_HEADER)
            .is_some()
    );
}
