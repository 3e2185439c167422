//! The Redis idempotency store: the conformance suite against a real redis-server.

mod idempotency_conformance;

use std::future::Future;
use std::pin::Pin;

use idempotency_conformance::TestStore;
use turnstile::idempotency::Idempotency;
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
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;
    use turnstile::idempotency::{Fingerprint, IdempotencyKey, IdempotencyOptions, Scope};
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

/// How many scripts (`EVAL`, `EVALSHA`) the server has run, from `INFO commandstats`.
async fn scripts_run(connection: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(connection)
        .await
        .unwrap();
    info.lines()
        .filter(|line| line.starts_with("cmdstat_eval:") || line.starts_with("cmdstat_evalsha:"))
        .map(|line| {
            let calls = line.split("calls=").nth(1).unwrap();
            calls[..calls.find(',').unwrap()].parse::<u64>().unwrap()
        })
        .sum()
}

/// A key nobody has claimed is claimed and completed with plain commands (no script
/// runs on the server), and so are a repeat's replay and another body's mismatch; a
/// script runs only for a duplicate of a claim still at work.
#[tokio::test]
async fn a_new_keys_claim_and_completion_run_no_script() {
    use std::time::Duration;
    use turnstile::idempotency::{ClaimAnswer, Fingerprint, Finish, IdempotencyKey, Scope};
    let server = turnstile_test_support::RedisServer::spawn();
    let client = redis::Client::open(server.url()).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    let backend = Idempotency::connect(&server.url())
        .await
        .unwrap()
        .store()
        .clone();
    let (scope, fingerprint) = (Scope::new("tenant").unwrap(), Fingerprint::of(&[b"x"]));
    let (lease, retention) = (Duration::from_secs(5), Duration::from_secs(60));
    let before = scripts_run(&mut connection).await;
    for n in 0..20 {
        let key = IdempotencyKey::new(format!("new-{n}")).unwrap();
        let ClaimAnswer::Started { token } = backend
            .claim(&scope, &key, &fingerprint, lease, retention)
            .await
            .unwrap()
        else {
            panic!("a new key was not started");
        };
        assert_eq!(
            backend
                .complete(&scope, &key, token, b"paid", retention)
                .await
                .unwrap(),
            Finish::Done
        );
    }
    assert_eq!(
        scripts_run(&mut connection).await,
        before,
        "a new key's claim or completion ran a script"
    );
    let key = IdempotencyKey::new("new-0").unwrap();
    assert_eq!(
        backend
            .claim(&scope, &key, &fingerprint, lease, retention)
            .await
            .unwrap(),
        ClaimAnswer::Replay {
            outcome: b"paid".to_vec()
        }
    );
    assert_eq!(
        backend
            .claim(&scope, &key, &Fingerprint::of(&[b"y"]), lease, retention)
            .await
            .unwrap(),
        ClaimAnswer::Mismatch
    );
    assert_eq!(
        scripts_run(&mut connection).await,
        before,
        "a replay or a mismatch ran a script"
    );
    let busy = IdempotencyKey::new("busy").unwrap();
    let started = backend
        .claim(&scope, &busy, &fingerprint, lease, retention)
        .await
        .unwrap();
    assert!(
        matches!(started, ClaimAnswer::Started { .. }),
        "{started:?}"
    );
    let duplicate = backend
        .claim(&scope, &busy, &fingerprint, lease, retention)
        .await
        .unwrap();
    assert!(
        matches!(duplicate, ClaimAnswer::InProgress { .. }),
        "{duplicate:?}"
    );
    assert!(
        scripts_run(&mut connection).await > before,
        "a duplicate of a claim at work is decided by the claim script"
    );
}

/// Records written by the earlier version of this store (one script per operation,
/// letter states, the outcome inside the record as state `c`) are still read: a repeat
/// gets the replay, and one in progress is still in progress and keeps its form.
#[tokio::test]
async fn records_from_the_script_only_version_are_still_read() {
    use std::time::Duration;
    use turnstile::idempotency::{ClaimAnswer, Fingerprint, IdempotencyKey, Scope};
    let prefix = unique_name("idemold");
    let url = format!("{}?turnstile_prefix={prefix}", shared_redis().url());
    let backend = Idempotency::connect(&url).await.unwrap().store().clone();
    let client = redis::Client::open(shared_redis().url()).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    let (scope, fingerprint) = (Scope::new("tenant").unwrap(), Fingerprint::of(&[b"x"]));
    let (lease, retention) = (Duration::from_secs(5), Duration::from_secs(60));
    for (name, state, outcome) in [("done", "c", "paid"), ("busy", "p", "")] {
        let key = IdempotencyKey::new(name).unwrap();
        // A first claim names the record's key and its fingerprint's form; the record is
        // then overwritten as the script-only version wrote it.
        let started = backend
            .claim(&scope, &key, &fingerprint, lease, retention)
            .await
            .unwrap();
        assert!(
            matches!(started, ClaimAnswer::Started { .. }),
            "{started:?}"
        );
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}:idem:*:record"))
            .query_async(&mut connection)
            .await
            .unwrap();
        let mut record = None;
        for candidate in keys {
            let value: String = redis::cmd("GET")
                .arg(&candidate)
                .query_async(&mut connection)
                .await
                .unwrap();
            if value.starts_with("1|") {
                record = Some((candidate, value));
            }
        }
        let (record, value) = record.expect("the first claim's record");
        let fingerprint_hex = value.split('|').nth(1).unwrap().to_owned();
        let time: (String, String) = redis::cmd("TIME")
            .query_async(&mut connection)
            .await
            .unwrap();
        let now_ms = time.0.parse::<u64>().unwrap() * 1000 + time.1.parse::<u64>().unwrap() / 1000;
        let old = format!(
            "{state}|{fingerprint_hex}|{}|{}|{}|{now_ms}|{outcome}",
            now_ms * 1000,
            now_ms + 5_000,
            now_ms + 60_000,
        );
        let _: () = redis::cmd("SET")
            .arg(&record)
            .arg(old)
            .arg("PX")
            .arg(60_000)
            .query_async(&mut connection)
            .await
            .unwrap();
        let answer = backend
            .claim(&scope, &key, &fingerprint, lease, retention)
            .await
            .unwrap();
        match state {
            "c" => assert_eq!(
                answer,
                ClaimAnswer::Replay {
                    outcome: b"paid".to_vec()
                }
            ),
            _ => {
                assert!(
                    matches!(answer, ClaimAnswer::InProgress { .. }),
                    "{answer:?}"
                );
                // The duplicate is noted in the old form, so the old version's
                // completion script still finds (and publishes) it.
                let value: String = redis::cmd("GET")
                    .arg(&record)
                    .query_async(&mut connection)
                    .await
                    .unwrap();
                assert!(value.starts_with("w|"), "{value}");
            }
        }
        let _: () = redis::cmd("DEL")
            .arg(&record)
            .query_async(&mut connection)
            .await
            .unwrap();
    }
}

/// A completion's outcome outlives its record, even when a renewal with a lease
/// longer than the retention keeps the record past the retention: a record that is
/// there never names an outcome that has expired (which would read as a claim at work).
#[tokio::test]
async fn an_outcome_never_expires_before_its_record() {
    use std::time::Duration;
    use turnstile::idempotency::{ClaimAnswer, Fingerprint, Finish, IdempotencyKey, Scope};
    let prefix = unique_name("idemttl");
    let url = format!("{}?turnstile_prefix={prefix}", shared_redis().url());
    let backend = Idempotency::connect(&url).await.unwrap().store().clone();
    let client = redis::Client::open(shared_redis().url()).unwrap();
    let (scope, key) = (
        Scope::new("tenant").unwrap(),
        IdempotencyKey::new("k").unwrap(),
    );
    let fingerprint = Fingerprint::of(&[b"x"]);
    let (lease, retention) = (Duration::from_secs(30), Duration::from_secs(2));
    let ClaimAnswer::Started { token } = backend
        .claim(&scope, &key, &fingerprint, lease, retention)
        .await
        .unwrap()
    else {
        panic!("a new key was not started");
    };
    backend.heartbeat(&scope, &key, token, lease).await.unwrap();
    assert_eq!(
        backend
            .complete(&scope, &key, token, b"paid", retention)
            .await
            .unwrap(),
        Finish::Done
    );
    let ttl = |suffix: &'static str| {
        let pattern = format!("{prefix}:idem:*:{suffix}");
        let client = client.clone();
        async move {
            let mut connection = client.get_multiplexed_async_connection().await.unwrap();
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(pattern)
                .query_async(&mut connection)
                .await
                .unwrap();
            let ttl: i64 = redis::cmd("PTTL")
                .arg(&keys[0])
                .query_async(&mut connection)
                .await
                .unwrap();
            ttl
        }
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
    use std::time::Duration;
    use turnstile::idempotency::{ClaimAnswer, Fingerprint, Finish, IdempotencyKey, Scope};
    let prefix = unique_name("idemslot");
    let url = format!("{}?turnstile_prefix={prefix}", shared_redis().url());
    let backend = Idempotency::connect(&url).await.unwrap().store().clone();
    let client = redis::Client::open(shared_redis().url()).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    let scope = Scope::new("tenant").unwrap();
    let fingerprint = Fingerprint::of(&[b"x"]);
    let (lease, retention) = (Duration::from_secs(5), Duration::from_secs(60));

    let again = IdempotencyKey::new("again").unwrap();
    let ClaimAnswer::Started { token } = backend
        .claim(&scope, &again, &fingerprint, lease, retention)
        .await
        .unwrap()
    else {
        panic!("a new key was not started");
    };
    for _ in 0..2 {
        assert_eq!(
            backend
                .complete(&scope, &again, token, b"once", retention)
                .await
                .unwrap(),
            Finish::Done
        );
    }

    let taken = IdempotencyKey::new("taken").unwrap();
    let ClaimAnswer::Started { token } = backend
        .claim(&scope, &taken, &fingerprint, lease, retention)
        .await
        .unwrap()
    else {
        panic!("a new key was not started");
    };
    let slots: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:idem:*:outcome"))
        .query_async(&mut connection)
        .await
        .unwrap();
    let record_slot = {
        // The slot of "taken" is the one not yet written ("again"'s holds its outcome).
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}:idem:*:record"))
            .query_async(&mut connection)
            .await
            .unwrap();
        keys.into_iter()
            .map(|record| format!("{}outcome", &record[..record.len() - "record".len()]))
            .find(|slot| !slots.contains(slot))
            .expect("the second key's slot")
    };
    let stale = token.get() - 1;
    let _: () = redis::cmd("SET")
        .arg(&record_slot)
        .arg(format!("{stale}|stale"))
        .arg("PX")
        .arg(60_000)
        .query_async(&mut connection)
        .await
        .unwrap();
    let duplicate = backend
        .claim(&scope, &taken, &fingerprint, lease, retention)
        .await
        .unwrap();
    assert!(
        matches!(duplicate, ClaimAnswer::InProgress { .. }),
        "a stale claimer's outcome was read as this claim's: {duplicate:?}"
    );
    assert_eq!(
        backend
            .complete(&scope, &taken, token, b"current", retention)
            .await
            .unwrap(),
        Finish::Done
    );
    for key in [&again, &taken] {
        let answer = backend
            .claim(&scope, key, &fingerprint, lease, retention)
            .await
            .unwrap();
        let expected: &[u8] = if key == &again { b"once" } else { b"current" };
        assert_eq!(
            answer,
            ClaimAnswer::Replay {
                outcome: expected.to_vec()
            }
        );
    }
}
