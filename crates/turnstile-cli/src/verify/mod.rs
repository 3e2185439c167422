//! `turnstile verify lock`: a fault campaign against a real store, with a checker that
//! reads only the history, and a report.
//!
//! Worker processes (this binary run again) loop acquire → fenced write → hold → fenced
//! write → release, recording every step on the host's monotonic clock. A nemesis
//! pauses holders with `SIGSTOP` past their TTL, cuts one worker's path to the store
//! (a built-in TCP proxy that stops forwarding without resetting anything), closes a
//! worker's connections (so the server sees its session end), restarts the store, or
//! steps the store host's clock through a command the user gives. The checker then
//! decides, from the history and the fenced register alone: the register never
//! accepted a smaller token after a larger one; every overlap of two holders is
//! explained by a fault the engine does not promise to survive; tokens increase; and
//! every fault-free window made progress.

mod check;
mod history;
#[cfg(all(feature = "postgres", feature = "mysql"))]
pub(crate) mod idempotency;
#[cfg(feature = "nats")]
mod outbox;
mod report;
pub(crate) mod worker;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Subcommand, ValueEnum};
use serde::Serialize;
use tokio::process::{Child, Command};
use turnstile_test_support::TcpProxy;

use check::{AcceptedWrite, RunCheck, RunFacts};
use history::{Event, EventKind, HistoryWriter, monotonic_ns};

/// Verification campaigns.
#[derive(Subcommand, Debug)]
pub(crate) enum VerifyCommand {
    /// Run worker processes that contend for one lock while faults are injected, then
    /// check the history: the fenced register never went back, every overlap of two
    /// holders is explained by a fault the engine does not promise to survive, tokens
    /// increase, and every fault-free window made progress. Exit status 0 when every
    /// check of every run passed, 1 when one did not, 64 bad input, 69 store
    /// unavailable.
    Lock(VerifyLockArgs),
    /// `verify lock` for leader election: workers campaign (advertising a value where
    /// the store keeps one), and each leader writes to the fenced register with its
    /// epoch. The same checks: epochs never go back in the register, two leaders at
    /// once only under a fault the engine does not promise to survive, epochs
    /// increase, and a leader is elected in every fault-free window.
    Election(VerifyLockArgs),
    /// `verify lock` for a semaphore of `--permits`: each worker holds one permit, and
    /// each permit has its own fenced register. The checks of a lock, per permit, and
    /// one more: never more holders than permits at once, beyond overlaps a fault
    /// explains.
    Semaphore(VerifySemaphoreArgs),
    /// Enqueue messages into an SQLite outbox (one transaction in seven rolled back)
    /// while relay processes publish them to a NATS JetStream stream this command
    /// starts and a consumer handles them through its inbox; kill relays and stop the
    /// broker for longer than its duplicate window; then check that every committed
    /// message was handled exactly once, nothing rolled back was handled, and each
    /// key's messages were handled in order. Exit status as for `verify lock`.
    #[cfg(feature = "nats")]
    Outbox(outbox::VerifyOutboxArgs),
    /// Send payments with `Idempotency-Key`s to several service instances (processes
    /// with the idempotency layer over the store), dropping responses and retrying,
    /// the same keys in other tenants too, while instances are killed mid-request and
    /// paused past their lease and the store restarts; then check that each request
    /// had one effect (beyond what the mode does not promise: the lease mode runs a
    /// killed or frozen handler's request again), every answer was the request's own,
    /// and every request was answered. Exit status as for `verify lock`.
    #[cfg(all(feature = "postgres", feature = "mysql"))]
    Idempotency(idempotency::VerifyIdempotencyArgs),
}

/// A fault the nemesis can inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Fault {
    /// Freeze the worker holding the lock (SIGSTOP) for 1.5 to 3 TTLs, then SIGCONT.
    Pause,
    /// Cut one worker's path to the store for 1.5 to 3 TTLs: nothing passes, nothing
    /// is reset (needs a store on a loopback address).
    Partition,
    /// Close the holder's connections to the store on both sides, so the server sees
    /// its session end (needs a store on a loopback address).
    KillConn,
    /// Restart the store: a server this command started, or `--restart-cmd`.
    Restart,
    /// Step the store host's clock with `--clock-cmd`.
    Clock,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::Pause => "pause",
            Fault::Partition => "partition",
            Fault::KillConn => "kill-conn",
            Fault::Restart => "restart",
            Fault::Clock => "clock",
        }
    }
}

/// `turnstile verify lock`.
#[derive(Args, Debug)]
pub(crate) struct VerifyLockArgs {
    /// The store: a URL (sqlite://, redis://, postgres://, mysql://, etcd://, zk://), or
    /// one of `sqlite`, `redis`, `postgres`, `postgres-session`, `mariadb`, `etcd`,
    /// `zookeeper` to start a private server of that kind for the campaign (it can then
    /// restart it, Redis empty), or `redis-sentinel` (a restart is a failover),
    /// `redlock` (five nodes, one restarted empty) or `etcd-cluster` (three members,
    /// one restarted).
    #[arg(long, value_name = "URL|KIND")]
    store: String,
    /// Worker processes contending for the lock.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Length of one run.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// The lock's TTL.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    ttl: Duration,
    /// Faults to inject, in turn, with quiet periods between.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "pause,partition,kill-conn,restart"
    )]
    faults: Vec<Fault>,
    /// Shell command that restarts the store (for a store given by URL).
    #[arg(long, value_name = "CMD")]
    restart_cmd: Option<String>,
    /// Shell command that steps the store host's clock.
    #[arg(long, value_name = "CMD")]
    clock_cmd: Option<String>,
    /// Runs, each with its own lock name, register and verdict.
    #[arg(long, default_value_t = 1)]
    runs: u32,
    /// Where histories, `summary.json` and `report.html` go.
    #[arg(long, value_name = "DIR", default_value = "turnstile-verify")]
    report: PathBuf,
    /// Print the summary as JSON on stdout.
    #[arg(long)]
    json: bool,
}

/// `turnstile verify semaphore`.
#[derive(Args, Debug)]
pub(crate) struct VerifySemaphoreArgs {
    #[command(flatten)]
    lock: VerifyLockArgs,
    /// The semaphore's permits (fewer than --workers, so that workers contend).
    #[arg(long, default_value_t = 3)]
    permits: u32,
}

/// What a campaign verifies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Primitive {
    /// A lock.
    Lock,
    /// Leadership of an election.
    Election,
    /// A permit of a semaphore.
    Semaphore,
}

impl Primitive {
    fn name(self) -> &'static str {
        match self {
            Primitive::Lock => "lock",
            Primitive::Election => "election",
            Primitive::Semaphore => "semaphore",
        }
    }
}

/// A primitive and, for a semaphore, its permits.
#[derive(Debug, Clone, Copy)]
struct Target {
    primitive: Primitive,
    permits: u32,
}

/// How the store is reached and faulted.
enum Store {
    Url(String),
    Sqlite(PathBuf),
    Redis(turnstile_test_support::RedisServer),
    Postgres(turnstile_test_support::PostgresServer, bool),
    MariaDb(turnstile_test_support::MariaDbServer, String),
    Etcd(turnstile_test_support::EtcdServer),
    ZooKeeper(turnstile_test_support::ZooKeeperServer),
    /// A master, a replica and three sentinels; a restart is a failover (the master
    /// killed, the replica promoted, the old master back as a replica, empty).
    RedisSentinel(turnstile_test_support::RedisSentinelGroup),
    /// Five independent Redis nodes; a restart brings one of them back empty.
    RedLock(Vec<turnstile_test_support::RedisServer>),
    /// Three etcd members; a restart kills one and starts it again with its data.
    EtcdCluster(turnstile_test_support::EtcdCluster),
}

impl Store {
    fn start(spec: &str, report: &Path) -> anyhow::Result<Store> {
        use turnstile_test_support as servers;
        Ok(match spec {
            "sqlite" => Store::Sqlite(report.join("locks.sqlite3")),
            "redis" => Store::Redis(servers::RedisServer::spawn()),
            "postgres" => Store::Postgres(servers::PostgresServer::spawn(), false),
            "postgres-session" => Store::Postgres(servers::PostgresServer::spawn(), true),
            "mariadb" => {
                let server = servers::MariaDbServer::spawn();
                let url = server.fresh_database("verify");
                Store::MariaDb(server, url)
            }
            "etcd" => Store::Etcd(servers::EtcdServer::spawn()),
            "zookeeper" => Store::ZooKeeper(servers::ZooKeeperServer::spawn()),
            "redis-sentinel" => Store::RedisSentinel(servers::RedisSentinelGroup::spawn()),
            "redlock" => Store::RedLock((0..5).map(|_| servers::RedisServer::spawn()).collect()),
            "etcd-cluster" => Store::EtcdCluster(servers::EtcdCluster::spawn(3)),
            url if url.contains("://") => Store::Url(url.to_owned()),
            other => anyhow::bail!(
                "--store {other:?} is neither a URL nor one of sqlite, redis, postgres, postgres-session, mariadb, etcd, zookeeper, redis-sentinel, redlock, etcd-cluster"
            ),
        })
    }

    fn url(&self) -> String {
        match self {
            Store::Url(url) => url.clone(),
            Store::Sqlite(path) => format!("sqlite://{}", path.display()),
            Store::Redis(server) => server.url(),
            Store::Postgres(server, false) => server.url(),
            Store::Postgres(server, true) => format!("{}?turnstile_mode=session", server.url()),
            Store::MariaDb(_, url) => url.clone(),
            Store::Etcd(server) => server.url(),
            Store::ZooKeeper(server) => server.url(),
            Store::RedisSentinel(group) => group.url(),
            Store::RedLock(nodes) => {
                let hosts: Vec<String> = nodes
                    .iter()
                    .map(|node| format!("127.0.0.1:{}", node.port()))
                    .collect();
                format!("redlock://{}", hosts.join(","))
            }
            Store::EtcdCluster(cluster) => cluster.url(),
        }
    }

    /// The engine, for what its guarantees table promises.
    fn engine(&self) -> &'static str {
        let url = self.url();
        let scheme = url.split("://").next().unwrap_or("");
        match scheme {
            "redis" | "rediss" | "redis+cluster" => "redis",
            "redis+sentinel" => "redis-sentinel",
            "redlock" => "redlock",
            "postgres" | "postgresql" if url.contains("turnstile_mode=session") => {
                "postgres-session"
            }
            "postgres" | "postgresql" => "postgres",
            "mysql" | "mariadb" => "mysql",
            "etcd" => "etcd",
            "zk" | "zookeeper" => "zookeeper",
            "sqlite" => "sqlite",
            _ => "unknown",
        }
    }

    /// Faults whose overlaps the engine's guarantees table does not promise to
    /// prevent: a frozen holder cannot act on its lost signal, nor can any engine
    /// survive a clock step on its host; locks kept in server memory or in a session
    /// do not survive a restart; a session lock ends with its connection.
    fn explaining_faults(&self) -> Vec<String> {
        let mut faults = vec!["pause".to_owned(), "clock".to_owned()];
        match self.engine() {
            // Redis without persistence comes back empty; a Sentinel failover can lose
            // the last writes (asynchronous replication); a RedLock node restarted empty
            // can give a second holder its majority.
            "redis" | "redis-sentinel" | "redlock" | "unknown" => faults.push("restart".into()),
            // Lease rows commit asynchronously unless `turnstile_sync_commit=on`: a
            // crash can lose the last acquisitions (the guarantees table says so), and
            // the holder learns it at its next renewal; the fence keeps it out.
            "postgres" if !self.url().contains("turnstile_sync_commit=on") => {
                faults.push("restart".into());
            }
            "postgres-session" | "mysql" => {
                faults.push("restart".into());
                faults.push("kill-conn".into());
            }
            _ => {}
        }
        faults
    }

    /// The store's loopback port, when it has one a proxy can stand in front of.
    fn loopback_port(&self) -> Option<u16> {
        let url = self.url();
        let rest = url.split_once("://")?.1;
        let authority = rest.split(['/', '?']).next()?;
        let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
        if host_port.contains(',') {
            return None;
        }
        let (host, port) = host_port.rsplit_once(':')?;
        matches!(host, "127.0.0.1" | "localhost")
            .then(|| port.parse().ok())
            .flatten()
    }

    fn can_restart(&self, restart_cmd: Option<&str>) -> bool {
        match self {
            Store::Url(_) => restart_cmd.is_some(),
            Store::Sqlite(_) => false,
            _ => true,
        }
    }

    /// Restarts the store (blocking).
    fn restart(&self, restart_cmd: Option<&str>) -> anyhow::Result<()> {
        match self {
            Store::Url(_) => return run_shell(restart_cmd.unwrap_or("false")),
            Store::Sqlite(_) => {}
            Store::Redis(server) => server.restart(),
            Store::Postgres(server, _) => server.crash_and_restart(),
            Store::MariaDb(server, _) => server.restart(),
            Store::Etcd(server) => server.restart(),
            Store::ZooKeeper(server) => server.start_again(),
            Store::RedisSentinel(group) => {
                let old = group.kill_master();
                group.wait_for_a_new_master(old, Duration::from_secs(30));
                // The fault lasts until the old master is a replica again: while it
                // is back as a second, empty master, clients may still reach it.
                group.start_again(old, Duration::from_secs(30));
            }
            Store::RedLock(nodes) => nodes[rand::random::<u64>() as usize % nodes.len()].restart(),
            Store::EtcdCluster(cluster) => {
                cluster.member(rand::random::<u64>() as usize % 3).restart()
            }
        }
        Ok(())
    }
}

fn run_shell(command: &str) -> anyhow::Result<()> {
    let status = std::process::Command::new("sh")
        .arg("-c")
        .arg(command)
        .status()?;
    anyhow::ensure!(status.success(), "`{command}` failed: {status}");
    Ok(())
}

/// One run's outcome, as the summary shows it.
#[derive(Debug, Serialize)]
struct RunSummary {
    run: u32,
    passed: bool,
    #[serde(flatten)]
    check: RunCheck,
}

/// The whole campaign.
#[derive(Debug, Serialize)]
struct Summary {
    /// `lock`, `election` or `semaphore`.
    primitive: Primitive,
    /// A semaphore's permits.
    #[serde(skip_serializing_if = "Option::is_none")]
    permits: Option<u32>,
    engine: &'static str,
    store: String,
    workers: usize,
    ttl_ms: u128,
    duration_ms: u128,
    faults: Vec<Fault>,
    skipped_faults: Vec<String>,
    passed: bool,
    runs: Vec<RunSummary>,
}

/// Runs `turnstile verify lock`.
pub(crate) async fn run(command: VerifyCommand) -> ExitCode {
    let (args, target) = match command {
        VerifyCommand::Lock(args) => (
            args,
            Target {
                primitive: Primitive::Lock,
                permits: 1,
            },
        ),
        VerifyCommand::Election(args) => (
            args,
            Target {
                primitive: Primitive::Election,
                permits: 1,
            },
        ),
        VerifyCommand::Semaphore(args) => (
            args.lock,
            Target {
                primitive: Primitive::Semaphore,
                permits: args.permits,
            },
        ),
        #[cfg(feature = "nats")]
        VerifyCommand::Outbox(args) => return outbox::run(args).await,
        #[cfg(all(feature = "postgres", feature = "mysql"))]
        VerifyCommand::Idempotency(args) => return idempotency::run(args).await,
    };
    let command = format!("verify {}", target.primitive.name());
    exit_code(verify_lock(args, target).await, &command)
}

/// The exit status of a campaign: 0 passed, 1 a check failed, 64 bad input (the
/// error names an option), 69 the store or a server could not be used.
fn exit_code(result: anyhow::Result<bool>, command: &str) -> ExitCode {
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(error) => {
            eprintln!("turnstile {command}: {error:#}");
            let usage = error.to_string().starts_with("--");
            ExitCode::from(if usage {
                crate::exit::USAGE
            } else {
                crate::exit::UNAVAILABLE
            })
        }
    }
}

async fn verify_lock(args: VerifyLockArgs, target: Target) -> anyhow::Result<bool> {
    anyhow::ensure!(
        (1..=256).contains(&args.workers),
        "--workers must be between 1 and 256"
    );
    if target.primitive == Primitive::Semaphore {
        anyhow::ensure!(
            (1..=turnstile::semaphore::MAX_PERMITS).contains(&target.permits),
            "--permits must be between 1 and {}",
            turnstile::semaphore::MAX_PERMITS
        );
        anyhow::ensure!(
            usize::try_from(target.permits).is_ok_and(|permits| permits < args.workers),
            "--permits must be fewer than --workers ({}), or nobody contends",
            args.workers
        );
    }
    anyhow::ensure!(
        args.ttl >= Duration::from_millis(100),
        "--ttl must be at least 100ms"
    );
    let shortest = WARM_UP + quiet_end(args.ttl) + 3 * args.ttl + Duration::from_millis(500);
    anyhow::ensure!(
        args.duration >= shortest,
        "--duration must be at least {}ms with a TTL of {}ms: a warm-up, one fault, recovery and a quiet window",
        shortest.as_millis(),
        args.ttl.as_millis()
    );
    std::fs::create_dir_all(&args.report)?;
    let spec = args.store.clone();
    let report_dir = args.report.clone();
    let store =
        Arc::new(tokio::task::spawn_blocking(move || Store::start(&spec, &report_dir)).await??);
    // The store must answer before the campaign starts.
    let locker = turnstile::lock::Locker::connect(&store.url())
        .await
        .map_err(|error| anyhow::anyhow!("cannot reach the store: {error}"))?;
    if target.primitive == Primitive::Semaphore {
        // An engine without semaphores (RedLock) is named now, not by every worker's
        // acquire failing for the whole run.
        turnstile::semaphore::Semaphore::new(locker)
            .stored_permits("turnstile-verify-probe")
            .await
            .map_err(|error| anyhow::anyhow!("this store cannot verify semaphores: {error}"))?;
    }
    let port = store.loopback_port();
    let mut faults = Vec::new();
    let mut skipped = Vec::new();
    for &fault in &args.faults {
        let available = match fault {
            Fault::Pause => true,
            Fault::Partition | Fault::KillConn => port.is_some(),
            Fault::Restart => store.can_restart(args.restart_cmd.as_deref()),
            Fault::Clock => args.clock_cmd.is_some(),
        };
        if available {
            faults.push(fault);
        } else {
            let why = match fault {
                Fault::Partition | Fault::KillConn => {
                    "the store has no single loopback address to proxy"
                }
                Fault::Restart => {
                    "give --restart-cmd for a store given by URL (an SQLite file has no server)"
                }
                _ => "give --clock-cmd",
            };
            eprintln!("turnstile verify: skipping {}: {why}", fault.name());
            skipped.push(format!("{}: {why}", fault.name()));
        }
    }
    let mut summary = Summary {
        primitive: target.primitive,
        permits: (target.primitive == Primitive::Semaphore).then_some(target.permits),
        engine: store.engine(),
        store: turnstile::store::redact(&store.url()),
        workers: args.workers,
        ttl_ms: args.ttl.as_millis(),
        duration_ms: args.duration.as_millis(),
        faults: faults.clone(),
        skipped_faults: skipped,
        passed: true,
        runs: Vec::new(),
    };
    // Faults are injected in turn across runs, so short runs together cover every kind.
    let mut injected = 0;
    for run in 1..=args.runs {
        let run_dir = args.report.join(format!("run-{run:03}"));
        if run_dir.exists() {
            std::fs::remove_dir_all(&run_dir)?;
        }
        std::fs::create_dir_all(&run_dir)?;
        let mut order = faults.clone();
        order.rotate_left(injected % faults.len().max(1));
        let check = one_run(&args, target, &store, port, &order, run, &run_dir).await?;
        injected += check.fault_windows.len();
        let passed = check.passed();
        summary.passed &= passed;
        eprintln!("{}", report::one_line(run, args.runs, &check));
        summary.runs.push(RunSummary { run, passed, check });
    }
    std::fs::write(
        args.report.join("summary.json"),
        serde_json::to_vec_pretty(&summary)?,
    )?;
    std::fs::write(
        args.report.join("report.html"),
        report::html(&summary_view(&summary)),
    )?;
    if args.json {
        println!("{}", serde_json::to_string(&summary)?);
    }
    eprintln!(
        "turnstile verify: {} ({} runs); report: {}",
        if summary.passed { "passed" } else { "FAILED" },
        summary.runs.len(),
        args.report.join("report.html").display()
    );
    Ok(summary.passed)
}

fn summary_view(summary: &Summary) -> report::View<'_> {
    report::View {
        primitive: summary.primitive.name(),
        engine: summary.engine,
        store: &summary.store,
        workers: summary.workers,
        ttl_ms: summary.ttl_ms,
        passed: summary.passed,
        skipped_faults: &summary.skipped_faults,
        runs: summary
            .runs
            .iter()
            .map(|run| (run.run, &run.check))
            .collect(),
    }
}

/// A worker process and what the nemesis needs to reach it.
struct Worker {
    child: Child,
    proxy: Option<TcpProxy>,
}

async fn one_run(
    args: &VerifyLockArgs,
    target: Target,
    store: &Arc<Store>,
    port: Option<u16>,
    faults: &[Fault],
    run: u32,
    run_dir: &Path,
) -> anyhow::Result<RunCheck> {
    let started_ns = monotonic_ns();
    let duration_ns = u64::try_from(args.duration.as_nanos()).unwrap_or(u64::MAX);
    let ended_ns = started_ns + duration_ns;
    let register = run_dir.join("register.sqlite3");
    // Created before any worker opens it.
    drop(worker::open_register(&register).await?);
    let name = format!("turnstile-verify-{}-{run}", std::process::id());
    let exe = std::env::current_exe()?;
    let mut workers = Vec::new();
    for index in 0..args.workers {
        let proxy = port.map(TcpProxy::start);
        let url = match &proxy {
            Some(proxy) => proxy.url_for(&store.url()),
            None => store.url(),
        };
        let log = std::fs::File::create(run_dir.join(format!("worker-{index}.log")))?;
        let child = Command::new(&exe)
            .arg("verify-worker")
            .arg("--store")
            .arg(&url)
            .arg("--name")
            .arg(&name)
            .arg("--ttl")
            .arg(format!("{}ms", args.ttl.as_millis()))
            .arg("--worker")
            .arg(index.to_string())
            .arg("--history")
            .arg(run_dir.join(format!("worker-{index}.jsonl")))
            .arg("--register")
            .arg(&register)
            .arg("--until-ns")
            .arg(ended_ns.to_string())
            .arg("--primitive")
            .arg(target.primitive.name())
            .arg("--permits")
            .arg(target.permits.to_string())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()?;
        workers.push(Worker { child, proxy });
    }
    let mut nemesis_history = HistoryWriter::create(&run_dir.join("nemesis.jsonl"))?;
    nemesis(
        args,
        store,
        &workers,
        faults,
        run_dir,
        ended_ns,
        &mut nemesis_history,
    )
    .await;
    // Workers stop on their own at the end (the nemesis may finish well before it); one
    // stuck in a store call gets a few TTLs more.
    let now = monotonic_ns();
    if now < ended_ns {
        tokio::time::sleep(Duration::from_nanos(ended_ns - now)).await;
    }
    let grace = 3 * args.ttl + Duration::from_secs(5);
    for (index, worker) in workers.iter_mut().enumerate() {
        if let Some(pid) = worker.child.id() {
            // A worker left paused would never stop.
            signal(pid, libc::SIGCONT);
        }
        if tokio::time::timeout(grace, worker.child.wait())
            .await
            .is_err()
        {
            // Killed, it stops working: the checker ends its hold here.
            nemesis_history.record(&Event::now(EventKind::FaultStart, Some(index)).fault("killed"));
            let _ = worker.child.kill().await;
        }
    }
    let events = history::read_all(run_dir)?;
    let accepted = read_register(&register).await?;
    let facts = RunFacts {
        started_ns,
        ended_ns,
        ttl_ns: u64::try_from(args.ttl.as_nanos()).unwrap_or(u64::MAX),
        explaining_faults: store.explaining_faults(),
        permits: (target.primitive == Primitive::Semaphore).then_some(target.permits),
    };
    let check = check::check(&events, &accepted, &facts);
    std::fs::write(
        run_dir.join("check.json"),
        serde_json::to_vec_pretty(&check)?,
    )?;
    Ok(check)
}

async fn read_register(path: &Path) -> anyhow::Result<Vec<AcceptedWrite>> {
    let pool = worker::open_register(path).await?;
    let rows: Vec<(i64, i64, i64)> =
        sqlx::query_as("SELECT worker, token, permit FROM verify_writes ORDER BY seq")
            .fetch_all(&pool)
            .await?;
    Ok(rows
        .into_iter()
        .map(|(worker, token, permit)| AcceptedWrite {
            worker: usize::try_from(worker).unwrap_or(usize::MAX),
            token: u64::try_from(token).unwrap_or(0),
            permit: u32::try_from(permit).unwrap_or(u32::MAX),
        })
        .collect())
}

fn signal(pid: u32, signal: libc::c_int) {
    if let Ok(pid) = libc::pid_t::try_from(pid) {
        // SAFETY: sending a signal to a child we started; an exited one is harmless.
        unsafe { libc::kill(pid, signal) };
    }
}

/// The worker holding the lock now, from the histories written so far (a worker whose
/// last `ok` has no `released` after it), else a random one.
fn current_holder(run_dir: &Path, workers: usize) -> usize {
    let events = history::read_all(run_dir).unwrap_or_default();
    let mut holding = vec![false; workers];
    for event in events {
        let Some(worker) = event.worker.filter(|&w| w < workers) else {
            continue;
        };
        match event.kind {
            EventKind::Ok => holding[worker] = true,
            EventKind::Released => holding[worker] = false,
            _ => {}
        }
    }
    holding
        .iter()
        .position(|&held| held)
        .unwrap_or_else(|| (rand::random::<u64>() % workers as u64) as usize)
}

fn between(low: Duration, high: Duration) -> Duration {
    let span = u64::try_from(high.saturating_sub(low).as_millis()).unwrap_or(0);
    low + Duration::from_millis(rand::random::<u64>() % (span + 1))
}

/// How long workers run before the first fault.
const WARM_UP: Duration = Duration::from_millis(1500);

/// The fault-free end of a run: recovery (as the checker allows it) and a window in
/// which progress is expected.
fn quiet_end(ttl: Duration) -> Duration {
    2 * ttl + Duration::from_secs(2) + (4 * ttl).max(Duration::from_secs(3))
}

/// Injects faults in turn until the run's quiet end, recording each in the history.
async fn nemesis(
    args: &VerifyLockArgs,
    store: &Arc<Store>,
    workers: &[Worker],
    faults: &[Fault],
    run_dir: &Path,
    ended_ns: u64,
    history: &mut HistoryWriter,
) {
    let ttl = args.ttl;
    let last_start_ns =
        ended_ns.saturating_sub(u64::try_from((quiet_end(ttl) + 3 * ttl).as_nanos()).unwrap_or(0));
    tokio::time::sleep(WARM_UP).await;
    let mut next = 0;
    while !faults.is_empty() && monotonic_ns() < last_start_ns {
        let fault = faults[next % faults.len()];
        next += 1;
        let target = current_holder(run_dir, workers.len());
        let length = between(ttl + ttl / 2, 3 * ttl);
        let targeted = matches!(fault, Fault::Pause | Fault::Partition | Fault::KillConn);
        let target_field = targeted.then_some(target);
        history.record(&Event::now(EventKind::FaultStart, target_field).fault(fault.name()));
        match fault {
            Fault::Pause => {
                if let Some(pid) = workers[target].child.id() {
                    signal(pid, libc::SIGSTOP);
                    tokio::time::sleep(length).await;
                    signal(pid, libc::SIGCONT);
                }
            }
            Fault::Partition => {
                if let Some(proxy) = &workers[target].proxy {
                    proxy.cut();
                    tokio::time::sleep(length).await;
                    proxy.heal();
                }
            }
            Fault::KillConn => {
                if let Some(proxy) = &workers[target].proxy {
                    proxy.close_connections();
                }
            }
            Fault::Restart => {
                let store = Arc::clone(store);
                let command = args.restart_cmd.clone();
                let restarted =
                    tokio::task::spawn_blocking(move || store.restart(command.as_deref())).await;
                if let Ok(Err(error)) = restarted {
                    history.record(
                        &Event::now(EventKind::FaultEnd, None)
                            .fault("restart-failed")
                            .detail(error.to_string()),
                    );
                }
            }
            Fault::Clock => {
                if let Some(command) = args.clock_cmd.clone() {
                    let _ = tokio::task::spawn_blocking(move || run_shell(&command)).await;
                }
            }
        }
        history.record(&Event::now(EventKind::FaultEnd, target_field).fault(fault.name()));
        // A quiet period: recovery plus a window in which progress is expected.
        let quiet = between(
            2 * ttl + Duration::from_secs(2),
            3 * ttl + Duration::from_secs(3),
        ) + (4 * ttl).max(Duration::from_secs(3));
        let now = monotonic_ns();
        if now >= ended_ns {
            break;
        }
        let left = Duration::from_nanos(ended_ns - now);
        tokio::time::sleep(quiet.min(left)).await;
    }
}
