//! `turnstile semaphore`: who holds a semaphore's permits (`status`), and forgetting its
//! number of permits (`forget`). Permits are taken with `turnstile lock exec --permits N`.

use std::process::ExitCode;

use clap::{Args, Subcommand};
use turnstile::semaphore::Semaphore;

use crate::{StoreArgs, fail, without_migrating};

#[derive(Subcommand, Debug)]
pub(crate) enum SemaphoreCommand {
    /// Show the number of permits the store holds for a semaphore and who holds each
    /// permit, with its fencing token and lease.
    Status(SemaphoreArgs),
    /// Forget the number of permits stored for a semaphore, so that the next client to
    /// use it declares a new one. Stop every client of the semaphore first: a client
    /// still running keeps the number it checked.
    Forget(SemaphoreArgs),
}

#[derive(Args, Debug)]
pub(crate) struct SemaphoreArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Print one JSON object instead of sentences.
    #[arg(long)]
    json: bool,
    /// The semaphore's name.
    name: String,
}

/// Runs one `turnstile semaphore` subcommand.
pub(crate) async fn run(command: SemaphoreCommand) -> ExitCode {
    match command {
        SemaphoreCommand::Status(args) => status(args).await,
        SemaphoreCommand::Forget(args) => forget(args).await,
    }
}

async fn open(args: &SemaphoreArgs) -> Result<Semaphore, turnstile::Error> {
    let url = args.store.url()?;
    let locker = turnstile::lock::Locker::connect(&without_migrating(&url)).await?;
    Ok(Semaphore::new(locker))
}

async fn status(args: SemaphoreArgs) -> ExitCode {
    let semaphore = match open(&args).await {
        Ok(semaphore) => semaphore,
        Err(error) => return fail(&error),
    };
    let permits = match semaphore.stored_permits(args.name.as_str()).await {
        Ok(permits) => permits,
        Err(error) => return fail(&error),
    };
    let held = match permits {
        Some(permits) => match semaphore.holders(args.name.as_str(), permits).await {
            Ok(held) => held,
            Err(error) => return fail(&error),
        },
        None => Vec::new(),
    };
    if args.json {
        let holders: Vec<serde_json::Value> = held
            .iter()
            .map(|(slot, info)| {
                serde_json::json!({
                    "permit": slot,
                    "owner": info.owner,
                    "fencing_token": info.fencing_token.map(|token| token.get()),
                    "remaining_ttl_ms": info.remaining_ttl.map(|ttl| u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX)),
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "name": args.name,
                "permits": permits,
                "held": held.len(),
                "holders": holders,
            })
        );
        return ExitCode::SUCCESS;
    }
    match permits {
        None => println!(
            "{:?} has no number of permits stored (no client has used it)",
            args.name
        ),
        Some(permits) => {
            println!("{:?}: {} of {permits} permits held", args.name, held.len());
            for (slot, info) in &held {
                let token = info
                    .fencing_token
                    .map_or_else(String::new, |token| format!(" with fencing token {token}"));
                let lease = info.remaining_ttl.map_or_else(String::new, |ttl| {
                    format!("; lease ends in {:.1}s", ttl.as_secs_f64())
                });
                println!("  permit {slot}: owner {}{token}{lease}", info.owner);
            }
        }
    }
    ExitCode::SUCCESS
}

async fn forget(args: SemaphoreArgs) -> ExitCode {
    let semaphore = match open(&args).await {
        Ok(semaphore) => semaphore,
        Err(error) => return fail(&error),
    };
    match semaphore.forget_permits(args.name.as_str()).await {
        Ok(forgotten) => {
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({ "name": args.name, "forgotten_permits": forgotten })
                );
            } else {
                match forgotten {
                    Some(permits) => println!(
                        "forgot that {:?} has {permits} permits; the next client to use it declares its number",
                        args.name
                    ),
                    None => println!("{:?} had no number of permits stored", args.name),
                }
            }
            ExitCode::SUCCESS
        }
        Err(error) => fail(&error),
    }
}
