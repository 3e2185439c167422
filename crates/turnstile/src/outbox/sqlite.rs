//! The outbox in the embedded SQLite database (the default store): a single-host
//! service relays from its own file.
//!
//! Two tables, `turnstile_outbox_keys` (a row per ordering key: its last sequence
//! number, what is delivered, its lease, backoff and parking) and `turnstile_outbox`
//! (undelivered messages). Application transactions that enqueue must be write
//! transactions from the start (`begin_with("BEGIN IMMEDIATE")`).
//!
//! # Guarantees
//! - **Order**: SQLite serialises writers, so sequence numbers per key follow commit
//!   order.
//! - **Clock**: leases and backoff are judged by the host's wall clock.
//! - **Durability**: WAL with `synchronous = NORMAL` (the engine's setting): a committed
//!   message survives a crash of the process; a power loss may take the last commits
//!   back, message and business change together.
//! - **Waking**: [`SqliteOutbox::commit`] wakes relays in this process at once; relays in
//!   other processes poll, backing off while idle.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sqlx::Row;
use sqlx::sqlite::{SqliteConnection, SqlitePool, SqliteSynchronous};
use tokio::sync::Notify;

use super::{
    Backoff, LaggingKey, LeasedKey, Message, OutboxStore, ParkedKey, Settled, Settlement, Status,
    Stored,
};
use crate::clock::wall_clock;
use crate::engine::sqlite::{millis_i64, open_pool, parse_url};
use crate::error::{Error, Result};
use crate::future::BoxFuture;
use crate::sql::map_error;

const CREATE: [&str; 7] = [
    "CREATE TABLE IF NOT EXISTS turnstile_outbox_keys (
        ordering_key TEXT PRIMARY KEY,
        last_seq INTEGER NOT NULL,
        acked_seq INTEGER NOT NULL DEFAULT 0,
        available_ms INTEGER NOT NULL DEFAULT 0,
        lease_token INTEGER NOT NULL DEFAULT 0,
        attempts INTEGER NOT NULL DEFAULT 0,
        last_error TEXT,
        parked INTEGER NOT NULL DEFAULT 0,
        parked_ms INTEGER,
        permanent_failures INTEGER NOT NULL DEFAULT 0,
        settled_token INTEGER NOT NULL DEFAULT 0) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS turnstile_outbox_keys_due
        ON turnstile_outbox_keys (available_ms) WHERE acked_seq < last_seq AND parked = 0",
    "CREATE TABLE IF NOT EXISTS turnstile_outbox (
        ordering_key TEXT NOT NULL,
        seq INTEGER NOT NULL,
        id TEXT NOT NULL,
        topic TEXT NOT NULL,
        headers TEXT NOT NULL,
        payload BLOB NOT NULL,
        created_ms INTEGER NOT NULL,
        PRIMARY KEY (ordering_key, seq))",
    // Delivered messages kept for audit (when the store is told to keep them).
    "CREATE TABLE IF NOT EXISTS turnstile_outbox_delivered (
        ordering_key TEXT NOT NULL,
        seq INTEGER NOT NULL,
        id TEXT NOT NULL,
        topic TEXT NOT NULL,
        headers TEXT NOT NULL,
        payload BLOB NOT NULL,
        created_ms INTEGER NOT NULL,
        delivered_ms INTEGER NOT NULL,
        UNIQUE (ordering_key, seq))",
    "CREATE INDEX IF NOT EXISTS turnstile_outbox_delivered_at
        ON turnstile_outbox_delivered (delivered_ms)",
    // The outbox's identity (one row): sent with every message, so that consumers
    // tell this outbox's keys and sequences from another's (or from these tables'
    // after they were dropped and made again).
    "CREATE TABLE IF NOT EXISTS turnstile_outbox_identity (
        one INTEGER PRIMARY KEY CHECK (one = 1),
        id TEXT NOT NULL)",
    // Messages an operator moved aside (`turnstile outbox skip`), kept for audit.
    "CREATE TABLE IF NOT EXISTS turnstile_outbox_skipped (
        ordering_key TEXT NOT NULL,
        seq INTEGER NOT NULL,
        id TEXT NOT NULL,
        topic TEXT NOT NULL,
        headers TEXT NOT NULL,
        payload BLOB NOT NULL,
        created_ms INTEGER NOT NULL,
        skipped_ms INTEGER NOT NULL,
        reason TEXT,
        UNIQUE (ordering_key, seq))",
];

/// Columns added to `turnstile_outbox_keys` after its first release, for tables made
/// before them: the head message's permanent failures (only those park a key), and
/// the lease token last settled (a settlement tried again after a lost commit reply
/// changes nothing).
const ADDED_KEY_COLUMNS: [(&str, &str); 2] = [
    (
        "permanent_failures",
        "ALTER TABLE turnstile_outbox_keys ADD COLUMN permanent_failures INTEGER NOT NULL DEFAULT 0",
    ),
    (
        "settled_token",
        "ALTER TABLE turnstile_outbox_keys ADD COLUMN settled_token INTEGER NOT NULL DEFAULT 0",
    ),
];

/// The outbox in a SQLite database file.
#[derive(Debug, Clone)]
pub struct SqliteOutbox {
    pool: SqlitePool,
    path: PathBuf,
    committed: Arc<Notify>,
    keep_delivered: Option<Duration>,
    max_message: Option<usize>,
    identity: Option<Arc<str>>,
}

fn fail(what: &'static str) -> impl Fn(sqlx::Error) -> Error {
    move |error| map_error(error, what)
}

fn unsigned(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

impl SqliteOutbox {
    /// Opens (creating if needed) the database at `path` and the outbox tables.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let pool = open_pool(&path, true, "outbox", SqliteSynchronous::Normal).await?;
        let mut outbox = SqliteOutbox {
            pool,
            path,
            committed: Arc::default(),
            keep_delivered: None,
            max_message: None,
            identity: None,
        };
        outbox.migrate().await?;
        outbox.identity = outbox.read_identity().await?;
        Ok(outbox)
    }

    /// Opens the outbox named by `sqlite://PATH` (with `?turnstile_migrate=off`, an
    /// existing file without creating anything; with `?turnstile_keep_delivered=SECONDS`,
    /// delivered messages are kept that long for audit; with
    /// `?turnstile_synchronous=full`, each commit is on disk when it returns).
    pub async fn open_url(url: &str) -> Result<Self> {
        let (url, keep) = super::keep_delivered_option(url)?;
        let url = parse_url(&url)?;
        let synchronous = url.synchronous.unwrap_or(SqliteSynchronous::Normal);
        let mut outbox = SqliteOutbox {
            pool: open_pool(&url.path, url.create, "outbox", synchronous).await?,
            path: url.path,
            committed: Arc::default(),
            keep_delivered: keep,
            max_message: None,
            identity: None,
        };
        if url.create {
            outbox.migrate().await?;
        } else {
            let columns = outbox.key_columns().await?;
            super::check_key_columns(&columns)?;
        }
        outbox.identity = outbox.read_identity().await?;
        Ok(outbox)
    }

    /// Refuses at enqueue (with [`ErrorKind::InvalidOptions`](crate::ErrorKind), before
    /// anything is written) a message whose payload and headers are over `bytes`: set
    /// it to the broker's limit (NATS `max_payload`, 1 MiB by default; Kafka
    /// `message.max.bytes`), so that a message the broker can never take fails in the
    /// application's transaction instead of parking its key later. `None` (the
    /// default) takes up to [`MAX_PAYLOAD_LEN`](super::MAX_PAYLOAD_LEN).
    pub fn max_message(mut self, bytes: Option<usize>) -> Self {
        self.max_message = bytes;
        self
    }

    /// Keeps delivered messages for `retention` (in `turnstile_outbox_delivered`) instead
    /// of deleting them when they are delivered; `None` deletes them (the default).
    pub fn keep_delivered(mut self, retention: Option<Duration>) -> Self {
        self.keep_delivered = retention;
        self
    }

    /// Creates the tables if missing, and the outbox's identity. Harmless to run again
    /// or concurrently.
    pub async fn migrate(&self) -> Result<()> {
        for create in CREATE {
            sqlx::query(create)
                .execute(&self.pool)
                .await
                .map_err(fail("cannot create the outbox tables"))?;
        }
        let columns = self.key_columns().await?;
        for (column, add) in ADDED_KEY_COLUMNS {
            if columns.iter().any(|name| name == column) {
                continue;
            }
            match sqlx::query(add).execute(&self.pool).await {
                Ok(_) => {}
                // Another process added it meanwhile.
                Err(error) if error.to_string().contains("duplicate column name") => {}
                Err(error) => {
                    return Err(map_error(error, "cannot add a column to the outbox tables"));
                }
            }
        }
        sqlx::query("INSERT OR IGNORE INTO turnstile_outbox_identity (one, id) VALUES (1, ?1)")
            .bind(uuid::Uuid::now_v7().to_string())
            .execute(&self.pool)
            .await
            .map_err(fail("cannot create the outbox's identity"))?;
        Ok(())
    }

    /// The key table's columns (none if there is no key table).
    async fn key_columns(&self) -> Result<Vec<String>> {
        sqlx::query_scalar("SELECT name FROM pragma_table_info('turnstile_outbox_keys')")
            .fetch_all(&self.pool)
            .await
            .map_err(fail("cannot read the outbox tables' columns"))
    }

    /// The identity stored with the tables (none in tables from before identities).
    async fn read_identity(&self) -> Result<Option<Arc<str>>> {
        match sqlx::query_scalar::<_, String>("SELECT id FROM turnstile_outbox_identity")
            .fetch_optional(&self.pool)
            .await
        {
            Ok(id) => Ok(id.map(Arc::from)),
            Err(error) if crate::sql::is_missing_table(&error) => Ok(None),
            Err(error) => Err(map_error(error, "cannot read the outbox's identity")),
        }
    }

    /// The outbox's identity, sent with every message as
    /// [`PRODUCER_HEADER`](super::PRODUCER_HEADER).
    pub fn identity(&self) -> Option<&str> {
        self.identity.as_deref()
    }

    /// The connection pool (same database file), for the application's transactions.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Writes `message` in the application's transaction on `connection` (a write
    /// transaction: `BEGIN IMMEDIATE`), after its key's last message. It is published
    /// once the transaction commits; a rollback takes it back.
    ///
    /// The sequence number and the message row are written as one step (inside a
    /// savepoint): on a connection outside a transaction, the message commits on its
    /// own, and a failed insert never leaves its number behind as a gap.
    pub async fn enqueue(
        &self,
        connection: &mut SqliteConnection,
        message: &Message,
    ) -> Result<u64> {
        super::check_size(message, self.max_message)?;
        let what = "cannot enqueue the message";
        // Outside a transaction SQLite's SAVEPOINT begins one and RELEASE commits it;
        // inside one they nest. Either way the two statements below land together.
        sqlx::query("SAVEPOINT turnstile_enqueue")
            .execute(&mut *connection)
            .await
            .map_err(fail(what))?;
        let written = Self::write_message(connection, message, self.identity()).await;
        let end = if written.is_ok() {
            "RELEASE turnstile_enqueue"
        } else {
            "ROLLBACK TO turnstile_enqueue; RELEASE turnstile_enqueue"
        };
        let ended = sqlx::raw_sql(end).execute(&mut *connection).await;
        let seq = written?;
        ended.map_err(fail(what))?;
        super::telemetry::enqueued(message, seq);
        Ok(seq)
    }

    async fn write_message(
        connection: &mut SqliteConnection,
        message: &Message,
        producer: Option<&str>,
    ) -> Result<u64> {
        let what = "cannot enqueue the message";
        let seq: i64 = sqlx::query_scalar(
            "INSERT INTO turnstile_outbox_keys (ordering_key, last_seq) VALUES (?1, 1)
             ON CONFLICT (ordering_key) DO UPDATE SET last_seq = last_seq + 1
             RETURNING last_seq",
        )
        .bind(message.key())
        .fetch_one(&mut *connection)
        .await
        .map_err(fail(what))?;
        let (now_ms, _) = wall_clock();
        sqlx::query(
            "INSERT INTO turnstile_outbox (ordering_key, seq, id, topic, headers, payload, created_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        )
        .bind(message.key())
        .bind(seq)
        .bind(message.id())
        .bind(message.topic())
        .bind(message.headers_json_from(producer))
        .bind(message.payload())
        .bind(now_ms)
        .execute(&mut *connection)
        .await
        .map_err(fail(what))?;
        Ok(unsigned(seq))
    }

    /// Commits `transaction` and wakes this process's relays at once.
    pub async fn commit(&self, transaction: sqlx::Transaction<'_, sqlx::Sqlite>) -> Result<()> {
        transaction
            .commit()
            .await
            .map_err(fail("cannot commit the transaction"))?;
        self.committed.notify_one();
        Ok(())
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl OutboxStore for SqliteOutbox {
    fn claim_within(
        &self,
        max_keys: u32,
        per_key: u32,
        max_bytes: u64,
        lease: Duration,
    ) -> BoxFuture<'_, Result<Vec<LeasedKey>>> {
        Box::pin(async move {
            let what = "cannot claim outbox messages";
            let mut transaction = self
                .pool
                .begin_with("BEGIN IMMEDIATE")
                .await
                .map_err(fail(what))?;
            let (now_ms, _) = wall_clock();
            let leased = sqlx::query(
                "UPDATE turnstile_outbox_keys
                 SET available_ms = ?1 + ?2, lease_token = lease_token + 1
                 WHERE ordering_key IN (
                    SELECT ordering_key FROM turnstile_outbox_keys
                    WHERE acked_seq < last_seq AND parked = 0 AND available_ms <= ?1
                    ORDER BY available_ms LIMIT ?3)
                 RETURNING ordering_key, acked_seq, lease_token, attempts",
            )
            .bind(now_ms)
            .bind(millis_i64(lease))
            .bind(i64::from(max_keys))
            .fetch_all(&mut *transaction)
            .await
            .map_err(fail(what))?;
            let mut keys = Vec::with_capacity(leased.len());
            // Messages are read only while their bytes fit the round's budget (the
            // first message of the round always does).
            let mut budget = i64::try_from(max_bytes).unwrap_or(i64::MAX);
            let mut first = true;
            for row in leased {
                let key: String = row.try_get("ordering_key").map_err(fail(what))?;
                let acked: i64 = row.try_get("acked_seq").map_err(fail(what))?;
                let rows = sqlx::query(
                    "SELECT seq, id, topic, created_ms, running, fits,
                            CASE WHEN fits THEN headers END AS headers,
                            CASE WHEN fits THEN payload END AS payload FROM (
                        SELECT seq, id, topic, headers, payload, created_ms, running,
                               running <= ?4 OR (?5 AND running = size) AS fits FROM (
                            SELECT seq, id, topic, headers, payload, created_ms,
                                   length(CAST(payload AS BLOB)) + length(CAST(headers AS BLOB)) AS size,
                                   sum(length(CAST(payload AS BLOB)) + length(CAST(headers AS BLOB)))
                                       OVER (ORDER BY seq ROWS UNBOUNDED PRECEDING) AS running
                            FROM turnstile_outbox
                            WHERE ordering_key = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3))
                     ORDER BY seq",
                )
                .bind(&key)
                .bind(acked)
                .bind(i64::from(per_key))
                .bind(budget)
                .bind(first)
                .fetch_all(&mut *transaction)
                .await
                .map_err(fail(what))?;
                let mut messages = Vec::with_capacity(rows.len());
                let mut over_budget = false;
                let mut used = 0;
                for row in rows {
                    if !row.try_get::<bool, _>("fits").map_err(fail(what))? {
                        over_budget = true;
                        continue;
                    }
                    used = row.try_get::<i64, _>("running").map_err(fail(what))?;
                    first = false;
                    let created_ms: i64 = row.try_get("created_ms").map_err(fail(what))?;
                    let headers: String = row.try_get("headers").map_err(fail(what))?;
                    messages.push(Stored {
                        seq: unsigned(row.try_get("seq").map_err(fail(what))?),
                        age: Duration::from_millis(unsigned(now_ms - created_ms)),
                        message: Message::from_stored(
                            row.try_get("id").map_err(fail(what))?,
                            row.try_get("topic").map_err(fail(what))?,
                            key.clone(),
                            &headers,
                            row.try_get("payload").map_err(fail(what))?,
                        ),
                    });
                }
                budget = budget.saturating_sub(used).max(0);
                keys.push(LeasedKey {
                    over_budget,
                    token: unsigned(row.try_get("lease_token").map_err(fail(what))?),
                    attempts: u32::try_from(row.try_get::<i64, _>("attempts").map_err(fail(what))?)
                        .unwrap_or(u32::MAX),
                    acked: unsigned(acked),
                    key,
                    messages,
                });
            }
            transaction.commit().await.map_err(fail(what))?;
            Ok(keys)
        })
    }

    fn settle<'a>(
        &'a self,
        settlements: &'a [Settlement],
        max_attempts: u32,
        backoff: Backoff,
    ) -> BoxFuture<'a, Result<Vec<Settled>>> {
        Box::pin(async move {
            let what = "cannot record delivered outbox messages";
            let mut transaction = self
                .pool
                .begin_with("BEGIN IMMEDIATE")
                .await
                .map_err(fail(what))?;
            let (now_ms, _) = wall_clock();
            let mut answers = Vec::with_capacity(settlements.len());
            for settlement in settlements {
                let failed = settlement.failure.is_some();
                let permanent = settlement.failure.as_ref().is_some_and(|f| f.permanent);
                // Every SET reads the row as it was. The head message's failures
                // before this one (all of them for the backoff, the permanent ones for
                // parking) start again at 0 when this settlement moved the head. A
                // lease settled already (its commit's reply lost, the settlement tried
                // again) is not counted twice: its recorded answer stands.
                let row = sqlx::query(
                    "UPDATE turnstile_outbox_keys SET
                        attempts = CASE WHEN ?4 THEN (CASE WHEN ?3 > acked_seq THEN 0 ELSE attempts END) + 1 ELSE 0 END,
                        permanent_failures = CASE
                            WHEN ?5 THEN (CASE WHEN ?3 > acked_seq THEN 0 ELSE permanent_failures END) + 1
                            WHEN ?4 AND ?3 <= acked_seq THEN permanent_failures
                            ELSE 0 END,
                        parked = CASE WHEN ?5 AND (CASE WHEN ?3 > acked_seq THEN 0 ELSE permanent_failures END) + 1 >= ?6
                                      THEN 1 ELSE 0 END,
                        settled_token = ?2,
                        parked_ms = ?7,
                        last_error = ?8,
                        available_ms = CASE WHEN ?4 THEN ?7 + (
                            min(?10, ?9 << min(CASE WHEN ?3 > acked_seq THEN 0 ELSE attempts END, 20)) / 2
                            + abs(random() % (min(?10, ?9 << min(CASE WHEN ?3 > acked_seq THEN 0 ELSE attempts END, 20)) / 2 + 1)))
                          ELSE ?7 END,
                        acked_seq = max(acked_seq, ?3)
                     WHERE ordering_key = ?1 AND lease_token = ?2 AND settled_token <> ?2
                     RETURNING parked",
                )
                .bind(&settlement.key)
                .bind(i64::try_from(settlement.token).unwrap_or(i64::MAX))
                .bind(i64::try_from(settlement.delivered_through).unwrap_or(i64::MAX))
                .bind(failed)
                .bind(permanent)
                .bind(i64::from(max_attempts.max(1)))
                .bind(now_ms)
                .bind(settlement.failure.as_ref().map(|f| f.reason.as_str()))
                .bind(millis_i64(backoff.base).max(1))
                .bind(millis_i64(backoff.max).max(1))
                .fetch_optional(&mut *transaction)
                .await
                .map_err(fail(what))?;
                let Some(row) = row else {
                    let settled: Option<i64> = sqlx::query_scalar(
                        "SELECT parked FROM turnstile_outbox_keys
                         WHERE ordering_key = ?1 AND lease_token = ?2 AND settled_token = ?2",
                    )
                    .bind(&settlement.key)
                    .bind(i64::try_from(settlement.token).unwrap_or(i64::MAX))
                    .fetch_optional(&mut *transaction)
                    .await
                    .map_err(fail(what))?;
                    answers.push(match settled {
                        Some(1) => Settled::Parked,
                        Some(_) => Settled::Done,
                        None => Settled::Fenced,
                    });
                    continue;
                };
                if self.keep_delivered.is_some() {
                    sqlx::query(
                        "INSERT OR IGNORE INTO turnstile_outbox_delivered
                            (ordering_key, seq, id, topic, headers, payload, created_ms, delivered_ms)
                         SELECT ordering_key, seq, id, topic, headers, payload, created_ms, ?3
                         FROM turnstile_outbox WHERE ordering_key = ?1 AND seq <= ?2",
                    )
                    .bind(&settlement.key)
                    .bind(i64::try_from(settlement.delivered_through).unwrap_or(i64::MAX))
                    .bind(now_ms)
                    .execute(&mut *transaction)
                    .await
                    .map_err(fail(what))?;
                }
                sqlx::query("DELETE FROM turnstile_outbox WHERE ordering_key = ?1 AND seq <= ?2")
                    .bind(&settlement.key)
                    .bind(i64::try_from(settlement.delivered_through).unwrap_or(i64::MAX))
                    .execute(&mut *transaction)
                    .await
                    .map_err(fail(what))?;
                let parked: i64 = row.try_get("parked").map_err(fail(what))?;
                answers.push(if parked == 1 {
                    Settled::Parked
                } else {
                    Settled::Done
                });
            }
            transaction.commit().await.map_err(fail(what))?;
            Ok(answers)
        })
    }

    fn redrive<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let changed = sqlx::query(
                "UPDATE turnstile_outbox_keys
                 SET parked = 0, attempts = 0, permanent_failures = 0, last_error = NULL,
                     available_ms = 0
                 WHERE ordering_key = ?1 AND parked = 1",
            )
            .bind(key)
            .execute(&self.pool)
            .await
            .map_err(fail("cannot redrive the key"))?
            .rows_affected();
            if changed > 0 {
                self.committed.notify_one();
            }
            Ok(changed > 0)
        })
    }

    fn skip<'a>(&'a self, key: &'a str, seq: u64) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let what = "cannot skip the message";
            let mut transaction = self
                .pool
                .begin_with("BEGIN IMMEDIATE")
                .await
                .map_err(fail(what))?;
            let head = sqlx::query(
                "SELECT acked_seq, parked FROM turnstile_outbox_keys WHERE ordering_key = ?1",
            )
            .bind(key)
            .fetch_optional(&mut *transaction)
            .await
            .map_err(fail(what))?
            .map(|row| {
                let acked: i64 = row.try_get("acked_seq").map_err(fail(what))?;
                let parked: i64 = row.try_get("parked").map_err(fail(what))?;
                Ok::<_, Error>((unsigned(acked) + 1, parked == 1))
            })
            .transpose()?;
            super::check_skip(key, seq, head)?;
            let seq = i64::try_from(seq).unwrap_or(i64::MAX);
            let (now_ms, _) = wall_clock();
            // An audit copy of this key and number already there (an outbox whose
            // sequences started again) is never dropped or overwritten: the skip is
            // refused, and changes nothing.
            let copied: Option<i64> = sqlx::query_scalar(
                "SELECT skipped_ms FROM turnstile_outbox_skipped WHERE ordering_key = ?1 AND seq = ?2",
            )
            .bind(key)
            .bind(seq)
            .fetch_optional(&mut *transaction)
            .await
            .map_err(fail(what))?;
            super::check_no_audit_copy(
                copied.is_some(),
                key,
                unsigned(seq),
                "turnstile_outbox_skipped",
            )?;
            let moved = sqlx::query(
                "INSERT INTO turnstile_outbox_skipped
                    (ordering_key, seq, id, topic, headers, payload, created_ms, skipped_ms, reason)
                 SELECT m.ordering_key, m.seq, m.id, m.topic, m.headers, m.payload, m.created_ms, ?3, k.last_error
                 FROM turnstile_outbox m JOIN turnstile_outbox_keys k ON k.ordering_key = m.ordering_key
                 WHERE m.ordering_key = ?1 AND m.seq = ?2",
            )
            .bind(key)
            .bind(seq)
            .bind(now_ms)
            .execute(&mut *transaction)
            .await
            .map_err(fail(what))?
            .rows_affected();
            sqlx::query("DELETE FROM turnstile_outbox WHERE ordering_key = ?1 AND seq = ?2")
                .bind(key)
                .bind(seq)
                .execute(&mut *transaction)
                .await
                .map_err(fail(what))?;
            sqlx::query(
                "UPDATE turnstile_outbox_keys SET acked_seq = ?2, parked = 0, attempts = 0,
                    permanent_failures = 0, last_error = NULL, available_ms = 0
                 WHERE ordering_key = ?1",
            )
            .bind(key)
            .bind(seq)
            .execute(&mut *transaction)
            .await
            .map_err(fail(what))?;
            transaction.commit().await.map_err(fail(what))?;
            super::telemetry::skipped(key, u64::try_from(seq).unwrap_or(0), moved > 0);
            self.committed.notify_one();
            Ok(moved > 0)
        })
    }

    fn status(&self, parked_limit: u32) -> BoxFuture<'_, Result<Status>> {
        Box::pin(async move {
            let what = "cannot read the outbox status";
            let (now_ms, _) = wall_clock();
            let row = sqlx::query(
                "SELECT coalesce(sum(last_seq - acked_seq), 0) AS pending, count(*) AS keys,
                    (SELECT min(m.created_ms) FROM turnstile_outbox_keys k
                     JOIN turnstile_outbox m ON m.ordering_key = k.ordering_key AND m.seq = k.acked_seq + 1
                     WHERE k.acked_seq < k.last_seq AND k.parked = 0) AS oldest_ms
                 FROM turnstile_outbox_keys WHERE acked_seq < last_seq AND parked = 0",
            )
            .fetch_one(&self.pool)
            .await
            .map_err(fail(what))?;
            let oldest: Option<i64> = row.try_get("oldest_ms").map_err(fail(what))?;
            let parked = sqlx::query(
                "SELECT ordering_key, attempts, last_error, last_seq - acked_seq AS pending
                 FROM turnstile_outbox_keys WHERE parked = 1 ORDER BY parked_ms LIMIT ?1",
            )
            .bind(i64::from(parked_limit))
            .fetch_all(&self.pool)
            .await
            .map_err(fail(what))?
            .iter()
            .map(|row| {
                Ok(ParkedKey {
                    key: row.try_get("ordering_key").map_err(fail(what))?,
                    attempts: u32::try_from(row.try_get::<i64, _>("attempts").map_err(fail(what))?)
                        .unwrap_or(u32::MAX),
                    reason: row.try_get("last_error").map_err(fail(what))?,
                    pending: unsigned(row.try_get("pending").map_err(fail(what))?),
                })
            })
            .collect::<Result<Vec<_>>>()?;
            let lagging = sqlx::query(
                "SELECT k.ordering_key, k.last_seq - k.acked_seq AS pending, m.created_ms
                 FROM turnstile_outbox_keys k
                 JOIN turnstile_outbox m ON m.ordering_key = k.ordering_key AND m.seq = k.acked_seq + 1
                 WHERE k.acked_seq < k.last_seq AND k.parked = 0
                 ORDER BY m.created_ms LIMIT ?1",
            )
            .bind(i64::from(parked_limit))
            .fetch_all(&self.pool)
            .await
            .map_err(fail(what))?
            .iter()
            .map(|row| {
                let created_ms: i64 = row.try_get("created_ms").map_err(fail(what))?;
                Ok(LaggingKey {
                    key: row.try_get("ordering_key").map_err(fail(what))?,
                    pending: unsigned(row.try_get("pending").map_err(fail(what))?),
                    oldest: Duration::from_millis(unsigned(now_ms - created_ms)),
                })
            })
            .collect::<Result<Vec<_>>>()?;
            let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM turnstile_outbox_delivered")
                .fetch_one(&self.pool)
                .await
                .map_err(fail(what))?;
            Ok(Status {
                kept: unsigned(kept),
                pending: unsigned(row.try_get("pending").map_err(fail(what))?),
                pending_keys: unsigned(row.try_get("keys").map_err(fail(what))?),
                oldest_pending: oldest.map(|ms| Duration::from_millis(unsigned(now_ms - ms))),
                parked,
                lagging,
            })
        })
    }

    fn sweep(&self, limit: u32) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move {
            let Some(retention) = self.keep_delivered else {
                return Ok(0);
            };
            let (now_ms, _) = wall_clock();
            Ok(sqlx::query(
                "DELETE FROM turnstile_outbox_delivered WHERE rowid IN (
                    SELECT rowid FROM turnstile_outbox_delivered
                    WHERE delivered_ms < ?1 ORDER BY delivered_ms LIMIT ?2)",
            )
            .bind(now_ms - millis_i64(retention))
            .bind(i64::from(limit))
            .execute(&self.pool)
            .await
            .map_err(fail("cannot sweep delivered outbox messages"))?
            .rows_affected())
        })
    }

    fn committed(&self, timeout: Duration) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let _ = tokio::time::timeout(timeout, self.committed.notified()).await;
        })
    }

    fn describe(&self) -> String {
        format!("sqlite://{}", self.path.display())
    }
}
