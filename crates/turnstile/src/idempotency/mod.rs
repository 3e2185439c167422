//! Idempotency keys: a retried request takes effect once.
//!
//! The client makes a key per logical request and sends it with every retry. The first
//! arrival *claims* the key and does the work; a repeat after completion gets the stored
//! outcome back without the work running again; a repeat while the first is still at
//! work is told so, or waits for it and then gets its outcome.
//!
//! ```
//! # #[cfg(feature = "sqlite")]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> turnstile::Result<()> {
//! use turnstile::idempotency::{Fingerprint, Idempotency, IdempotencyKey, Scope};
//!
//! # let dir = tempfile::tempdir().unwrap();
//! # let url = format!("sqlite://{}", dir.path().join("keys.db").display());
//! let keys = Idempotency::connect(&url).await?;
//! let tenant = Scope::new("tenant-7")?;
//! let key = IdempotencyKey::new("8e03978e-40d5-43e8-bc93-6894a57f9324")?;
//! let request = Fingerprint::of(&[b"charge", b"1000 EUR", b"card-42"]);
//!
//! let charge = || async { Ok::<_, turnstile::Error>(format!("ch_{}", 1)) };
//! let first: String = keys.run_once(&tenant, &key, &request, |_token| charge()).await?;
//! // A retry of the same request replays the stored outcome; `charge` does not run.
//! let again: String = keys.run_once(&tenant, &key, &request, |_token| charge()).await?;
//! assert_eq!(first, again);
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "sqlite"))]
//! # fn main() {}
//! ```
//!
//! # The model
//! A record per (scope, key): the request's fingerprint, its state (in progress or
//! completed), the fencing token and lease of the current claim, when it was created,
//! when it expires, and the stored outcome. Every key lives inside a [`Scope`] (a
//! tenant, a principal, or an explicit [`Scope::global`]); an outcome is never replayed
//! into another scope. Lease ends and retention are judged by the store's clock.
//!
//! A claim is a lease with a fencing token, kept by the same watchdog as a lock: while
//! the work runs it is renewed every lease/3, and if it is lost (the store says another
//! claim took over, or renewals fail until the local deadline) the work is cancelled.
//! Completing or releasing is refused unless the token is still the record's, so a stale
//! worker whose lease ran out can never overwrite a newer claim's outcome.
//!
//! # Outcomes
//! Work that returns `Ok` is stored and replayed. Work that returns `Err` gives the key
//! back (the record returns to absent) so that a retry runs again: a failure worth
//! retrying. A failure that must be replayed as it is (a declined payment) belongs in
//! the `Ok` value, for example as `Result<Receipt, Declined>`.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use crate::error::{Error, ErrorKind, Result};
use crate::fence::FencingToken;
use crate::lock::lease::{Keeper, Lease, LeaseKind, Renew};
use crate::lock::{BoxFuture, ExtendOutcome, ReleaseWatch};

#[cfg(feature = "axum")]
pub mod http;
pub mod inbox;
#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "sqlite")]
pub mod sqlite;
mod telemetry;

/// The longest scope and key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 255;

/// Where a key lives: a tenant, a principal, or [`Scope::global`] spelled out. An outcome
/// stored in one scope is never replayed into another.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope(String);

impl Scope {
    /// Validates `scope`: 1 to [`MAX_KEY_LEN`] bytes without control characters.
    pub fn new(scope: impl Into<String>) -> Result<Self> {
        let scope = scope.into();
        check_text("scope", &scope)?;
        Ok(Scope(scope))
    }

    /// The one scope shared by every caller — for keys that no tenant or principal
    /// owns. It has to be asked for by name, so no route shares keys by accident.
    ///
    /// It is kept apart from every named scope by construction: it is stored as the
    /// empty text, which [`Scope::new`] refuses, so a tenant called `global` has keys
    /// of its own.
    pub fn global() -> Self {
        Scope(String::new())
    }

    /// Whether this is [`Scope::global`].
    pub fn is_global(&self) -> bool {
        self.0.is_empty()
    }

    /// The scope as stored (empty for [`Scope::global`]).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_global() {
            f.write_str("(global)")
        } else {
            f.write_str(&self.0)
        }
    }
}

/// An idempotency key as the client sent it: 1 to [`MAX_KEY_LEN`] bytes of visible ASCII
/// (`!` to `~`), the character set of a bare HTTP token and of the IETF draft's
/// structured-field strings (which may also hold spaces).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Validates `key`.
    pub fn new(key: impl Into<String>) -> Result<Self> {
        let key = key.into();
        if key.is_empty() || key.len() > MAX_KEY_LEN {
            return Err(Error::new(
                ErrorKind::InvalidName,
                format!(
                    "an idempotency key is 1 to {MAX_KEY_LEN} characters; this one has {}",
                    key.len()
                ),
            ));
        }
        if let Some(bad) = key.chars().find(|c| !(' '..='~').contains(c)) {
            return Err(Error::new(
                ErrorKind::InvalidName,
                format!("an idempotency key holds visible ASCII only; found {bad:?}"),
            ));
        }
        Ok(IdempotencyKey(key))
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn check_text(what: &str, text: &str) -> Result<()> {
    if text.is_empty() || text.len() > MAX_KEY_LEN {
        return Err(Error::new(
            ErrorKind::InvalidName,
            format!(
                "an idempotency {what} is 1 to {MAX_KEY_LEN} bytes; this one has {}",
                text.len()
            ),
        ));
    }
    if let Some(bad) = text.chars().find(|c| c.is_control()) {
        return Err(Error::new(
            ErrorKind::InvalidName,
            format!("an idempotency {what} must not contain control characters; found {bad:?}"),
        ));
    }
    Ok(())
}

/// What makes two requests "the same request": a SHA-256 over the parts that matter
/// (method, route, canonical query, chosen headers, body…), each length-prefixed so that
/// no two different lists of parts hash alike (`["ab", "c"]` is not `["a", "bc"]`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of `parts`, in order.
    pub fn of(parts: &[&[u8]]) -> Self {
        let mut hasher = Sha256::new();
        for part in parts {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part);
        }
        Fingerprint(hasher.finalize().into())
    }

    /// A fingerprint from its 32 bytes (as stored).
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Fingerprint(bytes)
    }

    /// The 32 bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint(")?;
        for byte in &self.0[..8] {
            write!(f, "{byte:02x}")?;
        }
        write!(f, "…)")
    }
}

/// What a claim found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClaimAnswer {
    /// The key is ours to work on, with this fencing token.
    Started {
        /// The claim's token; completing or releasing needs it.
        token: FencingToken,
    },
    /// The request was completed before: here is its stored outcome.
    Replay {
        /// The outcome as stored.
        outcome: Vec<u8>,
    },
    /// Another claim is at work on the key.
    InProgress {
        /// How long its lease has left, by the store's clock, when known.
        lease_left: Option<Duration>,
    },
    /// The key was used before for a request with another fingerprint.
    Mismatch,
}

/// What completing or releasing a claim did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Finish {
    /// Done: the outcome is stored (or the key given back).
    Done,
    /// Refused: the claim's token is no longer the record's (its lease ran out and
    /// another claim took over, or an operator forgot the key). Nothing was changed.
    Fenced,
}

/// The state of a stored record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordState {
    /// A claim is (or was, if its lease ran out) at work.
    InProgress,
    /// The outcome is stored and replayed to repeats.
    Completed,
}

/// A stored record, as [`IdempotencyStore::get`] reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// In progress or completed.
    pub state: RecordState,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// The current (or last) claim's token.
    pub token: FencingToken,
    /// For a record in progress, how long its lease has left (zero: ran out).
    pub lease_left: Option<Duration>,
    /// How long until the record may be swept, by the store's clock.
    pub expires_in: Duration,
    /// The stored outcome of a completed record.
    pub outcome: Option<Vec<u8>>,
}

/// A claim in progress whose lease has run out, as [`IdempotencyStore::stale`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaleClaim {
    /// The record's scope (for the HTTP layer: the service's scope, method and route).
    pub scope: String,
    /// The key.
    pub key: String,
    /// The stale claim's token.
    pub token: FencingToken,
    /// How long ago its lease ran out.
    pub overdue: Duration,
}

/// A storage engine for idempotency records: only the atomic operations, each one
/// request to the store. Waiting, renewal and the lost signal are written once in
/// [`Idempotency`].
///
/// Contracts every engine keeps (the conformance suite checks them):
/// - `claim` answers `Started` to exactly one of any number of concurrent claimers of an
///   absent key, with a token larger than every token issued for the key before; a
///   claim of a record whose lease ran out takes it over with a new, larger token; a
///   claim with another fingerprint than the record's is a `Mismatch`.
/// - `heartbeat`, `complete` and `release` change nothing unless `token` is the record's
///   current token and the record is in progress.
/// - Lease ends and retention are judged by the store's clock.
pub trait IdempotencyStore: Send + Sync + fmt::Debug + 'static {
    /// Claims `key` for a request with `fingerprint`, with a lease of `lease`; a new
    /// record is kept for `retention` from now.
    fn claim<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        fingerprint: &'a Fingerprint,
        lease: Duration,
        retention: Duration,
    ) -> BoxFuture<'a, Result<ClaimAnswer>>;

    /// Renews the lease of the claim holding `token` to `lease` from now.
    fn heartbeat<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        token: FencingToken,
        lease: Duration,
    ) -> BoxFuture<'a, Result<ExtendOutcome>>;

    /// Stores `outcome` for the claim holding `token` and keeps it for `retention`
    /// from now; wakes waiters.
    fn complete<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        token: FencingToken,
        outcome: &'a [u8],
        retention: Duration,
    ) -> BoxFuture<'a, Result<Finish>>;

    /// Gives the key back (the work failed in a way worth retrying); wakes waiters.
    fn release<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        token: FencingToken,
    ) -> BoxFuture<'a, Result<Finish>>;

    /// The record of `key`, if there is one that has not expired.
    fn get<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<Option<Record>>>;

    /// An operator's removal of a record, whatever its state; `true` if there was one.
    /// A claim at work on it is fenced out (its completion is refused).
    fn forget<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<bool>>;

    /// Deletes up to `limit` records whose retention has passed; returns how many.
    fn sweep(&self, limit: u32) -> BoxFuture<'_, Result<u64>>;

    /// Up to `limit` records in progress whose lease has run out (their worker died or
    /// is cut off; the next claim takes them over), most overdue first. The default
    /// says the store cannot list them.
    fn stale(&self, limit: u32) -> BoxFuture<'_, Result<Vec<StaleClaim>>> {
        let _ = limit;
        Box::pin(async move {
            Err(Error::new(
                ErrorKind::UnsupportedStore,
                format!("{} cannot list stale claims", self.describe()),
            ))
        })
    }

    /// Starts listening for completions and releases of `key` (registered before the
    /// future completes, so none that happens afterwards is missed).
    fn watch<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> BoxFuture<'a, Result<ReleaseWatch>>;

    /// A short description of the store for messages (its URL without a password).
    fn describe(&self) -> String;
}

/// How keys are claimed and kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyOptions {
    lease: Duration,
    retention: Duration,
    wait: Option<Duration>,
}

impl Default for IdempotencyOptions {
    fn default() -> Self {
        IdempotencyOptions {
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(24 * 3600),
            wait: None,
        }
    }
}

impl IdempotencyOptions {
    /// Defaults: a 30 s lease, 24 h retention, and a duplicate in flight is answered at
    /// once (no waiting).
    pub fn new() -> Self {
        IdempotencyOptions::default()
    }

    /// The claim's lease (1 s to 1 day): a worker that crashes frees the key after at
    /// most this long; while it works, the lease is renewed every lease/3.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long a record is kept, from its creation (1 s to 1 year, and at least the
    /// lease), or from its completion when the work took longer than that. A claim
    /// at work is never handed to another request while its lease is renewed, whatever
    /// the retention. A retry after the retention runs again.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// A duplicate that arrives while the first request is at work waits up to `wait`
    /// for it to finish, then gets its outcome (woken by the completion, not by
    /// polling); past `wait` it gets [`ErrorKind::InProgress`].
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// The lease.
    pub fn get_lease(&self) -> Duration {
        self.lease
    }

    /// The retention.
    pub fn get_retention(&self) -> Duration {
        self.retention
    }

    /// How long a duplicate waits; `None` is not at all.
    pub fn get_wait(&self) -> Option<Duration> {
        self.wait
    }

    /// Checks the options, with an error that says what to change.
    pub fn validate(&self) -> Result<()> {
        let bad = |message: String| Err(Error::new(ErrorKind::InvalidOptions, message));
        if self.lease < Duration::from_secs(1) || self.lease > Duration::from_secs(24 * 3600) {
            return bad(format!(
                "the claim lease must be 1s to 1 day; got {:?}",
                self.lease
            ));
        }
        if self.retention < Duration::from_secs(1)
            || self.retention > Duration::from_secs(365 * 24 * 3600)
        {
            return bad(format!(
                "the retention must be 1s to a year; got {:?}",
                self.retention
            ));
        }
        if self.retention < self.lease {
            return bad(format!(
                "the retention ({:?}) must be at least the claim lease ({:?}): a record must \
                 outlive the claim that works on it",
                self.retention, self.lease
            ));
        }
        if self.wait.is_some_and(|wait| wait > crate::lock::MAX_WAIT) {
            return bad("the wait must be at most 100 years".to_owned());
        }
        Ok(())
    }
}

/// Runs work at most once per (scope, key), over one store.
///
/// Cheap to clone; clones share the store.
#[derive(Clone)]
pub struct Idempotency {
    /// The store as given (what [`store`](Self::store) returns).
    store: Arc<dyn IdempotencyStore>,
    /// The same store, every call timed: what the engine calls.
    timed: Arc<dyn IdempotencyStore>,
    options: IdempotencyOptions,
}

impl fmt::Debug for Idempotency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("store", &self.store.describe())
            .field("options", &self.options)
            .finish()
    }
}

/// How a claim's lease is renewed: a heartbeat with its token.
struct ClaimRenewal {
    store: Arc<dyn IdempotencyStore>,
    scope: Scope,
    key: IdempotencyKey,
    token: FencingToken,
}

impl Renew for ClaimRenewal {
    fn renew(&self, ttl: Duration) -> BoxFuture<'_, Result<ExtendOutcome>> {
        self.store
            .heartbeat(&self.scope, &self.key, self.token, ttl)
    }
}

impl Idempotency {
    /// Over `store`, with default options.
    pub fn new(store: impl IdempotencyStore) -> Self {
        Idempotency::from_arc(Arc::new(store))
    }

    /// Over a shared store, with default options.
    pub fn from_arc(store: Arc<dyn IdempotencyStore>) -> Self {
        let timed = telemetry::TimedStore {
            engine: telemetry::engine_of(store.as_ref()),
            inner: Arc::clone(&store),
        };
        Idempotency {
            store,
            timed: Arc::new(timed),
            options: IdempotencyOptions::default(),
        }
    }

    /// The same store with other options.
    pub fn with_options(mut self, options: IdempotencyOptions) -> Result<Self> {
        options.validate()?;
        self.options = options;
        Ok(self)
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn IdempotencyStore> {
        &self.store
    }

    /// Deletes records whose retention has passed until `shutdown` is cancelled: every
    /// `every`, batches of at most `batch` records (each batch one short statement, by
    /// the store's expiry index) until none is left, so that the table stays the size
    /// of the retention and no statement holds the store long. Claims at work are never
    /// swept. A store that fails is tried again at the next interval (logged and
    /// counted as `turnstile_idempotency_sweep_failures_total`). Opt-in: run it in one
    /// task per process (Redis expires records by itself and needs none).
    ///
    /// ```no_run
    /// # async fn demo(keys: turnstile::idempotency::Idempotency) {
    /// let shutdown = tokio_util::sync::CancellationToken::new();
    /// let sweeper = tokio::spawn({
    ///     let (keys, shutdown) = (keys.clone(), shutdown.clone());
    ///     async move { keys.run_sweeper(std::time::Duration::from_secs(60), 1000, shutdown).await }
    /// });
    /// // … serve …
    /// shutdown.cancel();
    /// sweeper.await.unwrap();
    /// # }
    /// ```
    pub async fn run_sweeper(
        &self,
        every: Duration,
        batch: u32,
        shutdown: tokio_util::sync::CancellationToken,
    ) {
        let batch = batch.max(1);
        while !shutdown.is_cancelled() {
            loop {
                match self.timed.sweep(batch).await {
                    Ok(swept) => {
                        telemetry::swept(swept);
                        if swept < u64::from(batch) || shutdown.is_cancelled() {
                            break;
                        }
                    }
                    Err(error) => {
                        telemetry::sweep_failed(&error);
                        break;
                    }
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(every) => {}
            }
        }
    }

    /// Runs `work` once for (`scope`, `key`), and replays its stored outcome to every
    /// repeat with the same `fingerprint`.
    ///
    /// - First arrival: claims the key, runs `work` with the claim's fencing token while
    ///   a watchdog renews the lease, stores an `Ok` outcome (serialised with serde) and
    ///   returns it. An `Err` gives the key back, so that a retry runs again.
    /// - Repeat after completion: the stored outcome, deserialised; `work` does not run.
    /// - Repeat while the first is at work: [`ErrorKind::InProgress`] at once, or, with
    ///   [`IdempotencyOptions::wait`], the first one's outcome when it finishes.
    /// - Same key, another fingerprint: [`ErrorKind::KeyMismatch`].
    /// - The claim lost while `work` runs (its lease taken over after renewals failed):
    ///   `work` is cancelled and the result is [`ErrorKind::LockLost`]; a completion the
    ///   store refuses because a newer claim holds the key is [`ErrorKind::Fencing`].
    /// - After `work` returned `Ok`, a transient refusal (store unreachable, busy, a
    ///   lock or statement timeout) is tried again, the lease renewed meanwhile, until
    ///   the outcome lands, the claim is lost, or one lease length has passed. An
    ///   outcome refused for good (too large) or for that whole length is recorded as
    ///   not stored, and repeats get [`ErrorKind::OutcomeNotStored`] instead of running
    ///   `work` again; if even that record is refused, the result is
    ///   [`ErrorKind::StoreUnavailable`] and the lease is left to run out, after which
    ///   a repeat runs `work` again.
    pub async fn run_once<T, E, F, Fut>(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        work: F,
    ) -> std::result::Result<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        F: FnOnce(FencingToken) -> Fut,
        Fut: Future<Output = std::result::Result<T, E>>,
    {
        let claim = match self.begin(scope, key, fingerprint).await? {
            Begun::Started(claim) => claim,
            Begun::Replay(outcome) => return decode(scope, key, &outcome).map_err(E::from),
        };
        let lost = claim.lost_signal();
        let result = tokio::select! {
            biased;
            reason = lost => {
                claim.give_back().await;
                return Err(E::from(Error::lost(reason)));
            }
            result = work(claim.token()) => result,
        };
        match result {
            Ok(value) => {
                claim
                    .complete_or(&encode(&value)?, |error| {
                        not_stored_marker(&error.to_string())
                    })
                    .await?;
                Ok(value)
            }
            Err(error) => {
                claim.give_back().await;
                Err(error)
            }
        }
    }

    /// Claims `key` (waiting for a duplicate in flight, with a wait bound): either the
    /// stored outcome to replay, or a running claim — its lease renewed by a watchdog —
    /// to complete or give back. The building block of [`run_once`](Self::run_once) and
    /// the HTTP layer.
    pub(crate) async fn begin(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
    ) -> Result<Begun> {
        let started = Instant::now();
        let (token, sent) = match self.claim_or_wait(scope, key, fingerprint).await? {
            Claimed::Started { token, sent } => (token, sent),
            Claimed::Replay(outcome) => {
                telemetry::replayed(scope, key, started.elapsed());
                return Ok(Begun::Replay(outcome));
            }
        };
        telemetry::started(scope, key, token);
        let lease = Lease::new(
            ClaimRenewal {
                store: Arc::clone(&self.timed),
                scope: scope.clone(),
                key: key.clone(),
                token,
            },
            LeaseKind::Claim,
            format!("{scope}/{key}"),
            self.options.lease,
            self.options.lease / 100 + Duration::from_millis(2),
            sent,
        );
        let keeper = Keeper::start(Arc::clone(&lease), true, None);
        Ok(Begun::Started(RunningClaim {
            store: Arc::clone(&self.timed),
            scope: scope.clone(),
            key: key.clone(),
            token,
            retention: self.options.retention,
            lease,
            keeper,
        }))
    }

    /// Claims, and with a wait bound waits for a duplicate in flight to finish.
    async fn claim_or_wait(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
    ) -> Result<Claimed> {
        let deadline = self
            .options
            .wait
            .and_then(|wait| Instant::now().checked_add(wait));
        let mut watch: Option<ReleaseWatch> = None;
        loop {
            let sent = Instant::now();
            let answer = self
                .timed
                .claim(
                    scope,
                    key,
                    fingerprint,
                    self.options.lease,
                    self.options.retention,
                )
                .await;
            let lease_left = match answer {
                Err(error) => {
                    telemetry::store_error(scope, key, &error);
                    return Err(error);
                }
                Ok(ClaimAnswer::Started { token }) => return Ok(Claimed::Started { token, sent }),
                Ok(ClaimAnswer::Replay { outcome }) => return Ok(Claimed::Replay(outcome)),
                Ok(ClaimAnswer::Mismatch) => {
                    telemetry::mismatch(scope, key);
                    return Err(mismatch(scope, key));
                }
                Ok(ClaimAnswer::InProgress { lease_left }) => lease_left,
            };
            let now = Instant::now();
            let Some(deadline) = deadline.filter(|deadline| *deadline > now) else {
                telemetry::in_progress(scope, key);
                return Err(in_progress(scope, key, lease_left));
            };
            // Subscribe, then claim again at once: a completion between the claim and
            // the subscription would otherwise go unnoticed until the re-check.
            if watch.as_ref().is_none_or(ReleaseWatch::is_closed) {
                watch = Some(self.timed.watch(scope, key).await?);
                continue;
            }
            let Some(watching) = watch.as_mut() else {
                continue;
            };
            // Re-check when the first claim's lease would run out (its worker may have
            // died), or sooner when its completion is announced.
            let recheck = lease_left
                .map(|left| left + Duration::from_millis(1))
                .unwrap_or(Duration::from_secs(1));
            telemetry::waiting(scope, key);
            watching.wait(recheck.min(deadline - now), true).await;
        }
    }
}

/// Idempotency inside the caller's own database transaction (SQL stores): the claim,
/// the business writes and the stored outcome commit together, or not at all.
///
/// A concurrent duplicate waits on the record's row lock (bounded by the database's
/// lock timeout), then replays. A crash rolls everything back — never "key saved, work
/// not done", nor the reverse. A completion whose token is no longer the record's is
/// refused inside the transaction, so its business writes roll back with it.
///
/// Hold such a transaction only as long as the database work takes: a handler that
/// calls a slow external service (a payment provider) holds the row lock, and a
/// connection, for all that time. For such work use the lease mode,
/// [`Idempotency::run_once`], which keeps the key with a renewed lease instead.
pub trait TransactionalIdempotency: Sync {
    /// The connection a transaction runs on.
    type Connection: Send;

    /// The statement that opens a transaction this store can claim in, when it is not
    /// the driver's plain `BEGIN` (SQLite: `BEGIN IMMEDIATE`).
    fn begin_statement(&self) -> Option<&'static str> {
        None
    }

    /// Claims (scope, key) inside the transaction on `connection`.
    fn claim_in_transaction<'a>(
        &'a self,
        connection: &'a mut Self::Connection,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        fingerprint: &'a Fingerprint,
        options: &'a IdempotencyOptions,
    ) -> BoxFuture<'a, Result<ClaimAnswer>>;

    /// Stores `outcome` inside the transaction on `connection`; it is replayed once the
    /// transaction commits.
    fn complete_in_transaction<'a>(
        &'a self,
        connection: &'a mut Self::Connection,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        token: FencingToken,
        outcome: &'a [u8],
        options: &'a IdempotencyOptions,
    ) -> BoxFuture<'a, Result<Finish>>;

    /// Moves the per-key cursor of `consumer` to `seq` inside the transaction on
    /// `connection`, if `seq` is the key's next one (`start + 1` for a key never seen:
    /// a new cursor starts at `start`): the building block of
    /// [`Inbox::process_in_order`](inbox::Inbox::process_in_order). Stores without
    /// cursors answer [`ErrorKind::UnsupportedStore`].
    fn advance_cursor<'a>(
        &'a self,
        connection: &'a mut Self::Connection,
        consumer: &'a Scope,
        key: &'a str,
        seq: u64,
        start: u64,
    ) -> BoxFuture<'a, Result<CursorStep>> {
        let _ = (connection, consumer, key, seq, start);
        Box::pin(async {
            Err(Error::new(
                ErrorKind::UnsupportedStore,
                "this store keeps no per-key cursors",
            ))
        })
    }

    /// Sets the per-key cursor of `consumer` to `seq`, wherever it was (a producer
    /// whose numbering went back: its database was restored).
    fn set_cursor<'a>(
        &'a self,
        connection: &'a mut Self::Connection,
        consumer: &'a Scope,
        key: &'a str,
        seq: u64,
    ) -> BoxFuture<'a, Result<()>> {
        let _ = (connection, consumer, key, seq);
        Box::pin(async {
            Err(Error::new(
                ErrorKind::UnsupportedStore,
                "this store keeps no per-key cursors",
            ))
        })
    }

    /// Runs `work` once for (scope, key) inside the caller's transaction and stores its
    /// outcome in the same transaction; a repeat replays it. Commit the transaction after
    /// an `Ok`, roll it back after an `Err` (that gives the key back too).
    ///
    /// Errors as [`Idempotency::run_once`]; a duplicate still at work in *lease* mode
    /// gives [`ErrorKind::InProgress`].
    fn run_once_in_transaction<T, E, F>(
        &self,
        connection: &mut Self::Connection,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        options: &IdempotencyOptions,
        work: F,
    ) -> impl Future<Output = std::result::Result<T, E>>
    where
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        F: AsyncFnOnce(&mut Self::Connection, FencingToken) -> std::result::Result<T, E>,
    {
        async move {
            let token = match self
                .claim_in_transaction(connection, scope, key, fingerprint, options)
                .await?
            {
                ClaimAnswer::Started { token } => token,
                ClaimAnswer::Replay { outcome } => {
                    telemetry::replayed(scope, key, Duration::ZERO);
                    return decode(scope, key, &outcome).map_err(E::from);
                }
                ClaimAnswer::InProgress { lease_left } => {
                    telemetry::in_progress(scope, key);
                    return Err(E::from(in_progress(scope, key, lease_left)));
                }
                ClaimAnswer::Mismatch => {
                    telemetry::mismatch(scope, key);
                    return Err(E::from(mismatch(scope, key)));
                }
            };
            telemetry::started(scope, key, token);
            let value = work(connection, token).await?;
            let outcome = encode(&value)?;
            match self
                .complete_in_transaction(connection, scope, key, token, &outcome, options)
                .await?
            {
                Finish::Done => {
                    telemetry::completed(scope, key, Duration::ZERO);
                    Ok(value)
                }
                Finish::Fenced => {
                    telemetry::fenced_out(scope, key, token);
                    Err(E::from(fenced(scope, key)))
                }
            }
        }
    }
}

/// The first bytes of an outcome that says the real one could not be stored: no JSON
/// document starts with a NUL byte, so no stored value is ever taken for it.
const NOT_STORED: &[u8] = b"\0turnstile:not-stored\0";

fn not_stored_marker(reason: &str) -> Vec<u8> {
    let mut marker = NOT_STORED.to_vec();
    marker.extend_from_slice(reason.as_bytes());
    marker
}

fn decode<T: DeserializeOwned>(scope: &Scope, key: &IdempotencyKey, outcome: &[u8]) -> Result<T> {
    if let Some(reason) = outcome.strip_prefix(NOT_STORED) {
        return Err(Error::new(
            ErrorKind::OutcomeNotStored,
            format!(
                "key \"{key}\" in scope \"{scope}\" ran, but its outcome was not stored ({}); \
                 use a new key for a new request",
                String::from_utf8_lossy(reason)
            ),
        ));
    }
    serde_json::from_slice(outcome).map_err(|error| {
        Error::new(
            ErrorKind::Store,
            format!(
                "the stored outcome of key \"{key}\" in scope \"{scope}\" does not deserialise \
                 as this call's result type"
            ),
        )
        .with_source(error)
    })
}

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(value).map_err(|error| {
        Error::new(ErrorKind::Store, "the outcome does not serialise").with_source(error)
    })
}

fn mismatch(scope: &Scope, key: &IdempotencyKey) -> Error {
    Error::new(
        ErrorKind::KeyMismatch,
        format!(
            "key \"{key}\" in scope \"{scope}\" was used before for a different request; \
             use a new key for a new request"
        ),
    )
}

fn fenced(scope: &Scope, key: &IdempotencyKey) -> Error {
    Error::new(
        ErrorKind::Fencing,
        format!(
            "key \"{key}\" in scope \"{scope}\": a newer claim holds the key (this claim's \
             lease ran out, or an operator forgot the key), so this outcome was not stored"
        ),
    )
}

/// The longest one attempt to record a cut-off handler's outcome may take: longer
/// than every store's own wait (SQLite's busy timeout is 5 s, the SQL stores' lock
/// waits are a second or less), so an attempt that takes longer has met a connection
/// that hangs, and another is tried.
const RECORD_ATTEMPT_LIMIT: Duration = Duration::from_secs(10);

fn not_stored_before_loss(lease: &Lease, error: Error) -> Error {
    let reason = lease
        .loss_reason()
        .map_or_else(|| "lease ended".to_owned(), |reason| reason.to_string());
    Error::new(
        ErrorKind::StoreUnavailable,
        format!("the outcome was not stored before the claim was lost ({reason})"),
    )
    .with_source(error)
}

/// Where a message stands against its key's cursor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CursorStep {
    /// It was the key's next message: the cursor now points at it.
    Next,
    /// The key's cursor is already at or past it: handled before.
    Seen,
    /// An earlier message of the key has not been handled yet; `expected` is the next.
    Early {
        /// The sequence number the key waits for.
        expected: u64,
    },
}

/// Where `seq` stands against a cursor at `last` (after it failed to move).
#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
pub(crate) fn cursor_step(last: i64, seq: i64) -> CursorStep {
    if seq <= last {
        CursorStep::Seen
    } else {
        CursorStep::Early {
            expected: u64::try_from(last).unwrap_or(0) + 1,
        }
    }
}

/// How [`RunningClaim::store_outcome`] retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "axum"), allow(dead_code))]
enum Retrying {
    /// A completion: given up at once when the claim is lost, and after one lease
    /// length of transient refusals while renewals get through (a refusal that lasts
    /// that long is taken as caused by this outcome).
    WhileHeld,
    /// A cut-off handler's record: tried whether or not the claim is lost, each attempt
    /// bounded by [`RECORD_ATTEMPT_LIMIT`], for one lease length after the first
    /// failure (it must land before anyone claims the key again).
    PastLoss,
}

/// What [`Idempotency::begin`] found.
pub(crate) enum Begun {
    Started(RunningClaim),
    Replay(Vec<u8>),
}

/// A claim at work: its lease is renewed until it is completed or given back (or
/// dropped: then the watchdog stops and the lease runs out on its own).
pub(crate) struct RunningClaim {
    store: Arc<dyn IdempotencyStore>,
    scope: Scope,
    key: IdempotencyKey,
    token: FencingToken,
    retention: Duration,
    lease: Arc<Lease>,
    keeper: Keeper,
}

impl RunningClaim {
    pub(crate) fn token(&self) -> FencingToken {
        self.token
    }

    /// Fires when the claim can no longer be assumed ours.
    pub(crate) fn lost_signal(&self) -> crate::lock::LostSignal {
        self.lease.lost_signal()
    }

    /// Stores `outcome`: [`ErrorKind::Fencing`] if a newer claim holds the key. A
    /// transient refusal is tried again, the lease renewed meanwhile, until the claim
    /// is lost or one lease length has passed: the work has run, and a completion
    /// dropped here would let a retry run it again. An outcome the store refuses for
    /// good (too large), or for that whole length, is replaced by `not_stored(error)`,
    /// so that repeats are told, not run again.
    pub(crate) async fn complete_or(
        mut self,
        outcome: &[u8],
        not_stored: impl FnOnce(&Error) -> Vec<u8>,
    ) -> Result<()> {
        let mut finished = self.store_outcome(outcome, Retrying::WhileHeld).await;
        if let Err(error) = &finished
            && error.kind() != ErrorKind::LockLost
            && !self.lease.is_lost()
        {
            // Refused for good (too large), or refused as transient for a whole lease
            // length while the lease held (a statement timeout the outcome itself
            // causes): a small marker tells repeats, instead of retrying for ever.
            telemetry::not_stored(&self.scope, &self.key, error);
            finished = self
                .store_outcome(&not_stored(error), Retrying::WhileHeld)
                .await;
        }
        self.keeper.stop();
        self.settled(finished)
    }

    /// What a completion's caller learns of how it ended, counted and traced once.
    fn settled(&self, finished: Result<Finish>) -> Result<()> {
        let (scope, key) = (&self.scope, &self.key);
        match finished {
            Ok(Finish::Done) => {
                telemetry::completed(scope, key, self.lease.started.elapsed());
                Ok(())
            }
            Ok(Finish::Fenced) => {
                telemetry::fenced_out(scope, key, self.token);
                Err(fenced(scope, key))
            }
            Err(error) => {
                telemetry::completion_failed(scope, key, &error);
                Err(error)
            }
        }
    }

    /// Records `outcome` for a claim whose handler was cut off mid-way (its effects are
    /// unknown), the claim lost or about to be: the store is most often what cut it
    /// off, so a store that answers a transient error, or does not answer within
    /// [`RECORD_ATTEMPT_LIMIT`], is asked again, for one lease length after the first
    /// failure. The record must land before anyone claims the key again, or that
    /// retry runs the handler a second time; a newer claim's record is never touched
    /// (the store fences this one). The keeper renews the claim until the record lands
    /// or the attempts end.
    #[cfg(feature = "axum")]
    pub(crate) async fn complete_with_retries(mut self, outcome: &[u8]) -> Result<()> {
        let finished = self.store_outcome(outcome, Retrying::PastLoss).await;
        self.keeper.stop();
        self.settled(finished)
    }

    /// One outcome stored, a transient refusal (or, with [`Retrying::PastLoss`], an
    /// attempt that does not answer within [`RECORD_ATTEMPT_LIMIT`]) tried again with a
    /// growing pause while the keeper renews the lease, for one lease length at most.
    async fn store_outcome(&self, outcome: &[u8], retrying: Retrying) -> Result<Finish> {
        let (scope, key) = (&self.scope, &self.key);
        let while_held = retrying == Retrying::WhileHeld;
        let lost = self.lease.lost_signal();
        tokio::pin!(lost);
        let window = self.lease.ttl;
        // While the claim holds, the length counts from the first attempt; past its
        // loss, from the first failure.
        let mut deadline = while_held.then(|| Instant::now() + window);
        let longest_pause = if while_held {
            Duration::from_secs(1)
        } else {
            // Once the store is back, a retry of the request may claim the key at any
            // moment, and the record must come first.
            Duration::from_millis(200)
        };
        let mut pause = Duration::from_millis(20);
        loop {
            let attempt = self
                .store
                .complete(scope, key, self.token, outcome, self.retention);
            let finished = if while_held {
                attempt.await
            } else {
                tokio::time::timeout(RECORD_ATTEMPT_LIMIT, attempt)
                    .await
                    .unwrap_or_else(|_| {
                        Err(Error::new(
                            ErrorKind::StoreUnavailable,
                            format!(
                                "the store did not answer within {}",
                                crate::lock::describe_wait(RECORD_ATTEMPT_LIMIT)
                            ),
                        ))
                    })
            };
            let error = match finished {
                Err(error) if error.kind() == ErrorKind::StoreUnavailable => error,
                finished => return finished,
            };
            if while_held && self.lease.is_lost() {
                return Err(not_stored_before_loss(&self.lease, error));
            }
            let deadline = *deadline.get_or_insert_with(|| Instant::now() + window);
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(if while_held {
                    Error::new(
                        ErrorKind::StoreUnavailable,
                        format!(
                            "the store refused the outcome for {} while the claim was kept",
                            crate::lock::describe_wait(window)
                        ),
                    )
                    .with_source(error)
                } else {
                    error
                });
            }
            telemetry::completion_retried(scope, key, &error);
            tokio::select! {
                biased;
                _ = &mut lost, if while_held => {
                    return Err(not_stored_before_loss(&self.lease, error));
                }
                () = tokio::time::sleep(pause.min(left)) => {}
            }
            pause = (pause * 2).min(longest_pause);
        }
    }

    /// Stores `outcome` inside the caller's transaction on `connection` (the watchdog
    /// stops first: the transaction's commit is what completes the claim). On an error
    /// roll the transaction back and [give the key back](Self::give_back).
    #[cfg(all(
        feature = "axum",
        any(feature = "sqlite", feature = "postgres", feature = "mysql")
    ))]
    pub(crate) async fn complete_in_transaction<S: TransactionalIdempotency>(
        &mut self,
        store: &S,
        connection: &mut S::Connection,
        outcome: &[u8],
    ) -> Result<()> {
        self.keeper.stop();
        let (scope, key) = (&self.scope, &self.key);
        let options = IdempotencyOptions::new().retention(self.retention);
        match store
            .complete_in_transaction(connection, scope, key, self.token, outcome, &options)
            .await?
        {
            Finish::Done => {
                telemetry::completed(scope, key, self.lease.started.elapsed());
                Ok(())
            }
            Finish::Fenced => {
                telemetry::fenced_out(scope, key, self.token);
                Err(fenced(scope, key))
            }
        }
    }

    /// Gives the key back for a retry, if it is still ours (the store refuses otherwise;
    /// either way there is nothing more to do about it).
    pub(crate) async fn give_back(mut self) {
        self.keeper.stop();
        let _ = self.store.release(&self.scope, &self.key, self.token).await;
        telemetry::released(&self.scope, &self.key);
    }
}

enum Claimed {
    Started { token: FencingToken, sent: Instant },
    Replay(Vec<u8>),
}

fn in_progress(scope: &Scope, key: &IdempotencyKey, lease_left: Option<Duration>) -> Error {
    let left = lease_left.map_or_else(String::new, |left| {
        format!(" (its lease has {} left)", crate::lock::describe_wait(left))
    });
    Error::new(
        ErrorKind::InProgress,
        format!(
            "key \"{key}\" in scope \"{scope}\" is being worked on by an earlier request{left}; \
             retry later"
        ),
    )
    .with_retry_after(lease_left)
}

/// The largest outcome a store keeps, in bytes (16 MiB): larger ones are refused rather
/// than stored half.
pub const MAX_OUTCOME_LEN: usize = 16 * 1024 * 1024;

#[cfg_attr(
    not(any(
        feature = "sqlite",
        feature = "postgres",
        feature = "mysql",
        feature = "redis"
    )),
    allow(dead_code)
)]
pub(crate) fn check_outcome(outcome: &[u8]) -> Result<()> {
    if outcome.len() > MAX_OUTCOME_LEN {
        return Err(Error::new(
            ErrorKind::InvalidOptions,
            format!(
                "an outcome of {} bytes is larger than the {MAX_OUTCOME_LEN} bytes a store keeps",
                outcome.len()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_scopes_are_validated() {
        assert!(IdempotencyKey::new("8e03978e-40d5-43e8-bc93-6894a57f9324").is_ok());
        assert!(IdempotencyKey::new("with space").is_ok());
        for bad in ["", "tab\there", "é", &"x".repeat(256)] {
            assert_eq!(
                IdempotencyKey::new(bad).unwrap_err().kind(),
                ErrorKind::InvalidName,
                "{bad:?}"
            );
        }
        assert!(Scope::new("tenant 7 / 東京").is_ok());
        assert!(Scope::new("").is_err());
        assert!(Scope::new("a\nb").is_err());
        assert_ne!(Scope::global(), Scope::new("global").unwrap());
        assert_ne!(Scope::global(), Scope::new("(global)").unwrap());
        assert!(Scope::global().is_global() && !Scope::new("global").unwrap().is_global());
    }

    #[test]
    fn fingerprints_frame_their_parts() {
        assert_ne!(
            Fingerprint::of(&[b"ab", b"c"]),
            Fingerprint::of(&[b"a", b"bc"])
        );
        assert_ne!(Fingerprint::of(&[b"", b"x"]), Fingerprint::of(&[b"x"]));
        assert_eq!(Fingerprint::of(&[b"a"]), Fingerprint::of(&[b"a"]));
    }

    #[test]
    fn options_are_validated() {
        assert!(IdempotencyOptions::new().validate().is_ok());
        for bad in [
            IdempotencyOptions::new().lease(Duration::from_millis(10)),
            IdempotencyOptions::new().retention(Duration::ZERO),
            IdempotencyOptions::new().wait(Duration::MAX),
            IdempotencyOptions::new()
                .lease(Duration::from_secs(30))
                .retention(Duration::from_secs(5)),
        ] {
            assert_eq!(
                bad.validate().unwrap_err().kind(),
                ErrorKind::InvalidOptions
            );
        }
    }
}
