//! SQLite: a database file opened in WAL mode with a busy timeout, shared by every
//! process on the host.

use std::path::{Path, PathBuf};
use std::time::Duration;

use sqlx::sqlite::{
    Sqlite, SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqliteSynchronous,
};

use crate::error::{Error, ErrorKind, Result};
use crate::sql::map_error;

/// A parsed `sqlite://PATH` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SqliteUrl {
    pub(crate) path: PathBuf,
    /// Create the file and the tables if missing (`turnstile_migrate=off` turns it off).
    pub(crate) create: bool,
    /// `turnstile_synchronous=full|normal`: how a commit reaches the disk, when the URL
    /// says (each concept has its own default).
    pub(crate) synchronous: Option<SqliteSynchronous>,
}

/// Parses `sqlite://PATH` (relative), `sqlite:///absolute/path` or `sqlite:PATH`.
pub(crate) fn parse_url(url: &str) -> Result<SqliteUrl> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidUrl,
                format!("{url:?} is not a sqlite:// URL"),
            )
        })?;
    let (path, options) = crate::url::split_url_options(rest);
    let mut create = true;
    let mut synchronous = None;
    for (key, value) in &options {
        match (key.as_str(), value.as_str()) {
            ("migrate", "on" | "true" | "1") => create = true,
            ("migrate", "off" | "false" | "0") => create = false,
            ("synchronous", "full") => synchronous = Some(SqliteSynchronous::Full),
            ("synchronous", "normal") => synchronous = Some(SqliteSynchronous::Normal),
            _ => {
                return Err(crate::url::unknown_option(
                    key,
                    value,
                    "turnstile_migrate=on|off, turnstile_synchronous=full|normal",
                ));
            }
        }
    }
    let path = path.split('?').next().unwrap_or_default();
    if path.is_empty() || path == ":memory:" {
        return Err(Error::new(
            ErrorKind::InvalidUrl,
            format!(
                "{url:?} names no file; use sqlite://PATH (relative) or sqlite:///absolute/path \
                 (an in-memory database cannot be shared between processes)"
            ),
        ));
    }
    Ok(SqliteUrl {
        path: PathBuf::from(path),
        create,
        synchronous,
    })
}

/// Opens the database at `path`: WAL, a 5 s busy timeout, and `synchronous` (`NORMAL`:
/// a commit survives a crash of the process, a power cut may take the last ones back;
/// `FULL`: each commit is on disk when it returns). With `create` off a missing file is
/// an error (`what` names what was looked for).
pub(crate) async fn open_pool(
    path: &Path,
    create: bool,
    what: &str,
    synchronous: SqliteSynchronous,
) -> Result<SqlitePool> {
    if !create && !path.is_file() {
        return Err(Error::new(
            ErrorKind::InvalidUrl,
            format!("there is no SQLite {what} at {}", path.display()),
        ));
    }
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty())
        && !parent.is_dir()
    {
        return Err(Error::new(
            ErrorKind::InvalidUrl,
            format!(
                "the directory {} for the SQLite {what} does not exist; create it first",
                parent.display()
            ),
        ));
    }
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(create)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(synchronous)
        .busy_timeout(Duration::from_secs(5));
    // Several processes creating the same new file at once race on switching it to
    // WAL (that takes the database's exclusive lock, which the busy timeout does not
    // cover): the losers see "database is locked" or "unable to open database file"
    // for a moment, so opening is retried for a few seconds.
    let started = std::time::Instant::now();
    let mut pause = Duration::from_millis(10);
    loop {
        let attempt = async {
            let pool = crate::sql::pool_options::<Sqlite>()
                .max_connections(4)
                .acquire_timeout(Duration::from_secs(5))
                .connect_with(options.clone())
                .await?;
            sqlx::query("SELECT 1").execute(&pool).await?;
            Ok::<_, sqlx::Error>(pool)
        }
        .await;
        match attempt {
            Ok(pool) => return Ok(pool),
            Err(error)
                if is_transient_open_error(&error)
                    && started.elapsed() < Duration::from_secs(5) =>
            {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(200));
            }
            Err(error) => {
                return Err(map_error(
                    error,
                    &format!("cannot open SQLite database {}", path.display()),
                ));
            }
        }
    }
}

/// SQLite's "database is locked" (5) and "unable to open database file" (14), as another
/// process creates the same file.
fn is_transient_open_error(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|db| db.code())
        .is_some_and(|code| matches!(code.as_ref(), "5" | "14" | "517"))
}

/// A duration in whole milliseconds (rounded up), for the SQLite engines' arithmetic.
pub(crate) fn millis_i64(duration: Duration) -> i64 {
    i64::try_from(crate::clock::ceil_millis(duration)).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_files() {
        let parsed = |url| parse_url(url).map(|url| (url.path, url.create));
        assert_eq!(
            parsed("sqlite:///tmp/x.db").unwrap(),
            (PathBuf::from("/tmp/x.db"), true)
        );
        assert_eq!(
            parsed("sqlite://x.db").unwrap(),
            (PathBuf::from("x.db"), true)
        );
        assert_eq!(
            parsed("sqlite:x.db").unwrap(),
            (PathBuf::from("x.db"), true)
        );
        assert_eq!(
            parsed("sqlite://x.db?turnstile_migrate=off").unwrap(),
            (PathBuf::from("x.db"), false)
        );
        for bad in [
            "sqlite://",
            "sqlite::memory:",
            "sqlite://x.db?turnstile_prefix=a",
        ] {
            assert_eq!(
                parse_url(bad).unwrap_err().kind(),
                ErrorKind::InvalidUrl,
                "{bad}"
            );
        }
    }
}
