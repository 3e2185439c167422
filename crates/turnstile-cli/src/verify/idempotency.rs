//! `turnstile verify idempotency`: clients send payments with `Idempotency-Key`s to
//! several service instances (processes of this binary, each an axum app with the
//! idempotency layer over one store), drop responses and retry, in other tenants with
//! the same keys too; a nemesis kills instances mid-request, pauses them past their
//! claim's lease and restarts the store. Every effect the handler has is a row written
//! with the effect's request; the checker reads those rows and what the clients were
//! finally answered, and decides: one effect per request (beyond what the mode does
//! not promise), every answer the request's own (its tenant, key and body, naming an
//! effect that happened), and every request answered.
//!
//! Two modes, as the library has them: **transaction** (SQLite, PostgreSQL, MySQL /
//! MariaDB: the handler writes its effect in the layer's transaction, which commits
//! with the stored response; no fault may give a second effect) and **lease** (every
//! store, the only one on Redis: the effect is written outside, so a handler killed or
//! frozen after its effect and before its response was stored runs again on a retry
//! once its lease is over — the documented cost of the mode, counted as *explained*).
//!
//! The report (`report.html` beside `summary.json`) draws each run as a row per
//! instance with a tick per effect (green a request's first, amber a second one a fault
//! explains, red one nothing explains) and the faults shaded where they hit.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use axum::http::{HeaderMap, StatusCode, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdout, Command};
use turnstile::idempotency::http::{IdempotencyLayer, IdempotentTransaction, types};
use turnstile::idempotency::{Idempotency, IdempotencyOptions, Scope};

use std::fmt::Write as _;

use svg::Document;
use svg::node::element::{Group, Line, Title};

use super::check::{self as lock_check, Verdict};
use super::history::monotonic_ns;
use super::report;
use super::{Store, between, signal};

/// The tenants requests come from; the last is the global scope (keys of no tenant).
const TENANTS: [&str; 3] = ["acme", "globex", GLOBAL];
/// The `X-Tenant` value that stands for [`Scope::global`].
const GLOBAL: &str = "*global";

/// A fault the nemesis can inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum IdempotencyFault {
    /// SIGKILL one service instance (requests in flight die with it), and start it
    /// again after 0.2 to 0.8 s.
    KillInstance,
    /// Freeze one instance (SIGSTOP) for 1.5 to 3 leases, then SIGCONT: its claims'
    /// leases run out while it cannot act.
    Pause,
    /// Restart the store: a server this command started, or `--restart-cmd`.
    Restart,
    /// Freeze the store (SIGSTOP; a Redis server this command started) for 0.5 to 1.5
    /// leases, then SIGCONT: renewals and completions meet a store that does not answer.
    StorePause,
    /// Make the store refuse writes with `READONLY`, as a replica does (a Redis server
    /// this command started made the replica of an address nobody answers at), for 0.5
    /// to 1.5 leases: renewals and completions meet a transient error.
    StoreReadOnly,
    /// Lock every record row no one else holds from another client's transaction
    /// (`SELECT … FOR UPDATE SKIP LOCKED`; a PostgreSQL or MariaDB server this command
    /// started) for 0.5 to 1.5 leases, then roll it back: claims and renewals of those
    /// keys wait out the store's own lock timeout (PostgreSQL 55P03 after 250 ms,
    /// MariaDB 1205 after 1 s; a claim is answered "in progress", a renewal retried),
    /// and so do the lease mode's completions; the transaction mode's completions, on
    /// the application's own pool, wait for the lock to end.
    StoreRowLock,
}

impl IdempotencyFault {
    fn name(self) -> &'static str {
        match self {
            IdempotencyFault::KillInstance => "kill-instance",
            IdempotencyFault::Pause => "pause",
            IdempotencyFault::Restart => "restart",
            IdempotencyFault::StorePause => "store-pause",
            IdempotencyFault::StoreReadOnly => "store-read-only",
            IdempotencyFault::StoreRowLock => "store-row-lock",
        }
    }
}

/// Where the handler's effect is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Mode {
    /// In the layer's transaction, committed with the stored response (SQL stores).
    Transaction,
    /// Outside the store (an SQLite file of the run), under the claim's lease.
    Lease,
}

/// `turnstile verify idempotency`.
#[derive(Args, Debug)]
pub(crate) struct VerifyIdempotencyArgs {
    /// The store: a URL (sqlite://, redis://, postgres://, mysql://), or one of
    /// `sqlite`, `redis`, `postgres`, `mariadb` to start a private server of that kind
    /// (it can then restart it; Redis comes back empty).
    #[arg(long, value_name = "URL|KIND")]
    store: String,
    /// Where the handler writes its effect: `transaction` (default on SQL stores) or
    /// `lease` (default, and the only mode, on Redis).
    #[arg(long, value_enum)]
    mode: Option<Mode>,
    /// Service instances (processes) the clients spread their requests over.
    #[arg(long, default_value_t = 3)]
    instances: usize,
    /// Clients sending requests at once.
    #[arg(long, default_value_t = 6)]
    clients: usize,
    /// How long new requests are sent and faults injected; the run then waits (up to
    /// a minute) for every request to be answered.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// The claims' lease.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    lease: Duration,
    /// Faults to inject, in turn, with quiet periods between.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "kill-instance,pause,restart"
    )]
    faults: Vec<IdempotencyFault>,
    /// The share of attempts whose response the client does not wait for (it gives up
    /// after 1 to 60 ms and retries, on any instance).
    #[arg(long, default_value_t = 0.3)]
    drop_responses: f64,
    /// Shell command that restarts the store (for a store given by URL).
    #[arg(long, value_name = "CMD")]
    restart_cmd: Option<String>,
    /// Runs, each with its own keys, effects and verdict.
    #[arg(long, default_value_t = 1)]
    runs: u32,
    /// Where each run's files and `summary.json` go.
    #[arg(
        long,
        value_name = "DIR",
        default_value = "turnstile-verify-idempotency"
    )]
    report: PathBuf,
    /// Print the summary as JSON on stdout.
    #[arg(long)]
    json: bool,
}

/// Internal to `verify idempotency`: one service instance.
#[derive(Args, Debug)]
pub(crate) struct InstanceArgs {
    #[arg(long)]
    store: String,
    #[arg(long, value_enum)]
    mode: Mode,
    #[arg(long, value_parser = humantime::parse_duration)]
    lease: Duration,
    #[arg(long)]
    instance: usize,
    #[arg(long)]
    run_id: String,
    /// The effects file (lease mode).
    #[arg(long)]
    effects: Option<PathBuf>,
}

/// The kinds of store the idempotency layer has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    Sqlite,
    Postgres,
    MySql,
    Redis,
}

fn engine_of(url: &str) -> anyhow::Result<Engine> {
    Ok(match url.split("://").next().unwrap_or("") {
        "sqlite" => Engine::Sqlite,
        "postgres" | "postgresql" => Engine::Postgres,
        "mysql" | "mariadb" => Engine::MySql,
        "redis" | "rediss" | "redis+cluster" | "redis+sentinel" => Engine::Redis,
        other => anyhow::bail!(
            "--store: no idempotency store for {other:?} URLs; use sqlite://, postgres://, mysql:// or redis://"
        ),
    })
}

// ---------------------------------------------------------------------------------
// The service instance.

/// One effect of the handler: a row in `verify_effects`, and the response body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Effect {
    effect: i64,
    scope: String,
    key: String,
    body: String,
    instance: i64,
    at_ns: i64,
}

impl Effect {
    /// A new effect of the request whose headers and body these are.
    fn of(instance: usize, headers: &HeaderMap, body: String) -> Effect {
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|value| value.to_str().ok())
                .unwrap_or("")
                .to_owned()
        };
        Effect {
            // Random, so that two effects of one request are told apart.
            effect: i64::try_from(rand::random::<u64>() >> 1).unwrap_or(0),
            scope: header("x-tenant"),
            key: header("idempotency-key").trim_matches('"').to_owned(),
            body,
            instance: i64::try_from(instance).unwrap_or(-1),
            at_ns: i64::try_from(monotonic_ns()).unwrap_or(i64::MAX),
        }
    }

    fn response(&self) -> Response {
        (
            StatusCode::CREATED,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            serde_json::to_vec(self).unwrap_or_default(),
        )
            .into_response()
    }
}

/// The payment provider's time: effects take a while, so faults land inside them.
async fn provider_call() {
    tokio::time::sleep(between(Duration::from_millis(1), Duration::from_millis(15))).await;
}

fn scope_of(parts: &Parts) -> Option<Scope> {
    let tenant = parts.headers.get("x-tenant")?.to_str().ok()?;
    if tenant == GLOBAL {
        Some(Scope::global())
    } else {
        Scope::new(tenant).ok()
    }
}

const CREATE_EFFECTS: &str = "CREATE TABLE IF NOT EXISTS verify_effects (
    effect BIGINT NOT NULL PRIMARY KEY,
    run_id VARCHAR(64) NOT NULL,
    scope VARCHAR(64) NOT NULL,
    idem_key VARCHAR(128) NOT NULL,
    body VARCHAR(128) NOT NULL,
    instance BIGINT NOT NULL,
    at_ns BIGINT NOT NULL)";
const INSERT_EFFECT: &str = "INSERT INTO verify_effects
    (effect, run_id, scope, idem_key, body, instance, at_ns) VALUES (?, ?, ?, ?, ?, ?, ?)";
const INSERT_EFFECT_POSTGRES: &str = "INSERT INTO verify_effects
    (effect, run_id, scope, idem_key, body, instance, at_ns) VALUES ($1, $2, $3, $4, $5, $6, $7)";

/// The same-transaction router on one SQL engine: the effect is written in the
/// request's transaction.
macro_rules! transaction_router {
    ($db:ty, $store:expr, $pool:expr, $options:expr, $args:expr, $insert:expr) => {{
        let store = $store;
        let (instance, run_id) = ($args.instance, $args.run_id.clone());
        let layer = IdempotencyLayer::new(
            Idempotency::new(store.clone()).with_options($options)?,
            scope_of,
        )
        .require_key(true)
        .in_transactions(store, $pool)?;
        Router::new()
            .route(
                "/charge",
                post(
                    move |mut transaction: IdempotentTransaction<$db>,
                          headers: HeaderMap,
                          body: String| {
                        let run_id = run_id.clone();
                        async move {
                            let effect = Effect::of(instance, &headers, body);
                            provider_call().await;
                            let written = sqlx::query($insert)
                                .bind(effect.effect)
                                .bind(&run_id)
                                .bind(&effect.scope)
                                .bind(&effect.key)
                                .bind(&effect.body)
                                .bind(effect.instance)
                                .bind(effect.at_ns)
                                .execute(&mut *transaction)
                                .await;
                            if let Err(error) = written {
                                // Not stored in this mode: rolled back, the key given back.
                                return (StatusCode::SERVICE_UNAVAILABLE, error.to_string())
                                    .into_response();
                            }
                            provider_call().await;
                            effect.response()
                        }
                    },
                ),
            )
            .route_layer(layer)
    }};
}

/// The lease-mode router: the effect is committed to the run's effects file before the
/// response, outside the store.
fn lease_router(engine: Idempotency, effects: SqlitePool, args: &InstanceArgs) -> Router {
    let (instance, run_id) = (args.instance, args.run_id.clone());
    let layer = IdempotencyLayer::new(engine, scope_of).require_key(true);
    Router::new()
        .route(
            "/charge",
            post(move |headers: HeaderMap, body: String| {
                let (effects, run_id) = (effects.clone(), run_id.clone());
                async move {
                    let effect = Effect::of(instance, &headers, body);
                    provider_call().await;
                    if let Err(error) = insert_effect(&effects, &run_id, &effect).await {
                        // A 5xx is stored in the lease mode; no effect happened, and the
                        // checker sees a request answered without one.
                        return (StatusCode::SERVICE_UNAVAILABLE, error.to_string())
                            .into_response();
                    }
                    provider_call().await;
                    effect.response()
                }
            }),
        )
        .route_layer(layer)
}

async fn insert_effect(pool: &SqlitePool, run_id: &str, effect: &Effect) -> sqlx::Result<()> {
    sqlx::query(INSERT_EFFECT)
        .bind(effect.effect)
        .bind(run_id)
        .bind(&effect.scope)
        .bind(&effect.key)
        .bind(&effect.body)
        .bind(effect.instance)
        .bind(effect.at_ns)
        .execute(pool)
        .await?;
    Ok(())
}

/// Opens (creating) an SQLite file shared by processes: WAL, a long busy timeout.
async fn open_effects_file(path: &Path) -> anyhow::Result<SqlitePool> {
    let options = SqliteConnectOptions::from_str(&format!("sqlite://{}", path.display()))?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(30));
    let pool = SqlitePoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await?;
    sqlx::query(CREATE_EFFECTS).execute(&pool).await?;
    Ok(pool)
}

/// Runs one service instance: prints its port on stdout, then serves until killed.
pub(crate) async fn instance(args: InstanceArgs) -> ExitCode {
    match serve_instance(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("turnstile verify-idempotency-instance: {error:#}");
            ExitCode::from(crate::exit::UNAVAILABLE)
        }
    }
}

async fn serve_instance(args: InstanceArgs) -> anyhow::Result<()> {
    use turnstile::idempotency::{
        mysql::MysqlIdempotencyStore, postgres::PostgresIdempotencyStore,
        sqlite::SqliteIdempotencyStore,
    };
    // Records outlive the run: a retry always finds its key's record.
    let options = IdempotencyOptions::new()
        .lease(args.lease)
        .retention(Duration::from_secs(3600));
    let router = match (args.mode, engine_of(&args.store)?) {
        (Mode::Lease, _) => {
            let effects = open_effects_file(args.effects.as_deref().context("--effects")?).await?;
            let engine = Idempotency::connect(&args.store)
                .await?
                .with_options(options)?;
            lease_router(engine, effects, &args)
        }
        (Mode::Transaction, Engine::Sqlite) => {
            let store = SqliteIdempotencyStore::open_url(&args.store).await?;
            let pool = store.pool().clone();
            transaction_router!(sqlx::Sqlite, store, pool, options, args, INSERT_EFFECT)
        }
        (Mode::Transaction, Engine::Postgres) => {
            let store = PostgresIdempotencyStore::connect(&args.store).await?;
            let pool =
                sqlx::PgPool::connect(&crate::without_turnstile_options(&args.store)).await?;
            transaction_router!(
                sqlx::Postgres,
                store,
                pool,
                options,
                args,
                INSERT_EFFECT_POSTGRES
            )
        }
        (Mode::Transaction, Engine::MySql) => {
            let store = MysqlIdempotencyStore::connect(&args.store).await?;
            let pool =
                sqlx::MySqlPool::connect(&crate::without_turnstile_options(&args.store)).await?;
            transaction_router!(sqlx::MySql, store, pool, options, args, INSERT_EFFECT)
        }
        (Mode::Transaction, Engine::Redis) => {
            anyhow::bail!("--mode transaction needs an SQL store; Redis has the lease mode only")
        }
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    // The one line the orchestrator reads.
    println!("{}", listener.local_addr()?.port());
    axum::serve(listener, router).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------
// The effects, read back by the orchestrator.

/// Where a run's effects are: the store's own database (transaction mode) or the run's
/// SQLite file (lease mode).
enum EffectsDb {
    Sqlite(SqlitePool),
    Postgres(sqlx::PgPool),
    MySql(sqlx::MySqlPool),
}

type EffectRow = (i64, String, String, String, i64, i64);

impl EffectsDb {
    /// Opens the effects table, creating it (before any instance writes to it).
    async fn open(mode: Mode, url: &str, lease_file: &Path) -> anyhow::Result<EffectsDb> {
        let db = match (mode, engine_of(url)?) {
            (Mode::Lease, _) => return Ok(EffectsDb::Sqlite(open_effects_file(lease_file).await?)),
            (Mode::Transaction, Engine::Sqlite) => {
                let path = url.trim_start_matches("sqlite://");
                let path = path.split('?').next().unwrap_or(path);
                EffectsDb::Sqlite(open_effects_file(Path::new(path)).await?)
            }
            (Mode::Transaction, Engine::Postgres) => EffectsDb::Postgres(
                sqlx::PgPool::connect(&crate::without_turnstile_options(url)).await?,
            ),
            (Mode::Transaction, Engine::MySql) => EffectsDb::MySql(
                sqlx::MySqlPool::connect(&crate::without_turnstile_options(url)).await?,
            ),
            (Mode::Transaction, Engine::Redis) => {
                anyhow::bail!(
                    "--mode transaction needs an SQL store; Redis has the lease mode only"
                )
            }
        };
        match &db {
            EffectsDb::Sqlite(_) => {}
            EffectsDb::Postgres(pool) => {
                sqlx::query(CREATE_EFFECTS).execute(pool).await?;
            }
            EffectsDb::MySql(pool) => {
                sqlx::query(CREATE_EFFECTS).execute(pool).await?;
            }
        }
        Ok(db)
    }

    /// Every effect of the run `run_id` (a store just restarted is waited for).
    async fn read(&self, run_id: &str) -> anyhow::Result<Vec<Effect>> {
        const SELECT: &str = "SELECT effect, scope, idem_key, body, instance, at_ns FROM verify_effects WHERE run_id = ?";
        const SELECT_POSTGRES: &str = "SELECT effect, scope, idem_key, body, instance, at_ns FROM verify_effects WHERE run_id = $1";
        let mut last = None;
        for _ in 0..30 {
            let rows: sqlx::Result<Vec<EffectRow>> = match self {
                EffectsDb::Sqlite(pool) => {
                    sqlx::query_as(SELECT).bind(run_id).fetch_all(pool).await
                }
                EffectsDb::Postgres(pool) => {
                    sqlx::query_as(SELECT_POSTGRES)
                        .bind(run_id)
                        .fetch_all(pool)
                        .await
                }
                EffectsDb::MySql(pool) => sqlx::query_as(SELECT).bind(run_id).fetch_all(pool).await,
            };
            match rows {
                Ok(rows) => {
                    return Ok(rows
                        .into_iter()
                        .map(|(effect, scope, key, body, instance, at_ns)| Effect {
                            effect,
                            scope,
                            key,
                            body,
                            instance,
                            at_ns,
                        })
                        .collect());
                }
                Err(error) => last = Some(error),
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        Err(last.map_or_else(|| anyhow::anyhow!("no answer"), Into::into))
            .context("reading the effects back")
    }
}

// ---------------------------------------------------------------------------------
// The clients.

/// One logical request and everything its client saw until it was answered.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct RequestRecord {
    scope: String,
    key: String,
    body: String,
    /// The final answer (a 201), if one came before the run's deadline.
    answer: Option<Effect>,
    /// Whether that answer was a replay (`Idempotent-Replayed: true`).
    replayed: bool,
    attempts: u32,
    /// Attempts whose response the client did not wait for.
    dropped: u32,
    /// 409: the key's first request was still in flight.
    in_flight: u32,
    /// 503: the store could not be reached.
    unavailable: u32,
    /// 503 `claim-lost`: the claim was lost while the handler ran (the key was given
    /// back).
    claim_lost: u32,
    /// Connection refused or reset (an instance killed or restarting).
    connection_errors: u32,
    /// 422 `key-reused`: the store took the request for another one with the same key.
    key_mismatch: bool,
    /// A stored (replayed) answer other than a 201: the request's final answer.
    stored_error: Option<u16>,
    /// 422 `idempotency-outcome-unknown`: the first attempt ran but was cut off (its
    /// claim lost, its body broken), so the key records that its outcome is unknown
    /// and never runs it again. A final answer, true whether or not the effect
    /// happened.
    outcome_unknown: bool,
    /// 422 `not-replayable`: the request ran but its response could not be stored. A
    /// final answer, which says an effect happened.
    not_stored: bool,
    /// Any other status, in order.
    other_statuses: Vec<u16>,
}

/// The `n`th logical request of a run: every fourth reuses the key of the one before
/// it in another tenant (sent at about the same time by another client), with another
/// body; each tenant must get its own effect and answer.
fn logical_request(run_id: &str, n: u64) -> RequestRecord {
    let key_of = if n % 4 == 1 { n - 1 } else { n };
    // For n % 4 == 1 the tenant is the one after request n - 1's.
    let tenant = TENANTS[usize::try_from((n + n / 4) % 3).unwrap_or(0)];
    RequestRecord {
        scope: tenant.to_owned(),
        key: format!("{run_id}-k{key_of}"),
        body: format!("amount={n}"),
        ..RequestRecord::default()
    }
}

/// The instances' ports (`None` while one is down), shared with the clients.
type Ports = Arc<Mutex<Vec<Option<u16>>>>;

fn pick_port(ports: &Ports) -> Option<u16> {
    let live: Vec<u16> = ports
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .iter()
        .flatten()
        .copied()
        .collect();
    (!live.is_empty()).then(|| live[(rand::random::<u64>() % live.len() as u64) as usize])
}

/// Sends `request` until it has a final answer (a 201, a 422 or a replayed error), or
/// `deadline_ns` passes.
async fn send_until_answered(
    http: &reqwest::Client,
    ports: &Ports,
    drop_share: f64,
    request: &mut RequestRecord,
    deadline_ns: u64,
) {
    while monotonic_ns() < deadline_ns {
        let Some(port) = pick_port(ports) else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        request.attempts += 1;
        let dropping = rand::random::<f64>() < drop_share;
        let timeout = if dropping {
            between(Duration::from_millis(1), Duration::from_millis(60))
        } else {
            Duration::from_secs(10)
        };
        let attempt = async {
            let response = http
                .post(format!("http://127.0.0.1:{port}/charge"))
                .header("x-tenant", &request.scope)
                .header("idempotency-key", format!("\"{}\"", request.key))
                .body(request.body.clone())
                .send()
                .await?;
            let status = response.status().as_u16();
            let replayed = response
                .headers()
                .get("idempotent-replayed")
                .is_some_and(|value| value == "true");
            let body = response.bytes().await?;
            Ok::<_, reqwest::Error>((status, replayed, body))
        };
        match tokio::time::timeout(timeout, attempt).await {
            Err(_) if dropping => request.dropped += 1,
            Err(_) | Ok(Err(_)) => {
                request.connection_errors += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(Ok((201, replayed, body))) => {
                request.answer = Some(serde_json::from_slice(&body).unwrap_or(Effect {
                    effect: -1,
                    scope: String::new(),
                    key: String::new(),
                    body: String::from_utf8_lossy(&body).into_owned(),
                    instance: -1,
                    at_ns: 0,
                }));
                request.replayed = replayed;
                return;
            }
            Ok(Ok((status, replayed, body))) => {
                let problem = serde_json::from_slice::<serde_json::Value>(&body)
                    .ok()
                    .and_then(|value| value["type"].as_str().map(str::to_owned))
                    .unwrap_or_default();
                if status == 422 && problem == types::KEY_REUSED {
                    request.key_mismatch = true;
                    return;
                }
                if status == 422 && problem == types::OUTCOME_UNKNOWN {
                    request.outcome_unknown = true;
                    return;
                }
                if status == 422 && problem == types::NOT_REPLAYABLE {
                    request.not_stored = true;
                    return;
                }
                if replayed {
                    // A stored answer: every retry would get it again.
                    request.stored_error = Some(status);
                    return;
                }
                match status {
                    409 => request.in_flight += 1,
                    503 if problem == types::CLAIM_LOST => request.claim_lost += 1,
                    503 => request.unavailable += 1,
                    other => request.other_statuses.push(other),
                }
                tokio::time::sleep(between(
                    Duration::from_millis(20),
                    Duration::from_millis(150),
                ))
                .await;
            }
        }
    }
}

// ---------------------------------------------------------------------------------
// The checker.

/// A fault, as the nemesis injected it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct FaultWindow {
    fault: IdempotencyFault,
    /// The instance it hit (`None`: the store).
    instance: Option<usize>,
    start_ns: u64,
    end_ns: u64,
    /// What a `store-row-lock` episode held.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    held_rows: Option<HeldRows>,
}

/// Which faults explain a second effect of one request, and how.
#[derive(Debug, Clone, Serialize)]
struct Explaining {
    /// The faults the mode does not promise to survive (none in the transaction mode).
    faults: Vec<IdempotencyFault>,
    /// How long after its effect a request can still be in flight (its response not
    /// yet stored): a fault that starts later did not interrupt it.
    in_flight_ns: u64,
    /// Whether a restart of the store forgets completed records (Redis without
    /// persistence), so that a restart anywhere between two effects explains them.
    store_forgets: bool,
}

impl Explaining {
    /// Whether `window` explains `later`, a second effect of the request that had
    /// `earlier`: a fault the mode does not survive, between the two, that hit the
    /// first effect's request while it was in flight (on an instance of either effect:
    /// a handler frozen before it took its time stamp has the later one), or a restart
    /// that made the store forget the completed record.
    fn explains(&self, window: &FaultWindow, earlier: &Effect, later: &Effect) -> bool {
        let at = |effect: &Effect| u64::try_from(effect.at_ns).unwrap_or(0);
        let between = window.start_ns <= at(later) && window.end_ns >= at(earlier);
        if !self.faults.contains(&window.fault) || !between {
            return false;
        }
        if window.fault == IdempotencyFault::Restart && self.store_forgets {
            return true;
        }
        let in_flight = window.start_ns <= at(earlier).saturating_add(self.in_flight_ns);
        let on_its_instance = window.instance.is_none_or(|instance| {
            i64::try_from(instance).is_ok_and(|i| i == earlier.instance || i == later.instance)
        });
        in_flight && on_its_instance
    }
}

/// What the checker found in one run.
#[derive(Debug, Clone, Serialize)]
struct IdempotencyCheck {
    requests: usize,
    answered: usize,
    replays: usize,
    effects: usize,
    /// Effects beyond the first of a request.
    duplicates: usize,
    /// Duplicates a fault the mode does not promise to survive explains.
    explained: usize,
    dropped_responses: u64,
    in_flight_answers: u64,
    unavailable_answers: u64,
    claims_lost: u64,
    /// Requests finally answered 422 outcome-unknown (the first attempt cut off).
    outcome_unknown_answers: usize,
    /// Requests finally answered 422 not-replayable (the response was not stored).
    not_stored_answers: usize,
    faults: BTreeMap<String, usize>,
    verdicts: Vec<Verdict>,
    /// Each second effect (its id) and whether a fault explains it, for the report.
    #[serde(skip)]
    second_effects: HashMap<i64, bool>,
}

/// Decides a run from what the clients were answered and the effects that happened;
/// `explaining` says which faults let the mode run a request's effect again.
fn check(
    requests: &[RequestRecord],
    effects: &[Effect],
    faults: &[FaultWindow],
    explaining: &Explaining,
) -> IdempotencyCheck {
    let mut by_request: HashMap<(&str, &str), Vec<&Effect>> = HashMap::new();
    for effect in effects {
        by_request
            .entry((effect.scope.as_str(), effect.key.as_str()))
            .or_default()
            .push(effect);
    }
    let sent: HashSet<(&str, &str)> = requests
        .iter()
        .map(|request| (request.scope.as_str(), request.key.as_str()))
        .collect();
    let strangers: Vec<String> = by_request
        .keys()
        .filter(|request| !sent.contains(*request))
        .map(|(scope, key)| format!("{scope}/{key}"))
        .collect();

    let (mut duplicates, mut explained) = (0, 0);
    let mut unexplained = Vec::new();
    let mut second_effects = HashMap::new();
    for ((scope, key), list) in &mut by_request {
        list.sort_by_key(|effect| effect.at_ns);
        for pair in list.windows(2) {
            let (earlier, later) = (pair[0], pair[1]);
            duplicates += 1;
            let explains = |window: &&FaultWindow| explaining.explains(window, earlier, later);
            let explained_by = faults.iter().find(explains);
            second_effects.insert(later.effect, explained_by.is_some());
            match explained_by {
                Some(_) => explained += 1,
                None => unexplained.push(format!(
                    "{scope}/{key}: effects {} (instance {}) and {} (instance {}) {:.0} ms apart",
                    earlier.effect,
                    earlier.instance,
                    later.effect,
                    later.instance,
                    (later.at_ns - earlier.at_ns) as f64 / 1e6
                )),
            }
        }
    }

    let mut wrong_answers = Vec::new();
    for request in requests {
        if request.key_mismatch {
            wrong_answers.push(format!(
                "{}/{}: 422, taken for another request with the same key",
                request.scope, request.key
            ));
        }
        if let Some(status) = request.stored_error
            && by_request.contains_key(&(request.scope.as_str(), request.key.as_str()))
        {
            wrong_answers.push(format!(
                "{}/{}: answered with a stored {status} though its effect happened",
                request.scope, request.key
            ));
        }
        if request.not_stored
            && !by_request.contains_key(&(request.scope.as_str(), request.key.as_str()))
        {
            wrong_answers.push(format!(
                "{}/{}: answered that its response was not stored, though no effect happened",
                request.scope, request.key
            ));
        }
        let Some(answer) = &request.answer else {
            continue;
        };
        let own = answer.scope == request.scope
            && answer.key == request.key
            && answer.body == request.body;
        let happened = by_request
            .get(&(request.scope.as_str(), request.key.as_str()))
            .is_some_and(|list| list.iter().any(|effect| effect.effect == answer.effect));
        if !own {
            wrong_answers.push(format!(
                "{}/{} ({}): answered with {}/{} ({})",
                request.scope, request.key, request.body, answer.scope, answer.key, answer.body
            ));
        } else if !happened {
            wrong_answers.push(format!(
                "{}/{}: answered with effect {}, which did not happen",
                request.scope, request.key, answer.effect
            ));
        }
    }
    let unanswered: Vec<String> = requests
        .iter()
        .filter(|request| {
            request.answer.is_none()
                && !request.key_mismatch
                && request.stored_error.is_none()
                && !request.outcome_unknown
                && !request.not_stored
        })
        .map(|request| {
            format!(
                "{}/{} after {} attempts (409 {}, 503 {}, 500 {}, other {:?})",
                request.scope,
                request.key,
                request.attempts,
                request.in_flight,
                request.unavailable,
                request.claim_lost,
                request.other_statuses
            )
        })
        .collect();

    let verdict = |check: &'static str, problems: &[String], fine: String| Verdict {
        check,
        passed: problems.is_empty(),
        detail: if problems.is_empty() {
            fine
        } else {
            let shown: Vec<&str> = problems.iter().take(5).map(String::as_str).collect();
            format!("{} found: {}", problems.len(), shown.join("; "))
        },
    };
    let mut once_problems = unexplained;
    once_problems.extend(
        strangers
            .into_iter()
            .map(|request| format!("{request}: an effect of a request no client sent")),
    );
    let verdicts = vec![
        verdict(
            "one effect per request",
            &once_problems,
            format!(
                "{} effects for {} requests; {duplicates} more than one, each explained by a fault the mode does not promise to survive",
                effects.len(),
                requests.len()
            ),
        ),
        verdict(
            "answers are their own",
            &wrong_answers,
            "every answer names its own tenant, key and body, and an effect that happened".into(),
        ),
        verdict(
            "every request answered",
            &unanswered,
            "every request was answered".into(),
        ),
    ];
    let mut fault_counts = BTreeMap::new();
    for window in faults {
        *fault_counts
            .entry(window.fault.name().to_owned())
            .or_default() += 1;
    }
    let total = |field: fn(&RequestRecord) -> u32| -> u64 {
        requests
            .iter()
            .map(|request| u64::from(field(request)))
            .sum()
    };
    IdempotencyCheck {
        requests: requests.len(),
        answered: requests.iter().filter(|r| r.answer.is_some()).count(),
        replays: requests.iter().filter(|r| r.replayed).count(),
        effects: effects.len(),
        duplicates,
        explained,
        dropped_responses: total(|r| r.dropped),
        in_flight_answers: total(|r| r.in_flight),
        unavailable_answers: total(|r| r.unavailable),
        claims_lost: total(|r| r.claim_lost),
        outcome_unknown_answers: requests.iter().filter(|r| r.outcome_unknown).count(),
        not_stored_answers: requests.iter().filter(|r| r.not_stored).count(),
        faults: fault_counts,
        verdicts,
        second_effects,
    }
}

// ---------------------------------------------------------------------------------
// The orchestrator.

/// One run's outcome, as the summary shows it.
#[derive(Debug, Serialize)]
struct IdempotencyRun {
    run: u32,
    passed: bool,
    #[serde(flatten)]
    check: IdempotencyCheck,
    /// What the report draws.
    #[serde(skip)]
    chart: EffectChart,
}

/// One run's effects and faults, for the report.
#[derive(Debug, Default)]
struct EffectChart {
    effects: Vec<Effect>,
    faults: Vec<FaultWindow>,
}

impl EffectChart {
    /// A row per instance, a tick per effect, the faults shaded where they hit (the
    /// store: every row).
    fn svg(&self, check: &IdempotencyCheck, instances: usize) -> Document {
        let Some(axis) = report::TimeAxis::spanning(
            self.effects
                .iter()
                .map(|effect| u64::try_from(effect.at_ns).unwrap_or(0))
                .chain(self.faults.iter().flat_map(|f| [f.start_ns, f.end_ns])),
        ) else {
            return Document::new().set("width", 10).set("height", 10);
        };
        let labels: Vec<String> = (0..instances).map(|i| format!("instance {i}")).collect();
        let (document, height) = report::timeline_frame(&labels);
        let bands: Vec<lock_check::FaultWindow> = self
            .faults
            .iter()
            .map(|window| lock_check::FaultWindow {
                fault: window.fault.name().to_owned(),
                target: window.instance,
                start: window.start_ns,
                end: window.end_ns,
            })
            .collect();
        let mut ticks = Group::new();
        // Seconds first, so that a first effect never hides one.
        let mut effects: Vec<(&Effect, Option<bool>)> = self
            .effects
            .iter()
            .map(|effect| (effect, check.second_effects.get(&effect.effect).copied()))
            .collect();
        effects.sort_by_key(|(_, second)| second.is_some());
        for (effect, second) in effects {
            let Ok(row) = usize::try_from(effect.instance) else {
                continue;
            };
            let (colour, width, what) = match second {
                None => ("#3ebd93", 1, ""),
                Some(true) => ("#f0b429", 3, "second effect, explained by a fault"),
                Some(false) => ("#d64545", 3, "second effect, NOT explained"),
            };
            let top = 20.0 + report::ROW * row as f64 + 2.0;
            let at = axis.x(u64::try_from(effect.at_ns).unwrap_or(0));
            let tick = Line::new()
                .set("x1", at)
                .set("x2", at)
                .set("y1", top)
                .set("y2", top + report::ROW - 4.0)
                .set("stroke", colour)
                .set("stroke-width", width);
            // Only the few second effects carry a tool tip: thousands of first ones
            // would make the page heavy for nothing.
            ticks = ticks.add(match second {
                Some(_) => tick.add(Title::new(format!(
                    "{}/{}: {what}",
                    effect.scope, effect.key
                ))),
                None => tick,
            });
        }
        document
            .add(report::fault_bands(
                &axis,
                &bands,
                20.0,
                report::ROW,
                instances,
            ))
            .add(ticks)
            .add(axis.length_label(height))
    }
}

/// The page: what the campaign was, and each run's verdicts and effects.
fn html(summary: &IdempotencySummary) -> String {
    let mut page = report::page_head(
        &format!(
            "turnstile verify idempotency — {} ({} mode)",
            summary.store,
            match summary.mode {
                Mode::Transaction => "transaction",
                Mode::Lease => "lease",
            }
        ),
        summary.passed,
    );
    let faults: Vec<&str> = summary.faults.iter().map(|fault| fault.name()).collect();
    let _ = write!(
        page,
        "<p>{} runs of {} ms; {} service instances; {} clients; lease {} ms; faults {}. \
         Faults that explain a second effect in this mode: {}.</p>\
         <p>Timelines: a row per instance, a tick per effect: green a request's first, amber a second \
         one a fault explains, red one nothing explains; grey, faults (over every row: the store).</p>",
        summary.runs.len(),
        summary.duration_ms,
        summary.instances,
        summary.clients,
        summary.lease_ms,
        report::escape(&faults.join(", ")),
        if summary.explaining.faults.is_empty() {
            "none".to_owned()
        } else {
            summary
                .explaining
                .faults
                .iter()
                .map(|fault| fault.name())
                .collect::<Vec<_>>()
                .join(", ")
        },
    );
    for run in &summary.runs {
        let check = &run.check;
        page.push_str(&report::run_verdicts(run.run, &check.verdicts));
        let _ = write!(
            page,
            "<p>{} requests, {} answered, {} effects, {} second effects ({} explained), {} replays, \
             {} dropped responses, {} answered 409 in flight, {} answered 503, {} finally answered \
             outcome-unknown, {} finally answered not-stored.</p>{}",
            check.requests,
            check.answered,
            check.effects,
            check.duplicates,
            check.explained,
            check.replays,
            check.dropped_responses,
            check.in_flight_answers,
            check.unavailable_answers,
            check.outcome_unknown_answers,
            check.not_stored_answers,
            run.chart.svg(check, summary.instances),
        );
    }
    page.push_str("</body></html>\n");
    page
}

/// The whole campaign.
#[derive(Debug, Serialize)]
struct IdempotencySummary {
    store: String,
    mode: Mode,
    instances: usize,
    clients: usize,
    lease_ms: u128,
    duration_ms: u128,
    faults: Vec<IdempotencyFault>,
    explaining: Explaining,
    passed: bool,
    runs: Vec<IdempotencyRun>,
}

pub(crate) async fn run(args: VerifyIdempotencyArgs) -> ExitCode {
    super::exit_code(verify(args).await, "verify idempotency")
}

async fn verify(args: VerifyIdempotencyArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(
        (1..=16).contains(&args.instances),
        "--instances must be between 1 and 16"
    );
    anyhow::ensure!(
        (1..=256).contains(&args.clients),
        "--clients must be between 1 and 256"
    );
    anyhow::ensure!(
        (0.0..=0.95).contains(&args.drop_responses),
        "--drop-responses must be between 0 and 0.95"
    );
    anyhow::ensure!(
        args.lease >= Duration::from_millis(300) && args.lease <= Duration::from_secs(60),
        "--lease must be between 300ms and 60s"
    );
    let shortest = WARM_UP + 3 * args.lease + quiet(args.lease) + Duration::from_millis(500);
    anyhow::ensure!(
        args.duration >= shortest && args.duration <= Duration::from_secs(24 * 3600),
        "--duration must be between {} (room for one fault: a warm-up, the fault, the quiet after it, with --lease {}) and 24h",
        humantime::format_duration(shortest),
        humantime::format_duration(args.lease)
    );
    anyhow::ensure!(!args.faults.is_empty(), "--faults names no fault");
    anyhow::ensure!(
        (1..=10_000).contains(&args.runs),
        "--runs must be between 1 and 10000"
    );
    std::fs::create_dir_all(&args.report)?;
    let spec = args.store.clone();
    let report = args.report.clone();
    let store = tokio::task::spawn_blocking(move || -> anyhow::Result<Store> {
        Ok(match spec.as_str() {
            "sqlite" => Store::Sqlite(report.join("idempotency.sqlite3")),
            "redis" | "postgres" | "mariadb" => Store::start(&spec, &report)?,
            url if url.contains("://") => Store::Url(url.to_owned()),
            other => anyhow::bail!(
                "--store {other:?} is neither a URL nor one of sqlite, redis, postgres, mariadb"
            ),
        })
    })
    .await??;
    let store = Arc::new(store);
    let url = store.url();
    let engine = engine_of(&url)?;
    let mode = match (args.mode, engine) {
        (Some(Mode::Transaction), Engine::Redis) => {
            anyhow::bail!("--mode transaction needs an SQL store; Redis has the lease mode only")
        }
        (Some(mode), _) => mode,
        (None, Engine::Redis) => Mode::Lease,
        (None, _) => Mode::Transaction,
    };
    let explaining = Explaining {
        faults: match mode {
            // The effect and the stored response commit together: nothing explains two.
            Mode::Transaction => vec![],
            // A store that stops answering for longer than a lease can lose a claim
            // whose handler had effects, as a frozen instance can.
            Mode::Lease => vec![
                IdempotencyFault::KillInstance,
                IdempotencyFault::Pause,
                IdempotencyFault::Restart,
                IdempotencyFault::StorePause,
                IdempotencyFault::StoreReadOnly,
                IdempotencyFault::StoreRowLock,
            ],
        },
        // The first request's response is stored within its lease, or its claim is
        // lost; twice that and a second of slack for a loaded machine.
        in_flight_ns: u64::try_from((2 * args.lease + Duration::from_secs(1)).as_nanos())
            .unwrap_or(u64::MAX),
        // Redis keeps records only as far as its persistence does (best-effort).
        store_forgets: engine == Engine::Redis,
    };
    let redis_faults = [
        IdempotencyFault::StorePause,
        IdempotencyFault::StoreReadOnly,
    ];
    anyhow::ensure!(
        matches!(store.as_ref(), Store::Redis(_))
            || !args.faults.iter().any(|fault| redis_faults.contains(fault)),
        "--faults store-pause and store-read-only need a Redis server this command starts (--store redis)"
    );
    anyhow::ensure!(
        matches!(store.as_ref(), Store::Postgres(..) | Store::MariaDb(..))
            || !args.faults.contains(&IdempotencyFault::StoreRowLock),
        "--faults store-row-lock needs a PostgreSQL or MariaDB server this command starts (--store postgres or --store mariadb)"
    );
    let mut faults = args.faults.clone();
    if !store.can_restart(args.restart_cmd.as_deref())
        && faults.contains(&IdempotencyFault::Restart)
    {
        eprintln!(
            "turnstile verify idempotency: skipping restart: this store cannot be restarted here (give --restart-cmd)"
        );
        faults.retain(|fault| *fault != IdempotencyFault::Restart);
        anyhow::ensure!(
            !faults.is_empty(),
            "--faults restart: this store cannot be restarted here (give --restart-cmd)"
        );
    }

    let mut summary = IdempotencySummary {
        store: turnstile::store::redact(&url),
        mode,
        instances: args.instances,
        clients: args.clients,
        lease_ms: args.lease.as_millis(),
        duration_ms: args.duration.as_millis(),
        faults: faults.clone(),
        explaining: explaining.clone(),
        passed: true,
        runs: Vec::new(),
    };
    for run in 1..=args.runs {
        let run_dir = args.report.join(format!("idempotency-run-{run:03}"));
        if run_dir.exists() {
            std::fs::remove_dir_all(&run_dir)?;
        }
        std::fs::create_dir_all(&run_dir)?;
        // Faults are injected in turn across runs, so short runs together cover every kind.
        let first_fault = (run as usize - 1) % faults.len();
        let (check, chart) = one_run(
            &args,
            &store,
            mode,
            &faults,
            first_fault,
            &explaining,
            run,
            &run_dir,
        )
        .await?;
        let passed = check.verdicts.iter().all(|verdict| verdict.passed);
        eprintln!(
            "run {run}/{}: {} — {} requests, {} effects, {} duplicates ({} explained), {} replays, {} dropped responses, faults {:?}",
            args.runs,
            if passed { "passed" } else { "FAILED" },
            check.requests,
            check.effects,
            check.duplicates,
            check.explained,
            check.replays,
            check.dropped_responses,
            check.faults
        );
        for verdict in check.verdicts.iter().filter(|verdict| !verdict.passed) {
            eprintln!("  {}: {}", verdict.check, verdict.detail);
        }
        summary.passed &= passed;
        summary.runs.push(IdempotencyRun {
            run,
            passed,
            check,
            chart,
        });
    }
    let json = serde_json::to_string_pretty(&summary)?;
    std::fs::write(args.report.join("summary.json"), &json)?;
    std::fs::write(args.report.join("report.html"), html(&summary))?;
    if args.json {
        println!("{json}");
    }
    eprintln!(
        "turnstile verify idempotency: {} ({} runs); report: {}",
        if summary.passed { "passed" } else { "FAILED" },
        summary.runs.len(),
        args.report.join("report.html").display()
    );
    Ok(summary.passed)
}

/// A running service instance.
struct Instance {
    child: Child,
    /// Kept open: the instance's stdout is a pipe.
    _stdout: ChildStdout,
}

/// How an instance is started (again, after a kill).
struct InstanceSpawner {
    exe: PathBuf,
    url: String,
    mode: Mode,
    lease: Duration,
    run_id: String,
    run_dir: PathBuf,
}

impl InstanceSpawner {
    /// Starts instance `index` and waits for its port.
    async fn spawn(&self, index: usize) -> anyhow::Result<(Instance, u16)> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.run_dir.join(format!("instance-{index}.log")))?;
        let mut command = Command::new(&self.exe);
        command
            .arg("verify-idempotency-instance")
            .arg("--store")
            .arg(&self.url)
            .arg("--mode")
            .arg(match self.mode {
                Mode::Transaction => "transaction",
                Mode::Lease => "lease",
            })
            .arg("--lease")
            .arg(format!("{}ms", self.lease.as_millis()))
            .arg("--instance")
            .arg(index.to_string())
            .arg("--run-id")
            .arg(&self.run_id)
            .arg("--effects")
            .arg(self.run_dir.join("effects.sqlite3"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true);
        let mut child = command.spawn()?;
        let stdout = child.stdout.take().context("the instance's stdout")?;
        let mut lines = BufReader::new(stdout);
        let mut line = String::new();
        // A store just restarted can take a while to take connections.
        tokio::time::timeout(Duration::from_secs(60), lines.read_line(&mut line))
            .await
            .with_context(|| format!("instance {index} did not start within 60 s"))??;
        let port: u16 = line.trim().parse().with_context(|| {
            format!(
                "instance {index} did not start; see {}",
                self.run_dir.join(format!("instance-{index}.log")).display()
            )
        })?;
        Ok((
            Instance {
                child,
                _stdout: lines.into_inner(),
            },
            port,
        ))
    }
}

#[allow(clippy::too_many_arguments)]
async fn one_run(
    args: &VerifyIdempotencyArgs,
    store: &Arc<Store>,
    mode: Mode,
    faults: &[IdempotencyFault],
    first_fault: usize,
    explaining: &Explaining,
    run: u32,
    run_dir: &Path,
) -> anyhow::Result<(IdempotencyCheck, EffectChart)> {
    let url = store.url();
    // Keys of this run only: runs against one store never share a key.
    let run_id = format!(
        "v{}r{run}t{}",
        std::process::id(),
        monotonic_ns() % 1_000_000_000_000
    );
    let effects_db = EffectsDb::open(mode, &url, &run_dir.join("effects.sqlite3")).await?;
    let spawner = InstanceSpawner {
        exe: std::env::current_exe()?,
        url: url.clone(),
        mode,
        lease: args.lease,
        run_id: run_id.clone(),
        run_dir: run_dir.to_owned(),
    };
    let mut instances = Vec::new();
    let ports: Ports = Arc::new(Mutex::new(Vec::new()));
    for index in 0..args.instances {
        let (instance, port) = spawner.spawn(index).await?;
        instances.push(instance);
        ports
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(Some(port));
    }

    let started_ns = monotonic_ns();
    let end_ns =
        started_ns.saturating_add(u64::try_from(args.duration.as_nanos()).unwrap_or(u64::MAX));
    let deadline_ns = end_ns.saturating_add(60_000_000_000);
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(4)
        .build()?;
    let next = Arc::new(AtomicU64::new(0));
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..args.clients {
        let (http, ports, next, run_id) =
            (http.clone(), ports.clone(), next.clone(), run_id.clone());
        let drop_share = args.drop_responses;
        clients.spawn(async move {
            let mut done = Vec::new();
            while monotonic_ns() < end_ns {
                let n = next.fetch_add(1, Ordering::Relaxed);
                let mut request = logical_request(&run_id, n);
                send_until_answered(&http, &ports, drop_share, &mut request, deadline_ns).await;
                done.push((n, request));
            }
            done
        });
    }

    let windows = nemesis(
        args,
        store,
        &spawner,
        &mut instances,
        &ports,
        faults,
        first_fault,
        end_ns,
    )
    .await?;

    let mut requests = Vec::new();
    while let Some(done) = clients.join_next().await {
        requests.extend(done?);
    }
    requests.sort_by_key(|(n, _)| *n);
    let requests: Vec<RequestRecord> = requests.into_iter().map(|(_, request)| request).collect();
    for instance in &mut instances {
        if let Some(pid) = instance.child.id() {
            signal(pid, libc::SIGCONT);
        }
        let _ = instance.child.kill().await;
    }
    let effects = effects_db.read(&run_id).await?;
    let mut check = check(&requests, &effects, &windows, explaining);
    // A run in which no fault landed shows nothing about faults.
    check.verdicts.push(Verdict {
        check: "faults injected",
        passed: !windows.is_empty(),
        detail: format!("{} fault episodes", windows.len()),
    });
    let mut lines = String::new();
    for request in &requests {
        lines.push_str(&serde_json::to_string(request)?);
        lines.push('\n');
    }
    std::fs::write(run_dir.join("requests.jsonl"), lines)?;
    std::fs::write(
        run_dir.join("faults.json"),
        serde_json::to_vec_pretty(&windows)?,
    )?;
    std::fs::write(
        run_dir.join("check.json"),
        serde_json::to_vec_pretty(&check)?,
    )?;
    Ok((
        check,
        EffectChart {
            effects,
            faults: windows,
        },
    ))
}

/// How long clients run before the first fault.
const WARM_UP: Duration = Duration::from_millis(1500);

/// The longest a store restart may take before the run gives up.
const RESTART_LIMIT: Duration = Duration::from_secs(120);

/// The quiet period after each fault.
fn quiet(lease: Duration) -> Duration {
    (3 * lease).max(Duration::from_secs(2))
}

/// How long a fault of the store lasts: 0.5 to 1.5 leases, shorter than a lease in some
/// episodes and longer in others.
fn store_fault_length(lease: Duration) -> Duration {
    between(lease / 2, lease * 3 / 2)
}

/// Injects faults in turn until the run's end, with quiet periods between.
#[allow(clippy::too_many_arguments)]
async fn nemesis(
    args: &VerifyIdempotencyArgs,
    store: &Arc<Store>,
    spawner: &InstanceSpawner,
    instances: &mut [Instance],
    ports: &Ports,
    faults: &[IdempotencyFault],
    first_fault: usize,
    end_ns: u64,
) -> anyhow::Result<Vec<FaultWindow>> {
    let quiet = quiet(args.lease);
    let mut windows = Vec::new();
    tokio::time::sleep(WARM_UP).await;
    let mut turn = first_fault;
    // A fault and the quiet after it fit before the end.
    while monotonic_ns() + u64::try_from((3 * args.lease + quiet).as_nanos()).unwrap_or(0) < end_ns
    {
        let fault = faults[turn % faults.len()];
        turn += 1;
        let target = (rand::random::<u64>() % instances.len() as u64) as usize;
        let mut start_ns = monotonic_ns();
        let mut held_rows = None;
        let instance = match fault {
            IdempotencyFault::KillInstance => {
                ports
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())[target] = None;
                let _ = instances[target].child.kill().await;
                tokio::time::sleep(between(
                    Duration::from_millis(200),
                    Duration::from_millis(800),
                ))
                .await;
                let (instance, port) = spawner.spawn(target).await?;
                instances[target] = instance;
                ports
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())[target] = Some(port);
                Some(target)
            }
            IdempotencyFault::Pause => {
                // An instance that has exited has no pid (and pid 0 would be this
                // command's own process group).
                let Some(pid) = instances[target].child.id() else {
                    continue;
                };
                signal(pid, libc::SIGSTOP);
                tokio::time::sleep(between(args.lease * 3 / 2, args.lease * 3)).await;
                signal(pid, libc::SIGCONT);
                Some(target)
            }
            IdempotencyFault::Restart => {
                let (store, command) = (store.clone(), args.restart_cmd.clone());
                let restart =
                    tokio::task::spawn_blocking(move || store.restart(command.as_deref()));
                match tokio::time::timeout(RESTART_LIMIT, restart).await {
                    Ok(done) => done??,
                    Err(_) => anyhow::bail!(
                        "the store did not restart within {}",
                        humantime::format_duration(RESTART_LIMIT)
                    ),
                }
                None
            }
            IdempotencyFault::StorePause | IdempotencyFault::StoreReadOnly => {
                let Store::Redis(server) = store.as_ref() else {
                    anyhow::bail!("{} needs a Redis server this command started", fault.name());
                };
                let lasts = store_fault_length(args.lease);
                if fault == IdempotencyFault::StorePause {
                    server.pause();
                    tokio::time::sleep(lasts).await;
                    server.resume();
                } else {
                    redis_read_only(&server.url(), true).await?;
                    tokio::time::sleep(lasts).await;
                    redis_read_only(&server.url(), false).await?;
                }
                None
            }
            IdempotencyFault::StoreRowLock => {
                let (held, locked_at_ns) =
                    hold_record_rows(store, store_fault_length(args.lease)).await?;
                start_ns = locked_at_ns;
                // Before the first request there is no row to hold: no fault.
                if held.rows == 0 {
                    continue;
                }
                held_rows = Some(held);
                None
            }
        };
        windows.push(FaultWindow {
            fault,
            instance,
            start_ns,
            end_ns: monotonic_ns(),
            held_rows,
        });
        tokio::time::sleep(quiet).await;
    }
    Ok(windows)
}

/// Makes the Redis server at `url` refuse writes (`READONLY`), as a replica does, by
/// making it the replica of an address nobody answers at (port 1 on loopback: no sync
/// ever starts, so its data stays), or a master again.
#[cfg(feature = "redis")]
async fn redis_read_only(url: &str, read_only: bool) -> anyhow::Result<()> {
    let client = redis::Client::open(url)?;
    let mut connection = client.get_multiplexed_async_connection().await?;
    let mut command = redis::cmd("REPLICAOF");
    if read_only {
        command.arg("127.0.0.1").arg(1);
    } else {
        command.arg("NO").arg("ONE");
    }
    let () = command.query_async(&mut connection).await?;
    Ok(())
}

/// Without Redis support there is no Redis store to make read-only.
#[cfg(not(feature = "redis"))]
async fn redis_read_only(_url: &str, _read_only: bool) -> anyhow::Result<()> {
    anyhow::bail!("store-read-only needs a build with Redis support")
}

/// What a `store-row-lock` episode held.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct HeldRows {
    /// Record rows held.
    rows: usize,
    /// Of them, claims in progress when the lock was taken: their renewals and (in the
    /// lease mode) completions had to wait.
    in_progress: usize,
}

/// Locks every record row no one else holds, from a transaction of its own, for
/// `lasts`, then rolls back. It waits (up to 2 s) for a moment when a claim is in
/// progress, so that renewals and completions meet the lock, not only new claims. The
/// table is the store's default one (`turnstile_idempotency`; schema `public` on
/// PostgreSQL), as the instances of a run open it.
async fn hold_record_rows(store: &Store, lasts: Duration) -> anyhow::Result<(HeldRows, u64)> {
    use sqlx::Connection as _;
    match store {
        #[cfg(feature = "postgres")]
        Store::Postgres(server, _) => {
            hold_rows::<sqlx::Postgres>(
                sqlx::PgConnection::connect(&server.url()).await?,
                "SELECT state FROM \"public\".\"turnstile_idempotency\" FOR UPDATE SKIP LOCKED",
                lasts,
            )
            .await
        }
        #[cfg(feature = "mysql")]
        Store::MariaDb(_, url) => {
            hold_rows::<sqlx::MySql>(
                sqlx::MySqlConnection::connect(url).await?,
                "SELECT state FROM turnstile_idempotency FOR UPDATE SKIP LOCKED",
                lasts,
            )
            .await
        }
        _ => anyhow::bail!(
            "store-row-lock needs a PostgreSQL or MariaDB server this command started, in a build with its support"
        ),
    }
}

/// [`hold_record_rows`] on one engine's connection; `select` locks the rows and
/// returns each one's state. Returns what it held and when the lock was taken (the
/// fault's start: the wait before it only took locks for milliseconds).
async fn hold_rows<DB>(
    mut connection: DB::Connection,
    select: &'static str,
    lasts: Duration,
) -> anyhow::Result<(HeldRows, u64)>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'r> String: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    use sqlx::{Connection as _, Row as _};
    let waiting_since = std::time::Instant::now();
    loop {
        let mut transaction = connection.begin().await?;
        let states: Vec<String> = sqlx::query(select)
            .fetch_all(&mut *transaction)
            .await?
            .iter()
            .map(|row| row.try_get(0))
            .collect::<Result<_, _>>()?;
        let held = HeldRows {
            rows: states.len(),
            in_progress: states
                .iter()
                .filter(|state| *state == "in_progress")
                .count(),
        };
        if held.in_progress == 0 && waiting_since.elapsed() < Duration::from_secs(2) {
            transaction.rollback().await?;
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        }
        let locked_at_ns = monotonic_ns();
        tokio::time::sleep(lasts).await;
        transaction.rollback().await?;
        return Ok((held, locked_at_ns));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn effect(n: i64, scope: &str, key: &str, instance: i64, at_ns: i64) -> Effect {
        Effect {
            effect: n,
            scope: scope.into(),
            key: key.into(),
            body: format!("body-{key}"),
            instance,
            at_ns,
        }
    }

    fn answered(scope: &str, key: &str, answer: &Effect) -> RequestRecord {
        RequestRecord {
            scope: scope.into(),
            key: key.into(),
            body: format!("body-{key}"),
            answer: Some(answer.clone()),
            ..RequestRecord::default()
        }
    }

    /// The transaction mode: nothing explains a second effect.
    fn strict() -> Explaining {
        Explaining {
            faults: vec![],
            in_flight_ns: 10_000,
            store_forgets: false,
        }
    }

    fn passed(check: &IdempotencyCheck, name: &str) -> bool {
        check
            .verdicts
            .iter()
            .find(|verdict| verdict.check == name)
            .unwrap()
            .passed
    }

    #[test]
    fn a_second_effect_is_a_violation_unless_a_fault_on_its_instance_explains_it() {
        let first = effect(1, "acme", "k", 0, 1_000);
        let second = effect(2, "acme", "k", 1, 5_000);
        let requests = [answered("acme", "k", &second)];
        let effects = [first.clone(), second.clone()];
        let all = Explaining {
            faults: vec![
                IdempotencyFault::KillInstance,
                IdempotencyFault::Pause,
                IdempotencyFault::Restart,
            ],
            in_flight_ns: 10_000,
            store_forgets: false,
        };
        let none = Explaining {
            faults: vec![],
            ..all.clone()
        };
        // No fault at all.
        let check = check(&requests, &effects, &[], &all);
        assert!(!passed(&check, "one effect per request"));
        assert_eq!((check.duplicates, check.explained), (1, 0));
        // A kill of an instance that had neither effect explains nothing; of the first
        // effect's, it does in the lease mode, and nothing does in the transaction mode.
        let kill = |instance| FaultWindow {
            fault: IdempotencyFault::KillInstance,
            instance: Some(instance),
            start_ns: 2_000,
            end_ns: 3_000,
            held_rows: None,
        };
        assert!(!passed(
            &super::check(&requests, &effects, &[kill(2)], &all),
            "one effect per request"
        ));
        let lease = super::check(&requests, &effects, &[kill(0)], &all);
        assert!(passed(&lease, "one effect per request"));
        assert_eq!(lease.explained, 1);
        assert!(!passed(
            &super::check(&requests, &effects, &[kill(0)], &none),
            "one effect per request"
        ));
        // A fault after the second effect explains nothing.
        let late = FaultWindow {
            start_ns: 6_000,
            end_ns: 7_000,
            ..kill(0)
        };
        assert!(!passed(
            &super::check(&requests, &effects, &[late], &all),
            "one effect per request"
        ));
    }

    #[test]
    fn an_answer_from_another_tenant_or_an_effect_that_did_not_happen_is_a_violation() {
        let theirs = effect(1, "globex", "k", 0, 1_000);
        let ours = effect(2, "acme", "k", 0, 2_000);
        let effects = [theirs.clone(), ours.clone()];
        let right = [
            answered("acme", "k", &ours),
            answered("globex", "k", &theirs),
        ];
        assert!(passed(
            &check(&right, &effects, &[], &strict()),
            "answers are their own"
        ));
        let crossed = [
            answered("acme", "k", &theirs),
            answered("globex", "k", &theirs),
        ];
        assert!(!passed(
            &check(&crossed, &effects, &[], &strict()),
            "answers are their own"
        ));
        let ghost = effect(3, "acme", "k", 0, 3_000);
        let made_up = [
            answered("acme", "k", &ghost),
            answered("globex", "k", &theirs),
        ];
        assert!(!passed(
            &check(&made_up, &effects, &[], &strict()),
            "answers are their own"
        ));
        let mut mismatch = answered("acme", "k", &ours);
        mismatch.answer = None;
        mismatch.key_mismatch = true;
        let refused = [mismatch, answered("globex", "k", &theirs)];
        assert!(!passed(
            &check(&refused, &effects, &[], &strict()),
            "answers are their own"
        ));
    }

    #[test]
    fn an_unanswered_request_fails_the_liveness_check() {
        let ours = effect(1, "acme", "k", 0, 1_000);
        let mut waiting = answered("acme", "k", &ours);
        waiting.answer = None;
        let check = check(&[waiting], &[ours], &[], &strict());
        assert!(!passed(&check, "every request answered"));
        assert!(passed(&check, "one effect per request"));
    }

    #[test]
    fn every_fourth_request_shares_its_key_with_the_one_before_in_another_tenant() {
        for n in (1..400).step_by(4) {
            let (before, now) = (logical_request("r", n - 1), logical_request("r", n));
            assert_eq!(before.key, now.key);
            assert_ne!(before.scope, now.scope);
            assert_ne!(before.body, now.body);
        }
        let all: HashSet<(String, String)> = (0..400)
            .map(|n| {
                let request = logical_request("r", n);
                (request.scope, request.key)
            })
            .collect();
        assert_eq!(all.len(), 400, "no two requests share tenant and key");
        assert_eq!(
            crate::without_turnstile_options("postgres://h/db?turnstile_mode=x&sslmode=off"),
            "postgres://h/db?sslmode=off"
        );
        assert_eq!(
            crate::without_turnstile_options("mysql://h/db?turnstile_prefix=p"),
            "mysql://h/db"
        );
    }

    #[test]
    fn only_a_fault_while_the_first_request_was_in_flight_explains_a_second_effect() {
        let first = effect(1, "acme", "k", 0, 1_000);
        let second = effect(2, "acme", "k", 1, 50_000);
        let requests = [answered("acme", "k", &second)];
        let effects = [first.clone(), second.clone()];
        let lease = Explaining {
            faults: vec![IdempotencyFault::KillInstance, IdempotencyFault::Restart],
            in_flight_ns: 10_000,
            store_forgets: false,
        };
        let window = |fault, instance, start_ns| FaultWindow {
            fault,
            instance,
            start_ns,
            end_ns: start_ns + 1_000,
            held_rows: None,
        };
        let explained = |windows: &[FaultWindow], explaining: &Explaining| {
            passed(
                &check(&requests, &effects, windows, explaining),
                "one effect per request",
            )
        };
        // The first request was done (its response stored) long before the kill.
        assert!(!explained(
            &[window(IdempotencyFault::KillInstance, Some(0), 30_000)],
            &lease
        ));
        // While it was in flight: explained.
        assert!(explained(
            &[window(IdempotencyFault::KillInstance, Some(0), 5_000)],
            &lease
        ));
        // On the later effect's instance (frozen before it stamped its effect): explained.
        assert!(explained(
            &[window(IdempotencyFault::KillInstance, Some(1), 5_000)],
            &lease
        ));
        // A restart of a store that keeps its records explains only an interrupted
        // request; one that forgets them (Redis without persistence), any in between.
        assert!(!explained(
            &[window(IdempotencyFault::Restart, None, 30_000)],
            &lease
        ));
        let forgetful = Explaining {
            store_forgets: true,
            ..lease.clone()
        };
        assert!(explained(
            &[window(IdempotencyFault::Restart, None, 30_000)],
            &forgetful
        ));
    }

    #[test]
    fn a_stored_error_for_a_request_whose_effect_happened_is_a_violation() {
        let ours = effect(1, "acme", "k", 0, 1_000);
        let mut request = answered("acme", "k", &ours);
        request.answer = None;
        request.stored_error = Some(503);
        let with_effect = check(&[request.clone()], &[ours], &[], &strict());
        assert!(!passed(&with_effect, "answers are their own"));
        assert!(passed(&with_effect, "every request answered"));
        let without = check(&[request], &[], &[], &strict());
        assert!(passed(&without, "answers are their own"));
    }

    #[test]
    fn outcome_unknown_and_not_stored_are_final_answers() {
        let ours = effect(1, "acme", "k", 0, 1_000);
        let mut unknown = answered("acme", "k", &ours);
        unknown.answer = None;
        unknown.outcome_unknown = true;
        // Outcome-unknown is honest whether or not the effect happened.
        for effects in [&[ours.clone()][..], &[]] {
            let check = check(&[unknown.clone()], effects, &[], &strict());
            assert!(passed(&check, "every request answered"));
            assert!(passed(&check, "answers are their own"));
            assert_eq!(check.outcome_unknown_answers, 1);
        }
        let mut not_stored = answered("acme", "k", &ours);
        not_stored.answer = None;
        not_stored.not_stored = true;
        let with_effect = check(&[not_stored.clone()], &[ours], &[], &strict());
        assert!(passed(&with_effect, "every request answered"));
        assert!(passed(&with_effect, "answers are their own"));
        // "Processed, response not stored" for a request that never ran is a lie.
        let without = check(&[not_stored], &[], &[], &strict());
        assert!(!passed(&without, "answers are their own"));
    }
}
