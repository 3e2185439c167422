//! `turnstile outbox`: run a relay, show what is pending and parked, redrive a key, skip
//! a message the broker will never take.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Subcommand};
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;
use turnstile::outbox::relay::{Relay, RelayOptions};

use crate::{StoreArgs, fail, parse_ttl};

#[derive(Subcommand, Debug)]
pub(crate) enum OutboxCommand {
    /// Publish the outbox's messages to a broker until SIGTERM or SIGINT; the round in
    /// flight is finished and recorded before it exits, so nothing is left half-marked.
    ///
    /// Exit status: 0 after a signal; 78 if the relay's lease cannot hold the broker
    /// client's delivery timeout; 69 store or broker unreachable at start; 64 bad
    /// input. A topic the broker cannot serve as promised (no stream for a subject, a
    /// duplicate window shorter than the relay's redelivery window) parks only its
    /// keys, with the reason in `outbox status`.
    Relay(RelayArgs),
    /// Show how many messages are pending, the oldest one's age, the keys most behind,
    /// and parked keys.
    Status(StatusArgs),
    /// Put a parked key back in line: its head message is tried again. Exit status 1 if
    /// the key is not parked.
    Redrive(RedriveArgs),
    /// Move a parked key's head message aside (kept in the store's
    /// `…_outbox_skipped` table with the reason it was parked) so that the key goes on
    /// with the next one: for a message the broker will never take. SEQ must be the
    /// key's next undelivered number (`outbox status` shows the reason; a sequence
    /// gap names the missing number). Exit status 1 if the key is not parked or SEQ is
    /// not its head.
    Skip(SkipArgs),
}

#[derive(Args, Debug)]
pub(crate) struct RelayArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Broker URL: nats://HOST:PORT (JetStream), redis://HOST[:PORT] (Redis Streams),
    /// amqp://USER:PASSWORD@HOST:PORT/VHOST (RabbitMQ, exchange `turnstile`) or
    /// kafka://HOST:PORT[,HOST:PORT…].
    #[arg(long, value_name = "URL")]
    broker: String,
    /// How long a relay's lease on the keys of one round lasts.
    #[arg(long, default_value = "30s", value_parser = parse_ttl, value_name = "DURATION")]
    lease: Duration,
    /// Permanent failures of a key's head message before the key is parked.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    max_attempts: u32,
    /// Keys leased (and published at once) per round.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    keys: u32,
    /// The longest pause of a failing key (and of the whole relay while every publish
    /// fails); with the lease, it sets how long a broker must keep duplicates out.
    #[arg(long, default_value = "60s", value_parser = parse_ttl, value_name = "DURATION")]
    backoff_max: Duration,
}

#[derive(Args, Debug)]
pub(crate) struct StatusArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// At most this many parked keys.
    #[arg(long, default_value_t = 100)]
    limit: u32,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub(crate) struct RedriveArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// The parked ordering key.
    key: String,
}

#[derive(Args, Debug)]
pub(crate) struct SkipArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// The parked ordering key.
    key: String,
    /// The sequence number of its head message.
    seq: u64,
}

pub(crate) async fn run(command: OutboxCommand) -> ExitCode {
    match command {
        OutboxCommand::Relay(args) => relay(args).await,
        OutboxCommand::Status(args) => status(args).await,
        OutboxCommand::Redrive(args) => redrive(args).await,
        OutboxCommand::Skip(args) => skip(args).await,
    }
}

async fn relay(args: RelayArgs) -> ExitCode {
    let result = async {
        let store = turnstile::store::connect_outbox(&args.store.url()?).await?;
        let publisher = turnstile::store::connect_publisher(&args.broker).await?;
        eprintln!(
            "turnstile: relaying the outbox at {} to {}",
            store.describe(),
            publisher.describe()
        );
        let relay = Relay::from_arcs(store, publisher).with_options(
            RelayOptions::new()
                .lease(args.lease)
                .max_attempts(args.max_attempts)
                .max_keys(args.keys)
                .backoff(turnstile::outbox::Backoff {
                    base: Duration::from_millis(100).min(args.backoff_max),
                    max: args.backoff_max,
                }),
        );
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone();
        let mut terminate = signal(SignalKind::terminate()).map_err(|error| {
            turnstile::Error::new(
                turnstile::ErrorKind::InvalidOptions,
                format!("cannot watch for SIGTERM: {error}"),
            )
        })?;
        tokio::spawn(async move {
            tokio::select! {
                _ = terminate.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            stop.cancel();
        });
        relay.run(shutdown).await
    }
    .await;
    match result {
        Ok(()) => {
            eprintln!("turnstile: relay stopped");
            ExitCode::SUCCESS
        }
        Err(error) => fail(&error),
    }
}

async fn status(args: StatusArgs) -> ExitCode {
    let result = async {
        let store = turnstile::store::connect_outbox(&args.store.url()?).await?;
        let status = store.status(args.limit).await?;
        Ok::<_, turnstile::Error>((store.describe(), status))
    }
    .await;
    let (store, status) = match result {
        Ok(found) => found,
        Err(error) => return fail(&error),
    };
    if args.json {
        let parked: Vec<serde_json::Value> = status
            .parked
            .iter()
            .map(|key| {
                serde_json::json!({
                    "key": key.key, "attempts": key.attempts, "reason": key.reason,
                    "pending": key.pending,
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "store": store,
                "pending": status.pending,
                "pending_keys": status.pending_keys,
                "oldest_pending_s": status.oldest_pending.map(|age| age.as_secs_f64()),
                "kept": status.kept,
                "parked": parked,
                "lagging": status.lagging.iter().map(|key| serde_json::json!({
                    "key": key.key, "pending": key.pending,
                    "oldest_pending_s": key.oldest.as_secs_f64(),
                })).collect::<Vec<_>>(),
            })
        );
        return ExitCode::SUCCESS;
    }
    let oldest = status.oldest_pending.map_or_else(
        || "none".to_owned(),
        |age| humantime::format_duration(Duration::from_millis(age.as_millis() as u64)).to_string(),
    );
    println!(
        "{store}: {} pending in {} keys, oldest {oldest}; {} parked; {} delivered kept for audit",
        status.pending,
        status.pending_keys,
        status.parked.len(),
        status.kept
    );
    for key in &status.lagging {
        println!(
            "  behind {:?}: {} pending, oldest {}",
            key.key,
            key.pending,
            humantime::format_duration(Duration::from_millis(key.oldest.as_millis() as u64))
        );
    }
    for key in &status.parked {
        println!(
            "  parked {:?}: {} behind it, {} attempts, last error: {}",
            key.key,
            key.pending,
            key.attempts,
            key.reason.as_deref().unwrap_or("-")
        );
    }
    ExitCode::SUCCESS
}

async fn redrive(args: RedriveArgs) -> ExitCode {
    let result = async {
        let store = turnstile::store::connect_outbox(&args.store.url()?).await?;
        Ok::<_, turnstile::Error>((store.describe(), store.redrive(&args.key).await?))
    }
    .await;
    match result {
        Ok((store, true)) => {
            println!("{store}: key {:?} is back in line", args.key);
            ExitCode::SUCCESS
        }
        Ok((store, false)) => {
            eprintln!("turnstile: {store}: key {:?} is not parked", args.key);
            ExitCode::FAILURE
        }
        Err(error) => fail(&error),
    }
}

async fn skip(args: SkipArgs) -> ExitCode {
    let result = async {
        let store = turnstile::store::connect_outbox(&args.store.url()?).await?;
        Ok::<_, turnstile::Error>((store.describe(), store.skip(&args.key, args.seq).await?))
    }
    .await;
    match result {
        Ok((store, moved)) => {
            let what = if moved {
                "moved aside to the skipped messages"
            } else {
                "was missing (a sequence gap); nothing to move"
            };
            println!(
                "{store}: key {:?}: message {} {what}; the key goes on with {}",
                args.key,
                args.seq,
                args.seq + 1
            );
            ExitCode::SUCCESS
        }
        Err(error) if error.kind() == turnstile::ErrorKind::InvalidOptions => {
            eprintln!("turnstile: {error}");
            ExitCode::FAILURE
        }
        Err(error) => fail(&error),
    }
}
