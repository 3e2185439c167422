//! The PostgreSQL engine, lease mode: a lock table with expiry by the database's clock.
//!
//! Every operation is one SQL statement (common table expressions do the checking and
//! the change together), so it works through a connection pooler in transaction mode.
//!
//! # Tables
//! `{schema}.{prefix}_locks (name, owner, expires_at)`,
//! `{schema}.{prefix}_tokens (name, token)` and `{schema}.{prefix}_fences (resource, token)`, schema `public` and prefix `turnstile`
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
//! - **Fencing tokens** are a per-name counter in `{prefix}_tokens` (never deleted),
//!   incremented in the same statement that takes the lock. The store's connections run
//!   with `synchronous_commit = on` whatever the server's default, so every issued token
//!   is on disk (in the WAL) before the holder learns it: tokens survive restarts and
//!   crashes, and a failover to a synchronous replica. After a failover to an *asynchronous* replica, the last acquisitions may be
//!   lost and their tokens issued again; use synchronous replication where that matters.
//! - **Partition**: a holder cut off from the database cannot renew; its lost signal
//!   fires at its local validity deadline, before the database's lease ends.
//! - **Waiting**: releases send `NOTIFY {prefix}_released` with the lock name; waiters
//!   `LISTEN` on one shared connection per store and re-check when the holder's lease
//!   would run out (expiry sends no notification). Behind a pooler in transaction mode,
//!   `LISTEN` does not work (and sqlx's cached prepared statements need PgBouncer 1.21 or
//!   newer with `max_prepared_statements`): set `turnstile_notify=off` (or
//!   [`notifications(false)`](PostgresLockConfig::notifications)) and waiters poll with a
//!   backoff from 5 ms to 100 ms instead.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::Row;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions, PgRow};
use tokio::sync::OnceCell;

use super::{
    BoxFuture, ExtendOutcome, LockBackend, LockInfo, LockName, LossReason, OwnerId, ReleaseOutcome,
    ReleaseSignals, ReleaseWatch, TryAcquire, ceil_millis,
};
use crate::error::{Error, ErrorKind, Result};
use crate::fence::FencingToken;
use crate::sql::{Statement, map_error, split_url_options, statement, validate_identifier};
use sqlx::AssertSqlSafe;

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

    /// The size of the store's own connection pool.
    pub fn max_connections(mut self, connections: u32) -> Self {
        self.max_connections = connections.max(1);
        self
    }

    /// How long to wait for a connection.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
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
                // Chosen by `store::connect` / `PostgresSessionLockStore::connect`.
                "mode" if value == "lease" => self,
                other => {
                    return Err(Error::new(
                        ErrorKind::InvalidUrl,
                        format!(
                            "unknown option turnstile_{other}; known: turnstile_mode, turnstile_schema, turnstile_prefix, turnstile_notify, turnstile_migrate"
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
    channel: String,
    acquire: Statement,
    reclaim: Statement,
    hand_over: Statement,
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
        // A lock row's token is the last one issued for its name, which is the holder's
        // while the lock is held.
        let bump = format!(
            "INSERT INTO {tokens} AS t (name, token) SELECT name, 1 FROM attempt
             ON CONFLICT (name) DO UPDATE SET token = t.token + 1
             RETURNING token"
        );
        let remaining =
            "GREATEST(0, CEIL(EXTRACT(EPOCH FROM (expires_at - clock_timestamp())) * 1000))::int8";
        Sql {
            acquire: statement(format!(
                "WITH attempt AS (
                    INSERT INTO {locks} AS l (name, owner, expires_at)
                    VALUES ($1, $2, clock_timestamp() + make_interval(secs => $3::float8 / 1000))
                    ON CONFLICT (name) DO UPDATE SET owner = EXCLUDED.owner, expires_at = EXCLUDED.expires_at
                    WHERE l.owner IS NULL OR l.expires_at <= clock_timestamp()
                    RETURNING name),
                 bumped AS ({bump})
                 SELECT (SELECT token FROM bumped) AS token,
                        (SELECT {remaining} FROM {locks} WHERE name = $1 AND owner IS NOT NULL) AS remaining_ms,
                        (SELECT owner FROM {locks} WHERE name = $1) AS holder"
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
                 bumped AS (
                    INSERT INTO {tokens} AS t (name, token) SELECT name, 1 FROM moved
                    ON CONFLICT (name) DO UPDATE SET token = t.token + 1
                    RETURNING token)
                 SELECT (SELECT token FROM bumped) AS token"
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
                    RETURNING pg_notify($3, $1))
                 SELECT (SELECT live FROM mine) AS live,
                        (SELECT count(*) FROM released) AS released,
                        EXISTS (SELECT 1 FROM {locks} WHERE name = $1 AND owner <> $2
                                AND expires_at > clock_timestamp()) AS taken"
            )),
            inspect: statement(format!(
                "SELECT owner, token, {remaining} AS remaining_ms FROM {locks} JOIN {tokens} USING (name)
                 WHERE name = $1 AND owner IS NOT NULL AND expires_at > clock_timestamp()"
            )),
            force: statement(format!(
                "WITH old AS (
                    SELECT owner, token, {remaining} AS remaining_ms FROM {locks} AS l JOIN {tokens} USING (name)
                    WHERE name = $1 AND owner IS NOT NULL AND expires_at > clock_timestamp()
                    FOR UPDATE OF l),
                 broken AS (
                    UPDATE {locks} SET owner = NULL, expires_at = clock_timestamp()
                    WHERE name = $1 AND EXISTS (SELECT 1 FROM old)
                    RETURNING pg_notify($2, $1))
                 SELECT owner, token, remaining_ms, (SELECT count(*) FROM broken) AS broken FROM old"
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
                "INSERT INTO {tokens} AS t (name, token) VALUES ($1, 1)
                 ON CONFLICT (name) DO UPDATE SET token = t.token + 1
                 RETURNING token"
            )),
            channel: format!("{}_released", config.prefix),
            schema,
            locks,
            tokens,
            fences,
        }
    }
}

/// Locks in a PostgreSQL table (lease mode).
#[derive(Clone)]
pub struct PostgresLockStore {
    pool: PgPool,
    config: PostgresLockConfig,
    sql: Arc<Sql>,
    signals: ReleaseSignals,
    listener: Arc<OnceCell<bool>>,
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
        let redacted = crate::store::redact(url);
        let options = PgConnectOptions::from_str(url).map_err(|error| {
            Error::new(
                ErrorKind::InvalidUrl,
                format!("{redacted} is not a valid PostgreSQL URL (postgres://user[:password]@host[:port]/database)"),
            )
            .with_source(error)
        })?;
        // Tokens must survive a crash even where the server runs with
        // synchronous_commit = off: a lost commit would issue a token again.
        let options = options.options([("synchronous_commit", "on")]);
        let pool = PgPoolOptions::new()
            .max_connections(config.max_connections)
            .acquire_timeout(config.connect_timeout)
            .connect_with(options)
            .await
            .map_err(|error| {
                let mut error = map_error(
                    error,
                    &format!("cannot connect to PostgreSQL at {redacted}"),
                );
                if error.kind() == ErrorKind::Store {
                    error = Error::new(
                        ErrorKind::StoreUnavailable,
                        format!("cannot connect to PostgreSQL at {redacted}"),
                    )
                    .with_source(error);
                }
                error
            })?;
        PostgresLockStore::with_pool_described(pool, config, redacted).await
    }

    /// Uses the application's own pool. Migrates on first use unless configured not to.
    ///
    /// Token durability then depends on the pool's settings: keep `synchronous_commit`
    /// on (the server's default) for its connections, or a crash can lose the last
    /// acquisitions and issue their tokens again. [`connect`](Self::connect) sets it on
    /// its own connections whatever the server's default.
    pub async fn from_pool(pool: PgPool, config: PostgresLockConfig) -> Result<Self> {
        config.validate()?;
        PostgresLockStore::with_pool_described(
            pool,
            config,
            "postgres (application pool)".to_owned(),
        )
        .await
    }

    async fn with_pool_described(
        pool: PgPool,
        config: PostgresLockConfig,
        url: String,
    ) -> Result<Self> {
        let store = PostgresLockStore {
            sql: Arc::new(Sql::new(&config)),
            pool,
            config,
            signals: ReleaseSignals::new(),
            listener: Arc::new(OnceCell::new()),
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
        let mut transaction = self.pool.begin().await.map_err(fail)?;
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
            format!(
                "CREATE TABLE IF NOT EXISTS {} (resource TEXT PRIMARY KEY, token BIGINT NOT NULL)",
                sql.fences
            ),
        ] {
            sqlx::query(AssertSqlSafe(statement))
                .execute(&mut *transaction)
                .await
                .map_err(fail)?;
        }
        transaction.commit().await.map_err(fail)
    }

    /// Takes the lock `name` for the rest of the transaction `transaction` runs on, and
    /// returns its fencing token; the lock is released exactly when that transaction
    /// commits or rolls back.
    ///
    /// The lock is a row lock (`SELECT … FOR UPDATE`) on the lock's row: another
    /// transaction-scoped locker waits for this transaction to end (bounded by the
    /// server's `lock_timeout`), and a lease acquirer waits too and then finds the lock
    /// free. If a lease (a [`LockGuard`](crate::LockGuard)) holds the lock now, this
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
        // The token is issued outside the caller's transaction, on the store's own
        // connection, so that a rollback cannot hand the same number out again. It is on
        // another row than the lock, so this does not wait for the lock we now hold.
        let token: i64 = sqlx::query_scalar(self.sql.issue_token.sql())
            .bind(name.as_str())
            .fetch_one(&self.pool)
            .await
            .map_err(fail)?;
        Ok(FencingToken::new(u64::try_from(token).unwrap_or(0)))
    }

    /// The qualified names of the lock and token tables.
    pub(crate) fn table_names(&self) -> (String, String) {
        (self.sql.locks.clone(), self.sql.tokens.clone())
    }

    /// The connection pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The fenced-write helper for this store's fence table.
    pub fn fence(&self) -> crate::fence::postgres::PostgresFence {
        crate::fence::postgres::PostgresFence::new(self.sql.fences.clone())
    }

    /// Starts the shared `LISTEN` connection once; `false` if it could not be started
    /// (waiters then poll).
    async fn ensure_listener(&self) -> bool {
        if !self.config.notifications {
            return false;
        }
        *self
            .listener
            .get_or_init(|| async {
                let Ok(mut listener) = PgListener::connect_with(&self.pool).await else {
                    return false;
                };
                if listener.listen(&self.sql.channel).await.is_err() {
                    return false;
                }
                let signals = self.signals.clone();
                tokio::spawn(async move {
                    loop {
                        match listener.try_recv().await {
                            Ok(Some(notification)) => signals.notify(notification.payload()),
                            // The connection dropped and is re-established on the next
                            // call: notifications may have been missed, so everyone
                            // re-checks.
                            Ok(None) => signals.notify_all(),
                            Err(_) => {
                                signals.notify_all();
                                tokio::time::sleep(Duration::from_millis(200)).await;
                            }
                        }
                    }
                });
                true
            })
            .await
    }
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
        fencing_token: FencingToken::new(u64::try_from(token).unwrap_or(0)),
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
            let row = sqlx::query(self.sql.acquire.sql())
                .bind(name.as_str())
                .bind(owner.as_str())
                .bind(ttl_millis(ttl))
                .fetch_one(&self.pool)
                .await
                .map_err(|error| map_error(error, "cannot acquire the lock"))?;
            let token: Option<i64> = row
                .try_get("token")
                .map_err(|e| map_error(e, "bad reply"))?;
            if let Some(token) = token {
                return Ok(TryAcquire::Acquired {
                    token: FencingToken::new(u64::try_from(token).unwrap_or(0)),
                });
            }
            let holder: Option<String> = row
                .try_get("holder")
                .map_err(|e| map_error(e, "bad reply"))?;
            if holder.as_deref() == Some(owner.as_str()) {
                // Our own earlier request took the lock and its reply was lost.
                let token: Option<i64> = sqlx::query_scalar(self.sql.reclaim.sql())
                    .bind(name.as_str())
                    .bind(owner.as_str())
                    .bind(ttl_millis(ttl))
                    .fetch_optional(&self.pool)
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
            let row = sqlx::query(self.sql.extend.sql())
                .bind(name.as_str())
                .bind(owner.as_str())
                .bind(ttl_millis(ttl))
                .fetch_one(&self.pool)
                .await
                .map_err(|error| map_error(error, "cannot extend the lock"))?;
            let renewed: bool = row
                .try_get("renewed")
                .map_err(|e| map_error(e, "bad reply"))?;
            let taken: bool = row
                .try_get("taken")
                .map_err(|e| map_error(e, "bad reply"))?;
            Ok(match (renewed, taken) {
                (true, _) => ExtendOutcome::Extended,
                (false, true) => ExtendOutcome::Lost(LossReason::TakenOver),
                (false, false) => ExtendOutcome::Lost(LossReason::Expired),
            })
        })
    }

    fn release<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
    ) -> BoxFuture<'a, Result<ReleaseOutcome>> {
        Box::pin(async move {
            let row = sqlx::query(self.sql.release.sql())
                .bind(name.as_str())
                .bind(owner.as_str())
                .bind(&self.sql.channel)
                .fetch_one(&self.pool)
                .await
                .map_err(|error| map_error(error, "cannot release the lock"))?;
            let live: Option<bool> = row.try_get("live").map_err(|e| map_error(e, "bad reply"))?;
            let released: i64 = row
                .try_get("released")
                .map_err(|e| map_error(e, "bad reply"))?;
            let taken: bool = row
                .try_get("taken")
                .map_err(|e| map_error(e, "bad reply"))?;
            if released > 0 {
                // Same-process waiters need not wait for the notification's round trip.
                self.signals.notify(name.as_str());
            }
            Ok(match (released > 0, live, taken) {
                (true, Some(true), _) => ReleaseOutcome::Released,
                (_, _, true) => ReleaseOutcome::HeldByOther,
                _ => ReleaseOutcome::AlreadyExpired,
            })
        })
    }

    fn inspect<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<LockInfo>>> {
        Box::pin(async move {
            let row = sqlx::query(self.sql.inspect.sql())
                .bind(name.as_str())
                .fetch_optional(&self.pool)
                .await
                .map_err(|error| map_error(error, "cannot read the lock"))?;
            row.as_ref().map(holder).transpose()
        })
    }

    fn force_release<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<LockInfo>>> {
        Box::pin(async move {
            let row = sqlx::query(self.sql.force.sql())
                .bind(name.as_str())
                .bind(&self.sql.channel)
                .fetch_optional(&self.pool)
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
            let token: Option<i64> = sqlx::query_scalar(self.sql.hand_over.sql())
                .bind(name.as_str())
                .bind(from.as_str())
                .bind(to.as_str())
                .bind(ttl_millis(ttl))
                .fetch_one(&self.pool)
                .await
                .map_err(|error| map_error(error, "cannot hand the lock over"))?;
            match token {
                Some(token) => Ok((
                    ReleaseOutcome::Released,
                    TryAcquire::Acquired {
                        token: FencingToken::new(u64::try_from(token).unwrap_or(0)),
                    },
                )),
                None => {
                    let released = self.release(name, from).await?;
                    Ok((released, self.try_acquire(name, to, ttl).await?))
                }
            }
        })
    }

    fn describe(&self) -> String {
        self.url.clone()
    }
}
