//! `turnstile bench failover`: how long an election goes without a leader when its
//! leader's process is killed, from the `SIGKILL` to the waiting candidate leading.
//!
//! Each round starts a leader process (this binary again, with the hidden
//! `--as-leader`), waits for it to lead, starts a candidate's campaign in this process,
//! lets it wait, kills the leader with `SIGKILL` (no release, no resign: a crash) and
//! times the candidate's campaign. A killed leader's lease runs out in the store, or
//! its session ends where the store notices that (a closed connection for MySQL and
//! PostgreSQL session mode): so the expected failover is at most the TTL plus the
//! candidate's wake-up, and the number the goal is written in is the excess
//! over the TTL. With `--raw` on etcd the same rounds use etcd's own election RPC
//! (`Campaign` on a lease kept alive every TTL/3), the peer.

use std::process::{ExitCode, Stdio};
use std::time::Duration;

use clap::Args;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::time::Instant;
use turnstile::election::Election;
use turnstile::lock::LockOptions;

use crate::exit;

/// Options of `turnstile bench failover`.
#[derive(Args, Debug)]
pub(crate) struct FailoverArgs {
    /// The store (any lock store URL).
    #[arg(long, value_name = "URL")]
    store: String,
    /// The leader's lease.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    ttl: Duration,
    /// Rounds, each a leader killed and a candidate elected.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    rounds: u32,
    /// Use etcd's election RPC instead of the library (etcd:// stores; needs the `etcd`
    /// feature): the peer to compare with.
    #[arg(long)]
    raw: bool,
    /// Internal: lead the election of this name and stay until killed.
    #[arg(long, hide = true, value_name = "NAME")]
    as_leader: Option<String>,
}

/// Runs `turnstile bench failover`.
pub(crate) async fn run(args: FailoverArgs) -> ExitCode {
    if args.ttl < Duration::from_millis(100) {
        eprintln!("turnstile bench failover: --ttl must be at least 100ms");
        return ExitCode::from(exit::USAGE);
    }
    let outcome = match &args.as_leader {
        Some(name) => lead_until_killed(&args, name).await,
        None => measure(&args).await,
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("turnstile bench failover: {error}");
            ExitCode::from(exit::UNAVAILABLE)
        }
    }
}

/// A campaign's options: the lease, and no bound on the wait.
fn options(ttl: Duration) -> LockOptions {
    LockOptions::new().ttl(ttl).wait_forever()
}

/// The leader process: campaigns, says so on stdout, and keeps leading (the watchdog
/// renews, or for `--raw` the lease is kept alive) until it is killed.
async fn lead_until_killed(args: &FailoverArgs, name: &str) -> Result<(), String> {
    if args.raw {
        return raw::lead_until_killed(args, name).await;
    }
    let election = Election::connect(&args.store)
        .await
        .map_err(|error| error.to_string())?;
    let leadership = election
        .campaign(name, "", &options(args.ttl))
        .await
        .map_err(|error| error.to_string())?;
    println!("leading {}", leadership.epoch().get());
    let reason = leadership.lost().await;
    Err(format!(
        "the leader lost its leadership before it was killed: {reason}"
    ))
}

/// A candidate's campaign in this process, started before the leader is killed.
enum Candidate {
    Library(Election),
    #[cfg(feature = "etcd")]
    Raw(Box<etcd_client::Client>),
}

impl Candidate {
    /// Waits to lead `name`, then steps down; answers when it led.
    async fn campaign(&self, name: &str, ttl: Duration) -> Result<Instant, String> {
        match self {
            Candidate::Library(election) => {
                let leadership = election
                    .campaign(name, "", &options(ttl))
                    .await
                    .map_err(|error| error.to_string())?;
                let elected = Instant::now();
                leadership
                    .resign()
                    .await
                    .map_err(|error| error.to_string())?;
                Ok(elected)
            }
            #[cfg(feature = "etcd")]
            Candidate::Raw(client) => raw::campaign(client, name, ttl).await,
        }
    }
}

async fn measure(args: &FailoverArgs) -> Result<(), String> {
    let candidate = if args.raw {
        raw::candidate(&args.store).await?
    } else {
        Candidate::Library(
            Election::connect(&args.store)
                .await
                .map_err(|error| error.to_string())?,
        )
    };
    let exe = std::env::current_exe().map_err(|error| error.to_string())?;
    let mut failovers_ms = Vec::new();
    for round in 0..args.rounds {
        let name = format!("bench-failover-{}-{round}", std::process::id());
        let mut leader = tokio::process::Command::new(&exe);
        leader
            .args(["bench", "failover", "--store", &args.store, "--ttl"])
            .arg(format!("{}ms", args.ttl.as_millis()))
            .args(["--as-leader", &name])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .kill_on_drop(true);
        if args.raw {
            leader.arg("--raw");
        }
        let mut leader = leader.spawn().map_err(|error| error.to_string())?;
        let stdout = leader.stdout.take().ok_or("the leader has no stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .map_err(|_| "the leader did not lead within 30 s".to_owned())?
            .map_err(|error| error.to_string())?;
        if !first.is_some_and(|line| line.starts_with("leading")) {
            return Err("the leader process ended before it led".into());
        }
        let campaign = candidate.campaign(&name, args.ttl);
        tokio::pin!(campaign);
        // The candidate is waiting when the leader dies (as a standby instance is), and
        // the kill falls anywhere between two of the leader's renewals (every TTL/3),
        // so that the rounds sample how much of its lease a crashed leader leaves.
        let renewal_ms = u64::try_from(args.ttl.as_millis() / 3).unwrap_or(1).max(1);
        let before_kill = Duration::from_millis(300 + rand::random::<u64>() % renewal_ms);
        let early = tokio::time::timeout(before_kill, &mut campaign).await;
        if early.is_ok() {
            return Err("the candidate led while the leader was alive".into());
        }
        let killed = Instant::now();
        leader.start_kill().map_err(|error| error.to_string())?;
        let elected = campaign.await?;
        let _ = leader.wait().await;
        let failover = elected.saturating_duration_since(killed);
        failovers_ms.push(failover.as_secs_f64() * 1e3);
        eprintln!(
            "round {}: {:.1} ms from SIGKILL to the next leader",
            round + 1,
            failover.as_secs_f64() * 1e3
        );
    }
    let mut sorted = failovers_ms.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    let ttl_ms = args.ttl.as_secs_f64() * 1e3;
    let report = serde_json::json!({
        "peer": if args.raw { "etcd-election-rpc" } else { "turnstile" },
        "store": turnstile::store::redact(&args.store),
        "ttl_ms": ttl_ms,
        "rounds": args.rounds,
        "failover_ms": failovers_ms,
        "p50_ms": median,
        "max_ms": sorted[sorted.len() - 1],
        "p50_over_ttl_ms": median - ttl_ms,
    });
    println!("{report}");
    Ok(())
}

#[cfg(feature = "etcd")]
mod raw {
    use super::{Candidate, FailoverArgs};
    use std::time::Duration;
    use tokio::time::Instant;

    fn seconds(ttl: Duration) -> i64 {
        i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX)
    }

    pub(super) async fn candidate(store: &str) -> Result<Candidate, String> {
        Ok(Candidate::Raw(Box::new(
            super::super::etcd::connect(store).await?,
        )))
    }

    /// etcd's own election: a lease, `Campaign` on it, and keep-alives every TTL/3.
    pub(super) async fn lead_until_killed(args: &FailoverArgs, name: &str) -> Result<(), String> {
        let mut client = super::super::etcd::connect(&args.store).await?;
        let text = |error: etcd_client::Error| error.to_string();
        let lease = client
            .lease_grant(seconds(args.ttl), None)
            .await
            .map_err(text)?
            .id();
        client.campaign(name, "", lease).await.map_err(text)?;
        println!("leading {lease}");
        keep_alive(client, lease, args.ttl).await
    }

    /// Keeps `lease` alive every TTL/3, as etcd's `concurrency.Session` does, until an
    /// error (or for good).
    async fn keep_alive(
        mut client: etcd_client::Client,
        lease: i64,
        ttl: Duration,
    ) -> Result<(), String> {
        let text = |error: etcd_client::Error| error.to_string();
        let (mut keeper, mut answers) = client.lease_keep_alive(lease).await.map_err(text)?;
        loop {
            tokio::time::sleep(ttl / 3).await;
            keeper.keep_alive().await.map_err(text)?;
            answers.message().await.map_err(text)?;
        }
    }

    pub(super) async fn campaign(
        client: &etcd_client::Client,
        name: &str,
        ttl: Duration,
    ) -> Result<Instant, String> {
        let mut client = client.clone();
        let text = |error: etcd_client::Error| error.to_string();
        let lease = client
            .lease_grant(seconds(ttl), None)
            .await
            .map_err(text)?
            .id();
        // The candidate's own lease lives while it waits, as a session's does.
        let keeper = tokio::spawn(keep_alive(client.clone(), lease, ttl));
        let campaigned = client.campaign(name, "", lease).await.map_err(text);
        let elected = Instant::now();
        keeper.abort();
        campaigned?;
        client.lease_revoke(lease).await.map_err(text)?;
        Ok(elected)
    }
}

#[cfg(not(feature = "etcd"))]
mod raw {
    use super::{Candidate, FailoverArgs};

    const NO_ETCD: &str = "--raw needs the etcd feature (etcd's election RPC)";

    pub(super) async fn candidate(_store: &str) -> Result<Candidate, String> {
        Err(NO_ETCD.into())
    }

    pub(super) async fn lead_until_killed(_args: &FailoverArgs, _name: &str) -> Result<(), String> {
        Err(NO_ETCD.into())
    }
}
