//! The SQLite idempotency store: the conformance suite against a real database file.

mod idempotency_conformance;

use std::future::Future;
use std::pin::Pin;

use idempotency_conformance::TestStore;
use turnstile::idempotency::Idempotency;
use turnstile::idempotency::sqlite::SqliteIdempotencyStore;

struct SqliteFile {
    dir: tempfile::TempDir,
}

impl TestStore for SqliteFile {
    fn client(&self) -> Pin<Box<dyn Future<Output = Idempotency> + Send + '_>> {
        Box::pin(async move {
            let path = self.dir.path().join("keys.sqlite3");
            Idempotency::new(SqliteIdempotencyStore::open(path).await.unwrap())
        })
    }
}

async fn sqlite_file() -> SqliteFile {
    SqliteFile {
        dir: tempfile::tempdir().unwrap(),
    }
}

idempotency_conformance_tests!(super::sqlite_file);

/// Same-transaction mode on SQLite: concurrent duplicates in write transactions insert
/// the row once; a rolled-back run leaves nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transaction_mode_commits_key_work_and_outcome_together() {
    use turnstile::idempotency::{
        Fingerprint, IdempotencyKey, IdempotencyOptions, IdempotencyStore, Scope,
        TransactionalIdempotency,
    };
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteIdempotencyStore::open(dir.path().join("keys.sqlite3"))
        .await
        .unwrap();
    let pool = store.pool().clone();
    sqlx::query("CREATE TABLE payments (id INTEGER PRIMARY KEY, key TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let scope = Scope::new("tenant-1").unwrap();
    let key = IdempotencyKey::new("pay-1").unwrap();
    let fingerprint = Fingerprint::of(&[b"1000"]);
    let options = IdempotencyOptions::new();
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let (store, pool, scope, key, options) = (
            store.clone(),
            pool.clone(),
            scope.clone(),
            key.clone(),
            options.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut transaction = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
            let id: i64 = store
                .run_once_in_transaction(
                    &mut transaction,
                    &scope,
                    &key,
                    &fingerprint,
                    &options,
                    async |connection: &mut sqlx::SqliteConnection, _token| {
                        Ok::<_, turnstile::Error>(
                            sqlx::query_scalar(
                                "INSERT INTO payments (key) VALUES ('pay-1') RETURNING id",
                            )
                            .fetch_one(&mut *connection)
                            .await
                            .unwrap(),
                        )
                    },
                )
                .await
                .unwrap();
            transaction.commit().await.unwrap();
            id
        }));
    }
    let mut ids = Vec::new();
    for task in tasks {
        ids.push(task.await.unwrap());
    }
    ids.dedup();
    assert_eq!(ids.len(), 1, "{ids:?}");
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM payments")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(count, 1);

    let other = IdempotencyKey::new("pay-2").unwrap();
    let mut transaction = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    let _: i64 = store
        .run_once_in_transaction(
            &mut transaction,
            &scope,
            &other,
            &fingerprint,
            &options,
            async |connection: &mut sqlx::SqliteConnection, _| {
                Ok::<_, turnstile::Error>(
                    sqlx::query_scalar("INSERT INTO payments (key) VALUES ('pay-2') RETURNING id")
                        .fetch_one(&mut *connection)
                        .await
                        .unwrap(),
                )
            },
        )
        .await
        .unwrap();
    transaction.rollback().await.unwrap();
    assert!(store.get(&scope, &other).await.unwrap().is_none());
}

/// The inbox: a redelivered message is skipped, per consumer; a rolled-back handling
/// leaves the message unrecorded, so its redelivery runs.
#[tokio::test]
async fn the_inbox_skips_redeliveries_per_consumer() {
    use turnstile::idempotency::inbox::{Delivery, Inbox};
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteIdempotencyStore::open(dir.path().join("app.sqlite3"))
        .await
        .unwrap();
    let billing = Inbox::new(store.clone(), "billing").unwrap();
    let shipping = Inbox::new(store.clone(), "shipping").unwrap();
    let deliver = async |inbox: &Inbox<SqliteIdempotencyStore>, id: &str, commit: bool| {
        let mut transaction = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
        let delivery = inbox
            .process(
                &mut transaction,
                id,
                async |_connection: &mut sqlx::SqliteConnection| {
                    Ok::<_, turnstile::Error>(id.len())
                },
            )
            .await
            .unwrap();
        if commit {
            transaction.commit().await.unwrap();
        } else {
            transaction.rollback().await.unwrap();
        }
        delivery
    };
    assert_eq!(deliver(&billing, "m-1", true).await, Delivery::Processed(3));
    assert_eq!(deliver(&billing, "m-1", true).await, Delivery::Duplicate);
    assert_eq!(
        deliver(&shipping, "m-1", true).await,
        Delivery::Processed(3)
    );
    assert_eq!(
        deliver(&billing, "m-2", false).await,
        Delivery::Processed(3)
    );
    assert_eq!(
        deliver(&billing, "m-2", true).await,
        Delivery::Processed(3),
        "a rolled-back handling was recorded"
    );
    let mut transaction = store.pool().begin().await.unwrap();
    let error = billing
        .process(
            &mut transaction,
            "bad\nid",
            async |_c: &mut sqlx::SqliteConnection| Ok::<_, turnstile::Error>(()),
        )
        .await
        .unwrap_err();
    assert_eq!(error.kind(), turnstile::ErrorKind::InvalidName);
}

/// Every outcome is counted and every store call timed, by engine and operation, into
/// whatever `metrics` recorder the application installed.
#[test]
fn outcomes_and_store_latency_reach_the_metrics_recorder() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use turnstile::idempotency::{Fingerprint, IdempotencyKey, Scope};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let dir = tempfile::tempdir().unwrap();
    metrics::with_local_recorder(&recorder, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let keys = Idempotency::new(
                SqliteIdempotencyStore::open(dir.path().join("m.db"))
                    .await
                    .unwrap(),
            );
            let (scope, key) = (Scope::global(), IdempotencyKey::new("k").unwrap());
            let fingerprint = Fingerprint::of(&[b"x"]);
            for _ in 0..2 {
                let answer: u32 = keys
                    .run_once(&scope, &key, &fingerprint, async |_| {
                        Ok::<_, turnstile::Error>(7)
                    })
                    .await
                    .unwrap();
                assert_eq!(answer, 7);
            }
        });
    });
    let mut outcomes = std::collections::BTreeMap::new();
    let mut store_calls = std::collections::BTreeMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let labels: Vec<(String, String)> = key
            .key()
            .labels()
            .map(|label| (label.key().to_owned(), label.value().to_owned()))
            .collect();
        let label = |name: &str| {
            labels
                .iter()
                .find(|(key, _)| key == name)
                .map(|(_, value)| value.clone())
                .unwrap_or_default()
        };
        match (key.key().name(), value) {
            ("turnstile_idempotency_outcomes_total", DebugValue::Counter(n)) => {
                outcomes.insert(label("outcome"), n);
            }
            ("turnstile_idempotency_store_seconds", DebugValue::Histogram(samples)) => {
                assert_eq!(label("engine"), "sqlite");
                assert_eq!(label("result"), "ok");
                store_calls.insert(label("op"), samples.len());
            }
            _ => {}
        }
    }
    assert_eq!(outcomes.get("started"), Some(&1), "{outcomes:?}");
    assert_eq!(outcomes.get("completed"), Some(&1), "{outcomes:?}");
    assert_eq!(outcomes.get("replayed"), Some(&1), "{outcomes:?}");
    assert_eq!(store_calls.get("claim"), Some(&2), "{store_calls:?}");
    assert_eq!(store_calls.get("complete"), Some(&1), "{store_calls:?}");
}

/// The inbox's per-key cursors on SQLite.
#[tokio::test]
async fn cursors_follow_each_keys_sequence() {
    use turnstile::idempotency::{Scope, TransactionalIdempotency};
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteIdempotencyStore::open(dir.path().join("c.db"))
        .await
        .unwrap();
    let consumer = Scope::new("projection").unwrap();
    idempotency_conformance::cursors_follow_each_keys_sequence(async |key: &str, seq| {
        let mut transaction = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
        let step = store
            .advance_cursor(&mut transaction, &consumer, key, seq, 0)
            .await
            .unwrap();
        transaction.commit().await.unwrap();
        step
    })
    .await;
}

/// The global scope and a tenant called "global" never share a key.
#[tokio::test]
async fn the_global_scope_is_no_tenants_scope() {
    use turnstile::idempotency::{Fingerprint, IdempotencyKey, Scope};
    let dir = tempfile::tempdir().unwrap();
    let keys = Idempotency::new(
        SqliteIdempotencyStore::open(dir.path().join("g.db"))
            .await
            .unwrap(),
    );
    let (key, fingerprint) = (IdempotencyKey::new("k").unwrap(), Fingerprint::of(&[b"x"]));
    let mut answers = Vec::new();
    for scope in [Scope::global(), Scope::new("global").unwrap()] {
        let answer: String = keys
            .run_once(&scope, &key, &fingerprint, async |_| {
                Ok::<_, turnstile::Error>(format!("ran in {scope}"))
            })
            .await
            .unwrap();
        answers.push(answer);
    }
    assert_eq!(answers, ["ran in (global)", "ran in global"]);
}

/// Records are committed durably by default (`synchronous = FULL`, each commit on disk
/// when it returns), and `turnstile_synchronous=normal` is the explicit opt-out.
#[tokio::test]
async fn records_are_committed_durably_unless_the_url_says_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("durable.db");
    let synchronous = |store: SqliteIdempotencyStore| async move {
        sqlx::query_scalar::<_, i64>("PRAGMA synchronous")
            .fetch_one(store.pool())
            .await
            .unwrap()
    };
    // SQLite's numbers: 1 is NORMAL, 2 is FULL.
    let opened = SqliteIdempotencyStore::open(&path).await.unwrap();
    assert_eq!(synchronous(opened).await, 2);
    let url = format!("sqlite://{}", path.display());
    let opened = SqliteIdempotencyStore::open_url(&url).await.unwrap();
    assert_eq!(synchronous(opened).await, 2);
    let opened = SqliteIdempotencyStore::open_url(&format!("{url}?turnstile_synchronous=normal"))
        .await
        .unwrap();
    assert_eq!(synchronous(opened).await, 1);
    let error = SqliteIdempotencyStore::open_url(&format!("{url}?turnstile_synchronous=off"))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), turnstile::ErrorKind::InvalidUrl);
}

/// A consumer that starts after a stream dropped its early messages: by default a key
/// never seen waits for its message 1; `start_at_first_seen` starts it at the first
/// message that arrives.
#[tokio::test]
async fn an_inbox_can_start_a_key_at_its_first_message_seen() {
    use turnstile::idempotency::inbox::{Delivery, Inbox};
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteIdempotencyStore::open(dir.path().join("in.db"))
        .await
        .unwrap();
    let step = async |inbox: &Inbox<SqliteIdempotencyStore>, id: &str, seq: u64| {
        let mut transaction = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
        let delivery = inbox
            .process_in_order(&mut transaction, id, "key", seq, async |_| {
                Ok::<_, turnstile::Error>(())
            })
            .await
            .unwrap();
        transaction.commit().await.unwrap();
        delivery
    };
    let from_one = Inbox::new(store.clone(), "from-one").unwrap();
    assert_eq!(
        step(&from_one, "m5", 5).await,
        Delivery::Early { expected: 1 }
    );
    let from_now = Inbox::new(store.clone(), "from-now")
        .unwrap()
        .start_at_first_seen(true);
    assert_eq!(step(&from_now, "m5", 5).await, Delivery::Processed(()));
    assert_eq!(
        step(&from_now, "m7", 7).await,
        Delivery::Early { expected: 6 }
    );
    assert_eq!(step(&from_now, "m6", 6).await, Delivery::Processed(()));
    assert_eq!(step(&from_now, "m6", 6).await, Delivery::Duplicate);
}

/// The cursor only moves forward: a message numbered below it but new to the consumer
/// (a competing consumer got ahead, a first delivery failed and came back later) is
/// handled, and the key's later messages still follow on from the highest number seen
/// (moving the cursor back to it left every later message `Early` for good).
#[tokio::test]
async fn an_inbox_cursor_never_moves_backwards() {
    use turnstile::idempotency::inbox::{Delivery, Inbox};
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteIdempotencyStore::open(dir.path().join("in.db"))
        .await
        .unwrap();
    let step = async |inbox: &Inbox<SqliteIdempotencyStore>, id: &str, seq: u64| {
        let mut transaction = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
        let delivery = inbox
            .process_in_order(&mut transaction, id, "key", seq, async |_| {
                Ok::<_, turnstile::Error>(())
            })
            .await
            .unwrap();
        transaction.commit().await.unwrap();
        delivery
    };
    let inbox = Inbox::new(store.clone(), "from-now")
        .unwrap()
        .start_at_first_seen(true);
    // Message 5's first delivery failed; 6 arrived first and started the key.
    assert_eq!(step(&inbox, "m6", 6).await, Delivery::Processed(()));
    assert_eq!(step(&inbox, "m5", 5).await, Delivery::Processed(()));
    assert_eq!(step(&inbox, "m5", 5).await, Delivery::Duplicate);
    assert_eq!(step(&inbox, "m6", 6).await, Delivery::Duplicate);
    assert_eq!(
        step(&inbox, "m7", 7).await,
        Delivery::Processed(()),
        "the cursor moved back to 5"
    );
    assert_eq!(step(&inbox, "m8", 8).await, Delivery::Processed(()));
}
