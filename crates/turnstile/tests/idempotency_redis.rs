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
