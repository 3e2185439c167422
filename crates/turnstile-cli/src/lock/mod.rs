//! `turnstile lock`: run a command under a lock (`exec`), look at a lock (`status`),
//! break it (`break`), forget unused names (`prune`).

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Subcommand};
use turnstile::lock::Locker;

use crate::{
    StoreArgs, fail, parse_kill_after, parse_max_hold, parse_ttl, parse_unused_for, parse_wait,
    without_migrating,
};

pub(crate) mod exec;

#[derive(Subcommand, Debug)]
pub(crate) enum LockCommand {
    /// Run a command while holding a lock, renewing it; stop the command if the lock is lost.
    ///
    /// The command gets TURNSTILE_FENCING_TOKEN and TURNSTILE_LOCK_NAME in its
    /// environment. It runs in its own process group, so what it starts (background
    /// jobs, pipelines) is signalled with it: SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to
    /// turnstile (Ctrl-C included) are passed on to the group, and if the lock is lost
    /// the group gets SIGTERM, then SIGKILL after --kill-after. If renewals keep
    /// failing (the store is unreachable), SIGTERM goes out --kill-after before the
    /// lease runs out and SIGKILL when it does, so the command is dead by then; and the
    /// command is not started if less than --kill-after of the lease is left once the
    /// lock is acquired (a store slower to answer than the TTL). Outside the
    /// terminal's foreground group, the command cannot read from the terminal, and
    /// Ctrl-Z is refused (it would stop the renewals, not the command).
    ///
    /// If turnstile itself dies (kill -9, a crash), the group is ended all the same:
    /// the command runs under a small supervisor (the turnstile binary run again) that
    /// notices and sends the group SIGTERM, then SIGKILL after --kill-after. On Linux
    /// it also ends what the command started and left (a double fork, a new session).
    ///
    /// Exit status: the command's own; 75 if the lock was not acquired in time; 76 if
    /// the lock was lost (or was about to run out unrenewed) and the command was
    /// terminated; 64 bad input; 69 store unavailable; 70 store error; 78 store refused
    /// the configuration (credentials, database, permissions); 126/127 command not executable /
    /// not found.
    Exec(ExecArgs),
    /// Show whether a lock is held, by whom, with which fencing token and how long is left.
    Status(StatusArgs),
    /// Force-release a lock whoever holds it (an operator's tool); says what it broke.
    Break(StatusArgs),
    /// Forget lock names nobody has held for a while (SQL stores keep a row per name
    /// ever used). Held locks are never touched, and tokens of a name used again still
    /// increase. Redis needs no pruning: its keys expire.
    Prune(PruneArgs),
}

#[derive(Args, Debug)]
pub(crate) struct ExecArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Lease length, at most 365 days; the lock is renewed every TTL/3 while the
    /// command runs.
    #[arg(long, default_value = "30s", value_parser = parse_ttl, value_name = "DURATION")]
    ttl: Duration,
    /// How long to wait for the lock, at most 100 years (default: as long as it takes).
    #[arg(long, value_parser = parse_wait, value_name = "DURATION", conflicts_with = "no_wait")]
    wait: Option<Duration>,
    /// Fail at once (exit 75) if the lock is held.
    #[arg(long)]
    no_wait: bool,
    /// Treat the lock as lost after this long in total (at most 100 years), even if
    /// renewals succeed.
    #[arg(long, value_parser = parse_max_hold, value_name = "DURATION")]
    max_hold: Option<Duration>,
    /// After SIGTERM, how long the command gets before SIGKILL when the lock is lost.
    ///
    /// When renewals stop succeeding, SIGTERM goes out this long before the lease runs
    /// out, so that the SIGKILL lands before another holder can take the lock. It must
    /// therefore be shorter than two thirds of --ttl (less a clock-drift allowance of
    /// 1% of the TTL + 2ms): termination has to start after the next renewal is due at
    /// TTL/3. Default: 10s, or TTL/3 if that is shorter. At most 100 years.
    #[arg(long, value_parser = parse_kill_after, value_name = "DURATION")]
    kill_after: Option<Duration>,
    /// Take the lock without a fencing token, for commands whose duplicate run only
    /// wastes work: `TURNSTILE_FENCING_TOKEN` is not set. Cheaper on Redis (a bare
    /// `SET NX PX`); the same cost as the fenced lock on the other engines.
    #[arg(long, conflicts_with = "permits")]
    unfenced: bool,
    /// Hold one of N permits of the semaphore NAME instead of the lock NAME: at most N
    /// commands run at once. The first client to use NAME stores N; another number is
    /// refused (exit 64). The command also gets TURNSTILE_SEMAPHORE and
    /// TURNSTILE_PERMIT (0 to N-1); TURNSTILE_LOCK_NAME is the permit's lock, NAME#PERMIT,
    /// and TURNSTILE_FENCING_TOKEN that permit's token.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=i64::from(turnstile::semaphore::MAX_PERMITS)))]
    permits: Option<u32>,
    /// The lock's name.
    name: String,
    /// The command and its arguments (after `--`).
    #[arg(last = true, value_name = "CMD")]
    command: Vec<String>,
}

#[derive(Args, Debug)]
pub(crate) struct PruneArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Forget names whose lease ended at least this long ago (at least 1s), e.g. 7d.
    #[arg(long, value_parser = parse_unused_for, value_name = "DURATION")]
    unused_for: Duration,
    /// Print one JSON object instead of a sentence.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub(crate) struct StatusArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Print one JSON object instead of a sentence.
    #[arg(long)]
    json: bool,
    /// The lock's name.
    name: String,
}

/// Runs one `turnstile lock` subcommand.
pub(crate) async fn run(command: LockCommand) -> ExitCode {
    match command {
        LockCommand::Exec(args) => exec::run(args).await,
        LockCommand::Status(args) => status(args, false).await,
        LockCommand::Break(args) => status(args, true).await,
        LockCommand::Prune(args) => prune(args).await,
    }
}

async fn status(args: StatusArgs, breaking: bool) -> ExitCode {
    let url = match args.store.url() {
        Ok(url) => url,
        Err(error) => return fail(&error),
    };
    // A look (or a break) creates nothing: no SQLite file, no tables.
    #[cfg(feature = "sqlite")]
    if url
        .get(..7)
        .is_some_and(|scheme| scheme.eq_ignore_ascii_case("sqlite:"))
        && let Ok(path) = turnstile::lock::sqlite::url_path(&url)
        && !path.exists()
    {
        let value = serde_json::json!({
            "name": args.name, "held": false, "broken": false, "store": url,
        });
        if args.json {
            println!("{value}");
        } else {
            println!(
                "{:?} is free (there is no lock store at {} yet)",
                args.name,
                path.display()
            );
        }
        return ExitCode::SUCCESS;
    }
    let locker = match Locker::connect(&without_migrating(&url)).await {
        Ok(locker) => locker,
        Err(error) => return fail(&error),
    };
    let answer = if breaking {
        locker.force_release(args.name.as_str()).await
    } else {
        locker.status(args.name.as_str()).await
    };
    let held = match answer {
        Ok(held) => held,
        Err(error) => return fail(&error),
    };
    if args.json {
        let value = match &held {
            Some(info) => serde_json::json!({
                "name": args.name,
                "held": true,
                "broken": breaking,
                "owner": info.owner,
                "fencing_token": info.fencing_token.map(|token| token.get()),
                "remaining_ttl_ms": info.remaining_ttl.map(|ttl| u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX)),
                "store": locker.backend().describe(),
            }),
            None => serde_json::json!({
                "name": args.name,
                "held": false,
                "broken": false,
                "store": locker.backend().describe(),
            }),
        };
        println!("{value}");
        return ExitCode::SUCCESS;
    }
    // Session locks (MySQL, PostgreSQL session mode) have no lease in the store: they
    // last while the holder's session does.
    let lease = |info: &turnstile::lock::LockInfo| match info.remaining_ttl {
        Some(ttl) => format!("lease ends in {:.1}s", ttl.as_secs_f64()),
        None => "held while the holder's session lives".to_owned(),
    };
    let owner = |info: &turnstile::lock::LockInfo| {
        if info.owner.is_empty() {
            "a session that has not recorded its owner".to_owned()
        } else {
            format!("owner {}", info.owner)
        }
    };
    let token = |info: &turnstile::lock::LockInfo| match info.fencing_token {
        Some(token) => format!("with fencing token {token}"),
        None => "unfenced (no token)".to_owned(),
    };
    match (held, breaking) {
        (Some(info), false) => println!(
            "{:?} is held by {} {}; {}",
            args.name,
            owner(&info),
            token(&info),
            lease(&info)
        ),
        (Some(info), true) => println!(
            "broke {:?}: it was held by {} {} ({}); \
             the holder learns of it at its next renewal",
            args.name,
            owner(&info),
            token(&info),
            lease(&info)
        ),
        (None, false) => println!("{:?} is free", args.name),
        (None, true) => println!("{:?} was not held; nothing to break", args.name),
    }
    ExitCode::SUCCESS
}

async fn prune(args: PruneArgs) -> ExitCode {
    let locker = match args.store.locker().await {
        Ok(locker) => locker,
        Err(error) => return fail(&error),
    };
    match locker.prune(args.unused_for).await {
        Ok(removed) if args.json => {
            let value = serde_json::json!({
                "pruned": removed,
                "unused_for_ms": u64::try_from(args.unused_for.as_millis()).unwrap_or(u64::MAX),
                "store": locker.backend().describe(),
            });
            println!("{value}");
            ExitCode::SUCCESS
        }
        Ok(removed) => {
            println!(
                "{}: forgot {removed} lock name(s) unused for {}",
                locker.backend().describe(),
                humantime::format_duration(args.unused_for)
            );
            ExitCode::SUCCESS
        }
        Err(error) => fail(&error),
    }
}
