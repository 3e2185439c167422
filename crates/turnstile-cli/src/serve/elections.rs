//! Leader election over HTTP: a campaign is a long-poll that answers with a lease
//! (owner id and epoch) the caller extends, proclaims through and resigns, as it does a
//! lock's; anyone may read the leader once or follow it as server-sent events.
//!
//! An election is the lock of the same name ([`turnstile::election`]), so the same
//! bounds hold (`--max-ttl`, `--max-wait`, `--max-long-polls`,
//! `--max-locks-per-tenant`), the same scopes apply (`locks:write` to campaign,
//! `locks:read` to read and observe, `locks:break` to depose with
//! `DELETE /v1/locks/{name}`) and a tenant's elections are inside its own names.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures_util::Stream;
use serde::{Deserialize, Serialize};
use turnstile::ErrorKind;
use turnstile::election::Leader;
use turnstile::lock::OwnerId;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::Service;
use super::api::{
    Body, LockPath, PathName, extend_lease, lock_name, ms, release_lease, take_lease, whole_number,
};
use super::auth::{Principal, Scope};
use super::problem::{Problem, ProblemDocument};

/// `api`'s routes with the election routes added.
pub(crate) fn routes(api: OpenApiRouter<Arc<Service>>) -> OpenApiRouter<Arc<Service>> {
    api.routes(routes!(campaign))
        .routes(routes!(extend))
        .routes(routes!(proclaim))
        .routes(routes!(resign))
        .routes(routes!(leader))
        .routes(routes!(observe))
}

/// How often an observer's stream carries a comment when nothing changes, so that
/// proxies do not close it as idle.
const OBSERVE_KEEP_ALIVE: Duration = Duration::from_secs(15);

/// After the store failed an observer's read, the wait before the next one.
const OBSERVE_RETRY: Duration = Duration::from_secs(1);

/// How to campaign.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct CampaignRequest {
    /// What the leader advertises to everyone who reads the election (its address, an
    /// instance id): at most 16384 bytes, no NUL character. Default: empty. Only
    /// stores that keep values take a non-empty one (not MySQL, PostgreSQL session
    /// mode or RedLock).
    #[schema(max_length = 16384)]
    #[serde(default)]
    value: String,
    /// The leader's lease in milliseconds (default 30000): leadership ends this long
    /// after the campaign or the last extend.
    #[schema(minimum = 10, maximum = 31536000000_u64)]
    #[serde(default, deserialize_with = "whole_number")]
    ttl_ms: Option<u64>,
    /// How long to wait for the current leader's term to end, in milliseconds
    /// (default 0: answer at once); at most the service's `--max-wait`. Campaign again
    /// after an `election-led` answer.
    #[schema(minimum = 0)]
    #[serde(default, deserialize_with = "whole_number")]
    wait_ms: Option<u64>,
}

/// A leadership: what extending, proclaiming and resigning need, and the epoch to send
/// with every write the leader makes.
#[derive(Serialize, ToSchema)]
pub(crate) struct LeaderLease {
    /// The election's name, as the caller gave it.
    name: String,
    /// The leadership's owner id: the capability to extend, proclaim and resign. Keep
    /// it secret.
    owner: String,
    /// The epoch: the election lock's fencing token, larger than every earlier
    /// leader's. Send it with every write the leader makes; the protected resource
    /// refuses a smaller one than it has seen.
    epoch: u64,
    /// What the leader advertises.
    value: String,
    /// The lease in milliseconds: extend before it passes.
    ttl_ms: u64,
}

/// Campaigns to lead an election, waiting up to `wait_ms` for the current leader's term
/// to end. The leadership is a lease: extend it before `ttl_ms` passes, resign to hand
/// over at once.
#[utoipa::path(
    post, path = "/v1/elections/{name}/campaign", tag = "elections",
    params(LockPath),
    request_body = CampaignRequest,
    responses(
        (status = 200, description = "Leading", body = LeaderLease),
        (status = 409, description = "Another instance still led when the wait ended (`election-led`)", body = ProblemDocument, content_type = "application/problem+json"),
        (status = 400, description = "Invalid name, value or options", body = ProblemDocument, content_type = "application/problem+json"),
        (status = 501, description = "A value on a store that keeps none (`unsupported-store`): MySQL, PostgreSQL session mode, RedLock", body = ProblemDocument, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn campaign(
    State(service): State<Arc<Service>>,
    principal: Principal,
    PathName(name): PathName,
    Body(request): Body<CampaignRequest>,
) -> Result<Json<LeaderLease>, Problem> {
    principal.require(Scope::LocksWrite)?;
    let value = request.value;
    let taken = take_lease(
        &service,
        &principal,
        &name,
        request.ttl_ms,
        request.wait_ms,
        async |full, options| {
            let leadership = service.election.campaign(full, value.as_str(), &options);
            Ok(leadership.await?.into_guard())
        },
    )
    .await
    .map_err(|problem| {
        if problem.kind() == "lock-held" {
            Problem::new(
                StatusCode::CONFLICT,
                "election-led",
                "Led by another instance",
                format!(
                    "election {name:?} has a leader whose term had not ended when the wait \
                     did; campaign again (with wait_ms) to wait for it"
                ),
            )
            .with("name", name.clone())
        } else {
            problem
        }
    })?;
    let epoch = taken.lease.fencing_token.get();
    service.activity.elected(
        taken.full.as_str(),
        principal.tenant.as_deref(),
        &name,
        taken.lease.owner.as_str(),
        epoch,
        &value,
        taken.ttl,
    );
    Ok(Json(LeaderLease {
        name,
        owner: taken.lease.owner.to_hex(),
        epoch,
        value,
        ttl_ms: ms(taken.ttl),
    }))
}

/// Extends a leadership.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct LeaderExtendRequest {
    /// The owner id the campaign returned.
    #[schema(pattern = "^[0-9a-f]{32}$")]
    owner: String,
    /// The new lease in milliseconds from now (default 30000).
    #[schema(minimum = 10, maximum = 31536000000_u64)]
    #[serde(default, deserialize_with = "whole_number")]
    ttl_ms: Option<u64>,
}

/// An extended leadership.
#[derive(Serialize, ToSchema)]
pub(crate) struct LeaderExtended {
    /// The lease in milliseconds from now.
    ttl_ms: u64,
}

fn leadership_lost(name: &str, reason: impl std::fmt::Display) -> Problem {
    Problem::new(
        StatusCode::CONFLICT,
        "leadership-lost",
        "Leadership lost",
        format!(
            "election {name:?} is no longer led by you: {reason}; stop the leader's work and \
             campaign again"
        ),
    )
    .with("reason", reason.to_string())
}

/// Renews a leadership for `ttl_ms` from now. One that ran out or was broken is lost
/// (409 `leadership-lost`): the former leader must stop its work.
#[utoipa::path(
    post, path = "/v1/elections/{name}/extend", tag = "elections",
    params(LockPath),
    request_body = LeaderExtendRequest,
    responses(
        (status = 200, description = "Extended", body = LeaderExtended),
        (status = 409, description = "Lost: the lease ran out or another instance leads (`leadership-lost`)", body = ProblemDocument, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn extend(
    State(service): State<Arc<Service>>,
    principal: Principal,
    PathName(name): PathName,
    Body(request): Body<LeaderExtendRequest>,
) -> Result<Json<LeaderExtended>, Problem> {
    principal.require(Scope::LocksWrite)?;
    let full = lock_name(&principal, &name)?;
    let owner = OwnerId::parse(&request.owner)?;
    let ttl = service.lease("ttl_ms", request.ttl_ms)?;
    match extend_lease(&service, &principal, &full, &owner, ttl).await? {
        None => {
            service
                .activity
                .term_extended(full.as_str(), owner.as_str(), ttl);
            Ok(Json(LeaderExtended { ttl_ms: ms(ttl) }))
        }
        Some(reason) => {
            service
                .activity
                .term_ended(full.as_str(), Some(owner.as_str()), "deposed");
            Err(leadership_lost(&name, reason))
        }
    }
}

/// A new value for the leader to advertise.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ProclaimRequest {
    /// The owner id the campaign returned.
    #[schema(pattern = "^[0-9a-f]{32}$")]
    owner: String,
    /// The value: at most 16384 bytes, no NUL character.
    #[schema(max_length = 16384)]
    value: String,
}

/// What the leader advertises now.
#[derive(Serialize, ToSchema)]
pub(crate) struct Proclaimed {
    /// The value, as stored.
    value: String,
}

/// Changes what the leader advertises, in one step that applies only while the caller
/// leads: a deposed leader's proclaim is refused (409 `leadership-lost`) and writes
/// nothing. Observers are told.
#[utoipa::path(
    post, path = "/v1/elections/{name}/proclaim", tag = "elections",
    params(LockPath),
    request_body = ProclaimRequest,
    responses(
        (status = 200, description = "Advertised", body = Proclaimed),
        (status = 409, description = "The caller does not lead (`leadership-lost`)", body = ProblemDocument, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn proclaim(
    State(service): State<Arc<Service>>,
    principal: Principal,
    PathName(name): PathName,
    Body(request): Body<ProclaimRequest>,
) -> Result<Json<Proclaimed>, Problem> {
    principal.require(Scope::LocksWrite)?;
    let full = lock_name(&principal, &name)?;
    let owner = OwnerId::parse(&request.owner)?;
    let proclaimed = service
        .timed(
            "proclaim",
            service
                .election
                .proclaim_detached(&full, &owner, &request.value),
        )
        .await;
    match proclaimed {
        Ok(()) => {
            service
                .activity
                .proclaimed(full.as_str(), owner.as_str(), &request.value);
            Ok(Json(Proclaimed {
                value: request.value,
            }))
        }
        Err(error) if error.kind() == ErrorKind::LockLost => {
            service
                .activity
                .term_ended(full.as_str(), Some(owner.as_str()), "deposed");
            Err(leadership_lost(
                &name,
                "this owner id does not lead it (its lease ended, or it was broken)",
            ))
        }
        Err(error) => Err(Problem::from(error)),
    }
}

/// Resigns a leadership.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ResignRequest {
    /// The owner id the campaign returned.
    #[schema(pattern = "^[0-9a-f]{32}$")]
    owner: String,
}

/// What a resign found.
#[derive(Serialize, ToSchema)]
pub(crate) struct Resigned {
    /// `released` (the caller led and now nobody does: the next candidate is woken),
    /// `already_expired` (its lease had ended; nobody leads) or `held_by_other` (its
    /// lease had ended and another instance leads now; it was left alone).
    outcome: &'static str,
}

/// Stops leading, so that the next candidate takes over at once.
#[utoipa::path(
    post, path = "/v1/elections/{name}/resign", tag = "elections",
    params(LockPath),
    request_body = ResignRequest,
    responses((status = 200, description = "What the resign found", body = Resigned))
)]
pub(crate) async fn resign(
    State(service): State<Arc<Service>>,
    principal: Principal,
    PathName(name): PathName,
    Body(request): Body<ResignRequest>,
) -> Result<Json<Resigned>, Problem> {
    principal.require(Scope::LocksWrite)?;
    let full = lock_name(&principal, &name)?;
    let owner = OwnerId::parse(&request.owner)?;
    let outcome = release_lease(&service, &principal, &full, &owner).await?;
    let how = if outcome == "released" {
        "resigned"
    } else {
        "deposed"
    };
    service
        .activity
        .term_ended(full.as_str(), Some(owner.as_str()), how);
    Ok(Json(Resigned { outcome }))
}

/// Who leads an election.
#[derive(Serialize, ToSchema)]
pub(crate) struct LeaderStatus {
    /// The election's name, as the caller gave it.
    name: String,
    /// Whether someone leads.
    leading: bool,
    /// The first 8 hex digits of the leader's owner id.
    holder: Option<String>,
    /// The leader's epoch.
    epoch: Option<u64>,
    /// What the leader advertises (absent when it advertised nothing, or the store
    /// keeps no values).
    value: Option<String>,
    /// How long the leader's lease has left, by the store's clock (absent on stores
    /// that do not say).
    lease_left_ms: Option<u64>,
    /// Unix time in milliseconds when this instance first saw this leader (for a
    /// one-off read, when it read it).
    seen_since_ms: Option<u64>,
}

fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH).map_or(0, ms)
}

fn leader_status(name: String, leader: Option<Leader>) -> LeaderStatus {
    match leader {
        Some(leader) => LeaderStatus {
            name,
            leading: true,
            holder: Some(leader.owner.chars().take(8).collect()),
            epoch: leader.epoch.map(|epoch| epoch.get()),
            value: leader.value,
            lease_left_ms: leader.remaining_ttl.map(ms),
            seen_since_ms: Some(unix_ms(leader.seen_since)),
        },
        None => LeaderStatus {
            name,
            leading: false,
            holder: None,
            epoch: None,
            value: None,
            lease_left_ms: None,
            seen_since_ms: None,
        },
    }
}

/// Who leads an election now: one read of the store.
#[utoipa::path(
    get, path = "/v1/elections/{name}", tag = "elections",
    params(LockPath),
    responses((status = 200, description = "The election's leader", body = LeaderStatus))
)]
pub(crate) async fn leader(
    State(service): State<Arc<Service>>,
    principal: Principal,
    PathName(name): PathName,
) -> Result<Json<LeaderStatus>, Problem> {
    principal.require(Scope::LocksRead)?;
    let full = lock_name(&principal, &name)?;
    let leader = service
        .timed("leader", service.election.leader(&full))
        .await?;
    Ok(Json(leader_status(name, leader)))
}

/// Follows an election as server-sent events: a `leader` event at once with who leads
/// now, then one at every change (a new leader, a new value, nobody leading), each a
/// `LeaderStatus` document with the event's number as its `id`. When the store cannot
/// be read, an `error` event carries a problem document and the stream goes on trying
/// every second. The stream ends when the service shuts down; at most
/// `--max-observers` streams are open at once (503 past it).
#[utoipa::path(
    get, path = "/v1/elections/{name}/observe", tag = "elections",
    params(LockPath),
    responses(
        (status = 200, description = "A stream of `leader` events (text/event-stream), each a LeaderStatus document", content_type = "text/event-stream", body = String),
        (status = 503, description = "At the limit of open streams (`too-many-observers`), or shutting down", body = ProblemDocument, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn observe(
    State(service): State<Arc<Service>>,
    principal: Principal,
    PathName(name): PathName,
) -> Result<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>, Problem> {
    principal.require(Scope::LocksRead)?;
    let full = lock_name(&principal, &name)?;
    let Ok(permit) = Arc::clone(&service.observers).try_acquire_owned() else {
        metrics::counter!("turnstile_serve_observers_refused_total").increment(1);
        return Err(Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "too-many-observers",
            "Too many observers",
            "the service is at its limit of open election streams (--max-observers); retry \
             shortly, or read GET /v1/elections/{name} instead",
        )
        .retry_after(1));
    };
    if service.shutdown.is_cancelled() {
        return Err(Problem::shutting_down());
    }
    let watch = service.election.observe(full).await?;
    let observer = Observer {
        service: Arc::clone(&service),
        name,
        watch,
        sent: 0,
        failed: false,
        _permit: permit,
    };
    let events = futures_util::stream::unfold(observer, Observer::next);
    Ok(Sse::new(events).keep_alive(KeepAlive::new().interval(OBSERVE_KEEP_ALIVE)))
}

/// One open stream of [`observe`]: its election's watch and the permit it holds.
struct Observer {
    service: Arc<Service>,
    /// The name as the caller gave it.
    name: String,
    watch: turnstile::election::LeaderWatch,
    sent: u64,
    /// The last read failed: wait before the next.
    failed: bool,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Observer {
    /// The stream's next event; `None` ends it (the service shuts down).
    async fn next(mut self) -> Option<(Result<SseEvent, Infallible>, Self)> {
        if self.failed {
            tokio::select! {
                () = tokio::time::sleep(OBSERVE_RETRY) => {}
                () = self.service.shutdown.cancelled() => return None,
            }
        }
        let changed = tokio::select! {
            changed = self.watch.changed() => changed,
            () = self.service.shutdown.cancelled() => return None,
        };
        self.sent += 1;
        self.failed = changed.is_err();
        let event = match changed {
            Ok(leader) => SseEvent::default()
                .event("leader")
                .id(self.sent.to_string())
                .json_data(leader_status(self.name.clone(), leader)),
            Err(error) => {
                let problem = Problem::from(error);
                let document = serde_json::json!({
                    "type": format!("/problems/{}", problem.kind()),
                    "detail": "the store could not be read; the stream tries again every second",
                });
                SseEvent::default()
                    .event("error")
                    .id(self.sent.to_string())
                    .json_data(document)
            }
        };
        // A document that cannot be written as JSON (it always can) ends the stream
        // rather than sending a broken event.
        let event = event.ok()?;
        Some((Ok(event), self))
    }
}
