//! The outbox on SQLite and on PostgreSQL relayed to a real NATS JetStream server:
//! nothing lost, order kept per key, rolled-back messages never sent, several relays at
//! once, a poison message parks only its key, a broker outage is waited out, and a
//! duplicate window too short for the relay's redelivery is refused.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use tokio_util::sync::CancellationToken;
use turnstile::outbox::mysql::MysqlOutbox;
use turnstile::outbox::nats::JetStreamPublisher;
use turnstile::outbox::postgres::PostgresOutbox;
use turnstile::outbox::relay::{Publisher, Relay, RelayOptions};
use turnstile::outbox::sqlite::SqliteOutbox;
use turnstile::outbox::{Backoff, Failure, Message, OutboxStore, Settled, Settlement};
use turnstile_test_support::{NatsServer, unique_name};

/// An outbox under test: its store, more stores on the same data (other processes'),
/// and the application's side.
trait TestOutbox: Send + Sync + 'static {
    type Store: OutboxStore + Clone;
    fn store(&self) -> Self::Store;
    async fn another(&self) -> Self::Store;
    /// Another store on the same data, opened with `turnstile_migrate=off`.
    async fn without_migrating(&self) -> turnstile::Result<Self::Store>;
    /// Another store on the same data that keeps delivered messages for `retention`.
    async fn keeping(&self, retention: Duration) -> Self::Store;
    /// Enqueues `message` in its own transaction, which ends `hold` later (its key's
    /// row locked all the while), committed or rolled back.
    async fn enqueue_in_transaction(&self, message: &Message, hold: Duration, commit: bool);
    /// Enqueues `message` in its own transaction, committed or rolled back.
    async fn enqueue_one(&self, message: &Message, commit: bool) {
        self.enqueue_in_transaction(message, Duration::ZERO, commit)
            .await;
    }
    /// Enqueues `message` in its own transaction and commits it after `hold`, its
    /// key's row locked all the while.
    async fn enqueue_holding(&self, message: &Message, hold: Duration) {
        self.enqueue_in_transaction(message, hold, true).await;
    }
    /// Enqueues `message` on a connection outside any transaction.
    async fn enqueue_alone(&self, message: &Message) -> turnstile::Result<u64>;
    /// Makes the database refuse to store messages of `topic` (a trigger), so that an
    /// enqueue fails after its key's sequence number was taken.
    async fn refuse_topic(&self, topic: &str);
    /// Runs `sql` on the outbox's database (to lose a row, as a bad restore would).
    async fn execute(&self, sql: &str);
}

struct Sqlite {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
    outbox: SqliteOutbox,
}

impl Sqlite {
    async fn new() -> Sqlite {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("app.db");
        let outbox = SqliteOutbox::open(&path).await.unwrap();
        Sqlite {
            _dir: dir,
            path,
            outbox,
        }
    }
}

impl TestOutbox for Sqlite {
    type Store = SqliteOutbox;

    fn store(&self) -> SqliteOutbox {
        self.outbox.clone()
    }

    async fn another(&self) -> SqliteOutbox {
        SqliteOutbox::open(&self.path).await.unwrap()
    }

    async fn without_migrating(&self) -> turnstile::Result<SqliteOutbox> {
        SqliteOutbox::open_url(&format!(
            "sqlite://{}?turnstile_migrate=off",
            self.path.display()
        ))
        .await
    }

    async fn keeping(&self, retention: Duration) -> SqliteOutbox {
        self.another().await.keep_delivered(Some(retention))
    }

    async fn enqueue_in_transaction(&self, message: &Message, hold: Duration, commit: bool) {
        let mut transaction = self
            .outbox
            .pool()
            .begin_with("BEGIN IMMEDIATE")
            .await
            .unwrap();
        self.outbox
            .enqueue(&mut transaction, message)
            .await
            .unwrap();
        if !hold.is_zero() {
            tokio::time::sleep(hold).await;
        }
        if commit {
            self.outbox.commit(transaction).await.unwrap();
        } else {
            transaction.rollback().await.unwrap();
        }
    }

    async fn enqueue_alone(&self, message: &Message) -> turnstile::Result<u64> {
        let mut connection = self.outbox.pool().acquire().await.unwrap();
        self.outbox.enqueue(&mut connection, message).await
    }

    async fn refuse_topic(&self, topic: &str) {
        self.execute(&format!(
            "CREATE TRIGGER refuse_{name} BEFORE INSERT ON turnstile_outbox
             WHEN NEW.topic = '{topic}' BEGIN SELECT RAISE(ABORT, 'refused by the test'); END",
            name = topic.replace(['.', '-'], "_")
        ))
        .await;
    }

    async fn execute(&self, sql: &str) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(self.outbox.pool())
            .await
            .unwrap();
    }
}

struct Postgres {
    url: String,
    pool: sqlx::PgPool,
    outbox: PostgresOutbox,
}

impl Postgres {
    async fn new() -> Postgres {
        let url = turnstile_test_support::shared_postgres().fresh_database("outbox");
        let outbox = PostgresOutbox::connect(&url).await.unwrap();
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        Postgres { url, pool, outbox }
    }
}

impl TestOutbox for Postgres {
    type Store = PostgresOutbox;

    fn store(&self) -> PostgresOutbox {
        self.outbox.clone()
    }

    async fn another(&self) -> PostgresOutbox {
        PostgresOutbox::connect(&self.url).await.unwrap()
    }

    async fn without_migrating(&self) -> turnstile::Result<PostgresOutbox> {
        PostgresOutbox::connect(&format!("{}?turnstile_migrate=off", self.url)).await
    }

    async fn keeping(&self, retention: Duration) -> PostgresOutbox {
        // Through the URL option, as `turnstile outbox relay` would be told.
        PostgresOutbox::connect(&format!(
            "{}?turnstile_keep_delivered={}",
            self.url,
            retention.as_secs()
        ))
        .await
        .unwrap()
    }

    async fn enqueue_in_transaction(&self, message: &Message, hold: Duration, commit: bool) {
        let mut transaction = self.pool.begin().await.unwrap();
        self.outbox
            .enqueue(&mut transaction, message)
            .await
            .unwrap();
        if !hold.is_zero() {
            tokio::time::sleep(hold).await;
        }
        if commit {
            self.outbox.commit(transaction).await.unwrap();
        } else {
            transaction.rollback().await.unwrap();
        }
    }

    async fn enqueue_alone(&self, message: &Message) -> turnstile::Result<u64> {
        let mut connection = self.pool.acquire().await.unwrap();
        self.outbox.enqueue(&mut connection, message).await
    }

    async fn refuse_topic(&self, topic: &str) {
        let name = topic.replace(['.', '-'], "_");
        self.execute(&format!(
            "CREATE FUNCTION refuse_{name}() RETURNS trigger AS $$
             BEGIN IF NEW.topic = '{topic}' THEN RAISE EXCEPTION 'refused by the test'; END IF;
             RETURN NEW; END $$ LANGUAGE plpgsql;
             CREATE TRIGGER refuse_{name} BEFORE INSERT ON turnstile_outbox
             FOR EACH ROW EXECUTE FUNCTION refuse_{name}()"
        ))
        .await;
    }

    async fn execute(&self, sql: &str) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&self.pool)
            .await
            .unwrap();
    }
}

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

struct Mysql {
    url: String,
    pool: sqlx::MySqlPool,
    outbox: MysqlOutbox,
}

impl Mysql {
    async fn new() -> Mysql {
        let url = turnstile_test_support::shared_mariadb().fresh_database("outbox");
        let outbox = MysqlOutbox::connect(&url).await.unwrap();
        let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
        Mysql { url, pool, outbox }
    }
}

impl TestOutbox for Mysql {
    type Store = MysqlOutbox;

    fn store(&self) -> MysqlOutbox {
        self.outbox.clone()
    }

    async fn another(&self) -> MysqlOutbox {
        MysqlOutbox::connect(&self.url).await.unwrap()
    }

    async fn without_migrating(&self) -> turnstile::Result<MysqlOutbox> {
        MysqlOutbox::connect(&format!("{}?turnstile_migrate=off", self.url)).await
    }

    async fn keeping(&self, retention: Duration) -> MysqlOutbox {
        self.another().await.keep_delivered(Some(retention))
    }

    async fn enqueue_in_transaction(&self, message: &Message, hold: Duration, commit: bool) {
        let mut transaction = self.pool.begin().await.unwrap();
        self.outbox
            .enqueue(&mut transaction, message)
            .await
            .unwrap();
        if !hold.is_zero() {
            tokio::time::sleep(hold).await;
        }
        if commit {
            self.outbox.commit(transaction).await.unwrap();
        } else {
            transaction.rollback().await.unwrap();
        }
    }

    async fn enqueue_alone(&self, message: &Message) -> turnstile::Result<u64> {
        let mut connection = self.pool.acquire().await.unwrap();
        self.outbox.enqueue(&mut connection, message).await
    }

    async fn refuse_topic(&self, topic: &str) {
        self.execute(&format!(
            "CREATE TRIGGER refuse_{name} BEFORE INSERT ON turnstile_outbox FOR EACH ROW
             IF NEW.topic = '{topic}' THEN
                SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused by the test';
             END IF",
            name = topic.replace(['.', '-'], "_")
        ))
        .await;
    }

    async fn execute(&self, sql: &str) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&self.pool)
            .await
            .unwrap();
    }
}

/// Enqueues `count` messages over `keys` keys, one transaction each; every seventh
/// transaction is rolled back. Returns the ids that committed.
async fn enqueue(
    outbox: &impl TestOutbox,
    topic: &str,
    keys: usize,
    count: usize,
) -> HashSet<String> {
    let mut committed = HashSet::new();
    for n in 0..count {
        let message = Message::json(
            topic,
            format!("{topic}/account-{}", n % keys),
            &serde_json::json!({"n": n}),
        )
        .unwrap();
        let commit = n % 7 != 6;
        outbox.enqueue_one(&message, commit).await;
        if commit {
            committed.insert(message.id().to_owned());
        }
    }
    committed
}

/// Checks what reached the stream: exactly the committed ids, once each, and each
/// key's messages in sequence order without gaps.
fn check_delivery(delivered: &[(String, u64, String)], committed: &HashSet<String>) {
    check_delivery_allowing(delivered, committed, &HashSet::new());
}

/// The same, where the ids in `maybe` may or may not have committed (their commit
/// failed with a connection error: it may have landed).
fn check_delivery_allowing(
    delivered: &[(String, u64, String)],
    committed: &HashSet<String>,
    maybe: &HashSet<String>,
) {
    let ids: HashSet<String> = delivered.iter().map(|(_, _, id)| id.clone()).collect();
    assert_eq!(
        ids.len(),
        delivered.len(),
        "a message reached the stream twice"
    );
    let lost: Vec<&String> = committed.difference(&ids).collect();
    let extra: Vec<&String> = ids
        .difference(committed)
        .filter(|id| !maybe.contains(*id))
        .collect();
    assert!(
        lost.is_empty() && extra.is_empty(),
        "lost {lost:?}, extra {extra:?} (of {} committed)",
        committed.len()
    );
    let mut last: BTreeMap<&str, u64> = BTreeMap::new();
    for (key, seq, _) in delivered {
        let previous = last.insert(key, *seq).unwrap_or(0);
        assert_eq!(*seq, previous + 1, "key {key}: seq {seq} after {previous}");
    }
}

async fn wait_until_empty(outbox: &impl OutboxStore) {
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

/// A publisher to the shared server and a stream of its own for one test, keeping
/// duplicates for 120 s: `(publisher, stream name, subject prefix)`.
async fn fresh_stream(label: &str) -> (JetStreamPublisher, String, String) {
    let publisher = connect(shared_nats()).await;
    let (stream_name, subject) = names(label);
    stream(
        &publisher,
        &stream_name,
        &format!("{subject}.>"),
        Duration::from_secs(120),
    )
    .await;
    (publisher, stream_name, subject)
}

/// The NATS server the tests share (the outage test has its own).
fn shared_nats() -> &'static NatsServer {
    static SERVER: std::sync::OnceLock<NatsServer> = std::sync::OnceLock::new();
    SERVER.get_or_init(NatsServer::spawn)
}

async fn connect(nats: &NatsServer) -> JetStreamPublisher {
    JetStreamPublisher::connect(&nats.url(), Duration::from_secs(5))
        .await
        .unwrap()
}

/// A stream of its own for one test: `(stream name, subject prefix)`.
fn names(label: &str) -> (String, String) {
    let unique = turnstile_test_support::unique_name(label).replace('-', "_");
    (unique.to_uppercase(), unique)
}

async fn three_relays_deliver_every_committed_message_once_in_key_order(outbox: impl TestOutbox) {
    let (publisher, stream_name, subject) = fresh_stream("three").await;
    let watched = watch_publishes(shared_nats(), &subject).await;
    let shutdown = CancellationToken::new();
    let mut relays = Vec::new();
    // Three relays, each with its own connections, as three processes would have;
    // small rounds so that they contend for keys.
    for _ in 0..3 {
        let relay = Relay::new(outbox.another().await, publisher.clone())
            .with_options(RelayOptions::new().max_keys(3).per_key(4));
        let shutdown = shutdown.clone();
        relays.push(tokio::spawn(async move { relay.run(shutdown).await }));
    }
    let committed = enqueue(&outbox, &format!("{subject}.created"), 12, 400).await;
    let relays = RunningRelays { shutdown, relays };
    relays
        .drain_and_check(
            &outbox.store(),
            &publisher,
            &stream_name,
            watched,
            &committed,
        )
        .await;
}

async fn a_poison_message_parks_its_key_while_the_others_flow(outbox: impl TestOutbox) {
    let (publisher, stream_name, subject) = fresh_stream("poison").await;
    let topic = format!("{subject}.created");
    // Larger than the server's max_payload (1 MiB): refused for good.
    let poison = Message::new(topic.as_str(), "poisoned", vec![b'x'; 2 * 1024 * 1024]).unwrap();
    let behind = Message::new(topic.as_str(), "poisoned", b"behind".to_vec()).unwrap();
    outbox.enqueue_one(&poison, true).await;
    outbox.enqueue_one(&behind, true).await;
    let committed = enqueue(&outbox, &topic, 4, 40).await;
    let store = outbox.store();
    let relay = Relay::new(store.clone(), publisher.clone()).with_options(
        RelayOptions::new().max_attempts(2).backoff(Backoff {
            base: Duration::from_millis(10),
            max: Duration::from_millis(50),
        }),
    );
    let mut parked = 0;
    for _ in 0..300 {
        parked += relay.run_once().await.unwrap().parked;
        let status = store.status(10).await.unwrap();
        if parked > 0 && status.pending == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let status = store.status(10).await.unwrap();
    assert_eq!(parked, 1);
    assert_eq!(status.pending, 0, "other keys did not flow: {status:?}");
    assert_eq!(status.parked.len(), 1);
    assert_eq!(status.parked[0].key, "poisoned");
    assert_eq!(
        status.parked[0].pending, 2,
        "the key's messages must wait behind it"
    );
    assert!(status.parked[0].reason.is_some());
    check_delivery(&read_all(&publisher, &stream_name).await, &committed);
    // Redrive puts it back in line (it fails again here: the broker still refuses it).
    assert!(store.redrive("poisoned").await.unwrap());
    assert!(!store.redrive("poisoned").await.unwrap());
    assert!(store.status(10).await.unwrap().parked.is_empty());
    // A key that is not parked cannot be skipped: a relay may be publishing its head.
    let refused = store.skip("poisoned", 1).await.unwrap_err();
    assert_eq!(
        refused.kind(),
        turnstile::ErrorKind::InvalidOptions,
        "{refused}"
    );
    while store.status(10).await.unwrap().parked.is_empty() {
        relay.run_once().await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Skipping the poison moves it aside; the message behind it goes out.
    assert!(store.skip("poisoned", 1).await.unwrap());
    while relay.run_once().await.unwrap().keys > 0 {}
    let status = store.status(10).await.unwrap();
    assert!(
        status.parked.is_empty() && status.pending == 0,
        "{status:?}"
    );
    let delivered = read_all(&publisher, &stream_name).await;
    let poisoned: Vec<_> = delivered
        .iter()
        .filter(|(key, ..)| key == "poisoned")
        .collect();
    assert_eq!(
        poisoned,
        [&("poisoned".to_owned(), 2, behind.id().to_owned())],
        "the message behind the skipped one goes out, once"
    );
    let others: Vec<_> = delivered
        .into_iter()
        .filter(|(key, ..)| key != "poisoned")
        .collect();
    check_delivery(&others, &committed);
}

async fn a_broker_outage_is_waited_out_and_nothing_is_lost(outbox: impl TestOutbox) {
    let nats = NatsServer::spawn();
    let publisher = connect(&nats).await;
    stream(&publisher, "LEDGER", "ledger.>", Duration::from_secs(120)).await;
    let store = outbox.store();
    let shutdown = CancellationToken::new();
    let relay = Relay::new(store.clone(), publisher.clone()).with_options(
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
    wait_until_empty(&store).await;
    nats.stop();
    committed.extend(enqueue(&outbox, "ledger.entry", 5, 50).await);
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(store.status(10).await.unwrap().pending > 0);
    nats.start_again();
    wait_until_empty(&store).await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    assert!(store.status(10).await.unwrap().parked.is_empty());
    check_delivery(&read_all(&publisher, "LEDGER").await, &committed);
}

/// A topic the broker cannot serve as promised — its stream's duplicate window is
/// shorter than the relay's redelivery window, or no stream takes it at all — parks
/// only the keys that reach it, with the reason in `outbox status`; the relay keeps
/// running and every other key flows.
async fn a_topic_the_broker_cannot_serve_parks_only_its_keys(outbox: impl TestOutbox) {
    let publisher = connect(shared_nats()).await;
    let (short_stream, short) = names("short");
    stream(
        &publisher,
        &short_stream,
        &format!("{short}.>"),
        Duration::from_secs(5),
    )
    .await;
    let (good_stream, good) = names("good");
    stream(
        &publisher,
        &good_stream,
        &format!("{good}.>"),
        Duration::from_secs(120),
    )
    .await;
    let (_, nowhere) = names("nowhere");
    let store = outbox.store();
    for (topic, key) in [
        (format!("{short}.x"), "short-key"),
        (format!("{nowhere}.x"), "nowhere-key"),
    ] {
        let message =
            Message::new(topic.as_str(), format!("{short}-{key}"), b"x".to_vec()).unwrap();
        outbox.enqueue_one(&message, true).await;
    }
    let committed = enqueue(&outbox, &format!("{good}.x"), 3, 9).await;
    let relay = Relay::new(store.clone(), publisher.clone()).with_options(
        RelayOptions::new().max_attempts(2).backoff(Backoff {
            base: Duration::from_millis(10),
            max: Duration::from_millis(50),
        }),
    );
    let mut parked = 0;
    for _ in 0..300 {
        parked += relay
            .run_once()
            .await
            .expect("the relay keeps running")
            .parked;
        if parked == 2 && store.status(10).await.unwrap().pending == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let status = store.status(10).await.unwrap();
    assert_eq!(status.pending, 0, "other keys did not flow: {status:?}");
    let reason = |key: &str| {
        status
            .parked
            .iter()
            .find(|parked| parked.key == format!("{short}-{key}"))
            .and_then(|parked| parked.reason.clone())
            .unwrap_or_else(|| panic!("{key} is not parked: {status:?}"))
    };
    assert!(
        reason("short-key").contains("duplicate"),
        "{}",
        reason("short-key")
    );
    assert!(
        reason("nowhere-key").contains("no JetStream stream"),
        "{}",
        reason("nowhere-key")
    );
    check_delivery(&read_all(&publisher, &good_stream).await, &committed);
    assert!(read_all(&publisher, &short_stream).await.is_empty());
}

async fn delivered_messages_are_kept_for_audit_then_swept(outbox: impl TestOutbox) {
    let (publisher, stream_name, subject) = fresh_stream("kept").await;
    let store = outbox.keeping(Duration::from_secs(1)).await;
    let committed = enqueue(&outbox, &format!("{subject}.x"), 2, 6).await;
    let relay = Relay::new(store.clone(), publisher.clone());
    while relay.run_once().await.unwrap().keys > 0 {}
    let status = store.status(10).await.unwrap();
    assert_eq!(status.pending, 0);
    assert_eq!(status.kept, committed.len() as u64, "{status:?}");
    // Nothing is past its retention yet.
    assert_eq!(store.sweep(100).await.unwrap(), 0);
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    // Bounded batches.
    assert_eq!(store.sweep(2).await.unwrap(), 2);
    assert_eq!(store.sweep(100).await.unwrap(), committed.len() as u64 - 2);
    assert_eq!(store.status(10).await.unwrap().kept, 0);
    check_delivery(&read_all(&publisher, &stream_name).await, &committed);
}

/// Relays running in tasks until `shutdown`.
struct RunningRelays {
    shutdown: CancellationToken,
    relays: Vec<tokio::task::JoinHandle<turnstile::Result<()>>>,
}

impl RunningRelays {
    /// Waits until `store` has nothing pending, stops the relays, and checks that the
    /// stream holds exactly `committed`, in key order, each published once.
    async fn drain_and_check(
        self,
        store: &impl OutboxStore,
        publisher: &JetStreamPublisher,
        stream_name: &str,
        watched: async_nats::Subscriber,
        committed: &HashSet<String>,
    ) {
        wait_until_empty(store).await;
        self.shutdown.cancel();
        for relay in self.relays {
            relay.await.unwrap().unwrap();
        }
        check_delivery(&read_all(publisher, stream_name).await, committed);
        check_published_once(&published_ids(watched).await, committed);
    }
}

/// Every publish that reaches the NATS server on `subject.>`, seen by a plain
/// subscriber: it gets each publish before JetStream's duplicate window drops a
/// repeat, so it counts what the stream would hide.
async fn watch_publishes(nats: &NatsServer, subject: &str) -> async_nats::Subscriber {
    let client = async_nats::connect(nats.url()).await.unwrap();
    let subscriber = client.subscribe(format!("{subject}.>")).await.unwrap();
    client.flush().await.unwrap();
    subscriber
}

/// The message ids `watch_publishes` saw, once the server has been quiet for a second.
async fn published_ids(mut subscriber: async_nats::Subscriber) -> Vec<String> {
    use futures_util::StreamExt;
    let mut ids = Vec::new();
    while let Ok(Some(message)) =
        tokio::time::timeout(Duration::from_secs(1), subscriber.next()).await
    {
        let headers = message.headers.expect("outbox messages carry headers");
        ids.push(headers.get("Nats-Msg-Id").unwrap().as_str().to_owned());
    }
    ids
}

/// Checks that each committed id was published once, counting the publishes the
/// broker saw (not the stream's deduplicated copy).
fn check_published_once(published: &[String], committed: &HashSet<String>) {
    let once: HashSet<&String> = published.iter().collect();
    assert_eq!(
        once.len(),
        published.len(),
        "a relay published a message twice"
    );
    assert_eq!(
        once.len(),
        committed.len(),
        "publishes do not match commits"
    );
}

/// Enqueues on connections outside any transaction, four writers at once while two
/// relays run: each enqueue must land as one step, or a relay delivers a key's later
/// message before an earlier one has its row and never sees the earlier one again.
async fn enqueues_outside_a_transaction_lose_nothing(outbox: impl TestOutbox) {
    let (publisher, stream_name, subject) = fresh_stream("alone").await;
    let watched = watch_publishes(shared_nats(), &subject).await;
    let shutdown = CancellationToken::new();
    let mut relays = Vec::new();
    for _ in 0..2 {
        let relay = Relay::new(outbox.another().await, publisher.clone()).with_options(
            RelayOptions::new()
                .max_keys(2)
                .per_key(2)
                .idle_poll(Duration::from_millis(1), Duration::from_millis(2)),
        );
        let shutdown = shutdown.clone();
        relays.push(tokio::spawn(async move { relay.run(shutdown).await }));
    }
    let topic = format!("{subject}.created");
    let writers = (0..4).map(|writer| {
        let (outbox, topic) = (&outbox, topic.as_str());
        async move {
            let mut ids = Vec::new();
            for n in 0..50 {
                let message = Message::json(
                    topic,
                    format!("{topic}/key-{}", n % 3),
                    &serde_json::json!({"writer": writer, "n": n}),
                )
                .unwrap();
                outbox.enqueue_alone(&message).await.unwrap();
                ids.push(message.id().to_owned());
            }
            ids
        }
    });
    let committed: HashSet<String> = futures_util::future::join_all(writers)
        .await
        .into_iter()
        .flatten()
        .collect();
    let relays = RunningRelays { shutdown, relays };
    relays
        .drain_and_check(
            &outbox.store(),
            &publisher,
            &stream_name,
            watched,
            &committed,
        )
        .await;
}

/// An enqueue outside a transaction whose message row is refused after its key's
/// sequence number was taken takes the number back: no gap is left, the key is not
/// parked, and the next message of the key is delivered.
async fn a_failed_enqueue_leaves_no_gap(outbox: impl TestOutbox) {
    let (publisher, stream_name, subject) = fresh_stream("nogap").await;
    let refused_topic = format!("{subject}.refused");
    outbox.refuse_topic(&refused_topic).await;
    let key = format!("{subject}-account");
    let refused = Message::new(refused_topic.as_str(), key.as_str(), b"no".to_vec()).unwrap();
    assert!(outbox.enqueue_alone(&refused).await.is_err());
    let store = outbox.store();
    let status = store.status(10).await.unwrap();
    assert_eq!(
        status.pending, 0,
        "the refused enqueue left its number: {status:?}"
    );
    let next = Message::new(format!("{subject}.created"), key.as_str(), b"yes".to_vec()).unwrap();
    assert_eq!(outbox.enqueue_alone(&next).await.unwrap(), 1);
    let relay = Relay::new(store.clone(), publisher.clone());
    relay.run_once().await.unwrap();
    check_delivery(
        &read_all(&publisher, &stream_name).await,
        &HashSet::from([next.id().to_owned()]),
    );
}

/// A round reads messages only while their bytes fit its budget: with 100 KB messages
/// and a 350 KB budget a round publishes at most three (before, every leased key's
/// messages were read at once: 64 keys × 128 messages × 16 MiB could be held). A
/// message larger than the whole budget still goes out, alone, and everything is
/// delivered in key order over the following rounds.
async fn a_round_holds_at_most_its_byte_budget(outbox: impl TestOutbox) {
    let (publisher, stream_name, subject) = fresh_stream("budget").await;
    let mut committed = HashSet::new();
    let filler = "x".repeat(100_000);
    for n in 0..12 {
        let message = Message::json(
            format!("{subject}.entry"),
            format!("{subject}-account-{}", n % 4),
            &serde_json::json!({ "n": n, "filler": filler }),
        )
        .unwrap();
        outbox.enqueue_one(&message, true).await;
        committed.insert(message.id().to_owned());
    }
    let store = outbox.store();
    let relay = Relay::new(store.clone(), publisher.clone())
        .with_options(RelayOptions::new().max_round_bytes(350_000));
    let first = relay.run_once().await.unwrap();
    assert_eq!(first.keys, 4, "{first:?}");
    assert!(
        (1..=3).contains(&first.published),
        "a round of 350 KB published {} messages of 100 KB",
        first.published
    );
    let mut rounds = 1;
    while relay.run_once().await.unwrap().keys > 0 {
        rounds += 1;
        assert!(rounds < 50, "the outbox does not drain");
    }
    assert!(
        rounds >= 4,
        "12 messages of 100 KB went out in {rounds} rounds"
    );

    let huge = Message::json(
        format!("{subject}.entry"),
        format!("{subject}-account-0"),
        &serde_json::json!({ "filler": "y".repeat(500_000) }),
    )
    .unwrap();
    outbox.enqueue_one(&huge, true).await;
    committed.insert(huge.id().to_owned());
    assert_eq!(relay.run_once().await.unwrap().published, 1);
    check_delivery(&read_all(&publisher, &stream_name).await, &committed);
}

/// `status` lists the keys whose oldest undelivered message has waited longest, most
/// behind first, with their pending counts: a key passed over shows there while the
/// totals look healthy.
async fn the_keys_most_behind_are_listed(outbox: impl TestOutbox) {
    let subject = unique_name("lag");
    for (key, count) in [("first", 3), ("second", 1), ("third", 2)] {
        for n in 0..count {
            let message = Message::new(
                format!("{subject}.entry"),
                format!("{subject}-{key}"),
                format!("{n}").into_bytes(),
            )
            .unwrap();
            outbox.enqueue_one(&message, true).await;
        }
        // Clocks count whole milliseconds on some stores.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let status = outbox.store().status(2).await.unwrap();
    let listed: Vec<(String, u64)> = status
        .lagging
        .iter()
        .map(|key| (key.key.clone(), key.pending))
        .collect();
    assert_eq!(
        listed,
        [
            (format!("{subject}-first"), 3),
            (format!("{subject}-second"), 1)
        ]
    );
    assert!(
        status.lagging[0].oldest > status.lagging[1].oldest,
        "{status:?}"
    );
    // The same message's age, read a moment after the totals.
    let oldest = status.oldest_pending.unwrap();
    assert!(
        status.lagging[0].oldest >= oldest
            && status.lagging[0].oldest < oldest + Duration::from_secs(1),
        "{status:?}"
    );
}

/// A key whose next message is missing (a row lost to a bad restore or a hand-run
/// DELETE) is never published past the hole: the messages before it go out, the key
/// parks with the gap as its reason, and nothing after it is sent or settled.
async fn a_missing_message_is_never_stepped_over(outbox: impl TestOutbox) {
    let (publisher, stream_name, subject) = fresh_stream("gap").await;
    let topic = format!("{subject}.created");
    let key = format!("{subject}-gappy");
    let messages: Vec<Message> = (1..=4)
        .map(|n| Message::json(topic.as_str(), key.as_str(), &serde_json::json!({"n": n})).unwrap())
        .collect();
    for message in &messages {
        outbox.enqueue_one(message, true).await;
    }
    outbox
        .execute(&format!(
            "DELETE FROM turnstile_outbox WHERE ordering_key = '{key}' AND seq = 2"
        ))
        .await;
    let store = outbox.store();
    let relay = Relay::new(store.clone(), publisher.clone()).with_options(
        RelayOptions::new().max_attempts(2).backoff(Backoff {
            base: Duration::from_millis(10),
            max: Duration::from_millis(20),
        }),
    );
    let mut parked = 0;
    for _ in 0..300 {
        parked += relay.run_once().await.unwrap().parked;
        if parked > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let status = store.status(10).await.unwrap();
    assert_eq!(parked, 1, "the key with a hole must park: {status:?}");
    assert_eq!(status.parked[0].key, key);
    assert_eq!(status.parked[0].pending, 3, "{status:?}");
    let reason = status.parked[0].reason.clone().unwrap_or_default();
    assert!(
        reason.contains("sequence gap: message 2 is missing"),
        "{reason}"
    );
    let delivered = read_all(&publisher, &stream_name).await;
    assert_eq!(
        delivered,
        vec![(key.clone(), 1, messages[0].id().to_owned())],
        "only the message before the hole may go out"
    );
    // An operator moves past the hole: only its number is accepted, nothing is moved,
    // and the rest of the key goes out in order.
    let refused = store.skip(&key, 3).await.unwrap_err();
    assert_eq!(
        refused.kind(),
        turnstile::ErrorKind::InvalidOptions,
        "{refused}"
    );
    assert!(
        !store.skip(&key, 2).await.unwrap(),
        "a hole has nothing to move"
    );
    while relay.run_once().await.unwrap().keys > 0 {}
    let status = store.status(10).await.unwrap();
    assert!(
        status.parked.is_empty() && status.pending == 0,
        "{status:?}"
    );
    let ids: Vec<String> = read_all(&publisher, &stream_name)
        .await
        .into_iter()
        .map(|(_, _, id)| id)
        .collect();
    assert_eq!(ids, [0, 2, 3].map(|n| messages[n].id().to_owned()));
}

/// `reachable` asks JetStream itself, not only the server: a NATS server without
/// JetStream answers PINGs but stores nothing, so for a relay it is not reachable (and
/// a relay whose every key fails there pauses as a whole, as on a broker that is down).
#[tokio::test]
async fn a_server_without_jetstream_is_not_reachable() {
    let core = tokio::task::spawn_blocking(NatsServer::spawn_without_jetstream)
        .await
        .unwrap();
    let publisher = JetStreamPublisher::connect(&core.url(), Duration::from_secs(2))
        .await
        .unwrap();
    assert!(
        !publisher.reachable().await,
        "a server without JetStream counted as reachable"
    );
    let (with_jetstream, ..) = fresh_stream("reachable").await;
    assert!(with_jetstream.reachable().await, "the broker is up");
}

/// One key that keeps failing (leased alone, batch after batch) backs off on its own:
/// another key's new message still goes out at once. Before, a batch whose keys all
/// failed paused the whole relay, longer each time up to the longest backoff.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_failing_key_does_not_pause_the_relay() {
    let outbox = Sqlite::new().await;
    let (nats, stream_name, subject) = fresh_stream("onefails").await;
    let failures = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // Every publish of one key fails as if its partition had no leader: a transient
    // failure of that key alone.
    let publisher = BeforeEach {
        inner: nats.clone(),
        hook: {
            let (stuck, failures) = (format!("{subject}-stuck"), Arc::clone(&failures));
            Box::new(move |message| {
                let fails = message.key() == stuck;
                if fails {
                    failures.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                Box::pin(async move {
                    if fails {
                        return Err(Failure {
                            permanent: false,
                            reason: "no leader for the key's partition".to_owned(),
                        });
                    }
                    Ok(())
                })
            })
        },
    };
    let store = outbox.store();
    let relay =
        Relay::new(store.clone(), publisher).with_options(RelayOptions::new().backoff(Backoff {
            base: Duration::from_millis(200),
            max: Duration::from_secs(30),
        }));
    assert!(nats.reachable().await, "the broker is up");
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await }
    });
    let topic = format!("{subject}.created");
    let stuck = Message::new(topic.as_str(), format!("{subject}-stuck"), b"s".to_vec()).unwrap();
    outbox.enqueue_one(&stuck, true).await;
    // Five lone failures: a relay that paused for them now waits 3.2 s.
    let started = std::time::Instant::now();
    while failures.load(std::sync::atomic::Ordering::SeqCst) < 5 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the stuck key was not retried"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let healthy =
        Message::new(topic.as_str(), format!("{subject}-healthy"), b"h".to_vec()).unwrap();
    let sent = std::time::Instant::now();
    outbox.enqueue_one(&healthy, true).await;
    loop {
        let delivered = read_all(&nats, &stream_name).await;
        if delivered.iter().any(|(_, _, id)| id == healthy.id()) {
            break;
        }
        assert!(
            sent.elapsed() < Duration::from_millis(1500),
            "the healthy key waited behind the failing one"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    running.await.unwrap().unwrap();
}

/// PostgreSQL's claim locks a key's row at its newest version but reads the messages
/// from the statement's snapshot. When another relay settles the key and a writer
/// enqueues its next message after the claim began, the claim sees the new sequence
/// number without its message: no gap, though it looked like one (and parked the key,
/// one permanent failure being enough here). The claim reads such a head again. The
/// window is made wide by a row-level security policy that makes the claim's scan
/// sleep on the key's row (for a role that is not a superuser: those skip policies).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_committed_after_the_claims_snapshot_is_no_gap_on_postgres() {
    let outbox = Postgres::new().await;
    let role = unique_name("relay").replace('-', "_").to_lowercase();
    outbox
        .execute(&format!(
            "CREATE ROLE {role} LOGIN;
             GRANT ALL ON ALL TABLES IN SCHEMA public TO {role};
             CREATE FUNCTION slow_claim(k text) RETURNS boolean AS $$
             BEGIN
                 IF k = 'hot' AND current_query() LIKE '%SKIP LOCKED%' THEN
                     PERFORM pg_sleep(0.4);
                 END IF;
                 RETURN true;
             END $$ LANGUAGE plpgsql;
             ALTER TABLE turnstile_outbox_keys ENABLE ROW LEVEL SECURITY;
             ALTER TABLE turnstile_outbox_keys FORCE ROW LEVEL SECURITY;
             CREATE POLICY slow ON turnstile_outbox_keys USING (slow_claim(ordering_key))
                 WITH CHECK (true)"
        ))
        .await;
    let url = outbox.url.replacen("postgres@", &format!("{role}@"), 1);
    let relay_store = PostgresOutbox::connect(&format!("{url}?turnstile_migrate=off"))
        .await
        .unwrap();
    let first = Message::new("nogap.x", "hot", b"1".to_vec()).unwrap();
    outbox.enqueue_one(&first, true).await;
    let claim = tokio::spawn(async move {
        relay_store
            .claim_within(1, 10, u64::MAX, Duration::from_secs(30))
            .await
            .unwrap()
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    // Meanwhile another relay delivers message 1, and a writer enqueues message 2.
    outbox
        .execute(
            "UPDATE turnstile_outbox_keys SET acked_seq = 1 WHERE ordering_key = 'hot';
             DELETE FROM turnstile_outbox WHERE ordering_key = 'hot' AND seq = 1",
        )
        .await;
    let second = Message::new("nogap.x", "hot", b"2".to_vec()).unwrap();
    outbox.enqueue_one(&second, true).await;
    let leased = claim.await.unwrap();
    assert_eq!(leased.len(), 1);
    assert_eq!(
        leased[0].acked, 1,
        "the claim locked the row's newest version"
    );
    let seqs: Vec<u64> = leased[0].messages.iter().map(|stored| stored.seq).collect();
    assert_eq!(
        seqs,
        [2],
        "the head committed after the snapshot is read again"
    );
    assert_eq!(leased[0].messages[0].message.id(), second.id());
}

/// Leases `store`'s one due key, waiting out its backoff.
async fn lease_the_key(store: &impl OutboxStore) -> turnstile::outbox::LeasedKey {
    for _ in 0..500 {
        let leased = store
            .claim_within(1, 10, u64::MAX, Duration::from_secs(30))
            .await
            .unwrap();
        if let Some(key) = leased.into_iter().next() {
            return key;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the key was never due again");
}

/// A settlement of `key` whose head message failed, permanently or not.
fn failed(key: &turnstile::outbox::LeasedKey, permanent: bool) -> Settlement {
    Settlement {
        key: key.key.clone(),
        token: key.token,
        delivered_through: 0,
        failure: Some(Failure {
            permanent,
            reason: if permanent { "refused" } else { "unreachable" }.to_owned(),
        }),
    }
}

/// Transient failures (a broker unreachable for a while) never count toward parking:
/// only `max_attempts` permanent ones do. A settlement tried again after its commit's
/// reply was lost (the same lease settled twice) counts once and gets its first
/// answer. Both columns are added to tables made before them.
async fn only_permanent_failures_park_and_a_settlement_counts_once(outbox: impl TestOutbox) {
    // Tables as an earlier release made them: opening a store adds the columns.
    outbox
        .execute("ALTER TABLE turnstile_outbox_keys DROP COLUMN permanent_failures")
        .await;
    outbox
        .execute("ALTER TABLE turnstile_outbox_keys DROP COLUMN settled_token")
        .await;
    // Told not to migrate, a store refuses such tables: its settlements would fail
    // every round, and every round would be published again.
    let refused = outbox.without_migrating().await.unwrap_err();
    assert_eq!(
        refused.kind(),
        turnstile::ErrorKind::Configuration,
        "{refused}"
    );
    assert!(refused.to_string().contains("settled_token"), "{refused}");
    let store = outbox.another().await;
    assert!(
        outbox.without_migrating().await.is_ok(),
        "the columns were added"
    );
    let message = Message::new("counted.x", "counted", b"m".to_vec()).unwrap();
    outbox.enqueue_one(&message, true).await;
    let backoff = Backoff {
        base: Duration::from_millis(1),
        max: Duration::from_millis(2),
    };
    let (max_attempts, done, parked) = (2, [Settled::Done], [Settled::Parked]);
    for _ in 0..5 {
        let key = lease_the_key(&store).await;
        let transient = [failed(&key, false)];
        let answer = store.settle(&transient, max_attempts, backoff).await;
        assert_eq!(answer.unwrap(), done, "a transient failure parked");
    }
    let key = lease_the_key(&store).await;
    let first = failed(&key, true);
    assert_eq!(
        store
            .settle(std::slice::from_ref(&first), max_attempts, backoff)
            .await
            .unwrap(),
        done
    );
    // Its reply lost, the relay settles the same lease again: counted once.
    assert_eq!(
        store.settle(&[first], max_attempts, backoff).await.unwrap(),
        done,
        "a settlement tried again counted its failure twice"
    );
    assert!(store.status(10).await.unwrap().parked.is_empty());
    let key = lease_the_key(&store).await;
    let second = failed(&key, true);
    assert_eq!(
        store
            .settle(std::slice::from_ref(&second), max_attempts, backoff)
            .await
            .unwrap(),
        parked
    );
    assert_eq!(
        store
            .settle(&[second], max_attempts, backoff)
            .await
            .unwrap(),
        parked
    );
    let status = store.status(10).await.unwrap();
    assert_eq!(status.parked.len(), 1, "{status:?}");
    assert_eq!(status.parked[0].reason.as_deref(), Some("refused"));
}

/// `outbox skip` never drops an audit copy: when the skipped messages already hold one
/// for the key and number (the outbox's sequences started again since), the skip is
/// refused with the reason and changes nothing; once that row is moved, it goes.
async fn a_skip_never_drops_an_older_audit_copy(outbox: impl TestOutbox) {
    let store = outbox.store();
    let backoff = Backoff {
        base: Duration::from_millis(1),
        max: Duration::from_millis(2),
    };
    let park = || async {
        let key = lease_the_key(&store).await;
        let answer = store
            .settle(&[failed(&key, true)], 1, backoff)
            .await
            .unwrap();
        assert_eq!(answer, [Settled::Parked]);
    };
    let first = Message::new("audit.x", "audited", b"first".to_vec()).unwrap();
    outbox.enqueue_one(&first, true).await;
    park().await;
    assert!(store.skip("audited", 1).await.unwrap());
    // The key's rows go (a restored or reset outbox) and its numbers start again.
    outbox
        .execute("DELETE FROM turnstile_outbox_keys WHERE ordering_key = 'audited'")
        .await;
    let again = Message::new("audit.x", "audited", b"again".to_vec()).unwrap();
    outbox.enqueue_one(&again, true).await;
    park().await;
    let refused = store.skip("audited", 1).await.unwrap_err();
    assert_eq!(refused.kind(), turnstile::ErrorKind::Conflict, "{refused}");
    assert!(refused.to_string().contains("audit copy"), "{refused}");
    let status = store.status(10).await.unwrap();
    assert_eq!(
        status.parked.len(),
        1,
        "the refused skip changed the key: {status:?}"
    );
    assert_eq!(status.parked[0].pending, 1);
    outbox
        .execute("DELETE FROM turnstile_outbox_skipped WHERE ordering_key = 'audited'")
        .await;
    assert!(
        store.skip("audited", 1).await.unwrap(),
        "the message was there"
    );
    assert!(store.status(10).await.unwrap().parked.is_empty());
}

/// The checks, once per store.
macro_rules! outbox_checks {
    ($module:ident, $outbox:expr) => {
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn three_relays_deliver_every_committed_message_once_in_key_order() {
                super::three_relays_deliver_every_committed_message_once_in_key_order($outbox)
                    .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_poison_message_parks_its_key_while_the_others_flow() {
                super::a_poison_message_parks_its_key_while_the_others_flow($outbox).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_broker_outage_is_waited_out_and_nothing_is_lost() {
                super::a_broker_outage_is_waited_out_and_nothing_is_lost($outbox).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn delivered_messages_are_kept_for_audit_then_swept() {
                super::delivered_messages_are_kept_for_audit_then_swept($outbox).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn enqueues_outside_a_transaction_lose_nothing() {
                super::enqueues_outside_a_transaction_lose_nothing($outbox).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_failed_enqueue_leaves_no_gap() {
                super::a_failed_enqueue_leaves_no_gap($outbox).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_round_holds_at_most_its_byte_budget() {
                super::a_round_holds_at_most_its_byte_budget($outbox).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_keys_most_behind_are_listed() {
                super::the_keys_most_behind_are_listed($outbox).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_missing_message_is_never_stepped_over() {
                super::a_missing_message_is_never_stepped_over($outbox).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_topic_the_broker_cannot_serve_parks_only_its_keys() {
                super::a_topic_the_broker_cannot_serve_parks_only_its_keys($outbox).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn only_permanent_failures_park_and_a_settlement_counts_once() {
                super::only_permanent_failures_park_and_a_settlement_counts_once($outbox).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_skip_never_drops_an_older_audit_copy() {
                super::a_skip_never_drops_an_older_audit_copy($outbox).await;
            }
        }
    };
}

outbox_checks!(sqlite, Sqlite::new().await);
outbox_checks!(postgres, Postgres::new().await);
outbox_checks!(mysql, Mysql::new().await);

/// A key that application transactions keep locked all the time (two writers taking
/// turns, so its row is never free) is still served: the claim's `SKIP LOCKED` passes
/// it over, and the relay then waits a moment for its row. Before, it was passed over
/// every round for as long as the writers went on (0 of 50 messages in 5 s).
async fn a_key_written_all_the_time_is_still_served(outbox: impl TestOutbox) {
    let (publisher, stream_name, subject) = fresh_stream("hotkey").await;
    let hot = format!("{subject}-hot");
    let topic = format!("{subject}.entry");
    let writing = CancellationToken::new();
    let writer = || async {
        let mut committed = 0;
        while !writing.is_cancelled() {
            let message = Message::new(topic.as_str(), hot.as_str(), b"hot".to_vec()).unwrap();
            outbox
                .enqueue_holding(&message, Duration::from_millis(100))
                .await;
            committed += 1;
        }
        committed
    };
    let shutdown = CancellationToken::new();
    let relay = Relay::new(outbox.store(), publisher.clone());
    let running = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { relay.run(shutdown).await })
    };
    let (first, second, delivered_while_busy) = tokio::join!(writer(), writer(), async {
        tokio::time::sleep(Duration::from_secs(5)).await;
        // Counted while the writers still hold the key's row.
        let delivered = read_all(&publisher, &stream_name).await.len();
        writing.cancel();
        delivered
    });
    let committed = first + second;
    assert!(
        delivered_while_busy >= 5,
        "{delivered_while_busy} of the busy key's messages delivered in 5 s ({committed} committed in all)"
    );
    wait_until_empty(&outbox.store()).await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    assert_eq!(read_all(&publisher, &stream_name).await.len(), committed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_written_all_the_time_is_still_served_on_postgres() {
    a_key_written_all_the_time_is_still_served(Postgres::new().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_written_all_the_time_is_still_served_on_mysql() {
    a_key_written_all_the_time_is_still_served(Mysql::new().await).await;
}

/// The real NATS publisher, with a test's hook awaited before each publish: to make
/// one key slow or fail, or to act between a relay's claim and its settlement.
struct BeforeEach {
    inner: JetStreamPublisher,
    hook: PublishHook,
}

/// What [`BeforeEach`] awaits before publishing a message.
type PublishHook = Box<
    dyn for<'m> Fn(&'m Message) -> turnstile::lock::BoxFuture<'m, Result<(), Failure>>
        + Send
        + Sync,
>;

impl Publisher for BeforeEach {
    fn publish<'a>(
        &'a self,
        message: &'a Message,
        seq: u64,
    ) -> turnstile::lock::BoxFuture<'a, Result<(), turnstile::outbox::Failure>> {
        Box::pin(async move {
            (self.hook)(message).await?;
            self.inner.publish(message, seq).await
        })
    }

    fn check<'a>(
        &'a self,
        topic: &'a str,
        redelivery: Duration,
    ) -> turnstile::lock::BoxFuture<'a, turnstile::Result<()>> {
        self.inner.check(topic, redelivery)
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn reachable(&self) -> turnstile::lock::BoxFuture<'_, bool> {
        self.inner.reachable()
    }
}

/// A slow key holds only itself: while its publish takes five seconds, other keys'
/// new messages are leased, published and settled. Before, a relay's round waited for
/// its slowest key, and every other key's next messages waited with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_key_does_not_hold_the_others() {
    let outbox = Sqlite::new().await;
    let (nats, stream_name, subject) = fresh_stream("slowkey").await;
    let slow_key = format!("{subject}-slow");
    let slow_key_name = slow_key.clone();
    // As one Kafka partition without a leader would hold the keys that map to it.
    let publisher = BeforeEach {
        inner: nats.clone(),
        hook: Box::new(move |message| {
            let slow = message.key() == slow_key;
            Box::pin(async move {
                if slow {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
                Ok(())
            })
        }),
    };
    let topic = format!("{subject}.entry");
    let mut committed = HashSet::new();
    let slow = Message::new(topic.as_str(), slow_key_name.as_str(), b"slow".to_vec()).unwrap();
    outbox.enqueue_one(&slow, true).await;
    committed.insert(slow.id().to_owned());
    let relay = Relay::new(outbox.store(), publisher)
        .with_options(RelayOptions::new().lease(Duration::from_secs(20)));
    let shutdown = CancellationToken::new();
    let running = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { relay.run(shutdown).await })
    };
    // The slow key's publish is under way; the others' messages come after it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = std::time::Instant::now();
    for n in 0..6 {
        let message = Message::new(
            topic.as_str(),
            format!("{subject}-fast-{}", n % 3),
            format!("{n}").into_bytes(),
        )
        .unwrap();
        outbox.enqueue_one(&message, true).await;
        committed.insert(message.id().to_owned());
    }
    while read_all(&nats, &stream_name).await.len() < 6 {
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "the other keys waited for the slow one: {} of 6 delivered after {:?}",
            read_all(&nats, &stream_name).await.len(),
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_until_empty(&outbox.store()).await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    check_delivery(&read_all(&nats, &stream_name).await, &committed);
}

/// An enqueue on a connection whose transaction was begun as SQL (not through `sqlx`)
/// stays in that transaction: the rollback takes the message back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mysql_enqueue_in_a_transaction_begun_as_sql_stays_in_it() {
    let outbox = Mysql::new().await;
    let mut connection = outbox.pool.acquire().await.unwrap();
    sqlx::raw_sql("START TRANSACTION")
        .execute(&mut *connection)
        .await
        .unwrap();
    let message = Message::new("sql.created", "begun-as-sql", b"x".to_vec()).unwrap();
    outbox
        .outbox
        .enqueue(&mut connection, &message)
        .await
        .unwrap();
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut *connection)
        .await
        .unwrap();
    let status = outbox.outbox.status(10).await.unwrap();
    assert_eq!(
        status.pending, 0,
        "the rollback must take it back: {status:?}"
    );
}

/// On PostgreSQL an idle relay is woken by `NOTIFY` (sent only because it marked
/// itself idle), not by its poll: with a 30 s poll, a message from another process is
/// still published at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_postgres_relay_is_woken_by_notify() {
    let outbox = Postgres::new().await;
    let (publisher, stream_name, subject) = fresh_stream("notify").await;
    let relay_store = outbox.another().await;
    let relay = Relay::new(relay_store.clone(), publisher.clone()).with_options(
        RelayOptions::new().idle_poll(Duration::from_secs(30), Duration::from_secs(30)),
    );
    let shutdown = CancellationToken::new();
    let running = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { relay.run(shutdown).await })
    };
    // Let it find nothing, mark itself idle and start its 30 s wait.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = std::time::Instant::now();
    // Another process's commit: `outbox`'s own pool, not the relay's store.
    let committed = enqueue(&outbox, &format!("{subject}.x"), 1, 1).await;
    wait_until_empty(&outbox.store()).await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the idle relay was not woken: {:?}",
        started.elapsed()
    );
    assert!(relay_store.notifications_received() >= 1);
    // Idle again, the relay is marked so (enqueues would notify it); once it stops, its
    // mark is gone, so that no enqueue sends a `NOTIFY` for a relay that is gone.
    let pool = &outbox.pool;
    let marked =
        "SELECT count(*) FROM turnstile_outbox_relays WHERE idle_until > clock_timestamp()";
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while sqlx::query_scalar::<_, i64>(marked)
        .fetch_one(pool)
        .await
        .unwrap()
        == 0
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the idle relay never marked itself idle"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    running.await.unwrap().unwrap();
    assert_eq!(
        sqlx::query_scalar::<_, i64>(marked)
            .fetch_one(pool)
            .await
            .unwrap(),
        0,
        "a stopped relay left its idle mark"
    );
    check_delivery(&read_all(&publisher, &stream_name).await, &committed);
}

/// Effectively once, end to end: an outbox on SQLite, the relay, JetStream, and a
/// consumer that keeps a per-account projection through the inbox (in another SQLite
/// file). Every fifth message's first delivery "crashes" between the consumer's commit
/// and its ack, so the stream delivers it again: the inbox skips it, and every total is
/// right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inbox_makes_delivery_effectively_once() {
    use turnstile::idempotency::inbox::Inbox;
    use turnstile::idempotency::sqlite::SqliteIdempotencyStore;
    use turnstile::outbox::nats::JetStreamConsumer;

    let outbox = Sqlite::new().await;
    let (publisher, stream_name, subject) = fresh_stream("inbox").await;
    let topic = format!("{subject}.payment");
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();
    for n in 0..60_i64 {
        let account = format!("acct-{}", n % 6);
        *expected.entry(account.clone()).or_default() += n;
        let message = Message::json(
            topic.as_str(),
            account.as_str(),
            &serde_json::json!({"account": account, "cents": n}),
        )
        .unwrap();
        outbox.enqueue_one(&message, true).await;
    }
    let relay = Relay::new(outbox.store(), publisher.clone());
    while relay.run_once().await.unwrap().keys > 0 {}

    let dir = tempfile::tempdir().unwrap();
    let keys = SqliteIdempotencyStore::open(dir.path().join("consumer.db"))
        .await
        .unwrap();
    sqlx::query("CREATE TABLE totals (account TEXT PRIMARY KEY, cents INTEGER NOT NULL)")
        .execute(keys.pool())
        .await
        .unwrap();
    let inbox = Inbox::new(keys.clone(), "projection").unwrap();
    let consumer = JetStreamConsumer::durable(
        publisher.jetstream(),
        &stream_name,
        "projection",
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let (mut handled, mut skipped, mut crashed) = (0, 0, 0);
    for _ in 0..100 {
        let done = consumer
            .process(
                20,
                Duration::from_millis(200),
                Duration::from_millis(10),
                async |incoming| {
                    let body: serde_json::Value =
                        serde_json::from_slice(&incoming.payload).unwrap();
                    let (account, cents) = (
                        body["account"].as_str().unwrap().to_owned(),
                        body["cents"].as_i64().unwrap(),
                    );
                    let mut transaction = keys.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
                    let delivery = inbox
                        .process(
                            &mut transaction,
                            &incoming.inbox_id()?,
                            async |connection| {
                                sqlx::query(
                                    "INSERT INTO totals (account, cents) VALUES (?1, ?2)
                             ON CONFLICT (account) DO UPDATE SET cents = cents + ?2",
                                )
                                .bind(&account)
                                .bind(cents)
                                .execute(&mut *connection)
                                .await
                                .unwrap();
                                Ok::<_, turnstile::Error>(())
                            },
                        )
                        .await?;
                    transaction.commit().await.unwrap();
                    if delivery.is_duplicate() {
                        skipped += 1;
                    } else {
                        handled += 1;
                    }
                    if incoming.deliveries == 1 && cents % 5 == 0 {
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
        if done.acked == 0 && done.retried == 0 && handled == 60 && skipped >= crashed {
            break;
        }
    }
    assert_eq!(handled, 60, "each message is handled once");
    assert_eq!(crashed, 12);
    assert_eq!(skipped, 12, "each redelivery after a commit is skipped");
    let totals: Vec<(String, i64)> =
        sqlx::query_as("SELECT account, cents FROM totals ORDER BY account")
            .fetch_all(keys.pool())
            .await
            .unwrap();
    assert_eq!(totals, expected.into_iter().collect::<Vec<_>>());
}

/// The database restarts (crash and recovery) under a running relay: the relay waits
/// it out, and every message committed before and after reaches the stream once, in
/// order per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restart_under_the_relay_loses_nothing() {
    let server = turnstile_test_support::PostgresServer::spawn();
    let url = server.fresh_database("outboxrestart");
    // The test server's default is `synchronous_commit = off`; an application that
    // counts a commit as durable sets it on.
    let app_options = <sqlx::postgres::PgConnectOptions as std::str::FromStr>::from_str(&url)
        .unwrap()
        .options([("synchronous_commit", "on")]);
    let outbox = Postgres {
        outbox: PostgresOutbox::connect(&url).await.unwrap(),
        pool: sqlx::PgPool::connect_with(app_options).await.unwrap(),
        url,
    };
    let (publisher, stream_name, subject) = fresh_stream("restart").await;
    let relay = Relay::new(outbox.another().await, publisher.clone()).with_options(
        RelayOptions::new()
            .lease(Duration::from_secs(5))
            .idle_poll(Duration::from_millis(5), Duration::from_millis(200)),
    );
    let shutdown = CancellationToken::new();
    let running = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { relay.run(shutdown).await })
    };
    let topic = format!("{subject}.x");
    let mut committed = enqueue(&outbox, &topic, 8, 100).await;
    server.crash_and_restart();
    // The application's pool reconnects too; retry its first transactions.
    let mut more = 0;
    let mut maybe = HashSet::new();
    while more < 100 {
        let message = Message::json(
            topic.as_str(),
            format!("{topic}/account-{}", more % 8),
            &more,
        )
        .unwrap();
        let attempt = async {
            let mut transaction = outbox.pool.begin().await.map_err(|e| e.to_string())?;
            outbox
                .outbox
                .enqueue(&mut transaction, &message)
                .await
                .map_err(|e| e.to_string())?;
            transaction.commit().await.map_err(|e| e.to_string())
        };
        match attempt.await {
            Ok(()) => {
                committed.insert(message.id().to_owned());
                more += 1;
            }
            Err(_) => {
                maybe.insert(message.id().to_owned());
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    wait_until_empty(&outbox.store()).await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    check_delivery_allowing(
        &read_all(&publisher, &stream_name).await,
        &committed,
        &maybe,
    );
}

/// A consumer that insists on key order gets a key's messages in sequence even when the
/// stream holds them out of order (here: published 3, 1, 2): an early one is sent back
/// and handled once its predecessors have been.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_can_insist_on_key_order() {
    use turnstile::idempotency::inbox::{Delivery, Inbox};
    use turnstile::idempotency::sqlite::SqliteIdempotencyStore;
    use turnstile::outbox::nats::JetStreamConsumer;
    use turnstile::outbox::relay::Publisher;

    let (publisher, stream_name, subject) = fresh_stream("ordered").await;
    let topic = format!("{subject}.x");
    let messages: Vec<Message> = (1..=3)
        .map(|n| Message::json(topic.as_str(), "acct-1", &n).unwrap())
        .collect();
    for seq in [3_u64, 1, 2] {
        publisher
            .publish(&messages[usize::try_from(seq - 1).unwrap()], seq)
            .await
            .unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let keys = SqliteIdempotencyStore::open(dir.path().join("consumer.db"))
        .await
        .unwrap();
    let inbox = Inbox::new(keys.clone(), "ordered").unwrap();
    let consumer = JetStreamConsumer::durable(
        publisher.jetstream(),
        &stream_name,
        "ordered",
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let mut handled = Vec::new();
    for _ in 0..100 {
        consumer
            .process(
                10,
                Duration::from_millis(100),
                Duration::from_millis(10),
                async |incoming| {
                    let mut transaction = keys.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
                    let delivery = inbox
                        .process_in_order(
                            &mut transaction,
                            &incoming.inbox_id()?,
                            &incoming.cursor_key().unwrap(),
                            incoming.seq.unwrap(),
                            async |_connection| Ok::<_, turnstile::Error>(incoming.seq.unwrap()),
                        )
                        .await?;
                    transaction.commit().await.unwrap();
                    match delivery {
                        Delivery::Processed(seq) => handled.push(seq),
                        Delivery::Early { expected } => {
                            return Err(turnstile::Error::out_of_order(
                                "acct-1",
                                incoming.seq.unwrap(),
                                expected,
                            ));
                        }
                        _ => {}
                    }
                    Ok(())
                },
            )
            .await
            .unwrap();
        if handled.len() == 3 {
            break;
        }
    }
    assert_eq!(handled, vec![1, 2, 3]);
}

/// A relay's settlement that meets an application transaction writing the same keys in
/// the other order fails (its store's lock timeout, or PostgreSQL's deadlock detector
/// picks one of the two). The relay settles again within its lease instead of dropping
/// the round, so nothing is published twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_settlement_is_retried_not_republished() {
    let outbox = Postgres::new().await;
    let (publisher, stream_name, subject) = fresh_stream("deadlock").await;
    let watched = watch_publishes(shared_nats(), &subject).await;
    let topic = format!("{subject}.created");
    let mut committed = HashSet::new();
    for key in ["a", "b"] {
        let message = Message::new(topic.as_str(), key, b"first".to_vec()).unwrap();
        outbox.enqueue_one(&message, true).await;
        committed.insert(message.id().to_owned());
    }
    let (hook, hooked) = tokio::sync::oneshot::channel();
    let relay = Relay::new(
        outbox.another().await,
        // Before the first publish, the test's application transaction runs, and the
        // publish waits for it: between the relay's claim and its settlement.
        BeforeEach {
            inner: publisher.clone(),
            hook: {
                let hook = std::sync::Arc::new(tokio::sync::Mutex::new(Some(hook)));
                Box::new(move |_| {
                    let hook = std::sync::Arc::clone(&hook);
                    Box::pin(async move {
                        if let Some(hook) = hook.lock().await.take() {
                            let (done, acted) = tokio::sync::oneshot::channel();
                            hook.send(done).unwrap();
                            acted.await.unwrap();
                        }
                        Ok(())
                    })
                })
            },
        },
    );
    let round = tokio::spawn(async move { relay.run_once().await });
    // After the claim, before the settlement: an application transaction writes key b,
    // lets the relay go on to settle (it waits for b), then writes key a.
    let resume = hooked.await.unwrap();
    let mut transaction = outbox.pool.begin().await.unwrap();
    let late_b = Message::new(topic.as_str(), "b", b"late".to_vec()).unwrap();
    outbox
        .outbox
        .enqueue(&mut transaction, &late_b)
        .await
        .unwrap();
    resume.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let late_a = Message::new(topic.as_str(), "a", b"late".to_vec()).unwrap();
    let application = outbox.outbox.enqueue(&mut transaction, &late_a).await;
    match application {
        Ok(_) => {
            outbox.outbox.commit(transaction).await.unwrap();
            committed.extend([late_a.id().to_owned(), late_b.id().to_owned()]);
        }
        // The application was the deadlock's victim: its transaction is gone.
        Err(_) => transaction.rollback().await.unwrap(),
    }
    let round = round
        .await
        .unwrap()
        .expect("the round must settle, not fail");
    assert_eq!(round.published, 2);
    let again = Relay::new(outbox.store(), publisher.clone());
    while again.run_once().await.unwrap().keys > 0 {}
    check_delivery(&read_all(&publisher, &stream_name).await, &committed);
    check_published_once(&published_ids(watched).await, &committed);
}

/// An outbox told its broker's limit refuses a larger message at enqueue, in the
/// application's transaction and before anything is written, instead of parking its
/// key at the first publish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_over_the_brokers_limit_is_refused_at_enqueue() {
    let outbox = Sqlite::new().await;
    let store = outbox.store().max_message(Some(1024 * 1024));
    let mut transaction = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    let large = Message::new("big.x", "k", vec![b'x'; 2 * 1024 * 1024]).unwrap();
    let error = store.enqueue(&mut transaction, &large).await.unwrap_err();
    assert_eq!(
        error.kind(),
        turnstile::ErrorKind::InvalidOptions,
        "{error}"
    );
    let small = Message::new("big.x", "k", vec![b'x'; 1024]).unwrap();
    assert_eq!(store.enqueue(&mut transaction, &small).await.unwrap(), 1);
    store.commit(transaction).await.unwrap();
    assert_eq!(store.status(10).await.unwrap().pending, 1);
}

/// Consumes every message of `stream_name` through `inbox`, in key order, and returns
/// what it handled as (producer, key, seq).
async fn consume_in_order(
    publisher: &JetStreamPublisher,
    stream_name: &str,
    consumer_name: &str,
    keys: &turnstile::idempotency::sqlite::SqliteIdempotencyStore,
    inbox: &turnstile::idempotency::inbox::Inbox<
        turnstile::idempotency::sqlite::SqliteIdempotencyStore,
    >,
) -> Vec<(Option<String>, String, u64)> {
    use turnstile::idempotency::inbox::Delivery;
    use turnstile::outbox::nats::JetStreamConsumer;
    let consumer = JetStreamConsumer::durable(
        publisher.jetstream(),
        stream_name,
        consumer_name,
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let mut handled = Vec::new();
    loop {
        let processed = consumer
            .process(
                10,
                Duration::from_millis(300),
                Duration::from_millis(10),
                async |incoming| {
                    let mut transaction = keys.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
                    let delivery = inbox
                        .process_in_order(
                            &mut transaction,
                            &incoming.inbox_id()?,
                            &incoming.cursor_key().unwrap(),
                            incoming.seq.unwrap(),
                            async |_| Ok::<_, turnstile::Error>(()),
                        )
                        .await?;
                    transaction.commit().await.unwrap();
                    if let Delivery::Processed(()) = delivery {
                        handled.push((
                            incoming.producer.clone(),
                            incoming.key.clone().unwrap(),
                            incoming.seq.unwrap(),
                        ));
                    }
                    Ok(())
                },
            )
            .await
            .unwrap();
        if processed.acked + processed.retried == 0 {
            return handled;
        }
    }
}

/// Two outboxes that use the same ordering key keep two cursors at the consumer (each
/// sends its identity); an outbox whose database was restored from a backup numbers
/// new messages again from where the backup was, and the consumer handles them
/// instead of taking them for messages it has seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cursors_are_per_producer_and_survive_a_restored_outbox() {
    use turnstile::idempotency::inbox::Inbox;
    use turnstile::idempotency::sqlite::SqliteIdempotencyStore;
    let (publisher, stream_name, subject) = fresh_stream("producers").await;
    let topic = format!("{subject}.created");
    let (first, second) = (Sqlite::new().await, Sqlite::new().await);
    assert_ne!(first.outbox.identity(), second.outbox.identity());
    assert!(first.outbox.identity().is_some());
    for outbox in [&first, &second] {
        for n in 0..2 {
            let message = Message::json(topic.as_str(), "account-1", &n).unwrap();
            outbox.enqueue_one(&message, true).await;
        }
    }
    // A backup of the first outbox after its two messages.
    let backup = first._dir.path().join("backup.db");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "VACUUM INTO '{}'",
        backup.display()
    )))
    .execute(first.outbox.pool())
    .await
    .unwrap();
    let message = Message::json(topic.as_str(), "account-1", &2).unwrap();
    first.enqueue_one(&message, true).await;
    for outbox in [&first, &second] {
        let relay = Relay::new(outbox.store(), publisher.clone());
        while relay.run_once().await.unwrap().keys > 0 {}
    }
    let dir = tempfile::tempdir().unwrap();
    let keys = SqliteIdempotencyStore::open(dir.path().join("consumer.db"))
        .await
        .unwrap();
    let inbox = Inbox::new(keys.clone(), "totals").unwrap();
    let handled = consume_in_order(&publisher, &stream_name, "totals", &keys, &inbox).await;
    let first_id = first.outbox.identity().map(str::to_owned);
    let second_id = second.outbox.identity().map(str::to_owned);
    let mut expected: Vec<_> = [(&first_id, 1), (&first_id, 2), (&first_id, 3)]
        .into_iter()
        .chain([(&second_id, 1), (&second_id, 2)])
        .map(|(producer, seq)| (producer.clone(), "account-1".to_owned(), seq))
        .collect();
    let mut sorted = handled.clone();
    sorted.sort();
    expected.sort();
    assert_eq!(
        sorted, expected,
        "both producers' messages, each in its own order"
    );

    // The first outbox's database is restored from the backup: its next message is
    // number 3 again, with a new id.
    let restored = SqliteOutbox::open(&backup).await.unwrap();
    assert_eq!(restored.identity(), first.outbox.identity());
    let mut transaction = restored.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    let again = Message::json(topic.as_str(), "account-1", &"after the restore").unwrap();
    assert_eq!(restored.enqueue(&mut transaction, &again).await.unwrap(), 3);
    restored.commit(transaction).await.unwrap();
    let relay = Relay::new(restored, publisher.clone());
    while relay.run_once().await.unwrap().keys > 0 {}
    let handled = consume_in_order(&publisher, &stream_name, "totals", &keys, &inbox).await;
    assert_eq!(
        handled,
        vec![(first_id, "account-1".to_owned(), 3)],
        "the restored outbox's new message was dropped as seen"
    );
}

/// A message from another producer without an id of its own (no `Nats-Msg-Id`) has
/// none at the consumer: the inbox refuses to deduplicate it on a made-up one, so
/// neither two such messages nor a redelivery are confused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_message_without_an_id_gets_none() {
    use turnstile::outbox::nats::JetStreamConsumer;
    let (publisher, stream_name, subject) = fresh_stream("foreign").await;
    for body in ["one", "two"] {
        publisher
            .jetstream()
            .publish(format!("{subject}.raw"), body.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let consumer = JetStreamConsumer::durable(
        publisher.jetstream(),
        &stream_name,
        "foreign",
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let mut refusals = Vec::new();
    consumer
        .process(
            10,
            Duration::from_millis(300),
            Duration::from_millis(10),
            async |incoming| {
                assert_eq!(incoming.id, None);
                assert_eq!(incoming.producer, None);
                refusals.push(incoming.inbox_id().unwrap_err().kind());
                Ok(())
            },
        )
        .await
        .unwrap();
    assert_eq!(refusals, [turnstile::ErrorKind::InvalidOptions; 2]);
}

/// A relay that dies after the broker's acks and before it settles, and stays down
/// longer than the stream's duplicate window: the next relay publishes the round
/// again, and the stream keeps both copies (its window has passed). The consumer's
/// inbox is what makes the effects happen once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_past_the_duplicate_window_are_handled_once_by_the_inbox() {
    use turnstile::idempotency::inbox::Inbox;
    use turnstile::idempotency::sqlite::SqliteIdempotencyStore;
    use turnstile::outbox::relay::Publisher as _;
    let publisher = connect(shared_nats()).await;
    let (stream_name, subject) = names("window");
    stream(
        &publisher,
        &stream_name,
        &format!("{subject}.>"),
        Duration::from_secs(2),
    )
    .await;
    let outbox = Sqlite::new().await;
    let topic = format!("{subject}.created");
    for n in 0..6 {
        let message = Message::json(topic.as_str(), format!("k{}", n % 2), &n).unwrap();
        outbox.enqueue_one(&message, true).await;
    }
    let store = outbox.store();
    // The relay that dies: its publishes are acked, its round never settles.
    let lease = Duration::from_millis(500);
    for leased in store.claim(8, 8, lease).await.unwrap() {
        for stored in &leased.messages {
            publisher
                .publish(&stored.message, stored.seq)
                .await
                .unwrap();
        }
    }
    // Down past its lease and past the stream's duplicate window.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let relay = Relay::new(store.clone(), publisher.clone()).with_options(
        RelayOptions::new().lease(lease).backoff(Backoff {
            base: Duration::from_millis(10),
            max: Duration::from_millis(100),
        }),
    );
    while relay.run_once().await.unwrap().keys > 0 {}
    assert_eq!(
        read_all(&publisher, &stream_name).await.len(),
        12,
        "past its window the stream keeps the second copy"
    );
    let dir = tempfile::tempdir().unwrap();
    let keys = SqliteIdempotencyStore::open(dir.path().join("consumer.db"))
        .await
        .unwrap();
    let inbox = Inbox::new(keys.clone(), "effects").unwrap();
    let handled = consume_in_order(&publisher, &stream_name, "effects", &keys, &inbox).await;
    assert_eq!(handled.len(), 6, "an effect happened twice: {handled:?}");
}

/// Header names the relay and NATS rely on are refused at enqueue, in any case
/// (`turnstile-seq`, `Nats-Msg-Id`, ...); a row an older version stored with one is
/// published with the relay's own id and sequence, never the application's, so the
/// inbox does not take an unhandled message for a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserved_header_names_never_win_over_the_relays() {
    use turnstile::outbox::nats::JetStreamConsumer;
    for name in [
        "turnstile-seq",
        "Turnstile-Id",
        "TURNSTILE-KEY",
        "nats-msg-id",
        "Nats-Expected-Stream",
        "turnstile-dead-letter-reason",
    ] {
        let refused = Message::json("t", "k", &1)
            .unwrap()
            .header(name, "7")
            .unwrap_err();
        assert_eq!(refused.kind(), turnstile::ErrorKind::InvalidName, "{name}");
    }
    let (publisher, stream_name, subject) = fresh_stream("reserved").await;
    let outbox = Sqlite::new().await;
    let message = Message::json(format!("{subject}.created").as_str(), "account-1", &1).unwrap();
    outbox.enqueue_one(&message, true).await;
    // As an older version could have stored it.
    sqlx::query(
        "UPDATE turnstile_outbox SET headers = \
         '{\"turnstile-seq\":\"99\",\"nats-msg-id\":\"forged\",\"x-app\":\"kept\"}'",
    )
    .execute(outbox.outbox.pool())
    .await
    .unwrap();
    let relay = Relay::new(outbox.store(), publisher.clone());
    while relay.run_once().await.unwrap().keys > 0 {}
    let consumer = JetStreamConsumer::durable(
        publisher.jetstream(),
        &stream_name,
        "reserved",
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let mut seen = Vec::new();
    for _ in 0..20 {
        consumer
            .process(
                10,
                Duration::from_millis(200),
                Duration::from_millis(10),
                async |incoming| {
                    seen.push((
                        incoming.id.clone(),
                        incoming.seq,
                        incoming.header("x-app").map(str::to_owned),
                    ));
                    Ok::<_, turnstile::Error>(())
                },
            )
            .await
            .unwrap();
        if !seen.is_empty() {
            break;
        }
    }
    assert_eq!(
        seen,
        vec![(
            Some(message.id().to_owned()),
            Some(1),
            Some("kept".to_owned())
        )]
    );
}

/// A relay that starts while the broker is down has not checked its topics yet: the
/// check's request fails (no responders, a timeout), which is a broker outage, not a
/// missing stream, so no key parks however often it fails, and everything goes out
/// once the broker is back (the check's failure used to count as permanent and park
/// every key after `max_attempts`). The outage lasts past two of the client's 5 s
/// request timeouts, so that two checks fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_started_during_an_outage_parks_nothing() {
    let nats = NatsServer::spawn();
    let publisher = connect(&nats).await;
    stream(&publisher, "BLIP", "blip.>", Duration::from_secs(120)).await;
    let outbox = Sqlite::new().await;
    let store = outbox.store();
    nats.stop();
    let committed = enqueue(&outbox, "blip.entry", 3, 5).await;
    let shutdown = CancellationToken::new();
    let relay = Relay::new(store.clone(), publisher.clone()).with_options(
        RelayOptions::new().max_attempts(2).backoff(Backoff {
            base: Duration::from_millis(50),
            max: Duration::from_millis(200),
        }),
    );
    let running = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { relay.run(shutdown).await })
    };
    tokio::time::sleep(Duration::from_secs(12)).await;
    let status = store.status(10).await.unwrap();
    assert!(
        status.parked.is_empty(),
        "an outage parked keys: {:?}",
        status.parked
    );
    assert!(status.pending > 0);
    nats.start_again();
    wait_until_empty(&store).await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    assert!(store.status(10).await.unwrap().parked.is_empty());
    check_delivery(&read_all(&publisher, "BLIP").await, &committed);
}

/// An application transaction that holds one key's row while a relay settles a round
/// delays only that key: the other key of the round is recorded as delivered while the
/// row is still held, and nothing is published twice. On MySQL the settlement used to
/// wait out the server's 50 s lock wait with every key of the round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_locked_key_row_delays_only_its_key() {
    let outbox = Arc::new(Mysql::new().await);
    let (nats, stream_name, subject) = fresh_stream("lockedrow").await;
    let topic = format!("{subject}.entry");
    let (locked, free) = (format!("{subject}-locked"), format!("{subject}-free"));
    let mut committed = HashSet::new();
    for key in [&locked, &free] {
        let message = Message::new(topic.as_str(), key.as_str(), b"first".to_vec()).unwrap();
        outbox.enqueue_one(&message, true).await;
        committed.insert(message.id().to_owned());
    }
    let next = Message::new(topic.as_str(), locked.as_str(), b"next".to_vec()).unwrap();
    committed.insert(next.id().to_owned());
    // Between the claim and the settlement, an application transaction takes the
    // locked key's row (enqueueing its next message) and holds it for 6 s.
    let holder: Arc<std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>> = Arc::default();
    let publisher = BeforeEach {
        inner: nats.clone(),
        hook: {
            let (outbox, locked, next, holder) = (
                Arc::clone(&outbox),
                locked.clone(),
                next.clone(),
                Arc::clone(&holder),
            );
            Box::new(move |message| {
                let start = message.key() == locked && holder.lock().unwrap().is_none();
                if start {
                    let (outbox, next) = (Arc::clone(&outbox), next.clone());
                    *holder.lock().unwrap() = Some(tokio::spawn(async move {
                        outbox.enqueue_holding(&next, Duration::from_secs(6)).await;
                    }));
                }
                Box::pin(async move {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    Ok(())
                })
            })
        },
    };
    let relay = Relay::new(outbox.store(), publisher)
        .with_options(RelayOptions::new().lease(Duration::from_secs(20)));
    let started = std::time::Instant::now();
    let round = tokio::spawn(async move { relay.run_once().await });
    let acked = async |key: &str| -> i64 {
        sqlx::query_scalar("SELECT acked_seq FROM turnstile_outbox_keys WHERE ordering_key = ?")
            .bind(key.as_bytes())
            .fetch_one(&outbox.pool)
            .await
            .unwrap()
    };
    while acked(&free).await < 1 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the free key waited for the locked one's row"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(round.await.unwrap().is_ok());
    let held = holder.lock().unwrap().take().unwrap();
    held.await.unwrap();
    wait_for_relay(&outbox, &nats).await;
    check_delivery(&read_all(&nats, &stream_name).await, &committed);
}

/// Drains `outbox` with a plain relay.
async fn wait_for_relay(outbox: &Mysql, nats: &JetStreamPublisher) {
    let relay = Relay::new(outbox.store(), nats.clone());
    while relay.run_once().await.unwrap().keys > 0 {}
}

/// A relay whose NATS connection broke, and whose client is reconnecting through a
/// network that swallows everything: a publish it makes meanwhile must complete inside
/// its lease or never be sent (async-nats queues commands while it reconnects and sends
/// them once it is back). Another relay then publishes the key's messages; when the
/// first relay's network heals, past the stream's duplicate window, no stale copy of
/// the key's head lands after its later messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_never_lands_after_its_lease() {
    use turnstile_test_support::TcpProxy;
    let nats = shared_nats();
    let direct = connect(nats).await;
    let (stream_name, subject) = names("stale");
    let window = Duration::from_secs(2);
    stream(&direct, &stream_name, &format!("{subject}.>"), window).await;
    let proxy = TcpProxy::start(nats.port());
    let cut_off = JetStreamPublisher::connect(&proxy.url_for(&nats.url()), Duration::from_secs(1))
        .await
        .unwrap();
    let outbox = Sqlite::new().await;
    let store = outbox.store();
    let topic = format!("{subject}.entry");
    let options = RelayOptions::new()
        .lease(Duration::from_secs(1))
        .backoff(Backoff {
            base: Duration::from_millis(10),
            max: Duration::from_millis(100),
        });
    // The first relay checks the topic and publishes while its network is whole.
    let stale = Relay::new(store.clone(), cut_off.clone()).with_options(options.clone());
    let warm = Message::json(topic.as_str(), "warm", &0).unwrap();
    outbox.enqueue_one(&warm, true).await;
    assert_eq!(stale.run_once().await.unwrap().published, 1);
    let first = Message::json(topic.as_str(), "k", &1).unwrap();
    outbox.enqueue_one(&first, true).await;
    proxy.cut();
    proxy.close_connections();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let round = stale.run_once().await.unwrap();
    assert_eq!(round.keys, 1);
    // Its lease over, a relay with a working network publishes the head and the next.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let second = Message::json(topic.as_str(), "k", &2).unwrap();
    outbox.enqueue_one(&second, true).await;
    let fresh = Relay::new(store.clone(), direct.clone()).with_options(options);
    wait_until_empty_relaying(&fresh, &store).await;
    tokio::time::sleep(window + Duration::from_millis(500)).await;
    proxy.heal();
    tokio::time::sleep(Duration::from_secs(6)).await;
    let delivered = read_all(&direct, &stream_name).await;
    let seqs: Vec<u64> = delivered
        .iter()
        .filter(|(key, _, _)| key == "k")
        .map(|(_, seq, _)| *seq)
        .collect();
    assert_eq!(
        seqs,
        [1, 2],
        "a publish landed after its lease: {delivered:?}"
    );
}

/// Runs `relay` round after round until `store` holds nothing to publish.
async fn wait_until_empty_relaying(relay: &Relay, store: &impl OutboxStore) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while store.status(1).await.unwrap().pending > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the relay did not catch up"
        );
        let _ = relay.run_once().await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
