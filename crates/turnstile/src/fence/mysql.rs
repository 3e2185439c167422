//! Fenced writes in MySQL / MariaDB: a token check inside the application's own
//! transaction.

use sqlx::mysql::MySqlConnection;

use super::{FenceOutcome, FencingToken, validate_resource};
use crate::error::Result;
use crate::sql::{Statement, map_error, statement};

/// Checks and records fencing tokens in a fence table (see
/// [`MysqlLockStore::fence`](crate::lock::mysql::MysqlLockStore::fence)).
#[derive(Debug, Clone)]
pub struct MysqlFence {
    insert: Statement,
    read_for_update: Statement,
    raise: Statement,
}

impl MysqlFence {
    pub(crate) fn new(table: &str) -> Self {
        MysqlFence {
            insert: statement(format!(
                "INSERT IGNORE INTO {table} (resource, token) VALUES (?, ?)"
            )),
            read_for_update: statement(format!(
                "SELECT token FROM {table} WHERE resource = ? FOR UPDATE"
            )),
            raise: statement(format!("UPDATE {table} SET token = ? WHERE resource = ?")),
        }
    }

    /// Records `token` for `resource` if it is not smaller than the largest token the
    /// resource has seen, and says whether it was.
    ///
    /// Run it inside the transaction (InnoDB) that makes the protected write, and write
    /// only on [`FenceOutcome::Applied`]. The fence row stays locked (`FOR UPDATE`) until
    /// that transaction ends, so two holders cannot both pass with out-of-order tokens.
    pub async fn check_and_record(
        &self,
        connection: &mut MySqlConnection,
        resource: &str,
        token: FencingToken,
    ) -> Result<FenceOutcome> {
        validate_resource(resource)?;
        let fail = |error| map_error(error, "cannot check the fencing token");
        sqlx::query(self.insert.sql())
            .bind(resource.as_bytes())
            .bind(token.get())
            .execute(&mut *connection)
            .await
            .map_err(fail)?;
        let highest: u64 = sqlx::query_scalar(self.read_for_update.sql())
            .bind(resource.as_bytes())
            .fetch_one(&mut *connection)
            .await
            .map_err(fail)?;
        if token.get() < highest {
            return Ok(FenceOutcome::Rejected {
                highest_seen: FencingToken::new(highest),
            });
        }
        sqlx::query(self.raise.sql())
            .bind(token.get())
            .bind(resource.as_bytes())
            .execute(&mut *connection)
            .await
            .map_err(fail)?;
        Ok(FenceOutcome::Applied)
    }
}
