//! Redis: opening clients (TLS included), multiplexed connections with timeouts, error
//! mapping, and the shared Pub/Sub connection that carries release and completion
//! notifications.

use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use redis::Client;
use redis::aio::{ConnectionManager, ConnectionManagerConfig, PubSubSink};

use crate::error::{Error, ErrorKind, Result};
use crate::notify::{ReleaseSignals, ReleaseWatch};

/// Maps a driver error: connection trouble is [`ErrorKind::StoreUnavailable`]; a
/// refused password or a missing ACL permission is [`ErrorKind::Configuration`].
pub(crate) fn map_error(error: redis::RedisError, context: &str) -> Error {
    if error.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(error.code(), Some("NOPERM" | "WRONGPASS" | "NOAUTH"))
    {
        let message = format!("{context}: Redis refused this client ({error})");
        return Error::new(ErrorKind::Configuration, message).with_quiet_source(error);
    }
    let kind = if error.is_io_error()
        || error.is_timeout()
        || error.is_connection_refusal()
        || error.is_connection_dropped()
        || is_transient_refusal(&error)
    {
        ErrorKind::StoreUnavailable
    } else {
        ErrorKind::Store
    };
    Error::new(kind, context.to_owned()).with_source(error)
}

/// Whether Redis refused the command for now rather than for good: a script running too
/// long (`BUSY`), a dataset loading (`LOADING`), a replica or a primary cut off from its
/// replicas refusing writes (`READONLY`, `MASTERDOWN`, `NOREPLICAS`, `MISCONF` after a
/// failed save), memory full under `noeviction` (`OOM`), a cluster resharding or down
/// (`TRYAGAIN`, `CLUSTERDOWN`). The same command can succeed when tried again, so every
/// pillar treats these like a store that cannot be reached for a moment. A script's
/// refused write reaches the client as the script's error, whose text carries the
/// server's code, so that is looked at too.
fn is_transient_refusal(error: &redis::RedisError) -> bool {
    const TRANSIENT: [&str; 9] = [
        "BUSY",
        "LOADING",
        "READONLY",
        "MASTERDOWN",
        "NOREPLICAS",
        "MISCONF",
        "OOM",
        "TRYAGAIN",
        "CLUSTERDOWN",
    ];
    if error.code().is_some_and(|code| TRANSIENT.contains(&code)) {
        return true;
    }
    // A refusal inside a pipeline or a transaction reaches the client as a list of the
    // commands' errors, whose first one alone gives `code()` (and only when the driver
    // knows its code: not `OOM`).
    if let Some(errors) = error.clone().into_server_errors()
        && errors
            .iter()
            .any(|(_, error)| TRANSIENT.contains(&error.code()))
    {
        return true;
    }
    // A Lua `redis.call` that meets one may fail the script with the code after a dash
    // (`@user_script:12: -READONLY You can't write ...`).
    let text = error.to_string();
    TRANSIENT
        .iter()
        .any(|code| text.contains(&format!("-{code} ")))
}

/// Opens a client for a `redis://` or `rediss://` URL, checking it first.
pub(crate) fn open_client(url: &str, tls_root_certificate: Option<&[u8]>) -> Result<Client> {
    let invalid = |error: redis::RedisError| {
        Error::new(
            ErrorKind::InvalidUrl,
            format!(
                "{} is not a valid Redis URL (expected redis://[user:password@]host[:port][/db])",
                crate::url::redact(url)
            ),
        )
        .with_source(error)
    };
    if url.starts_with("rediss://") {
        #[cfg(feature = "redis-tls")]
        {
            // rustls needs a process-wide crypto provider; another part of the program
            // may have installed one already, which is just as good.
            let _ = rustls::crypto::ring::default_provider().install_default();
            if let Some(pem) = tls_root_certificate {
                let certificates = redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem.to_vec()),
                };
                return Client::build_with_tls(url, certificates).map_err(invalid);
            }
        }
        #[cfg(not(feature = "redis-tls"))]
        {
            let _ = tls_root_certificate;
            return Err(Error::new(
                ErrorKind::UnsupportedStore,
                format!(
                    "{} needs TLS: build turnstile with the `redis-tls` feature",
                    crate::url::redact(url)
                ),
            ));
        }
    }
    Client::open(url).map_err(invalid)
}

/// Connects a multiplexed, self-reconnecting connection within `connect_timeout`.
pub(crate) async fn connect_manager(
    client: Client,
    url: &str,
    connect_timeout: Duration,
    response_timeout: Duration,
) -> Result<ConnectionManager> {
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(connect_timeout))
        .set_response_timeout(Some(response_timeout))
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_millis(500));
    let unavailable = || {
        Error::new(
            ErrorKind::StoreUnavailable,
            format!(
                "cannot reach Redis at {} within {connect_timeout:?}; is it running?",
                crate::url::redact(url)
            ),
        )
    };
    match tokio::time::timeout(
        connect_timeout * 2,
        client.get_connection_manager_with_config(config),
    )
    .await
    {
        Ok(Ok(connection)) => Ok(connection),
        // A certificate this client does not trust is not going to change on a retry.
        Ok(Err(error)) if is_untrusted_certificate(&error) => Err(Error::new(
            ErrorKind::Configuration,
            format!(
                "Redis at {} presented a TLS certificate this client does not trust; give the \
                 CA with SSL_CERT_FILE or RedisLockConfig::tls_root_certificate",
                crate::url::redact(url)
            ),
        )
        .with_source(error)),
        Ok(Err(error))
            if error.is_io_error() || error.is_timeout() || error.is_connection_refusal() =>
        {
            Err(unavailable().with_source(error))
        }
        Ok(Err(error)) => Err(map_error(
            error,
            &format!("cannot connect to Redis at {}", crate::url::redact(url)),
        )),
        Err(_) => Err(unavailable()),
    }
}

/// Whether a connection failed because the server's TLS certificate is not trusted
/// (rustls reports it through an I/O error, so only its text tells).
fn is_untrusted_certificate(error: &redis::RedisError) -> bool {
    let text = error.to_string();
    text.contains("invalid peer certificate")
        || text.contains("UnknownIssuer")
        || text.contains("certificate verify failed")
}

/// One Pub/Sub connection per store, shared by every waiter, reconnected on demand.
pub(crate) struct Notifier {
    client: std::sync::Mutex<Client>,
    connect_timeout: Duration,
    response_timeout: Duration,
    signals: ReleaseSignals,
    sink: tokio::sync::Mutex<Option<(u64, PubSubSink)>>,
    generation: std::sync::atomic::AtomicU64,
}

impl Notifier {
    /// Whether a waiter of this store listens on `channel` (so that a release's
    /// notification reaches this store's own connection too).
    pub(crate) fn is_watched(&self, channel: &str) -> bool {
        self.signals.is_watched(channel)
    }

    pub(crate) fn new(
        client: Client,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> Arc<Notifier> {
        Arc::new_cyclic(|weak: &Weak<Notifier>| {
            let weak = weak.clone();
            Notifier {
                client: std::sync::Mutex::new(client),
                connect_timeout,
                response_timeout,
                signals: ReleaseSignals::with_idle_hook(move |channel| {
                    if let (Some(notifier), Ok(runtime)) =
                        (weak.upgrade(), tokio::runtime::Handle::try_current())
                    {
                        let channel = channel.to_owned();
                        runtime.spawn(async move { notifier.unsubscribe(channel).await });
                    }
                }),
                sink: tokio::sync::Mutex::new(None),
                generation: std::sync::atomic::AtomicU64::new(0),
            }
        })
    }

    pub(crate) async fn watch(self: &Arc<Self>, channel: String) -> Result<ReleaseWatch> {
        let mut sink = self.sink.lock().await;
        if sink.is_none() {
            *sink = Some(self.connect().await?);
        }
        let (watch, first) = self.signals.watch(&channel);
        if first {
            let Some((_, live)) = sink.as_mut() else {
                unreachable!("connected above");
            };
            // Bounded: the notifier's mutex is held meanwhile, and every waiter of this
            // store needs it.
            let error =
                match tokio::time::timeout(self.response_timeout, live.subscribe(&channel)).await {
                    Ok(Ok(())) => return Ok(watch),
                    Ok(Err(error)) => map_error(error, "cannot subscribe to lock releases"),
                    Err(_) => Error::new(
                        ErrorKind::StoreUnavailable,
                        format!(
                            "Redis did not confirm the subscription to lock releases within {:?}",
                            self.response_timeout
                        ),
                    ),
                };
            self.discard(&mut sink);
            return Err(error);
        }
        Ok(watch)
    }

    async fn unsubscribe(&self, channel: String) {
        let mut sink = self.sink.lock().await;
        // Someone may have started watching again since the last watch was dropped.
        if self.signals.is_watched(&channel) {
            return;
        }
        if let Some((_, live)) = sink.as_mut()
            && !matches!(
                tokio::time::timeout(self.response_timeout, live.unsubscribe(&channel)).await,
                Ok(Ok(()))
            )
        {
            self.discard(&mut sink);
        }
    }

    /// Forgets a Pub/Sub connection that failed, and closes every watch: the channels
    /// subscribed on it are no longer heard, so their waiters must subscribe again on a
    /// new connection (they see their watch closed and do).
    fn discard(&self, sink: &mut Option<(u64, PubSubSink)>) {
        *sink = None;
        self.signals.close_all();
    }

    /// Listens on `client`'s server from now on (a new master after a failover): the
    /// current connection goes, and every watch closes so that waiters subscribe again.
    pub(crate) async fn move_to(&self, client: Client) {
        *self
            .client
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = client;
        let mut sink = self.sink.lock().await;
        self.discard(&mut sink);
    }

    async fn connect(self: &Arc<Self>) -> Result<(u64, PubSubSink)> {
        let client = self
            .client
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let pubsub = tokio::time::timeout(self.connect_timeout, client.get_async_pubsub())
            .await
            .map_err(|_| {
                Error::new(
                    ErrorKind::StoreUnavailable,
                    "timed out opening the Redis Pub/Sub connection",
                )
            })?
            .map_err(|error| map_error(error, "cannot open the Redis Pub/Sub connection"))?;
        let (sink, mut stream) = pubsub.split();
        let generation = self
            .generation
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        let notifier = Arc::downgrade(self);
        let signals = self.signals.clone();
        tokio::spawn(async move {
            while let Some(message) = stream.next().await {
                signals.notify(message.get_channel_name());
            }
            // The connection is gone: forget it, then close every watch so waiters
            // subscribe again on a new connection.
            if let Some(notifier) = notifier.upgrade() {
                let mut sink = notifier.sink.lock().await;
                if sink
                    .as_ref()
                    .is_some_and(|(current, _)| *current == generation)
                {
                    notifier.discard(&mut sink);
                }
            }
        });
        Ok((generation, sink))
    }
}

/// A connection to one Redis server (self-reconnecting), or to a Redis Cluster (which
/// routes each command by its keys' slot and follows `MOVED` and failovers).
#[derive(Clone)]
pub enum RedisConnection {
    /// One server.
    Single(ConnectionManager),
    /// A cluster.
    Cluster(redis::cluster_async::ClusterConnection),
    /// The master that Redis Sentinel names, found again after a failover.
    Sentinel(Arc<SentinelConnection>),
}

impl std::fmt::Debug for RedisConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RedisConnection::Single(_) => "RedisConnection::Single",
            RedisConnection::Cluster(_) => "RedisConnection::Cluster",
            RedisConnection::Sentinel(_) => "RedisConnection::Sentinel",
        })
    }
}

impl redis::aio::ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            RedisConnection::Single(connection) => connection.req_packed_command(cmd),
            RedisConnection::Cluster(connection) => connection.req_packed_command(cmd),
            RedisConnection::Sentinel(connection) => {
                let connection = Arc::clone(connection);
                Box::pin(async move { connection.send(cmd).await })
            }
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            RedisConnection::Single(connection) => {
                connection.req_packed_commands(pipeline, offset, count)
            }
            RedisConnection::Cluster(connection) => {
                connection.req_packed_commands(pipeline, offset, count)
            }
            RedisConnection::Sentinel(connection) => {
                let mut current = connection.current();
                Box::pin(async move { current.req_packed_commands(pipeline, offset, count).await })
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConnection::Single(connection) => connection.get_db(),
            RedisConnection::Cluster(connection) => connection.get_db(),
            RedisConnection::Sentinel(connection) => connection.current().get_db(),
        }
    }
}

/// A connection to the master that Redis Sentinel names. A command that fails because
/// that server is gone or no longer a master (`READONLY` after a failover) makes it ask
/// the sentinels again, connect to the master they name now, and send the command once
/// more there; the Pub/Sub notifier follows too.
pub struct SentinelConnection {
    sentinels: Vec<String>,
    master_name: String,
    /// One discovery at a time.
    discovering: tokio::sync::Mutex<()>,
    current: std::sync::Mutex<(u64, ConnectionManager)>,
    notifier: std::sync::Mutex<Option<Weak<Notifier>>>,
    described: String,
    connect_timeout: Duration,
    response_timeout: Duration,
}

/// Sentinel's client protocol: the first sentinel that answers names the master
/// (`SENTINEL get-master-addr-by-name`), and that server must say it is a master
/// (`ROLE`) — during a failover the named one may still be the old master, or gone.
async fn discover_master(
    sentinels: &[String],
    master_name: &str,
    described: &str,
    connect_timeout: Duration,
) -> Result<Client> {
    let mut last_error = None;
    for sentinel in sentinels {
        let attempt = async {
            let client = Client::open(format!("redis://{sentinel}"))?;
            let mut connection = client.get_multiplexed_async_connection().await?;
            let address: Option<(String, u16)> = redis::cmd("SENTINEL")
                .arg("get-master-addr-by-name")
                .arg(master_name)
                .query_async(&mut connection)
                .await?;
            let Some((host, port)) = address else {
                return Ok(None);
            };
            let master = Client::open(format!("redis://{host}:{port}"))?;
            let mut connection = master.get_multiplexed_async_connection().await?;
            let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(&mut connection).await?;
            let is_master = matches!(role.first(), Some(redis::Value::BulkString(role)) if role == b"master")
                || matches!(role.first(), Some(redis::Value::SimpleString(role)) if role == "master");
            Ok::<_, redis::RedisError>(is_master.then_some(master))
        };
        match tokio::time::timeout(connect_timeout, attempt).await {
            Ok(Ok(Some(master))) => return Ok(master),
            Ok(Ok(None)) => {}
            Ok(Err(error)) => last_error = Some(error),
            Err(_) => {}
        }
    }
    let message = format!("the sentinels at {described} named no reachable master");
    Err(match last_error {
        Some(error) => Error::new(ErrorKind::StoreUnavailable, message).with_source(error),
        None => Error::new(ErrorKind::StoreUnavailable, message),
    })
}

/// Finds the master the sentinels name and opens a self-reconnecting connection to it.
async fn open_master(
    sentinels: &[String],
    master_name: &str,
    described: &str,
    connect_timeout: Duration,
    response_timeout: Duration,
) -> Result<(Client, ConnectionManager)> {
    let client = discover_master(sentinels, master_name, described, connect_timeout).await?;
    let manager =
        connect_manager(client.clone(), described, connect_timeout, response_timeout).await?;
    Ok((client, manager))
}

/// Whether a failed command should make a Sentinel client look for the master again.
fn master_may_have_moved(error: &redis::RedisError) -> bool {
    error.is_io_error()
        || error.is_connection_refusal()
        || error.is_connection_dropped()
        || error.is_timeout()
        || matches!(error.code(), Some("READONLY" | "MASTERDOWN"))
}

impl SentinelConnection {
    /// Asks the sentinels `sentinels` (`host:port`) for the master `master_name` and
    /// connects to it.
    pub(crate) async fn connect(
        sentinels: &[String],
        master_name: &str,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> Result<(Arc<SentinelConnection>, Client)> {
        let described = format!("{} (master {master_name})", sentinels.join(","));
        let (client, manager) = open_master(
            sentinels,
            master_name,
            &described,
            connect_timeout,
            response_timeout,
        )
        .await?;
        let connection = Arc::new(SentinelConnection {
            sentinels: sentinels.to_vec(),
            master_name: master_name.to_owned(),
            discovering: tokio::sync::Mutex::new(()),
            current: std::sync::Mutex::new((0, manager)),
            notifier: std::sync::Mutex::new(None),
            described,
            connect_timeout,
            response_timeout,
        });
        Ok((connection, client))
    }

    /// The notifier to move to the new master after a failover.
    pub(crate) fn follow_with(&self, notifier: &Arc<Notifier>) {
        *self
            .notifier
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Arc::downgrade(notifier));
    }

    fn current(&self) -> ConnectionManager {
        self.current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .1
            .clone()
    }

    async fn send(&self, cmd: &redis::Cmd) -> redis::RedisResult<redis::Value> {
        use redis::aio::ConnectionLike;
        let (generation, mut connection) = self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        match connection.req_packed_command(cmd).await {
            Err(error) if master_may_have_moved(&error) => {
                if self.rediscover(generation).await.is_err() {
                    return Err(error);
                }
                self.current().req_packed_command(cmd).await
            }
            answer => answer,
        }
    }

    /// Connects to the master the sentinels name now, unless another command did so
    /// since `seen` (the generation its failed command used).
    async fn rediscover(&self, seen: u64) -> Result<()> {
        let _one_at_a_time = self.discovering.lock().await;
        if self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0
            != seen
        {
            return Ok(());
        }
        let (client, manager) = open_master(
            &self.sentinels,
            &self.master_name,
            &self.described,
            self.connect_timeout,
            self.response_timeout,
        )
        .await?;
        *self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = (seen + 1, manager);
        let notifier = self
            .notifier
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .and_then(Weak::upgrade);
        if let Some(notifier) = notifier {
            notifier.move_to(client).await;
        }
        Ok(())
    }
}

/// Connects to a Redis Cluster through the seed nodes `hosts` (`host:port`, any of its
/// nodes), on RESP3 so that sharded Pub/Sub messages arrive on `pushes`.
pub(crate) async fn connect_cluster(
    hosts: &[String],
    connect_timeout: Duration,
    response_timeout: Duration,
    pushes: tokio::sync::mpsc::UnboundedSender<redis::PushInfo>,
) -> Result<redis::cluster_async::ClusterConnection> {
    let nodes: Vec<String> = hosts.iter().map(|host| format!("redis://{host}")).collect();
    let described = hosts.join(",");
    let client = redis::cluster::ClusterClientBuilder::new(nodes)
        .use_protocol(redis::ProtocolVersion::RESP3)
        .push_sender(pushes)
        .connection_timeout(connect_timeout)
        .response_timeout(response_timeout)
        // Retries (after a failover or a slot move) within the response timeout: the
        // client's default waits start at 1.28 s, past most of that budget.
        .retries(12)
        .min_retry_wait(10)
        .max_retry_wait(250)
        .build()
        .map_err(|error| {
            Error::new(
                ErrorKind::InvalidUrl,
                format!("not a usable Redis Cluster address list: {described}"),
            )
            .with_source(error)
        })?;
    match tokio::time::timeout(connect_timeout * 2, client.get_async_connection()).await {
        Ok(Ok(connection)) => Ok(connection),
        Ok(Err(error)) => Err(map_error(
            error,
            &format!("cannot connect to the Redis Cluster at {described}"),
        )),
        Err(_) => Err(Error::new(
            ErrorKind::StoreUnavailable,
            format!("cannot reach the Redis Cluster at {described} within {connect_timeout:?}"),
        )),
    }
}

/// Release notifications on a Redis Cluster: sharded Pub/Sub (`SSUBSCRIBE`), whose
/// channels live in their hash slot like keys, so a lock's channel follows its keys
/// across resharding and failovers (the client subscribes again after a reconnection).
pub(crate) struct ClusterNotifier {
    connection: tokio::sync::Mutex<redis::cluster_async::ClusterConnection>,
    response_timeout: Duration,
    signals: ReleaseSignals,
}

impl ClusterNotifier {
    /// Whether a waiter of this store listens on `channel` (so that a release's
    /// notification reaches this store's own connection too).
    pub(crate) fn is_watched(&self, channel: &str) -> bool {
        self.signals.is_watched(channel)
    }

    /// Feeds release messages from `pushes` (the cluster connection's push channel)
    /// to waiters.
    pub(crate) fn new(
        connection: redis::cluster_async::ClusterConnection,
        response_timeout: Duration,
        mut pushes: tokio::sync::mpsc::UnboundedReceiver<redis::PushInfo>,
    ) -> Arc<ClusterNotifier> {
        let notifier = Arc::new_cyclic(|weak: &Weak<ClusterNotifier>| {
            let weak = weak.clone();
            ClusterNotifier {
                connection: tokio::sync::Mutex::new(connection),
                response_timeout,
                signals: ReleaseSignals::with_idle_hook(move |channel| {
                    if let (Some(notifier), Ok(runtime)) =
                        (weak.upgrade(), tokio::runtime::Handle::try_current())
                    {
                        let channel = channel.to_owned();
                        runtime.spawn(async move { notifier.unsubscribe(channel).await });
                    }
                }),
            }
        });
        let signals = notifier.signals.clone();
        tokio::spawn(async move {
            while let Some(push) = pushes.recv().await {
                match push.kind {
                    redis::PushKind::SMessage | redis::PushKind::Message => {
                        if let Some(redis::Value::BulkString(channel)) = push.data.first() {
                            signals.notify(&String::from_utf8_lossy(channel));
                        }
                    }
                    // A connection to a node dropped: its messages meanwhile are lost,
                    // so every waiter checks again now.
                    redis::PushKind::Disconnection => signals.notify_all(),
                    _ => {}
                }
            }
        });
        notifier
    }

    pub(crate) async fn watch(&self, channel: String) -> Result<ReleaseWatch> {
        let (watch, first) = self.signals.watch(&channel);
        if first {
            let mut connection = self.connection.lock().await;
            match tokio::time::timeout(self.response_timeout, connection.ssubscribe(&channel)).await
            {
                Ok(Ok(())) => {}
                Ok(Err(error)) => {
                    return Err(map_error(error, "cannot subscribe to lock releases"));
                }
                Err(_) => {
                    return Err(Error::new(
                        ErrorKind::StoreUnavailable,
                        format!(
                            "Redis did not confirm the subscription to lock releases within {:?}",
                            self.response_timeout
                        ),
                    ));
                }
            }
        }
        // A safety net for messages lost during a failover or a slot migration.
        Ok(watch.with_poll(Duration::from_millis(50), Duration::from_millis(500)))
    }

    async fn unsubscribe(&self, channel: String) {
        let mut connection = self.connection.lock().await;
        // Checked under the connection's lock: a new first watcher subscribes under it
        // too, so it cannot subscribe between this check and the `SUNSUBSCRIBE`.
        if self.signals.is_watched(&channel) {
            return;
        }
        let _ =
            tokio::time::timeout(self.response_timeout, connection.sunsubscribe(&channel)).await;
    }
}

/// Settings of a [`RedisLockStore`](crate::lock::redis::RedisLockStore), and of every
/// other store on Redis (the idempotency store and the fence share its key prefix and
/// timeouts).
#[derive(Debug, Clone)]
pub struct RedisLockConfig {
    pub(crate) prefix: String,
    pub(crate) fence_retention: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) response_timeout: Duration,
    pub(crate) tls_root_certificate: Option<Vec<u8>>,
}

impl Default for RedisLockConfig {
    fn default() -> Self {
        RedisLockConfig {
            prefix: "turnstile".to_owned(),
            fence_retention: Duration::from_secs(7 * 24 * 3600),
            connect_timeout: Duration::from_secs(3),
            response_timeout: Duration::from_secs(3),
            tls_root_certificate: None,
        }
    }
}

impl RedisLockConfig {
    /// Defaults: prefix `turnstile`, fence retention 7 days, 3 s connect and response
    /// timeouts.
    pub fn new() -> Self {
        RedisLockConfig::default()
    }

    /// The first part of every key; lets several applications share one Redis.
    /// Must be non-empty, printable, and free of `{` and `}` (they would break the
    /// hash tag).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The key prefix.
    pub fn get_prefix(&self) -> &str {
        &self.prefix
    }

    /// How long the last issued fencing token is kept after the last acquisition of a
    /// name. After that, new tokens rely on the server clock alone (see the module docs).
    pub fn fence_retention(mut self, retention: Duration) -> Self {
        self.fence_retention = retention;
        self
    }

    /// How long to wait for a connection.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long to wait for each reply.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// For `rediss://`: trust this CA certificate (PEM) instead of the system's trust
    /// store. Without it the system store is used, and the `SSL_CERT_FILE` environment
    /// variable can name a PEM bundle to trust instead.
    pub fn tls_root_certificate(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_root_certificate = Some(pem.into());
        self
    }

    /// Applies a URL's `turnstile_*` options: `turnstile_prefix=P`.
    pub(crate) fn apply_url_options(mut self, options: &[(String, String)]) -> Result<Self> {
        for (key, value) in options {
            self = match key.as_str() {
                "prefix" => self.prefix(value.clone()),
                _ => return Err(crate::url::unknown_option(key, value, "turnstile_prefix")),
            };
        }
        Ok(self)
    }

    pub(crate) fn validate(&self) -> Result<()> {
        let prefix = &self.prefix;
        if prefix.is_empty()
            || prefix.len() > 128
            || prefix.contains(['{', '}'])
            || prefix.chars().any(char::is_control)
        {
            return Err(Error::new(
                ErrorKind::InvalidOptions,
                format!(
                    "the Redis key prefix {prefix:?} must be 1 to 128 printable characters without '{{' or '}}'"
                ),
            ));
        }
        if self.fence_retention < Duration::from_secs(1) {
            return Err(Error::new(
                ErrorKind::InvalidOptions,
                "the fence retention must be at least one second",
            ));
        }
        Ok(())
    }
}
