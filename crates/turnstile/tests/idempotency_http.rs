//! The HTTP layer on axum, over real stores (SQLite files, a real PostgreSQL), driven
//! through the router in-process.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::response::IntoResponse;
use axum::routing::post;
use http::{Request, StatusCode, header};
use http_body_util::BodyExt;
use tower::ServiceExt;
use turnstile::idempotency::http::{IdempotencyLayer, types};
use turnstile::idempotency::{Idempotency, IdempotencyOptions, Scope};

/// The tenant named by `Authorization: Bearer <tenant>`.
fn tenant(parts: &http::request::Parts) -> Option<Scope> {
    parts
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .and_then(|tenant| Scope::new(tenant).ok())
}

struct App {
    router: Router,
    runs: Arc<AtomicUsize>,
    dir: tempfile::TempDir,
}

async fn app(
    configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
    options: IdempotencyOptions,
) -> App {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("keys.db").display());
    let keys = Idempotency::connect(&url)
        .await
        .unwrap()
        .with_options(options)
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let layer = configure(IdempotencyLayer::new(keys, tenant).require_key(true));
    let router = Router::new()
        .route(
            "/payments",
            post(move |body: String| {
                let counter = counter.clone();
                async move {
                    let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    if body.contains("fail") {
                        return (StatusCode::BAD_GATEWAY, "provider down".to_owned())
                            .into_response();
                    }
                    if body.contains("break") {
                        // A body that fails half way, as a proxied upstream that drops
                        // its connection would.
                        let chunks: [Result<&'static str, std::io::Error>; 2] = [
                            Ok("half a rec"),
                            Err(std::io::Error::other("upstream reset")),
                        ];
                        return (
                            StatusCode::CREATED,
                            Body::from_stream(futures_util::stream::iter(chunks)),
                        )
                            .into_response();
                    }
                    if body.contains("linger") {
                        tokio::time::sleep(Duration::from_secs(3)).await;
                    }
                    if body.contains("unwind") {
                        // A body stream that panics on its first frame: the handler's
                        // own code, run after its effect.
                        let frames = futures_util::stream::poll_fn(
                            |_| -> std::task::Poll<Option<Result<&'static str, std::io::Error>>> {
                                panic!("the response body panicked after the handler's effect")
                            },
                        );
                        return (StatusCode::CREATED, Body::from_stream(frames)).into_response();
                    }
                    if body.contains("panic") {
                        panic!("the handler panicked after its effect");
                    }
                    if body.contains("timeout") {
                        // What a timeout layer inside this one answers once it dropped
                        // the handler mid-way.
                        return (StatusCode::REQUEST_TIMEOUT, "cut off").into_response();
                    }
                    if body.contains("trailers") {
                        // A failure signalled in trailers, as gRPC does.
                        let mut trailers = http::HeaderMap::new();
                        trailers.insert("grpc-status", http::HeaderValue::from_static("13"));
                        let frames: [Result<http_body::Frame<bytes::Bytes>, std::io::Error>; 2] = [
                            Ok(http_body::Frame::data(bytes::Bytes::from_static(
                                b"partial",
                            ))),
                            Ok(http_body::Frame::trailers(trailers)),
                        ];
                        return (
                            StatusCode::OK,
                            Body::new(http_body_util::StreamBody::new(futures_util::stream::iter(
                                frames,
                            ))),
                        )
                            .into_response();
                    }
                    if body.contains("huge") {
                        return (StatusCode::CREATED, "x".repeat(4096)).into_response();
                    }
                    (
                        StatusCode::CREATED,
                        [
                            (header::LOCATION, format!("/payments/{n}")),
                            (header::SET_COOKIE, "session=secret".to_owned()),
                        ],
                        format!("payment {n} for {body}"),
                    )
                        .into_response()
                }
            }),
        )
        .route(
            "/refunds",
            post(|| async { (StatusCode::CREATED, "refund") }),
        )
        .route_layer(layer);
    App { router, runs, dir }
}

fn request(path: &str, tenant: &str, key: Option<&str>, body: &str) -> Request<Body> {
    let mut builder = Request::post(path).header(header::AUTHORIZATION, format!("Bearer {tenant}"));
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder.body(Body::from(body.to_owned())).unwrap()
}

async fn send(router: &Router, request: Request<Body>) -> (StatusCode, http::HeaderMap, String) {
    let response = router.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, headers, String::from_utf8_lossy(&body).into_owned())
}

fn problem_type(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body).unwrap()["type"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_duplicates_run_the_handler_once_with_409s() {
    let app = app(|layer| layer, IdempotencyOptions::new()).await;
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let router = app.router.clone();
        tasks.push(tokio::spawn(async move {
            send(
                &router,
                request("/payments", "acme", Some("\"k-1\""), "10 EUR"),
            )
            .await
        }));
    }
    let mut bodies = Vec::new();
    for task in tasks {
        let (status, headers, body) = task.await.unwrap();
        match status {
            StatusCode::CREATED => bodies.push(body),
            StatusCode::CONFLICT => {
                assert_eq!(problem_type(&body), types::KEY_IN_USE);
                assert!(headers.contains_key(header::RETRY_AFTER));
            }
            other => panic!("unexpected {other}: {body}"),
        }
    }
    assert_eq!(
        app.runs.load(Ordering::SeqCst),
        1,
        "the handler ran more than once"
    );
    bodies.dedup();
    assert_eq!(bodies, vec!["payment 1 for 10 EUR".to_owned()]);
    // After completion, a retry is a replay with the allowed headers only.
    let (status, headers, body) = send(
        &app.router,
        request("/payments", "acme", Some("k-1"), "10 EUR"),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(body, "payment 1 for 10 EUR");
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(headers[header::LOCATION], "/payments/1");
    assert!(
        headers.get(header::SET_COOKIE).is_none(),
        "a cookie was replayed"
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_wait_mode_every_duplicate_gets_the_replay() {
    let app = app(
        |layer| layer,
        IdempotencyOptions::new().wait(Duration::from_secs(10)),
    )
    .await;
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let router = app.router.clone();
        tasks.push(tokio::spawn(async move {
            send(
                &router,
                request("/payments", "acme", Some("k-wait"), "5 EUR"),
            )
            .await
        }));
    }
    let mut replayed = 0;
    for task in tasks {
        let (status, headers, body) = task.await.unwrap();
        assert_eq!(status, StatusCode::CREATED, "{body}");
        assert_eq!(body, "payment 1 for 5 EUR");
        replayed += usize::from(headers["idempotent-replayed"] == "true");
    }
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    assert_eq!(replayed, 49);
}

#[tokio::test]
async fn bad_and_reused_keys_get_problems_and_run_nothing() {
    let app = app(|layer| layer, IdempotencyOptions::new()).await;
    let (status, _, body) = send(&app.router, request("/payments", "acme", None, "x")).await;
    assert_eq!(
        (status, problem_type(&body)),
        (StatusCode::BAD_REQUEST, types::KEY_MISSING.to_owned())
    );
    let (status, _, body) = send(
        &app.router,
        request("/payments", "acme", Some("two words"), "x"),
    )
    .await;
    assert_eq!(
        (status, problem_type(&body)),
        (StatusCode::BAD_REQUEST, types::KEY_MALFORMED.to_owned())
    );
    let long = format!("\"{}\"", "k".repeat(300));
    let (status, _, _) = send(&app.router, request("/payments", "acme", Some(&long), "x")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(app.runs.load(Ordering::SeqCst), 0);

    let (status, _, _) = send(
        &app.router,
        request("/payments", "acme", Some("k"), "10 EUR"),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, headers, body) = send(
        &app.router,
        request("/payments", "acme", Some("k"), "99 EUR"),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(problem_type(&body), types::KEY_REUSED);
    assert_eq!(headers[header::CONTENT_TYPE], "application/problem+json");
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn tenants_and_routes_never_share_a_key() {
    let app = app(|layer| layer, IdempotencyOptions::new()).await;
    let (_, _, alice) = send(
        &app.router,
        request("/payments", "alice", Some("same"), "10 EUR"),
    )
    .await;
    let (status, headers, bob) = send(
        &app.router,
        request("/payments", "bob", Some("same"), "10 EUR"),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "false");
    assert_ne!(alice, bob, "bob got alice's response");
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);
    let (status, _, body) = send(
        &app.router,
        request("/refunds", "alice", Some("same"), "10 EUR"),
    )
    .await;
    assert_eq!((status, body.as_str()), (StatusCode::CREATED, "refund"));
    let (status, _, body) = send(
        &app.router,
        Request::post("/payments")
            .header("idempotency-key", "k")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(
        (status, problem_type(&body)),
        (StatusCode::UNAUTHORIZED, types::SCOPE_MISSING.to_owned())
    );
}

#[tokio::test]
async fn server_errors_are_replayed_and_large_bodies_are_bounded() {
    let app = app(
        |layer| layer.max_request_body(1024).max_response_body(1024),
        IdempotencyOptions::new(),
    )
    .await;
    // In the lease mode a 5xx is stored: the handler may have charged before it
    // failed, and the retry must not charge again.
    let (status, headers, _) =
        send(&app.router, request("/payments", "acme", Some("f"), "fail")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(headers["idempotent-replayed"], "false");
    let (status, headers, body) =
        send(&app.router, request("/payments", "acme", Some("f"), "fail")).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::BAD_GATEWAY, "provider down")
    );
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(
        app.runs.load(Ordering::SeqCst),
        1,
        "a 502 was run again instead of replayed"
    );

    let (status, _, body) = send(
        &app.router,
        request("/payments", "acme", Some("big-in"), &"y".repeat(2048)),
    )
    .await;
    assert_eq!(
        (status, problem_type(&body)),
        (
            StatusCode::PAYLOAD_TOO_LARGE,
            types::REQUEST_TOO_LARGE.to_owned()
        )
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);

    // A response too large to store reaches its client whole; a repeat is told why it
    // gets no replay, and the handler does not run again.
    let (status, _, body) = send(
        &app.router,
        request("/payments", "acme", Some("big-out"), "huge"),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(body.len(), 4096);
    let (status, _, body) = send(
        &app.router,
        request("/payments", "acme", Some("big-out"), "huge"),
    )
    .await;
    assert_eq!(
        (status, problem_type(&body)),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            types::NOT_REPLAYABLE.to_owned()
        )
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);
}

/// A policy that gives 5xx back (the application's choice, for handlers whose
/// effects a failure undoes): the retry runs again.
#[tokio::test]
async fn a_policy_can_give_server_errors_back() {
    let app = app(
        |layer| layer.store_status(|status| status.is_success()),
        IdempotencyOptions::new(),
    )
    .await;
    for _ in 0..2 {
        let (status, headers, _) =
            send(&app.router, request("/payments", "acme", Some("f"), "fail")).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY);
        assert_eq!(headers["idempotent-replayed"], "false");
    }
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);
}

/// A response body that breaks off half way is not a response: the client's body
/// breaks off too, and it is not replayed as a complete 201. The handler ran, with its
/// effects, so a retry is told the first attempt's outcome is unknown (422,
/// `types::OUTCOME_UNKNOWN`) and the handler does not run again.
#[tokio::test]
async fn a_body_that_breaks_half_way_is_recorded_as_outcome_unknown() {
    let app = app(|layer| layer, IdempotencyOptions::new()).await;
    let response = app
        .router
        .clone()
        .oneshot(request("/payments", "acme", Some("torn"), "break"))
        .await
        .unwrap();
    assert_eq!(response.headers()["idempotent-replayed"], "false");
    let body = response.into_body().collect().await;
    assert!(
        body.is_err(),
        "a torn body was passed on as complete: {:?}",
        body.map(|collected| collected.to_bytes())
    );
    for _ in 0..2 {
        let (status, _, body) = send(
            &app.router,
            request("/payments", "acme", Some("torn"), "break"),
        )
        .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        assert_eq!(problem_type(&body), types::OUTCOME_UNKNOWN);
    }
    assert_eq!(app.runs.load(Ordering::SeqCst), 1, "the handler ran again");
}

/// A handler that panics after its effect, and one cut off by a timeout layer inside
/// (408): in the lease mode neither gives the key back, so a retry is told the outcome
/// is unknown instead of running the effect again.
#[tokio::test]
async fn a_panic_or_a_timeout_inside_is_recorded_as_outcome_unknown() {
    let app = app(|layer| layer, IdempotencyOptions::new()).await;
    let (status, _, body) = send(
        &app.router,
        request("/payments", "acme", Some("boom"), "panic"),
    )
    .await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
    assert_eq!(problem_type(&body), types::OUTCOME_UNKNOWN);
    let (status, _, body) = send(
        &app.router,
        request("/payments", "acme", Some("slow"), "timeout"),
    )
    .await;
    assert_eq!(status, StatusCode::REQUEST_TIMEOUT, "{body}");
    for (key, body) in [("boom", "panic"), ("slow", "timeout")] {
        let (status, _, answer) =
            send(&app.router, request("/payments", "acme", Some(key), body)).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{key}: {answer}");
        assert_eq!(problem_type(&answer), types::OUTCOME_UNKNOWN, "{key}");
    }
    assert_eq!(app.runs.load(Ordering::SeqCst), 2, "a handler ran again");
}

/// A response body whose stream panics is the handler's code failing after its
/// effect: the key records that the outcome is unknown, so a retry, even one after the
/// lease would have run out, is told so instead of running the handler again.
#[tokio::test]
async fn a_body_that_panics_is_recorded_as_outcome_unknown() {
    let app = app(
        |layer| layer,
        IdempotencyOptions::new().lease(Duration::from_secs(1)),
    )
    .await;
    let (status, _, body) = send(
        &app.router,
        request("/payments", "acme", Some("unwound"), "unwind"),
    )
    .await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
    assert_eq!(problem_type(&body), types::OUTCOME_UNKNOWN);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (status, _, answer) = send(
        &app.router,
        request("/payments", "acme", Some("unwound"), "unwind"),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{answer}");
    assert_eq!(problem_type(&answer), types::OUTCOME_UNKNOWN);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1, "the handler ran again");
}

/// A claim lost while its handler runs (renewals blocked past the lease by a writer
/// holding the database) drops the handler mid-way, after effects it may have had: in
/// the lease mode the key records that the outcome is unknown once the store answers,
/// so the retry is told so instead of running the handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_lost_mid_handler_is_recorded_as_outcome_unknown() {
    a_claim_lost_while_the_database_is_held_is_recorded_as_outcome_unknown(
        "held",
        Duration::from_millis(1_500),
    )
    .await;
}

/// The same with the store out of reach for longer than one attempt to record it (a
/// writer holds the database past the store's 5 s busy timeout): the record is asked
/// again, not once, so it still lands before the retry, which is told the outcome is
/// unknown rather than running the handler again. The handler lingers 3 s; the claim
/// is lost at about 1 s. Its first record attempt waits out SQLite's 5 s busy timeout
/// and fails at about 6 s; the next one (within a lease of that) waits for the
/// writer, which commits at about 6.7 s, and lands. One attempt alone would not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_claims_outcome_unknown_is_recorded_though_the_first_try_fails() {
    a_claim_lost_while_the_database_is_held_is_recorded_as_outcome_unknown(
        "held-long",
        Duration::from_millis(6_500),
    )
    .await;
}

/// A lingering request with the key `key` (lease 1 s), a writer holding the keys'
/// database for `held` from 200 ms in; then the first attempt failed, and a retry is
/// told the outcome is unknown, the handler having run once.
async fn a_claim_lost_while_the_database_is_held_is_recorded_as_outcome_unknown(
    key: &'static str,
    held: Duration,
) {
    use sqlx::Connection;
    let app = app(
        |layer| layer,
        IdempotencyOptions::new().lease(Duration::from_secs(1)),
    )
    .await;
    let router = app.router.clone();
    let first = tokio::spawn(async move {
        send(&router, request("/payments", "acme", Some(key), "linger")).await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let url = format!("sqlite://{}", app.dir.path().join("keys.db").display());
    let mut writer = sqlx::SqliteConnection::connect(&url).await.unwrap();
    sqlx::query("BEGIN EXCLUSIVE")
        .execute(&mut writer)
        .await
        .unwrap();
    tokio::time::sleep(held).await;
    sqlx::query("COMMIT").execute(&mut writer).await.unwrap();
    let (status, _, body) = first.await.unwrap();
    assert!(status.is_server_error(), "{status}: {body}");
    let (status, _, answer) = send(
        &app.router,
        request("/payments", "acme", Some(key), "linger"),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{answer}");
    assert_eq!(problem_type(&answer), types::OUTCOME_UNKNOWN);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1, "the handler ran again");
}

/// A response that ends with trailers is passed on with them, but not stored as a
/// success without them (a failure can be signalled there): a retry is told the
/// response was not stored, and the handler does not run again.
#[tokio::test]
async fn a_response_with_trailers_is_passed_on_and_not_replayed_without_them() {
    let app = app(|layer| layer, IdempotencyOptions::new()).await;
    let response = app
        .router
        .clone()
        .oneshot(request("/payments", "acme", Some("grpc"), "trailers"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let collected = response.into_body().collect().await.unwrap();
    assert_eq!(
        collected
            .trailers()
            .and_then(|trailers| trailers.get("grpc-status")),
        Some(&http::HeaderValue::from_static("13")),
        "the trailers were dropped"
    );
    assert_eq!(&collected.to_bytes()[..], b"partial");
    let (status, _, body) = send(
        &app.router,
        request("/payments", "acme", Some("grpc"), "trailers"),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(problem_type(&body), types::NOT_REPLAYABLE);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
}

/// A request body that breaks off is a 400 (`types::REQUEST_BODY_UNREADABLE`), not
/// "too large"; nothing is claimed and the handler does not run.
#[tokio::test]
async fn a_request_body_that_breaks_off_is_a_400() {
    let app = app(|layer| layer, IdempotencyOptions::new()).await;
    let chunks: [Result<&'static str, std::io::Error>; 2] =
        [Ok("10 E"), Err(std::io::Error::other("client reset"))];
    let torn = Request::post("/payments")
        .header(header::AUTHORIZATION, "Bearer acme")
        .header("idempotency-key", "torn-request")
        .body(Body::from_stream(futures_util::stream::iter(chunks)))
        .unwrap();
    let (status, _, body) = send(&app.router, torn).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(problem_type(&body), types::REQUEST_BODY_UNREADABLE);
    let (status, _, _) = send(
        &app.router,
        request("/payments", "acme", Some("torn-request"), "10 EUR"),
    )
    .await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "the torn request claimed the key"
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
}

/// A store that is down: 503 with `Retry-After`, and the handler never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_is_down_answers_503_and_runs_nothing() {
    let server = turnstile_test_support::PostgresServer::spawn();
    let keys = Idempotency::connect(&server.url()).await.unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let router = Router::new()
        .route(
            "/payments",
            post(move || {
                counter.fetch_add(1, Ordering::SeqCst);
                async { StatusCode::CREATED }
            }),
        )
        .route_layer(IdempotencyLayer::new(keys, tenant));
    let (status, _, _) = send(&router, request("/payments", "acme", Some("k"), "x")).await;
    assert_eq!(status, StatusCode::CREATED);
    server.kill();
    let (status, headers, body) =
        send(&router, request("/payments", "acme", Some("k2"), "x")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(problem_type(&body), types::STORE_UNAVAILABLE);
    assert!(headers.contains_key(header::RETRY_AFTER));
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the handler ran without protection"
    );
}

/// Several `Idempotency-Key` headers are a 400; fingerprinted headers count with their
/// names (`x-a: b` is not `x-b: b`); `Content-Type` is part of the default fingerprint;
/// a duplicate in flight is told to come back when the first one's lease would end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_headers_and_retry_after_are_read_exactly() {
    use http::HeaderValue;
    let app = app(
        |layer| {
            layer.fingerprint_headers([
                header::CONTENT_TYPE,
                http::HeaderName::from_static("x-a"),
                http::HeaderName::from_static("x-b"),
            ])
        },
        IdempotencyOptions::new(),
    )
    .await;
    let mut twice = request("/payments", "acme", Some("k1"), "x");
    twice
        .headers_mut()
        .append("idempotency-key", HeaderValue::from_static("k2"));
    let (status, _, body) = send(&app.router, twice).await;
    assert_eq!(
        (status, problem_type(&body)),
        (StatusCode::BAD_REQUEST, types::KEY_MALFORMED.to_owned())
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 0);

    let with = |key: &str, name: &'static str, value: &'static str| {
        let mut request = request("/payments", "acme", Some(key), "x");
        request
            .headers_mut()
            .insert(name, HeaderValue::from_static(value));
        request
    };
    let (status, _, _) = send(&app.router, with("hdr", "x-a", "b")).await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, _, body) = send(&app.router, with("hdr", "x-b", "b")).await;
    assert_eq!(
        (status, problem_type(&body)),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            types::KEY_REUSED.to_owned()
        ),
        "x-a: b and x-b: b fingerprinted alike"
    );
    let (status, _, _) = send(&app.router, with("ct", "content-type", "application/json")).await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, _, body) = send(&app.router, with("ct", "content-type", "text/plain")).await;
    assert_eq!(
        (status, problem_type(&body)),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            types::KEY_REUSED.to_owned()
        ),
        "the same bytes with another Content-Type are another request"
    );

    let first = tokio::spawn(app.router.clone().oneshot(request(
        "/payments",
        "acme",
        Some("busy"),
        "x",
    )));
    tokio::time::sleep(Duration::from_millis(40)).await;
    let (status, headers, _) =
        send(&app.router, request("/payments", "acme", Some("busy"), "x")).await;
    assert_eq!(status, StatusCode::CONFLICT);
    let after: u64 = headers[header::RETRY_AFTER]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (20..=30).contains(&after),
        "Retry-After {after}: the first request's 30 s lease has about 30 s left"
    );
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::CREATED);
}
