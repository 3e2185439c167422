//! Opening a store from a URL, the way the `turnstile` command does.

use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};
use crate::lock::LockBackend;
pub use crate::url::redact;

/// The URL schemes Turnstile understands, for error messages (whether this build
/// supports each depends on its cargo features).
pub const SCHEMES: &[&str] = &[
    "sqlite://PATH",
    "redis://HOST[:PORT][/DB]",
    "rediss://HOST[:PORT][/DB]",
    "redis+cluster://HOST:PORT[,HOST:PORT…]",
    "redis+sentinel://HOST:PORT[,HOST:PORT…]/MASTER",
    "redlock://HOST:PORT,HOST:PORT,HOST:PORT[,…][/DB]",
    "etcd://HOST:PORT[,HOST:PORT…]",
    "zk://HOST:PORT[,HOST:PORT…][/PATH]",
    "postgres://USER@HOST[:PORT]/DB",
    "mysql://USER@HOST[:PORT]/DB (or mariadb://)",
];

// The URL constructors of the concepts live here, on the floor that knows every
// engine, so that no concept has to reach up to this module for them.
impl crate::lock::Locker {
    /// Opens the store a URL names (`sqlite://PATH`, `redis://…`, `rediss://…`); see
    /// [`crate::store::connect`].
    pub async fn connect(url: &str) -> Result<Self> {
        connect(url).await.map(crate::lock::Locker::from_arc)
    }
}

impl crate::election::Election {
    /// Opens the store a URL names (the same URLs as the locks); see
    /// [`crate::store::connect`].
    pub async fn connect(url: &str) -> Result<Self> {
        crate::lock::Locker::connect(url)
            .await
            .map(crate::election::Election::new)
    }
}

impl crate::semaphore::Semaphore {
    /// Opens the store a URL names (the same URLs as the locks); see
    /// [`crate::store::connect`].
    pub async fn connect(url: &str) -> Result<Self> {
        crate::lock::Locker::connect(url)
            .await
            .map(crate::semaphore::Semaphore::new)
    }
}

impl crate::rwlock::RwLock {
    /// Opens the store a URL names (the same URLs as the locks); see
    /// [`crate::store::connect`].
    pub async fn connect(url: &str) -> Result<Self> {
        crate::lock::Locker::connect(url)
            .await
            .map(crate::rwlock::RwLock::new)
    }
}

impl crate::idempotency::Idempotency {
    /// Opens the store a URL names (the same URLs as the locks: `sqlite://PATH`,
    /// `postgres://…`).
    pub async fn connect(url: &str) -> Result<Self> {
        connect_idempotency(url)
            .await
            .map(crate::idempotency::Idempotency::from_arc)
    }
}

/// Opens the lock store a URL names.
///
/// | URL | engine | cargo feature |
/// |---|---|---|
/// | `sqlite://PATH` (relative) or `sqlite:///abs/path` | [`SqliteLockStore`](crate::lock::sqlite::SqliteLockStore) | `sqlite` (default) |
/// | `redis://[user:pass@]host[:port][/db]` | [`RedisLockStore`](crate::lock::redis::RedisLockStore) | `redis` |
/// | `rediss://…` (TLS) | the same | `redis-tls` |
///
/// Errors: [`ErrorKind::InvalidUrl`] for a malformed URL or unknown scheme,
/// [`ErrorKind::UnsupportedStore`] when the engine's feature is off,
/// [`ErrorKind::StoreUnavailable`] when the store cannot be reached within a few seconds.
pub async fn connect(url: &str) -> Result<Arc<dyn LockBackend>> {
    let url = url.trim();
    // `sqlite:PATH`, as sqlx writes it, is accepted as well as `sqlite://PATH`.
    if url
        .get(..7)
        .is_some_and(|start| start.eq_ignore_ascii_case("sqlite:"))
    {
        return open_sqlite(url).await;
    }
    let Some((scheme, _)) = url.split_once("://") else {
        return Err(Error::new(
            ErrorKind::InvalidUrl,
            format!(
                "{url:?} is not a store URL; expected one of {}",
                SCHEMES.join(", ")
            ),
        ));
    };
    match scheme.to_ascii_lowercase().as_str() {
        "sqlite" => open_sqlite(url).await,
        "redis" | "rediss" | "redis+unix" | "unix" | "redis+cluster" | "redis+sentinel" => {
            open_redis(url).await
        }
        "redlock" => open_redlock(url).await,
        "etcd" => open_etcd(url).await,
        "zk" | "zookeeper" => open_zookeeper(url).await,
        "postgres" | "postgresql" => open_postgres(url).await,
        "mysql" | "mariadb" => open_mysql(url).await,
        other => Err(Error::new(
            ErrorKind::InvalidUrl,
            format!(
                "unknown store scheme {other:?} in {url:?}; expected one of {}",
                SCHEMES.join(", ")
            ),
        )),
    }
}

#[cfg(feature = "sqlite")]
async fn open_sqlite(url: &str) -> Result<Arc<dyn LockBackend>> {
    let store = crate::lock::sqlite::SqliteLockStore::open_url(url).await?;
    Ok(Arc::new(store))
}

#[cfg(not(feature = "sqlite"))]
async fn open_sqlite(url: &str) -> Result<Arc<dyn LockBackend>> {
    Err(Error::new(
        ErrorKind::UnsupportedStore,
        format!("{url:?} needs SQLite support: build turnstile with the `sqlite` feature"),
    ))
}

#[cfg(feature = "mysql")]
async fn open_mysql(url: &str) -> Result<Arc<dyn LockBackend>> {
    // sqlx knows the scheme as mysql://.
    let url = match url.strip_prefix("mariadb://") {
        Some(rest) => format!("mysql://{rest}"),
        None => url.to_owned(),
    };
    let store = crate::lock::mysql::MysqlLockStore::connect(&url).await?;
    Ok(Arc::new(store))
}

#[cfg(not(feature = "mysql"))]
async fn open_mysql(url: &str) -> Result<Arc<dyn LockBackend>> {
    Err(Error::new(
        ErrorKind::UnsupportedStore,
        format!(
            "{} needs MySQL support: build turnstile with the `mysql` feature",
            redact(url)
        ),
    ))
}

#[cfg(feature = "postgres")]
async fn open_postgres(url: &str) -> Result<Arc<dyn LockBackend>> {
    let (_, options) = crate::url::split_url_options(url);
    let mode = options
        .iter()
        .find(|(key, _)| key == "mode")
        .map_or("lease", |(_, value)| value.as_str());
    match mode {
        "lease" => Ok(Arc::new(
            crate::lock::postgres::PostgresLockStore::connect(url).await?,
        )),
        "session" => Ok(Arc::new(
            crate::lock::postgres_session::PostgresSessionLockStore::connect(url).await?,
        )),
        other => Err(Error::new(
            ErrorKind::InvalidUrl,
            format!("turnstile_mode={other:?}: expected lease or session"),
        )),
    }
}

#[cfg(not(feature = "postgres"))]
async fn open_postgres(url: &str) -> Result<Arc<dyn LockBackend>> {
    Err(Error::new(
        ErrorKind::UnsupportedStore,
        format!(
            "{} needs PostgreSQL support: build turnstile with the `postgres` feature",
            redact(url)
        ),
    ))
}

#[cfg(feature = "redis")]
async fn open_redis(url: &str) -> Result<Arc<dyn LockBackend>> {
    let store = crate::lock::redis::RedisLockStore::connect(url).await?;
    Ok(Arc::new(store))
}

#[cfg(feature = "etcd")]
async fn open_etcd(url: &str) -> Result<Arc<dyn LockBackend>> {
    Ok(Arc::new(
        crate::lock::etcd::EtcdLockStore::connect(url).await?,
    ))
}

#[cfg(not(feature = "etcd"))]
async fn open_etcd(url: &str) -> Result<Arc<dyn LockBackend>> {
    Err(Error::new(
        ErrorKind::UnsupportedStore,
        format!(
            "{} needs etcd support: build turnstile with the `etcd` feature",
            redact(url)
        ),
    ))
}

#[cfg(feature = "zookeeper")]
async fn open_zookeeper(url: &str) -> Result<Arc<dyn LockBackend>> {
    Ok(Arc::new(
        crate::lock::zookeeper::ZooKeeperLockStore::connect(url).await?,
    ))
}

#[cfg(not(feature = "zookeeper"))]
async fn open_zookeeper(url: &str) -> Result<Arc<dyn LockBackend>> {
    Err(Error::new(
        ErrorKind::UnsupportedStore,
        format!(
            "{} needs ZooKeeper support: build turnstile with the `zookeeper` feature",
            redact(url)
        ),
    ))
}

#[cfg(feature = "redis")]
async fn open_redlock(url: &str) -> Result<Arc<dyn LockBackend>> {
    let store = crate::lock::redlock::RedLockStore::connect(url).await?;
    Ok(Arc::new(store))
}

#[cfg(not(feature = "redis"))]
async fn open_redlock(url: &str) -> Result<Arc<dyn LockBackend>> {
    Err(Error::new(
        ErrorKind::UnsupportedStore,
        format!(
            "{} needs Redis support: build turnstile with the `redis` feature",
            redact(url)
        ),
    ))
}

#[cfg(not(feature = "redis"))]
async fn open_redis(url: &str) -> Result<Arc<dyn LockBackend>> {
    Err(Error::new(
        ErrorKind::UnsupportedStore,
        format!("{url:?} needs Redis support: build turnstile with the `redis` feature"),
    ))
}

/// Opens the idempotency store a URL names: the same URLs as [`connect`]. Engines
/// without an idempotency store yet say so ([`ErrorKind::UnsupportedStore`]).
pub async fn connect_idempotency(url: &str) -> Result<IdempotencyStoreArc> {
    let url = url.trim();
    let scheme = url
        .split_once(':')
        .map(|(scheme, _)| scheme.to_ascii_lowercase())
        .unwrap_or_default();
    match scheme.as_str() {
        "sqlite" => open_sqlite_idempotency(url).await,
        "postgres" | "postgresql" => open_postgres_idempotency(url).await,
        "redis" | "rediss" => open_redis_idempotency(url).await,
        "mysql" | "mariadb" => open_mysql_idempotency(url).await,
        // Lock stores only, so far.
        "redlock" | "etcd" | "zk" | "zookeeper" => Err(Error::new(
            ErrorKind::UnsupportedStore,
            format!(
                "{}: there is no idempotency store for {scheme}:// (there are for SQLite, \
                 Redis, PostgreSQL and MySQL)",
                redact(url)
            ),
        )),
        _ => Err(Error::new(
            ErrorKind::InvalidUrl,
            format!(
                "{} is not a store URL; expected one of {}",
                redact(url),
                SCHEMES.join(", ")
            ),
        )),
    }
}

type IdempotencyStoreArc = Arc<dyn crate::idempotency::IdempotencyStore>;

/// Opens the outbox a URL names: `sqlite://PATH`, `postgres://…` or `mysql://…` (Redis
/// has no outbox store: the business data the outbox commits with lives in SQL).
pub async fn connect_outbox(url: &str) -> Result<Arc<dyn crate::outbox::OutboxStore>> {
    let url = url.trim();
    let scheme = url
        .split_once(':')
        .map(|(scheme, _)| scheme.to_ascii_lowercase())
        .unwrap_or_default();
    match scheme.as_str() {
        #[cfg(feature = "sqlite")]
        "sqlite" => Ok(Arc::new(
            crate::outbox::sqlite::SqliteOutbox::open_url(url).await?,
        )),
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => Ok(Arc::new(
            crate::outbox::postgres::PostgresOutbox::connect(url).await?,
        )),
        #[cfg(feature = "mysql")]
        "mysql" | "mariadb" => Ok(Arc::new(
            crate::outbox::mysql::MysqlOutbox::connect(url).await?,
        )),
        // What a build without an engine's feature answers for it.
        #[allow(unreachable_patterns)]
        "sqlite" | "postgres" | "postgresql" | "mysql" | "mariadb" | "redis" | "rediss" => {
            Err(Error::new(
                ErrorKind::UnsupportedStore,
                format!(
                    "{}: this build has no outbox store for {scheme}:// (there are outbox stores for \
                     SQLite, PostgreSQL and MySQL, with the `sqlite`, `postgres` and `mysql` \
                     features)",
                    redact(url)
                ),
            ))
        }
        _ => Err(Error::new(
            ErrorKind::InvalidUrl,
            format!(
                "{} is not an outbox store URL; expected sqlite://PATH, postgres://USER@HOST[:PORT]/DB \
                 or mysql://USER@HOST[:PORT]/DB",
                redact(url)
            ),
        )),
    }
}

/// Connects the publisher a broker URL names: `nats://HOST:PORT` (JetStream),
/// `redis://…` (Redis Streams), `amqp://…` (RabbitMQ, exchange `turnstile`) or
/// `kafka://host:port[,…]` (Kafka).
pub async fn connect_publisher(url: &str) -> Result<Arc<dyn crate::outbox::relay::Publisher>> {
    let url = url.trim();
    let scheme = url
        .split_once("://")
        .map(|(scheme, _)| scheme.to_ascii_lowercase())
        .unwrap_or_default();
    match scheme.as_str() {
        #[cfg(feature = "nats")]
        "nats" => Ok(Arc::new(
            crate::outbox::nats::JetStreamPublisher::connect(
                url,
                std::time::Duration::from_secs(5),
            )
            .await?,
        )),
        #[cfg(feature = "redis")]
        "redis" | "rediss" => Ok(Arc::new(
            crate::outbox::redis_streams::RedisStreamsPublisher::connect(url).await?,
        )),
        #[cfg(feature = "rabbitmq")]
        "amqp" | "amqps" => Ok(Arc::new(
            crate::outbox::rabbitmq::RabbitMqPublisher::connect(url, "turnstile").await?,
        )),
        #[cfg(feature = "kafka")]
        "kafka" => Ok(Arc::new(crate::outbox::kafka::KafkaPublisher::connect(
            url,
        )?)),
        // What a build without the `kafka` feature answers.
        #[allow(unreachable_patterns)]
        "kafka" => Err(Error::new(
            ErrorKind::UnsupportedStore,
            format!("{url} needs Kafka support: build turnstile with the `kafka` feature"),
        )),
        // What a build without the `rabbitmq` feature answers.
        #[allow(unreachable_patterns)]
        "amqp" | "amqps" => Err(Error::new(
            ErrorKind::UnsupportedStore,
            format!(
                "{} needs RabbitMQ support: build turnstile with the `rabbitmq` feature",
                redact(url)
            ),
        )),
        // What a build without the `redis` feature answers.
        #[allow(unreachable_patterns)]
        "redis" | "rediss" => Err(Error::new(
            ErrorKind::UnsupportedStore,
            format!(
                "{} needs Redis support: build turnstile with the `redis` feature",
                redact(url)
            ),
        )),
        // What a build without the `nats` feature answers.
        #[allow(unreachable_patterns)]
        "nats" => Err(Error::new(
            ErrorKind::UnsupportedStore,
            format!(
                "{} needs NATS support: build turnstile with the `nats` feature",
                redact(url)
            ),
        )),
        _ => Err(Error::new(
            ErrorKind::InvalidUrl,
            format!(
                "{} is not a broker URL; expected nats://HOST:PORT, redis://HOST[:PORT], \
                 amqp://USER:PASSWORD@HOST:PORT/VHOST or kafka://HOST:PORT[,HOST:PORT…]",
                redact(url)
            ),
        )),
    }
}

#[cfg(feature = "sqlite")]
async fn open_sqlite_idempotency(url: &str) -> Result<IdempotencyStoreArc> {
    let store = crate::idempotency::sqlite::SqliteIdempotencyStore::open_url(url).await?;
    Ok(Arc::new(store))
}

#[cfg(not(feature = "sqlite"))]
async fn open_sqlite_idempotency(url: &str) -> Result<IdempotencyStoreArc> {
    Err(Error::new(
        ErrorKind::UnsupportedStore,
        format!("{url:?} needs SQLite support: build turnstile with the `sqlite` feature"),
    ))
}

#[cfg(feature = "redis")]
async fn open_redis_idempotency(url: &str) -> Result<IdempotencyStoreArc> {
    let store = crate::idempotency::redis::RedisIdempotencyStore::connect(url).await?;
    Ok(Arc::new(store))
}

#[cfg(not(feature = "redis"))]
async fn open_redis_idempotency(url: &str) -> Result<IdempotencyStoreArc> {
    Err(Error::new(
        ErrorKind::UnsupportedStore,
        format!(
            "{} needs Redis support: build turnstile with the `redis` feature",
            redact(url)
        ),
    ))
}

#[cfg(feature = "mysql")]
async fn open_mysql_idempotency(url: &str) -> Result<IdempotencyStoreArc> {
    let store = crate::idempotency::mysql::MysqlIdempotencyStore::connect(url).await?;
    Ok(Arc::new(store))
}

#[cfg(not(feature = "mysql"))]
async fn open_mysql_idempotency(url: &str) -> Result<IdempotencyStoreArc> {
    Err(Error::new(
        ErrorKind::UnsupportedStore,
        format!(
            "{} needs MySQL support: build turnstile with the `mysql` feature",
            redact(url)
        ),
    ))
}

#[cfg(feature = "postgres")]
async fn open_postgres_idempotency(url: &str) -> Result<IdempotencyStoreArc> {
    let store = crate::idempotency::postgres::PostgresIdempotencyStore::connect(url).await?;
    Ok(Arc::new(store))
}

#[cfg(not(feature = "postgres"))]
async fn open_postgres_idempotency(url: &str) -> Result<IdempotencyStoreArc> {
    Err(Error::new(
        ErrorKind::UnsupportedStore,
        format!(
            "{} needs PostgreSQL support: build turnstile with the `postgres` feature",
            redact(url)
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bad_urls_are_refused_with_the_kind_that_says_why() {
        for (url, kind) in [
            ("", ErrorKind::InvalidUrl),
            ("localhost:6379", ErrorKind::InvalidUrl),
            ("mongodb://localhost", ErrorKind::InvalidUrl),
        ] {
            let error = connect(url).await.unwrap_err();
            assert_eq!(error.kind(), kind, "{url}: {error}");
        }
    }
}
