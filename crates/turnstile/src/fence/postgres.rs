//! Fenced writes in PostgreSQL: a token check inside the application's own transaction.
//!
//! ```no_run
//! # async fn demo(store: turnstile::lock::postgres::PostgresLockStore, token: turnstile::FencingToken) -> turnstile::Result<()> {
//! use turnstile::fence::FenceOutcome;
//!
//! let fence = store.fence();
//! let mut transaction = store.pool().begin().await.unwrap();
//! if fence.check_and_record(&mut transaction, "invoice:42", token).await? == FenceOutcome::Applied {
//!     // ... the business write, in the same transaction ...
//!     transaction.commit().await.unwrap();
//! }
//! # Ok(())
//! # }
//! ```

use sqlx::postgres::PgConnection;

use super::{FenceOutcome, FencingToken, validate_resource};
use crate::error::Result;
use crate::sql::{Statement, map_error, statement};

/// Checks and records fencing tokens in a fence table (see
/// [`PostgresLockStore::fence`](crate::lock::postgres::PostgresLockStore::fence)).
#[derive(Debug, Clone)]
pub struct PostgresFence {
    record: Statement,
    read: Statement,
}

impl PostgresFence {
    pub(crate) fn new(table: String) -> Self {
        PostgresFence {
            record: statement(format!(
                "INSERT INTO {table} AS f (resource, token) VALUES ($1, $2)
                 ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token
                 WHERE f.token <= EXCLUDED.token
                 RETURNING token"
            )),
            read: statement(format!("SELECT token FROM {table} WHERE resource = $1")),
        }
    }

    /// Records `token` for `resource` if it is not smaller than the largest token the
    /// resource has seen, and says whether it was.
    ///
    /// Run it inside the transaction that makes the protected write, and write only on
    /// [`FenceOutcome::Applied`]. The fence row stays locked until that transaction ends,
    /// so two holders cannot both pass with out-of-order tokens.
    pub async fn check_and_record(
        &self,
        connection: &mut PgConnection,
        resource: &str,
        token: FencingToken,
    ) -> Result<FenceOutcome> {
        validate_resource(resource)?;
        let accepted: Option<i64> = sqlx::query_scalar(self.record.sql())
            .bind(resource)
            .bind(token.to_i64()?)
            .fetch_optional(&mut *connection)
            .await
            .map_err(|error| map_error(error, "cannot check the fencing token"))?;
        if accepted.is_some() {
            return Ok(FenceOutcome::Applied);
        }
        let highest: i64 = sqlx::query_scalar(self.read.sql())
            .bind(resource)
            .fetch_one(&mut *connection)
            .await
            .map_err(|error| map_error(error, "cannot read the fencing token"))?;
        Ok(FenceOutcome::Rejected {
            highest_seen: FencingToken::new(u64::try_from(highest).unwrap_or(0)),
        })
    }
}
