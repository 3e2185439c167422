//! The PostgreSQL engine: the conformance suite against a real server, plus what only a
//! durable database does.

mod conformance;
mod faults;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use conformance::TestStore;
use turnstile::ErrorKind;
use turnstile::fence::FencingToken;
use turnstile::lock::postgres::{PostgresLockConfig, PostgresLockStore};
use turnstile::lock::{LockOptions, Locker, LossReason};
use turnstile_test_support::{PostgresServer, TcpProxy, shared_postgres, unique_name};

/// Clients of one database of the shared server.
struct PostgresDatabase {
    url: String,
}

impl TestStore for PostgresDatabase {
    fn locker(&self) -> Pin<Box<dyn Future<Output = Locker> + Send + '_>> {
        Box::pin(async move { Locker::new(PostgresLockStore::connect(&self.url).await.unwrap()) })
    }

    fn notifies_other_processes(&self) -> bool {
        !self.url.contains("turnstile_notify=off")
    }
}

async fn fresh_database() -> PostgresDatabase {
    PostgresDatabase {
        url: shared_postgres().fresh_database("lock"),
    }
}

conformance_tests!(super::fresh_database);

mod polling {
    //! The same suite with notifications off, as behind a pooler in transaction mode.
    use super::*;

    async fn without_notifications() -> PostgresDatabase {
        PostgresDatabase {
            url: format!(
                "{}?turnstile_notify=off",
                shared_postgres().fresh_database("poll")
            ),
        }
    }

    conformance_tests!(super::without_notifications);
}

mod server_clock_ahead {
    //! The whole suite on a server whose wall clock is an hour ahead of the host's: leases, expiry and tokens
    //! go by the database server's clock alone. A deadline written by one clock and read
    //! by the other would expire every lease at once here (`mutual_exclusion_under_contention`
    //! and `watchdog_keeps_the_lock_past_several_ttls` fail) or keep a crashed holder's for
    //! an hour behind (`expiry_frees_a_crashed_holder` fails, below).
    use super::*;
    use turnstile_test_support::ServerClock;

    async fn fresh_database() -> PostgresDatabase {
        database_on(ServerClock::HourAhead).await
    }

    conformance_tests!(super::fresh_database);
}

mod server_clock_behind {
    //! The whole suite on a server whose wall clock is an hour behind the host's.
    use super::*;
    use turnstile_test_support::ServerClock;

    async fn fresh_database() -> PostgresDatabase {
        database_on(ServerClock::HourBehind).await
    }

    conformance_tests!(super::fresh_database);
}

/// A database of the shared server on `clock`.
async fn database_on(clock: turnstile_test_support::ServerClock) -> PostgresDatabase {
    PostgresDatabase {
        url: turnstile_test_support::shared_postgres_on(clock).fresh_database("clock"),
    }
}

/// Tokens are floored by the database server's clock, not the host's: on a server an
/// hour ahead and on one an hour behind, a new name's first token is that server's
/// clock in microseconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_follow_the_database_servers_clock() {
    use turnstile_test_support::ServerClock;
    for clock in [ServerClock::HourAhead, ServerClock::HourBehind] {
        let store = database_on(clock).await;
        let locker = store.locker().await;
        let guard = locker
            .acquire(&unique_name("clocktok"), &LockOptions::new())
            .await
            .unwrap();
        conformance::assert_token_follows_the_servers_clock(guard.fencing_token(), clock);
        guard.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_increasing_across_a_restart_and_a_crash() {
    let server = PostgresServer::spawn();
    let url = server.url();
    let mut last = FencingToken::new(0);
    for round in 0..3 {
        let locker = Locker::new(PostgresLockStore::connect(&url).await.unwrap());
        for _ in 0..3 {
            let guard = locker.acquire("ledger", &LockOptions::new()).await.unwrap();
            assert!(
                guard.fencing_token() > last,
                "round {round}: {} after {last}",
                guard.fencing_token()
            );
            last = guard.fencing_token();
            guard.release().await.unwrap();
        }
        drop(locker);
        match round {
            0 => server.restart(),
            1 => server.crash_and_restart(),
            _ => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrating_twice_and_concurrently_is_harmless() {
    let url = shared_postgres().fresh_database("migrate");
    let config = || {
        PostgresLockConfig::new()
            .schema("locks_here")
            .table_prefix("app")
            .migrate_on_first_use(false)
    };
    let stores: Vec<_> = futures_join((0..4).map(|_| {
        let url = url.clone();
        tokio::spawn(async move {
            let store = PostgresLockStore::connect_with(&url, config())
                .await
                .unwrap();
            store.migrate().await.unwrap();
            store.migrate().await.unwrap();
            store
        })
    }))
    .await;
    let locker = Locker::new(stores[0].clone());
    let guard = locker
        .acquire("after-migrate", &LockOptions::new())
        .await
        .unwrap();
    let (count,): (i64,) = sqlx::query_as("SELECT count(*) FROM locks_here.app_locks")
        .fetch_one(stores[1].pool())
        .await
        .unwrap();
    assert_eq!(count, 1);
    guard.release().await.unwrap();
}

async fn futures_join<T: Send + 'static>(
    tasks: impl Iterator<Item = tokio::task::JoinHandle<T>>,
) -> Vec<T> {
    let mut results = Vec::new();
    for task in tasks.collect::<Vec<_>>() {
        results.push(task.await.unwrap());
    }
    results
}

#[tokio::test]
async fn the_applications_pool_can_be_used() {
    let url = shared_postgres().fresh_database("pool");
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let store = PostgresLockStore::from_pool(pool.clone(), PostgresLockConfig::new())
        .await
        .unwrap();
    let locker = Locker::new(store);
    let guard = locker
        .acquire("shared-pool", &LockOptions::new())
        .await
        .unwrap();
    let (owner,): (String,) =
        sqlx::query_as("SELECT owner FROM turnstile_locks WHERE name = 'shared-pool'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(owner, guard.owner().as_str());
    guard.release().await.unwrap();
}

#[tokio::test]
async fn bad_urls_and_options_say_what_is_wrong() {
    let base = shared_postgres().url();
    let closed = turnstile_test_support::ClosedPort::bind();
    for (url, kind) in [
        (
            format!("{base}?turnstile_schema=bad-name"),
            ErrorKind::InvalidOptions,
        ),
        (
            format!("{base}?turnstile_notify=maybe"),
            ErrorKind::InvalidUrl,
        ),
        (
            format!("{base}?turnstile_colour=blue"),
            ErrorKind::InvalidUrl,
        ),
        (
            format!("postgres://postgres@127.0.0.1:{}/x", closed.port()),
            ErrorKind::StoreUnavailable,
        ),
    ] {
        let error = Locker::connect(&url).await.unwrap_err();
        assert_eq!(error.kind(), kind, "{url}: {error}");
    }
}

/// The notes' paused-holder scenario, stopped by a fenced write in the application's
/// own transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_holders_late_write_is_rejected() {
    let url = shared_postgres().fresh_database("fence");
    let store = PostgresLockStore::connect(&url).await.unwrap();
    let pool = store.pool().clone();
    sqlx::query("CREATE TABLE invoices (id TEXT PRIMARY KEY, total BIGINT)")
        .execute(&pool)
        .await
        .unwrap();
    let fence = store.fence();
    let write = |token: FencingToken, total: i64| {
        let (pool, fence) = (pool.clone(), fence.clone());
        async move {
            let mut transaction = pool.begin().await.unwrap();
            let outcome = fence
                .check_and_record(&mut transaction, "invoice:1", token)
                .await
                .unwrap();
            if outcome.is_applied() {
                sqlx::query(
                    "INSERT INTO invoices VALUES ('invoice:1', $1)
                     ON CONFLICT (id) DO UPDATE SET total = EXCLUDED.total",
                )
                .bind(total)
                .execute(&mut *transaction)
                .await
                .unwrap();
                transaction.commit().await.unwrap();
            }
            outcome
        }
    };
    let read = || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar("SELECT total FROM invoices")
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let lease = LockOptions::new().ttl(Duration::from_millis(500));
    conformance::a_paused_holders_late_write_is_rejected(
        &Locker::new(store),
        lease,
        "invoice:1",
        write,
        read,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_scoped_lock_lasts_exactly_as_long_as_its_transaction() {
    let url = shared_postgres().fresh_database("xact");
    let store = PostgresLockStore::connect(&url).await.unwrap();
    let mut first = store.pool().begin().await.unwrap();
    let first_token = store
        .lock_in_transaction(&mut first, "batch")
        .await
        .unwrap();

    // A second transaction waits for the first to end.
    let waiter = {
        let store = store.clone();
        tokio::spawn(async move {
            let mut second = store.pool().begin().await.unwrap();
            let token = store
                .lock_in_transaction(&mut second, "batch")
                .await
                .unwrap();
            let got_it = tokio::time::Instant::now();
            second.rollback().await.unwrap(); // a rollback releases too
            (token, got_it)
        })
    };
    // The second transaction is seen waiting on a lock in the database.
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&admin)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(
            !waiter.is_finished(),
            "the second transaction did not wait for the lock"
        );
        assert!(tokio::time::Instant::now() < until, "nobody waits");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(!waiter.is_finished(), "the lock did not hold");
    let committed = tokio::time::Instant::now();
    first.commit().await.unwrap();
    let (second_token, got_it) = waiter.await.unwrap();
    assert!(got_it >= committed);
    assert!(second_token > first_token);

    // A lease waits for a transaction-scoped lock too.
    let mut third = store.pool().begin().await.unwrap();
    let third_token = store
        .lock_in_transaction(&mut third, "batch")
        .await
        .unwrap();
    assert!(third_token > second_token);
    let (locker, counting) = conformance::Counting::wrap(&Locker::new(store.clone()));
    let lease = {
        let locker = locker.clone();
        tokio::spawn(async move {
            locker
                .acquire("batch", &LockOptions::new().wait(Duration::from_secs(10)))
                .await
        })
    };
    // The lease was refused and waits.
    conformance::contender_sleeps(&counting).await;
    assert!(
        !lease.is_finished(),
        "the lease did not wait for the transaction"
    );
    third.commit().await.unwrap();
    let guard = lease.await.unwrap().unwrap();
    assert!(
        guard.fencing_token() > third_token,
        "tokens of both kinds share one order"
    );

    // While the lease is held, a transaction-scoped lock says so at once.
    let mut fourth = store.pool().begin().await.unwrap();
    let error = store
        .lock_in_transaction(&mut fourth, "batch")
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Held);
    fourth.rollback().await.unwrap();
    guard.release().await.unwrap();

    // A rolled-back transaction does not give its token back.
    let mut fifth = store.pool().begin().await.unwrap();
    let fifth_token = store
        .lock_in_transaction(&mut fifth, "batch")
        .await
        .unwrap();
    fifth.rollback().await.unwrap();
    let mut sixth = store.pool().begin().await.unwrap();
    assert!(
        store
            .lock_in_transaction(&mut sixth, "batch")
            .await
            .unwrap()
            > fifth_token
    );
    sixth.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optimistic_updates_lose_nothing_under_concurrent_writers() {
    use turnstile::optimistic::{Attempt, RetryPolicy, retry};
    let url = shared_postgres().fresh_database("optimistic");
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    sqlx::query("CREATE TABLE counters (id INT PRIMARY KEY, value BIGINT NOT NULL, version BIGINT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO counters VALUES (1, 0, 0)")
        .execute(&pool)
        .await
        .unwrap();
    let conflicts = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut writers = Vec::new();
    for _ in 0..6 {
        let (pool, conflicts) = (pool.clone(), conflicts.clone());
        writers.push(tokio::spawn(async move {
            for _ in 0..10 {
                let policy = RetryPolicy::new().attempts(200).max_pause(Duration::from_millis(20));
                retry(&policy, |_| {
                    let (pool, conflicts) = (pool.clone(), conflicts.clone());
                    async move {
                        let (value, version): (i64, i64) =
                            sqlx::query_as("SELECT value, version FROM counters WHERE id = 1")
                                .fetch_one(&pool)
                                .await
                                .unwrap();
                        // Widen the window between read and write, as real work would.
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        let changed = sqlx::query(
                            "UPDATE counters SET value = $1, version = version + 1 WHERE id = 1 AND version = $2",
                        )
                        .bind(value + 1)
                        .bind(version)
                        .execute(&pool)
                        .await
                        .unwrap()
                        .rows_affected();
                        Ok(if changed == 1 {
                            Attempt::Done(())
                        } else {
                            conflicts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            Attempt::Conflict
                        })
                    }
                })
                .await
                .unwrap();
            }
        }));
    }
    for writer in writers {
        writer.await.unwrap();
    }
    let (value, version): (i64, i64) =
        sqlx::query_as("SELECT value, version FROM counters WHERE id = 1")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((value, version), (60, 60));
    assert!(
        conflicts.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "the writers never collided"
    );
}

mod session {
    //! Session mode: advisory locks on dedicated connections, the same suite.
    use super::*;

    pub(super) struct SessionDatabase {
        pub(super) url: String,
    }

    impl TestStore for SessionDatabase {
        fn locker(&self) -> Pin<Box<dyn Future<Output = Locker> + Send + '_>> {
            Box::pin(async move { Locker::connect(&self.url).await.unwrap() })
        }

        fn notifies_other_processes(&self) -> bool {
            false
        }
    }

    pub(super) async fn session_database() -> SessionDatabase {
        SessionDatabase {
            url: format!(
                "{}?turnstile_mode=session",
                shared_postgres().fresh_database("session")
            ),
        }
    }

    conformance_tests!(super::session_database);

    /// Tables made by a version whose tokens table had no `holder` column (it kept a
    /// session holder's name on the locks row, and a token from then is still there):
    /// the store adds the column, tokens keep growing and the holder is reported.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tables_from_before_the_holder_column_are_migrated() {
        let url = shared_postgres().fresh_database("old_tables");
        let admin = sqlx::PgPool::connect(&url).await.unwrap();
        sqlx::raw_sql(
            "CREATE TABLE turnstile_locks (name TEXT PRIMARY KEY, owner TEXT,
                 expires_at TIMESTAMPTZ NOT NULL,
                 waiting_until TIMESTAMPTZ NOT NULL DEFAULT '-infinity');
             CREATE TABLE turnstile_tokens (name TEXT PRIMARY KEY, token BIGINT NOT NULL);
             INSERT INTO turnstile_locks VALUES ('old', 'gone@1', '-infinity');
             INSERT INTO turnstile_tokens VALUES ('old', 9000000000000000000);",
        )
        .execute(&admin)
        .await
        .unwrap();
        let locker = Locker::connect(&format!("{url}?turnstile_mode=session"))
            .await
            .unwrap();
        let guard = locker.acquire("old", &LockOptions::new()).await.unwrap();
        assert!(guard.fencing_token() > FencingToken::new(9_000_000_000_000_000_000));
        let status = locker.status("old").await.unwrap().expect("held");
        assert_eq!(status.owner, guard.owner().to_hex());
        assert_eq!(status.fencing_token, Some(guard.fencing_token()));
        guard.release().await.unwrap();
    }

    /// A released session goes back to the pool with the server's idle timeout, not
    /// the lease: it is still there well after the lease would have ended it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_released_session_keeps_the_servers_idle_timeout_not_the_lease() {
        let database = session_database().await;
        let locker = database.locker().await;
        let ttl = Duration::from_millis(500);
        let guard = locker
            .acquire("idle", &LockOptions::new().ttl(ttl))
            .await
            .unwrap();
        let admin = sqlx::PgPool::connect(database.url.split('?').next().unwrap())
            .await
            .unwrap();
        let holder: i32 = sqlx::query_scalar(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .fetch_one(&admin)
        .await
        .unwrap();
        assert_eq!(
            guard.release().await.unwrap(),
            turnstile::lock::ReleaseOutcome::Released
        );
        // Four leases: an idle timeout left at the lease would have ended the session.
        tokio::time::sleep(4 * ttl).await;
        let alive: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE pid = $1")
            .bind(holder)
            .fetch_one(&admin)
            .await
            .unwrap();
        assert_eq!(
            alive, 1,
            "the pooled session was ended by the lease's idle timeout"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn terminating_the_holders_backend_fires_the_lost_signal() {
        let database = session_database().await;
        let locker = database.locker().await;
        let ttl = Duration::from_millis(1_500);
        let guard = locker
            .acquire("report", &LockOptions::new().ttl(ttl))
            .await
            .unwrap();
        let admin = sqlx::PgPool::connect(database.url.split('?').next().unwrap())
            .await
            .unwrap();
        let terminated: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_locks
             WHERE locktype = 'advisory' AND granted
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database())) AS t",
        )
        .fetch_one(&admin)
        .await
        .unwrap();
        assert_eq!(terminated, 1);
        let terminated_at = tokio::time::Instant::now();
        // Told at the next renewal, within TTL/3.
        let (reason, seen) = faults::first_seen_lost(&guard, ttl).await;
        assert_eq!(reason, LossReason::Expired);
        assert!(
            seen - terminated_at <= ttl / 3 + Duration::from_millis(300),
            "the loss was seen {:?} after the termination",
            seen - terminated_at
        );
        // And the lock is free for others at once.
        let other = database.locker().await;
        let guard = other
            .acquire("report", &LockOptions::new().wait(Duration::ZERO))
            .await
            .unwrap();
        guard.release().await.unwrap();
    }

    #[tokio::test]
    async fn a_bad_mode_is_refused() {
        let url = format!("{}?turnstile_mode=exclusive", shared_postgres().url());
        assert_eq!(
            Locker::connect(&url).await.unwrap_err().kind(),
            ErrorKind::InvalidUrl
        );
    }
}

/// Waits (bounded) until `condition` holds.
async fn eventually(what: &str, limit: Duration, mut condition: impl FnMut() -> bool) {
    let until = tokio::time::Instant::now() + limit;
    while !condition() {
        assert!(
            tokio::time::Instant::now() < until,
            "{what} did not happen within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A waiter in another process is woken by the release's NOTIFY (seen on its store's
/// counter), and a release that nobody waits for sends no NOTIFY at all (each one
/// serialises every committing transaction that sent one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_notify_waiters_and_only_when_someone_waits() {
    use turnstile::lock::{LockBackend, LockName};
    let url = shared_postgres().fresh_database("notify");
    let holder_store = PostgresLockStore::connect(&url).await.unwrap();
    let waiter_store = PostgresLockStore::connect(&url).await.unwrap();
    let holder = Locker::new(holder_store.clone());
    let (waiter, counting) = conformance::Counting::wrap(&Locker::new(waiter_store.clone()));
    // Start the waiter's LISTEN connection.
    let _watch = waiter_store
        .watch_releases(&LockName::new("warm-up").unwrap())
        .await
        .unwrap();
    assert!(waiter_store.is_listening());

    // Nobody waits: the release sends no notification.
    let long = LockOptions::new().ttl(Duration::from_secs(30));
    holder
        .acquire("quiet", &long)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        waiter_store.notifications_received(),
        0,
        "a release nobody waited for notified"
    );

    // Someone waits: woken by the notification, long before the holder's 30 s lease.
    let guard = holder.acquire("busy", &long).await.unwrap();
    let waiting = tokio::spawn(async move {
        waiter
            .acquire("busy", &long.clone().wait(Duration::from_secs(20)))
            .await
    });
    // Release once the waiter is asleep, waiting for the notification.
    conformance::contender_sleeps(&counting).await;
    let released = tokio::time::Instant::now();
    guard.release().await.unwrap();
    let taken = waiting.await.unwrap().unwrap();
    assert!(
        released.elapsed() < Duration::from_secs(2),
        "woke {:?} after",
        released.elapsed()
    );
    assert!(
        waiter_store.notifications_received() >= 1,
        "the waiter was not notified"
    );
    taken.release().await.unwrap();
}

/// A release says whether its notification went out, which is what the lock core's
/// pause after a run of hand-overs goes by: yes only when a waiter marked the row; with
/// notifications off, it cannot tell.
#[tokio::test]
async fn a_release_says_whether_it_woke_waiters_elsewhere() {
    use turnstile::lock::{LockBackend, LockName, OwnerId, ReleaseOutcome, TryAcquire};
    let url = shared_postgres().fresh_database("woke");
    let store = PostgresLockStore::connect(&url).await.unwrap();
    let ttl = Duration::from_secs(30);
    let (holder, waiter) = (OwnerId::random(), OwnerId::random());
    // The holder takes `name` on `store`; with `contended`, the waiter's refused
    // attempt then marks the row. What the holder's release says.
    let cycle = async |store: &PostgresLockStore, name: &LockName, contended: bool| {
        let acquired = |answer| matches!(answer, TryAcquire::Acquired { .. });
        assert!(acquired(
            store.try_acquire(name, &holder, ttl).await.unwrap()
        ));
        if contended {
            assert!(!acquired(
                store.try_acquire(name, &waiter, ttl).await.unwrap()
            ));
        }
        store.release_waking_others(name, &holder).await.unwrap()
    };

    let (quiet, busy) = (
        LockName::new("quiet").unwrap(),
        LockName::new("busy").unwrap(),
    );
    assert_eq!(
        cycle(&store, &quiet, false).await,
        (ReleaseOutcome::Released, Some(false))
    );
    assert_eq!(
        cycle(&store, &busy, true).await,
        (ReleaseOutcome::Released, Some(true))
    );

    let polling = PostgresLockStore::connect(&format!("{url}?turnstile_notify=off"))
        .await
        .unwrap();
    assert_eq!(
        cycle(&polling, &busy, true).await,
        (ReleaseOutcome::Released, None)
    );
}

/// A LISTEN connection that cannot be made at first (the server is down) is retried;
/// waiters poll meanwhile and are notified again once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listen_connection_comes_back_after_the_server_does() {
    use turnstile::lock::{LockBackend, LockName};
    let server = PostgresServer::spawn();
    let store = PostgresLockStore::connect(&server.url()).await.unwrap();
    server.kill();
    let name = LockName::new("later").unwrap();
    let _watch = store.watch_releases(&name).await.unwrap();
    assert!(!store.is_listening());
    server.restart();
    eventually("listening again", Duration::from_secs(20), || {
        store.is_listening()
    })
    .await;
}

/// The store keeps its connections between statements instead of returning them to
/// its pool. Sixteen tasks on a two-connection store: a statement waiting for the pool
/// takes a connection another statement puts back, rather than waiting for the pool
/// (which would never see it again) until its acquire timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_callers_than_connections_share_the_kept_ones() {
    let url = shared_postgres().fresh_database("kept");
    let config = PostgresLockConfig::new()
        .max_connections(2)
        .connect_timeout(Duration::from_secs(1));
    let locker = Locker::new(PostgresLockStore::connect_with(&url, config).await.unwrap());
    let name = unique_name("kept");
    let tasks = (0..16).map(|task| {
        let locker = locker.clone();
        let name = format!("{name}-{task}");
        tokio::spawn(async move {
            for _ in 0..20 {
                let guard = locker.acquire(&name, &LockOptions::new()).await?;
                guard.release().await?;
            }
            Ok::<_, turnstile::Error>(())
        })
    });
    for result in futures_join(tasks).await {
        result.unwrap();
    }
}

/// A waiter in another process hears of releases through its store's LISTEN
/// connection. When that connection is lost, the waiters re-check once it is back, and
/// poll while it is not: a release made meanwhile still wakes them at once, not at the
/// end of the holder's 30 s lease. Twenty rounds, each losing the connection shortly
/// before the release: ended by the server (an error on the connection) or cut by the
/// network (the connection just closes, and sqlx reconnects before it says so).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_while_the_listen_connection_is_lost_is_not_missed() {
    let server = shared_postgres();
    let url = server.fresh_database("relisten");
    let proxy = TcpProxy::start(server.port());
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    let holders = Locker::new(PostgresLockStore::connect(&url).await.unwrap());
    let waiting_store = PostgresLockStore::connect(&proxy.url_for(&url))
        .await
        .unwrap();
    let waiters = Locker::new(waiting_store.clone());
    let name = unique_name("relisten");
    let lease = LockOptions::new().ttl(Duration::from_secs(30));
    for round in 0..20 {
        let held = holders.acquire(&name, &lease).await.unwrap();
        let waiter = {
            let (waiters, name, lease) = (waiters.clone(), name.clone(), lease.clone());
            tokio::spawn(async move {
                waiters
                    .acquire(&name, &lease.wait(Duration::from_secs(60)))
                    .await
            })
        };
        eventually(
            "the waiter's store listens",
            Duration::from_secs(10),
            || waiting_store.is_listening(),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        if round % 2 == 0 {
            let ended = terminate_sessions(&admin, "AND query LIKE 'LISTEN%'").await;
            assert_eq!(ended, 1, "round {round}: one LISTEN connection");
        } else {
            proxy.close_connections();
        }
        // Released at once or up to 19 ms later: before or after the waiter has heard
        // of the loss, before or after its store is listening again.
        tokio::time::sleep(Duration::from_millis(round)).await;
        held.release().await.unwrap();
        let woken = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .unwrap_or_else(|_| panic!("round {round}: the waiter missed the release"));
        woken.unwrap().unwrap().release().await.unwrap();
    }
}

/// A database that refuses new sessions for a while (`ALLOW_CONNECTIONS false`, as
/// for maintenance) answers with a FATAL error: the store is unavailable, which a
/// waiting acquire retries, not broken. It works again once the database accepts
/// sessions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_refusing_sessions_is_unavailable_not_broken() {
    let server = shared_postgres();
    let url = server.fresh_database("refusing");
    let database = url.rsplit('/').next().unwrap().to_owned();
    let locker = Locker::connect(&url).await.unwrap();
    let name = unique_name("refusing");
    let quick = LockOptions::new().wait(Duration::ZERO);
    let take_and_release = async || locker.acquire(&name, &quick).await?.release().await;
    take_and_release().await.unwrap();
    server.sql(
        "postgres",
        &format!(
            "ALTER DATABASE \"{database}\" ALLOW_CONNECTIONS false;
             SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{database}'"
        ),
    );
    let error = locker.acquire(&name, &quick).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::StoreUnavailable, "{error:?}");
    server.sql(
        "postgres",
        &format!("ALTER DATABASE \"{database}\" ALLOW_CONNECTIONS true"),
    );
    take_and_release().await.unwrap();
}

/// The application's pool must leave a connection for renewals; the LISTEN connection
/// is not taken from it.
#[tokio::test]
async fn an_application_pool_too_small_to_renew_is_refused() {
    let url = shared_postgres().fresh_database("tinypool");
    let tiny = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .unwrap();
    let error = PostgresLockStore::from_pool(tiny, PostgresLockConfig::new())
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidOptions);
    assert!(error.to_string().contains("at least 2"), "{error}");
}

/// A lease acquire meeting a transaction-scoped holder answers "held" within the
/// store's short lock timeout instead of waiting for the transaction to end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_acquire_does_not_wait_for_a_transaction_scoped_holder() {
    let url = shared_postgres().fresh_database("xwait");
    let store = PostgresLockStore::connect(&url).await.unwrap();
    let mut transaction = store.pool().begin().await.unwrap();
    store
        .lock_in_transaction(&mut transaction, "nightly")
        .await
        .unwrap();
    let other = Locker::new(PostgresLockStore::connect(&url).await.unwrap());
    let started = tokio::time::Instant::now();
    let answer = other
        .try_acquire("nightly", &LockOptions::new())
        .await
        .unwrap();
    assert!(answer.is_none(), "the lock is held by the transaction");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "waited {:?}",
        started.elapsed()
    );
    transaction.rollback().await.unwrap();
    other
        .try_acquire("nightly", &LockOptions::new())
        .await
        .unwrap()
        .expect("free after the rollback")
        .release()
        .await
        .unwrap();
}

/// A name used in session mode cannot be taken in lease mode, and the other way round:
/// each says so clearly (before: "cannot subtract infinite timestamps").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_name_is_used_in_one_mode() {
    let url = shared_postgres().fresh_database("modes");
    let lease = Locker::connect(&url).await.unwrap();
    let session = Locker::connect(&format!("{url}?turnstile_mode=session"))
        .await
        .unwrap();
    let held = session
        .acquire("by-session", &LockOptions::new())
        .await
        .unwrap();
    let error = lease
        .try_acquire("by-session", &LockOptions::new())
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidOptions, "{error}");
    assert!(error.to_string().contains("one mode per name"), "{error}");
    held.release().await.unwrap();

    lease
        .acquire("by-lease", &LockOptions::new())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let error = session
        .try_acquire("by-lease", &LockOptions::new())
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidOptions, "{error}");
}

/// Session mode's unfenced lock is a bare `pg_try_advisory_lock`: no token row is
/// written, the holder is named in its session's application
/// name (status shows its owner and no token), a fenced waiter elsewhere waits for it
/// past two collision checks instead of taking it for a colliding name's holder and gets
/// a token once it is released, a hand-over within the process to a fenced waiter
/// records that waiter with a token, and a release gives the session its application
/// name back. A lease-mode name is refused unfenced too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfenced_session_lock_writes_nothing() {
    let url = shared_postgres().fresh_database("unfenced");
    let session_url = format!("{url}?turnstile_mode=session");
    let locker = Locker::connect(&session_url).await.unwrap();
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    // Creates the tables (a first use).
    locker
        .acquire("first", &LockOptions::new())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let token_rows = |name: &'static str| {
        let admin = admin.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM turnstile_tokens WHERE name = $1")
                .bind(name)
                .fetch_one(&admin)
                .await
                .unwrap()
        }
    };
    let named_sessions = || {
        let admin = admin.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'ts %'",
            )
            .fetch_one(&admin)
            .await
            .unwrap()
        }
    };

    let guard = locker
        .acquire_unfenced("bare", &LockOptions::new())
        .await
        .unwrap();
    assert_eq!(
        token_rows("bare").await,
        0,
        "an unfenced acquire wrote a token row"
    );
    assert_eq!(named_sessions().await, 1);
    let status = locker.status("bare").await.unwrap().expect("held");
    assert_eq!(status.owner, guard.owner().to_hex());
    assert_eq!(status.fencing_token, None);

    let other = Locker::connect(&session_url).await.unwrap();
    let waiter = tokio::spawn(async move {
        let guard = other
            .acquire("bare", &LockOptions::new().wait(Duration::from_secs(15)))
            .await;
        (other, guard)
    });
    tokio::time::sleep(Duration::from_millis(2_600)).await;
    assert!(
        !waiter.is_finished(),
        "the fenced waiter did not wait for the unfenced holder"
    );
    guard.release().await.unwrap();
    let (other, fenced) = waiter.await.unwrap();
    let fenced = fenced.expect("the fenced waiter gets the lock, not a collision error");
    let status = other.status("bare").await.unwrap().expect("held");
    assert_eq!(status.owner, fenced.owner().to_hex());
    assert_eq!(status.fencing_token, Some(fenced.fencing_token()));
    assert_eq!(token_rows("bare").await, 1);
    fenced.release().await.unwrap();
    assert_eq!(
        named_sessions().await,
        0,
        "a released session kept its holder's name"
    );

    // A hand-over within one process, from an unfenced holder to a fenced waiter.
    let holder = locker
        .acquire_unfenced("handed", &LockOptions::new())
        .await
        .unwrap();
    let next = {
        let locker = locker.clone();
        tokio::spawn(async move { locker.acquire("handed", &LockOptions::new()).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    holder.release().await.unwrap();
    let next = next.await.unwrap().unwrap();
    let status = locker.status("handed").await.unwrap().expect("held");
    assert_eq!(status.owner, next.owner().to_hex());
    assert_eq!(status.fencing_token, Some(next.fencing_token()));
    assert_eq!(named_sessions().await, 0);
    next.release().await.unwrap();

    // A lease-mode name is refused unfenced as it is fenced.
    Locker::connect(&url)
        .await
        .unwrap()
        .acquire("by-lease", &LockOptions::new())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let error = locker
        .try_acquire_unfenced("by-lease", &LockOptions::new())
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidOptions, "{error}");
    assert!(error.to_string().contains("one mode per name"), "{error}");
}

/// A session that holds a lock's advisory key without being the lock's holder (a name
/// crafted to hash alike, stood in for here by a raw `pg_advisory_lock` on the key) does
/// not keep a waiter waiting until its deadline: the waiter is refused with a reason
/// within about two checks. A lock held the ordinary way still makes waiters wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_mode_refuses_a_key_held_for_another_name() {
    let url = shared_postgres().fresh_database("collide");
    let session = Locker::connect(&format!("{url}?turnstile_mode=session"))
        .await
        .unwrap();
    let waiting = LockOptions::new().wait(Duration::from_secs(6));

    // Held by a Turnstile holder of the same name: an ordinary wait that times out.
    let other = Locker::connect(&format!("{url}?turnstile_mode=session"))
        .await
        .unwrap();
    let held = other.acquire("owned", &LockOptions::new()).await.unwrap();
    let error = session
        .acquire(
            "owned",
            &LockOptions::new().wait(Duration::from_millis(2500)),
        )
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::AcquireTimeout, "{error}");
    held.release().await.unwrap();

    // The key of a name used before, and of a name never used, held by a foreign session.
    session
        .acquire("victim", &LockOptions::new())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    for name in ["victim", "never-used"] {
        let foreign = sqlx::PgPool::connect(&url).await.unwrap();
        let mut raw = foreign.acquire().await.unwrap();
        sqlx::query("SELECT pg_advisory_lock(hashtextextended($1, 1953854062))")
            .bind(name)
            .execute(&mut *raw)
            .await
            .unwrap();
        let started = std::time::Instant::now();
        let error = session.acquire(name, &waiting).await.unwrap_err();
        assert_eq!(error.kind(), ErrorKind::InvalidName, "{name}: {error}");
        assert!(
            error.to_string().contains("hashes to the same key"),
            "{error}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "{name}: refused only after {:?}",
            started.elapsed()
        );
        sqlx::query("SELECT pg_advisory_unlock_all()")
            .execute(&mut *raw)
            .await
            .unwrap();
        drop(raw);
        // Once the key is free, the name is usable again.
        session
            .acquire(name, &waiting)
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }
}

/// Both modes asked for a brand-new name at the same instant: at most one gets it, the
/// other finds it held or is refused. Before the session acquire's marker row was an
/// upsert that sees a lease row committed after the statement began, both got the lock
/// in about one pair of five.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_modes_on_a_new_name_at_once_never_both_hold() {
    let url = shared_postgres().fresh_database("moderace");
    let lease = Locker::connect(&url).await.unwrap();
    let session = Locker::connect(&format!("{url}?turnstile_mode=session"))
        .await
        .unwrap();
    let mut both = 0;
    for n in 0..300 {
        let name = format!("race-{n}");
        let options = LockOptions::new();
        let (a, b) = tokio::join!(
            lease.try_acquire(&name, &options),
            session.try_acquire(&name, &options)
        );
        // A loser finds the name in the other mode and says so, whichever way the race
        // went (a lease acquire may learn it only as its own statement runs).
        for error in [a.as_ref().err(), b.as_ref().err()].into_iter().flatten() {
            assert_eq!(
                error.kind(),
                ErrorKind::InvalidOptions,
                "round {n}: {error}"
            );
            assert!(error.to_string().contains("one mode per name"), "{error}");
        }
        if let (Ok(Some(a)), Ok(Some(b))) = (a, b) {
            both += 1;
            drop((a, b));
        }
    }
    assert_eq!(both, 0, "both modes held a new name {both} times of 300");
}

/// A wrong user or an unknown database is a configuration error: not retryable, one
/// sentence with the server's words, no driver internals.
#[tokio::test]
async fn refusals_are_configuration_errors_that_say_why() {
    let server = shared_postgres();
    let port = server.port();
    for (url, says) in [
        (
            format!("postgres://nosuchuser@127.0.0.1:{port}/postgres"),
            "nosuchuser",
        ),
        (
            format!("postgres://postgres@127.0.0.1:{port}/nosuchdb"),
            "nosuchdb",
        ),
    ] {
        let error = PostgresLockStore::connect(&url).await.unwrap_err();
        assert_eq!(error.kind(), ErrorKind::Configuration, "{url}: {error}");
        assert!(!error.is_retryable());
        let text = error.to_string();
        assert!(text.contains(says), "{text}");
        assert!(!text.contains(" at line "), "driver internals in {text}");
    }
    // Nothing listens (nor can, while `closed` lives): unavailable, and the cause is named.
    let closed = turnstile_test_support::ClosedPort::bind();
    let error = PostgresLockStore::connect(&format!(
        "postgres://postgres@127.0.0.1:{}/postgres",
        closed.port()
    ))
    .await
    .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::StoreUnavailable, "{error}");
    assert!(!error.to_string().contains("pool timed out"), "{error}");
}

/// Token durability with the clock floor out of the way: the stored token is far ahead
/// of the clock, so only the committed counter can keep the next token larger. The test
/// server runs with `synchronous_commit = off`; with `turnstile_sync_commit=on` the
/// store forces it on for its own connections, or the crash would lose the last token
/// and issue it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_sync_commit_a_token_ahead_of_the_clock_survives_a_crash() {
    // fsync on, and commits that do not wait for the disk lost by a crash every time.
    let server = PostgresServer::spawn_durable();
    let url = format!("{}?turnstile_sync_commit=on", server.url());
    let store = PostgresLockStore::connect(&url).await.unwrap();
    let setting: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(setting, "on");
    let locker = Locker::new(store.clone());
    locker
        .acquire("ahead", &LockOptions::new())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let ahead: i64 = 1 << 60;
    sqlx::query("UPDATE turnstile_tokens SET token = $1 WHERE name = 'ahead'")
        .bind(ahead)
        .execute(store.pool())
        .await
        .unwrap();
    // A short lease: the crash leaves it held until it runs out.
    let first = locker
        .acquire(
            "ahead",
            &LockOptions::new()
                .ttl(Duration::from_secs(1))
                .watchdog(false),
        )
        .await
        .unwrap();
    assert_eq!(first.fencing_token(), FencingToken::new(ahead as u64 + 1));
    std::mem::forget(first);
    drop(locker);
    server.crash_and_restart();
    let after = Locker::new(PostgresLockStore::connect(&url).await.unwrap());
    let second = after
        .acquire("ahead", &LockOptions::new().wait(Duration::from_secs(40)))
        .await
        .unwrap();
    assert_eq!(second.fencing_token(), FencingToken::new(ahead as u64 + 2));
    second.release().await.unwrap();
}

/// The default: the store's commits do not wait for the disk, and a crash loses the
/// last ones, yet every token issued before the crash is below the first one after it,
/// because tokens are floored by the database clock (which did not step back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_sync_commit_tokens_still_grow_across_a_crash() {
    // fsync on, and commits that do not wait for the disk lost by a crash every time:
    // the crash must lose the last tokens, or the clock floor is never put to work.
    let server = PostgresServer::spawn_durable();
    let url = server.url();
    let store = PostgresLockStore::connect(&url).await.unwrap();
    let setting: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(setting, "on", "the application's pool is left alone");
    let locker = Locker::new(store.clone());
    let options = LockOptions::new()
        .ttl(Duration::from_secs(1))
        .watchdog(false);
    let mut before = Vec::new();
    for _ in 0..200 {
        let guard = locker.acquire("crash", &options).await.unwrap();
        before.push(guard.fencing_token());
        guard.release().await.unwrap();
    }
    // The last one is held through the crash.
    let held = locker.acquire("crash", &options).await.unwrap();
    before.push(held.fencing_token());
    std::mem::forget(held);
    drop(locker);
    drop(store);
    server.crash_and_restart();
    let store = PostgresLockStore::connect(&url).await.unwrap();
    let kept: i64 = sqlx::query_scalar("SELECT token FROM turnstile_tokens WHERE name = 'crash'")
        .fetch_one(store.pool())
        .await
        .unwrap();
    let lost = before
        .iter()
        .filter(|token| token.get() > kept as u64)
        .count();
    assert!(
        lost > 0,
        "the crash lost none of the last {} tokens' commits: the clock floor was not needed",
        before.len()
    );
    let after = Locker::new(store);
    let guard = after
        .acquire("crash", &LockOptions::new().wait(Duration::from_secs(40)))
        .await
        .unwrap();
    conformance::assert_above_every_earlier_token(guard.fencing_token(), &before);
    guard.release().await.unwrap();
}

/// Transaction-scoped holders waiting for one name fill the application's pool; the
/// holder still gets its token (issued on the store's own connections), so nobody
/// times out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_transactions_cannot_starve_the_holders_token() {
    let url = shared_postgres().fresh_database("xstarve");
    let store = PostgresLockStore::connect(&url).await.unwrap();
    let size = store.pool().options().get_max_connections();
    let mut tasks = Vec::new();
    for _ in 0..size {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let mut transaction = store.pool().begin().await.unwrap();
            let token = store
                .lock_in_transaction(&mut transaction, "payroll")
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
            transaction.commit().await.unwrap();
            token
        }));
    }
    let mut tokens = Vec::new();
    for task in tasks {
        tokens.push(
            tokio::time::timeout(Duration::from_secs(20), task)
                .await
                .expect("a holder got stuck")
                .unwrap(),
        );
    }
    tokens.sort();
    tokens.dedup();
    assert_eq!(tokens.len(), size as usize, "a token was issued twice");
}

/// The LISTEN connection and its task end with the last clone of the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listen_connection_ends_with_the_store() {
    use turnstile::lock::{LockBackend, LockName};
    let url = shared_postgres().fresh_database("listenend");
    let observer = sqlx::PgPool::connect(&url).await.unwrap();
    let listening = || async {
        let count: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND query LIKE 'LISTEN%'",
        )
        .fetch_one(&observer)
        .await
        .unwrap();
        count
    };
    let store = PostgresLockStore::connect(&url).await.unwrap();
    let watch = store
        .watch_releases(&LockName::new("x").unwrap())
        .await
        .unwrap();
    assert!(store.is_listening());
    assert_eq!(listening().await, 1);
    drop(watch);
    drop(store);
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    while listening().await > 0 {
        assert!(
            tokio::time::Instant::now() < until,
            "the LISTEN connection outlived the store"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A lease holder cut off by a partition stops before the next holder starts: its
/// lost signal fires at its local deadline, and a client polling the database
/// directly gets the lock only after that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_holder_stops_before_the_next_holder_starts() {
    let server = shared_postgres();
    let url = server.fresh_database("partition");
    let proxy = TcpProxy::start(server.port());
    let holder = Locker::new(
        PostgresLockStore::connect(&proxy.url_for(&url))
            .await
            .unwrap(),
    );
    let direct = Locker::new(PostgresLockStore::connect(&url).await.unwrap());
    faults::a_partitioned_holder_stops_before_the_next_holder_starts(
        &proxy,
        &holder,
        &direct,
        Duration::from_secs(3),
        Duration::from_secs(3) / 3,
    )
    .await;
}

/// The lease of the fault exercises.
const FAULT_TTL: Duration = Duration::from_millis(1_500);

fn fault_lease() -> LockOptions {
    LockOptions::new()
        .ttl(FAULT_TTL)
        .wait(Duration::from_secs(2))
}

/// Three clients of `url` (lease or session mode), each with its own store, making
/// fenced writes in transactions of their store's application pool.
async fn postgres_contenders(url: &str) -> Vec<faults::Contender> {
    let resource = unique_name("resource");
    let mut contenders = Vec::new();
    for _ in 0..3 {
        let locker = Locker::connect(url).await.unwrap();
        let base = url.split('?').next().unwrap();
        let store = PostgresLockStore::connect(base).await.unwrap();
        let (pool, fence, resource) = (store.pool().clone(), store.fence(), resource.clone());
        let write: faults::Write = std::sync::Arc::new(move |token| {
            let (pool, fence, resource) = (pool.clone(), fence.clone(), resource.clone());
            Box::pin(async move {
                let mut transaction = pool.begin().await.map_err(|e| e.to_string())?;
                let outcome = fence
                    .check_and_record(&mut transaction, &resource, token)
                    .await
                    .map_err(|e| e.to_string())?;
                transaction.commit().await.map_err(|e| e.to_string())?;
                Ok(outcome)
            })
        });
        contenders.push(faults::Contender { locker, write });
    }
    contenders
}

/// Ends every session of the database but the caller's; returns how many it ended.
async fn terminate_sessions(admin: &sqlx::PgPool, filter: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid() {filter}) AS t"
    )))
    .fetch_one(admin)
    .await
    .unwrap()
}

/// Both modes hand out a connection without a ping unless it sat idle for a second
/// (sqlx's default pings each time: a round trip before every statement), and a
/// statement whose connection turns out to be gone is sent again on another, as many
/// times as there may be pooled connections. A connection the server ended is
/// replaced, not reported as an error: just after its last use (the retry) and after a
/// second idle (the ping). Four locks held at once leave four sessions in session
/// mode's pool, all ended together, so the retry meets several in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_the_server_ended_are_replaced_not_reported() {
    let url = shared_postgres().fresh_database("idle_ended");
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    for mode in ["", "?turnstile_mode=session"] {
        let locker = Locker::connect(&format!("{url}{mode}")).await.unwrap();
        let name = unique_name("idle");
        for idle in [Duration::from_millis(200), Duration::from_millis(1_200)] {
            conformance::hold_at_once_then_release(&locker, &name, 4).await;
            assert!(terminate_sessions(&admin, "").await > 0);
            tokio::time::sleep(idle).await;
            let guard = locker
                .acquire(&name, &LockOptions::new().wait(Duration::ZERO))
                .await
                .unwrap_or_else(|error| panic!("mode {mode:?}, idle {idle:?}: {error}"));
            guard.release().await.unwrap();
        }
    }
}

/// A restart (data kept) while contenders hold and wait in lease mode: the lease is in
/// the table and expires by the database clock, so nobody shares the lock; a holder
/// that cannot renew in time stops at its local deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion_holds_across_a_restart_in_lease_mode() {
    let server = PostgresServer::spawn();
    let contenders = postgres_contenders(&server.url()).await;
    let exercise = faults::Exercise::start(
        &unique_name("restart"),
        &fault_lease(),
        faults::Work::SHORT,
        contenders,
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    exercise.new_holder().await;
    server.restart();
    let back = tokio::time::Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    exercise.finish().await.check(&faults::Expect {
        exclusive: true,
        reasons: &[LossReason::RenewalFailed],
        someone_loses: false,
        faults: &[back],
        detect_slack: Duration::ZERO,
    });
}

/// Every session of the database ended (pg_terminate_backend) three times while
/// contenders hold and wait in lease mode: the pools reconnect, nobody loses the lock
/// and nobody shares it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion_holds_and_nobody_loses_when_sessions_are_terminated_in_lease_mode() {
    let url = shared_postgres().fresh_database("terminate");
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    let contenders = postgres_contenders(&url).await;
    let exercise = faults::Exercise::start(
        &unique_name("terminate"),
        &fault_lease(),
        faults::Work::SHORT,
        contenders,
    );
    tokio::time::sleep(Duration::from_millis(800)).await;
    let mut kills = Vec::new();
    for _ in 0..3 {
        exercise.new_holder().await;
        assert!(terminate_sessions(&admin, "").await > 0);
        kills.push(tokio::time::Instant::now());
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    exercise.finish().await.check(&faults::Expect {
        exclusive: true,
        reasons: &[],
        someone_loses: false,
        faults: &kills,
        detect_slack: Duration::ZERO,
    });
}

/// Session mode: the holder's session ended (pg_terminate_backend) frees the lock at
/// once, so the next holder may start before the old one can know; the old one learns
/// at its next renewal, within TTL/3, and its late writes are fenced out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_session_is_fenced_and_noticed_within_a_third_of_the_ttl() {
    let url = shared_postgres().fresh_database("sessionkill");
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    let contenders = postgres_contenders(&format!("{url}?turnstile_mode=session")).await;
    // Sections longer than the renewal interval: the holder is still at work when its
    // next renewal finds its session gone.
    let work = faults::Work {
        writes: 8,
        pause: Duration::from_millis(120),
    };
    let exercise = faults::Exercise::start(
        &unique_name("sessionkill"),
        &fault_lease(),
        work,
        contenders,
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut kills = Vec::new();
    for _ in 0..2 {
        exercise.new_holder().await;
        let ended = terminate_sessions(
            &admin,
            "AND pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted)",
        )
        .await;
        assert_eq!(ended, 1, "the holder's session was not found");
        kills.push(tokio::time::Instant::now());
        tokio::time::sleep(Duration::from_millis(1_200)).await;
    }
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    exercise.finish().await.check(&faults::Expect {
        exclusive: false,
        reasons: &[LossReason::Expired, LossReason::TakenOver],
        someone_loses: true,
        faults: &kills,
        detect_slack: Duration::from_millis(300),
    });
}
