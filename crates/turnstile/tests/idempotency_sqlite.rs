//! The SQLite idempotency store: the conformance suite against a real database file.

mod idempotency_conformance;

use std::future::Future;
use std::pin::Pin;

use idempotency_conformance::TestStore;
use turnstile::idempotency::Idempotency;
use turnstile::idempotency::sqlite::SqliteIdempotencyStore;

struct SqliteFile {
    dir: tempfile::TempDir,
}

impl TestStore for SqliteFile {
    fn client(&self) -> Pin<Box<dyn Future<Output = Idempotency> + Send + '_>> {
        Box::pin(async move {
            let path = self.dir.path().join("keys.sqlite3");
            Idempotency::new(SqliteIdempotencyStore::open(path).await.unwrap())
        })
    }
}

async fn sqlite_file() -> SqliteFile {
    SqliteFile {
        dir: tempfile::tempdir().unwrap(),
    }
}

idempotency_conformance_tests!(super::sqlite_file);
