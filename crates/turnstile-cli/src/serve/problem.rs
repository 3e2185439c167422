//! Errors as `application/problem+json` (RFC 9457): a stable `type` per kind of
//! failure that clients can branch on, a sentence for people, and extra members where a
//! client needs them (`retry_after_ms`, `reason`).

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::{Map, Value};
use turnstile::ErrorKind;
use utoipa::ToSchema;

/// The media type of every error response.
pub(crate) const PROBLEM_JSON: &str = "application/problem+json";

/// An error response (boxed: it travels in every handler's `Result`).
#[derive(Debug)]
pub(crate) struct Problem(Box<Fields>);

#[derive(Debug)]
struct Fields {
    status: StatusCode,
    kind: &'static str,
    title: &'static str,
    detail: String,
    extra: Map<String, Value>,
    retry_after_secs: Option<u64>,
    challenge: bool,
}

/// The body of an error response, as the OpenAPI document describes it.
#[derive(Serialize, ToSchema)]
pub(crate) struct ProblemDocument {
    /// A relative URI naming the kind of failure, e.g. `/problems/lock-held`; stable, for
    /// clients to branch on.
    #[serde(rename = "type")]
    kind: String,
    /// The kind of failure in a few words.
    title: String,
    /// The HTTP status code.
    status: u16,
    /// What went wrong with this request, and what to do about it.
    detail: String,
}

impl Problem {
    pub(crate) fn new(
        status: StatusCode,
        kind: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Self {
        Problem(Box::new(Fields {
            status,
            kind,
            title,
            detail: detail.into(),
            extra: Map::new(),
            retry_after_secs: None,
            challenge: false,
        }))
    }

    /// A 400 for a request that is malformed or out of range.
    pub(crate) fn invalid(detail: impl Into<String>) -> Self {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "invalid-request",
            "Invalid request",
            detail,
        )
    }

    /// A 401: no token, or one the service does not know.
    pub(crate) fn unauthenticated(detail: impl Into<String>) -> Self {
        let mut problem = Problem::new(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            "Authentication required",
            detail,
        );
        problem.0.challenge = true;
        problem
    }

    /// A 403: the token lacks a scope.
    pub(crate) fn forbidden(detail: impl Into<String>) -> Self {
        Problem::new(StatusCode::FORBIDDEN, "forbidden", "Not allowed", detail)
    }

    /// A 503 for a service that is shutting down.
    pub(crate) fn shutting_down() -> Self {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "shutting-down",
            "Shutting down",
            "this instance is shutting down; retry (another instance, or this one after its restart)",
        )
        .retry_after(1)
    }

    /// Adds a member to the document.
    pub(crate) fn with(mut self, name: &str, value: impl Into<Value>) -> Self {
        self.0.extra.insert(name.to_owned(), value.into());
        self
    }

    /// The kind of failure (the last part of `type`).
    pub(crate) fn kind(&self) -> &'static str {
        self.0.kind
    }

    /// Sets `Retry-After` (seconds).
    pub(crate) fn retry_after(mut self, secs: u64) -> Self {
        self.0.retry_after_secs = Some(secs);
        self
    }
}

/// What a client is told of a store's own error: not the driver's text (it names
/// tables, hosts and users), but an id under which the whole error is logged.
fn logged(error: &turnstile::Error, what: &str) -> String {
    let id = format!("{:016x}", rand::random::<u64>());
    tracing::warn!(error_id = %id, %error, "{what}");
    format!("{what}; the service's log has the cause under error id {id}")
}

impl From<turnstile::Error> for Problem {
    fn from(error: turnstile::Error) -> Self {
        let detail = match error.kind() {
            ErrorKind::StoreUnavailable => logged(&error, "the store did not answer"),
            ErrorKind::Configuration => logged(&error, "the store refused the service"),
            ErrorKind::Store => logged(&error, "the store answered with an error"),
            _ => error.to_string(),
        };
        match error.kind() {
            ErrorKind::InvalidName | ErrorKind::InvalidOptions | ErrorKind::InvalidUrl => {
                Problem::invalid(detail)
            }
            ErrorKind::AcquireTimeout | ErrorKind::Held => {
                Problem::new(StatusCode::CONFLICT, "lock-held", "Lock held", detail)
            }
            ErrorKind::InProgress => Problem::new(
                StatusCode::CONFLICT,
                "in-progress",
                "Request in progress",
                detail,
            ),
            ErrorKind::KeyMismatch => Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "key-mismatch",
                "Idempotency key reused",
                detail,
            ),
            ErrorKind::UnsupportedStore => Problem::new(
                StatusCode::NOT_IMPLEMENTED,
                "unsupported-store",
                "Not supported by this store",
                detail,
            ),
            ErrorKind::StoreUnavailable => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store-unavailable",
                "Store unavailable",
                detail,
            )
            .retry_after(1),
            ErrorKind::Configuration => Problem::new(
                StatusCode::BAD_GATEWAY,
                "store-configuration",
                "Store refused the service",
                detail,
            ),
            _ => Problem::new(
                StatusCode::BAD_GATEWAY,
                "store-error",
                "Store error",
                detail,
            ),
        }
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let problem = *self.0;
        let mut body = Map::new();
        body.insert("type".into(), format!("/problems/{}", problem.kind).into());
        body.insert("title".into(), problem.title.into());
        body.insert("status".into(), problem.status.as_u16().into());
        body.insert("detail".into(), problem.detail.into());
        body.extend(problem.extra);
        let mut response = (problem.status, Value::Object(body).to_string()).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(secs) = problem.retry_after_secs {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if problem.challenge {
            headers.insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"turnstile\""),
            );
        }
        response
    }
}
