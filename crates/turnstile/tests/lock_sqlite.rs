//! The SQLite engine: the conformance suite, plus what only SQLite does.

mod conformance;

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;

use conformance::TestStore;
use turnstile::fence::FencingToken;
use turnstile::lock::sqlite::SqliteLockStore;
use turnstile::lock::{LockOptions, Locker};

struct SqliteFile {
    dir: tempfile::TempDir,
}

impl SqliteFile {
    fn path(&self) -> PathBuf {
        self.dir.path().join("locks.sqlite3")
    }
}

impl TestStore for SqliteFile {
    fn locker(&self) -> Pin<Box<dyn Future<Output = Locker> + Send + '_>> {
        Box::pin(async move { Locker::new(SqliteLockStore::open(self.path()).await.unwrap()) })
    }

    fn notifies_other_processes(&self) -> bool {
        false
    }
}

async fn sqlite_file() -> SqliteFile {
    SqliteFile {
        dir: tempfile::tempdir().unwrap(),
    }
}

conformance_tests!(super::sqlite_file);

#[tokio::test]
async fn tokens_survive_reopening_the_file() {
    let file = sqlite_file().await;
    let first = file.locker().await;
    let guard = first.acquire("report", &LockOptions::new()).await.unwrap();
    let token = guard.fencing_token();
    guard.release().await.unwrap();
    drop(first);
    let reopened = file.locker().await;
    let guard = reopened
        .acquire("report", &LockOptions::new())
        .await
        .unwrap();
    assert!(guard.fencing_token() > token);
    guard.release().await.unwrap();
}

/// A store that has been answering "held" and turns slow (another process holds the
/// database's write lock) when the wait runs out: the lock was still held, so the
/// caller learns that it timed out, not that the store is gone.
#[tokio::test]
async fn a_store_that_is_slow_when_the_wait_ends_is_a_timeout_not_an_outage() {
    let file = sqlite_file().await;
    let holder = file.locker().await;
    let guard = holder
        .acquire(
            "busy",
            &LockOptions::new().ttl(std::time::Duration::from_secs(60)),
        )
        .await
        .unwrap();
    let waiter = file.locker().await;
    let blocker = async {
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        let mut connection = <sqlx::SqliteConnection as sqlx::Connection>::connect(&format!(
            "sqlite://{}",
            file.path().display()
        ))
        .await
        .unwrap();
        sqlx::query("BEGIN EXCLUSIVE")
            .execute(&mut connection)
            .await
            .unwrap();
        tokio::time::sleep(std::time::Duration::from_secs(3)).await;
        sqlx::query("ROLLBACK")
            .execute(&mut connection)
            .await
            .unwrap();
    };
    let options = LockOptions::new().wait(std::time::Duration::from_millis(1500));
    let waiting = waiter.acquire("busy", &options);
    let (waited, ()) = tokio::join!(waiting, blocker);
    let error = waited.unwrap_err();
    assert_eq!(
        error.kind(),
        turnstile::ErrorKind::AcquireTimeout,
        "{error}"
    );
    guard.release().await.unwrap();
}

#[tokio::test]
async fn urls_open_the_store_and_bad_ones_say_why() {
    let file = sqlite_file().await;
    let url = format!("sqlite://{}", file.path().display());
    let locker = Locker::connect(&url).await.unwrap();
    assert_eq!(locker.backend().describe(), url);
    let missing_dir = format!("sqlite://{}/no/such/dir/x.db", file.dir.path().display());
    let error = Locker::connect(&missing_dir).await.unwrap_err();
    assert_eq!(error.kind(), turnstile::ErrorKind::InvalidUrl);
    assert!(error.to_string().contains("does not exist"), "{error}");
}

/// The notes' paused-holder scenario, stopped by a fenced write in the application's
/// own transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_holders_late_write_is_rejected() {
    let file = sqlite_file().await;
    let store = SqliteLockStore::open(file.path()).await.unwrap();
    let pool = store.pool().clone();
    conformance::a_paused_holders_late_write_is_rejected_by_an_sqlite_fence(
        &Locker::new(store),
        &pool,
    )
    .await;
}

/// Tokens count up from the stored one when it is ahead of the clock (the `last + 1`
/// side of `max(last + 1, clock)`), across a reopening of the file: the stored token,
/// not the clock, is what keeps them increasing here.
#[tokio::test]
async fn tokens_count_up_from_a_stored_token_ahead_of_the_clock() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locks.sqlite3");
    let store = SqliteLockStore::open(&path).await.unwrap();
    let locker = Locker::new(store.clone());
    locker
        .acquire("ahead", &LockOptions::new())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    // A token a year ahead of the clock.
    let ahead: i64 = 1 << 60;
    sqlx::query("UPDATE turnstile_locks SET token = ?1 WHERE name = 'ahead'")
        .bind(ahead)
        .execute(store.pool())
        .await
        .unwrap();
    let first = locker.acquire("ahead", &LockOptions::new()).await.unwrap();
    assert_eq!(first.fencing_token(), FencingToken::new(ahead as u64 + 1));
    first.release().await.unwrap();
    drop(locker);
    store.pool().close().await;
    let reopened = Locker::new(SqliteLockStore::open(&path).await.unwrap());
    let second = reopened
        .acquire("ahead", &LockOptions::new())
        .await
        .unwrap();
    assert_eq!(second.fencing_token(), FencingToken::new(ahead as u64 + 2));
    second.release().await.unwrap();
}
