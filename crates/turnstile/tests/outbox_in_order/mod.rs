//! The in-order scenario the broker tests share: a consumer that handles each key's
//! messages in order through an inbox in a SQLite file, with one message its handler
//! always fails. Once that message is dead-lettered, the key's later messages wait for
//! this consumer (they come back as out of order, never counted as failures, never
//! dead-lettered) until the inbox skips the dead one; then they are handled, in order,
//! and a failure of one of them is its first, however often it waited.

use std::time::Duration;

use turnstile::idempotency::inbox::{Delivery, Inbox};
use turnstile::idempotency::sqlite::SqliteIdempotencyStore;
use turnstile::outbox::relay::Publisher;
use turnstile::outbox::{Incoming, Message, Processed};

/// A broker's consumer, as the scenario drives it.
pub(crate) trait Consumer {
    /// One `process` call: a batch of up to 20, waiting up to 100 ms, with `retry_after`.
    async fn process_batch<F>(
        &self,
        retry_after: Duration,
        handle: F,
    ) -> turnstile::Result<Processed>
    where
        F: AsyncFnMut(&Incoming) -> turnstile::Result<()>;
}

struct Context {
    keys: SqliteIdempotencyStore,
    inbox: Inbox<SqliteIdempotencyStore>,
    /// The messages handled, by number.
    handled: Vec<u64>,
    /// How often each of messages 1, 2, 3 came before its turn.
    early: [u64; 4],
    /// The key's cursor, once a message came.
    cursor: Option<String>,
    /// Whether message 2 has failed yet on its turn: it fails once.
    flaked: bool,
}

impl Context {
    /// The consumer's handler: message 1 always fails.
    async fn handle(&mut self, incoming: &Incoming) -> turnstile::Result<()> {
        let seq = incoming.seq.unwrap();
        let cursor = incoming.cursor_key().unwrap();
        self.cursor = Some(cursor.clone());
        let mut transaction = self
            .keys
            .pool()
            .begin_with("BEGIN IMMEDIATE")
            .await
            .unwrap();
        let delivery = self
            .inbox
            .process_in_order(
                &mut transaction,
                &incoming.inbox_id()?,
                &cursor,
                seq,
                async |_connection| {
                    if seq == 1 {
                        return Err(turnstile::Error::new(turnstile::ErrorKind::Store, "poison"));
                    }
                    if seq == 2 && !self.flaked {
                        self.flaked = true;
                        return Err(turnstile::Error::new(turnstile::ErrorKind::Store, "a blip"));
                    }
                    Ok(seq)
                },
            )
            .await?;
        transaction.commit().await.unwrap();
        match delivery {
            Delivery::Processed(seq) => self.handled.push(seq),
            Delivery::Early { expected } => {
                self.early[usize::try_from(seq).unwrap()] += 1;
                return Err(turnstile::Error::out_of_order(&cursor, seq, expected));
            }
            _ => {}
        }
        Ok(())
    }
}

/// Publishes messages 1, 2, 3 of one key to `topic`; message 1's handler always fails.
/// `consumer` must dead-letter on its `max_deliveries`-th failure.
pub(crate) async fn a_dead_lettered_message_parks_its_key_until_skipped(
    publisher: &impl Publisher,
    topic: &str,
    consumer: &impl Consumer,
    max_deliveries: u32,
) {
    let dir = tempfile::tempdir().unwrap();
    let keys = SqliteIdempotencyStore::open(dir.path().join("in-order.db"))
        .await
        .unwrap();
    let mut context = Context {
        inbox: Inbox::new(keys.clone(), "in-order").unwrap(),
        keys,
        handled: Vec::new(),
        early: [0; 4],
        cursor: None,
        flaked: false,
    };
    let key = turnstile_test_support::unique_name("account");
    for seq in 1..=3_u64 {
        let message = Message::new(topic, key.as_str(), format!("m{seq}").into_bytes()).unwrap();
        publisher.publish(&message, seq).await.unwrap();
    }
    let delay = Duration::from_millis(100);
    let mut total = Processed::default();
    // Until message 1 is dead-lettered and each later message has waited more often
    // than max_deliveries.
    let waited = |early: &[u64; 4]| early[2] > u64::from(max_deliveries) + 2 && early[3] > 0;
    for _ in 0..200 {
        let done = consumer
            .process_batch(delay, async |incoming| context.handle(incoming).await)
            .await
            .unwrap();
        total.dead_lettered += done.dead_lettered;
        total.early += done.early;
        if total.dead_lettered > 0 && waited(&context.early) {
            break;
        }
    }
    assert_eq!(
        total.dead_lettered, 1,
        "only the failing message is dead-lettered, not the ones that waited for it \
         (early deliveries {:?})",
        context.early
    );
    assert!(
        waited(&context.early),
        "the later messages kept coming back: {:?}",
        context.early
    );
    assert!(
        u64::try_from(total.early).unwrap() >= context.early[2] + context.early[3],
        "the consumer counts what waited"
    );
    assert!(
        context.handled.is_empty(),
        "nothing handled out of order: {:?}",
        context.handled
    );
    // The operator drops message 1: the key goes on. Message 2 fails once on its turn:
    // its first failure, however often it waited, so it is retried, not dead-lettered.
    let cursor = context.cursor.clone().unwrap();
    let mut transaction = context
        .keys
        .pool()
        .begin_with("BEGIN IMMEDIATE")
        .await
        .unwrap();
    let refused = context
        .inbox
        .skip(&mut transaction, &cursor, 2)
        .await
        .unwrap_err();
    assert_eq!(refused.kind(), turnstile::ErrorKind::InvalidOptions);
    assert!(
        context
            .inbox
            .skip(&mut transaction, &cursor, 1)
            .await
            .unwrap()
    );
    assert!(
        !context
            .inbox
            .skip(&mut transaction, &cursor, 1)
            .await
            .unwrap()
    );
    transaction.commit().await.unwrap();
    for _ in 0..300 {
        let done = consumer
            .process_batch(delay, async |incoming| context.handle(incoming).await)
            .await
            .unwrap();
        total.dead_lettered += done.dead_lettered;
        if context.handled.len() == 2 {
            break;
        }
    }
    assert_eq!(
        context.handled,
        [2, 3],
        "the key's later messages, in order"
    );
    assert!(context.flaked);
    assert_eq!(
        total.dead_lettered, 1,
        "a message that waited is not dead-lettered on its first failure"
    );
}
