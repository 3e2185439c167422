//! Idempotency records in the embedded SQLite database (the default store).
//!
//! One table, `turnstile_idempotency`, in the same kind of file as the SQLite lock store
//! (it may be the same file). Every operation is one transaction; SQLite serialises
//! writers, so of any number of concurrent claimers of an absent key exactly one starts.
//!
//! # Guarantees
//! - **Clock**: lease ends and retention are judged by the host's wall clock, which every
//!   process on the host shares.
//! - **Tokens**: `max(last + 1, host clock in µs)`, so they keep increasing across a
//!   swept record.
//! - **Waiting**: a duplicate in the same process is woken by the completion; one in
//!   another process re-checks with a backoff from 2 ms to 50 ms.
//! - **Durability**: WAL with `synchronous = FULL` by default: a claim or an outcome is
//!   on disk when the call returns, so a power cut cannot take back a completion and let
//!   a retry run the work again. `?turnstile_synchronous=normal` trades that for speed
//!   (no `fsync` per commit; a crash of the process still loses nothing).

use std::path::{Path, PathBuf};
use std::time::Duration;

use sqlx::Row;
use sqlx::sqlite::{SqliteConnection, SqlitePool, SqliteRow, SqliteSynchronous};

use super::{
    ClaimAnswer, CursorStep, Fingerprint, Finish, IdempotencyKey, IdempotencyOptions,
    IdempotencyStore, Record, RecordState, Scope, StaleClaim, TransactionalIdempotency,
    check_outcome,
};
use crate::clock::wall_clock;
use crate::engine::sqlite::{millis_i64, open_pool, parse_url};
use crate::error::{Error, ErrorKind, Result};
use crate::fence::FencingToken;
use crate::lock::{BoxFuture, ExtendOutcome, ReleaseSignals, ReleaseWatch};
use crate::sql::map_error;

const CREATE: &str = "CREATE TABLE IF NOT EXISTS turnstile_idempotency (
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    state TEXT NOT NULL,
    fingerprint BLOB NOT NULL,
    token INTEGER NOT NULL,
    lease_until_ms INTEGER NOT NULL,
    created_ms INTEGER NOT NULL,
    expires_ms INTEGER NOT NULL,
    outcome BLOB,
    PRIMARY KEY (scope, key)
) WITHOUT ROWID";

/// What `sweep` looks for, without reading the whole table.
const CREATE_EXPIRES_INDEX: &str = "CREATE INDEX IF NOT EXISTS turnstile_idempotency_expires
    ON turnstile_idempotency (expires_ms)";

/// What `stale` looks for.
const CREATE_LEASE_INDEX: &str = "CREATE INDEX IF NOT EXISTS turnstile_idempotency_lease
    ON turnstile_idempotency (lease_until_ms) WHERE state = 'in_progress'";

const CREATE_CURSORS: &str = "CREATE TABLE IF NOT EXISTS turnstile_inbox_cursors (
    consumer TEXT NOT NULL,
    ordering_key TEXT NOT NULL,
    last_seq INTEGER NOT NULL,
    PRIMARY KEY (consumer, ordering_key)
) WITHOUT ROWID";

const SELECT: &str = "SELECT state, fingerprint, token, lease_until_ms, expires_ms, outcome
    FROM turnstile_idempotency WHERE scope = ?1 AND key = ?2";

const POLL_MIN: Duration = Duration::from_millis(2);
const POLL_MAX: Duration = Duration::from_millis(50);

/// Idempotency records in a SQLite database file.
#[derive(Debug, Clone)]
pub struct SqliteIdempotencyStore {
    pool: SqlitePool,
    path: PathBuf,
    signals: ReleaseSignals,
}

/// A record row as read.
struct Row_ {
    state: String,
    fingerprint: Vec<u8>,
    token: i64,
    lease_until_ms: i64,
    expires_ms: i64,
    outcome: Option<Vec<u8>>,
}

impl Row_ {
    /// Whether the record still stands: within its retention, or a claim whose lease
    /// is live (a claim at work is never handed to another request, whatever the
    /// retention says).
    fn live(&self, now_ms: i64) -> bool {
        self.expires_ms > now_ms || (self.state == "in_progress" && self.lease_until_ms > now_ms)
    }
}

fn read(row: &SqliteRow) -> Result<Row_> {
    let bad = |error| map_error(error, "bad idempotency record");
    Ok(Row_ {
        state: row.try_get("state").map_err(bad)?,
        fingerprint: row.try_get("fingerprint").map_err(bad)?,
        token: row.try_get("token").map_err(bad)?,
        lease_until_ms: row.try_get("lease_until_ms").map_err(bad)?,
        expires_ms: row.try_get("expires_ms").map_err(bad)?,
        outcome: row.try_get("outcome").map_err(bad)?,
    })
}

fn token_of(value: i64) -> FencingToken {
    FencingToken::new(u64::try_from(value).unwrap_or(0))
}

fn left(until_ms: i64, now_ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(until_ms.saturating_sub(now_ms)).unwrap_or(0))
}

impl SqliteIdempotencyStore {
    /// Opens (creating if needed) the database at `path` and its table, with durable
    /// commits (`synchronous = FULL`): a record is on disk when its claim or completion
    /// returns, so a power cut cannot take back an outcome that a retry would then run
    /// again.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self> {
        SqliteIdempotencyStore::open_with(path.as_ref().to_path_buf(), true, None).await
    }

    /// Opens the store named by `sqlite://PATH`; with `?turnstile_migrate=off`, an
    /// existing file without creating anything; with `?turnstile_synchronous=normal`,
    /// commits that survive a crash of the process but not a power cut (faster: no
    /// `fsync` per commit).
    pub async fn open_url(url: &str) -> Result<Self> {
        let url = parse_url(url)?;
        SqliteIdempotencyStore::open_with(url.path, url.create, url.synchronous).await
    }

    async fn open_with(
        path: PathBuf,
        create: bool,
        synchronous: Option<SqliteSynchronous>,
    ) -> Result<Self> {
        let synchronous = synchronous.unwrap_or(SqliteSynchronous::Full);
        let pool = open_pool(&path, create, "idempotency store", synchronous).await?;
        let store = SqliteIdempotencyStore {
            pool,
            path,
            signals: ReleaseSignals::new(),
        };
        if create {
            store.migrate().await?;
        }
        Ok(store)
    }

    /// Creates the table if missing. Harmless to run again or concurrently.
    pub async fn migrate(&self) -> Result<()> {
        for create in [
            CREATE,
            CREATE_CURSORS,
            CREATE_EXPIRES_INDEX,
            CREATE_LEASE_INDEX,
        ] {
            sqlx::query(create)
                .execute(&self.pool)
                .await
                .map_err(|error| map_error(error, "cannot create the idempotency tables"))?;
        }
        Ok(())
    }

    /// The connection pool (same database file), for the application's own work.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    fn signal_key(scope: &Scope, key: &IdempotencyKey) -> String {
        format!("{}\u{0}{}", scope.as_str(), key.as_str())
    }

    async fn claim_inner(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        retention: Duration,
    ) -> Result<ClaimAnswer> {
        let fail = |error| map_error(error, "cannot claim the idempotency key");
        // A replay needs no write lock: look first.
        let (now_ms, _) = wall_clock();
        if let Some(row) = sqlx::query(SELECT)
            .bind(scope.as_str())
            .bind(key.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(fail)?
        {
            let row = read(&row)?;
            if row.expires_ms > now_ms && row.state == "completed" {
                return Ok(if row.fingerprint == fingerprint.as_bytes() {
                    ClaimAnswer::Replay {
                        outcome: row.outcome.unwrap_or_default(),
                    }
                } else {
                    ClaimAnswer::Mismatch
                });
            }
        }
        let mut transaction = self
            .pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(fail)?;
        let answer = claim_on(&mut transaction, scope, key, fingerprint, lease, retention).await?;
        transaction.commit().await.map_err(fail)?;
        Ok(answer)
    }

    /// Runs `statement` (which must check `token` and the in-progress state) and says
    /// whether it changed the record.
    async fn finish(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        statement: SqliteQuery<'_>,
        what: &str,
    ) -> Result<Finish> {
        let changed = statement
            .execute(&self.pool)
            .await
            .map_err(|error| map_error(error, what))?
            .rows_affected();
        if changed == 0 {
            return Ok(Finish::Fenced);
        }
        self.signals.notify(&Self::signal_key(scope, key));
        Ok(Finish::Done)
    }
}

type SqliteQuery<'q> = sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments>;

/// Stores `outcome` for the claim holding `token`. Kept for the retention from its
/// creation, or from its completion when the work outlived the retention (the retry
/// that is surely coming still gets the replay).
fn complete_statement<'q>(
    scope: &'q Scope,
    key: &'q IdempotencyKey,
    token: FencingToken,
    outcome: &'q [u8],
    retention: Duration,
) -> Result<SqliteQuery<'q>> {
    check_outcome(outcome)?;
    let token = token.to_i64()?;
    let (now_ms, _) = wall_clock();
    Ok(sqlx::query(
        "UPDATE turnstile_idempotency
         SET state = 'completed', outcome = ?4, lease_until_ms = ?5,
             expires_ms = CASE WHEN created_ms + ?6 > ?5 THEN created_ms + ?6 ELSE ?5 + ?6 END
         WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 'in_progress'",
    )
    .bind(scope.as_str())
    .bind(key.as_str())
    .bind(token)
    .bind(outcome)
    .bind(now_ms)
    .bind(millis_i64(retention)))
}

/// Whether the record names `token` and is completed (by that claim; its completion's
/// reply may have been lost): a completion or heartbeat retried after that is no
/// failure.
async fn completed_by<'e>(
    executor: impl sqlx::Executor<'e, Database = sqlx::Sqlite>,
    scope: &Scope,
    key: &IdempotencyKey,
    token: FencingToken,
) -> Result<bool> {
    Ok(sqlx::query_scalar::<_, i64>(
        "SELECT COUNT(*) FROM turnstile_idempotency
         WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 'completed'",
    )
    .bind(scope.as_str())
    .bind(key.as_str())
    .bind(token.to_i64()?)
    .fetch_one(executor)
    .await
    .map_err(|error| map_error(error, "cannot read the record"))?
        > 0)
}

impl TransactionalIdempotency for SqliteIdempotencyStore {
    type Connection = SqliteConnection;

    fn begin_statement(&self) -> Option<&'static str> {
        Some("BEGIN IMMEDIATE")
    }

    fn advance_cursor<'a>(
        &'a self,
        connection: &'a mut SqliteConnection,
        consumer: &'a Scope,
        key: &'a str,
        seq: u64,
        start: u64,
    ) -> BoxFuture<'a, Result<CursorStep>> {
        Box::pin(async move {
            let fail = |error| map_error(error, "cannot move the inbox cursor");
            let seq = i64::try_from(seq).unwrap_or(i64::MAX);
            sqlx::query(
                "INSERT INTO turnstile_inbox_cursors (consumer, ordering_key, last_seq)
                 VALUES (?1, ?2, ?3) ON CONFLICT DO NOTHING",
            )
            .bind(consumer.as_str())
            .bind(key)
            .bind(i64::try_from(start).unwrap_or(i64::MAX))
            .execute(&mut *connection)
            .await
            .map_err(fail)?;
            let moved = sqlx::query(
                "UPDATE turnstile_inbox_cursors SET last_seq = ?3
                 WHERE consumer = ?1 AND ordering_key = ?2 AND last_seq = ?3 - 1",
            )
            .bind(consumer.as_str())
            .bind(key)
            .bind(seq)
            .execute(&mut *connection)
            .await
            .map_err(fail)?
            .rows_affected();
            if moved == 1 {
                return Ok(CursorStep::Next);
            }
            let last: i64 = sqlx::query_scalar(
                "SELECT last_seq FROM turnstile_inbox_cursors WHERE consumer = ?1 AND ordering_key = ?2",
            )
            .bind(consumer.as_str())
            .bind(key)
            .fetch_one(&mut *connection)
            .await
            .map_err(fail)?;
            Ok(super::cursor_step(last, seq))
        })
    }

    fn set_cursor<'a>(
        &'a self,
        connection: &'a mut SqliteConnection,
        consumer: &'a Scope,
        key: &'a str,
        seq: u64,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            sqlx::query(
                "UPDATE turnstile_inbox_cursors SET last_seq = ?3
                 WHERE consumer = ?1 AND ordering_key = ?2",
            )
            .bind(consumer.as_str())
            .bind(key)
            .bind(i64::try_from(seq).unwrap_or(i64::MAX))
            .execute(&mut *connection)
            .await
            .map_err(|error| map_error(error, "cannot set the inbox cursor"))?;
            Ok(())
        })
    }

    /// Claims inside the caller's transaction, which must be a write transaction from the
    /// start (`pool.begin_with("BEGIN IMMEDIATE")`): a deferred one that reads first
    /// may find it cannot upgrade to writing while another transaction writes.
    fn claim_in_transaction<'a>(
        &'a self,
        connection: &'a mut SqliteConnection,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        fingerprint: &'a Fingerprint,
        options: &'a IdempotencyOptions,
    ) -> BoxFuture<'a, Result<ClaimAnswer>> {
        Box::pin(claim_on(
            connection,
            scope,
            key,
            fingerprint,
            options.get_lease(),
            options.get_retention(),
        ))
    }

    fn complete_in_transaction<'a>(
        &'a self,
        connection: &'a mut SqliteConnection,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        token: FencingToken,
        outcome: &'a [u8],
        options: &'a IdempotencyOptions,
    ) -> BoxFuture<'a, Result<Finish>> {
        Box::pin(async move {
            let statement =
                complete_statement(scope, key, token, outcome, options.get_retention())?;
            let changed = statement
                .execute(&mut *connection)
                .await
                .map_err(|error| map_error(error, "cannot store the outcome"))?
                .rows_affected();
            // Waiters in this process re-check now and find the record once the
            // transaction commits (they wait on SQLite's write lock meanwhile).
            self.signals.notify(&Self::signal_key(scope, key));
            Ok(
                if changed == 1 || completed_by(&mut *connection, scope, key, token).await? {
                    Finish::Done
                } else {
                    Finish::Fenced
                },
            )
        })
    }
}

/// The claim, on a connection inside a write transaction (which makes it atomic: SQLite
/// serialises writers).
async fn claim_on(
    connection: &mut SqliteConnection,
    scope: &Scope,
    key: &IdempotencyKey,
    fingerprint: &Fingerprint,
    lease: Duration,
    retention: Duration,
) -> Result<ClaimAnswer> {
    let fail = |error| map_error(error, "cannot claim the idempotency key");
    let (now_ms, now_us) = wall_clock();
    let prior = sqlx::query(SELECT)
        .bind(scope.as_str())
        .bind(key.as_str())
        .fetch_optional(&mut *connection)
        .await
        .map_err(fail)?
        .map(|row| read(&row))
        .transpose()?;
    let mut last_token = 0;
    if let Some(row) = prior.filter(|row| row.live(now_ms)) {
        if row.fingerprint != fingerprint.as_bytes() {
            return Ok(ClaimAnswer::Mismatch);
        }
        match row.state.as_str() {
            "completed" => {
                return Ok(ClaimAnswer::Replay {
                    outcome: row.outcome.unwrap_or_default(),
                });
            }
            "in_progress" if row.lease_until_ms > now_ms => {
                return Ok(ClaimAnswer::InProgress {
                    lease_left: Some(left(row.lease_until_ms, now_ms)),
                });
            }
            // Released, or in progress with a lease that ran out: take it over.
            _ => last_token = row.token,
        }
    } else if let Some(row) =
        sqlx::query("SELECT token FROM turnstile_idempotency WHERE scope = ?1 AND key = ?2")
            .bind(scope.as_str())
            .bind(key.as_str())
            .fetch_optional(&mut *connection)
            .await
            .map_err(fail)?
    {
        // An expired record: start afresh, but keep its token as a floor.
        last_token = row.try_get("token").map_err(fail)?;
    }
    let token = now_us.max(last_token.saturating_add(1));
    sqlx::query(
        "INSERT INTO turnstile_idempotency
            (scope, key, state, fingerprint, token, lease_until_ms, created_ms, expires_ms, outcome)
         VALUES (?1, ?2, 'in_progress', ?3, ?4, ?5, ?6, ?7, NULL)
         ON CONFLICT (scope, key) DO UPDATE SET
            state = 'in_progress', fingerprint = excluded.fingerprint, token = excluded.token,
            lease_until_ms = excluded.lease_until_ms,
            created_ms = CASE WHEN turnstile_idempotency.expires_ms > ?6
                              THEN turnstile_idempotency.created_ms ELSE excluded.created_ms END,
            expires_ms = CASE WHEN turnstile_idempotency.expires_ms > ?6
                              THEN turnstile_idempotency.expires_ms ELSE excluded.expires_ms END,
            outcome = NULL",
    )
    .bind(scope.as_str())
    .bind(key.as_str())
    .bind(&fingerprint.as_bytes()[..])
    .bind(token)
    .bind(now_ms.saturating_add(millis_i64(lease)))
    .bind(now_ms)
    .bind(now_ms.saturating_add(millis_i64(retention)))
    .execute(&mut *connection)
    .await
    .map_err(fail)?;
    Ok(ClaimAnswer::Started {
        token: token_of(token),
    })
}

impl IdempotencyStore for SqliteIdempotencyStore {
    fn claim<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        fingerprint: &'a Fingerprint,
        lease: Duration,
        retention: Duration,
    ) -> BoxFuture<'a, Result<ClaimAnswer>> {
        Box::pin(self.claim_inner(scope, key, fingerprint, lease, retention))
    }

    fn heartbeat<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        token: FencingToken,
        lease: Duration,
    ) -> BoxFuture<'a, Result<ExtendOutcome>> {
        Box::pin(async move {
            let fail = |error| map_error(error, "cannot renew the idempotency claim");
            let claim = token;
            let token = token.to_i64()?;
            let (now_ms, _) = wall_clock();
            let renewed = sqlx::query(
                "UPDATE turnstile_idempotency SET lease_until_ms = ?4, expires_ms = max(expires_ms, ?4)
                 WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 'in_progress'",
            )
            .bind(scope.as_str())
            .bind(key.as_str())
            .bind(token)
            .bind(now_ms.saturating_add(millis_i64(lease)))
            .execute(&self.pool)
            .await
            .map_err(fail)?
            .rows_affected();
            if renewed == 1 || completed_by(&self.pool, scope, key, claim).await? {
                return Ok(ExtendOutcome::Extended);
            }
            let newer: Option<i64> = sqlx::query_scalar(
                "SELECT token FROM turnstile_idempotency
                 WHERE scope = ?1 AND key = ?2 AND token <> ?3 AND state = 'in_progress'",
            )
            .bind(scope.as_str())
            .bind(key.as_str())
            .bind(token)
            .fetch_optional(&self.pool)
            .await
            .map_err(fail)?;
            Ok(ExtendOutcome::from_answers(false, newer.is_some()))
        })
    }

    fn complete<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        token: FencingToken,
        outcome: &'a [u8],
        retention: Duration,
    ) -> BoxFuture<'a, Result<Finish>> {
        Box::pin(async move {
            let statement = complete_statement(scope, key, token, outcome, retention)?;
            match self
                .finish(scope, key, statement, "cannot store the outcome")
                .await?
            {
                Finish::Fenced if completed_by(&self.pool, scope, key, token).await? => {
                    Ok(Finish::Done)
                }
                finished => Ok(finished),
            }
        })
    }

    fn release<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        token: FencingToken,
    ) -> BoxFuture<'a, Result<Finish>> {
        Box::pin(async move {
            let token = token.to_i64()?;
            let (now_ms, _) = wall_clock();
            let statement = sqlx::query(
                "UPDATE turnstile_idempotency SET state = 'released', lease_until_ms = ?4, outcome = NULL
                 WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 'in_progress'",
            )
            .bind(scope.as_str())
            .bind(key.as_str())
            .bind(token)
            .bind(now_ms);
            self.finish(scope, key, statement, "cannot give the key back")
                .await
        })
    }

    fn get<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<Option<Record>>> {
        Box::pin(async move {
            let (now_ms, _) = wall_clock();
            let row = match sqlx::query(SELECT)
                .bind(scope.as_str())
                .bind(key.as_str())
                .fetch_optional(&self.pool)
                .await
            {
                Err(error) if crate::sql::is_missing_table(&error) => return Ok(None),
                other => other.map_err(|error| map_error(error, "cannot read the record"))?,
            };
            let Some(row) = row.map(|row| read(&row)).transpose()? else {
                return Ok(None);
            };
            if !row.live(now_ms) || row.state == "released" {
                return Ok(None);
            }
            let fingerprint: [u8; 32] = row.fingerprint.as_slice().try_into().map_err(|_| {
                Error::new(ErrorKind::Store, "a stored fingerprint is not 32 bytes")
            })?;
            let in_progress = row.state == "in_progress";
            Ok(Some(Record {
                state: if in_progress {
                    RecordState::InProgress
                } else {
                    RecordState::Completed
                },
                fingerprint: Fingerprint::from_bytes(fingerprint),
                token: token_of(row.token),
                lease_left: in_progress.then(|| left(row.lease_until_ms, now_ms)),
                expires_in: left(row.expires_ms, now_ms),
                outcome: row.outcome,
            }))
        })
    }

    fn forget<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            // The row stays (its token is the floor of the next claim's); it becomes
            // absent, and a claim at work on it is fenced out.
            let (now_ms, _) = wall_clock();
            let forgotten = sqlx::query(
                "UPDATE turnstile_idempotency
                 SET state = 'released', token = token + 1, lease_until_ms = ?3, outcome = NULL
                 WHERE scope = ?1 AND key = ?2 AND state <> 'released' AND expires_ms > ?3",
            )
            .bind(scope.as_str())
            .bind(key.as_str())
            .bind(now_ms)
            .execute(&self.pool)
            .await
            .map_err(|error| map_error(error, "cannot forget the record"))?
            .rows_affected();
            if forgotten == 1 {
                self.signals.notify(&Self::signal_key(scope, key));
            }
            Ok(forgotten == 1)
        })
    }

    fn sweep(&self, limit: u32) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move {
            let (now_ms, _) = wall_clock();
            let swept = sqlx::query(
                "DELETE FROM turnstile_idempotency WHERE (scope, key) IN (
                    SELECT scope, key FROM turnstile_idempotency
                    WHERE expires_ms <= ?1 AND NOT (state = 'in_progress' AND lease_until_ms > ?1)
                    LIMIT ?2)",
            )
            .bind(now_ms)
            .bind(i64::from(limit))
            .execute(&self.pool)
            .await
            .map_err(|error| map_error(error, "cannot sweep expired records"))?
            .rows_affected();
            Ok(swept)
        })
    }

    fn stale(&self, limit: u32) -> BoxFuture<'_, Result<Vec<StaleClaim>>> {
        Box::pin(async move {
            let (now_ms, _) = wall_clock();
            let rows = sqlx::query(
                "SELECT scope, key, token, lease_until_ms FROM turnstile_idempotency
                 WHERE state = 'in_progress' AND lease_until_ms <= ?1 AND expires_ms > ?1
                 ORDER BY lease_until_ms LIMIT ?2",
            )
            .bind(now_ms)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(|error| map_error(error, "cannot list stale claims"))?;
            rows.iter()
                .map(|row| {
                    let bad = |error| map_error(error, "bad idempotency record");
                    let lease_until: i64 = row.try_get("lease_until_ms").map_err(bad)?;
                    Ok(StaleClaim {
                        scope: row.try_get("scope").map_err(bad)?,
                        key: row.try_get("key").map_err(bad)?,
                        token: token_of(row.try_get("token").map_err(bad)?),
                        overdue: left(now_ms, lease_until),
                    })
                })
                .collect()
        })
    }

    fn watch<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<ReleaseWatch>> {
        Box::pin(async move {
            let (watch, _) = self.signals.watch(&Self::signal_key(scope, key));
            Ok(watch.with_poll(POLL_MIN, POLL_MAX))
        })
    }

    fn describe(&self) -> String {
        format!("sqlite://{}", self.path.display())
    }
}
