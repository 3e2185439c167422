//! The MySQL / MariaDB engine: the conformance suite against a real MariaDB, plus what
//! only named locks on sessions do.

mod conformance;
mod faults;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use conformance::TestStore;
use sqlx::AssertSqlSafe;
use tokio::time::Instant;
use turnstile::fence::FencingToken;
use turnstile::lock::LockGuard;
use turnstile::lock::mysql::MysqlLockStore;
use turnstile::lock::{LockOptions, Locker, LossReason, ReleaseOutcome};
use turnstile_test_support::{MariaDbServer, TcpProxy, shared_mariadb, unique_name};

struct MysqlDatabase {
    url: String,
}

impl TestStore for MysqlDatabase {
    fn locker(&self) -> Pin<Box<dyn Future<Output = Locker> + Send + '_>> {
        Box::pin(async move { Locker::new(MysqlLockStore::connect(&self.url).await.unwrap()) })
    }

    fn notifies_other_processes(&self) -> bool {
        false
    }
}

async fn fresh_database() -> MysqlDatabase {
    MysqlDatabase {
        url: shared_mariadb().fresh_database("lock"),
    }
}

conformance_tests!(super::fresh_database);

mod server_clock_ahead {
    //! The whole suite on a server whose wall clock is an hour ahead of the host's: tokens
    //! come from the database server's clock, and expiry is the session's
    //! `wait_timeout`, which no wall clock moves.
    use super::*;
    use turnstile_test_support::ServerClock;

    async fn fresh_database() -> MysqlDatabase {
        database_on(ServerClock::HourAhead).await
    }

    conformance_tests!(super::fresh_database);
}

mod server_clock_behind {
    //! The whole suite on a server whose wall clock is an hour behind the host's.
    use super::*;
    use turnstile_test_support::ServerClock;

    async fn fresh_database() -> MysqlDatabase {
        database_on(ServerClock::HourBehind).await
    }

    conformance_tests!(super::fresh_database);
}

/// A database of the shared server on `clock`.
async fn database_on(clock: turnstile_test_support::ServerClock) -> MysqlDatabase {
    MysqlDatabase {
        url: turnstile_test_support::shared_mariadb_on(clock).fresh_database("clock"),
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

fn options() -> LockOptions {
    LockOptions::new()
        .ttl(Duration::from_secs(3))
        .wait(Duration::from_secs(10))
}

/// The server-side name of a lock whose name is short and plain (as `unique_name`'s
/// are): `ts:` and the name.
fn server_lock_name(name: &str) -> String {
    assert!(name.len() <= 60 && !name.contains(|c: char| c.is_ascii_uppercase()));
    format!("ts:{name}")
}

/// Ends the session holding `name` with `KILL CONNECTION`.
fn kill_holder(server: &MariaDbServer, name: &str) {
    let holder = server.sql(&format!(
        "SELECT IS_USED_LOCK('{}')",
        server_lock_name(name)
    ));
    let holder = holder.trim();
    assert!(
        holder.parse::<u64>().is_ok(),
        "nobody holds {name}: {holder}"
    );
    server.sql(&format!("KILL CONNECTION {holder}"));
}

/// The sessions' pool hands out a connection without a ping unless it sat idle for a
/// second (sqlx's default pings each time: a round trip before every statement), and
/// an acquire whose connection turns out to be gone is sent again on another, as many
/// times as the pool may hold connections. A connection the server ended is replaced,
/// not reported as an error: just after its last use (the retry) and after a second
/// idle (the ping). Four locks held at once leave four sessions in the pool, all ended
/// together, so the retry meets several in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_the_server_ended_are_replaced_not_reported() {
    let server = shared_mariadb();
    let url = server.fresh_database("idle_ended");
    let database = url.rsplit('/').next().unwrap();
    let locker = Locker::new(MysqlLockStore::connect(&url).await.unwrap());
    let name = unique_name("idle");
    for idle in [Duration::from_millis(200), Duration::from_millis(1_200)] {
        conformance::hold_at_once_then_release(&locker, &name, 4).await;
        let ids = server.sql(&format!(
            "SELECT id FROM information_schema.processlist WHERE db = '{database}'"
        ));
        let ids: Vec<&str> = ids.split_whitespace().collect();
        assert!(!ids.is_empty(), "no connection to {database}");
        for id in ids {
            server.sql(&format!("KILL CONNECTION {id}"));
        }
        tokio::time::sleep(idle).await;
        let guard = locker
            .acquire(&name, &LockOptions::new().wait(Duration::ZERO))
            .await
            .unwrap_or_else(|error| panic!("idle {idle:?}: {error}"));
        assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
    }
}

/// A killed session is a certain loss: the next renewal (within TTL/3) says
/// `Expired`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_holders_session_fires_the_lost_signal() {
    let server = shared_mariadb();
    let url = server.fresh_database("kill");
    let locker = Locker::new(MysqlLockStore::connect(&url).await.unwrap());
    let ttl = Duration::from_secs(1);
    let name = unique_name("report");
    let guard = locker
        .acquire(&name, &LockOptions::new().ttl(ttl))
        .await
        .unwrap();
    kill_holder(server, &name);
    let killed = tokio::time::Instant::now();
    let (reason, seen) = faults::first_seen_lost(&guard, ttl).await;
    assert_eq!(reason, LossReason::Expired);
    assert!(
        seen - killed <= ttl / 3 + Duration::from_millis(300),
        "the loss was seen {:?} after the kill",
        seen - killed
    );
}

/// A holder whose session was killed releases with a same-process waiter queued: the
/// hand-over's statement finds the session dead (there is no ping before it), so the
/// lock is released the ordinary way and the waiter takes it on a fresh session, with
/// a larger token, instead of the hand-over failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_over_from_a_killed_session_falls_back_to_an_ordinary_acquire() {
    let server = shared_mariadb();
    let url = server.fresh_database("killed_hand_over");
    let locker = Locker::new(MysqlLockStore::connect(&url).await.unwrap());
    // Long enough that no renewal notices the kill before the release.
    let ttl = Duration::from_secs(30);
    let name = unique_name("handover");
    let holder = locker
        .acquire(&name, &LockOptions::new().ttl(ttl))
        .await
        .unwrap();
    let before = holder.fencing_token();
    let waiter = {
        let (locker, name) = (locker.clone(), name.clone());
        tokio::spawn(async move {
            locker
                .acquire(
                    &name,
                    &LockOptions::new().ttl(ttl).wait(Duration::from_secs(10)),
                )
                .await
        })
    };
    // Let the waiter queue behind the holder.
    tokio::time::sleep(Duration::from_millis(200)).await;
    kill_holder(server, &name);
    let released = holder.release().await.unwrap();
    assert_ne!(
        released,
        ReleaseOutcome::Released,
        "a killed session released its lock"
    );
    let next = waiter.await.unwrap().expect("the waiter got the lock");
    assert!(next.fencing_token() > before);
    assert!(!next.is_lost());
    next.release().await.unwrap();
}

/// A restart ends every session: the holder's next renewal finds its session dead and
/// says `Expired` (within TTL/3 of the restart, whether or not the server is back), the
/// lock is free, and tokens keep increasing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_increasing_across_restarts_and_every_lock_is_freed() {
    let server = MariaDbServer::spawn();
    let url = server.url();
    let locker = Locker::new(MysqlLockStore::connect(&url).await.unwrap());
    let ttl = Duration::from_secs(3);
    let name = unique_name("ledger");
    let guard = locker
        .acquire(&name, &LockOptions::new().ttl(ttl))
        .await
        .unwrap();
    let before = guard.fencing_token();
    let restarting = tokio::time::Instant::now();
    server.restart();
    let (reason, seen) = faults::first_seen_lost(&guard, ttl).await;
    assert_eq!(reason, LossReason::Expired);
    assert!(
        seen - restarting <= ttl / 3 + Duration::from_millis(500),
        "the loss was seen {:?} after the restart began",
        seen - restarting
    );
    let other = Locker::new(MysqlLockStore::connect(&url).await.unwrap());
    let after = other
        .acquire(&name, &options().wait(Duration::ZERO))
        .await
        .unwrap();
    assert!(after.fencing_token() > before);
    after.release().await.unwrap();
    server.kill();
}

#[tokio::test]
async fn long_and_mixed_case_names_get_their_own_locks() {
    let url = shared_mariadb().fresh_database("names");
    let locker = Locker::new(MysqlLockStore::connect(&url).await.unwrap());
    // Named locks are global on the server, across databases and test processes:
    // every name here is unique.
    let unique = unique_name("names");
    let upper = format!("{unique}:Order:1");
    let lower = format!("{unique}:order:1");
    let long = format!("{unique}:{}", "x".repeat(300));
    let longer = format!("{long}y");
    let japanese = format!("{unique}:注文:1");
    let names = [
        upper.as_str(),
        lower.as_str(),
        long.as_str(),
        longer.as_str(),
        japanese.as_str(),
    ];
    let mut guards = Vec::new();
    for name in names {
        // Each is free although all the others are held.
        let guard = locker.try_acquire(name, &options()).await.unwrap();
        guards.push(guard.unwrap_or_else(|| panic!("{name:?} collided with another name")));
    }
    for (guard, name) in guards.iter().zip(names) {
        let status = locker.status(name).await.unwrap().expect("held");
        assert_eq!(status.fencing_token, Some(guard.fencing_token()));
    }
    for guard in guards {
        assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
    }
}

/// The notes' paused-holder scenario, stopped by a fenced write in the application's
/// own transaction. A's lease is 1 s, the shortest a session lock has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_holders_late_write_is_rejected() {
    let url = shared_mariadb().fresh_database("fence");
    let store = MysqlLockStore::connect(&url).await.unwrap();
    let pool = store.pool().clone();
    sqlx::query("CREATE TABLE invoices (id VARCHAR(32) PRIMARY KEY, total BIGINT) ENGINE = InnoDB")
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
                sqlx::query("REPLACE INTO invoices VALUES ('invoice:1', ?)")
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
    let lease = LockOptions::new().ttl(Duration::from_secs(1));
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
    let url = shared_mariadb().fresh_database("xact");
    let store = MysqlLockStore::connect(&url).await.unwrap();
    // Named locks are global on the server: a name no other test uses.
    let name = unique_name("batch");
    let mut first = store.pool().begin().await.unwrap();
    let first_token = store.lock_in_transaction(&mut first, &name).await.unwrap();
    let waiter = {
        let (store, name) = (store.clone(), name.clone());
        tokio::spawn(async move {
            let mut second = store.pool().begin().await.unwrap();
            let token = store.lock_in_transaction(&mut second, &name).await.unwrap();
            let got_it = tokio::time::Instant::now();
            second.rollback().await.unwrap();
            (token, got_it)
        })
    };
    // The second transaction is seen waiting for a row lock in this test's database.
    let database = url.rsplit('/').next().unwrap();
    let waiting = format!(
        "SELECT COUNT(*) FROM information_schema.INNODB_TRX t
         JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id
         WHERE t.trx_state = 'LOCK WAIT' AND p.DB = '{database}'"
    );
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    while shared_mariadb().sql(&waiting).trim() == "0" {
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

    // While a named lock is held, a transaction-scoped lock says so.
    let locker = Locker::new(store.clone());
    let guard = locker.acquire(&name, &options()).await.unwrap();
    assert!(guard.fencing_token() > second_token);
    let mut third = store.pool().begin().await.unwrap();
    let error = store
        .lock_in_transaction(&mut third, &name)
        .await
        .unwrap_err();
    assert_eq!(error.kind(), turnstile::ErrorKind::Held);
    third.rollback().await.unwrap();
    guard.release().await.unwrap();
}

/// Transaction-scoped holders and named-lock holders of one name, all at once: each
/// holder's fenced write must be accepted (tokens follow the order in which holders got
/// the lock), and no two holders are ever inside together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_holders_of_both_kinds_get_tokens_in_lock_order() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use turnstile::ErrorKind;

    let url = shared_mariadb().fresh_database("xorder");
    let store = MysqlLockStore::connect(&url).await.unwrap();
    // The application's own pool, as a service would have.
    let app = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(10)
        .connect(&url)
        .await
        .unwrap();
    let fence = store.fence();
    // Named locks are global on the server: a name no other test uses.
    let name = unique_name("batch");
    let inside = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for worker in 0..8 {
        let (store, app, fence, inside, name) = (
            store.clone(),
            app.clone(),
            fence.clone(),
            inside.clone(),
            name.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let locker = Locker::new(store.clone());
            let mut done = 0;
            while done < 6 {
                if worker % 4 == 3 {
                    // A named-lock holder.
                    let guard = locker.acquire(&name, &options()).await.unwrap();
                    assert_eq!(
                        inside.fetch_add(1, Ordering::SeqCst),
                        0,
                        "two holders inside"
                    );
                    let mut transaction = app.begin().await.unwrap();
                    let outcome = fence
                        .check_and_record(&mut transaction, &name, guard.fencing_token())
                        .await
                        .unwrap();
                    transaction.commit().await.unwrap();
                    inside.fetch_sub(1, Ordering::SeqCst);
                    assert!(
                        outcome.is_applied(),
                        "a named holder was fenced out: {outcome:?}"
                    );
                    guard.release().await.unwrap();
                    done += 1;
                    continue;
                }
                let mut transaction = app.begin().await.unwrap();
                match store.lock_in_transaction(&mut transaction, &name).await {
                    Ok(token) => {
                        assert_eq!(
                            inside.fetch_add(1, Ordering::SeqCst),
                            0,
                            "two holders inside"
                        );
                        let outcome = fence
                            .check_and_record(&mut transaction, &name, token)
                            .await
                            .unwrap();
                        assert!(
                            outcome.is_applied(),
                            "a transaction-scoped holder was fenced out: {outcome:?}"
                        );
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        inside.fetch_sub(1, Ordering::SeqCst);
                        transaction.commit().await.unwrap();
                        done += 1;
                    }
                    Err(error) if error.kind() == ErrorKind::Held => {
                        transaction.rollback().await.unwrap();
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    Err(error) => panic!("{error}"),
                }
            }
        }));
    }
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("holders made no progress")
            .unwrap();
    }
}

/// A named lock and a transaction-scoped lock asked for a brand-new name at nearly the
/// same instant, 300 times: at most one of them gets it. The named acquire runs on a
/// session the store has used before, so it is the one-statement acquire, which checks
/// for a transaction-scoped holder only on names marked as used that way: the mark and
/// the order of the two sides' steps are what keep them apart. The transaction-scoped
/// lock takes several round trips, so the named acquire starts 0 to 3 ms later, to land
/// at every step of it. When each sees the other's step, both stand back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_kinds_on_a_new_name_at_once_never_both_hold() {
    let url = shared_mariadb().fresh_database("kindrace");
    let store = MysqlLockStore::connect(&url).await.unwrap();
    let locker = Locker::new(store.clone());
    let app = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .unwrap();
    let options = LockOptions::new().ttl(Duration::from_secs(5));
    // Named locks are global on the server: names no other test uses.
    let prefix = unique_name("kr");
    let warm = locker
        .acquire(&format!("{prefix}-warm"), &options)
        .await
        .unwrap();
    warm.release().await.unwrap();
    let (mut both, mut named, mut scoped, mut neither) = (0, 0, 0, 0);
    for n in 0..300 {
        let name = format!("{prefix}-{n}");
        let mut transaction = app.begin().await.unwrap();
        let delay = Duration::from_micros(100 * (n % 30));
        let named_acquire = async {
            // Yielding, not sleeping: tokio's timer counts whole milliseconds.
            let start = tokio::time::Instant::now();
            while start.elapsed() < delay {
                tokio::task::yield_now().await;
            }
            locker.try_acquire(&name, &options).await
        };
        let (guard, token) = tokio::join!(
            named_acquire,
            store.lock_in_transaction(&mut transaction, &name)
        );
        let guard = guard.unwrap();
        match (&guard, &token) {
            (Some(_), Ok(_)) => both += 1,
            (Some(_), Err(error)) => {
                assert_eq!(error.kind(), turnstile::ErrorKind::Held, "{error}");
                named += 1;
            }
            (None, Ok(_)) => scoped += 1,
            // Each saw the other's step and stood back: safe, and both may try again.
            (None, Err(error)) => {
                assert_eq!(error.kind(), turnstile::ErrorKind::Held, "{error}");
                neither += 1;
            }
        }
        transaction.rollback().await.unwrap();
        if let Some(guard) = guard {
            guard.release().await.unwrap();
        }
    }
    assert_eq!(both, 0, "both kinds held a new name {both} times of 300");
    assert!(
        named > 0 && scoped > 0,
        "one side always won ({named} named, {scoped} scoped, {neither} neither): no race was run"
    );
}

/// Tables made before names were marked as used with transaction-scoped locks get the
/// mark's column when the store connects, and every name with a transaction-scoped row
/// is marked, so that the one-statement acquire checks it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_from_before_the_mark_are_migrated_and_marked() {
    let url = shared_mariadb().fresh_database("oldmark");
    let admin = sqlx::MySqlPool::connect(&url).await.unwrap();
    let name = unique_name("oldx");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE turnstile_tokens (name VARBINARY(512) PRIMARY KEY,
             token BIGINT UNSIGNED NOT NULL, holder_token BIGINT UNSIGNED, owner CHAR(32),
             connection_id BIGINT UNSIGNED) ENGINE = MEMORY;
         CREATE TABLE turnstile_xact_locks (name VARBINARY(512) PRIMARY KEY) ENGINE = InnoDB;
         INSERT INTO turnstile_xact_locks VALUES ('{name}');
         INSERT INTO turnstile_tokens (name, token) VALUES ('plain', 5);"
    )))
    .execute(&admin)
    .await
    .unwrap();
    let store = MysqlLockStore::connect(&url).await.unwrap();
    let marked: Vec<(Vec<u8>, bool)> =
        sqlx::query_as("SELECT name, xact_used FROM turnstile_tokens ORDER BY name")
            .fetch_all(&admin)
            .await
            .unwrap();
    let mut expected = vec![
        (name.clone().into_bytes(), true),
        (b"plain".to_vec(), false),
    ];
    expected.sort();
    assert_eq!(marked, expected);
    // A transaction holding the marked name's row keeps a named acquirer out, also on
    // a session the store has used before (the one-statement acquire).
    let locker = Locker::new(store.clone());
    let options = LockOptions::new().ttl(Duration::from_secs(5));
    let warm = locker
        .acquire(&format!("{name}-warm"), &options)
        .await
        .unwrap();
    warm.release().await.unwrap();
    let mut transaction = admin.begin().await.unwrap();
    let token = store
        .lock_in_transaction(&mut transaction, &name)
        .await
        .unwrap();
    assert!(locker.try_acquire(&name, &options).await.unwrap().is_none());
    transaction.rollback().await.unwrap();
    let guard = locker
        .try_acquire(&name, &options)
        .await
        .unwrap()
        .expect("free again");
    assert!(guard.fencing_token() > token);
    guard.release().await.unwrap();
}

/// A holder whose session was killed learns of the loss at its next renewal even when
/// the store cannot answer who holds the lock now (its shared pool is exhausted): the
/// session is known dead, so the loss is certain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_session_is_lost_at_once_even_when_the_lookup_cannot_run() {
    let server = shared_mariadb();
    let url = server.fresh_database("deadlookup");
    let store = MysqlLockStore::connect(&url).await.unwrap();
    let locker = Locker::new(store.clone());
    let ttl = Duration::from_secs(6);
    let name = unique_name("exhausted");
    let guard = locker
        .acquire(&name, &LockOptions::new().ttl(ttl))
        .await
        .unwrap();
    let acquired = tokio::time::Instant::now();
    // Take every connection of the store's shared pool (8), so the holder lookup waits
    // for the pool's 3 s timeout.
    let mut hostages = Vec::new();
    for _ in 0..8 {
        hostages.push(store.pool().acquire().await.unwrap());
    }
    kill_holder(server, &name);
    let reason = tokio::time::timeout(Duration::from_secs(10), guard.lost())
        .await
        .expect("no signal");
    let after = acquired.elapsed();
    // The first renewal runs at TTL/3 = 2 s and finds the session dead; the loss must be
    // reported then (plus the bounded lookup), long before the local deadline (~6 s).
    assert_eq!(reason, LossReason::Expired);
    assert!(
        after < ttl / 3 + Duration::from_millis(1_500),
        "the loss was reported {after:?} after acquiring"
    );
    drop(hostages);
}

/// An unknown database or a wrong user is a configuration error, not a retryable one.
#[tokio::test]
async fn refusals_are_configuration_errors() {
    let port = shared_mariadb().port();
    for url in [
        format!("mysql://turnstile@127.0.0.1:{port}/nosuchdb"),
        format!("mysql://nosuchuser:pw@127.0.0.1:{port}/test"),
    ] {
        let error = MysqlLockStore::connect(&url).await.unwrap_err();
        assert_eq!(
            error.kind(),
            turnstile::ErrorKind::Configuration,
            "{url}: {error}"
        );
        assert!(!error.is_retryable());
    }
}

/// With synchronous tokens (an InnoDB tokens table), token durability with the clock
/// floor out of the way: the stored token is far ahead of the clock, so only the
/// committed counter keeps the next token larger across a crash of the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_sync_commit_a_token_ahead_of_the_clock_survives_a_crash() {
    // Durable settings, as the claim is made for them.
    let server = MariaDbServer::spawn_durable();
    let flush: String = {
        let pool = sqlx::MySqlPool::connect(&server.url()).await.unwrap();
        sqlx::query_scalar("SELECT CAST(@@innodb_flush_log_at_trx_commit AS CHAR)")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    assert_eq!(flush, "1");
    let url = format!("{}?turnstile_sync_commit=on", server.url());
    let store = MysqlLockStore::connect(&url).await.unwrap();
    let name = turnstile_test_support::unique_name("ahead");
    let locker = Locker::new(store.clone());
    locker
        .acquire(&name, &options())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let ahead: u64 = 1 << 60;
    sqlx::query("UPDATE turnstile_tokens SET token = ? WHERE name = ?")
        .bind(ahead)
        .bind(name.as_bytes())
        .execute(store.pool())
        .await
        .unwrap();
    let first = locker.acquire(&name, &options()).await.unwrap();
    assert_eq!(first.fencing_token(), FencingToken::new(ahead + 1));
    drop(first);
    drop(locker);
    server.kill();
    server.restart();
    let after = Locker::new(MysqlLockStore::connect(&url).await.unwrap());
    let second = after.acquire(&name, &options()).await.unwrap();
    assert_eq!(second.fencing_token(), FencingToken::new(ahead + 2));
    second.release().await.unwrap();
    server.kill();
}

/// The default tokens table is a MEMORY table (no log flush per acquisition); a crash
/// empties it, and the clock floor keeps every token after the restart above every
/// token before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_sync_commit_tokens_still_grow_across_a_crash() {
    let server = MariaDbServer::spawn();
    let url = server.url();
    let store = MysqlLockStore::connect(&url).await.unwrap();
    let engine: String = sqlx::query_scalar(
        "SELECT ENGINE FROM information_schema.TABLES
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'turnstile_tokens'",
    )
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(engine, "MEMORY");
    let locker = Locker::new(store.clone());
    let mut before = Vec::new();
    for _ in 0..200 {
        let guard = locker.acquire("crash", &options()).await.unwrap();
        before.push(guard.fencing_token());
        guard.release().await.unwrap();
    }
    let held = locker.acquire("crash", &options()).await.unwrap();
    before.push(held.fencing_token());
    std::mem::forget(held);
    drop(locker);
    drop(store);
    server.kill();
    server.restart();
    let store = MysqlLockStore::connect(&url).await.unwrap();
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM turnstile_tokens")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(rows, 0, "the crash emptied the MEMORY table");
    let after = Locker::new(store);
    let guard = after.acquire("crash", &options()).await.unwrap();
    conformance::assert_above_every_earlier_token(guard.fencing_token(), &before);
    guard.release().await.unwrap();
    server.kill();
}

/// The holder's session ended (`KILL CONNECTION`) while contenders wait: the server
/// frees the lock at once, so the next holder may start before the old one can know;
/// the old one learns at its next renewal, within TTL/3, and its late writes are
/// fenced out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_session_is_fenced_and_noticed_within_a_third_of_the_ttl() {
    let server = shared_mariadb();
    let url = server.fresh_database("sessionkill");
    let resource = unique_name("resource");
    let mut contenders = Vec::new();
    for _ in 0..3 {
        let store = MysqlLockStore::connect(&url).await.unwrap();
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
        contenders.push(faults::Contender {
            locker: Locker::new(store),
            write,
        });
    }
    let name = unique_name("sessionkill");
    let ttl = Duration::from_millis(1_500);
    let lease = LockOptions::new().ttl(ttl).wait(Duration::from_secs(3));
    // Sections longer than the renewal interval: the holder is still at work when its
    // next renewal finds its session gone.
    let work = faults::Work {
        writes: 8,
        pause: Duration::from_millis(120),
    };
    let exercise = faults::Exercise::start(&name, &lease, work, contenders);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut kills = Vec::new();
    for _ in 0..2 {
        exercise.new_holder().await;
        kill_holder(server, &name);
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

/// A named acquire that took `GET_LOCK` and then found a transaction-scoped holder
/// (its `NOWAIT` check failed) must not return its session to the pool still holding
/// the named lock: the next user of that session would "acquire" re-entrantly, and the
/// lock would stay held for everyone else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_failed_after_get_lock_is_never_pooled() {
    let url = shared_mariadb().fresh_database("failpool");
    let name = turnstile_test_support::unique_name("xleak");
    let store = MysqlLockStore::connect(&url).await.unwrap();
    let locker = Locker::new(store.clone());
    // A transaction-scoped holder.
    let mut transaction = store.pool().begin().await.unwrap();
    store
        .lock_in_transaction(&mut transaction, name.as_str())
        .await
        .unwrap();
    // The named acquire gets GET_LOCK, then finds the transaction's row lock: held.
    assert!(
        locker
            .try_acquire(&name, &options())
            .await
            .unwrap()
            .is_none(),
        "a named lock was granted while a transaction held the name"
    );
    transaction.commit().await.unwrap();
    // Another client must find the lock free now.
    let other = Locker::new(MysqlLockStore::connect(&url).await.unwrap());
    let guard = other
        .try_acquire(&name, &options())
        .await
        .unwrap()
        .expect("the named lock leaked into the first client's pool");
    guard.release().await.unwrap();
}

/// How long the server may take, past `wait_timeout`, to end an idle session and free
/// its lock, plus a loaded two-core machine's scheduling and the 10 ms polling.
const SERVER_EXPIRY_SLACK: Duration = Duration::from_millis(500);

/// Polls `try_acquire` on `name` every 10 ms until it gets the lock (panics after
/// `give_up`); returns the guard, when it was taken, and when the last refused poll was
/// sent (the lock was still held then).
async fn poll_until_taken(
    locker: &Locker,
    name: &str,
    give_up: Duration,
) -> (LockGuard, Instant, Instant) {
    let started = Instant::now();
    let mut last_refused = None;
    loop {
        let asked = Instant::now();
        if let Some(taken) = locker.try_acquire(name, &options()).await.unwrap() {
            let last_refused = last_refused.expect("the lock was free at the first poll");
            return (taken, Instant::now(), last_refused);
        }
        last_refused = Some(asked);
        assert!(
            started.elapsed() < give_up,
            "the lock did not come free within {give_up:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The lease of a holder that stops talking to the server is the session's
/// `wait_timeout`, the TTL rounded **up** to whole seconds: with a 1.2 s TTL and no
/// renewals (watchdog off) the lock stays held for another client for 2 s from the
/// acquire (not 1.2 s, nor the 1 s that rounding to the nearest second would give), and
/// is free within `SERVER_EXPIRY_SLACK` after that; the next token is larger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_stops_renewing_keeps_the_lock_for_its_ttl_rounded_up_to_whole_seconds() {
    let url = shared_mariadb().fresh_database("waittimeout");
    let holder = Locker::new(MysqlLockStore::connect(&url).await.unwrap());
    let other = Locker::new(MysqlLockStore::connect(&url).await.unwrap());
    let name = unique_name("idle-holder");
    let ttl = Duration::from_millis(1_200);
    let wait_timeout = Duration::from_secs(2);
    // The server counts `wait_timeout` from the end of the acquire's statements, which
    // were sent after this instant and answered before the acquire returned.
    let asked = Instant::now();
    let guard = holder
        .acquire(&name, &LockOptions::new().ttl(ttl).watchdog(false))
        .await
        .unwrap();
    let acquired = Instant::now();
    let (taken, taken_at, last_refused) =
        poll_until_taken(&other, &name, wait_timeout + Duration::from_secs(5)).await;
    assert!(
        last_refused >= asked + wait_timeout - Duration::from_millis(100),
        "the lock came free {:?} after the acquire was sent: before the TTL rounded up \
         ({wait_timeout:?})",
        taken_at - asked
    );
    assert!(
        taken_at >= asked + wait_timeout,
        "the lock was taken {:?} after the acquire was sent, before the TTL rounded up \
         ({wait_timeout:?})",
        taken_at - asked
    );
    assert!(
        taken_at <= acquired + wait_timeout + SERVER_EXPIRY_SLACK,
        "the lock came free only {:?} after the acquire",
        taken_at - acquired
    );
    assert!(taken.fencing_token() > guard.fencing_token());
    assert!(
        guard.is_lost(),
        "the holder's lost signal did not fire by its deadline"
    );
    taken.release().await.unwrap();
}

/// A holder cut off by a partition (a proxy that stops passing bytes) stops at its
/// local deadline: its lost signal fires there with `RenewalFailed`. The server frees
/// the lock only when `wait_timeout` (the TTL rounded up: 2 s for 1.2 s) has passed
/// since the holder's last renewal, so a client talking to the server directly gets
/// the lock after the holder's signal, with a larger token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_holder_stops_at_its_deadline_and_the_server_frees_the_lock_at_wait_timeout()
{
    let server = shared_mariadb();
    let url = server.fresh_database("partition");
    let proxy = TcpProxy::start(server.port());
    let holder = Locker::new(MysqlLockStore::connect(&proxy.url_for(&url)).await.unwrap());
    let direct = Locker::new(MysqlLockStore::connect(&url).await.unwrap());
    let name = unique_name("partition");
    let ttl = Duration::from_millis(1_200);
    let wait_timeout = Duration::from_secs(2);
    let guard = holder
        .acquire(&name, &LockOptions::new().ttl(ttl))
        .await
        .unwrap();
    assert!(
        proxy.accepted() > 0,
        "the holder does not go through the proxy"
    );
    // The last renewal was sent before it was seen here, and the server's idle time
    // counts from its answer, so the server frees the lock no later than this plus
    // `wait_timeout`; and no earlier than the renewal was sent, which is the deadline
    // less the TTL (the drift allowance makes it a little later still).
    faults::right_after_a_renewal(&guard, ttl).await;
    let renewal_seen = Instant::now();
    let deadline = guard.valid_until();
    proxy.cut();
    let direct_client = tokio::spawn({
        let name = name.clone();
        async move { poll_until_taken(&direct, &name, wait_timeout + Duration::from_secs(5)).await }
    });
    let (reason, seen) = faults::first_seen_lost(&guard, ttl).await;
    assert_eq!(reason, LossReason::RenewalFailed);
    faults::assert_at_deadline(seen, deadline);
    let (taken, taken_at, last_refused) = direct_client.await.unwrap();
    assert!(
        taken_at > seen,
        "the direct client got the lock before the holder's lost signal fired"
    );
    let renewal_sent = deadline - ttl;
    assert!(
        last_refused >= renewal_sent + wait_timeout - Duration::from_millis(100),
        "the server freed the lock {:?} after the last renewal was sent, before \
         wait_timeout ({wait_timeout:?})",
        taken_at - renewal_sent
    );
    assert!(
        taken_at <= renewal_seen + wait_timeout + SERVER_EXPIRY_SLACK,
        "the server freed the lock only {:?} after the last renewal",
        taken_at - renewal_seen
    );
    assert!(taken.fencing_token() > guard.fencing_token());
    proxy.heal();
    taken.release().await.unwrap();
    let _ = tokio::time::timeout(Duration::from_secs(5), guard.release()).await;
}

/// The sessions' connect timeout, `MysqlLockConfig`'s default.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// How late past a timer a test may see it fire: the scheduling of a loaded two-core
/// machine.
const SCHEDULING_SLACK: Duration = Duration::from_millis(300);

/// Each held lock keeps a session of its own, at most 64 per store by default. With 64
/// held, a 65th acquire through the same store waits for a session: it gets one (and
/// the lock) as soon as one of the 64 is released. With none released it fails as
/// `StoreUnavailable` when the first of two bounds passes: the store's connect timeout
/// (3 s), or the call's wait bound (at least a second). Neither message names the
/// limit. Another store on the same database is not affected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_holds_64_locks_at_once_and_a_65th_waits_for_one_of_their_sessions() {
    const MAX_HELD: usize = 64;
    let url = shared_mariadb().fresh_database("maxheld");
    let locker = Locker::new(MysqlLockStore::connect(&url).await.unwrap());
    let prefix = unique_name("held");
    let mut guards = Vec::new();
    for i in 0..MAX_HELD {
        let name = format!("{prefix}-{i}");
        let guard = locker.try_acquire(&name, &options()).await.unwrap();
        guards.push(guard.unwrap_or_else(|| panic!("lock {i} of {MAX_HELD} was refused")));
    }
    let extra = format!("{prefix}-extra");
    let refused_after = async |wait: Duration| {
        let started = Instant::now();
        let error = locker
            .acquire(&extra, &options().wait(wait))
            .await
            .unwrap_err();
        (started.elapsed(), error)
    };
    // A timer that a loaded machine may overrun a little, never undercut.
    let about = |took: Duration, bound: Duration| took >= bound && took < bound + SCHEDULING_SLACK;
    // No session comes free: the store's own bound, its connect timeout, ends the wait.
    let (took, error) = refused_after(Duration::from_secs(10)).await;
    assert_eq!(
        error.kind(),
        turnstile::ErrorKind::StoreUnavailable,
        "{error}"
    );
    // It says why: the store's sessions all hold locks, not a server that is down.
    assert!(
        error.to_string().contains(
            "cannot open a MySQL session for the lock: all 64 sessions of this store hold locks"
        ),
        "{error}"
    );
    assert!(about(took, CONNECT_TIMEOUT), "refused after {took:?}");
    // A shorter wait bound ends it first (a call that may not wait gives its one
    // attempt a second), with the lock core's "did not answer within the wait bound".
    for (wait, bound) in [
        (Duration::ZERO, Duration::from_secs(1)),
        (Duration::from_millis(1_500), Duration::from_millis(1_500)),
    ] {
        let (took, error) = refused_after(wait).await;
        assert_eq!(
            error.kind(),
            turnstile::ErrorKind::StoreUnavailable,
            "{error}"
        );
        assert!(error.to_string().contains("did not answer"), "{error}");
        assert!(about(took, bound), "wait {wait:?}: refused after {took:?}");
    }
    // A session comes free while the 65th waits: it gets the lock at once.
    let waiter = tokio::spawn({
        let (locker, extra) = (locker.clone(), extra.clone());
        async move {
            let guard = locker
                .acquire(&extra, &options().wait(Duration::from_secs(10)))
                .await;
            (Instant::now(), guard)
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let released_at = Instant::now();
    guards.pop().unwrap().release().await.unwrap();
    let (got_at, guard) = waiter.await.unwrap();
    let guard = guard.unwrap();
    assert!(
        got_at - released_at < SCHEDULING_SLACK,
        "the 65th got the lock {:?} after a release",
        got_at - released_at
    );
    let other = Locker::new(MysqlLockStore::connect(&url).await.unwrap());
    let elsewhere = other
        .try_acquire(&format!("{prefix}-elsewhere"), &options())
        .await
        .unwrap()
        .expect("another store's lock");
    elsewhere.release().await.unwrap();
    guard.release().await.unwrap();
    for guard in guards {
        guard.release().await.unwrap();
    }
}

/// `GET_LOCK` names are server-wide: two applications in different databases, with
/// different table prefixes, that use the same lock name share one lock (the README
/// tells them to give their names distinct beginnings).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_name_in_two_databases_is_one_lock() {
    let one = shared_mariadb().fresh_database("serverwide");
    let other = format!(
        "{}?turnstile_prefix=other",
        shared_mariadb().fresh_database("serverwide")
    );
    let first = Locker::new(MysqlLockStore::connect(&one).await.unwrap());
    let second = Locker::new(MysqlLockStore::connect(&other).await.unwrap());
    let name = unique_name("server-wide");
    let held = first
        .try_acquire(&name, &options())
        .await
        .unwrap()
        .expect("free at first");
    assert!(
        second
            .try_acquire(&name, &options())
            .await
            .unwrap()
            .is_none(),
        "another database's application got a lock that is held"
    );
    held.release().await.unwrap();
    let taken = second
        .try_acquire(&name, &options())
        .await
        .unwrap()
        .expect("free after the release");
    taken.release().await.unwrap();
}
