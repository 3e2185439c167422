//! An example payments service whose POSTs are safe to retry.
//!
//! ```text
//! cargo run --release -p payments -- --listen 127.0.0.1:8080 [--store URL] [--delay 300ms]
//! ```
//!
//! - `POST /accounts/{account}/payments` with `Idempotency-Key` and
//!   `{"amount_cents": 1000, "currency": "USD", "reference": "invoice 7"}` →
//!   `201 {"payment_id", "account", "amount_cents", "currency", "reference"}`, with
//!   `Idempotent-Replayed: true` on a replay. The tenant is the one
//!   `Authorization: Bearer <token>` names in the token table (`--tokens FILE`, a JSON
//!   object of tokens to tenants): the bearer string itself is no identity. An account
//!   belongs to the tenant that paid into it first, and another tenant gets 403.
//! - `GET /accounts/{account}/payments` → `{"payments": [...]}`;
//!   `GET /accounts/{account}/balance` → `{"account", "balance_cents"}`.
//!
//! On SQL stores (`sqlite://…`, the default, or `postgres://…`) the key's claim, the
//! payment row and the stored response commit in one transaction: a crash leaves
//! neither a charge without a key nor a key without a charge. On Redis the HTTP layer
//! keeps the key with a lease, and the ledger is an SQLite file (`--ledger`): the two
//! commit separately, so the ledger itself refuses a second payment for one (tenant,
//! key) — a unique constraint — and a second run (a lost lease, a Redis failover that
//! lost the record) answers with the first payment instead of charging again.
//!
//! Every replica of a deployment starts at once: the ledger's schema is made under the
//! same PostgreSQL advisory lock as the library's own migrations, so replicas never
//! race on `CREATE TABLE`.
//! `--delay` makes a payment wait before it is written (a slow provider), so tests can
//! kill an instance mid-request. Several instances may serve one store.
//!
//! Every payment also writes a `payments.created` event (ordering key: the account)
//! through the transactional outbox, in the same transaction as the payment row (on
//! Redis, in the ledger's transaction). With `--broker nats://…` or `--broker redis://…`
//! the service runs a relay that publishes them (or run `turnstile outbox relay` next to
//! it); the `payments-projection` binary consumes them into per-account totals through
//! an inbox.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Parser;
use http::{HeaderMap, StatusCode, header};
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, SqlitePool};
use turnstile::idempotency::http::{IdempotencyLayer, error_response, parse_key};
use turnstile::idempotency::postgres::PostgresIdempotencyStore;
use turnstile::idempotency::sqlite::SqliteIdempotencyStore;
use turnstile::idempotency::{
    Fingerprint, Idempotency, IdempotencyOptions, Scope, TransactionalIdempotency,
};
use turnstile::outbox::postgres::PostgresOutbox;
use turnstile::outbox::sqlite::SqliteOutbox;
use turnstile::outbox::{Message, OutboxStore};

/// The payments service.
#[derive(Parser, Debug)]
#[command(name = "payments", about)]
struct Args {
    /// Where to listen.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Where keys (and, on SQL stores, the ledger) live.
    #[arg(long, default_value = "sqlite://payments.sqlite3")]
    store: String,
    /// The ledger's SQLite file when the store is Redis.
    #[arg(long, default_value = "payments-ledger.sqlite3")]
    ledger: String,
    /// How long a payment waits before it is written.
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    delay: Duration,
    /// Relay the `payments.created` events to this broker (nats://HOST:PORT or
    /// redis://HOST:PORT); without it, run `turnstile outbox relay` next to the service.
    #[arg(long, value_name = "URL")]
    broker: Option<String>,
    /// The token table: a JSON object of bearer tokens to tenants, such as
    /// `{"a-long-random-token": "acme"}`.
    #[arg(long, value_name = "FILE")]
    tokens: std::path::PathBuf,
}

/// Where keys and payments live.
enum Backend {
    /// Keys, payments and events in one SQLite file, in one transaction.
    Sqlite(SqliteIdempotencyStore, SqliteOutbox),
    /// Keys, payments and events in one PostgreSQL database, in one transaction.
    Postgres(PostgresIdempotencyStore, PgPool, PostgresOutbox),
    /// Keys in Redis (the HTTP layer, lease mode), payments and events in SQLite.
    Redis(SqlitePool, SqliteOutbox),
}

impl Backend {
    fn outbox(&self) -> Arc<dyn OutboxStore> {
        match self {
            Backend::Sqlite(_, outbox) | Backend::Redis(_, outbox) => Arc::new(outbox.clone()),
            Backend::Postgres(_, _, outbox) => Arc::new(outbox.clone()),
        }
    }
}

/// The event every payment writes.
fn created_event(payment: &Payment) -> Result<Message, turnstile::Error> {
    Message::json("payments.created", payment.account.as_str(), payment)
}

struct App {
    backend: Backend,
    delay: Duration,
    options: IdempotencyOptions,
    tokens: Tokens,
}

/// Tenants by the SHA-256 of their bearer token: a lookup by digest, so the time it
/// takes says nothing about the tokens.
#[derive(Clone)]
struct Tokens(Arc<std::collections::HashMap<Fingerprint, String>>);

impl Tokens {
    fn load(path: &std::path::Path) -> Result<Tokens, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|error| format!("cannot read the token table {}: {error}", path.display()))?;
        let table: std::collections::BTreeMap<String, String> = serde_json::from_str(&text)
            .map_err(|error| {
                format!(
                    "the token table {} is not a JSON object of tokens to tenants: {error}",
                    path.display()
                )
            })?;
        let mut tenants = std::collections::HashMap::new();
        for (token, tenant) in table {
            if token.len() < 16 {
                return Err(format!(
                    "a token of tenant {tenant:?} is shorter than 16 characters"
                ));
            }
            Scope::new(tenant.as_str()).map_err(|error| error.to_string())?;
            tenants.insert(Fingerprint::of(&[token.as_bytes()]), tenant);
        }
        Ok(Tokens(Arc::new(tenants)))
    }

    fn tenant_of(&self, headers: &HeaderMap) -> Option<String> {
        let token = headers
            .get(header::AUTHORIZATION)?
            .to_str()
            .ok()?
            .strip_prefix("Bearer ")?
            .trim();
        self.0.get(&Fingerprint::of(&[token.as_bytes()])).cloned()
    }
}

#[derive(Deserialize)]
struct PaymentRequest {
    amount_cents: i64,
    currency: String,
    reference: String,
}

#[derive(Serialize, Deserialize)]
struct Payment {
    payment_id: String,
    account: String,
    amount_cents: i64,
    currency: String,
    reference: String,
}

/// What a handler can answer besides success.
enum Refusal {
    Unauthorized,
    Forbidden,
    Invalid(String),
    Turnstile(turnstile::Error),
    Database(sqlx::Error),
}

impl From<turnstile::Error> for Refusal {
    fn from(error: turnstile::Error) -> Self {
        Refusal::Turnstile(error)
    }
}

impl From<sqlx::Error> for Refusal {
    fn from(error: sqlx::Error) -> Self {
        Refusal::Database(error)
    }
}

fn problem(status: StatusCode, title: &str, detail: &str) -> Response {
    let body = serde_json::json!({ "type": "about:blank", "title": title, "status": status.as_u16(), "detail": detail });
    let mut response = (status, body.to_string()).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/problem+json"),
    );
    response
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        match self {
            Refusal::Unauthorized => problem(
                StatusCode::UNAUTHORIZED,
                "No tenant",
                "send Authorization: Bearer <token>, a token of the service's token table",
            ),
            Refusal::Forbidden => problem(
                StatusCode::FORBIDDEN,
                "Not your account",
                "this account belongs to another tenant",
            ),
            Refusal::Invalid(detail) => {
                problem(StatusCode::BAD_REQUEST, "Invalid payment", &detail)
            }
            Refusal::Turnstile(error) => error_response(&error),
            Refusal::Database(error) => problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "The ledger is unavailable",
                &error.to_string(),
            ),
        }
    }
}

fn check_request(body: &[u8]) -> Result<PaymentRequest, Refusal> {
    let request: PaymentRequest = serde_json::from_slice(body)
        .map_err(|error| Refusal::Invalid(format!("the body is not a payment: {error}")))?;
    if request.amount_cents <= 0 || request.amount_cents > 100_000_000 {
        return Err(Refusal::Invalid(
            "amount_cents must be 1 to 100000000".to_owned(),
        ));
    }
    if request.currency.len() != 3 || !request.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(Refusal::Invalid(
            "currency must be three capital letters, like USD".to_owned(),
        ));
    }
    if request.reference.chars().count() > 200 {
        return Err(Refusal::Invalid(
            "reference must be at most 200 characters".to_owned(),
        ));
    }
    Ok(request)
}

fn new_payment_id() -> String {
    format!("pay_{:016x}", rand_u64())
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}

// The ledger's statements, per database (placeholders differ).
// One payment per (tenant, idempotency key), whatever runs the handler twice.
const SQLITE_SCHEMA: &str =
    "CREATE TABLE IF NOT EXISTS accounts (account TEXT PRIMARY KEY, tenant TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS payments (payment_id TEXT PRIMARY KEY, account TEXT NOT NULL,
  amount_cents INTEGER NOT NULL, currency TEXT NOT NULL, reference TEXT NOT NULL,
  tenant TEXT NOT NULL, idempotency_key TEXT NOT NULL,
  created_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP,
  UNIQUE (tenant, idempotency_key))";
const POSTGRES_SCHEMA: &str =
    "CREATE TABLE IF NOT EXISTS accounts (account TEXT PRIMARY KEY, tenant TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS payments (payment_id TEXT PRIMARY KEY, account TEXT NOT NULL,
  amount_cents BIGINT NOT NULL, currency TEXT NOT NULL, reference TEXT NOT NULL,
  tenant TEXT NOT NULL, idempotency_key TEXT NOT NULL,
  created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  UNIQUE (tenant, idempotency_key))";

/// Claims the account for `tenant` if nobody has it; `true` if it is the tenant's.
async fn owns_sqlite(
    connection: &mut sqlx::SqliteConnection,
    account: &str,
    tenant: &str,
) -> Result<bool, sqlx::Error> {
    sqlx::query(
        "INSERT INTO accounts (account, tenant) VALUES (?1, ?2) ON CONFLICT (account) DO NOTHING",
    )
    .bind(account)
    .bind(tenant)
    .execute(&mut *connection)
    .await?;
    let owner: String = sqlx::query_scalar("SELECT tenant FROM accounts WHERE account = ?1")
        .bind(account)
        .fetch_one(&mut *connection)
        .await?;
    Ok(owner == tenant)
}

/// Writes `payment` for (`tenant`, `key`), or finds the one written before for them:
/// `None` when the payment is new, the earlier one when this is a second run.
async fn insert_sqlite(
    connection: &mut sqlx::SqliteConnection,
    payment: &Payment,
    tenant: &str,
    key: &str,
) -> Result<Option<Payment>, sqlx::Error> {
    let inserted = sqlx::query("INSERT INTO payments (payment_id, account, amount_cents, currency, reference, tenant, idempotency_key) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) ON CONFLICT (tenant, idempotency_key) DO NOTHING")
        .bind(&payment.payment_id)
        .bind(&payment.account)
        .bind(payment.amount_cents)
        .bind(&payment.currency)
        .bind(&payment.reference)
        .bind(tenant)
        .bind(key)
        .execute(&mut *connection)
        .await?
        .rows_affected();
    if inserted == 1 {
        return Ok(None);
    }
    let (payment_id, account, amount_cents, currency, reference) = sqlx::query_as(
        "SELECT payment_id, account, amount_cents, currency, reference FROM payments
         WHERE tenant = ?1 AND idempotency_key = ?2",
    )
    .bind(tenant)
    .bind(key)
    .fetch_one(&mut *connection)
    .await?;
    Ok(Some(Payment {
        payment_id,
        account,
        amount_cents,
        currency,
        reference,
    }))
}

async fn owns_postgres(
    connection: &mut sqlx::PgConnection,
    account: &str,
    tenant: &str,
) -> Result<bool, sqlx::Error> {
    sqlx::query(
        "INSERT INTO accounts (account, tenant) VALUES ($1, $2) ON CONFLICT (account) DO NOTHING",
    )
    .bind(account)
    .bind(tenant)
    .execute(&mut *connection)
    .await?;
    let owner: String = sqlx::query_scalar("SELECT tenant FROM accounts WHERE account = $1")
        .bind(account)
        .fetch_one(&mut *connection)
        .await?;
    Ok(owner == tenant)
}

async fn create_payment(
    State(app): State<Arc<App>>,
    Path(account): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, Refusal> {
    let tenant = app
        .tokens
        .tenant_of(&headers)
        .ok_or(Refusal::Unauthorized)?;
    let key = match headers.get("idempotency-key").map(parse_key) {
        Some(Ok(key)) => key,
        Some(Err(detail)) => return Err(Refusal::Invalid(detail)),
        None => {
            return Err(Refusal::Invalid(
                "send an Idempotency-Key header".to_owned(),
            ));
        }
    };
    let request = check_request(&body)?;
    let scope = Scope::new(format!("{tenant} POST /accounts/{{account}}/payments"))?;
    let fingerprint = Fingerprint::of(&[account.as_bytes(), &body]);
    let make = |account: &str| Payment {
        payment_id: new_payment_id(),
        account: account.to_owned(),
        amount_cents: request.amount_cents,
        currency: request.currency.clone(),
        reference: request.reference.clone(),
    };
    // Whether the handler's work ran in this request (false: a replay).
    let mut ran = false;
    let payment: Payment = match &app.backend {
        Backend::Sqlite(store, outbox) => {
            let mut transaction = store.pool().begin_with("BEGIN IMMEDIATE").await?;
            let payment = store
                .run_once_in_transaction(
                    &mut transaction,
                    &scope,
                    &key,
                    &fingerprint,
                    &app.options,
                    async |connection: &mut sqlx::SqliteConnection, _token| {
                        ran = true;
                        if !owns_sqlite(connection, &account, &tenant).await? {
                            return Err(Refusal::Forbidden);
                        }
                        tokio::time::sleep(app.delay).await;
                        let payment = make(&account);
                        // The key's claim is in this transaction: the ledger's own
                        // constraint is a second line, never met here.
                        if let Some(earlier) =
                            insert_sqlite(connection, &payment, &tenant, key.as_str()).await?
                        {
                            return Ok(earlier);
                        }
                        outbox
                            .enqueue(connection, &created_event(&payment)?)
                            .await?;
                        Ok(payment)
                    },
                )
                .await?;
            outbox.commit(transaction).await?;
            payment
        }
        Backend::Postgres(store, pool, outbox) => {
            let mut transaction = pool.begin().await?;
            let payment = store
                .run_once_in_transaction(&mut transaction, &scope, &key, &fingerprint, &app.options, async |connection: &mut sqlx::PgConnection, _token| {
                    ran = true;
                    if !owns_postgres(connection, &account, &tenant).await? {
                        return Err(Refusal::Forbidden);
                    }
                    tokio::time::sleep(app.delay).await;
                    let payment = make(&account);
                    sqlx::query("INSERT INTO payments (payment_id, account, amount_cents, currency, reference, tenant, idempotency_key) VALUES ($1, $2, $3, $4, $5, $6, $7)")
                        .bind(&payment.payment_id)
                        .bind(&payment.account)
                        .bind(payment.amount_cents)
                        .bind(&payment.currency)
                        .bind(&payment.reference)
                        .bind(&tenant)
                        .bind(key.as_str())
                        .execute(&mut *connection)
                        .await?;
                    outbox.enqueue(connection, &created_event(&payment)?).await?;
                    Ok(payment)
                })
                .await?;
            outbox.commit(transaction).await?;
            payment
        }
        Backend::Redis(ledger, outbox) => {
            // The layer in front has claimed the key in Redis, which commits apart from
            // this ledger: a lost lease or a failover that lost the record runs this
            // again, and the ledger's (tenant, key) constraint turns that into the
            // first payment, not a second charge. (The layer marks replays itself.)
            let mut transaction = ledger.begin_with("BEGIN IMMEDIATE").await?;
            if !owns_sqlite(&mut transaction, &account, &tenant).await? {
                return Err(Refusal::Forbidden);
            }
            tokio::time::sleep(app.delay).await;
            let payment = make(&account);
            let payment =
                match insert_sqlite(&mut transaction, &payment, &tenant, key.as_str()).await? {
                    Some(earlier) => earlier,
                    None => {
                        outbox
                            .enqueue(&mut transaction, &created_event(&payment)?)
                            .await?;
                        payment
                    }
                };
            outbox.commit(transaction).await?;
            return Ok((StatusCode::CREATED, Json(payment)).into_response());
        }
    };
    let replayed = if ran { "false" } else { "true" };
    Ok((
        StatusCode::CREATED,
        [("idempotent-replayed", replayed)],
        Json(payment),
    )
        .into_response())
}

async fn list_payments(
    State(app): State<Arc<App>>,
    Path(account): Path<String>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    let tenant = app
        .tokens
        .tenant_of(&headers)
        .ok_or(Refusal::Unauthorized)?;
    let rows: Vec<(String, String, i64, String, String)> = match &app.backend {
        Backend::Sqlite(store, _) => ledger_rows_sqlite(store.pool(), &account, &tenant).await?,
        Backend::Redis(ledger, _) => ledger_rows_sqlite(ledger, &account, &tenant).await?,
        Backend::Postgres(_, pool, _) => {
            let owner: Option<String> =
                sqlx::query_scalar("SELECT tenant FROM accounts WHERE account = $1")
                    .bind(&account)
                    .fetch_optional(pool)
                    .await?;
            if owner.is_some_and(|owner| owner != tenant) {
                return Err(Refusal::Forbidden);
            }
            sqlx::query_as("SELECT payment_id, account, amount_cents, currency, reference FROM payments WHERE account = $1 ORDER BY created_at, payment_id")
                .bind(&account)
                .fetch_all(pool)
                .await?
        }
    };
    let payments: Vec<Payment> = rows
        .into_iter()
        .map(
            |(payment_id, account, amount_cents, currency, reference)| Payment {
                payment_id,
                account,
                amount_cents,
                currency,
                reference,
            },
        )
        .collect();
    Ok(Json(serde_json::json!({ "payments": payments })).into_response())
}

async fn ledger_rows_sqlite(
    pool: &SqlitePool,
    account: &str,
    tenant: &str,
) -> Result<Vec<(String, String, i64, String, String)>, Refusal> {
    let owner: Option<String> =
        sqlx::query_scalar("SELECT tenant FROM accounts WHERE account = ?1")
            .bind(account)
            .fetch_optional(pool)
            .await?;
    if owner.is_some_and(|owner| owner != tenant) {
        return Err(Refusal::Forbidden);
    }
    Ok(sqlx::query_as("SELECT payment_id, account, amount_cents, currency, reference FROM payments WHERE account = ?1 ORDER BY created_at, payment_id")
        .bind(account)
        .fetch_all(pool)
        .await?)
}

async fn balance(
    state: State<Arc<App>>,
    Path(account): Path<String>,
    headers: HeaderMap,
) -> Result<Response, Refusal> {
    let listed = list_payments(state, Path(account.clone()), headers).await?;
    let body = axum::body::to_bytes(listed.into_body(), usize::MAX)
        .await
        .map_err(|error| Refusal::Invalid(error.to_string()))?;
    let value: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let total: i64 = value["payments"]
        .as_array()
        .map(|payments| {
            payments
                .iter()
                .filter_map(|p| p["amount_cents"].as_i64())
                .sum()
        })
        .unwrap_or(0);
    Ok(Json(serde_json::json!({ "account": account, "balance_cents": total })).into_response())
}

async fn open(args: &Args) -> Result<(Backend, Option<Idempotency>), String> {
    let store = args.store.as_str();
    let scheme = store.split(':').next().unwrap_or("").to_ascii_lowercase();
    let error = |error: &dyn std::fmt::Display| format!("{error}");
    match scheme.as_str() {
        "sqlite" => {
            let keys = SqliteIdempotencyStore::open_url(store)
                .await
                .map_err(|e| error(&e))?;
            sqlx::raw_sql(SQLITE_SCHEMA)
                .execute(keys.pool())
                .await
                .map_err(|e| error(&e))?;
            let outbox = SqliteOutbox::open_url(store).await.map_err(|e| error(&e))?;
            Ok((Backend::Sqlite(keys, outbox), None))
        }
        "postgres" | "postgresql" => {
            let keys = PostgresIdempotencyStore::connect(store)
                .await
                .map_err(|e| error(&e))?;
            let pool = PgPool::connect(store.split('?').next().unwrap_or(store))
                .await
                .map_err(|e| error(&e))?;
            // Replicas start at once: `CREATE TABLE IF NOT EXISTS` run by two at the same
            // moment fails in one of them, so the schema is made under the advisory
            // lock the library's own migrations take, in one transaction.
            let mut transaction = pool.begin().await.map_err(|e| error(&e))?;
            sqlx::query("SELECT pg_advisory_xact_lock(hashtext('turnstile:migrate'))")
                .execute(&mut *transaction)
                .await
                .map_err(|e| error(&e))?;
            sqlx::raw_sql(POSTGRES_SCHEMA)
                .execute(&mut *transaction)
                .await
                .map_err(|e| error(&e))?;
            transaction.commit().await.map_err(|e| error(&e))?;
            let outbox = PostgresOutbox::connect(store)
                .await
                .map_err(|e| error(&e))?;
            Ok((Backend::Postgres(keys, pool, outbox), None))
        }
        "redis" | "rediss" => {
            let keys = Idempotency::connect(store).await.map_err(|e| error(&e))?;
            let ledger = sqlx::sqlite::SqlitePoolOptions::new()
                .connect_with(
                    sqlx::sqlite::SqliteConnectOptions::new()
                        .filename(&args.ledger)
                        .create_if_missing(true)
                        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                        .busy_timeout(Duration::from_secs(5)),
                )
                .await
                .map_err(|e| error(&e))?;
            sqlx::raw_sql(SQLITE_SCHEMA)
                .execute(&ledger)
                .await
                .map_err(|e| error(&e))?;
            let outbox = SqliteOutbox::open(&args.ledger)
                .await
                .map_err(|e| error(&e))?;
            Ok((Backend::Redis(ledger, outbox), Some(keys)))
        }
        _ => Err(format!(
            "{store:?}: use a sqlite://, postgres:// or redis:// URL"
        )),
    }
}

fn router(app: Arc<App>, lease_keys: Option<Idempotency>) -> Router {
    let mut payments = post(create_payment);
    if let Some(keys) = lease_keys {
        // On Redis the layer keeps the key; the handler only writes the ledger.
        let tokens = app.tokens.clone();
        let layer = IdempotencyLayer::new(keys, move |parts: &http::request::Parts| {
            tokens
                .tenant_of(&parts.headers)
                .and_then(|tenant| Scope::new(tenant).ok())
        })
        .require_key(true);
        payments = payments.route_layer(layer);
    }
    Router::new()
        .route("/accounts/{account}/payments", payments.get(list_payments))
        .route("/accounts/{account}/balance", get(balance))
        .with_state(app)
}

/// Runs a relay in this process (it stops with the process; the round in flight is
/// published again by the next relay, and consumers' inboxes drop the copies).
async fn start_relay(outbox: Arc<dyn OutboxStore>, broker: &str) -> turnstile::Result<()> {
    if broker.starts_with("nats://") {
        ensure_nats_stream(broker).await?;
    }
    let publisher = turnstile::store::connect_publisher(broker).await?;
    let relay = turnstile::outbox::relay::Relay::from_arcs(outbox, publisher);
    tokio::spawn(async move {
        if let Err(error) = relay.run(tokio_util::sync::CancellationToken::new()).await {
            eprintln!("payments: the relay stopped: {error}");
        }
    });
    Ok(())
}

/// The stream the events go to on NATS: `PAYMENTS`, subjects `payments.>`.
async fn ensure_nats_stream(broker: &str) -> turnstile::Result<()> {
    let publisher =
        turnstile::outbox::nats::JetStreamPublisher::connect(broker, Duration::from_secs(5))
            .await?;
    publisher
        .jetstream()
        .get_or_create_stream(async_nats::jetstream::stream::Config {
            name: "PAYMENTS".to_owned(),
            subjects: vec!["payments.>".to_owned()],
            duplicate_window: Duration::from_secs(300),
            ..Default::default()
        })
        .await
        .map(|_| ())
        .map_err(|error| {
            turnstile::Error::new(
                turnstile::ErrorKind::StoreUnavailable,
                format!("cannot create the PAYMENTS stream: {error}"),
            )
        })
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let tokens = match Tokens::load(&args.tokens) {
        Ok(tokens) => tokens,
        Err(error) => {
            eprintln!("payments: {error}");
            return std::process::ExitCode::from(64);
        }
    };
    let (backend, lease_keys) = match open(&args).await {
        Ok(opened) => opened,
        Err(error) => {
            eprintln!("payments: cannot open the store: {error}");
            return std::process::ExitCode::from(69);
        }
    };
    if let Some(broker) = &args.broker {
        match start_relay(backend.outbox(), broker).await {
            Ok(()) => eprintln!("payments: relaying events to {broker}"),
            Err(error) => {
                eprintln!("payments: cannot relay events to {broker}: {error}");
                return std::process::ExitCode::from(69);
            }
        }
    }
    let app = Arc::new(App {
        backend,
        delay: args.delay,
        options: IdempotencyOptions::new(),
        tokens,
    });
    let listener = match tokio::net::TcpListener::bind(args.listen).await {
        Ok(listener) => listener,
        Err(error) => {
            eprintln!("payments: cannot listen on {}: {error}", args.listen);
            return std::process::ExitCode::from(69);
        }
    };
    eprintln!("payments: listening on {}", args.listen);
    if let Err(error) = axum::serve(listener, router(app, lease_keys)).await {
        eprintln!("payments: {error}");
        return std::process::ExitCode::from(70);
    }
    std::process::ExitCode::SUCCESS
}
