//! Idempotency records in Redis: one round trip of plain commands for the first claim
//! of a key, for a replay and for a completion; a Lua script for everything else
//! (duplicates of a claim at work, reclaims, heartbeats, give-backs, a contested
//! completion). Needs Redis 7.0 or newer (`SET … NX … GET`, `PEXPIRE … GT`).
//!
//! A record is one string value at `P:idem:{H}:record`, where `P` is the prefix
//! (`turnstile`, or the URL's `turnstile_prefix`) and `H` the first 32 hex digits of the
//! SHA-256 of the scope and the key: fixed-length keys whatever the scope and key hold,
//! and the `{H}` hash tag keeps every key of a record in one Cluster slot. The value is
//! `STATE|FINGERPRINT|TOKEN|LEASE_UNTIL_MS|EXPIRES_MS|CREATED_MS|` (state `2` in
//! progress, `3` in progress with a duplicate seen, `4` released), written by scripts
//! with `SET … PXAT` so that the record and its expiry change in one command. The
//! outcome is in its own slot, `P:idem:{H}:outcome`, as `TOKEN|OUTCOME`: the record is
//! completed when the slot holds the outcome of the token the record names.
//!
//! **The first claim of a key** is one pipelined round trip: `GET outcome`, then `SET
//! record "1|FP|TOKEN|LEASE_MS|RETENTION_MS|0|" NX PX max(lease, retention) GET` (the
//! order matters: the claim's comments say why). It creates the record only if there is
//! none; otherwise it reads the record that is there and the slot, so a replay and a
//! mismatch (another fingerprint) are answered at once, and only a duplicate of a claim
//! at work or a reclaim calls the claim script. A state `1` record keeps its lease and
//! retention as lengths; the scripts read its times off the key's own expiry (`PTTL`),
//! so the lease is still judged by the server's clock.
//!
//! **A completion** is one pipelined round trip: `SET outcome "TOKEN|OUTCOME" NX PX`
//! (the retention, or the longest lease this store used, plus a second: it outlives its
//! record), `PEXPIRE record retention GT`, `GET record`. No compare-and-set is needed on
//! the way that is nearly always taken: the slot was free (a reclaim clears it) and the
//! record read back names this claim, so the outcome is this claim's and is read as
//! such. Otherwise (the slot held another token's outcome, or this claim's from an
//! earlier try; or the record names another claim) a script decides, and takes this
//! claim's outcome back out if it is not to be read ([`Finish::Fenced`]). Only when the
//! record shows a duplicate saw the claim at work (state `3`) is the completion
//! published on `P:idem:{H}:done`.
//!
//! Why plain commands where they suffice: each `redis.call` inside a script costs a few
//! microseconds of the server's single thread, more than the command itself, and a
//! script's own run as much again; a new key's claim and completion were two scripts.
//!
//! # Guarantees
//! - **Atomicity**: the first claim is one `SET NX`, a completion one `SET NX` of the
//!   outcome; every other change of a record or its outcome is one script, which Redis
//!   runs alone.
//! - **Clock**: lease ends and retention are judged by the Redis server's clock
//!   (`TIME`, and key expiry for a first claim); a record expires with the key, so
//!   there is nothing to sweep. A completed record is kept for the retention from its
//!   completion (the SQL stores keep it from its creation unless the work outlived
//!   it). A stale claimer's fenced completion can lengthen a record's life (never
//!   shorten it), and so a first claim's lease as the scripts read it: a duplicate
//!   may then wait longer, never take a live lease.
//! - **Tokens**: a reclaim takes `max(last + 1, server TIME in µs)`, so tokens of a key
//!   strictly increase while its record lives. A first claim (no record) takes the
//!   server's clock as this host reads it (its own clock plus the offset one `TIME`
//!   measured at connect, within half a round trip and the two clocks' drift since),
//!   never less than the last token this process handed out; nothing older than the
//!   record can complete it, because an outcome is read only under the token the
//!   record names.
//! - **Upgrades**: the records the script-only version wrote (letter states, the
//!   outcome inline) are read and finished in their own form; that version's scripts
//!   refuse this version's records as not idempotency records (a store error, so a 503
//!   from the layer) rather than misread them. During a rolling upgrade a request can
//!   so fail on an old process; it never runs twice because of the mix.
//! - **Durability**: as Redis is configured. Without persistence, a restart forgets
//!   every record (a retry then runs again), and asynchronous replication can lose the
//!   last completions on failover: **Redis idempotency is best-effort across failures**;
//!   use a SQL store, ideally in the same transaction as the business data, where a
//!   second run must never happen.
//! - **Waiting**: duplicates subscribe to the record's channel and re-check at the
//!   claim's lease end.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
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
-- States of the records this version writes: '1' a first claim (its lease and
-- retention as lengths), '2' in progress, '3' in progress with a duplicate seen, '4'
-- released. The letters p, w, r and c are records of the script-only version: they
-- keep their form while their token lives, so its processes can still finish them,
-- and its scripts refuse the digits (their pattern wants a letter) instead of
-- misreading a record this version completed.
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

/// KEYS[1] record, KEYS[2] outcome; ARGV fingerprint, lease ms, retention ms. Run when the first claim's
/// `SET NX` found a record. Answers
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

/// KEYS[1] record, KEYS[2] outcome; ARGV token, lease ms. 1 renewed, -1 another claim holds it, 0 gone.
const HEARTBEAT: &str = concat!(
    record_lua!(),
    r"
local r = load()
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

/// KEYS[1] record, KEYS[2] outcome; ARGV token, outcome, outcome ms, retention ms,
/// channel. A completion whose plain `SET NX` of the outcome found the slot taken, or
/// whose record named another claim: 1 stored (or already stored by this claim), 0
/// refused (and this claim's outcome, if it is in the slot, removed).
const COMPLETE_CONTESTED: &str = concat!(
    record_lua!(),
    r"
local r = load()
if r and r.token == ARGV[1] and not r.legacy then
  if r.state == 'c' then
    return 1
  end
  if in_progress(r) then
    redis.call('SET', KEYS[2], ARGV[1] .. '|' .. ARGV[2], 'PX', ARGV[3])
    redis.call('PEXPIRE', KEYS[1], ARGV[4], 'GT')
    if r.state == 'w' then
      redis.call('PUBLISH', ARGV[5], 'completed')
    end
    return 1
  end
end
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
    complete_contested: Script,
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
    /// The Redis server's clock minus this host's, in µs, read once at connect: a first
    /// claim's token is this host's clock moved onto the server's.
    clock_offset_us: i64,
    /// The longest lease (ms) this store has claimed or renewed with: a completion keeps
    /// the outcome at least that long, so it never expires before its record.
    longest_lease_ms: Arc<AtomicU64>,
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
        let mut connection = connect_manager(client.clone(), &driver_url, timeout, timeout).await?;
        let clock_offset_us = server_clock_offset(&mut connection).await?;
        Ok(RedisIdempotencyStore {
            connection,
            prefix,
            scripts: Arc::new(Scripts {
                claim: Script::new(CLAIM),
                complete_contested: Script::new(COMPLETE_CONTESTED),
                heartbeat: Script::new(HEARTBEAT),
                release: Script::new(RELEASE),
                forget: Script::new(FORGET),
                get: Script::new(GET),
            }),
            notifier: Notifier::new(client, timeout, timeout),
            url: crate::url::redact(&driver_url),
            clock_offset_us,
            longest_lease_ms: Arc::new(AtomicU64::new(0)),
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

/// The server's clock minus this host's, in µs: one `TIME`, taken against the middle of
/// its round trip.
async fn server_clock_offset(connection: &mut ConnectionManager) -> Result<i64> {
    let sent = crate::clock::wall_clock().1;
    let (seconds, micros): (i64, i64) = redis::cmd("TIME")
        .query_async(connection)
        .await
        .map_err(|error| map_error(error, "cannot read the Redis server's clock"))?;
    let answered = crate::clock::wall_clock().1;
    let server = seconds.saturating_mul(1_000_000).saturating_add(micros);
    Ok(server - (sent / 2 + answered / 2))
}

/// The token of a first claim: the server's clock in µs as this host reads it (its own
/// clock plus the offset measured at connect), and never less than one more than the
/// last token this function gave, so a process's tokens strictly increase even when
/// its clock steps back. (A reclaim's token comes from the script, `max(last + 1,
/// server TIME)`, above whatever a first claim took.)
fn first_claim_token(clock_offset_us: i64) -> FencingToken {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now =
        u64::try_from(crate::clock::wall_clock().1.saturating_add(clock_offset_us)).unwrap_or(0);
    let previous = LAST
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
            Some(now.max(last + 1))
        })
        .unwrap_or_else(|last| last);
    FencingToken::new(now.max(previous + 1))
}

/// A record's value as the first claim reads it back: its state letter, fingerprint in
/// hex, token, and what follows the sixth `|` (the outcome, in a record that holds it).
struct RecordHeader<'v> {
    state: u8,
    fingerprint: &'v [u8],
    token_text: &'v str,
    token: u64,
    outcome: &'v [u8],
}

/// The outcome in a slot (`TOKEN|OUTCOME`) if it is the claim with `token`'s.
fn outcome_of<'s>(slot: &'s [u8], token: &str) -> Option<&'s [u8]> {
    let rest = slot.strip_prefix(token.as_bytes())?;
    rest.strip_prefix(b"|")
}

impl<'v> RecordHeader<'v> {
    /// In progress, in this version's form (whose outcome goes to the outcome slot).
    fn is_at_work(&self) -> bool {
        matches!(self.state, b'1' | b'2' | b'3')
    }

    fn parse(value: &'v [u8]) -> Option<Self> {
        let mut fields = value.splitn(7, |&byte| byte == b'|');
        let state = *fields.next()?.first()?;
        let fingerprint = fields.next()?;
        let token_text = std::str::from_utf8(fields.next()?).ok()?;
        let token = token_text.parse().ok()?;
        let outcome = fields.nth(3)?;
        Some(RecordHeader {
            state,
            fingerprint,
            token_text,
            token,
            outcome,
        })
    }
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
            // A key nobody holds is created by the SET; a record that is there comes
            // back instead, with the outcome slot, and is decided here if it is
            // completed or another request's, by the script below otherwise.
            self.longest_lease_ms.fetch_max(lease_ms, Ordering::Relaxed);
            let token = first_claim_token(self.clock_offset_us);
            let first = format!("1|{fingerprint}|{token}|{lease_ms}|{retention_ms}|0|");
            // The slot is read before the record, in the same pipeline (Redis runs a
            // connection's commands in order), and its outcome is taken only under the
            // token the record names. An outcome read first was stored before the
            // record was read; a record that then still names its token was that
            // claim's own, since a key's tokens only move forward: a stale claimer's
            // fenced outcome is never under the token a later record names.
            let (slot, existing): (Option<Vec<u8>>, Option<Vec<u8>>) = redis::pipe()
                .cmd("GET")
                .arg(&keys.outcome)
                .cmd("SET")
                .arg(&keys.record)
                .arg(first)
                .arg("NX")
                .arg("PX")
                .arg(lease_ms.max(retention_ms).max(1))
                .arg("GET")
                .query_async(&mut connection)
                .await
                .map_err(|error| map_error(error, "cannot claim the idempotency key"))?;
            let Some(existing) = existing else {
                return Ok(ClaimAnswer::Started { token });
            };
            if let Some(header) = RecordHeader::parse(&existing) {
                if header.fingerprint != fingerprint.as_bytes() {
                    return Ok(ClaimAnswer::Mismatch);
                }
                if header.state == b'c' {
                    // Completed by the script-only version: the outcome is inline.
                    return Ok(ClaimAnswer::Replay {
                        outcome: header.outcome.to_vec(),
                    });
                }
                if header.is_at_work()
                    && let Some(outcome) = slot
                        .as_deref()
                        .and_then(|slot| outcome_of(slot, header.token_text))
                {
                    return Ok(ClaimAnswer::Replay {
                        outcome: outcome.to_vec(),
                    });
                }
            }
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
            self.longest_lease_ms
                .fetch_max(ceil_millis(lease), Ordering::Relaxed);
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
            let token_text = token.get().to_string();
            let mut connection = self.connection.clone();
            // The outcome outlives its record: that lives at most the longer of the
            // retention from now and the lease of its last renewal (which this store
            // gave), and the outcome a second more.
            let outcome_ms = retention_ms
                .max(self.longest_lease_ms.load(Ordering::Relaxed))
                .saturating_add(1_000);
            let mut slot = Vec::with_capacity(token_text.len() + 1 + outcome.len());
            slot.extend_from_slice(token_text.as_bytes());
            slot.push(b'|');
            slot.extend_from_slice(outcome);
            let (stored, now_named): (Option<String>, Option<Vec<u8>>) = redis::pipe()
                .cmd("SET")
                .arg(&keys.outcome)
                .arg(slot)
                .arg("NX")
                .arg("PX")
                .arg(outcome_ms)
                .cmd("PEXPIRE")
                .arg(&keys.record)
                .arg(retention_ms)
                .arg("GT")
                .ignore()
                .cmd("GET")
                .arg(&keys.record)
                .query_async(&mut connection)
                .await
                .map_err(|error| map_error(error, "cannot store the outcome"))?;
            let header = now_named.as_deref().and_then(RecordHeader::parse);
            if stored.is_some()
                && let Some(header) = header
                && header.token == token.get()
                && header.is_at_work()
            {
                if header.state == b'3' {
                    // A duplicate saw the claim at work and may be waiting. The outcome
                    // is stored whatever this answers: a duplicate that misses it
                    // learns at the lease's end.
                    let published: redis::RedisResult<i64> = redis::cmd("PUBLISH")
                        .arg(keys.channel())
                        .arg("completed")
                        .query_async(&mut connection)
                        .await;
                    if let Err(error) = published {
                        tracing::warn!(%error, "cannot announce a stored outcome to waiting duplicates");
                    }
                }
                return Ok(Finish::Done);
            }
            // The slot was taken (a stale claimer's outcome, or this claim's own from
            // an earlier try), or the record names another claim: the script decides,
            // and takes this claim's outcome back out if it is not to be read.
            let answer: i64 = self
                .scripts
                .complete_contested
                .key(&keys.record)
                .key(&keys.outcome)
                .arg(&token_text)
                .arg(outcome)
                .arg(outcome_ms)
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
