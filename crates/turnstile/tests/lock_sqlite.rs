//! The SQLite engine: the conformance suite, plus what only SQLite does.

mod conformance;

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::time::Duration;

use conformance::TestStore;
use turnstile::fence::{FenceOutcome, FencingToken, sqlite as fence};
use turnstile::lock::sqlite::SqliteLockStore;
use turnstile::lock::{LockOptions, Locker, ReleaseOutcome};

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

/// The notes' paused-holder scenario, stopped by the protected store: A holds token N
/// and pauses past its TTL, B acquires N+1 and writes, A's late write is rejected.
#[tokio::test]
async fn a_paused_holders_late_write_is_rejected() {
    let file = sqlite_file().await;
    let store = SqliteLockStore::open(file.path()).await.unwrap();
    let pool = store.pool().clone();
    sqlx::query("CREATE TABLE invoices (id TEXT PRIMARY KEY, total INTEGER, written_by INTEGER)")
        .execute(&pool)
        .await
        .unwrap();
    let locker = Locker::new(store);
    let short = LockOptions::new()
        .ttl(Duration::from_millis(200))
        .watchdog(false);

    let a = locker.acquire("invoice:1", &short).await.unwrap();
    let token_a = a.fencing_token();
    // A pauses (GC, swap): its lease runs out while it is frozen.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let b = locker.acquire("invoice:1", &short).await.unwrap();
    let token_b = b.fencing_token();
    assert!(token_b > token_a);
    assert_eq!(
        write_invoice(&pool, token_b, 200).await,
        FenceOutcome::Applied
    );

    // A wakes up and writes, believing it still holds the lock.
    assert_eq!(
        write_invoice(&pool, token_a, 100).await,
        FenceOutcome::Rejected {
            highest_seen: token_b
        }
    );
    let (total, written_by): (i64, i64) =
        sqlx::query_as("SELECT total, written_by FROM invoices WHERE id = 'invoice:1'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (total, written_by),
        (200, i64::try_from(token_b.get()).unwrap())
    );
    // The same holder may write again with its own token.
    assert_eq!(
        write_invoice(&pool, token_b, 250).await,
        FenceOutcome::Applied
    );
    assert_eq!(a.release().await.unwrap(), ReleaseOutcome::HeldByOther);
    b.release().await.unwrap();
}

async fn write_invoice(pool: &sqlx::SqlitePool, token: FencingToken, total: i64) -> FenceOutcome {
    let mut transaction = pool.begin().await.unwrap();
    let outcome = fence::check_and_record(&mut transaction, "invoice:1", token)
        .await
        .unwrap();
    if outcome.is_applied() {
        sqlx::query("INSERT INTO invoices (id, total, written_by) VALUES ('invoice:1', ?1, ?2)
                     ON CONFLICT (id) DO UPDATE SET total = excluded.total, written_by = excluded.written_by")
            .bind(total)
            .bind(token.to_i64().unwrap())
            .execute(&mut *transaction)
            .await
            .unwrap();
        transaction.commit().await.unwrap();
    }
    outcome
}
