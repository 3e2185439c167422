//! The MySQL / MariaDB idempotency store: the conformance suite against a real MariaDB
//! server, and the same-transaction mode.

mod idempotency_conformance;

use std::future::Future;
use std::pin::Pin;

use idempotency_conformance::TestStore;
use turnstile::idempotency::mysql::MysqlIdempotencyStore;
use turnstile::idempotency::{
    Fingerprint, Idempotency, IdempotencyKey, IdempotencyOptions, IdempotencyStore, Scope,
    TransactionalIdempotency,
};
use turnstile_test_support::shared_mariadb;

struct MysqlDatabase {
    url: String,
}

impl TestStore for MysqlDatabase {
    fn client(&self) -> Pin<Box<dyn Future<Output = Idempotency> + Send + '_>> {
        Box::pin(async move {
            Idempotency::new(MysqlIdempotencyStore::connect(&self.url).await.unwrap())
        })
    }
}

async fn fresh_database() -> MysqlDatabase {
    MysqlDatabase {
        url: shared_mariadb().fresh_database("idem"),
    }
}

idempotency_conformance_tests!(super::fresh_database);

mod server_clock_ahead {
    //! The whole suite on a server whose wall clock is an hour ahead of the host's:
    //! leases and retention go by the database server's clock alone. A deadline written
    //! by one clock and read by the other would end every lease at once here or keep a
    //! dead worker's key for an hour on the server behind
    //! (`a_dead_workers_key_is_claimable_after_its_lease` fails).
    use super::*;
    use turnstile_test_support::ServerClock;

    async fn fresh_database() -> MysqlDatabase {
        MysqlDatabase {
            url: turnstile_test_support::shared_mariadb_on(ServerClock::HourAhead)
                .fresh_database("ahead"),
        }
    }

    idempotency_conformance_tests!(super::fresh_database);
}

mod server_clock_behind {
    //! The whole suite on a server whose wall clock is an hour behind the host's.
    use super::*;
    use turnstile_test_support::ServerClock;

    async fn fresh_database() -> MysqlDatabase {
        MysqlDatabase {
            url: turnstile_test_support::shared_mariadb_on(ServerClock::HourBehind)
                .fresh_database("behind"),
        }
    }

    idempotency_conformance_tests!(super::fresh_database);
}

/// Stores are opened from URLs like the lock stores; unknown options are refused.
#[tokio::test]
async fn urls_open_the_store() {
    let url = shared_mariadb().fresh_database("idemurl");
    let keys = Idempotency::connect(&format!("{url}?turnstile_prefix=app"))
        .await
        .unwrap();
    assert!(keys.store().describe().starts_with("mysql://"));
    let error = Idempotency::connect(&format!("{url}?turnstile_nope=1"))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), turnstile::ErrorKind::InvalidUrl);
}

/// A claim that does not start leaves the connection's reported insert id at 0: the
/// store tells "started" from it, so a second claim on the very connection that made
/// the first must not pass for a start.
#[tokio::test]
async fn a_repeated_claim_on_one_connection_is_not_a_start() {
    let url = shared_mariadb().fresh_database("idemone");
    // Calls one after another: the pool hands out its one idle connection each time.
    let store = MysqlIdempotencyStore::connect(&url).await.unwrap();
    let scope = Scope::new("t").unwrap();
    let key = IdempotencyKey::new("k").unwrap();
    let fingerprint = Fingerprint::of(&[b"x"]);
    let lease = std::time::Duration::from_secs(30);
    let retention = std::time::Duration::from_secs(60);
    let mut tokens = Vec::new();
    for _ in 0..20 {
        if let turnstile::idempotency::ClaimAnswer::Started { token } = store
            .claim(&scope, &key, &fingerprint, lease, retention)
            .await
            .unwrap()
        {
            tokens.push(token);
        }
    }
    assert_eq!(tokens.len(), 1, "more than one claim started: {tokens:?}");
}

/// Same-transaction mode: 20 concurrent duplicates, each in its own transaction,
/// insert the payment exactly once and all get its id; a rolled-back run leaves
/// neither the key nor the payment behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transaction_mode_commits_key_work_and_outcome_together() {
    let url = shared_mariadb().fresh_database("idemtx");
    let store = MysqlIdempotencyStore::connect(&url).await.unwrap();
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(25)
        .connect(&url)
        .await
        .unwrap();
    sqlx::query(
        "CREATE TABLE payments (id BIGINT AUTO_INCREMENT PRIMARY KEY, k VARCHAR(20) NOT NULL, cents BIGINT NOT NULL)",
    )
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
            let id: u64 = store
                .run_once_in_transaction(
                    &mut transaction,
                    &scope,
                    &key,
                    &fingerprint,
                    &options,
                    async |connection: &mut sqlx::MySqlConnection, _token| {
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                        let done =
                            sqlx::query("INSERT INTO payments (k, cents) VALUES ('pay-1', 1000)")
                                .execute(&mut *connection)
                                .await
                                .unwrap();
                        Ok::<_, turnstile::Error>(done.last_insert_id())
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
    let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM payments")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(count, 1, "the payment was made more than once");

    // A run whose transaction rolls back (a crash would too) leaves nothing behind.
    let other = IdempotencyKey::new("pay-2").unwrap();
    let mut transaction = pool.begin().await.unwrap();
    let _: u64 = store
        .run_once_in_transaction(
            &mut transaction,
            &scope,
            &other,
            &fingerprint,
            &options,
            async |connection: &mut sqlx::MySqlConnection, _| {
                let done = sqlx::query("INSERT INTO payments (k, cents) VALUES ('pay-2', 1)")
                    .execute(&mut *connection)
                    .await
                    .unwrap();
                Ok::<_, turnstile::Error>(done.last_insert_id())
            },
        )
        .await
        .unwrap();
    transaction.rollback().await.unwrap();
    assert!(
        store.get(&scope, &other).await.unwrap().is_none(),
        "the key outlived its rollback"
    );
    let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM payments WHERE k = 'pay-2'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(count, 0);
}

/// The inbox's per-key cursors on MariaDB.
#[tokio::test]
async fn cursors_follow_each_keys_sequence() {
    let url = shared_mariadb().fresh_database("cursors");
    let store = MysqlIdempotencyStore::connect(&url).await.unwrap();
    let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
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

/// The work ran, then another transaction held the record's row past the store's own
/// `innodb_lock_wait_timeout = 1` (error 1205): the completion is tried again until the
/// row is free, so a repeat gets the replay, never a "not stored" answer and never a
/// second run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_is_stored_once_a_row_lock_is_released() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;
    let url = shared_mariadb().fresh_database("idemrowlock");
    let keys = Idempotency::new(MysqlIdempotencyStore::connect(&url).await.unwrap())
        .with_options(IdempotencyOptions::new().lease(Duration::from_secs(10)))
        .unwrap();
    let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
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
                sqlx::query("SELECT 1 FROM turnstile_idempotency WHERE `key` = 'pay' FOR UPDATE")
                    .fetch_one(&mut *holder)
                    .await
                    .unwrap();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(2_500)).await;
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
