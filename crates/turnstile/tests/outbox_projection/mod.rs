//! The consumer the broker tests share: per-account totals kept through an inbox in a
//! SQLite file, counting what it handled, skipped as a duplicate, and saw out of its
//! key's order.

use std::path::Path;

use turnstile::idempotency::inbox::Inbox;
use turnstile::idempotency::sqlite::SqliteIdempotencyStore;
use turnstile::outbox::Incoming;

pub(crate) struct Projection {
    keys: SqliteIdempotencyStore,
    inbox: Inbox<SqliteIdempotencyStore>,
    pub(crate) handled: usize,
    pub(crate) skipped: usize,
    pub(crate) out_of_order: usize,
}

impl Projection {
    pub(crate) async fn open(path: &Path) -> Projection {
        let keys = SqliteIdempotencyStore::open(path).await.unwrap();
        sqlx::query(
            "CREATE TABLE totals (account TEXT PRIMARY KEY, cents INTEGER NOT NULL, last_seq INTEGER NOT NULL)",
        )
        .execute(keys.pool())
        .await
        .unwrap();
        Projection {
            inbox: Inbox::new(keys.clone(), "projection").unwrap(),
            keys,
            handled: 0,
            skipped: 0,
            out_of_order: 0,
        }
    }

    /// Adds one `{"account", "cents"}` event to its account's total, in a transaction
    /// with its inbox record, and returns its cents.
    pub(crate) async fn apply(&mut self, incoming: &Incoming) -> turnstile::Result<i64> {
        let body: serde_json::Value = serde_json::from_slice(&incoming.payload).unwrap();
        let account = body["account"].as_str().unwrap().to_owned();
        let cents = body["cents"].as_i64().unwrap();
        let seq = i64::try_from(incoming.seq.unwrap()).unwrap();
        let mut out_of_order = false;
        let mut transaction = self
            .keys
            .pool()
            .begin_with("BEGIN IMMEDIATE")
            .await
            .unwrap();
        let delivery = self
            .inbox
            .process(
                &mut transaction,
                &incoming.inbox_id()?,
                async |connection| {
                    let last: Option<i64> =
                        sqlx::query_scalar("SELECT last_seq FROM totals WHERE account = ?1")
                            .bind(&account)
                            .fetch_optional(&mut *connection)
                            .await
                            .unwrap();
                    out_of_order = last.unwrap_or(0) + 1 != seq;
                    sqlx::query(
                        "INSERT INTO totals (account, cents, last_seq) VALUES (?1, ?2, ?3)
                     ON CONFLICT (account) DO UPDATE SET cents = cents + ?2, last_seq = ?3",
                    )
                    .bind(&account)
                    .bind(cents)
                    .bind(seq)
                    .execute(&mut *connection)
                    .await
                    .unwrap();
                    Ok::<_, turnstile::Error>(())
                },
            )
            .await?;
        transaction.commit().await.unwrap();
        self.out_of_order += usize::from(out_of_order);
        if delivery.is_duplicate() {
            self.skipped += 1;
        } else {
            self.handled += 1;
        }
        Ok(cents)
    }

    /// Every account's total, in account order.
    pub(crate) async fn totals(&self) -> Vec<(String, i64)> {
        sqlx::query_as("SELECT account, cents FROM totals ORDER BY account")
            .fetch_all(self.keys.pool())
            .await
            .unwrap()
    }
}
