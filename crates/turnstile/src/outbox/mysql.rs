//! The outbox in MySQL / MariaDB (InnoDB; `FOR UPDATE SKIP LOCKED` needs MySQL 8.0 or
//! MariaDB 10.6).
//!
//! Tables `{prefix}_outbox_keys` and `{prefix}_outbox` (prefix `turnstile` by default; URL
//! options `turnstile_prefix` and `turnstile_migrate`). Times are microseconds of the
//! server's clock.
//!
//! # Guarantees
//! - **Order**: the enqueue takes the key's row lock to assign the next sequence number,
//!   so sequence numbers per key follow commit order; a relay skips keys an application
//!   transaction holds (`SKIP LOCKED`).
//! - **Clock**: leases and backoff are judged by the database server's clock.
//! - **Durability**: an InnoDB commit (`innodb_flush_log_at_trx_commit = 1`, the
//!   default, for any crash).
//! - **Waking**: MySQL has no notifications: a [`commit`](MysqlOutbox::commit) wakes
//!   relays in this process; relays in other processes poll, backing off while idle.
//! - **Enqueue last**: the key's row stays locked until the application's transaction
//!   ends.

use std::sync::Arc;
use std::time::Duration;

use sqlx::mysql::{MySql, MySqlConnection, MySqlPool};
use sqlx::{Connection, Row};
use tokio::sync::Notify;

use super::{
    Backoff, LaggingKey, LeasedKey, Message, OutboxStore, ParkedKey, Settled, Settlement, Status,
    Stored,
};
use crate::engine::mysql::{CLOCK_US, connect_options, open_pool};
use crate::error::{Error, ErrorKind, Result};
use crate::future::BoxFuture;
use crate::sql::{Statement, map_error, statement, validate_identifier};
use crate::url::{split_url_options, unknown_option};

struct Sql {
    create: [Statement; 5],
    /// The key table's columns, to add the ones tables made before them lack.
    key_columns: Statement,
    /// Columns added to the key table after its first release, and how to add each:
    /// the head message's permanent failures (only those park a key), and the lease
    /// token last settled (a settlement tried again after a lost commit reply changes
    /// nothing).
    added_key_columns: [(&'static str, Statement); 2],
    /// A row if the message (key, seq) has an audit copy (a skip refuses to drop or
    /// overwrite one).
    skipped_copy: Statement,
    /// The recorded answer of a lease settled already (key, token, token).
    settled_before: Statement,
    identity: Statement,
    create_identity: Statement,
    skip_head: Statement,
    skip_keep: Statement,
    skip_delete: Statement,
    skip_unpark: Statement,
    keep: Statement,
    sweep: Statement,
    kept: Statement,
    bump: Statement,
    insert: Statement,
    pick: Statement,
    pick_one: Statement,
    starved: Statement,
    settle: Statement,
    parked_of: Statement,
    delete: Statement,
    redrive: Statement,
    status: Statement,
    parked: Statement,
    lagging: Statement,
    keys: String,
    outbox: String,
}

impl Sql {
    fn new(prefix: &str) -> Sql {
        let keys = format!("`{prefix}_outbox_keys`");
        let outbox = format!("`{prefix}_outbox`");
        let delivered = format!("`{prefix}_outbox_delivered`");
        let now = CLOCK_US;
        Sql {
            create: [
                statement(format!(
                    "CREATE TABLE IF NOT EXISTS {keys} (
                        ordering_key VARBINARY(255) PRIMARY KEY,
                        last_seq BIGINT NOT NULL,
                        acked_seq BIGINT NOT NULL DEFAULT 0,
                        available_us BIGINT NOT NULL DEFAULT 0,
                        lease_token BIGINT NOT NULL DEFAULT 0,
                        attempts INT NOT NULL DEFAULT 0,
                        last_error TEXT NULL,
                        parked TINYINT NOT NULL DEFAULT 0,
                        parked_us BIGINT NULL,
                        permanent_failures INT NOT NULL DEFAULT 0,
                        settled_token BIGINT NOT NULL DEFAULT 0,
                        KEY due (parked, available_us)) ENGINE = InnoDB"
                )),
                statement(format!(
                    "CREATE TABLE IF NOT EXISTS {outbox} (
                        ordering_key VARBINARY(255) NOT NULL,
                        seq BIGINT NOT NULL,
                        id VARCHAR(36) CHARACTER SET ascii NOT NULL,
                        topic VARBINARY(255) NOT NULL,
                        headers TEXT NOT NULL,
                        payload LONGBLOB NOT NULL,
                        created_us BIGINT NOT NULL,
                        PRIMARY KEY (ordering_key, seq)) ENGINE = InnoDB"
                )),
                statement(format!(
                    "CREATE TABLE IF NOT EXISTS {delivered} (
                        ordering_key VARBINARY(255) NOT NULL,
                        seq BIGINT NOT NULL,
                        id VARCHAR(36) CHARACTER SET ascii NOT NULL,
                        topic VARBINARY(255) NOT NULL,
                        headers TEXT NOT NULL,
                        payload LONGBLOB NOT NULL,
                        created_us BIGINT NOT NULL,
                        delivered_us BIGINT NOT NULL,
                        PRIMARY KEY (ordering_key, seq),
                        KEY delivered_at (delivered_us)) ENGINE = InnoDB"
                )),
                // The outbox's identity (one row): sent with every message, so that
                // consumers tell this outbox's keys and sequences from another's.
                statement(format!(
                    "CREATE TABLE IF NOT EXISTS `{prefix}_outbox_identity` (
                        one TINYINT PRIMARY KEY, id VARCHAR(36) CHARACTER SET ascii NOT NULL)
                     ENGINE = InnoDB"
                )),
                // Messages an operator moved aside (`turnstile outbox skip`), for audit.
                statement(format!(
                    "CREATE TABLE IF NOT EXISTS `{prefix}_outbox_skipped` (
                        ordering_key VARBINARY(255) NOT NULL,
                        seq BIGINT NOT NULL,
                        id VARCHAR(36) CHARACTER SET ascii NOT NULL,
                        topic VARBINARY(255) NOT NULL,
                        headers TEXT NOT NULL,
                        payload LONGBLOB NOT NULL,
                        created_us BIGINT NOT NULL,
                        skipped_us BIGINT NOT NULL,
                        reason TEXT NULL,
                        PRIMARY KEY (ordering_key, seq)) ENGINE = InnoDB"
                )),
            ],
            key_columns: statement(format!(
                "SELECT CAST(COLUMN_NAME AS CHAR) FROM information_schema.COLUMNS
                 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = '{prefix}_outbox_keys'"
            )),
            added_key_columns: [
                (
                    "permanent_failures",
                    statement(format!(
                        "ALTER TABLE {keys} ADD COLUMN permanent_failures INT NOT NULL DEFAULT 0"
                    )),
                ),
                (
                    "settled_token",
                    statement(format!(
                        "ALTER TABLE {keys} ADD COLUMN settled_token BIGINT NOT NULL DEFAULT 0"
                    )),
                ),
            ],
            skipped_copy: statement(format!(
                "SELECT 1 FROM `{prefix}_outbox_skipped` WHERE ordering_key = ? AND seq = ?"
            )),
            settled_before: statement(format!(
                "SELECT parked FROM {keys} WHERE ordering_key = ? AND lease_token = ? AND settled_token = ?"
            )),
            identity: statement(format!("SELECT id FROM `{prefix}_outbox_identity`")),
            create_identity: statement(format!(
                "INSERT IGNORE INTO `{prefix}_outbox_identity` (one, id) VALUES (1, ?)"
            )),
            skip_head: statement(format!(
                "SELECT acked_seq, parked FROM {keys} WHERE ordering_key = ? FOR UPDATE"
            )),
            skip_keep: statement(format!(
                "INSERT INTO `{prefix}_outbox_skipped`
                    (ordering_key, seq, id, topic, headers, payload, created_us, skipped_us, reason)
                 SELECT m.ordering_key, m.seq, m.id, m.topic, m.headers, m.payload, m.created_us, {now}, k.last_error
                 FROM {outbox} m JOIN {keys} k ON k.ordering_key = m.ordering_key
                 WHERE m.ordering_key = ? AND m.seq = ?"
            )),
            skip_delete: statement(format!(
                "DELETE FROM {outbox} WHERE ordering_key = ? AND seq = ?"
            )),
            skip_unpark: statement(format!(
                "UPDATE {keys} SET acked_seq = ?, parked = 0, attempts = 0, permanent_failures = 0,
                    last_error = NULL, available_us = 0
                 WHERE ordering_key = ?"
            )),
            keep: statement(format!(
                "INSERT IGNORE INTO {delivered}
                    (ordering_key, seq, id, topic, headers, payload, created_us, delivered_us)
                 SELECT ordering_key, seq, id, topic, headers, payload, created_us, {now}
                 FROM {outbox} WHERE ordering_key = ? AND seq <= ?"
            )),
            sweep: statement(format!(
                "DELETE FROM {delivered} WHERE delivered_us < {now} - ? ORDER BY delivered_us LIMIT ?"
            )),
            kept: statement(format!("SELECT COUNT(*) FROM {delivered}")),
            // The new sequence number comes back as the statement's insert id.
            bump: statement(format!(
                "INSERT INTO {keys} (ordering_key, last_seq) VALUES (?, LAST_INSERT_ID(1))
                 ON DUPLICATE KEY UPDATE last_seq = LAST_INSERT_ID(last_seq + 1)"
            )),
            insert: statement(format!(
                "INSERT INTO {outbox} (ordering_key, seq, id, topic, headers, payload, created_us)
                 VALUES (?, ?, ?, ?, ?, ?, {now})"
            )),
            pick: statement(format!(
                "SELECT ordering_key, acked_seq, lease_token, attempts, available_us FROM {keys}
                 WHERE parked = 0 AND available_us <= {now} AND acked_seq < last_seq
                 ORDER BY available_us LIMIT ? FOR UPDATE SKIP LOCKED"
            )),
            // One key, waiting for its row (within the session's lock wait).
            pick_one: statement(format!(
                "SELECT ordering_key, acked_seq, lease_token, attempts, available_us FROM {keys}
                 WHERE ordering_key = ? AND parked = 0 AND available_us <= {now}
                   AND acked_seq < last_seq
                 FOR UPDATE"
            )),
            // The oldest key due for a second that a claim passed over although a
            // newer one (due at ?, the newest picked) was taken: a consistent read,
            // which locked rows do not stop.
            starved: statement(format!(
                "SELECT ordering_key FROM {keys}
                 WHERE parked = 0 AND available_us <= {now} - 1000000 AND acked_seq < last_seq
                   AND available_us < ?
                 ORDER BY available_us LIMIT 1"
            )),
            // MySQL assigns left to right on the updated row: `permanent_failures`,
            // `attempts` and `acked_seq`, which the others read, come last. The head
            // message's failures before this one (all of them for the backoff, the
            // permanent ones for parking) start again at 0 when this settlement moved
            // the head. A lease settled already is left as it is (`settled_token`).
            // Binds: permanent, delivered, max attempts (park); reason; failed, max µs,
            // base µs, delivered (backoff); permanent, delivered, failed, delivered
            // (permanent failures); failed, delivered (attempts); token; delivered; key,
            // token, token.
            settle: statement(format!(
                "UPDATE {keys} SET
                    parked = IF(? AND IF(? > acked_seq, 0, permanent_failures) + 1 >= ?, 1, 0),
                    parked_us = {now},
                    last_error = ?,
                    available_us = IF(?, {now} + CAST(LEAST(?, ? << LEAST(IF(? > acked_seq, 0, attempts), 20))
                                         * (0.5 + RAND() / 2) AS SIGNED), {now}),
                    permanent_failures = IF(?, IF(? > acked_seq, 0, permanent_failures) + 1,
                                            IF(? AND ? <= acked_seq, permanent_failures, 0)),
                    attempts = IF(?, IF(? > acked_seq, 0, attempts) + 1, 0),
                    settled_token = ?,
                    acked_seq = GREATEST(acked_seq, ?)
                 WHERE ordering_key = ? AND lease_token = ? AND settled_token <> ?"
            )),
            parked_of: statement(format!("SELECT parked FROM {keys} WHERE ordering_key = ?")),
            delete: statement(format!("DELETE FROM {outbox} WHERE ordering_key = ? AND seq <= ?")),
            redrive: statement(format!(
                "UPDATE {keys} SET parked = 0, attempts = 0, permanent_failures = 0,
                    last_error = NULL, available_us = 0
                 WHERE ordering_key = ? AND parked = 1"
            )),
            status: statement(format!(
                "SELECT CAST(COALESCE(SUM(last_seq - acked_seq), 0) AS SIGNED) AS pending,
                        COUNT(*) AS pending_keys,
                        (SELECT {now} - MIN(m.created_us) FROM {keys} k
                         JOIN {outbox} m ON m.ordering_key = k.ordering_key AND m.seq = k.acked_seq + 1
                         WHERE k.acked_seq < k.last_seq AND k.parked = 0) AS oldest_us
                 FROM {keys} WHERE acked_seq < last_seq AND parked = 0"
            )),
            parked: statement(format!(
                "SELECT ordering_key, attempts, last_error, last_seq - acked_seq AS pending
                 FROM {keys} WHERE parked = 1 ORDER BY parked_us LIMIT ?"
            )),
            lagging: statement(format!(
                "SELECT k.ordering_key, CAST(k.last_seq - k.acked_seq AS SIGNED) AS pending,
                        CAST({now} - m.created_us AS SIGNED) AS oldest_us
                 FROM {keys} k
                 JOIN {outbox} m ON m.ordering_key = k.ordering_key AND m.seq = k.acked_seq + 1
                 WHERE k.acked_seq < k.last_seq AND k.parked = 0
                 ORDER BY m.created_us LIMIT ?"
            )),
            keys,
            outbox,
        }
    }
}

/// The outbox in MySQL / MariaDB tables.
#[derive(Clone)]
pub struct MysqlOutbox {
    pool: MySqlPool,
    keep_delivered: Option<Duration>,
    max_message: Option<usize>,
    identity: Option<Arc<str>>,
    sql: Arc<Sql>,
    committed: Arc<Notify>,
    url: String,
}

impl std::fmt::Debug for MysqlOutbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MysqlOutbox")
            .field("url", &self.url)
            .finish()
    }
}

fn fail(what: &'static str) -> impl Fn(sqlx::Error) -> Error {
    move |error| map_error(error, what)
}

fn unsigned(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

fn signed(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

fn text(bytes: Vec<u8>) -> String {
    String::from_utf8_lossy(&bytes).into_owned()
}

impl MysqlOutbox {
    /// Connects with the URL's `turnstile_*` options (`prefix`, `migrate`,
    /// `keep_delivered=SECONDS`), creating the tables on first use unless
    /// `turnstile_migrate=off`.
    pub async fn connect(url: &str) -> Result<Self> {
        let (url, keep_delivered) = super::keep_delivered_option(url)?;
        let (driver_url, options) = split_url_options(&url);
        let (mut prefix, mut migrate) = ("turnstile".to_owned(), true);
        for (key, value) in &options {
            match (key.as_str(), value.as_str()) {
                ("prefix", _) => prefix = value.clone(),
                ("migrate", "on" | "true" | "1" | "yes") => migrate = true,
                ("migrate", "off" | "false" | "0" | "no") => migrate = false,
                _ => {
                    return Err(unknown_option(
                        key,
                        value,
                        "turnstile_prefix, turnstile_migrate=on|off",
                    ));
                }
            }
        }
        validate_identifier("table prefix", &prefix)?;
        let redacted = crate::url::redact(&driver_url);
        let options = connect_options(&driver_url)?;
        // READ COMMITTED: a settlement's DELETE then locks the rows it deletes and no
        // gaps, so it cannot deadlock with an application's enqueue inserting the next
        // message of a key.
        let pool = open_pool(
            &options,
            8,
            Duration::from_secs(3),
            &redacted,
            &["SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED"],
        )
        .await?;
        let mut outbox = MysqlOutbox {
            pool,
            keep_delivered,
            max_message: None,
            identity: None,
            sql: Arc::new(Sql::new(&prefix)),
            committed: Arc::default(),
            url: redacted,
        };
        if migrate {
            outbox.migrate().await?;
        } else {
            super::check_key_columns(&outbox.key_columns().await?)?;
        }
        outbox.identity = match sqlx::query_scalar::<_, String>(outbox.sql.identity.sql())
            .fetch_optional(&outbox.pool)
            .await
        {
            Ok(id) => id.map(Arc::from),
            Err(error) if crate::sql::is_missing_table(&error) => None,
            Err(error) => return Err(map_error(error, "cannot read the outbox's identity")),
        };
        Ok(outbox)
    }

    /// The outbox's identity, sent with every message as
    /// [`PRODUCER_HEADER`](super::PRODUCER_HEADER).
    pub fn identity(&self) -> Option<&str> {
        self.identity.as_deref()
    }

    /// Creates the tables if missing; harmless to repeat and to run at once.
    pub async fn migrate(&self) -> Result<()> {
        for create in &self.sql.create {
            sqlx::query(create.sql())
                .execute(&self.pool)
                .await
                .map_err(fail("cannot create the outbox tables"))?;
        }
        let columns = self.key_columns().await?;
        for (column, add) in &self.sql.added_key_columns {
            if columns.iter().any(|name| name == column) {
                continue;
            }
            // A waiting ALTER TABLE holds up every later statement on the table (every
            // enqueue), and MySQL's metadata-lock wait is a year by default: it waits at
            // most 10 s for an open transaction, on a connection of its own that is
            // closed after, so the setting reaches no pooled connection.
            let mut connection = self
                .pool
                .acquire()
                .await
                .map_err(fail("cannot add a column to the outbox tables"))?
                .detach();
            let added = match sqlx::query("SET SESSION lock_wait_timeout = 10")
                .execute(&mut connection)
                .await
            {
                Ok(_) => sqlx::query(add.sql()).execute(&mut connection).await,
                Err(error) => Err(error),
            };
            let _ = Connection::close(connection).await;
            match added {
                Ok(_) => {}
                // Another process added it meanwhile (1060: duplicate column name).
                Err(sqlx::Error::Database(error)) if error.code().as_deref() == Some("42S21") => {}
                Err(error) => {
                    return Err(map_error(error, "cannot add a column to the outbox tables"));
                }
            }
        }
        sqlx::query(self.sql.create_identity.sql())
            .bind(uuid::Uuid::now_v7().to_string())
            .execute(&self.pool)
            .await
            .map_err(fail("cannot create the outbox's identity"))?;
        Ok(())
    }

    /// The key table's columns (none if there is no key table).
    async fn key_columns(&self) -> Result<Vec<String>> {
        sqlx::query_scalar(self.sql.key_columns.sql())
            .fetch_all(&self.pool)
            .await
            .map_err(fail("cannot read the outbox tables' columns"))
    }

    /// Writes `message` in the application's transaction on `connection`, after its
    /// key's last message. Enqueue last in the transaction: the key's row stays locked
    /// until it ends.
    ///
    /// The sequence number and the message row are two statements that must commit
    /// together, or a relay could deliver a later message first and never see this
    /// one. On a connection outside a transaction the enqueue therefore runs in a
    /// transaction of its own (committed before it returns) where the server can say
    /// that none is open (MariaDB's `@@in_transaction`); where it cannot (MySQL), an
    /// enqueue outside a `sqlx` transaction is refused with
    /// [`ErrorKind::InvalidOptions`] and writes
    /// nothing.
    pub async fn enqueue(
        &self,
        connection: &mut MySqlConnection,
        message: &Message,
    ) -> Result<u64> {
        super::check_size(message, self.max_message)?;
        let what = "cannot enqueue the message";
        let seq = if connection.is_in_transaction() || open_transaction(connection).await? {
            self.write_message(connection, message).await?
        } else {
            let mut transaction = connection.begin().await.map_err(fail(what))?;
            let seq = self.write_message(&mut transaction, message).await?;
            transaction.commit().await.map_err(fail(what))?;
            self.committed.notify_one();
            seq
        };
        super::telemetry::enqueued(message, seq);
        Ok(seq)
    }

    async fn write_message(
        &self,
        connection: &mut MySqlConnection,
        message: &Message,
    ) -> Result<u64> {
        let what = "cannot enqueue the message";
        let seq = sqlx::query(self.sql.bump.sql())
            .bind(message.key())
            .execute(&mut *connection)
            .await
            .map_err(fail(what))?
            .last_insert_id();
        sqlx::query(self.sql.insert.sql())
            .bind(message.key())
            .bind(signed(seq))
            .bind(message.id())
            .bind(message.topic())
            .bind(message.headers_json_from(self.identity()))
            .bind(message.payload())
            .execute(&mut *connection)
            .await
            .map_err(fail(what))?;
        Ok(seq)
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

    /// Keeps delivered messages for `retention` (in `{prefix}_outbox_delivered`) instead
    /// of deleting them when they are delivered; `None` deletes them (the default).
    pub fn keep_delivered(mut self, retention: Option<Duration>) -> Self {
        self.keep_delivered = retention;
        self
    }

    /// Commits `transaction` and wakes this process's relays at once.
    pub async fn commit(&self, transaction: sqlx::Transaction<'_, sqlx::MySql>) -> Result<()> {
        transaction
            .commit()
            .await
            .map_err(fail("cannot commit the transaction"))?;
        self.committed.notify_one();
        Ok(())
    }
}

/// Whether the server has a transaction open on `connection` that `sqlx` does not
/// know of (a `START TRANSACTION` sent as SQL): MariaDB says so in `@@in_transaction`;
/// a server that cannot say (MySQL) gets a refusal rather than a guess, because
/// beginning a transaction inside an open one would commit the open one.
async fn open_transaction(connection: &mut MySqlConnection) -> Result<bool> {
    match sqlx::query_scalar::<_, u64>("SELECT CAST(@@in_transaction AS UNSIGNED)")
        .fetch_one(&mut *connection)
        .await
    {
        Ok(open) => Ok(open != 0),
        Err(sqlx::Error::Database(_)) => Err(Error::new(
            ErrorKind::InvalidOptions,
            "enqueue outside a transaction: this server cannot say whether one is open \
             (no @@in_transaction), so begin one with `pool.begin()` and enqueue on it",
        )),
        Err(error) => Err(map_error(error, "cannot enqueue the message")),
    }
}

impl MysqlOutbox {
    async fn settle_once(
        &self,
        connection: &mut sqlx::MySqlConnection,
        settlements: &[Settlement],
        max_attempts: u32,
        backoff: Backoff,
    ) -> Result<Vec<Settled>> {
        let what = "cannot record delivered outbox messages";
        let base_us = i64::try_from(backoff.base.as_micros())
            .unwrap_or(i64::MAX)
            .max(1);
        let max_us = i64::try_from(backoff.max.as_micros())
            .unwrap_or(i64::MAX)
            .max(1);
        let mut transaction = Connection::begin(&mut *connection)
            .await
            .map_err(fail(what))?;
        // Keys in one order in every relay's settlement, so two never wait on each other.
        let mut order: Vec<usize> = (0..settlements.len()).collect();
        order.sort_by(|a, b| settlements[*a].key.cmp(&settlements[*b].key));
        let mut answers = vec![Settled::Fenced; settlements.len()];
        for index in order {
            let settlement = &settlements[index];
            let failed = settlement.failure.is_some();
            let permanent = settlement.failure.as_ref().is_some_and(|f| f.permanent);
            let delivered = signed(settlement.delivered_through);
            let token = signed(settlement.token);
            let changed = sqlx::query(self.sql.settle.sql())
                .bind(permanent)
                .bind(delivered)
                .bind(i64::from(max_attempts.max(1)))
                .bind(settlement.failure.as_ref().map(|f| f.reason.as_str()))
                .bind(failed)
                .bind(max_us)
                .bind(base_us)
                .bind(delivered)
                .bind(permanent)
                .bind(delivered)
                .bind(failed)
                .bind(delivered)
                .bind(failed)
                .bind(delivered)
                .bind(token)
                .bind(delivered)
                .bind(settlement.key.as_bytes())
                .bind(token)
                .bind(token)
                .execute(&mut *transaction)
                .await
                .map_err(fail(what))?
                .rows_affected();
            if changed == 0 {
                // Fenced, or settled already (its commit's reply was lost and the
                // settlement is tried again): then its recorded answer, counted once.
                let settled: Option<i8> = sqlx::query_scalar(self.sql.settled_before.sql())
                    .bind(settlement.key.as_bytes())
                    .bind(token)
                    .bind(token)
                    .fetch_optional(&mut *transaction)
                    .await
                    .map_err(fail(what))?;
                answers[index] = match settled {
                    Some(1) => Settled::Parked,
                    Some(_) => Settled::Done,
                    None => Settled::Fenced,
                };
                continue;
            }
            if self.keep_delivered.is_some() {
                sqlx::query(self.sql.keep.sql())
                    .bind(settlement.key.as_bytes())
                    .bind(delivered)
                    .execute(&mut *transaction)
                    .await
                    .map_err(fail(what))?;
            }
            sqlx::query(self.sql.delete.sql())
                .bind(settlement.key.as_bytes())
                .bind(delivered)
                .execute(&mut *transaction)
                .await
                .map_err(fail(what))?;
            let parked: i8 = sqlx::query_scalar(self.sql.parked_of.sql())
                .bind(settlement.key.as_bytes())
                .fetch_one(&mut *transaction)
                .await
                .map_err(fail(what))?;
            answers[index] = if parked == 1 {
                Settled::Parked
            } else {
                Settled::Done
            };
        }
        transaction.commit().await.map_err(fail(what))?;
        Ok(answers)
    }
}

/// InnoDB's "deadlock found" (1213): the transaction was rolled back and may be retried.
fn is_deadlock(error: &Error) -> bool {
    use std::error::Error as _;
    error
        .source()
        .and_then(|source| source.downcast_ref::<sqlx::Error>())
        .and_then(crate::engine::mysql::server_error_number)
        == Some(1213)
}

/// A leased key as the claim reads it: (key, acked, lease token, attempts).
type LeasedRow = (String, i64, u64, u32);

impl MysqlOutbox {
    /// Leases the keys `picked` holds (their rows locked by this transaction).
    async fn lease_picked(
        &self,
        transaction: &mut sqlx::Transaction<'_, MySql>,
        picked: &[sqlx::mysql::MySqlRow],
        lease: Duration,
    ) -> Result<Vec<LeasedRow>> {
        let what = "cannot claim outbox messages";
        let mut keys = Vec::with_capacity(picked.len());
        for row in picked {
            keys.push((
                text(row.try_get("ordering_key").map_err(fail(what))?),
                row.try_get::<i64, _>("acked_seq").map_err(fail(what))?,
                unsigned(row.try_get("lease_token").map_err(fail(what))?) + 1,
                u32::try_from(row.try_get::<i32, _>("attempts").map_err(fail(what))?).unwrap_or(0),
            ));
        }
        if keys.is_empty() {
            return Ok(keys);
        }
        let marks = vec!["?"; keys.len()].join(", ");
        let lease_sql = format!(
            "UPDATE {} SET available_us = {CLOCK_US} + ?, lease_token = lease_token + 1
             WHERE ordering_key IN ({marks})",
            self.sql.keys
        );
        let mut lease_query = sqlx::query(sqlx::AssertSqlSafe(lease_sql))
            .bind(i64::try_from(lease.as_micros()).unwrap_or(i64::MAX));
        for (key, ..) in &keys {
            lease_query = lease_query.bind(key.as_bytes());
        }
        lease_query
            .execute(&mut **transaction)
            .await
            .map_err(fail(what))?;
        Ok(keys)
    }

    /// Leases `key`, waiting up to a second (InnoDB's shortest lock wait) for an
    /// application transaction that holds its row; `None` if it is no longer due.
    async fn lease_waiting(&self, key: &str, lease: Duration) -> Result<Option<LeasedRow>> {
        let what = "cannot claim a passed-over outbox key";
        let mut connection =
            ShortLockWait::set(&self.pool, "SET SESSION innodb_lock_wait_timeout = 1", what)
                .await?;
        let leased = async {
            let mut transaction = Connection::begin(&mut *connection)
                .await
                .map_err(fail(what))?;
            let picked = sqlx::query(self.sql.pick_one.sql())
                .bind(key.as_bytes())
                .fetch_all(&mut *transaction)
                .await
                .map_err(fail(what))?;
            let keys = self.lease_picked(&mut transaction, &picked, lease).await?;
            transaction.commit().await.map_err(fail(what))?;
            Ok(keys.into_iter().next())
        }
        .await;
        connection.reset(what).await?;
        leased
    }
}

/// A pooled connection whose `innodb_lock_wait_timeout` is cut short for one job. It
/// goes back to the pool only once [`ShortLockWait::reset`] restored the server's own
/// wait; dropped otherwise (the job cancelled, or the reset refused), it is closed, so
/// that no later statement on the pool meets the short wait.
struct ShortLockWait {
    connection: sqlx::pool::PoolConnection<MySql>,
    reset: bool,
}

impl ShortLockWait {
    async fn set(
        pool: &MySqlPool,
        statement: &'static str,
        what: &'static str,
    ) -> Result<ShortLockWait> {
        let mut connection = ShortLockWait {
            connection: pool.acquire().await.map_err(fail(what))?,
            reset: false,
        };
        sqlx::query(statement)
            .execute(&mut *connection.connection)
            .await
            .map_err(fail(what))?;
        Ok(connection)
    }

    async fn reset(&mut self, what: &'static str) -> Result<()> {
        sqlx::query("SET SESSION innodb_lock_wait_timeout = DEFAULT")
            .execute(&mut *self.connection)
            .await
            .map_err(fail(what))?;
        self.reset = true;
        Ok(())
    }
}

impl std::ops::Deref for ShortLockWait {
    type Target = MySqlConnection;
    fn deref(&self) -> &MySqlConnection {
        &self.connection
    }
}

impl std::ops::DerefMut for ShortLockWait {
    fn deref_mut(&mut self) -> &mut MySqlConnection {
        &mut self.connection
    }
}

impl Drop for ShortLockWait {
    fn drop(&mut self) {
        if !self.reset {
            self.connection.close_on_drop();
        }
    }
}

impl OutboxStore for MysqlOutbox {
    fn claim_within(
        &self,
        max_keys: u32,
        per_key: u32,
        max_bytes: u64,
        lease: Duration,
    ) -> BoxFuture<'_, Result<Vec<LeasedKey>>> {
        Box::pin(async move {
            let what = "cannot claim outbox messages";
            let mut transaction = self.pool.begin().await.map_err(fail(what))?;
            let picked = sqlx::query(self.sql.pick.sql())
                .bind(i64::from(max_keys))
                .fetch_all(&mut *transaction)
                .await
                .map_err(fail(what))?;
            let mut keys = self.lease_picked(&mut transaction, &picked, lease).await?;
            transaction.commit().await.map_err(fail(what))?;
            // A key passed over by `SKIP LOCKED` although its turn had come (due for a
            // second, and older than a key that was picked): an application
            // transaction held its row. Wait a moment for it, so that a key written all
            // the time is still served; a wait that runs out leaves it to the next round.
            if keys.len() < max_keys as usize {
                let newest_picked = picked
                    .iter()
                    .filter_map(|row| row.try_get::<i64, _>("available_us").ok())
                    .max()
                    .unwrap_or(i64::MAX);
                let starved: Option<Vec<u8>> = sqlx::query_scalar(self.sql.starved.sql())
                    .bind(newest_picked)
                    .fetch_optional(&self.pool)
                    .await
                    .map_err(fail(what))?;
                if let Some(starved) = starved.map(text)
                    && keys.iter().all(|(key, ..)| *key != starved)
                {
                    match self.lease_waiting(&starved, lease).await {
                        Ok(Some(key)) => {
                            super::telemetry::starved_key_served(&starved);
                            keys.push(key);
                        }
                        Ok(None) => {}
                        Err(error) => {
                            tracing::debug!(%error, key = %starved, "a passed-over key stayed locked");
                        }
                    }
                }
            }
            if keys.is_empty() {
                return Ok(Vec::new());
            }
            // The leased keys' next messages (their rows are ours until the lease ends).
            let ranges =
                vec!["(ordering_key = ? AND seq > ? AND seq <= ?)"; keys.len()].join(" OR ");
            // Only while the bytes, counted in key order, fit the budget (the first
            // message always does): the round's memory is bounded whatever the sizes.
            let read_sql = format!(
                "SELECT ordering_key, seq, id, topic, fits,
                        CASE WHEN fits THEN headers END AS headers,
                        CASE WHEN fits THEN payload END AS payload, age_us FROM (
                    SELECT ordering_key, seq, id, topic, headers, payload,
                           {CLOCK_US} - created_us AS age_us,
                           SUM(LENGTH(payload) + LENGTH(headers))
                               OVER (ORDER BY ordering_key, seq ROWS UNBOUNDED PRECEDING) <= ?
                           OR SUM(LENGTH(payload) + LENGTH(headers))
                               OVER (ORDER BY ordering_key, seq ROWS UNBOUNDED PRECEDING)
                              = LENGTH(payload) + LENGTH(headers) AS fits
                    FROM {} WHERE {ranges}) sized
                 ORDER BY ordering_key, seq",
                self.sql.outbox
            );
            let mut read = sqlx::query(sqlx::AssertSqlSafe(read_sql))
                .bind(i64::try_from(max_bytes).unwrap_or(i64::MAX));
            for (key, acked, ..) in &keys {
                read = read
                    .bind(key.as_bytes())
                    .bind(*acked)
                    .bind(acked.saturating_add(i64::from(per_key)));
            }
            let rows = read.fetch_all(&self.pool).await.map_err(fail(what))?;
            let mut leased: Vec<LeasedKey> = keys
                .into_iter()
                .map(|(key, acked, token, attempts)| LeasedKey {
                    key,
                    token,
                    attempts,
                    acked: unsigned(acked),
                    messages: Vec::new(),
                    over_budget: false,
                })
                .collect();
            for row in rows {
                let key = text(row.try_get("ordering_key").map_err(fail(what))?);
                let Some(entry) = leased.iter_mut().find(|entry| entry.key == key) else {
                    continue;
                };
                if !row.try_get::<bool, _>("fits").map_err(fail(what))? {
                    entry.over_budget = true;
                    continue;
                }
                // Gaps are the relay's to find (it checks every store's messages
                // against the key's delivered number), so all are handed over.
                let seq = unsigned(row.try_get("seq").map_err(fail(what))?);
                let headers: String = row.try_get("headers").map_err(fail(what))?;
                entry.messages.push(Stored {
                    seq,
                    age: Duration::from_micros(unsigned(
                        row.try_get("age_us").map_err(fail(what))?,
                    )),
                    message: Message::from_stored(
                        row.try_get("id").map_err(fail(what))?,
                        text(row.try_get("topic").map_err(fail(what))?),
                        key,
                        &headers,
                        row.try_get("payload").map_err(fail(what))?,
                    ),
                });
            }
            Ok(leased)
        })
    }

    fn settle<'a>(
        &'a self,
        settlements: &'a [Settlement],
        max_attempts: u32,
        backoff: Backoff,
    ) -> BoxFuture<'a, Result<Vec<Settled>>> {
        Box::pin(async move {
            // InnoDB may pick this transaction as a deadlock victim (its index updates
            // meet other relays' claims); it is rolled back whole, and settling again is
            // harmless (tokens and GREATEST make it idempotent).
            let what = "cannot record delivered outbox messages";
            // A key row an application's transaction holds makes the settlement wait
            // at most two seconds, not the server's 50 s (longer than the lease): the
            // relay then settles the other keys on their own and retries this one.
            let mut connection =
                ShortLockWait::set(&self.pool, "SET SESSION innodb_lock_wait_timeout = 2", what)
                    .await?;
            let mut attempt = 0;
            let settled = loop {
                match self
                    .settle_once(&mut connection, settlements, max_attempts, backoff)
                    .await
                {
                    Err(error) if attempt < 5 && is_deadlock(&error) => {
                        attempt += 1;
                        tokio::time::sleep(Duration::from_millis(2 * attempt)).await;
                    }
                    other => break other,
                }
            };
            connection.reset(what).await?;
            settled
        })
    }
    fn redrive<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let changed = sqlx::query(self.sql.redrive.sql())
                .bind(key.as_bytes())
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
            let mut transaction = self.pool.begin().await.map_err(fail(what))?;
            let head = sqlx::query(self.sql.skip_head.sql())
                .bind(key.as_bytes())
                .fetch_optional(&mut *transaction)
                .await
                .map_err(fail(what))?
                .map(|row| {
                    let acked: i64 = row.try_get("acked_seq").map_err(fail(what))?;
                    let parked: i8 = row.try_get("parked").map_err(fail(what))?;
                    Ok::<_, Error>((unsigned(acked) + 1, parked == 1))
                })
                .transpose()?;
            super::check_skip(key, seq, head)?;
            // An audit copy of this key and number already there (an outbox whose
            // sequences started again) is never dropped or overwritten: the skip is
            // refused, and changes nothing.
            let copied: Option<i32> = sqlx::query_scalar(self.sql.skipped_copy.sql())
                .bind(key.as_bytes())
                .bind(signed(seq))
                .fetch_optional(&mut *transaction)
                .await
                .map_err(fail(what))?;
            super::check_no_audit_copy(copied.is_some(), key, seq, "the skipped messages' table")?;
            let moved = sqlx::query(self.sql.skip_keep.sql())
                .bind(key.as_bytes())
                .bind(signed(seq))
                .execute(&mut *transaction)
                .await
                .map_err(fail(what))?
                .rows_affected();
            sqlx::query(self.sql.skip_delete.sql())
                .bind(key.as_bytes())
                .bind(signed(seq))
                .execute(&mut *transaction)
                .await
                .map_err(fail(what))?;
            sqlx::query(self.sql.skip_unpark.sql())
                .bind(signed(seq))
                .bind(key.as_bytes())
                .execute(&mut *transaction)
                .await
                .map_err(fail(what))?;
            transaction.commit().await.map_err(fail(what))?;
            super::telemetry::skipped(key, seq, moved > 0);
            self.committed.notify_one();
            Ok(moved > 0)
        })
    }

    fn status(&self, parked_limit: u32) -> BoxFuture<'_, Result<Status>> {
        Box::pin(async move {
            let what = "cannot read the outbox status";
            let row = sqlx::query(self.sql.status.sql())
                .fetch_one(&self.pool)
                .await
                .map_err(fail(what))?;
            let parked = sqlx::query(self.sql.parked.sql())
                .bind(i64::from(parked_limit))
                .fetch_all(&self.pool)
                .await
                .map_err(fail(what))?
                .iter()
                .map(|row| {
                    Ok(ParkedKey {
                        key: text(row.try_get("ordering_key").map_err(fail(what))?),
                        attempts: u32::try_from(
                            row.try_get::<i32, _>("attempts").map_err(fail(what))?,
                        )
                        .unwrap_or(0),
                        reason: row.try_get("last_error").map_err(fail(what))?,
                        pending: unsigned(row.try_get("pending").map_err(fail(what))?),
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let oldest: Option<i64> = row.try_get("oldest_us").map_err(fail(what))?;
            let kept: i64 = sqlx::query_scalar(self.sql.kept.sql())
                .fetch_one(&self.pool)
                .await
                .map_err(fail(what))?;
            let lagging = sqlx::query(self.sql.lagging.sql())
                .bind(i64::from(parked_limit))
                .fetch_all(&self.pool)
                .await
                .map_err(fail(what))?
                .iter()
                .map(|row| {
                    Ok(LaggingKey {
                        key: text(row.try_get("ordering_key").map_err(fail(what))?),
                        pending: unsigned(row.try_get("pending").map_err(fail(what))?),
                        oldest: Duration::from_micros(unsigned(
                            row.try_get("oldest_us").map_err(fail(what))?,
                        )),
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(Status {
                kept: unsigned(kept),
                pending: unsigned(row.try_get("pending").map_err(fail(what))?),
                pending_keys: unsigned(row.try_get("pending_keys").map_err(fail(what))?),
                oldest_pending: oldest.map(|us| Duration::from_micros(unsigned(us))),
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
            Ok(sqlx::query(self.sql.sweep.sql())
                .bind(i64::try_from(retention.as_micros()).unwrap_or(i64::MAX))
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
        self.url.clone()
    }
}
