//! The outbox in PostgreSQL.
//!
//! Tables `{schema}.{prefix}_outbox_keys` (a row per ordering key: its last sequence
//! number, what is delivered, its lease, backoff and parking), `{prefix}_outbox`
//! (undelivered messages) and `{prefix}_outbox_relays` (which relays are idle); schema
//! `public` and prefix `turnstile` by default, with the URL options `turnstile_schema`,
//! `turnstile_prefix`, `turnstile_notify` and `turnstile_migrate` as for the other
//! stores.
//!
//! # Guarantees
//! - **Order**: the enqueue statement takes the key's row lock to assign the next
//!   sequence number, so sequence numbers per key follow commit order. A relay skips
//!   keys whose rows an application transaction holds (`FOR UPDATE SKIP LOCKED`), so it
//!   never waits for one; it never reads past a gap.
//! - **Clock**: leases and backoff are judged by the database server's clock.
//! - **Durability**: committed with the application's transaction; the store's own
//!   statements run with `synchronous_commit = on`. Commit the application's
//!   transactions with `synchronous_commit = on` too (PostgreSQL's default): with it
//!   off, a database crash can lose a transaction whose message a relay already
//!   published — an event for a change that never happened.
//! - **Waking**: a relay that finds nothing marks itself idle in the same statement;
//!   an enqueue sends `NOTIFY` only while some relay is marked idle, so a busy system
//!   sends none (each `NOTIFY` makes its commit take a database-wide lock). Relays in
//!   the process of a [`commit`](PostgresOutbox::commit) are woken directly; the idle
//!   poll covers a notification that crossed the mark.
//! - **Enqueue last**: the key's row stays locked until the application's transaction
//!   ends; enqueue at the end of the transaction, and to several keys in a fixed order.

use std::sync::Arc;
use std::time::Duration;

use sqlx::Row;
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions};

use super::{
    Backoff, LaggingKey, LeasedKey, Message, OutboxStore, ParkedKey, Settled, Settlement, Status,
    Stored,
};
use crate::engine::postgres::{Listener, connect_options, open_bounded_pool};
use crate::error::{Error, Result};
use crate::future::BoxFuture;
use crate::notify::{ReleaseSignals, ReleaseWatch};
use crate::sql::{Statement, map_error, statement, validate_identifier};
use crate::url::{split_url_options, unknown_option};

struct Sql {
    create: Vec<String>,
    /// The key table's columns, to add the ones tables made before them lack.
    key_columns: Statement,
    /// Columns added to the key table after its first release, and how to add each:
    /// the head message's permanent failures (only those park a key), and the lease
    /// token last settled (a settlement tried again after a lost commit reply changes
    /// nothing).
    added_key_columns: Vec<(&'static str, String)>,
    /// $1 key, $2 seq: a key's head message, read again in a statement of its own.
    head_again: Statement,
    /// $1 key, $2 seq: a row if the message has an audit copy (a skip refuses to drop
    /// or overwrite one).
    skipped_copy: Statement,
    enqueue: Statement,
    claim: Statement,
    claim_waiting: Statement,
    lock_key: Statement,
    settle: Statement,
    settle_keeping: Statement,
    sweep: Statement,
    kept: Statement,
    redrive: Statement,
    skip_head: Statement,
    identity: Statement,
    create_identity: Statement,
    skip: Statement,
    status: Statement,
    parked: Statement,
    lagging: Statement,
    forget_relays: Statement,
    forget_relay: Statement,
    channel: String,
}

impl Sql {
    fn new(schema: &str, prefix: &str) -> Sql {
        let schema = format!("\"{schema}\"");
        let keys = format!("{schema}.\"{prefix}_outbox_keys\"");
        let outbox = format!("{schema}.\"{prefix}_outbox\"");
        let relays = format!("{schema}.\"{prefix}_outbox_relays\"");
        let delivered = format!("{schema}.\"{prefix}_outbox_delivered\"");
        let skipped = format!("{schema}.\"{prefix}_outbox_skipped\"");
        let identity = format!("{schema}.\"{prefix}_outbox_identity\"");
        let channel = format!("{prefix}_outbox");
        let now = "clock_timestamp()";
        let secs = |n: u8| format!("make_interval(secs => ${n}::float8)");
        // A claim: `picked` chooses and locks the keys (ordering_key, available_at),
        // `starved` names a key it passed over. $1 keys, $2 lease (s), $3 relay id, $4
        // messages per key, $5 idle mark (s), $6 bytes. The messages are read from the
        // statement's snapshot: a key's visible messages are a prefix of its sequence
        // (its commits are in order). Past the byte budget (the first message always
        // fits) rows carry the key alone, so the round's memory is bounded however
        // large the messages. Each key's messages are a range read of the outbox's
        // index (the `LIMIT` keeps it so): as a join, the planner hashed the whole
        // outbox table on every claim while a backlog drained, a cost per claim that
        // grew with the backlog.
        let claim = |picked: &str, starved: &str| {
            format!(
                "WITH picked AS ({picked}),
                 starved AS ({starved}),
                 leased AS (
                    UPDATE {keys} k SET available_at = {now} + {lease}, lease_token = k.lease_token + 1
                    FROM picked p WHERE k.ordering_key = p.ordering_key
                    RETURNING k.ordering_key, k.acked_seq, k.lease_token, k.attempts),
                 mark AS (
                    INSERT INTO {relays} AS r (relay_id, idle_until, seen_at)
                    SELECT $3, CASE WHEN EXISTS (SELECT 1 FROM leased) THEN '-infinity'::timestamptz
                                    ELSE {now} + {idle} END, {now}
                    ON CONFLICT (relay_id) DO UPDATE
                    SET idle_until = EXCLUDED.idle_until, seen_at = EXCLUDED.seen_at
                    -- Only a change is written: a busy relay marked busy, or an idle one
                    -- whose mark has more than half its time left, writes nothing, so
                    -- an empty claim commits without a flush to disk.
                    WHERE r.idle_until IS DISTINCT FROM EXCLUDED.idle_until
                      AND (EXCLUDED.idle_until = '-infinity'::timestamptz
                           OR r.idle_until < {now} + {idle} / 2)
                    RETURNING 1),
                 candidates AS (
                    SELECT l.ordering_key, l.lease_token, l.attempts, l.acked_seq, m.seq, m.id, m.topic,
                           m.headers, m.payload, m.created_at,
                           coalesce(octet_length(m.payload) + octet_length(m.headers), 0) AS size
                    FROM leased l LEFT JOIN LATERAL (
                        SELECT * FROM {outbox} o
                        WHERE o.ordering_key = l.ordering_key AND o.seq > l.acked_seq AND o.seq <= l.acked_seq + $4
                        ORDER BY o.seq LIMIT $4) m ON true),
                 sized AS (
                    SELECT r.*, sum(r.size) OVER (ORDER BY r.ordering_key, r.seq
                                                  ROWS UNBOUNDED PRECEDING) AS running
                    FROM candidates r)
                 SELECT s.ordering_key, s.lease_token, s.attempts, s.acked_seq,
                        CASE WHEN s.running <= $6 OR s.running = s.size THEN s.seq END AS seq,
                        s.id, s.topic, s.headers,
                        CASE WHEN s.running <= $6 OR s.running = s.size THEN s.payload END AS payload,
                        s.seq IS NOT NULL AND NOT (s.running <= $6 OR s.running = s.size) AS withheld,
                        EXTRACT(EPOCH FROM ({now} - s.created_at))::float8 AS age_s,
                        (SELECT count(*) FROM mark) AS marked,
                        (SELECT * FROM starved) AS starved
                 FROM sized s
                 UNION ALL
                 SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, false, NULL,
                        (SELECT count(*) FROM mark), (SELECT * FROM starved)
                 WHERE NOT EXISTS (SELECT 1 FROM leased)
                 ORDER BY 1, 5",
                lease = secs(2),
                idle = secs(5),
            )
        };
        // Arrays: $1 keys, $2 tokens, $3 delivered through, $4 failed, $5 permanent,
        // $6 reasons; $7 max attempts, $8 backoff base ms, $9 backoff max ms. Every SET
        // reads the row as it was; `tries` is the failures of the head message before
        // this one (0 when this settlement moved the head). `gone` deletes the delivered
        // messages (or moves them to the kept ones).
        let settle = |gone: &str| {
            let gone = gone
                .replace("{outbox}", &outbox)
                .replace("{delivered}", &delivered)
                .replace("{now}", now);
            format!(
                "WITH locked AS MATERIALIZED (
                    SELECT ordering_key, acked_seq FROM {keys} WHERE ordering_key = ANY($1::text[])
                    ORDER BY ordering_key FOR UPDATE),
                 d AS (
                    SELECT * FROM unnest($1::text[], $2::int8[], $3::int8[], $4::bool[], $5::bool[], $6::text[])
                        AS d(ordering_key, token, delivered, failed, permanent, reason)
                    -- An InitPlan, run before the first row: every key row is locked in
                    -- key order before the update takes any, so two settlements (or a
                    -- settlement and a relay's claim) never wait on each other in a
                    -- circle. An application transaction that writes several keys in
                    -- another order can still meet one: the relay retries the settle.
                    WHERE (SELECT count(*) FROM locked) >= 0),
                 settled AS (
                    UPDATE {keys} k SET
                        attempts = CASE WHEN d.failed
                            THEN (CASE WHEN d.delivered > k.acked_seq THEN 0 ELSE k.attempts END) + 1
                            ELSE 0 END,
                        permanent_failures = CASE
                            WHEN d.permanent THEN
                                (CASE WHEN d.delivered > k.acked_seq THEN 0 ELSE k.permanent_failures END) + 1
                            WHEN d.failed AND d.delivered <= k.acked_seq THEN k.permanent_failures
                            ELSE 0 END,
                        parked = d.permanent
                            AND (CASE WHEN d.delivered > k.acked_seq THEN 0 ELSE k.permanent_failures END) + 1 >= $7,
                        settled_token = d.token,
                        parked_at = {now},
                        last_error = d.reason,
                        available_at = CASE WHEN d.failed THEN {now} + make_interval(secs =>
                            LEAST($9::int8, $8::int8 << LEAST(CASE WHEN d.delivered > k.acked_seq THEN 0 ELSE k.attempts END, 20))
                            * (0.5 + random() / 2) / 1000.0)
                            ELSE {now} END,
                        acked_seq = GREATEST(k.acked_seq, d.delivered)
                    FROM d JOIN locked l ON l.ordering_key = d.ordering_key
                    WHERE k.ordering_key = d.ordering_key AND k.lease_token = d.token
                        AND k.settled_token <> d.token
                    RETURNING k.ordering_key, k.acked_seq, k.parked, l.acked_seq AS acked_before),
                 {gone}
                 SELECT ordering_key, parked, (SELECT count(*) FROM gone) AS deleted FROM settled
                 -- A lease settled already (its commit's reply was lost and the
                 -- settlement is tried again): its recorded answer, counted once.
                 UNION ALL
                 SELECT k.ordering_key, k.parked, 0 FROM {keys} k JOIN d ON d.ordering_key = k.ordering_key
                 WHERE k.lease_token = d.token AND k.settled_token = d.token"
            )
        };
        // A pending key's head message, looked up in the key's index. The `LIMIT`
        // keeps the planner from turning the lookups into a join that hashes the whole
        // outbox table (which it chose while a backlog was draining, at ~30 ms a read).
        let head = format!(
            "SELECT created_at FROM {outbox} WHERE ordering_key = k.ordering_key AND seq = k.acked_seq + 1 LIMIT 1"
        );
        Sql {
            create: vec![
                format!("CREATE SCHEMA IF NOT EXISTS {schema}"),
                // The outbox's identity (one row): sent with every message, so that
                // consumers tell this outbox's keys and sequences from another's.
                format!(
                    "CREATE TABLE IF NOT EXISTS {identity} (
                        one INT PRIMARY KEY CHECK (one = 1), id TEXT NOT NULL)"
                ),
                // Messages an operator moved aside (`turnstile outbox skip`), for audit.
                format!(
                    "CREATE TABLE IF NOT EXISTS {skipped} (
                        ordering_key TEXT COLLATE \"C\" NOT NULL,
                        seq BIGINT NOT NULL,
                        id TEXT NOT NULL,
                        topic TEXT NOT NULL,
                        headers TEXT NOT NULL,
                        payload BYTEA NOT NULL,
                        created_at TIMESTAMPTZ NOT NULL,
                        skipped_at TIMESTAMPTZ NOT NULL,
                        reason TEXT,
                        PRIMARY KEY (ordering_key, seq))"
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {keys} (
                        ordering_key TEXT COLLATE \"C\" PRIMARY KEY,
                        last_seq BIGINT NOT NULL,
                        acked_seq BIGINT NOT NULL DEFAULT 0,
                        available_at TIMESTAMPTZ NOT NULL DEFAULT '-infinity',
                        lease_token BIGINT NOT NULL DEFAULT 0,
                        attempts INT NOT NULL DEFAULT 0,
                        last_error TEXT,
                        parked BOOLEAN NOT NULL DEFAULT false,
                        parked_at TIMESTAMPTZ,
                        permanent_failures INT NOT NULL DEFAULT 0,
                        settled_token BIGINT NOT NULL DEFAULT 0)"
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS \"{prefix}_outbox_keys_due\" ON {keys} (available_at)
                     WHERE acked_seq < last_seq AND NOT parked"
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {outbox} (
                        ordering_key TEXT COLLATE \"C\" NOT NULL,
                        seq BIGINT NOT NULL,
                        id TEXT NOT NULL,
                        topic TEXT NOT NULL,
                        headers TEXT NOT NULL,
                        payload BYTEA NOT NULL,
                        created_at TIMESTAMPTZ NOT NULL,
                        PRIMARY KEY (ordering_key, seq))"
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {delivered} (
                        ordering_key TEXT COLLATE \"C\" NOT NULL,
                        seq BIGINT NOT NULL,
                        id TEXT NOT NULL,
                        topic TEXT NOT NULL,
                        headers TEXT NOT NULL,
                        payload BYTEA NOT NULL,
                        created_at TIMESTAMPTZ NOT NULL,
                        delivered_at TIMESTAMPTZ NOT NULL,
                        PRIMARY KEY (ordering_key, seq))"
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS \"{prefix}_outbox_delivered_at\" ON {delivered} (delivered_at)"
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {relays} (
                        relay_id TEXT PRIMARY KEY,
                        idle_until TIMESTAMPTZ NOT NULL,
                        seen_at TIMESTAMPTZ NOT NULL)"
                ),
            ],
            // $1 key, $2 id, $3 topic, $4 headers, $5 payload.
            enqueue: statement(format!(
                "WITH k AS (
                    INSERT INTO {keys} AS k (ordering_key, last_seq) VALUES ($1, 1)
                    ON CONFLICT (ordering_key) DO UPDATE SET last_seq = k.last_seq + 1
                    RETURNING last_seq),
                 m AS (
                    INSERT INTO {outbox} (ordering_key, seq, id, topic, headers, payload, created_at)
                    SELECT $1, last_seq, $2, $3, $4, $5, {now} FROM k RETURNING seq),
                 woken AS (
                    SELECT pg_notify('{channel}', '') FROM {relays} WHERE idle_until > {now} LIMIT 1)
                 SELECT (SELECT seq FROM m) AS seq, (SELECT count(*) FROM woken) AS woken"
            )),
            claim: statement(claim(
                &format!(
                    "SELECT ordering_key, available_at FROM {keys}
                     WHERE acked_seq < last_seq AND NOT parked AND available_at <= {now}
                     ORDER BY available_at LIMIT $1 FOR UPDATE SKIP LOCKED"
                ),
                // The oldest due key that `SKIP LOCKED` passed over although its turn
                // had come (due for a second, and older than a key that was picked):
                // an application transaction held its row. A key written all the time
                // would be passed over every round; the relay then waits for it.
                &format!(
                    "SELECT k.ordering_key FROM {keys} k
                     WHERE k.acked_seq < k.last_seq AND NOT k.parked
                       AND k.available_at <= {now} - interval '1 second'
                       AND k.ordering_key NOT IN (SELECT ordering_key FROM picked)
                       AND k.available_at < coalesce((SELECT max(available_at) FROM picked), 'infinity')
                     ORDER BY k.available_at LIMIT 1"
                ),
            )),
            lock_key: statement(format!(
                "SELECT 1 FROM {keys} WHERE ordering_key = $1 FOR UPDATE"
            )),
            // The same for one key passed over before, whose row `lock_key` took: $7
            // the key.
            claim_waiting: statement(claim(
                &format!(
                    "SELECT ordering_key, available_at FROM {keys}
                     WHERE ordering_key = $7 AND acked_seq < last_seq AND NOT parked
                       AND available_at <= {now}
                     FOR UPDATE"
                ),
                "SELECT NULL::text WHERE $1::int8 IS NULL",
            )),
            // Arrays: $1 keys, $2 tokens, $3 delivered through, $4 failed, $5 permanent,
            // $6 reasons; $7 max attempts, $8 backoff base ms, $9 backoff max ms. Every SET
            // reads the row as it was; `tries` is the failures of the head message
            // before this one (0 when this settlement moved the head). The delete reads
            // only the delivered range, between the key's old `acked_seq` (as `locked`
            // read it; the rows up to it went with the settlement or skip that moved it)
            // and its new one, both bounds from one row of `settled`, so that they bound
            // the index scan. An open range read either every row deleted before and not
            // yet vacuumed, or (a bound from each of two CTEs, which the planner kept
            // apart) the key's whole backlog, per settlement: a drain that slowed down
            // as the outbox grew.
            settle: statement(settle(
                "gone AS (
                    DELETE FROM {outbox} m USING settled s
                    WHERE m.ordering_key = s.ordering_key AND m.seq > s.acked_before AND m.seq <= s.acked_seq
                    RETURNING 1)",
            )),
            settle_keeping: statement(settle(
                "moved AS (
                    DELETE FROM {outbox} m USING settled s
                    WHERE m.ordering_key = s.ordering_key AND m.seq > s.acked_before AND m.seq <= s.acked_seq
                    RETURNING m.*),
                 gone AS (
                    INSERT INTO {delivered}
                        (ordering_key, seq, id, topic, headers, payload, created_at, delivered_at)
                    SELECT ordering_key, seq, id, topic, headers, payload, created_at, {now} FROM moved
                    ON CONFLICT DO NOTHING RETURNING 1)",
            )),
            // $1 retention (s), $2 rows.
            sweep: statement(format!(
                "WITH gone AS (
                    DELETE FROM {delivered} WHERE ctid = ANY (ARRAY(
                        SELECT ctid FROM {delivered}
                        WHERE delivered_at < {now} - make_interval(secs => $1::float8)
                        ORDER BY delivered_at LIMIT $2))
                    RETURNING 1)
                 SELECT count(*) FROM gone"
            )),
            kept: statement(format!("SELECT count(*) FROM {delivered}")),
            identity: statement(format!("SELECT id FROM {identity}")),
            create_identity: statement(format!(
                "INSERT INTO {identity} (one, id) VALUES (1, $1) ON CONFLICT DO NOTHING"
            )),
            key_columns: statement(format!(
                "SELECT attname::text FROM pg_attribute
                 WHERE attrelid = to_regclass('{keys}') AND attnum > 0 AND NOT attisdropped"
            )),
            added_key_columns: vec![
                (
                    "permanent_failures",
                    format!("ALTER TABLE {keys} ADD COLUMN IF NOT EXISTS permanent_failures INT NOT NULL DEFAULT 0"),
                ),
                (
                    "settled_token",
                    format!("ALTER TABLE {keys} ADD COLUMN IF NOT EXISTS settled_token BIGINT NOT NULL DEFAULT 0"),
                ),
            ],
            head_again: statement(format!(
                "SELECT id, topic, headers, payload,
                        EXTRACT(EPOCH FROM ({now} - created_at))::float8 AS age_s
                 FROM {outbox} WHERE ordering_key = $1 AND seq = $2"
            )),
            skipped_copy: statement(format!(
                "SELECT 1 FROM {skipped} WHERE ordering_key = $1 AND seq = $2"
            )),
            skip_head: statement(format!(
                "SELECT acked_seq, parked FROM {keys} WHERE ordering_key = $1 FOR UPDATE"
            )),
            // $1 key, $2 seq: the head message moves to the skipped ones (with the
            // reason the key was parked), and the key goes on after it.
            skip: statement(format!(
                "WITH moved AS (
                    DELETE FROM {outbox} WHERE ordering_key = $1 AND seq = $2 RETURNING *),
                 kept AS (
                    INSERT INTO {skipped}
                        (ordering_key, seq, id, topic, headers, payload, created_at, skipped_at, reason)
                    SELECT m.ordering_key, m.seq, m.id, m.topic, m.headers, m.payload, m.created_at, {now},
                           (SELECT last_error FROM {keys} WHERE ordering_key = $1)
                    FROM moved m RETURNING 1),
                 unparked AS (
                    UPDATE {keys} SET acked_seq = $2, parked = false, attempts = 0,
                        permanent_failures = 0, last_error = NULL,
                        available_at = '-infinity'
                    WHERE ordering_key = $1 RETURNING 1),
                 woken AS (SELECT pg_notify('{channel}', '') FROM unparked)
                 SELECT (SELECT count(*) FROM moved) AS moved, (SELECT count(*) FROM woken) AS woken"
            )),
            redrive: statement(format!(
                "WITH k AS (
                    UPDATE {keys} SET parked = false, attempts = 0, permanent_failures = 0,
                        last_error = NULL, available_at = '-infinity'
                    WHERE ordering_key = $1 AND parked RETURNING 1),
                 woken AS (SELECT pg_notify('{channel}', '') FROM k)
                 SELECT (SELECT count(*) FROM k) AS redriven, (SELECT count(*) FROM woken) AS woken"
            )),
            status: statement(format!(
                "SELECT coalesce(sum(last_seq - acked_seq), 0)::int8 AS pending, count(*) AS keys,
                    (SELECT EXTRACT(EPOCH FROM ({now} - min(m.created_at)))::float8 FROM {keys} k
                     CROSS JOIN LATERAL ({head}) m
                     WHERE k.acked_seq < k.last_seq AND NOT k.parked) AS oldest_s
                 FROM {keys} WHERE acked_seq < last_seq AND NOT parked"
            )),
            parked: statement(format!(
                "SELECT ordering_key, attempts, last_error, last_seq - acked_seq AS pending
                 FROM {keys} WHERE parked ORDER BY parked_at LIMIT $1"
            )),
            lagging: statement(format!(
                "SELECT k.ordering_key, k.last_seq - k.acked_seq AS pending,
                        EXTRACT(EPOCH FROM ({now} - m.created_at))::float8 AS oldest_s
                 FROM {keys} k CROSS JOIN LATERAL ({head}) m
                 WHERE k.acked_seq < k.last_seq AND NOT k.parked
                 ORDER BY m.created_at LIMIT $1"
            )),
            forget_relay: statement(format!("DELETE FROM {relays} WHERE relay_id = $1")),
            forget_relays: statement(format!(
                "DELETE FROM {relays} WHERE seen_at < {now} - interval '1 day'"
            )),
            channel,
        }
    }
}

/// The outbox in PostgreSQL tables.
#[derive(Clone)]
pub struct PostgresOutbox {
    pool: PgPool,
    keep_delivered: Option<Duration>,
    max_message: Option<usize>,
    identity: Option<Arc<str>>,
    sql: Arc<Sql>,
    relay_id: String,
    signals: ReleaseSignals,
    listener: Arc<Listener>,
    notifications: bool,
    /// The relay's wake-up watch, kept between rounds so that a wake-up that comes
    /// while a round runs is not missed.
    wake: Arc<tokio::sync::Mutex<Option<ReleaseWatch>>>,
    url: String,
}

impl std::fmt::Debug for PostgresOutbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresOutbox")
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

fn seconds(value: Option<f64>) -> Option<Duration> {
    value
        .filter(|s| s.is_finite())
        .map(|s| Duration::from_secs_f64(s.max(0.0)))
}

impl PostgresOutbox {
    /// Connects with the URL's `turnstile_*` options (`schema`, `prefix`, `notify`,
    /// `migrate`, `keep_delivered=SECONDS`), creating the tables on first use unless
    /// `turnstile_migrate=off`.
    pub async fn connect(url: &str) -> Result<Self> {
        let (url, keep_delivered) = super::keep_delivered_option(url)?;
        let (driver_url, options) = split_url_options(&url);
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
        let pool =
            open_bounded_pool(PgPoolOptions::new(), options.clone(), 8, timeout, &redacted).await?;
        let mut outbox = PostgresOutbox {
            pool,
            keep_delivered,
            max_message: None,
            identity: None,
            sql: Arc::new(Sql::new(&schema, &prefix)),
            relay_id: uuid::Uuid::now_v7().to_string(),
            signals: ReleaseSignals::new(),
            listener: Arc::new(Listener::new(options, timeout)),
            notifications: notify,
            wake: Arc::default(),
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
        // Marks of relays gone for a day (their processes ended) are no use.
        let _ = sqlx::query(outbox.sql.forget_relays.sql())
            .execute(&outbox.pool)
            .await;
        Ok(outbox)
    }

    /// The outbox's identity, sent with every message as
    /// [`PRODUCER_HEADER`](super::PRODUCER_HEADER).
    pub fn identity(&self) -> Option<&str> {
        self.identity.as_deref()
    }

    /// Creates the schema and tables if missing, and the outbox's identity; harmless
    /// to repeat and to run from several processes at once.
    pub async fn migrate(&self) -> Result<()> {
        let what = "cannot create the outbox tables";
        let mut transaction = self.pool.begin().await.map_err(fail(what))?;
        sqlx::raw_sql("SET LOCAL lock_timeout = '60s'; SET LOCAL statement_timeout = 0")
            .execute(&mut *transaction)
            .await
            .map_err(fail(what))?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('turnstile:migrate'))")
            .execute(&mut *transaction)
            .await
            .map_err(fail(what))?;
        for create in &self.sql.create {
            sqlx::query(sqlx::AssertSqlSafe(create.as_str()))
                .execute(&mut *transaction)
                .await
                .map_err(fail(what))?;
        }
        // Only a column that is missing is added: an ALTER TABLE waits for every
        // transaction on the table, and every enqueue waits behind it.
        let columns: Vec<String> = sqlx::query_scalar(self.sql.key_columns.sql())
            .fetch_all(&mut *transaction)
            .await
            .map_err(fail(what))?;
        for (column, add) in &self.sql.added_key_columns {
            if !columns.iter().any(|name| name == column) {
                sqlx::query(sqlx::AssertSqlSafe(add.as_str()))
                    .execute(&mut *transaction)
                    .await
                    .map_err(fail(what))?;
            }
        }
        sqlx::query(self.sql.create_identity.sql())
            .bind(uuid::Uuid::now_v7().to_string())
            .execute(&mut *transaction)
            .await
            .map_err(fail(what))?;
        transaction.commit().await.map_err(fail(what))
    }

    /// Writes `message` in the application's transaction on `connection`, after its
    /// key's last message. It is published once the transaction commits; a rollback
    /// takes it back. Enqueue last in the transaction: the key's row stays locked until
    /// it ends.
    ///
    /// Under `REPEATABLE READ` or `SERIALIZABLE` the enqueue updates the key's row,
    /// which a relay updates too whenever it leases or settles the key: if a relay
    /// touched it after the transaction's snapshot was taken, PostgreSQL refuses the
    /// update with a serialization failure (SQLSTATE 40001), reported as
    /// [`ErrorKind::StoreUnavailable`](crate::ErrorKind::StoreUnavailable). Nothing is
    /// enqueued and the transaction is aborted: roll it back and run the whole
    /// transaction again (not the enqueue alone), as for any serialization failure.
    /// Under the default `READ COMMITTED` the enqueue waits for the relay's row lock
    /// instead and never fails for this.
    pub async fn enqueue(&self, connection: &mut PgConnection, message: &Message) -> Result<u64> {
        super::check_size(message, self.max_message)?;
        let row = sqlx::query(self.sql.enqueue.sql())
            .bind(message.key())
            .bind(message.id())
            .bind(message.topic())
            .bind(message.headers_json_from(self.identity()))
            .bind(message.payload())
            .fetch_one(&mut *connection)
            .await
            .map_err(fail("cannot enqueue the message"))?;
        let seq = unsigned(
            row.try_get("seq")
                .map_err(fail("cannot enqueue the message"))?,
        );
        super::telemetry::enqueued(message, seq);
        Ok(seq)
    }

    /// Commits `transaction` and wakes this process's relays at once.
    pub async fn commit(&self, transaction: sqlx::Transaction<'_, sqlx::Postgres>) -> Result<()> {
        transaction
            .commit()
            .await
            .map_err(fail("cannot commit the transaction"))?;
        self.signals.notify("");
        Ok(())
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

    /// Whether the relay's `LISTEN` connection is up (it polls while it is not).
    pub fn is_listening(&self) -> bool {
        self.listener.is_listening()
    }

    /// How many notifications the `LISTEN` connection has delivered.
    pub fn notifications_received(&self) -> u64 {
        self.listener.received()
    }
}

/// The keys a claim leased, with their messages, and the key it passed over, if any.
fn leased_keys(rows: Vec<sqlx::postgres::PgRow>) -> Result<(Vec<LeasedKey>, Option<String>)> {
    let what = "cannot claim outbox messages";
    let mut keys: Vec<LeasedKey> = Vec::new();
    let mut starved = None;
    for row in rows {
        if starved.is_none() {
            starved = row
                .try_get::<Option<String>, _>("starved")
                .map_err(fail(what))?;
        }
        let Some(key) = row
            .try_get::<Option<String>, _>("ordering_key")
            .map_err(fail(what))?
        else {
            continue;
        };
        if keys.last().is_none_or(|last| last.key != key) {
            keys.push(LeasedKey {
                key: key.clone(),
                token: unsigned(row.try_get("lease_token").map_err(fail(what))?),
                attempts: u32::try_from(row.try_get::<i32, _>("attempts").map_err(fail(what))?)
                    .unwrap_or(0),
                acked: unsigned(row.try_get("acked_seq").map_err(fail(what))?),
                messages: Vec::new(),
                over_budget: false,
            });
        }
        if row.try_get::<bool, _>("withheld").map_err(fail(what))?
            && let Some(last) = keys.last_mut()
        {
            last.over_budget = true;
        }
        let Some(seq) = row.try_get::<Option<i64>, _>("seq").map_err(fail(what))? else {
            continue;
        };
        let headers: String = row.try_get("headers").map_err(fail(what))?;
        let stored = Stored {
            seq: unsigned(seq),
            age: seconds(row.try_get("age_s").map_err(fail(what))?).unwrap_or_default(),
            message: Message::from_stored(
                row.try_get("id").map_err(fail(what))?,
                row.try_get("topic").map_err(fail(what))?,
                key,
                &headers,
                row.try_get("payload").map_err(fail(what))?,
            ),
        };
        if let Some(last) = keys.last_mut() {
            // Never read past a gap: a later message of the key whose earlier one is
            // not visible yet waits for the next round.
            let next = last.messages.last().map_or(0, |m| m.seq + 1);
            if next == 0 || stored.seq == next {
                last.messages.push(stored);
            }
        }
    }
    Ok((keys, starved))
}

/// How long a claim waits for the row of a key `SKIP LOCKED` passed over.
const STARVED_KEY_WAIT: &str = "250ms";

impl PostgresOutbox {
    /// Leases `key`, waiting up to [`STARVED_KEY_WAIT`] for an application
    /// transaction that holds its row.
    async fn claim_waiting(
        &self,
        key: &str,
        per_key: u32,
        max_bytes: u64,
        lease: Duration,
    ) -> Result<Vec<LeasedKey>> {
        let what = "cannot claim a passed-over outbox key";
        let mut transaction = self.pool.begin().await.map_err(fail(what))?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SET LOCAL lock_timeout = '{STARVED_KEY_WAIT}'"
        )))
        .execute(&mut *transaction)
        .await
        .map_err(fail(what))?;
        // The wait comes first, in a statement of its own: the claim that follows
        // then reads every message committed before it got the row (a statement's
        // snapshot is taken when it starts, and the writers commit while it waits).
        sqlx::query(self.sql.lock_key.sql())
            .bind(key)
            .execute(&mut *transaction)
            .await
            .map_err(fail(what))?;
        let rows = sqlx::query(self.sql.claim_waiting.sql())
            .bind(1_i64)
            .bind(lease.as_secs_f64())
            .bind(&self.relay_id)
            .bind(i64::from(per_key))
            .bind(if self.notifications { 60.0 } else { 0.0 })
            .bind(i64::try_from(max_bytes).unwrap_or(i64::MAX))
            .bind(key)
            .fetch_all(&mut *transaction)
            .await
            .map_err(fail(what))?;
        transaction.commit().await.map_err(fail(what))?;
        Ok(leased_keys(rows)?.0)
    }
}

impl PostgresOutbox {
    /// The key table's columns (none if there is no key table).
    async fn key_columns(&self) -> Result<Vec<String>> {
        sqlx::query_scalar(self.sql.key_columns.sql())
            .fetch_all(&self.pool)
            .await
            .map_err(fail("cannot read the outbox tables' columns"))
    }

    /// Reads again, in a statement of its own, the head message of each leased key
    /// whose claim did not see it. The claim locks a key's row at its newest version
    /// (committed after the statement's snapshot was taken, when another relay settled
    /// it and a writer enqueued meanwhile) but reads messages from its snapshot, which
    /// may not hold the newest ones yet: that is no gap, and must not be reported (or
    /// park the key) as one. Only a head that is still missing is a gap.
    async fn read_heads_again(&self, keys: &mut [LeasedKey]) -> Result<()> {
        let what = "cannot claim outbox messages";
        for key in keys.iter_mut() {
            let head = key.acked + 1;
            let seen = key.messages.first().map(|stored| stored.seq);
            if seen == Some(head) || (seen.is_none() && key.over_budget) {
                continue;
            }
            let Some(row) = sqlx::query(self.sql.head_again.sql())
                .bind(&key.key)
                .bind(signed(head))
                .fetch_optional(&self.pool)
                .await
                .map_err(fail(what))?
            else {
                continue;
            };
            let headers: String = row.try_get("headers").map_err(fail(what))?;
            let stored = Stored {
                seq: head,
                age: seconds(row.try_get("age_s").map_err(fail(what))?).unwrap_or_default(),
                message: Message::from_stored(
                    row.try_get("id").map_err(fail(what))?,
                    row.try_get("topic").map_err(fail(what))?,
                    key.key.clone(),
                    &headers,
                    row.try_get("payload").map_err(fail(what))?,
                ),
            };
            super::telemetry::head_read_again(&key.key, head);
            // The messages seen after it stay, if they follow it.
            if seen != Some(head + 1) {
                key.messages.clear();
            }
            key.messages.insert(0, stored);
        }
        Ok(())
    }
}

impl OutboxStore for PostgresOutbox {
    fn claim_within(
        &self,
        max_keys: u32,
        per_key: u32,
        max_bytes: u64,
        lease: Duration,
    ) -> BoxFuture<'_, Result<Vec<LeasedKey>>> {
        Box::pin(async move {
            let what = "cannot claim outbox messages";
            // Listening before the first claim marks this relay idle, so that no
            // notification is sent to nobody.
            if self.notifications {
                self.listener.ensure(&self.sql.channel, &self.signals).await;
            }
            let rows = sqlx::query(self.sql.claim.sql())
                .bind(i64::from(max_keys))
                .bind(lease.as_secs_f64())
                .bind(&self.relay_id)
                .bind(i64::from(per_key))
                .bind(if self.notifications { 60.0 } else { 0.0 })
                .bind(i64::try_from(max_bytes).unwrap_or(i64::MAX))
                .fetch_all(&self.pool)
                .await
                .map_err(fail(what))?;
            let (mut keys, starved) = leased_keys(rows)?;
            // A key passed over by `SKIP LOCKED` although its turn had come: wait a
            // moment for its row, so that a key an application writes all the time is
            // still served. A wait that runs out leaves it to the next round.
            if let Some(starved) = starved.filter(|key| keys.iter().all(|k| &k.key != key)) {
                match self
                    .claim_waiting(&starved, per_key, max_bytes, lease)
                    .await
                {
                    Ok(more) => {
                        super::telemetry::starved_key_served(&starved);
                        keys.extend(more);
                    }
                    Err(error) => {
                        tracing::debug!(%error, key = %starved, "a passed-over key stayed locked")
                    }
                }
            }
            self.read_heads_again(&mut keys).await?;
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
            let keys: Vec<&str> = settlements.iter().map(|s| s.key.as_str()).collect();
            let tokens: Vec<i64> = settlements.iter().map(|s| signed(s.token)).collect();
            let delivered: Vec<i64> = settlements
                .iter()
                .map(|s| signed(s.delivered_through))
                .collect();
            let failed: Vec<bool> = settlements.iter().map(|s| s.failure.is_some()).collect();
            let permanent: Vec<bool> = settlements
                .iter()
                .map(|s| s.failure.as_ref().is_some_and(|f| f.permanent))
                .collect();
            let reasons: Vec<Option<&str>> = settlements
                .iter()
                .map(|s| s.failure.as_ref().map(|f| f.reason.as_str()))
                .collect();
            let statement = if self.keep_delivered.is_some() {
                &self.sql.settle_keeping
            } else {
                &self.sql.settle
            };
            let rows = sqlx::query(statement.sql())
                .bind(&keys)
                .bind(&tokens)
                .bind(&delivered)
                .bind(&failed)
                .bind(&permanent)
                .bind(&reasons)
                .bind(i32::try_from(max_attempts.max(1)).unwrap_or(i32::MAX))
                .bind(
                    i64::try_from(backoff.base.as_millis())
                        .unwrap_or(i64::MAX)
                        .max(1),
                )
                .bind(
                    i64::try_from(backoff.max.as_millis())
                        .unwrap_or(i64::MAX)
                        .max(1),
                )
                .fetch_all(&self.pool)
                .await
                .map_err(fail(what))?;
            let mut landed = std::collections::HashMap::new();
            for row in rows {
                let key: String = row.try_get("ordering_key").map_err(fail(what))?;
                let parked: bool = row.try_get("parked").map_err(fail(what))?;
                landed.insert(key, parked);
            }
            Ok(settlements
                .iter()
                .map(|s| match landed.get(&s.key) {
                    Some(true) => Settled::Parked,
                    Some(false) => Settled::Done,
                    None => Settled::Fenced,
                })
                .collect())
        })
    }

    fn redrive<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let redriven: i64 = sqlx::query(self.sql.redrive.sql())
                .bind(key)
                .fetch_one(&self.pool)
                .await
                .map_err(fail("cannot redrive the key"))?
                .try_get("redriven")
                .map_err(fail("cannot redrive the key"))?;
            if redriven > 0 {
                self.signals.notify("");
            }
            Ok(redriven > 0)
        })
    }

    fn skip<'a>(&'a self, key: &'a str, seq: u64) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let what = "cannot skip the message";
            let mut transaction = self.pool.begin().await.map_err(fail(what))?;
            let head = sqlx::query(self.sql.skip_head.sql())
                .bind(key)
                .fetch_optional(&mut *transaction)
                .await
                .map_err(fail(what))?
                .map(|row| {
                    let acked: i64 = row.try_get("acked_seq").map_err(fail(what))?;
                    let parked: bool = row.try_get("parked").map_err(fail(what))?;
                    Ok::<_, Error>((unsigned(acked) + 1, parked))
                })
                .transpose()?;
            super::check_skip(key, seq, head)?;
            // An audit copy of this key and number already there (an outbox whose
            // sequences started again) is never dropped or overwritten: the skip is
            // refused, and changes nothing.
            let copied: Option<i32> = sqlx::query_scalar(self.sql.skipped_copy.sql())
                .bind(key)
                .bind(signed(seq))
                .fetch_optional(&mut *transaction)
                .await
                .map_err(fail(what))?;
            super::check_no_audit_copy(copied.is_some(), key, seq, "the skipped messages' table")?;
            let moved: i64 = sqlx::query(self.sql.skip.sql())
                .bind(key)
                .bind(signed(seq))
                .fetch_one(&mut *transaction)
                .await
                .map_err(fail(what))?
                .try_get("moved")
                .map_err(fail(what))?;
            transaction.commit().await.map_err(fail(what))?;
            super::telemetry::skipped(key, seq, moved > 0);
            self.signals.notify("");
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
                        key: row.try_get("ordering_key").map_err(fail(what))?,
                        attempts: u32::try_from(
                            row.try_get::<i32, _>("attempts").map_err(fail(what))?,
                        )
                        .unwrap_or(0),
                        reason: row.try_get("last_error").map_err(fail(what))?,
                        pending: unsigned(row.try_get("pending").map_err(fail(what))?),
                    })
                })
                .collect::<Result<Vec<_>>>()?;
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
                        key: row.try_get("ordering_key").map_err(fail(what))?,
                        pending: unsigned(row.try_get("pending").map_err(fail(what))?),
                        oldest: seconds(row.try_get("oldest_s").map_err(fail(what))?)
                            .unwrap_or_default(),
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(Status {
                kept: unsigned(kept),
                pending: unsigned(row.try_get("pending").map_err(fail(what))?),
                pending_keys: unsigned(row.try_get("keys").map_err(fail(what))?),
                oldest_pending: seconds(row.try_get("oldest_s").map_err(fail(what))?),
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
            let swept: i64 = sqlx::query_scalar(self.sql.sweep.sql())
                .bind(retention.as_secs_f64())
                .bind(i64::from(limit))
                .fetch_one(&self.pool)
                .await
                .map_err(fail("cannot sweep delivered outbox messages"))?;
            Ok(unsigned(swept))
        })
    }

    fn committed(&self, timeout: Duration) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let mut wake = self.wake.lock().await;
            let watch = wake.get_or_insert_with(|| self.signals.watch("").0);
            watch.wait(timeout, false).await;
        })
    }

    fn relay_stopped(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            // A stopped relay's idle mark would make every enqueue of the next minute
            // send a `NOTIFY` nobody waits for (and take its database-wide lock).
            // Another relay of this process sharing the id marks itself again at its
            // next claim.
            if let Err(error) = sqlx::query(self.sql.forget_relay.sql())
                .bind(&self.relay_id)
                .execute(&self.pool)
                .await
            {
                tracing::debug!(%error, "cannot drop a stopped relay's idle mark");
            }
        })
    }

    fn describe(&self) -> String {
        self.url.clone()
    }
}
