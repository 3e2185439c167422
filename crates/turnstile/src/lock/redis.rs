//! The Redis engine: one atomic server-side script per operation.
//!
//! # Keys
//! A lock named `NAME` under the prefix `P` (default `turnstile`) uses:
//! - `P:{NAME}:lock` — a string `OWNER:TOKEN` with a millisecond expiry (the lease);
//! - `P:{NAME}:fence` — the last fencing token issued for `NAME`, kept for the fence
//!   retention (default 7 days) after the last acquisition;
//! - `P:{NAME}:value` — `OWNER:VALUE`, what the holder advertises (an election's
//!   leader value), read only while `OWNER` holds the lock and kept as long as the
//!   fence key;
//! - `P:{NAME}:permits` — a semaphore's number of permits (no expiry; its permits
//!   are the locks `NAME#0`, `NAME#1`, …);
//! - the Pub/Sub channel `P:{NAME}:released`, announced on every release (and when a
//!   holder proclaims a value).
//!
//! The `{NAME}` hash tag puts all keys of one lock in one Redis Cluster slot, so every
//! script touches a single slot.
//!
//! # Redis Cluster (`redis+cluster://host:port[,host:port…]`)
//! The same scripts run on a cluster client, which routes each call by its keys' slot
//! and follows `MOVED` redirections and failovers (it retries within the response
//! timeout). Release announcements use **sharded Pub/Sub** (`SPUBLISH` from the
//! scripts, `SSUBSCRIBE` by waiters, on RESP3), whose channels live in the lock's slot
//! and so follow it; waiters also re-check every 50–500 ms, since messages can be lost
//! while a node fails over. Tested on three masters and three replicas: the whole
//! conformance suite, a held lock whose slot moves to another master (`redis-cli
//! --cluster reshard`: renewals follow the move, a second client stays out), and a
//! master killed under a held lock (the replica takes over; the store answers again at
//! once, and the next token is larger). Replication is asynchronous, so a failover can
//! lose a lock that its master had not yet sent to the replica: the holder's next
//! renewal finds it gone and its lost signal fires (within TTL/3), and tokens keep
//! growing by the clock floor, as after a single server's restart. (In the failover
//! test here the replica had the lock each time; the loss path is the restart test's.)
//!
//! # Redis Sentinel (`redis+sentinel://host:port[,host:port…]/MASTER`)
//! The store asks the sentinels which server is `MASTER` (`SENTINEL
//! get-master-addr-by-name`, then `ROLE` on that server, since during a failover the
//! named one may still be the old master), and asks again whenever a command finds the
//! server gone or read-only (`READONLY`), resending that command once on the new
//! master; the Pub/Sub connection for release notifications follows. A failover
//! behaves as on a cluster: locks the replica had survive, others are lost (the holder
//! learns at its next renewal), and tokens keep growing by the clock floor. Tested with
//! a master, a replica and three sentinels: the conformance suite, and the master
//! killed under a held lock.
//!
//! # Guarantees
//! - **Atomicity**: acquire, extend, release, inspect and break are each one Lua script
//!   (called by SHA, reloaded on `NOSCRIPT`); Redis runs a script alone.
//! - **Expiry** is decided by the Redis server's clock (`PX`), never the client's.
//!   Holders measure their own validity on their monotonic clock from the moment the
//!   request was sent, minus a drift allowance.
//! - **Fencing tokens** are `max(last + 1, server TIME in µs since the Unix epoch)`.
//!   They stay strictly increasing across a restart that lost every key (no
//!   persistence) **provided the server's wall clock does not step back** across the
//!   restart by more than the restart took — true of an NTP-disciplined host. After a
//!   failover the new primary's clock must likewise be ahead of the last token the old
//!   primary issued; with synchronised clocks it is, since a failover takes far longer
//!   than clock skew. The same assumption covers fence keys that aged out of retention.
//! - **Restart or failover without persistence**: held locks vanish (the note's "single
//!   Redis fails" row). A second holder can then acquire while the first still works;
//!   the first holder's next renewal finds no lock and its lost signal fires (within
//!   TTL/3), and its writes are refused by fenced stores because the second holder's
//!   token is larger. Redis replication is asynchronous, so a failover can lose an
//!   acquisition in the same way: **Redis locks are best-effort under failover**. Use
//!   fencing where correctness matters.
//! - **Partition**: a holder cut off from Redis cannot renew; its lost signal fires at
//!   its local validity deadline, which is before the server-side lease ends (by the
//!   drift allowance), so while clocks run at similar rates it stops before another
//!   holder can start.
//! - **Waiting**: waiters subscribe to the release channel and are woken by the
//!   release script's `PUBLISH`; if a message is lost (connection drop) they re-check
//!   when the holder's lease would run out. Expiry itself sends no message, so a waiter
//!   behind a crashed holder wakes at the holder's remaining TTL.

use std::sync::Arc;
use std::time::Duration;

use redis::{Script, Value};

use super::{
    BoxFuture, ExtendOutcome, HolderAndValue, LockBackend, LockInfo, LockName, LossReason, OwnerId,
    ReleaseOutcome, ReleaseWatch, TryAcquire, TryAcquireUnfenced, ceil_millis,
};
pub use crate::engine::redis::RedisConnection;
use crate::engine::redis::{
    ClusterNotifier, Notifier, SentinelConnection, connect_cluster, connect_manager, map_error,
    open_client,
};
use crate::error::{Error, ErrorKind, Result};

/// Lua: `issue(owner, ttl_ms, retention_ms, only_if_free)` takes the lock in KEYS[1]
/// for `owner` with a fencing token `max(last + 1, server µs clock)` kept in KEYS[2].
/// With `only_if_free` it returns `nil` and changes nothing when the lock is held.
macro_rules! issue_lua {
    () => {
        r"
local function issue(owner, ttl, retention, only_if_free)
  local now = redis.call('TIME')
  local token = tonumber(now[1]) * 1000000 + tonumber(now[2])
  local last = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
  if last >= token then
    token = last + 1
  end
  local text = string.format('%d', token)
  if only_if_free then
    if not redis.call('SET', KEYS[1], owner .. ':' .. text, 'NX', 'PX', ttl) then
      return nil
    end
  else
    redis.call('SET', KEYS[1], owner .. ':' .. text, 'PX', ttl)
  end
  redis.call('SET', KEYS[2], text, 'PX', retention)
  return text
end
"
    };
}

/// Takes the lock, or, when `owner` already holds it (its earlier request ran but the
/// reply was lost), renews it and returns the token it has.
const ACQUIRE: &str = concat!(
    issue_lua!(),
    r"
local token = issue(ARGV[1], ARGV[2], ARGV[3], true)
if token then
  return {1, token}
end
local held = redis.call('GET', KEYS[1])
if held and string.sub(held, 1, 33) == ARGV[1] .. ':' then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, string.sub(held, 34)}
end
return {0, redis.call('PTTL', KEYS[1])}
"
);

/// Release by ARGV[1] and acquire for ARGV[2] in one step. Returns
/// `{released, acquired, token_or_pttl}` with `released` 1 (was ours), 0 (had expired)
/// or -1 (someone else holds it, and then nothing changes).
const HAND_OVER: &str = concat!(
    issue_lua!(),
    r"
local value = redis.call('GET', KEYS[1])
local released = 0
if value then
  if string.sub(value, 1, 33) ~= ARGV[1] .. ':' then
    return {-1, 0, redis.call('PTTL', KEYS[1])}
  end
  released = 1
end
return {released, 1, issue(ARGV[2], ARGV[3], ARGV[4], false)}
"
);

const EXTEND: &str = r"
local value = redis.call('GET', KEYS[1])
if not value then
  return 0
end
if string.sub(value, 1, 33) ~= ARGV[1] .. ':' then
  return -1
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
";

const RELEASE: &str = r"
local value = redis.call('GET', KEYS[1])
if not value then
  return 0
end
if string.sub(value, 1, 33) ~= ARGV[1] .. ':' then
  return -1
end
redis.call('DEL', KEYS[1])
return 1 + redis.call(ARGV[3], ARGV[2], 'released')
";

const INSPECT: &str = r"
local value = redis.call('GET', KEYS[1])
if not value then
  return false
end
return {value, redis.call('PTTL', KEYS[1])}
";

/// Stores `OWNER:VALUE` in KEYS[2] while ARGV[1] holds the lock in KEYS[1], kept as
/// long as the fence key (ARGV[3] ms), and announces it on the release channel so that
/// observers look again.
const PROCLAIM: &str = r"
local held = redis.call('GET', KEYS[1])
if not held or string.sub(held, 1, 33) ~= ARGV[1] .. ':' then
  return 0
end
redis.call('SET', KEYS[2], ARGV[1] .. ':' .. ARGV[2], 'PX', ARGV[3])
redis.call(ARGV[5], ARGV[4], 'proclaimed')
return 1
";

/// The holder, its lease and, when the holder wrote it, its value: a value written by
/// an earlier holder has another owner in front and is not returned.
const INSPECT_WITH_VALUE: &str = r"
local held = redis.call('GET', KEYS[1])
if not held then
  return false
end
local pttl = redis.call('PTTL', KEYS[1])
local value = redis.call('GET', KEYS[2])
if value and string.sub(value, 1, 33) == string.sub(held, 1, 33) then
  return {held, pttl, string.sub(value, 34)}
end
return {held, pttl}
";

/// Keeps the number of permits in KEYS[1] if one is there, else stores ARGV[1]; answers
/// the number kept.
const DECLARE_PERMITS: &str = r"
local stored = redis.call('GET', KEYS[1])
if stored then
  return stored
end
redis.call('SET', KEYS[1], ARGV[1])
return ARGV[1]
";

const FORGET_PERMITS: &str = r"
local stored = redis.call('GET', KEYS[1])
redis.call('DEL', KEYS[1])
return stored
";

const BREAK: &str = r"
local value = redis.call('GET', KEYS[1])
if not value then
  return false
end
local pttl = redis.call('PTTL', KEYS[1])
redis.call('DEL', KEYS[1])
redis.call(ARGV[2], ARGV[1], 'broken')
return {value, pttl}
";

pub use crate::engine::redis::RedisLockConfig;

/// Locks in Redis (single node; the key layout is Cluster-ready).
#[derive(Clone)]
pub struct RedisLockStore {
    connection: RedisConnection,
    config: RedisLockConfig,
    scripts: Arc<Scripts>,
    notifier: Notifications,
    url: String,
}

/// Where release notifications come from: Pub/Sub on one server, sharded Pub/Sub on a
/// cluster.
#[derive(Clone)]
enum Notifications {
    Single(Arc<Notifier>),
    Cluster(Arc<ClusterNotifier>),
}

impl Notifications {
    /// Whether a waiter of this store listens on `channel`.
    fn is_watched(&self, channel: &str) -> bool {
        match self {
            Notifications::Single(notifier) => notifier.is_watched(channel),
            Notifications::Cluster(notifier) => notifier.is_watched(channel),
        }
    }

    /// The command the release scripts announce with.
    fn publish_command(&self) -> &'static str {
        match self {
            Notifications::Single(_) => "PUBLISH",
            Notifications::Cluster(_) => "SPUBLISH",
        }
    }
}

struct Scripts {
    acquire: Script,
    hand_over: Script,
    extend: Script,
    release: Script,
    inspect: Script,
    force: Script,
    proclaim: Script,
    inspect_with_value: Script,
}

impl std::fmt::Debug for RedisLockStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLockStore")
            .field("url", &self.url)
            .field("prefix", &self.config.prefix)
            .finish()
    }
}

impl RedisLockStore {
    /// Connects with the settings in the URL's `turnstile_*` options
    /// (`redis://host/0?turnstile_prefix=app`), or the defaults.
    pub async fn connect(url: &str) -> Result<Self> {
        let (driver_url, options) = crate::url::split_url_options(url);
        let config = RedisLockConfig::default().apply_url_options(&options)?;
        RedisLockStore::connect_with(&driver_url, config).await
    }

    /// Connects with `config`. Fails within about the connect timeout if Redis is not
    /// reachable.
    pub async fn connect_with(url: &str, config: RedisLockConfig) -> Result<Self> {
        config.validate()?;
        if let Some(hosts) = cluster_hosts(url)? {
            return RedisLockStore::connect_cluster(&hosts, config).await;
        }
        if let Some((sentinels, master)) = sentinel_target(url)? {
            return RedisLockStore::connect_sentinel(&sentinels, &master, config).await;
        }
        let client = open_client(url, config.tls_root_certificate.as_deref())?;
        let connection = connect_manager(
            client.clone(),
            url,
            config.connect_timeout,
            config.response_timeout,
        )
        .await?;
        let mut store = RedisLockStore {
            connection: RedisConnection::Single(connection),
            notifier: Notifications::Single(Notifier::new(
                client,
                config.connect_timeout,
                config.response_timeout,
            )),
            config,
            scripts: Arc::new(scripts()),
            url: crate::url::redact(url),
        };
        store.load_scripts().await?;
        Ok(store)
    }

    /// Connects to the master that the sentinels `sentinels` (`host:port`) name for
    /// `master`, and follows it across failovers.
    async fn connect_sentinel(
        sentinels: &[String],
        master: &str,
        config: RedisLockConfig,
    ) -> Result<Self> {
        let (connection, client) = SentinelConnection::connect(
            sentinels,
            master,
            config.connect_timeout,
            config.response_timeout,
        )
        .await?;
        let notifier = Notifier::new(client, config.connect_timeout, config.response_timeout);
        connection.follow_with(&notifier);
        let mut store = RedisLockStore {
            connection: RedisConnection::Sentinel(connection),
            notifier: Notifications::Single(notifier),
            config,
            scripts: Arc::new(scripts()),
            url: format!("redis+sentinel://{}/{master}", sentinels.join(",")),
        };
        store.load_scripts().await?;
        Ok(store)
    }

    /// Connects to a Redis Cluster through its seed nodes (`host:port`).
    async fn connect_cluster(hosts: &[String], config: RedisLockConfig) -> Result<Self> {
        let (pushes, received) = tokio::sync::mpsc::unbounded_channel();
        let connection = connect_cluster(
            hosts,
            config.connect_timeout,
            config.response_timeout,
            pushes,
        )
        .await?;
        let notifier = ClusterNotifier::new(connection.clone(), config.response_timeout, received);
        // Scripts load on each node at their first use there (`NOSCRIPT`, then `EVAL`).
        Ok(RedisLockStore {
            connection: RedisConnection::Cluster(connection),
            notifier: Notifications::Cluster(notifier),
            config,
            scripts: Arc::new(scripts()),
            url: format!("redis+cluster://{}", hosts.join(",")),
        })
    }

    /// Runs the release script, announcing on `channel`: its answer for
    /// `release_outcome`.
    async fn release_code(&self, name: &LockName, owner: &OwnerId, channel: &str) -> Result<i64> {
        let mut connection = self.connection.clone();
        self.scripts
            .release
            .key(self.lock_key(name))
            .arg(owner.as_str())
            .arg(channel)
            .arg(self.notifier.publish_command())
            .invoke_async(&mut connection)
            .await
            .map_err(|error| map_error(error, "cannot release the lock"))
    }

    /// Loads every script once so the first calls go straight to `EVALSHA`.
    async fn load_scripts(&mut self) -> Result<()> {
        if matches!(self.connection, RedisConnection::Cluster(_)) {
            return Ok(());
        }
        let scripts = Arc::clone(&self.scripts);
        for script in [
            &scripts.acquire,
            &scripts.extend,
            &scripts.release,
            &scripts.inspect,
            &scripts.force,
        ] {
            script
                .load_async(&mut self.connection)
                .await
                .map_err(|error| map_error(error, "cannot load the lock scripts"))?;
        }
        Ok(())
    }

    /// The connection (multiplexed; to one server or a cluster), to share with the
    /// application.
    pub fn connection(&self) -> &RedisConnection {
        &self.connection
    }

    /// The key prefix in use.
    pub fn prefix(&self) -> &str {
        &self.config.prefix
    }

    /// The key holding the lease of `name`.
    pub fn lock_key(&self, name: &LockName) -> String {
        self.key_of(name, "lock")
    }

    /// The key holding the last fencing token issued for `name`.
    pub fn fence_key(&self, name: &LockName) -> String {
        self.key_of(name, "fence")
    }

    /// The key holding the value `name`'s holder advertises (`OWNER:VALUE`; an
    /// election's leader value).
    pub fn value_key(&self, name: &LockName) -> String {
        self.key_of(name, "value")
    }

    /// The key holding the number of permits of the semaphore `name` (no expiry).
    pub fn permits_key(&self, name: &LockName) -> String {
        self.key_of(name, "permits")
    }

    /// The Pub/Sub channel announcing releases of `name`.
    pub fn release_channel(&self, name: &LockName) -> String {
        self.key_of(name, "released")
    }

    /// `PREFIX:{NAME}:suffix`, copied into place: three of these per lock cycle cost
    /// about 3,000 instructions through `format!` (callgrind), a fifth of what the
    /// library adds to a Redis command.
    fn key_of(&self, name: &LockName, suffix: &str) -> String {
        let (prefix, name) = (self.config.prefix.as_str(), name.as_str());
        let mut key = String::with_capacity(prefix.len() + name.len() + suffix.len() + 4);
        for part in [prefix, ":{", name, "}:", suffix] {
            key.push_str(part);
        }
        key
    }
}

fn scripts() -> Scripts {
    Scripts {
        acquire: Script::new(ACQUIRE),
        hand_over: Script::new(HAND_OVER),
        extend: Script::new(EXTEND),
        release: Script::new(RELEASE),
        inspect: Script::new(INSPECT),
        force: Script::new(BREAK),
        proclaim: Script::new(PROCLAIM),
        inspect_with_value: Script::new(INSPECT_WITH_VALUE),
    }
}

/// The seed nodes of a `redis+cluster://host:port[,host:port…]` URL (`None` for any
/// other URL).
fn cluster_hosts(url: &str) -> Result<Option<Vec<String>>> {
    let Some(rest) = url.strip_prefix("redis+cluster://") else {
        return Ok(None);
    };
    let hosts: Vec<String> = rest
        .trim_end_matches('/')
        .split(',')
        .map(str::to_owned)
        .collect();
    let valid = hosts.iter().all(|host| {
        !host.contains(['/', '@'])
            && host
                .rsplit_once(':')
                .is_some_and(|(name, port)| !name.is_empty() && port.parse::<u16>().is_ok())
    });
    if !valid {
        return Err(Error::new(
            ErrorKind::InvalidUrl,
            format!(
                "{} is not a Redis Cluster URL (redis+cluster://host:port[,host:port…])",
                crate::url::redact(url)
            ),
        ));
    }
    Ok(Some(hosts))
}

/// The sentinels and the master name of a `redis+sentinel://host:port[,…]/MASTER` URL
/// (`None` for any other URL).
fn sentinel_target(url: &str) -> Result<Option<(Vec<String>, String)>> {
    let Some(rest) = url.strip_prefix("redis+sentinel://") else {
        return Ok(None);
    };
    let invalid = || {
        Error::new(
            ErrorKind::InvalidUrl,
            format!(
                "{} is not a Redis Sentinel URL (redis+sentinel://host:port[,host:port…]/MASTER)",
                crate::url::redact(url)
            ),
        )
    };
    let (hosts, master) = rest.split_once('/').ok_or_else(invalid)?;
    let master = master.trim_end_matches('/');
    if master.is_empty() || master.contains('/') {
        return Err(invalid());
    }
    let sentinels: Vec<String> = hosts.split(',').map(str::to_owned).collect();
    let valid = sentinels.iter().all(|host| {
        !host.contains('@')
            && host
                .rsplit_once(':')
                .is_some_and(|(name, port)| !name.is_empty() && port.parse::<u16>().is_ok())
    });
    if !valid {
        return Err(invalid());
    }
    Ok(Some((sentinels, master.to_owned())))
}

/// Reads `{1, token}` / `{0, pttl}` from the acquire and hand-over scripts.
fn acquire_reply(acquired: i64, detail: Value) -> Result<TryAcquire> {
    let bad = |error: redis::ParsingError| {
        Error::new(ErrorKind::Store, "unexpected reply from the acquire script").with_source(error)
    };
    if acquired == 1 {
        let token: String = redis::from_redis_value(detail).map_err(bad)?;
        return Ok(TryAcquire::Acquired {
            token: token.parse()?,
        });
    }
    let pttl: i64 = redis::from_redis_value(detail).map_err(bad)?;
    Ok(TryAcquire::Held {
        remaining_ttl: u64::try_from(pttl).ok().map(Duration::from_millis),
    })
}

/// Reads the release scripts' answer: 1 released, -1 held by another, 0 expired.
/// The release and hand-over scripts' answer: 1 or more released (the release script
/// adds how many subscribers its notification reached), -1 held by another, 0 expired.
fn release_outcome(code: i64) -> ReleaseOutcome {
    match code {
        1.. => ReleaseOutcome::Released,
        -1 => ReleaseOutcome::HeldByOther,
        _ => ReleaseOutcome::AlreadyExpired,
    }
}

fn parse_holder(value: Value) -> Result<Option<LockInfo>> {
    Ok(parse_holder_with_value(value)?.map(|(info, _)| info))
}

/// The inspect scripts' answer: `{OWNER:TOKEN, PTTL[, VALUE]}`, or nothing.
fn parse_holder_with_value(value: Value) -> Result<Option<HolderAndValue>> {
    let Value::Array(items) = value else {
        return Ok(None);
    };
    let bad = || Error::new(ErrorKind::Store, "unexpected reply from the lock script");
    let mut items = items.into_iter();
    let (Some(stored), Some(pttl)) = (items.next(), items.next()) else {
        return Err(bad());
    };
    let proclaimed: Option<String> = items
        .next()
        .map(redis::from_redis_value)
        .transpose()
        .map_err(|e| bad().with_source(e))?;
    let stored: String = redis::from_redis_value(stored).map_err(|e| bad().with_source(e))?;
    let pttl: i64 = redis::from_redis_value(pttl).map_err(|e| bad().with_source(e))?;
    let (owner, token) = stored.split_once(':').ok_or_else(bad)?;
    let info = LockInfo {
        owner: owner.to_owned(),
        // An unfenced holder's value has no token after the colon.
        fencing_token: if token.is_empty() {
            None
        } else {
            Some(token.parse()?)
        },
        remaining_ttl: u64::try_from(pttl).ok().map(Duration::from_millis),
    };
    Ok(Some((info, proclaimed)))
}

impl LockBackend for RedisLockStore {
    fn try_acquire<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<TryAcquire>> {
        Box::pin(async move {
            let mut connection = self.connection.clone();
            let (acquired, detail): (i64, Value) = self
                .scripts
                .acquire
                .key(self.lock_key(name))
                .key(self.fence_key(name))
                .arg(owner.as_str())
                .arg(ceil_millis(ttl))
                .arg(ceil_millis(self.config.fence_retention))
                .invoke_async(&mut connection)
                .await
                .map_err(|error| map_error(error, "cannot acquire the lock"))?;
            acquire_reply(acquired, detail)
        })
    }

    /// `SET NX PX` with the owner and no token (the value `OWNER:`, which the release,
    /// renewal and hand-over scripts read as the fenced value's owner), in one round
    /// trip with the `GET` and `PTTL` a refusal needs: no script, no token key.
    fn try_acquire_unfenced<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<TryAcquireUnfenced>> {
        Box::pin(async move {
            let mut connection = self.connection.clone();
            let key = self.lock_key(name);
            let value = format!("{}:", owner.as_str());
            let (set, held, pttl): (Option<String>, Option<String>, i64) = redis::pipe()
                .cmd("SET")
                .arg(&key)
                .arg(&value)
                .arg("NX")
                .arg("PX")
                .arg(ceil_millis(ttl))
                .cmd("GET")
                .arg(&key)
                .cmd("PTTL")
                .arg(&key)
                .query_async(&mut connection)
                .await
                .map_err(|error| map_error(error, "cannot acquire the lock"))?;
            if set.is_some() {
                return Ok(TryAcquireUnfenced::Acquired);
            }
            if held.as_deref().is_some_and(|held| held.starts_with(&value)) {
                // Ours already (an earlier request ran, its reply was lost): renewed
                // from now, so the lease the lock core counts from this request's
                // sending does not outlast the store's.
                return Ok(match self.extend(name, owner, ttl).await? {
                    ExtendOutcome::Extended => TryAcquireUnfenced::Acquired,
                    ExtendOutcome::Lost(_) => TryAcquireUnfenced::Held {
                        remaining_ttl: None,
                    },
                });
            }
            Ok(TryAcquireUnfenced::Held {
                remaining_ttl: u64::try_from(pttl).ok().map(Duration::from_millis),
            })
        })
    }

    fn unfenced_is_cheaper(&self) -> bool {
        true
    }

    fn extend<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<ExtendOutcome>> {
        Box::pin(async move {
            let mut connection = self.connection.clone();
            let answer: i64 = self
                .scripts
                .extend
                .key(self.lock_key(name))
                .arg(owner.as_str())
                .arg(ceil_millis(ttl))
                .invoke_async(&mut connection)
                .await
                .map_err(|error| map_error(error, "cannot extend the lock"))?;
            Ok(match answer {
                1 => ExtendOutcome::Extended,
                -1 => ExtendOutcome::Lost(LossReason::TakenOver),
                _ => ExtendOutcome::Lost(LossReason::Expired),
            })
        })
    }

    fn release<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
    ) -> BoxFuture<'a, Result<ReleaseOutcome>> {
        Box::pin(async move {
            let channel = self.release_channel(name);
            Ok(release_outcome(
                self.release_code(name, owner, &channel).await?,
            ))
        })
    }

    /// Says whether the release's notification reached a subscriber besides this
    /// store's own connection: every store listens through one, so another receiver is
    /// another store (in practice, another process) waiting for the name or holding it.
    fn release_waking_others<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
    ) -> BoxFuture<'a, Result<(ReleaseOutcome, Option<bool>)>> {
        Box::pin(async move {
            let channel = self.release_channel(name);
            let code = self.release_code(name, owner, &channel).await?;
            let receivers = code - 1;
            let ours = i64::from(self.notifier.is_watched(&channel));
            Ok((
                release_outcome(code),
                (code >= 1).then_some(receivers > ours),
            ))
        })
    }

    fn inspect<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<LockInfo>>> {
        Box::pin(async move {
            let mut connection = self.connection.clone();
            let answer: Value = self
                .scripts
                .inspect
                .key(self.lock_key(name))
                .invoke_async(&mut connection)
                .await
                .map_err(|error| map_error(error, "cannot read the lock"))?;
            parse_holder(answer)
        })
    }

    fn proclaim<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        value: &'a str,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let mut connection = self.connection.clone();
            let applied: i64 = self
                .scripts
                .proclaim
                .key(self.lock_key(name))
                .key(self.value_key(name))
                .arg(owner.as_str())
                .arg(value)
                .arg(ceil_millis(self.config.fence_retention))
                .arg(self.release_channel(name))
                .arg(self.notifier.publish_command())
                .invoke_async(&mut connection)
                .await
                .map_err(|error| map_error(error, "cannot store the holder's value"))?;
            Ok(applied == 1)
        })
    }

    fn inspect_with_value<'a>(
        &'a self,
        name: &'a LockName,
    ) -> BoxFuture<'a, Result<Option<HolderAndValue>>> {
        Box::pin(async move {
            let mut connection = self.connection.clone();
            let answer: Value = self
                .scripts
                .inspect_with_value
                .key(self.lock_key(name))
                .key(self.value_key(name))
                .invoke_async(&mut connection)
                .await
                .map_err(|error| map_error(error, "cannot read the lock"))?;
            parse_holder_with_value(answer)
        })
    }

    fn keeps_holder_values(&self) -> bool {
        true
    }

    fn declare_permits<'a>(
        &'a self,
        name: &'a LockName,
        permits: u32,
    ) -> BoxFuture<'a, Result<u32>> {
        Box::pin(async move {
            let mut connection = self.connection.clone();
            let stored: String = Script::new(DECLARE_PERMITS)
                .key(self.permits_key(name))
                .arg(permits)
                .invoke_async(&mut connection)
                .await
                .map_err(|error| map_error(error, "cannot declare the semaphore's permits"))?;
            stored.parse().map_err(|_| {
                Error::new(
                    ErrorKind::Store,
                    format!("the semaphore's permits key holds {stored:?}, not a number"),
                )
            })
        })
    }

    fn stored_permits<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<u32>>> {
        Box::pin(async move {
            let mut connection = self.connection.clone();
            let stored: Option<String> = redis::cmd("GET")
                .arg(self.permits_key(name))
                .query_async(&mut connection)
                .await
                .map_err(|error| map_error(error, "cannot read the semaphore's permits"))?;
            Ok(stored.and_then(|stored| stored.parse().ok()))
        })
    }

    fn forget_permits<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<u32>>> {
        Box::pin(async move {
            let mut connection = self.connection.clone();
            let stored: Option<String> = Script::new(FORGET_PERMITS)
                .key(self.permits_key(name))
                .invoke_async(&mut connection)
                .await
                .map_err(|error| map_error(error, "cannot forget the semaphore's permits"))?;
            Ok(stored.and_then(|stored| stored.parse().ok()))
        })
    }

    fn force_release<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<LockInfo>>> {
        Box::pin(async move {
            let mut connection = self.connection.clone();
            let answer: Value = self
                .scripts
                .force
                .key(self.lock_key(name))
                .arg(self.release_channel(name))
                .arg(self.notifier.publish_command())
                .invoke_async(&mut connection)
                .await
                .map_err(|error| map_error(error, "cannot break the lock"))?;
            parse_holder(answer)
        })
    }

    fn watch_releases<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<ReleaseWatch>> {
        Box::pin(async move {
            match &self.notifier {
                Notifications::Single(notifier) => notifier.watch(self.release_channel(name)).await,
                Notifications::Cluster(notifier) => {
                    notifier.watch(self.release_channel(name)).await
                }
            }
        })
    }

    fn describe(&self) -> String {
        self.url.clone()
    }

    fn hand_over<'a>(
        &'a self,
        name: &'a LockName,
        from: &'a OwnerId,
        to: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(ReleaseOutcome, TryAcquire)>> {
        Box::pin(async move {
            let mut connection = self.connection.clone();
            let (released, acquired, detail): (i64, i64, Value) = self
                .scripts
                .hand_over
                .key(self.lock_key(name))
                .key(self.fence_key(name))
                .arg(from.as_str())
                .arg(to.as_str())
                .arg(ceil_millis(ttl))
                .arg(ceil_millis(self.config.fence_retention))
                .invoke_async(&mut connection)
                .await
                .map_err(|error| map_error(error, "cannot hand the lock over"))?;
            Ok((release_outcome(released), acquire_reply(acquired, detail)?))
        })
    }
}
