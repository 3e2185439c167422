//! Keeps per-account totals of the payments service's `payments.created` events, through
//! an inbox: each event counts once, however often the broker delivers it.
//!
//! ```text
//! cargo run --release -p payments --bin payments-projection -- \
//!     --broker nats://127.0.0.1:4222 [--store sqlite://projection.sqlite3]
//! ```
//!
//! On NATS it reads the `PAYMENTS` stream with the durable consumer `projection`; on
//! Redis (`--broker redis://…`) the stream `payments.created` with the consumer group
//! `projection`. Totals live in the table `totals (account, cents, payments)` of the
//! store, next to the inbox's records, and are committed together with them.

use std::time::Duration;

use clap::Parser;
use serde::Deserialize;
use turnstile::idempotency::inbox::Inbox;
use turnstile::idempotency::sqlite::SqliteIdempotencyStore;
use turnstile::outbox::Incoming;

/// The projection consumer.
#[derive(Parser, Debug)]
#[command(name = "payments-projection", about)]
struct Args {
    /// Where the events come from: nats://HOST:PORT or redis://HOST:PORT.
    #[arg(long, value_name = "URL")]
    broker: String,
    /// Where the totals and the inbox live.
    #[arg(long, default_value = "sqlite://projection.sqlite3")]
    store: String,
}

#[derive(Deserialize)]
struct Created {
    account: String,
    amount_cents: i64,
}

/// Applies one event in one transaction with its inbox record.
async fn apply(
    store: &SqliteIdempotencyStore,
    inbox: &Inbox<SqliteIdempotencyStore>,
    incoming: &Incoming,
) -> turnstile::Result<()> {
    let event: Created = serde_json::from_slice(&incoming.payload).map_err(|error| {
        turnstile::Error::new(
            turnstile::ErrorKind::InvalidOptions,
            format!("event {:?} is not a payment: {error}", incoming.id),
        )
    })?;
    let database = |error: sqlx::Error| {
        turnstile::Error::new(turnstile::ErrorKind::Store, "cannot write the projection")
            .with_source(error)
    };
    let mut transaction = store
        .pool()
        .begin_with("BEGIN IMMEDIATE")
        .await
        .map_err(database)?;
    inbox
        .process(
            &mut transaction,
            &incoming.inbox_id()?,
            async |connection| {
                sqlx::query(
                    "INSERT INTO totals (account, cents, payments) VALUES (?1, ?2, 1)
                 ON CONFLICT (account) DO UPDATE SET cents = cents + ?2, payments = payments + 1",
                )
                .bind(&event.account)
                .bind(event.amount_cents)
                .execute(&mut *connection)
                .await
                .map_err(database)?;
                Ok::<_, turnstile::Error>(())
            },
        )
        .await?;
    transaction.commit().await.map_err(database)
}

async fn run(args: Args) -> turnstile::Result<()> {
    let store = SqliteIdempotencyStore::open_url(&args.store).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS totals (account TEXT PRIMARY KEY, cents INTEGER NOT NULL,
             payments INTEGER NOT NULL)",
    )
    .execute(store.pool())
    .await
    .map_err(|error| {
        turnstile::Error::new(
            turnstile::ErrorKind::Store,
            "cannot create the totals table",
        )
        .with_source(error)
    })?;
    let inbox = Inbox::new(store.clone(), "projection")?;
    let (batch, wait, retry) = (100, Duration::from_secs(1), Duration::from_secs(1));
    if args.broker.starts_with("nats://") {
        let publisher = turnstile::outbox::nats::JetStreamPublisher::connect(
            &args.broker,
            Duration::from_secs(5),
        )
        .await?;
        let consumer = turnstile::outbox::nats::JetStreamConsumer::durable(
            publisher.jetstream(),
            "PAYMENTS",
            "projection",
            Duration::from_secs(30),
        )
        .await?;
        loop {
            consumer
                .process(batch, wait, retry, async |incoming| {
                    apply(&store, &inbox, incoming).await
                })
                .await?;
        }
    } else {
        let consumer = turnstile::outbox::redis_streams::RedisStreamsConsumer::connect(
            &args.broker,
            "payments.created",
            "projection",
            "projection-1",
        )
        .await?;
        loop {
            consumer
                .process(batch, wait, retry, async |incoming| {
                    apply(&store, &inbox, incoming).await
                })
                .await?;
        }
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match run(Args::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("payments-projection: {error}");
            std::process::ExitCode::from(69)
        }
    }
}
