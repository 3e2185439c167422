//! The `turnstile` command: run a command under a distributed lock, inspect and break
//! locks, benchmark a store.

mod bench;
mod exec;
mod idempotency;
mod outbox;
mod serve;
#[cfg(feature = "sqlite")]
mod verify;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use turnstile::lock::Locker;
use turnstile::{Error, ErrorKind};

/// Exit codes of `turnstile` itself (a command run by `lock exec` passes its own through).
pub(crate) mod exit {
    /// Bad input: an invalid name, duration, URL or missing command.
    pub(crate) const USAGE: u8 = 64;
    /// The store could not be reached, or this build does not support it.
    pub(crate) const UNAVAILABLE: u8 = 69;
    /// The store answered with an error, or something else went wrong inside turnstile.
    pub(crate) const SOFTWARE: u8 = 70;
    /// The store refused us for good: wrong credentials, unknown database, missing
    /// permission. Fix the URL or the grants; retrying does not help.
    pub(crate) const CONFIG: u8 = 78;
    /// The lock was not acquired within the wait (or at once, with `--no-wait`).
    pub(crate) const NOT_ACQUIRED: u8 = 75;
    /// The lock was lost while the command ran; the command was terminated.
    pub(crate) const LOST: u8 = 76;
    /// The command was found but could not be executed.
    pub(crate) const CANNOT_EXECUTE: u8 = 126;
    /// The command was not found.
    pub(crate) const NOT_FOUND: u8 = 127;
}

/// Keeps a fleet of servers from doing the same work twice.
#[derive(Parser, Debug)]
#[command(name = "turnstile", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Distributed locks.
    #[command(subcommand)]
    Lock(LockCommand),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Idempotency records: show, list stale claims, forget, sweep.
    #[command(subcommand)]
    Idempotency(idempotency::IdempotencyCommand),
    /// The transactional outbox: run a relay, show status, redrive a parked key.
    #[command(subcommand)]
    Outbox(outbox::OutboxCommand),
    /// Serve the locks, idempotency keys and outbox status over HTTP, with metrics and a
    /// live dashboard (default: the SQLite store, on 127.0.0.1:7070).
    Serve(serve::ServeArgs),
    /// Create the store's tables (locks, fences, idempotency records) if they are
    /// missing (SQL stores); harmless to repeat.
    Migrate(StoreOnlyArgs),
    /// Fault campaigns with a checker: run workers against a store while faults are
    /// injected, and check what they saw.
    #[cfg(feature = "sqlite")]
    #[command(subcommand)]
    Verify(verify::VerifyCommand),
    /// Internal to `verify lock`: one worker process.
    #[cfg(feature = "sqlite")]
    #[command(name = "verify-worker", hide = true)]
    VerifyWorker(verify::worker::WorkerArgs),
    /// Internal to `verify idempotency`: one service instance.
    #[cfg(all(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    #[command(name = "verify-idempotency-instance", hide = true)]
    VerifyIdempotencyInstance(verify::idempotency::InstanceArgs),
    /// Internal to `lock exec`: runs the command between turnstile and it.
    #[command(name = exec::SUPERVISOR, hide = true)]
    ExecSupervisor(exec::SupervisorArgs),
}

#[derive(Args, Debug)]
struct StoreOnlyArgs {
    #[command(flatten)]
    store: StoreArgs,
}

#[derive(Subcommand, Debug)]
enum LockCommand {
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

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// The lock workload (v1): uncontended cycles, then contended critical sections.
    Lock(bench::BenchArgs),
    /// Serve the idempotency layer's HTTP workload for `wrk` (see BENCHMARKS.md).
    IdempotencyServer(bench::http::ServerArgs),
    /// Send many requests with one new key at once to a running idempotency-server and
    /// report what they got.
    IdempotencyDuplicates(bench::http::DuplicatesArgs),
    /// The outbox on PostgreSQL relayed to NATS JetStream, or the bare relay (`--raw`).
    #[cfg(all(feature = "postgres", feature = "nats"))]
    Outbox(bench::outbox::OutboxBenchArgs),
}

/// Where the locks live.
#[derive(Args, Debug, Clone)]
pub(crate) struct StoreArgs {
    /// Store URL: sqlite://PATH, redis://HOST[:PORT][/DB], rediss://…,
    /// postgres://USER@HOST[:PORT]/DB, mysql://USER@HOST[:PORT]/DB. Default: the
    /// TURNSTILE_STORE environment variable, else an SQLite file in the per-user state
    /// directory ($XDG_STATE_HOME/turnstile/locks.sqlite3, or
    /// ~/.local/state/turnstile/locks.sqlite3).
    #[arg(long, env = "TURNSTILE_STORE", value_name = "URL")]
    store: Option<String>,
}

#[derive(Args, Debug)]
struct ExecArgs {
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
    #[arg(long)]
    unfenced: bool,
    /// The lock's name.
    name: String,
    /// The command and its arguments (after `--`).
    #[arg(last = true, value_name = "CMD")]
    command: Vec<String>,
}

#[derive(Args, Debug)]
struct PruneArgs {
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
struct StatusArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Print one JSON object instead of a sentence.
    #[arg(long)]
    json: bool,
    /// The lock's name.
    name: String,
}

/// The longest lease the library accepts.
const MAX_TTL: Duration = Duration::from_secs(365 * 24 * 3600);

/// The longest `--wait`, `--max-hold` or `--kill-after`: 100 years of 365 days, the
/// bound the library puts on waits and hold caps (humantime's "100years" counts 365.25
/// days and is just over). Far beyond any real use, yet small enough that adding it to
/// a clock reading cannot overflow (which would panic).
const MAX_SPAN: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Parses `--ttl`: positive, at most 365 days.
pub(crate) fn parse_ttl(text: &str) -> Result<Duration, String> {
    at_most(parse_positive(text)?, MAX_TTL, "too long; at most 365 days")
}

/// Parses `--wait`: may be zero, at most 100 years.
fn parse_wait(text: &str) -> Result<Duration, String> {
    at_most(
        parse_span(text)?,
        MAX_SPAN,
        "too long; at most 100 years, or omit --wait to wait forever",
    )
}

/// Parses `--max-hold`: positive, at most 100 years.
fn parse_max_hold(text: &str) -> Result<Duration, String> {
    at_most(
        parse_positive(text)?,
        MAX_SPAN,
        "too long; at most 100 years, or omit --max-hold for no cap",
    )
}

/// Parses `--unused-for`: positive, at most 100 years (the library wants at least 1s
/// and says so itself).
fn parse_unused_for(text: &str) -> Result<Duration, String> {
    at_most(
        parse_positive(text)?,
        MAX_SPAN,
        "too long; at most 100 years",
    )
}

/// Parses `--kill-after`: may be zero, at most 100 years.
fn parse_kill_after(text: &str) -> Result<Duration, String> {
    at_most(parse_span(text)?, MAX_SPAN, "too long; at most 100 years")
}

/// `duration`, or `too_long` if it exceeds `limit`.
fn at_most(duration: Duration, limit: Duration, too_long: &str) -> Result<Duration, String> {
    if duration > limit {
        return Err(too_long.to_owned());
    }
    Ok(duration)
}

/// Parses a positive duration such as `30s`, `500ms`, `2m`.
fn parse_positive(text: &str) -> Result<Duration, String> {
    let duration = parse_span(text)?;
    if duration.is_zero() {
        return Err("must be greater than zero".to_owned());
    }
    Ok(duration)
}

/// Parses a duration that may be zero; it must have a unit.
fn parse_span(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.parse::<f64>().is_ok() {
        return Err(format!(
            "{text:?} has no unit; write it like 30s, 500ms or 2m"
        ));
    }
    humantime::parse_duration(text).map_err(|error| {
        format!("{text:?} is not a duration ({error}); write it like 30s, 500ms or 2m")
    })
}

/// The default store: an SQLite file in the per-user state directory.
fn default_store_path() -> Result<PathBuf, Error> {
    let base = std::env::var_os("XDG_STATE_HOME")
        .filter(|dir| !dir.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".local/state")))
        .ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidUrl,
                "no store given and neither XDG_STATE_HOME nor HOME is set; pass --store URL",
            )
        })?;
    let dir = base.join("turnstile");
    std::fs::create_dir_all(&dir).map_err(|error| {
        Error::new(
            ErrorKind::StoreUnavailable,
            format!("cannot create the state directory {}", dir.display()),
        )
        .with_source(error)
    })?;
    Ok(dir.join("locks.sqlite3"))
}

impl StoreArgs {
    /// The URL to use: `--store`, else `TURNSTILE_STORE`, else the default SQLite file.
    pub(crate) fn url(&self) -> Result<String, Error> {
        match self.store.as_deref().map(str::trim) {
            Some(url) if !url.is_empty() => Ok(url.to_owned()),
            _ => Ok(format!("sqlite://{}", default_store_path()?.display())),
        }
    }

    pub(crate) async fn locker(&self) -> Result<Locker, Error> {
        Locker::connect(&self.url()?).await
    }
}

/// `url` with `turnstile_migrate=off` for the SQL stores, unless it says otherwise.
fn without_migrating(url: &str) -> String {
    let scheme = url.split(':').next().unwrap_or("").to_ascii_lowercase();
    let sql = matches!(
        scheme.as_str(),
        "sqlite" | "postgres" | "postgresql" | "mysql" | "mariadb"
    );
    if !sql || url.contains("turnstile_migrate=") {
        return url.to_owned();
    }
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}turnstile_migrate=off")
}

/// Exit code for a library error.
pub(crate) fn exit_code_for(error: &Error) -> u8 {
    match error.kind() {
        ErrorKind::InvalidName | ErrorKind::InvalidOptions | ErrorKind::InvalidUrl => exit::USAGE,
        ErrorKind::StoreUnavailable | ErrorKind::UnsupportedStore => exit::UNAVAILABLE,
        ErrorKind::Configuration => exit::CONFIG,
        ErrorKind::AcquireTimeout | ErrorKind::Held => exit::NOT_ACQUIRED,
        ErrorKind::LockLost => exit::LOST,
        _ => exit::SOFTWARE,
    }
}

pub(crate) fn fail(error: &Error) -> ExitCode {
    eprintln!("turnstile: {error}");
    ExitCode::from(exit_code_for(error))
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

async fn migrate(args: StoreOnlyArgs) -> ExitCode {
    let locker = match args.store.locker().await {
        Ok(locker) => locker,
        Err(error) => return fail(&error),
    };
    if let Err(error) = locker.backend().migrate().await {
        return fail(&error);
    }
    // The idempotency records' table too (opening the store creates it), where the
    // engine has one.
    let url = match args.store.url() {
        Ok(url) => url,
        Err(error) => return fail(&error),
    };
    match turnstile::store::connect_idempotency(&url).await {
        Ok(_) => {}
        Err(error) if error.kind() == ErrorKind::UnsupportedStore => {}
        Err(error) => return fail(&error),
    }
    println!("{}: tables ready", locker.backend().describe());
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => {
            let code = if error.use_stderr() { exit::USAGE } else { 0 };
            let _ = error.print();
            return ExitCode::from(code);
        }
    };
    // The supervisor takes the pipes it inherited before the runtime opens anything.
    if let Command::ExecSupervisor(args) = cli.command {
        return exec::supervisor(args);
    }
    // The service uses both cores; every other command is one task at a time.
    // `bench lock` runs on the multi-thread runtime too with BENCH_RUNTIME=multi_thread,
    // as a service would run the library.
    let multi_thread = matches!(cli.command, Command::Serve(_))
        || (matches!(cli.command, Command::Bench(BenchCommand::Lock(_)))
            && std::env::var("BENCH_RUNTIME").is_ok_and(|runtime| runtime == "multi_thread"));
    let mut builder = if multi_thread {
        tokio::runtime::Builder::new_multi_thread()
    } else {
        tokio::runtime::Builder::new_current_thread()
    };
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("turnstile: cannot start the async runtime: {error}");
            return ExitCode::from(exit::SOFTWARE);
        }
    };
    runtime.block_on(async move {
        match cli.command {
            Command::Lock(LockCommand::Exec(args)) => exec::run(args).await,
            Command::Lock(LockCommand::Status(args)) => status(args, false).await,
            Command::Lock(LockCommand::Break(args)) => status(args, true).await,
            Command::Lock(LockCommand::Prune(args)) => prune(args).await,
            Command::Bench(BenchCommand::Lock(args)) => bench::run(args).await,
            Command::Bench(BenchCommand::IdempotencyServer(args)) => bench::http::serve(args).await,
            Command::Bench(BenchCommand::IdempotencyDuplicates(args)) => {
                bench::http::duplicates(args).await
            }
            #[cfg(all(feature = "postgres", feature = "nats"))]
            Command::Bench(BenchCommand::Outbox(args)) => bench::outbox::run(args).await,
            Command::Migrate(args) => migrate(args).await,
            Command::Idempotency(command) => idempotency::run(command).await,
            Command::Outbox(command) => outbox::run(command).await,
            Command::Serve(args) => serve::run(args).await,
            #[cfg(feature = "sqlite")]
            Command::Verify(command) => verify::run(command).await,
            #[cfg(feature = "sqlite")]
            Command::VerifyWorker(args) => verify::worker::run(args).await,
            #[cfg(all(feature = "sqlite", feature = "postgres", feature = "mysql"))]
            Command::VerifyIdempotencyInstance(args) => verify::idempotency::instance(args).await,
            // Run above, before the runtime.
            Command::ExecSupervisor(_) => ExitCode::from(exit::SOFTWARE),
        }
    })
}

/// `url` without its `turnstile_*` query options: the URL an application's own driver
/// pool connects with (the options are the store's, not the driver's).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn without_turnstile_options(url: &str) -> String {
    let Some((base, query)) = url.split_once('?') else {
        return url.to_owned();
    };
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| !pair.starts_with("turnstile_"))
        .collect();
    if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_need_units_and_ttls_must_be_positive() {
        assert_eq!(parse_ttl("1500ms"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_ttl("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_ttl("0s").is_err());
        assert!(parse_ttl("5").unwrap_err().contains("no unit"));
        assert!(parse_ttl("soon").is_err());
        assert!(parse_max_hold("0s").is_err());
        assert_eq!(parse_wait("0s"), Ok(Duration::ZERO));
        assert_eq!(parse_kill_after("0s"), Ok(Duration::ZERO));
    }

    #[test]
    fn durations_are_bounded_so_deadlines_cannot_overflow() {
        assert_eq!(parse_ttl("365days"), Ok(MAX_TTL));
        assert!(
            parse_ttl("366days")
                .unwrap_err()
                .contains("at most 365 days")
        );
        for parse in [parse_wait, parse_max_hold, parse_kill_after] {
            assert_eq!(parse("36500days"), Ok(MAX_SPAN));
            assert!(
                parse("36501days")
                    .unwrap_err()
                    .contains("at most 100 years")
            );
            assert!(
                parse("10000000000000000000s")
                    .unwrap_err()
                    .contains("too long")
            );
        }
        assert!(parse_wait("101years").unwrap_err().contains("omit --wait"));
    }

    #[test]
    fn the_command_line_is_well_formed() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
