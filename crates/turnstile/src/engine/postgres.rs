//! PostgreSQL: connection settings, bounded pools, the database clock, and the `LISTEN`
//! connection that carries release and completion notifications.

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions};
use tokio::sync::OnceCell;

use crate::error::{Error, ErrorKind, Result};
use crate::notify::ReleaseSignals;

/// The database clock in microseconds since the Unix epoch: the floor of new tokens.
pub(crate) const CLOCK_US: &str = "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000)::int8";

/// The driver's options for `url`, with `synchronous_commit` on whatever the server's
/// default: a token or a stored outcome must be on disk before anyone learns of it.
pub(crate) fn connect_options(url: &str) -> Result<PgConnectOptions> {
    let options = PgConnectOptions::from_str(url).map_err(|error| {
        Error::new(
            ErrorKind::InvalidUrl,
            format!(
                "{} is not a valid PostgreSQL URL (postgres://user[:password]@host[:port]/database)",
                crate::url::redact(url)
            ),
        )
        .with_source(error)
    })?;
    Ok(options.options([("synchronous_commit", "on")]))
}

/// A pool that connects on first use.
pub(crate) fn lazy_pool(options: PgConnectOptions, max: u32, timeout: Duration) -> PgPool {
    PgPoolOptions::new()
        .max_connections(max.max(1))
        .min_connections(0)
        .acquire_timeout(timeout)
        .connect_lazy_with(options)
}

/// The pool for a store's own statements, connected now (so a wrong URL or password is
/// reported at once, with its cause): no statement waits long for a row lock (250 ms;
/// an application's transaction may hold one) or runs long (10 s), so the callers' own
/// bounds stay in charge. `pool` is sqlx's default ([`PgPoolOptions::new`]) or
/// [`crate::sql::pool_options`] for a store that sends its statements again when their
/// connection turns out gone.
pub(crate) async fn open_bounded_pool(
    pool: PgPoolOptions,
    options: PgConnectOptions,
    max: u32,
    timeout: Duration,
    redacted: &str,
) -> Result<PgPool> {
    let options = options.options([("lock_timeout", "250"), ("statement_timeout", "10000")]);
    match pool
        .max_connections(max.max(1))
        .acquire_timeout(timeout)
        .connect_with(options.clone())
        .await
    {
        Ok(pool) => Ok(pool),
        Err(error) => {
            let what = format!("cannot connect to PostgreSQL at {redacted}");
            Err(crate::sql::connect_failure(error, &options, &what, timeout).await)
        }
    }
}

/// The `LISTEN` side of a store: its own connection (outside the store's pool, and
/// outside an application's pool given to `from_pool`), a task that keeps it up, and
/// the task's end when the last clone of the store is dropped.
pub(crate) struct Listener {
    pool: PgPool,
    state: Arc<ListenerState>,
    started: OnceCell<()>,
    task: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

#[derive(Default)]
struct ListenerState {
    listening: AtomicBool,
    received: AtomicU64,
}

impl Listener {
    pub(crate) fn new(connect_options: PgConnectOptions, connect_timeout: Duration) -> Listener {
        Listener {
            pool: lazy_pool(connect_options, 1, connect_timeout),
            state: Arc::default(),
            started: OnceCell::new(),
            task: std::sync::Mutex::new(None),
        }
    }

    /// Starts listening on `channel` on first use, delivering each notification's
    /// payload to `signals`; says whether it is listening now (callers poll while it is
    /// not).
    pub(crate) async fn ensure(&self, channel: &str, signals: &ReleaseSignals) -> bool {
        self.started
            .get_or_init(|| async {
                // The first connection is made here, so the first waiter already knows
                // whether it will be notified; later ones are the task's business.
                let first = listen(&self.pool, channel).await;
                self.state.listening.store(first.is_ok(), Ordering::SeqCst);
                let task = tokio::spawn(keep_listening(
                    first,
                    self.pool.clone(),
                    channel.to_owned(),
                    Arc::clone(&self.state),
                    signals.clone(),
                ));
                *self.task.lock().unwrap_or_else(|p| p.into_inner()) = Some(task);
            })
            .await;
        self.is_listening()
    }

    /// Whether the connection is up now.
    pub(crate) fn is_listening(&self) -> bool {
        self.state.listening.load(Ordering::SeqCst)
    }

    /// How many notifications it has delivered.
    pub(crate) fn received(&self) -> u64 {
        self.state.received.load(Ordering::Relaxed)
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Some(task) = self
            .task
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            task.abort();
        }
    }
}

async fn listen(pool: &PgPool, channel: &str) -> std::result::Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(channel).await?;
    Ok(listener)
}

/// Delivers notifications to waiters; when the connection fails, wakes every waiter
/// (notifications may have been missed) and reconnects with a backoff from 100 ms to
/// 30 s. Waiters poll while it is down.
async fn keep_listening(
    mut attempt: std::result::Result<PgListener, sqlx::Error>,
    pool: PgPool,
    channel: String,
    state: Arc<ListenerState>,
    signals: ReleaseSignals,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        match attempt {
            Ok(mut listener) => {
                state.listening.store(true, Ordering::SeqCst);
                backoff = Duration::from_millis(100);
                loop {
                    match listener.try_recv().await {
                        Ok(Some(notification)) => {
                            state.received.fetch_add(1, Ordering::Relaxed);
                            metrics::counter!("turnstile_notifications_total", "store" => "postgres")
                                .increment(1);
                            signals.notify(notification.payload());
                        }
                        // The connection dropped, and sqlx has connected and listened
                        // again before saying so (its eager reconnect, the default).
                        // Notifications sent in between were missed, so everyone
                        // re-checks now that new ones will be heard.
                        Ok(None) => signals.notify_all(),
                        Err(error) => {
                            tracing::warn!(
                                %error,
                                channel,
                                "the PostgreSQL LISTEN connection failed; waiters poll until it is back"
                            );
                            break;
                        }
                    }
                }
                state.listening.store(false, Ordering::SeqCst);
                // Close every watch rather than only waking it: a waiter that kept its
                // notified watch would re-check once and then sleep through releases it
                // can no longer hear of (until the holder's lease ends). Closed, it
                // subscribes again and gets a polling watch while this is down.
                signals.close_all();
            }
            Err(error) => tracing::warn!(
                %error,
                channel,
                retry_in = ?backoff,
                "cannot LISTEN for notifications; waiters poll until it works"
            ),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(30));
        attempt = listen(&pool, &channel).await;
    }
}
