//! The payments service, black-box: real processes on loopback ports, a plain HTTP/1.1
//! client that drops responses and retries, and the ledger checked afterwards.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use turnstile_test_support::{free_port, shared_postgres, shared_redis, unique_name};

/// A running `payments` process, killed when dropped.
struct Service {
    child: Child,
    port: u16,
    _tokens: tempfile::NamedTempFile,
}

/// The bearer token of `tenant` in the tests' token table.
fn token_of(tenant: &str) -> String {
    format!("{tenant}-token-0123456789abcdef")
}

impl Service {
    fn start(store: &str, extra: &[&str]) -> Service {
        let tokens = tempfile::NamedTempFile::new().unwrap();
        let table: serde_json::Map<String, serde_json::Value> = ["acme", "alice", "bob"]
            .into_iter()
            .map(|tenant| (token_of(tenant), tenant.into()))
            .collect();
        std::fs::write(tokens.path(), serde_json::Value::Object(table).to_string()).unwrap();
        let port = free_port();
        let mut child = Command::new(env!("CARGO_BIN_EXE_payments"))
            .args(["--listen", &format!("127.0.0.1:{port}"), "--store", store])
            .arg("--tokens")
            .arg(tokens.path())
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let started = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Some(status) = child.try_wait().unwrap() {
                panic!("payments exited before it listened: {status}");
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "payments did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Service {
            child,
            port,
            _tokens: tokens,
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sends one request; `None` for a body means "drop the connection as soon as the
/// request is written", a response lost on the way back.
fn send(
    port: u16,
    method: &str,
    path: &str,
    tenant: &str,
    key: Option<&str>,
    body: &str,
    read: bool,
) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let key = key.map_or(String::new(), |key| {
        format!("Idempotency-Key: \"{key}\"\r\n")
    });
    let token = token_of(tenant);
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {token}\r\n{key}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).ok()?;
    if !read {
        return None;
    }
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split(' ').nth(1)?.parse().ok()?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())?;
    Some((status, body))
}

fn pay(port: u16, tenant: &str, account: &str, key: &str, cents: i64) -> (u16, String) {
    let body = format!("{{\"amount_cents\":{cents},\"currency\":\"USD\",\"reference\":\"{key}\"}}");
    send(
        port,
        "POST",
        &format!("/accounts/{account}/payments"),
        tenant,
        Some(key),
        &body,
        true,
    )
    .expect("no response")
}

fn payments(port: u16, tenant: &str, account: &str) -> Vec<serde_json::Value> {
    let (status, body) = send(
        port,
        "GET",
        &format!("/accounts/{account}/payments"),
        tenant,
        None,
        "",
        true,
    )
    .unwrap();
    assert_eq!(status, 200, "{body}");
    let value: serde_json::Value = serde_json::from_str(&body).unwrap();
    value["payments"].as_array().unwrap().clone()
}

/// Every key is sent once with its response dropped, then retried until answered: the
/// ledger holds exactly one payment per key, and each retry saw that payment.
fn dropped_responses_charge_once(store: &str, extra: &[&str]) {
    let service = Service::start(store, extra);
    let account = unique_name("acct");
    let mut seen = BTreeSet::new();
    for i in 0..20 {
        let key = format!("key-{i}");
        let body = format!("{{\"amount_cents\":100,\"currency\":\"USD\",\"reference\":\"{key}\"}}");
        let _ = send(
            service.port,
            "POST",
            &format!("/accounts/{account}/payments"),
            "acme",
            Some(&key),
            &body,
            false,
        );
        let answer = loop {
            let (status, body) = pay(service.port, "acme", &account, &key, 100);
            match status {
                201 => break body,
                // The dropped request is still being processed: retry as a client would.
                409 => std::thread::sleep(Duration::from_millis(50)),
                other => panic!("unexpected {other}: {body}"),
            }
        };
        let payment: serde_json::Value = serde_json::from_str(&answer).unwrap();
        assert_eq!(payment["reference"], key.as_str());
        seen.insert(payment["payment_id"].as_str().unwrap().to_owned());
        // And once more: a replay of the same payment.
        let (status, again) = pay(service.port, "acme", &account, &key, 100);
        assert_eq!(status, 201);
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&again).unwrap()["payment_id"],
            payment["payment_id"]
        );
    }
    let ledger = payments(service.port, "acme", &account);
    assert_eq!(ledger.len(), 20, "charges must equal unique keys");
    let ids: BTreeSet<String> = ledger
        .iter()
        .map(|p| p["payment_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids, seen);
}

/// Sends a payment and returns the whole response, headers included.
fn pay_response(port: u16, tenant: &str, account: &str, key: &str) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let body = format!("{{\"amount_cents\":100,\"currency\":\"USD\",\"reference\":\"{key}\"}}");
    let request = format!(
        "POST /accounts/{account}/payments HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {}\r\nIdempotency-Key: {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        token_of(tenant),
        body.len()
    );
    stream.write_all(request.as_bytes()).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response.to_ascii_lowercase()
}

/// Replays say so on the SQL stores too (`Idempotent-Replayed`), and a bearer that is
/// not in the token table is no tenant: 401, nothing charged.
#[test]
fn replays_are_marked_and_unknown_bearers_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let service = Service::start(
        &format!("sqlite://{}", dir.path().join("p.db").display()),
        &[],
    );
    let first = pay_response(service.port, "acme", "acct-r", "once");
    assert!(first.contains("idempotent-replayed: false"), "{first}");
    let again = pay_response(service.port, "acme", "acct-r", "once");
    assert!(again.contains("idempotent-replayed: true"), "{again}");
    assert_eq!(pay(service.port, "mallory", "acct-m", "k", 100).0, 401);
    assert_eq!(payments(service.port, "acme", "acct-r").len(), 1);
}

/// Every replica of a deployment starts at once: three instances on a fresh
/// PostgreSQL database all come up (the ledger's schema is made under the migrations'
/// advisory lock, not raced).
#[test]
fn three_instances_start_at_once_on_a_fresh_postgres() {
    for _ in 0..3 {
        let store = shared_postgres().fresh_database("replicas");
        let starting: Vec<_> = (0..3)
            .map(|_| {
                let store = store.clone();
                std::thread::spawn(move || Service::start(&store, &[]))
            })
            .collect();
        let services: Vec<Service> = starting.into_iter().map(|s| s.join().unwrap()).collect();
        assert_eq!(pay(services[2].port, "acme", "acct-rep", "k", 100).0, 201);
    }
}

/// On Redis the key and the ledger commit apart. A Redis that loses the record (a
/// failover to a replica that never got it, here FLUSHALL) runs the handler again for
/// the retry: the ledger's (tenant, key) constraint answers with the first payment,
/// and nothing is charged twice.
#[test]
fn a_redis_that_loses_the_record_does_not_charge_twice() {
    let redis = turnstile_test_support::RedisServer::spawn();
    let dir = tempfile::tempdir().unwrap();
    let ledger = dir.path().join("ledger.db");
    let service = Service::start(&redis.url(), &["--ledger", ledger.to_str().unwrap()]);
    let (status, first) = pay(service.port, "acme", "acct-f", "failover", 700);
    assert_eq!(status, 201, "{first}");
    let flushed = Command::new("redis-cli")
        .args(["-p", &redis.port().to_string(), "FLUSHALL"])
        .output()
        .unwrap();
    assert!(flushed.status.success(), "{flushed:?}");
    let (status, again) = pay(service.port, "acme", "acct-f", "failover", 700);
    assert_eq!(status, 201, "{again}");
    let id =
        |body: &str| serde_json::from_str::<serde_json::Value>(body).unwrap()["payment_id"].clone();
    assert_eq!(
        id(&first),
        id(&again),
        "the retry was charged as a new payment"
    );
    assert_eq!(payments(service.port, "acme", "acct-f").len(), 1);
}

#[test]
fn sqlite_store_charges_once_through_dropped_responses() {
    let dir = tempfile::tempdir().unwrap();
    dropped_responses_charge_once(
        &format!("sqlite://{}", dir.path().join("p.db").display()),
        &[],
    );
}

#[test]
fn postgres_store_charges_once_through_dropped_responses() {
    dropped_responses_charge_once(&shared_postgres().fresh_database("payments"), &[]);
}

#[test]
fn redis_store_charges_once_through_dropped_responses() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = dir.path().join("ledger.db").display().to_string();
    let store = format!(
        "{}?turnstile_prefix={}",
        shared_redis().url(),
        unique_name("pay")
    );
    dropped_responses_charge_once(&store, &["--ledger", &ledger]);
}

/// Two instances on one store, concurrent duplicates across both: one payment.
#[test]
fn two_instances_charge_once_for_concurrent_duplicates() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("p.db").display());
    let (a, b) = (
        Service::start(&store, &["--delay", "300ms"]),
        Service::start(&store, &["--delay", "300ms"]),
    );
    let threads: Vec<_> = (0..10)
        .map(|i| {
            let port = if i % 2 == 0 { a.port } else { b.port };
            std::thread::spawn(move || pay(port, "acme", "acct-dup", "once", 500))
        })
        .collect();
    let mut created = Vec::new();
    for thread in threads {
        let (status, body) = thread.join().unwrap();
        match status {
            201 => created.push(body),
            409 => {}
            other => panic!("unexpected {other}: {body}"),
        }
    }
    assert!(!created.is_empty());
    created.dedup();
    assert_eq!(created.len(), 1, "duplicates saw different payments");
    assert_eq!(payments(a.port, "acme", "acct-dup").len(), 1);
}

/// An instance killed in the middle of a payment leaves the key claimable; the retry,
/// on another instance, completes it once.
#[test]
fn a_killed_instance_leaves_the_key_to_the_retry() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("p.db").display());
    let mut slow = Service::start(&store, &["--delay", "3s"]);
    let body = "{\"amount_cents\":700,\"currency\":\"USD\",\"reference\":\"r\"}";
    let port = slow.port;
    let inflight = std::thread::spawn(move || {
        send(
            port,
            "POST",
            "/accounts/acct-kill/payments",
            "acme",
            Some("killed"),
            body,
            true,
        )
    });
    std::thread::sleep(Duration::from_millis(800));
    slow.kill();
    assert!(
        inflight.join().unwrap().is_none(),
        "the killed instance answered"
    );
    let other = Service::start(&store, &[]);
    let (status, answer) = pay(other.port, "acme", "acct-kill", "killed", 700);
    assert_eq!(status, 201, "{answer}");
    assert_eq!(payments(other.port, "acme", "acct-kill").len(), 1);
}

/// Tenants are isolated: another tenant's account is refused, and the same key in two
/// tenants is two payments.
#[test]
fn tenants_are_isolated() {
    let dir = tempfile::tempdir().unwrap();
    let service = Service::start(
        &format!("sqlite://{}", dir.path().join("p.db").display()),
        &[],
    );
    assert_eq!(pay(service.port, "alice", "acct-alice", "k", 100).0, 201);
    assert_eq!(pay(service.port, "bob", "acct-alice", "k2", 100).0, 403);
    let (status, _) = send(
        service.port,
        "GET",
        "/accounts/acct-alice/payments",
        "bob",
        None,
        "",
        true,
    )
    .unwrap();
    assert_eq!(status, 403);
    assert_eq!(pay(service.port, "bob", "acct-bob", "k", 100).0, 201);
    assert_eq!(payments(service.port, "alice", "acct-alice").len(), 1);
    assert_eq!(payments(service.port, "bob", "acct-bob").len(), 1);
    // Bad input: a clear answer, nothing charged.
    let (status, _) = send(
        service.port,
        "POST",
        "/accounts/acct-bob/payments",
        "bob",
        Some("x"),
        "{\"amount_cents\":-5,\"currency\":\"USD\",\"reference\":\"r\"}",
        true,
    )
    .unwrap();
    assert_eq!(status, 400);
    let (status, _) = send(
        service.port,
        "POST",
        "/accounts/acct-bob/payments",
        "bob",
        None,
        "{}",
        true,
    )
    .unwrap();
    assert_eq!(status, 400);
    let (status, _) = pay(service.port, "bob", "acct-bob", "k", 999);
    assert_eq!(status, 422, "a reused key with another amount");
    assert_eq!(payments(service.port, "bob", "acct-bob").len(), 1);
}

/// A running `payments-projection` process, killed when dropped.
struct Projection {
    child: Child,
}

impl Projection {
    fn start(broker: &str, store: &str) -> Projection {
        let child = Command::new(env!("CARGO_BIN_EXE_payments-projection"))
            .args(["--broker", broker, "--store", store])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        Projection { child }
    }
}

impl Drop for Projection {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The projection's totals per account, read from its SQLite file.
fn totals(path: &std::path::Path) -> std::collections::BTreeMap<String, (i64, i64)> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let Ok(pool) = sqlx::SqlitePool::connect(&format!("sqlite://{}", path.display())).await
        else {
            return Default::default();
        };
        let rows: Vec<(String, i64, i64)> =
            sqlx::query_as("SELECT account, cents, payments FROM totals")
                .fetch_all(&pool)
                .await
                .unwrap_or_default();
        pool.close().await;
        rows.into_iter()
            .map(|(account, cents, payments)| (account, (cents, payments)))
            .collect()
    })
}

/// Payments through dropped responses and retries, the service relaying its events,
/// the projection killed and restarted halfway: every account's total and payment count
/// in the projection equal the ledger's.
fn events_reach_the_projection_once(broker: &str) {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("payments.sqlite3").display());
    let projection_file = dir.path().join("projection.sqlite3");
    let projection_store = format!("sqlite://{}", projection_file.display());
    let service = Service::start(&store, &["--broker", broker]);
    let mut projection = Some(Projection::start(broker, &projection_store));
    let accounts: Vec<String> = (0..3).map(|_| unique_name("acct")).collect();
    let mut expected = std::collections::BTreeMap::new();
    for i in 0..30_i64 {
        let account = &accounts[usize::try_from(i).unwrap() % accounts.len()];
        let key = format!("{account}-{i}");
        let _ = send(
            service.port,
            "POST",
            &format!("/accounts/{account}/payments"),
            "acme",
            Some(&key),
            &format!(
                "{{\"amount_cents\":{},\"currency\":\"USD\",\"reference\":\"{key}\"}}",
                100 + i
            ),
            false,
        );
        loop {
            let (status, body) = pay(service.port, "acme", account, &key, 100 + i);
            match status {
                201 => break,
                409 => std::thread::sleep(Duration::from_millis(20)),
                other => panic!("unexpected {other}: {body}"),
            }
        }
        let entry = expected.entry(account.clone()).or_insert((0, 0));
        entry.0 += 100 + i;
        entry.1 += 1;
        if i == 15 {
            // The consumer dies and comes back: what it had not acknowledged comes
            // again, and its inbox drops what it had already counted.
            drop(projection.take());
            projection = Some(Projection::start(broker, &projection_store));
        }
    }
    let started = Instant::now();
    loop {
        let found = totals(&projection_file);
        if found == expected {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the projection {found:?} never matched the ledger {expected:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(projection);
}

#[test]
fn events_reach_the_projection_once_through_redis_streams() {
    // A Redis of its own: the stream and group names are the example's fixed ones.
    let redis = turnstile_test_support::RedisServer::spawn();
    events_reach_the_projection_once(&redis.url());
}

#[test]
fn events_reach_the_projection_once_through_nats() {
    let nats = turnstile_test_support::NatsServer::spawn();
    events_reach_the_projection_once(&nats.url());
}
