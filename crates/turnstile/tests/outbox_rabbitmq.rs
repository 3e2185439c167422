//! The outbox on SQLite relayed to a real RabbitMQ node: publisher confirms, persistent
//! messages, mandatory routing (an unroutable message parks its key), a broker outage
//! waited out, and a queue consumer whose inbox skips copies and redeliveries.

mod outbox_projection;

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use futures_util::StreamExt as _;
use outbox_projection::Projection;
use tokio_util::sync::CancellationToken;
use turnstile::outbox::rabbitmq::{RabbitMqConsumer, RabbitMqPublisher};
use turnstile::outbox::relay::{Publisher, Relay, RelayOptions};
use turnstile::outbox::sqlite::SqliteOutbox;
use turnstile::outbox::{Backoff, Message, OutboxStore};
use turnstile_test_support::{RabbitMqServer, shared_rabbitmq, unique_name};

/// Declares a durable queue bound to exchange `turnstile` for `routing`.
async fn queue(url: &str, name: &str, routing: &str) {
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
    use lapin::types::FieldTable;
    let connection = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .exchange_declare(
            "turnstile".into(),
            lapin::ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    channel
        .queue_declare(
            name.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    channel
        .queue_bind(
            name.into(),
            "turnstile".into(),
            routing.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let _ = connection.close(200, "done".into()).await;
}

async fn enqueue(outbox: &SqliteOutbox, message: &Message) -> u64 {
    let mut transaction = outbox.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    let seq = outbox.enqueue(&mut transaction, message).await.unwrap();
    outbox.commit(transaction).await.unwrap();
    seq
}

async fn drain(outbox: &SqliteOutbox) {
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
async fn copies_and_redeliveries_are_handled_once_in_key_order() {
    let rabbit = shared_rabbitmq();
    let topic = unique_name("payments").replace('-', "_");
    let queue_name = format!("{topic}.q");
    queue(&rabbit.url(), &queue_name, &topic).await;
    let dir = tempfile::tempdir().unwrap();
    let outbox = SqliteOutbox::open(dir.path().join("app.db")).await.unwrap();
    let publisher = RabbitMqPublisher::connect(&rabbit.url(), "turnstile")
        .await
        .unwrap();
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();
    let mut by_key: BTreeMap<String, Vec<(Message, u64)>> = BTreeMap::new();
    for n in 0..90_i64 {
        let account = format!("acct-{}", n % 6);
        *expected.entry(account.clone()).or_default() += n;
        let message = Message::json(
            topic.as_str(),
            account.as_str(),
            &serde_json::json!({"account": account, "cents": n}),
        )
        .unwrap();
        let seq = enqueue(&outbox, &message).await;
        by_key.entry(account).or_default().push((message, seq));
    }
    // A relay that published the first two messages of every key, then died.
    for messages in by_key.values() {
        for (message, seq) in &messages[..2] {
            publisher.publish(message, *seq).await.unwrap();
        }
    }
    let relay = Relay::new(outbox.clone(), publisher).with_options(RelayOptions::new().max_keys(2));
    while relay.run_once().await.unwrap().keys > 0 {}
    drain(&outbox).await;

    let mut projection = Projection::open(&dir.path().join("consumer.db")).await;
    let consumer = RabbitMqConsumer::connect(&rabbit.url(), &queue_name, "c1", 20)
        .await
        .unwrap();
    let mut crashed = 0;
    for _ in 0..100 {
        let done = consumer
            .process(50, Duration::from_millis(200), async |incoming| {
                let cents = projection.apply(incoming).await?;
                // Dies between its commit and its ack: the message comes back.
                if incoming.deliveries == 1 && cents % 7 == 0 {
                    crashed += 1;
                    return Err(turnstile::Error::new(
                        turnstile::ErrorKind::Store,
                        "crashed before the ack",
                    ));
                }
                Ok(())
            })
            .await
            .unwrap();
        if done.acked == 0 && done.retried == 0 && projection.handled == 90 {
            break;
        }
    }
    assert_eq!(projection.handled, 90, "each message handled once");
    assert!(crashed > 0);
    assert_eq!(
        projection.skipped,
        12 + crashed,
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
async fn an_unroutable_message_parks_its_key() {
    let rabbit = shared_rabbitmq();
    let routed = unique_name("routed").replace('-', "_");
    queue(&rabbit.url(), &format!("{routed}.q"), &routed).await;
    let dir = tempfile::tempdir().unwrap();
    let outbox = SqliteOutbox::open(dir.path().join("app.db")).await.unwrap();
    enqueue(
        &outbox,
        &Message::new("nobody.listens", "lonely", b"x".to_vec()).unwrap(),
    )
    .await;
    for n in 0..10 {
        enqueue(
            &outbox,
            &Message::new(routed.as_str(), format!("k{}", n % 3), b"y".to_vec()).unwrap(),
        )
        .await;
    }
    let publisher = RabbitMqPublisher::connect(&rabbit.url(), "turnstile")
        .await
        .unwrap();
    let relay = Relay::new(outbox.clone(), publisher).with_options(
        RelayOptions::new().max_attempts(2).backoff(Backoff {
            base: Duration::from_millis(10),
            max: Duration::from_millis(50),
        }),
    );
    for _ in 0..100 {
        relay.run_once().await.unwrap();
        let status = outbox.status(10).await.unwrap();
        if status.pending == 0 && !status.parked.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let status = outbox.status(10).await.unwrap();
    assert_eq!(status.pending, 0, "{status:?}");
    assert_eq!(status.parked.len(), 1);
    assert_eq!(status.parked[0].key, "lonely");
    assert!(
        status.parked[0]
            .reason
            .as_deref()
            .unwrap_or("")
            .contains("no queue is bound")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_is_waited_out_and_nothing_is_lost() {
    let rabbit = RabbitMqServer::spawn();
    queue(&rabbit.url(), "ledger.q", "ledger").await;
    let dir = tempfile::tempdir().unwrap();
    let outbox = SqliteOutbox::open(dir.path().join("app.db")).await.unwrap();
    let publisher = RabbitMqPublisher::connect(&rabbit.url(), "turnstile")
        .await
        .unwrap();
    let relay =
        Relay::new(outbox.clone(), publisher).with_options(RelayOptions::new().backoff(Backoff {
            base: Duration::from_millis(50),
            max: Duration::from_millis(500),
        }));
    let shutdown = CancellationToken::new();
    let running = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { relay.run(shutdown).await })
    };
    let mut ids = HashSet::new();
    for n in 0..40 {
        let message = Message::new("ledger", format!("k{}", n % 4), b"z".to_vec()).unwrap();
        ids.insert(message.id().to_owned());
        enqueue(&outbox, &message).await;
    }
    drain(&outbox).await;
    rabbit.stop();
    for n in 0..40 {
        let message = Message::new("ledger", format!("k{}", n % 4), b"z".to_vec()).unwrap();
        ids.insert(message.id().to_owned());
        enqueue(&outbox, &message).await;
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(outbox.status(10).await.unwrap().pending > 0);
    rabbit.start_again();
    drain(&outbox).await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    assert!(outbox.status(10).await.unwrap().parked.is_empty());
    // Every message is in the durable queue (persistent, confirmed): at least once each.
    let connection =
        lapin::Connection::connect(&rabbit.url(), lapin::ConnectionProperties::default())
            .await
            .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let mut consumer = channel
        .basic_consume(
            "ledger.q".into(),
            "check".into(),
            lapin::options::BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    let mut seen = HashSet::new();
    while let Ok(Some(delivery)) =
        tokio::time::timeout(Duration::from_secs(2), consumer.next()).await
    {
        let delivery = delivery.unwrap();
        seen.insert(
            delivery
                .properties
                .message_id()
                .as_ref()
                .unwrap()
                .as_str()
                .to_owned(),
        );
        if seen == ids {
            break;
        }
    }
    assert_eq!(seen, ids, "lost messages");
}
