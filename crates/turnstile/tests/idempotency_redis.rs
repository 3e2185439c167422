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
