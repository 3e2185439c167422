//! Opening a store from a URL, the way the `turnstile` command does.

use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};
use crate::lock::LockBackend;

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
    let (_, options) = split_url_options(url);
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

/// A URL with every credential it can carry hidden, for messages, logs and anything
/// shown to people: the userinfo (`user:***@`, and a bare `***@` where the userinfo is
/// one word, a token or a password alone), in each host of a comma-separated list, and
/// the value of every query parameter whose name says it holds a secret (`password`,
/// `pass`, `pwd`, `token`, `secret`, `auth`, `sslkey`, `apikey`, …).
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let authority = authority
        .split(',')
        .map(|host| match host.rsplit_once('@') {
            Some((credentials, host)) => match credentials.split_once(':') {
                Some((user, _password)) => format!("{user}:***@{host}"),
                None => format!("***@{host}"),
            },
            None => host.to_owned(),
        })
        .collect::<Vec<_>>()
        .join(",");
    let (path, query) = match tail.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (tail, None),
    };
    let Some(query) = query else {
        return format!("{scheme}://{authority}{path}");
    };
    let (query, fragment) = match query.split_once('#') {
        Some((query, fragment)) => (query, format!("#{fragment}")),
        None => (query, String::new()),
    };
    let query = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if is_secret_parameter(name) => format!("{name}=***"),
            _ => pair.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("&");
    format!("{scheme}://{authority}{path}?{query}{fragment}")
}

/// Whether a URL query parameter's name says that its value is a secret (or, like
/// `sslkey`, points at one).
fn is_secret_parameter(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    [
        "pass",
        "pwd",
        "token",
        "secret",
        "auth",
        "key",
        "credential",
        "signature",
    ]
    .iter()
    .any(|word| name.contains(word))
}

/// Splits Turnstile's own `turnstile_*` options off a store URL's query string,
/// returning the URL the driver should see and the options (without the prefix).
#[cfg_attr(
    not(any(
        feature = "sqlite",
        feature = "redis",
        feature = "postgres",
        feature = "mysql"
    )),
    allow(dead_code)
)]
pub(crate) fn split_url_options(url: &str) -> (String, Vec<(String, String)>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), Vec::new());
    };
    let mut kept = Vec::new();
    let mut ours = Vec::new();
    for pair in query.split('&').filter(|pair| !pair.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if let Some(option) = key.strip_prefix("turnstile_") {
            ours.push((option.to_owned(), value.to_owned()));
        } else {
            kept.push(pair);
        }
    }
    let url = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    (url, ours)
}

/// The error for a `turnstile_*` URL option an engine does not know.
#[allow(dead_code)]
pub(crate) fn unknown_option(key: &str, value: &str, known: &str) -> crate::Error {
    crate::Error::new(
        ErrorKind::InvalidUrl,
        format!("unknown or invalid option turnstile_{key}={value:?}; known: {known}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_credential_form_is_redacted() {
        for (url, shown) in [
            ("redis://u:secret@h:1/0", "redis://u:***@h:1/0"),
            ("redis://:secret@h:1", "redis://:***@h:1"),
            ("redis://TOKEN@h:1", "redis://***@h:1"),
            ("postgres://app@h/db", "postgres://***@h/db"),
            ("redis://h:1", "redis://h:1"),
            ("sqlite:///tmp/a", "sqlite:///tmp/a"),
            (
                "postgres://h/db?password=secret&sslmode=require",
                "postgres://h/db?password=***&sslmode=require",
            ),
            ("mysql://h/db?pass=s&PWD=s", "mysql://h/db?pass=***&PWD=***"),
            (
                "postgres://h/db?sslkey=/k.pem&sslpassword=s&sslrootcert=/ca.pem",
                "postgres://h/db?sslkey=***&sslpassword=***&sslrootcert=/ca.pem",
            ),
            ("redis://h?token=s&auth=s", "redis://h?token=***&auth=***"),
            (
                "redis://h?access_token=s#frag",
                "redis://h?access_token=***#frag",
            ),
            (
                "redis+sentinel://u:a@h1:1,u:b@h2:2/mymaster?password=c",
                "redis+sentinel://u:***@h1:1,u:***@h2:2/mymaster?password=***",
            ),
            (
                "sqlite://keys.db?turnstile_migrate=off",
                "sqlite://keys.db?turnstile_migrate=off",
            ),
        ] {
            assert_eq!(redact(url), shown, "{url}");
            assert!(!redact(url).contains("secret"), "{url}");
        }
    }

    #[test]
    fn our_options_are_split_off() {
        let (url, ours) =
            split_url_options("postgres://h/db?sslmode=disable&turnstile_schema=locks");
        assert_eq!(url, "postgres://h/db?sslmode=disable");
        assert_eq!(ours, vec![("schema".to_owned(), "locks".to_owned())]);
        assert_eq!(split_url_options("postgres://h/db").0, "postgres://h/db");
    }

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
