//! Idempotency records in Redis: one Lua script per operation.
//!
//! A record is a hash at `P:idem:{H}` where `P` is the prefix (`turnstile`, or the URL's
//! `turnstile_prefix`) and `H` the first 32 hex digits of the SHA-256 of the scope and
//! the key: fixed-length keys whatever the scope and key hold, and the `{H}` hash tag
//! keeps every key of a record in one Cluster slot. Completions and releases are
//! published on `P:idem:{H}:done`.
//!
//! # Guarantees
//! - **Atomicity**: each operation is one script; Redis runs a script alone.
//! - **Clock**: lease ends and retention are judged by the Redis server's clock
//!   (`TIME`); a record expires with the key (`PEXPIREAT`), so there is nothing to sweep.
//! - **Tokens**: `max(last + 1, server TIME in µs)`.
//! - **Durability**: as Redis is configured. Without persistence, a restart forgets
//!   every record (a retry then runs again), and asynchronous replication can lose the
//!   last completions on failover: **Redis idempotency is best-effort across failures**;
//!   use a SQL store, ideally in the same transaction as the business data, where a
//!   second run must never happen.
//! - **Waiting**: duplicates subscribe to the record's channel and re-check at the
//!   claim's lease end.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::{Script, Value};
use sha2::{Digest, Sha256};

use super::{
    ClaimAnswer, Fingerprint, Finish, IdempotencyKey, IdempotencyStore, Record, RecordState, Scope,
    check_outcome,
};
use crate::engine::redis::{Notifier, connect_manager, map_error, open_client};
use crate::error::{Error, ErrorKind, Result};
use crate::fence::FencingToken;
use crate::lock::{BoxFuture, ExtendOutcome, LossReason, ReleaseWatch, ceil_millis};

/// Shared by the scripts: the server's clock in ms and µs.
macro_rules! clock_lua {
    () => {
        r"
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local now_us = tonumber(time[1]) * 1000000 + tonumber(time[2])
"
    };
}

/// KEYS[1] record; ARGV fingerprint, lease ms, retention ms. Answers
/// `{'started', token}`, `{'replay', outcome}`, `{'in_progress', lease_left_ms}` or
/// `{'mismatch'}`.
const CLAIM: &str = concat!(
    clock_lua!(),
    r"
local r = redis.call('HMGET', KEYS[1], 'state', 'fp', 'token', 'lease_until', 'expires', 'outcome')
local state, fp, last, lease_until, expires = r[1], r[2], tonumber(r[3] or '0'), tonumber(r[4] or '0'), tonumber(r[5] or '0')
if state then
  if fp ~= ARGV[1] then
    return {'mismatch'}
  end
  if state == 'completed' then
    return {'replay', r[6] or ''}
  end
  if state == 'in_progress' and lease_until > now_ms then
    return {'in_progress', tostring(lease_until - now_ms)}
  end
else
  expires = now_ms + tonumber(ARGV[3])
  redis.call('HSET', KEYS[1], 'fp', ARGV[1], 'created', now_ms, 'expires', expires)
end
local token = now_us
if last >= token then
  token = last + 1
end
local text = string.format('%.0f', token)
lease_until = now_ms + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'state', 'in_progress', 'token', text, 'lease_until', lease_until)
redis.call('HDEL', KEYS[1], 'outcome')
redis.call('PEXPIREAT', KEYS[1], math.max(expires, lease_until))
return {'started', text}
"
);

/// KEYS[1] record; ARGV token, lease ms. 1 renewed, -1 another claim holds it, 0 gone.
const HEARTBEAT: &str = concat!(
    clock_lua!(),
    r"
local r = redis.call('HMGET', KEYS[1], 'state', 'token', 'expires')
if r[1] ~= 'in_progress' then
  return 0
end
if r[2] ~= ARGV[1] then
  return -1
end
local lease_until = now_ms + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'lease_until', lease_until)
redis.call('PEXPIREAT', KEYS[1], math.max(tonumber(r[3]), lease_until))
return 1
"
);

/// KEYS[1] record; ARGV token, outcome, retention ms, channel. 1 stored, 0 refused.
const COMPLETE: &str = concat!(
    clock_lua!(),
    r"
local r = redis.call('HMGET', KEYS[1], 'state', 'token', 'created')
if r[1] ~= 'in_progress' or r[2] ~= ARGV[1] then
  return 0
end
local expires = math.max(tonumber(r[3]) + tonumber(ARGV[3]), now_ms + 1000)
redis.call('HSET', KEYS[1], 'state', 'completed', 'outcome', ARGV[2], 'lease_until', now_ms, 'expires', expires)
redis.call('PEXPIREAT', KEYS[1], expires)
redis.call('PUBLISH', ARGV[4], 'completed')
return 1
"
);

/// KEYS[1] record; ARGV token, channel. 1 given back, 0 refused.
const RELEASE: &str = concat!(
    clock_lua!(),
    r"
local r = redis.call('HMGET', KEYS[1], 'state', 'token')
if r[1] ~= 'in_progress' or r[2] ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'state', 'released', 'lease_until', now_ms)
redis.call('PUBLISH', ARGV[2], 'released')
return 1
"
);

/// KEYS[1] record; ARGV channel. 1 forgotten (the token bumped, so a claim at work is
/// fenced out), 0 nothing to forget.
const FORGET: &str = concat!(
    clock_lua!(),
    r"
local r = redis.call('HMGET', KEYS[1], 'state', 'token')
if not r[1] or r[1] == 'released' then
  return 0
end
local token = tonumber(r[2]) + 1
if now_us > token then
  token = now_us
end
redis.call('HSET', KEYS[1], 'state', 'released', 'token', string.format('%.0f', token), 'lease_until', now_ms)
redis.call('HDEL', KEYS[1], 'outcome')
redis.call('PUBLISH', ARGV[1], 'forgotten')
return 1
"
);

/// KEYS[1] record. `{state, fp, token, lease_left_ms, expires_in_ms, outcome}` or nil.
const GET: &str = concat!(
    clock_lua!(),
    r"
local r = redis.call('HMGET', KEYS[1], 'state', 'fp', 'token', 'lease_until', 'expires', 'outcome')
if not r[1] or r[1] == 'released' then
  return false
end
return {r[1], r[2], r[3], tostring(math.max(0, tonumber(r[4]) - now_ms)),
        tostring(math.max(0, tonumber(r[5]) - now_ms)), r[6] or ''}
"
);

struct Scripts {
    claim: Script,
    heartbeat: Script,
    complete: Script,
    release: Script,
    forget: Script,
    get: Script,
}

/// Idempotency records in Redis.
#[derive(Clone)]
pub struct RedisIdempotencyStore {
    connection: ConnectionManager,
    prefix: String,
    scripts: Arc<Scripts>,
    notifier: Arc<Notifier>,
    url: String,
}

impl std::fmt::Debug for RedisIdempotencyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisIdempotencyStore")
            .field("url", &self.url)
            .field("prefix", &self.prefix)
            .finish()
    }
}

fn unexpected(what: &str) -> Error {
    Error::new(
        ErrorKind::Store,
        format!("unexpected reply from the {what} script"),
    )
}

impl RedisIdempotencyStore {
    /// Connects with the URL's `turnstile_prefix` option (default `turnstile`).
    pub async fn connect(url: &str) -> Result<Self> {
        let (driver_url, options) = crate::store::split_url_options(url);
        let config = crate::lock::redis::RedisLockConfig::default().apply_url_options(&options)?;
        let prefix = config.get_prefix().to_owned();
        if prefix.is_empty() || prefix.contains(['{', '}']) || prefix.chars().any(char::is_control)
        {
            return Err(Error::new(
                ErrorKind::InvalidOptions,
                format!("the Redis key prefix {prefix:?} must be printable, without braces"),
            ));
        }
        let timeout = Duration::from_secs(3);
        let client = open_client(&driver_url, None)?;
        let connection = connect_manager(client.clone(), &driver_url, timeout, timeout).await?;
        Ok(RedisIdempotencyStore {
            connection,
            prefix,
            scripts: Arc::new(Scripts {
                claim: Script::new(CLAIM),
                heartbeat: Script::new(HEARTBEAT),
                complete: Script::new(COMPLETE),
                release: Script::new(RELEASE),
                forget: Script::new(FORGET),
                get: Script::new(GET),
            }),
            notifier: Notifier::new(client, timeout, timeout),
            url: crate::store::redact(&driver_url),
        })
    }

    /// The record's key.
    fn record_key(&self, scope: &Scope, key: &IdempotencyKey) -> String {
        let mut hasher = Sha256::new();
        hasher.update((scope.as_str().len() as u64).to_be_bytes());
        hasher.update(scope.as_str());
        hasher.update(key.as_str());
        let digest = hasher.finalize();
        let mut record = String::with_capacity(self.prefix.len() + 48);
        record.push_str(&self.prefix);
        record.push_str(":idem:{");
        crate::hex::push_hex(&mut record, &digest[..16]);
        record.push('}');
        record
    }

    /// The record's key and its notification channel.
    fn keys(&self, scope: &Scope, key: &IdempotencyKey) -> (String, String) {
        let record = self.record_key(scope, key);
        let channel = format!("{record}:done");
        (record, channel)
    }
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(text) => Some(text.clone()),
        _ => None,
    }
}

fn bytes(value: &Value) -> Vec<u8> {
    match value {
        Value::BulkString(bytes) => bytes.clone(),
        Value::SimpleString(text) => text.as_bytes().to_vec(),
        _ => Vec::new(),
    }
}

fn millis(value: &Value) -> Option<Duration> {
    text(value)?.parse::<u64>().ok().map(Duration::from_millis)
}

fn fingerprint_hex(fingerprint: &Fingerprint) -> String {
    crate::hex::hex(fingerprint.as_bytes())
}

impl IdempotencyStore for RedisIdempotencyStore {
    fn claim<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        fingerprint: &'a Fingerprint,
        lease: Duration,
        retention: Duration,
    ) -> BoxFuture<'a, Result<ClaimAnswer>> {
        Box::pin(async move {
            let record = self.record_key(scope, key);
            let mut connection = self.connection.clone();
            let reply: Vec<Value> = self
                .scripts
                .claim
                .key(record)
                .arg(fingerprint_hex(fingerprint))
                .arg(ceil_millis(lease))
                .arg(ceil_millis(retention))
                .invoke_async(&mut connection)
                .await
                .map_err(|error| map_error(error, "cannot claim the idempotency key"))?;
            let kind = reply
                .first()
                .and_then(text)
                .ok_or_else(|| unexpected("claim"))?;
            let detail = reply.get(1);
            Ok(match kind.as_str() {
                "started" => ClaimAnswer::Started {
                    token: detail
                        .and_then(text)
                        .ok_or_else(|| unexpected("claim"))?
                        .parse()?,
                },
                "replay" => ClaimAnswer::Replay {
                    outcome: detail.map(bytes).unwrap_or_default(),
                },
                "in_progress" => ClaimAnswer::InProgress {
                    lease_left: detail.and_then(millis),
                },
                "mismatch" => ClaimAnswer::Mismatch,
                _ => return Err(unexpected("claim")),
            })
        })
    }

    fn heartbeat<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        token: FencingToken,
        lease: Duration,
    ) -> BoxFuture<'a, Result<ExtendOutcome>> {
        Box::pin(async move {
            let record = self.record_key(scope, key);
            let mut connection = self.connection.clone();
            let answer: i64 = self
                .scripts
                .heartbeat
                .key(record)
                .arg(token.get().to_string())
                .arg(ceil_millis(lease))
                .invoke_async(&mut connection)
                .await
                .map_err(|error| map_error(error, "cannot renew the idempotency claim"))?;
            Ok(match answer {
                1 => ExtendOutcome::Extended,
                -1 => ExtendOutcome::Lost(LossReason::TakenOver),
                _ => ExtendOutcome::Lost(LossReason::Expired),
            })
        })
    }

    fn complete<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        token: FencingToken,
        outcome: &'a [u8],
        retention: Duration,
    ) -> BoxFuture<'a, Result<Finish>> {
        Box::pin(async move {
            check_outcome(outcome)?;
            let (record, channel) = self.keys(scope, key);
            let mut connection = self.connection.clone();
            let answer: i64 = self
                .scripts
                .complete
                .key(record)
                .arg(token.get().to_string())
                .arg(outcome)
                .arg(ceil_millis(retention))
                .arg(channel)
                .invoke_async(&mut connection)
                .await
                .map_err(|error| map_error(error, "cannot store the outcome"))?;
            Ok(if answer == 1 {
                Finish::Done
            } else {
                Finish::Fenced
            })
        })
    }

    fn release<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        token: FencingToken,
    ) -> BoxFuture<'a, Result<Finish>> {
        Box::pin(async move {
            let (record, channel) = self.keys(scope, key);
            let mut connection = self.connection.clone();
            let answer: i64 = self
                .scripts
                .release
                .key(record)
                .arg(token.get().to_string())
                .arg(channel)
                .invoke_async(&mut connection)
                .await
                .map_err(|error| map_error(error, "cannot give the key back"))?;
            Ok(if answer == 1 {
                Finish::Done
            } else {
                Finish::Fenced
            })
        })
    }

    fn get<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<Option<Record>>> {
        Box::pin(async move {
            let record = self.record_key(scope, key);
            let mut connection = self.connection.clone();
            let reply: Value = self
                .scripts
                .get
                .key(record)
                .invoke_async(&mut connection)
                .await
                .map_err(|error| map_error(error, "cannot read the record"))?;
            let Value::Array(items) = reply else {
                return Ok(None);
            };
            let field = |i: usize| items.get(i).ok_or_else(|| unexpected("get"));
            let state = text(field(0)?).ok_or_else(|| unexpected("get"))?;
            let fp_hex = text(field(1)?).ok_or_else(|| unexpected("get"))?;
            let mut fingerprint = [0u8; 32];
            for (i, byte) in fingerprint.iter_mut().enumerate() {
                *byte = fp_hex
                    .get(2 * i..2 * i + 2)
                    .and_then(|pair| u8::from_str_radix(pair, 16).ok())
                    .ok_or_else(|| unexpected("get"))?;
            }
            let in_progress = state == "in_progress";
            Ok(Some(Record {
                state: if in_progress {
                    RecordState::InProgress
                } else {
                    RecordState::Completed
                },
                fingerprint: Fingerprint::from_bytes(fingerprint),
                token: text(field(2)?).ok_or_else(|| unexpected("get"))?.parse()?,
                lease_left: if in_progress { millis(field(3)?) } else { None },
                expires_in: millis(field(4)?).unwrap_or_default(),
                outcome: (!in_progress).then(|| bytes(&items[5])),
            }))
        })
    }

    fn forget<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let (record, channel) = self.keys(scope, key);
            let mut connection = self.connection.clone();
            let answer: i64 = self
                .scripts
                .forget
                .key(record)
                .arg(channel)
                .invoke_async(&mut connection)
                .await
                .map_err(|error| map_error(error, "cannot forget the record"))?;
            Ok(answer == 1)
        })
    }

    /// Nothing to do: records expire with their keys, by the server's clock.
    fn sweep(&self, _limit: u32) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async { Ok(0) })
    }

    fn watch<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<ReleaseWatch>> {
        Box::pin(async move {
            let (_, channel) = self.keys(scope, key);
            self.notifier.watch(channel).await
        })
    }

    fn describe(&self) -> String {
        self.url.clone()
    }
}
