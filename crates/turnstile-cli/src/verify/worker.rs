//! A verification worker: one process (so the nemesis can pause it with a real
//! `SIGSTOP`) that takes the lock (or leads the election, or holds a permit of the
//! semaphore), writes to the fenced register with its token, holds for a while, writes
//! again, and releases, recording every step.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Args;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use turnstile::election::Election;
use turnstile::fence::{FenceOutcome, FencingToken, sqlite as fence};
use turnstile::lock::{LockGuard, LockOptions, Locker};
use turnstile::semaphore::Semaphore;

use super::Primitive;
use super::history::{Event, EventKind, HistoryWriter, monotonic_ns};

/// The fenced register's resource name.
const REGISTER: &str = "verify-register";

/// Internal to `verify lock`: one worker process.
#[derive(Args, Debug)]
pub(crate) struct WorkerArgs {
    #[arg(long)]
    store: String,
    #[arg(long)]
    name: String,
    #[arg(long, value_parser = humantime::parse_duration)]
    ttl: Duration,
    #[arg(long)]
    worker: usize,
    #[arg(long)]
    history: PathBuf,
    #[arg(long)]
    register: PathBuf,
    /// Stop when the host's monotonic clock reaches this (nanoseconds).
    #[arg(long)]
    until_ns: u64,
    /// What to take: the lock, a leadership of the election, or a permit.
    #[arg(long, value_enum, default_value_t = Primitive::Lock)]
    primitive: Primitive,
    /// The semaphore's permits.
    #[arg(long, default_value_t = 1)]
    permits: u32,
}

/// Takes what the run verifies, as a lock guard (with the permit, for a semaphore).
async fn take(
    locker: &Locker,
    args: &WorkerArgs,
    options: &LockOptions,
) -> turnstile::Result<(LockGuard, Option<u32>)> {
    let name = args.name.as_str();
    match args.primitive {
        Primitive::Lock => Ok((locker.acquire(name, options).await?, None)),
        Primitive::Election => {
            // Each leader advertises itself where the store keeps values; the value is
            // written only while it leads, so it exercises that step under faults too.
            let value = if locker.backend().keeps_holder_values() {
                format!("worker-{}", args.worker)
            } else {
                String::new()
            };
            let election = Election::new(locker.clone());
            let leadership = election.campaign(name, value, options).await?;
            Ok((leadership.into_guard(), None))
        }
        Primitive::Semaphore => {
            let semaphore = Semaphore::new(locker.clone());
            let permit = semaphore.acquire(name, args.permits, options).await?;
            let slot = permit.slot();
            Ok((permit.into_guard(), Some(slot)))
        }
    }
}

/// Opens the fenced register (an SQLite file outside the lock store), creating it.
pub(crate) async fn open_register(path: &Path) -> anyhow::Result<SqlitePool> {
    let options = SqliteConnectOptions::from_str(&format!("sqlite://{}", path.display()))?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(30));
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await?;
    fence::create_table(&pool).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS verify_writes (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            worker INTEGER NOT NULL,
            token INTEGER NOT NULL,
            permit INTEGER NOT NULL DEFAULT 0,
            t INTEGER NOT NULL)",
    )
    .execute(&pool)
    .await?;
    Ok(pool)
}

/// One write to the register (a permit's own, for a semaphore): the fence check and
/// the write commit together.
async fn fenced_write(
    register: &SqlitePool,
    worker: usize,
    token: u64,
    permit: Option<u32>,
) -> anyhow::Result<bool> {
    let resource = match permit {
        Some(permit) => format!("{REGISTER}#{permit}"),
        None => REGISTER.to_owned(),
    };
    let mut transaction = register.begin().await?;
    let outcome =
        fence::check_and_record(&mut transaction, &resource, FencingToken::new(token)).await?;
    if !matches!(outcome, FenceOutcome::Applied) {
        return Ok(false);
    }
    sqlx::query("INSERT INTO verify_writes (worker, token, permit, t) VALUES (?1, ?2, ?3, ?4)")
        .bind(i64::try_from(worker)?)
        .bind(i64::try_from(token)?)
        .bind(i64::from(permit.unwrap_or(0)))
        .bind(i64::try_from(monotonic_ns())?)
        .execute(&mut *transaction)
        .await?;
    transaction.commit().await?;
    Ok(true)
}

/// Runs one worker until `--until-ns`.
pub(crate) async fn run(args: WorkerArgs) -> ExitCode {
    match work(&args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("turnstile verify worker {}: {error:#}", args.worker);
            ExitCode::from(crate::exit::SOFTWARE)
        }
    }
}

fn record(history: &Mutex<HistoryWriter>, event: &Event) {
    history
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .record(event);
}

async fn work(args: &WorkerArgs) -> anyhow::Result<()> {
    let history = Arc::new(Mutex::new(HistoryWriter::create(&args.history)?));
    let register = open_register(&args.register).await?;
    let worker = Some(args.worker);
    // The store may be down or cut off when a worker starts (a fault under way): keep
    // trying until the run ends.
    let locker = loop {
        match Locker::connect(&args.store).await {
            Ok(locker) => break locker,
            Err(error) if monotonic_ns() < args.until_ns => {
                record(
                    &history,
                    &Event::now(EventKind::Fail, worker).detail(error.to_string()),
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(error) => return Err(error.into()),
        }
    };
    let options = LockOptions::new()
        .ttl(args.ttl)
        .wait(2 * args.ttl + Duration::from_secs(1));
    // Holds up to one TTL: some outlast a partition's first renewals, so the lost
    // signal has to stop them.
    let ttl_ms = u64::try_from(args.ttl.as_millis()).unwrap_or(u64::MAX);
    while monotonic_ns() < args.until_ns {
        record(&history, &Event::now(EventKind::Invoke, worker));
        let (guard, permit) = match take(&locker, args, &options).await {
            Ok(taken) => taken,
            Err(error) => {
                record(
                    &history,
                    &Event::now(EventKind::Fail, worker).detail(error.to_string()),
                );
                let pause = 5 + rand::random::<u64>() % 45;
                tokio::time::sleep(Duration::from_millis(pause)).await;
                continue;
            }
        };
        let token = guard.fencing_token().get();
        record(
            &history,
            &Event::now(EventKind::Ok, worker)
                .token(token)
                .permit(permit),
        );
        // The lost signal is recorded the moment it fires, whatever the worker is doing.
        let lost_watch = {
            let history = Arc::clone(&history);
            let lost = guard.lost();
            tokio::spawn(async move {
                let reason = lost.await;
                record(
                    &history,
                    &Event::now(EventKind::Lost, worker)
                        .token(token)
                        .permit(permit)
                        .detail(format!("{reason:?}")),
                );
            })
        };
        let hold = Duration::from_millis(rand::random::<u64>() % (ttl_ms + 1));
        // The protected work: a write, a hold, a second write. A careful holder checks
        // its lost signal before each write; the fence still stops the write that a
        // pause made stale between the check and the write.
        for step in 0..2 {
            if step == 1 {
                tokio::select! {
                    () = tokio::time::sleep(hold) => {}
                    _ = guard.lost() => {}
                }
            }
            if guard.is_lost() {
                break;
            }
            let outcome = match fenced_write(&register, args.worker, token, permit).await {
                Ok(true) => "accepted".to_owned(),
                Ok(false) => "rejected".to_owned(),
                Err(error) => format!("error: {error}"),
            };
            record(
                &history,
                &Event::now(EventKind::Write, worker)
                    .token(token)
                    .permit(permit)
                    .outcome(outcome),
            );
        }
        record(
            &history,
            &Event::now(EventKind::SectionEnd, worker)
                .token(token)
                .permit(permit),
        );
        let released = match guard.release().await {
            Ok(outcome) => format!("{outcome:?}"),
            Err(error) => format!("error: {error}"),
        };
        // Let a signal that fired during the release be recorded, then stop watching.
        tokio::task::yield_now().await;
        lost_watch.abort();
        record(
            &history,
            &Event::now(EventKind::Released, worker)
                .token(token)
                .permit(permit)
                .outcome(released),
        );
    }
    Ok(())
}
