//! The embedded SQLite engine: no server, works across processes on one host.
//!
//! Locks live in one table of a SQLite database file opened in WAL mode with a busy
//! timeout, so any number of processes on the host (and tasks in each) can share it.
//!
//! # Guarantees
//! - **Atomicity**: acquire is one `INSERT … ON CONFLICT DO UPDATE … WHERE expired`
//!   statement; SQLite serialises writers, so exactly one contender wins.
//! - **Expiry** is decided by the host's wall clock (`SystemTime`), which every process
//!   on the host shares. A wall-clock step forward can end leases early; a step back
//!   lengthens them. Holders measure their own validity on the monotonic clock.
//! - **Fencing tokens** are `max(last + 1, now in µs since the Unix epoch)`, kept in the
//!   lock's row, which is never deleted. They survive process crashes and restarts;
//!   because they are floored by the clock they stay increasing even if the last
//!   commits were lost to a power cut (`synchronous = NORMAL`), provided the wall clock
//!   did not step back across the crash.
//! - **Waiting**: waiters in the same process are woken directly by a release; waiters
//!   in other processes re-check with a backoff from 2 ms doubling to 50 ms (SQLite
//!   has no cross-process notification), capped by the holder's remaining lease.
//! - **Partition / failover**: not applicable — the store is a local file. A holder is
//!   only cut off if the file becomes unwritable; its renewals then fail and the lost
//!   signal fires at the validity deadline.
//! - The file must be on a local filesystem: WAL needs shared memory and network
//!   filesystems break SQLite's locking.

use std::path::{Path, PathBuf};
use std::time::Duration;

use sqlx::Row;
use sqlx::sqlite::SqlitePool;

use super::{
    BoxFuture, ExtendOutcome, HolderAndValue, LockBackend, LockInfo, LockName, LossReason, OwnerId,
    ReleaseOutcome, ReleaseSignals, ReleaseWatch, TryAcquire,
};
use crate::clock::wall_clock;
use crate::engine::sqlite::millis_i64;
use crate::error::Result;
use crate::fence::FencingToken;
pub(crate) use crate::sql::map_error;

const CREATE_LOCKS: &str = "CREATE TABLE IF NOT EXISTS turnstile_locks (
    name TEXT PRIMARY KEY NOT NULL,
    owner TEXT,
    token INTEGER NOT NULL,
    expires_at_ms INTEGER NOT NULL
) WITHOUT ROWID";

const ACQUIRE: &str = "INSERT INTO turnstile_locks (name, owner, token, expires_at_ms)
VALUES (?1, ?2, ?3, ?4)
ON CONFLICT (name) DO UPDATE SET
    owner = excluded.owner,
    token = CASE WHEN turnstile_locks.owner IS excluded.owner THEN turnstile_locks.token
                 ELSE max(turnstile_locks.token + 1, excluded.token) END,
    expires_at_ms = excluded.expires_at_ms
WHERE turnstile_locks.owner IS NULL OR turnstile_locks.expires_at_ms <= ?5
   OR turnstile_locks.owner = excluded.owner
RETURNING token";

/// What each holder advertises (an election's leader value), one row per name, keyed
/// by the acquisition that wrote it: a row whose owner no longer holds the lock is
/// never read, so a new holder starts with no value without anyone deleting the row.
const CREATE_HOLDER_VALUES: &str = "CREATE TABLE IF NOT EXISTS turnstile_holder_values (
    name TEXT PRIMARY KEY NOT NULL,
    owner TEXT NOT NULL,
    value TEXT NOT NULL
) WITHOUT ROWID";

/// The number of permits of each semaphore, set by the first client to use it.
const CREATE_SEMAPHORES: &str = "CREATE TABLE IF NOT EXISTS turnstile_semaphores (
    name TEXT PRIMARY KEY NOT NULL,
    permits INTEGER NOT NULL
) WITHOUT ROWID";

/// Stores ?2 as semaphore ?1's permits unless a number is there, and returns the number
/// stored.
const DECLARE_PERMITS: &str = "INSERT INTO turnstile_semaphores (name, permits) VALUES (?1, ?2)
ON CONFLICT (name) DO UPDATE SET permits = turnstile_semaphores.permits
RETURNING permits";

/// Writes ?3 as the value of ?2's lock ?1, only while ?2 holds it (at ?4).
const PROCLAIM: &str = "INSERT INTO turnstile_holder_values (name, owner, value)
SELECT name, owner, ?3 FROM turnstile_locks WHERE name = ?1 AND owner = ?2 AND expires_at_ms > ?4
ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, value = excluded.value";

/// Passes a live lock from its holder (?2) straight to the next owner (?3) with a new
/// token: the lock is never free in between.
const HAND_OVER: &str = "UPDATE turnstile_locks
SET owner = ?3, token = max(token + 1, ?4), expires_at_ms = ?5
WHERE name = ?1 AND owner = ?2 AND expires_at_ms > ?6
RETURNING token";

/// The first and the longest interval between re-checks by a waiter that no
/// notification can reach (one in another process).
const POLL_MIN: Duration = Duration::from_millis(2);
const POLL_MAX: Duration = Duration::from_millis(50);

/// Locks in a SQLite database file.
#[derive(Debug, Clone)]
pub struct SqliteLockStore {
    pool: SqlitePool,
    path: PathBuf,
    signals: ReleaseSignals,
}

impl SqliteLockStore {
    /// Opens (creating if needed) the database at `path` and its tables.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self> {
        SqliteLockStore::open_with(path.as_ref().to_path_buf(), true, None).await
    }

    /// Opens the database at `path`; with `create` off, neither the file nor its tables
    /// are created (a read-only look, such as `turnstile lock status`, changes nothing),
    /// and a missing file is an error.
    async fn open_with(
        path: PathBuf,
        create: bool,
        synchronous: Option<sqlx::sqlite::SqliteSynchronous>,
    ) -> Result<Self> {
        let synchronous = synchronous.unwrap_or(sqlx::sqlite::SqliteSynchronous::Normal);
        let pool =
            crate::engine::sqlite::open_pool(&path, create, "lock store", synchronous).await?;
        let store = SqliteLockStore {
            pool,
            path,
            signals: ReleaseSignals::new(),
        };
        if create {
            store.migrate().await?;
        }
        Ok(store)
    }

    /// Opens the store named by `sqlite://PATH` (relative) or `sqlite:///absolute/path`.
    ///
    /// `?turnstile_migrate=off` opens an existing store without creating anything.
    pub async fn open_url(url: &str) -> Result<Self> {
        let url = crate::engine::sqlite::parse_url(url)?;
        SqliteLockStore::open_with(url.path, url.create, url.synchronous).await
    }

    /// Creates the tables if they are missing. Harmless to run again or concurrently.
    pub async fn migrate(&self) -> Result<()> {
        sqlx::query(CREATE_LOCKS)
            .execute(&self.pool)
            .await
            .map_err(|error| map_error(error, "cannot create the lock table"))?;
        sqlx::query(CREATE_HOLDER_VALUES)
            .execute(&self.pool)
            .await
            .map_err(|error| map_error(error, "cannot create the holder value table"))?;
        sqlx::query(CREATE_SEMAPHORES)
            .execute(&self.pool)
            .await
            .map_err(|error| map_error(error, "cannot create the semaphore table"))?;
        crate::fence::sqlite::create_table(&self.pool).await
    }

    /// The connection pool, to share with the application (for fenced writes in the
    /// same database, say).
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    async fn holder(&self, name: &LockName, now_ms: i64) -> Result<Option<LockInfo>> {
        let row = sqlx::query(
            "SELECT owner, token, expires_at_ms FROM turnstile_locks
             WHERE name = ?1 AND owner IS NOT NULL AND expires_at_ms > ?2",
        )
        .bind(name.as_str())
        .bind(now_ms)
        .fetch_optional(&self.pool)
        .await;
        let row = match row {
            Err(error) if crate::sql::is_missing_table(&error) => return Ok(None),
            other => other.map_err(|error| map_error(error, "cannot read the lock"))?,
        };
        row.map(|row| lock_info(&row, now_ms)).transpose()
    }

    async fn holder_with_value(
        &self,
        name: &LockName,
        now_ms: i64,
    ) -> Result<Option<HolderAndValue>> {
        let row = sqlx::query(
            "SELECT l.owner, l.token, l.expires_at_ms, v.value FROM turnstile_locks l
             LEFT JOIN turnstile_holder_values v ON v.name = l.name AND v.owner = l.owner
             WHERE l.name = ?1 AND l.owner IS NOT NULL AND l.expires_at_ms > ?2",
        )
        .bind(name.as_str())
        .bind(now_ms)
        .fetch_optional(&self.pool)
        .await;
        let row = match row {
            // A store made before values existed, opened without migrating: the
            // holder, with no value.
            Err(error) if crate::sql::is_missing_table(&error) => {
                return Ok(self.holder(name, now_ms).await?.map(|info| (info, None)));
            }
            other => other.map_err(|error| map_error(error, "cannot read the lock"))?,
        };
        row.map(|row| {
            let value: Option<String> = row
                .try_get("value")
                .map_err(|e| map_error(e, "bad holder value row"))?;
            Ok((lock_info(&row, now_ms)?, value))
        })
        .transpose()
    }
}

fn lock_info(row: &sqlx::sqlite::SqliteRow, now_ms: i64) -> Result<LockInfo> {
    let owner: Option<String> = row
        .try_get("owner")
        .map_err(|e| map_error(e, "bad lock row"))?;
    let token: i64 = row
        .try_get("token")
        .map_err(|e| map_error(e, "bad lock row"))?;
    let expires_at_ms: i64 = row
        .try_get("expires_at_ms")
        .map_err(|e| map_error(e, "bad lock row"))?;
    Ok(LockInfo {
        owner: owner.unwrap_or_default(),
        fencing_token: Some(FencingToken::new(u64::try_from(token).unwrap_or(0))),
        remaining_ttl: Some(Duration::from_millis(
            u64::try_from(expires_at_ms.saturating_sub(now_ms)).unwrap_or(0),
        )),
    })
}

/// The database file a `sqlite://PATH` (or `sqlite:PATH`) URL names.
///
/// ```
/// # #[cfg(feature = "sqlite")]
/// assert_eq!(
///     turnstile::lock::sqlite::url_path("sqlite:///var/lib/app/locks.db").unwrap(),
///     std::path::PathBuf::from("/var/lib/app/locks.db")
/// );
/// ```
pub fn url_path(url: &str) -> Result<PathBuf> {
    crate::engine::sqlite::parse_url(url).map(|url| url.path)
}

impl LockBackend for SqliteLockStore {
    fn try_acquire<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<TryAcquire>> {
        Box::pin(async move {
            let (now_ms, now_us) = wall_clock();
            let token: Option<i64> = sqlx::query_scalar(ACQUIRE)
                .bind(name.as_str())
                .bind(owner.as_str())
                .bind(now_us)
                .bind(now_ms.saturating_add(millis_i64(ttl)))
                .bind(now_ms)
                .fetch_optional(&self.pool)
                .await
                .map_err(|error| map_error(error, "cannot acquire the lock"))?;
            match token {
                Some(token) => Ok(TryAcquire::Acquired {
                    token: FencingToken::new(u64::try_from(token).unwrap_or(0)),
                }),
                None => {
                    let holder = self.holder(name, now_ms).await?;
                    Ok(TryAcquire::Held {
                        remaining_ttl: holder.and_then(|info| info.remaining_ttl),
                    })
                }
            }
        })
    }

    fn extend<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<ExtendOutcome>> {
        Box::pin(async move {
            let (now_ms, _) = wall_clock();
            let updated = sqlx::query(
                "UPDATE turnstile_locks SET expires_at_ms = ?3
                 WHERE name = ?1 AND owner = ?2 AND expires_at_ms > ?4",
            )
            .bind(name.as_str())
            .bind(owner.as_str())
            .bind(now_ms.saturating_add(millis_i64(ttl)))
            .bind(now_ms)
            .execute(&self.pool)
            .await
            .map_err(|error| map_error(error, "cannot extend the lock"))?
            .rows_affected();
            if updated == 1 {
                return Ok(ExtendOutcome::Extended);
            }
            let holder = self.holder(name, now_ms).await?;
            Ok(ExtendOutcome::Lost(match holder {
                Some(info) if info.owner != owner.as_str() => LossReason::TakenOver,
                _ => LossReason::Expired,
            }))
        })
    }

    fn release<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
    ) -> BoxFuture<'a, Result<ReleaseOutcome>> {
        Box::pin(async move {
            let (now_ms, _) = wall_clock();
            let owner_hex = owner.as_str();
            // Each step is atomic on its own, and once the row is not ours it never
            // becomes ours again, so the steps cannot report a wrong outcome. A freed
            // row keeps when it was last in use (for `prune`).
            let live = sqlx::query(
                "UPDATE turnstile_locks SET owner = NULL, expires_at_ms = ?3
                 WHERE name = ?1 AND owner = ?2 AND expires_at_ms > ?3",
            )
            .bind(name.as_str())
            .bind(owner_hex)
            .bind(now_ms)
            .execute(&self.pool)
            .await
            .map_err(|error| map_error(error, "cannot release the lock"))?
            .rows_affected();
            if live == 1 {
                self.signals.notify(name.as_str());
                return Ok(ReleaseOutcome::Released);
            }
            let expired_ours = sqlx::query(
                "UPDATE turnstile_locks SET owner = NULL, expires_at_ms = min(expires_at_ms, ?3)
                 WHERE name = ?1 AND owner = ?2",
            )
            .bind(name.as_str())
            .bind(owner_hex)
            .bind(now_ms)
            .execute(&self.pool)
            .await
            .map_err(|error| map_error(error, "cannot release the lock"))?
            .rows_affected();
            if expired_ours == 1 {
                self.signals.notify(name.as_str());
                return Ok(ReleaseOutcome::AlreadyExpired);
            }
            Ok(match self.holder(name, now_ms).await? {
                Some(_) => ReleaseOutcome::HeldByOther,
                None => ReleaseOutcome::AlreadyExpired,
            })
        })
    }

    fn inspect<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<LockInfo>>> {
        Box::pin(async move { self.holder(name, wall_clock().0).await })
    }

    fn proclaim<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        value: &'a str,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let applied = sqlx::query(PROCLAIM)
                .bind(name.as_str())
                .bind(owner.as_str())
                .bind(value)
                .bind(wall_clock().0)
                .execute(&self.pool)
                .await
                .map_err(|error| map_error(error, "cannot store the holder's value"))?
                .rows_affected()
                == 1;
            if applied {
                self.signals.notify(name.as_str());
            }
            Ok(applied)
        })
    }

    fn inspect_with_value<'a>(
        &'a self,
        name: &'a LockName,
    ) -> BoxFuture<'a, Result<Option<HolderAndValue>>> {
        Box::pin(async move { self.holder_with_value(name, wall_clock().0).await })
    }

    fn keeps_holder_values(&self) -> bool {
        true
    }

    fn declare_permits<'a>(
        &'a self,
        name: &'a LockName,
        permits: u32,
    ) -> BoxFuture<'a, Result<u32>> {
        Box::pin(async move {
            let stored: i64 = sqlx::query_scalar(DECLARE_PERMITS)
                .bind(name.as_str())
                .bind(i64::from(permits))
                .fetch_one(&self.pool)
                .await
                .map_err(|error| map_error(error, "cannot declare the semaphore's permits"))?;
            Ok(u32::try_from(stored).unwrap_or(0))
        })
    }

    fn stored_permits<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<u32>>> {
        Box::pin(async move {
            let stored: Option<i64> = match sqlx::query_scalar(
                "SELECT permits FROM turnstile_semaphores WHERE name = ?1",
            )
            .bind(name.as_str())
            .fetch_optional(&self.pool)
            .await
            {
                Err(error) if crate::sql::is_missing_table(&error) => None,
                other => other
                    .map_err(|error| map_error(error, "cannot read the semaphore's permits"))?,
            };
            Ok(stored.map(|permits| u32::try_from(permits).unwrap_or(0)))
        })
    }

    fn forget_permits<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<u32>>> {
        Box::pin(async move {
            let stored: Option<i64> = sqlx::query_scalar(
                "DELETE FROM turnstile_semaphores WHERE name = ?1 RETURNING permits",
            )
            .bind(name.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(|error| map_error(error, "cannot forget the semaphore's permits"))?;
            Ok(stored.map(|permits| u32::try_from(permits).unwrap_or(0)))
        })
    }

    fn force_release<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<LockInfo>>> {
        Box::pin(async move {
            let (now_ms, _) = wall_clock();
            let mut transaction = self
                .pool
                .begin_with("BEGIN IMMEDIATE")
                .await
                .map_err(|error| map_error(error, "cannot start a transaction"))?;
            let row = sqlx::query(
                "SELECT owner, token, expires_at_ms FROM turnstile_locks
                 WHERE name = ?1 AND owner IS NOT NULL AND expires_at_ms > ?2",
            )
            .bind(name.as_str())
            .bind(now_ms)
            .fetch_optional(&mut *transaction)
            .await
            .map_err(|error| map_error(error, "cannot read the lock"))?;
            let held = row.map(|row| lock_info(&row, now_ms)).transpose()?;
            if held.is_some() {
                sqlx::query(
                    "UPDATE turnstile_locks SET owner = NULL, expires_at_ms = ?2 WHERE name = ?1",
                )
                .bind(name.as_str())
                .bind(now_ms)
                .execute(&mut *transaction)
                .await
                .map_err(|error| map_error(error, "cannot break the lock"))?;
            }
            transaction
                .commit()
                .await
                .map_err(|error| map_error(error, "cannot break the lock"))?;
            if held.is_some() {
                self.signals.notify(name.as_str());
            }
            Ok(held)
        })
    }

    fn watch_releases<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<ReleaseWatch>> {
        Box::pin(async move {
            let (watch, _) = self.signals.watch(name.as_str());
            Ok(watch.with_poll(POLL_MIN, POLL_MAX))
        })
    }

    fn migrate(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(SqliteLockStore::migrate(self))
    }

    fn prune(&self, unused_for: Duration) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move {
            let (now_ms, _) = wall_clock();
            let before = now_ms.saturating_sub(millis_i64(unused_for));
            let removed = sqlx::query("DELETE FROM turnstile_locks WHERE expires_at_ms <= ?1")
                .bind(before)
                .execute(&self.pool)
                .await
                .map_err(|error| map_error(error, "cannot prune lock rows"))?
                .rows_affected();
            // A value is only read while its owner holds the lock, so the rows of
            // names just forgotten are dead.
            sqlx::query(
                "DELETE FROM turnstile_holder_values WHERE name NOT IN
                 (SELECT name FROM turnstile_locks WHERE owner IS NOT NULL)",
            )
            .execute(&self.pool)
            .await
            .map_err(|error| map_error(error, "cannot prune holder values"))?;
            Ok(removed)
        })
    }

    fn hand_over<'a>(
        &'a self,
        name: &'a LockName,
        from: &'a OwnerId,
        to: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(ReleaseOutcome, TryAcquire)>> {
        Box::pin(async move {
            let (now_ms, now_us) = wall_clock();
            let token: Option<i64> = sqlx::query_scalar(HAND_OVER)
                .bind(name.as_str())
                .bind(from.as_str())
                .bind(to.as_str())
                .bind(now_us)
                .bind(now_ms.saturating_add(millis_i64(ttl)))
                .bind(now_ms)
                .fetch_optional(&self.pool)
                .await
                .map_err(|error| map_error(error, "cannot hand the lock over"))?;
            super::backend::moved_or_released(self, token, name, from, to, ttl).await
        })
    }

    fn describe(&self) -> String {
        format!("sqlite://{}", self.path.display())
    }
}
