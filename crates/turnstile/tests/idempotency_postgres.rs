//! The PostgreSQL idempotency store: the conformance suite against a real server, with
//! and without notifications.

mod idempotency_conformance;

use std::future::Future;
use std::pin::Pin;

use idempotency_conformance::TestStore;
use turnstile::idempotency::Idempotency;
use turnstile::idempotency::postgres::PostgresIdempotencyStore;
use turnstile_test_support::shared_postgres;

struct PostgresDatabase {
    url: String,
}

impl TestStore for PostgresDatabase {
    fn client(&self) -> Pin<Box<dyn Future<Output = Idempotency> + Send + '_>> {
        Box::pin(async move {
            Idempotency::new(PostgresIdempotencyStore::connect(&self.url).await.unwrap())
        })
    }
}

async fn fresh_database() -> PostgresDatabase {
    PostgresDatabase {
        url: shared_postgres().fresh_database("idem"),
    }
}

idempotency_conformance_tests!(super::fresh_database);

mod polling {
    //! The same suite with notifications off: waiters poll.
    use super::*;

    async fn without_notifications() -> PostgresDatabase {
        PostgresDatabase {
            url: format!(
                "{}?turnstile_notify=off",
                shared_postgres().fresh_database("idempoll")
            ),
        }
    }

    idempotency_conformance_tests!(super::without_notifications);
}

mod server_clock_ahead {
    //! The whole suite on a server whose wall clock is an hour ahead of the host's:
    //! leases and retention go by the database server's clock alone. A deadline written
    //! by one clock and read by the other would end every lease at once here or keep a
    //! dead worker's key for an hour on the server behind
    //! (`a_dead_workers_key_is_claimable_after_its_lease` fails).
    use super::*;
    use turnstile_test_support::ServerClock;

    async fn fresh_database() -> PostgresDatabase {
        PostgresDatabase {
            url: turnstile_test_support::shared_postgres_on(ServerClock::HourAhead)
                .fresh_database("ahead"),
        }
    }

    idempotency_conformance_tests!(super::fresh_database);
}

mod server_clock_behind {
    //! The whole suite on a server whose wall clock is an hour behind the host's.
    use super::*;
    use turnstile_test_support::ServerClock;

    async fn fresh_database() -> PostgresDatabase {
        PostgresDatabase {
            url: turnstile_test_support::shared_postgres_on(ServerClock::HourBehind)
                .fresh_database("behind"),
        }
    }

    idempotency_conformance_tests!(super::fresh_database);
}

/// Stores are opened from URLs like the lock stores; unknown options are refused.
#[tokio::test]
async fn urls_open_the_store() {
    let url = shared_postgres().fresh_database("idemurl");
    let keys = Idempotency::connect(&format!("{url}?turnstile_prefix=app"))
        .await
        .unwrap();
    assert!(keys.store().describe().starts_with("postgres://"));
    let error = Idempotency::connect(&format!("{url}?turnstile_nope=1"))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), turnstile::ErrorKind::InvalidUrl);
    // MySQL is an idempotency store too: a server that is not there is unavailable.
    let error = Idempotency::connect("mysql://127.0.0.1:1/db")
        .await
        .unwrap_err();
    assert_eq!(error.kind(), turnstile::ErrorKind::StoreUnavailable);
    let error = Idempotency::connect("nope://x").await.unwrap_err();
    assert_eq!(error.kind(), turnstile::ErrorKind::InvalidUrl);
}

/// Same-transaction mode: 20 concurrent duplicates, each in its own transaction,
/// insert the payment exactly once and all get its id; a rolled-back run leaves
/// neither the key nor the payment behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transaction_mode_commits_key_work_and_outcome_together() {
    use turnstile::idempotency::{
        Fingerprint, IdempotencyKey, IdempotencyOptions, Scope, TransactionalIdempotency,
    };
    let url = shared_postgres().fresh_database("idemtx");
    let store = PostgresIdempotencyStore::connect(&url).await.unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(25)
        .connect(&url)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE payments (id BIGSERIAL PRIMARY KEY, key TEXT NOT NULL, cents BIGINT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let scope = Scope::new("tenant-1").unwrap();
    let key = IdempotencyKey::new("pay-1").unwrap();
    let fingerprint = Fingerprint::of(&[b"1000"]);
    let options = IdempotencyOptions::new();
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let (store, pool, scope, key, options) = (
            store.clone(),
            pool.clone(),
            scope.clone(),
            key.clone(),
            options.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut transaction = pool.begin().await.unwrap();
            let id: i64 = store
                .run_once_in_transaction(
                    &mut transaction,
                    &scope,
                    &key,
                    &fingerprint,
                    &options,
                    async |connection: &mut sqlx::PgConnection, _token| {
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                        let id: i64 = sqlx::query_scalar(
                            "INSERT INTO payments (key, cents) VALUES ('pay-1', 1000) RETURNING id",
                        )
                        .fetch_one(&mut *connection)
                        .await
                        .unwrap();
                        Ok::<_, turnstile::Error>(id)
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
    assert_eq!(ids.len(), 1, "duplicates saw different payments: {ids:?}");
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM payments")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(count, 1, "the payment was made more than once");

    // A run whose transaction rolls back (a crash would too) leaves nothing behind.
    let other = IdempotencyKey::new("pay-2").unwrap();
    let mut transaction = pool.begin().await.unwrap();
    let _: i64 = store
        .run_once_in_transaction(
            &mut transaction,
            &scope,
            &other,
            &fingerprint,
            &options,
            async |connection: &mut sqlx::PgConnection, _| {
                Ok::<_, turnstile::Error>(
                    sqlx::query_scalar(
                        "INSERT INTO payments (key, cents) VALUES ('pay-2', 1) RETURNING id",
                    )
                    .fetch_one(&mut *connection)
                    .await
                    .unwrap(),
                )
            },
        )
        .await
        .unwrap();
    transaction.rollback().await.unwrap();
    use turnstile::idempotency::IdempotencyStore;
    assert!(
        store.get(&scope, &other).await.unwrap().is_none(),
        "the key outlived its rollback"
    );
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM payments WHERE key = 'pay-2'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(count, 0);
}

/// The inbox on PostgreSQL: ten concurrent deliveries of one message, each in its own
/// transaction, are handled once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inbox_handles_concurrent_redeliveries_once() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use turnstile::idempotency::inbox::Inbox;
    let url = shared_postgres().fresh_database("inbox");
    let store = PostgresIdempotencyStore::connect(&url).await.unwrap();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let inbox = Inbox::new(store, "ledger").unwrap();
    let handled = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let (inbox, pool, handled) = (inbox.clone(), pool.clone(), handled.clone());
        tasks.push(tokio::spawn(async move {
            let mut transaction = pool.begin().await.unwrap();
            let delivery = inbox
                .process(
                    &mut transaction,
                    "evt-7",
                    async |_c: &mut sqlx::PgConnection| {
                        handled.fetch_add(1, Ordering::SeqCst);
                        Ok::<_, turnstile::Error>(())
                    },
                )
                .await
                .unwrap();
            transaction.commit().await.unwrap();
            delivery.is_duplicate()
        }));
    }
    let mut duplicates = 0;
    for task in tasks {
        duplicates += usize::from(task.await.unwrap());
    }
    assert_eq!(handled.load(Ordering::SeqCst), 1);
    assert_eq!(duplicates, 9);
}

/// The inbox's per-key cursors on PostgreSQL.
#[tokio::test]
async fn cursors_follow_each_keys_sequence() {
    use turnstile::idempotency::{Scope, TransactionalIdempotency};
    let url = shared_postgres().fresh_database("cursors");
    let store = PostgresIdempotencyStore::connect(&url).await.unwrap();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let consumer = Scope::new("projection").unwrap();
    idempotency_conformance::cursors_follow_each_keys_sequence(async |key: &str, seq| {
        let mut transaction = pool.begin().await.unwrap();
        let step = store
            .advance_cursor(&mut transaction, &consumer, key, seq, 0)
            .await
            .unwrap();
        transaction.commit().await.unwrap();
        step
    })
    .await;
}

/// A duplicate that waits on the record's row past its transaction's `lock_timeout`
/// hears "in progress" (a 409 over HTTP), not a store error: the lock timeout aborted
/// its transaction, and nothing more is asked of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_timeout_in_the_callers_transaction_is_in_progress() {
    use turnstile::idempotency::{
        ClaimAnswer, Fingerprint, IdempotencyKey, IdempotencyOptions, Scope,
        TransactionalIdempotency,
    };
    let url = shared_postgres().fresh_database("idemlt");
    let store = PostgresIdempotencyStore::connect(&url).await.unwrap();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let (scope, key) = (
        Scope::new("tenant-1").unwrap(),
        IdempotencyKey::new("slow").unwrap(),
    );
    let (fingerprint, options) = (Fingerprint::of(&[b"x"]), IdempotencyOptions::new());
    let mut first = pool.begin().await.unwrap();
    let answer = store
        .claim_in_transaction(&mut first, &scope, &key, &fingerprint, &options)
        .await
        .unwrap();
    assert!(matches!(answer, ClaimAnswer::Started { .. }), "{answer:?}");
    let mut second = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '200ms'")
        .execute(&mut *second)
        .await
        .unwrap();
    let answer = store
        .claim_in_transaction(&mut second, &scope, &key, &fingerprint, &options)
        .await
        .expect("a lock timeout is an answer, not a store error");
    assert_eq!(answer, ClaimAnswer::InProgress { lease_left: None });
    second.rollback().await.unwrap();
    first.rollback().await.unwrap();
}

/// Same-transaction mode on a server whose default is `synchronous_commit = off` (whose
/// WAL writer waits 10 s): an outcome the caller committed, and the business write
/// committed with it, survive a crash that comes right after — the completion makes the
/// transaction's commit wait for the disk, so no answer already given is taken back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_committed_in_the_callers_transaction_survives_a_crash() {
    use turnstile::idempotency::{
        Fingerprint, IdempotencyKey, IdempotencyOptions, Scope, TransactionalIdempotency,
    };
    let server = turnstile_test_support::PostgresServer::spawn_durable();
    let url = server.url();
    let store = PostgresIdempotencyStore::connect(&url).await.unwrap();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let setting: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        setting, "off",
        "the application's connections do not wait for the disk"
    );
    sqlx::query("CREATE TABLE payments (key TEXT PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();
    let scope = Scope::new("tenant-1").unwrap();
    let fingerprint = Fingerprint::of(&[b"1000"]);
    let options = IdempotencyOptions::new();
    for n in 0..5 {
        let key = IdempotencyKey::new(format!("pay-{n}")).unwrap();
        let mut transaction = pool.begin().await.unwrap();
        store
            .run_once_in_transaction(
                &mut transaction,
                &scope,
                &key,
                &fingerprint,
                &options,
                async |connection: &mut sqlx::PgConnection, _token| {
                    sqlx::query("INSERT INTO payments VALUES ($1)")
                        .bind(format!("pay-{n}"))
                        .execute(&mut *connection)
                        .await
                        .unwrap();
                    Ok::<_, turnstile::Error>(n)
                },
            )
            .await
            .unwrap();
        transaction.commit().await.unwrap();
    }
    // Then a commit of the application's own that did not wait for the disk: the crash
    // must take it, or the test does not show what it should.
    sqlx::query("INSERT INTO payments VALUES ('not durable')")
        .execute(&pool)
        .await
        .unwrap();
    drop(pool);
    drop(store);
    server.crash_and_restart();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let kept: Vec<String> = sqlx::query_scalar("SELECT key FROM payments ORDER BY key")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(
        kept,
        ["pay-0", "pay-1", "pay-2", "pay-3", "pay-4"],
        "the plain commit is lost, the idempotent ones are not"
    );
    let store = PostgresIdempotencyStore::connect(&url).await.unwrap();
    let keys = Idempotency::new(store);
    for n in 0..5 {
        let key = IdempotencyKey::new(format!("pay-{n}")).unwrap();
        let replayed: u32 = keys
            .run_once(&scope, &key, &fingerprint, |_| async {
                Err(turnstile::Error::new(
                    turnstile::ErrorKind::Store,
                    "a completed key ran again after the crash",
                ))
            })
            .await
            .unwrap();
        assert_eq!(replayed, n);
    }
}

/// The work ran, then another transaction held the record's row past the store's own
/// 250 ms `lock_timeout` (SQLSTATE 55P03): the completion is tried again until the row
/// is free, so a repeat gets the replay, never a "not stored" answer and never a second
/// run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_is_stored_once_a_row_lock_is_released() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;
    use turnstile::idempotency::{Fingerprint, IdempotencyKey, IdempotencyOptions, Scope};
    let url = shared_postgres().fresh_database("idemrowlock");
    let keys = Idempotency::new(PostgresIdempotencyStore::connect(&url).await.unwrap())
        .with_options(IdempotencyOptions::new().lease(Duration::from_secs(10)))
        .unwrap();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let (scope, key) = (
        Scope::new("tenant").unwrap(),
        IdempotencyKey::new("pay").unwrap(),
    );
    let fingerprint = Fingerprint::of(&[b"x"]);
    let runs = AtomicUsize::new(0);
    for _ in 0..2 {
        let value: u32 = keys
            .run_once(&scope, &key, &fingerprint, async |_| {
                runs.fetch_add(1, Ordering::SeqCst);
                let mut holder = pool.begin().await.unwrap();
                sqlx::query("SELECT 1 FROM turnstile_idempotency WHERE key = 'pay' FOR UPDATE")
                    .fetch_one(&mut *holder)
                    .await
                    .unwrap();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(1_500)).await;
                    holder.commit().await.unwrap();
                });
                Ok::<_, turnstile::Error>(7)
            })
            .await
            .expect("the completion must wait for the row, not give up");
        assert_eq!(value, 7);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the work ran twice");
}

/// A refusal that only looks transient and never ends: every completion of this
/// outcome hits a statement timeout (SQLSTATE 57014, raised here by a trigger as a too
/// slow write of a large outcome would) while lease renewals get through. The
/// completion is retried for one lease length, then the small "not stored" marker is
/// recorded: the call returns, and a repeat is told, never run. If even the marker is
/// refused, the call still returns (an error) instead of retrying for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_refused_for_a_whole_lease_records_the_outcome_as_not_stored() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;
    use turnstile::ErrorKind;
    use turnstile::idempotency::{Fingerprint, IdempotencyKey, IdempotencyOptions, Scope};
    let url = shared_postgres().fresh_database("idemslowout");
    let keys = Idempotency::new(PostgresIdempotencyStore::connect(&url).await.unwrap())
        .with_options(IdempotencyOptions::new().lease(Duration::from_secs(2)))
        .unwrap();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    // Refuses real outcomes (a marker starts with a NUL byte); `all` refuses markers too.
    sqlx::query(
        "CREATE FUNCTION refuse_outcome() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF NEW.state = 'completed' AND (NEW.key = 'all' OR get_byte(NEW.outcome, 0) <> 0) THEN
             RAISE EXCEPTION 'canceling statement due to statement timeout' USING ERRCODE = '57014';
           END IF;
           RETURN NEW;
         END $$",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "CREATE TRIGGER refuse_outcome BEFORE UPDATE ON turnstile_idempotency
         FOR EACH ROW EXECUTE FUNCTION refuse_outcome()",
    )
    .execute(&pool)
    .await
    .unwrap();
    let scope = Scope::new("tenant").unwrap();
    let fingerprint = Fingerprint::of(&[b"x"]);
    let runs = &AtomicUsize::new(0);
    let work = move |_| async move {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<_, turnstile::Error>(7u32)
    };
    let marked = IdempotencyKey::new("big").unwrap();
    let value = tokio::time::timeout(
        Duration::from_secs(10),
        keys.run_once(&scope, &marked, &fingerprint, work),
    )
    .await
    .expect("the completion was retried for ever")
    .unwrap();
    assert_eq!(value, 7);
    let repeat = keys
        .run_once(&scope, &marked, &fingerprint, work)
        .await
        .unwrap_err();
    assert_eq!(repeat.kind(), ErrorKind::OutcomeNotStored, "{repeat}");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the work ran twice");

    let refused = IdempotencyKey::new("all").unwrap();
    let error = tokio::time::timeout(
        Duration::from_secs(10),
        keys.run_once(&scope, &refused, &fingerprint, work),
    )
    .await
    .expect("the marker was retried for ever")
    .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::StoreUnavailable, "{error}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}
