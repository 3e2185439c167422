//! The inbox: the consumer side of the idempotency engine. A message delivered again
//! (brokers deliver at least once) is recognised by `(consumer, message id)` and
//! skipped; the record is written in the handler's own transaction, so "recorded but
//! not handled" and "handled but not recorded" cannot happen.
//!
//! It is the same table, retention and sweeper as the HTTP and `run_once` records: the
//! consumer's name is the scope, the message id the key.
//!
//! ```
//! # #[cfg(feature = "sqlite")]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> turnstile::Result<()> {
//! use turnstile::idempotency::inbox::{Delivery, Inbox};
//! use turnstile::idempotency::sqlite::SqliteIdempotencyStore;
//!
//! # let dir = tempfile::tempdir().unwrap();
//! let store = SqliteIdempotencyStore::open(dir.path().join("app.db")).await?;
//! let inbox = Inbox::new(store.clone(), "billing")?;
//! for delivery in ["order-42", "order-42"] {
//!     let mut transaction = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
//!     let handled = inbox
//!         .process(&mut transaction, delivery, async |_connection| {
//!             // ... the handler's writes, on `_connection` ...
//!             Ok::<_, turnstile::Error>(())
//!         })
//!         .await?;
//!     transaction.commit().await.unwrap();
//!     println!("{delivery}: {}", if handled.is_duplicate() { "skipped" } else { "handled" });
//! }
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "sqlite"))]
//! # fn main() {}
//! ```

use super::{
    ClaimAnswer, CursorStep, Fingerprint, Finish, IdempotencyKey, IdempotencyOptions, Scope,
    TransactionalIdempotency, fenced, in_progress, telemetry,
};
use crate::error::{Error, ErrorKind, Result};

/// What [`Inbox::process`] did with a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Delivery<T> {
    /// First delivery: the handler ran, with this result.
    Processed(T),
    /// Seen before by this consumer: the handler did not run.
    Duplicate,
    /// ([`Inbox::process_in_order`]) An earlier message of its key has not been handled
    /// yet: the handler did not run. Roll back and let the broker deliver it again
    /// later: return [`Error::out_of_order`] from the consumer's handler, which sends
    /// the message back without counting the delivery toward `max_deliveries` (any
    /// other error counts, and dead-letters a message that only waited for its turn).
    Early {
        /// The sequence number its key waits for.
        expected: u64,
    },
}

impl<T> Delivery<T> {
    /// Whether the message had been processed before.
    pub fn is_duplicate(&self) -> bool {
        matches!(self, Delivery::Duplicate)
    }
}

/// One consumer's inbox over a transactional idempotency store.
#[derive(Debug, Clone)]
pub struct Inbox<S> {
    store: S,
    consumer: Scope,
    options: IdempotencyOptions,
    start_at_first_seen: bool,
}

impl<S: TransactionalIdempotency> Inbox<S> {
    /// The inbox of `consumer` (1 to 255 bytes, no control characters). Records are kept
    /// 7 days by default: longer than any broker redelivers.
    pub fn new(store: S, consumer: &str) -> Result<Self> {
        Ok(Inbox {
            store,
            consumer: Scope::new(consumer)?,
            options: IdempotencyOptions::new()
                .retention(std::time::Duration::from_secs(7 * 24 * 3600)),
            start_at_first_seen: false,
        })
    }

    /// For [`process_in_order`](Self::process_in_order): a key this consumer has never
    /// seen starts at the first message that arrives, not at 1. For a consumer that
    /// joins a stream whose early messages were trimmed away (or that starts from the
    /// current position on purpose): without it every such key waits forever for a
    /// message 1 that will never come ([`Delivery::Early`]).
    pub fn start_at_first_seen(mut self, on: bool) -> Self {
        self.start_at_first_seen = on;
        self
    }

    /// The same inbox with other options (the retention is what matters here: keep
    /// records longer than the broker may redeliver).
    pub fn with_options(mut self, options: IdempotencyOptions) -> Result<Self> {
        options.validate()?;
        self.options = options;
        Ok(self)
    }

    /// Like [`process`](Self::process), and in order per key: `seq` must be the next
    /// number of `key`'s sequence (Turnstile's outbox numbers each key's messages 1, 2,
    /// 3…, in the `Turnstile-Seq` / `turnstile-seq` header and in
    /// [`Incoming::seq`](crate::outbox::Incoming::seq)). A message whose predecessor has
    /// not been handled is [`Delivery::Early`]: nothing runs, and the caller has the
    /// broker deliver it again later. A key this consumer has never seen starts at 1
    /// (or, with [`start_at_first_seen`](Self::start_at_first_seen), at the first
    /// message that arrives).
    ///
    /// Pass [`Incoming::cursor_key`](crate::outbox::Incoming::cursor_key) as `key` and
    /// [`Incoming::inbox_id`](crate::outbox::Incoming::inbox_id) as `message_id`: both
    /// carry the producing outbox's identity, so two outboxes using the same keys keep
    /// two cursors. A number the cursor has passed is a duplicate only if its id was
    /// recorded: a message never seen with such a number (from a producer whose
    /// numbering went back after its database was restored from a backup, or one a
    /// competing consumer got ahead of) is handled instead of being acknowledged and
    /// dropped, out of order. The cursor only moves forward, so such a message never
    /// leaves the key's later messages waiting for good.
    pub async fn process_in_order<T, E, F>(
        &self,
        connection: &mut S::Connection,
        message_id: &str,
        key: &str,
        seq: u64,
        handle: F,
    ) -> std::result::Result<Delivery<T>, E>
    where
        E: From<Error>,
        F: AsyncFnOnce(&mut S::Connection) -> std::result::Result<T, E>,
    {
        let start = self.cursor_start(seq);
        match self
            .store
            .advance_cursor(connection, &self.consumer, key, seq, start)
            .await?
        {
            CursorStep::Next => self.process(connection, message_id, handle).await,
            CursorStep::Seen => {
                let delivery = self.process(connection, message_id, handle).await?;
                // The cursor stays where it is: it only moves forward. Moving it back to
                // this number would leave every later message of the key `Early` once
                // it had been passed (a message handled out of turn by a competing
                // consumer, a first delivery that failed under `start_at_first_seen`).
                if !delivery.is_duplicate() {
                    tracing::warn!(
                        consumer = %self.consumer, key, seq, message_id,
                        "a message new to this consumer comes with a number its key has passed \
                         (a competing consumer got ahead, or the producer's numbering went back \
                         after a restore): handled out of order; the key's cursor stays"
                    );
                }
                Ok(delivery)
            }
            CursorStep::Early { expected } => {
                tracing::debug!(consumer = %self.consumer, key, seq, expected, "message ahead of its key's order; left for later");
                Ok(Delivery::Early { expected })
            }
        }
    }

    /// Where the cursor of a key never seen starts, when message `seq` comes first.
    fn cursor_start(&self, seq: u64) -> u64 {
        if self.start_at_first_seen {
            seq.saturating_sub(1)
        } else {
            0
        }
    }

    /// Moves `key`'s cursor past message `seq`, its next expected number, without
    /// handling it, so that the key's later messages go on: for a message that was
    /// dead-lettered (a consumer's handler kept failing on it) and that the operator
    /// decides to drop rather than replay. In the caller's transaction: commit it.
    /// Returns `false` if the cursor had passed `seq` already (nothing changes). A
    /// message its key does not wait for yet (a number past the next) is refused
    /// ([`ErrorKind::InvalidOptions`]): skipping it would skip the ones before it too.
    ///
    /// A copy of the skipped message replayed later is handled, out of order, as any
    /// message whose number the cursor has passed but whose id is new.
    pub async fn skip(&self, connection: &mut S::Connection, key: &str, seq: u64) -> Result<bool> {
        let start = self.cursor_start(seq);
        match self
            .store
            .advance_cursor(connection, &self.consumer, key, seq, start)
            .await?
        {
            CursorStep::Next => {
                metrics::counter!("turnstile_inbox_skipped_total").increment(1);
                tracing::warn!(consumer = %self.consumer, key, seq, "message skipped by the inbox: the key goes on with the next one");
                Ok(true)
            }
            CursorStep::Seen => Ok(false),
            CursorStep::Early { expected } => Err(Error::new(
                ErrorKind::InvalidOptions,
                format!(
                    "key {key:?} of consumer {} waits for message {expected}, not {seq}: skip \
                     {expected} first",
                    self.consumer
                ),
            )),
        }
    }

    /// Runs `handle` for `message_id` unless this consumer processed it before, inside
    /// the transaction on `connection`. Commit after `Ok` (a duplicate included), roll
    /// back after `Err` (the message is then not recorded, and its redelivery runs
    /// again).
    ///
    /// Errors: [`ErrorKind::InvalidName`] for a message id that is not 1 to 255 visible
    /// ASCII characters; [`ErrorKind::InProgress`] if the id is claimed in lease mode by
    /// a worker at work now.
    pub async fn process<T, E, F>(
        &self,
        connection: &mut S::Connection,
        message_id: &str,
        handle: F,
    ) -> std::result::Result<Delivery<T>, E>
    where
        E: From<Error>,
        F: AsyncFnOnce(&mut S::Connection) -> std::result::Result<T, E>,
    {
        let key = IdempotencyKey::new(message_id).map_err(|error| {
            E::from(
                Error::new(
                    ErrorKind::InvalidName,
                    format!("message id {message_id:?} cannot be recorded in the inbox"),
                )
                .with_source(error),
            )
        })?;
        let fingerprint = Fingerprint::of(&[b"inbox", message_id.as_bytes()]);
        let scope = &self.consumer;
        let token = match self
            .store
            .claim_in_transaction(connection, scope, &key, &fingerprint, &self.options)
            .await?
        {
            ClaimAnswer::Started { token } => token,
            ClaimAnswer::Replay { .. } | ClaimAnswer::Mismatch => {
                telemetry::replayed(scope, &key, std::time::Duration::ZERO);
                return Ok(Delivery::Duplicate);
            }
            ClaimAnswer::InProgress { lease_left } => {
                return Err(E::from(in_progress(scope, &key, lease_left)));
            }
        };
        let value = handle(connection).await?;
        match self
            .store
            .complete_in_transaction(connection, scope, &key, token, b"null", &self.options)
            .await?
        {
            Finish::Done => {
                telemetry::completed(scope, &key, std::time::Duration::ZERO);
                Ok(Delivery::Processed(value))
            }
            Finish::Fenced => Err(E::from(fenced(scope, &key))),
        }
    }
}
