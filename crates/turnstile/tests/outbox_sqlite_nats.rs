//! The outbox on SQLite relayed to a real NATS JetStream server: nothing lost, order
//! kept per key, rolled-back messages never sent, several relays at once, a poison
//! message parks only its key, a broker outage is waited out, and a duplicate window
//! too short for the relay's redelivery is refused.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use async_nats::jetstream;
use tokio_util::sync::CancellationToken;
use turnstile::outbox::nats::JetStreamPublisher;
use turnstile::outbox::relay::{Relay, RelayOptions};
use turnstile::outbox::sqlite::SqliteOutbox;
use turnstile::outbox::{Backoff, Message, OutboxStore};
use turnstile_test_support::NatsServer;

async fn stream(publisher: &JetStreamPublisher, name: &str, subjects: &str, window: Duration) {
    publisher
        .jetstream()
        .create_stream(jetstream::stream::Config {
            name: name.to_owned(),
            subjects: vec![subjects.to_owned()],
            duplicate_window: window,
            ..Default::default()
        })
        .await
        .unwrap();
}

/// Every message of the stream, in stream order, as (key, seq, id).
async fn read_all(publisher: &JetStreamPublisher, name: &str) -> Vec<(String, u64, String)> {
    let mut stream = publisher.jetstream().get_stream(name).await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut messages = Vec::new();
    for sequence in 1..=last {
        let message = stream.get_raw_message(sequence).await.unwrap();
        let header = |name: &str| message.headers.get(name).unwrap().as_str().to_owned();
        messages.push((
            header("Turnstile-Key"),
            header("Turnstile-Seq").parse().unwrap(),
            header("Nats-Msg-Id"),
        ));
    }
    messages
}

/// Enqueues `count` messages over `keys` keys, one transaction each; every seventh
/// transaction is rolled back. Returns the ids that committed.
async fn enqueue(outbox: &SqliteOutbox, topic: &str, keys: usize, count: usize) -> HashSet<String> {
    let mut committed = HashSet::new();
    for n in 0..count {
        let message = Message::json(
            topic,
            format!("{topic}/account-{}", n % keys),
            &serde_json::json!({"n": n}),
        )
        .unwrap();
        let mut transaction = outbox.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
        outbox.enqueue(&mut transaction, &message).await.unwrap();
        if n % 7 == 6 {
            transaction.rollback().await.unwrap();
        } else {
            outbox.commit(transaction).await.unwrap();
            committed.insert(message.id().to_owned());
        }
    }
    committed
}

/// Checks what reached the stream: exactly the committed ids, once each, and each
/// key's messages in sequence order without gaps.
fn check_delivery(delivered: &[(String, u64, String)], committed: &HashSet<String>) {
    let ids: HashSet<String> = delivered.iter().map(|(_, _, id)| id.clone()).collect();
    assert_eq!(
        ids.len(),
        delivered.len(),
        "a message reached the stream twice"
    );
    assert_eq!(&ids, committed, "lost or extra messages");
    let mut last: BTreeMap<&str, u64> = BTreeMap::new();
    for (key, seq, _) in delivered {
        let previous = last.insert(key, *seq).unwrap_or(0);
        assert_eq!(*seq, previous + 1, "key {key}: seq {seq} after {previous}");
    }
}

async fn wait_until_empty(outbox: &SqliteOutbox) {
    for _ in 0..600 {
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
async fn three_relays_deliver_every_committed_message_once_in_key_order() {
    let nats = NatsServer::spawn();
    let publisher = JetStreamPublisher::connect(&nats.url(), Duration::from_secs(5))
        .await
        .unwrap();
    stream(
        &publisher,
        "PAYMENTS",
        "payments.>",
        Duration::from_secs(120),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let outbox = SqliteOutbox::open(&path).await.unwrap();
    let shutdown = CancellationToken::new();
    let mut relays = Vec::new();
    // Three relays, each with its own connections to the file, as three processes
    // would have; small rounds so that they contend for keys.
    for _ in 0..3 {
        let store = SqliteOutbox::open(&path).await.unwrap();
        let relay = Relay::new(store, publisher.clone())
            .with_options(RelayOptions::new().max_keys(3).per_key(4));
        let shutdown = shutdown.clone();
        relays.push(tokio::spawn(async move { relay.run(shutdown).await }));
    }
    let committed = enqueue(&outbox, "payments.created", 12, 400).await;
    wait_until_empty(&outbox).await;
    shutdown.cancel();
    for relay in relays {
        relay.await.unwrap().unwrap();
    }
    check_delivery(&read_all(&publisher, "PAYMENTS").await, &committed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_parks_its_key_while_the_others_flow() {
    let nats = NatsServer::spawn();
    let publisher = JetStreamPublisher::connect(&nats.url(), Duration::from_secs(5))
        .await
        .unwrap();
    stream(&publisher, "ORDERS", "orders.>", Duration::from_secs(120)).await;
    let dir = tempfile::tempdir().unwrap();
    let outbox = SqliteOutbox::open(dir.path().join("app.db")).await.unwrap();
    // Larger than the server's max_payload (1 MiB): refused for good.
    let poison = Message::new("orders.created", "poisoned", vec![b'x'; 2 * 1024 * 1024]).unwrap();
    let behind = Message::new("orders.created", "poisoned", b"behind".to_vec()).unwrap();
    let mut transaction = outbox.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    outbox.enqueue(&mut transaction, &poison).await.unwrap();
    outbox.enqueue(&mut transaction, &behind).await.unwrap();
    outbox.commit(transaction).await.unwrap();
    let committed = enqueue(&outbox, "orders.created", 4, 40).await;
    let relay = Relay::new(outbox.clone(), publisher.clone()).with_options(
        RelayOptions::new().max_attempts(2).backoff(Backoff {
            base: Duration::from_millis(10),
            max: Duration::from_millis(50),
        }),
    );
    let mut parked = 0;
    for _ in 0..200 {
        parked += relay.run_once().await.unwrap().parked;
        let status = outbox.status(10).await.unwrap();
        if parked > 0 && status.pending == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let status = outbox.status(10).await.unwrap();
    assert_eq!(parked, 1);
    assert_eq!(status.pending, 0, "other keys did not flow: {status:?}");
    assert_eq!(status.parked.len(), 1);
    assert_eq!(status.parked[0].key, "poisoned");
    assert_eq!(
        status.parked[0].pending, 2,
        "the key's messages must wait behind it"
    );
    assert!(status.parked[0].reason.is_some());
    check_delivery(&read_all(&publisher, "ORDERS").await, &committed);
    // Redrive puts it back in line (it fails again here: the broker still refuses it).
    assert!(outbox.redrive("poisoned").await.unwrap());
    assert!(!outbox.redrive("poisoned").await.unwrap());
    assert!(outbox.status(10).await.unwrap().parked.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_is_waited_out_and_nothing_is_lost() {
    let nats = NatsServer::spawn();
    let publisher = JetStreamPublisher::connect(&nats.url(), Duration::from_secs(5))
        .await
        .unwrap();
    stream(&publisher, "LEDGER", "ledger.>", Duration::from_secs(120)).await;
    let dir = tempfile::tempdir().unwrap();
    let outbox = SqliteOutbox::open(dir.path().join("app.db")).await.unwrap();
    let shutdown = CancellationToken::new();
    let relay = Relay::new(outbox.clone(), publisher.clone()).with_options(
        RelayOptions::new().backoff(Backoff {
            base: Duration::from_millis(50),
            max: Duration::from_millis(500),
        }),
    );
    let running = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { relay.run(shutdown).await })
    };
    let mut committed = enqueue(&outbox, "ledger.entry", 5, 50).await;
    wait_until_empty(&outbox).await;
    nats.stop();
    committed.extend(enqueue(&outbox, "ledger.entry", 5, 50).await);
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(outbox.status(10).await.unwrap().pending > 0);
    nats.start_again();
    wait_until_empty(&outbox).await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    assert!(outbox.status(10).await.unwrap().parked.is_empty());
    check_delivery(&read_all(&publisher, "LEDGER").await, &committed);
}

#[tokio::test]
async fn a_duplicate_window_shorter_than_redelivery_is_refused() {
    let nats = NatsServer::spawn();
    let publisher = JetStreamPublisher::connect(&nats.url(), Duration::from_secs(5))
        .await
        .unwrap();
    stream(&publisher, "SHORT", "short.>", Duration::from_secs(5)).await;
    let dir = tempfile::tempdir().unwrap();
    let outbox = SqliteOutbox::open(dir.path().join("app.db")).await.unwrap();
    enqueue(&outbox, "short.x", 1, 1).await;
    let relay = Relay::new(outbox.clone(), publisher.clone());
    let error = relay.run_once().await.unwrap_err();
    assert_eq!(error.kind(), turnstile::ErrorKind::Configuration, "{error}");
    assert!(error.to_string().contains("duplicate_window"), "{error}");
    // A subject no stream takes is refused the same way.
    enqueue(&outbox, "nowhere.x", 1, 1).await;
    let short = Relay::new(outbox.clone(), publisher.clone()).with_options(
        RelayOptions::new()
            .lease(Duration::from_secs(1))
            .backoff(Backoff {
                base: Duration::from_millis(10),
                max: Duration::from_millis(100),
            }),
    );
    let mut refusal = None;
    for _ in 0..5 {
        if let Err(error) = short.run_once().await {
            refusal = Some(error);
            break;
        }
    }
    let refusal = refusal.expect("a subject without a stream was relayed");
    assert_eq!(
        refusal.kind(),
        turnstile::ErrorKind::Configuration,
        "{refusal}"
    );
}
