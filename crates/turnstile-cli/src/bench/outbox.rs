//! `turnstile bench outbox`: the outbox on PostgreSQL relayed to NATS JetStream or to
//! RabbitMQ, or (`--raw`) the bare relay as the floor: `DELETE … WHERE id IN (SELECT …
//! ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED) RETURNING`, the 100 published at once
//! (NATS with `Nats-Msg-Id`; RabbitMQ persistent, on one confirming channel), acks
//! awaited, commit — no per-key order, no backoff, no parking.
//!
//! One JSON line per phase (the keys are read by tools; keep them):
//! - `{"peer", "phase": "drain-1" | "drain-4", "messages", "rows_per_s", "lost",
//!   "order_ok"}`: a full outbox (`MESSAGES`, over `KEYS` keys, each key written by one
//!   of `WRITERS` writers in order) drained by one relay, then by four at once (each
//!   with its own store connection and relay id, as four processes); `lost`
//!   counts committed messages the broker does not hold, `order_ok` says whether every
//!   key's messages are in the broker in commit order.
//! - `{"peer", "phase": "live", "producer_tps", "publish_p50_ms", "publish_p99_ms",
//!   "lag_end", "lost", "order_ok"}`: writers commit at `LIVE_TPS` in all for
//!   `LIVE_SECS` while one relay runs; the latency is per message, from its commit to
//!   its arrival at a consumer of the stream or queue (after the broker's ack, so an
//!   upper bound of commit-to-ack); `lag_end` is what the outbox still held when the
//!   writers stopped.
//! - `{"peer", "phase": "enqueue-cost", "tps_with", "tps_without"}`: a business
//!   transaction (an insert and an update of a row, fsync as the server has it) by
//!   `WRITERS` writers for `COST_SECS`, with and without the outbox write.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
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
    if keys % writers != 0 {
        return Err(Error::new(
            ErrorKind::InvalidOptions,
            format!(
                "KEYS ({keys}) must be a multiple of WRITERS ({writers}): each key is written by one writer, so its commit order is known"
            ),
        ));
    }
    let live_tps = env_number("LIVE_TPS", 1_000)?;
    let live_secs = env_number("LIVE_SECS", 10)?;
    let cost_secs = env_number("COST_SECS", 5)?;
    let per_key = env_number("PER_KEY", 128)?;
    let broker = Arc::new(Broker::prepare(&args.broker).await?);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(u32::try_from(writers + 6).unwrap_or(14))
        .connect(&args.store)
        .await
        .map_err(store_error)?;
    let peer = if args.raw { "raw" } else { "turnstile" };
    sqlx::raw_sql(
        "DROP TABLE IF EXISTS bench_raw_outbox, bench_accounts, bench_events;
         CREATE TABLE bench_raw_outbox (id BIGSERIAL PRIMARY KEY, key TEXT NOT NULL,
             msg_id TEXT NOT NULL, payload BYTEA NOT NULL, created_at TIMESTAMPTZ NOT NULL DEFAULT now());
         CREATE TABLE bench_accounts (id INT PRIMARY KEY, balance BIGINT NOT NULL);
         INSERT INTO bench_accounts SELECT n, 0 FROM generate_series(0, 999) AS n;
         CREATE TABLE bench_events (id BIGSERIAL PRIMARY KEY, account INT NOT NULL, amount BIGINT NOT NULL)",
    )
    .execute(&pool)
    .await
    .map_err(store_error)?;
    let bench = Bench {
        pool,
        outbox: PostgresOutbox::connect(&args.store).await?,
        broker,
        raw: args.raw,
        keys,
        writers,
        per_key,
    };

    for (phase, relays) in [("drain-1", 1), ("drain-4", 4)] {
        bench.broker.reset().await?;
        let commits = Arc::new(std::sync::Mutex::new(Vec::new()));
        bench.write(0, messages, None, &commits).await?;
        // Each of the library's relays its own store (pool, relay id, wake-ups), as
        // relays in separate processes have; connected before the clock starts.
        let mut outboxes = Vec::new();
        while !bench.raw && outboxes.len() < relays {
            outboxes.push(PostgresOutbox::connect(&args.store).await?);
        }
        let started = Instant::now();
        bench.drain(relays, outboxes).await?;
        let took = started.elapsed();
        let done = CancellationToken::new();
        done.cancel();
        let arrived = bench.broker.collect(done).await?;
        let (lost, order_ok) = lost_and_order(messages, keys, &arrived);
        println!(
            "{}",
            serde_json::json!({"peer": peer, "phase": phase, "messages": messages,
                "rows_per_s": (messages as f64 / took.as_secs_f64()).round(),
                "lost": lost, "order_ok": order_ok})
        );
    }

    // Live: writers at a steady rate while one relay runs and a consumer reads.
    bench.broker.reset().await?;
    let stop_consumer = CancellationToken::new();
    let consumer = {
        let (broker, stop) = (Arc::clone(&bench.broker), stop_consumer.clone());
        tokio::spawn(async move { broker.collect(stop).await })
    };
    let stop_relay = CancellationToken::new();
    let relay = bench.spawn_relay(bench.outbox.clone(), stop_relay.clone());
    let live_messages = live_tps * live_secs;
    let commits = Arc::new(std::sync::Mutex::new(Vec::new()));
    let started = Instant::now();
    bench
        .write(
            0,
            live_messages,
            Some(Duration::from_secs_f64(writers as f64 / live_tps as f64)),
            &commits,
        )
        .await?;
    let produced_in = started.elapsed();
    let lag_end = bench.pending().await?;
    // Drained (or given up after a minute), then the consumer reads what is left.
    let drained_by = Instant::now() + Duration::from_secs(60);
    while bench.pending().await? > 0 && Instant::now() < drained_by {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop_relay.cancel();
    relay.await.map_err(store_error)??;
    stop_consumer.cancel();
    let arrived = consumer.await.map_err(store_error)??;
    let (lost, order_ok) = lost_and_order(live_messages, keys, &arrived);
    let committed_at: std::collections::HashMap<u64, Instant> = commits
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .iter()
        .copied()
        .collect();
    let mut seen = std::collections::HashSet::new();
    let mut latencies: Vec<f64> = arrived
        .iter()
        .filter(|(_, n, _)| seen.insert(*n))
        .filter_map(|(_, n, at)| {
            committed_at
                .get(n)
                .map(|committed| at.saturating_duration_since(*committed).as_secs_f64() * 1e3)
        })
        .collect();
    latencies.sort_by(f64::total_cmp);
    let percentile = |p: f64| {
        if latencies.is_empty() {
            return 0.0;
        }
        let rank = ((p / 100.0) * latencies.len() as f64).ceil().max(1.0) as usize;
        (latencies[rank.min(latencies.len()) - 1] * 1000.0).round() / 1000.0
    };
    println!(
        "{}",
        serde_json::json!({"peer": peer, "phase": "live",
            "producer_tps": (live_messages as f64 / produced_in.as_secs_f64()).round(),
            "publish_p50_ms": percentile(50.0), "publish_p99_ms": percentile(99.0),
            "lag_end": lag_end, "lost": lost, "order_ok": order_ok})
    );

    // What the outbox write adds to a business transaction: without, with, with,
    // without, so that a drift over the phase (a warming cache, a growing table)
    // weighs on both alike.
    let length = Duration::from_secs(cost_secs as u64);
    let (mut tps_without, mut tps_with) = (0.0, 0.0);
    for outbox in [false, true, true, false] {
        let tps = bench.business(outbox, length).await? / 2.0;
        if outbox {
            tps_with += tps;
        } else {
            tps_without += tps;
        }
    }
    println!(
        "{}",
        serde_json::json!({"peer": peer, "phase": "enqueue-cost",
            "tps_with": tps_with.round(), "tps_without": tps_without.round()})
    );
    Ok(())
}

/// A message's payload: its key and number, padded to 200 bytes.
fn payload(key: &str, n: u64) -> Vec<u8> {
    let mut text = format!("{key} {n} ");
    text.extend(std::iter::repeat_n(
        '.',
        200usize.saturating_sub(text.len()),
    ));
    text.into_bytes()
}

/// A payload's key and number.
fn parse_payload(payload: &[u8]) -> Option<(String, u64)> {
    let text = std::str::from_utf8(payload).ok()?;
    let mut parts = text.split_whitespace();
    let key = parts.next()?.to_owned();
    let n = parts.next()?.parse().ok()?;
    Some((key, n))
}

/// How many of messages `0..messages` did not arrive, and whether every key's first
/// arrivals are in the order its writer committed them (a later copy of a message is
/// not an order fault: the consumer's inbox removes it).
fn lost_and_order(
    messages: usize,
    keys: usize,
    arrived: &[(String, u64, Instant)],
) -> (usize, bool) {
    let mut seen = std::collections::HashSet::new();
    let mut last: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
    let mut order_ok = true;
    for (key, n, _) in arrived {
        if !seen.insert(*n) {
            continue;
        }
        if let Some(previous) = last.insert(key.as_str(), *n)
            && previous > *n
        {
            order_ok = false;
        }
    }
    let _ = keys;
    let lost = (0..messages as u64).filter(|n| !seen.contains(n)).count();
    (lost, order_ok)
}

/// What the phases share.
struct Bench {
    pool: sqlx::PgPool,
    outbox: PostgresOutbox,
    broker: Arc<Broker>,
    raw: bool,
    keys: usize,
    writers: usize,
    /// Messages of one key a relay round publishes (`RelayOptions::per_key`).
    per_key: usize,
}

impl Bench {
    /// Commits messages `first..first + count`, one per transaction, by `writers`
    /// writers; writer `w` writes the messages whose key is `w` modulo the writers, in
    /// order. With `pace`, each writer commits at most once per `pace`. Each commit's
    /// time goes into `commits`.
    async fn write(
        &self,
        first: usize,
        count: usize,
        pace: Option<Duration>,
        commits: &Arc<std::sync::Mutex<Vec<(u64, Instant)>>>,
    ) -> Result<(), Error> {
        let mut tasks = tokio::task::JoinSet::new();
        for writer in 0..self.writers {
            let (pool, outbox, commits) =
                (self.pool.clone(), self.outbox.clone(), Arc::clone(commits));
            let (raw, writers, keys) = (self.raw, self.writers, self.keys);
            tasks.spawn(async move {
                let mut next = Instant::now();
                let mut n = first + writer;
                while n < first + count {
                    if let Some(pace) = pace {
                        tokio::time::sleep_until(next).await;
                        next += pace;
                    }
                    let key = format!("key-{}", n % keys);
                    let number = n as u64;
                    let message = Message::new("bench.event", key.as_str(), payload(&key, number))?;
                    let mut transaction = pool.begin().await.map_err(store_error)?;
                    if raw {
                        insert_raw(&mut transaction, &key, &message).await?;
                        transaction.commit().await.map_err(store_error)?;
                    } else {
                        outbox.enqueue(&mut transaction, &message).await?;
                        outbox.commit(transaction).await?;
                    }
                    commits
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .push((number, Instant::now()));
                    n += writers;
                }
                Ok::<_, Error>(())
            });
        }
        while let Some(done) = tasks.join_next().await {
            done.map_err(store_error)??;
        }
        Ok(())
    }

    /// Drains the outbox with `relays` bare relays at once, or (the library) one relay
    /// per store in `outboxes`.
    async fn drain(&self, relays: usize, outboxes: Vec<PostgresOutbox>) -> Result<(), Error> {
        let mut tasks = tokio::task::JoinSet::new();
        let stop = CancellationToken::new();
        if self.raw {
            for _ in 0..relays {
                let (pool, broker) = (self.pool.clone(), Arc::clone(&self.broker));
                tasks.spawn(tokio::spawn(async move { raw_relay(&pool, &broker).await }));
            }
        }
        for outbox in outboxes {
            // `Relay::run`, as a deployment runs it: a relay that finds nothing waits
            // (for a commit or its idle poll) instead of claiming again at once, and
            // leases more keys while the last ones publish.
            tasks.spawn(self.spawn_relay(outbox, stop.clone()));
        }
        if !self.raw {
            // Drained when nothing is pending; the relays then finish what they have
            // in flight and stop. The check is one read of the key table's due index
            // (`status`, which also finds each key's oldest message, would take a
            // share of the server's core from the relays it times).
            while self.any_pending().await? {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            stop.cancel();
        }
        while let Some(done) = tasks.join_next().await {
            done.map_err(store_error)?.map_err(store_error)??;
        }
        Ok(())
    }

    fn relay(&self, outbox: PostgresOutbox) -> Relay {
        Relay::from_arcs(Arc::new(outbox), self.broker.publisher()).with_options(
            RelayOptions::new()
                .max_keys(u32::try_from(self.keys).unwrap_or(64))
                .per_key(u32::try_from(self.per_key).unwrap_or(128)),
        )
    }

    /// One relay (the bare one, or the library's over `outbox`) running until `stop`.
    fn spawn_relay(
        &self,
        outbox: PostgresOutbox,
        stop: CancellationToken,
    ) -> tokio::task::JoinHandle<Result<(), Error>> {
        if self.raw {
            let (pool, broker) = (self.pool.clone(), Arc::clone(&self.broker));
            tokio::spawn(async move {
                while !stop.is_cancelled() {
                    raw_relay(&pool, &broker).await?;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Ok(())
            })
        } else {
            let relay = self.relay(outbox);
            tokio::spawn(async move { relay.run(stop).await })
        }
    }

    /// Messages committed and not yet relayed.
    async fn pending(&self) -> Result<u64, Error> {
        if self.raw {
            let count: i64 = sqlx::query_scalar("SELECT count(*) FROM bench_raw_outbox")
                .fetch_one(&self.pool)
                .await
                .map_err(store_error)?;
            Ok(u64::try_from(count).unwrap_or(0))
        } else {
            Ok(self.outbox.status(0).await?.pending)
        }
    }

    /// Whether any key has messages not yet relayed (the library's outbox).
    async fn any_pending(&self) -> Result<bool, Error> {
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM turnstile_outbox_keys WHERE acked_seq < last_seq AND NOT parked)",
        )
        .fetch_one(&self.pool)
        .await
        .map_err(store_error)
    }

    /// Business transactions per second over `length`: an insert and an update, and
    /// with `outbox` the outbox write too.
    async fn business(&self, outbox: bool, length: Duration) -> Result<f64, Error> {
        let until = Instant::now() + length;
        let mut tasks = tokio::task::JoinSet::new();
        for writer in 0..self.writers {
            let (pool, store, raw) = (self.pool.clone(), self.outbox.clone(), self.raw);
            tasks.spawn(async move {
                let mut done = 0u64;
                while Instant::now() < until {
                    let account =
                        i32::try_from((done * 7 + writer as u64 * 131) % 1000).unwrap_or(0);
                    let mut transaction = pool.begin().await.map_err(store_error)?;
                    sqlx::query("INSERT INTO bench_events (account, amount) VALUES ($1, 1)")
                        .bind(account)
                        .execute(&mut *transaction)
                        .await
                        .map_err(store_error)?;
                    sqlx::query("UPDATE bench_accounts SET balance = balance + 1 WHERE id = $1")
                        .bind(account)
                        .execute(&mut *transaction)
                        .await
                        .map_err(store_error)?;
                    if outbox {
                        let key = format!("account-{account}");
                        let message =
                            Message::new("bench.cost", key.as_str(), payload(&key, done))?;
                        if raw {
                            insert_raw(&mut transaction, &key, &message).await?;
                        } else {
                            store.enqueue(&mut transaction, &message).await?;
                        }
                    }
                    if outbox && !raw {
                        store.commit(transaction).await?;
                    } else {
                        transaction.commit().await.map_err(store_error)?;
                    }
                    done += 1;
                }
                Ok::<_, Error>(done)
            });
        }
        let mut total = 0;
        while let Some(done) = tasks.join_next().await {
            total += done.map_err(store_error)??;
        }
        Ok(total as f64 / length.as_secs_f64())
    }
}

async fn insert_raw(
    transaction: &mut sqlx::PgTransaction<'_>,
    key: &str,
    message: &Message,
) -> Result<(), Error> {
    sqlx::query("INSERT INTO bench_raw_outbox (key, msg_id, payload) VALUES ($1, $2, $3)")
        .bind(key)
        .bind(message.id())
        .bind(message.payload())
        .execute(&mut **transaction)
        .await
        .map_err(store_error)?;
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
        let broker = Broker::Nats(publisher);
        broker.reset().await?;
        Ok(broker)
    }

    /// Empties the stream or queue.
    async fn reset(&self) -> Result<(), Error> {
        match self {
            Broker::Nats(publisher) => {
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
            }
            #[cfg(feature = "rabbitmq")]
            Broker::RabbitMq { channel, .. } => {
                channel
                    .queue_purge(
                        RABBITMQ_QUEUE.into(),
                        lapin::options::QueuePurgeOptions::default(),
                    )
                    .await
                    .map_err(store_error)?;
            }
        }
        Ok(())
    }

    /// Reads the stream (from its start) or the queue, with the time each message
    /// arrived, until `stop` is cancelled and nothing more comes for 200 ms.
    async fn collect(&self, stop: CancellationToken) -> Result<Vec<(String, u64, Instant)>, Error> {
        use futures_util::StreamExt;
        let mut arrived = Vec::new();
        let quiet = Duration::from_millis(200);
        match self {
            Broker::Nats(publisher) => {
                let stream = publisher
                    .jetstream()
                    .get_stream("BENCH")
                    .await
                    .map_err(store_error)?;
                let consumer = stream
                    .create_consumer(async_nats::jetstream::consumer::pull::Config {
                        deliver_policy: async_nats::jetstream::consumer::DeliverPolicy::All,
                        ack_policy: async_nats::jetstream::consumer::AckPolicy::None,
                        ..Default::default()
                    })
                    .await
                    .map_err(store_error)?;
                loop {
                    let mut batch = consumer
                        .fetch()
                        .max_messages(1000)
                        .expires(quiet)
                        .messages()
                        .await
                        .map_err(store_error)?;
                    let mut got = 0;
                    while let Some(message) = batch.next().await {
                        let message = message.map_err(store_error)?;
                        got += 1;
                        if let Some((key, n)) = parse_payload(&message.payload) {
                            arrived.push((key, n, Instant::now()));
                        }
                    }
                    if got == 0 && stop.is_cancelled() {
                        break;
                    }
                }
            }
            #[cfg(feature = "rabbitmq")]
            Broker::RabbitMq { channel, .. } => {
                let tag = format!("bench-{}", rand::random::<u32>());
                let mut consumer = channel
                    .basic_consume(
                        RABBITMQ_QUEUE.into(),
                        tag.as_str().into(),
                        lapin::options::BasicConsumeOptions {
                            no_ack: true,
                            ..Default::default()
                        },
                        lapin::types::FieldTable::default(),
                    )
                    .await
                    .map_err(store_error)?;
                loop {
                    match tokio::time::timeout(quiet, consumer.next()).await {
                        Ok(Some(delivery)) => {
                            let delivery = delivery.map_err(store_error)?;
                            if let Some((key, n)) = parse_payload(&delivery.data) {
                                arrived.push((key, n, Instant::now()));
                            }
                        }
                        Ok(None) => break,
                        Err(_) if stop.is_cancelled() => break,
                        Err(_) => {}
                    }
                }
                channel
                    .basic_cancel(
                        tag.as_str().into(),
                        lapin::options::BasicCancelOptions::default(),
                    )
                    .await
                    .map_err(store_error)?;
            }
        }
        Ok(arrived)
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
