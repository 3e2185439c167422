//! Errors of the HTTP layer as `application/problem+json` (RFC 9457), with stable
//! `type` values.

use std::time::Duration;

use axum::body::Body;
use http::{HeaderValue, Response, StatusCode, header};

/// The `type` of each problem the layer answers with. Stable: clients may match on them.
pub mod types {
    /// 401: the service found no tenant or principal (scope) for the request.
    pub const SCOPE_MISSING: &str = "urn:turnstile:problem:idempotency-scope-missing";
    /// 400: the route requires an `Idempotency-Key` and the request has none.
    pub const KEY_MISSING: &str = "urn:turnstile:problem:idempotency-key-missing";
    /// 400: the `Idempotency-Key` header is not a valid key.
    pub const KEY_MALFORMED: &str = "urn:turnstile:problem:idempotency-key-malformed";
    /// 422: the key was used before for a request with another fingerprint.
    pub const KEY_REUSED: &str = "urn:turnstile:problem:idempotency-key-reused";
    /// 409: a request with this key is still being processed; retry after `Retry-After`.
    pub const KEY_IN_USE: &str = "urn:turnstile:problem:idempotency-key-in-use";
    /// 503: the idempotency store is unreachable; retry after `Retry-After`. The
    /// handler did not run.
    pub const STORE_UNAVAILABLE: &str = "urn:turnstile:problem:idempotency-store-unavailable";
    /// 413: the request body is larger than the layer reads to fingerprint it.
    pub const REQUEST_TOO_LARGE: &str = "urn:turnstile:problem:request-body-too-large";
    /// 422: the first response to this key was too large to store, so it cannot be
    /// replayed; the request was processed once.
    pub const NOT_REPLAYABLE: &str = "urn:turnstile:problem:idempotency-response-not-stored";
    /// 422 for a repeat (500 for the first attempt): the first request's handler ran but
    /// did not finish as a response — it panicked, its response body broke off half
    /// way, or a timeout layer inside the idempotency layer cut it off (408). Its effects
    /// may or may not have happened, so it is not run again under this key: check what
    /// happened, then use a new key for a new request. (In the same-transaction mode the
    /// rollback undid the handler's writes and the key is given back instead.)
    pub const OUTCOME_UNKNOWN: &str = "urn:turnstile:problem:idempotency-outcome-unknown";
    /// 400: the request body could not be read (the client broke it off or sent it
    /// malformed).
    pub const REQUEST_BODY_UNREADABLE: &str = "urn:turnstile:problem:request-body-unreadable";
    /// 503: the claim on the key was lost while the handler ran (renewals failed); the
    /// handler was cancelled. Retry with the same key.
    pub const CLAIM_LOST: &str = "urn:turnstile:problem:idempotency-claim-lost";
    /// 500: the handler asks for an
    /// [`IdempotentTransaction`](super::super::IdempotentTransaction), but its route's
    /// layer has no transactions for that database (or the request has no key).
    pub const NO_TRANSACTION: &str = "urn:turnstile:problem:idempotency-no-transaction";
}

/// A problem response: `type`, `title`, `status`, `detail`, and `Retry-After` when
/// given.
pub(crate) fn problem(
    status: StatusCode,
    kind: &str,
    title: &str,
    detail: &str,
    retry_after: Option<Duration>,
) -> Response<Body> {
    let body = serde_json::json!({
        "type": kind,
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut response = Response::new(Body::from(body.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    if let Some(after) = retry_after {
        // Whole seconds, rounded up, at least one.
        let seconds = after.as_secs() + u64::from(after.subsec_nanos() > 0);
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(seconds.max(1)));
    }
    response
}
