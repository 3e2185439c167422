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

/// Maps a driver error: connection trouble is [`ErrorKind::StoreUnavailable`]; a
/// refusal that no retry can fix (credentials, unknown database, permissions) is
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
        _ => ErrorKind::Store,
    };
    Error::new(kind, context.to_owned()).with_source(error)
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
