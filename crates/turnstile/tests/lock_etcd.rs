//! The etcd engine: the conformance suite against a real etcd member, a restart, and a
//! crashed client. (The three-member cluster has its own test binary, `lock_etcd_cluster`,
//! so that its three servers do not load the machine under the timing checks here.)

mod conformance;
mod faults;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use conformance::TestStore;
use turnstile::lock::etcd::EtcdLockStore;
use turnstile::lock::{LockOptions, Locker};
use turnstile_test_support::{EtcdServer, shared_etcd, unique_name};

#[derive(Clone)]
struct Shared {
    url: String,
}

impl TestStore for Shared {
    fn locker(&self) -> Pin<Box<dyn Future<Output = Locker> + Send + '_>> {
        Box::pin(async move { Locker::new(EtcdLockStore::connect(&self.url).await.unwrap()) })
    }
}

async fn shared() -> Shared {
    Shared {
        url: format!(
            "{}?turnstile_prefix={}",
            shared_etcd().url(),
            unique_name("t")
        ),
    }
}

conformance_tests!(super::shared);

/// Tokens are create revisions: after the member restarts (same data), a new holder's
/// token is larger than every earlier one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_grow_across_a_restart() {
    let server = EtcdServer::spawn();
    let locker = Locker::new(EtcdLockStore::connect(&server.url()).await.unwrap());
    let options = LockOptions::new()
        .ttl(Duration::from_secs(2))
        .wait(Duration::from_secs(10));
    let guard = locker.acquire("job", &options).await.unwrap();
    let before = guard.fencing_token();
    guard.release().await.unwrap();
    server.restart();
    let locker = Locker::new(EtcdLockStore::connect(&server.url()).await.unwrap());
    let guard = locker.acquire("job", &options).await.unwrap();
    assert!(guard.fencing_token() > before);
    guard.release().await.unwrap();
}

/// A waiter whose wait ends while etcd is down cannot take its key out of the line.
/// Before, the key stayed on the waiter client's session lease, which that client kept
/// alive, and once it was first in line it held the lock for good: `turnstile verify
/// lock --store etcd --faults restart` saw no acquisition for the rest of its runs. The
/// client now deletes it once etcd answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_gives_up_while_etcd_is_down_leaves_no_key_in_line() {
    let server = EtcdServer::spawn();
    let holder = Locker::new(EtcdLockStore::connect(&server.url()).await.unwrap());
    // Kept alive to the end, and with it the session lease of its key.
    let waiter = Locker::new(EtcdLockStore::connect(&server.url()).await.unwrap());
    let ttl = Duration::from_secs(2);
    let guard = holder
        .acquire("job", &LockOptions::new().ttl(ttl))
        .await
        .unwrap();
    let waiting = {
        let waiter = waiter.clone();
        tokio::spawn(async move {
            waiter
                .acquire(
                    "job",
                    &LockOptions::new().ttl(ttl).wait(Duration::from_secs(2)),
                )
                .await
                .map(drop)
        })
    };
    // The waiter is in line; then etcd goes away until its wait has ended.
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.kill();
    assert!(waiting.await.unwrap().is_err());
    server.restart();
    let _ = guard.release().await;
    let next = Locker::new(EtcdLockStore::connect(&server.url()).await.unwrap());
    let taken = next
        .acquire(
            "job",
            &LockOptions::new().ttl(ttl).wait(Duration::from_secs(10)),
        )
        .await
        .expect("the lock stayed held by the key of a waiter that had given up");
    taken.release().await.unwrap();
    drop(waiter);
}

/// A release dropped before etcd answered (the lock core bounds a release; a caller may
/// drop it) still takes the key out: the session keeper deletes it once etcd answers
/// again. Found by `turnstile verify lock --store etcd --faults partition`: a holder
/// cut off while releasing left its key first in line, and nobody got the lock for the
/// rest of the run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_dropped_unanswered_still_frees_the_lock() {
    let server = shared_etcd();
    let proxy = turnstile_test_support::TcpProxy::start(server.port());
    let url = format!(
        "{}?turnstile_prefix={}",
        server.url(),
        unique_name("dropped")
    );
    let holder = Locker::new(EtcdLockStore::connect(&proxy.url_for(&url)).await.unwrap());
    let ttl = Duration::from_secs(2);
    let guard = holder
        .acquire("job", &LockOptions::new().ttl(ttl))
        .await
        .unwrap();
    proxy.cut();
    let dropped = tokio::time::timeout(Duration::from_millis(200), guard.release()).await;
    assert!(
        dropped.is_err(),
        "the release was answered through a cut path"
    );
    // The request never reaches etcd: its connection ends with the bytes held back.
    proxy.close_connections();
    proxy.heal();
    let other = Locker::new(EtcdLockStore::connect(&url).await.unwrap());
    let taken = other
        .acquire(
            "job",
            &LockOptions::new().ttl(ttl).wait(Duration::from_secs(5)),
        )
        .await
        .expect("the key of a release dropped unanswered held the lock");
    taken.release().await.unwrap();
    drop(holder);
}

/// A client that dies holding a lock (its runtime stops: no release, no keep-alive, no
/// revoke) frees it when its session lease runs out on etcd — the TTL rounded up to
/// whole seconds, plus one second, after its last keep-alive — and not before the TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_clients_lock_frees_when_its_session_lease_ends() {
    // Session lease 2 s.
    conformance::a_crashed_clients_lock_frees_within(
        shared().await,
        Duration::from_secs(1),
        Duration::from_secs(4),
    )
    .await;
}

/// A holder cut off by a partition stops before the next holder starts: its lost
/// signal fires at its local deadline, and a client talking to etcd directly gets
/// the lock only after that (when the holder's session has ended on the server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_holder_stops_before_the_next_holder_starts() {
    let server = shared_etcd();
    let base = unique_name("partition");
    let proxy = turnstile_test_support::TcpProxy::start(server.port());
    let url = format!("{}?turnstile_prefix={}", server.url(), base);
    let holder = Locker::new(EtcdLockStore::connect(&proxy.url_for(&url)).await.unwrap());
    let direct = Locker::new(EtcdLockStore::connect(&url).await.unwrap());
    faults::a_partitioned_holder_stops_before_the_next_holder_starts(
        &proxy,
        &holder,
        &direct,
        Duration::from_secs(2),
        Duration::from_millis(1_500) + Duration::from_secs(2) / 3,
    )
    .await;
}

/// The notes' paused-holder scenario: the holder pauses past its lease, the next holder
/// gets a larger token, and the paused one's late write is refused by a fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_holders_late_write_is_rejected() {
    let server = shared_etcd();
    let locker = Locker::new(
        EtcdLockStore::connect(&format!(
            "{}?turnstile_prefix={}",
            server.url(),
            unique_name("fenced")
        ))
        .await
        .unwrap(),
    );
    let dir = tempfile::tempdir().unwrap();
    let app = sqlx::SqlitePool::connect(&format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("app.db").display()
    ))
    .await
    .unwrap();
    conformance::a_paused_holders_late_write_is_rejected_by_an_sqlite_fence(&locker, &app).await;
}

/// Names that extend one another (`acme` and `acme/x`, as a global lock and a tenant's
/// lock in the service) are separate locks: holding one neither holds nor blocks the
/// other, and breaking one leaves the other held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_and_its_extensions_are_separate_locks() {
    let store = shared().await;
    let locker = store.locker().await;
    let base = unique_name("acme");
    let options = LockOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Duration::from_millis(500));
    let extension = locker
        .acquire(format!("{base}/x").as_str(), &options)
        .await
        .unwrap();
    let plain = locker
        .acquire(base.as_str(), &options)
        .await
        .expect("a lock under a longer name blocked this one");
    assert!(locker.force_release(base.as_str()).await.unwrap().is_some());
    let status = locker.status(format!("{base}/x").as_str()).await.unwrap();
    assert!(status.is_some(), "breaking {base} broke {base}/x");
    drop(plain);
    extension.release().await.unwrap();
}
