//! `turnstile bench outbox`: the outbox on PostgreSQL relayed to NATS JetStream or to
//! RabbitMQ, or (`--raw`) the bare relay as the floor: `DELETE … WHERE id IN (SELECT …
//! ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED) RETURNING`, the 100 published at once
//! (NATS with `Nats-Msg-Id`; RabbitMQ persistent, on one confirming channel), acks
//! awaited, commit — no per-key order, no backoff, no parking.
//!
//! Phases, one JSON line each: `enqueue` (WRITERS tasks, one message per transaction),
//! then `relay` (from a full outbox to empty). Environment: `MESSAGES` (20000), `KEYS`
//! (64), `WRITERS` (8).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use tokio::time::Instant;
use turnstile::outbox::nats::JetStreamPublisher;
use turnstile::outbox::postgres::PostgresOutbox;
use turnstile::outbox::relay::{Relay, RelayOptions};
use turnstile::outbox::{Message, OutboxStore};
use turnstile::{Error, ErrorKind};

use crate::exit_code_for;

/// Options of `turnstile bench outbox`.
#[derive(Args, Debug)]
pub(crate) struct OutboxBenchArgs {
    /// PostgreSQL URL of the outbox.
    #[arg(long, value_name = "URL")]
    store: String,
    /// `nats://…` (a stream `BENCH` on `bench.>` is created) or `amqp://…` (a durable
    /// queue `turnstile-bench`, bound to the topic exchange `turnstile` for `bench.#`,
    /// is created empty).
    #[arg(long, value_name = "URL")]
    broker: String,
    /// Run the bare relay instead of the library: the floor to compare with.
    #[arg(long)]
    raw: bool,
}

fn env_number(name: &str, default: usize) -> Result<usize, Error> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(text) => text
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidOptions,
                    format!("{name}={text:?} must be a positive whole number"),
                )
            }),
    }
}

fn store_error(error: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Store, format!("the benchmark failed: {error}"))
}

pub(crate) async fn run(args: OutboxBenchArgs) -> ExitCode {
    match run_inner(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("turnstile: {error}");
            ExitCode::from(exit_code_for(&error))
        }
    }
}

async fn run_inner(args: OutboxBenchArgs) -> Result<(), Error> {
    let messages = env_number("MESSAGES", 20_000)?;
    let keys = env_number("KEYS", 64)?;
    let writers = env_number("WRITERS", 8)?;
    let broker = Broker::prepare(&args.broker).await?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(u32::try_from(writers + 2).unwrap_or(10))
        .connect(&args.store)
        .await
        .map_err(store_error)?;
    let peer = if args.raw { "raw" } else { "turnstile" };
    let payload = vec![b'x'; 200];
    if args.raw {
        sqlx::raw_sql(
            "DROP TABLE IF EXISTS bench_raw_outbox;
             CREATE TABLE bench_raw_outbox (id BIGSERIAL PRIMARY KEY, key TEXT NOT NULL,
                 msg_id TEXT NOT NULL, payload BYTEA NOT NULL, created_at TIMESTAMPTZ NOT NULL DEFAULT now())",
        )
        .execute(&pool)
        .await
        .map_err(store_error)?;
    }
    let outbox = PostgresOutbox::connect(&args.store).await?;
    // Enqueue: `writers` tasks, a transaction per message.
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for writer in 0..writers {
        let (pool, outbox, payload) = (pool.clone(), outbox.clone(), payload.clone());
        let raw = args.raw;
        tasks.spawn(async move {
            let mut n = writer;
            while n < messages {
                let key = format!("key-{}", n % keys);
                let message = Message::new("bench.event", key.as_str(), payload.clone())?;
                let mut transaction = pool.begin().await.map_err(store_error)?;
                if raw {
                    sqlx::query(
                        "INSERT INTO bench_raw_outbox (key, msg_id, payload) VALUES ($1, $2, $3)",
                    )
                    .bind(&key)
                    .bind(message.id())
                    .bind(message.payload())
                    .execute(&mut *transaction)
                    .await
                    .map_err(store_error)?;
                    transaction.commit().await.map_err(store_error)?;
                } else {
                    outbox.enqueue(&mut transaction, &message).await?;
                    outbox.commit(transaction).await?;
                }
                n += writers;
            }
            Ok::<_, Error>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.map_err(store_error)??;
    }
    let took = started.elapsed();
    println!(
        "{}",
        serde_json::json!({"peer": peer, "phase": "enqueue", "messages": messages, "writers": writers,
            "messages_per_s": (messages as f64 / took.as_secs_f64()).round()})
    );
    // Relay: from full to empty.
    let started = Instant::now();
    if args.raw {
        raw_relay(&pool, &broker).await?;
    } else {
        let relay = Relay::from_arcs(Arc::new(outbox.clone()), broker.publisher())
            .with_options(RelayOptions::new().max_keys(u32::try_from(keys).unwrap_or(64)));
        loop {
            let round = relay.run_once().await?;
            if round.keys == 0 && outbox.status(0).await?.pending == 0 {
                break;
            }
        }
    }
    let took = started.elapsed();
    let in_stream = broker.messages().await?;
    println!(
        "{}",
        serde_json::json!({"peer": peer, "phase": "relay", "messages": messages, "keys": keys,
            "messages_per_s": (messages as f64 / took.as_secs_f64()).round(),
            "in_stream": in_stream, "all_there": in_stream == messages as u64})
    );
    Ok(())
}

/// The broker the relay publishes to, made empty for the run.
enum Broker {
    Nats(JetStreamPublisher),
    #[cfg(feature = "rabbitmq")]
    RabbitMq {
        publisher: Arc<turnstile::outbox::rabbitmq::RabbitMqPublisher>,
        channel: lapin::Channel,
        // Kept open for the channel.
        _connection: lapin::Connection,
    },
}

#[cfg(feature = "rabbitmq")]
const RABBITMQ_QUEUE: &str = "turnstile-bench";

impl Broker {
    async fn prepare(url: &str) -> Result<Broker, Error> {
        if url.starts_with("amqp://") {
            #[cfg(feature = "rabbitmq")]
            return Broker::prepare_rabbitmq(url).await;
            #[cfg(not(feature = "rabbitmq"))]
            return Err(Error::new(
                ErrorKind::Configuration,
                "this build has no RabbitMQ support (feature `rabbitmq`)",
            ));
        }
        let publisher = JetStreamPublisher::connect(url, Duration::from_secs(5)).await?;
        let jetstream = publisher.jetstream();
        let _ = jetstream.delete_stream("BENCH").await;
        jetstream
            .create_stream(async_nats::jetstream::stream::Config {
                name: "BENCH".to_owned(),
                subjects: vec!["bench.>".to_owned()],
                duplicate_window: Duration::from_secs(600),
                ..Default::default()
            })
            .await
            .map_err(store_error)?;
        Ok(Broker::Nats(publisher))
    }

    #[cfg(feature = "rabbitmq")]
    async fn prepare_rabbitmq(url: &str) -> Result<Broker, Error> {
        use lapin::options::QueueDeleteOptions;
        use lapin::options::{ConfirmSelectOptions, QueueBindOptions, QueueDeclareOptions};
        use lapin::types::FieldTable;
        // Declares the exchange `turnstile`.
        let publisher =
            turnstile::outbox::rabbitmq::RabbitMqPublisher::connect(url, "turnstile").await?;
        let connection = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
            .await
            .map_err(store_error)?;
        let channel = connection.create_channel().await.map_err(store_error)?;
        channel
            .queue_delete(RABBITMQ_QUEUE.into(), QueueDeleteOptions::default())
            .await
            .map_err(store_error)?;
        channel
            .queue_declare(
                RABBITMQ_QUEUE.into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(store_error)?;
        channel
            .queue_bind(
                RABBITMQ_QUEUE.into(),
                "turnstile".into(),
                "bench.#".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(store_error)?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(store_error)?;
        Ok(Broker::RabbitMq {
            publisher: Arc::new(publisher),
            channel,
            _connection: connection,
        })
    }

    fn publisher(&self) -> Arc<dyn turnstile::outbox::relay::Publisher> {
        match self {
            Broker::Nats(publisher) => Arc::new(publisher.clone()),
            #[cfg(feature = "rabbitmq")]
            Broker::RabbitMq { publisher, .. } => publisher.clone(),
        }
    }

    /// How many messages the stream or queue holds.
    async fn messages(&self) -> Result<u64, Error> {
        match self {
            Broker::Nats(publisher) => {
                let mut stream = publisher
                    .jetstream()
                    .get_stream("BENCH")
                    .await
                    .map_err(store_error)?;
                Ok(stream.info().await.map_err(store_error)?.state.messages)
            }
            #[cfg(feature = "rabbitmq")]
            Broker::RabbitMq { channel, .. } => {
                let queue = channel
                    .queue_declare(
                        RABBITMQ_QUEUE.into(),
                        lapin::options::QueueDeclareOptions {
                            passive: true,
                            ..Default::default()
                        },
                        lapin::types::FieldTable::default(),
                    )
                    .await
                    .map_err(store_error)?;
                Ok(u64::from(queue.message_count()))
            }
        }
    }

    /// Publishes a batch at once and waits for every ack.
    async fn publish_all(&self, batch: Vec<(String, Vec<u8>)>) -> Result<(), Error> {
        match self {
            Broker::Nats(publisher) => {
                let jetstream = publisher.jetstream();
                let mut acks = Vec::with_capacity(batch.len());
                for (id, payload) in batch {
                    let mut headers = async_nats::HeaderMap::new();
                    headers.insert("Nats-Msg-Id", id.as_str());
                    acks.push(
                        jetstream
                            .publish_with_headers("bench.event", headers, payload.into())
                            .await
                            .map_err(store_error)?,
                    );
                }
                for ack in acks {
                    ack.await.map_err(store_error)?;
                }
            }
            #[cfg(feature = "rabbitmq")]
            Broker::RabbitMq { channel, .. } => {
                let mut confirms = Vec::with_capacity(batch.len());
                for (id, payload) in batch {
                    let properties = lapin::BasicProperties::default()
                        .with_message_id(id.as_str().into())
                        .with_delivery_mode(2);
                    confirms.push(
                        channel
                            .basic_publish(
                                "turnstile".into(),
                                "bench.event".into(),
                                lapin::options::BasicPublishOptions::default(),
                                &payload,
                                properties,
                            )
                            .await
                            .map_err(store_error)?,
                    );
                }
                for confirm in confirms {
                    if !confirm.await.map_err(store_error)?.is_ack() {
                        return Err(store_error("RabbitMQ refused a message"));
                    }
                }
            }
        }
        Ok(())
    }
}

/// The bare relay: batches of 100 in id order, published at once, committed after the
/// acks.
async fn raw_relay(pool: &sqlx::PgPool, broker: &Broker) -> Result<(), Error> {
    use sqlx::Row;
    loop {
        let mut transaction = pool.begin().await.map_err(store_error)?;
        let rows = sqlx::query(
            "DELETE FROM bench_raw_outbox WHERE id IN (
                SELECT id FROM bench_raw_outbox ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED)
             RETURNING msg_id, payload",
        )
        .fetch_all(&mut *transaction)
        .await
        .map_err(store_error)?;
        if rows.is_empty() {
            return Ok(());
        }
        let mut batch = Vec::with_capacity(rows.len());
        for row in rows {
            let id: String = row.try_get("msg_id").map_err(store_error)?;
            let payload: Vec<u8> = row.try_get("payload").map_err(store_error)?;
            batch.push((id, payload));
        }
        broker.publish_all(batch).await?;
        transaction.commit().await.map_err(store_error)?;
    }
}
