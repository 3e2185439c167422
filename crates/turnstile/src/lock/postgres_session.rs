//! The PostgreSQL engine, session mode: a session-level advisory lock held on a
//! dedicated connection (`postgres://…?turnstile_mode=session`).
//!
//! Each held lock owns one connection from a session pool. The lock lives exactly as
//! long as that session: the server frees it when the session ends — release, a crash
//! of the holder, a network failure, `pg_terminate_backend`.
//!
//! # The lease
//! The TTL (plus 10% and 50 ms, so a merely late renewal does not cut a live holder
//! off) becomes the session's `idle_session_timeout` (PostgreSQL 14 or newer): a holder
//! that stops talking to the server (crashed, paused, cut off) loses its session, and
//! with it the lock, once that passes, measured by the server. The watchdog's
//! renewal is a ping on the session, so a killed session is noticed within TTL/3. The
//! client also enforces the lease: a guard that asks the engine anything after its TTL
//! passed without contact finds its session closed and the lock gone.
//!
//! # Guarantees
//! - **Atomicity**: `pg_try_advisory_lock` in the server. The advisory key is a 64-bit
//!   hash of the name (`hashtextextended`); two names that hash alike exclude each other,
//!   which is safe (never two holders of one name), merely stricter. The hash is not
//!   cryptographic, so a client that can choose names (a tenant of `turnstile serve`)
//!   could craft one that shares another name's key and keep that name busy. A waiter
//!   therefore checks, at most once a second per name, that the session holding its key
//!   is the one its name's token row records; when another session has held the key
//!   for a second without being the name's holder, the acquire is refused with
//!   [`ErrorKind::InvalidName`] naming the holding backend, instead of waiting forever
//!   (test `session_mode_refuses_a_key_held_for_another_name` in `lock_postgres.rs`).
//!   A keyed hash would hide the key from such a client, but processes of older
//!   versions would then stop excluding newer ones on the same names.
//! - **Fencing tokens**: the per-name counter shared with lease mode
//!   (`{prefix}_tokens`), floored by the database clock and incremented in the same
//!   statement that takes the lock. Its commit does not wait for the disk by default
//!   (the advisory lock itself writes nothing): tokens keep growing across a crash
//!   provided the database server's clock never steps back, as in lease mode (see
//!   [the lease mode's guarantees](super::postgres)); `turnstile_sync_commit=on` puts
//!   every token on disk before its holder learns it.
//! - **Restart / failover**: a restart ends every session and frees every lock; holders
//!   learn it at their next renewal. Advisory locks are not replicated: after a
//!   failover the lock is free at once, and fencing tokens keep the old holder's late
//!   writes out.
//! - **Poolers**: needs a real session; it does **not** work behind a pooler in
//!   transaction mode (the advisory lock would stay on a server connection that the
//!   pooler hands to someone else). Use lease mode there.
//! - **One mode per name**: a name lease mode has used is refused here, and the other way
//!   round, with an error saying so. The two also exclude each other when both ask for
//!   a new name at once: session mode records the holder on the name's token row,
//!   lease mode's rows have none, and this engine's acquire refuses (and unlocks) when
//!   the row it upserts has no holder; a lease-mode acquire fails when the row it
//!   upserts has one. Older versions marked session-mode names with a row in the locks
//!   table instead; during an upgrade, older lease-mode processes must not use names
//!   that newer session-mode processes use.
//! - **Waiting**: same-process waiters are woken directly; others re-check with a backoff
//!   from 5 ms to 100 ms.
//!
//! # Unfenced locks
//! [`Locker::acquire_unfenced`](super::Locker::acquire_unfenced) takes the advisory lock
//! with a bare `pg_try_advisory_lock` and **writes nothing**: no token row, no
//! transaction, so no WAL. The holder names itself in its session's
//! `application_name` (`ts KEY OWNER`, visible in `pg_stat_activity` to every role),
//! which is what [`inspect`](LockBackend::inspect), the collision check above and
//! `turnstile lock break` read for it; the release (and a hand-over within the
//! process) puts the session's own application name back. Exclusion with fenced
//! holders is the advisory lock's, and a fenced acquisition after an unfenced one
//! still gets a token larger than every earlier one (the counter only grows). What it
//! gives up besides the token: a name that lease mode uses is refused only once its
//! token row exists, so a lease-mode process can take a name that only unfenced
//! session-mode holders have used (test `an_unfenced_session_lock_writes_nothing`).

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::Row;
use sqlx::postgres::{PgConnectOptions, Postgres};
use tokio::time::Instant;

use super::session::{self, Dedicated, HeldSessions, Session, SessionEngine};
use super::{
    BoxFuture, ExtendOutcome, LockBackend, LockInfo, LockName, OwnerId, ReleaseOutcome,
    ReleaseSignals, ReleaseWatch, TryAcquire, TryAcquireUnfenced, ceil_millis,
};
use crate::error::{Error, ErrorKind, Result};
use crate::fence::FencingToken;
use crate::lock::postgres::{CLOCK_US, PostgresLockConfig, PostgresLockStore, one_mode_per_name};
use crate::sql::{KeptConnections, Statement, map_error, sent_again_if_gone, statement};

const POLL_MIN: Duration = Duration::from_millis(5);
const POLL_MAX: Duration = Duration::from_millis(100);

/// Seeds the name hash, so Turnstile's advisory keys do not line up with an
/// application's own `hashtextextended(name, 0)` keys.
const KEY_SEED: i64 = 0x7475_726e;

/// The SQL for the advisory key of the name in `name` (a parameter or a column).
fn advisory_key(name: &str) -> String {
    format!("hashtextextended({name}, {KEY_SEED})")
}

/// The session's idle timeout for a lease of `ttl`: the server ends the session after
/// the TTL without contact, plus a margin so that a holder whose renewal is merely late
/// is not cut off; the holder itself stops trusting the lock before the TTL.
fn server_lease(ttl: Duration) -> Duration {
    ttl + ttl / 10 + Duration::from_millis(50)
}

struct Sql {
    unlock: Statement,
    acquire_unfenced: Statement,
    terminate_holder: Statement,
    prune: Statement,
    acquire: Statement,
    reissue: Statement,
    holder: Statement,
}

/// Locks as PostgreSQL session-level advisory locks.
#[derive(Clone)]
pub struct PostgresSessionLockStore {
    tables: PostgresLockStore,
    sessions: KeptConnections<Postgres>,
    held: Arc<HeldSessions<Dedicated<Postgres>, ()>>,
    sql: Arc<Sql>,
    signals: ReleaseSignals,
    /// The `idle_session_timeout` and `application_name` that `RESET` would restore
    /// on this store's sessions (they share one role, database and startup options),
    /// read once: the unlock statement restores them itself, so a release is one round
    /// trip. A default changed later (`ALTER ROLE`) reaches sessions that start after
    /// it only when the store is opened again.
    session_defaults: tokio::sync::OnceCell<SessionDefaults>,
    /// Per busy name: when its key's holder was last compared with the name's token
    /// row, and the backend that held the key without being the name's holder then.
    collision_checks: Arc<std::sync::Mutex<HashMap<String, KeyCheck>>>,
}

/// What a session returned to the pool is reset to.
#[derive(Clone)]
struct SessionDefaults {
    idle_timeout: String,
    application_name: String,
}

/// The last comparison of a busy name's key holder with the name's recorded holder.
#[derive(Clone, Copy)]
struct KeyCheck {
    at: Instant,
    foreign_holder: Option<u64>,
}

/// How often a waiter compares its key's holder with its name's holder: one query
/// a second per busy name, and a foreign holder must be seen twice this far apart
/// before the acquire is refused (an acquire that has taken the key but not yet
/// committed its token row looks foreign for a moment).
const KEY_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// Names whose checks are remembered; past this the memory is cleared (a check is
/// then merely repeated).
const KEY_CHECKS_KEPT: usize = 4096;

impl std::fmt::Debug for PostgresSessionLockStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresSessionLockStore")
            .field("tables", &self.tables)
            .finish()
    }
}

impl PostgresSessionLockStore {
    /// Connects with the URL's `turnstile_*` options: those of lease mode, plus
    /// `turnstile_max_held=N` (default 64).
    pub async fn connect(url: &str) -> Result<Self> {
        let (driver_url, mut options) = crate::url::split_url_options(url);
        let mut max_held = 64;
        options.retain(|(key, value)| match key.as_str() {
            "mode" => value != "session",
            "max_held" => {
                max_held = value.parse().unwrap_or(0);
                false
            }
            _ => true,
        });
        if max_held == 0 {
            return Err(Error::new(
                ErrorKind::InvalidUrl,
                "turnstile_max_held must be a positive number",
            ));
        }
        let config = PostgresLockConfig::default().apply_url_options(&options)?;
        PostgresSessionLockStore::connect_with(&driver_url, config, max_held).await
    }

    /// Connects with `config` (its tables, schema and prefix are shared with lease mode);
    /// `max_held` is how many locks may be held at once, one session each.
    pub async fn connect_with(
        url: &str,
        config: PostgresLockConfig,
        max_held: u32,
    ) -> Result<Self> {
        let synchronous_commit = if config.is_synchronous_commit() {
            "on"
        } else {
            "off"
        };
        let tables = PostgresLockStore::connect_with(url, config.notifications(false)).await?;
        let options = PgConnectOptions::from_str(url)
            .map_err(|error| {
                Error::new(ErrorKind::InvalidUrl, "not a valid PostgreSQL URL").with_source(error)
            })?
            .options([("synchronous_commit", synchronous_commit)]);
        let sessions = crate::sql::pool_options::<Postgres>()
            .max_connections(max_held.max(1))
            .min_connections(0)
            .acquire_timeout(Duration::from_secs(3))
            .connect_lazy_with(options);
        // A lock's session goes back on this shelf when the lock is released, not to
        // the pool, which would ping it on the way in.
        let sessions = KeptConnections::new(sessions);
        let (locks, tokens) = tables.table_names();
        let key = advisory_key("$1");
        let sql = Sql {
            // A session-mode name's token row names its holder (`owner@pid`); lease
            // mode's rows have none. With the advisory lock taken, the token row's upsert
            // decides: it waits for a lease acquisition writing the row at the same
            // instant and sees its committed version, which no snapshot would. A row
            // without a holder makes the session give the advisory lock back and refuse;
            // a new row or one with a holder gets the token. (A lease acquisition that
            // meets this row as it runs fails; see lease mode's token bump.) A name that
            // an older version marked in the locks table (and whose token row may have
            // no holder) is session mode's too; lease mode refuses those marker rows, so
            // reading the statement's snapshot for them is enough.
            acquire: statement(format!(
                "WITH got AS (SELECT pg_try_advisory_lock({key}) AS ok),
                 bumped AS (
                    INSERT INTO {tokens} AS t (name, token, holder)
                    SELECT $1, {CLOCK_US}, $2 || '@' || pg_backend_pid() FROM got WHERE ok
                    ON CONFLICT (name) DO UPDATE
                    SET token = GREATEST(t.token + 1, EXCLUDED.token), holder = EXCLUDED.holder
                    WHERE t.holder IS NOT NULL
                       OR EXISTS (SELECT 1 FROM {locks} WHERE name = $1 AND NOT isfinite(expires_at))
                    RETURNING token),
                 refused AS (
                    SELECT pg_advisory_unlock({key}) FROM got
                    WHERE ok AND NOT EXISTS (SELECT 1 FROM bumped)),
                 lease AS (SELECT set_config('idle_session_timeout', $3, false) FROM bumped)
                 SELECT EXISTS (SELECT 1 FROM bumped) AS ok,
                        (SELECT count(*) FROM refused) > 0 AS lease_mode,
                        (SELECT token FROM bumped) AS token,
                        (SELECT count(*) FROM lease) AS leased, pg_backend_pid() AS pid"
            )),
            // The unfenced acquire: the advisory lock and nothing written. The holder
            // names itself in the session's `application_name` (`ts KEY OWNER`), which
            // every role can read in `pg_stat_activity`, instead of in the token row; a
            // lease-mode name (a token row without a holder) is refused as above, read
            // from the statement's snapshot (a lease-mode acquisition of a name never
            // used before, at the same instant, is not seen: see the module's notes).
            acquire_unfenced: statement(format!(
                "WITH got AS (SELECT pg_try_advisory_lock({key}) AS ok),
                 lease_name AS (
                    SELECT 1 FROM {tokens} t
                    WHERE t.name = $1 AND t.holder IS NULL
                      AND NOT EXISTS (SELECT 1 FROM {locks} WHERE name = $1 AND NOT isfinite(expires_at))),
                 refused AS (
                    SELECT pg_advisory_unlock({key}) FROM got
                    WHERE ok AND EXISTS (SELECT 1 FROM lease_name)),
                 held AS (
                    SELECT set_config('idle_session_timeout', $3, false),
                           set_config('application_name', 'ts ' || {key} || ' ' || $2, false)
                    FROM got WHERE ok AND NOT EXISTS (SELECT 1 FROM lease_name))
                 SELECT (SELECT count(*) FROM held) > 0 AS ok,
                        (SELECT count(*) FROM refused) > 0 AS lease_mode,
                        pg_backend_pid() AS pid"
            )),
            // The application name is put back only where an unfenced holder changed
            // it, so a fenced release sets nothing more than before.
            unlock: statement(format!(
                "SELECT pg_advisory_unlock({key}), set_config('idle_session_timeout', $2, false),
                        CASE WHEN current_setting('application_name') <> $3
                             THEN set_config('application_name', $3, false) END"
            )),
            terminate_holder: statement(format!(
                "SELECT pg_terminate_backend(l.pid) FROM pg_locks l
                 WHERE l.pid = $2 AND l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
                   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                   AND l.classid = (({key} >> 32) & 4294967295)::oid
                   AND l.objid = ({key} & 4294967295)::oid"
            )),
            // Rows of session-mode names (a token row with a holder, and the marker rows
            // older versions kept in the locks table) whose last token is old and whose
            // advisory lock nobody holds now. A session taking the name meanwhile updates
            // the token row first (the delete then sees its new token and keeps it) or
            // waits for the delete and inserts a new one.
            prune: statement(format!(
                "WITH gone AS (
                    DELETE FROM {tokens} t
                    WHERE t.holder IS NOT NULL
                      AND t.token < {CLOCK_US} - ($1::float8 * 1000000)::int8
                      AND NOT EXISTS (
                        SELECT 1 FROM pg_locks p
                        WHERE p.locktype = 'advisory' AND p.granted AND p.objsubid = 1
                          AND p.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                          AND p.classid = (({name_key} >> 32) & 4294967295)::oid
                          AND p.objid = ({name_key} & 4294967295)::oid)
                    RETURNING t.name),
                 markers_gone AS (
                    DELETE FROM {locks} l
                    WHERE NOT isfinite(l.expires_at)
                      AND (l.name IN (SELECT name FROM gone)
                           OR NOT EXISTS (SELECT 1 FROM {tokens} t WHERE t.name = l.name)))
                 SELECT count(*) FROM gone",
                name_key = advisory_key("t.name")
            )),
            reissue: statement(format!(
                "WITH bumped AS (
                    UPDATE {tokens}
                    SET token = GREATEST(token + 1, {CLOCK_US}), holder = $2 || '@' || pg_backend_pid()
                    WHERE name = $1
                    RETURNING token),
                 lease AS (SELECT set_config('idle_session_timeout', $3, false)),
                 named AS (
                    SELECT set_config('application_name', $4, false)
                    WHERE current_setting('application_name') <> $4)
                 SELECT (SELECT token FROM bumped), (SELECT count(*) FROM lease),
                        (SELECT count(*) FROM named)"
            )),
            // An unfenced holder is the one its session's application name names,
            // whatever the token row says (it may be left from an earlier holder).
            holder: statement(format!(
                "WITH k AS (SELECT {key} AS key),
                 holder AS (
                    SELECT l.pid, k.key FROM pg_locks l, k
                    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
                      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                      AND l.classid = ((k.key >> 32) & 4294967295)::oid
                      AND l.objid = (k.key & 4294967295)::oid)
                 SELECT h.pid, t.holder, r.owner, t.token,
                        CASE WHEN a.application_name LIKE 'ts ' || h.key || ' %'
                             THEN split_part(a.application_name, ' ', 3) END AS unfenced_owner
                 FROM holder h
                 LEFT JOIN LATERAL pg_stat_get_activity(h.pid) a ON true
                 LEFT JOIN {locks} r ON r.name = $1
                 LEFT JOIN {tokens} t ON t.name = $1"
            )),
        };
        Ok(PostgresSessionLockStore {
            tables,
            sessions,
            held: Arc::default(),
            sql: Arc::new(sql),
            signals: ReleaseSignals::new(),
            session_defaults: tokio::sync::OnceCell::new(),
            collision_checks: Arc::default(),
        })
    }

    /// The lease-mode store over the same tables (for fences, migrations, the pool).
    pub fn tables(&self) -> &PostgresLockStore {
        &self.tables
    }

    /// Refuses `name` when its advisory key has been held, for at least
    /// [`KEY_CHECK_INTERVAL`], by a session that is not the name's holder: another name
    /// hashes to the same key (or something outside Turnstile takes the key), and
    /// waiting would last as long as that other lock. Called when the key is busy; asks
    /// the server at most once per interval per name.
    async fn refuse_foreign_key_holder(&self, name: &LockName) -> Result<()> {
        let earlier = {
            let checks = self
                .collision_checks
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            checks.get(name.as_str()).copied()
        };
        if earlier.is_some_and(|check| check.at.elapsed() < KEY_CHECK_INTERVAL) {
            return Ok(());
        }
        let foreign_holder = match self.current_holder(name).await? {
            // The recorded holder matches the session that holds the key only when
            // that session took this name.
            Some((pid, owner, _)) if owner.is_empty() => Some(pid),
            _ => None,
        };
        {
            let mut checks = self
                .collision_checks
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if checks.len() >= KEY_CHECKS_KEPT {
                checks.clear();
            }
            checks.insert(
                name.as_str().to_owned(),
                KeyCheck {
                    at: Instant::now(),
                    foreign_holder,
                },
            );
        }
        // Two sightings of one foreign holder count only when they are close together
        // (a wait that checks every interval); an old sighting is only a first one.
        let recent = earlier.filter(|check| check.at.elapsed() < 3 * KEY_CHECK_INTERVAL);
        match (
            recent.and_then(|check| check.foreign_holder),
            foreign_holder,
        ) {
            (Some(before), Some(now)) if before == now => Err(Error::new(
                ErrorKind::InvalidName,
                format!(
                    "lock \"{name}\" cannot be taken: its PostgreSQL advisory key is held by backend {now}, \
                     which does not hold \"{name}\" (another lock name hashes to the same key, or an \
                     application takes Turnstile's advisory keys); rename the lock, or use lease mode"
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Who holds `name` by the server: (backend pid, owner, token); no token for an
    /// unfenced holder, and no owner for a session that holds the key without being
    /// the name's recorded holder.
    async fn current_holder(
        &self,
        name: &LockName,
    ) -> Result<Option<(u64, String, Option<FencingToken>)>> {
        let row = sqlx::query(self.sql.holder.sql())
            .bind(name.as_str())
            .fetch_optional(self.tables.pool())
            .await
            .map_err(|error| map_error(error, "cannot read the lock"))?;
        let Some(row) = row else {
            return Ok(None);
        };
        let bad = |error| map_error(error, "bad lock row");
        let pid: i32 = row.try_get("pid").map_err(bad)?;
        let pid = u64::try_from(pid).unwrap_or(0);
        let unfenced_owner: Option<String> = row.try_get("unfenced_owner").map_err(bad)?;
        if let Some(owner) = unfenced_owner.filter(|owner| !owner.is_empty()) {
            return Ok(Some((pid, owner, None)));
        }
        let holder: Option<String> = row.try_get("holder").map_err(bad)?;
        // Where an older version of this engine recorded the holder.
        let recorded_by_older: Option<String> = row.try_get("owner").map_err(bad)?;
        let token: Option<i64> = row.try_get("token").map_err(bad)?;
        // The holder is recorded as `owner@pid`; trust it only for the session that holds.
        let owner = [holder, recorded_by_older]
            .into_iter()
            .flatten()
            .find_map(|text| {
                let (owner, recorded_pid) = text.rsplit_once('@')?;
                (recorded_pid.parse::<u64>().ok() == Some(pid)).then(|| owner.to_owned())
            })
            .unwrap_or_default();
        Ok(Some((
            pid,
            owner,
            Some(FencingToken::new(
                token.and_then(|t| u64::try_from(t).ok()).unwrap_or(0),
            )),
        )))
    }

    /// The defaults a session returned to the pool gets back (see `session_defaults`),
    /// read on the first release.
    async fn session_defaults(
        &self,
        connection: &mut Dedicated<Postgres>,
    ) -> Option<&SessionDefaults> {
        self.session_defaults
            .get_or_try_init(|| async {
                let (idle_timeout, application_name): (Option<String>, Option<String>) =
                    sqlx::query_as(
                        "SELECT max(reset_val) FILTER (WHERE name = 'idle_session_timeout'),
                                max(reset_val) FILTER (WHERE name = 'application_name')
                         FROM pg_settings
                         WHERE name IN ('idle_session_timeout', 'application_name')",
                    )
                    .fetch_one(&mut **connection)
                    .await?;
                Ok::<_, sqlx::Error>(SessionDefaults {
                    idle_timeout: idle_timeout.ok_or(sqlx::Error::RowNotFound)?,
                    application_name: application_name.unwrap_or_default(),
                })
            })
            .await
            .ok()
    }

    /// Takes the advisory lock on a session of its own, `fenced` with a token row or
    /// not: the token (`Some(None)` unfenced), or `None` when someone else holds it.
    async fn take(
        &self,
        name: &LockName,
        owner: &OwnerId,
        ttl: Duration,
        fenced: bool,
    ) -> Result<Option<Option<FencingToken>>> {
        if let Some(held) = session::already_held(self, owner).await {
            return Ok(Some(held));
        }
        let statement = if fenced {
            &self.sql.acquire
        } else {
            &self.sql.acquire_unfenced
        };
        // A pooled session the server had ended (the pool pings only idle ones) is
        // replaced: the statement is sent again on another.
        let sent_statement = sent_again_if_gone(self.sessions.size(), || async move {
            let connection = self.sessions.take().await?;
            // Until it is registered below, a connection that may hold the lock
            // is closed if this future is dropped or a statement fails, never
            // pooled.
            let mut connection = Dedicated::new(connection);
            let sent = Instant::now();
            // The lease (see `server_lease`) is set in the statement that takes
            // the lock, and only if it does.
            let row = sqlx::query(statement.sql())
                .bind(name.as_str())
                .bind(owner.as_str())
                .bind(ceil_millis(server_lease(ttl)).to_string())
                .fetch_one(&mut *connection)
                .await?;
            Ok((connection, row, sent))
        })
        .await;
        let (connection, row, sent) = match sent_statement {
            Ok(sent) => sent,
            Err(error @ (sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed)) => {
                let what =
                    session::no_session_left("PostgreSQL", self.held.len(), self.sessions.size());
                return Err(map_error(error, &what));
            }
            Err(error) => return Err(map_error(error, "cannot acquire the lock")),
        };
        let bad = |error| map_error(error, "bad reply");
        let ok: bool = row.try_get("ok").map_err(bad)?;
        let lease_mode: bool = row.try_get("lease_mode").map_err(bad)?;
        if lease_mode {
            connection.recycle();
            return Err(one_mode_per_name(name, "lease", "session"));
        }
        if !ok {
            connection.recycle();
            self.refuse_foreign_key_holder(name).await?;
            return Ok(None);
        }
        let token = if fenced {
            let token: i64 = row.try_get("token").map_err(bad)?;
            Some(FencingToken::new(u64::try_from(token).unwrap_or(0)))
        } else {
            None
        };
        let pid: i32 = row.try_get("pid").map_err(bad)?;
        self.held.insert(
            owner,
            Session {
                connection: Some(connection),
                server_id: u64::try_from(pid).unwrap_or(0),
                key: (),
                token,
                ttl,
                last_contact: sent,
            },
        );
        Ok(Some(token))
    }
}

impl LockBackend for PostgresSessionLockStore {
    fn try_acquire<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<TryAcquire>> {
        Box::pin(async move {
            Ok(match self.take(name, owner, ttl, true).await? {
                Some(Some(token)) => TryAcquire::Acquired { token },
                // This owner holds it unfenced (it cannot ask again fenced through a
                // `Locker`, which gives every acquisition an owner of its own).
                Some(None) => {
                    return Err(Error::new(
                        ErrorKind::Conflict,
                        format!("lock \"{name}\" is held unfenced by this owner already"),
                    ));
                }
                None => TryAcquire::Held {
                    remaining_ttl: None,
                },
            })
        })
    }

    /// `pg_try_advisory_lock` and nothing written: no token row, the holder named in
    /// its session's `application_name`.
    fn try_acquire_unfenced<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<TryAcquireUnfenced>> {
        Box::pin(async move {
            Ok(match self.take(name, owner, ttl, false).await? {
                Some(_) => TryAcquireUnfenced::Acquired,
                None => TryAcquireUnfenced::Held {
                    remaining_ttl: None,
                },
            })
        })
    }

    fn unfenced_is_cheaper(&self) -> bool {
        true
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
                .map(|(_, owner, token)| LockInfo {
                    owner,
                    fencing_token: token,
                    remaining_ttl: None,
                }))
        })
    }

    fn force_release<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<LockInfo>>> {
        Box::pin(async move {
            let Some((pid, owner, token)) = self.current_holder(name).await? else {
                return Ok(None);
            };
            // Terminate the backend only if it still holds this lock as the statement
            // runs: a session that released meanwhile, and went back to its pool for
            // another lock, is left alone.
            sqlx::query(self.sql.terminate_holder.sql())
                .bind(name.as_str())
                .bind(i32::try_from(pid).unwrap_or(0))
                .execute(self.tables.pool())
                .await
                .map_err(|error| {
                    map_error(error, "cannot end the holder's session (pg_terminate_backend needs pg_signal_backend)")
                })?;
            self.signals.notify(name.as_str());
            Ok(Some(LockInfo {
                owner,
                fencing_token: token,
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
        Box::pin(self.tables.migrate())
    }

    /// Prunes the shared tables: lease-mode rows as lease mode does, and session-mode
    /// rows whose last token is older than `unused_for` and whose advisory lock no
    /// session holds now.
    fn prune(&self, unused_for: Duration) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move {
            let leases = LockBackend::prune(&self.tables, unused_for).await?;
            let sessions: i64 = sqlx::query_scalar(self.sql.prune.sql())
                .bind(unused_for.as_secs_f64())
                .fetch_one(self.tables.pool())
                .await
                .map_err(|error| map_error(error, "cannot prune unused lock names"))?;
            Ok(leases + u64::try_from(sessions).unwrap_or(0))
        })
    }

    fn declare_permits<'a>(
        &'a self,
        name: &'a LockName,
        permits: u32,
    ) -> BoxFuture<'a, Result<u32>> {
        Box::pin(self.tables.declare_permits_in_table(name, permits))
    }

    fn stored_permits<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<u32>>> {
        Box::pin(self.tables.stored_permits_in_table(name))
    }

    fn forget_permits<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<u32>>> {
        Box::pin(self.tables.forget_permits_in_table(name))
    }

    fn describe(&self) -> String {
        format!("{} (session mode)", self.tables.describe())
    }
}

impl SessionEngine for PostgresSessionLockStore {
    type Connection = Dedicated<Postgres>;
    type Key = ();

    fn sessions(&self) -> &HeldSessions<Dedicated<Postgres>, ()> {
        &self.held
    }

    fn signals(&self) -> &ReleaseSignals {
        &self.signals
    }

    async fn ping(&self, connection: &mut Dedicated<Postgres>, _key: &()) -> bool {
        // A live session still holds its session-level advisory lock.
        sqlx::query("SELECT 1")
            .execute(&mut **connection)
            .await
            .is_ok()
    }

    async fn unlock(
        &self,
        connection: &mut Dedicated<Postgres>,
        name: &LockName,
        _key: &(),
    ) -> bool {
        // Without the defaults to restore, the session is not fit for the pool: `false`
        // closes it, which frees the lock as well.
        let Some(defaults) = self.session_defaults(connection).await else {
            return false;
        };
        // pg_advisory_unlock is its own ownership check: true only if this session held
        // the lock. The same statement puts back the idle timeout the server or role
        // configures (not the lease, and not "none") and the application name an
        // unfenced holder changed, for the session's return to the pool.
        sqlx::query_scalar::<_, bool>(self.sql.unlock.sql())
            .bind(name.as_str())
            .bind(&defaults.idle_timeout)
            .bind(&defaults.application_name)
            .fetch_one(&mut **connection)
            .await
            .unwrap_or(false)
    }

    async fn recycle(&self, connection: Dedicated<Postgres>) {
        // The unlock statement already restored the idle timeout.
        connection.recycle();
    }

    async fn close(&self, connection: Dedicated<Postgres>) {
        connection.close().await;
    }

    async fn reissue(
        &self,
        connection: &mut Dedicated<Postgres>,
        name: &LockName,
        to: &OwnerId,
        ttl: Duration,
        _held_ttl: Duration,
    ) -> Result<FencingToken> {
        let Some(defaults) = self.session_defaults(connection).await else {
            return Err(Error::new(
                ErrorKind::Store,
                "cannot hand the lock over: the session's defaults cannot be read",
            ));
        };
        // A hand-over from an unfenced holder names the next holder in the token row,
        // so the application name goes back to the session's own.
        let token: i64 = sqlx::query_scalar(self.sql.reissue.sql())
            .bind(name.as_str())
            .bind(to.as_str())
            .bind(ceil_millis(server_lease(ttl)).to_string())
            .bind(&defaults.application_name)
            .fetch_one(&mut **connection)
            .await
            .map_err(|error| map_error(error, "cannot hand the lock over"))?;
        Ok(FencingToken::new(u64::try_from(token).unwrap_or(0)))
    }

    async fn holder_id(&self, name: &LockName) -> Result<Option<u64>> {
        Ok(self.current_holder(name).await?.map(|(pid, _, _)| pid))
    }
}
