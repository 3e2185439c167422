//! What the SQL engines share: error mapping, identifier checks, URL options.

use std::sync::Arc;

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

/// Maps a driver error: connection trouble is [`ErrorKind::StoreUnavailable`].
pub(crate) fn map_error(error: sqlx::Error, context: &str) -> Error {
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

/// Splits Turnstile's own `turnstile_*` options off a database URL's query string,
/// returning the URL the driver should see and the options.
#[allow(dead_code)]
pub(crate) fn split_url_options(url: &str) -> (String, Vec<(String, String)>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), Vec::new());
    };
    let mut kept = Vec::new();
    let mut ours = Vec::new();
    for pair in query.split('&').filter(|pair| !pair.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if let Some(option) = key.strip_prefix("turnstile_") {
            ours.push((option.to_owned(), value.to_owned()));
        } else {
            kept.push(pair);
        }
    }
    let url = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    (url, ours)
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

    #[test]
    fn our_options_are_split_off() {
        let (url, ours) =
            split_url_options("postgres://h/db?sslmode=disable&turnstile_schema=locks");
        assert_eq!(url, "postgres://h/db?sslmode=disable");
        assert_eq!(ours, vec![("schema".to_owned(), "locks".to_owned())]);
        assert_eq!(split_url_options("postgres://h/db").0, "postgres://h/db");
    }
}
