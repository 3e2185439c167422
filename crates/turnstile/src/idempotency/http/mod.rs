//! Idempotency keys over HTTP: a tower layer for axum (feature `axum`).
//!
//! ```no_run
//! # async fn demo() -> turnstile::Result<()> {
//! use axum::{Router, routing::post};
//! use turnstile::idempotency::http::IdempotencyLayer;
//! use turnstile::idempotency::{Idempotency, Scope};
//!
//! let keys = Idempotency::connect("sqlite://keys.db").await?;
//! // Whose keys these are: here the tenant named by a header; a real service takes it
//! // from its authentication. A request without one gets 401.
//! let layer = IdempotencyLayer::new(keys, |parts: &http::request::Parts| {
//!     parts
//!         .headers
//!         .get("x-tenant")
//!         .and_then(|value| value.to_str().ok())
//!         .and_then(|tenant| Scope::new(tenant).ok())
//! })
//! .require_key(true);
//! let app: Router = Router::new()
//!     .route("/payments", post(|| async { "charged" }))
//!     .route_layer(layer);
//! # let _ = app;
//! # Ok(())
//! # }
//! ```
//!
//! # What it does
//! - Reads `Idempotency-Key` as the IETF draft's structured-field string (`"…"`), or,
//!   for Stripe-style clients, a bare token. A request without one passes through
//!   unless [`require_key`](IdempotencyLayer::require_key) is set (then 400).
//! - The record lives in the scope the service's closure returns (a tenant, a
//!   principal, [`Scope::global`]), combined with the method and the route template
//!   (axum's `MatchedPath`): the same key on another route is another key.
//! - The fingerprint covers method, route, the query (pairs sorted), chosen headers
//!   (`Content-Type` by default, each with its name) and the body, framed and hashed;
//!   the same key with another fingerprint is a 422. More than one `Idempotency-Key`
//!   header is a 400.
//! - The first request runs the handler under a claim whose lease a watchdog renews; a
//!   duplicate in flight gets 409 with `Retry-After` (the time the first one's lease
//!   has left, when the store says), or, with
//!   [`IdempotencyOptions::wait`](super::IdempotencyOptions::wait), waits and gets the
//!   replay. A store that cannot be reached answers 503 with `Retry-After`, and the
//!   handler does not run.
//! - Stored, by default: every response but 408, 409, 425 and 429 (those give the key
//!   back so that a retry runs again). In the lease mode that includes 5xx: the
//!   handler may have had effects (a charged card) before it failed, and a retry must
//!   not repeat them. In the same-transaction mode a 5xx rolls the handler's writes
//!   back and gives the key back. [`IdempotencyLayer::store_status`] sets another
//!   policy.
//! - A first attempt that ran but did not end as a whole response — the handler
//!   panicked, its response body broke off half way (the client's response breaks off
//!   too), its claim was lost while it ran (it was dropped mid-way), or, with the
//!   default policy, a timeout layer inside this one answered 408
//!   after dropping the handler mid-way — has effects nobody can tell. In the lease
//!   mode the key records that: a retry gets 422 `types::OUTCOME_UNKNOWN` and the
//!   handler never runs twice (a panicking first attempt itself gets 500 of that
//!   type). In the same-transaction mode the rollback undid the writes and the key
//!   goes back. A response that ends with trailers is passed on whole but not stored
//!   (a failure can be signalled in trailers): a retry gets 422
//!   `types::NOT_REPLAYABLE`. A request body that breaks off is a 400
//!   (`types::REQUEST_BODY_UNREADABLE`) and claims nothing. Replays carry
//!   the stored status, an allow-list of headers (`Content-Type`, `Location`,
//!   `Content-Location`, `ETag`, `Last-Modified`, `Link`) and the body, plus
//!   `Idempotent-Replayed: true` (first answers carry `false`).
//! - Nothing is buffered without bound: a request body over
//!   [`max_request_body`](IdempotencyLayer::max_request_body) (1 MiB) is refused with
//!   413; a response over [`max_response_body`](IdempotencyLayer::max_response_body)
//!   (1 MiB) is passed on but not stored, and the record says so (a repeat gets 422).
//!
//! - With [`in_transactions`](IdempotencyLayer::in_transactions), a handler that takes
//!   an `IdempotentTransaction` commits its writes and the stored response together.
//!
//! Errors are `application/problem+json` with the stable `type` values in [`types`].

mod problem;
mod replay;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
mod transaction;

use std::convert::Infallible;
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::MatchedPath;
use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use http::request::Parts;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode, header};
use http_body_util::BodyExt;
use tower::{Layer, Service};

use problem::problem;
pub use problem::types;
use replay::StoredOutcome;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub use transaction::{IdempotentTransaction, TransactionRejection};

use super::{Begun, Fingerprint, Idempotency, IdempotencyKey, Scope};
use crate::error::{Error, ErrorKind};
use crate::future::BoxFuture;

/// The largest response body the layer stores for replay (8 MiB): with its status and
/// headers it fits every store's outcome limit
/// ([`MAX_OUTCOME_LEN`](super::MAX_OUTCOME_LEN)) and MariaDB's default
/// `max_allowed_packet` (16 MiB).
pub const MAX_STORED_RESPONSE_BODY: usize = 8 * 1024 * 1024;

/// The request header carrying the key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The response header saying whether the answer is a replay.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

type ScopeFn = dyn Fn(&Parts) -> Option<Scope> + Send + Sync;

/// The layer's settings, shared by every service it wraps.
struct Config {
    engine: Idempotency,
    scope: Box<ScopeFn>,
    require_key: bool,
    max_request_body: usize,
    max_response_body: usize,
    replay_headers: Vec<HeaderName>,
    fingerprint_headers: Vec<HeaderName>,
    /// Which responses are stored; `None` is the default policy of the mode the
    /// request ran in.
    store_status: Option<fn(StatusCode) -> bool>,
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    transactions: Option<Box<dyn transaction::TransactionSource>>,
}

/// Makes POST (and any other) routes safe to retry with an `Idempotency-Key`.
#[derive(Clone)]
pub struct IdempotencyLayer {
    config: Arc<Config>,
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("engine", &self.config.engine)
            .field("require_key", &self.config.require_key)
            .finish()
    }
}

/// Whether a response is stored and replayed by default in the lease mode: every
/// status but 408, 409, 425 and 429 (answers that ask the client to come back), **5xx
/// included**. (A 408 is not replayed, but with this default policy the layer records
/// the key's outcome as unknown rather than give it back: a 408 from inside the layer
/// is a timeout that dropped the handler mid-way.) A handler that charged a card through a provider and then failed its
/// own write answers 500 after an effect that nothing undoes; giving the key back
/// would let the retry charge again (Stripe stores 5xx for the same reason).
pub fn stored_by_default(status: StatusCode) -> bool {
    let code = status.as_u16();
    (200..600).contains(&code) && !matches!(code, 408 | 409 | 425 | 429)
}

/// Whether a response is stored and replayed by default in the same-transaction mode
/// ([`IdempotencyLayer::in_transactions`]): 2xx, 3xx and the 4xx that a retry would
/// only repeat; not 408, 409, 425 or 429, and no 5xx, because there the rollback has
/// undone the handler's writes, so the retry may safely run again.
pub fn stored_in_transactions_by_default(status: StatusCode) -> bool {
    let code = status.as_u16();
    (200..500).contains(&code) && !matches!(code, 408 | 409 | 425 | 429)
}

impl IdempotencyLayer {
    /// A layer over `engine`; `scope` says whose keys a request's are (its tenant or
    /// principal, [`Scope::global`] where keys belong to no one). A request it finds no
    /// scope for gets 401 (`types::SCOPE_MISSING`) and does not run.
    pub fn new(
        engine: Idempotency,
        scope: impl Fn(&Parts) -> Option<Scope> + Send + Sync + 'static,
    ) -> Self {
        IdempotencyLayer {
            config: Arc::new(Config {
                engine,
                scope: Box::new(scope),
                require_key: false,
                max_request_body: 1024 * 1024,
                max_response_body: 1024 * 1024,
                replay_headers: vec![
                    header::CONTENT_TYPE,
                    header::LOCATION,
                    header::CONTENT_LOCATION,
                    header::ETAG,
                    header::LAST_MODIFIED,
                    header::LINK,
                ],
                fingerprint_headers: vec![header::CONTENT_TYPE],
                store_status: None,
                #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
                transactions: None,
            }),
        }
    }

    fn config_mut(&mut self) -> &mut Config {
        Arc::get_mut(&mut self.config).expect("the layer is configured before it is cloned")
    }

    /// Refuse (400) requests without a key instead of passing them through.
    pub fn require_key(mut self, on: bool) -> Self {
        self.config_mut().require_key = on;
        self
    }

    /// The largest request body read to fingerprint it (413 above).
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.config_mut().max_request_body = bytes;
        self
    }

    /// The largest response body stored for replay (larger ones are passed on, not
    /// stored), at most [`MAX_STORED_RESPONSE_BODY`] so that a stored response fits
    /// every store.
    pub fn max_response_body(mut self, bytes: usize) -> Self {
        self.config_mut().max_response_body = bytes.min(MAX_STORED_RESPONSE_BODY);
        self
    }

    /// The response headers kept for replay (default: `Content-Type`, `Location`,
    /// `Content-Location`, `ETag`, `Last-Modified`, `Link`).
    pub fn replay_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config_mut().replay_headers = headers.into_iter().collect();
        self
    }

    /// Request headers that are part of the fingerprint (`Content-Type` by default:
    /// the same bytes as JSON and as a form are different requests). Each is hashed
    /// with its name and its number of values.
    pub fn fingerprint_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config_mut().fingerprint_headers = headers.into_iter().collect();
        self
    }

    /// The same-transaction mode, for handlers that take an [`IdempotentTransaction`]:
    /// such a handler's writes on `pool` and the stored response commit together, after
    /// the handler answered with a response that is stored (any other answer rolls the
    /// writes back and gives the key back). `store` must be the engine's store (it keeps
    /// the records in the database `pool` reaches); handlers that do not take the
    /// transaction keep the lease mode.
    ///
    /// The key is claimed with a lease first, as in the lease mode: a duplicate gets 409
    /// or waits for a completion notice, and never holds a connection or a row lock
    /// while it waits. A crash rolls the transaction back — writes and response
    /// together — and the key is claimable again when its lease ends.
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    pub fn in_transactions<DB, S>(mut self, store: S, pool: sqlx::Pool<DB>) -> crate::Result<Self>
    where
        DB: sqlx::Database,
        S: super::TransactionalIdempotency<Connection = DB::Connection>
            + super::IdempotencyStore
            + Clone,
    {
        let engine_store = self.config.engine.store().describe();
        if store.describe() != engine_store {
            return Err(Error::new(
                ErrorKind::InvalidOptions,
                format!(
                    "the layer's transactions must use its engine's store ({engine_store}), not {}",
                    store.describe()
                ),
            ));
        }
        self.config_mut().transactions = Some(Box::new(transaction::Source { pool, store }));
        Ok(self)
    }

    /// Which responses are stored and replayed; the others give the key back so that a
    /// retry runs the handler again. Unless set: [`stored_by_default`] in the lease
    /// mode (5xx stored: the handler's effects may stand) and
    /// [`stored_in_transactions_by_default`] for a handler whose writes ran in the
    /// layer's transaction (5xx given back: the rollback undid them).
    pub fn store_status(mut self, stored: fn(StatusCode) -> bool) -> Self {
        self.config_mut().store_status = Some(stored);
        self
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotent<S>;

    fn layer(&self, inner: S) -> Idempotent<S> {
        Idempotent {
            inner,
            config: Arc::clone(&self.config),
        }
    }
}

/// The service [`IdempotencyLayer`] wraps around a handler.
#[derive(Clone)]
pub struct Idempotent<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> fmt::Debug for Idempotent<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Idempotent")
    }
}

impl<S> Service<Request<Body>> for Idempotent<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // The ready service answers this request; a fresh clone takes its place.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let config = Arc::clone(&self.config);
        Box::pin(async move { Ok(handle(config, inner, request).await) })
    }
}

/// Reads an `Idempotency-Key` header value: a structured-field string (`"…"`, with
/// `\"` and `\\` escapes) or a bare token; the error says what is wrong with it. For
/// handlers that use the engine directly (the same-transaction mode).
pub fn parse_key(value: &HeaderValue) -> Result<IdempotencyKey, String> {
    let text = value
        .to_str()
        .map_err(|_| "the Idempotency-Key header is not visible ASCII".to_owned())?
        .trim();
    let key = match text.strip_prefix('"') {
        Some(quoted) => {
            let inner = quoted
                .strip_suffix('"')
                .ok_or("a quoted Idempotency-Key must end with a quote")?;
            let mut key = String::with_capacity(inner.len());
            let mut chars = inner.chars();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => match chars.next() {
                        Some(escaped @ ('"' | '\\')) => key.push(escaped),
                        _ => {
                            return Err(
                                "a quoted Idempotency-Key may escape only \\\" and \\\\".to_owned()
                            );
                        }
                    },
                    '"' => {
                        return Err(
                            "a quoted Idempotency-Key has an unescaped quote inside".to_owned()
                        );
                    }
                    other => key.push(other),
                }
            }
            key
        }
        None if text.contains([' ', '"', ',', ';', '\\']) => {
            return Err("a bare Idempotency-Key is one token; quote it (\"…\") to use spaces or punctuation".to_owned());
        }
        None => text.to_owned(),
    };
    IdempotencyKey::new(key).map_err(|error| error.to_string())
}

/// The record's scope: the service's scope with the method and the route template, so
/// that one key on two routes is two keys; hashed if that is too long to keep as it is.
fn record_scope(scope: &Scope, parts: &Parts) -> Scope {
    let route = parts
        .extensions
        .get::<MatchedPath>()
        .map_or_else(|| parts.uri.path(), MatchedPath::as_str);
    // The stored text, not the display: the global scope is empty here, so no named
    // scope's combination can equal it.
    let combined = format!("{} {} {route}", scope.as_str(), parts.method);
    Scope::new(combined.clone()).unwrap_or_else(|_| {
        let digest = Fingerprint::of(&[combined.as_bytes()]);
        Scope::new(format!("h:{}", crate::hex::hex(digest.as_bytes())))
            .unwrap_or_else(|_| Scope::global())
    })
}

fn fingerprint(config: &Config, parts: &Parts, body: &[u8]) -> Fingerprint {
    let route = parts
        .extensions
        .get::<MatchedPath>()
        .map_or_else(|| parts.uri.path(), MatchedPath::as_str);
    let mut query: Vec<&str> = parts
        .uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|pair| !pair.is_empty())
        .collect();
    query.sort_unstable();
    let query = query.join("&");
    // Each chosen header as its name, how many values it has, and the values: framed
    // so that no two different sets of headers hash alike (`a: b` is not `b: b`).
    let mut headers = Vec::new();
    for name in &config.fingerprint_headers {
        let values: Vec<&HeaderValue> = parts.headers.get_all(name).iter().collect();
        headers.push(name.as_str().as_bytes().to_vec());
        headers.push(values.len().to_string().into_bytes());
        headers.extend(values.iter().map(|value| value.as_bytes().to_vec()));
    }
    let mut framed: Vec<&[u8]> = vec![
        parts.method.as_str().as_bytes(),
        route.as_bytes(),
        parts.uri.path().as_bytes(),
        query.as_bytes(),
    ];
    framed.push(b"headers");
    framed.extend(headers.iter().map(Vec::as_slice));
    framed.push(b"body");
    framed.push(body);
    Fingerprint::of(&framed)
}

fn mark(mut response: Response<Body>, replayed: bool) -> Response<Body> {
    response.headers_mut().insert(
        HeaderName::from_static(IDEMPOTENT_REPLAYED),
        HeaderValue::from_static(if replayed { "true" } else { "false" }),
    );
    response
}

/// The layer's answer for an error of the engine — 409 for a duplicate in flight, 422
/// for a reused key, 503 for a lost claim or an unreachable store — for handlers that
/// use the engine directly (the same-transaction mode) and answer like the layer.
pub fn error_response(error: &Error) -> Response<Body> {
    match error.kind() {
        // Come back when the request in flight's lease would end (its worker may have
        // died), or in a second when the store could not say.
        ErrorKind::InProgress => problem(
            StatusCode::CONFLICT,
            types::KEY_IN_USE,
            "A request with this Idempotency-Key is being processed",
            &error.to_string(),
            Some(
                error
                    .retry_after()
                    .unwrap_or(std::time::Duration::from_secs(1)),
            ),
        ),
        ErrorKind::KeyMismatch => problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            types::KEY_REUSED,
            "This Idempotency-Key was used for a different request",
            &error.to_string(),
            None,
        ),
        ErrorKind::OutcomeNotStored => problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            types::NOT_REPLAYABLE,
            "The request was processed, but its response was not stored",
            &error.to_string(),
            None,
        ),
        ErrorKind::LockLost | ErrorKind::Fencing => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            types::CLAIM_LOST,
            "The claim on this Idempotency-Key was lost while the request ran",
            &error.to_string(),
            Some(std::time::Duration::from_secs(1)),
        ),
        _ => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            types::STORE_UNAVAILABLE,
            "The idempotency store cannot be reached; the request was not processed",
            &error.to_string(),
            Some(std::time::Duration::from_secs(1)),
        ),
    }
}

async fn handle<S>(config: Arc<Config>, mut inner: S, request: Request<Body>) -> Response<Body>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Send + 'static,
    S::Future: Send,
{
    let (parts, body) = request.into_parts();
    if parts
        .headers
        .get_all(IDEMPOTENCY_KEY)
        .iter()
        .nth(1)
        .is_some()
    {
        return problem(
            StatusCode::BAD_REQUEST,
            types::KEY_MALFORMED,
            "The request has more than one Idempotency-Key header",
            "send exactly one Idempotency-Key header; which of several was meant cannot be told",
            None,
        );
    }
    let key = match parts.headers.get(IDEMPOTENCY_KEY).map(parse_key) {
        Some(Ok(key)) => key,
        Some(Err(detail)) => {
            return problem(
                StatusCode::BAD_REQUEST,
                types::KEY_MALFORMED,
                "The Idempotency-Key header is malformed",
                &detail,
                None,
            );
        }
        None if config.require_key => {
            return problem(
                StatusCode::BAD_REQUEST,
                types::KEY_MISSING,
                "This route requires an Idempotency-Key header",
                "send a unique key (for example a UUID) with the request, and the same key with every retry of it",
                None,
            );
        }
        None => return call(&mut inner, Request::from_parts(parts, body)).await,
    };
    let scope = match (config.scope)(&parts) {
        Some(scope) => record_scope(&scope, &parts),
        None => {
            return problem(
                StatusCode::UNAUTHORIZED,
                types::SCOPE_MISSING,
                "The request names no tenant or principal for its Idempotency-Key",
                "idempotency keys are kept per tenant or principal; authenticate the request",
                None,
            );
        }
    };
    let body = match read_limited(body, config.max_request_body).await {
        Ok(body) => body,
        Err(BodyRefused::TooLarge(detail)) => {
            return problem(
                StatusCode::PAYLOAD_TOO_LARGE,
                types::REQUEST_TOO_LARGE,
                "The request body is too large",
                &detail,
                None,
            );
        }
        Err(BodyRefused::Unreadable(detail)) => {
            return problem(
                StatusCode::BAD_REQUEST,
                types::REQUEST_BODY_UNREADABLE,
                "The request body could not be read",
                &detail,
                None,
            );
        }
    };
    let fingerprint = fingerprint(&config, &parts, &body);
    // The claim, the handler and the stored outcome run in a task of their own: a
    // client that goes away (a dropped connection cancels this future) must not cut
    // the work off between the claim and the stored outcome — a claim left behind
    // would answer "in progress" until its lease ran out, and work cut off after its
    // side effects would run again on the retry.
    let request = Request::from_parts(parts, Body::from(body));
    let worker = tokio::spawn(async move {
        match config.engine.begin(&scope, &key, &fingerprint).await {
            Ok(Begun::Started(claim)) => run_claimed(&config, inner, request, claim).await,
            Ok(Begun::Replay(outcome)) => replay(&outcome),
            Err(error) => error_response(&error),
        }
    });
    match worker.await {
        Ok(response) => response,
        Err(_) => problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            types::CLAIM_LOST,
            "The handler failed",
            "the handler panicked; the key is given back when its lease ends",
            None,
        ),
    }
}

/// Runs the handler under `claim` and stores what it answered.
async fn run_claimed<S>(
    config: &Config,
    mut inner: S,
    #[allow(unused_mut)] mut request: Request<Body>,
    claim: super::RunningClaim,
) -> Response<Body>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
{
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    let finisher = config
        .transactions
        .as_ref()
        .map(|source| source.attach(request.extensions_mut(), claim.token()));
    #[cfg(not(any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
    let finisher: Option<NoTransactions> = None;
    let lost = claim.lost_signal();
    let response = tokio::select! {
        biased;
        reason = lost => {
            // The handler was dropped mid-way. In the same-transaction mode its writes
            // roll back and the key goes back; in the lease mode its effects may have
            // happened, so the store is asked once to record that the outcome is
            // unknown (it refuses if a newer claim already holds the key).
            let in_transaction = finisher.as_ref().is_some_and(|finisher| finisher.asked());
            if let Some(finisher) = finisher {
                finisher.rollback().await;
            }
            if in_transaction {
                claim.give_back().await;
            } else {
                record_outcome_unknown(claim, "the first attempt's claim was lost while its handler ran").await;
            }
            return error_response(&Error::lost(reason));
        }
        response = std::panic::AssertUnwindSafe(call(&mut inner, request)).catch_unwind() => response,
    };
    let in_transaction = finisher.as_ref().is_some_and(|finisher| finisher.asked());
    let Ok(response) = response else {
        if let Some(finisher) = finisher {
            finisher.rollback().await;
        }
        return panicked(
            claim,
            in_transaction,
            "the first attempt's handler panicked",
        )
        .await;
    };
    let stored = config.store_status.unwrap_or(if in_transaction {
        stored_in_transactions_by_default
    } else {
        stored_by_default
    });
    if !stored(response.status()) {
        if let Some(finisher) = finisher {
            finisher.rollback().await;
        }
        // With the default policy, a 408 in the lease mode is a timeout layer inside
        // this one that dropped the handler mid-way: how far it got is unknown.
        if response.status() == StatusCode::REQUEST_TIMEOUT
            && config.store_status.is_none()
            && !in_transaction
        {
            record_outcome_unknown(
                claim,
                "the first attempt's handler was cut off by a timeout (408)",
            )
            .await;
        } else {
            claim.give_back().await;
        }
        return mark(response, false);
    }
    let (head, body) = response.into_parts();
    let ReadBody {
        prefix,
        trailers,
        rest,
    } = match std::panic::AssertUnwindSafe(read_prefix(body, config.max_response_body))
        .catch_unwind()
        .await
    {
        // A body stream is the handler's code run late: its panic is the handler's.
        Err(_) => {
            if let Some(finisher) = finisher {
                finisher.rollback().await;
            }
            return panicked(
                claim,
                in_transaction,
                "the first attempt's response body panicked",
            )
            .await;
        }
        Ok(Ok(read)) => read,
        // The body broke off: what was read is no answer to store or to pass on as
        // whole, and the client's response breaks off the same way, so that it does
        // not trust half a body. In the same-transaction mode the rollback undoes the
        // writes and the key goes back; in the lease mode the handler's effects may
        // have happened, so a retry is told the outcome is unknown, never run again.
        Ok(Err((prefix, error))) => {
            if in_transaction {
                if let Some(finisher) = finisher {
                    finisher.rollback().await;
                }
                claim.give_back().await;
                tracing::warn!(%error, "the handler's response body failed; its transaction is rolled back and the Idempotency-Key given back");
            } else {
                if let Some(finisher) = finisher {
                    finisher.rollback().await;
                }
                record_outcome_unknown(
                    claim,
                    "the first attempt's response body broke off half way",
                )
                .await;
            }
            let body = Body::from_stream(futures_util::stream::iter([
                Ok::<_, axum::Error>(prefix),
                Err(error),
            ]));
            return mark(Response::from_parts(head, body), false);
        }
    };
    let outcome = match (&rest, &trailers) {
        (None, None) => replay::encode(head.status, &head.headers, &config.replay_headers, &prefix),
        (Some(_), _) => replay::encode_not_stored(&format!(
            "the first response's body was over the {} bytes this route stores",
            config.max_response_body
        )),
        // A failure can be signalled in trailers (gRPC's status): a replay without
        // them could read as a success, so the response is not stored.
        (None, Some(_)) => replay::encode_not_stored(
            "the first response ended with trailers, which this layer does not store",
        ),
    };
    match finisher.filter(|finisher| finisher.opened()) {
        // The handler's writes and the response commit together, or its answer does
        // not stand.
        Some(finisher) => {
            if let Err(error) = finisher.commit(claim, outcome).await {
                return error_response(&error);
            }
        }
        // The handler ran, and its response goes to this client whatever becomes of
        // the record. The completion is tried until the claim is lost (an outcome the
        // store refuses for good is recorded as not stored); if even that fails, it
        // is counted and logged (`completion_failed`), and a retry after the lease
        // runs again. A refusal (a newer claim holds the key) changes nothing here.
        None => {
            let _ = claim
                .complete_or(&outcome, |error| {
                    replay::encode_not_stored(&format!("the response could not be stored: {error}"))
                })
                .await;
        }
    }
    let body = match (rest, trailers) {
        (None, None) => Body::from(prefix),
        (None, Some(trailers)) => Body::new(http_body_util::StreamBody::new(
            futures_util::stream::iter([
                Ok::<_, axum::Error>(http_body::Frame::data(prefix)),
                Ok(http_body::Frame::trailers(trailers)),
            ]),
        )),
        (Some(rest), _) => Body::from_stream(
            futures_util::stream::once(async move { Ok::<_, axum::Error>(prefix) })
                .chain(rest.into_data_stream()),
        ),
    };
    mark(Response::from_parts(head, body), false)
}

/// Stands in for the transaction hooks when no SQL engine is built in.
#[cfg(not(any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
struct NoTransactions;

#[cfg(not(any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
impl NoTransactions {
    fn opened(&self) -> bool {
        false
    }
    fn asked(&self) -> bool {
        false
    }
    async fn rollback(self) {}
    async fn commit(self, _claim: super::RunningClaim, _outcome: Vec<u8>) -> crate::Result<()> {
        Ok(())
    }
}

async fn call<S>(inner: &mut S, request: Request<Body>) -> Response<Body>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
{
    match inner.call(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

fn replay(outcome: &[u8]) -> Response<Body> {
    match replay::decode(outcome) {
        Some(StoredOutcome::Response {
            status,
            headers,
            body,
        }) => {
            let mut response = Response::new(Body::from(body));
            *response.status_mut() = status;
            *response.headers_mut() = headers;
            mark(response, true)
        }
        Some(StoredOutcome::NotStored { reason }) => problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            types::NOT_REPLAYABLE,
            "The request was processed, but its response was not stored",
            &format!("{reason}; use a new Idempotency-Key to make a new request"),
            None,
        ),
        Some(StoredOutcome::Unknown { what_happened }) => problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            types::OUTCOME_UNKNOWN,
            "The request was processed, but how far it got is unknown",
            &format!(
                "{what_happened}, so its effects may or may not have happened and it is not \
                 run again; check what happened, then use a new Idempotency-Key for a new request"
            ),
            None,
        ),
        None => problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            types::STORE_UNAVAILABLE,
            "The stored response cannot be read",
            "the idempotency record holds something this layer did not write",
            None,
        ),
    }
}

/// Why a request body was not read whole.
enum BodyRefused {
    /// Over the limit (413).
    TooLarge(String),
    /// Broken off or malformed (400).
    Unreadable(String),
}

/// The whole body if it is at most `limit` bytes.
async fn read_limited(body: Body, limit: usize) -> Result<Bytes, BodyRefused> {
    match http_body_util::Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<http_body_util::LengthLimitError>() => Err(BodyRefused::TooLarge(
            format!("the body is over the {limit} bytes read to check the Idempotency-Key"),
        )),
        Err(error) => Err(BodyRefused::Unreadable(format!(
            "the body broke off before its end ({error}); send the request again"
        ))),
    }
}

/// A response body as far as the layer read it.
struct ReadBody {
    /// Up to the limit, and a little more.
    prefix: Bytes,
    /// The trailers that ended the body, if any (gRPC-style status, a checksum).
    trailers: Option<http::HeaderMap>,
    /// What follows the prefix when the body is over the limit, to pass on unread.
    rest: Option<Body>,
}

/// Up to `limit` bytes of the body; if there is more, what was read and the rest of
/// the body (to pass on unread). A body that fails before its end is an error, with
/// what was read before it: a stream error is never taken for the end of the body.
async fn read_prefix(mut body: Body, limit: usize) -> Result<ReadBody, (Bytes, axum::Error)> {
    let mut prefix = Vec::new();
    let mut trailers = None;
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(error) => return Err((Bytes::from(prefix), error)),
        };
        match frame.into_data() {
            Ok(data) => {
                prefix.extend_from_slice(&data);
                if prefix.len() > limit {
                    return Ok(ReadBody {
                        prefix: Bytes::from(prefix),
                        trailers: None,
                        rest: Some(body),
                    });
                }
            }
            Err(frame) => {
                if let Ok(more) = frame.into_trailers() {
                    trailers
                        .get_or_insert_with(http::HeaderMap::new)
                        .extend(more);
                }
            }
        }
    }
    Ok(ReadBody {
        prefix: Bytes::from(prefix),
        trailers,
        rest: None,
    })
}

/// Records that the handler ran but its outcome is unknown (`what_happened`): a retry
/// is told so and does not run it again. Whether the record landed.
async fn record_outcome_unknown(claim: super::RunningClaim, what_happened: &str) -> bool {
    tracing::warn!(
        what_happened,
        "the handler's outcome is unknown; the Idempotency-Key records that instead of running it again"
    );
    claim
        .complete_with_retries(&replay::encode_unknown(what_happened))
        .await
        .is_ok()
}

/// Settles a claim whose handler (or its response body) panicked, its transaction
/// already rolled back, and answers. In the same-transaction mode the rollback undid
/// the handler's writes, so the key goes back; in the lease mode its effects may have
/// happened, and a retry must not repeat them: the key records that the outcome is
/// unknown.
async fn panicked(
    claim: super::RunningClaim,
    in_transaction: bool,
    what_happened: &str,
) -> Response<Body> {
    if in_transaction {
        claim.give_back().await;
        tracing::error!(
            what_happened,
            "the handler panicked; its transaction is rolled back and the Idempotency-Key given back"
        );
        return problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            types::STORE_UNAVAILABLE,
            "The handler failed",
            "the handler panicked; its writes were rolled back, and a retry with this key runs it again",
            None,
        );
    }
    let detail = if record_outcome_unknown(claim, what_happened).await {
        "the handler panicked; its effects are unknown, so this Idempotency-Key will not run it again"
    } else {
        "the handler panicked; its effects are unknown, and the store did not record that: a retry with this key may run it again"
    };
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        types::OUTCOME_UNKNOWN,
        "The handler failed",
        detail,
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(text: &str) -> Result<IdempotencyKey, String> {
        parse_key(&HeaderValue::from_str(text).unwrap())
    }

    #[test]
    fn keys_are_structured_field_strings_or_bare_tokens() {
        assert_eq!(key("\"abc-123\"").unwrap().as_str(), "abc-123");
        assert_eq!(key("\"with space\"").unwrap().as_str(), "with space");
        assert_eq!(key("\"q\\\"uote\"").unwrap().as_str(), "q\"uote");
        assert_eq!(key("8e03978e-40d5").unwrap().as_str(), "8e03978e-40d5");
        for bad in ["\"open", "\"a\"b\"", "two words", "\"\"", "\"bad\\x\""] {
            assert!(key(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_default_policy_stores_what_a_retry_would_repeat() {
        for code in [200, 201, 204, 301, 400, 404, 422] {
            assert!(
                stored_by_default(StatusCode::from_u16(code).unwrap()),
                "{code}"
            );
        }
        for code in [500, 502, 503] {
            let status = StatusCode::from_u16(code).unwrap();
            assert!(stored_by_default(status), "{code}");
            assert!(!stored_in_transactions_by_default(status), "{code}");
        }
        for code in [408, 409, 425, 429] {
            let status = StatusCode::from_u16(code).unwrap();
            assert!(!stored_by_default(status), "{code}");
            assert!(!stored_in_transactions_by_default(status), "{code}");
        }
    }
}
