//! What the SQL engines share: error mapping, identifier checks, URL options.

use std::sync::Arc;
use std::time::Duration;

use sqlx::AssertSqlSafe;

use crate::error::{Error, ErrorKind, Result};

/// A statement built once from validated identifiers (schema, table prefix), shared
/// cheaply by every call.
#[derive(Debug, Clone)]
#[allow(dead_code)]
pub(crate) struct Statement(Arc<str>);

#[allow(dead_code)]
impl Statement {
    /// The statement for `sqlx::query`. Safe: the only dynamic parts are identifiers
    /// that passed [`validate_identifier`] and are quoted.
    pub(crate) fn sql(&self) -> AssertSqlSafe<Arc<str>> {
        AssertSqlSafe(Arc::clone(&self.0))
    }
}

#[allow(dead_code)]
pub(crate) fn statement(text: String) -> Statement {
    Statement(text.into())
}

/// SQLSTATE classes and codes (PostgreSQL) and error numbers (MySQL / MariaDB) that
/// mean the configuration is wrong: credentials, database name, permissions.
fn is_configuration_error(db: &dyn sqlx::error::DatabaseError) -> bool {
    #[cfg(feature = "mysql")]
    if let Some(mysql) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        // 1044/1045 access denied, 1049 unknown database, 1142/1143/1227 privileges.
        return matches!(mysql.number(), 1044 | 1045 | 1049 | 1142 | 1143 | 1227);
    }
    // 28000/28P01 authentication, 3D000 unknown database, 42501 insufficient privilege.
    db.code()
        .is_some_and(|code| matches!(code.as_ref(), "28000" | "28P01" | "3D000" | "42501"))
}

/// SQLSTATE codes and classes (PostgreSQL) and error numbers (MySQL / MariaDB) of a
/// refusal that says "not now" rather than "never": a row lock not granted in time, a
/// serialization failure or deadlock, a read-only server (a failover in progress), a
/// statement cancelled by a timeout, resources or connections exhausted, a server
/// shutting down. The same statement can succeed when tried again, so every pillar
/// treats these like a store that cannot be reached for a moment.
fn is_transient_refusal(db: &dyn sqlx::error::DatabaseError) -> bool {
    #[cfg(feature = "mysql")]
    if let Some(mysql) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        // 1205 lock wait timeout, 1213 deadlock, 1021 disk full, 1040 too many
        // connections, 1041 out of memory, 1053 shutdown in progress, 1290/1836/1792
        // read-only server or transaction, 1317 query interrupted, 1637 too many
        // transactions, 1927 connection killed, 1969 (MariaDB) and 3024 (MySQL)
        // statement timeout, 4031 disconnected for inactivity.
        return matches!(
            mysql.number(),
            1205 | 1213
                | 1021
                | 1040
                | 1041
                | 1053
                | 1290
                | 1836
                | 1792
                | 1317
                | 1637
                | 1927
                | 1969
                | 3024
                | 4031
        );
    }
    // 55P03 lock not available, 40001 serialization failure, 40P01 deadlock, 40003
    // statement completion unknown, 25006 read-only transaction (a standby), 57014
    // statement cancelled (statement_timeout), 57P01..57P03 shutdown and startup, class 08
    // connection exceptions, class 53 insufficient resources.
    db.code().is_some_and(|code| {
        matches!(
            code.as_ref(),
            "55P03" | "40001" | "40P01" | "40003" | "25006" | "57014" | "57P01" | "57P02" | "57P03"
        ) || code.starts_with("08")
            || code.starts_with("53")
    })
}

/// Maps a driver error: connection trouble and a refusal worth retrying (see
/// `is_transient_refusal`) are [`ErrorKind::StoreUnavailable`]; a refusal that no retry
/// can fix (credentials, unknown database, permissions) is
/// [`ErrorKind::Configuration`], with the server's own sentence as the message.
pub(crate) fn map_error(error: sqlx::Error, context: &str) -> Error {
    if let Some(db) = error.as_database_error()
        && is_configuration_error(db)
    {
        let message = format!("{context}: the server says \"{}\"", db.message());
        return Error::new(ErrorKind::Configuration, message).with_quiet_source(error);
    }
    let kind = match &error {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Tls(_) => ErrorKind::StoreUnavailable,
        sqlx::Error::Database(db)
            if db.message().contains("locked")
                || db.message().contains("busy")
                || db.message().contains("terminating connection")
                || db.message().contains("shutting down") =>
        {
            ErrorKind::StoreUnavailable
        }
        sqlx::Error::Database(db)
            if ends_the_session(db.as_ref()) || is_transient_refusal(db.as_ref()) =>
        {
            ErrorKind::StoreUnavailable
        }
        _ => ErrorKind::Store,
    };
    Error::new(kind, context.to_owned()).with_source(error)
}

/// Whether the server ended the session with the error (PostgreSQL severity FATAL or
/// PANIC): a database that refuses sessions for now (`ALLOW_CONNECTIONS false`,
/// SQLSTATE 55000), too many connections (53300), a server in recovery. Worth retrying
/// later, unlike an error in a statement. Refusals no retry can fix (credentials, an
/// unknown database) are FATAL too, and are told apart before this.
fn ends_the_session(db: &dyn sqlx::error::DatabaseError) -> bool {
    #[cfg(feature = "postgres")]
    if let Some(postgres) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
        use sqlx::postgres::PgSeverity;
        return matches!(postgres.severity(), PgSeverity::Fatal | PgSeverity::Panic);
    }
    let _ = db;
    false
}

/// Whether a statement gave up waiting for a row lock (PostgreSQL `lock_timeout`,
/// SQLSTATE 55P03).
#[cfg(feature = "postgres")]
pub(crate) fn is_lock_timeout(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|db| db.code())
        .is_some_and(|code| code == "55P03")
}

/// Turns a failure to open a store's pool into the error that says why: the pool
/// reports only that it timed out, so one direct connection attempt (within
/// `limit`) finds the cause — connection refused, authentication failed, unknown
/// database. Configuration errors keep their kind; anything else means the store is
/// unavailable.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) async fn connect_failure<O>(
    error: sqlx::Error,
    options: &O,
    what: &str,
    limit: std::time::Duration,
) -> Error
where
    O: sqlx::ConnectOptions,
    O::Connection: Sized,
{
    let error = match error {
        sqlx::Error::PoolTimedOut => match tokio::time::timeout(limit, options.connect()).await {
            Ok(Err(cause)) => cause,
            _ => sqlx::Error::PoolTimedOut,
        },
        other => other,
    };
    let error = map_error(error, what);
    match error.kind() {
        ErrorKind::Configuration | ErrorKind::StoreUnavailable => error,
        _ => Error::new(ErrorKind::StoreUnavailable, what.to_owned()).with_source(error),
    }
}

/// Whether a statement failed because Turnstile's tables do not exist (yet): for a
/// read-only look at a store nobody has migrated, that means nothing is locked.
pub(crate) fn is_missing_table(error: &sqlx::Error) -> bool {
    error.as_database_error().is_some_and(|db| {
        db.code()
            .is_some_and(|code| matches!(code.as_ref(), "42P01" | "42S02"))
            || db.message().contains("no such table")
    })
}

/// Checks a schema or table-name prefix: a plain SQL identifier, so it can be quoted
/// safely into statements.
#[allow(dead_code)]
pub(crate) fn validate_identifier(what: &str, value: &str) -> Result<()> {
    let mut chars = value.chars();
    let valid = value.len() <= 48
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if valid {
        Ok(())
    } else {
        Err(Error::new(
            ErrorKind::InvalidOptions,
            format!(
                "the {what} {value:?} must be 1 to 48 letters, digits or underscores, not starting with a digit"
            ),
        ))
    }
}

/// How long a pooled connection may sit idle before the pool pings it on the way out.
const PING_IF_IDLE_FOR: Duration = Duration::from_secs(1);

/// Options for pools whose every use is one statement that can simply be sent again
/// on a fresh connection when the one it got turns out to be gone: the session
/// engines' lock sessions, and SQLite (whose connections no server can close).
///
/// sqlx pings every connection it hands out, a round trip before each statement,
/// which doubled the round trips of a session acquire. These pools ping only a
/// connection that sat idle for a second or more. One that died sooner after its last
/// use (a server restart, a killed session) fails its statement, and the caller
/// retries it once on a fresh connection ([`is_connection_gone`]).
pub(crate) fn pool_options<DB: sqlx::Database>() -> sqlx::pool::PoolOptions<DB> {
    sqlx::pool::PoolOptions::new()
        .test_before_acquire(false)
        .before_acquire(|connection, metadata| {
            Box::pin(async move {
                if metadata.idle_for >= PING_IF_IDLE_FOR {
                    sqlx::Connection::ping(connection).await?;
                }
                Ok(true)
            })
        })
}

/// Whether `error` says the statement's connection was gone: closed by the server (a
/// restart, a killed session) or by the network. A session-level lock that such a
/// statement may have taken went with its session, so the statement can be sent
/// again on a fresh connection.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn is_connection_gone(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(db) => {
            // PostgreSQL: admin shutdown, crash shutdown, "cannot connect now";
            // MariaDB: the connection was killed.
            db.code()
                .is_some_and(|code| matches!(code.as_ref(), "57P01" | "57P02" | "57P03" | "70100"))
                || db.message().contains("terminating connection")
        }
        _ => false,
    }
}

/// Sends a statement, and sends it again on another connection while the one it got
/// turns out to be gone ([`is_connection_gone`]): for a store whose pool pings only
/// idle connections ([`pool_options`]). After a server restart every pooled connection
/// is gone, so a statement may meet several in turn: it is sent at most `pool_size + 1`
/// times. With the server down, a new connection fails to open and that ends it.
///
/// Only for statements that may harmlessly run twice. A connection that dies before
/// the statement reaches the server (the usual case: the server restarted or ended
/// the session while the connection sat in the pool) leaves nothing behind. One that
/// dies in the middle of a statement may have run it, and the next sending then
/// answers for a state the first one made: each caller says what that means for it.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) async fn sent_again_if_gone<T, F>(
    pool_size: u32,
    mut send: impl FnMut() -> F,
) -> std::result::Result<T, sqlx::Error>
where
    F: std::future::Future<Output = std::result::Result<T, sqlx::Error>>,
{
    let mut sendings_left = pool_size;
    loop {
        match send().await {
            Err(error) if sendings_left > 0 && is_connection_gone(&error) => sendings_left -= 1,
            answer => return answer,
        }
    }
}

/// A store's own connections, kept checked out of their pool between statements.
///
/// sqlx pings each connection that goes back to its pool: a round trip, in a task of
/// its own, that the server must wake up for. A lease-mode lock cycle is two
/// one-statement transactions, so those pings doubled the server's wake-ups per cycle.
/// Here a statement takes a connection off a shelf and puts it back when it succeeds.
/// The pool still opens the connections, bounds their number and applies the connect
/// options; a connection whose statement failed or was cancelled goes back to it, to be
/// tested or closed there. A connection that sat on the shelf for a second or more is
/// pinged before use, and a store sends its statements through
/// [`sent_again_if_gone`], which replaces one the server ended sooner.
///
/// Given an application's pool ([`shared`](Self::shared)), nothing is kept: the
/// application needs its connections back.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) struct KeptConnections<DB: sqlx::Database> {
    pool: sqlx::Pool<DB>,
    shelf: Option<Arc<Shelf<DB>>>,
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
struct Shelf<DB: sqlx::Database> {
    idle: std::sync::Mutex<
        Vec<(
            sqlx::pool::PoolConnection<DB>,
            std::time::Instant,
            SessionFacts,
        )>,
    >,
    /// Wakes a statement waiting for the pool when a connection is put back here
    /// instead: the pool alone would never hand it out again.
    returned: tokio::sync::Notify,
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl<DB: sqlx::Database> Clone for KeptConnections<DB> {
    fn clone(&self) -> Self {
        KeptConnections {
            pool: self.pool.clone(),
            shelf: self.shelf.clone(),
        }
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl<DB: sqlx::Database> std::fmt::Debug for KeptConnections<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeptConnections")
            .field("pool", &self.pool)
            .field("kept", &self.shelf.is_some())
            .finish()
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl<DB: sqlx::Database> KeptConnections<DB> {
    /// Keeps the connections of a pool that only this store uses.
    pub(crate) fn new(pool: sqlx::Pool<DB>) -> Self {
        KeptConnections {
            pool,
            shelf: Some(Arc::new(Shelf {
                idle: std::sync::Mutex::new(Vec::new()),
                returned: tokio::sync::Notify::new(),
            })),
        }
    }

    /// Uses an application's pool as it is: every statement takes a connection from it
    /// and gives it back.
    pub(crate) fn shared(pool: sqlx::Pool<DB>) -> Self {
        KeptConnections { pool, shelf: None }
    }

    /// The pool the connections come from.
    pub(crate) fn pool(&self) -> &sqlx::Pool<DB> {
        &self.pool
    }

    /// How many connections there may be, all of which a server restart may have ended.
    pub(crate) fn size(&self) -> u32 {
        self.pool.options().get_max_connections()
    }

    /// A connection for one statement: from the shelf if one is there, else from the
    /// pool, whichever comes first, within the pool's acquire timeout.
    pub(crate) async fn take(&self) -> std::result::Result<Lent<DB>, sqlx::Error> {
        let Some(shelf) = &self.shelf else {
            return Ok(Lent {
                connection: Some(self.pool.acquire().await?),
                shelf: None,
                facts: SessionFacts::default(),
            });
        };
        let limit = self.pool.options().get_acquire_timeout();
        let taken = tokio::time::timeout(limit, async {
            loop {
                let returned = shelf.returned.notified();
                tokio::pin!(returned);
                // Registered before the shelf is looked at, so a connection put back
                // after the look still wakes this statement.
                returned.as_mut().enable();
                let kept = shelf.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
                if let Some((mut connection, since, facts)) = kept {
                    if since.elapsed() < PING_IF_IDLE_FOR
                        || sqlx::Connection::ping(&mut *connection).await.is_ok()
                    {
                        return Ok((connection, facts));
                    }
                    // Gone while it sat here: closed (dropped), and the next one is tried.
                    continue;
                }
                tokio::select! {
                    connection = self.pool.acquire() => {
                        return connection.map(|connection| (connection, SessionFacts::default()));
                    }
                    () = &mut returned => {}
                }
            }
        })
        .await;
        let (connection, facts) = taken.unwrap_or(Err(sqlx::Error::PoolTimedOut))?;
        Ok(Lent {
            connection: Some(connection),
            shelf: Some(Arc::clone(shelf)),
            facts,
        })
    }
}

/// What a store has learnt about a kept connection's session, kept with it on the
/// shelf so that later statements need not ask again. A connection that went back to
/// the pool (or came from it) knows nothing.
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SessionFacts {
    /// The server's id for the session (MySQL's `CONNECTION_ID()`).
    pub(crate) server_id: Option<u64>,
    /// The idle timeout last set on the session, in seconds (MySQL's `wait_timeout`).
    pub(crate) idle_timeout_secs: Option<u64>,
}

/// A connection taken for one statement: put back on the shelf by [`keep`](Self::keep)
/// once the statement succeeded; dropped otherwise, which returns it to the pool.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) struct Lent<DB: sqlx::Database> {
    connection: Option<sqlx::pool::PoolConnection<DB>>,
    shelf: Option<Arc<Shelf<DB>>>,
    facts: SessionFacts,
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl<DB: sqlx::Database> Lent<DB> {
    /// Takes the connection out of the pool's count for good: dropping it closes its
    /// socket, so the server ends the session (and frees whatever the session holds).
    pub(crate) fn detach(mut self) -> DB::Connection {
        self.connection
            .take()
            .expect("a lent connection is present until kept")
            .detach()
    }

    /// Puts the connection back for the next statement, with what is known of it.
    pub(crate) fn keep(mut self) {
        if let (Some(connection), Some(shelf)) = (self.connection.take(), &self.shelf) {
            shelf.idle.lock().unwrap_or_else(|p| p.into_inner()).push((
                connection,
                std::time::Instant::now(),
                self.facts,
            ));
            shelf.returned.notify_one();
        }
    }

    /// What is known of the session.
    pub(crate) fn facts(&self) -> SessionFacts {
        self.facts
    }

    /// Records what the last statement established about the session.
    pub(crate) fn learn(&mut self, facts: SessionFacts) {
        self.facts = facts;
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl<DB: sqlx::Database> std::ops::Deref for Lent<DB> {
    type Target = DB::Connection;
    fn deref(&self) -> &DB::Connection {
        self.connection
            .as_deref()
            .expect("a lent connection is present until kept")
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl<DB: sqlx::Database> std::ops::DerefMut for Lent<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        self.connection
            .as_deref_mut()
            .expect("a lent connection is present until kept")
    }
}

/// Statements sent on `&KeptConnections` as on a pool: each takes a connection and
/// keeps it if it succeeds.
#[cfg(any(feature = "postgres", feature = "mysql"))]
impl<'p, DB: sqlx::Database> sqlx::Executor<'p> for &'p KeptConnections<DB>
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    type Database = DB;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> futures_util::stream::BoxStream<
        'e,
        std::result::Result<sqlx::Either<DB::QueryResult, DB::Row>, sqlx::Error>,
    >
    where
        'p: 'e,
        E: 'q + sqlx::Execute<'q, DB>,
    {
        use futures_util::{StreamExt, TryStreamExt};
        // The whole reply is read before it is handed on, so the connection is kept (or
        // not) as soon as the statement ends. The store's statements reply with a row
        // or two.
        futures_util::stream::once(async move {
            let mut connection = self.take().await?;
            let steps: Vec<_> = (&mut *connection).fetch_many(query).try_collect().await?;
            connection.keep();
            Ok::<_, sqlx::Error>(futures_util::stream::iter(steps.into_iter().map(Ok)))
        })
        .try_flatten()
        .boxed()
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> futures_util::future::BoxFuture<'e, std::result::Result<Option<DB::Row>, sqlx::Error>>
    where
        'p: 'e,
        E: 'q + sqlx::Execute<'q, DB>,
    {
        Box::pin(async move {
            let mut connection = self.take().await?;
            let row = (&mut *connection).fetch_optional(query).await?;
            connection.keep();
            Ok(row)
        })
    }

    fn prepare_with<'e>(
        self,
        sql: sqlx::SqlStr,
        parameters: &'e [DB::TypeInfo],
    ) -> futures_util::future::BoxFuture<'e, std::result::Result<DB::Statement, sqlx::Error>>
    where
        'p: 'e,
    {
        Box::pin(async move {
            let mut connection = self.take().await?;
            let statement = (&mut *connection).prepare_with(sql, parameters).await?;
            connection.keep();
            Ok(statement)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_plain() {
        assert!(validate_identifier("schema", "turnstile_1").is_ok());
        for bad in ["", "1abc", "a-b", "a\"b", &"x".repeat(49)] {
            assert!(validate_identifier("schema", bad).is_err(), "{bad}");
        }
    }
}
