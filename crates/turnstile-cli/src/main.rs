//! The `turnstile` command: run a command under a distributed lock, inspect and break
//! locks, benchmark a store.

mod bench;
mod idempotency;
mod lead;
mod lock;
mod migrate;
mod outbox;
mod semaphore;
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
    Lock(lock::LockCommand),
    /// Run a command while this instance leads an election, and campaign again when
    /// its term ends.
    ///
    /// A campaign waits for the election's lock; the leader keeps it renewed while the
    /// command runs, exactly as `lock exec` does, and the command is stopped the same
    /// way if leadership is lost. The command gets TURNSTILE_ELECTION,
    /// TURNSTILE_LEADER_EPOCH (the leader's fencing token, larger than every earlier
    /// leader's; also as TURNSTILE_FENCING_TOKEN), TURNSTILE_LEADER_VALUE and
    /// TURNSTILE_LOCK_NAME in its environment.
    ///
    /// When a term ends (the command exited, or leadership was lost and the command
    /// terminated), turnstile waits --retry-period and campaigns again; with --once it
    /// exits with the command's status instead (see `lock exec` for the codes). A
    /// signal (SIGINT, SIGTERM, SIGHUP) stops it: while leading, after the command,
    /// to which the signal is passed, has exited (with the command's status); while
    /// campaigning, at once (status 0). While the store cannot be reached it keeps
    /// campaigning.
    Lead(lead::LeadArgs),
    /// Semaphores: who holds their permits, forget their number of permits (take a
    /// permit with `lock exec --permits N`).
    #[command(subcommand)]
    Semaphore(semaphore::SemaphoreCommand),
    /// Show who leads an election: the leader's owner id, epoch, value and lease
    /// (--watch: every change, as it happens).
    Leader(lead::LeaderArgs),
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
    Migrate(migrate::MigrateArgs),
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
    #[command(name = lock::exec::SUPERVISOR, hide = true)]
    ExecSupervisor(lock::exec::SupervisorArgs),
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
    /// Leader failover: a leader process killed, timed until the waiting candidate
    /// leads; or etcd's own election RPC (`--raw`).
    Failover(bench::failover::FailoverArgs),
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
pub(crate) fn parse_wait(text: &str) -> Result<Duration, String> {
    at_most(
        parse_span(text)?,
        MAX_SPAN,
        "too long; at most 100 years, or omit --wait to wait forever",
    )
}

/// Parses `--max-hold`: positive, at most 100 years.
pub(crate) fn parse_max_hold(text: &str) -> Result<Duration, String> {
    at_most(
        parse_positive(text)?,
        MAX_SPAN,
        "too long; at most 100 years, or omit --max-hold for no cap",
    )
}

/// Parses `--unused-for`: positive, at most 100 years (the library wants at least 1s
/// and says so itself).
pub(crate) fn parse_unused_for(text: &str) -> Result<Duration, String> {
    at_most(
        parse_positive(text)?,
        MAX_SPAN,
        "too long; at most 100 years",
    )
}

/// Parses `--kill-after`: may be zero, at most 100 years.
pub(crate) fn parse_kill_after(text: &str) -> Result<Duration, String> {
    at_most(parse_span(text)?, MAX_SPAN, "too long; at most 100 years")
}

/// Parses a positive span such as `--retry-period`: at most 100 years.
pub(crate) fn parse_positive_span(text: &str) -> Result<Duration, String> {
    at_most(
        parse_positive(text)?,
        MAX_SPAN,
        "too long; at most 100 years",
    )
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
pub(crate) fn without_migrating(url: &str) -> String {
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
        return lock::exec::supervisor(args);
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
            Command::Lock(command) => lock::run(command).await,
            Command::Lead(args) => lead::lead(args).await,
            Command::Leader(args) => lead::leader(args).await,
            Command::Semaphore(command) => semaphore::run(command).await,
            Command::Bench(BenchCommand::Lock(args)) => bench::run(args).await,
            Command::Bench(BenchCommand::IdempotencyServer(args)) => bench::http::serve(args).await,
            Command::Bench(BenchCommand::Failover(args)) => bench::failover::run(args).await,
            Command::Bench(BenchCommand::IdempotencyDuplicates(args)) => {
                bench::http::duplicates(args).await
            }
            #[cfg(all(feature = "postgres", feature = "nats"))]
            Command::Bench(BenchCommand::Outbox(args)) => bench::outbox::run(args).await,
            Command::Migrate(args) => migrate::run(args).await,
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
