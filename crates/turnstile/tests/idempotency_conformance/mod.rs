//! The conformance suite every idempotency store must pass, written once.
//!
//! An engine's test file implements [`TestStore`] (another independent client of the
//! same store — a stand-in for another process) and invokes
//! `idempotency_conformance_tests!(make_store)`.

#![allow(dead_code, unreachable_pub)]

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use turnstile::ErrorKind;
use turnstile::idempotency::{
    ClaimAnswer, Fingerprint, Finish, Idempotency, IdempotencyKey, IdempotencyOptions, RecordState,
    Scope,
};
use turnstile::lock::{ExtendOutcome, LossReason};

/// A store under test.
pub trait TestStore: Send + Sync + 'static {
    /// A new client with its own connections, as another process would have.
    fn client(&self) -> Pin<Box<dyn Future<Output = Idempotency> + Send + '_>>;
}

fn key() -> IdempotencyKey {
    IdempotencyKey::new(turnstile_test_support::unique_name("k")).unwrap()
}

fn scope(label: &str) -> Scope {
    Scope::new(turnstile_test_support::unique_name(label)).unwrap()
}

fn request(body: &str) -> Fingerprint {
    Fingerprint::of(&[b"POST", b"/payments", body.as_bytes()])
}

/// 50 concurrent duplicates from two clients run the work exactly once; with a wait
/// bound every one of them gets the first one's outcome.
pub async fn concurrent_duplicates_run_the_work_once(store: impl TestStore) {
    let (scope, key, fingerprint) = (scope("dup"), key(), request("100 EUR"));
    let runs = Arc::new(AtomicUsize::new(0));
    let options = IdempotencyOptions::new()
        .lease(Duration::from_secs(10))
        .wait(Duration::from_secs(20));
    let clients = [
        store.client().await.with_options(options.clone()).unwrap(),
        store.client().await.with_options(options).unwrap(),
    ];
    let mut tasks = Vec::new();
    for i in 0..50 {
        let client = clients[i % 2].clone();
        let (scope, key, runs) = (scope.clone(), key.clone(), runs.clone());
        tasks.push(tokio::spawn(async move {
            client
                .run_once(&scope, &key, &fingerprint, |token| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    Ok::<_, turnstile::Error>(format!("charge-{}", token.get()))
                })
                .await
        }));
    }
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.push(task.await.unwrap().unwrap());
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the work ran more than once"
    );
    outcomes.dedup();
    assert_eq!(
        outcomes.len(),
        1,
        "duplicates got different outcomes: {outcomes:?}"
    );
}

/// Without a wait bound, a duplicate in flight is told so at once (retryable), and the
/// work still runs once.
pub async fn a_duplicate_in_flight_is_told_so(store: impl TestStore) {
    let (scope, key, fingerprint) = (scope("busy"), key(), request("x"));
    let client = store.client().await;
    let other = store.client().await;
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let (finish_tx, finish) = tokio::sync::oneshot::channel::<()>();
    let first = {
        let (client, scope, key) = (client.clone(), scope.clone(), key.clone());
        tokio::spawn(async move {
            client
                .run_once(&scope, &key, &fingerprint, |_| async move {
                    let _ = started_tx.send(());
                    let _ = finish.await;
                    Ok::<_, turnstile::Error>(7u32)
                })
                .await
        })
    };
    started.await.unwrap();
    let error = other
        .run_once(&scope, &key, &fingerprint, |_| async {
            Ok::<_, turnstile::Error>(8u32)
        })
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InProgress, "{error}");
    assert!(error.is_retryable());
    finish_tx.send(()).unwrap();
    assert_eq!(first.await.unwrap().unwrap(), 7);
    let replay: u32 = other
        .run_once(&scope, &key, &fingerprint, |_| async {
            Ok::<_, turnstile::Error>(9u32)
        })
        .await
        .unwrap();
    assert_eq!(replay, 7, "the stored outcome is replayed");
}

/// The same key with another request is refused; another scope is another key.
pub async fn keys_are_bound_to_their_request_and_scope(store: impl TestStore) {
    let client = store.client().await;
    let (tenant_a, tenant_b, key) = (scope("a"), scope("b"), key());
    let a: String = client
        .run_once(&tenant_a, &key, &request("alice pays 10"), |_| async {
            Ok::<_, turnstile::Error>("a".to_owned())
        })
        .await
        .unwrap();
    assert_eq!(a, "a");
    let error = client
        .run_once(&tenant_a, &key, &request("alice pays 99"), |_| async {
            Ok::<_, turnstile::Error>("tampered".to_owned())
        })
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::KeyMismatch, "{error}");
    assert!(!error.is_retryable());
    // Tenant B uses the same key for its own request: its own work runs, and tenant A's
    // outcome is never replayed to it.
    let b: String = client
        .run_once(&tenant_b, &key, &request("alice pays 10"), |_| async {
            Ok::<_, turnstile::Error>("b".to_owned())
        })
        .await
        .unwrap();
    assert_eq!(b, "b");
}

/// Work that fails gives the key back: the retry runs again, and its success is stored.
pub async fn a_failure_gives_the_key_back(store: impl TestStore) {
    let client = store.client().await;
    let (scope, key, fingerprint) = (scope("fail"), key(), request("x"));
    let runs = Arc::new(AtomicUsize::new(0));
    let attempt = |fail: bool| {
        let runs = runs.clone();
        move |_| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            if fail {
                Err(turnstile::Error::new(
                    ErrorKind::StoreUnavailable,
                    "provider down",
                ))
            } else {
                Ok(1u8)
            }
        }
    };
    let error = client
        .run_once(&scope, &key, &fingerprint, attempt(true))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::StoreUnavailable);
    assert_eq!(
        client
            .run_once(&scope, &key, &fingerprint, attempt(false))
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        client
            .run_once(&scope, &key, &fingerprint, attempt(false))
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the failure ran again, the success did not"
    );
}

/// A key given back after a failure keeps its request's fingerprint until the
/// retention ends: the same request claims it again, another request under that key is
/// a mismatch (a key names one request for its whole life).
pub async fn a_given_back_key_keeps_its_fingerprint(store: impl TestStore) {
    let client = store.client().await;
    let backend = client.store().clone();
    let (scope, key) = (scope("givenback"), key());
    let (lease, day) = (Duration::from_secs(10), Duration::from_secs(86_400));
    let ClaimAnswer::Started { token } = backend
        .claim(&scope, &key, &request("x"), lease, day)
        .await
        .unwrap()
    else {
        panic!("the key was free");
    };
    assert_eq!(
        backend.release(&scope, &key, token).await.unwrap(),
        Finish::Done
    );
    assert_eq!(
        backend
            .claim(&scope, &key, &request("y"), lease, day)
            .await
            .unwrap(),
        ClaimAnswer::Mismatch,
        "another request took a given-back key"
    );
    let again = backend
        .claim(&scope, &key, &request("x"), lease, day)
        .await
        .unwrap();
    assert!(
        matches!(again, ClaimAnswer::Started { token: next } if next > token),
        "{again:?}"
    );
}

/// A completion tried again by the claim that made it (its first reply was lost) is a
/// success, not "fenced", and leaves the first outcome in place; a heartbeat that
/// finds its own claim completed is no loss. No caller is told to compensate for a
/// request that is in fact recorded.
pub async fn a_completion_retried_by_its_claim_succeeds(store: impl TestStore) {
    let client = store.client().await;
    let backend = client.store().clone();
    let (scope, key, fingerprint) = (scope("retried"), key(), request("x"));
    let (lease, day) = (Duration::from_secs(10), Duration::from_secs(86_400));
    let ClaimAnswer::Started { token } = backend
        .claim(&scope, &key, &fingerprint, lease, day)
        .await
        .unwrap()
    else {
        panic!("the key was free");
    };
    for outcome in [&b"\"first\""[..], b"\"again\""] {
        assert_eq!(
            backend
                .complete(&scope, &key, token, outcome, day)
                .await
                .unwrap(),
            Finish::Done,
            "a completion by the claim that completed the record"
        );
    }
    assert_eq!(
        backend.heartbeat(&scope, &key, token, lease).await.unwrap(),
        ExtendOutcome::Extended,
        "a heartbeat of the claim that completed the record"
    );
    assert_eq!(
        backend
            .claim(&scope, &key, &fingerprint, lease, day)
            .await
            .unwrap(),
        ClaimAnswer::Replay {
            outcome: b"\"first\"".to_vec()
        }
    );
}

/// A worker whose lease ran out cannot store its outcome once another claim took the
/// key over; tokens increase; the newer claim's outcome is the one replayed.
pub async fn a_stale_worker_cannot_complete(store: impl TestStore) {
    let client = store.client().await;
    let backend = client.store().clone();
    let (scope, key, fingerprint) = (scope("stale"), key(), request("x"));
    let lease = Duration::from_secs(1);
    let day = Duration::from_secs(86_400);
    let ClaimAnswer::Started { token: stale } = backend
        .claim(&scope, &key, &fingerprint, lease, day)
        .await
        .unwrap()
    else {
        panic!("the key was free");
    };
    match backend
        .claim(&scope, &key, &fingerprint, lease, day)
        .await
        .unwrap()
    {
        ClaimAnswer::InProgress { lease_left } => {
            assert!(
                lease_left.is_some_and(|left| left <= lease),
                "{lease_left:?}"
            )
        }
        other => panic!("expected in progress, got {other:?}"),
    }
    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    let ClaimAnswer::Started { token: fresh } = backend
        .claim(&scope, &key, &fingerprint, lease * 10, day)
        .await
        .unwrap()
    else {
        panic!("a claim whose lease ran out was not taken over");
    };
    assert!(fresh > stale, "token {fresh} after {stale}");
    assert_eq!(
        backend.heartbeat(&scope, &key, stale, lease).await.unwrap(),
        ExtendOutcome::Lost(LossReason::TakenOver)
    );
    assert_eq!(
        backend
            .complete(&scope, &key, stale, b"\"stale\"", day)
            .await
            .unwrap(),
        Finish::Fenced
    );
    assert_eq!(
        backend.release(&scope, &key, stale).await.unwrap(),
        Finish::Fenced
    );
    assert_eq!(
        backend
            .complete(&scope, &key, fresh, b"\"fresh\"", day)
            .await
            .unwrap(),
        Finish::Done
    );
    let replay: String = client
        .run_once(&scope, &key, &fingerprint, |_| async {
            Ok::<_, turnstile::Error>("x".to_owned())
        })
        .await
        .unwrap();
    assert_eq!(replay, "fresh");
    let record = backend.get(&scope, &key).await.unwrap().expect("stored");
    assert_eq!(record.state, RecordState::Completed);
    assert_eq!(record.token, fresh);
}

/// A worker that died mid-request leaves the key claimable once its lease runs out,
/// and a waiting retry completes it once.
pub async fn a_dead_workers_key_is_claimable_after_its_lease(store: impl TestStore) {
    let client = store.client().await;
    let (scope, key, fingerprint) = (scope("dead"), key(), request("x"));
    let lease = Duration::from_secs(1);
    // The dead worker: claimed and never heard of again.
    let claimed = client
        .store()
        .claim(&scope, &key, &fingerprint, lease, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(
        matches!(claimed, ClaimAnswer::Started { .. }),
        "{claimed:?}"
    );
    let retry = store
        .client()
        .await
        .with_options(IdempotencyOptions::new().wait(Duration::from_secs(10)))
        .unwrap();
    let started = Instant::now();
    let value: u32 = retry
        .run_once(&scope, &key, &fingerprint, |_| async {
            Ok::<_, turnstile::Error>(5u32)
        })
        .await
        .unwrap();
    assert_eq!(value, 5);
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(800) && took < Duration::from_secs(4),
        "the retry got the key after {took:?} (lease 1 s)"
    );
}

/// A long piece of work keeps its claim: the lease is renewed while it runs, so a
/// duplicate arriving after several leases is still told "in progress".
pub async fn the_lease_is_renewed_while_the_work_runs(store: impl TestStore) {
    let options = IdempotencyOptions::new().lease(Duration::from_secs(1));
    let client = store.client().await.with_options(options.clone()).unwrap();
    let other = store.client().await.with_options(options).unwrap();
    let (scope, key, fingerprint) = (scope("long"), key(), request("x"));
    let work = {
        let (scope, key) = (scope.clone(), key.clone());
        tokio::spawn(async move {
            client
                .run_once(&scope, &key, &fingerprint, |_| async {
                    tokio::time::sleep(Duration::from_millis(3_500)).await;
                    Ok::<_, turnstile::Error>(1u8)
                })
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let error = other
        .run_once(&scope, &key, &fingerprint, |_| async {
            Ok::<_, turnstile::Error>(2u8)
        })
        .await
        .unwrap_err();
    assert_eq!(
        error.kind(),
        ErrorKind::InProgress,
        "the claim was not renewed: {error}"
    );
    assert_eq!(work.await.unwrap().unwrap(), 1);
}

/// Records are kept for the retention, by the store's clock; then a retry runs again,
/// and sweeping removes them.
pub async fn retention_ends_and_sweeping_removes(store: impl TestStore) {
    let options = IdempotencyOptions::new()
        .lease(Duration::from_secs(1))
        .retention(Duration::from_secs(1));
    let client = store.client().await.with_options(options).unwrap();
    let (scope, key, fingerprint) = (scope("ret"), key(), request("x"));
    let runs = Arc::new(AtomicUsize::new(0));
    let work = || {
        let runs = runs.clone();
        move |_| async move { Ok::<_, turnstile::Error>(runs.fetch_add(1, Ordering::SeqCst)) }
    };
    assert_eq!(
        client
            .run_once(&scope, &key, &fingerprint, work())
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        client
            .run_once(&scope, &key, &fingerprint, work())
            .await
            .unwrap(),
        0
    );
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    assert!(
        client.store().get(&scope, &key).await.unwrap().is_none(),
        "kept past retention"
    );
    let swept = client.store().sweep(1_000).await.unwrap();
    // Redis expires records itself; the SQL stores delete them here.
    let redis = client.store().describe().starts_with("redis");
    assert!(redis || swept >= 1, "nothing swept");
    assert_eq!(
        client
            .run_once(&scope, &key, &fingerprint, work())
            .await
            .unwrap(),
        1
    );
}

/// A claim at work outlives the record's retention: while its lease is renewed no
/// other request gets the key (not a duplicate, not another body), and its completion
/// is kept for the retention from the completion, not from the claim.
pub async fn a_claim_at_work_outlives_the_retention(store: impl TestStore) {
    let client = store.client().await;
    let backend = client.store().clone();
    let (scope, key, fingerprint) = (scope("outlive"), key(), request("x"));
    let (lease, retention) = (Duration::from_secs(4), Duration::from_secs(2));
    let ClaimAnswer::Started { token } = backend
        .claim(&scope, &key, &fingerprint, lease, retention)
        .await
        .unwrap()
    else {
        panic!("free");
    };
    tokio::time::sleep(Duration::from_millis(2_300)).await;
    assert_eq!(
        backend.heartbeat(&scope, &key, token, lease).await.unwrap(),
        ExtendOutcome::Extended
    );
    for other in [request("x"), request("another body")] {
        let answer = backend
            .claim(&scope, &key, &other, lease, retention)
            .await
            .unwrap();
        assert!(
            !matches!(answer, ClaimAnswer::Started { .. }),
            "a claim at work was handed to another request past the retention: {answer:?}"
        );
    }
    let record = backend.get(&scope, &key).await.unwrap();
    assert_eq!(
        record.map(|record| record.state),
        Some(RecordState::InProgress)
    );
    assert_eq!(
        backend
            .complete(&scope, &key, token, b"done", retention)
            .await
            .unwrap(),
        Finish::Done
    );
    // Past a second after the completion (the old floor), within the retention from it.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(
        backend
            .claim(&scope, &key, &fingerprint, lease, retention)
            .await
            .unwrap(),
        ClaimAnswer::Replay {
            outcome: b"done".to_vec()
        }
    );
}

/// The background sweeper deletes what is past its retention, in batches until none
/// is left, and spares a claim at work whose retention has passed.
pub async fn the_sweeper_deletes_expired_records_and_spares_live_claims(store: impl TestStore) {
    let client = store.client().await;
    let backend = client.store().clone();
    let scope = scope("sweeper");
    let second = Duration::from_secs(1);
    for _ in 0..5 {
        let key = key();
        let ClaimAnswer::Started { token } = backend
            .claim(&scope, &key, &request("x"), second, second)
            .await
            .unwrap()
        else {
            panic!("free");
        };
        backend
            .complete(&scope, &key, token, b"done", second)
            .await
            .unwrap();
    }
    let working = key();
    let ClaimAnswer::Started { .. } = backend
        .claim(
            &scope,
            &working,
            &request("x"),
            Duration::from_secs(30),
            second,
        )
        .await
        .unwrap()
    else {
        panic!("free");
    };
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let sweeper = tokio::spawn({
        let (client, shutdown) = (client.clone(), shutdown.clone());
        // Batches of two: the five records take three statements in one pass.
        async move {
            client
                .run_sweeper(Duration::from_secs(60), 2, shutdown)
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), sweeper)
        .await
        .expect("the sweeper stops when told")
        .unwrap();
    assert_eq!(
        backend.sweep(1_000).await.unwrap(),
        0,
        "left for a later sweep"
    );
    let record = backend.get(&scope, &working).await.unwrap();
    assert_eq!(
        record.map(|record| record.state),
        Some(RecordState::InProgress),
        "a claim at work was swept"
    );
}

/// An operator's forget: a completed key runs again; a claim at work is fenced out.
pub async fn forgetting_a_key(store: impl TestStore) {
    let client = store.client().await;
    let backend = client.store().clone();
    let (scope, key, fingerprint) = (scope("forget"), key(), request("x"));
    let day = Duration::from_secs(86_400);
    assert!(
        !backend.forget(&scope, &key).await.unwrap(),
        "nothing to forget yet"
    );
    let ClaimAnswer::Started { token } = backend
        .claim(&scope, &key, &fingerprint, day, day)
        .await
        .unwrap()
    else {
        panic!("free");
    };
    assert!(backend.forget(&scope, &key).await.unwrap());
    assert_eq!(
        backend
            .complete(&scope, &key, token, b"1", day)
            .await
            .unwrap(),
        Finish::Fenced,
        "a forgotten claim completed"
    );
    let value: u8 = client
        .run_once(&scope, &key, &fingerprint, |_| async {
            Ok::<_, turnstile::Error>(2u8)
        })
        .await
        .unwrap();
    assert_eq!(value, 2);
}

/// Bad input gets a specific error, never a panic.
pub async fn bad_input_is_refused(store: impl TestStore) {
    let client = store.client().await;
    assert_eq!(
        IdempotencyKey::new("").unwrap_err().kind(),
        ErrorKind::InvalidName
    );
    assert_eq!(
        IdempotencyKey::new("x".repeat(256)).unwrap_err().kind(),
        ErrorKind::InvalidName
    );
    assert_eq!(Scope::new("").unwrap_err().kind(), ErrorKind::InvalidName);
    let error = client
        .clone()
        .with_options(IdempotencyOptions::new().lease(Duration::ZERO))
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidOptions);
    // An outcome too large to keep is refused, and the key given back.
    let (scope, key, fingerprint) = (scope("big"), key(), request("x"));
    let backend = client.store().clone();
    let ClaimAnswer::Started { token } = backend
        .claim(
            &scope,
            &key,
            &fingerprint,
            Duration::from_secs(5),
            Duration::from_secs(60),
        )
        .await
        .unwrap()
    else {
        panic!("free");
    };
    let huge = vec![b'x'; turnstile::idempotency::MAX_OUTCOME_LEN + 1];
    let error = backend
        .complete(&scope, &key, token, &huge, Duration::from_secs(60))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidOptions);
}

/// Claims whose lease ran out are listed for operators (stores that can list them).
pub async fn stale_claims_are_listed(store: impl TestStore) {
    let client = store.client().await;
    let backend = client.store().clone();
    let (scope, key, fingerprint) = (scope("stale-list"), key(), request("x"));
    backend
        .claim(
            &scope,
            &key,
            &fingerprint,
            Duration::from_secs(1),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    match backend.stale(1_000).await {
        Ok(stale) => {
            let found = stale
                .iter()
                .find(|claim| claim.scope == scope.as_str() && claim.key == key.as_str())
                .expect("the stale claim is listed");
            assert!(found.overdue >= Duration::from_millis(100), "{found:?}");
        }
        Err(error) => {
            assert_eq!(error.kind(), ErrorKind::UnsupportedStore, "{error}");
            assert!(
                backend.describe().starts_with("redis"),
                "only Redis cannot list"
            );
        }
    }
}

/// Generates one `#[tokio::test]` per conformance check for the store `$make` builds.
#[macro_export]
macro_rules! idempotency_conformance_tests {
    ($make:expr) => {
        $crate::idempotency_conformance_tests!(@each $make;
            concurrent_duplicates_run_the_work_once,
            a_duplicate_in_flight_is_told_so,
            keys_are_bound_to_their_request_and_scope,
            a_failure_gives_the_key_back,
            a_stale_worker_cannot_complete,
            a_completion_retried_by_its_claim_succeeds,
            a_given_back_key_keeps_its_fingerprint,
            a_dead_workers_key_is_claimable_after_its_lease,
            the_lease_is_renewed_while_the_work_runs,
            retention_ends_and_sweeping_removes,
            a_claim_at_work_outlives_the_retention,
            the_sweeper_deletes_expired_records_and_spares_live_claims,
            forgetting_a_key,
            bad_input_is_refused,
            stale_claims_are_listed,
        );
    };
    (@each $make:expr; $($check:ident),* $(,)?) => {
        mod idempotency_conformance_checks {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $check() {
                    idempotency_conformance::$check($make().await).await;
                }
            )*
        }
    };
}

/// Per-key cursors (the inbox's in-order processing): `step(key, seq)` moves the cursor
/// of one consumer in a transaction of its own and commits.
#[allow(dead_code)]
pub async fn cursors_follow_each_keys_sequence<F>(step: F)
where
    F: AsyncFn(&str, u64) -> turnstile::idempotency::CursorStep,
{
    use turnstile::idempotency::CursorStep;
    assert_eq!(step("a", 2).await, CursorStep::Early { expected: 1 });
    assert_eq!(step("a", 1).await, CursorStep::Next);
    assert_eq!(step("a", 1).await, CursorStep::Seen);
    assert_eq!(step("a", 3).await, CursorStep::Early { expected: 2 });
    assert_eq!(step("a", 2).await, CursorStep::Next);
    assert_eq!(step("a", 3).await, CursorStep::Next);
    // Keys are independent.
    assert_eq!(step("b", 1).await, CursorStep::Next);
    assert_eq!(step("a", 2).await, CursorStep::Seen);
}
