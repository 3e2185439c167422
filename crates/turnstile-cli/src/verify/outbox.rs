//! `turnstile verify outbox`: an application enqueues messages (some in transactions it
//! rolls back) into an SQLite outbox while relay processes publish them to a NATS
//! JetStream stream and a consumer handles them through its inbox; a nemesis kills
//! relays with SIGKILL and stops the broker for longer than the stream's duplicate
//! window, so copies get past the broker. The checker reads what the application
//! committed and what the consumer's handler did, and decides: every committed message
//! handled exactly once, nothing handled that was rolled back, each key's messages
//! handled in order.
//!
//! The report (`report.html` beside `summary.json`) shows, per run, how many messages
//! had been committed and how many handled at each moment, with the faults shaded, and
//! the delivery time (commit to handling) of every message over all runs.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde::Serialize;
use sqlx::Row;
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;
use turnstile::idempotency::inbox::{Delivery, Inbox};
use turnstile::idempotency::sqlite::SqliteIdempotencyStore;
use turnstile::outbox::Message;
use turnstile::outbox::nats::{JetStreamConsumer, JetStreamPublisher};
use turnstile::outbox::sqlite::SqliteOutbox;
use turnstile_test_support::NatsServer;

use svg::Document;
use svg::node::element::{Polyline, Text};

use super::check::{FaultWindow, Verdict, percentile};
use super::history::{Event, EventKind, HistoryWriter, monotonic_ns};
use super::report;

/// The relays' lease: with the backoff below, the window in which the broker must keep
/// duplicates out (the stream's duplicate window is set to exactly that).
const RELAY_LEASE: Duration = Duration::from_secs(2);
const RELAY_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// The stream's duplicate window: just above what the relays need (they refuse a
/// stream whose window is not longer than their lease and longest backoff).
const DUPLICATE_WINDOW: Duration = Duration::from_secs(4);

/// What goes wrong during a run, episode after episode while the application enqueues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum OutboxFault {
    /// A relay killed (SIGKILL) and, in turn, every relay killed and the broker
    /// stopped for longer than the duplicate window, so copies get past the broker.
    KillRelayBrokerOutage,
    /// Every relay killed and started again while the broker is stopped; the broker
    /// comes back 3 s later.
    BrokerDownAtStart,
    /// Every relay killed and started again while the broker is frozen (SIGSTOP:
    /// connections open, nothing answers) for longer than the relays' lease.
    BrokerFrozenAtStart,
    /// The consumer's handler fails the first delivery of one message in four, before
    /// it touches the inbox: the broker redelivers it after later messages of its key.
    FailingFirstDeliveries,
    /// Two consumers (connections of their own) take turns at one durable consumer,
    /// so a key's messages reach them interleaved.
    CompetingConsumers,
}

impl OutboxFault {
    pub(crate) fn name(self) -> &'static str {
        match self {
            OutboxFault::KillRelayBrokerOutage => "kill-relay-broker-outage",
            OutboxFault::BrokerDownAtStart => "broker-down-at-start",
            OutboxFault::BrokerFrozenAtStart => "broker-frozen-at-start",
            OutboxFault::FailingFirstDeliveries => "failing-first-deliveries",
            OutboxFault::CompetingConsumers => "competing-consumers",
        }
    }
}

/// `turnstile verify outbox`.
#[derive(Args, Debug)]
pub(crate) struct VerifyOutboxArgs {
    /// What goes wrong during each run.
    #[arg(long, value_enum, default_value = "kill-relay-broker-outage")]
    fault: OutboxFault,
    /// Relay processes publishing at once.
    #[arg(long, default_value_t = 2)]
    relays: usize,
    /// Messages the application enqueues (one in seven rolled back).
    #[arg(long, default_value_t = 2000)]
    messages: usize,
    /// Ordering keys the messages are spread over.
    #[arg(long, default_value_t = 6)]
    keys: usize,
    /// How long the application enqueues and the nemesis injects faults; the run then
    /// waits (up to a minute) for the outbox to drain.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Runs, each with its own outbox, stream and inbox.
    #[arg(long, default_value_t = 1)]
    runs: u32,
    /// Where the files of each run and `summary.json` go.
    #[arg(long, value_name = "DIR", default_value = "turnstile-verify-outbox")]
    report: PathBuf,
    /// Print the summary as JSON on stdout.
    #[arg(long)]
    json: bool,
}

/// One run's findings.
#[derive(Debug, Serialize)]
struct OutboxRun {
    run: u32,
    passed: bool,
    committed: usize,
    rolled_back: usize,
    handled: usize,
    /// Deliveries the inbox recognised as copies and skipped.
    duplicates_skipped: u64,
    faults: BTreeMap<String, usize>,
    /// Commit to first handling, in milliseconds, over the run's handled messages.
    delivery_ms: Option<DeliveryPercentiles>,
    verdicts: Vec<Verdict>,
    /// What the report draws.
    #[serde(skip)]
    chart: DeliveryChart,
}

/// How long messages took from their commit to their handling.
#[derive(Debug, Serialize)]
struct DeliveryPercentiles {
    p50: f64,
    p99: f64,
    max: f64,
}

/// One run's moments on the host's monotonic clock, for the report.
#[derive(Debug, Default)]
struct DeliveryChart {
    /// When each committed message was committed, in order.
    committed_ns: Vec<u64>,
    /// When each committed message was first handled, in order.
    handled_ns: Vec<u64>,
    faults: Vec<FaultWindow>,
    /// Commit to first handling, per handled message.
    delivery_ms: Vec<f64>,
}

pub(crate) async fn run(args: VerifyOutboxArgs) -> ExitCode {
    super::exit_code(verify(args).await, "verify outbox")
}

async fn verify(args: VerifyOutboxArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(
        (1..=16).contains(&args.relays),
        "--relays must be between 1 and 16"
    );
    anyhow::ensure!(
        (1..=100_000).contains(&args.messages),
        "--messages must be between 1 and 100000"
    );
    anyhow::ensure!(
        (1..=10_000).contains(&args.keys),
        "--keys must be between 1 and 10000"
    );
    anyhow::ensure!(
        args.duration >= Duration::from_secs(10),
        "--duration must be at least 10s: a relay kill and a broker outage longer than the duplicate window"
    );
    std::fs::create_dir_all(&args.report)?;
    let nats = tokio::task::spawn_blocking(NatsServer::spawn).await?;
    let mut runs = Vec::new();
    for run in 1..=args.runs {
        let dir = args.report.join(format!("outbox-run-{run:03}"));
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
        std::fs::create_dir_all(&dir)?;
        let outcome = one_run(&args, &nats, run, &dir).await?;
        eprintln!(
            "run {run}/{}: {} — {} committed, {} handled, {} copies skipped by the inbox, faults {:?}",
            args.runs,
            if outcome.passed { "passed" } else { "FAILED" },
            outcome.committed,
            outcome.handled,
            outcome.duplicates_skipped,
            outcome.faults
        );
        for verdict in outcome.verdicts.iter().filter(|v| !v.passed) {
            eprintln!("  {}: {}", verdict.check, verdict.detail);
        }
        runs.push(outcome);
    }
    let passed = runs.iter().all(|run| run.passed);
    let summary = serde_json::json!({
        "pillar": "outbox",
        "store": "sqlite",
        "broker": "nats",
        "fault": args.fault.name(),
        "relays": args.relays,
        "passed": passed,
        "runs": runs,
    });
    std::fs::write(
        args.report.join("summary.json"),
        serde_json::to_vec_pretty(&summary)?,
    )?;
    std::fs::write(args.report.join("report.html"), html(&args, &runs))?;
    if args.json {
        println!("{summary}");
    }
    eprintln!(
        "turnstile verify outbox: {} ({} runs); report: {}",
        if passed { "passed" } else { "FAILED" },
        runs.len(),
        args.report.join("report.html").display()
    );
    Ok(passed)
}

/// Starts again every relay that ended, as a supervisor would. One that found the
/// broker unreachable when it started exits with 69 (`EX_UNAVAILABLE`); any other end
/// (a panic, a configuration error) goes into `unexpected`, which fails the run.
fn supervise(
    relays: &mut [Child],
    relay: &impl Fn(usize) -> anyhow::Result<Child>,
    unexpected: &mut Vec<String>,
) -> anyhow::Result<()> {
    for (index, running) in relays.iter_mut().enumerate() {
        if let Some(status) = running.try_wait().ok().flatten() {
            if status.code() != Some(69) {
                unexpected.push(format!("relay {index} ended: {status}"));
            }
            *running = relay(index)?;
        }
    }
    Ok(())
}

/// A broker taken away by a `broker-*-at-start` episode, and when it comes back.
struct BrokerAway {
    fault: OutboxFault,
    index: usize,
    start: u64,
    back_at: tokio::time::Instant,
}

impl BrokerAway {
    /// Brings the broker back and records the episode.
    fn end(
        self,
        nats: &NatsServer,
        nemesis_log: &mut HistoryWriter,
        windows: &mut Vec<FaultWindow>,
        faults: &mut BTreeMap<String, usize>,
    ) {
        if self.fault == OutboxFault::BrokerFrozenAtStart {
            nats.resume();
        } else {
            nats.start_again();
        }
        let name = self.fault.name();
        nemesis_log.record(&Event::now(EventKind::FaultEnd, Some(self.index)).fault(name));
        windows.push(FaultWindow {
            fault: name.replace('-', " "),
            target: None,
            start: self.start,
            end: monotonic_ns(),
        });
        *faults.entry(name.to_owned()).or_insert(0) += 1;
    }
}

/// A relay process: `turnstile outbox relay`, started again after a kill.
fn start_relay(store_url: &str, broker: &str, log: &Path) -> anyhow::Result<Child> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    Ok(Command::new(std::env::current_exe()?)
        .args(["outbox", "relay", "--store", store_url, "--broker", broker])
        .arg("--lease")
        .arg(format!("{}ms", RELAY_LEASE.as_millis()))
        .arg("--backoff-max")
        .arg(format!("{}ms", RELAY_BACKOFF_MAX.as_millis()))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()?)
}

async fn one_run(
    args: &VerifyOutboxArgs,
    nats: &NatsServer,
    run: u32,
    dir: &Path,
) -> anyhow::Result<OutboxRun> {
    let store_path = dir.join("outbox.sqlite3");
    let outbox = SqliteOutbox::open(&store_path).await?;
    let store_url = format!("sqlite://{}", store_path.display());
    let broker = nats.url();
    let subject = format!("verify{run}-{}", std::process::id());
    let stream = format!("VERIFY_{run}_{}", std::process::id());
    let publisher = JetStreamPublisher::connect(&broker, Duration::from_secs(5)).await?;
    publisher
        .jetstream()
        .create_stream(async_nats::jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{subject}.>")],
            duplicate_window: DUPLICATE_WINDOW,
            ..Default::default()
        })
        .await
        .map_err(|error| anyhow::anyhow!("cannot create the stream: {error}"))?;
    let relay =
        |index: usize| start_relay(&store_url, &broker, &dir.join(format!("relay-{index}.log")));
    let mut relays = Vec::new();
    for index in 0..args.relays {
        relays.push(relay(index)?);
    }
    let mut nemesis_log = HistoryWriter::create(&dir.join("nemesis.jsonl"))?;

    // The consumer: a durable pull consumer whose handler records its effect in the
    // inbox's transaction.
    let inbox_store = SqliteIdempotencyStore::open(dir.join("consumer.sqlite3")).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS effects (
            n INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL, key TEXT NOT NULL,
            seq INTEGER NOT NULL, at_ns INTEGER NOT NULL)",
    )
    .execute(inbox_store.pool())
    .await?;
    let stop_consuming = CancellationToken::new();
    let consumer = |failing_first_deliveries| {
        consume(
            inbox_store.clone(),
            &broker,
            &stream,
            failing_first_deliveries,
            stop_consuming.clone(),
        )
    };
    let failing = args.fault == OutboxFault::FailingFirstDeliveries;
    let mut handled_by = [0; 2];
    let consuming = async {
        if args.fault == OutboxFault::CompetingConsumers {
            let (first, second) = tokio::join!(consumer(false), consumer(false));
            let (first, second) = (first?, second?);
            // Both must have taken part, or the run shows nothing about competition.
            handled_by = [first.handled, second.handled];
            Ok::<_, anyhow::Error>(first + second)
        } else {
            consumer(failing).await
        }
    };
    let producing = async {
        // The application: enqueues at a steady pace over the first two thirds of the
        // run, one transaction in seven rolled back.
        let mut committed = HashSet::new();
        let mut committed_at = HashMap::new();
        let mut rolled_back = HashSet::new();
        let mut windows = Vec::new();
        let enqueue_for = args.duration * 2 / 3;
        let pace = enqueue_for / u32::try_from(args.messages).unwrap_or(u32::MAX).max(1);
        let started = tokio::time::Instant::now();
        let mut next_fault = started + Duration::from_secs(2);
        let mut fault_turn = 0;
        // A broker episode under way: the application goes on enqueuing while the
        // broker is away, so the relays take leases on new rows they cannot publish.
        let mut broker_away: Option<BrokerAway> = None;
        let mut unexpected_exits = Vec::new();
        let mut supervised = tokio::time::Instant::now();
        let mut faults = BTreeMap::new();
        for n in 0..args.messages {
            let message = Message::json(
                format!("{subject}.m"),
                format!("k{}", n % args.keys),
                &serde_json::json!({ "n": n }),
            )?;
            let mut transaction = outbox.pool().begin_with("BEGIN IMMEDIATE").await?;
            outbox.enqueue(&mut transaction, &message).await?;
            if n % 7 == 6 {
                transaction.rollback().await?;
                rolled_back.insert(message.id().to_owned());
            } else {
                outbox.commit(transaction).await?;
                committed.insert(message.id().to_owned());
                committed_at.insert(message.id().to_owned(), monotonic_ns());
            }
            // Every 100 ms at most: a relay that cannot connect exits at once, and is
            // started again about that often, as a supervisor would.
            if supervised.elapsed() >= Duration::from_millis(100) {
                supervise(&mut relays, &relay, &mut unexpected_exits)?;
                supervised = tokio::time::Instant::now();
            }
            if let Some(away) =
                broker_away.take_if(|away| tokio::time::Instant::now() >= away.back_at)
            {
                away.end(nats, &mut nemesis_log, &mut windows, &mut faults);
                next_fault = tokio::time::Instant::now() + Duration::from_secs(1);
            }
            // Faults, in turn, between enqueues.
            if broker_away.is_none() && tokio::time::Instant::now() >= next_fault {
                match args.fault {
                    // Relay kills and broker outages in turn.
                    OutboxFault::KillRelayBrokerOutage if fault_turn % 2 == 0 => {
                        let index = fault_turn % relays.len();
                        let start = monotonic_ns();
                        nemesis_log.record(
                            &Event::now(EventKind::FaultStart, Some(index)).fault("kill-relay"),
                        );
                        let _ = relays[index].kill().await;
                        relays[index] = relay(index)?;
                        nemesis_log.record(
                            &Event::now(EventKind::FaultEnd, Some(index)).fault("kill-relay"),
                        );
                        windows.push(FaultWindow {
                            fault: format!("kill relay {index}"),
                            target: None,
                            start,
                            end: monotonic_ns(),
                        });
                        *faults.entry("kill-relay".to_owned()).or_insert(0) += 1;
                    }
                    OutboxFault::KillRelayBrokerOutage => {
                        // Longer than the duplicate window, with the relays killed as it goes
                        // down: what they had published and not recorded goes out again after
                        // the window, past the broker's duplicate detection.
                        let start = monotonic_ns();
                        nemesis_log.record(
                            &Event::now(EventKind::FaultStart, None).fault("broker-outage"),
                        );
                        for running in relays.iter_mut() {
                            let _ = running.kill().await;
                        }
                        // Blocking for the moment the server takes to stop: the consumer waits.
                        nats.stop();
                        tokio::time::sleep(DUPLICATE_WINDOW + Duration::from_secs(2)).await;
                        nats.start_again();
                        for (index, running) in relays.iter_mut().enumerate() {
                            *running = relay(index)?;
                        }
                        nemesis_log
                            .record(&Event::now(EventKind::FaultEnd, None).fault("broker-outage"));
                        windows.push(FaultWindow {
                            fault: "broker outage".to_owned(),
                            target: None,
                            start,
                            end: monotonic_ns(),
                        });
                        *faults.entry("broker-outage".to_owned()).or_insert(0) += 1;
                    }
                    OutboxFault::BrokerDownAtStart | OutboxFault::BrokerFrozenAtStart => {
                        // The broker goes away first; then one relay is killed and
                        // started again, so it starts with no broker to talk to (stopped:
                        // it cannot connect and exits, and is started again; frozen: its
                        // connect waits), while the others take leases on the rows the
                        // application goes on enqueuing and cannot publish them, for
                        // longer than a lease. None may give up for good, park a key, or
                        // publish anything stale once the broker is back.
                        let fault = args.fault;
                        let index = fault_turn % relays.len();
                        let start = monotonic_ns();
                        nemesis_log.record(
                            &Event::now(EventKind::FaultStart, Some(index)).fault(fault.name()),
                        );
                        if fault == OutboxFault::BrokerFrozenAtStart {
                            nats.pause();
                        } else {
                            nats.stop();
                        }
                        let _ = relays[index].kill().await;
                        relays[index] = relay(index)?;
                        broker_away = Some(BrokerAway {
                            fault,
                            index,
                            start,
                            back_at: tokio::time::Instant::now()
                                + RELAY_LEASE
                                + Duration::from_secs(1),
                        });
                    }
                    // The consumer's own faults: nothing to do between enqueues.
                    OutboxFault::FailingFirstDeliveries | OutboxFault::CompetingConsumers => {}
                }
                fault_turn += 1;
                next_fault = tokio::time::Instant::now() + Duration::from_secs(1);
            }
            tokio::time::sleep_until(started + pace * u32::try_from(n + 1).unwrap_or(u32::MAX))
                .await;
        }
        if let Some(away) = broker_away.take() {
            tokio::time::sleep_until(away.back_at).await;
            away.end(nats, &mut nemesis_log, &mut windows, &mut faults);
        }
        // Drain: the outbox empties and the consumer has handled every committed message
        // (or a minute passes).
        let drained_by = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let handled: i64 = sqlx::query_scalar("SELECT count(DISTINCT id) FROM effects")
                .fetch_one(inbox_store.pool())
                .await?;
            let pending = turnstile::outbox::OutboxStore::status(&outbox, 1)
                .await?
                .pending;
            if (pending == 0 && handled as usize >= committed.len())
                || tokio::time::Instant::now() >= drained_by
            {
                break;
            }
            supervise(&mut relays, &relay, &mut unexpected_exits)?;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // Late copies still in flight get a moment to arrive.
        tokio::time::sleep(Duration::from_secs(1)).await;
        Ok::<_, anyhow::Error>((
            committed,
            committed_at,
            rolled_back,
            faults,
            windows,
            unexpected_exits,
        ))
    };
    let producing = async {
        let produced = producing.await;
        stop_consuming.cancel();
        produced
    };
    let (counts, produced) = tokio::join!(consuming, producing);
    let (committed, committed_at, rolled_back, mut faults, windows, unexpected_exits) = produced?;
    let ConsumerCounts {
        skipped: duplicates_skipped,
        failed_first_deliveries,
        ..
    } = counts?;
    if failing {
        faults.insert("failed-first-delivery".to_owned(), failed_first_deliveries);
    }
    if args.fault == OutboxFault::CompetingConsumers {
        for (index, handled) in handled_by.into_iter().enumerate() {
            faults.insert(format!("handled-by-consumer-{}", index + 1), handled);
        }
    }
    for relay in &mut relays {
        let _ = relay.kill().await;
    }
    let rows = sqlx::query("SELECT id, key, seq, at_ns FROM effects ORDER BY n")
        .fetch_all(inbox_store.pool())
        .await?;
    let mut effects = Vec::with_capacity(rows.len());
    let mut handled_at: HashMap<String, u64> = HashMap::new();
    for row in &rows {
        let (id, key, seq): (String, String, i64) =
            (row.try_get("id")?, row.try_get("key")?, row.try_get("seq")?);
        let at = u64::try_from(row.try_get::<i64, _>("at_ns")?).unwrap_or(0);
        handled_at.entry(id.clone()).or_insert(at);
        effects.push((id, key, seq));
    }
    let mut verdicts = check(&committed, &rolled_back, &effects);
    verdicts.push(fault_happened(args.fault, &faults));
    verdicts.push(Verdict {
        check: "relays ended only for an unreachable broker",
        passed: unexpected_exits.is_empty(),
        detail: if unexpected_exits.is_empty() {
            "every relay that ended had found the broker unreachable (exit 69)".to_owned()
        } else {
            unexpected_exits.join("; ")
        },
    });
    let chart = DeliveryChart::of(&committed_at, &handled_at, windows);
    let show = |p| percentile(&chart.delivery_ms, p);
    let delivery_ms = match (show(50.0), show(99.0), show(100.0)) {
        (Some(p50), Some(p99), Some(max)) => Some(DeliveryPercentiles { p50, p99, max }),
        _ => None,
    };
    Ok(OutboxRun {
        run,
        passed: verdicts.iter().all(|v| v.passed),
        committed: committed.len(),
        rolled_back: rolled_back.len(),
        handled: effects.len(),
        duplicates_skipped,
        faults,
        delivery_ms,
        verdicts,
        chart,
    })
}

impl DeliveryChart {
    fn of(
        committed_at: &HashMap<String, u64>,
        handled_at: &HashMap<String, u64>,
        faults: Vec<FaultWindow>,
    ) -> DeliveryChart {
        let mut committed_ns: Vec<u64> = committed_at.values().copied().collect();
        committed_ns.sort_unstable();
        let mut handled_ns = Vec::new();
        let mut delivery_ms = Vec::new();
        for (id, &committed) in committed_at {
            if let Some(&handled) = handled_at.get(id) {
                handled_ns.push(handled);
                delivery_ms.push(handled.saturating_sub(committed) as f64 / 1e6);
            }
        }
        handled_ns.sort_unstable();
        DeliveryChart {
            committed_ns,
            handled_ns,
            faults,
            delivery_ms,
        }
    }

    /// Messages committed (grey) and handled (green) so far at each moment, with the
    /// faults shaded behind.
    fn svg(&self) -> Document {
        const TOP: f64 = 20.0;
        const HEIGHT: f64 = 160.0;
        let Some(axis) = report::TimeAxis::spanning(
            self.committed_ns
                .iter()
                .chain(&self.handled_ns)
                .copied()
                .chain(self.faults.iter().flat_map(|f| [f.start, f.end])),
        ) else {
            return Document::new().set("width", 10).set("height", 10);
        };
        let total = self.committed_ns.len().max(1) as f64;
        let y = |count: usize| TOP + HEIGHT - count as f64 / total * HEIGHT;
        // A step line: one point per message, as the count went up.
        let steps = |moments: &[u64]| -> String {
            let mut points = format!("{:.1},{:.1}", report::LEFT, y(0));
            for (i, &at) in moments.iter().enumerate() {
                let _ = write!(points, " {:.1},{:.1}", axis.x(at), y(i + 1));
            }
            points
        };
        let height = TOP + HEIGHT + 24.0;
        Document::new()
            .set("width", report::WIDTH)
            .set("height", height)
            .set("viewBox", (0, 0, report::WIDTH, height))
            .set("font-family", "sans-serif")
            .set("font-size", 10)
            .add(report::fault_bands(&axis, &self.faults, TOP, HEIGHT, 1))
            .add(
                Polyline::new()
                    .set("points", steps(&self.committed_ns))
                    .set("fill", "none")
                    .set("stroke", "#829ab1")
                    .set("stroke-width", 2),
            )
            .add(
                Polyline::new()
                    .set("points", steps(&self.handled_ns))
                    .set("fill", "none")
                    .set("stroke", "#27ab83")
                    .set("stroke-width", 2),
            )
            .add(
                Text::new(format!("{} committed", self.committed_ns.len()))
                    .set("x", 4)
                    .set("y", TOP + 10.0),
            )
            .add(Text::new("0").set("x", 4).set("y", TOP + HEIGHT))
            .add(axis.length_label(height))
    }
}

/// Buckets of delivery times (commit to handling), in milliseconds.
const DELIVERY_BUCKETS: [f64; 11] = [
    10.0,
    20.0,
    50.0,
    100.0,
    200.0,
    500.0,
    1000.0,
    2000.0,
    5000.0,
    10000.0,
    f64::INFINITY,
];

/// The page: the verdicts and the delivery chart of every run, and the delivery times
/// over all runs.
fn html(args: &VerifyOutboxArgs, runs: &[OutboxRun]) -> String {
    let passed = runs.iter().all(|run| run.passed);
    let mut page = report::page_head("turnstile verify outbox — SQLite to NATS JetStream", passed);
    let _ = write!(
        page,
        "<p>Fault: {}. {} runs; {} relay processes; {} messages over {} keys per run, one \
         transaction in seven rolled back; the stream's duplicate window {} s, each broker outage \
         longer.</p>",
        args.fault.name(),
        runs.len(),
        args.relays,
        args.messages,
        args.keys,
        DUPLICATE_WINDOW.as_secs(),
    );
    let delivery: Vec<f64> = runs
        .iter()
        .flat_map(|run| run.chart.delivery_ms.iter().copied())
        .collect();
    let _ = write!(
        page,
        "<h2>Delivery time (ms, commit to handling), all runs</h2>{}\
         <p>Charts: messages committed (grey) and handled through the inbox (green) so far; grey \
         bands, faults (hover for which).</p>",
        report::histogram(&DELIVERY_BUCKETS, &delivery, "messages"),
    );
    for run in runs {
        page.push_str(&report::run_verdicts(run.run, &run.verdicts));
        let _ = write!(
            page,
            "<p>{} committed, {} rolled back, {} handled, {} copies skipped by the inbox.</p>{}",
            run.committed,
            run.rolled_back,
            run.handled,
            run.duplicates_skipped,
            run.chart.svg(),
        );
    }
    page.push_str("</body></html>\n");
    page
}

/// A database error in the consumer's handler, as the handler reports it.
fn handler_error(error: sqlx::Error) -> turnstile::Error {
    turnstile::Error::new(turnstile::ErrorKind::Store, error.to_string())
}

/// What one consumer saw.
#[derive(Debug, Default, Clone, Copy)]
struct ConsumerCounts {
    /// Deliveries the inbox recognised as copies and skipped.
    skipped: u64,
    /// First deliveries its handler failed on purpose.
    failed_first_deliveries: usize,
    /// Messages its handler handled (their effect committed).
    handled: usize,
}

impl std::ops::Add for ConsumerCounts {
    type Output = ConsumerCounts;

    fn add(self, other: ConsumerCounts) -> ConsumerCounts {
        ConsumerCounts {
            skipped: self.skipped + other.skipped,
            failed_first_deliveries: self.failed_first_deliveries + other.failed_first_deliveries,
            handled: self.handled + other.handled,
        }
    }
}

/// Whether the handler fails the first delivery of the message `id` on purpose: one
/// message in four, picked by its id so that a restarted consumer picks the same.
fn fails_first_delivery(id: &str) -> bool {
    id.bytes().fold(0u32, |hash, byte| {
        hash.wrapping_mul(31).wrapping_add(u32::from(byte))
    }) % 4
        == 0
}

/// Handles deliveries through the inbox until `stop`; with `failing_first_deliveries`,
/// its handler fails the first delivery of one message in four before it touches the
/// inbox.
async fn consume(
    store: SqliteIdempotencyStore,
    broker: &str,
    stream: &str,
    failing_first_deliveries: bool,
    stop: CancellationToken,
) -> anyhow::Result<ConsumerCounts> {
    let inbox = Inbox::new(store.clone(), "verify")?;
    let (mut skipped, mut handled) = (0, 0);
    let mut failed_once: HashSet<String> = HashSet::new();
    let mut consumer: Option<JetStreamConsumer> = None;
    while !stop.is_cancelled() {
        // The broker goes away and comes back: connect (again) when needed.
        let Some(open) = consumer.as_ref() else {
            let connected = async {
                let publisher = JetStreamPublisher::connect(broker, Duration::from_secs(2)).await?;
                JetStreamConsumer::durable(
                    publisher.jetstream(),
                    stream,
                    "verify",
                    Duration::from_secs(2),
                )
                .await
            };
            match connected.await {
                Ok(opened) => consumer = Some(opened),
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
            continue;
        };
        let processed = open
            .process(
                32,
                Duration::from_millis(300),
                Duration::from_millis(200),
                async |incoming| {
                    // The inbox's key (the producer and the message id), and the
                    // message id the application knows.
                    let inbox_id = incoming.inbox_id()?;
                    let id = incoming.id.clone().unwrap_or_default();
                    let key = incoming.key.clone().unwrap_or_default();
                    if failing_first_deliveries
                        && fails_first_delivery(&id)
                        && failed_once.insert(id.clone())
                    {
                        return Err(turnstile::Error::new(
                            turnstile::ErrorKind::Store,
                            "the handler fails this message's first delivery on purpose",
                        ));
                    }

                    let mut transaction = store
                        .pool()
                        .begin_with("BEGIN IMMEDIATE")
                        .await
                        .map_err(handler_error)?;
                    // In order per key: JetStream redelivers a message that was not
                    // acknowledged after later ones of its key went out.
                    let cursor = incoming.cursor_key().unwrap_or_default();
                    let position = incoming.seq.unwrap_or(0);
                    let seq = i64::try_from(position).unwrap_or(i64::MAX);
                    let delivery = inbox
                        .process_in_order(
                            &mut transaction,
                            &inbox_id,
                            &cursor,
                            position,
                            async |connection| {
                                sqlx::query(
                                    "INSERT INTO effects (id, key, seq, at_ns) VALUES (?1, ?2, ?3, ?4)",
                                )
                                .bind(&id)
                                .bind(&key)
                                .bind(seq)
                                .bind(i64::try_from(monotonic_ns()).unwrap_or(i64::MAX))
                                .execute(&mut *connection)
                                .await
                                .map_err(handler_error)?;
                                Ok::<_, turnstile::Error>(())
                            },
                        )
                        .await?;
                    transaction.commit().await.map_err(handler_error)?;
                    match delivery {
                        Delivery::Processed(()) => handled += 1,
                        Delivery::Duplicate => skipped += 1,
                        // Its predecessor comes first: the broker delivers it again.
                        Delivery::Early { expected } => {
                            return Err(turnstile::Error::out_of_order(
                                &cursor, position, expected,
                            ));
                        }
                        _ => {}
                    }
                    Ok(())
                },
            )
            .await;
        if processed.is_err() {
            consumer = None;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    Ok(ConsumerCounts {
        skipped,
        failed_first_deliveries: failed_once.len(),
        handled,
    })
}

/// Whether the run's fault did happen, from its counts: a run in which it did nothing
/// shows nothing about it.
fn fault_happened(fault: OutboxFault, faults: &BTreeMap<String, usize>) -> Verdict {
    let count = |name: &str| faults.get(name).copied().unwrap_or(0);
    let wanted: &[&str] = match fault {
        OutboxFault::KillRelayBrokerOutage => &["kill-relay", "broker-outage"],
        OutboxFault::BrokerDownAtStart => &["broker-down-at-start"],
        OutboxFault::BrokerFrozenAtStart => &["broker-frozen-at-start"],
        OutboxFault::FailingFirstDeliveries => &["failed-first-delivery"],
        // Both consumers must have handled some: one that did all shows no competition.
        OutboxFault::CompetingConsumers => &["handled-by-consumer-1", "handled-by-consumer-2"],
    };
    let missing: Vec<&str> = wanted
        .iter()
        .copied()
        .filter(|name| count(name) == 0)
        .collect();
    Verdict {
        check: "the fault happened",
        passed: missing.is_empty(),
        detail: if missing.is_empty() {
            format!("{} ({faults:?})", fault.name())
        } else {
            format!("{}: none of {}", fault.name(), missing.join(", "))
        },
    }
}

/// The verdicts, from what the application committed and what the handler did.
fn check(
    committed: &HashSet<String>,
    rolled_back: &HashSet<String>,
    effects: &[(String, String, i64)],
) -> Vec<Verdict> {
    let mut times: HashMap<&str, usize> = HashMap::new();
    for (id, ..) in effects {
        *times.entry(id.as_str()).or_insert(0) += 1;
    }
    let lost: Vec<&String> = committed
        .iter()
        .filter(|id| !times.contains_key(id.as_str()))
        .collect();
    let twice: Vec<&str> = times
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(id, _)| *id)
        .collect();
    let phantom: Vec<&String> = rolled_back
        .iter()
        .filter(|id| times.contains_key(id.as_str()))
        .collect();
    let mut last_seq: HashMap<&str, i64> = HashMap::new();
    let mut out_of_order = Vec::new();
    for (id, key, seq) in effects {
        if let Some(&last) = last_seq.get(key.as_str())
            && *seq <= last
        {
            out_of_order.push(format!("{key}: seq {seq} ({id}) handled after {last}"));
        }
        last_seq.insert(key.as_str(), *seq);
    }
    let verdict = |check: &'static str, problems: Vec<String>, fine: String| Verdict {
        check,
        passed: problems.is_empty(),
        detail: if problems.is_empty() {
            fine
        } else {
            let shown: Vec<String> = problems.iter().take(5).cloned().collect();
            format!("{} ({} in all)", shown.join("; "), problems.len())
        },
    };
    vec![
        verdict(
            "every committed message handled",
            lost.iter()
                .map(|id| format!("{id} never handled"))
                .collect(),
            format!("{} committed, all handled", committed.len()),
        ),
        verdict(
            "handled at most once",
            twice
                .iter()
                .map(|id| format!("{id} handled twice"))
                .collect(),
            format!("{} handled once each", times.len()),
        ),
        verdict(
            "nothing rolled back handled",
            phantom
                .iter()
                .map(|id| format!("{id} was rolled back"))
                .collect(),
            format!("{} rolled back, none handled", rolled_back.len()),
        ),
        verdict(
            "each key in order",
            out_of_order,
            "every key's messages handled in sequence order".to_owned(),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(names: &[&str]) -> HashSet<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_fault_that_did_nothing_fails_the_run() {
        let counts = |pairs: &[(&str, usize)]| -> BTreeMap<String, usize> {
            pairs
                .iter()
                .map(|(name, n)| (name.to_string(), *n))
                .collect()
        };
        let competing = OutboxFault::CompetingConsumers;
        let both = counts(&[("handled-by-consumer-1", 3), ("handled-by-consumer-2", 4)]);
        assert!(fault_happened(competing, &both).passed);
        let one = counts(&[("handled-by-consumer-1", 7), ("handled-by-consumer-2", 0)]);
        assert!(!fault_happened(competing, &one).passed);
        let kills_only = counts(&[("kill-relay", 2)]);
        assert!(!fault_happened(OutboxFault::KillRelayBrokerOutage, &kills_only).passed);
        assert!(!fault_happened(OutboxFault::BrokerFrozenAtStart, &counts(&[])).passed);
    }

    #[test]
    fn each_defect_fails_its_own_check() {
        let committed = ids(&["a", "b", "c"]);
        let rolled_back = ids(&["x"]);
        let effect = |id: &str, seq| (id.to_owned(), "k".to_owned(), seq);
        let clean = check(
            &committed,
            &rolled_back,
            &[effect("a", 1), effect("b", 2), effect("c", 3)],
        );
        assert!(clean.iter().all(|v| v.passed), "{clean:?}");
        let failed = |effects: &[(String, String, i64)]| -> Vec<&'static str> {
            check(&committed, &rolled_back, effects)
                .into_iter()
                .filter(|v| !v.passed)
                .map(|v| v.check)
                .collect()
        };
        assert_eq!(
            failed(&[effect("a", 1), effect("b", 2)]),
            ["every committed message handled"]
        );
        assert_eq!(
            failed(&[
                effect("a", 1),
                effect("b", 2),
                effect("c", 3),
                effect("c", 3)
            ]),
            ["handled at most once", "each key in order"]
        );
        assert_eq!(
            failed(&[
                effect("a", 1),
                effect("b", 2),
                effect("c", 3),
                effect("x", 4)
            ]),
            ["nothing rolled back handled"]
        );
        assert_eq!(
            failed(&[effect("b", 2), effect("a", 1), effect("c", 3)]),
            ["each key in order"]
        );
    }
}
