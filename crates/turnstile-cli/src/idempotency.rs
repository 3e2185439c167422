//! `turnstile idempotency`: look at, list, forget and sweep idempotency records.

use std::process::ExitCode;

use clap::{Args, Subcommand};
use turnstile::idempotency::{Idempotency, IdempotencyKey, RecordState, Scope};

use crate::{StoreArgs, fail};

#[derive(Subcommand, Debug)]
pub(crate) enum IdempotencyCommand {
    /// Show one record: its state, token, lease and retention left, and the size of its
    /// stored outcome.
    Show(KeyArgs),
    /// List claims in progress whose lease has run out (their worker died or is cut off).
    Stale(ListArgs),
    /// Forget one record (an operator's tool): a retry runs again, and a claim at work on
    /// it can no longer store its outcome.
    Forget(KeyArgs),
    /// Delete records whose retention has passed (Redis needs none: its keys expire).
    Sweep(ListArgs),
}

#[derive(Args, Debug)]
pub(crate) struct KeyArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// The record's scope (for the HTTP layer: "<scope> <METHOD> <route>").
    #[arg(long)]
    scope: String,
    /// Print one JSON object instead of a sentence.
    #[arg(long)]
    json: bool,
    /// The idempotency key.
    key: String,
}

#[derive(Args, Debug)]
pub(crate) struct ListArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// At most this many records.
    #[arg(long, default_value_t = 1000)]
    limit: u32,
    /// Print JSON instead of sentences.
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run(command: IdempotencyCommand) -> ExitCode {
    match command {
        IdempotencyCommand::Show(args) => show(args, false).await,
        IdempotencyCommand::Forget(args) => show(args, true).await,
        IdempotencyCommand::Stale(args) => stale(args).await,
        IdempotencyCommand::Sweep(args) => sweep(args).await,
    }
}

async fn open(store: &StoreArgs) -> Result<Idempotency, turnstile::Error> {
    Idempotency::connect(&store.url()?).await
}

async fn show(args: KeyArgs, forgetting: bool) -> ExitCode {
    let (scope, key) = match (
        Scope::new(args.scope.as_str()),
        IdempotencyKey::new(args.key.as_str()),
    ) {
        (Ok(scope), Ok(key)) => (scope, key),
        (Err(error), _) | (_, Err(error)) => return fail(&error),
    };
    let engine = match open(&args.store).await {
        Ok(engine) => engine,
        Err(error) => return fail(&error),
    };
    let store = engine.store();
    let record = match store.get(&scope, &key).await {
        Ok(record) => record,
        Err(error) => return fail(&error),
    };
    let forgotten = if forgetting {
        match store.forget(&scope, &key).await {
            Ok(forgotten) => forgotten,
            Err(error) => return fail(&error),
        }
    } else {
        false
    };
    if args.json {
        let value = match &record {
            Some(record) => serde_json::json!({
                "scope": scope.as_str(),
                "key": key.as_str(),
                "state": match record.state {
                    RecordState::InProgress => "in_progress",
                    RecordState::Completed => "completed",
                    _ => "unknown",
                },
                "token": record.token.get(),
                "lease_left_ms": record.lease_left.map(|left| u64::try_from(left.as_millis()).unwrap_or(u64::MAX)),
                "expires_in_ms": u64::try_from(record.expires_in.as_millis()).unwrap_or(u64::MAX),
                "outcome_bytes": record.outcome.as_ref().map(Vec::len),
                "forgotten": forgotten,
            }),
            None => serde_json::json!({
                "scope": scope.as_str(), "key": key.as_str(), "state": "absent", "forgotten": false,
            }),
        };
        println!("{value}");
        return ExitCode::SUCCESS;
    }
    match record {
        None => println!(
            "key {:?} in scope {:?}: no record",
            key.as_str(),
            scope.as_str()
        ),
        Some(record) => {
            let state = match (record.state, record.lease_left) {
                (RecordState::InProgress, Some(left)) if !left.is_zero() => {
                    format!("in progress, lease ends in {:.1}s", left.as_secs_f64())
                }
                (RecordState::InProgress, _) => {
                    "in progress, lease ran out (the next claim takes it over)".to_owned()
                }
                _ => format!(
                    "completed, outcome of {} bytes",
                    record.outcome.as_ref().map_or(0, Vec::len)
                ),
            };
            println!(
                "key {:?} in scope {:?}: {state}; token {}; kept for {:.0}s more{}",
                key.as_str(),
                scope.as_str(),
                record.token,
                record.expires_in.as_secs_f64(),
                if forgotten { "; forgotten now" } else { "" }
            );
        }
    }
    ExitCode::SUCCESS
}

async fn stale(args: ListArgs) -> ExitCode {
    let engine = match open(&args.store).await {
        Ok(engine) => engine,
        Err(error) => return fail(&error),
    };
    let stale = match engine.store().stale(args.limit).await {
        Ok(stale) => stale,
        Err(error) => return fail(&error),
    };
    if args.json {
        let items: Vec<_> = stale
            .iter()
            .map(|claim| {
                serde_json::json!({
                    "scope": claim.scope,
                    "key": claim.key,
                    "token": claim.token.get(),
                    "overdue_ms": u64::try_from(claim.overdue.as_millis()).unwrap_or(u64::MAX),
                })
            })
            .collect();
        println!("{}", serde_json::json!({ "stale": items }));
        return ExitCode::SUCCESS;
    }
    if stale.is_empty() {
        println!("no claim in progress has outlived its lease");
    }
    for claim in stale {
        println!(
            "key {:?} in scope {:?}: token {}, lease ran out {:.1}s ago",
            claim.key,
            claim.scope,
            claim.token,
            claim.overdue.as_secs_f64()
        );
    }
    ExitCode::SUCCESS
}

async fn sweep(args: ListArgs) -> ExitCode {
    let engine = match open(&args.store).await {
        Ok(engine) => engine,
        Err(error) => return fail(&error),
    };
    match engine.store().sweep(args.limit).await {
        Ok(swept) if args.json => {
            println!("{}", serde_json::json!({ "swept": swept }));
            ExitCode::SUCCESS
        }
        Ok(swept) => {
            println!(
                "{}: swept {swept} expired record(s)",
                engine.store().describe()
            );
            ExitCode::SUCCESS
        }
        Err(error) => fail(&error),
    }
}
