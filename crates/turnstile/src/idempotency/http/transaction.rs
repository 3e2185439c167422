//! The same-transaction mode of the layer: the handler's business writes and the stored
//! response commit together.
//!
//! The layer claims the key as in the lease mode (a claim with a fencing token, renewed
//! by the watchdog, so that duplicates are answered at once or woken when it ends), and
//! puts a transaction slot into the request. A handler that takes
//! [`IdempotentTransaction`] gets a transaction opened on the application's pool; when it
//! returns a response the layer stores, the layer writes that response into the same
//! transaction — refused if the claim's token is no longer the record's — and commits.
//! A handler that does not take it runs in the lease mode.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use http::request::Parts;
use tokio::sync::{Mutex, OwnedMutexGuard};

use super::problem::{problem, types};
use super::replay;
use crate::error::{Error, ErrorKind, Result};
use crate::fence::FencingToken;
use crate::future::BoxFuture;
use crate::idempotency::{RunningClaim, TransactionalIdempotency};

/// Where a request's transaction lives while the handler runs: opened by the extractor
/// on first use, taken back by the layer after the handler.
struct Slot<DB: sqlx::Database> {
    pool: sqlx::Pool<DB>,
    begin: Option<&'static str>,
    token: FencingToken,
    transaction: Arc<Mutex<Option<sqlx::Transaction<'static, DB>>>>,
    /// Set when the handler asked for the transaction, even if it could not be opened:
    /// the request is in the same-transaction mode either way.
    asked: std::sync::atomic::AtomicBool,
}

/// The handler's side of the same-transaction mode: the request's database
/// transaction, in which the layer will also store the response. Use it as an
/// executor (`&mut *transaction`); do not commit it — the layer does, after the
/// handler returned a response it stores, and rolls it back otherwise (a 5xx, a lost
/// claim, a failure to store the response).
///
/// ```no_run
/// use axum::http::StatusCode;
/// use turnstile::idempotency::http::IdempotentTransaction;
///
/// async fn pay(mut transaction: IdempotentTransaction<sqlx::Postgres>) -> StatusCode {
///     let inserted = sqlx::query("INSERT INTO payments (cents) VALUES (1000)")
///         .execute(&mut *transaction)
///         .await;
///     match inserted {
///         Ok(_) => StatusCode::CREATED,
///         Err(_) => StatusCode::INTERNAL_SERVER_ERROR, // not stored: rolled back
///     }
/// }
/// ```
pub struct IdempotentTransaction<DB: sqlx::Database> {
    guard: OwnedMutexGuard<Option<sqlx::Transaction<'static, DB>>>,
    token: FencingToken,
}

impl<DB: sqlx::Database> std::fmt::Debug for IdempotentTransaction<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotentTransaction")
            .field("token", &self.token)
            .finish()
    }
}

impl<DB: sqlx::Database> IdempotentTransaction<DB> {
    /// The claim's fencing token: for fenced writes to resources outside this database.
    pub fn token(&self) -> FencingToken {
        self.token
    }
}

impl<DB: sqlx::Database> Deref for IdempotentTransaction<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        match self.guard.as_ref() {
            Some(transaction) => transaction,
            // The extractor only hands out a slot it has filled.
            None => unreachable!("an IdempotentTransaction always holds its transaction"),
        }
    }
}

impl<DB: sqlx::Database> DerefMut for IdempotentTransaction<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        match self.guard.as_mut() {
            Some(transaction) => transaction,
            None => unreachable!("an IdempotentTransaction always holds its transaction"),
        }
    }
}

/// Why a handler could not get its transaction.
#[derive(Debug)]
pub struct TransactionRejection(Response);

impl IntoResponse for TransactionRejection {
    fn into_response(self) -> Response {
        self.0
    }
}

impl<DB: sqlx::Database, State: Sync> FromRequestParts<State> for IdempotentTransaction<DB> {
    type Rejection = TransactionRejection;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &State,
    ) -> std::result::Result<Self, TransactionRejection> {
        let Some(slot) = parts.extensions.get::<Arc<Slot<DB>>>().cloned() else {
            return Err(TransactionRejection(problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                types::NO_TRANSACTION,
                "This route has no idempotent transaction",
                "the handler asks for an IdempotentTransaction, but the request came without an \
                 Idempotency-Key or the route's IdempotencyLayer was not given transactions \
                 (IdempotencyLayer::in_transactions) for this database",
                None,
            )));
        };
        slot.asked.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut guard = Arc::clone(&slot.transaction).lock_owned().await;
        if guard.is_none() {
            let opened = match slot.begin {
                Some(statement) => slot.pool.begin_with(statement).await,
                None => slot.pool.begin().await,
            };
            match opened {
                Ok(transaction) => *guard = Some(transaction),
                Err(error) => {
                    let error = crate::sql::map_error(error, "cannot open the transaction");
                    return Err(TransactionRejection(super::error_response(&error)));
                }
            }
        }
        Ok(IdempotentTransaction {
            guard,
            token: slot.token,
        })
    }
}

/// The layer's side: made per request by [`TransactionSource::attach`].
pub(super) trait Finisher: Send {
    /// Whether the handler opened the transaction.
    fn opened(&self) -> bool;

    /// Whether the handler asked for the transaction (opened or not): its response
    /// follows the same-transaction mode's policy. A handler whose transaction could
    /// not be opened (a 503 from the extractor) had no effect to keep, so that answer
    /// must give the key back, not be stored and replayed.
    fn asked(&self) -> bool;

    /// Stores `outcome` in the handler's transaction and commits it; on any failure the
    /// transaction is rolled back and the key given back.
    fn commit(
        self: Box<Self>,
        claim: RunningClaim,
        outcome: Vec<u8>,
    ) -> BoxFuture<'static, Result<()>>;

    /// Rolls the handler's transaction back (if it opened one).
    fn rollback(self: Box<Self>) -> BoxFuture<'static, ()>;
}

/// Makes the per-request slot: kept by the layer's configuration, for one database.
pub(super) trait TransactionSource: Send + Sync {
    fn attach(&self, extensions: &mut http::Extensions, token: FencingToken) -> Box<dyn Finisher>;
}

pub(super) struct Source<DB: sqlx::Database, S> {
    pub(super) pool: sqlx::Pool<DB>,
    pub(super) store: S,
}

struct RequestFinisher<DB: sqlx::Database, S> {
    slot: Arc<Slot<DB>>,
    store: S,
}

impl<DB, S> TransactionSource for Source<DB, S>
where
    DB: sqlx::Database,
    S: TransactionalIdempotency<Connection = DB::Connection> + Clone + Send + Sync + 'static,
{
    fn attach(&self, extensions: &mut http::Extensions, token: FencingToken) -> Box<dyn Finisher> {
        let slot = Arc::new(Slot {
            pool: self.pool.clone(),
            begin: self.store.begin_statement(),
            token,
            transaction: Arc::default(),
            asked: std::sync::atomic::AtomicBool::new(false),
        });
        extensions.insert(Arc::clone(&slot));
        Box::new(RequestFinisher {
            slot,
            store: self.store.clone(),
        })
    }
}

impl<DB: sqlx::Database, S> RequestFinisher<DB, S> {
    /// The transaction, once the handler has let go of it.
    fn take(&self) -> Result<Option<sqlx::Transaction<'static, DB>>> {
        match self.slot.transaction.try_lock() {
            Ok(mut guard) => Ok(guard.take()),
            Err(_) => Err(Error::new(
                ErrorKind::InvalidOptions,
                "the handler kept its IdempotentTransaction beyond its response (moved into a \
                 spawned task?); the request's writes were rolled back",
            )),
        }
    }
}

impl<DB, S> Finisher for RequestFinisher<DB, S>
where
    DB: sqlx::Database,
    S: TransactionalIdempotency<Connection = DB::Connection> + Send + Sync + 'static,
{
    fn opened(&self) -> bool {
        match self.slot.transaction.try_lock() {
            Ok(guard) => guard.is_some(),
            // Still held: it was opened.
            Err(_) => true,
        }
    }

    fn asked(&self) -> bool {
        self.slot.asked.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn commit(
        self: Box<Self>,
        mut claim: RunningClaim,
        outcome: Vec<u8>,
    ) -> BoxFuture<'static, Result<()>> {
        Box::pin(async move {
            let mut transaction = match self.take() {
                Ok(Some(transaction)) => transaction,
                Ok(None) => {
                    return claim
                        .complete_or(&outcome, |error| {
                            replay::encode_not_stored(&format!(
                                "the response could not be stored: {error}"
                            ))
                        })
                        .await;
                }
                Err(error) => {
                    claim.give_back().await;
                    return Err(error);
                }
            };
            let stored = claim
                .complete_in_transaction(&self.store, &mut transaction, &outcome)
                .await;
            let committed = match stored {
                Ok(()) => transaction
                    .commit()
                    .await
                    .map_err(|error| crate::sql::map_error(error, "cannot commit the request")),
                Err(error) => {
                    let _ = transaction.rollback().await;
                    Err(error)
                }
            };
            if committed.is_err() {
                claim.give_back().await;
            }
            committed
        })
    }

    fn rollback(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            if let Ok(Some(transaction)) = self.take() {
                let _ = transaction.rollback().await;
            }
        })
    }
}
