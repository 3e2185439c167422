//! Fenced writes in SQLite: a token check inside the application's own transaction.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> turnstile::Result<()> {
//! use turnstile::fence::{sqlite, FenceOutcome, FencingToken};
//! # let dir = tempfile::tempdir().unwrap();
//! # let store = turnstile::lock::sqlite::SqliteLockStore::open(dir.path().join("app.db")).await?;
//! let pool = store.pool(); // or the application's own pool on the same file
//!
//! let mut transaction = pool.begin().await.unwrap();
//! match sqlite::check_and_record(&mut transaction, "invoice:42", FencingToken::new(7)).await? {
//!     FenceOutcome::Applied => {
//!         // ... the business write, in the same transaction ...
//!         transaction.commit().await.unwrap();
//!     }
//!     FenceOutcome::Rejected { highest_seen } => {
//!         // A newer holder has written already: this holder lost its lock.
//!         # let _ = highest_seen;
//!     }
//!     _ => {}
//! }
//! # Ok(())
//! # }
//! ```

use sqlx::sqlite::SqliteConnection;
use sqlx::{Executor, Sqlite};

use super::{FenceOutcome, FencingToken, validate_resource};
use crate::error::Result;
use crate::error::{Error, ErrorKind};
use crate::sql::map_error;

const CREATE_FENCES: &str = "CREATE TABLE IF NOT EXISTS turnstile_fences (
    resource TEXT PRIMARY KEY NOT NULL,
    token INTEGER NOT NULL
) WITHOUT ROWID";

/// Creates the `turnstile_fences` table if it is missing (the lock store does this when
/// it opens). Harmless to run again or concurrently.
pub async fn create_table<'e, E>(executor: E) -> Result<()>
where
    E: Executor<'e, Database = Sqlite>,
{
    executor
        .execute(CREATE_FENCES)
        .await
        .map_err(|error| map_error(error, "cannot create the fence table"))?;
    Ok(())
}

/// Records `token` for `resource` if it is not smaller than the largest token the
/// resource has seen, and says whether it was.
///
/// Run it inside the transaction that makes the protected write, and write only on
/// [`FenceOutcome::Applied`]: the check and the write then commit together or not at
/// all. SQLite serialises writers, so two holders cannot both pass the check with
/// out-of-order tokens.
pub async fn check_and_record(
    connection: &mut SqliteConnection,
    resource: &str,
    token: FencingToken,
) -> Result<FenceOutcome> {
    validate_resource(resource)?;
    let token = token.to_i64()?;
    let accepted: Option<i64> = sqlx::query_scalar(
        "INSERT INTO turnstile_fences (resource, token) VALUES (?1, ?2)
         ON CONFLICT (resource) DO UPDATE SET token = excluded.token
         WHERE excluded.token >= turnstile_fences.token
         RETURNING token",
    )
    .bind(resource)
    .bind(token)
    .fetch_optional(&mut *connection)
    .await
    .map_err(|error| {
        let missing = error
            .as_database_error()
            .is_some_and(|db| db.message().contains("no such table"));
        if missing {
            Error::new(
                ErrorKind::Store,
                "the fence table turnstile_fences does not exist in this database; \
                 create it once with turnstile::fence::sqlite::create_table (or open a \
                 SqliteLockStore on the same file, which does)",
            )
            .with_source(error)
        } else {
            map_error(error, "cannot check the fencing token")
        }
    })?;
    if accepted.is_some() {
        return Ok(FenceOutcome::Applied);
    }
    let highest: i64 = sqlx::query_scalar("SELECT token FROM turnstile_fences WHERE resource = ?1")
        .bind(resource)
        .fetch_one(&mut *connection)
        .await
        .map_err(|error| map_error(error, "cannot read the fencing token"))?;
    Ok(FenceOutcome::Rejected {
        highest_seen: FencingToken::new(u64::try_from(highest).unwrap_or(0)),
    })
}
