//! The outbox on SQLite relayed to a real RabbitMQ node: publisher confirms, persistent
//! messages, mandatory routing (an unroutable message parks its key), a broker outage
//! waited out, and a queue consumer whose inbox skips copies and redeliveries.

mod outbox_in_order;
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
use turnstile_test_support::{RabbitMqServer, TcpProxy, shared_rabbitmq, unique_name};

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
    for n in 0..90_i64 {
        let account = format!("acct-{}", n % 6);
        *expected.entry(account.clone()).or_default() += n;
        let message = Message::json(
            topic.as_str(),
            account.as_str(),
            &serde_json::json!({"account": account, "cents": n}),
        )
        .unwrap();
        enqueue(&outbox, &message).await;
    }
    // A relay that published the first two messages of every key, as it read them from
    // the store (with the outbox's identity), then died without recording them (its
    // lease runs out).
    for leased in outbox
        .claim(6, 2, Duration::from_millis(200))
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
            .process(
                50,
                Duration::from_millis(200),
                Duration::from_millis(20),
                async |incoming| {
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
                },
            )
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

/// While every publish fails (the broker is down), the whole relay pauses, longer each
/// time up to the longest backoff, instead of leasing the next keys at once only to fail
/// them too: with 40 keys, 4 a round and a backoff of 100 ms to 1 s, four seconds of
/// outage lease about 30 keys; without the pause, each key came round at its own
/// backoff, some 250 leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_is_down_pauses_the_whole_relay() {
    let rabbit = RabbitMqServer::spawn();
    let dir = tempfile::tempdir().unwrap();
    let outbox = SqliteOutbox::open(dir.path().join("app.db")).await.unwrap();
    let publisher = RabbitMqPublisher::connect(&rabbit.url(), "turnstile")
        .await
        .unwrap();
    rabbit.stop();
    for n in 0..40 {
        let message = Message::new("ledger", format!("k{n}"), b"z".to_vec()).unwrap();
        enqueue(&outbox, &message).await;
    }
    let relay = Relay::new(outbox.clone(), publisher).with_options(
        RelayOptions::new().max_keys(4).backoff(Backoff {
            base: Duration::from_millis(100),
            max: Duration::from_secs(1),
        }),
    );
    let shutdown = CancellationToken::new();
    let running = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { relay.run(shutdown).await })
    };
    tokio::time::sleep(Duration::from_secs(4)).await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    let leases: i64 = sqlx::query_scalar("SELECT sum(lease_token) FROM turnstile_outbox_keys")
        .fetch_one(outbox.pool())
        .await
        .unwrap();
    assert!(leases >= 4, "the relay did not try at all");
    assert!(leases <= 60, "{leases} leases in four seconds of outage");
    assert_eq!(outbox.status(10).await.unwrap().pending, 40);
}

/// A broker cut off by a partition is tried once per backoff, not once per publish:
/// before, each of a round's publishes reconnected in turn, each waiting out the
/// connect timeout (5 s) behind the one before, so a round of 16 keys took 80 s and
/// made 16 connection attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_behind_a_partition_is_not_reconnected_per_publish() {
    let rabbit = shared_rabbitmq();
    let proxy = TcpProxy::start(rabbit.port());
    let publisher = RabbitMqPublisher::connect(&proxy.url_for(&rabbit.url()), "turnstile")
        .await
        .unwrap();
    proxy.cut();
    proxy.close_connections();
    // Let the client see its connection end.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let attempts_before = proxy.accepted();
    let message = Message::new("ledger", "k", b"z".to_vec()).unwrap();
    let started = std::time::Instant::now();
    let publishes = (0..16u64).map(|seq| publisher.publish(&message, seq + 1));
    let answers = tokio::time::timeout(
        Duration::from_secs(40),
        futures_util::future::join_all(publishes),
    )
    .await
    .expect("publishes to an unreachable broker waited for each other");
    assert!(answers.iter().all(Result::is_err));
    let attempts = proxy.accepted() - attempts_before;
    assert!(
        attempts <= 1,
        "{attempts} connection attempts for 16 publishes"
    );
    assert!(
        started.elapsed() < Duration::from_secs(12),
        "16 failing publishes took {:?}",
        started.elapsed()
    );
}

/// Declares a durable quorum queue bound to exchange `turnstile` for `routing`.
async fn quorum_queue(url: &str, name: &str, routing: &str) {
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
    use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
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
    let mut arguments = FieldTable::default();
    arguments.insert(
        ShortString::from("x-queue-type"),
        AMQPValue::LongString(LongString::from("quorum".as_bytes().to_vec())),
    );
    channel
        .queue_declare(
            name.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            arguments,
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

/// Every message in `queue`, taken off it (basic.get, acknowledged).
async fn take_all(url: &str, queue: &str) -> Vec<lapin::message::BasicGetMessage> {
    let connection = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let mut taken = Vec::new();
    while let Some(message) = channel
        .basic_get(
            queue.into(),
            lapin::options::BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
    {
        taken.push(message);
    }
    let _ = connection.close(200, "done".into()).await;
    taken
}

fn header(properties: &lapin::BasicProperties, name: &str) -> Option<String> {
    properties
        .headers()
        .as_ref()?
        .inner()
        .iter()
        .find_map(|(key, value)| match value {
            lapin::types::AMQPValue::LongString(text) if key.as_str() == name => {
                Some(String::from_utf8_lossy(text.as_bytes()).into_owned())
            }
            _ => None,
        })
}

/// A message whose handler always fails no longer blocks the queue in a tight loop: it
/// is returned only after the delay (the others are handled meanwhile), tried exactly
/// `max_deliveries` times, then copied once to `{queue}.dead-letter` with its payload,
/// id and the reason, and acknowledged; the consumer then has nothing left to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_is_retried_after_a_delay_then_dead_lettered() {
    let rabbit = shared_rabbitmq();
    let topic = unique_name("poison").replace('-', "_");
    let queue_name = format!("{topic}.q");
    queue(&rabbit.url(), &queue_name, &topic).await;
    let publisher = RabbitMqPublisher::connect(&rabbit.url(), "turnstile")
        .await
        .unwrap();
    let mut poison_id = String::new();
    for n in 0..10_u64 {
        let message = Message::new(
            topic.as_str(),
            format!("k{}", n % 2),
            format!("m{n}").into_bytes(),
        )
        .unwrap();
        if n == 3 {
            poison_id = message.id().to_owned();
        }
        publisher.publish(&message, n + 1).await.unwrap();
    }
    let consumer = RabbitMqConsumer::connect(&rabbit.url(), &queue_name, "c1", 20)
        .await
        .unwrap()
        .max_deliveries(3);
    assert_eq!(
        consumer.dead_letter_queue(),
        format!("{queue_name}.dead-letter")
    );
    let delay = Duration::from_millis(400);
    let mut attempts: Vec<(std::time::Instant, u64)> = Vec::new();
    let mut handled: Vec<Vec<u8>> = Vec::new();
    let mut total = turnstile::outbox::Processed::default();
    let mut calls = 0;
    while calls < 40 && (total.dead_lettered == 0 || handled.len() < 9) {
        calls += 1;
        let done = consumer
            .process(20, Duration::from_millis(200), delay, async |incoming| {
                if incoming.payload == b"m3" {
                    attempts.push((std::time::Instant::now(), incoming.deliveries));
                    return Err(turnstile::Error::new(
                        turnstile::ErrorKind::Store,
                        "poison:\nno handler takes it",
                    ));
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
    let mut others = handled.clone();
    others.sort();
    others.dedup();
    assert_eq!(others.len(), 9, "every other message handled: {handled:?}");
    assert_eq!(handled.len(), 9, "each other message handled once");
    assert_eq!(
        attempts.iter().map(|(_, n)| *n).collect::<Vec<_>>(),
        [1, 2, 3],
        "the poison message is tried max_deliveries times, counted"
    );
    for pair in attempts.windows(2) {
        let gap = pair[1].0 - pair[0].0;
        assert!(gap >= delay, "retried after {gap:?}, before the delay");
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
    for _ in 0..3 {
        let done = consumer
            .process(20, Duration::from_millis(300), delay, async |_| {
                panic!("a message came back")
            })
            .await
            .unwrap();
        assert_eq!(done, turnstile::outbox::Processed::default());
    }
    assert!(take_all(&rabbit.url(), &queue_name).await.is_empty());
    let dead = take_all(&rabbit.url(), consumer.dead_letter_queue()).await;
    assert_eq!(dead.len(), 1, "one copy in the dead-letter queue");
    let copy = &dead[0];
    assert_eq!(copy.delivery.data, b"m3");
    assert_eq!(
        copy.delivery
            .properties
            .message_id()
            .as_ref()
            .unwrap()
            .as_str(),
        poison_id
    );
    assert_eq!(copy.delivery.properties.delivery_mode(), &Some(2));
    let properties = &copy.delivery.properties;
    assert_eq!(header(properties, "turnstile-key").as_deref(), Some("k1"));
    assert_eq!(
        header(properties, turnstile::outbox::DEAD_LETTER_DELIVERIES_HEADER).as_deref(),
        Some("3")
    );
    assert_eq!(
        header(properties, turnstile::outbox::DEAD_LETTER_SOURCE_HEADER),
        Some(queue_name.clone())
    );
    let reason = header(properties, turnstile::outbox::DEAD_LETTER_REASON_HEADER).unwrap();
    assert!(reason.contains("poison: no handler takes it"), "{reason}");
}

/// A quorum queue counts deliveries itself (`x-delivery-count`): a message it already
/// delivered twice (and got back) is dead-lettered on its first failure at a consumer
/// allowing three deliveries — a classic queue's count, kept by the consumer, would
/// start again at this consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_queues_own_delivery_count_is_used() {
    let rabbit = shared_rabbitmq();
    let topic = unique_name("quorum").replace('-', "_");
    let queue_name = format!("{topic}.q");
    quorum_queue(&rabbit.url(), &queue_name, &topic).await;
    let publisher = RabbitMqPublisher::connect(&rabbit.url(), "turnstile")
        .await
        .unwrap();
    publisher
        .publish(
            &Message::new(topic.as_str(), "k", b"poison".to_vec()).unwrap(),
            1,
        )
        .await
        .unwrap();
    // Another client got it twice and gave it back.
    {
        let connection =
            lapin::Connection::connect(&rabbit.url(), lapin::ConnectionProperties::default())
                .await
                .unwrap();
        let channel = connection.create_channel().await.unwrap();
        for _ in 0..2 {
            let message = channel
                .basic_get(queue_name.as_str().into(), Default::default())
                .await
                .unwrap()
                .unwrap();
            message
                .delivery
                .reject(lapin::options::BasicRejectOptions { requeue: true })
                .await
                .unwrap();
        }
        let _ = connection.close(200, "done".into()).await;
    }
    let consumer = RabbitMqConsumer::connect(&rabbit.url(), &queue_name, "c1", 20)
        .await
        .unwrap()
        .max_deliveries(3);
    let mut seen = Vec::new();
    let mut total = turnstile::outbox::Processed::default();
    for _ in 0..10 {
        let done = consumer
            .process(
                10,
                Duration::from_millis(300),
                Duration::from_millis(100),
                async |incoming| {
                    seen.push(incoming.deliveries);
                    Err(turnstile::Error::new(turnstile::ErrorKind::Store, "poison"))
                },
            )
            .await
            .unwrap();
        total.retried += done.retried;
        total.dead_lettered += done.dead_lettered;
        if total.dead_lettered > 0 {
            break;
        }
    }
    assert_eq!(
        seen,
        [3],
        "the broker's count: the third delivery, the last"
    );
    assert_eq!(total.dead_lettered, 1);
    let dead = take_all(&rabbit.url(), consumer.dead_letter_queue()).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].delivery.data, b"poison");
}

impl outbox_in_order::Consumer for RabbitMqConsumer {
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

/// A message its handler always fails is dead-lettered; the key's later messages, which
/// come back as out of order meanwhile (rejected, so a quorum queue would count them),
/// are never dead-lettered, and go on in order once the inbox skips the dead one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_lettered_message_parks_its_key_until_skipped() {
    let rabbit = shared_rabbitmq();
    let topic = unique_name("parked").replace('-', "_");
    let queue_name = format!("{topic}.q");
    queue(&rabbit.url(), &queue_name, &topic).await;
    let publisher = RabbitMqPublisher::connect(&rabbit.url(), "turnstile")
        .await
        .unwrap();
    let consumer = RabbitMqConsumer::connect(&rabbit.url(), &queue_name, "c1", 20)
        .await
        .unwrap()
        // 2: a classic queue has no delivery count, and any redelivery counts as the
        // second.
        .max_deliveries(2);
    outbox_in_order::a_dead_lettered_message_parks_its_key_until_skipped(
        &publisher, &topic, &consumer, 2,
    )
    .await;
}
