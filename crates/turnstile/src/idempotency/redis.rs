//! Idempotency records in Redis: every change of a record is one Lua script, which
//! Redis runs alone. Needs Redis 7.0 or newer.
//!
//! A record is one string value at `P:idem:{H}:record`, where `P` is the prefix
//! (`turnstile`, or the URL's `turnstile_prefix`) and `H` the first 32 hex digits of the
//! SHA-256 of the scope and the key: fixed-length keys whatever the scope and key hold,
//! and the `{H}` hash tag keeps every key of a record in one Cluster slot. The value is
//! `STATE|FINGERPRINT|TOKEN|LEASE_UNTIL_MS|EXPIRES_MS|CREATED_MS|` (state `2` in
//! progress, `3` in progress with a duplicate seen, `4` released), written with `SET …
//! PXAT` so that the record and its expiry change in one command. The outcome is in its
//! own slot, `P:idem:{H}:outcome`, as `TOKEN|OUTCOME`: the record is completed when the
//! slot holds the outcome of the token the record names.
//!
//! **A claim** is the claim script: it creates a record where there is none (its token
//! the server's `TIME` in µs), answers a replay, a mismatch or "in progress" from the
//! record that is there, or takes a lapsed lease over with a larger token.
//!
//! **A completion** is the completion script: only while the record names the claim's
//! token and is in progress does it store the outcome, rewrite the record with its
//! lease ended and its expiry the retention from now, and keep the outcome a second
//! longer than the record; a completion whose record names another claim (or none)
//! changes nothing. Only when the record shows a duplicate saw the claim at work (state
//! `3`) is the completion published on `P:idem:{H}:done`.
//!
//! # Guarantees
//! - **Atomicity**: every change of a record or its outcome is one script.
//! - **Clock**: lease ends and retention are judged by the Redis server's clock
//!   (`TIME`); a record expires with the key, so there is nothing to sweep. A completed
//!   record is kept for the retention from its completion (the SQL stores keep it from
//!   its creation unless the work outlived it). A refused (fenced) completion changes
//!   no record's life.
//! - **Tokens**: a new record's token is the server's `TIME` in µs; a reclaim takes
//!   `max(last + 1, server TIME in µs)`, so tokens of a key strictly increase while its
//!   record lives, whatever the clients' clocks do. No host clock is read.
//! - **Upgrades**: the records the script-only version wrote (letter states, the
//!   outcome inline) are read and finished in their own form, and so are the first
//!   claims (state `1`, lease and retention as lengths read against the key's expiry)
//!   and the pipelined completions of the version before this one; the script-only
//!   version's scripts refuse this version's records as not idempotency records (a
//!   store error, so a 503 from the layer) rather than misread them. During a rolling
//!   upgrade a request can so fail on an old process; it never runs twice because of
//!   the mix.
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

/// Shared by the scripts: the server's clock (`now_ms`, and `now_us()` as text, built
/// without formatting a float), `load()` which reads and splits the record in KEYS[1]
/// (nil when there is none), and `store(...)` which writes it back with its expiry.
macro_rules! record_lua {
    () => {
        r"
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local function now_us()
  return time[1] .. string.format('%06d', tonumber(time[2]))
end
-- States of the records this version writes: '2' in progress, '3' in progress with a
-- duplicate seen, '4' released; '1' is a first claim the previous version wrote with a
-- plain SET (its lease and retention as lengths), read and rewritten as '2'. The
-- letters p, w, r and c are records of the script-only version: they keep their form
-- while their token lives, so its processes can still finish them, and its scripts
-- refuse the digits (their pattern wants a letter) instead of misreading a record
-- this version completed.
local decode = {['1'] = 'n', ['2'] = 'p', ['3'] = 'w', ['4'] = 'r'}
-- The outcome in an outcome slot (`TOKEN|OUTCOME`) if it is the claim with `token`'s.
local function outcome_in(slot, token)
  if slot and string.sub(slot, 1, #token + 1) == token .. '|' then
    return string.sub(slot, #token + 2)
  end
  return nil
end
local encode = {p = '2', w = '3', r = '4'}
local function load()
  local value = redis.call('GET', KEYS[1])
  if not value then
    return nil
  end
  local state, fp, token, lease_until, expires, created, at =
    string.match(value, '^(%w)|(%x*)|(%d+)|(%d+)|(%d+)|(%d+)|()')
  if not state then
    error('turnstile: ' .. KEYS[1] .. ' does not hold an idempotency record')
  end
  local r = {state = decode[state] or state, legacy = decode[state] == nil, fp = fp,
             token = token, lease_until = tonumber(lease_until), expires = tonumber(expires),
             created = created, outcome = string.sub(value, at)}
  if r.state == 'n' then
    -- A first claim, written by one SET with the longer of its lease and retention
    -- as the key's expiry: its times come from that expiry, on this server's clock.
    -- (Only ever later than the truth: an expiry is never shortened.)
    local lease, retention = r.lease_until, r.expires
    local created_ms = now_ms + redis.call('PTTL', KEYS[1]) - math.max(lease, retention)
    r.state, r.created = 'p', string.format('%d', created_ms)
    r.lease_until, r.expires = created_ms + lease, created_ms + retention
  end
  if not r.legacy and (r.state == 'p' or r.state == 'w') then
    local outcome = outcome_in(redis.call('GET', KEYS[2]), r.token)
    if outcome then
      -- Completed: its expiry is the key's, which the completion moved.
      r.state, r.outcome, r.lease_until = 'c', outcome, now_ms
      r.expires = now_ms + math.max(0, redis.call('PTTL', KEYS[1]))
    end
  end
  return r
end
local function store(r, expire_at)
  local state = r.state
  if not r.legacy then
    state = encode[r.state]
  end
  redis.call('SET', KEYS[1], state .. '|' .. r.fp .. '|' .. r.token .. '|' .. string.format('%d', r.lease_until)
    .. '|' .. string.format('%d', r.expires) .. '|' .. r.created .. '|' .. r.outcome, 'PXAT', string.format('%d', expire_at))
end
local function in_progress(r)
  return r.state == 'p' or r.state == 'w'
end
"
    };
}

/// KEYS[1] record, KEYS[2] outcome; ARGV fingerprint, lease ms, retention ms. Answers
/// `{'started', token}`, `{'replay', outcome}`, `{'in_progress', lease_left_ms}` or
/// `{'mismatch'}`.
const CLAIM: &str = concat!(
    record_lua!(),
    r"
local r = load()
local token = now_us()
if r then
  if r.fp ~= ARGV[1] then
    return {'mismatch'}
  end
  if r.state == 'c' then
    return {'replay', r.outcome}
  end
  if in_progress(r) and r.lease_until > now_ms then
    if r.state == 'p' then
      -- A duplicate may wait: from now on the completion is published.
      r.state = 'w'
      store(r, math.max(r.expires, r.lease_until))
    end
    return {'in_progress', string.format('%d', r.lease_until - now_ms)}
  end
  if tonumber(r.token) >= tonumber(token) then
    token = string.format('%d', tonumber(r.token) + 1)
  end
  -- Whatever the slot holds is an older token's, never read again: clear it so this
  -- claim's completion finds it free.
  redis.call('DEL', KEYS[2])
else
  r = {fp = ARGV[1], expires = now_ms + tonumber(ARGV[3]), created = string.format('%d', now_ms)}
end
r.state, r.token, r.lease_until, r.outcome, r.legacy = 'p', token, now_ms + tonumber(ARGV[2]), '', false
store(r, math.max(r.expires, r.lease_until))
return {'started', token}
"
);

/// KEYS[1] record, KEYS[2] outcome; ARGV token, lease ms. 1 renewed (or completed by this
/// claim), -1 another claim holds it, 0 gone.
const HEARTBEAT: &str = concat!(
    record_lua!(),
    r"
local r = load()
if r and r.state == 'c' and r.token == ARGV[1] then
  -- This claim's own completion landed (its reply may have been lost): nothing was
  -- taken from it.
  return 1
end
if not r or not in_progress(r) then
  return 0
end
if r.token ~= ARGV[1] then
  return -1
end
r.lease_until = now_ms + tonumber(ARGV[2])
store(r, math.max(r.expires, r.lease_until))
return 1
"
);

/// KEYS[1] record, KEYS[2] outcome; ARGV token, outcome, retention ms, channel. 1 stored
/// (or already stored by this claim), 0 refused: the record names another claim, or
/// none. A refused completion changes nothing but its own leftovers.
const COMPLETE: &str = concat!(
    record_lua!(),
    r"
local r = load()
if r and r.token == ARGV[1] and not r.legacy then
  if r.state == 'c' then
    return 1
  end
  if in_progress(r) then
    -- Kept for the retention from now; the record is rewritten with its times, so
    -- that nothing is read off the key's expiry again, and the outcome outlives it.
    local waited = r.state == 'w'
    local expire_at = now_ms + tonumber(ARGV[3])
    r.lease_until, r.expires = now_ms, expire_at
    store(r, expire_at)
    redis.call('SET', KEYS[2], ARGV[1] .. '|' .. ARGV[2], 'PXAT', string.format('%d', expire_at + 1000))
    if waited then
      redis.call('PUBLISH', ARGV[4], 'completed')
    end
    return 1
  end
end
-- An outcome of this claim's that a version with a pipelined completion left in the
-- slot is never to be read: take it out.
if outcome_in(redis.call('GET', KEYS[2]), ARGV[1]) then
  redis.call('DEL', KEYS[2])
end
return 0
"
);

/// KEYS[1] record, KEYS[2] outcome; ARGV token, channel. 1 given back, 0 refused.
const RELEASE: &str = concat!(
    record_lua!(),
    r"
local r = load()
if not r or not in_progress(r) or r.token ~= ARGV[1] then
  return 0
end
local waited = r.state == 'w'
r.state, r.lease_until = 'r', now_ms
store(r, r.expires)
if waited then
  redis.call('PUBLISH', ARGV[2], 'released')
end
return 1
"
);

/// KEYS[1] record, KEYS[2] outcome; ARGV channel. 1 forgotten (the token bumped, so a claim at work is
/// fenced out), 0 nothing to forget.
const FORGET: &str = concat!(
    record_lua!(),
    r"
local r = load()
if not r or r.state == 'r' then
  return 0
end
redis.call('DEL', KEYS[2])
local token = now_us()
if tonumber(r.token) >= tonumber(token) then
  token = string.format('%d', tonumber(r.token) + 1)
end
r.state, r.token, r.lease_until, r.outcome, r.legacy = 'r', token, now_ms, '', false
store(r, math.max(r.expires, now_ms + 1000))
redis.call('PUBLISH', ARGV[1], 'forgotten')
return 1
"
);

/// KEYS[1] record, KEYS[2] outcome. `{state, fp, token, lease_left_ms, expires_in_ms, outcome}` or nil.
const GET: &str = concat!(
    record_lua!(),
    r"
local r = load()
if not r or r.state == 'r' then
  return false
end
local state = 'completed'
if in_progress(r) then
  state = 'in_progress'
end
return {state, r.fp, r.token, string.format('%d', math.max(0, r.lease_until - now_ms)),
        string.format('%d', math.max(0, r.expires - now_ms)), r.outcome}
"
);

struct Scripts {
    claim: Script,
    complete: Script,
    heartbeat: Script,
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
        let (driver_url, options) = crate::url::split_url_options(url);
        let config =
            crate::engine::redis::RedisLockConfig::default().apply_url_options(&options)?;
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
                complete: Script::new(COMPLETE),
                heartbeat: Script::new(HEARTBEAT),
                release: Script::new(RELEASE),
                forget: Script::new(FORGET),
                get: Script::new(GET),
            }),
            notifier: Notifier::new(client, timeout, timeout),
            url: crate::url::redact(&driver_url),
        })
    }

    /// The keys of the record for `scope` and `key`.
    fn keys(&self, scope: &Scope, key: &IdempotencyKey) -> RecordKeys {
        let mut hasher = Sha256::new();
        hasher.update((scope.as_str().len() as u64).to_be_bytes());
        hasher.update(scope.as_str());
        hasher.update(key.as_str());
        let digest = hasher.finalize();
        let mut base = String::with_capacity(self.prefix.len() + 48);
        base.push_str(&self.prefix);
        base.push_str(":idem:{");
        crate::hex::push_hex(&mut base, &digest[..16]);
        base.push_str("}:");
        let mut outcome = String::with_capacity(base.len() + "outcome".len());
        outcome.push_str(&base);
        outcome.push_str("outcome");
        base.push_str("record");
        RecordKeys {
            record: base,
            outcome,
        }
    }
}

/// The keys of one record, all in its `{H}` hash slot.
struct RecordKeys {
    /// The record (`STATE|FP|TOKEN|…`).
    record: String,
    /// The completed claim's outcome, `TOKEN|OUTCOME`: read only under the token the
    /// record names.
    outcome: String,
}

impl RecordKeys {
    /// Where completions and give-backs are published to waiting duplicates: made only
    /// where it is used, off the claim's path.
    fn channel(&self) -> String {
        format!("{}done", &self.record[..self.record.len() - "record".len()])
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
            let keys = self.keys(scope, key);
            let mut connection = self.connection.clone();
            let fingerprint = fingerprint_hex(fingerprint);
            let (lease_ms, retention_ms) = (ceil_millis(lease), ceil_millis(retention));
            let reply: Vec<Value> = self
                .scripts
                .claim
                .key(&keys.record)
                .key(&keys.outcome)
                .arg(fingerprint)
                .arg(lease_ms)
                .arg(retention_ms)
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
            let keys = self.keys(scope, key);
            let mut connection = self.connection.clone();
            let answer: i64 = self
                .scripts
                .heartbeat
                .key(&keys.record)
                .key(&keys.outcome)
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
            let keys = self.keys(scope, key);
            let retention_ms = ceil_millis(retention).max(1);
            let mut connection = self.connection.clone();
            let answer: i64 = self
                .scripts
                .complete
                .key(&keys.record)
                .key(&keys.outcome)
                .arg(token.get().to_string())
                .arg(outcome)
                .arg(retention_ms)
                .arg(keys.channel())
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
            let keys = self.keys(scope, key);
            let mut connection = self.connection.clone();
            let answer: i64 = self
                .scripts
                .release
                .key(&keys.record)
                .key(&keys.outcome)
                .arg(token.get().to_string())
                .arg(keys.channel())
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
            let keys = self.keys(scope, key);
            let mut connection = self.connection.clone();
            let reply: Value = self
                .scripts
                .get
                .key(&keys.record)
                .key(&keys.outcome)
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
            let keys = self.keys(scope, key);
            let mut connection = self.connection.clone();
            let answer: i64 = self
                .scripts
                .forget
                .key(&keys.record)
                .key(&keys.outcome)
                .arg(keys.channel())
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
        Box::pin(async move { self.notifier.watch(self.keys(scope, key).channel()).await })
    }

    fn describe(&self) -> String {
        self.url.clone()
    }
}
