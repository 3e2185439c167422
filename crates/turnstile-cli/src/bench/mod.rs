//! `turnstile bench lock`: the lock workload (v1), for the library or for bare Redis
//! commands (`--raw`) in the same process, so the two can be compared honestly.
//!
//! Environment: `REDIS_PORT` (6390; used when no `--store` is given), `BENCH_SECS` (5),
//! `WORKERS` (8), `LOCK_TTL_MS` (10000), `ACQUIRE_TIMEOUT_MS` (5000), `BENCH_RUNTIME`
//! (`current_thread`, the default, or `multi_thread`: the runtime a service would run),
//! `BENCH_CPU_CORES` (say `0,1`: report how busy these cores were per uncontended
//! cycle, from `/proc/stat`, so that a pinned server's and client's costs can be told
//! apart).

#[cfg(feature = "redis")]
mod blocking;
#[cfg(feature = "etcd")]
mod etcd;
pub(crate) mod failover;
pub(crate) mod http;
#[cfg(all(feature = "postgres", feature = "nats"))]
pub(crate) mod outbox;
#[cfg(feature = "rslock")]
mod rslock;
mod service;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod sql;
mod workload;
#[cfg(feature = "zookeeper")]
mod zookeeper;

use std::process::ExitCode;
use std::rc::Rc;
use std::time::Duration;

use clap::Args;
use tokio::time::Instant;
use turnstile::lock::{LockGuard, LockOptions, Locker};
use turnstile::{Error, ErrorKind};

use crate::{exit, exit_code_for};
#[cfg(feature = "redis")]
use workload::RAW_RELEASE;
use workload::{
    CoreClock, Uncontended, WorkerReport, Workload, env_number, report_first_error, report_json,
};

/// Options of `turnstile bench lock`.
#[derive(Args, Debug)]
pub(crate) struct BenchArgs {
    /// Store URL (default: redis://127.0.0.1:$REDIS_PORT).
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// Run the workload on bare Redis commands (SET NX PX with busy retry, a
    /// compare-and-delete script) instead of the library: the floor to compare with.
    #[arg(long)]
    raw: bool,
    /// The same bare commands on blocking connections, one per worker thread (Redis
    /// only): the physical floor, with no async runtime in the way.
    #[arg(long, conflicts_with = "raw")]
    raw_blocking: bool,
    /// Take the locks through a running `turnstile serve` at this URL (http://IP:PORT)
    /// instead; the contended phase's counter lives in --store, which should be the
    /// store the service runs on.
    #[arg(long, value_name = "URL", conflicts_with_all = ["raw", "raw_blocking"])]
    service: Option<String>,
    /// Run the workload on the rslock crate (RedLock on the one Redis of --store, with
    /// its default retries) instead: the Rust crate the library is compared with. Needs
    /// the `rslock` feature.
    #[arg(long, conflicts_with_all = ["raw", "raw_blocking", "service"])]
    rslock: bool,
    /// Take the locks unfenced (`Locker::acquire_unfenced`: no token; on Redis a bare
    /// `SET NX PX`), to compare with the fenced default on the same store.
    #[arg(long, conflicts_with_all = ["raw", "raw_blocking", "service", "rslock"])]
    unfenced: bool,
    /// etcd only: the writes a section needs and nothing else, as the floor of the
    /// store's cost: a put of the lock's key to take it and a delete to give it back,
    /// with the exclusion itself done in this process (a local FIFO mutex), so no wait,
    /// lease or watch is paid for.
    #[arg(long, conflicts_with_all = ["raw", "raw_blocking", "service", "rslock", "unfenced"])]
    raw_writes: bool,
}

/// One held lock, whichever peer took it.
enum Held {
    Library(LockGuard),
    LibraryUnfenced(turnstile::lock::UnfencedGuard),
    Service(service::ServiceHeld),
    #[cfg(feature = "redis")]
    Raw {
        key: String,
        token: String,
    },
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    RawSql(sql::RawSqlHeld),
    #[cfg(feature = "etcd")]
    RawEtcd(etcd::RawEtcdHeld),
    #[cfg(feature = "etcd")]
    EtcdWrites(etcd::EtcdWritesHeld),
    #[cfg(feature = "zookeeper")]
    RawZooKeeper(zookeeper::RawZooKeeperHeld),
    #[cfg(feature = "rslock")]
    Rslock(rslock::RslockHeld),
}

enum AcquireError {
    Timeout,
    Failed(String),
}

/// The thing measured: the library, or the same workload on bare commands.
enum Peer {
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    RawSql {
        raw: sql::RawSql,
        counter: sql::SqlCounter,
    },
    Library {
        locker: Locker,
        counter: Counter,
    },
    /// The library with unfenced locks (`--unfenced`).
    LibraryUnfenced {
        locker: Locker,
        counter: Counter,
    },
    /// `turnstile serve`, over HTTP.
    Service {
        client: service::ServiceClient,
        counter: Counter,
    },
    /// etcd's own lock RPC.
    #[cfg(feature = "etcd")]
    RawEtcd {
        client: Box<etcd_client::Client>,
        counter: Box<etcd::EtcdCounter>,
    },
    /// The writes a section needs on etcd, exclusion done locally (`--raw-writes`).
    #[cfg(feature = "etcd")]
    EtcdWrites {
        writes: Box<etcd::EtcdWrites>,
        counter: Box<etcd::EtcdCounter>,
    },
    /// The zookeeper-client crate's lock recipe.
    #[cfg(feature = "zookeeper")]
    RawZooKeeper {
        counter: Box<zookeeper::ZooKeeperCounter>,
    },
    #[cfg(feature = "redis")]
    Raw {
        connection: redis::aio::MultiplexedConnection,
        release: redis::Script,
        counter_key: String,
    },
    /// The rslock crate.
    #[cfg(feature = "rslock")]
    Rslock {
        rslock: Box<rslock::Rslock>,
        counter_key: String,
    },
}

/// The shared counter the contended phase increments with two separate round trips.
enum Counter {
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    Sql(sql::SqlCounter),
    #[cfg(feature = "redis")]
    Redis {
        connection: turnstile::lock::redis::RedisConnection,
        key: String,
    },
    #[cfg(feature = "sqlite")]
    Sqlite {
        pool: sqlx::SqlitePool,
        name: String,
    },
    #[cfg(feature = "etcd")]
    Etcd(Box<etcd::EtcdCounter>),
    #[cfg(feature = "zookeeper")]
    ZooKeeper(Box<zookeeper::ZooKeeperCounter>),
}

/// Reads the Redis counter: one `GET` round trip, on whichever connection the peer uses.
#[cfg(feature = "redis")]
async fn redis_counter_get<C>(connection: &C, key: &str) -> Result<i64, String>
where
    C: redis::aio::ConnectionLike + Clone + Send,
{
    redis::cmd("GET")
        .arg(key)
        .query_async::<Option<i64>>(&mut connection.clone())
        .await
        .map(Option::unwrap_or_default)
        .map_err(|e| e.to_string())
}

/// Writes the Redis counter: one `SET` round trip.
#[cfg(feature = "redis")]
async fn redis_counter_set<C>(connection: &C, key: &str, value: i64) -> Result<(), String>
where
    C: redis::aio::ConnectionLike + Clone + Send,
{
    redis::cmd("SET")
        .arg(key)
        .arg(value)
        .query_async::<()>(&mut connection.clone())
        .await
        .map_err(|e| e.to_string())
}

impl Counter {
    async fn set(&self, value: i64) -> Result<(), String> {
        match self {
            #[cfg(any(feature = "postgres", feature = "mysql"))]
            Counter::Sql(counter) => counter.set(value).await,
            #[cfg(feature = "redis")]
            Counter::Redis { connection, key } => redis_counter_set(connection, key, value).await,
            #[cfg(feature = "sqlite")]
            Counter::Sqlite { pool, name } => sqlx::query(
                "INSERT INTO turnstile_bench_counter (name, value) VALUES (?1, ?2)
                 ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            )
            .bind(name)
            .bind(value)
            .execute(pool)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string()),
            #[cfg(feature = "etcd")]
            Counter::Etcd(counter) => counter.set(value).await,
            #[cfg(feature = "zookeeper")]
            Counter::ZooKeeper(counter) => counter.set(value).await,
        }
    }

    async fn get(&self) -> Result<i64, String> {
        match self {
            #[cfg(any(feature = "postgres", feature = "mysql"))]
            Counter::Sql(counter) => counter.get().await,
            #[cfg(feature = "redis")]
            Counter::Redis { connection, key } => redis_counter_get(connection, key).await,
            #[cfg(feature = "sqlite")]
            Counter::Sqlite { pool, name } => sqlx::query_scalar::<_, i64>(
                "SELECT value FROM turnstile_bench_counter WHERE name = ?1",
            )
            .bind(name)
            .fetch_optional(pool)
            .await
            .map(Option::unwrap_or_default)
            .map_err(|e| e.to_string()),
            #[cfg(feature = "etcd")]
            Counter::Etcd(counter) => counter.get().await,
            #[cfg(feature = "zookeeper")]
            Counter::ZooKeeper(counter) => counter.get().await,
        }
    }
}

impl Peer {
    fn name(&self) -> &'static str {
        match self {
            #[cfg(any(feature = "postgres", feature = "mysql"))]
            Peer::RawSql { .. } => "raw",
            Peer::Library { .. } => "turnstile",
            Peer::LibraryUnfenced { .. } => "turnstile-unfenced",
            Peer::Service { .. } => "turnstile-serve",
            #[cfg(feature = "redis")]
            Peer::Raw { .. } => "raw",
            #[cfg(feature = "etcd")]
            Peer::RawEtcd { .. } => "raw",
            #[cfg(feature = "etcd")]
            Peer::EtcdWrites { .. } => "raw-writes",
            #[cfg(feature = "zookeeper")]
            Peer::RawZooKeeper { .. } => "raw",
            #[cfg(feature = "rslock")]
            Peer::Rslock { .. } => "rslock",
        }
    }

    fn wait_strategy(&self) -> &'static str {
        match self {
            #[cfg(any(feature = "postgres", feature = "mysql"))]
            Peer::RawSql { .. } => "busy-retry",
            Peer::Library { .. } | Peer::LibraryUnfenced { .. } => {
                "release-notification+local-fifo-queue"
            }
            Peer::Service { .. } => "http-long-poll",
            #[cfg(feature = "redis")]
            Peer::Raw { .. } => "busy-retry",
            #[cfg(feature = "etcd")]
            Peer::RawEtcd { .. } => "etcd-lock-rpc",
            #[cfg(feature = "etcd")]
            Peer::EtcdWrites { .. } => "local-fifo-mutex",
            #[cfg(feature = "zookeeper")]
            Peer::RawZooKeeper { .. } => "zookeeper-client-recipe",
            #[cfg(feature = "rslock")]
            Peer::Rslock { .. } => "rslock-lock-retried",
        }
    }

    async fn acquire(&self, name: &str, work: &Workload) -> Result<Held, AcquireError> {
        let ttl = Duration::from_millis(work.ttl_ms);
        let wait = Duration::from_millis(work.acquire_timeout_ms);
        match self {
            #[cfg(any(feature = "postgres", feature = "mysql"))]
            Peer::RawSql { raw, .. } => match raw.acquire(name, work.ttl_ms, wait).await {
                Ok(Some(held)) => Ok(Held::RawSql(held)),
                Ok(None) => Err(AcquireError::Timeout),
                Err(error) => Err(AcquireError::Failed(error)),
            },
            Peer::Library { locker, .. } | Peer::LibraryUnfenced { locker, .. } => {
                let options = LockOptions::new().ttl(ttl).wait(wait);
                let acquired = if let Peer::LibraryUnfenced { .. } = self {
                    locker
                        .acquire_unfenced(name, &options)
                        .await
                        .map(Held::LibraryUnfenced)
                } else {
                    locker.acquire(name, &options).await.map(Held::Library)
                };
                match acquired {
                    Ok(held) => Ok(held),
                    Err(error) if error.kind() == ErrorKind::AcquireTimeout => {
                        Err(AcquireError::Timeout)
                    }
                    Err(error) => Err(AcquireError::Failed(error.to_string())),
                }
            }
            Peer::Service { client, .. } => {
                match client
                    .acquire(name, work.ttl_ms, work.acquire_timeout_ms)
                    .await
                {
                    Ok(Some(held)) => Ok(Held::Service(held)),
                    Ok(None) => Err(AcquireError::Timeout),
                    Err(error) => Err(AcquireError::Failed(error)),
                }
            }
            #[cfg(feature = "etcd")]
            Peer::RawEtcd { client, .. } => {
                match etcd::raw_acquire(client, name, ttl, wait).await {
                    Ok(Some(held)) => Ok(Held::RawEtcd(held)),
                    Ok(None) => Err(AcquireError::Timeout),
                    Err(error) => Err(AcquireError::Failed(error)),
                }
            }
            #[cfg(feature = "etcd")]
            Peer::EtcdWrites { writes, .. } => match writes.acquire(name, wait).await {
                Ok(Some(held)) => Ok(Held::EtcdWrites(held)),
                Ok(None) => Err(AcquireError::Timeout),
                Err(error) => Err(AcquireError::Failed(error)),
            },
            #[cfg(feature = "zookeeper")]
            Peer::RawZooKeeper { counter } => {
                match zookeeper::raw_acquire(&counter.client, &counter.directory, name, wait).await
                {
                    Ok(Some(held)) => Ok(Held::RawZooKeeper(held)),
                    Ok(None) => Err(AcquireError::Timeout),
                    Err(error) => Err(AcquireError::Failed(error)),
                }
            }
            #[cfg(feature = "rslock")]
            Peer::Rslock { rslock, .. } => match rslock.acquire(name, ttl, wait).await {
                Ok(Some(held)) => Ok(Held::Rslock(held)),
                Ok(None) => Err(AcquireError::Timeout),
                Err(error) => Err(AcquireError::Failed(error)),
            },
            #[cfg(feature = "redis")]
            Peer::Raw { connection, .. } => {
                let key = format!("{name}:raw-lock");
                let token = format!("{:032x}", rand::random::<u128>());
                let deadline = Instant::now() + wait;
                let mut connection = connection.clone();
                loop {
                    let set: Option<String> = redis::cmd("SET")
                        .arg(&key)
                        .arg(&token)
                        .arg("NX")
                        .arg("PX")
                        .arg(work.ttl_ms)
                        .query_async(&mut connection)
                        .await
                        .map_err(|e| AcquireError::Failed(e.to_string()))?;
                    if set.is_some() {
                        return Ok(Held::Raw { key, token });
                    }
                    if Instant::now() >= deadline {
                        return Err(AcquireError::Timeout);
                    }
                }
            }
        }
    }

    async fn release(&self, held: Held) -> Result<(), String> {
        match (self, held) {
            #[cfg(any(feature = "postgres", feature = "mysql"))]
            (Peer::RawSql { raw, .. }, Held::RawSql(held)) => raw.release(held).await,
            (_, Held::Library(guard)) => {
                guard.release().await.map(|_| ()).map_err(|e| e.to_string())
            }
            (_, Held::LibraryUnfenced(guard)) => {
                guard.release().await.map(|_| ()).map_err(|e| e.to_string())
            }
            (Peer::Service { client, .. }, Held::Service(held)) => client.release(held).await,
            #[cfg(feature = "etcd")]
            (Peer::RawEtcd { client, .. }, Held::RawEtcd(held)) => {
                etcd::raw_release(client, held).await
            }
            #[cfg(feature = "etcd")]
            (Peer::EtcdWrites { writes, .. }, Held::EtcdWrites(held)) => writes.release(held).await,
            #[cfg(feature = "zookeeper")]
            (Peer::RawZooKeeper { .. }, Held::RawZooKeeper(held)) => {
                zookeeper::raw_release(held).await
            }
            #[cfg(feature = "rslock")]
            (Peer::Rslock { rslock, .. }, Held::Rslock(held)) => {
                rslock.release(held).await;
                Ok(())
            }
            #[cfg(feature = "redis")]
            (
                Peer::Raw {
                    connection,
                    release,
                    ..
                },
                Held::Raw { key, token },
            ) => release
                .key(key)
                .arg(token)
                .invoke_async::<i64>(&mut connection.clone())
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            #[allow(unreachable_patterns)]
            _ => Err("a raw lock handed to the library peer".to_owned()),
        }
    }

    async fn counter_get(&self) -> Result<i64, String> {
        match self {
            #[cfg(any(feature = "postgres", feature = "mysql"))]
            Peer::RawSql { counter, .. } => counter.get().await,
            Peer::Library { counter, .. }
            | Peer::LibraryUnfenced { counter, .. }
            | Peer::Service { counter, .. } => counter.get().await,
            #[cfg(feature = "etcd")]
            Peer::RawEtcd { counter, .. } | Peer::EtcdWrites { counter, .. } => counter.get().await,
            #[cfg(feature = "zookeeper")]
            Peer::RawZooKeeper { counter } => counter.get().await,
            #[cfg(feature = "redis")]
            Peer::Raw {
                connection,
                counter_key,
                ..
            } => redis_counter_get(connection, counter_key).await,
            #[cfg(feature = "rslock")]
            Peer::Rslock {
                rslock,
                counter_key,
            } => redis_counter_get(&rslock.connection, counter_key).await,
        }
    }

    async fn counter_set(&self, value: i64) -> Result<(), String> {
        match self {
            #[cfg(any(feature = "postgres", feature = "mysql"))]
            Peer::RawSql { counter, .. } => counter.set(value).await,
            Peer::Library { counter, .. }
            | Peer::LibraryUnfenced { counter, .. }
            | Peer::Service { counter, .. } => counter.set(value).await,
            #[cfg(feature = "etcd")]
            Peer::RawEtcd { counter, .. } | Peer::EtcdWrites { counter, .. } => {
                counter.set(value).await
            }
            #[cfg(feature = "zookeeper")]
            Peer::RawZooKeeper { counter } => counter.set(value).await,
            #[cfg(feature = "redis")]
            Peer::Raw {
                connection,
                counter_key,
                ..
            } => redis_counter_set(connection, counter_key, value).await,
            #[cfg(feature = "rslock")]
            Peer::Rslock {
                rslock,
                counter_key,
            } => redis_counter_set(&rslock.connection, counter_key, value).await,
        }
    }
}

/// The service at `service` as the peer, with the counter the library peer would use
/// on `store`.
async fn open_service_peer(service: &str, store: &str, run: &str) -> Result<Peer, Error> {
    let client = service::ServiceClient::new(service)?;
    match open_peer(store, false, run).await? {
        Peer::Library { counter, .. } => Ok(Peer::Service { client, counter }),
        _ => Err(Error::new(
            ErrorKind::InvalidOptions,
            "--service needs a --store the library opens, for the counter",
        )),
    }
}

/// The writes-only floor on the etcd of `url` as the peer (`--raw-writes`).
async fn open_etcd_writes_peer(url: &str, run: &str) -> Result<Peer, Error> {
    #[cfg(feature = "etcd")]
    {
        if !url.starts_with("etcd://") {
            return Err(Error::new(
                ErrorKind::InvalidOptions,
                "--raw-writes measures etcd only: give an etcd:// --store",
            ));
        }
        let client = etcd::connect(url)
            .await
            .map_err(|e| Error::new(ErrorKind::StoreUnavailable, e))?;
        Ok(Peer::EtcdWrites {
            writes: Box::new(etcd::EtcdWrites::new(client.clone(), run)),
            counter: Box::new(etcd::EtcdCounter {
                client,
                key: format!("{run}:counter"),
            }),
        })
    }
    #[cfg(not(feature = "etcd"))]
    {
        let _ = (url, run);
        Err(Error::new(
            ErrorKind::InvalidOptions,
            "--raw-writes needs turnstile built with the `etcd` feature",
        ))
    }
}

/// The rslock crate on the Redis of `url` as the peer.
async fn open_rslock_peer(url: &str, run: &str) -> Result<Peer, Error> {
    #[cfg(feature = "rslock")]
    {
        let rslock = rslock::Rslock::open(url)
            .await
            .map_err(|error| Error::new(ErrorKind::StoreUnavailable, error))?;
        Ok(Peer::Rslock {
            rslock: Box::new(rslock),
            counter_key: format!("{run}:counter"),
        })
    }
    #[cfg(not(feature = "rslock"))]
    {
        let _ = (url, run);
        Err(Error::new(
            ErrorKind::InvalidOptions,
            "--rslock needs turnstile built with the `rslock` feature",
        ))
    }
}

/// Opens the peer for `url`, with a counter unique to this run.
async fn open_peer(url: &str, raw: bool, run: &str) -> Result<Peer, Error> {
    let scheme = url
        .split("://")
        .next()
        .unwrap_or_default()
        .to_ascii_lowercase();
    match (scheme.as_str(), raw) {
        #[cfg(feature = "redis")]
        ("redis" | "rediss", true) => {
            let client = redis::Client::open(url).map_err(|e| {
                Error::new(ErrorKind::InvalidUrl, format!("bad Redis URL {url:?}")).with_source(e)
            })?;
            let connection = tokio::time::timeout(
                Duration::from_secs(3),
                client.get_multiplexed_async_connection(),
            )
            .await
            .map_err(|_| {
                Error::new(
                    ErrorKind::StoreUnavailable,
                    format!("cannot reach {url} in 3s"),
                )
            })?
            .map_err(|e| {
                Error::new(ErrorKind::StoreUnavailable, format!("cannot reach {url}"))
                    .with_source(e)
            })?;
            Ok(Peer::Raw {
                connection,
                release: redis::Script::new(RAW_RELEASE),
                counter_key: format!("{run}:counter"),
            })
        }
        #[cfg(feature = "redis")]
        ("redis" | "rediss" | "redis+cluster", false) => {
            let store = turnstile::lock::redis::RedisLockStore::connect(url).await?;
            let counter = Counter::Redis {
                connection: store.connection().clone(),
                key: format!("{run}:counter"),
            };
            Ok(Peer::Library {
                locker: Locker::new(store),
                counter,
            })
        }
        #[cfg(feature = "etcd")]
        ("etcd", raw) => {
            let client = etcd::connect(url)
                .await
                .map_err(|e| Error::new(ErrorKind::StoreUnavailable, e))?;
            let counter = etcd::EtcdCounter {
                client: client.clone(),
                key: format!("{run}:counter"),
            };
            if raw {
                Ok(Peer::RawEtcd {
                    client: Box::new(client),
                    counter: Box::new(counter),
                })
            } else {
                Ok(Peer::Library {
                    locker: Locker::connect(url).await?,
                    counter: Counter::Etcd(Box::new(counter)),
                })
            }
        }
        #[cfg(feature = "zookeeper")]
        ("zk" | "zookeeper", raw) => {
            let (client, directory) = zookeeper::connect(url)
                .await
                .map_err(|e| Error::new(ErrorKind::StoreUnavailable, e))?;
            let counter = Box::new(zookeeper::ZooKeeperCounter {
                path: format!("{directory}/{run}-counter"),
                client,
                directory,
            });
            if raw {
                Ok(Peer::RawZooKeeper { counter })
            } else {
                Ok(Peer::Library {
                    locker: Locker::connect(url).await?,
                    counter: Counter::ZooKeeper(counter),
                })
            }
        }
        // RedLock: the lock over every node, the counter on the first one.
        #[cfg(feature = "redis")]
        ("redlock", false) => {
            let store = turnstile::lock::redlock::RedLockStore::connect(url).await?;
            let first = url
                .trim_start_matches("redlock://")
                .split([',', '/', '?'])
                .next()
                .unwrap_or_default();
            let counter_store =
                turnstile::lock::redis::RedisLockStore::connect(&format!("redis://{first}"))
                    .await?;
            let counter = Counter::Redis {
                connection: counter_store.connection().clone(),
                key: format!("{run}:counter"),
            };
            Ok(Peer::Library {
                locker: Locker::new(store),
                counter,
            })
        }
        #[cfg(feature = "sqlite")]
        ("sqlite", false) => {
            let store = turnstile::lock::sqlite::SqliteLockStore::open_url(url).await?;
            sqlx::query("CREATE TABLE IF NOT EXISTS turnstile_bench_counter (name TEXT PRIMARY KEY, value INTEGER NOT NULL)")
                .execute(store.pool())
                .await
                .map_err(|e| Error::new(ErrorKind::Store, "cannot create the bench counter").with_source(e))?;
            let counter = Counter::Sqlite {
                pool: store.pool().clone(),
                name: run.to_owned(),
            };
            Ok(Peer::Library {
                locker: Locker::new(store),
                counter,
            })
        }
        #[cfg(any(feature = "postgres", feature = "mysql"))]
        ("postgres" | "postgresql" | "mysql" | "mariadb", true) => {
            let raw = sql::RawSql::open(url).await?;
            let counter = sql::SqlCounter::open(url, run).await?;
            Ok(Peer::RawSql { raw, counter })
        }
        #[cfg(any(feature = "postgres", feature = "mysql"))]
        ("postgres" | "postgresql" | "mysql" | "mariadb", false) => {
            let locker = Locker::connect(url).await?;
            let counter = Counter::Sql(sql::SqlCounter::open(url, run).await?);
            Ok(Peer::Library { locker, counter })
        }
        (_, true) => Err(Error::new(
            ErrorKind::UnsupportedStore,
            format!("--raw needs a redis://, postgres://, mysql:// or etcd:// store; got {url:?}"),
        )),
        _ => {
            // Let the library explain what is wrong with the URL.
            Locker::connect(url).await?;
            Err(Error::new(
                ErrorKind::UnsupportedStore,
                format!("no benchmark counter for {url:?}"),
            ))
        }
    }
}

pub(crate) async fn run(args: BenchArgs) -> ExitCode {
    let work = match Workload::from_env() {
        Ok(work) => work,
        Err(error) => {
            eprintln!("turnstile: {error}");
            return ExitCode::from(exit::USAGE);
        }
    };
    let url = match args.store {
        Some(url) => url,
        None => match env_number("REDIS_PORT", 6390) {
            Ok(port) => format!("redis://127.0.0.1:{port}"),
            Err(error) => {
                eprintln!("turnstile: {error}");
                return ExitCode::from(exit::USAGE);
            }
        },
    };
    let run = format!(
        "turnstile-bench:{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    );
    if args.raw_blocking {
        #[cfg(feature = "redis")]
        return blocking::run(&url, &work, &run).await;
        #[cfg(not(feature = "redis"))]
        {
            eprintln!("turnstile: --raw-blocking needs the `redis` feature");
            return ExitCode::from(exit::USAGE);
        }
    }
    let opened = match &args.service {
        Some(service) => open_service_peer(service, &url, &run).await,
        None if args.rslock => open_rslock_peer(&url, &run).await,
        None if args.raw_writes => open_etcd_writes_peer(&url, &run).await,
        None => open_peer(&url, args.raw, &run)
            .await
            .map(|peer| match peer {
                Peer::Library { locker, counter } if args.unfenced => {
                    Peer::LibraryUnfenced { locker, counter }
                }
                other => other,
            }),
    };
    let peer = match opened {
        Ok(peer) => Rc::new(peer),
        Err(error) => {
            eprintln!("turnstile: {error}");
            return ExitCode::from(exit_code_for(&error));
        }
    };
    if let Err(error) = peer.counter_set(0).await {
        eprintln!("turnstile: cannot set up the counter: {error}");
        return ExitCode::from(exit::UNAVAILABLE);
    }
    // Warm-up, not measured.
    match peer.acquire(&format!("{run}:warmup"), &work).await {
        Ok(held) => {
            if let Err(error) = peer.release(held).await {
                eprintln!("turnstile: warm-up release failed: {error}");
                return ExitCode::from(exit::UNAVAILABLE);
            }
        }
        Err(_) => {
            eprintln!("turnstile: warm-up acquire failed");
            return ExitCode::from(exit::UNAVAILABLE);
        }
    }

    // Phase A: one worker, a new lock name each cycle.
    let window = Duration::from_secs(work.secs);
    let cores = CoreClock::start();
    let started = Instant::now();
    let deadline = started + window;
    let mut acquire_us = Vec::new();
    let mut uncontended_errors = 0u64;
    let mut cycle = 0u64;
    while Instant::now() < deadline {
        let name = format!("{run}:a:{cycle}");
        cycle += 1;
        let sent = Instant::now();
        match peer.acquire(&name, &work).await {
            Ok(held) => {
                acquire_us.push(sent.elapsed().as_secs_f64() * 1e6);
                if peer.release(held).await.is_err() {
                    uncontended_errors += 1;
                }
            }
            Err(AcquireError::Failed(error)) => {
                report_first_error(&error);
                uncontended_errors += 1;
            }
            Err(AcquireError::Timeout) => uncontended_errors += 1,
        }
    }
    let uncontended_elapsed = started.elapsed().as_secs_f64();
    let cores = cores.finish();
    acquire_us.sort_by(f64::total_cmp);

    // Phase B: WORKERS tasks on one hot lock.
    let hot = format!("{run}:hot");
    let barrier = Rc::new(tokio::sync::Barrier::new(work.workers));
    let work = Rc::new(work);
    let local = tokio::task::LocalSet::new();
    let (reports, contended_elapsed) = local
        .run_until(async {
            let mut tasks = Vec::new();
            let begun = Instant::now();
            for _ in 0..work.workers {
                let (peer, barrier, work, hot) = (
                    Rc::clone(&peer),
                    Rc::clone(&barrier),
                    Rc::clone(&work),
                    hot.clone(),
                );
                tasks.push(tokio::task::spawn_local(async move {
                    barrier.wait().await;
                    let deadline = Instant::now() + Duration::from_secs(work.secs);
                    let mut report = WorkerReport {
                        sections: 0,
                        waits_ms: Vec::new(),
                        timeouts: 0,
                        errors: 0,
                    };
                    while Instant::now() < deadline {
                        let asked = Instant::now();
                        let held = match peer.acquire(&hot, &work).await {
                            Ok(held) => held,
                            Err(AcquireError::Timeout) => {
                                report.timeouts += 1;
                                continue;
                            }
                            Err(AcquireError::Failed(error)) => {
                                report_first_error(&error);
                                report.errors += 1;
                                continue;
                            }
                        };
                        report.waits_ms.push(asked.elapsed().as_secs_f64() * 1e3);
                        let ok = match peer.counter_get().await {
                            Ok(value) => peer.counter_set(value + 1).await.is_ok(),
                            Err(_) => false,
                        };
                        if ok {
                            report.sections += 1;
                        } else {
                            report.errors += 1;
                        }
                        if peer.release(held).await.is_err() {
                            report.errors += 1;
                        }
                    }
                    report
                }));
            }
            let mut reports = Vec::new();
            for task in tasks {
                reports.push(task.await.unwrap_or(WorkerReport {
                    sections: 0,
                    waits_ms: Vec::new(),
                    timeouts: 0,
                    errors: 1,
                }));
            }
            (reports, begun.elapsed().as_secs_f64())
        })
        .await;

    let counter_value = peer.counter_get().await.unwrap_or(-1);
    let report = report_json(
        peer.name(),
        peer.wait_strategy(),
        &work,
        Uncontended {
            acquire_us,
            elapsed: uncontended_elapsed,
            errors: uncontended_errors,
            cores,
        },
        &reports,
        contended_elapsed,
        counter_value,
    );
    println!("{report}");
    ExitCode::SUCCESS
}
