//! Idempotency records in MySQL / MariaDB (InnoDB).
//!
//! One table, `{prefix}_idempotency` (prefix `turnstile` by default; the URL options
//! `turnstile_prefix` and `turnstile_migrate` as for the lock store). Times are kept as
//! microseconds of the server's clock.
//!
//! # Guarantees
//! - **Atomic claim**: one `INSERT … ON DUPLICATE KEY UPDATE` whose first assignment
//!   decides, from the record as it stands, whether this call takes it (marking the
//!   record with a random claim id that the other assignments test, since MySQL
//!   evaluates them in order on the updated row). Of any number of concurrent claimers
//!   of an absent key exactly one starts. Starting takes that one round trip; a
//!   duplicate (replay, in progress, mismatch) takes a second one to read the record.
//! - **Clock**: lease ends and retention are judged by the database server's clock.
//! - **Durability**: an InnoDB commit: with `innodb_flush_log_at_trx_commit = 1` (the
//!   default) a stored outcome survives any crash; with `2`, a server crash but not an
//!   OS crash.
//! - **Tokens**: `max(last + 1, server clock in µs)`.
//! - **Waiting**: MySQL has no notifications: a duplicate in the same process is woken
//!   by the completion; one in another process re-checks with a backoff from 5 ms to
//!   100 ms.
//! - **Same-transaction mode**: the claim takes the record's row lock in the caller's
//!   transaction; a concurrent duplicate waits on it (bounded by its session's
//!   `innodb_lock_wait_timeout`, 50 s by default) and then replays.

use std::sync::Arc;
use std::time::Duration;

use sqlx::Row;
use sqlx::mysql::{MySqlConnection, MySqlPool, MySqlRow};

use super::{
    ClaimAnswer, CursorStep, Fingerprint, Finish, IdempotencyKey, IdempotencyOptions,
    IdempotencyStore, Record, RecordState, Scope, StaleClaim, TransactionalIdempotency,
    check_outcome,
};
use crate::engine::mysql::{CLOCK_US, connect_options, open_pool};
use crate::error::{Error, ErrorKind, Result};
use crate::fence::FencingToken;
use crate::lock::{BoxFuture, ExtendOutcome, ReleaseSignals, ReleaseWatch};
use crate::sql::{Statement, map_error, statement, validate_identifier};
use crate::url::{split_url_options, unknown_option};

const POLL_MIN: Duration = Duration::from_millis(5);
const POLL_MAX: Duration = Duration::from_millis(100);

struct Sql {
    create: Statement,
    create_cursors: Statement,
    cursor_insert: Statement,
    cursor_move: Statement,
    cursor_read: Statement,
    cursor_set: Statement,
    claim: Statement,
    read: Statement,
    read_locked: Statement,
    heartbeat: Statement,
    /// Whether the claim with a token completed the record (its completion's reply may
    /// have been lost): a completion or heartbeat retried after that is no failure.
    completed_by: Statement,
    taken: Statement,
    complete: Statement,
    release: Statement,
    get: Statement,
    forget: Statement,
    sweep: Statement,
    /// The condition a swept row must still meet when it is deleted.
    sweep_due: String,
    /// The indexes (name, statement), for a table made before they were part of it.
    add_indexes: [(String, String); 2],
    /// The table's name, quoted.
    table: String,
    /// The table's name as information_schema spells it.
    table_name: String,
    stale: Statement,
}

impl Sql {
    fn new(prefix: &str) -> Sql {
        let table = format!("`{prefix}_idempotency`");
        let now = CLOCK_US;
        let millis_left =
            |column: &str| format!("CAST(GREATEST(0, CEIL(({column} - {now}) / 1000)) AS SIGNED)");
        let claimed = "claim_id = ?";
        let read = format!(
            "SELECT state, fingerprint = ? AS same,
                    (expires_at > {now} OR (state = 'in_progress' AND lease_until > {now})) AS live,
                    {lease_left} AS lease_left_ms, outcome
             FROM {table} WHERE scope = ? AND `key` = ?",
            lease_left = millis_left("lease_until"),
        );
        Sql {
            create: statement(format!(
                "CREATE TABLE IF NOT EXISTS {table} (
                    scope VARBINARY(255) NOT NULL,
                    `key` VARBINARY(255) NOT NULL,
                    claim_id BINARY(16) NOT NULL,
                    state VARCHAR(16) CHARACTER SET ascii NOT NULL,
                    fingerprint BINARY(32) NOT NULL,
                    token BIGINT UNSIGNED NOT NULL,
                    lease_until BIGINT NOT NULL,
                    created_at BIGINT NOT NULL,
                    expires_at BIGINT NOT NULL,
                    outcome LONGBLOB,
                    PRIMARY KEY (scope, `key`),
                    KEY `{prefix}_idempotency_expires` (expires_at),
                    KEY `{prefix}_idempotency_lease` (state, lease_until)) ENGINE = InnoDB"
            )),
            create_cursors: statement(format!(
                "CREATE TABLE IF NOT EXISTS `{prefix}_inbox_cursors` (
                    consumer VARBINARY(255) NOT NULL,
                    ordering_key VARBINARY(255) NOT NULL,
                    last_seq BIGINT NOT NULL,
                    PRIMARY KEY (consumer, ordering_key)) ENGINE = InnoDB"
            )),
            cursor_insert: statement(format!(
                "INSERT IGNORE INTO `{prefix}_inbox_cursors` (consumer, ordering_key, last_seq) VALUES (?, ?, ?)"
            )),
            cursor_move: statement(format!(
                "UPDATE `{prefix}_inbox_cursors` SET last_seq = ?
                 WHERE consumer = ? AND ordering_key = ? AND last_seq = ? - 1"
            )),
            cursor_set: statement(format!("UPDATE `{prefix}_inbox_cursors` SET last_seq = ? WHERE consumer = ? AND ordering_key = ?")),
            cursor_read: statement(format!(
                "SELECT last_seq FROM `{prefix}_inbox_cursors` WHERE consumer = ? AND ordering_key = ? FOR UPDATE"
            )),
            // Binds: scope, key, claim id, fingerprint, lease µs, retention µs; then in
            // the update: fingerprint, claim id ×3, retention µs, claim id ×2,
            // fingerprint, claim id, lease µs, claim id.
            //
            // The first assignment decides on the record as it stands; the others see
            // the updated `claim_id` (MySQL assigns left to right) and follow it. The
            // connection's LAST_INSERT_ID ends up as the new token when this call
            // started, and 0 when it did not (the value the server reports back).
            claim: statement(format!(
                "INSERT INTO {table}
                    (scope, `key`, claim_id, state, fingerprint, token, lease_until, created_at, expires_at, outcome)
                 VALUES (?, ?, ?, 'in_progress', ?, LAST_INSERT_ID({now}), {now} + ?, {now}, {now} + ?, NULL)
                 ON DUPLICATE KEY UPDATE
                    claim_id = IF((expires_at <= {now} AND NOT (state = 'in_progress' AND lease_until > {now}))
                                  OR (fingerprint = ? AND (state = 'released'
                                      OR (state = 'in_progress' AND lease_until <= {now}))),
                                  ?, claim_id),
                    token = IF({claimed}, LAST_INSERT_ID(GREATEST(token + 1, {now})), token + LAST_INSERT_ID(0)),
                    created_at = IF({claimed} AND expires_at <= {now}, {now}, created_at),
                    expires_at = IF({claimed} AND expires_at <= {now}, {now} + ?, expires_at),
                    state = IF({claimed}, 'in_progress', state),
                    fingerprint = IF({claimed}, ?, fingerprint),
                    lease_until = IF({claimed}, {now} + ?, lease_until),
                    outcome = IF({claimed}, NULL, outcome)"
            )),
            // A locking read inside a caller's transaction: its snapshot may predate the
            // commit of the duplicate it waited for.
            read_locked: statement(format!("{read} LOCK IN SHARE MODE")),
            read: statement(read),
            heartbeat: statement(format!(
                "UPDATE {table} SET lease_until = {now} + ?, expires_at = GREATEST(expires_at, lease_until)
                 WHERE scope = ? AND `key` = ? AND token = ? AND state = 'in_progress'"
            )),
            taken: statement(format!(
                "SELECT COUNT(*) FROM {table}
                 WHERE scope = ? AND `key` = ? AND token <> ? AND state = 'in_progress'"
            )),
            completed_by: statement(format!(
                "SELECT COUNT(*) FROM {table}
                 WHERE scope = ? AND `key` = ? AND token = ? AND state = 'completed'"
            )),
            // Kept for the retention from its creation, or from its completion when the
            // work outlived the retention (the retry that is surely coming still gets
            // the replay). MySQL assigns left to right: the second `expires_at` sees
            // the first, and `expires_at - created_at` is the retention bound once.
            complete: statement(format!(
                "UPDATE {table} SET state = 'completed', outcome = ?, lease_until = {now},
                    expires_at = created_at + ?,
                    expires_at = IF(expires_at > {now}, expires_at, {now} + (expires_at - created_at))
                 WHERE scope = ? AND `key` = ? AND token = ? AND state = 'in_progress'"
            )),
            release: statement(format!(
                "UPDATE {table} SET state = 'released', outcome = NULL, lease_until = {now}
                 WHERE scope = ? AND `key` = ? AND token = ? AND state = 'in_progress'"
            )),
            get: statement(format!(
                "SELECT state, fingerprint, token, {lease_left} AS lease_left_ms,
                        {expires_left} AS expires_ms, outcome
                 FROM {table}
                 WHERE scope = ? AND `key` = ? AND state <> 'released'
                   AND (expires_at > {now} OR (state = 'in_progress' AND lease_until > {now}))",
                lease_left = millis_left("lease_until"),
                expires_left = millis_left("expires_at"),
            )),
            // The row stays (its token is the floor of the next claim's); a claim at work
            // on it is fenced out by the bumped token.
            forget: statement(format!(
                "UPDATE {table} SET state = 'released', token = token + 1, outcome = NULL,
                    lease_until = {now}
                 WHERE scope = ? AND `key` = ? AND state <> 'released' AND expires_at > {now}"
            )),
            // A plain (non-locking) read of what is due, by the expiry index; the delete
            // then takes only those rows, by primary key, re-checking that they are
            // still due — never scanning, and so never locking, a row a claim needs.
            sweep: statement(format!(
                "SELECT scope, `key` FROM {table}
                 WHERE expires_at <= {now} AND NOT (state = 'in_progress' AND lease_until > {now})
                 ORDER BY expires_at LIMIT ?"
            )),
            sweep_due: format!(
                "AND expires_at <= {now} AND NOT (state = 'in_progress' AND lease_until > {now})"
            ),
            add_indexes: [
                (
                    format!("{prefix}_idempotency_expires"),
                    format!(
                        "ALTER TABLE {table} ADD KEY `{prefix}_idempotency_expires` (expires_at)"
                    ),
                ),
                (
                    format!("{prefix}_idempotency_lease"),
                    format!(
                        "ALTER TABLE {table} ADD KEY `{prefix}_idempotency_lease` (state, lease_until)"
                    ),
                ),
            ],
            table_name: format!("{prefix}_idempotency"),
            table: table.clone(),
            stale: statement(format!(
                "SELECT scope, `key`, token,
                        CAST(CEIL(({now} - lease_until) / 1000) AS SIGNED) AS overdue_ms
                 FROM {table}
                 WHERE state = 'in_progress' AND lease_until <= {now} AND expires_at > {now}
                 ORDER BY lease_until LIMIT ?"
            )),
        }
    }
}

/// Idempotency records in a MySQL / MariaDB table.
#[derive(Clone)]
pub struct MysqlIdempotencyStore {
    pool: MySqlPool,
    sql: Arc<Sql>,
    signals: ReleaseSignals,
    url: String,
}

impl std::fmt::Debug for MysqlIdempotencyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MysqlIdempotencyStore")
            .field("url", &self.url)
            .finish()
    }
}

fn bad(error: sqlx::Error) -> Error {
    map_error(error, "bad reply from the idempotency store")
}

fn duration_ms(millis: Option<i64>) -> Option<Duration> {
    millis
        .and_then(|ms| u64::try_from(ms).ok())
        .map(Duration::from_millis)
}

fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

fn text(bytes: Vec<u8>) -> Result<String> {
    String::from_utf8(bytes)
        .map_err(|_| Error::new(ErrorKind::Store, "a stored scope or key is not UTF-8"))
}

/// MySQL's "lock wait timeout exceeded" (1205) and "deadlock found" (1213).
fn is_lock_conflict(error: &sqlx::Error) -> bool {
    matches!(
        crate::engine::mysql::server_error_number(error),
        Some(1205 | 1213)
    )
}

impl MysqlIdempotencyStore {
    /// Connects with the URL's `turnstile_*` options (`prefix`, `migrate`), creating the
    /// table on first use unless `turnstile_migrate=off`.
    pub async fn connect(url: &str) -> Result<Self> {
        let (driver_url, options) = split_url_options(url);
        let (mut prefix, mut migrate) = ("turnstile".to_owned(), true);
        for (key, value) in &options {
            match (key.as_str(), value.as_str()) {
                ("prefix", _) => prefix = value.clone(),
                ("migrate", "on" | "true" | "1" | "yes") => migrate = true,
                ("migrate", "off" | "false" | "0" | "no") => migrate = false,
                ("migrate", _) => return Err(unknown_option(key, value, "on or off")),
                _ => {
                    return Err(unknown_option(
                        key,
                        value,
                        "turnstile_prefix, turnstile_migrate",
                    ));
                }
            }
        }
        validate_identifier("table prefix", &prefix)?;
        let redacted = crate::url::redact(&driver_url);
        let options = connect_options(&driver_url)?;
        let timeout = Duration::from_secs(3);
        // Its statements never wait long for a row an application's transaction holds
        // (1 s, MySQL's least): such a claim is in progress.
        let pool = open_pool(
            &options,
            8,
            timeout,
            &redacted,
            &["SET SESSION innodb_lock_wait_timeout = 1"],
        )
        .await?;
        let store = MysqlIdempotencyStore {
            pool,
            sql: Arc::new(Sql::new(&prefix)),
            signals: ReleaseSignals::new(),
            url: redacted,
        };
        if migrate {
            store.migrate().await?;
        }
        Ok(store)
    }

    /// Creates the table if missing; harmless to repeat and to run from several processes
    /// at once.
    pub async fn migrate(&self) -> Result<()> {
        for create in [&self.sql.create, &self.sql.create_cursors] {
            sqlx::query(create.sql())
                .execute(&self.pool)
                .await
                .map_err(|error| map_error(error, "cannot create the idempotency tables"))?;
        }
        // Tables made by earlier versions lack the indexes (MySQL has no ADD KEY IF NOT
        // EXISTS): look first, so that a start never waits on the table's metadata lock
        // for nothing; another process adding the same one at that moment is no error.
        for (name, add) in &self.sql.add_indexes {
            let present: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM information_schema.statistics
                 WHERE table_schema = DATABASE() AND table_name = ? AND index_name = ?",
            )
            .bind(&self.sql.table_name)
            .bind(name)
            .fetch_one(&self.pool)
            .await
            .map_err(|error| map_error(error, "cannot read the idempotency table's indexes"))?;
            if present > 0 {
                continue;
            }
            match sqlx::query(sqlx::AssertSqlSafe(add.as_str()))
                .execute(&self.pool)
                .await
            {
                Ok(_) => {}
                Err(error) if crate::engine::mysql::server_error_number(&error) == Some(1061) => {}
                Err(error) => {
                    return Err(map_error(error, "cannot index the idempotency table"));
                }
            }
        }
        Ok(())
    }

    /// The connection pool, for the application's own work.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    fn signal_key(scope: &Scope, key: &IdempotencyKey) -> String {
        format!("{}\n{}", scope.as_str(), key.as_str())
    }

    /// The claim on `connection` (autocommit, or inside a caller's transaction when
    /// `locked_read`).
    async fn claim_on(
        &self,
        connection: &mut MySqlConnection,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        options: (Duration, Duration),
        in_transaction: bool,
    ) -> Result<ClaimAnswer> {
        let fail = |error| map_error(error, "cannot claim the idempotency key");
        let (lease, retention) = (micros(options.0), micros(options.1));
        let claim_id: [u8; 16] = rand::random();
        let fingerprint = &fingerprint.as_bytes()[..];
        let claimed = sqlx::query(self.sql.claim.sql())
            .bind(scope.as_str())
            .bind(key.as_str())
            .bind(&claim_id[..])
            .bind(fingerprint)
            .bind(lease)
            .bind(retention)
            .bind(fingerprint)
            .bind(&claim_id[..])
            .bind(&claim_id[..])
            .bind(&claim_id[..])
            .bind(&claim_id[..])
            .bind(retention)
            .bind(&claim_id[..])
            .bind(&claim_id[..])
            .bind(fingerprint)
            .bind(&claim_id[..])
            .bind(lease)
            .bind(&claim_id[..])
            .execute(&mut *connection)
            .await;
        let claimed = match claimed {
            Ok(claimed) => claimed,
            // A transaction holds the record (a claim of the same key committing
            // slowly): it is at work. Inside a caller's transaction a deadlock has
            // rolled that transaction back, which the caller must hear.
            Err(error) if !in_transaction && is_lock_conflict(&error) => {
                return Ok(ClaimAnswer::InProgress { lease_left: None });
            }
            Err(error) => return Err(fail(error)),
        };
        if claimed.last_insert_id() != 0 {
            return Ok(ClaimAnswer::Started {
                token: FencingToken::new(claimed.last_insert_id()),
            });
        }
        let read = if in_transaction {
            &self.sql.read_locked
        } else {
            &self.sql.read
        };
        let row = sqlx::query(read.sql())
            .bind(fingerprint)
            .bind(scope.as_str())
            .bind(key.as_str())
            .fetch_optional(&mut *connection)
            .await
            .map_err(fail)?;
        let Some(row) = row else {
            // Swept between the two statements: whoever claims next starts.
            return Ok(ClaimAnswer::InProgress { lease_left: None });
        };
        let state: String = row.try_get("state").map_err(bad)?;
        let same: bool = row.try_get("same").map_err(bad)?;
        let live: bool = row.try_get("live").map_err(bad)?;
        Ok(match (state.as_str(), same, live) {
            (_, false, true) => ClaimAnswer::Mismatch,
            ("completed", true, true) => ClaimAnswer::Replay {
                outcome: row
                    .try_get::<Option<Vec<u8>>, _>("outcome")
                    .map_err(bad)?
                    .unwrap_or_default(),
            },
            ("in_progress", _, _) => ClaimAnswer::InProgress {
                lease_left: duration_ms(row.try_get("lease_left_ms").map_err(bad)?),
            },
            // Changed between the two statements (released, expired): claim again.
            _ => ClaimAnswer::InProgress { lease_left: None },
        })
    }

    /// Runs a statement that changes one record when `token` still holds it, and wakes
    /// same-process waiters when it did.
    async fn finish(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        query: sqlx::query::Query<'_, sqlx::MySql, sqlx::mysql::MySqlArguments>,
        what: &str,
    ) -> Result<Finish> {
        let changed = query
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

    /// Whether the record names `token` and is completed (by that claim).
    async fn completed_by<'e>(
        &self,
        executor: impl sqlx::Executor<'e, Database = sqlx::MySql>,
        scope: &Scope,
        key: &IdempotencyKey,
        token: FencingToken,
    ) -> Result<bool> {
        Ok(sqlx::query_scalar::<_, i64>(self.sql.completed_by.sql())
            .bind(scope.as_str())
            .bind(key.as_str())
            .bind(token.get())
            .fetch_one(executor)
            .await
            .map_err(|error| map_error(error, "cannot read the record"))?
            > 0)
    }

    fn complete_query<'q>(
        &'q self,
        scope: &'q Scope,
        key: &'q IdempotencyKey,
        token: FencingToken,
        outcome: &'q [u8],
        retention: Duration,
    ) -> Result<sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments>> {
        check_outcome(outcome)?;
        Ok(sqlx::query(self.sql.complete.sql())
            .bind(outcome)
            .bind(micros(retention))
            .bind(scope.as_str())
            .bind(key.as_str())
            .bind(token.get()))
    }
}

fn record(row: &MySqlRow) -> Result<Record> {
    let state: String = row.try_get("state").map_err(bad)?;
    let fingerprint: Vec<u8> = row.try_get("fingerprint").map_err(bad)?;
    let fingerprint: [u8; 32] = fingerprint
        .as_slice()
        .try_into()
        .map_err(|_| Error::new(ErrorKind::Store, "a stored fingerprint is not 32 bytes"))?;
    let in_progress = state == "in_progress";
    Ok(Record {
        state: if in_progress {
            RecordState::InProgress
        } else {
            RecordState::Completed
        },
        fingerprint: Fingerprint::from_bytes(fingerprint),
        token: FencingToken::new(row.try_get("token").map_err(bad)?),
        lease_left: if in_progress {
            duration_ms(row.try_get("lease_left_ms").map_err(bad)?)
        } else {
            None
        },
        expires_in: duration_ms(row.try_get("expires_ms").map_err(bad)?).unwrap_or_default(),
        outcome: row.try_get("outcome").map_err(bad)?,
    })
}

impl TransactionalIdempotency for MysqlIdempotencyStore {
    type Connection = MySqlConnection;

    fn advance_cursor<'a>(
        &'a self,
        connection: &'a mut MySqlConnection,
        consumer: &'a Scope,
        key: &'a str,
        seq: u64,
        start: u64,
    ) -> BoxFuture<'a, Result<CursorStep>> {
        Box::pin(async move {
            let fail = |error| map_error(error, "cannot move the inbox cursor");
            let seq = i64::try_from(seq).unwrap_or(i64::MAX);
            sqlx::query(self.sql.cursor_insert.sql())
                .bind(consumer.as_str())
                .bind(key)
                .bind(i64::try_from(start).unwrap_or(i64::MAX))
                .execute(&mut *connection)
                .await
                .map_err(fail)?;
            let moved = sqlx::query(self.sql.cursor_move.sql())
                .bind(seq)
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
            let last: i64 = sqlx::query_scalar(self.sql.cursor_read.sql())
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
        connection: &'a mut MySqlConnection,
        consumer: &'a Scope,
        key: &'a str,
        seq: u64,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            sqlx::query(self.sql.cursor_set.sql())
                .bind(i64::try_from(seq).unwrap_or(i64::MAX))
                .bind(consumer.as_str())
                .bind(key)
                .execute(&mut *connection)
                .await
                .map_err(|error| map_error(error, "cannot set the inbox cursor"))?;
            Ok(())
        })
    }

    /// Claims inside the caller's InnoDB transaction: a duplicate claiming at the same
    /// time waits on the record's row until this transaction ends, bounded by its
    /// session's `innodb_lock_wait_timeout`. A deadlock reported here has rolled the
    /// caller's transaction back: retry it from the start.
    fn claim_in_transaction<'a>(
        &'a self,
        connection: &'a mut MySqlConnection,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        fingerprint: &'a Fingerprint,
        options: &'a IdempotencyOptions,
    ) -> BoxFuture<'a, Result<ClaimAnswer>> {
        Box::pin(self.claim_on(
            connection,
            scope,
            key,
            fingerprint,
            (options.get_lease(), options.get_retention()),
            true,
        ))
    }

    fn complete_in_transaction<'a>(
        &'a self,
        connection: &'a mut MySqlConnection,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        token: FencingToken,
        outcome: &'a [u8],
        options: &'a IdempotencyOptions,
    ) -> BoxFuture<'a, Result<Finish>> {
        Box::pin(async move {
            let changed = self
                .complete_query(scope, key, token, outcome, options.get_retention())?
                .execute(&mut *connection)
                .await
                .map_err(|error| map_error(error, "cannot store the outcome"))?
                .rows_affected();
            // Waiters in this process re-check now and wait on the row until the commit.
            self.signals.notify(&Self::signal_key(scope, key));
            Ok(
                if changed == 1
                    || self
                        .completed_by(&mut *connection, scope, key, token)
                        .await?
                {
                    Finish::Done
                } else {
                    Finish::Fenced
                },
            )
        })
    }
}

impl IdempotencyStore for MysqlIdempotencyStore {
    fn claim<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        fingerprint: &'a Fingerprint,
        lease: Duration,
        retention: Duration,
    ) -> BoxFuture<'a, Result<ClaimAnswer>> {
        Box::pin(async move {
            let mut connection = self
                .pool
                .acquire()
                .await
                .map_err(|error| map_error(error, "cannot claim the idempotency key"))?;
            self.claim_on(
                &mut connection,
                scope,
                key,
                fingerprint,
                (lease, retention),
                false,
            )
            .await
        })
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
            let renewed = sqlx::query(self.sql.heartbeat.sql())
                .bind(micros(lease))
                .bind(scope.as_str())
                .bind(key.as_str())
                .bind(token.get())
                .execute(&self.pool)
                .await
                .map_err(fail)?
                .rows_affected()
                == 1
                || self.completed_by(&self.pool, scope, key, token).await?;
            let taken = !renewed
                && sqlx::query_scalar::<_, i64>(self.sql.taken.sql())
                    .bind(scope.as_str())
                    .bind(key.as_str())
                    .bind(token.get())
                    .fetch_one(&self.pool)
                    .await
                    .map_err(fail)?
                    > 0;
            Ok(ExtendOutcome::from_answers(renewed, taken))
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
            let query = self.complete_query(scope, key, token, outcome, retention)?;
            match self
                .finish(scope, key, query, "cannot store the outcome")
                .await?
            {
                Finish::Fenced if self.completed_by(&self.pool, scope, key, token).await? => {
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
            let query = sqlx::query(self.sql.release.sql())
                .bind(scope.as_str())
                .bind(key.as_str())
                .bind(token.get());
            self.finish(scope, key, query, "cannot give the key back")
                .await
        })
    }

    fn get<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<Option<Record>>> {
        Box::pin(async move {
            let row = match sqlx::query(self.sql.get.sql())
                .bind(scope.as_str())
                .bind(key.as_str())
                .fetch_optional(&self.pool)
                .await
            {
                Err(error) if crate::sql::is_missing_table(&error) => return Ok(None),
                other => other.map_err(|error| map_error(error, "cannot read the record"))?,
            };
            row.as_ref().map(record).transpose()
        })
    }

    fn forget<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let query = sqlx::query(self.sql.forget.sql())
                .bind(scope.as_str())
                .bind(key.as_str());
            Ok(self
                .finish(scope, key, query, "cannot forget the record")
                .await?
                == Finish::Done)
        })
    }

    fn sweep(&self, limit: u32) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move {
            let fail = |error| map_error(error, "cannot sweep expired records");
            let due = sqlx::query(self.sql.sweep.sql())
                .bind(limit)
                .fetch_all(&self.pool)
                .await
                .map_err(fail)?;
            if due.is_empty() {
                return Ok(0);
            }
            let rows = vec!["(?, ?)"; due.len()].join(", ");
            let delete = format!(
                "DELETE FROM {} WHERE (scope, `key`) IN ({rows}) {}",
                self.sql.table, self.sql.sweep_due
            );
            let mut query = sqlx::query(sqlx::AssertSqlSafe(delete));
            for row in &due {
                query = query
                    .bind(row.try_get::<Vec<u8>, _>("scope").map_err(bad)?)
                    .bind(row.try_get::<Vec<u8>, _>("key").map_err(bad)?);
            }
            Ok(query
                .execute(&self.pool)
                .await
                .map_err(fail)?
                .rows_affected())
        })
    }

    fn stale(&self, limit: u32) -> BoxFuture<'_, Result<Vec<StaleClaim>>> {
        Box::pin(async move {
            let rows = sqlx::query(self.sql.stale.sql())
                .bind(limit)
                .fetch_all(&self.pool)
                .await
                .map_err(|error| map_error(error, "cannot list stale claims"))?;
            rows.iter()
                .map(|row| {
                    Ok(StaleClaim {
                        scope: text(row.try_get("scope").map_err(bad)?)?,
                        key: text(row.try_get("key").map_err(bad)?)?,
                        token: FencingToken::new(row.try_get("token").map_err(bad)?),
                        overdue: duration_ms(row.try_get("overdue_ms").map_err(bad)?)
                            .unwrap_or_default(),
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
        self.url.clone()
    }
}
