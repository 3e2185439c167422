//! Serving connections within bounds, so that no client can hold the service:
//!
//! - **Header and idle timeout**: a request's head must arrive within the timeout, and
//!   a kept-alive connection that sends no next request within it is closed (hyper's
//!   header read timeout, which runs from the moment a connection is idle). Half a
//!   request line held open forever, the slowloris attack, costs the attacker a
//!   reconnect every few seconds instead of a connection for good.
//! - **A cap on connections**: past `max_connections`, a new connection is served by a
//!   small fallback that answers `/healthz` (so that a load balancer sees the instance
//!   alive) and 503 with `Retry-After` to everything else, then closes; past the
//!   fallback's own cap, a connection is closed at once.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::problem::Problem;

/// How many connections past the cap are still answered (`/healthz`, 503).
const OVERFLOW_CONNECTIONS: usize = 256;

/// The bounds a service keeps.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    /// Connections served at once.
    pub(super) max_connections: usize,
    /// How long a request's head may take to arrive, and how long a kept-alive
    /// connection may wait for its next request.
    pub(super) header_timeout: Duration,
}

/// What a connection past the cap gets: `/healthz` still answers; everything else is
/// told to come back.
fn overflow() -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .fallback(|| async {
            let mut response = Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "too-many-connections",
                "Too many connections",
                "the service is at its connection limit (--max-connections); retry shortly",
            )
            .retry_after(1)
            .into_response();
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            response
        })
}

/// Serves `app` on the connections `listener` accepts until `shutdown`; then lets the
/// requests in flight finish (each connection closes after its current response).
pub(super) async fn serve<L>(
    mut listener: L,
    app: Router,
    limits: Limits,
    shutdown: CancellationToken,
) where
    L: axum::serve::Listener,
{
    let served = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let overflowing = Arc::new(Semaphore::new(OVERFLOW_CONNECTIONS));
    let overflow = overflow();
    let connections = TaskTracker::new();
    loop {
        let (io, _) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = shutdown.cancelled() => break,
        };
        let (router, permit, header_timeout) = match Arc::clone(&served).try_acquire_owned() {
            Ok(permit) => (app.clone(), permit, limits.header_timeout),
            Err(_) => match Arc::clone(&overflowing).try_acquire_owned() {
                Ok(permit) => {
                    metrics::counter!("turnstile_http_connections_refused_total", "answer" => "503")
                        .increment(1);
                    // A short leash: these are answered once and closed.
                    let timeout = limits.header_timeout.min(Duration::from_secs(2));
                    (overflow.clone(), permit, timeout)
                }
                Err(_) => {
                    metrics::counter!("turnstile_http_connections_refused_total", "answer" => "closed")
                        .increment(1);
                    drop(io);
                    continue;
                }
            },
        };
        let shutdown = shutdown.clone();
        connections.spawn(async move {
            let _permit = permit;
            let mut builder = http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .keep_alive(true);
            let connection =
                builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(router));
            tokio::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                () = shutdown.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    let _ = connection.await;
                }
            }
        });
    }
    connections.close();
    connections.wait().await;
}
