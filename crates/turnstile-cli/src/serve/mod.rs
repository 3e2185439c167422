//! `turnstile serve`: the locks, idempotency keys and outbox status over HTTP/JSON for
//! services in any language, with Prometheus metrics and a live dashboard.
//!
//! The service keeps no state that matters: every lease, token and record lives in the
//! store, so several instances behind a load balancer share everything through it (on
//! lease stores: SQLite, Redis, PostgreSQL lease mode; a session-bound lock — MySQL,
//! PostgreSQL session mode, etcd, ZooKeeper — lives in the instance that took it, whose
//! extend and release must reach that instance). What an instance remembers is only its
//! dashboard's window on its own traffic.

mod activity;
mod api;
mod auth;
mod capability;
mod conn;
mod elections;
mod problem;
mod quota;
mod tls;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use clap::{Args, ValueEnum};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;
use turnstile::election::Election;
use turnstile::idempotency::IdempotencyStore;
use turnstile::lock::Locker;
use turnstile::outbox::OutboxStore;
use turnstile::{Error, ErrorKind};

use crate::{StoreArgs, exit};
use activity::{Activity, IdempotencyOutcome};
use auth::Auth;
use problem::Problem;

/// `turnstile serve`.
#[derive(Args, Debug)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Where to listen. Without TLS the default is loopback only; serving other hosts
    /// needs an address such as 0.0.0.0:7070, and tokens (or --no-auth).
    #[arg(long, default_value = "127.0.0.1:7070", value_name = "ADDR")]
    listen: SocketAddr,
    /// A JSON document of bearer tokens with scopes and tenants (see docs/service.md); the
    /// TURNSTILE_TOKENS environment variable may hold the document itself instead.
    #[arg(long, value_name = "FILE")]
    tokens: Option<PathBuf>,
    /// Serve a non-loopback address without tokens: every caller is an admin.
    #[arg(long)]
    no_auth: bool,
    /// Serve bearer tokens over plain HTTP on a non-loopback address (they cross the
    /// network readable by anyone on the path); without it that is refused: give
    /// --tls-cert and --tls-key.
    #[arg(long)]
    insecure_http: bool,
    /// A bearer token that /metrics requires. Without it (the default) /metrics is
    /// open to anyone who reaches the service, as Prometheus scrapers expect: it shows
    /// counts (outbox pending and parked keys, idempotency outcomes), never names, keys
    /// or tokens. The TURNSTILE_METRICS_TOKEN environment variable may hold it instead.
    #[arg(
        long,
        value_name = "TOKEN",
        env = "TURNSTILE_METRICS_TOKEN",
        hide_env_values = true
    )]
    metrics_token: Option<String>,
    /// A file whose bytes sign the capabilities of idempotency claims (at least 16).
    /// Every instance that serves the same claims needs the same one; without it the
    /// tokens document is used, and without tokens a secret of this process.
    #[arg(long, value_name = "FILE")]
    claim_secret_file: Option<PathBuf>,
    /// A `Host` the service answers to besides its listen address, `localhost` and
    /// `127.0.0.1` (with its port, as browsers send it: `locks.internal:7070`); may be
    /// given more than once. Without tokens, requests for any other host are refused,
    /// so that a web page cannot reach the service through DNS rebinding.
    #[arg(long, value_name = "HOST:PORT")]
    allowed_host: Vec<String>,
    /// TLS certificate chain (PEM); with --tls-key, the service speaks HTTPS only.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// TLS private key (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// The longest lease an acquire or extend may ask for (`ttl_ms`): a crashed client's
    /// lock is free again after at most this long.
    #[arg(long, default_value = "5m", value_parser = crate::parse_ttl, value_name = "DURATION")]
    max_ttl: Duration,
    /// The most locks one tenant (or one token without a tenant) holds through this
    /// instance at once; past it an acquire gets 429. Default: 16 on session-bound
    /// stores (MySQL, PostgreSQL session mode: each held lock pins one of their 64
    /// sessions), 10000 elsewhere.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1_000_000), value_name = "N")]
    max_locks_per_tenant: Option<u32>,
    /// The longest long-poll an acquire may ask for (`wait_ms`).
    #[arg(long, default_value = "30s", value_parser = crate::parse_ttl, value_name = "DURATION")]
    max_wait: Duration,
    /// The largest request body, in bytes (idempotency outcomes included).
    #[arg(long, default_value_t = 1024 * 1024, value_name = "BYTES")]
    max_body: usize,
    /// Also relay the store's outbox to this broker (as `turnstile outbox relay
    /// --broker` does), so that its publish latency and outcomes are on this service's
    /// /metrics and dashboard. Run it in one instance, or in all: relays share the work
    /// through the store's leases.
    #[arg(long, value_name = "BROKER_URL")]
    relay: Option<String>,
    /// Connections served at once; past it, a new connection gets 503 with
    /// Retry-After (and /healthz still answers), and closes.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=1_000_000), value_name = "N")]
    max_connections: u32,
    /// Acquires waiting at once (long polls, `wait_ms` > 0); past it, 503 with
    /// Retry-After.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=1_000_000), value_name = "N")]
    max_long_polls: u32,
    /// Election streams open at once (`GET /v1/elections/{name}/observe`, server-sent
    /// events that last until the client leaves); past it, 503 with Retry-After. Each
    /// holds a connection, so keep it below --max-connections.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=1_000_000), value_name = "N")]
    max_observers: u32,
    /// How long a request's head may take to arrive, and a kept-alive connection may
    /// sit idle before it is closed.
    #[arg(long, default_value = "10s", value_parser = crate::parse_ttl, value_name = "DURATION")]
    header_timeout: Duration,
    /// Delete idempotency records past their retention every DURATION, in batches
    /// of 1000 (off by default; `turnstile idempotency sweep` does one pass). Run it in
    /// one instance or in all: batches are short and skip one another's rows.
    #[arg(long, value_parser = crate::parse_ttl, value_name = "DURATION")]
    sweep_every: Option<Duration>,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Everything a request handler needs.
pub(crate) struct Service {
    locker: Locker,
    /// Elections, over the same locker.
    election: Election,
    /// The idempotency store, or why this store has none.
    idempotency: Result<Arc<dyn IdempotencyStore>, String>,
    /// The outbox, or why this store has none.
    outbox: Result<Arc<dyn OutboxStore>, String>,
    auth: Auth,
    activity: Activity,
    engine: &'static str,
    max_wait: Duration,
    max_ttl: Duration,
    /// Locks held per tenant through this instance: `--max-locks-per-tenant`.
    held: quota::HeldLocks,
    /// Permits for acquires that wait (long polls): `--max-long-polls`.
    long_polls: Arc<tokio::sync::Semaphore>,
    /// Permits for election streams: `--max-observers`.
    observers: Arc<tokio::sync::Semaphore>,
    metrics: PrometheusHandle,
    /// The `Host` values the service answers to when it has no tokens (lower case,
    /// with the port).
    allowed_hosts: Vec<String>,
    /// Signs the capabilities of idempotency claims.
    claim_secret: capability::ClaimSecret,
    /// The SHA-256 of the token /metrics requires, if any.
    metrics_token: Option<[u8; 32]>,
    /// Cancelled at SIGTERM/SIGINT: long-polls end at once with a 503.
    shutdown: CancellationToken,
}

impl Service {
    /// A lease asked for in `what` (default 30 s, or `--max-ttl` if shorter), at most
    /// `--max-ttl`; the lower bound is the lock options' own, with their message.
    fn lease(&self, what: &str, asked: Option<u64>) -> Result<Duration, Problem> {
        // The default never exceeds the service's own bound.
        let lease = asked.map_or(
            Duration::from_secs(30).min(self.max_ttl),
            Duration::from_millis,
        );
        if lease > self.max_ttl {
            return Err(Problem::invalid(format!(
                "{what} is at most {} on this service (--max-ttl): a lock outlives a crashed \
                 holder by its lease; extend a shorter one instead",
                self.max_ttl.as_millis()
            )));
        }
        Ok(lease)
    }

    fn idempotency(&self) -> Result<&Arc<dyn IdempotencyStore>, Problem> {
        self.idempotency.as_ref().map_err(|why| unsupported(why))
    }

    fn outbox(&self) -> Result<&Arc<dyn OutboxStore>, Problem> {
        self.outbox.as_ref().map_err(|why| unsupported(why))
    }

    /// Runs one store operation and records how long it took when it succeeds.
    async fn timed<T>(
        &self,
        operation: &'static str,
        request: impl Future<Output = turnstile::Result<T>>,
    ) -> turnstile::Result<T> {
        let started = std::time::Instant::now();
        let answer = request.await?;
        self.observe_store(operation, started.elapsed());
        Ok(answer)
    }

    /// Records how long one store operation took, for `/metrics` and the dashboard.
    fn observe_store(&self, operation: &'static str, took: Duration) {
        metrics::histogram!(
            "turnstile_serve_store_seconds",
            "engine" => self.engine,
            "operation" => operation
        )
        .record(took.as_secs_f64());
        self.activity.latency(operation, took);
    }

    fn idempotency_outcome(&self, outcome: IdempotencyOutcome) {
        let label = match outcome {
            IdempotencyOutcome::Started => "started",
            IdempotencyOutcome::Replayed => "replayed",
            IdempotencyOutcome::InProgress => "in_progress",
            IdempotencyOutcome::Mismatched => "mismatched",
            IdempotencyOutcome::Completed => "completed",
            IdempotencyOutcome::Fenced => "fenced",
        };
        metrics::counter!("turnstile_serve_idempotency_total", "outcome" => label).increment(1);
        self.activity.idempotency(outcome);
    }
}

fn unsupported(why: &str) -> Problem {
    Problem::from(Error::new(ErrorKind::UnsupportedStore, why.to_owned()))
}

/// The engine's name, a metric label.
/// The `Host` values a service on `address` answers to without tokens.
fn allowed_hosts(address: SocketAddr, extra: &[String]) -> Vec<String> {
    let port = address.port();
    // Loopback names with or without the port: a rebinding page's requests carry its
    // own domain, never these.
    let mut hosts = vec![
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        format!("[::1]:{port}"),
        "127.0.0.1".to_owned(),
        "localhost".to_owned(),
        "[::1]".to_owned(),
        address.to_string(),
    ];
    hosts.extend(extra.iter().map(|host| host.to_ascii_lowercase()));
    hosts
}

/// Without tokens, the service is one developer's: only requests addressed to it (its
/// `Host`) are served, and a browser page from elsewhere (a cross-site `Origin` or
/// `Sec-Fetch-Site`) may not change anything. With tokens, a browser cannot present
/// one unasked, and this check is not needed.
async fn guard_open_mode(
    State(service): State<Arc<Service>>,
    request: Request,
    next: Next,
) -> Response {
    if !service.auth.is_open() {
        return next.run(request).await;
    }
    let allowed = |host: &str| {
        let host = host.to_ascii_lowercase();
        service.allowed_hosts.contains(&host)
    };
    let headers = request.headers();
    let host = headers
        .get(header::HOST)
        .and_then(|host| host.to_str().ok());
    if host.is_some_and(|host| !allowed(host)) {
        return Problem::new(
            StatusCode::MISDIRECTED_REQUEST,
            "unknown-host",
            "Unknown host",
            "this service (without tokens) answers only to its own address; name others with \
             --allowed-host",
        )
        .into_response();
    }
    let changes = !matches!(request.method().as_str(), "GET" | "HEAD" | "OPTIONS");
    let origin_elsewhere = headers
        .get(header::ORIGIN)
        .and_then(|origin| origin.to_str().ok())
        .is_some_and(|origin| {
            origin == "null"
                || !origin
                    .split_once("://")
                    .is_some_and(|(_, host)| allowed(host.trim_end_matches('/')))
        });
    let cross_site = headers
        .get("sec-fetch-site")
        .is_some_and(|site| site != "same-origin" && site != "none");
    if changes && (origin_elsewhere || cross_site) {
        return Problem::forbidden(
            "a page from another site may not change anything on a service without tokens; \
             configure tokens to serve browsers elsewhere"
                .to_owned(),
        )
        .into_response();
    }
    next.run(request).await
}

/// Whether every lock held on this store pins a database session (a bounded pool).
fn session_bound(url: &str) -> bool {
    match engine_of(url) {
        "mysql" => true,
        "postgres" => url.contains("turnstile_mode=session"),
        _ => false,
    }
}

fn engine_of(url: &str) -> &'static str {
    let scheme = url.split_once(':').map_or("", |(scheme, _)| scheme);
    match scheme.to_ascii_lowercase().as_str() {
        "sqlite" => "sqlite",
        "redis" | "rediss" | "redis+cluster" | "redis+sentinel" => "redis",
        "postgres" | "postgresql" => "postgres",
        "mysql" | "mariadb" => "mysql",
        "etcd" => "etcd",
        "zk" | "zookeeper" => "zookeeper",
        "redlock" => "redlock",
        _ => "other",
    }
}

/// Histogram buckets (seconds): store round trips from 50 µs, waits up to a minute.
const BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Runs the service until SIGTERM or SIGINT (on a multi-threaded runtime).
pub(crate) async fn run(args: ServeArgs) -> ExitCode {
    init_logging(args.log_format);
    serve(args).await
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.with_ansi(false).try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

fn usage(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("turnstile serve: {message}");
    ExitCode::from(exit::USAGE)
}

async fn serve(args: ServeArgs) -> ExitCode {
    let (auth, tokens_document) = match load_tokens(args.tokens.as_deref()) {
        Ok(loaded) => loaded,
        Err(message) => return usage(message),
    };
    let claim_secret = match claim_secret(
        args.claim_secret_file.as_deref(),
        tokens_document.as_deref(),
    ) {
        Ok(secret) => secret,
        Err(message) => return usage(message),
    };
    let loopback = args.listen.ip().is_loopback();
    if auth.is_open() && !loopback && !args.no_auth {
        return usage(format!(
            "{} is not a loopback address and no tokens are configured: anyone who reaches \
             it could take and break every lock. Give --tokens FILE (or TURNSTILE_TOKENS), \
             or --no-auth if that is really meant",
            args.listen
        ));
    }
    if !auth.is_open() && !loopback && args.tls_cert.is_none() && !args.insecure_http {
        return usage(format!(
            "{} is not a loopback address and this is plain HTTP: every bearer token would \
             cross the network unencrypted. Give --tls-cert and --tls-key, or --insecure-http \
             if the network is trusted",
            args.listen
        ));
    }
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => match tls::acceptor(cert, key) {
            Ok(acceptor) => Some(acceptor),
            Err(message) => return usage(message),
        },
        _ => None,
    };
    let metrics = match PrometheusBuilder::new()
        .set_buckets(BUCKETS)
        .map(PrometheusBuilder::install_recorder)
    {
        Ok(Ok(handle)) => handle,
        Ok(Err(error)) | Err(error) => {
            eprintln!("turnstile serve: cannot set up metrics: {error}");
            return ExitCode::from(exit::SOFTWARE);
        }
    };
    let url = match args.store.url() {
        Ok(url) => url,
        Err(error) => return crate::fail(&error),
    };
    let locker = match Locker::connect(&url).await {
        Ok(locker) => locker,
        Err(error) => return crate::fail(&error),
    };
    let idempotency = match optional(
        "idempotency records",
        turnstile::store::connect_idempotency(&url).await,
    ) {
        Ok(store) => store,
        Err(code) => return code,
    };
    let outbox = match optional("the outbox", turnstile::store::connect_outbox(&url).await) {
        Ok(store) => store,
        Err(code) => return code,
    };
    let relay = match (&args.relay, &outbox) {
        (None, _) => None,
        (Some(broker), Ok(outbox)) => match turnstile::store::connect_publisher(broker).await {
            Ok(publisher) => Some(turnstile::outbox::relay::Relay::from_arcs(
                Arc::clone(outbox),
                publisher,
            )),
            Err(error) => return crate::fail(&error),
        },
        (Some(_), Err(why)) => return usage(format!("--relay needs an outbox: {why}")),
    };
    let listener = match tokio::net::TcpListener::bind(args.listen).await {
        Ok(listener) => listener,
        Err(error) => {
            eprintln!("turnstile serve: cannot listen on {}: {error}", args.listen);
            return ExitCode::from(exit::UNAVAILABLE);
        }
    };
    let address = listener.local_addr().unwrap_or(args.listen);
    let shutdown = CancellationToken::new();
    let service = Arc::new(Service {
        engine: engine_of(&url),
        election: Election::new(locker.clone()),
        locker,
        idempotency,
        outbox,
        auth,
        activity: Activity::default(),
        max_wait: args.max_wait,
        max_ttl: args.max_ttl,
        allowed_hosts: allowed_hosts(address, &args.allowed_host),
        claim_secret,
        metrics_token: args
            .metrics_token
            .as_deref()
            .map(|token| sha256(token.as_bytes())),
        held: quota::HeldLocks::new(
            args.max_locks_per_tenant
                .map_or(if session_bound(&url) { 16 } else { 10_000 }, |n| {
                    usize::try_from(n).unwrap_or(usize::MAX)
                }),
        ),
        long_polls: Arc::new(tokio::sync::Semaphore::new(
            usize::try_from(args.max_long_polls).unwrap_or(usize::MAX),
        )),
        observers: Arc::new(tokio::sync::Semaphore::new(
            usize::try_from(args.max_observers).unwrap_or(usize::MAX),
        )),
        metrics,
        shutdown: shutdown.clone(),
    });
    tokio::spawn(sample(Arc::clone(&service)));
    if let Some(relay) = relay {
        let stop = shutdown.clone();
        tokio::spawn(async move {
            // A relay that cannot go on (a broker that cannot keep its promises) is
            // reported; the locks and keys are served on regardless.
            if let Err(error) = relay.run(stop).await {
                tracing::error!(%error, "the outbox relay stopped");
            }
        });
    }
    let app = app(Arc::clone(&service), args.max_body);
    announce(&service, address, tls.is_some(), loopback);
    if let Some(every) = args.sweep_every {
        let store = match &service.idempotency {
            Ok(store) => Arc::clone(store),
            Err(why) => return usage(format!("--sweep-every needs idempotency records: {why}")),
        };
        let keys = turnstile::idempotency::Idempotency::from_arc(store);
        let stop = shutdown.clone();
        tokio::spawn(async move { keys.run_sweeper(every, 1000, stop).await });
    }
    tokio::spawn(stop_on_signal(shutdown.clone()));
    let limits = conn::Limits {
        max_connections: usize::try_from(args.max_connections).unwrap_or(usize::MAX),
        header_timeout: args.header_timeout,
    };
    match tls {
        Some(acceptor) => {
            let listener = tls::TlsListener::start(listener, acceptor, shutdown.clone());
            conn::serve(listener, app, limits, shutdown.clone()).await;
        }
        None => conn::serve(listener, app, limits, shutdown.clone()).await,
    }
    tracing::info!("stopped");
    ExitCode::SUCCESS
}

/// A part of the store this engine may not have: its endpoints then answer 501.
fn optional<T>(what: &str, opened: Result<T, Error>) -> Result<Result<T, String>, ExitCode> {
    match opened {
        Ok(store) => Ok(Ok(store)),
        Err(error) if error.kind() == ErrorKind::UnsupportedStore => {
            eprintln!("turnstile serve: no {what} on this store; its endpoints answer 501");
            Ok(Err(error.to_string()))
        }
        Err(error) => Err(crate::fail(&error)),
    }
}

/// The tokens, and the document they came from (none in open mode).
fn load_tokens(path: Option<&std::path::Path>) -> Result<(Auth, Option<String>), String> {
    let text = match path {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|error| format!("cannot read {}: {error}", path.display()))?,
        None => match std::env::var("TURNSTILE_TOKENS") {
            Ok(text) if !text.trim().is_empty() => text,
            _ => return Ok((Auth::open(), None)),
        },
    };
    Ok((Auth::from_json(&text)?, Some(text)))
}

/// What signs claim capabilities: `--claim-secret-file`, else the tokens document
/// (shared by every instance of a deployment), else a secret of this process (open
/// mode: one developer's single instance).
fn claim_secret(
    file: Option<&std::path::Path>,
    tokens: Option<&str>,
) -> Result<capability::ClaimSecret, String> {
    match (file, tokens) {
        (Some(path), _) => {
            let material = std::fs::read(path)
                .map_err(|error| format!("cannot read {}: {error}", path.display()))?;
            if material.len() < 16 {
                return Err(format!(
                    "{} holds {} bytes; a claim secret needs at least 16",
                    path.display(),
                    material.len()
                ));
            }
            Ok(capability::ClaimSecret::derive(&material))
        }
        (None, Some(tokens)) => Ok(capability::ClaimSecret::derive(tokens.as_bytes())),
        (None, None) => Ok(capability::ClaimSecret::random()),
    }
}

fn announce(service: &Service, address: SocketAddr, tls: bool, loopback: bool) {
    let scheme = if tls { "https" } else { "http" };
    let base = format!("{scheme}://{address}");
    println!(
        "turnstile serve: store {}",
        service.locker.backend().describe()
    );
    println!(
        "listening on {base}{}",
        if loopback {
            " (loopback only; --listen 0.0.0.0:7070 serves other hosts)"
        } else if tls {
            ""
        } else {
            " (plain HTTP on a non-loopback address: tokens cross the network unencrypted; \
             give --tls-cert and --tls-key)"
        }
    );
    if service.auth.is_open() {
        println!(
            "auth: none (no tokens configured: every caller is an admin). No-token mode is for \
             one developer's machine: requests must name this address as their Host, and pages \
             from other sites may change nothing; configure --tokens for anything shared"
        );
    } else {
        println!("auth: {} bearer token(s)", service.auth.token_count());
    }
    println!("dashboard: {base}/");
    println!(
        "try: curl -s -X POST {base}/v1/locks/hello/acquire -H 'content-type: application/json' -d '{{\"ttl_ms\":30000}}'"
    );
    tracing::info!(%address, tls, "listening");
}

async fn stop_on_signal(shutdown: CancellationToken) {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
    }
    tracing::info!("shutting down: finishing requests in flight, ending long-polls");
    shutdown.cancel();
}

/// Every two seconds: the outbox's lag (for the dashboard and `/metrics`) and the
/// Prometheus recorder's upkeep.
async fn sample(service: Arc<Service>) {
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = service.shutdown.cancelled() => return,
        }
        service.metrics.run_upkeep();
        let Ok(outbox) = &service.outbox else {
            continue;
        };
        match outbox.status(1000).await {
            Ok(status) => {
                let oldest = status.oldest_pending.map_or(0.0, |age| age.as_secs_f64());
                metrics::gauge!("turnstile_outbox_pending").set(status.pending as f64);
                metrics::gauge!("turnstile_outbox_oldest_pending_seconds").set(oldest);
                metrics::gauge!("turnstile_outbox_parked_keys").set(status.parked.len() as f64);
                service.activity.outbox(
                    status.pending,
                    status.oldest_pending,
                    status.parked.len() as u64,
                );
            }
            Err(error) => tracing::warn!(%error, "cannot read the outbox's status"),
        }
    }
}

/// The whole application: the API, its OpenAPI document, metrics, the dashboard.
fn app(service: Arc<Service>, max_body: usize) -> Router {
    let (api, openapi) = elections::routes(api::router()).split_for_parts();
    let openapi = Arc::new(finish_document(openapi, service.max_wait, service.max_ttl));
    api.route(
        "/openapi.json",
        get(move || {
            let openapi = Arc::clone(&openapi);
            async move {
                (
                    [(header::CONTENT_TYPE, "application/json")],
                    openapi.as_ref().clone(),
                )
            }
        }),
    )
    .route("/metrics", get(prometheus))
    .route("/healthz", get(|| async { "ok\n" }))
    .route(
        "/",
        get(|| async {
            // One page with its script and styles inline: it may fetch from this origin
            // only, and no other site may frame it.
            (
                [
                    (
                        header::CONTENT_SECURITY_POLICY,
                        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                         connect-src 'self'; img-src 'self' data:; base-uri 'none'; \
                         form-action 'none'; frame-ancestors 'none'",
                    ),
                    (header::X_FRAME_OPTIONS, "DENY"),
                    (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
                ],
                Html(DASHBOARD),
            )
        }),
    )
    .fallback(|| async {
        Problem::new(
            StatusCode::NOT_FOUND,
            "not-found",
            "Not found",
            "no such route; the API is described at /openapi.json",
        )
    })
    .method_not_allowed_fallback(|| async {
        Problem::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method-not-allowed",
            "Method not allowed",
            "this route does not take that method; see /openapi.json",
        )
    })
    .layer(DefaultBodyLimit::max(max_body))
    .layer(middleware::from_fn_with_state(Arc::clone(&service), guard_open_mode))
    .layer(middleware::from_fn(observe))
    .with_state(service)
}

/// The OpenAPI document as served: the handlers' own descriptions, plus the answers
/// every operation can give (a bad request, authentication, a store that is down; for
/// operations with a body, its size, media type and shape) and this instance's limits.
fn finish_document(
    openapi: utoipa::openapi::OpenApi,
    max_wait: Duration,
    max_ttl: Duration,
) -> String {
    let Ok(mut document) = serde_json::to_value(&openapi) else {
        return String::new();
    };
    let problem = |description: &str| {
        serde_json::json!({
            "description": description,
            "content": {"application/problem+json": {
                "schema": {"$ref": "#/components/schemas/ProblemDocument"}
            }}
        })
    };
    let always = [
        ("400", "Invalid name, key, option or parameter"),
        ("401", "No token, or an unknown one"),
        (
            "403",
            "The token lacks the scope, or is confined to a tenant",
        ),
        (
            "503",
            "The store is unavailable, or the service is shutting down",
        ),
    ];
    let with_body = [
        ("413", "The body is larger than --max-body"),
        ("415", "The body is not sent as application/json"),
        ("422", "The body is JSON of the wrong shape"),
    ];
    if let Some(paths) = document["paths"].as_object_mut() {
        for operation in paths.values_mut().filter_map(|path| path.as_object_mut()) {
            for operation in operation.values_mut() {
                let has_body = operation.get("requestBody").is_some();
                let Some(responses) = operation["responses"].as_object_mut() else {
                    continue;
                };
                let extra = always
                    .iter()
                    .chain(if has_body { &with_body[..] } else { &[] });
                for (status, description) in extra {
                    responses
                        .entry(status.to_string())
                        .or_insert_with(|| problem(description));
                }
            }
        }
    }
    let wait = &mut document["components"]["schemas"]["AcquireRequest"]["properties"]["wait_ms"];
    if wait.is_object() {
        wait["maximum"] = serde_json::Value::from(max_wait.as_millis() as u64);
    }
    // This service's own bounds, so that clients (and the API fuzzer) see them.
    for schema in ["AcquireRequest", "ExtendRequest"] {
        let ttl = &mut document["components"]["schemas"][schema]["properties"]["ttl_ms"];
        if ttl.is_object() {
            ttl["maximum"] = serde_json::Value::from(max_ttl.as_millis() as u64);
        }
    }
    if let Some(responses) =
        document["paths"]["/v1/locks/{name}/acquire"]["post"]["responses"].as_object_mut()
    {
        responses.entry("429").or_insert_with(|| {
            problem("The tenant holds as many locks as --max-locks-per-tenant allows")
        });
    }
    document.to_string()
}

/// The dashboard: one page, its script and styles inline, nothing fetched from elsewhere.
const DASHBOARD: &str = include_str!("dashboard.html");

fn sha256(text: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(text).into()
}

async fn prometheus(
    State(service): State<Arc<Service>>,
    headers: axum::http::HeaderMap,
) -> Response {
    if let Some(expected) = &service.metrics_token {
        use subtle::ConstantTimeEq;
        // Digests compared in constant time, as the API's tokens are.
        let matches = headers
            .get(header::AUTHORIZATION)
            .and_then(|value| auth::bearer(value.as_bytes()))
            .is_some_and(|token| bool::from(sha256(token).ct_eq(expected)));
        if !matches {
            return Problem::new(
                StatusCode::UNAUTHORIZED,
                "unauthenticated",
                "Metrics need a token",
                "this service's /metrics requires the bearer token given with --metrics-token",
            )
            .into_response();
        }
    }
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        service.metrics.render(),
    )
        .into_response()
}

/// Counts and times every request by route (never by name or key) and status.
async fn observe(request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |path| path.as_str().to_owned());
    // A closed set of labels: hyper accepts any method name, and each new label value
    // would be a new series kept for good (and shown on /metrics, before any token).
    let method: &'static str = match request.method().as_str() {
        "GET" => "GET",
        "HEAD" => "HEAD",
        "POST" => "POST",
        "PUT" => "PUT",
        "DELETE" => "DELETE",
        "PATCH" => "PATCH",
        "OPTIONS" => "OPTIONS",
        _ => "OTHER",
    };
    let started = std::time::Instant::now();
    let response = next.run(request).await;
    let status = response.status().as_u16().to_string();
    metrics::counter!(
        "turnstile_http_requests_total",
        "method" => method,
        "route" => route.clone(),
        "status" => status
    )
    .increment(1);
    metrics::histogram!("turnstile_http_request_seconds", "method" => method, "route" => route)
        .record(started.elapsed().as_secs_f64());
    response
}
