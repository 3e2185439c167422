//! The layer's same-transaction mode on SQLite, PostgreSQL and MariaDB: a handler's
//! writes and the stored response commit together, or neither does.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http::{Request, StatusCode, header};
use http_body_util::BodyExt;
use tower::ServiceExt;
use turnstile::idempotency::http::{IdempotencyLayer, IdempotentTransaction, types};
use turnstile::idempotency::{
    Idempotency, IdempotencyKey, IdempotencyStore, Scope, TransactionalIdempotency,
};

fn tenant(parts: &http::request::Parts) -> Option<Scope> {
    parts
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .and_then(|tenant| Scope::new(tenant).ok())
}

/// What the handlers share with the test: how often each ran, and a switch that makes
/// the next payment fail after its write.
#[derive(Clone, Default)]
struct Probe {
    runs: Arc<AtomicUsize>,
    fail_next: Arc<AtomicUsize>,
}

/// A router whose `/payments` handler writes a row in the request's transaction and
/// whose `/plain` handler takes no transaction (the lease mode).
macro_rules! router {
    ($db:ty, $store:expr, $pool:expr, $probe:expr) => {{
        let store = $store;
        let probe: Probe = $probe;
        let layer = IdempotencyLayer::new(Idempotency::new(store.clone()), tenant)
            .require_key(true)
            .in_transactions(store, $pool)
            .unwrap();
        let (pay_probe, plain_probe) = (probe.clone(), probe.clone());
        Router::new()
            .route(
                "/payments",
                post(
                    move |mut transaction: IdempotentTransaction<$db>, body: String| {
                        let probe = pay_probe.clone();
                        async move {
                            let n = probe.runs.fetch_add(1, Ordering::SeqCst) + 1;
                            sqlx::query("INSERT INTO payments (note) VALUES ('paid')")
                                .execute(&mut *transaction)
                                .await
                                .unwrap();
                            if body.contains("slow") {
                                tokio::time::sleep(Duration::from_millis(400)).await;
                            }
                            if probe
                                .fail_next
                                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                                    n.checked_sub(1)
                                })
                                .is_ok()
                            {
                                return (StatusCode::BAD_GATEWAY, "provider down").into_response();
                            }
                            tokio::time::sleep(Duration::from_millis(30)).await;
                            (StatusCode::CREATED, format!("payment {n}")).into_response()
                        }
                    },
                ),
            )
            .route(
                "/plain",
                post(move || {
                    let probe = plain_probe.clone();
                    async move {
                        probe.runs.fetch_add(1, Ordering::SeqCst);
                        (StatusCode::CREATED, "plain")
                    }
                }),
            )
            .route_layer(layer)
    }};
}

fn request(path: &str, key: &str, body: &str) -> Request<Body> {
    Request::post(path)
        .header(header::AUTHORIZATION, "Bearer acme")
        .header("idempotency-key", key)
        .body(Body::from(body.to_owned()))
        .unwrap()
}

async fn send(router: &Router, request: Request<Body>) -> (StatusCode, http::HeaderMap, String) {
    let response: Response = router.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, headers, String::from_utf8_lossy(&body).into_owned())
}

/// The checks, on any store: `rows()` counts committed payments. On SQLite, whose
/// writers take turns, an operator's `forget` waits for the request's transaction to
/// commit and then forgets the completed record.
async fn check_the_transaction_mode<S, F, Fut>(
    router: Router,
    store: S,
    probe: Probe,
    rows: F,
    writers_take_turns: bool,
) where
    S: IdempotencyStore + TransactionalIdempotency,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = i64>,
{
    // 20 concurrent duplicates: one payment, every answer that is not a 409 is the same.
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let router = router.clone();
        tasks.push(tokio::spawn(async move {
            send(&router, request("/payments", "dup", "100")).await
        }));
    }
    let mut bodies = Vec::new();
    for task in tasks {
        let (status, _, body) = task.await.unwrap();
        match status {
            StatusCode::CREATED => bodies.push(body),
            StatusCode::CONFLICT => {}
            other => panic!("unexpected {other}: {body}"),
        }
    }
    assert_eq!(rows().await, 1, "the payment was committed more than once");
    assert_eq!(probe.runs.load(Ordering::SeqCst), 1);
    let (status, headers, body) = send(&router, request("/payments", "dup", "100")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    bodies.push(body);
    bodies.dedup();
    assert_eq!(bodies, vec!["payment 1".to_owned()]);

    // A handler that wrote and then answered 502: its write is rolled back and the key
    // given back; the retry runs and commits once.
    probe.fail_next.store(1, Ordering::SeqCst);
    let (status, _, _) = send(&router, request("/payments", "flaky", "100")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(rows().await, 1, "the failed request's write was committed");
    let (status, headers, _) = send(&router, request("/payments", "flaky", "100")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "false");
    assert_eq!(rows().await, 2);

    // An operator forgets the key while the handler runs: the handler's claim is fenced
    // out, so its write and response do not commit, and the client hears so.
    let forgetter = {
        let store_scope = Scope::new("acme POST /payments").unwrap();
        let key = IdempotencyKey::new("fenced").unwrap();
        let store = store;
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(150)).await;
            assert!(store.forget(&store_scope, &key).await.unwrap());
        })
    };
    let (status, _, body) = send(&router, request("/payments", "fenced", "slow")).await;
    forgetter.await.unwrap();
    if writers_take_turns {
        assert_eq!(status, StatusCode::CREATED, "{body}");
        assert_eq!(rows().await, 3);
    } else {
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert!(body.contains(types::CLAIM_LOST), "{body}");
        assert_eq!(
            rows().await,
            2,
            "a fenced-out request's write was committed"
        );
    }

    // A handler that takes no transaction keeps the lease mode.
    let before = probe.runs.load(Ordering::SeqCst);
    for _ in 0..2 {
        let (status, _, body) = send(&router, request("/plain", "p", "")).await;
        assert_eq!((status, body.as_str()), (StatusCode::CREATED, "plain"));
    }
    assert_eq!(probe.runs.load(Ordering::SeqCst), before + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_commits_writes_and_response_together() {
    use turnstile::idempotency::sqlite::SqliteIdempotencyStore;
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteIdempotencyStore::open(dir.path().join("app.db"))
        .await
        .unwrap();
    let pool = store.pool().clone();
    sqlx::query("CREATE TABLE payments (id INTEGER PRIMARY KEY, note TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let probe = Probe::default();
    let router = router!(sqlx::Sqlite, store.clone(), pool.clone(), probe.clone());
    check_the_transaction_mode(
        router,
        store,
        probe,
        || async {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM payments")
                .fetch_one(&pool)
                .await
                .unwrap()
        },
        true,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_commits_writes_and_response_together() {
    use turnstile::idempotency::postgres::PostgresIdempotencyStore;
    let url = turnstile_test_support::shared_postgres().fresh_database("httptx");
    let store = PostgresIdempotencyStore::connect(&url).await.unwrap();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    sqlx::query("CREATE TABLE payments (id BIGSERIAL PRIMARY KEY, note TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let probe = Probe::default();
    let router = router!(sqlx::Postgres, store.clone(), pool.clone(), probe.clone());
    check_the_transaction_mode(
        router,
        store,
        probe,
        || async {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM payments")
                .fetch_one(&pool)
                .await
                .unwrap()
        },
        false,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_commits_writes_and_response_together() {
    use turnstile::idempotency::mysql::MysqlIdempotencyStore;
    let url = turnstile_test_support::shared_mariadb().fresh_database("httptx");
    let store = MysqlIdempotencyStore::connect(&url).await.unwrap();
    let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
    sqlx::query("CREATE TABLE payments (id BIGINT AUTO_INCREMENT PRIMARY KEY, note TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let probe = Probe::default();
    let router = router!(sqlx::MySql, store.clone(), pool.clone(), probe.clone());
    check_the_transaction_mode(
        router,
        store,
        probe,
        || async {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM payments")
                .fetch_one(&pool)
                .await
                .unwrap()
        },
        false,
    )
    .await;
}

/// A layer refuses transactions on a store other than its engine's.
#[tokio::test]
async fn transactions_must_use_the_engines_store() {
    use turnstile::idempotency::sqlite::SqliteIdempotencyStore;
    let dir = tempfile::tempdir().unwrap();
    let one = SqliteIdempotencyStore::open(dir.path().join("one.db"))
        .await
        .unwrap();
    let other = SqliteIdempotencyStore::open(dir.path().join("other.db"))
        .await
        .unwrap();
    let error = IdempotencyLayer::new(Idempotency::new(one), tenant)
        .in_transactions(other.clone(), other.pool().clone())
        .unwrap_err();
    assert_eq!(error.kind(), turnstile::ErrorKind::InvalidOptions);
}

/// A handler whose transaction cannot be opened (the pool has no connection to give)
/// answers 503 without running: that answer gives the key back, so the retry runs
/// the handler, instead of being stored and replayed as the lease mode stores a 5xx.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_that_cannot_open_gives_the_key_back() {
    use turnstile::idempotency::sqlite::SqliteIdempotencyStore;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let store = SqliteIdempotencyStore::open(&path).await.unwrap();
    sqlx::query("CREATE TABLE payments (id INTEGER PRIMARY KEY, note TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    // The application's pool: one connection, given up for after 200 ms.
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(200))
        .connect_with(
            sqlx::sqlite::SqliteConnectOptions::new()
                .filename(&path)
                .busy_timeout(Duration::from_secs(5)),
        )
        .await
        .unwrap();
    let probe = Probe::default();
    let router = router!(sqlx::Sqlite, store.clone(), pool.clone(), probe.clone());
    let taken = pool.acquire().await.unwrap();
    let (status, _, body) = send(&router, request("/payments", "k-1", "pay")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(probe.runs.load(Ordering::SeqCst), 0);
    drop(taken);
    let (status, headers, body) = send(&router, request("/payments", "k-1", "pay")).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(headers["idempotent-replayed"], "false");
    assert_eq!(probe.runs.load(Ordering::SeqCst), 1);
}
