//! `turnstile lead`: run a command while this instance leads an election; `turnstile
//! leader`: who leads one.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use tokio::signal::unix::{SignalKind, signal};
use turnstile::ErrorKind;
use turnstile::election::{Election, Leader};
use turnstile::lock::{LockName, LockOptions};

use crate::lock::exec::{self, HeldLock};
use crate::{StoreArgs, exit, fail, parse_kill_after, parse_positive_span, parse_ttl};

#[derive(Args, Debug)]
pub(crate) struct LeadArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// The leader's lease (client-go's lease duration), at most 365 days; renewed every
    /// TTL/3 while the command runs. A leader that crashed is replaced after at most
    /// this long.
    #[arg(long, default_value = "15s", value_parser = parse_ttl, value_name = "DURATION")]
    ttl: Duration,
    /// What this instance advertises while it leads (an address, an id), shown by
    /// `turnstile leader` and passed to the command as TURNSTILE_LEADER_VALUE. SQLite,
    /// Redis and PostgreSQL (lease mode) keep values; elsewhere leave it empty.
    #[arg(long, default_value = "", value_name = "TEXT")]
    value: String,
    /// Exit when the first term ends (with the command's status) instead of
    /// campaigning again.
    #[arg(long)]
    once: bool,
    /// How long to wait after a term ends before campaigning again (client-go's retry
    /// period), so that a command that fails at once does not spin.
    #[arg(long, default_value = "2s", value_parser = parse_positive_span, value_name = "DURATION")]
    retry_period: Duration,
    /// After SIGTERM, how long the command gets before SIGKILL when leadership is lost
    /// (as for `lock exec`). Default: 10s, or TTL/3 if that is shorter.
    #[arg(long, value_parser = parse_kill_after, value_name = "DURATION")]
    kill_after: Option<Duration>,
    /// The election's name (a lock name).
    name: String,
    /// The command and its arguments (after `--`).
    #[arg(last = true, value_name = "CMD")]
    command: Vec<String>,
}

#[derive(Args, Debug)]
pub(crate) struct LeaderArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Keep running and print every change of leader (a new leader, a new value, nobody
    /// leading) as it happens.
    #[arg(long)]
    watch: bool,
    /// Print JSON (one object per line with --watch) instead of sentences.
    #[arg(long)]
    json: bool,
    /// The election's name.
    name: String,
}

/// `turnstile lead NAME [--value V] [--once] -- CMD`.
pub(crate) async fn lead(args: LeadArgs) -> ExitCode {
    if args.command.is_empty() {
        eprintln!(
            "turnstile: no command given; usage: turnstile lead [OPTIONS] NAME -- CMD [ARGS...]"
        );
        return ExitCode::from(exit::USAGE);
    }
    let name = match LockName::new(args.name.as_str()) {
        Ok(name) => name,
        Err(error) => return fail(&error),
    };
    let options = LockOptions::new().ttl(args.ttl).wait_forever();
    if let Err(error) = options.validate() {
        return fail(&error);
    }
    let kill_after =
        match exec::kill_after_within(args.ttl, options.get_clock_drift(), args.kill_after) {
            Ok(kill_after) => kill_after,
            Err(message) => {
                eprintln!("turnstile: {message}");
                return ExitCode::from(exit::USAGE);
            }
        };
    let election = match args.store.locker().await {
        Ok(locker) => Election::new(locker),
        Err(error) => return fail(&error),
    };
    let (Ok(mut terminate), Ok(mut interrupt), Ok(mut hangup)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) else {
        eprintln!("turnstile: cannot install signal handlers");
        return ExitCode::from(exit::SOFTWARE);
    };
    loop {
        let campaign = election.campaign(name.clone(), args.value.clone(), &options);
        let leadership = tokio::select! {
            leadership = campaign => leadership,
            // Asked to stop while only a candidate: nothing runs, nothing is held.
            _ = terminate.recv() => return ExitCode::SUCCESS,
            _ = interrupt.recv() => return ExitCode::SUCCESS,
            _ = hangup.recv() => return ExitCode::SUCCESS,
        };
        let leadership = match leadership {
            Ok(leadership) => leadership,
            // A candidate keeps campaigning through an outage of the store.
            Err(error) if !args.once && error.kind() == ErrorKind::StoreUnavailable => {
                eprintln!(
                    "turnstile: cannot campaign for {:?} ({error}); trying again in {}",
                    name.as_str(),
                    humantime::format_duration(args.retry_period)
                );
                if stopped_while_waiting(
                    args.retry_period,
                    &mut terminate,
                    &mut interrupt,
                    &mut hangup,
                )
                .await
                {
                    return ExitCode::SUCCESS;
                }
                continue;
            }
            Err(error) => return fail(&error),
        };
        let epoch = leadership.epoch();
        eprintln!(
            "turnstile: leading {:?} with epoch {epoch}; running the command",
            name.as_str()
        );
        let environment = [
            ("TURNSTILE_LOCK_NAME", name.as_str().to_owned()),
            ("TURNSTILE_FENCING_TOKEN", epoch.to_string()),
            ("TURNSTILE_ELECTION", name.as_str().to_owned()),
            ("TURNSTILE_LEADER_EPOCH", epoch.to_string()),
            ("TURNSTILE_LEADER_VALUE", leadership.value().to_owned()),
        ];
        let guard = HeldLock::Fenced(leadership.into_guard());
        let ended = exec::run_held(guard, &args.command, &environment, kill_after).await;
        // A command that cannot run at all will not run next term either.
        let hopeless = matches!(
            ended.code,
            exit::CANNOT_EXECUTE | exit::NOT_FOUND | exit::SOFTWARE
        );
        if args.once || ended.signalled || hopeless {
            return ExitCode::from(ended.code);
        }
        eprintln!(
            "turnstile: the term of epoch {epoch} ended (exit status {}); campaigning again in {}",
            ended.code,
            humantime::format_duration(args.retry_period)
        );
        if stopped_while_waiting(
            args.retry_period,
            &mut terminate,
            &mut interrupt,
            &mut hangup,
        )
        .await
        {
            return ExitCode::SUCCESS;
        }
    }
}

/// Sleeps `period`; says whether a stop signal came first.
async fn stopped_while_waiting(
    period: Duration,
    terminate: &mut tokio::signal::unix::Signal,
    interrupt: &mut tokio::signal::unix::Signal,
    hangup: &mut tokio::signal::unix::Signal,
) -> bool {
    tokio::select! {
        () = tokio::time::sleep(period) => false,
        _ = terminate.recv() => true,
        _ = interrupt.recv() => true,
        _ = hangup.recv() => true,
    }
}

/// `turnstile leader NAME [--watch] [--json]`.
pub(crate) async fn leader(args: LeaderArgs) -> ExitCode {
    let url = match args.store.url() {
        Ok(url) => url,
        Err(error) => return fail(&error),
    };
    // A look creates nothing (no tables), as `lock status` does.
    let election = match turnstile::lock::Locker::connect(&crate::without_migrating(&url)).await {
        Ok(locker) => Election::new(locker),
        Err(error) => return fail(&error),
    };
    let mut watch = match election.observe(args.name.as_str()).await {
        Ok(watch) => watch,
        Err(error) => return fail(&error),
    };
    loop {
        let leader = match watch.changed().await {
            Ok(leader) => leader,
            Err(error) if args.watch && error.kind() == ErrorKind::StoreUnavailable => {
                eprintln!("turnstile: {error}; looking again in 1s");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
            Err(error) => return fail(&error),
        };
        print_leader(&args, leader.as_ref());
        if !args.watch {
            return ExitCode::SUCCESS;
        }
    }
}

fn print_leader(args: &LeaderArgs, leader: Option<&Leader>) {
    if args.json {
        let value = match leader {
            Some(leader) => serde_json::json!({
                "name": args.name,
                "leading": true,
                "owner": leader.owner,
                "epoch": leader.epoch.map(|epoch| epoch.get()),
                "value": leader.value,
                "remaining_ttl_ms": leader.remaining_ttl.map(|ttl| u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX)),
                "seen_since_ms": leader.seen_since.duration_since(std::time::UNIX_EPOCH).ok().map(|since| u64::try_from(since.as_millis()).unwrap_or(u64::MAX)),
            }),
            None => serde_json::json!({ "name": args.name, "leading": false }),
        };
        println!("{value}");
        return;
    }
    match leader {
        Some(leader) => {
            let epoch = leader.epoch.map_or_else(
                || "no epoch (held as an unfenced lock)".to_owned(),
                |epoch| format!("epoch {epoch}"),
            );
            let value = match leader.value.as_deref() {
                Some("") | None => "no value".to_owned(),
                Some(value) => format!("value {value:?}"),
            };
            let lease = leader.remaining_ttl.map_or_else(String::new, |ttl| {
                format!("; lease ends in {:.1}s", ttl.as_secs_f64())
            });
            println!(
                "{:?} is led by {} with {epoch}, {value}{lease}",
                args.name, leader.owner
            );
        }
        None => println!("{:?} has no leader", args.name),
    }
}
