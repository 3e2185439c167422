//! The PostgreSQL idempotency store: the conformance suite against a real server, with
//! and without notifications.

mod idempotency_conformance;

use std::future::Future;
use std::pin::Pin;

use idempotency_conformance::TestStore;
use turnstile::idempotency::Idempotency;
use turnstile::idempotency::postgres::PostgresIdempotencyStore;
use turnstile_test_support::shared_postgres;

struct PostgresDatabase {
    url: String,
}

impl TestStore for PostgresDatabase {
    fn client(&self) -> Pin<Box<dyn Future<Output = Idempotency> + Send + '_>> {
        Box::pin(async move {
            Idempotency::new(PostgresIdempotencyStore::connect(&self.url).await.unwrap())
        })
    }
}

async fn fresh_database() -> PostgresDatabase {
    PostgresDatabase {
        url: shared_postgres().fresh_database("idem"),
    }
}

idempotency_conformance_tests!(super::fresh_database);

mod polling {
    //! The same suite with notifications off: waiters poll.
    use super::*;

    async fn without_notifications() -> PostgresDatabase {
        PostgresDatabase {
            url: format!(
                "{}?turnstile_notify=off",
                shared_postgres().fresh_database("idempoll")
            ),
        }
    }

    idempotency_conformance_tests!(super::without_notifications);
}

/// Stores are opened from URLs like the lock stores; unknown options are refused.
#[tokio::test]
async fn urls_open_the_store() {
    let url = shared_postgres().fresh_database("idemurl");
    let keys = Idempotency::connect(&format!("{url}?turnstile_prefix=app"))
        .await
        .unwrap();
    assert!(keys.store().describe().starts_with("postgres://"));
    let error = Idempotency::connect(&format!("{url}?turnstile_nope=1"))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), turnstile::ErrorKind::InvalidUrl);
    let error = Idempotency::connect("redis://127.0.0.1:1")
        .await
        .unwrap_err();
    assert_eq!(error.kind(), turnstile::ErrorKind::UnsupportedStore);
}
