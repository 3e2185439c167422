//! The SQL floors for `turnstile bench lock --raw`: the same kind of statements the
//! library sends, on bare sqlx, with busy retry and no library.

use std::time::Duration;

use tokio::time::Instant;
use turnstile::{Error, ErrorKind};

/// A raw peer on a SQL database. Its connections are kept between statements (see
/// [`Kept`]), so a lock cycle costs its statements' round trips and nothing more.
pub(crate) enum RawSql {
    #[cfg(feature = "postgres")]
    Postgres(Kept<sqlx::Postgres>),
    /// Session advisory locks (`pg_try_advisory_lock`), the floor of session mode: chosen
    /// by `turnstile_mode=session` in the URL.
    #[cfg(feature = "postgres")]
    PostgresAdvisory(Kept<sqlx::Postgres>),
    /// `GET_LOCK` with a token row written per acquire (an InnoDB commit), or, with
    /// `turnstile_tokens=off` in the URL, `GET_LOCK` alone: the primitive itself, the
    /// floor the library's tokens are measured against.
    #[cfg(feature = "mysql")]
    Mysql {
        connections: Kept<sqlx::MySql>,
        tokens: bool,
    },
}

/// Connections kept between statements instead of going back to the pool after each:
/// sqlx pings a connection it hands out and one that comes back, two round trips per
/// lock cycle that a raw floor must not pay (the library's stores keep theirs the same
/// way).
pub(crate) struct Kept<DB: sqlx::Database> {
    pool: sqlx::Pool<DB>,
    idle: std::sync::Mutex<Vec<sqlx::pool::PoolConnection<DB>>>,
}

impl<DB: sqlx::Database> Kept<DB> {
    fn new(pool: sqlx::Pool<DB>) -> Self {
        Kept {
            pool,
            idle: std::sync::Mutex::default(),
        }
    }

    async fn take(&self) -> Result<sqlx::pool::PoolConnection<DB>, String> {
        let kept = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match kept {
            Some(connection) => Ok(connection),
            None => self.pool.acquire().await.map_err(|e| e.to_string()),
        }
    }

    fn put(&self, connection: sqlx::pool::PoolConnection<DB>) {
        self.idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(connection);
    }

    /// Runs one statement on a kept connection, and keeps it again if it succeeded.
    async fn run<T>(
        &self,
        statement: impl AsyncFnOnce(&mut DB::Connection) -> Result<T, sqlx::Error>,
    ) -> Result<T, String> {
        let mut connection = self.take().await?;
        let answer = statement(&mut connection)
            .await
            .map_err(|e| e.to_string())?;
        self.put(connection);
        Ok(answer)
    }
}

/// A lock the raw peer holds.
pub(crate) enum RawSqlHeld {
    #[cfg(feature = "postgres")]
    Postgres { name: String, owner: String },
    #[cfg(feature = "postgres")]
    PostgresAdvisory {
        connection: sqlx::pool::PoolConnection<sqlx::Postgres>,
        name: String,
    },
    #[cfg(feature = "mysql")]
    Mysql {
        connection: sqlx::pool::PoolConnection<sqlx::MySql>,
        key: String,
    },
}

/// A counter row incremented with two separate statements (read, then write), on kept
/// connections like the floors'.
pub(crate) enum SqlCounter {
    #[cfg(feature = "postgres")]
    Postgres {
        connections: Kept<sqlx::Postgres>,
        name: String,
    },
    #[cfg(feature = "mysql")]
    Mysql {
        connections: Kept<sqlx::MySql>,
        name: String,
    },
}

#[cfg(feature = "postgres")]
const PG_ACQUIRE: &str = "WITH attempt AS (
        INSERT INTO turnstile_bench_raw_locks AS l (name, owner, expires_at)
        VALUES ($1, $2, clock_timestamp() + make_interval(secs => $3::float8 / 1000))
        ON CONFLICT (name) DO UPDATE SET owner = EXCLUDED.owner, expires_at = EXCLUDED.expires_at
        WHERE l.owner IS NULL OR l.expires_at <= clock_timestamp()
        RETURNING name),
     bumped AS (
        INSERT INTO turnstile_bench_raw_tokens AS t (name, token) SELECT name, 1 FROM attempt
        ON CONFLICT (name) DO UPDATE SET token = t.token + 1
        RETURNING token)
     SELECT token FROM bumped";

fn setup_error(error: sqlx::Error) -> Error {
    Error::new(ErrorKind::Store, "cannot set up the benchmark tables").with_source(error)
}

fn unreachable_store(error: sqlx::Error) -> Error {
    Error::new(ErrorKind::StoreUnavailable, "cannot reach the database").with_source(error)
}

impl SqlCounter {
    /// A counter for the library peer or the raw peer, in the store's database.
    pub(crate) async fn open(url: &str, run: &str) -> Result<SqlCounter, Error> {
        // The library's `turnstile_*` options are not the driver's.
        let url = &crate::without_turnstile_options(url);
        let scheme = url
            .split("://")
            .next()
            .unwrap_or_default()
            .to_ascii_lowercase();
        match scheme.as_str() {
            #[cfg(feature = "postgres")]
            "postgres" | "postgresql" => {
                let pool = sqlx::PgPool::connect(url)
                    .await
                    .map_err(unreachable_store)?;
                sqlx::query("CREATE TABLE IF NOT EXISTS turnstile_bench_counter (name TEXT PRIMARY KEY, value BIGINT NOT NULL)")
                    .execute(&pool)
                    .await
                    .map_err(setup_error)?;
                Ok(SqlCounter::Postgres {
                    connections: Kept::new(pool),
                    name: run.to_owned(),
                })
            }
            #[cfg(feature = "mysql")]
            "mysql" | "mariadb" => {
                let pool = sqlx::MySqlPool::connect(url)
                    .await
                    .map_err(unreachable_store)?;
                sqlx::query("CREATE TABLE IF NOT EXISTS turnstile_bench_counter (name VARCHAR(128) PRIMARY KEY, value BIGINT NOT NULL) ENGINE = InnoDB")
                    .execute(&pool)
                    .await
                    .map_err(setup_error)?;
                Ok(SqlCounter::Mysql {
                    connections: Kept::new(pool),
                    name: run.to_owned(),
                })
            }
            other => Err(Error::new(
                ErrorKind::UnsupportedStore,
                format!("no SQL counter for {other}://"),
            )),
        }
    }

    pub(crate) async fn get(&self) -> Result<i64, String> {
        let value = match self {
            #[cfg(feature = "postgres")]
            SqlCounter::Postgres { connections, name } => {
                connections
                    .run(async |connection| {
                        sqlx::query_scalar(
                            "SELECT value FROM turnstile_bench_counter WHERE name = $1",
                        )
                        .bind(name)
                        .fetch_optional(connection)
                        .await
                    })
                    .await?
            }
            #[cfg(feature = "mysql")]
            SqlCounter::Mysql { connections, name } => {
                connections
                    .run(async |connection| {
                        sqlx::query_scalar(
                            "SELECT value FROM turnstile_bench_counter WHERE name = ?",
                        )
                        .bind(name)
                        .fetch_optional(connection)
                        .await
                    })
                    .await?
            }
        };
        Ok(value.unwrap_or_default())
    }

    pub(crate) async fn set(&self, value: i64) -> Result<(), String> {
        match self {
            #[cfg(feature = "postgres")]
            SqlCounter::Postgres { connections, name } => connections
                .run(async |connection| {
                    sqlx::query(
                        "INSERT INTO turnstile_bench_counter (name, value) VALUES ($1, $2)
                         ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value",
                    )
                    .bind(name)
                    .bind(value)
                    .execute(connection)
                    .await
                })
                .await
                .map(|_| ()),
            #[cfg(feature = "mysql")]
            SqlCounter::Mysql { connections, name } => connections
                .run(async |connection| {
                    sqlx::query(
                        "INSERT INTO turnstile_bench_counter (name, value) VALUES (?, ?)
                         ON DUPLICATE KEY UPDATE value = VALUES(value)",
                    )
                    .bind(name)
                    .bind(value)
                    .execute(connection)
                    .await
                })
                .await
                .map(|_| ()),
        }
    }
}

impl RawSql {
    /// Connects and creates the raw peer's own tables.
    pub(crate) async fn open(url: &str) -> Result<RawSql, Error> {
        let scheme = url
            .split("://")
            .next()
            .unwrap_or_default()
            .to_ascii_lowercase();
        match scheme.as_str() {
            #[cfg(feature = "postgres")]
            "postgres" | "postgresql" => {
                use std::str::FromStr;
                let (base, query) = url.split_once('?').unwrap_or((url, ""));
                let advisory = query
                    .split('&')
                    .any(|pair| pair == "turnstile_mode=session");
                // Durable commits: the floor pays for them (session advisory locks write
                // nothing, so there it makes no difference).
                let options = sqlx::postgres::PgConnectOptions::from_str(base)
                    .map_err(|e| {
                        Error::new(ErrorKind::InvalidUrl, "bad PostgreSQL URL").with_source(e)
                    })?
                    .options([("synchronous_commit", "on")]);
                if advisory {
                    let pool = sqlx::postgres::PgPoolOptions::new()
                        .max_connections(16)
                        .connect_with(options)
                        .await
                        .map_err(unreachable_store)?;
                    return Ok(RawSql::PostgresAdvisory(Kept::new(pool)));
                }
                let pool = sqlx::postgres::PgPoolOptions::new()
                    .max_connections(8)
                    .connect_with(options)
                    .await
                    .map_err(unreachable_store)?;
                for statement in [
                    "CREATE TABLE IF NOT EXISTS turnstile_bench_raw_locks (name TEXT PRIMARY KEY, owner TEXT, expires_at TIMESTAMPTZ NOT NULL)",
                    "CREATE TABLE IF NOT EXISTS turnstile_bench_raw_tokens (name TEXT PRIMARY KEY, token BIGINT NOT NULL)",
                ] {
                    sqlx::query(statement)
                        .execute(&pool)
                        .await
                        .map_err(setup_error)?;
                }
                Ok(RawSql::Postgres(Kept::new(pool)))
            }
            #[cfg(feature = "mysql")]
            "mysql" | "mariadb" => {
                let (base, query) = url.split_once('?').unwrap_or((url, ""));
                let tokens = !query.split('&').any(|pair| pair == "turnstile_tokens=off");
                let pool = sqlx::mysql::MySqlPoolOptions::new()
                    .max_connections(16)
                    .connect(base)
                    .await
                    .map_err(unreachable_store)?;
                sqlx::query("CREATE TABLE IF NOT EXISTS turnstile_bench_raw_tokens (name VARCHAR(128) PRIMARY KEY, token BIGINT UNSIGNED NOT NULL) ENGINE = InnoDB")
                    .execute(&pool)
                    .await
                    .map_err(setup_error)?;
                Ok(RawSql::Mysql {
                    connections: Kept::new(pool),
                    tokens,
                })
            }
            other => Err(Error::new(
                ErrorKind::UnsupportedStore,
                format!("--raw has no floor for {other}://"),
            )),
        }
    }

    /// Busy-retries the acquire statement until it wins or `wait` passes; `Ok(None)`
    /// is a timeout. (`ttl_ms` is the PostgreSQL lease; a named lock has none.)
    #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
    pub(crate) async fn acquire(
        &self,
        name: &str,
        ttl_ms: u64,
        wait: Duration,
    ) -> Result<Option<RawSqlHeld>, String> {
        let deadline = Instant::now() + wait;
        let owner = format!("{:032x}", rand::random::<u128>());
        match self {
            #[cfg(feature = "postgres")]
            RawSql::Postgres(connections) => loop {
                let token: Option<i64> = connections
                    .run(async |connection| {
                        sqlx::query_scalar(PG_ACQUIRE)
                            .bind(name)
                            .bind(&owner)
                            .bind(ttl_ms as f64)
                            .fetch_optional(connection)
                            .await
                    })
                    .await?;
                if token.is_some() {
                    return Ok(Some(RawSqlHeld::Postgres {
                        name: name.to_owned(),
                        owner,
                    }));
                }
                if Instant::now() >= deadline {
                    return Ok(None);
                }
            },
            #[cfg(feature = "postgres")]
            RawSql::PostgresAdvisory(connections) => {
                let mut connection = connections.take().await?;
                loop {
                    let got: bool =
                        sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtextextended($1, 0))")
                            .bind(name)
                            .fetch_one(&mut *connection)
                            .await
                            .map_err(|e| e.to_string())?;
                    if got {
                        return Ok(Some(RawSqlHeld::PostgresAdvisory {
                            connection,
                            name: name.to_owned(),
                        }));
                    }
                    if Instant::now() >= deadline {
                        return Ok(None);
                    }
                }
            }
            #[cfg(feature = "mysql")]
            RawSql::Mysql {
                connections,
                tokens,
            } => {
                let mut connection = connections.take().await?;
                // Benchmark names are short and lower case: usable as named-lock keys.
                let key: String = name.chars().take(64).collect();
                loop {
                    let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 0)")
                        .bind(&key)
                        .fetch_one(&mut *connection)
                        .await
                        .map_err(|e| e.to_string())?;
                    if got == Some(1) && !tokens {
                        return Ok(Some(RawSqlHeld::Mysql { connection, key }));
                    }
                    if got == Some(1) {
                        sqlx::query(
                            "INSERT INTO turnstile_bench_raw_tokens (name, token) VALUES (?, LAST_INSERT_ID(1))
                             ON DUPLICATE KEY UPDATE token = LAST_INSERT_ID(token + 1)",
                        )
                        .bind(&key)
                        .execute(&mut *connection)
                        .await
                        .map_err(|e| e.to_string())?;
                        return Ok(Some(RawSqlHeld::Mysql { connection, key }));
                    }
                    if Instant::now() >= deadline {
                        return Ok(None);
                    }
                }
            }
        }
    }

    pub(crate) async fn release(&self, held: RawSqlHeld) -> Result<(), String> {
        match (self, held) {
            #[cfg(feature = "postgres")]
            (RawSql::Postgres(connections), RawSqlHeld::Postgres { name, owner }) => connections
                .run(async |connection| {
                    sqlx::query(
                        "UPDATE turnstile_bench_raw_locks SET owner = NULL WHERE name = $1 AND owner = $2",
                    )
                    .bind(name)
                    .bind(owner)
                    .execute(connection)
                    .await
                })
                .await
                .map(|_| ()),
            #[cfg(feature = "postgres")]
            (
                RawSql::PostgresAdvisory(connections),
                RawSqlHeld::PostgresAdvisory {
                    mut connection,
                    name,
                },
            ) => {
                sqlx::query("SELECT pg_advisory_unlock(hashtextextended($1, 0))")
                    .bind(name)
                    .execute(&mut *connection)
                    .await
                    .map_err(|e| e.to_string())?;
                connections.put(connection);
                Ok(())
            }
            #[cfg(feature = "mysql")]
            (
                RawSql::Mysql { connections, .. },
                RawSqlHeld::Mysql {
                    mut connection,
                    key,
                },
            ) => {
                sqlx::query("DO RELEASE_LOCK(?)")
                    .bind(key)
                    .execute(&mut *connection)
                    .await
                    .map_err(|e| e.to_string())?;
                connections.put(connection);
                Ok(())
            }
            #[allow(unreachable_patterns)]
            _ => Err("a lock of one database handed to another".to_owned()),
        }
    }
}
