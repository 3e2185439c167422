//! The PostgreSQL engine, lease mode: a lock table with expiry by the database's clock.
//!
//! Every operation is one SQL statement (common table expressions do the checking and
//! the change together), which is what a connection pooler in transaction mode needs;
//! working through one is not tested (see docs/guarantees.md: PgBouncer 1.18 does not work).
//!
//! # Tables
//! `{schema}.{prefix}_locks (name, owner, expires_at, waiting_until)`,
//! `{schema}.{prefix}_tokens (name, token, holder)` (`holder`: session mode's holder),
//! `{schema}.{prefix}_fences (resource, token)` and `{schema}.{prefix}_holder_values
//! (name, owner, value)` (what a holder [proclaims](super::LockBackend::proclaim): an
//! election's leader value), schema `public` and prefix `turnstile`
//! by default. [`migrate`](PostgresLockStore::migrate) creates them; it takes a
//! transaction-scoped advisory lock first, so running it twice, or from two processes at
//! once, is harmless. The store migrates on first use unless told not to.
//!
//! # Guarantees
//! - **Atomicity**: acquire is one `INSERT … ON CONFLICT DO UPDATE … WHERE expired`;
//!   PostgreSQL's row locks make exactly one of any number of contenders win.
//! - **Expiry** is decided by the database server's clock (`clock_timestamp()`), never a
//!   client's. Holders measure their own validity on their monotonic clock from the
//!   moment the request was sent, minus a drift allowance.
//! - **Fencing tokens** are `max(last + 1, database clock in µs since the Unix epoch)`,
//!   kept per name in `{prefix}_tokens` (until [pruned](super::Locker::prune)) and
//!   issued in the same statement that takes the lock.
//! - **Commits** of the store's own statements do **not** wait for the disk by default
//!   (`synchronous_commit = off` on its connections; the application's pool is left
//!   alone). A crash of the database server can then lose the last of them: the
//!   window PostgreSQL documents for asynchronous commit is up to three times
//!   `wal_writer_delay` (200 ms by default); that bound is the server's, not measured
//!   here. What that costs:
//!   - *Tokens* keep growing all the same, **provided the database server's clock never
//!     steps back**: a lost token was at most the clock when it was issued (a token
//!     only runs ahead of the clock with more than one acquisition of a name per
//!     microsecond, or after the clock stepped back), and the first token after the
//!     restart is at least the clock then. Tested: tokens issued just before a crash
//!     (`kill -9`) are all below the first one after the restart.
//!   - A *lost acquisition* is a lost lock: after the restart another owner can take
//!     it; the first holder's next renewal finds it gone and its lost signal fires
//!     (within TTL/3), and its token is the smaller one, so fenced writes refuse it.
//!   - A *lost release* brings the lock back until its lease runs out.
//!   - With [`synchronous_commit(true)`](PostgresLockConfig::synchronous_commit)
//!     (`turnstile_sync_commit=on`), every token is on disk (in the WAL) before the
//!     holder learns it, whatever the clock does: tokens survive restarts and crashes
//!     (tested with a stored token ahead of the clock, so that only the commit can keep
//!     the next one larger), and a failover to a synchronous replica.
//!   - Either way, after a failover to an *asynchronous* replica the last acquisitions
//!     may be lost; the clock floor still keeps new tokens larger as long as the new
//!     primary's clock is not behind the old one's by more than the failover took.
//! - **Bounded statements**: the store's own statements run with `lock_timeout = 250ms`
//!   and `statement_timeout = 10s`; an acquire that meets a transaction-scoped holder's
//!   row lock answers "held" instead of waiting for the transaction.
//! - **Partition**: a holder cut off from the database cannot renew; its lost signal
//!   fires at its local validity deadline, before the database's lease ends.
//! - **Waiting**: waiters `LISTEN` on `{prefix}_released` on one connection per store,
//!   outside the store's pool (reconnected with a backoff from 100 ms to 30 s; waiters
//!   poll while it is down, and a warning is logged), and re-check when the holder's
//!   lease would run out (expiry sends no notification). A waiter marks the lock's row
//!   (`waiting_until`), and a release sends `NOTIFY` only while that mark is fresh: a
//!   `NOTIFY` makes its commit take a database-wide lock, so releases nobody waits for
//!   (most of them) do not serialise with the application's other commits. Behind a pooler in transaction mode,
//!   `LISTEN` does not work (and sqlx's cached prepared statements need PgBouncer 1.21 or
//!   newer with `max_prepared_statements`): set `turnstile_notify=off` (or
//!   [`notifications(false)`](PostgresLockConfig::notifications)) and waiters poll with a
//!   backoff from 5 ms to 100 ms instead.

use std::sync::Arc;
use std::time::Duration;

use crate::engine::postgres::Listener;
use sqlx::Postgres;
use sqlx::Row;
use sqlx::postgres::{PgPool, PgRow};

use super::{
    BoxFuture, ExtendOutcome, HolderAndValue, LockBackend, LockInfo, LockName, OwnerId,
    ReleaseOutcome, ReleaseSignals, ReleaseWatch, TryAcquire, ceil_millis,
};
use crate::error::{Error, ErrorKind, Result};
use crate::fence::FencingToken;
use crate::sql::{
    KeptConnections, Statement, map_error, sent_again_if_gone, statement, validate_identifier,
};
use crate::url::split_url_options;
use sqlx::AssertSqlSafe;

pub(crate) use crate::engine::postgres::CLOCK_US;

const POLL_MIN: Duration = Duration::from_millis(5);
const POLL_MAX: Duration = Duration::from_millis(100);

/// Settings of a [`PostgresLockStore`].
///
/// In a URL they are query options: `postgres://…/db?turnstile_schema=locks&turnstile_prefix=app&turnstile_notify=off&turnstile_migrate=off`.
#[derive(Debug, Clone)]
pub struct PostgresLockConfig {
    schema: String,
    prefix: String,
    notifications: bool,
    migrate: bool,
    max_connections: u32,
    connect_timeout: Duration,
    synchronous_commit: bool,
}

impl Default for PostgresLockConfig {
    fn default() -> Self {
        PostgresLockConfig {
            schema: "public".to_owned(),
            prefix: "turnstile".to_owned(),
            notifications: true,
            migrate: true,
            max_connections: 8,
            connect_timeout: Duration::from_secs(3),
            synchronous_commit: false,
        }
    }
}

impl PostgresLockConfig {
    /// Defaults: schema `public`, table prefix `turnstile`, notifications on, migrate on
    /// first use, 8 connections, 3 s connect timeout.
    pub fn new() -> Self {
        PostgresLockConfig::default()
    }

    /// The schema of Turnstile's tables (created if missing).
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// The first part of Turnstile's table names and of its notification channel.
    pub fn table_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Wake waiters with `LISTEN`/`NOTIFY` (on by default). Turn off behind a pooler in
    /// transaction mode; waiters then poll.
    pub fn notifications(mut self, on: bool) -> Self {
        self.notifications = on;
        self
    }

    /// Create the tables on first use (on by default). Off: run `turnstile migrate`.
    pub fn migrate_on_first_use(mut self, on: bool) -> Self {
        self.migrate = on;
        self
    }

    /// The size of the store's own connection pool. It pings only connections idle for
    /// a second or more; a statement whose connection turns out gone is sent once more
    /// on another.
    pub fn max_connections(mut self, connections: u32) -> Self {
        self.max_connections = connections.max(1);
        self
    }

    /// How long to wait for a connection.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Whether the store's own statements (acquire, renew, release, and the tokens they
    /// issue) wait for their commit to reach the disk (`synchronous_commit = on`). Off
    /// by default: tokens are floored by the database clock, so they keep growing across
    /// a crash that loses the last commits, provided that clock never steps back (see
    /// the module's guarantees). On: every token is on disk before its holder learns
    /// it, whatever the clock does, at the price of a disk flush per acquisition. In a
    /// URL: `turnstile_sync_commit=on`.
    pub fn synchronous_commit(mut self, on: bool) -> Self {
        self.synchronous_commit = on;
        self
    }

    pub(crate) fn is_synchronous_commit(&self) -> bool {
        self.synchronous_commit
    }

    pub(crate) fn apply_url_options(mut self, options: &[(String, String)]) -> Result<Self> {
        for (key, value) in options {
            let on = || match value.as_str() {
                "on" | "true" | "1" | "yes" => Ok(true),
                "off" | "false" | "0" | "no" => Ok(false),
                _ => Err(Error::new(
                    ErrorKind::InvalidUrl,
                    format!("turnstile_{key}={value:?}: expected on or off"),
                )),
            };
            self = match key.as_str() {
                "schema" => self.schema(value.clone()),
                "prefix" => self.table_prefix(value.clone()),
                "notify" => self.notifications(on()?),
                "migrate" => self.migrate_on_first_use(on()?),
                "sync_commit" => self.synchronous_commit(on()?),
                // Chosen by `store::connect` / `PostgresSessionLockStore::connect`.
                "mode" if value == "lease" => self,
                other => {
                    return Err(Error::new(
                        ErrorKind::InvalidUrl,
                        format!(
                            "unknown option turnstile_{other}; known: turnstile_mode, turnstile_schema, turnstile_prefix, turnstile_notify, turnstile_migrate, turnstile_sync_commit"
                        ),
                    ));
                }
            };
        }
        Ok(self)
    }

    fn validate(&self) -> Result<()> {
        validate_identifier("schema", &self.schema)?;
        validate_identifier("table prefix", &self.prefix)
    }
}

/// Qualified, quoted table names and the channel, built once.
#[derive(Debug)]
struct Sql {
    schema: String,
    locks: String,
    tokens: String,
    fences: String,
    /// What each holder advertises (an election's leader value), one row per name,
    /// read only while its owner holds the lock.
    values: String,
    /// The number of permits of each semaphore.
    semaphores: String,
    channel: String,
    declare_permits: Statement,
    stored_permits: Statement,
    forget_permits: Statement,
    acquire: Statement,
    proclaim: Statement,
    inspect_with_value: Statement,
    reclaim: Statement,
    hand_over: Statement,
    prune: Statement,
    extend: Statement,
    release: Statement,
    inspect: Statement,
    force: Statement,
    ensure_row: Statement,
    take_in_transaction: Statement,
    issue_token: Statement,
}

impl Sql {
    fn new(config: &PostgresLockConfig) -> Sql {
        let schema = format!("\"{}\"", config.schema);
        let locks = format!("{schema}.\"{}_locks\"", config.prefix);
        let fences = format!("{schema}.\"{}_fences\"", config.prefix);
        let tokens = format!("{schema}.\"{}_tokens\"", config.prefix);
        let values = format!("{schema}.\"{}_holder_values\"", config.prefix);
        let semaphores = format!("{schema}.\"{}_semaphores\"", config.prefix);
        // A name's token row holds the last token issued for it, which is the holder's
        // while the lock is held. New tokens are `max(last + 1, database clock in µs)`,
        // so they keep increasing even if the row was pruned, and share their range with
        // the other engines.
        // Session mode records its holder on the token row; lease mode's rows have none,
        // and session mode refuses those. The acquire's snapshot shows the session-mode
        // rows committed before it (and the acquire then takes nothing), but not one a
        // session acquire committed since: the upsert waits for that and sees it, and
        // then fails the whole statement (its lease row too) with an error carrying
        // SESSION_MODE_NAME, which `one_mode_per_name` reports. The name in the message
        // keeps the planner from raising it while it folds constants.
        let bump = |from: &str| {
            format!(
                "INSERT INTO {tokens} AS t (name, token) SELECT name, {CLOCK_US} FROM {from}
                 ON CONFLICT (name) DO UPDATE SET token = CASE
                     WHEN t.holder IS NULL THEN GREATEST(t.token + 1, EXCLUDED.token)
                     ELSE ('{SESSION_MODE_NAME}' || t.name)::int8 END
                 RETURNING token"
            )
        };
        let attempt_bump = bump("attempt");
        let moved_bump = bump("moved");
        // NULL for a row written by session mode, whose lease is the session's.
        let remaining = "CASE WHEN isfinite(expires_at) THEN
             GREATEST(0, CEIL(EXTRACT(EPOCH FROM (expires_at - clock_timestamp())) * 1000))::int8 END";
        Sql {
            acquire: statement(format!(
                "WITH attempt AS (
                    INSERT INTO {locks} AS l (name, owner, expires_at)
                    SELECT $1, $2, clock_timestamp() + make_interval(secs => $3::float8 / 1000)
                    WHERE NOT EXISTS (SELECT 1 FROM {tokens} WHERE name = $1 AND holder IS NOT NULL)
                    ON CONFLICT (name) DO UPDATE SET owner = EXCLUDED.owner, expires_at = EXCLUDED.expires_at
                    WHERE isfinite(l.expires_at) AND (l.owner IS NULL OR l.expires_at <= clock_timestamp())
                    RETURNING name),
                 bumped AS ({attempt_bump}),
                 waiting AS (
                    UPDATE {locks} SET waiting_until = GREATEST(waiting_until, expires_at + interval '1 second')
                    WHERE name = $1 AND isfinite(expires_at) AND NOT EXISTS (SELECT 1 FROM attempt)
                    RETURNING 1)
                 SELECT (SELECT token FROM bumped) AS token,
                        (SELECT {remaining} FROM {locks} WHERE name = $1 AND owner IS NOT NULL) AS remaining_ms,
                        (SELECT owner FROM {locks} WHERE name = $1) AS holder,
                        CASE WHEN NOT EXISTS (SELECT 1 FROM bumped) THEN
                          (SELECT NOT isfinite(expires_at) FROM {locks} WHERE name = $1)
                          OR EXISTS (SELECT 1 FROM {tokens} WHERE name = $1 AND holder IS NOT NULL)
                        END AS session_mode"
            )),
            // Only for an owner that already holds the lock: a renewal that also returns
            // the token. Nobody can have been issued a token since the owner took the
            // lock, so the name's last token is the owner's.
            reclaim: statement(format!(
                "WITH renewed AS (
                    UPDATE {locks} SET expires_at = clock_timestamp() + make_interval(secs => $3::float8 / 1000)
                    WHERE name = $1 AND owner = $2 AND expires_at > clock_timestamp()
                    RETURNING 1)
                 SELECT token FROM {tokens} WHERE name = $1 AND EXISTS (SELECT 1 FROM renewed)"
            )),
            hand_over: statement(format!(
                "WITH moved AS (
                    UPDATE {locks} SET owner = $3,
                        expires_at = clock_timestamp() + make_interval(secs => $4::float8 / 1000)
                    WHERE name = $1 AND owner = $2 AND expires_at > clock_timestamp()
                    RETURNING name),
                 bumped AS ({moved_bump})
                 SELECT (SELECT token FROM bumped) AS token"
            )),
            // Lease-mode rows whose lease ended long enough ago; rows a transaction holds
            // are skipped, and session-mode rows are left alone (their lease is the
            // session's, which the table does not see).
            prune: statement(format!(
                "WITH old AS (
                    SELECT name FROM {locks}
                    WHERE isfinite(expires_at)
                      AND expires_at <= clock_timestamp() - make_interval(secs => $1::float8)
                    FOR UPDATE SKIP LOCKED),
                 gone AS (DELETE FROM {locks} l USING old WHERE l.name = old.name RETURNING l.name),
                 tokens_gone AS (
                    DELETE FROM {tokens} t USING gone WHERE t.name = gone.name
                    AND t.token < {CLOCK_US} - ($1::float8 * 1000000)::int8)
                 SELECT count(*) FROM gone"
            )),
            extend: statement(format!(
                "WITH renewed AS (
                    UPDATE {locks} SET expires_at = clock_timestamp() + make_interval(secs => $3::float8 / 1000)
                    WHERE name = $1 AND owner = $2 AND expires_at > clock_timestamp()
                    RETURNING 1)
                 SELECT EXISTS (SELECT 1 FROM renewed) AS renewed,
                        EXISTS (SELECT 1 FROM {locks} WHERE name = $1 AND owner <> $2
                                AND expires_at > clock_timestamp()) AS taken"
            )),
            release: statement(format!(
                "WITH mine AS (
                    SELECT expires_at > clock_timestamp() AS live FROM {locks}
                    WHERE name = $1 AND owner = $2 FOR UPDATE),
                 released AS (
                    UPDATE {locks} SET owner = NULL, expires_at = clock_timestamp()
                    WHERE name = $1 AND owner = $2
                    RETURNING waiting_until),
                 notified AS (
                    SELECT pg_notify($3, $1) FROM released WHERE waiting_until > clock_timestamp())
                 SELECT (SELECT live FROM mine) AS live,
                        (SELECT count(*) FROM notified) AS notified,
                        (SELECT count(*) FROM released) AS released,
                        EXISTS (SELECT 1 FROM {locks} WHERE name = $1 AND owner <> $2
                                AND expires_at > clock_timestamp()) AS taken"
            )),
            inspect: statement(format!(
                "SELECT owner, token, {remaining} AS remaining_ms FROM {locks} JOIN {tokens} USING (name)
                 WHERE name = $1 AND owner IS NOT NULL AND expires_at > clock_timestamp()
                   AND isfinite(expires_at)"
            )),
            force: statement(format!(
                "WITH old AS (
                    SELECT owner, token, {remaining} AS remaining_ms FROM {locks} AS l JOIN {tokens} USING (name)
                    WHERE name = $1 AND owner IS NOT NULL AND expires_at > clock_timestamp()
                      AND isfinite(expires_at)
                    FOR UPDATE OF l),
                 broken AS (
                    UPDATE {locks} SET owner = NULL, expires_at = clock_timestamp()
                    WHERE name = $1 AND EXISTS (SELECT 1 FROM old)
                    RETURNING waiting_until),
                 notified AS (
                    SELECT pg_notify($2, $1) FROM broken WHERE waiting_until > clock_timestamp())
                 SELECT owner, token, remaining_ms, (SELECT count(*) FROM broken) AS broken,
                        (SELECT count(*) FROM notified) AS notified FROM old"
            )),
            ensure_row: statement(format!(
                "INSERT INTO {locks} (name, owner, expires_at) VALUES ($1, NULL, clock_timestamp())
                 ON CONFLICT (name) DO NOTHING"
            )),
            take_in_transaction: statement(format!(
                "SELECT owner IS NOT NULL AND expires_at > clock_timestamp() AS leased
                 FROM {locks} WHERE name = $1 FOR UPDATE"
            )),
            issue_token: statement(format!(
                "INSERT INTO {tokens} AS t (name, token) VALUES ($1, {CLOCK_US})
                 ON CONFLICT (name) DO UPDATE SET token = GREATEST(t.token + 1, EXCLUDED.token)
                 RETURNING token"
            )),
            // Always announced: a value changes rarely, and observers of an election
            // (who are not waiting for the lock, so have left no waiting mark) need to
            // hear of it.
            proclaim: statement(format!(
                "WITH applied AS (
                    INSERT INTO {values} AS v (name, owner, value)
                    SELECT name, owner, $3 FROM {locks}
                    WHERE name = $1 AND owner = $2 AND expires_at > clock_timestamp()
                      AND isfinite(expires_at)
                    ON CONFLICT (name) DO UPDATE SET owner = EXCLUDED.owner, value = EXCLUDED.value
                    RETURNING 1),
                 notified AS (SELECT pg_notify($4, $1) FROM applied)
                 SELECT (SELECT count(*) FROM applied) AS applied,
                        (SELECT count(*) FROM notified) AS notified"
            )),
            inspect_with_value: statement(format!(
                "SELECT l.owner, t.token, {remaining} AS remaining_ms, v.value
                 FROM {locks} l JOIN {tokens} t USING (name)
                 LEFT JOIN {values} v ON v.name = l.name AND v.owner = l.owner
                 WHERE l.name = $1 AND l.owner IS NOT NULL AND l.expires_at > clock_timestamp()
                   AND isfinite(l.expires_at)"
            )),
            declare_permits: statement(format!(
                "INSERT INTO {semaphores} AS s (name, permits) VALUES ($1, $2)
                 ON CONFLICT (name) DO UPDATE SET permits = s.permits
                 RETURNING permits"
            )),
            stored_permits: statement(format!("SELECT permits FROM {semaphores} WHERE name = $1")),
            forget_permits: statement(format!(
                "DELETE FROM {semaphores} WHERE name = $1 RETURNING permits"
            )),
            channel: format!("{}_released", config.prefix),
            schema,
            values,
            semaphores,
            locks,
            tokens,
            fences,
        }
    }
}

/// Locks in a PostgreSQL table (lease mode).
#[derive(Clone)]
pub struct PostgresLockStore {
    /// The store's own statements, with short lock and statement timeouts. With
    /// [`connect`](Self::connect), their connections are kept between statements and
    /// pinged only after a second idle, not at every statement, so each statement is sent
    /// through [`sent_again_if_gone`].
    ops: KeptConnections<Postgres>,
    config: PostgresLockConfig,
    sql: Arc<Sql>,
    signals: ReleaseSignals,
    listener: Arc<Listener>,
    /// For the application's own transactions (see [`pool`](Self::pool)): the store's
    /// connections carry short lock and statement timeouts that must not leak into
    /// them.
    pool: PgPool,
    /// Issues transaction-scoped tokens: apart from `pool`, which callers may fill with
    /// transactions waiting for the very lock whose holder needs a token.
    issuer: PgPool,
    url: String,
}

impl std::fmt::Debug for PostgresLockStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresLockStore")
            .field("url", &self.url)
            .field("config", &self.config)
            .finish()
    }
}

impl PostgresLockStore {
    /// Connects with the settings in the URL's `turnstile_*` options (or the defaults).
    pub async fn connect(url: &str) -> Result<Self> {
        let (driver_url, options) = split_url_options(url);
        let config = PostgresLockConfig::default().apply_url_options(&options)?;
        PostgresLockStore::connect_with(&driver_url, config).await
    }

    /// Connects with `config`; fails within the connect timeout if the database is not
    /// reachable.
    pub async fn connect_with(url: &str, config: PostgresLockConfig) -> Result<Self> {
        config.validate()?;
        let redacted = crate::url::redact(url);
        let options = crate::engine::postgres::connect_options(url)?;
        let app_pool = crate::engine::postgres::lazy_pool(
            options.clone(),
            config.max_connections,
            config.connect_timeout,
        );
        // The application's pool keeps `synchronous_commit` on; the store's own
        // statements follow the configuration.
        let store_options = if config.synchronous_commit {
            options
        } else {
            options.options([("synchronous_commit", "off")])
        };
        // Pinged only when idle: every statement the store sends on it is sent again
        // when its connection turns out gone (see `send`).
        let pool = crate::engine::postgres::open_bounded_pool(
            crate::sql::pool_options(),
            store_options,
            config.max_connections,
            config.connect_timeout,
            &redacted,
        )
        .await?;
        PostgresLockStore::with_pool_described(
            KeptConnections::new(pool),
            app_pool,
            config,
            redacted,
        )
        .await
    }

    /// Uses the application's own pool. Migrates on first use unless configured not to.
    ///
    /// Token durability then depends on the pool's settings, not on
    /// [`synchronous_commit`](PostgresLockConfig::synchronous_commit): with
    /// `synchronous_commit` on (the server's default), every token is on disk before its
    /// holder learns it; with it off, tokens depend on the database clock never stepping
    /// back, as with [`connect`](Self::connect)'s default.
    ///
    /// The pool needs at least two connections: renewals must find one while the
    /// application holds another (say, in a transaction). Notifications use a connection
    /// of their own, made with the pool's settings.
    pub async fn from_pool(pool: PgPool, config: PostgresLockConfig) -> Result<Self> {
        config.validate()?;
        let size = pool.options().get_max_connections();
        if size < 2 {
            return Err(Error::new(
                ErrorKind::InvalidOptions,
                format!(
                    "the application's pool has {size} connection; Turnstile needs at least 2 \
                     (renewals must get one while the application holds another)"
                ),
            ));
        }
        PostgresLockStore::with_pool_described(
            KeptConnections::shared(pool.clone()),
            pool,
            config,
            "postgres (application pool)".to_owned(),
        )
        .await
    }

    async fn with_pool_described(
        ops: KeptConnections<Postgres>,
        app_pool: PgPool,
        config: PostgresLockConfig,
        url: String,
    ) -> Result<Self> {
        let connect_options = (*ops.pool().connect_options()).clone();
        let store = PostgresLockStore {
            sql: Arc::new(Sql::new(&config)),
            listener: Arc::new(Listener::new(
                connect_options.clone(),
                config.connect_timeout,
            )),
            issuer: crate::engine::postgres::lazy_pool(connect_options, 2, config.connect_timeout),
            ops,
            pool: app_pool,
            config,
            signals: ReleaseSignals::new(),
            url,
        };
        if store.config.migrate {
            store.migrate().await?;
        }
        Ok(store)
    }

    /// Creates the schema and tables if missing. Harmless to run again or concurrently:
    /// it holds a transaction-scoped advisory lock while it works.
    pub async fn migrate(&self) -> Result<()> {
        let sql = &self.sql;
        let fail = |error| map_error(error, "cannot create Turnstile's PostgreSQL tables");
        let mut connection = sent_again_if_gone(self.pool_size(), || async {
            let mut connection = self.ops.take().await?;
            sqlx::Connection::ping(&mut *connection).await?;
            Ok(connection)
        })
        .await
        .map_err(fail)?;
        let mut transaction = sqlx::Connection::begin(&mut *connection)
            .await
            .map_err(fail)?;
        // Another process may be migrating: wait for it, longer than the store's usual
        // timeouts allow.
        sqlx::raw_sql("SET LOCAL lock_timeout = '60s'; SET LOCAL statement_timeout = 0")
            .execute(&mut *transaction)
            .await
            .map_err(fail)?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('turnstile:migrate'))")
            .execute(&mut *transaction)
            .await
            .map_err(fail)?;
        for statement in [
            format!("CREATE SCHEMA IF NOT EXISTS {}", sql.schema),
            format!(
                "CREATE TABLE IF NOT EXISTS {} (
                    name TEXT PRIMARY KEY,
                    owner TEXT,
                    expires_at TIMESTAMPTZ NOT NULL)",
                sql.locks
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {} (name TEXT PRIMARY KEY, token BIGINT NOT NULL)",
                sql.tokens
            ),
            // Until when someone waits for the lock: a release notifies only then, since a
            // NOTIFY serialises every committing transaction that sent one. Added only if
            // missing: ALTER TABLE would take an exclusive lock on the table (and wait for
            // every open transaction that touched it) even when there is nothing to do.
            format!(
                "DO $$ BEGIN
                   IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = '{locks}'::regclass
                                  AND attname = 'waiting_until' AND NOT attisdropped) THEN
                     ALTER TABLE {locks} ADD COLUMN waiting_until TIMESTAMPTZ NOT NULL DEFAULT '-infinity';
                   END IF;
                 END $$",
                locks = sql.locks
            ),
            // Who holds a session-mode lock (`owner@backend pid`), kept on the token row
            // that the acquire writes anyway, so a session acquire writes one row, not two.
            format!(
                "DO $$ BEGIN
                   IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = '{tokens}'::regclass
                                  AND attname = 'holder' AND NOT attisdropped) THEN
                     ALTER TABLE {tokens} ADD COLUMN holder TEXT;
                   END IF;
                 END $$",
                tokens = sql.tokens
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {} (resource TEXT PRIMARY KEY, token BIGINT NOT NULL)",
                sql.fences
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {} (name TEXT PRIMARY KEY, owner TEXT NOT NULL, value TEXT NOT NULL)",
                sql.values
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {} (name TEXT PRIMARY KEY, permits BIGINT NOT NULL)",
                sql.semaphores
            ),
        ] {
            sqlx::query(AssertSqlSafe(statement))
                .execute(&mut *transaction)
                .await
                .map_err(fail)?;
        }
        transaction.commit().await.map_err(fail)?;
        connection.keep();
        Ok(())
    }

    /// Takes the lock `name` for the rest of the transaction `transaction` runs on, and
    /// returns its fencing token; the lock is released exactly when that transaction
    /// commits or rolls back.
    ///
    /// The lock is a row lock (`SELECT … FOR UPDATE`) on the lock's row: another
    /// transaction-scoped locker waits for this transaction to end (bounded by the
    /// `lock_timeout` of the caller's session), and a lease acquirer finds the lock held
    /// (within the store's own 250 ms lock timeout). If a lease (a [`LockGuard`](crate::LockGuard)) holds the lock now, this
    /// returns [`ErrorKind::Held`] at once rather than wait for it; roll back and retry.
    /// The token comes from the same per-name counter as lease tokens, and is committed
    /// on its own: a rollback does not give the number back, so tokens stay strictly
    /// increasing whatever the transaction does.
    ///
    /// ```no_run
    /// # async fn demo(store: turnstile::lock::postgres::PostgresLockStore) -> turnstile::Result<()> {
    /// let mut transaction = store.pool().begin().await.unwrap();
    /// let token = store.lock_in_transaction(&mut transaction, "invoice:42").await?;
    /// // ... reads and writes under the lock, passing `token` to fenced stores ...
    /// transaction.commit().await.unwrap(); // releases the lock
    /// # let _ = token;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn lock_in_transaction(
        &self,
        transaction: &mut sqlx::PgConnection,
        name: impl super::IntoLockName,
    ) -> Result<FencingToken> {
        let name = name.into_lock_name()?;
        let fail = |error| map_error(error, "cannot take the transaction-scoped lock");
        sqlx::query(self.sql.ensure_row.sql())
            .bind(name.as_str())
            .execute(&mut *transaction)
            .await
            .map_err(fail)?;
        let leased: bool = sqlx::query_scalar(self.sql.take_in_transaction.sql())
            .bind(name.as_str())
            .fetch_one(&mut *transaction)
            .await
            .map_err(fail)?;
        if leased {
            return Err(Error::new(
                ErrorKind::Held,
                format!("lock \"{name}\" is held by a lease; roll back and try again later"),
            ));
        }
        // The token is issued outside the caller's transaction, on a connection of the
        // store's own (not the shared pool, which callers waiting for this very lock may
        // have exhausted), so that a rollback cannot hand the same number out again. It
        // is on another row than the lock, so this does not wait for the lock we hold.
        let token: i64 = sqlx::query_scalar(self.sql.issue_token.sql())
            .bind(name.as_str())
            .fetch_one(&self.issuer)
            .await
            .map_err(fail)?;
        Ok(FencingToken::new(u64::try_from(token).unwrap_or(0)))
    }

    /// How many connections the store's own pool may hold, all of which a restart of
    /// the server may have ended.
    fn pool_size(&self) -> u32 {
        self.ops.size()
    }

    /// The qualified names of the lock and token tables.
    pub(crate) fn table_names(&self) -> (String, String) {
        (self.sql.locks.clone(), self.sql.tokens.clone())
    }

    /// A pool for the application's own work on this database — transactions that
    /// take [`lock_in_transaction`](Self::lock_in_transaction), fenced writes — with
    /// `synchronous_commit` on and none of the short timeouts the store's own
    /// statements run under. (With [`from_pool`](Self::from_pool), the application's
    /// pool.)
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The fenced-write helper for this store's fence table.
    pub fn fence(&self) -> crate::fence::postgres::PostgresFence {
        crate::fence::postgres::PostgresFence::new(self.sql.fences.clone())
    }

    /// Starts the `LISTEN` connection on first use and says whether it is listening
    /// now (waiters poll while it is not).
    async fn ensure_listener(&self) -> bool {
        self.config.notifications && self.listener.ensure(&self.sql.channel, &self.signals).await
    }

    /// Releases `owner`'s lock; also says whether the release sent a `NOTIFY` (a waiter
    /// had marked the row).
    async fn release_telling(
        &self,
        name: &LockName,
        owner: &OwnerId,
    ) -> Result<(ReleaseOutcome, bool)> {
        // Had a first sending released the lock before its connection died, the
        // second finds it gone and says it had expired: a false alarm, never a
        // release reported that did not happen.
        let row = sent_again_if_gone(self.pool_size(), || {
            sqlx::query(self.sql.release.sql())
                .bind(name.as_str())
                .bind(owner.as_str())
                .bind(&self.sql.channel)
                .fetch_one(&self.ops)
        })
        .await
        .map_err(|error| map_error(error, "cannot release the lock"))?;
        let bad = |error| map_error(error, "bad reply");
        let live: Option<bool> = row.try_get("live").map_err(bad)?;
        let released: i64 = row.try_get("released").map_err(bad)?;
        let taken: bool = row.try_get("taken").map_err(bad)?;
        let notified: i64 = row.try_get("notified").map_err(bad)?;
        if released > 0 {
            // Same-process waiters need not wait for the notification's round trip.
            self.signals.notify(name.as_str());
        }
        let outcome = match (released > 0, live, taken) {
            (true, Some(true), _) => ReleaseOutcome::Released,
            (_, _, true) => ReleaseOutcome::HeldByOther,
            _ => ReleaseOutcome::AlreadyExpired,
        };
        Ok((outcome, notified > 0))
    }

    /// Declares a semaphore's permits in this database's semaphore table (session mode
    /// keeps them there too).
    pub(crate) async fn declare_permits_in_table(
        &self,
        name: &LockName,
        permits: u32,
    ) -> Result<u32> {
        let stored: i64 = sent_again_if_gone(self.pool_size(), || {
            sqlx::query_scalar(self.sql.declare_permits.sql())
                .bind(name.as_str())
                .bind(i64::from(permits))
                .fetch_one(&self.ops)
        })
        .await
        .map_err(|error| map_error(error, "cannot declare the semaphore's permits"))?;
        Ok(u32::try_from(stored).unwrap_or(0))
    }

    /// The permits stored for a semaphore, if any.
    pub(crate) async fn stored_permits_in_table(&self, name: &LockName) -> Result<Option<u32>> {
        let stored: Option<i64> = match sent_again_if_gone(self.pool_size(), || {
            sqlx::query_scalar(self.sql.stored_permits.sql())
                .bind(name.as_str())
                .fetch_optional(&self.ops)
        })
        .await
        {
            Err(error) if crate::sql::is_missing_table(&error) => None,
            other => {
                other.map_err(|error| map_error(error, "cannot read the semaphore's permits"))?
            }
        };
        Ok(stored.map(|permits| u32::try_from(permits).unwrap_or(0)))
    }

    /// Forgets a semaphore's permits (see [`declare_permits_in_table`](Self::declare_permits_in_table)).
    pub(crate) async fn forget_permits_in_table(&self, name: &LockName) -> Result<Option<u32>> {
        let stored: Option<i64> = sent_again_if_gone(self.pool_size(), || {
            sqlx::query_scalar(self.sql.forget_permits.sql())
                .bind(name.as_str())
                .fetch_optional(&self.ops)
        })
        .await
        .map_err(|error| map_error(error, "cannot forget the semaphore's permits"))?;
        Ok(stored.map(|permits| u32::try_from(permits).unwrap_or(0)))
    }

    /// How many release notifications this store's `LISTEN` connection has delivered:
    /// a way to see that waiters are woken by notifications and not by polling.
    pub fn notifications_received(&self) -> u64 {
        self.listener.received()
    }

    /// Whether the `LISTEN` connection is up now (`false` before the first waiter, with
    /// notifications off, or while it reconnects; waiters poll meanwhile).
    pub fn is_listening(&self) -> bool {
        self.listener.is_listening()
    }
}

/// What a lease-mode acquire's failure says when a session-mode acquire took the name
/// as it ran (see the token bump).
const SESSION_MODE_NAME: &str = "turnstile: session mode holds ";

/// Whether `error` is a lease-mode acquire finding that session mode took the name.
fn is_session_mode_name(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .is_some_and(|error| error.message().contains(SESSION_MODE_NAME.trim_end()))
}

/// The error for a lock name taken in one mode and asked for in the other.
pub(crate) fn one_mode_per_name(name: &LockName, used: &str, asked: &str) -> Error {
    Error::new(
        ErrorKind::InvalidOptions,
        format!(
            "lock \"{name}\" is used in {used} mode in this database, so it cannot be taken in {asked} mode; \
             use one mode per name (`turnstile lock prune` forgets names no longer in use)"
        ),
    )
}

fn remaining(row: &PgRow) -> Result<Option<Duration>> {
    let millis: Option<i64> = row
        .try_get("remaining_ms")
        .map_err(|e| map_error(e, "bad reply"))?;
    Ok(millis
        .and_then(|ms| u64::try_from(ms).ok())
        .map(Duration::from_millis))
}

fn holder(row: &PgRow) -> Result<LockInfo> {
    let owner: String = row
        .try_get("owner")
        .map_err(|e| map_error(e, "bad lock row"))?;
    let token: i64 = row
        .try_get("token")
        .map_err(|e| map_error(e, "bad lock row"))?;
    Ok(LockInfo {
        owner,
        fencing_token: Some(FencingToken::new(u64::try_from(token).unwrap_or(0))),
        remaining_ttl: remaining(row)?,
    })
}

fn ttl_millis(ttl: Duration) -> f64 {
    ceil_millis(ttl) as f64
}

impl LockBackend for PostgresLockStore {
    fn try_acquire<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<TryAcquire>> {
        Box::pin(async move {
            // Sent again if its connection was gone: had the first one taken the lock,
            // the second finds it ours and reclaims it below.
            let row = match sent_again_if_gone(self.pool_size(), || {
                sqlx::query(self.sql.acquire.sql())
                    .bind(name.as_str())
                    .bind(owner.as_str())
                    .bind(ttl_millis(ttl))
                    .fetch_one(&self.ops)
            })
            .await
            {
                Ok(row) => row,
                // A transaction-scoped holder keeps the row locked past the store's
                // lock timeout: the lock is held.
                Err(error) if crate::sql::is_lock_timeout(&error) => {
                    return Ok(TryAcquire::Held {
                        remaining_ttl: None,
                    });
                }
                Err(error) if is_session_mode_name(&error) => {
                    return Err(one_mode_per_name(name, "session", "lease"));
                }
                Err(error) => return Err(map_error(error, "cannot acquire the lock")),
            };
            let token: Option<i64> = row
                .try_get("token")
                .map_err(|e| map_error(e, "bad reply"))?;
            if let Some(token) = token {
                return Ok(TryAcquire::Acquired {
                    token: FencingToken::new(u64::try_from(token).unwrap_or(0)),
                });
            }
            let session_mode: Option<bool> = row
                .try_get("session_mode")
                .map_err(|e| map_error(e, "bad reply"))?;
            if session_mode == Some(true) {
                return Err(one_mode_per_name(name, "session", "lease"));
            }
            let holder: Option<String> = row
                .try_get("holder")
                .map_err(|e| map_error(e, "bad reply"))?;
            if holder.as_deref() == Some(owner.as_str()) {
                // Our own earlier request took the lock and its reply was lost.
                let token: Option<i64> = sent_again_if_gone(self.pool_size(), || {
                    sqlx::query_scalar(self.sql.reclaim.sql())
                        .bind(name.as_str())
                        .bind(owner.as_str())
                        .bind(ttl_millis(ttl))
                        .fetch_optional(&self.ops)
                })
                .await
                .map_err(|error| map_error(error, "cannot acquire the lock"))?;
                if let Some(token) = token {
                    return Ok(TryAcquire::Acquired {
                        token: FencingToken::new(u64::try_from(token).unwrap_or(0)),
                    });
                }
            }
            Ok(TryAcquire::Held {
                remaining_ttl: remaining(&row)?,
            })
        })
    }

    fn extend<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<ExtendOutcome>> {
        Box::pin(async move {
            // A renewal sent twice renews twice.
            let row = sent_again_if_gone(self.pool_size(), || {
                sqlx::query(self.sql.extend.sql())
                    .bind(name.as_str())
                    .bind(owner.as_str())
                    .bind(ttl_millis(ttl))
                    .fetch_one(&self.ops)
            })
            .await
            .map_err(|error| map_error(error, "cannot extend the lock"))?;
            let renewed: bool = row
                .try_get("renewed")
                .map_err(|e| map_error(e, "bad reply"))?;
            let taken: bool = row
                .try_get("taken")
                .map_err(|e| map_error(e, "bad reply"))?;
            Ok(ExtendOutcome::from_answers(renewed, taken))
        })
    }

    fn release<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
    ) -> BoxFuture<'a, Result<ReleaseOutcome>> {
        Box::pin(async move { Ok(self.release_telling(name, owner).await?.0) })
    }

    /// Says whether the release's `NOTIFY` went out: it does only while a waiter in
    /// some process has marked the row (`waiting_until`), which this process's own
    /// waiters do not need to do while one of its tasks holds the lock.
    fn release_waking_others<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
    ) -> BoxFuture<'a, Result<(ReleaseOutcome, Option<bool>)>> {
        Box::pin(async move {
            let (outcome, notified) = self.release_telling(name, owner).await?;
            Ok((outcome, self.config.notifications.then_some(notified)))
        })
    }

    fn inspect<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<LockInfo>>> {
        Box::pin(async move {
            let row = match sent_again_if_gone(self.pool_size(), || {
                sqlx::query(self.sql.inspect.sql())
                    .bind(name.as_str())
                    .fetch_optional(&self.ops)
            })
            .await
            {
                // Not migrated yet: nothing was ever locked here.
                Err(error) if crate::sql::is_missing_table(&error) => return Ok(None),
                other => other.map_err(|error| map_error(error, "cannot read the lock"))?,
            };
            row.as_ref().map(holder).transpose()
        })
    }

    fn proclaim<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        value: &'a str,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            // Writing the same value twice is harmless, so a resend is too.
            let applied: i64 = sent_again_if_gone(self.pool_size(), || {
                sqlx::query_scalar(self.sql.proclaim.sql())
                    .bind(name.as_str())
                    .bind(owner.as_str())
                    .bind(value)
                    .bind(&self.sql.channel)
                    .fetch_one(&self.ops)
            })
            .await
            .map_err(|error| map_error(error, "cannot store the holder's value"))?;
            if applied > 0 {
                self.signals.notify(name.as_str());
            }
            Ok(applied > 0)
        })
    }

    fn inspect_with_value<'a>(
        &'a self,
        name: &'a LockName,
    ) -> BoxFuture<'a, Result<Option<HolderAndValue>>> {
        Box::pin(async move {
            let row = match sent_again_if_gone(self.pool_size(), || {
                sqlx::query(self.sql.inspect_with_value.sql())
                    .bind(name.as_str())
                    .fetch_optional(&self.ops)
            })
            .await
            {
                // A database migrated before values existed, opened without migrating:
                // the holder, with no value.
                Err(error) if crate::sql::is_missing_table(&error) => {
                    return Ok(self.inspect(name).await?.map(|info| (info, None)));
                }
                other => other.map_err(|error| map_error(error, "cannot read the lock"))?,
            };
            row.as_ref()
                .map(|row| {
                    let value: Option<String> = row
                        .try_get("value")
                        .map_err(|e| map_error(e, "bad holder value row"))?;
                    Ok((holder(row)?, value))
                })
                .transpose()
        })
    }

    fn keeps_holder_values(&self) -> bool {
        true
    }

    fn declare_permits<'a>(
        &'a self,
        name: &'a LockName,
        permits: u32,
    ) -> BoxFuture<'a, Result<u32>> {
        Box::pin(self.declare_permits_in_table(name, permits))
    }

    fn stored_permits<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<u32>>> {
        Box::pin(self.stored_permits_in_table(name))
    }

    fn forget_permits<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<u32>>> {
        Box::pin(self.forget_permits_in_table(name))
    }

    fn force_release<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<LockInfo>>> {
        Box::pin(async move {
            // Had a first sending broken the lock before its connection died, the second
            // finds it free and reports no holder.
            let row = sent_again_if_gone(self.pool_size(), || {
                sqlx::query(self.sql.force.sql())
                    .bind(name.as_str())
                    .bind(&self.sql.channel)
                    .fetch_optional(&self.ops)
            })
            .await
            .map_err(|error| map_error(error, "cannot break the lock"))?;
            let held = row.as_ref().map(holder).transpose()?;
            if held.is_some() {
                self.signals.notify(name.as_str());
            }
            Ok(held)
        })
    }

    fn watch_releases<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<ReleaseWatch>> {
        Box::pin(async move {
            let listening = self.ensure_listener().await;
            let (watch, _) = self.signals.watch(name.as_str());
            Ok(if listening {
                watch
            } else {
                watch.with_poll(POLL_MIN, POLL_MAX)
            })
        })
    }

    fn migrate(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(PostgresLockStore::migrate(self))
    }

    fn prune(&self, unused_for: Duration) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move {
            let removed: i64 = sent_again_if_gone(self.pool_size(), || {
                sqlx::query_scalar(self.sql.prune.sql())
                    .bind(unused_for.as_secs_f64())
                    .fetch_one(&self.ops)
            })
            .await
            .map_err(|error| map_error(error, "cannot prune unused lock names"))?;
            Ok(u64::try_from(removed).unwrap_or(0))
        })
    }

    /// One statement: the lock passes from `from` to `to` with a new token and is never
    /// free in between. If `from` no longer holds it, a release then an acquire.
    fn hand_over<'a>(
        &'a self,
        name: &'a LockName,
        from: &'a OwnerId,
        to: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(ReleaseOutcome, TryAcquire)>> {
        Box::pin(async move {
            // Had a first sending moved the lock before its connection died, the second
            // finds `to` holding it: the fallback below then reports `from`'s lock as
            // taken (a false alarm) and `to` reclaims it with its token.
            let token: Option<i64> = sent_again_if_gone(self.pool_size(), || {
                sqlx::query_scalar(self.sql.hand_over.sql())
                    .bind(name.as_str())
                    .bind(from.as_str())
                    .bind(to.as_str())
                    .bind(ttl_millis(ttl))
                    .fetch_one(&self.ops)
            })
            .await
            .map_err(|error| map_error(error, "cannot hand the lock over"))?;
            super::backend::moved_or_released(self, token, name, from, to, ttl).await
        })
    }

    fn describe(&self) -> String {
        self.url.clone()
    }
}
