//! The etcd engine: the conformance suite against a real etcd member, and a restart.

mod conformance;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use conformance::TestStore;
use turnstile::lock::etcd::EtcdLockStore;
use turnstile::lock::{LockOptions, Locker};
use turnstile_test_support::{EtcdServer, shared_etcd, unique_name};

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
