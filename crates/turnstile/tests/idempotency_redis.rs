//! The Redis idempotency store: the conformance suite against a real redis-server.

mod idempotency_conformance;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use idempotency_conformance::TestStore;
use redis::aio::MultiplexedConnection;
use turnstile::FencingToken;
use turnstile::idempotency::{
    ClaimAnswer, Fingerprint, Finish, Idempotency, IdempotencyKey, IdempotencyStore, Scope,
};
use turnstile_test_support::{shared_redis, unique_name};

/// Clients of the shared server under a key prefix of their own.
struct RedisPrefix {
    url: String,
}

impl TestStore for RedisPrefix {
    fn client(&self) -> Pin<Box<dyn Future<Output = Idempotency> + Send + '_>> {
        Box::pin(async move { Idempotency::connect(&self.url).await.unwrap() })
    }
}

async fn shared() -> RedisPrefix {
    RedisPrefix {
        url: format!(
            "{}?turnstile_prefix={}",
            shared_redis().url(),
            unique_name("idem")
        ),
    }
}

idempotency_conformance_tests!(super::shared);

/// The work ran, then the store went away while its outcome was being stored: the
/// completion is tried again (the lease renewed meanwhile) until the store is back,
/// so a repeat gets the replay and the work never runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_is_stored_once_the_store_is_back() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use turnstile::idempotency::IdempotencyOptions;
    let proxy = Arc::new(turnstile_test_support::TcpProxy::start(
        shared_redis().port(),
    ));
    let url = format!(
        "{}?turnstile_prefix={}",
        proxy.url_for(&shared_redis().url()),
        unique_name("idemback")
    );
    let keys = Idempotency::connect(&url)
        .await
        .unwrap()
        .with_options(IdempotencyOptions::new().lease(Duration::from_secs(10)))
        .unwrap();
    let (scope, key) = (
        Scope::new("tenant").unwrap(),
        IdempotencyKey::new("pay").unwrap(),
    );
    let fingerprint = Fingerprint::of(&[b"x"]);
    let runs = AtomicUsize::new(0);
    for _ in 0..2 {
        let value: u32 = keys
            .run_once(&scope, &key, &fingerprint, async |_| {
                runs.fetch_add(1, Ordering::SeqCst);
                // The effect happened; now the store goes away for 1.5 s.
                proxy.cut();
                proxy.close_connections();
                let healer = Arc::clone(&proxy);
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(1_500));
                    healer.heal();
                });
                Ok::<_, turnstile::Error>(7)
            })
            .await
            .expect("the completion must wait for the store, not give up");
        assert_eq!(value, 7);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the work ran twice");
}

/// The work ran, then the server refused writes for a moment (a replica during a
/// failover answers `READONLY`; a full `noeviction` server answers `OOM`): the
/// completion is tried again until the server takes it, so a repeat gets the replay,
/// never a "not stored" answer and never a second run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_is_stored_once_the_server_takes_writes_again() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use turnstile::idempotency::IdempotencyOptions;
    let server = turnstile_test_support::RedisServer::spawn();
    let nowhere = turnstile_test_support::ClosedPort::bind();
    let port = nowhere.port().to_string();
    // Each fault: its name, the command that starts it, the command that ends it.
    let refuse: [(&str, Vec<&str>, Vec<&str>); 2] = [
        (
            "READONLY",
            vec!["REPLICAOF", "127.0.0.1", port.as_str()],
            vec!["REPLICAOF", "NO", "ONE"],
        ),
        (
            "OOM",
            vec!["CONFIG", "SET", "maxmemory", "1"],
            vec!["CONFIG", "SET", "maxmemory", "0"],
        ),
    ];
    let admin = redis::Client::open(server.url()).unwrap();
    for (fault, start, end) in refuse {
        let keys = Idempotency::connect(&server.url())
            .await
            .unwrap()
            .with_options(IdempotencyOptions::new().lease(Duration::from_secs(10)))
            .unwrap();
        let (scope, key) = (
            Scope::new("tenant").unwrap(),
            IdempotencyKey::new(format!("pay-{fault}")).unwrap(),
        );
        let fingerprint = Fingerprint::of(&[b"x"]);
        let runs = AtomicUsize::new(0);
        for _ in 0..2 {
            let value: u32 = keys
                .run_once(&scope, &key, &fingerprint, async |_| {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let mut connection = admin.get_multiplexed_async_connection().await.unwrap();
                    let () = redis::cmd(start[0])
                        .arg(&start[1..])
                        .query_async(&mut connection)
                        .await
                        .unwrap();
                    let end: Vec<String> = end.iter().map(|part| (*part).to_owned()).collect();
                    let admin = admin.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(1_500)).await;
                        let mut connection =
                            admin.get_multiplexed_async_connection().await.unwrap();
                        let () = redis::cmd(&end[0])
                            .arg(&end[1..])
                            .query_async(&mut connection)
                            .await
                            .unwrap();
                    });
                    Ok::<_, turnstile::Error>(7)
                })
                .await
                .unwrap_or_else(|error| {
                    panic!("under {fault} the completion must wait for the server: {error}")
                });
            assert_eq!(value, 7, "under {fault}");
        }
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "under {fault} the work ran twice"
        );
    }
}

/// A store over a Redis server, with a plain connection beside it to read and write
/// what the store keeps there, and the lease and retention the tests claim with.
struct Raw {
    prefix: String,
    backend: Arc<dyn IdempotencyStore>,
    connection: MultiplexedConnection,
    scope: Scope,
    fingerprint: Fingerprint,
}

const LEASE: Duration = Duration::from_secs(5);
const RETENTION: Duration = Duration::from_secs(60);

impl Raw {
    /// On the shared server, under a prefix of its own made from `label`.
    async fn shared(label: &str) -> Raw {
        let prefix = unique_name(label);
        let url = format!("{}?turnstile_prefix={prefix}", shared_redis().url());
        Raw::on(&url, &shared_redis().url(), prefix).await
    }

    async fn on(store_url: &str, server_url: &str, prefix: String) -> Raw {
        let backend = Idempotency::connect(store_url)
            .await
            .unwrap()
            .store()
            .clone();
        let client = redis::Client::open(server_url).unwrap();
        Raw {
            prefix,
            backend,
            connection: client.get_multiplexed_async_connection().await.unwrap(),
            scope: Scope::new("tenant").unwrap(),
            fingerprint: Fingerprint::of(&[b"x"]),
        }
    }

    async fn claim(&self, key: &IdempotencyKey, lease: Duration) -> ClaimAnswer {
        self.backend
            .claim(&self.scope, key, &self.fingerprint, lease, RETENTION)
            .await
            .unwrap()
    }

    /// Claims a key nobody holds.
    async fn start(&self, key: &IdempotencyKey, lease: Duration) -> FencingToken {
        match self.claim(key, lease).await {
            ClaimAnswer::Started { token } => token,
            other => panic!("a new key was not started: {other:?}"),
        }
    }

    async fn complete(&self, key: &IdempotencyKey, token: FencingToken, outcome: &[u8]) -> Finish {
        self.backend
            .complete(&self.scope, key, token, outcome, RETENTION)
            .await
            .unwrap()
    }

    /// The store's keys that end with `suffix` (`record`, `outcome`).
    async fn keys(&mut self, suffix: &str) -> Vec<String> {
        redis::cmd("KEYS")
            .arg(format!("{}:idem:*:{suffix}", self.prefix))
            .query_async(&mut self.connection)
            .await
            .unwrap()
    }

    async fn command<T: redis::FromRedisValue>(&mut self, command: &mut redis::Cmd) -> T {
        command.query_async(&mut self.connection).await.unwrap()
    }
}

fn key(name: &str) -> IdempotencyKey {
    IdempotencyKey::new(name).unwrap()
}

/// A claim whose lease lapsed completes late, after the claim that took the key over
/// completed with a short retention: the late completion is refused and changes
/// nothing, so the key is free again once the current claim's retention ends (the
/// late caller's own 600 s retention used to be put on the record, and every claim of
/// the key got "in progress" for ten minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_late_completion_changes_nothing() {
    let raw = Raw::shared("idemlate").await;
    let late = key("late");
    let first = raw.start(&late, Duration::from_millis(1_000)).await;
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let current = raw.start(&late, LEASE).await;
    assert!(current > first);
    let complete = async |token: FencingToken, outcome: &[u8], retention: Duration| {
        raw.backend
            .complete(&raw.scope, &late, token, outcome, retention)
            .await
            .unwrap()
    };
    assert_eq!(
        complete(current, b"current", Duration::from_secs(2)).await,
        Finish::Done
    );
    assert_eq!(
        complete(first, b"late", Duration::from_secs(600)).await,
        Finish::Fenced
    );
    assert_eq!(
        raw.claim(&late, LEASE).await,
        ClaimAnswer::Replay {
            outcome: b"current".to_vec()
        }
    );
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    let answer = raw.claim(&late, LEASE).await;
    assert!(
        matches!(answer, ClaimAnswer::Started { .. }),
        "the key is still held after its retention: {answer:?}"
    );
}

/// Records written by the earlier version of this store (one script per operation,
/// letter states, the outcome inside the record as state `c`) are still read: a repeat
/// gets the replay, and one in progress is still in progress and keeps its form.
#[tokio::test]
async fn records_from_the_script_only_version_are_still_read() {
    let mut raw = Raw::shared("idemold").await;
    for (name, state, outcome) in [("done", "c", "paid"), ("busy", "p", "")] {
        // A first claim makes the record's key and its fingerprint's form; the record
        // is then overwritten as the script-only version wrote it.
        raw.start(&key(name), LEASE).await;
        let record = raw
            .keys("record")
            .await
            .pop()
            .expect("the first claim's record");
        let value: String = raw.command(redis::cmd("GET").arg(&record)).await;
        assert!(value.starts_with("2|"), "{value}");
        let fingerprint_hex = value.split('|').nth(1).unwrap().to_owned();
        let (seconds, micros): (u64, u64) = raw.command(&mut redis::cmd("TIME")).await;
        let now_ms = seconds * 1000 + micros / 1000;
        let old = format!(
            "{state}|{fingerprint_hex}|{}|{}|{}|{now_ms}|{outcome}",
            now_ms * 1000,
            now_ms + 5_000,
            now_ms + 60_000,
        );
        let () = raw
            .command(
                redis::cmd("SET")
                    .arg(&record)
                    .arg(old)
                    .arg("PX")
                    .arg(60_000),
            )
            .await;
        let answer = raw.claim(&key(name), LEASE).await;
        if state == "c" {
            assert_eq!(
                answer,
                ClaimAnswer::Replay {
                    outcome: b"paid".to_vec()
                }
            );
        } else {
            assert!(
                matches!(answer, ClaimAnswer::InProgress { .. }),
                "{answer:?}"
            );
            // The duplicate is noted in the old form, so the old version's completion
            // script still finds (and publishes) it.
            let value: String = raw.command(redis::cmd("GET").arg(&record)).await;
            assert!(value.starts_with("w|"), "{value}");
        }
        let () = raw.command(redis::cmd("DEL").arg(&record)).await;
    }
}

/// A completion's outcome outlives its record, even when a renewal with a lease longer
/// than the retention keeps the record past the retention: a record that is there never
/// names an outcome that has expired (which would read as a claim at work).
#[tokio::test]
async fn an_outcome_never_expires_before_its_record() {
    let mut raw = Raw::shared("idemttl").await;
    let lease = RETENTION * 2;
    let token = raw.start(&key("k"), lease).await;
    raw.backend
        .heartbeat(&raw.scope, &key("k"), token, lease)
        .await
        .unwrap();
    assert_eq!(raw.complete(&key("k"), token, b"paid").await, Finish::Done);
    let mut ttl = async |suffix: &str| -> i64 {
        let found = raw.keys(suffix).await;
        raw.command(redis::cmd("PTTL").arg(&found[0])).await
    };
    let (record, outcome) = (ttl("record").await, ttl("outcome").await);
    assert!(
        record > 0 && outcome > record,
        "record {record} ms, outcome {outcome} ms"
    );
}

/// The outcome slot when it is contested: a completion tried again with the same token
/// is confirmed, not refused; a slot holding a stale claimer's outcome (its SET landed
/// before it learnt it was fenced) does not keep the current claim from completing,
/// and it is the current claim's outcome that is replayed.
#[tokio::test]
async fn a_contested_outcome_slot_goes_to_the_claim_the_record_names() {
    let mut raw = Raw::shared("idemslot").await;
    let token = raw.start(&key("again"), LEASE).await;
    for _ in 0..2 {
        assert_eq!(
            raw.complete(&key("again"), token, b"once").await,
            Finish::Done
        );
    }
    let written = raw.keys("outcome").await;
    let token = raw.start(&key("taken"), LEASE).await;
    // The slot of "taken" is the one not written yet ("again"'s holds its outcome).
    let slot = raw
        .keys("record")
        .await
        .into_iter()
        .map(|record| format!("{}outcome", &record[..record.len() - "record".len()]))
        .find(|slot| !written.contains(slot))
        .expect("the second key's slot");
    let stale = token.get() - 1;
    let () = raw
        .command(
            redis::cmd("SET")
                .arg(&slot)
                .arg(format!("{stale}|stale"))
                .arg("PX")
                .arg(60_000),
        )
        .await;
    let duplicate = raw.claim(&key("taken"), LEASE).await;
    assert!(
        matches!(duplicate, ClaimAnswer::InProgress { .. }),
        "a stale claimer's outcome was read as this claim's: {duplicate:?}"
    );
    assert_eq!(
        raw.complete(&key("taken"), token, b"current").await,
        Finish::Done
    );
    for (name, expected) in [("again", &b"once"[..]), ("taken", &b"current"[..])] {
        assert_eq!(
            raw.claim(&key(name), LEASE).await,
            ClaimAnswer::Replay {
                outcome: expected.to_vec()
            }
        );
    }
}
