//! MySQL / MariaDB: connection settings, the connected pool a store opens first, the
//! server clock, and the server's error numbers.

use std::str::FromStr;
use std::time::Duration;

use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};

use crate::error::{Error, ErrorKind, Result};

/// The server clock in microseconds since the Unix epoch: the floor of new tokens, and
/// the clock of lease ends and retention. Both parts read the statement's start time;
/// neither depends on the session's time zone.
pub(crate) const CLOCK_US: &str = "(UNIX_TIMESTAMP() * 1000000 + MICROSECOND(NOW(6)))";

/// The server's error number (`ER_…`) of a failed statement; `None` for an error that
/// did not come from the server.
pub(crate) fn server_error_number(error: &sqlx::Error) -> Option<u16> {
    error
        .as_database_error()
        .and_then(|db| db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
        .map(sqlx::mysql::MySqlDatabaseError::number)
}

/// The driver's options for `url`, or an error that shows the expected form.
pub(crate) fn connect_options(url: &str) -> Result<MySqlConnectOptions> {
    MySqlConnectOptions::from_str(url).map_err(|error| {
        Error::new(
            ErrorKind::InvalidUrl,
            format!(
                "{} is not a valid MySQL URL (mysql://user[:password]@host[:port]/database)",
                crate::url::redact(url)
            ),
        )
        .with_source(error)
    })
}

/// A pool connected now, so that a wrong URL or password is reported at once with its
/// cause; every connection first runs `session` (settings such as a shorter lock wait).
pub(crate) async fn open_pool(
    options: &MySqlConnectOptions,
    max: u32,
    timeout: Duration,
    redacted: &str,
    session: &'static [&'static str],
) -> Result<MySqlPool> {
    match MySqlPoolOptions::new()
        .max_connections(max.max(1))
        .acquire_timeout(timeout)
        .after_connect(move |connection, _| {
            Box::pin(async move {
                for statement in session {
                    sqlx::query(*statement).execute(&mut *connection).await?;
                }
                Ok(())
            })
        })
        .connect_with(options.clone())
        .await
    {
        Ok(pool) => Ok(pool),
        Err(error) => {
            let what = format!("cannot connect to MySQL at {redacted}");
            Err(crate::sql::connect_failure(error, options, &what, timeout).await)
        }
    }
}
