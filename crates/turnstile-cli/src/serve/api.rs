//! The HTTP API: routes, request and response documents, and their OpenAPI description
//! (generated from these handlers: a route cannot be served without being documented).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use base64::Engine as _;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use turnstile::ErrorKind;
use turnstile::idempotency::{
    ClaimAnswer, Fingerprint, Finish, IdempotencyKey, IdempotencyOptions, RecordState,
    Scope as KeyScope,
};
use turnstile::lock::{ExtendOutcome, LockName, LockOptions, OwnerId, ReleaseOutcome};
use utoipa::{IntoParams, OpenApi, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::Service;
use super::activity::{
    ElectionView, Event, HeldLock, IdempotencyOutcome, IdempotencySecond, Latency, OutboxSample,
};
use super::auth::{Principal, Scope};
use super::problem::{Problem, ProblemDocument};
use super::quota;

/// The API's description, completed by the routes registered in [`router`].
#[derive(OpenApi)]
#[openapi(
    info(
        title = "Turnstile",
        description = "Distributed locks with fencing tokens, idempotency keys and the \
                       transactional outbox's status, over HTTP. Errors are \
                       application/problem+json documents whose `type` says what happened.",
    ),
    modifiers(&BearerAuth),
    security(("bearer" = [])),
    tags(
        (name = "locks", description = "Leases with fencing tokens"),
        (name = "elections", description = "One leader at a time, with a fencing epoch"),
        (name = "idempotency", description = "Claim, complete and replay keyed requests"),
        (name = "outbox", description = "The transactional outbox"),
        (name = "service", description = "The dashboard's data"),
    )
)]
pub(crate) struct ApiDoc;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The API's routes with their OpenAPI document.
pub(crate) fn router() -> OpenApiRouter<Arc<Service>> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(acquire))
        .routes(routes!(extend))
        .routes(routes!(release))
        .routes(routes!(status, force_release))
        .routes(routes!(claim))
        .routes(routes!(heartbeat))
        .routes(routes!(complete))
        .routes(routes!(give_back))
        .routes(routes!(record))
        .routes(routes!(outbox_status))
        .routes(routes!(redrive))
        .routes(routes!(dashboard))
}

// ---- extractors whose failures are problem documents ----

/// A JSON body; a malformed, oversized or mistyped one is a problem document.
pub(crate) struct Body<T>(pub(super) T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = Problem;

    async fn from_request(request: Request, state: &S) -> Result<Self, Problem> {
        match Json::<T>::from_request(request, state).await {
            Ok(Json(value)) => Ok(Body(value)),
            Err(rejection) => Err(json_problem(&rejection)),
        }
    }
}

fn json_problem(rejection: &JsonRejection) -> Problem {
    let status = rejection.status();
    match status.as_u16() {
        413 => Problem::new(
            status,
            "body-too-large",
            "Body too large",
            format!("{}; the limit is set by --max-body", rejection.body_text()),
        ),
        415 => Problem::new(
            status,
            "unsupported-media-type",
            "Unsupported media type",
            "send the body as JSON with `Content-Type: application/json` (`{}` for all defaults)",
        ),
        // 400 for malformed JSON, 422 for JSON of the wrong shape.
        _ => Problem::new(
            status,
            "invalid-request",
            "Invalid request",
            rejection.body_text(),
        ),
    }
}

/// The `{name}` path parameter of the lock routes.
pub(crate) struct PathName(pub(super) String);

impl<S: Send + Sync> FromRequestParts<S> for PathName {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Problem> {
        match Path::<LockPath>::from_request_parts(parts, state).await {
            Ok(Path(path)) => Ok(PathName(path.name)),
            Err(rejection) => Err(path_problem(&rejection)),
        }
    }
}

fn path_problem(rejection: &PathRejection) -> Problem {
    Problem::invalid(rejection.body_text())
}

/// Query parameters.
pub(crate) struct Params<T>(T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for Params<T> {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Problem> {
        match Query::<T>::from_request_parts(parts, state).await {
            Ok(Query(value)) => Ok(Params(value)),
            Err(rejection) => Err(query_problem(&rejection)),
        }
    }
}

fn query_problem(rejection: &QueryRejection) -> Problem {
    Problem::invalid(rejection.body_text())
}

// ---- numbers: JSON has one number type ----

/// A whole number of milliseconds, written as an integer or as a float with no
/// fraction (`2500.0`, as some JSON encoders write every number).
pub(super) fn whole_number<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<u64>, D::Error> {
    let Some(number) = Option::<serde_json::Number>::deserialize(deserializer)? else {
        return Ok(None);
    };
    exact_u64(&number, 1u64 << 53).map(Some).ok_or_else(|| {
        serde::de::Error::custom(format!("{number} is not a whole number of milliseconds"))
    })
}

/// A token: an integer, or a float with no fraction below 2^53 (where floats stop
/// being exact).
fn whole_token<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    let number = serde_json::Number::deserialize(deserializer)?;
    exact_u64(&number, 1u64 << 53).ok_or_else(|| {
        serde::de::Error::custom(format!("{number} is not a token (a whole number)"))
    })
}

fn exact_u64(number: &serde_json::Number, float_limit: u64) -> Option<u64> {
    if let Some(whole) = number.as_u64() {
        return Some(whole);
    }
    let float = number.as_f64()?;
    (float >= 0.0 && float.fract() == 0.0 && float < float_limit as f64).then_some(float as u64)
}

// ---- naming: tenants see only their own names and keys ----

/// The store's name for a caller's lock: `tenant/name` for a caller confined to a
/// tenant (tenant ids hold no `/`, so no two tenants' names meet), `name` otherwise.
pub(super) fn lock_name(principal: &Principal, name: &str) -> Result<LockName, Problem> {
    let full = match &principal.tenant {
        Some(tenant) => format!("{tenant}/{name}"),
        None => name.to_owned(),
    };
    LockName::new(full).map_err(Problem::from)
}

fn key_scope(principal: &Principal, scope: Option<&str>) -> Result<KeyScope, Problem> {
    let scope = scope.unwrap_or("global");
    let full = match &principal.tenant {
        Some(tenant) => format!("{tenant}/{scope}"),
        None => scope.to_owned(),
    };
    KeyScope::new(full).map_err(Problem::from)
}

fn millis(what: &str, value: Option<u64>, default: Duration) -> Result<Duration, Problem> {
    match value {
        None => Ok(default),
        Some(ms) if ms > 365 * 24 * 3600 * 1000 => Err(Problem::invalid(format!(
            "{what} is at most 365 days (31536000000 ms); got {ms}"
        ))),
        Some(ms) => Ok(Duration::from_millis(ms)),
    }
}

pub(super) fn ms(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

// ---- locks ----

/// How to take a lock.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct AcquireRequest {
    /// The lease in milliseconds (default 30000): the lock frees itself this long after
    /// the acquire or the last extend.
    #[schema(minimum = 10, maximum = 31536000000_u64)]
    #[serde(default, deserialize_with = "whole_number")]
    ttl_ms: Option<u64>,
    /// How long to wait for a held lock, in milliseconds (default 0: answer at once);
    /// at most the service's `--max-wait`. Long-poll again after a `lock-held` answer.
    #[schema(minimum = 0)]
    #[serde(default, deserialize_with = "whole_number")]
    wait_ms: Option<u64>,
}

/// A lease: what extending and releasing need, and the token to pass to the resource.
#[derive(Serialize, ToSchema)]
pub(crate) struct LockLease {
    /// The lock's name, as the caller gave it.
    name: String,
    /// The acquisition's owner id: the capability to extend and release. Keep it secret.
    owner: String,
    /// The fencing token: send it with every write to the protected resource, which
    /// must refuse a token smaller than the largest it has seen.
    fencing_token: u64,
    /// The lease in milliseconds: extend before it passes.
    ttl_ms: u64,
}

/// The `{name}` of the lock routes, read by [`PathName`] and described by the OpenAPI
/// document from this one definition.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub(crate) struct LockPath {
    /// The lock's name (percent-encoded): 1 to 512 bytes of UTF-8 without control
    /// characters.
    #[param(
        min_length = 1,
        max_length = 512,
        pattern = "^[^\\x00-\\x1f\\x7f-\\x9f]+$"
    )]
    name: String,
}

/// Takes a lock, waiting up to `wait_ms` for it.
#[utoipa::path(
    post, path = "/v1/locks/{name}/acquire", tag = "locks",
    params(LockPath),
    request_body = AcquireRequest,
    responses(
        (status = 200, description = "Acquired", body = LockLease),
        (status = 409, description = "Held by someone else when the wait ended", body = ProblemDocument, content_type = "application/problem+json"),
        (status = 400, description = "Invalid name or options", body = ProblemDocument, content_type = "application/problem+json"),
        (status = 503, description = "Store unavailable or the service is shutting down", body = ProblemDocument, content_type = "application/problem+json"),
    )
)]
async fn acquire(
    State(service): State<Arc<Service>>,
    principal: Principal,
    PathName(name): PathName,
    Body(request): Body<AcquireRequest>,
) -> Result<Json<LockLease>, Problem> {
    principal.require(Scope::LocksWrite)?;
    let taken = take_lease(
        &service,
        &principal,
        &name,
        request.ttl_ms,
        request.wait_ms,
        async |full, options| service.locker.acquire(full, &options).await,
    )
    .await?;
    let token = taken.lease.fencing_token.get();
    service.activity.held(
        taken.full.as_str(),
        principal.tenant.as_deref(),
        &name,
        taken.lease.owner.as_str(),
        token,
        taken.ttl,
    );
    Ok(Json(LockLease {
        name,
        owner: taken.lease.owner.to_hex(),
        fencing_token: token,
        ttl_ms: ms(taken.ttl),
    }))
}

/// A lease taken for a caller by [`take_lease`], detached from this process: the caller
/// extends and releases it.
pub(super) struct Taken {
    /// The store's name (with the tenant).
    pub(super) full: LockName,
    pub(super) lease: turnstile::lock::DetachedLock,
    pub(super) ttl: Duration,
}

/// Takes a lease for a caller through `take` (a lock's acquire, an election's
/// campaign), within this instance's bounds: the lease and the wait are checked
/// against `--max-ttl` and `--max-wait`, a waiting request takes one of
/// `--max-long-polls`, the tenant's locks are counted against
/// `--max-locks-per-tenant`, and shutdown ends the wait.
pub(super) async fn take_lease(
    service: &Service,
    principal: &Principal,
    name: &str,
    ttl_ms: Option<u64>,
    wait_ms: Option<u64>,
    take: impl AsyncFnOnce(LockName, LockOptions) -> turnstile::Result<turnstile::lock::LockGuard>,
) -> Result<Taken, Problem> {
    let full = lock_name(principal, name)?;
    let ttl = service.lease("ttl_ms", ttl_ms)?;
    let wait = Duration::from_millis(wait_ms.unwrap_or(0));
    if wait > service.max_wait {
        return Err(Problem::invalid(format!(
            "wait_ms is at most {} on this service (--max-wait); long-poll again after a \
             lock-held answer",
            ms(service.max_wait)
        )));
    }
    // A waiting acquire holds a task and a connection for up to --max-wait: their
    // number is bounded, and past it a caller is told to come back, not queued.
    let _long_poll = if wait.is_zero() {
        None
    } else {
        match Arc::clone(&service.long_polls).try_acquire_owned() {
            Ok(permit) => Some(permit),
            Err(_) => {
                metrics::counter!("turnstile_serve_long_polls_refused_total").increment(1);
                return Err(Problem::new(
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    "too-many-long-polls",
                    "Too many waiting acquires",
                    "the service is at its limit of acquires that wait (--max-long-polls); \
                     retry shortly, or acquire without wait_ms",
                )
                .retry_after(1));
            }
        }
    };
    let holder = principal.holder();
    let reserved = service.held.reserve(holder, full.as_str(), ttl + wait);
    if reserved == quota::Reserved::Full {
        metrics::counter!("turnstile_serve_tenant_limit_total").increment(1);
        return Err(Problem::new(
            axum::http::StatusCode::TOO_MANY_REQUESTS,
            "tenant-lock-limit",
            "Too many locks held",
            format!(
                "this tenant holds {} locks through this instance, the most --max-locks-per-tenant \
                 allows; release one first",
                service.held.limit()
            ),
        )
        .retry_after(1));
    }
    let options = LockOptions::new().ttl(ttl).wait(wait);
    let _waiting = service.activity.waiting(full.as_str());
    let started = Instant::now();
    let acquired = tokio::select! {
        acquired = take(full.clone(), options) => acquired,
        // Dropping the acquire is safe: a request that took the lock meanwhile is
        // released in the background.
        () = service.shutdown.cancelled() => return Err(Problem::shutting_down()),
    };
    if wait.is_zero() {
        service.observe_store("acquire", started.elapsed());
    }
    if acquired.is_err() && reserved == quota::Reserved::New {
        service.held.released(holder, full.as_str(), None);
    }
    let guard = acquired.map_err(|error| {
        let held = error.kind() == ErrorKind::AcquireTimeout;
        let problem = Problem::from(error);
        if held {
            problem.with("name", name.to_owned())
        } else {
            problem
        }
    })?;
    let lease = guard.detach();
    service
        .held
        .acquired(holder, full.as_str(), lease.owner.as_str(), ttl);
    Ok(Taken { full, lease, ttl })
}

/// Extends the lease `owner` holds on `full` for a caller, keeping the tenant's count:
/// `None` when extended, the reason when the lease was lost.
pub(super) async fn extend_lease(
    service: &Service,
    principal: &Principal,
    full: &LockName,
    owner: &OwnerId,
    ttl: Duration,
) -> Result<Option<turnstile::lock::LossReason>, Problem> {
    let outcome = service
        .timed("extend", service.locker.extend_detached(full, owner, ttl))
        .await?;
    match outcome {
        ExtendOutcome::Extended => {
            service
                .held
                .extended(principal.holder(), full.as_str(), ttl);
            Ok(None)
        }
        ExtendOutcome::Lost(reason) => {
            service
                .held
                .released(principal.holder(), full.as_str(), Some(owner.as_str()));
            Ok(Some(reason))
        }
        _ => Err(Problem::invalid("unexpected extend outcome")),
    }
}

/// Releases the lease `owner` holds on `full` for a caller, keeping the tenant's
/// count: `released`, `already_expired` or `held_by_other`.
pub(super) async fn release_lease(
    service: &Service,
    principal: &Principal,
    full: &LockName,
    owner: &OwnerId,
) -> Result<&'static str, Problem> {
    let outcome = service
        .timed("release", service.locker.release_detached(full, owner))
        .await?;
    let outcome = match outcome {
        ReleaseOutcome::Released => "released",
        ReleaseOutcome::AlreadyExpired => "already_expired",
        ReleaseOutcome::HeldByOther => "held_by_other",
        _ => "unknown",
    };
    if outcome == "released" || outcome == "already_expired" {
        service
            .held
            .released(principal.holder(), full.as_str(), Some(owner.as_str()));
    }
    Ok(outcome)
}

/// Extends a lease.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ExtendRequest {
    /// The owner id the acquire returned.
    #[schema(pattern = "^[0-9a-f]{32}$")]
    owner: String,
    /// The new lease in milliseconds from now (default 30000).
    #[schema(minimum = 10, maximum = 31536000000_u64)]
    #[serde(default, deserialize_with = "whole_number")]
    ttl_ms: Option<u64>,
}

/// An extended lease.
#[derive(Serialize, ToSchema)]
pub(crate) struct Extended {
    /// The lease in milliseconds from now.
    ttl_ms: u64,
}

/// Renews a lease for `ttl_ms` from now. A lease that ran out or was broken is lost
/// (409 `lock-lost`): the holder must stop writing.
#[utoipa::path(
    post, path = "/v1/locks/{name}/extend", tag = "locks",
    params(LockPath),
    request_body = ExtendRequest,
    responses(
        (status = 200, description = "Extended", body = Extended),
        (status = 409, description = "Lost: the lease ran out or another owner holds the lock", body = ProblemDocument, content_type = "application/problem+json"),
        (status = 400, description = "Invalid name, owner or TTL", body = ProblemDocument, content_type = "application/problem+json"),
    )
)]
async fn extend(
    State(service): State<Arc<Service>>,
    principal: Principal,
    PathName(name): PathName,
    Body(request): Body<ExtendRequest>,
) -> Result<Json<Extended>, Problem> {
    principal.require(Scope::LocksWrite)?;
    let full = lock_name(&principal, &name)?;
    let owner = OwnerId::parse(&request.owner)?;
    let ttl = service.lease("ttl_ms", request.ttl_ms)?;
    match extend_lease(&service, &principal, &full, &owner, ttl).await? {
        None => {
            service.activity.extended(full.as_str(), ttl);
            Ok(Json(Extended { ttl_ms: ms(ttl) }))
        }
        Some(reason) => {
            // Only the holder's own loss removes its row: an extend with another owner
            // id (a stale holder's, or a wrong one) leaves the real holder shown. The
            // event goes to this tenant's own buffer.
            service.activity.gone(full.as_str(), Some(owner.as_str()));
            service.activity.event(
                "lost",
                principal.tenant.as_deref(),
                &name,
                reason.to_string(),
            );
            Err(Problem::new(
                axum::http::StatusCode::CONFLICT,
                "lock-lost",
                "Lock lost",
                format!(
                    "lock {name:?} is no longer yours: {reason}; stop writing to what it protects"
                ),
            )
            .with("reason", reason.to_string()))
        }
    }
}

/// Releases a lease.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ReleaseRequest {
    /// The owner id the acquire returned.
    #[schema(pattern = "^[0-9a-f]{32}$")]
    owner: String,
}

/// What a release found.
#[derive(Serialize, ToSchema)]
pub(crate) struct Released {
    /// `released` (it was yours and is now free), `already_expired` (your lease had
    /// ended; nobody holds it) or `held_by_other` (your lease had ended and someone
    /// else holds it now; it was left alone).
    outcome: &'static str,
}

/// Releases a lease, reporting what the store found.
#[utoipa::path(
    post, path = "/v1/locks/{name}/release", tag = "locks",
    params(LockPath),
    request_body = ReleaseRequest,
    responses(
        (status = 200, description = "What the release found", body = Released),
        (status = 400, description = "Invalid name or owner", body = ProblemDocument, content_type = "application/problem+json"),
    )
)]
async fn release(
    State(service): State<Arc<Service>>,
    principal: Principal,
    PathName(name): PathName,
    Body(request): Body<ReleaseRequest>,
) -> Result<Json<Released>, Problem> {
    principal.require(Scope::LocksWrite)?;
    let full = lock_name(&principal, &name)?;
    let owner = OwnerId::parse(&request.owner)?;
    let outcome = release_lease(&service, &principal, &full, &owner).await?;
    if outcome == "released" || outcome == "already_expired" {
        service.activity.gone(full.as_str(), Some(owner.as_str()));
    }
    if outcome != "released" {
        service.activity.event(
            "released_late",
            principal.tenant.as_deref(),
            &name,
            outcome.to_owned(),
        );
    }
    Ok(Json(Released { outcome }))
}

/// A lock's state.
#[derive(Serialize, ToSchema)]
pub(crate) struct LockStatus {
    /// The lock's name, as the caller gave it.
    name: String,
    /// Whether someone holds it.
    held: bool,
    /// The first 8 hex digits of the holder's owner id.
    holder: Option<String>,
    /// The holder's fencing token.
    fencing_token: Option<u64>,
    /// How long the lease has left, by the store's clock (absent on stores that do not
    /// say).
    lease_left_ms: Option<u64>,
}

/// The current holder of a lock, if any.
#[utoipa::path(
    get, path = "/v1/locks/{name}", tag = "locks",
    params(LockPath),
    responses(
        (status = 200, description = "The lock's state", body = LockStatus),
        (status = 400, description = "Invalid name", body = ProblemDocument, content_type = "application/problem+json"),
    )
)]
async fn status(
    State(service): State<Arc<Service>>,
    principal: Principal,
    PathName(name): PathName,
) -> Result<Json<LockStatus>, Problem> {
    principal.require(Scope::LocksRead)?;
    let full = lock_name(&principal, &name)?;
    let info = service
        .timed("status", service.locker.status(&full))
        .await?;
    Ok(Json(lock_status(name, info)))
}

fn lock_status(name: String, info: Option<turnstile::lock::LockInfo>) -> LockStatus {
    match info {
        Some(info) => LockStatus {
            name,
            held: true,
            holder: Some(info.owner.chars().take(8).collect()),
            fencing_token: info.fencing_token.map(|token| token.get()),
            lease_left_ms: info.remaining_ttl.map(ms),
        },
        None => LockStatus {
            name,
            held: false,
            holder: None,
            fencing_token: None,
            lease_left_ms: None,
        },
    }
}

/// Breaks a lock, whoever holds it (scope `locks:break`). The holder finds out at its
/// next extend; its writes meanwhile are what fencing tokens stop. Answers what was
/// held (`held: false` if nothing was).
#[utoipa::path(
    delete, path = "/v1/locks/{name}", tag = "locks",
    params(LockPath),
    responses(
        (status = 200, description = "What was held", body = LockStatus),
        (status = 403, description = "The token lacks locks:break", body = ProblemDocument, content_type = "application/problem+json"),
    )
)]
async fn force_release(
    State(service): State<Arc<Service>>,
    principal: Principal,
    PathName(name): PathName,
) -> Result<Json<LockStatus>, Problem> {
    principal.require(Scope::LocksBreak)?;
    let full = lock_name(&principal, &name)?;
    let info = service
        .timed("break", service.locker.force_release(&full))
        .await?;
    if let Some(info) = &info {
        service.activity.gone(full.as_str(), None);
        service.activity.term_ended(full.as_str(), None, "broken");
        service
            .held
            .released(principal.holder(), full.as_str(), None);
        service.activity.event(
            "broken",
            principal.tenant.as_deref(),
            &name,
            format!(
                "by {}; token {} held by {}…",
                principal.name,
                info.fencing_token
                    .map_or_else(|| "none".to_owned(), |token| token.get().to_string()),
                info.owner.chars().take(8).collect::<String>()
            ),
        );
        tracing::warn!(lock = %full, by = %principal.name, token = info.fencing_token.map(|token| token.get()), "lock broken through the service");
    }
    Ok(Json(lock_status(name, info)))
}

// ---- idempotency ----

/// Where a key lives and which request it stands for.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ClaimRequest {
    /// The idempotency key: 1 to 255 visible ASCII characters.
    #[schema(min_length = 1, max_length = 255, pattern = "^[ -~]+$")]
    key: String,
    /// The key's scope (default `global`); for a token confined to a tenant, inside that
    /// tenant.
    #[schema(
        min_length = 1,
        max_length = 200,
        pattern = "^[^\\x00-\\x1f\\x7f-\\x9f]+$"
    )]
    scope: Option<String>,
    /// The request's fingerprint: 64 hex digits of a SHA-256 over what makes two
    /// requests the same request. A repeat with another fingerprint is refused.
    #[schema(pattern = "^[0-9a-fA-F]{64}$")]
    fingerprint: String,
    /// The claim's lease in milliseconds, 1 s to 1 day (default 30000): heartbeat
    /// before it passes.
    #[schema(minimum = 1000, maximum = 86400000)]
    #[serde(default, deserialize_with = "whole_number")]
    lease_ms: Option<u64>,
    /// How long the record is kept, in milliseconds, 1 s to a year (default 24 hours).
    #[schema(minimum = 1000, maximum = 31536000000_u64)]
    #[serde(default, deserialize_with = "whole_number")]
    retention_ms: Option<u64>,
}

/// What a claim found.
#[derive(Serialize, ToSchema)]
pub(crate) struct Claimed {
    /// `started`: the key is yours; do the work, then complete or release with
    /// `token` and `capability`. `replay`: the request was done before; here is its
    /// outcome.
    state: &'static str,
    /// For `started`: the claim's fencing token.
    token: Option<u64>,
    /// For `started`: the claim's secret capability (32 hex digits), required to renew,
    /// complete or give back the claim. It is handed out here only: keep it with the
    /// work, never log it.
    capability: Option<String>,
    /// For `replay`: the stored outcome, when it is UTF-8 text.
    outcome: Option<String>,
    /// For `replay`: the stored outcome in base64 (always present with `replay`).
    outcome_base64: Option<String>,
}

fn parse_fingerprint(hex: &str) -> Result<Fingerprint, Problem> {
    let bad = || {
        Problem::invalid(format!(
            "fingerprint is 64 hex digits (a SHA-256); got {:?}",
            hex.chars().take(70).collect::<String>()
        ))
    };
    if hex.len() != 64 {
        return Err(bad());
    }
    let mut bytes = [0u8; 32];
    for (i, byte) in bytes.iter_mut().enumerate() {
        *byte = hex
            .get(2 * i..2 * i + 2)
            .and_then(|pair| u8::from_str_radix(pair, 16).ok())
            .ok_or_else(bad)?;
    }
    Ok(Fingerprint::from_bytes(bytes))
}

/// Claims an idempotency key for a request.
#[utoipa::path(
    post, path = "/v1/idempotency/claim", tag = "idempotency",
    request_body = ClaimRequest,
    responses(
        (status = 200, description = "Started (yours) or a replay of the stored outcome", body = Claimed),
        (status = 409, description = "Another claim is at work on the key (`in-progress`, with `lease_left_ms`)", body = ProblemDocument, content_type = "application/problem+json"),
        (status = 422, description = "The key was used for a request with another fingerprint", body = ProblemDocument, content_type = "application/problem+json"),
        (status = 501, description = "The store has no idempotency records", body = ProblemDocument, content_type = "application/problem+json"),
    )
)]
async fn claim(
    State(service): State<Arc<Service>>,
    principal: Principal,
    Body(request): Body<ClaimRequest>,
) -> Result<Json<Claimed>, Problem> {
    principal.require(Scope::IdempotencyWrite)?;
    let store = service.idempotency()?;
    let scope = key_scope(&principal, request.scope.as_deref())?;
    let key = IdempotencyKey::new(request.key)?;
    let fingerprint = parse_fingerprint(&request.fingerprint)?;
    let defaults = IdempotencyOptions::new();
    let lease = millis("lease_ms", request.lease_ms, defaults.get_lease())?;
    let retention = millis(
        "retention_ms",
        request.retention_ms,
        defaults.get_retention(),
    )?;
    IdempotencyOptions::new()
        .lease(lease)
        .retention(retention)
        .validate()?;
    let answer = service
        .timed(
            "claim",
            store.claim(&scope, &key, &fingerprint, lease, retention),
        )
        .await?;
    match answer {
        ClaimAnswer::Started { token } => {
            service.idempotency_outcome(IdempotencyOutcome::Started);
            Ok(Json(Claimed {
                state: "started",
                token: Some(token.get()),
                capability: Some(service.claim_secret.capability(
                    scope.as_str(),
                    key.as_str(),
                    token.get(),
                )),
                outcome: None,
                outcome_base64: None,
            }))
        }
        ClaimAnswer::Replay { outcome } => {
            service.idempotency_outcome(IdempotencyOutcome::Replayed);
            Ok(Json(Claimed {
                state: "replay",
                token: None,
                capability: None,
                outcome_base64: Some(base64::engine::general_purpose::STANDARD.encode(&outcome)),
                outcome: String::from_utf8(outcome).ok(),
            }))
        }
        ClaimAnswer::InProgress { lease_left } => {
            service.idempotency_outcome(IdempotencyOutcome::InProgress);
            let mut problem = Problem::new(
                axum::http::StatusCode::CONFLICT,
                "in-progress",
                "Request in progress",
                format!(
                    "another claim is at work on key {:?}; retry after its lease",
                    key.as_str()
                ),
            );
            if let Some(left) = lease_left {
                problem = problem
                    .with("lease_left_ms", ms(left))
                    .retry_after(left.as_secs().max(1));
            }
            Err(problem)
        }
        ClaimAnswer::Mismatch => {
            service.idempotency_outcome(IdempotencyOutcome::Mismatched);
            Err(Problem::new(
                axum::http::StatusCode::UNPROCESSABLE_ENTITY,
                "key-mismatch",
                "Idempotency key reused",
                format!(
                    "key {:?} was used before for a request with another fingerprint",
                    key.as_str()
                ),
            ))
        }
        _ => Err(Problem::invalid("unexpected claim answer")),
    }
}

/// Names a claim.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ClaimRef {
    /// The idempotency key.
    #[schema(min_length = 1, max_length = 255, pattern = "^[ -~]+$")]
    key: String,
    /// The key's scope (default `global`).
    #[schema(
        min_length = 1,
        max_length = 200,
        pattern = "^[^\\x00-\\x1f\\x7f-\\x9f]+$"
    )]
    scope: Option<String>,
    /// The claim's token, as the claim returned it.
    #[serde(deserialize_with = "whole_token")]
    #[schema(minimum = 0, maximum = 9223372036854775807_u64)]
    token: u64,
    /// The claim's capability, as the claim returned it.
    #[schema(pattern = "^[0-9a-f]{32}$")]
    capability: String,
}

/// Renews a claim's lease.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct HeartbeatRequest {
    #[serde(flatten)]
    claim: ClaimRef,
    /// The new lease in milliseconds from now, 1 s to 1 day (default 30000).
    #[schema(minimum = 1000, maximum = 86400000)]
    #[serde(default, deserialize_with = "whole_number")]
    lease_ms: Option<u64>,
}

/// Stores a claim's outcome.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct CompleteRequest {
    #[serde(flatten)]
    claim: ClaimRef,
    /// The outcome as text (give this or `outcome_base64`; neither stores an empty
    /// outcome).
    outcome: Option<String>,
    /// The outcome as base64 bytes.
    outcome_base64: Option<String>,
    /// How long the record is kept from now, in milliseconds, 1 s to a year (default
    /// 24 hours).
    #[schema(minimum = 1000, maximum = 31536000000_u64)]
    #[serde(default, deserialize_with = "whole_number")]
    retention_ms: Option<u64>,
}

/// Whether a claim's token was still the record's.
#[derive(Serialize, ToSchema)]
pub(crate) struct Done {
    /// Always `done` (a fenced claim is a 409 `fenced` problem).
    state: &'static str,
}

fn claim_parts(
    service: &Service,
    principal: &Principal,
    claim: &ClaimRef,
) -> Result<(KeyScope, IdempotencyKey, turnstile::fence::FencingToken), Problem> {
    // Every store keeps tokens in a signed 64-bit column, so a larger one was never
    // issued: a client's mistake, not a store's.
    if claim.token > i64::MAX as u64 {
        return Err(Problem::invalid(format!(
            "token {} was never issued (tokens are at most 2^63 - 1)",
            claim.token
        )));
    }
    let scope = key_scope(principal, claim.scope.as_deref())?;
    let key = IdempotencyKey::new(claim.key.clone())?;
    if !service
        .claim_secret
        .verify(scope.as_str(), key.as_str(), claim.token, &claim.capability)
    {
        metrics::counter!("turnstile_serve_claim_capability_refused_total").increment(1);
        return Err(Problem::forbidden(format!(
            "the capability does not match the claim on key {:?} with token {}: only the \
             claimer, with the capability its claim returned, may renew, complete or give it \
             back",
            key.as_str(),
            claim.token
        ))
        .with("reason", "claim-capability"));
    }
    Ok((scope, key, turnstile::fence::FencingToken::new(claim.token)))
}

fn finished(
    service: &Service,
    key: &IdempotencyKey,
    finish: Finish,
) -> Result<Json<Done>, Problem> {
    match finish {
        Finish::Done => Ok(Json(Done { state: "done" })),
        _ => {
            service.idempotency_outcome(IdempotencyOutcome::Fenced);
            Err(Problem::new(
                axum::http::StatusCode::CONFLICT,
                "fenced",
                "Claim fenced",
                format!(
                    "the claim on key {:?} is no longer the record's (its lease ran out and \
                     another claim took over, or an operator forgot the key); nothing was changed",
                    key.as_str()
                ),
            ))
        }
    }
}

/// Renews a claim's lease; a claim whose lease ran out and was taken over is fenced.
#[utoipa::path(
    post, path = "/v1/idempotency/heartbeat", tag = "idempotency",
    request_body = HeartbeatRequest,
    responses(
        (status = 200, description = "Renewed", body = Done),
        (status = 409, description = "Fenced: the claim is no longer the record's", body = ProblemDocument, content_type = "application/problem+json"),
        (status = 403, description = "The capability does not match the claim", body = ProblemDocument, content_type = "application/problem+json"),
    )
)]
async fn heartbeat(
    State(service): State<Arc<Service>>,
    principal: Principal,
    Body(request): Body<HeartbeatRequest>,
) -> Result<Json<Done>, Problem> {
    principal.require(Scope::IdempotencyWrite)?;
    let store = service.idempotency()?;
    let (scope, key, token) = claim_parts(&service, &principal, &request.claim)?;
    let lease = millis(
        "lease_ms",
        request.lease_ms,
        IdempotencyOptions::new().get_lease(),
    )?;
    IdempotencyOptions::new().lease(lease).validate()?;
    let outcome = service
        .timed("heartbeat", store.heartbeat(&scope, &key, token, lease))
        .await?;
    let finish = match outcome {
        ExtendOutcome::Extended => Finish::Done,
        _ => Finish::Fenced,
    };
    finished(&service, &key, finish)
}

/// Stores a claim's outcome; repeats of the request get it replayed.
#[utoipa::path(
    post, path = "/v1/idempotency/complete", tag = "idempotency",
    request_body = CompleteRequest,
    responses(
        (status = 200, description = "Stored", body = Done),
        (status = 409, description = "Fenced: the claim is no longer the record's", body = ProblemDocument, content_type = "application/problem+json"),
        (status = 403, description = "The capability does not match the claim", body = ProblemDocument, content_type = "application/problem+json"),
        (status = 413, description = "Body too large", body = ProblemDocument, content_type = "application/problem+json"),
    )
)]
async fn complete(
    State(service): State<Arc<Service>>,
    principal: Principal,
    Body(request): Body<CompleteRequest>,
) -> Result<Json<Done>, Problem> {
    principal.require(Scope::IdempotencyWrite)?;
    let store = service.idempotency()?;
    let (scope, key, token) = claim_parts(&service, &principal, &request.claim)?;
    let outcome = match (request.outcome, request.outcome_base64) {
        (Some(text), None) => text.into_bytes(),
        (None, Some(encoded)) => base64::engine::general_purpose::STANDARD
            .decode(encoded.as_bytes())
            .map_err(|error| Problem::invalid(format!("outcome_base64 is not base64: {error}")))?,
        // Done, with nothing to replay but the fact.
        (None, None) => Vec::new(),
        (Some(_), Some(_)) => {
            return Err(Problem::invalid(
                "give at most one of outcome (text) and outcome_base64",
            ));
        }
    };
    let retention = millis(
        "retention_ms",
        request.retention_ms,
        IdempotencyOptions::new().get_retention(),
    )?;
    // Only the retention's range matters here: the claim's lease was checked when it
    // was taken.
    IdempotencyOptions::new()
        .lease(Duration::from_secs(1))
        .retention(retention)
        .validate()?;
    let finish = service
        .timed(
            "complete",
            store.complete(&scope, &key, token, &outcome, retention),
        )
        .await?;
    if finish == Finish::Done {
        service.idempotency_outcome(IdempotencyOutcome::Completed);
    }
    finished(&service, &key, finish)
}

/// Gives a key back (the work failed in a way worth retrying): the next claim starts.
#[utoipa::path(
    post, path = "/v1/idempotency/release", tag = "idempotency",
    request_body = ClaimRef,
    responses(
        (status = 200, description = "Given back", body = Done),
        (status = 409, description = "Fenced: the claim is no longer the record's", body = ProblemDocument, content_type = "application/problem+json"),
        (status = 403, description = "The capability does not match the claim", body = ProblemDocument, content_type = "application/problem+json"),
    )
)]
async fn give_back(
    State(service): State<Arc<Service>>,
    principal: Principal,
    Body(request): Body<ClaimRef>,
) -> Result<Json<Done>, Problem> {
    principal.require(Scope::IdempotencyWrite)?;
    let store = service.idempotency()?;
    let (scope, key, token) = claim_parts(&service, &principal, &request)?;
    let finish = service
        .timed("give_back", store.release(&scope, &key, token))
        .await?;
    finished(&service, &key, finish)
}

/// Which record to read.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct RecordQuery {
    /// The idempotency key.
    #[param(min_length = 1, max_length = 255, pattern = "^[ -~]+$")]
    key: String,
    /// The key's scope (default `global`).
    #[param(
        min_length = 1,
        max_length = 200,
        pattern = "^[^\\x00-\\x1f\\x7f-\\x9f]+$"
    )]
    scope: Option<String>,
}

/// A stored record.
#[derive(Serialize, ToSchema)]
pub(crate) struct RecordDocument {
    /// `in_progress` or `completed`.
    state: &'static str,
    /// The request's fingerprint (64 hex digits).
    fingerprint: String,
    /// The current (or last) claim's token.
    token: u64,
    /// For a record in progress, how long its lease has left (0: ran out).
    lease_left_ms: Option<u64>,
    /// How long until the record may be swept.
    expires_in_ms: u64,
    /// The stored outcome as text, when it is UTF-8.
    outcome: Option<String>,
    /// The stored outcome in base64.
    outcome_base64: Option<String>,
}

/// Reads a key's record.
#[utoipa::path(
    get, path = "/v1/idempotency/record", tag = "idempotency",
    params(RecordQuery),
    responses(
        (status = 200, description = "The record", body = RecordDocument),
        (status = 404, description = "No record (never claimed, or swept)", body = ProblemDocument, content_type = "application/problem+json"),
    )
)]
async fn record(
    State(service): State<Arc<Service>>,
    principal: Principal,
    Params(query): Params<RecordQuery>,
) -> Result<Json<RecordDocument>, Problem> {
    principal.require(Scope::IdempotencyRead)?;
    let store = service.idempotency()?;
    let scope = key_scope(&principal, query.scope.as_deref())?;
    let key = IdempotencyKey::new(query.key)?;
    let record = service.timed("record", store.get(&scope, &key)).await?;
    let Some(record) = record else {
        return Err(Problem::new(
            axum::http::StatusCode::NOT_FOUND,
            "no-record",
            "No record",
            format!("no record for key {:?} in this scope", key.as_str()),
        ));
    };
    Ok(Json(RecordDocument {
        state: match record.state {
            RecordState::Completed => "completed",
            _ => "in_progress",
        },
        fingerprint: record
            .fingerprint
            .as_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect(),
        token: record.token.get(),
        lease_left_ms: record.lease_left.map(ms),
        expires_in_ms: ms(record.expires_in),
        outcome_base64: record
            .outcome
            .as_ref()
            .map(|bytes| base64::engine::general_purpose::STANDARD.encode(bytes)),
        outcome: record
            .outcome
            .and_then(|bytes| String::from_utf8(bytes).ok()),
    }))
}

// ---- outbox ----

/// How many parked keys to list.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct OutboxQuery {
    /// Parked keys to list, 0 to 1000 (default 20).
    #[param(minimum = 0, maximum = 1000)]
    parked_limit: Option<u32>,
}

/// A parked key.
#[derive(Serialize, ToSchema)]
pub(crate) struct Parked {
    /// The ordering key.
    key: String,
    /// Failed attempts of its head message.
    attempts: u32,
    /// The last failure's reason.
    reason: Option<String>,
    /// Messages waiting behind it.
    pending: u64,
}

/// What the outbox holds.
#[derive(Serialize, ToSchema)]
pub(crate) struct OutboxStatus {
    /// Undelivered messages of keys that are not parked.
    pending: u64,
    /// Keys with undelivered messages (not parked).
    pending_keys: u64,
    /// Age of the oldest undelivered message of a key that is not parked.
    oldest_pending_ms: Option<u64>,
    /// Delivered messages kept for audit.
    kept: u64,
    /// Parked keys, oldest failure first.
    parked: Vec<Parked>,
}

/// The outbox's pending messages and parked keys (scope `outbox:read`; not for tokens
/// confined to a tenant: the outbox is shared).
#[utoipa::path(
    get, path = "/v1/outbox", tag = "outbox",
    params(OutboxQuery),
    responses(
        (status = 200, description = "Status", body = OutboxStatus),
        (status = 501, description = "The store has no outbox (Redis, etcd, ZooKeeper)", body = ProblemDocument, content_type = "application/problem+json"),
    )
)]
async fn outbox_status(
    State(service): State<Arc<Service>>,
    principal: Principal,
    Params(query): Params<OutboxQuery>,
) -> Result<Json<OutboxStatus>, Problem> {
    principal.require(Scope::OutboxRead)?;
    principal.require_all_tenants("the outbox")?;
    let limit = query.parked_limit.unwrap_or(20);
    if limit > 1000 {
        return Err(Problem::invalid(format!(
            "parked_limit is at most 1000; got {limit}"
        )));
    }
    let outbox = service.outbox()?;
    let status = service.timed("outbox_status", outbox.status(limit)).await?;
    Ok(Json(OutboxStatus {
        pending: status.pending,
        pending_keys: status.pending_keys,
        oldest_pending_ms: status.oldest_pending.map(ms),
        kept: status.kept,
        parked: status
            .parked
            .into_iter()
            .map(|parked| Parked {
                key: parked.key,
                attempts: parked.attempts,
                reason: parked.reason,
                pending: parked.pending,
            })
            .collect(),
    }))
}

/// Which parked key to redrive.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct RedriveRequest {
    /// The parked ordering key.
    #[schema(min_length = 1, max_length = 1024)]
    key: String,
}

/// Whether a key was parked.
#[derive(Serialize, ToSchema)]
pub(crate) struct Redriven {
    /// `true` if the key was parked and is delivered again from its head message.
    redriven: bool,
}

/// Delivers a parked key again from its head message (scope `outbox:write`).
#[utoipa::path(
    post, path = "/v1/outbox/redrive", tag = "outbox",
    request_body = RedriveRequest,
    responses(
        (status = 200, description = "Whether the key was parked", body = Redriven),
        (status = 501, description = "The store has no outbox", body = ProblemDocument, content_type = "application/problem+json"),
    )
)]
async fn redrive(
    State(service): State<Arc<Service>>,
    principal: Principal,
    Body(request): Body<RedriveRequest>,
) -> Result<Json<Redriven>, Problem> {
    principal.require(Scope::OutboxWrite)?;
    principal.require_all_tenants("the outbox")?;
    if request.key.is_empty() || request.key.len() > 1024 {
        return Err(Problem::invalid("key is 1 to 1024 bytes"));
    }
    let outbox = service.outbox()?;
    let redriven = service
        .timed("redrive", outbox.redrive(&request.key))
        .await?;
    if redriven {
        tracing::info!(key = %request.key, by = %principal.name, "outbox key redriven through the service");
    }
    Ok(Json(Redriven { redriven }))
}

// ---- dashboard ----

/// What the dashboard shows.
#[derive(Serialize, ToSchema)]
pub(crate) struct DashboardState {
    /// The store, with every credential hidden; shown to `admin` tokens only (others
    /// get `null`: a store's host and database are no tenant's business).
    store: Option<String>,
    /// The caller's token name and tenant.
    caller: String,
    /// Whether the caller may break locks.
    may_break: bool,
    /// Locks this instance handed out whose lease has not ended.
    held: Vec<HeldLock>,
    /// Elections campaigned through this instance: the current term and the ones
    /// before it.
    elections: Vec<ElectionView>,
    /// Recent losses, breaks and late releases, newest first.
    events: Vec<Event>,
    /// Idempotency outcomes per second (instance-wide; empty for tenant tokens).
    idempotency: Vec<IdempotencySecond>,
    /// Outbox samples (instance-wide; empty for tenant tokens or stores without one).
    outbox: Vec<OutboxSample>,
    /// Store latency per operation (instance-wide; empty for tenant tokens).
    latency: Vec<Latency>,
}

/// The dashboard's data (scope `locks:read`; a tenant token sees its own locks).
#[utoipa::path(
    get, path = "/v1/dashboard", tag = "service",
    responses((status = 200, description = "This instance's view", body = DashboardState))
)]
async fn dashboard(
    State(service): State<Arc<Service>>,
    principal: Principal,
) -> Result<Json<DashboardState>, Problem> {
    principal.require(Scope::LocksRead)?;
    let snapshot = service.activity.snapshot(principal.tenant.as_deref());
    Ok(Json(DashboardState {
        store: principal
            .allows(Scope::Admin)
            .then(|| service.locker.backend().describe()),
        caller: match &principal.tenant {
            Some(tenant) => format!("{} (tenant {tenant})", principal.name),
            None => principal.name.clone(),
        },
        may_break: principal.allows(Scope::LocksBreak),
        held: snapshot.held,
        elections: snapshot.elections,
        events: snapshot.events,
        idempotency: snapshot.idempotency,
        outbox: snapshot.outbox,
        latency: snapshot.latency,
    }))
}
