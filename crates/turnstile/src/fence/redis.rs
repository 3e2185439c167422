//! Fenced writes in Redis: a script that writes only if the token is not smaller than
//! the largest token the resource has seen.
//!
//! ```no_run
//! # async fn demo(guard: turnstile::LockGuard) -> turnstile::Result<()> {
//! use turnstile::fence::redis::RedisFencedStore;
//!
//! let store = RedisFencedStore::connect("redis://127.0.0.1:6379").await?;
//! let outcome = store.write("report:2026-11", guard.fencing_token(), b"totals...").await?;
//! if !outcome.is_applied() {
//!     // A newer holder has written already: this holder lost its lock.
//! }
//! # Ok(())
//! # }
//! ```

use std::time::Duration;

use redis::Script;
use redis::aio::ConnectionManager;

use super::{FenceOutcome, FencingToken, validate_resource};
use crate::engine::redis::RedisLockConfig;
use crate::engine::redis::{connect_manager, map_error, open_client};
use crate::error::{Error, ErrorKind, Result};

// Tokens are compared as decimal strings (length first), so every u64 compares
// exactly; Lua numbers are doubles and would not.
const WRITE: &str = r"
local seen = redis.call('GET', KEYS[1])
if seen and (#ARGV[1] < #seen or (#ARGV[1] == #seen and ARGV[1] < seen)) then
  return {0, seen}
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[2])
return {1, ARGV[1]}
";

// KEYS[1] fence token, KEYS[2] value, KEYS[3] where versions before the key spaces
// were split kept the value (`P:{R}:value`, an election's leader value key too): read
// only for a resource written before, until its next write, and only if that key has
// no expiry. The old fenced write was a plain SET (no expiry); a leader's value always
// has one, so it is never read as the resource's data.
const READ: &str = r"
local value = redis.call('GET', KEYS[2])
if value or redis.call('EXISTS', KEYS[1]) == 0 then
  return value
end
if redis.call('PTTL', KEYS[3]) == -1 then
  return redis.call('GET', KEYS[3])
end
return false
";

/// A key-value store in Redis whose writes are fenced by token.
///
/// Resource `R` under prefix `P` keeps its value at `P:{R}:fenced-value` and the
/// largest token it has accepted at `P:{R}:fence-token` (one Cluster slot): keys of
/// their own, apart from every lock's, semaphore's and election's under the same
/// prefix (an election's leader value for the lock `R` is `P:{R}:value`, where earlier
/// versions kept the resource's value too; a resource written by one is read from
/// there until its next write).
#[derive(Clone)]
pub struct RedisFencedStore {
    connection: ConnectionManager,
    prefix: String,
    write: Script,
    read: Script,
}

impl std::fmt::Debug for RedisFencedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisFencedStore")
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl RedisFencedStore {
    /// Connects with the key prefix in the URL's `turnstile_prefix` option (the same
    /// option the lock store takes), `turnstile` by default.
    pub async fn connect(url: &str) -> Result<Self> {
        let (driver_url, options) = crate::url::split_url_options(url);
        let config = RedisLockConfig::default().apply_url_options(&options)?;
        let client = open_client(&driver_url, None)?;
        let connection = connect_manager(
            client,
            &driver_url,
            Duration::from_secs(3),
            Duration::from_secs(3),
        )
        .await?;
        Ok(RedisFencedStore::with_connection(
            connection,
            config.get_prefix(),
        ))
    }

    /// Uses an existing connection (for example [`RedisLockStore::connection`](crate::lock::redis::RedisLockStore::connection)).
    pub fn with_connection(connection: ConnectionManager, prefix: impl Into<String>) -> Self {
        RedisFencedStore {
            connection,
            prefix: prefix.into(),
            write: Script::new(WRITE),
            read: Script::new(READ),
        }
    }

    fn keys(&self, resource: &str) -> (String, String) {
        (
            format!("{}:{{{resource}}}:fence-token", self.prefix),
            format!("{}:{{{resource}}}:fenced-value", self.prefix),
        )
    }

    /// Writes `value` to `resource` if `token` is not smaller than any token the
    /// resource has accepted; otherwise writes nothing and says which token beat it.
    pub async fn write(
        &self,
        resource: &str,
        token: FencingToken,
        value: &[u8],
    ) -> Result<FenceOutcome> {
        validate_resource(resource)?;
        let (fence_key, value_key) = self.keys(resource);
        let mut connection = self.connection.clone();
        let (applied, seen): (i64, String) = self
            .write
            .key(fence_key)
            .key(value_key)
            .arg(token.get().to_string())
            .arg(value)
            .invoke_async(&mut connection)
            .await
            .map_err(|error| map_error(error, "cannot make the fenced write"))?;
        if applied == 1 {
            return Ok(FenceOutcome::Applied);
        }
        let highest_seen = seen.parse().map_err(|_| {
            Error::new(
                ErrorKind::Store,
                format!("the fence key of {resource:?} holds {seen:?}, not a token"),
            )
        })?;
        Ok(FenceOutcome::Rejected { highest_seen })
    }

    /// The value last written to `resource`.
    pub async fn read(&self, resource: &str) -> Result<Option<Vec<u8>>> {
        validate_resource(resource)?;
        let (fence_key, value_key) = self.keys(resource);
        let mut connection = self.connection.clone();
        self.read
            .key(fence_key)
            .key(value_key)
            .key(format!("{}:{{{resource}}}:value", self.prefix))
            .invoke_async(&mut connection)
            .await
            .map_err(|error| map_error(error, "cannot read the fenced value"))
    }
}
