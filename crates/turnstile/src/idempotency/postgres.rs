//! Idempotency records in PostgreSQL.
//!
//! One table, `{schema}.{prefix}_idempotency` (schema `public`, prefix `turnstile` by
//! default; the URL options `turnstile_schema`, `turnstile_prefix`, `turnstile_notify`
//! and `turnstile_migrate` as for the lock store). Every operation is one statement.
//!
//! # Guarantees
//! - **Atomic claim**: `INSERT … ON CONFLICT DO UPDATE … WHERE claimable`; of any number
//!   of concurrent claimers of an absent key exactly one starts.
//! - **Clock**: lease ends and retention are judged by the database server's clock.
//! - **Durability**: the store's connections run with `synchronous_commit = on`, so a
//!   stored outcome and an issued token are on disk before anyone learns of them.
//! - **Tokens**: `max(last + 1, database clock in µs)`.
//! - **Waiting**: a duplicate waits on `LISTEN {prefix}_idempotency` (its own connection,
//!   reconnected with a backoff; polling while it is down). A waiter marks the record,
//!   and a completion or release sends `NOTIFY` only then: each `NOTIFY` makes its
//!   commit take a database-wide lock.

use std::sync::Arc;
use std::time::Duration;

use sqlx::Row;
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions, PgRow};

use super::{
    ClaimAnswer, CursorStep, Fingerprint, Finish, IdempotencyKey, IdempotencyOptions,
    IdempotencyStore, Record, RecordState, Scope, StaleClaim, TransactionalIdempotency,
    check_outcome,
};
use crate::engine::postgres::{CLOCK_US, Listener, connect_options, open_bounded_pool};
use crate::error::{Error, ErrorKind, Result};
use crate::fence::FencingToken;
use crate::lock::{BoxFuture, ExtendOutcome, ReleaseSignals, ReleaseWatch};
use crate::sql::{Statement, map_error, statement, validate_identifier};
use crate::url::{split_url_options, unknown_option};

const POLL_MIN: Duration = Duration::from_millis(5);
const POLL_MAX: Duration = Duration::from_millis(100);

struct Sql {
    create: [String; 5],
    cursor_insert: Statement,
    cursor_move: Statement,
    cursor_read: Statement,
    cursor_set: Statement,
    claim: Statement,
    heartbeat: Statement,
    complete: Statement,
    release: Statement,
    get: Statement,
    forget: Statement,
    sweep: Statement,
    stale: Statement,
    channel: String,
}

impl Sql {
    fn new(schema: &str, prefix: &str) -> Sql {
        let schema = format!("\"{schema}\"");
        let table = format!("{schema}.\"{prefix}_idempotency\"");
        let now = "clock_timestamp()";
        let secs = |n: u8| format!("make_interval(secs => ${n}::float8)");
        let millis_left = |column: &str| {
            format!("GREATEST(0, CEIL(EXTRACT(EPOCH FROM ({column} - {now})) * 1000))::int8")
        };
        let channel = format!("{prefix}_idempotency");
        // Sends the record's name to waiters, only if one marked it.
        let notify = |from: &str| {
            format!(
                "SELECT pg_notify('{channel}', $1 || chr(10) || $2) FROM {from} WHERE waiting_until > {now}"
            )
        };
        Sql {
            create: [
                format!("CREATE SCHEMA IF NOT EXISTS {schema}"),
                format!(
                    "CREATE TABLE IF NOT EXISTS {table} (
                        scope TEXT NOT NULL,
                        key TEXT NOT NULL,
                        state TEXT NOT NULL,
                        fingerprint BYTEA NOT NULL,
                        token BIGINT NOT NULL,
                        lease_until TIMESTAMPTZ NOT NULL,
                        created_at TIMESTAMPTZ NOT NULL,
                        expires_at TIMESTAMPTZ NOT NULL,
                        outcome BYTEA,
                        waiting_until TIMESTAMPTZ NOT NULL DEFAULT '-infinity',
                        PRIMARY KEY (scope, key))"
                ),
                // What `sweep` and `stale` look for, without reading the whole table.
                format!(
                    "CREATE INDEX IF NOT EXISTS \"{prefix}_idempotency_expires\" ON {table} (expires_at)"
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS \"{prefix}_idempotency_lease\" ON {table} (lease_until)
                     WHERE state = 'in_progress'"
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {schema}.\"{prefix}_inbox_cursors\" (
                        consumer TEXT NOT NULL,
                        ordering_key TEXT NOT NULL,
                        last_seq BIGINT NOT NULL,
                        PRIMARY KEY (consumer, ordering_key))"
                ),
            ],
            cursor_insert: statement(format!(
                "INSERT INTO {schema}.\"{prefix}_inbox_cursors\" (consumer, ordering_key, last_seq)
                 VALUES ($1, $2, $3) ON CONFLICT DO NOTHING"
            )),
            cursor_move: statement(format!(
                "UPDATE {schema}.\"{prefix}_inbox_cursors\" SET last_seq = $3
                 WHERE consumer = $1 AND ordering_key = $2 AND last_seq = $3 - 1"
            )),
            cursor_set: statement(format!("UPDATE {schema}.\"{prefix}_inbox_cursors\" SET last_seq = $3 WHERE consumer = $1 AND ordering_key = $2")),
            cursor_read: statement(format!(
                "SELECT last_seq FROM {schema}.\"{prefix}_inbox_cursors\"
                 WHERE consumer = $1 AND ordering_key = $2 FOR UPDATE"
            )),
            // $1 scope, $2 key, $3 fingerprint, $4 lease (s), $5 retention (s). The
            // final read is the statement's snapshot: when the claim did not apply
            // because a concurrent claimer got in first, it may not show that claimer's
            // row yet, and the answer is "in progress" (its lease unknown).
            claim: statement(format!(
                "WITH attempt AS (
                    INSERT INTO {table} AS r
                        (scope, key, state, fingerprint, token, lease_until, created_at, expires_at)
                    VALUES ($1, $2, 'in_progress', $3, {CLOCK_US}, {now} + {lease}, {now}, {now} + {retention})
                    ON CONFLICT (scope, key) DO UPDATE SET
                        state = 'in_progress', fingerprint = EXCLUDED.fingerprint,
                        token = GREATEST(r.token + 1, EXCLUDED.token),
                        lease_until = EXCLUDED.lease_until,
                        created_at = CASE WHEN r.expires_at > {now} THEN r.created_at ELSE EXCLUDED.created_at END,
                        expires_at = CASE WHEN r.expires_at > {now} THEN r.expires_at ELSE EXCLUDED.expires_at END,
                        outcome = NULL
                    WHERE (r.expires_at <= {now} AND NOT (r.state = 'in_progress' AND r.lease_until > {now}))
                       OR (r.fingerprint = EXCLUDED.fingerprint
                           AND (r.state = 'released' OR (r.state = 'in_progress' AND r.lease_until <= {now})))
                    RETURNING token),
                 waiting AS (
                    UPDATE {table} SET waiting_until = GREATEST(waiting_until, lease_until + interval '1 second')
                    WHERE scope = $1 AND key = $2 AND state = 'in_progress'
                      AND NOT EXISTS (SELECT 1 FROM attempt)
                    RETURNING 1)
                 SELECT (SELECT token FROM attempt) AS started, r.state,
                        r.fingerprint = $3 AS same,
                        (r.expires_at > {now} OR (r.state = 'in_progress' AND r.lease_until > {now})) AS live,
                        {lease_left} AS lease_left_ms, r.outcome
                 FROM (SELECT 1) AS one LEFT JOIN {table} AS r ON r.scope = $1 AND r.key = $2",
                lease = secs(4),
                retention = secs(5),
                lease_left = millis_left("r.lease_until"),
            )),
            heartbeat: statement(format!(
                "WITH renewed AS (
                    UPDATE {table} SET lease_until = {now} + {lease},
                        expires_at = GREATEST(expires_at, {now} + {lease})
                    WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_progress'
                    RETURNING 1)
                 SELECT EXISTS (SELECT 1 FROM renewed)
                        -- This claim's own completion landed (its reply may have been
                        -- lost): nothing was taken from it.
                        OR EXISTS (SELECT 1 FROM {table} WHERE scope = $1 AND key = $2
                                AND token = $3 AND state = 'completed') AS renewed,
                        EXISTS (SELECT 1 FROM {table} WHERE scope = $1 AND key = $2
                                AND token <> $3 AND state = 'in_progress') AS taken",
                lease = secs(4),
            )),
            // Kept for the retention from its creation, or from its completion when the
            // work outlived the retention (the retry that is surely coming still gets
            // the replay). In the caller's transaction the commit must wait for the
            // disk whatever the application's connection says: a response is sent
            // once it commits, and a crash must not take the stored outcome (and the
            // work that committed with it) back after the client has been answered.
            complete: statement(format!(
                "WITH done AS (
                    UPDATE {table} SET state = 'completed', outcome = $4, lease_until = {now},
                        expires_at = CASE WHEN created_at + {retention} > {now}
                            THEN created_at + {retention} ELSE {now} + {retention} END
                    WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_progress'
                    RETURNING waiting_until),
                 notified AS ({notify})
                 SELECT (SELECT count(*) FROM done)
                        -- Completed by this claim already (a retry after a lost reply):
                        -- the outcome is recorded, so it is a success. (The statement's
                        -- snapshot does not see its own update.)
                        + (SELECT count(*) FROM {table} WHERE scope = $1 AND key = $2
                           AND token = $3 AND state = 'completed') AS done,
                    (SELECT count(*) FROM notified) AS notified,
                    set_config('synchronous_commit', 'on', true) AS durable",
                retention = secs(5),
                notify = notify("done"),
            )),
            release: statement(format!(
                "WITH done AS (
                    UPDATE {table} SET state = 'released', outcome = NULL, lease_until = {now}
                    WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_progress'
                    RETURNING waiting_until),
                 notified AS ({notify})
                 SELECT (SELECT count(*) FROM done) AS done, (SELECT count(*) FROM notified) AS notified",
                notify = notify("done"),
            )),
            get: statement(format!(
                "SELECT state, fingerprint, token, {lease_left} AS lease_left_ms,
                        {expires_left} AS expires_ms, outcome
                 FROM {table} WHERE scope = $1 AND key = $2 AND state <> 'released'
                   AND (expires_at > {now} OR (state = 'in_progress' AND lease_until > {now}))",
                lease_left = millis_left("lease_until"),
                expires_left = millis_left("expires_at"),
            )),
            // The row stays (its token is the floor of the next claim's); a claim at work
            // on it is fenced out by the bumped token.
            forget: statement(format!(
                "WITH done AS (
                    UPDATE {table} SET state = 'released', token = token + 1, outcome = NULL,
                        lease_until = {now}
                    WHERE scope = $1 AND key = $2 AND state <> 'released' AND expires_at > {now}
                    RETURNING waiting_until),
                 notified AS ({notify})
                 SELECT (SELECT count(*) FROM done) AS done, (SELECT count(*) FROM notified) AS notified",
                notify = notify("done"),
            )),
            sweep: statement(format!(
                "WITH gone AS (
                    DELETE FROM {table} WHERE (scope, key) IN (
                        SELECT scope, key FROM {table}
                        WHERE expires_at <= {now} AND NOT (state = 'in_progress' AND lease_until > {now})
                        LIMIT $1 FOR UPDATE SKIP LOCKED)
                    RETURNING 1)
                 SELECT count(*) FROM gone"
            )),
            stale: statement(format!(
                "SELECT scope, key, token,
                        CEIL(EXTRACT(EPOCH FROM ({now} - lease_until)) * 1000)::int8 AS overdue_ms
                 FROM {table}
                 WHERE state = 'in_progress' AND lease_until <= {now} AND expires_at > {now}
                 ORDER BY lease_until LIMIT $1"
            )),
            channel,
        }
    }
}

/// What a claim statement found: an answer, or a lock timeout on the record's row,
/// which inside a caller's transaction has aborted that transaction.
enum Claimed {
    Answer(ClaimAnswer),
    LockTimedOut,
}

/// Idempotency records in a PostgreSQL table.
#[derive(Clone)]
pub struct PostgresIdempotencyStore {
    ops: PgPool,
    sql: Arc<Sql>,
    signals: ReleaseSignals,
    listener: Arc<Listener>,
    notifications: bool,
    url: String,
}

impl std::fmt::Debug for PostgresIdempotencyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresIdempotencyStore")
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

fn token_of(value: i64) -> FencingToken {
    FencingToken::new(u64::try_from(value).unwrap_or(0))
}

fn seconds(duration: Duration) -> f64 {
    duration.as_secs_f64()
}

impl PostgresIdempotencyStore {
    /// Connects with the URL's `turnstile_*` options (`schema`, `prefix`, `notify`,
    /// `migrate`), creating the table on first use unless `turnstile_migrate=off`.
    pub async fn connect(url: &str) -> Result<Self> {
        let (driver_url, options) = split_url_options(url);
        let (mut schema, mut prefix, mut notify, mut migrate) =
            ("public".to_owned(), "turnstile".to_owned(), true, true);
        for (key, value) in &options {
            let on = || match value.as_str() {
                "on" | "true" | "1" | "yes" => Ok(true),
                "off" | "false" | "0" | "no" => Ok(false),
                _ => Err(unknown_option(key, value, "on or off")),
            };
            match key.as_str() {
                "schema" => schema = value.clone(),
                "prefix" => prefix = value.clone(),
                "notify" => notify = on()?,
                "migrate" => migrate = on()?,
                _ => {
                    return Err(unknown_option(
                        key,
                        value,
                        "turnstile_schema, turnstile_prefix, turnstile_notify, turnstile_migrate",
                    ));
                }
            }
        }
        validate_identifier("schema", &schema)?;
        validate_identifier("table prefix", &prefix)?;
        let redacted = crate::url::redact(&driver_url);
        let options = connect_options(&driver_url)?;
        let timeout = Duration::from_secs(3);
        let ops =
            open_bounded_pool(PgPoolOptions::new(), options.clone(), 8, timeout, &redacted).await?;
        let store = PostgresIdempotencyStore {
            sql: Arc::new(Sql::new(&schema, &prefix)),
            listener: Arc::new(Listener::new(options, timeout)),
            ops,
            signals: ReleaseSignals::new(),
            notifications: notify,
            url: redacted,
        };
        if migrate {
            store.migrate().await?;
        }
        Ok(store)
    }

    /// Creates the schema and table if missing; harmless to repeat and to run from
    /// several processes at once.
    pub async fn migrate(&self) -> Result<()> {
        let fail = |error| map_error(error, "cannot create the idempotency table");
        let mut transaction = self.ops.begin().await.map_err(fail)?;
        sqlx::raw_sql("SET LOCAL lock_timeout = '60s'; SET LOCAL statement_timeout = 0")
            .execute(&mut *transaction)
            .await
            .map_err(fail)?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('turnstile:migrate'))")
            .execute(&mut *transaction)
            .await
            .map_err(fail)?;
        for create in &self.sql.create {
            sqlx::query(sqlx::AssertSqlSafe(create.as_str()))
                .execute(&mut *transaction)
                .await
                .map_err(fail)?;
        }
        transaction.commit().await.map_err(fail)
    }

    /// The claim statement, on the store's pool or inside a caller's transaction.
    async fn claim_on<'e, X>(
        &self,
        executor: X,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        retention: Duration,
    ) -> Result<Claimed>
    where
        X: sqlx::PgExecutor<'e>,
    {
        let row = match sqlx::query(self.sql.claim.sql())
            .bind(scope.as_str())
            .bind(key.as_str())
            .bind(&fingerprint.as_bytes()[..])
            .bind(seconds(lease))
            .bind(seconds(retention))
            .fetch_one(executor)
            .await
        {
            Ok(row) => row,
            // The record's row is locked past the store's lock timeout (a claim of
            // the same key committing slowly): it is at work. Inside a caller's
            // transaction that transaction is now aborted, so nothing more may be
            // asked on it.
            Err(error) if crate::sql::is_lock_timeout(&error) => return Ok(Claimed::LockTimedOut),
            Err(error) => return Err(map_error(error, "cannot claim the idempotency key")),
        };
        if let Some(token) = row.try_get::<Option<i64>, _>("started").map_err(bad)? {
            return Ok(Claimed::Answer(ClaimAnswer::Started {
                token: token_of(token),
            }));
        }
        let state: Option<String> = row.try_get("state").map_err(bad)?;
        let same: Option<bool> = row.try_get("same").map_err(bad)?;
        let live: Option<bool> = row.try_get("live").map_err(bad)?;
        Ok(Claimed::Answer(match (state.as_deref(), same, live) {
            (Some(_), Some(false), Some(true)) => ClaimAnswer::Mismatch,
            (Some("completed"), Some(true), Some(true)) => ClaimAnswer::Replay {
                outcome: row
                    .try_get::<Option<Vec<u8>>, _>("outcome")
                    .map_err(bad)?
                    .unwrap_or_default(),
            },
            (Some("in_progress"), _, _) => ClaimAnswer::InProgress {
                lease_left: duration_ms(row.try_get("lease_left_ms").map_err(bad)?),
            },
            // A claimer that got in first is not in this statement's snapshot yet.
            _ => ClaimAnswer::InProgress { lease_left: None },
        }))
    }

    fn signal_key(scope: &Scope, key: &IdempotencyKey) -> String {
        format!("{}\n{}", scope.as_str(), key.as_str())
    }

    /// Runs a completing statement (`done`, `notified` counts) and wakes same-process
    /// waiters when it changed the record.
    async fn finish(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        query: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
        what: &str,
    ) -> Result<Finish> {
        let row = query
            .fetch_one(&self.ops)
            .await
            .map_err(|error| map_error(error, what))?;
        let done: i64 = row.try_get("done").map_err(bad)?;
        if done == 0 {
            return Ok(Finish::Fenced);
        }
        self.signals.notify(&Self::signal_key(scope, key));
        Ok(Finish::Done)
    }
}

fn record(row: &PgRow) -> Result<Record> {
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
        token: token_of(row.try_get("token").map_err(bad)?),
        lease_left: if in_progress {
            duration_ms(row.try_get("lease_left_ms").map_err(bad)?)
        } else {
            None
        },
        expires_in: duration_ms(row.try_get("expires_ms").map_err(bad)?).unwrap_or_default(),
        outcome: row.try_get("outcome").map_err(bad)?,
    })
}

impl TransactionalIdempotency for PostgresIdempotencyStore {
    type Connection = PgConnection;

    fn advance_cursor<'a>(
        &'a self,
        connection: &'a mut PgConnection,
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
        connection: &'a mut PgConnection,
        consumer: &'a Scope,
        key: &'a str,
        seq: u64,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            sqlx::query(self.sql.cursor_set.sql())
                .bind(consumer.as_str())
                .bind(key)
                .bind(i64::try_from(seq).unwrap_or(i64::MAX))
                .execute(&mut *connection)
                .await
                .map_err(|error| map_error(error, "cannot set the inbox cursor"))?;
            Ok(())
        })
    }

    /// Claims inside the caller's transaction (READ COMMITTED, PostgreSQL's default): a
    /// duplicate claiming at the same time waits on the record's row until this
    /// transaction ends, bounded by its session's `lock_timeout`.
    fn claim_in_transaction<'a>(
        &'a self,
        connection: &'a mut PgConnection,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        fingerprint: &'a Fingerprint,
        options: &'a IdempotencyOptions,
    ) -> BoxFuture<'a, Result<ClaimAnswer>> {
        Box::pin(async move {
            let answer = self
                .claim_on(
                    &mut *connection,
                    scope,
                    key,
                    fingerprint,
                    options.get_lease(),
                    options.get_retention(),
                )
                .await?;
            match answer {
                // The aborted transaction can answer nothing more: the duplicate is
                // at work, and the caller must roll back.
                Claimed::LockTimedOut => return Ok(ClaimAnswer::InProgress { lease_left: None }),
                Claimed::Answer(ClaimAnswer::InProgress { lease_left: None }) => {}
                Claimed::Answer(answer) => return Ok(answer),
            }
            // The claim waited for another transaction's record, which its snapshot
            // predates: look again, now that it has committed.
            let record = sqlx::query(self.sql.get.sql())
                .bind(scope.as_str())
                .bind(key.as_str())
                .fetch_optional(&mut *connection)
                .await
                .map_err(|error| map_error(error, "cannot read the record"))?
                .as_ref()
                .map(record)
                .transpose()?;
            Ok(match record {
                Some(record) if record.fingerprint != *fingerprint => ClaimAnswer::Mismatch,
                Some(Record {
                    state: RecordState::Completed,
                    outcome,
                    ..
                }) => ClaimAnswer::Replay {
                    outcome: outcome.unwrap_or_default(),
                },
                Some(record) => ClaimAnswer::InProgress {
                    lease_left: record.lease_left,
                },
                None => ClaimAnswer::InProgress { lease_left: None },
            })
        })
    }

    fn complete_in_transaction<'a>(
        &'a self,
        connection: &'a mut PgConnection,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        token: FencingToken,
        outcome: &'a [u8],
        options: &'a IdempotencyOptions,
    ) -> BoxFuture<'a, Result<Finish>> {
        Box::pin(async move {
            check_outcome(outcome)?;
            let row = sqlx::query(self.sql.complete.sql())
                .bind(scope.as_str())
                .bind(key.as_str())
                .bind(token.to_i64()?)
                .bind(outcome)
                .bind(seconds(options.get_retention()))
                .fetch_one(&mut *connection)
                .await
                .map_err(|error| map_error(error, "cannot store the outcome"))?;
            let done: i64 = row.try_get("done").map_err(bad)?;
            // Waiters elsewhere are notified at commit (NOTIFY is transactional); those
            // in this process re-check now and wait on the row until the commit.
            self.signals.notify(&Self::signal_key(scope, key));
            Ok(if done == 1 {
                Finish::Done
            } else {
                Finish::Fenced
            })
        })
    }
}

impl IdempotencyStore for PostgresIdempotencyStore {
    fn claim<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        fingerprint: &'a Fingerprint,
        lease: Duration,
        retention: Duration,
    ) -> BoxFuture<'a, Result<ClaimAnswer>> {
        Box::pin(async move {
            Ok(
                match self
                    .claim_on(&self.ops, scope, key, fingerprint, lease, retention)
                    .await?
                {
                    Claimed::Answer(answer) => answer,
                    Claimed::LockTimedOut => ClaimAnswer::InProgress { lease_left: None },
                },
            )
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
            let row = sqlx::query(self.sql.heartbeat.sql())
                .bind(scope.as_str())
                .bind(key.as_str())
                .bind(token.to_i64()?)
                .bind(seconds(lease))
                .fetch_one(&self.ops)
                .await
                .map_err(|error| map_error(error, "cannot renew the idempotency claim"))?;
            let renewed: bool = row.try_get("renewed").map_err(bad)?;
            let taken: bool = row.try_get("taken").map_err(bad)?;
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
            check_outcome(outcome)?;
            let query = sqlx::query(self.sql.complete.sql())
                .bind(scope.as_str())
                .bind(key.as_str())
                .bind(token.to_i64()?)
                .bind(outcome)
                .bind(seconds(retention));
            self.finish(scope, key, query, "cannot store the outcome")
                .await
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
                .bind(token.to_i64()?);
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
                .fetch_optional(&self.ops)
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
            let swept: i64 = sqlx::query_scalar(self.sql.sweep.sql())
                .bind(i64::from(limit))
                .fetch_one(&self.ops)
                .await
                .map_err(|error| map_error(error, "cannot sweep expired records"))?;
            Ok(u64::try_from(swept).unwrap_or(0))
        })
    }

    fn stale(&self, limit: u32) -> BoxFuture<'_, Result<Vec<StaleClaim>>> {
        Box::pin(async move {
            let rows = sqlx::query(self.sql.stale.sql())
                .bind(i64::from(limit))
                .fetch_all(&self.ops)
                .await
                .map_err(|error| map_error(error, "cannot list stale claims"))?;
            rows.iter()
                .map(|row| {
                    Ok(StaleClaim {
                        scope: row.try_get("scope").map_err(bad)?,
                        key: row.try_get("key").map_err(bad)?,
                        token: token_of(row.try_get("token").map_err(bad)?),
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
            let listening =
                self.notifications && self.listener.ensure(&self.sql.channel, &self.signals).await;
            let (watch, _) = self.signals.watch(&Self::signal_key(scope, key));
            Ok(if listening {
                watch
            } else {
                watch.with_poll(POLL_MIN, POLL_MAX)
            })
        })
    }

    fn describe(&self) -> String {
        self.url.clone()
    }
}
