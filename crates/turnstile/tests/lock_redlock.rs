//! RedLock over five real redis-server processes: the conformance suite, then nodes
//! killed and emptied.

mod conformance;

use std::future::Future;
use std::pin::Pin;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use conformance::TestStore;
use turnstile::ErrorKind;
use turnstile::lock::redlock::RedLockStore;
use turnstile::lock::{LockOptions, Locker};
use turnstile_test_support::{RedisServer, unique_name};

fn url_of(servers: &[RedisServer], prefix: &str) -> String {
    let hosts: Vec<String> = servers
        .iter()
        .map(|server| format!("127.0.0.1:{}", server.port()))
        .collect();
    format!("redlock://{}?turnstile_prefix={prefix}", hosts.join(","))
}

fn shared_nodes() -> &'static [RedisServer] {
    static NODES: OnceLock<Vec<RedisServer>> = OnceLock::new();
    NODES.get_or_init(|| (0..5).map(|_| RedisServer::spawn()).collect())
}

struct Shared {
    url: String,
}

impl TestStore for Shared {
    fn locker(&self) -> Pin<Box<dyn Future<Output = Locker> + Send + '_>> {
        Box::pin(async move { Locker::new(RedLockStore::connect(&self.url).await.unwrap()) })
    }
}

async fn shared() -> Shared {
    Shared {
        url: url_of(shared_nodes(), &unique_name("t")),
    }
}

conformance_tests!(super::shared);

fn options() -> LockOptions {
    LockOptions::new()
        .ttl(Duration::from_secs(2))
        .wait(Duration::from_secs(3))
}

/// With two of five nodes dead the lock works as before; with three dead an acquisition
/// fails at once with a clear error rather than hanging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_minority_may_die_a_majority_may_not() {
    let nodes: Vec<RedisServer> = (0..5).map(|_| RedisServer::spawn()).collect();
    let url = url_of(&nodes, "m");
    let first = Locker::new(RedLockStore::connect(&url).await.unwrap());
    let second = Locker::new(RedLockStore::connect(&url).await.unwrap());
    nodes[0].kill();
    nodes[1].kill();
    let guard = first.acquire("job", &options()).await.unwrap();
    assert!(
        second
            .try_acquire("job", &options())
            .await
            .unwrap()
            .is_none(),
        "a second holder got in"
    );
    // Renewals keep a majority: still held after several TTLs.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!guard.is_lost());
    guard.release().await.unwrap();
    second
        .acquire("job", &options())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();

    nodes[2].kill();
    let started = Instant::now();
    let error = first.acquire("other", &options()).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::StoreUnavailable, "{error}");
    assert!(error.to_string().contains("of 5 RedLock nodes"), "{error}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
}

/// A node restarted empty while the lock is held: the holder keeps its majority (four of
/// five), renewals go on, and nobody else gets in; tokens of later holders are larger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarted_empty_mid_hold_changes_nothing() {
    let nodes: Vec<RedisServer> = (0..5).map(|_| RedisServer::spawn()).collect();
    let url = url_of(&nodes, "r");
    let first = Locker::new(RedLockStore::connect(&url).await.unwrap());
    let second = Locker::new(RedLockStore::connect(&url).await.unwrap());
    let guard = first.acquire("job", &options()).await.unwrap();
    let token = guard.fencing_token();
    nodes[3].restart();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!guard.is_lost());
    assert!(
        second
            .try_acquire("job", &options())
            .await
            .unwrap()
            .is_none(),
        "a second holder got in"
    );
    guard.release().await.unwrap();
    let next = second.acquire("job", &options()).await.unwrap();
    assert!(next.fencing_token() > token);
    next.release().await.unwrap();
}

/// Bad URLs are refused with a message.
#[tokio::test]
async fn redlock_urls_are_checked() {
    for bad in ["redlock://127.0.0.1:1,127.0.0.1:2", "redlock://"] {
        let error = RedLockStore::connect(bad).await.unwrap_err();
        assert_eq!(error.kind(), ErrorKind::InvalidUrl, "{bad}: {error}");
    }
    let error = RedLockStore::connect("redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3")
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::StoreUnavailable, "{error}");
}
