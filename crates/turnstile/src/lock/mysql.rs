//! The MySQL / MariaDB engine: `GET_LOCK()` named locks on a dedicated connection.
//!
//! Each held lock owns one connection from a session pool. The lock lives exactly as
//! long as that connection's session: the server frees it when the session ends —
//! release, a crash of the holder, a network failure, an operator's `KILL`.
//!
//! # The lease
//! A named lock has no expiry of its own, so the TTL becomes the session's
//! `wait_timeout`: a holder that stops talking to the server (crashed, paused, cut off)
//! loses its session, and with it the lock, after the TTL **rounded up to whole
//! seconds**, measured by the server. The watchdog's renewal is a ping on the session
//! that also checks the lock is still held by it (`IS_USED_LOCK(key) = CONNECTION_ID()`).
//! The client also enforces the lease: a guard that asks the engine anything after its
//! TTL has passed without contact finds its session closed and the lock gone.
//!
//! # Names
//! MySQL lock names are at most 64 characters and compared without regard to case.
//! Names of up to 60 characters from `a-z 0-9 _ : . / -` are used as they are (after
//! `ts:`); every other name is replaced by `ts#` and 61 hex digits of its SHA-256, so two
//! different names never share a lock (short of a SHA-256 collision).
//!
//! # Guarantees
//! - **Atomicity**: `GET_LOCK(key, 0)` is atomic in the server.
//! - **Fencing tokens**: `max(last + 1, server clock in µs since the Unix epoch)`, kept
//!   per name in `{prefix}_tokens` (until [pruned](super::Locker::prune)) and issued by
//!   the holder's session in the same round trip as `GET_LOCK`, before the holder learns
//!   it.
//!   - By default `{prefix}_tokens` is a **`MEMORY` table**, so issuing a token writes
//!     nothing to disk and waits for no log flush (InnoDB has no per-session way to skip
//!     the flush at commit). A restart empties the table; the next token of a name is
//!     then the clock. Tokens therefore keep growing across restarts and crashes
//!     **provided the database server's clock never steps back**: a token issued
//!     before was at most the clock then (it only runs ahead of the clock with more than
//!     one acquisition of a name per microsecond), and the restart takes far longer
//!     than that. Tested: tokens issued before a `kill -9` are all below the first one
//!     after the restart. A restart frees every named lock anyway (see below), so the
//!     table holds nothing else worth keeping.
//!   - The table is created with room for 1 GiB of rows (`max_heap_table_size` at
//!     creation), about 1.7 million names; names unused for a while are forgotten by
//!     [`prune`](super::Locker::prune), and a full table is reported as such.
//!   - `MEMORY` tables are not replicated by Galera, and a replica's copy is emptied
//!     when it restarts: after a failover the clock floor alone keeps new tokens larger,
//!     as long as the new server's clock is not behind the old one's by more than the
//!     failover took.
//!   - With [`synchronous_tokens(true)`](MysqlLockConfig::synchronous_tokens)
//!     (`turnstile_sync_commit=on`) the table is created as InnoDB instead: tokens are
//!     then as durable as an InnoDB commit (with `innodb_flush_log_at_trx_commit = 1`,
//!     the default, they survive any crash whatever the clock does), at the price of a
//!     log flush per acquisition. The choice is made when the table is created; an
//!     existing table keeps its engine (`ALTER TABLE {prefix}_tokens ENGINE = MEMORY`
//!     or `= InnoDB` changes it, keeping its rows).
//! - **Transaction-scoped locks** ([`lock_in_transaction`](MysqlLockStore::lock_in_transaction))
//!   lock the name's row in `{prefix}_xact_locks` and only then issue their token; a
//!   named-lock acquirer checks that row with `NOWAIT` right after `GET_LOCK` and answers
//!   "held" while a transaction has it. A fresh session's acquire checks every name;
//!   the one-statement acquire of a session used before checks only names marked (in
//!   their token row) as used with transaction-scoped locks: a transaction-scoped locker
//!   sets the mark before it looks at the named lock, and the acquirer reads it after
//!   taking the named lock, in one statement, so one of the two always sees the other.
//!   Marks are never removed, and [`prune`](super::Locker::prune) keeps the rows of
//!   marked names (deleting one could let an unmarked row replace it while a
//!   transaction holds the lock). During an upgrade from an older version, no older
//!   process may run `lock_in_transaction` or `prune` while newer ones take named
//!   locks: older versions neither set nor keep the mark.
//! - **Expiry**: the server's clock (`wait_timeout`), in whole seconds.
//! - **Restart / failover**: a restart ends every session, so every lock is freed and
//!   every holder's next renewal fails: the lost signal fires within TTL/3. Named locks
//!   are not replicated: after a failover another client can take a lock at once, and
//!   the old holder learns of its loss at its next renewal. Fencing tokens (replicated
//!   with the table) keep its late writes out, subject to the replica having the row.
//! - **Partition**: the holder's renewals fail and its lost signal fires at its local
//!   validity deadline; the server frees the lock when `wait_timeout` passes.
//! - **Waiting**: waiters in the same process are woken directly by a release; waiters in
//!   other processes re-check with a backoff from 5 ms doubling to 100 ms.
//! - `turnstile lock break` ends the holder's session with `KILL CONNECTION`, which needs
//!   the `CONNECTION ADMIN` (or `SUPER`) privilege for other users' sessions. MySQL
//!   cannot kill conditionally: the holder is checked again right before the `KILL`,
//!   but a holder that releases in the microseconds between, and whose session is
//!   reused for another lock at once, would lose that other lock (its lost signal fires
//!   and fencing keeps its writes out).

use std::sync::Arc;
use std::time::Duration;

use futures_util::TryStreamExt;
use sha2::{Digest, Sha256};
use sqlx::mysql::{MySql, MySqlPool, MySqlPoolOptions, MySqlQueryResult, MySqlRow};
use sqlx::{AssertSqlSafe, Either, Row};
use tokio::time::Instant;

use super::session::{self, Dedicated, HeldSessions, SessionEngine};
use super::{
    BoxFuture, ExtendOutcome, LockBackend, LockInfo, LockName, OwnerId, ReleaseOutcome,
    ReleaseSignals, ReleaseWatch, TryAcquire,
};
use crate::engine::mysql::{CLOCK_US, connect_options, open_pool, server_error_number};
use crate::error::{Error, ErrorKind, Result};
use crate::fence::FencingToken;
use crate::hex::hex;
use crate::sql::{
    KeptConnections, SessionFacts, Statement, map_error, sent_again_if_gone, statement,
    validate_identifier,
};
use crate::url::split_url_options;

const POLL_MIN: Duration = Duration::from_millis(5);
const POLL_MAX: Duration = Duration::from_millis(100);

/// Settings of a [`MysqlLockStore`].
///
/// In a URL: `mysql://…/db?turnstile_prefix=app&turnstile_migrate=off`.
#[derive(Debug, Clone)]
pub struct MysqlLockConfig {
    prefix: String,
    migrate: bool,
    max_connections: u32,
    max_held: u32,
    connect_timeout: Duration,
    synchronous_tokens: bool,
}

impl Default for MysqlLockConfig {
    fn default() -> Self {
        MysqlLockConfig {
            prefix: "turnstile".to_owned(),
            migrate: true,
            max_connections: 8,
            max_held: 64,
            connect_timeout: Duration::from_secs(3),
            synchronous_tokens: false,
        }
    }
}

impl MysqlLockConfig {
    /// Defaults: table prefix `turnstile`, migrate on first use, 8 shared connections, at
    /// most 64 locks held at once (one session each), 3 s connect timeout.
    pub fn new() -> Self {
        MysqlLockConfig::default()
    }

    /// The first part of Turnstile's table names.
    pub fn table_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Create the tables on first use (on by default).
    pub fn migrate_on_first_use(mut self, on: bool) -> Self {
        self.migrate = on;
        self
    }

    /// How many locks this store may hold at once: each needs its own session. With
    /// that many held, a further acquire waits for one of them to be released; it fails
    /// with [`ErrorKind::StoreUnavailable`] when its wait bound or the connect timeout
    /// passes first.
    pub fn max_held_locks(mut self, locks: u32) -> Self {
        self.max_held = locks.max(1);
        self
    }

    /// How long to wait for a connection.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Whether a new tokens table is an InnoDB table, so that every token is on disk
    /// before its holder learns it (a log flush per acquisition), rather than a `MEMORY`
    /// table floored by the server's clock (the default; see the module's guarantees).
    /// It decides the engine when the table is created. In a URL:
    /// `turnstile_sync_commit=on`.
    pub fn synchronous_tokens(mut self, on: bool) -> Self {
        self.synchronous_tokens = on;
        self
    }

    fn apply_url_options(mut self, options: &[(String, String)]) -> Result<Self> {
        for (key, value) in options {
            self = match (key.as_str(), value.as_str()) {
                ("prefix", _) => self.table_prefix(value.clone()),
                ("migrate", "on" | "true" | "1") => self.migrate_on_first_use(true),
                ("migrate", "off" | "false" | "0") => self.migrate_on_first_use(false),
                ("sync_commit", "on" | "true" | "1") => self.synchronous_tokens(true),
                ("sync_commit", "off" | "false" | "0") => self.synchronous_tokens(false),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidUrl,
                        format!(
                            "unknown or invalid option turnstile_{key}={value:?}; known: turnstile_prefix, turnstile_migrate=on|off, turnstile_sync_commit=on|off"
                        ),
                    ));
                }
            };
        }
        Ok(self)
    }
}

/// The server-side lock key for a name (see the module docs).
pub fn lock_key(name: &LockName) -> String {
    let text = name.as_str();
    let plain = text.len() <= 60
        && text
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_:./-".contains(&b));
    if plain {
        format!("ts:{text}")
    } else {
        let digest = Sha256::digest(text.as_bytes());
        format!("ts#{}", &hex(&digest)[..61])
    }
}

type Session = super::session::Session<Dedicated<MySql>, String>;

struct Sql {
    tokens: String,
    xact_locks: String,
    /// One statement (see `fast_acquire`).
    fast_acquire: Statement,
    /// After `fast_acquire` met a name used with transaction-scoped locks.
    check_xact_row: Statement,
    issue_to_holder: Statement,
    /// Step 0 of a transaction-scoped lock.
    mark_xact_used: Statement,
    has_xact_used_column: Statement,
    add_xact_used_column: Statement,
    mark_all_xact_used: Statement,
    issue_token: Statement,
    xact_row_exists: Statement,
    prune_tokens: Statement,
    orphan_xact_rows: Statement,
    delete_xact_row: Statement,
    create_xact_row: Statement,
    take_in_transaction: Statement,
    holder: Statement,
    create: [Statement; 5],
    semaphores: String,
    fences: String,
}

/// Locks as MySQL / MariaDB named locks.
#[derive(Clone)]
pub struct MysqlLockStore {
    pool: MySqlPool,
    sessions: KeptConnections<MySql>,
    /// Issues transaction-scoped tokens: apart from `pool`, which callers may fill with
    /// transactions waiting for the very lock whose holder needs a token.
    issuer: MySqlPool,
    held: Arc<HeldSessions<Dedicated<MySql>, String>>,
    sql: Arc<Sql>,
    signals: ReleaseSignals,
    url: String,
}

impl std::fmt::Debug for MysqlLockStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MysqlLockStore")
            .field("url", &self.url)
            .finish()
    }
}

fn unavailable(error: sqlx::Error, what: &str) -> Error {
    let error = map_error(error, what);
    if error.kind() == ErrorKind::Store {
        Error::new(ErrorKind::StoreUnavailable, what.to_owned()).with_source(error)
    } else {
        error
    }
}

impl MysqlLockStore {
    /// Connects with the settings in the URL's `turnstile_*` options (or the defaults).
    pub async fn connect(url: &str) -> Result<Self> {
        let (driver_url, options) = split_url_options(url);
        let config = MysqlLockConfig::default().apply_url_options(&options)?;
        MysqlLockStore::connect_with(&driver_url, config).await
    }

    /// Connects with `config`; fails within the connect timeout if the server is not
    /// reachable.
    pub async fn connect_with(url: &str, config: MysqlLockConfig) -> Result<Self> {
        validate_identifier("table prefix", &config.prefix)?;
        let redacted = crate::url::redact(url);
        let options = connect_options(url)?;
        let pool = open_pool(
            &options,
            config.max_connections,
            config.connect_timeout,
            &redacted,
            &[],
        )
        .await?;
        let sessions = crate::sql::pool_options::<MySql>()
            .max_connections(config.max_held)
            .min_connections(0)
            .acquire_timeout(config.connect_timeout)
            .connect_lazy_with(options.clone());
        // A lock's session goes back on this shelf when the lock is released, not to
        // the pool, which would ping it on the way in.
        let sessions = KeptConnections::new(sessions);
        // Its statements never wait long for a row lock: creating a name's row can meet
        // a transaction that holds it (then the row exists and the wait is pointless).
        let issuer = MySqlPoolOptions::new()
            .max_connections(4)
            .min_connections(0)
            .acquire_timeout(config.connect_timeout)
            .after_connect(|connection, _| {
                Box::pin(async move {
                    sqlx::query("SET SESSION innodb_lock_wait_timeout = 1")
                        .execute(connection)
                        .await
                        .map(|_| ())
                })
            })
            .connect_lazy_with(options);
        let fences = format!("`{}_fences`", config.prefix);
        let tokens = format!("`{}_tokens`", config.prefix);
        let xact_locks = format!("`{}_xact_locks`", config.prefix);
        let semaphores = format!("`{}_semaphores`", config.prefix);
        // `token` is the last token issued for the name; `holder_token`, `owner` and
        // `connection_id` describe the named-lock holder that took it last.
        let sql = Sql {
            fast_acquire: statement(format!(
                "INSERT INTO {tokens} (name, token, holder_token, owner, connection_id)
                 SELECT ?, LAST_INSERT_ID({CLOCK_US}), {CLOCK_US}, ?, CONNECTION_ID() FROM DUAL
                   WHERE GET_LOCK(?, 0) = 1
                 ON DUPLICATE KEY UPDATE
                   token = IF(xact_used, token + 0 * LAST_INSERT_ID({XACT_USED_MARK}),
                              LAST_INSERT_ID(GREATEST(token + 1, {CLOCK_US}))),
                   holder_token = IF(xact_used, holder_token, token),
                   owner = IF(xact_used, owner, ?),
                   connection_id = IF(xact_used, connection_id, CONNECTION_ID())"
            )),
            check_xact_row: statement(format!(
                "SELECT COUNT(*) FROM {xact_locks} WHERE name = ? FOR UPDATE NOWAIT"
            )),
            issue_to_holder: statement(format!(
                "UPDATE {tokens} SET token = LAST_INSERT_ID(GREATEST(token + 1, {CLOCK_US})),
                   holder_token = token, owner = ?, connection_id = CONNECTION_ID()
                 WHERE name = ?"
            )),
            // The row is given a token of the clock if it is new: no holder has it, and
            // the next token is larger.
            mark_xact_used: statement(format!(
                "INSERT INTO {tokens} (name, token, xact_used) VALUES (?, {CLOCK_US}, TRUE)
                 ON DUPLICATE KEY UPDATE xact_used = TRUE"
            )),
            has_xact_used_column: statement(format!(
                "SELECT COUNT(*) FROM information_schema.columns
                 WHERE table_schema = DATABASE() AND table_name = '{}_tokens'
                   AND column_name = 'xact_used'",
                config.prefix
            )),
            add_xact_used_column: statement(format!(
                "ALTER TABLE {tokens} ADD COLUMN xact_used BOOLEAN NOT NULL DEFAULT FALSE"
            )),
            // Names used with transaction-scoped locks before the mark existed have a row
            // in xact_locks. (After a restart has emptied a MEMORY table, a
            // transaction-scoped locker marks its name again before it looks at the
            // named lock, which is what the ordering needs.)
            mark_all_xact_used: statement(format!(
                "INSERT INTO {tokens} (name, token, xact_used)
                 SELECT name, {CLOCK_US}, TRUE FROM {xact_locks}
                 ON DUPLICATE KEY UPDATE xact_used = TRUE"
            )),
            issue_token: statement(format!(
                "INSERT INTO {tokens} (name, token) VALUES (?, LAST_INSERT_ID({CLOCK_US}))
                 ON DUPLICATE KEY UPDATE token = LAST_INSERT_ID(GREATEST(token + 1, {CLOCK_US}))"
            )),
            // A plain read first: the common case (the row exists) takes no lock at all.
            // Creating a missing row is a separate autocommit statement; locking it is
            // a record lock on an existing row, which cannot deadlock with another
            // locker the way an upsert's gap locks do.
            xact_row_exists: statement(format!("SELECT COUNT(*) FROM {xact_locks} WHERE name = ?")),
            // A name is unused when its last token is older than the limit and nobody
            // holds its named lock (the key computed as `lock_key` does). The row of a
            // name used with transaction-scoped locks stays: its mark is what sends
            // named-lock acquirers to check the transaction's row lock.
            prune_tokens: statement(format!(
                "DELETE FROM {tokens}
                 WHERE token < {CLOCK_US} - ? * 1000000
                   AND NOT xact_used
                   AND IS_USED_LOCK(IF(name REGEXP '^[a-z0-9_:./-]{{1,60}}$',
                                       CONCAT('ts:', name),
                                       CONCAT('ts#', LEFT(SHA2(name, 256), 61)))) IS NULL"
            )),
            orphan_xact_rows: statement(format!(
                "SELECT name FROM {xact_locks} x
                 WHERE NOT EXISTS (SELECT 1 FROM {tokens} t WHERE t.name = x.name)
                 FOR UPDATE SKIP LOCKED"
            )),
            delete_xact_row: statement(format!("DELETE FROM {xact_locks} WHERE name = ?")),
            create_xact_row: statement(format!("INSERT IGNORE INTO {xact_locks} (name) VALUES (?)")),
            take_in_transaction: statement(format!("SELECT 1 FROM {xact_locks} WHERE name = ? FOR UPDATE")),
            holder: statement(format!(
                "SELECT owner, holder_token, connection_id, CAST(IS_USED_LOCK(?) AS UNSIGNED) AS holder
                 FROM {tokens} WHERE name = ?"
            )),
            create: [
                // A MEMORY table's size limit is the session's max_heap_table_size
                // when it is created.
                statement("SET SESSION max_heap_table_size = 1073741824".to_owned()),
                statement(format!(
                    "CREATE TABLE IF NOT EXISTS {tokens} (
                        name VARBINARY(512) PRIMARY KEY,
                        token BIGINT UNSIGNED NOT NULL,
                        holder_token BIGINT UNSIGNED,
                        owner CHAR(32),
                        connection_id BIGINT UNSIGNED,
                        xact_used BOOLEAN NOT NULL DEFAULT FALSE) ENGINE = {engine}",
                    engine = if config.synchronous_tokens { "InnoDB" } else { "MEMORY" }
                )),
                statement(format!(
                    "CREATE TABLE IF NOT EXISTS {fences} (
                        resource VARBINARY(512) PRIMARY KEY,
                        token BIGINT UNSIGNED NOT NULL) ENGINE = InnoDB"
                )),
                // The row a transaction-scoped holder keeps locked (kept apart from the
                // token row, so that the token can be issued after the lock is taken).
                statement(format!(
                    "CREATE TABLE IF NOT EXISTS {xact_locks} (
                        name VARBINARY(512) PRIMARY KEY) ENGINE = InnoDB"
                )),
                // The number of permits of each semaphore (whose permits are named locks).
                statement(format!(
                    "CREATE TABLE IF NOT EXISTS {semaphores} (
                        name VARBINARY(512) PRIMARY KEY,
                        permits BIGINT UNSIGNED NOT NULL) ENGINE = InnoDB"
                )),
            ],
            semaphores,
            fences,
            tokens,
            xact_locks,
        };
        let store = MysqlLockStore {
            pool,
            sessions,
            issuer,
            held: Arc::default(),
            sql: Arc::new(sql),
            signals: ReleaseSignals::new(),
            url: redacted,
        };
        if config.migrate {
            store.migrate().await?;
        }
        Ok(store)
    }

    /// The permits stored for a semaphore, if any (none before the table exists).
    async fn stored_permits_in_table(&self, name: &LockName) -> Result<Option<u32>> {
        let table = &self.sql.semaphores;
        let stored: Option<u64> = match sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT permits FROM {table} WHERE name = ?"
        )))
        .bind(name.as_str().as_bytes())
        .fetch_optional(&self.pool)
        .await
        {
            Err(error) if crate::sql::is_missing_table(&error) => None,
            other => {
                other.map_err(|error| map_error(error, "cannot read the semaphore's permits"))?
            }
        };
        Ok(stored.map(|stored| u32::try_from(stored).unwrap_or(0)))
    }

    /// Creates the tables if missing. Harmless to run again or concurrently (it holds
    /// a named lock while it works).
    pub async fn migrate(&self) -> Result<()> {
        let fail = |error| map_error(error, "cannot create Turnstile's MySQL tables");
        let mut connection = self.pool.acquire().await.map_err(fail)?;
        let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK('ts-migrate', 30)")
            .fetch_one(&mut *connection)
            .await
            .map_err(fail)?;
        if got != Some(1) {
            return Err(Error::new(
                ErrorKind::StoreUnavailable,
                "another migration did not finish in 30 s",
            ));
        }
        let result = async {
            for create in &self.sql.create {
                sqlx::query(create.sql()).execute(&mut *connection).await?;
            }
            // Tables made before the mark (a rebuilt MEMORY table keeps the size the
            // session set above).
            let has_mark: i64 = sqlx::query_scalar(self.sql.has_xact_used_column.sql())
                .fetch_one(&mut *connection)
                .await?;
            if has_mark == 0 {
                sqlx::query(self.sql.add_xact_used_column.sql())
                    .execute(&mut *connection)
                    .await?;
            }
            sqlx::query(self.sql.mark_all_xact_used.sql())
                .execute(&mut *connection)
                .await?;
            Ok::<_, sqlx::Error>(())
        }
        .await;
        let _ = sqlx::query("DO RELEASE_LOCK('ts-migrate')")
            .execute(&mut *connection)
            .await;
        result.map_err(fail)
    }

    /// Takes the lock `name` for the rest of the InnoDB transaction `transaction` runs
    /// on, and returns its fencing token; the lock is released exactly when that
    /// transaction commits or rolls back.
    ///
    /// The lock is a row lock (`SELECT … FOR UPDATE` on the name's row in
    /// `{prefix}_xact_locks`): another transaction-scoped locker waits for this
    /// transaction to end (bounded by the session's `innodb_lock_wait_timeout`, 50 s by
    /// default: lower it in the transaction's session for a shorter wait), and a
    /// named-lock acquirer is refused while it is held. If a named lock (a
    /// [`LockGuard`](crate::LockGuard)) is held now, this returns [`ErrorKind::Held`];
    /// roll back and retry.
    ///
    /// The token is issued only once the lock is ours, so tokens follow the order in
    /// which holders got the lock. It comes from the same per-name counter as named-lock
    /// tokens and is committed on a connection of the store's own (not the caller's
    /// transaction, and not the shared pool the caller may be using), so a rollback never
    /// gives the number back.
    pub async fn lock_in_transaction(
        &self,
        transaction: &mut sqlx::MySqlConnection,
        name: impl super::IntoLockName,
    ) -> Result<FencingToken> {
        let name = name.into_lock_name()?;
        let key = lock_key(&name);
        let fail = |error| map_error(error, "cannot take the transaction-scoped lock");
        // 0. The mark that sends named-lock acquirers of this name to check the row lock
        //    (they check it after taking the named lock; this sets it before looking at
        //    the named lock in step 2, so one of the two sees the other).
        sqlx::query(self.sql.mark_xact_used.sql())
            .bind(name.as_str().as_bytes())
            .execute(&self.issuer)
            .await
            .map_err(|error| {
                if is_missing_column(&error) {
                    self.needs_migration(error)
                } else {
                    fail(error)
                }
            })?;
        // 1. The lock: the row lock on the name's row, held until the caller's
        //    transaction ends. The row is created first if missing; if `prune` deletes it
        //    between the two steps, the lock finds no row and it goes round again.
        let mut locked = false;
        for _ in 0..3 {
            let exists: i64 = sqlx::query_scalar(self.sql.xact_row_exists.sql())
                .bind(name.as_str().as_bytes())
                .fetch_one(&self.issuer)
                .await
                .map_err(fail)?;
            if exists == 0 {
                match sqlx::query(self.sql.create_xact_row.sql())
                    .bind(name.as_str().as_bytes())
                    .execute(&self.issuer)
                    .await
                {
                    // A lock wait means a transaction holds the row: it exists.
                    Err(error) if !is_lock_wait(&error) => return Err(fail(error)),
                    _ => {}
                }
            }
            let row = sqlx::query(self.sql.take_in_transaction.sql())
                .bind(name.as_str().as_bytes())
                .fetch_optional(&mut *transaction)
                .await
                .map_err(fail)?;
            if row.is_some() {
                locked = true;
                break;
            }
        }
        if !locked {
            return Err(Error::new(
                ErrorKind::Store,
                format!(
                    "the row of lock \"{name}\" kept disappearing (is a prune running in a loop?)"
                ),
            ));
        }
        // 2. A named-lock holder that got in before the row lock is seen here; one that
        //    comes after finds the row locked and gives up.
        let named_lock_held: Option<i64> = sqlx::query_scalar("SELECT IS_USED_LOCK(?) IS NOT NULL")
            .bind(&key)
            .fetch_one(&mut *transaction)
            .await
            .map_err(fail)?;
        if named_lock_held == Some(1) {
            return Err(Error::new(
                ErrorKind::Held,
                format!("lock \"{name}\" is held as a named lock; roll back and try again later"),
            ));
        }
        // 3. Only now the token: larger than that of every holder before us.
        let token = sqlx::query(self.sql.issue_token.sql())
            .bind(name.as_str().as_bytes())
            .execute(&self.issuer)
            .await
            .map_err(fail)?
            .last_insert_id();
        Ok(FencingToken::new(token))
    }

    /// The shared connection pool (not the sessions holding locks).
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// The fenced-write helper for this store's fence table.
    pub fn fence(&self) -> crate::fence::mysql::MysqlFence {
        crate::fence::mysql::MysqlFence::new(&self.sql.fences)
    }

    /// Who holds `name` now, by the server: `(owner, token, connection id)`.
    async fn current_holder(&self, name: &LockName) -> Result<Option<(String, FencingToken, u64)>> {
        let row = match sqlx::query(self.sql.holder.sql())
            .bind(lock_key(name))
            .bind(name.as_str().as_bytes())
            .fetch_optional(&self.pool)
            .await
        {
            // Not migrated yet: nothing was ever locked here through Turnstile.
            Err(error) if crate::sql::is_missing_table(&error) => return Ok(None),
            other => other.map_err(|error| map_error(error, "cannot read the lock"))?,
        };
        let Some(row) = row else {
            // Never taken through Turnstile; someone may still hold the key directly.
            return Ok(None);
        };
        let holder: Option<u64> = row
            .try_get("holder")
            .map_err(|e| map_error(e, "bad lock row"))?;
        let recorded: Option<u64> = row
            .try_get("connection_id")
            .map_err(|e| map_error(e, "bad lock row"))?;
        let owner: Option<String> = row
            .try_get("owner")
            .map_err(|e| map_error(e, "bad lock row"))?;
        let token: Option<u64> = row
            .try_get("holder_token")
            .map_err(|e| map_error(e, "bad lock row"))?;
        let token = token.unwrap_or(0);
        Ok(match holder {
            Some(id) if recorded == Some(id) => {
                Some((owner.unwrap_or_default(), FencingToken::new(token), id))
            }
            // Held by a session that has not recorded itself yet (it is between GET_LOCK
            // and its token) or by someone outside Turnstile.
            Some(id) => Some((String::new(), FencingToken::new(token), id)),
            None => None,
        })
    }
}

/// The acquire on a session the store knows nothing about yet (fresh from the pool):
/// one round trip that sets the lease, takes the named lock and, if it got it, records
/// the holder and issues its token, and tells the session's id. Later acquires on the
/// same session use the one statement of `MysqlLockStore::fast_acquire`.
/// 1. the lease (`wait_timeout`) is set in the statement that calls `GET_LOCK`, so it
///    covers the lock from the first instant;
/// 2. a transaction-scoped holder's row lock is checked with `NOWAIT` after `GET_LOCK`
///    (it fails the batch, and the caller closes the session and reports the lock held);
/// 3. the token is issued only when the lock was taken, in the same autocommit
///    statement that records the holder.
///
/// A session that did not get the lock keeps the lease as its `wait_timeout` in the
/// pool (see `recycle`). The row check also reports whether `GET_LOCK` succeeded and
/// the session's connection id, and the token comes back in the `INSERT`'s own reply
/// (its OK packet carries the argument of `LAST_INSERT_ID(expr)`).
///
/// Sent as text: a batch cannot be prepared. Everything spliced in is safe as it
/// stands: the key holds only `[a-z0-9_:./#-]`, the name goes in as a hex literal, the
/// owner is hex digits.
fn acquire_batch(
    sql: &Sql,
    name: &LockName,
    key: &str,
    owner: &OwnerId,
    lease_secs: u64,
) -> String {
    let name_hex = hex(name.as_str().as_bytes());
    let owner = owner.as_str();
    let (tokens, xact_locks) = (&sql.tokens, &sql.xact_locks);
    format!(
        "SET SESSION wait_timeout = {lease_secs}, @ts_got = GET_LOCK('{key}', 0);
         SELECT CAST(@ts_got AS SIGNED) AS got, CAST(CONNECTION_ID() AS UNSIGNED) AS id,
           COUNT(*) AS xact FROM {xact_locks} WHERE name = X'{name_hex}' FOR UPDATE NOWAIT;
         INSERT INTO {tokens} (name, token, holder_token, owner, connection_id)
           SELECT X'{name_hex}', LAST_INSERT_ID({CLOCK_US}), {CLOCK_US}, '{owner}', CONNECTION_ID()
             FROM DUAL WHERE @ts_got = 1
           ON DUPLICATE KEY UPDATE token = LAST_INSERT_ID(GREATEST(token + 1, {CLOCK_US})),
             holder_token = token, owner = '{owner}', connection_id = CONNECTION_ID()"
    )
}

/// Whether a statement failed because a row it needed was locked (`NOWAIT`: MySQL 3572,
/// MariaDB 1205; an exhausted `innodb_lock_wait_timeout`: 1205).
fn is_lock_wait(error: &sqlx::Error) -> bool {
    matches!(server_error_number(error), Some(1205 | 3572))
}

/// Whether a statement failed because a table is full (1114: a MEMORY table at its
/// size limit).
fn is_table_full(error: &sqlx::Error) -> bool {
    server_error_number(error) == Some(1114)
}

fn wait_timeout_secs(ttl: Duration) -> u64 {
    ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0)
}

/// What `fast_acquire` sets `LAST_INSERT_ID` to, instead of issuing a token, when the
/// name is marked as used with transaction-scoped locks. Real tokens are microseconds
/// since 1970, far above it.
const XACT_USED_MARK: u64 = 1;

/// What an acquire's statements answered.
enum Reply {
    /// The batch's replies, on a session the store knew nothing about yet.
    Batch(Vec<Either<MySqlQueryResult, MySqlRow>>),
    /// The one statement's result, on a session whose id and lease are known.
    Single {
        result: MySqlQueryResult,
        server_id: u64,
    },
}

/// Whether a statement named a column the table does not have (1054): a table made by
/// an older version, with migration off.
fn is_missing_column(error: &sqlx::Error) -> bool {
    server_error_number(error) == Some(1054)
}

impl MysqlLockStore {
    /// The error for a statement that met tables made by an older version, with
    /// migration off.
    fn needs_migration(&self, error: sqlx::Error) -> Error {
        Error::new(
            ErrorKind::Configuration,
            format!(
                "the tokens table {} predates this version of Turnstile: run `turnstile \
                 migrate --store URL` (or connect with migration on)",
                self.sql.tokens
            ),
        )
        .with_source(error)
    }

    /// The acquire in one prepared statement, on a session whose lease (`wait_timeout`)
    /// is already the one wanted and whose id is known: `GET_LOCK`, then the token in
    /// the same statement (see `Sql::fast_acquire`). Each statement of a batch is a
    /// response the client wakes up for: on the machine of `BENCHMARKS.md` the
    /// three-statement batch cost about 100 µs more than this one.
    ///
    /// A transaction-scoped holder is checked for only on names marked as used with
    /// transaction-scoped locks. The order is what makes that enough: this statement
    /// takes the named lock before it reads the mark (the mark lives in the row its
    /// `ON DUPLICATE KEY UPDATE` reads, after `GET_LOCK` in its `WHERE` let the row
    /// through), and a transaction-scoped locker sets the mark before it looks at the
    /// named lock. So either it sees this session's named lock and gives up, or this
    /// statement sees the mark and the row lock is checked (`NOWAIT`) before a token is
    /// issued. Marks are never removed; a restart may empty a MEMORY table of them, but
    /// it also ends every transaction and frees every named lock, and a transaction's
    /// locker marks its name again first.
    async fn fast_acquire(
        &self,
        connection: &mut Dedicated<MySql>,
        name: &LockName,
        key: &str,
        owner: &OwnerId,
    ) -> std::result::Result<MySqlQueryResult, sqlx::Error> {
        let result = sqlx::query(self.sql.fast_acquire.sql())
            .bind(name.as_str().as_bytes())
            .bind(owner.as_str())
            .bind(key)
            .bind(owner.as_str())
            .execute(&mut **connection)
            .await?;
        if result.last_insert_id() != XACT_USED_MARK {
            return Ok(result);
        }
        // The named lock is ours; a transaction may hold the row lock (then this fails
        // with a lock wait, and the caller closes the session, freeing the named lock).
        sqlx::query(self.sql.check_xact_row.sql())
            .bind(name.as_str().as_bytes())
            .fetch_one(&mut **connection)
            .await?;
        let issued = sqlx::query(self.sql.issue_to_holder.sql())
            .bind(owner.as_str())
            .bind(name.as_str().as_bytes())
            .execute(&mut **connection)
            .await?;
        // The row gone (deleted by hand) would read as "not acquired" and the session,
        // which holds the named lock, would go back on the shelf: an error closes it.
        if issued.rows_affected() == 0 {
            return Err(sqlx::Error::RowNotFound);
        }
        Ok(issued)
    }
}

impl LockBackend for MysqlLockStore {
    fn try_acquire<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<TryAcquire>> {
        Box::pin(async move {
            // This engine takes every lock fenced, so a held session has a token.
            if let Some(Some(token)) = session::already_held(self, owner).await {
                return Ok(TryAcquire::Acquired { token });
            }
            let key = lock_key(name);
            let lease = wait_timeout_secs(ttl);
            let key = key.as_str();
            // A pooled session the server had ended (the pool pings only idle ones) is
            // replaced: the statements are sent again on another.
            let sent = sent_again_if_gone(self.sessions.size(), || async move {
                let connection = self.sessions.take().await?;
                // Until it is registered below, a connection that may hold the lock is
                // closed if this future is dropped or a statement fails, never pooled.
                let mut connection = Dedicated::new(connection);
                let sent = Instant::now();
                let reply = match connection.facts() {
                    SessionFacts {
                        server_id: Some(server_id),
                        idle_timeout_secs: Some(set),
                    } if set == lease => Reply::Single {
                        result: self.fast_acquire(&mut connection, name, key, owner).await?,
                        server_id,
                    },
                    _ => {
                        let batch = acquire_batch(&self.sql, name, key, owner, lease);
                        Reply::Batch(
                            sqlx::raw_sql(AssertSqlSafe(batch))
                                .fetch_many(&mut *connection)
                                .try_collect::<Vec<_>>()
                                .await?,
                        )
                    }
                };
                Ok((connection, reply, sent))
            })
            .await;
            let (mut connection, reply, sent) = match sent {
                Ok(sent) => sent,
                Err(error @ (sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed)) => {
                    let what =
                        session::no_session_left("MySQL", self.held.len(), self.sessions.size());
                    return Err(unavailable(error, &what));
                }
                // A transaction-scoped holder keeps the name's row locked: the lock is
                // held. The session may have taken the named lock before finding out,
                // so it was closed (dropped), not pooled.
                Err(error) if is_lock_wait(&error) => {
                    return Ok(TryAcquire::Held {
                        remaining_ttl: None,
                    });
                }
                Err(error) if is_table_full(&error) => {
                    return Err(Error::new(
                        ErrorKind::Store,
                        format!(
                            "cannot acquire the lock: the tokens table {} is full (a MEMORY \
                             table holds up to 1 GiB of names); forget unused names with \
                             `turnstile lock prune`, or recreate it larger",
                            self.sql.tokens
                        ),
                    ));
                }
                Err(error) if is_missing_column(&error) => return Err(self.needs_migration(error)),
                Err(error) => return Err(map_error(error, "cannot acquire the lock")),
            };
            let (server_id, token) = match reply {
                Reply::Single { result, server_id } => {
                    if result.rows_affected() == 0 && result.last_insert_id() == 0 {
                        connection.recycle();
                        return Ok(TryAcquire::Held {
                            remaining_ttl: None,
                        });
                    }
                    (server_id, result.last_insert_id())
                }
                Reply::Batch(replies) => {
                    let bad = |error| map_error(error, "bad reply to GET_LOCK");
                    // Replies in order: SET's result, the row check's row and result,
                    // the INSERT's result.
                    let (Some(Either::Right(row)), Some(Either::Left(inserted))) =
                        (replies.get(1), replies.get(3))
                    else {
                        return Err(Error::new(ErrorKind::Store, "no reply to GET_LOCK"));
                    };
                    let got: Option<i64> = row.try_get("got").map_err(bad)?;
                    let server_id: u64 = row.try_get("id").map_err(bad)?;
                    // The batch set the lease: the next acquire on this session can
                    // skip it.
                    connection.learn(SessionFacts {
                        server_id: Some(server_id),
                        idle_timeout_secs: Some(lease),
                    });
                    if got != Some(1) {
                        connection.recycle();
                        return Ok(TryAcquire::Held {
                            remaining_ttl: None,
                        });
                    }
                    // An INSERT that wrote nothing reports id 0: refused below.
                    (server_id, inserted.last_insert_id())
                }
            };
            if token <= XACT_USED_MARK {
                return Err(Error::new(
                    ErrorKind::Store,
                    "the server issued no fencing token with GET_LOCK",
                ));
            }
            let token = FencingToken::new(token);
            let session = Session {
                connection: Some(connection),
                server_id,
                key: key.to_owned(),
                token: Some(token),
                ttl,
                last_contact: sent,
            };
            self.held.insert(owner, session);
            Ok(TryAcquire::Acquired { token })
        })
    }

    fn extend<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        _ttl: Duration,
    ) -> BoxFuture<'a, Result<ExtendOutcome>> {
        Box::pin(session::extend(self, name, owner))
    }

    fn release<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
    ) -> BoxFuture<'a, Result<ReleaseOutcome>> {
        Box::pin(session::release(self, name, owner))
    }

    fn hand_over<'a>(
        &'a self,
        name: &'a LockName,
        from: &'a OwnerId,
        to: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(ReleaseOutcome, TryAcquire)>> {
        Box::pin(session::hand_over(
            self,
            name,
            from,
            to,
            ttl,
            self.try_acquire(name, to, ttl),
        ))
    }

    fn inspect<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<LockInfo>>> {
        Box::pin(async move {
            Ok(self
                .current_holder(name)
                .await?
                .map(|(owner, token, _)| LockInfo {
                    owner,
                    fencing_token: Some(token),
                    remaining_ttl: None,
                }))
        })
    }

    fn force_release<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<LockInfo>>> {
        Box::pin(async move {
            let Some((owner, token, connection_id)) = self.current_holder(name).await? else {
                return Ok(None);
            };
            // MySQL has no conditional KILL: check once more, on the connection that
            // kills, that this session still holds the lock, which narrows the window
            // in which a session that released and was pooled for another lock could be
            // ended instead (documented in the module's guarantees).
            let mut connection = self
                .pool
                .acquire()
                .await
                .map_err(|error| map_error(error, "cannot break the lock"))?;
            let still: Option<i64> = sqlx::query_scalar("SELECT IS_USED_LOCK(?) = ?")
                .bind(lock_key(name))
                .bind(connection_id)
                .fetch_one(&mut *connection)
                .await
                .map_err(|error| map_error(error, "cannot break the lock"))?;
            if still != Some(1) {
                return Ok(None);
            }
            sqlx::query(AssertSqlSafe(format!("KILL CONNECTION {connection_id}")))
                .execute(&mut *connection)
                .await
                .map_err(|error| {
                    map_error(
                        error,
                        "cannot end the holder's session (KILL needs CONNECTION ADMIN)",
                    )
                })?;
            self.signals.notify(name.as_str());
            Ok(Some(LockInfo {
                owner,
                fencing_token: Some(token),
                remaining_ttl: None,
            }))
        })
    }

    fn watch_releases<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<ReleaseWatch>> {
        Box::pin(async move {
            let (watch, _) = self.signals.watch(name.as_str());
            Ok(watch.with_poll(POLL_MIN, POLL_MAX))
        })
    }

    fn migrate(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(MysqlLockStore::migrate(self))
    }

    fn prune(&self, unused_for: Duration) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move {
            let fail = |error| map_error(error, "cannot prune unused lock names");
            let removed = sqlx::query(self.sql.prune_tokens.sql())
                .bind(unused_for.as_secs())
                .execute(&self.pool)
                .await
                .map_err(fail)?
                .rows_affected();
            // Transaction-scoped rows of forgotten names; those locked now are skipped
            // (the issuer's sessions do not wait long for row locks anyway).
            let mut transaction = self.issuer.begin().await.map_err(fail)?;
            let orphans: Vec<Vec<u8>> = sqlx::query_scalar(self.sql.orphan_xact_rows.sql())
                .fetch_all(&mut *transaction)
                .await
                .map_err(fail)?;
            for name in orphans {
                sqlx::query(self.sql.delete_xact_row.sql())
                    .bind(name)
                    .execute(&mut *transaction)
                    .await
                    .map_err(fail)?;
            }
            transaction.commit().await.map_err(fail)?;
            Ok(removed)
        })
    }

    /// An insert that keeps a number already there, then a read: a number, once
    /// stored, changes only when it is forgotten, so the read sees the number the
    /// insert kept.
    fn declare_permits<'a>(
        &'a self,
        name: &'a LockName,
        permits: u32,
    ) -> BoxFuture<'a, Result<u32>> {
        Box::pin(async move {
            let fail = |error| map_error(error, "cannot declare the semaphore's permits");
            let table = &self.sql.semaphores;
            sqlx::query(AssertSqlSafe(format!(
                "INSERT IGNORE INTO {table} (name, permits) VALUES (?, ?)"
            )))
            .bind(name.as_str().as_bytes())
            .bind(u64::from(permits))
            .execute(&self.pool)
            .await
            .map_err(fail)?;
            let stored: Option<u64> = sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT permits FROM {table} WHERE name = ?"
            )))
            .bind(name.as_str().as_bytes())
            .fetch_optional(&self.pool)
            .await
            .map_err(fail)?;
            // Forgotten between the two: this client's number is as good as any.
            Ok(stored.map_or(permits, |stored| u32::try_from(stored).unwrap_or(0)))
        })
    }

    fn stored_permits<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<u32>>> {
        Box::pin(self.stored_permits_in_table(name))
    }

    fn forget_permits<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<u32>>> {
        Box::pin(async move {
            let fail = |error| map_error(error, "cannot forget the semaphore's permits");
            let table = &self.sql.semaphores;
            let stored = self.stored_permits_in_table(name).await?;
            sqlx::query(AssertSqlSafe(format!("DELETE FROM {table} WHERE name = ?")))
                .bind(name.as_str().as_bytes())
                .execute(&self.pool)
                .await
                .map_err(fail)?;
            Ok(stored)
        })
    }

    fn describe(&self) -> String {
        self.url.clone()
    }
}

impl SessionEngine for MysqlLockStore {
    type Connection = Dedicated<MySql>;
    type Key = String;

    fn sessions(&self) -> &HeldSessions<Dedicated<MySql>, String> {
        &self.held
    }

    fn signals(&self) -> &ReleaseSignals {
        &self.signals
    }

    async fn ping(&self, connection: &mut Dedicated<MySql>, key: &String) -> bool {
        // Constant text with a bound key: one cached prepared statement per session.
        // (Text with the key spliced in would be a new statement per lock name, and the
        // statement-cache evictions stall on Nagle's algorithm for 40 ms.)
        matches!(
            sqlx::query_scalar::<_, Option<i64>>("SELECT IS_USED_LOCK(?) = CONNECTION_ID()")
                .bind(key)
                .fetch_one(&mut **connection)
                .await,
            Ok(Some(1))
        )
    }

    async fn unlock(
        &self,
        connection: &mut Dedicated<MySql>,
        _name: &LockName,
        key: &String,
    ) -> bool {
        // RELEASE_LOCK is its own ownership check: 1 only if this session held the lock.
        matches!(
            sqlx::query_scalar::<_, Option<i64>>("SELECT RELEASE_LOCK(?)")
                .bind(key)
                .fetch_one(&mut **connection)
                .await,
            Ok(Some(1))
        )
    }

    async fn recycle(&self, connection: Dedicated<MySql>) {
        // Its `wait_timeout` stays at the last lease: a pooled session idle longer than
        // that is ended by the server, and the pool replaces it (it tests connections
        // before handing them out).
        connection.recycle();
    }

    async fn close(&self, connection: Dedicated<MySql>) {
        connection.close().await;
    }

    async fn reissue(
        &self,
        connection: &mut Dedicated<MySql>,
        name: &LockName,
        to: &OwnerId,
        ttl: Duration,
        held_ttl: Duration,
    ) -> Result<FencingToken> {
        // The token comes back in the UPDATE's own reply, as in `fast_acquire`. The lease
        // is set only when it changes (a round trip more, rare): in a run of hand-overs
        // with one TTL this is one prepared statement.
        let fail = |error| map_error(error, "cannot hand the lock over");
        let lease = wait_timeout_secs(ttl);
        if lease != wait_timeout_secs(held_ttl) {
            sqlx::raw_sql(AssertSqlSafe(format!("SET SESSION wait_timeout = {lease}")))
                .execute(&mut **connection)
                .await
                .map_err(fail)?;
            connection.learn(SessionFacts {
                idle_timeout_secs: Some(lease),
                ..connection.facts()
            });
        }
        let updated = sqlx::query(self.sql.issue_to_holder.sql())
            .bind(to.as_str())
            .bind(name.as_str().as_bytes())
            .execute(&mut **connection)
            .await
            .map_err(fail)?;
        if updated.rows_affected() == 1 && updated.last_insert_id() != 0 {
            return Ok(FencingToken::new(updated.last_insert_id()));
        }
        // The name's row is gone (pruned by hand while held): no token to hand on.
        Err(Error::new(
            ErrorKind::Store,
            format!(
                "the hand-over found no token row for the lock in {}",
                self.sql.tokens
            ),
        ))
    }

    async fn holder_id(&self, name: &LockName) -> Result<Option<u64>> {
        Ok(self.current_holder(name).await?.map(|(_, _, id)| id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_fit_and_never_collide_by_case_or_length() {
        let key = |name: &str| lock_key(&LockName::new(name).unwrap());
        assert_eq!(key("order:123"), "ts:order:123");
        assert_ne!(key("Order:123"), key("order:123"));
        assert!(key("Order:123").starts_with("ts#"));
        let long_a = "a".repeat(100);
        let long_b = format!("{}b", "a".repeat(99));
        assert_ne!(key(&long_a), key(&long_b));
        for name in ["x", "Order:123", &long_a, "注文", "a'b", "a b"] {
            let k = key(name);
            assert!(k.len() <= 64, "{k}");
            assert!(
                k.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_:./#-".contains(&b)),
                "{k}"
            );
        }
    }

    #[test]
    fn wait_timeouts_round_up() {
        assert_eq!(wait_timeout_secs(Duration::from_millis(300)), 1);
        assert_eq!(wait_timeout_secs(Duration::from_secs(30)), 30);
        assert_eq!(wait_timeout_secs(Duration::from_millis(30_001)), 31);
    }
}
