//! `turnstile bench idempotency-server` and `turnstile bench idempotency-duplicates`:
//! the HTTP workload of the idempotency layer (issue 7's benchmark), served and driven
//! so that `wrk` and this client measure the layer against the bare handler.
//!
//! The server's routes:
//! - `POST /payments` with the body `{"amount":1000,"currency":"EUR","customer":"c-42"}`
//!   and an optional `Idempotency-Key`: counts a payment n, answers
//!   `201 {"payment_id":"pay_<n>","amount":1000,"currency":"EUR","status":"succeeded"}`.
//! - `POST /slow`, same body, `Idempotency-Key: K`: waits `SLOW_MS` (200 ms), counts a
//!   run of K, answers `201 {"payment_id":"slow_<runs[K]>","status":"succeeded"}`.
//! - `GET /stats?key=K`: `{"payments":n,"slow_runs":runs[K]}`; `GET /health`: 200.
//!
//! Requests without a key pass through; keys live in the scope `global`.
//! Environment: `HTTP_PORT` (8431), `REDIS_PORT` (6421, for the default store),
//! `SLOW_MS` (200).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use clap::Args;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;
use turnstile::idempotency::http::IdempotencyLayer;
use turnstile::idempotency::{Idempotency, IdempotencyOptions, Scope};
use turnstile::{Error, ErrorKind};

use crate::exit_code_for;

/// The body every benchmark request carries.
pub(crate) const PAYMENT_BODY: &str = r#"{"amount":1000,"currency":"EUR","customer":"c-42"}"#;

/// Options of `turnstile bench idempotency-server`.
#[derive(Args, Debug)]
pub(crate) struct ServerArgs {
    /// Store URL for the keys (default: redis://127.0.0.1:$REDIS_PORT).
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// Duplicates in flight wait for the first and get its replay (instead of 409).
    #[arg(long)]
    wait: bool,
    /// Serve the routes without the idempotency layer: the baseline.
    #[arg(long, conflicts_with = "wait")]
    no_layer: bool,
    /// Instead of the layer, the floor of any Redis-backed design: per request with a
    /// key, one plain `SET … NX PX` before the handler and one `SET … PX` of the body
    /// after it (no scripts, fingerprint, token, watchdog or replay).
    #[arg(long, conflicts_with_all = ["wait", "no_layer"])]
    raw_redis: bool,
}

/// Options of `turnstile bench idempotency-duplicates`.
#[derive(Args, Debug)]
pub(crate) struct DuplicatesArgs {
    /// How many requests with one new key are sent at once to `POST /slow`.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(2..=10_000))]
    count: u32,
}

fn env_number(name: &str, default: u64) -> Result<u64, Error> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(text) => text.trim().parse::<u64>().map_err(|_| {
            Error::new(
                ErrorKind::InvalidOptions,
                format!("{name}={text:?} must be a whole number"),
            )
        }),
    }
}

fn port(name: &str, default: u16) -> Result<u16, Error> {
    let value = env_number(name, u64::from(default))?;
    u16::try_from(value)
        .ok()
        .filter(|port| *port > 0)
        .ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidOptions,
                format!("{name}={value} is not a TCP port"),
            )
        })
}

#[derive(Default)]
struct Counters {
    payments: u64,
    slow_runs: HashMap<String, u64>,
}

#[derive(Clone)]
struct App {
    counters: Arc<Mutex<Counters>>,
    slow: Duration,
}

fn lock(counters: &Mutex<Counters>) -> std::sync::MutexGuard<'_, Counters> {
    // A poisoned counter lock only means a handler panicked; the counts stay usable.
    counters
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn json(status: StatusCode, body: serde_json::Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn check_body(body: &str) -> Option<Response> {
    let expected: serde_json::Value =
        serde_json::json!({"amount":1000,"currency":"EUR","customer":"c-42"});
    match serde_json::from_str::<serde_json::Value>(body) {
        Ok(value) if value == expected => None,
        _ => Some(json(
            StatusCode::BAD_REQUEST,
            serde_json::json!({"error": format!("the body must be {PAYMENT_BODY}")}),
        )),
    }
}

async fn payments(State(app): State<App>, body: String) -> Response {
    if let Some(refusal) = check_body(&body) {
        return refusal;
    }
    let n = {
        let mut counters = lock(&app.counters);
        counters.payments += 1;
        counters.payments
    };
    json(
        StatusCode::CREATED,
        serde_json::json!({"payment_id": format!("pay_{n}"), "amount": 1000, "currency": "EUR", "status": "succeeded"}),
    )
}

async fn slow(State(app): State<App>, headers: HeaderMap, body: String) -> Response {
    if let Some(refusal) = check_body(&body) {
        return refusal;
    }
    let key = headers
        .get("idempotency-key")
        .and_then(|value| value.to_str().ok())
        .unwrap_or("")
        .trim_matches('"')
        .to_owned();
    tokio::time::sleep(app.slow).await;
    let runs = {
        let mut counters = lock(&app.counters);
        let runs = counters.slow_runs.entry(key).or_default();
        *runs += 1;
        *runs
    };
    json(
        StatusCode::CREATED,
        serde_json::json!({"payment_id": format!("slow_{runs}"), "status": "succeeded"}),
    )
}

async fn stats(State(app): State<App>, Query(query): Query<HashMap<String, String>>) -> Response {
    let counters = lock(&app.counters);
    let runs = query
        .get("key")
        .and_then(|key| counters.slow_runs.get(key))
        .copied()
        .unwrap_or(0);
    json(
        StatusCode::OK,
        serde_json::json!({"payments": counters.payments, "slow_runs": runs}),
    )
}

/// Serves the workload's routes until interrupted.
pub(crate) async fn serve(args: ServerArgs) -> ExitCode {
    match serve_inner(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("turnstile: {error}");
            ExitCode::from(exit_code_for(&error))
        }
    }
}

async fn serve_inner(args: ServerArgs) -> Result<(), Error> {
    let http_port = port("HTTP_PORT", 8431)?;
    let app = App {
        counters: Arc::default(),
        slow: Duration::from_millis(env_number("SLOW_MS", 200)?),
    };
    let routes = Router::new()
        .route("/payments", post(payments))
        .route("/slow", post(slow));
    let routes = if args.no_layer {
        routes
    } else if args.raw_redis {
        raw_redis_floor(routes, args.store).await?
    } else {
        let store = match args.store {
            Some(store) => store,
            None => format!("redis://127.0.0.1:{}", port("REDIS_PORT", 6421)?),
        };
        let mut options = IdempotencyOptions::new();
        if args.wait {
            options = options.wait(Duration::from_secs(10));
        }
        let keys = Idempotency::connect(&store).await?.with_options(options)?;
        eprintln!(
            "turnstile: idempotency layer on {} ({} mode)",
            keys.store().describe(),
            if args.wait { "wait" } else { "409" }
        );
        routes.route_layer(IdempotencyLayer::new(keys, |_| Some(Scope::global())))
    };
    let router = routes
        .route("/stats", get(stats))
        .route("/health", get(|| async { StatusCode::OK }))
        .with_state(app);
    let address = SocketAddr::from(([127, 0, 0, 1], http_port));
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .map_err(|error| {
            Error::new(
                ErrorKind::InvalidOptions,
                format!("cannot listen on {address}: {error}"),
            )
        })?;
    eprintln!("turnstile: serving the idempotency workload on http://{address}");
    axum::serve(listener, router)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .map_err(|error| Error::new(ErrorKind::Store, format!("the server failed: {error}")))
}

/// Wraps `routes` in the raw Redis floor (`--raw-redis`).
#[cfg(feature = "redis")]
async fn raw_redis_floor(routes: Router<App>, store: Option<String>) -> Result<Router<App>, Error> {
    use axum::body::Body;
    use axum::extract::Request;
    use axum::middleware::Next;

    async fn floor(
        State(connection): State<redis::aio::ConnectionManager>,
        request: Request,
        next: Next,
    ) -> Response {
        let Some(key) = request
            .headers()
            .get("idempotency-key")
            .and_then(|value| value.to_str().ok())
            .map(|key| format!("bench:raw:{key}"))
        else {
            return next.run(request).await;
        };
        let failed = |error: redis::RedisError| {
            json(
                StatusCode::SERVICE_UNAVAILABLE,
                serde_json::json!({"error": error.to_string()}),
            )
        };
        let mut connection = connection.clone();
        let claimed: Option<String> = match redis::cmd("SET")
            .arg(&key)
            .arg("in_progress")
            .arg("NX")
            .arg("PX")
            .arg(30_000)
            .query_async(&mut connection)
            .await
        {
            Ok(claimed) => claimed,
            Err(error) => return failed(error),
        };
        if claimed.is_none() {
            return StatusCode::CONFLICT.into_response();
        }
        let (head, body) = next.run(request).await.into_parts();
        let Ok(body) = axum::body::to_bytes(body, 1 << 20).await else {
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        };
        if let Err(error) = redis::cmd("SET")
            .arg(&key)
            .arg(&body[..])
            .arg("PX")
            .arg(86_400_000)
            .query_async::<()>(&mut connection)
            .await
        {
            return failed(error);
        }
        Response::from_parts(head, Body::from(body))
    }

    let url = match store {
        Some(store) => store,
        None => format!("redis://127.0.0.1:{}", port("REDIS_PORT", 6421)?),
    };
    let client = redis::Client::open(url.as_str())
        .map_err(|error| Error::new(ErrorKind::InvalidUrl, format!("{url}: {error}")))?;
    let connection = client.get_connection_manager().await.map_err(|error| {
        Error::new(
            ErrorKind::StoreUnavailable,
            format!("cannot reach Redis at {url}: {error}"),
        )
    })?;
    eprintln!("turnstile: the raw Redis floor (two plain SETs per new key) on {url}");
    Ok(routes.route_layer(axum::middleware::from_fn_with_state(connection, floor)))
}

/// What a build without Redis answers to `--raw-redis`.
#[cfg(not(feature = "redis"))]
async fn raw_redis_floor(_: Router<App>, _: Option<String>) -> Result<Router<App>, Error> {
    Err(Error::new(
        ErrorKind::UnsupportedStore,
        "--raw-redis needs Redis support: build the turnstile command with the `redis` feature",
    ))
}

/// One HTTP/1.1 exchange on its own connection: status, whether it was a replay, and
/// the body.
async fn exchange(
    address: SocketAddr,
    request: &str,
) -> std::io::Result<(u16, Option<bool>, String)> {
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    stream.set_nodelay(true)?;
    stream.write_all(request.as_bytes()).await?;
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).await?;
    let text = String::from_utf8_lossy(&reply);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    let replayed = head.lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.eq_ignore_ascii_case("idempotent-replayed")
            .then(|| value.trim() == "true")
    });
    Ok((status, replayed, body.to_owned()))
}

fn post_request(path: &str, key: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Idempotency-Key: {key}\r\nContent-Length: {}\r\n\r\n{PAYMENT_BODY}",
        PAYMENT_BODY.len()
    )
}

/// Sends `--count` requests with one new key to `POST /slow` at once and prints one
/// JSON line: the status histogram, how many times the handler ran, and how long after
/// the first answer the duplicates were answered.
pub(crate) async fn duplicates(args: DuplicatesArgs) -> ExitCode {
    match duplicates_inner(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("turnstile: {error}");
            ExitCode::from(exit_code_for(&error))
        }
    }
}

async fn duplicates_inner(args: DuplicatesArgs) -> Result<(), Error> {
    let address = SocketAddr::from(([127, 0, 0, 1], port("HTTP_PORT", 8431)?));
    let unreachable = |error: std::io::Error| {
        Error::new(
            ErrorKind::StoreUnavailable,
            format!("the benchmark server at {address} does not answer: {error}"),
        )
    };
    let key = format!("dup-{:016x}", rand::random::<u64>());
    let request = Arc::new(post_request("/slow", &key));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..args.count {
        let request = Arc::clone(&request);
        tasks.push(tokio::spawn(async move {
            let answer = exchange(address, &request).await;
            (answer, started.elapsed())
        }));
    }
    let mut histogram: std::collections::BTreeMap<String, u32> = Default::default();
    let mut first_run: Option<Duration> = None;
    let mut replays = Vec::new();
    for task in tasks {
        let (answer, at) = task.await.map_err(|error| {
            Error::new(ErrorKind::Store, format!("a request task failed: {error}"))
        })?;
        let (status, replayed, _) = answer.map_err(unreachable)?;
        let label = match (status, replayed) {
            (201, Some(true)) => "201 replayed".to_owned(),
            (201, _) => "201".to_owned(),
            (other, _) => other.to_string(),
        };
        *histogram.entry(label).or_default() += 1;
        match (status, replayed) {
            (201, Some(true)) => replays.push(at),
            (201, _) => first_run = Some(at),
            _ => {}
        }
    }
    // A retry after completion must be a replay.
    let (retry_status, retry_replayed, _) =
        exchange(address, &request).await.map_err(unreachable)?;
    let stats = exchange(
        address,
        &format!("GET /stats?key={key} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n"),
    )
    .await
    .map_err(unreachable)?;
    let runs = serde_json::from_str::<serde_json::Value>(&stats.2)
        .ok()
        .and_then(|value| value["slow_runs"].as_u64());
    let late_ms: Vec<f64> = match first_run {
        Some(first) => replays
            .iter()
            .map(|at| at.saturating_sub(first).as_secs_f64() * 1000.0)
            .collect(),
        None => Vec::new(),
    };
    let max_late = late_ms.iter().copied().fold(0.0_f64, f64::max);
    println!(
        "{}",
        serde_json::json!({
            "phase": "duplicates",
            "requests": args.count,
            "statuses": histogram,
            "handler_runs": runs,
            "retry_after_completion": {"status": retry_status, "replayed": retry_replayed},
            "first_answer_ms": first_run.map(|at| at.as_secs_f64() * 1000.0),
            "replays_after_first_max_ms": if late_ms.is_empty() { None } else { Some(max_late) },
        })
    );
    Ok(())
}
