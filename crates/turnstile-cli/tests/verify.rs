//! `turnstile verify lock`, run as a user runs it: worker processes, real faults, the
//! checker's verdicts and the report.

use std::process::{Command, Output, Stdio};

fn verify(args: &[&str], report: &std::path::Path) -> Output {
    verify_pillar("lock", args, report)
}

/// Runs `turnstile verify PILLAR ARGS --report REPORT`.
fn verify_pillar(pillar: &str, args: &[&str], report: &std::path::Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args(["verify", pillar])
        .args(args)
        .arg("--report")
        .arg(report)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// The names of a run's checks, in order.
fn check_names(run: &serde_json::Value) -> Vec<&str> {
    run["verdicts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["check"].as_str().unwrap())
        .collect()
}

fn summary(output: &Output) -> serde_json::Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|error| {
        panic!(
            "not JSON ({error}): {}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

/// Checks that every verdict of every run passed and that the faults asked for were
/// injected, and returns the runs.
fn assert_passed(output: &Output, faults: &[&str]) -> Vec<serde_json::Value> {
    assert_passed_checks(output, faults, &LOCK_CHECKS)
}

/// The checks of `verify lock` and `verify election`.
const LOCK_CHECKS: [&str; 4] = [
    "fenced register monotonic",
    "no unexplained overlap",
    "tokens increase",
    "progress without faults",
];

/// As [`assert_passed`], for a campaign whose runs make the `checks` named.
fn assert_passed_checks(
    output: &Output,
    faults: &[&str],
    checks: &[&str],
) -> Vec<serde_json::Value> {
    let summary = summary(output);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert_eq!(summary["passed"], true, "{summary}");
    let runs = summary["runs"].as_array().unwrap().clone();
    for run in &runs {
        let verdicts = run["verdicts"].as_array().unwrap();
        assert_eq!(check_names(run), checks);
        assert!(verdicts.iter().all(|v| v["passed"] == true), "{run}");
        assert!(run["acquisitions"].as_u64().unwrap() > 10, "{run}");
    }
    for fault in faults {
        let injected: u64 = runs
            .iter()
            .map(|run| run["faults"][fault].as_u64().unwrap_or(0))
            .sum();
        assert!(injected > 0, "{fault} was not injected: {summary}");
    }
    runs
}

/// Workers on an SQLite file, holders frozen with SIGSTOP past their TTL: every
/// overlap the pause causes is explained by it, and the fence refuses the frozen
/// holder's late write.
#[test]
fn sqlite_under_pauses_passes_and_the_fence_stops_the_paused_holder() {
    let dir = tempfile::tempdir().unwrap();
    let output = verify(
        &[
            "--store",
            "sqlite",
            "--workers",
            "3",
            "--duration",
            "10s",
            "--ttl",
            "300ms",
            "--faults",
            "pause",
            "--json",
        ],
        dir.path(),
    );
    let runs = assert_passed(&output, &["pause"]);
    for overlap in runs[0]["overlaps"].as_array().unwrap() {
        assert_eq!(overlap["explained_by"], "pause", "{overlap}");
    }
    let page = std::fs::read_to_string(dir.path().join("report.html")).unwrap();
    assert!(page.contains("<svg") && page.contains("passed"), "{page}");
    assert!(!page.contains("<script"), "the report runs no scripts");
    assert!(dir.path().join("run-001/worker-0.jsonl").exists());
}

/// A Redis server the command starts itself, with every fault: pauses, partitions,
/// connections closed, and restarts that bring Redis back empty (two runs of two
/// faults each).
#[test]
fn redis_started_by_the_command_passes_under_every_fault() {
    let dir = tempfile::tempdir().unwrap();
    let output = verify(
        &[
            "--store",
            "redis",
            "--workers",
            "4",
            "--duration",
            "20s",
            "--runs",
            "2",
            "--ttl",
            "400ms",
            "--faults",
            "pause,partition,kill-conn,restart",
            "--json",
        ],
        dir.path(),
    );
    assert_passed(&output, &["pause", "partition", "kill-conn", "restart"]);
}

/// A semaphore of two permits on Redis, its holders cut off by partitions and frozen
/// past their lease: each permit is checked as a lock with its own fenced register, and
/// the holders of all permits together never outnumber the permits except inside an
/// overlap a pause explains (a partitioned holder's lost signal must fire before its
/// permit is handed on, so partitions explain nothing). Both permits are used.
#[test]
fn a_semaphore_under_partitions_and_pauses_never_admits_more_than_its_permits() {
    let dir = tempfile::tempdir().unwrap();
    let output = verify_pillar(
        "semaphore",
        &[
            "--store",
            "redis",
            "--workers",
            "4",
            "--permits",
            "2",
            "--duration",
            "12s",
            "--runs",
            "2",
            "--ttl",
            "400ms",
            "--faults",
            "partition,pause",
            "--json",
        ],
        dir.path(),
    );
    let checks = [
        "fenced register monotonic",
        "no unexplained overlap",
        "at most N holders",
        "tokens increase",
        "progress without faults",
    ];
    let runs = assert_passed_checks(&output, &["partition", "pause"], &checks);
    assert_eq!(summary(&output)["permits"], 2);
    for run in &runs {
        let at_most = run["verdicts"][2]["detail"].as_str().unwrap();
        assert!(
            at_most.starts_with("at most 2 holders") || at_most.starts_with("at most 3 holders"),
            "both permits are held at once, and more only under a pause: {at_most}"
        );
    }
    let history = std::fs::read_to_string(dir.path().join("run-001/worker-0.jsonl")).unwrap()
        + &std::fs::read_to_string(dir.path().join("run-001/worker-1.jsonl")).unwrap();
    assert!(history.contains("\"permit\":0") && history.contains("\"permit\":1"));
}

/// Leader election on Redis, its leaders cut off and frozen: a leader's epoch is its
/// fenced write's token, so the checks of a lock apply to leaderships as they are.
#[test]
fn an_election_under_partitions_and_pauses_passes() {
    let dir = tempfile::tempdir().unwrap();
    let output = verify_pillar(
        "election",
        &[
            "--store",
            "redis",
            "--workers",
            "3",
            "--duration",
            "12s",
            "--runs",
            "2",
            "--ttl",
            "400ms",
            "--faults",
            "partition,pause",
            "--json",
        ],
        dir.path(),
    );
    assert_passed(&output, &["partition", "pause"]);
    assert_eq!(summary(&output)["primitive"], "election");
}

#[test]
fn bad_input_gets_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    for (args, code, says) in [
        (
            &["--store", "sqlite", "--workers", "0"][..],
            64,
            "--workers",
        ),
        (&["--store", "nonsense"][..], 64, "neither a URL"),
        (&["--store", "sqlite", "--ttl", "1ms"][..], 64, "--ttl"),
        (
            &["--store", "sqlite", "--duration", "1s"][..],
            64,
            "--duration",
        ),
        (
            &["--store", "sqlite", "--faults", "meteor"][..],
            64,
            "meteor",
        ),
        (
            &["--store", "redis://127.0.0.1:1"][..],
            69,
            "cannot reach the store",
        ),
    ] {
        let output = verify(args, dir.path());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(code), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}

/// The outbox's consumer-side faults: a handler that fails first deliveries (the
/// broker redelivers them after later messages of their key) and two consumers taking
/// turns at one durable consumer. Every committed message is still handled once, in
/// order, and the fault did happen (failures counted, both consumers handled some).
#[test]
fn the_outbox_passes_when_first_deliveries_fail_and_consumers_compete() {
    for (fault, shows) in [
        ("failing-first-deliveries", &["failed-first-delivery"][..]),
        (
            "competing-consumers",
            &["handled-by-consumer-1", "handled-by-consumer-2"][..],
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let output = verify_pillar(
            "outbox",
            &[
                "--fault",
                fault,
                "--duration",
                "10s",
                "--messages",
                "400",
                "--json",
            ],
            dir.path(),
        );
        let summary = summary(&output);
        assert_eq!(output.status.code(), Some(0), "{fault}: {summary}");
        assert_eq!(summary["fault"], fault);
        let run = &summary["runs"][0];
        assert_eq!(run["handled"], run["committed"], "{fault}: {run}");
        for counted in shows {
            assert!(
                run["faults"][counted].as_u64().unwrap() > 0,
                "{fault}: {counted} is 0: {run}"
            );
        }
    }
}

/// The outbox under relay kills and broker outages longer than the stream's duplicate
/// window: every committed message handled once, nothing rolled back handled, each key
/// in order.
#[test]
fn the_outbox_passes_under_relay_kills_and_broker_outages() {
    let dir = tempfile::tempdir().unwrap();
    let output = verify_pillar(
        "outbox",
        &["--duration", "12s", "--messages", "800", "--json"],
        dir.path(),
    );
    let summary = summary(&output);
    assert_eq!(output.status.code(), Some(0), "{summary}");
    let run = &summary["runs"][0];
    assert_eq!(
        check_names(run),
        [
            "every committed message handled",
            "handled at most once",
            "nothing rolled back handled",
            "each key in order",
            "the fault happened",
            "relays ended only for an unreachable broker"
        ]
    );
    assert!(run["committed"].as_u64().unwrap() > 600, "{run}");
    assert_eq!(run["handled"], run["committed"], "{run}");
    assert!(run["faults"]["kill-relay"].as_u64().unwrap() >= 1, "{run}");
    assert!(
        run["faults"]["broker-outage"].as_u64().unwrap() >= 1,
        "{run}"
    );
    let delivery = &run["delivery_ms"];
    assert!(
        delivery["p50"].as_f64().unwrap() <= delivery["p99"].as_f64().unwrap()
            && delivery["p99"].as_f64().unwrap() <= delivery["max"].as_f64().unwrap(),
        "{run}"
    );
    // The page: the verdicts, the delivery chart with both faults shaded, no scripts.
    let page = std::fs::read_to_string(dir.path().join("report.html")).unwrap();
    for shown in [
        "every committed message handled",
        "<polyline",
        "broker outage",
        "kill relay",
    ] {
        assert!(page.contains(shown), "the report shows {shown:?}");
    }
    assert!(!page.contains("<script"), "the report runs no scripts");
}

/// Idempotency keys in the transaction mode on SQLite: three service instances, one
/// killed mid-request and one frozen past its lease, 30% of responses dropped, every
/// fourth key also used by another tenant; one effect per request, every answer the
/// request's own, every request answered.
#[test]
fn idempotency_on_sqlite_passes_under_kills_and_pauses() {
    let dir = tempfile::tempdir().unwrap();
    let output = verify_pillar(
        "idempotency",
        &[
            "--store",
            "sqlite",
            "--duration",
            "14s",
            "--faults",
            "kill-instance,pause",
            "--json",
        ],
        dir.path(),
    );
    let summary = summary(&output);
    assert_eq!(output.status.code(), Some(0), "{summary}");
    assert_eq!(summary["mode"], "transaction");
    let run = &summary["runs"][0];
    assert_eq!(
        check_names(run),
        [
            "one effect per request",
            "answers are their own",
            "every request answered",
            "faults injected"
        ]
    );
    assert!(run["requests"].as_u64().unwrap() > 100, "{run}");
    assert_eq!(run["effects"], run["requests"], "{run}");
    assert!(run["dropped_responses"].as_u64().unwrap() > 0, "{run}");
    assert!(run["replays"].as_u64().unwrap() > 0, "{run}");
    assert_eq!(run["faults"]["kill-instance"], 1, "{run}");
    assert_eq!(run["faults"]["pause"], 1, "{run}");
    // The page: the verdicts, a row per instance with the faults shaded, no scripts.
    let page = std::fs::read_to_string(dir.path().join("report.html")).unwrap();
    for shown in [
        "one effect per request",
        "instance 2",
        "kill-instance",
        "pause",
        "<svg",
    ] {
        assert!(page.contains(shown), "the report shows {shown:?}");
    }
    assert!(!page.contains("<script"), "the report runs no scripts");
    // Bad input: a clear error, exit 64.
    for (args, says) in [
        (&["--store", "etcd"][..], "neither a URL"),
        (
            &["--store", "sqlite", "--faults", "store-pause"][..],
            "need a Redis server",
        ),
        (
            &["--store", "redis", "--faults", "store-row-lock"][..],
            "needs a PostgreSQL or MariaDB server",
        ),
        (
            &["--store", "sqlite", "--drop-responses", "2"][..],
            "--drop-responses",
        ),
        (&["--store", "sqlite", "--lease", "1ms"][..], "--lease"),
        (&["--store", "zk://127.0.0.1:1"][..], "no idempotency store"),
    ] {
        let output = verify_pillar("idempotency", args, dir.path());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(64), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}

/// The lease mode on Redis while the store itself freezes (SIGSTOP) and turns
/// read-only (`READONLY`, as a replica): completions and renewals meet a store that
/// does not answer or answers a transient error, and still every request has one
/// effect (or a second one those faults explain), its own answer, and an answer.
#[test]
fn idempotency_on_redis_passes_when_the_store_freezes_or_turns_read_only() {
    let dir = tempfile::tempdir().unwrap();
    let output = verify_pillar(
        "idempotency",
        &[
            "--store",
            "redis",
            "--duration",
            "14s",
            "--faults",
            "store-pause,store-read-only",
            "--json",
        ],
        dir.path(),
    );
    let summary = summary(&output);
    assert_eq!(output.status.code(), Some(0), "{summary}");
    assert_eq!(summary["mode"], "lease");
    let run = &summary["runs"][0];
    assert!(run["requests"].as_u64().unwrap() > 100, "{run}");
    assert_eq!(run["faults"]["store-pause"], 1, "{run}");
    assert_eq!(run["faults"]["store-read-only"], 1, "{run}");
}

/// The transaction mode on PostgreSQL and MariaDB while another client's transaction
/// holds every record row locked past the store's own lock timeout: claims and
/// renewals meet it (55P03, 1205; completions wait for the lock), and still every request has
/// exactly one effect, its own answer, and an answer. (The lease mode under this fault
/// runs in the campaign: there a second effect is the mode's documented cost.)
#[test]
fn idempotency_on_sql_stores_passes_while_another_transaction_holds_the_record_rows() {
    for store in ["postgres", "mariadb"] {
        let dir = tempfile::tempdir().unwrap();
        let output = verify_pillar(
            "idempotency",
            &[
                "--store",
                store,
                "--duration",
                "8s",
                "--faults",
                "store-row-lock",
                "--json",
            ],
            dir.path(),
        );
        let summary = summary(&output);
        assert_eq!(output.status.code(), Some(0), "{store}: {summary}");
        assert_eq!(summary["mode"], "transaction", "{store}");
        let run = &summary["runs"][0];
        assert!(run["requests"].as_u64().unwrap() > 50, "{store}: {run}");
        assert_eq!(run["effects"], run["requests"], "{store}: {run}");
        assert_eq!(run["faults"]["store-row-lock"], 1, "{store}: {run}");
        // The fault happened: rows were held, claims in progress among them.
        let faults: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join("idempotency-run-001/faults.json")).unwrap(),
        )
        .unwrap();
        let held = &faults[0]["held_rows"];
        assert!(held["rows"].as_u64().unwrap() > 0, "{store}: {faults}");
        assert!(
            held["in_progress"].as_u64().unwrap() > 0,
            "{store}: {faults}"
        );
    }
}
