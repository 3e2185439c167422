//! Locks in etcd (`etcd://host:port[,host:port…]`, feature `etcd`).
//!
//! Each acquisition is a key `{prefix}/{name}\x1f{owner}` (U+001F, a control character
//! no name may hold, ends the name, so that one name's keys never fall in another's
//! range; versions before this one used `/`, so upgrade while no lock is held); the
//! key with the smallest create revision under the name holds the lock. Keys live on this client's
//! **session lease** — one lease per whole-second TTL in use (the TTL rounded up, plus
//! one second), kept alive every half second while the store lives, as etcd's own
//! concurrency package does — so no lease is granted or revoked per acquisition. An
//! acquisition is one transaction: our key joins the line (unless it is there already)
//! and the first key is read back. A waiter's key **stays in line**, so waiters in every
//! process get the lock in the order they asked; a waiter already in line checks its
//! place with one read, and the lock core deletes its key when it stops waiting. A
//! hand-over between tasks of one process is one transaction too: our key goes and the
//! next owner's joins the line, behind any waiter elsewhere.
//!
//! # Guarantees
//! - **Atomicity and order**: etcd's Raft log; revisions grow cluster-wide.
//! - **Fencing tokens**: the holder key's create revision — grows with every write to
//!   the cluster, survives restarts and leader changes (it is in the replicated log).
//! - **Expiry of a crashed or cut-off holder**: its session lease, by the etcd leader's
//!   clock: the key goes at most the TTL rounded up to whole seconds, plus one second,
//!   after the holder's last keep-alive. A holder that is alive but stops renewing a
//!   lock (no watchdog, or past its deadline) has the key deleted by its own client at
//!   its deadline (within half a second), since its session lease lives on.
//! - **Lost signal**: a renewal confirms that the key is still there and first, and
//!   that the session lease was kept alive to cover the new deadline; a lease that
//!   expired (etcd answers a keep-alive with TTL 0) takes every key of the session with
//!   it, and the next renewal of each finds its key gone. Renewals that fail fire the
//!   signal at the local validity deadline.
//! - **Partition / leader change**: a holder cut off from a quorum cannot keep its
//!   session alive and stops at its local deadline, before its lease can end on etcd; a
//!   leader change keeps leases (their TTL restarts on the new leader, so a lease may
//!   outlive its TTL, never the reverse).
//! - **Waiting**: a waiter watches the name's keys from the current revision and is
//!   woken by a deletion (a release, an expired lease); it also re-checks with a backoff
//!   from 50 ms to 500 ms in case a notification is lost.
//! - **Breaking** a lock deletes the holder's key only; the holder's other locks on the
//!   same session lease stay.
//! - **Members down**: list every member in the URL. A request that a dead member
//!   refuses is sent to the next endpoint (etcd-client's balancer keeps dead endpoints in
//!   its rotation); without a quorum, requests fail and holders stop at their deadline.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, GetOptions, LeaseKeepAliveStream, LeaseKeeper, PutOptions,
    SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse,
};

use super::{
    BoxFuture, ExtendOutcome, HolderAndValue, LockBackend, LockInfo, LockName, LossReason, OwnerId,
    ReleaseOutcome, ReleaseWatch, TryAcquire,
};
use crate::error::{Error, ErrorKind, Result};
use crate::fence::FencingToken;

/// Ends a watch's task when the watch is dropped.
struct WatchTask(tokio::task::JoinHandle<()>);

impl Drop for WatchTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// When each lock this client holds stops being trusted without a renewal (sent +
/// TTL), by key. The session lease outlives every single lock's TTL, so past its
/// deadline a key is this client's to delete.
type Deadlines = Arc<Mutex<HashMap<String, Instant>>>;

fn lock_deadlines(
    deadlines: &Mutex<HashMap<String, Instant>>,
) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
    deadlines
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// How often a session lease is kept alive. Its TTL is one second longer than the
/// locks' (rounded up), so a keep-alive at most this old still covers a new lock's
/// whole TTL and acquisitions need none of their own.
const SESSION_KEEP_ALIVE_EVERY: Duration = Duration::from_millis(500);

/// How long one keep-alive exchange may take before it counts as failed.
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(2);

/// One lease shared by this client's keys of one whole-second TTL.
struct Session {
    id: i64,
    secs: i64,
    /// Until when etcd keeps the lease at the least: the last answered keep-alive's
    /// send time plus the lease's TTL.
    alive_until: Mutex<Instant>,
    /// etcd answered a keep-alive with TTL 0: the lease and its keys are gone.
    expired: AtomicBool,
    channel: tokio::sync::Mutex<Option<(LeaseKeeper, LeaseKeepAliveStream)>>,
    client: Client,
}

impl Session {
    fn alive_until(&self) -> Instant {
        *self
            .alive_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keeps the lease alive once: `Ok(false)` when etcd says it has expired.
    async fn keep_alive(&self) -> Result<bool> {
        let sent = Instant::now();
        let mut channel = self.channel.lock().await;
        let exchange = async {
            if channel.is_none() {
                *channel = Some(self.client.clone().lease_keep_alive(self.id).await?);
            }
            let Some((keeper, stream)) = channel.as_mut() else {
                unreachable!("opened above");
            };
            keeper.keep_alive().await?;
            stream.message().await
        };
        let answer = match tokio::time::timeout(KEEP_ALIVE_TIMEOUT, exchange).await {
            Ok(Ok(Some(answer))) => answer,
            Ok(Ok(None)) => {
                *channel = None;
                return Err(Error::new(
                    ErrorKind::StoreUnavailable,
                    "etcd closed the lease keep-alive stream",
                ));
            }
            Ok(Err(error)) => {
                *channel = None;
                return Err(failed("cannot renew the session lease")(error));
            }
            Err(_) => {
                *channel = None;
                return Err(Error::new(
                    ErrorKind::StoreUnavailable,
                    format!("etcd did not answer a lease keep-alive within {KEEP_ALIVE_TIMEOUT:?}"),
                ));
            }
        };
        if answer.ttl() <= 0 {
            self.expired.store(true, Ordering::SeqCst);
            return Ok(false);
        }
        let mut alive_until = self
            .alive_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let renewed = sent + Duration::from_secs(u64::try_from(self.secs).unwrap_or(1));
        if renewed > *alive_until {
            *alive_until = renewed;
        }
        Ok(true)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // No lock of this store is held any more (a held lock keeps the store, and so
        // its sessions, alive): give the lease back rather than let it run out.
        let (mut client, id) = (self.client.clone(), self.id);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = client.lease_revoke(id).await;
            });
        }
    }
}

/// Keeps a session lease alive, and deletes this client's keys whose deadline passed
/// without a renewal; ends with the session.
async fn keep_session(session: Weak<Session>, deadlines: Weak<Mutex<HashMap<String, Instant>>>) {
    loop {
        tokio::time::sleep(SESSION_KEEP_ALIVE_EVERY).await;
        let Some(session) = session.upgrade() else {
            return;
        };
        if session.expired.load(Ordering::SeqCst) {
            return;
        }
        // A failure is retried at the next tick; renewals and acquisitions that need a
        // fresher lease keep it alive themselves, and fail if they cannot.
        let _ = session.keep_alive().await;
        let Some(deadlines) = deadlines.upgrade() else {
            return;
        };
        let now = Instant::now();
        let overdue: Vec<String> = lock_deadlines(&deadlines)
            .iter()
            .filter(|(_, deadline)| now >= **deadline)
            .map(|(key, _)| key.clone())
            .collect();
        for key in overdue {
            if session
                .client
                .clone()
                .delete(key.as_str(), None)
                .await
                .is_ok()
            {
                let mut deadlines = lock_deadlines(&deadlines);
                if deadlines.get(&key).is_some_and(|deadline| now >= *deadline) {
                    deadlines.remove(&key);
                }
            }
        }
    }
}

/// Locks in etcd.
#[derive(Clone)]
pub struct EtcdLockStore {
    client: Client,
    prefix: String,
    url: String,
    deadlines: Deadlines,
    /// Keys this client has in a name's line (holding or waiting): a waiter that asks
    /// again reads its place instead of writing.
    in_line: Arc<Mutex<std::collections::HashSet<String>>>,
    /// The session leases, by their TTL in whole seconds.
    sessions: Arc<tokio::sync::Mutex<HashMap<i64, Arc<Session>>>>,
    /// How many endpoints the URL names: how often a refused request is sent again.
    endpoints: usize,
}

/// Whether a request failed before it reached etcd: the connection to the endpoint the
/// client's balancer picked was refused (a member that is down). Sent again, the
/// request goes to another endpoint.
fn never_sent(error: &etcd_client::Error) -> bool {
    match error {
        etcd_client::Error::GRpcStatus(status) => status.message().contains("tcp connect error"),
        _ => false,
    }
}

impl std::fmt::Debug for EtcdLockStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdLockStore")
            .field("url", &self.url)
            .finish()
    }
}

fn failed(what: &str) -> impl Fn(etcd_client::Error) -> Error + '_ {
    move |error| {
        let kind = match &error {
            etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => {
                ErrorKind::StoreUnavailable
            }
            // gRPC's "unavailable", "deadline exceeded" and "cancelled": the cluster
            // did not answer (no quorum, no leader, gone).
            etcd_client::Error::GRpcStatus(status)
                if matches!(
                    format!("{:?}", status.code()).as_str(),
                    "Unavailable" | "DeadlineExceeded" | "Cancelled"
                ) =>
            {
                ErrorKind::StoreUnavailable
            }
            // tonic reports a connection that broke under a request (a member that
            // restarted) as "unknown" with this message.
            etcd_client::Error::GRpcStatus(status)
                if format!("{:?}", status.code()) == "Unknown"
                    && status.message().contains("transport error") =>
            {
                ErrorKind::StoreUnavailable
            }
            _ => ErrorKind::Store,
        };
        Error::new(kind, format!("{what}: {error}"))
    }
}

fn whole_seconds(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis().div_ceil(1000))
        .unwrap_or(i64::MAX)
        .max(1)
}

/// The first `count` keys under a name's prefix, oldest (smallest create revision) first.
fn in_line_options(count: i64) -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
        .with_limit(count)
}

/// The first key of each of a transaction's first two reads: ours, and the name's
/// first in line.
fn mine_and_first(
    answer: &etcd_client::TxnResponse,
) -> (Option<etcd_client::KeyValue>, Option<etcd_client::KeyValue>) {
    let mut got = answer
        .op_responses()
        .into_iter()
        .filter_map(|response| match response {
            TxnOpResponse::Get(got) => Some(got.kvs().first().cloned()),
            _ => None,
        });
    (got.next().flatten(), got.next().flatten())
}

/// A key's value: the owner id, then, once the holder proclaimed one, U+001F and its
/// value.
fn owner_and_value(kv: &etcd_client::KeyValue) -> (&str, Option<&str>) {
    let stored = kv.value_str().unwrap_or_default();
    match stored.split_once('\u{1f}') {
        Some((owner, value)) => (owner, Some(value)),
        None => (stored, None),
    }
}

fn token(revision: i64) -> FencingToken {
    FencingToken::new(u64::try_from(revision).unwrap_or(0))
}

impl EtcdLockStore {
    /// Connects to the endpoints of `etcd://host:port[,host:port…]` (`turnstile_prefix`
    /// in the query sets the key prefix, `turnstile` by default).
    pub async fn connect(url: &str) -> Result<Self> {
        let (base, options) = crate::url::split_url_options(url);
        let mut prefix = "turnstile".to_owned();
        for (key, value) in &options {
            match key.as_str() {
                "prefix" => prefix = value.clone(),
                _ => return Err(crate::url::unknown_option(key, value, "turnstile_prefix")),
            }
        }
        let hosts = base
            .strip_prefix("etcd://")
            .map(|rest| rest.trim_end_matches('/'))
            .filter(|rest| !rest.is_empty() && !rest.contains(['/', '@']))
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidUrl,
                    format!("{url:?} is not an etcd URL (etcd://host:port[,host:port…])"),
                )
            })?;
        let endpoints: Vec<String> = hosts
            .split(',')
            .map(|host| format!("http://{host}"))
            .collect();
        let options = etcd_client::ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(3))
            .with_timeout(Duration::from_secs(5));
        let mut client = Client::connect(&endpoints, Some(options))
            .await
            .map_err(failed(&format!("cannot connect to etcd at {hosts}")))?;
        // The connection is lazy: ask something now, so a wrong address is reported here.
        client
            .status()
            .await
            .map_err(failed(&format!("cannot reach etcd at {hosts}")))?;
        Ok(EtcdLockStore {
            client,
            prefix,
            url: format!("etcd://{hosts}"),
            deadlines: Arc::default(),
            in_line: Arc::default(),
            sessions: Arc::default(),
            endpoints: endpoints.len(),
        })
    }

    /// Sends a request, and again (once per endpoint at most) while the endpoint it went
    /// to refused the connection: etcd-client's balancer keeps a dead member in its
    /// rotation, and without this every request that lands on it would fail although
    /// a quorum is up.
    async fn failover<T, F, Fut>(&self, request: F) -> std::result::Result<T, etcd_client::Error>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        let mut refused = 0;
        loop {
            match request(self.client.clone()).await {
                Err(error) if never_sent(&error) && refused < self.endpoints => refused += 1,
                answer => return answer,
            }
        }
    }

    async fn txn(
        &self,
        txn: Txn,
    ) -> std::result::Result<etcd_client::TxnResponse, etcd_client::Error> {
        self.failover(|mut client| {
            let txn = txn.clone();
            async move { client.txn(txn).await }
        })
        .await
    }

    async fn delete(&self, key: &str) {
        let key = key.to_owned();
        let deleted = self
            .failover(|mut client| {
                let key = key.clone();
                async move { client.delete(key, None).await }
            })
            .await;
        if deleted.is_err() {
            self.delete_later(key, Duration::ZERO);
        }
    }

    /// Has the session keeper delete `key` once `after` has passed, and again until it
    /// goes: a key this client gave up on but could not delete (the store was down, or
    /// the release was dropped unfinished) lives on the session lease, which this
    /// client keeps alive, so nobody else would ever remove it, and a waiter's key left
    /// in line would hold the lock for good.
    fn delete_later(&self, key: String, after: Duration) {
        self.deadlines().insert(key, Instant::now() + after);
    }

    /// The session lease for locks of `ttl`, kept alive at least until `needed_until`
    /// (granted, or kept alive now, when it is not).
    async fn session(&self, ttl: Duration, needed_until: Instant) -> Result<Arc<Session>> {
        let secs = whole_seconds(ttl).saturating_add(1);
        let mut sessions = self.sessions.lock().await;
        if let Some(session) = sessions.get(&secs)
            && !session.expired.load(Ordering::SeqCst)
        {
            let session = Arc::clone(session);
            drop(sessions);
            if session.alive_until() >= needed_until || session.keep_alive().await? {
                return Ok(session);
            }
            sessions = self.sessions.lock().await;
        }
        let sent = Instant::now();
        let id = self
            .failover(|mut client| async move { client.lease_grant(secs, None).await })
            .await
            .map_err(failed("cannot take a session lease"))?
            .id();
        let session = Arc::new(Session {
            id,
            secs,
            alive_until: Mutex::new(sent + Duration::from_secs(u64::try_from(secs).unwrap_or(1))),
            expired: AtomicBool::new(false),
            channel: tokio::sync::Mutex::new(None),
            client: self.client.clone(),
        });
        tokio::spawn(keep_session(
            Arc::downgrade(&session),
            Arc::downgrade(&self.deadlines),
        ));
        sessions.insert(secs, Arc::clone(&session));
        Ok(session)
    }

    /// The keys of `name`'s line: `{prefix}/{name}` and a terminator that no name can
    /// hold (a control character), so that no other name's keys fall in this range:
    /// with `/` alone, the keys of `acme/x` lay inside the range of a lock named
    /// `acme`, which then saw them in its line (and breaking it deleted them).
    fn name_prefix(&self, name: &LockName) -> String {
        format!("{}/{}\u{1f}", self.prefix, name.as_str())
    }

    /// Reads the first `count` keys in line for `name`, oldest first.
    fn in_line(&self, name: &LockName, count: i64) -> TxnOp {
        TxnOp::get(self.name_prefix(name), Some(in_line_options(count)))
    }

    /// A semaphore's number of permits: outside every name's range of lock keys
    /// (`{prefix}/…`).
    fn permits_key(&self, name: &LockName) -> String {
        format!("{}\u{1f}permits/{}", self.prefix, name.as_str())
    }

    fn key(&self, name: &LockName, owner: &OwnerId) -> String {
        format!("{}{owner}", self.name_prefix(name))
    }

    /// The holder: the key under `name` with the smallest create revision.
    async fn first(&self, name: &LockName) -> Result<Option<etcd_client::KeyValue>> {
        let prefix = self.name_prefix(name);
        let response = self
            .failover(|mut client| {
                let prefix = prefix.clone();
                async move { client.get(prefix, Some(in_line_options(1))).await }
            })
            .await
            .map_err(failed("cannot read the lock"))?;
        Ok(response.kvs().first().cloned())
    }

    fn is_in_line(&self, key: &str) -> bool {
        self.in_line
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(key)
    }

    fn left_line(&self, key: &str) {
        self.in_line
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(key);
        self.deadlines().remove(key);
    }

    /// The answer for our key `mine` in line, given the name's `first` key: the lock is
    /// ours until `deadline` if our key is first; otherwise our key waits in line.
    fn placed(
        &self,
        key: String,
        mine: &etcd_client::KeyValue,
        first: Option<&etcd_client::KeyValue>,
        deadline: Instant,
    ) -> TryAcquire {
        self.in_line
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(key.clone());
        if first.is_some_and(|first| first.key() == mine.key()) {
            self.deadlines().insert(key, deadline);
            TryAcquire::Acquired {
                token: token(mine.create_revision()),
            }
        } else {
            TryAcquire::Held {
                remaining_ttl: None,
            }
        }
    }

    fn deadlines(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        lock_deadlines(&self.deadlines)
    }

    /// Whether this client's TTL for `key` has passed without a renewal.
    fn overdue(&self, key: &str) -> bool {
        self.deadlines()
            .get(key)
            .is_some_and(|deadline| Instant::now() >= *deadline)
    }

    async fn lease_left(&self, lease: i64) -> Option<Duration> {
        let response = self
            .failover(|mut client| async move { client.lease_time_to_live(lease, None).await })
            .await
            .ok()?;
        u64::try_from(response.ttl()).ok().map(Duration::from_secs)
    }

    async fn info(&self, kv: &etcd_client::KeyValue) -> LockInfo {
        LockInfo {
            owner: owner_and_value(kv).0.to_owned(),
            fencing_token: Some(token(kv.create_revision())),
            remaining_ttl: self.lease_left(kv.lease()).await,
        }
    }
}

impl LockBackend for EtcdLockStore {
    fn try_acquire<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<TryAcquire>> {
        Box::pin(async move {
            let sent = Instant::now();
            let key = self.key(name, owner);
            // Already in line: our key and the name's first key, in one read (no write,
            // so nothing to sync on etcd's log).
            if self.is_in_line(&key) {
                let first_key = self.in_line(name, 1);
                let read = async {
                    self.txn(Txn::new().and_then([TxnOp::get(key.as_str(), None), first_key]))
                        .await
                        .map_err(failed("cannot read the lock key"))
                };
                let (_, answer) = tokio::try_join!(self.session(ttl, sent + ttl), read)?;
                let (mine, first) = mine_and_first(&answer);
                if let Some(mine) = mine {
                    return Ok(self.placed(key, &mine, first.as_ref(), sent + ttl));
                }
                // Our key went (its lease expired, or it was broken): join again.
                self.left_line(&key);
            }
            let session = self.session(ttl, sent + ttl).await?;
            // Our key at the back of the line, unless it is there already (an acquire
            // repeated by its owner), then our key and the first key, in one round trip.
            let read_back = [TxnOp::get(key.as_str(), None), self.in_line(name, 1)];
            let txn = Txn::new()
                .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
                .and_then(
                    std::iter::once(TxnOp::put(
                        key.as_str(),
                        owner.to_string(),
                        Some(PutOptions::new().with_lease(session.id)),
                    ))
                    .chain(read_back.clone())
                    .collect::<Vec<_>>(),
                )
                .or_else(read_back);
            let answer = self
                .txn(txn)
                .await
                .map_err(failed("cannot write the lock key"))?;
            let (mine, first) = mine_and_first(&answer);
            let Some(mine) = mine else {
                return Err(Error::new(
                    ErrorKind::Store,
                    format!("etcd did not keep the lock key {key} just written"),
                ));
            };
            Ok(self.placed(key, &mine, first.as_ref(), sent + ttl))
        })
    }

    fn extend<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<ExtendOutcome>> {
        Box::pin(async move {
            let sent = Instant::now();
            let mut client = self.client.clone();
            let key = self.key(name, owner);
            if self.overdue(&key) {
                // Past this client's TTL: the lock is not ours to renew any more.
                self.delete(&key).await;
                self.left_line(&key);
                return Ok(ExtendOutcome::Lost(LossReason::Expired));
            }
            // Our key and the name's first key in one read, while the session lease is
            // made sure of for the new deadline.
            let first_key = self.in_line(name, 1);
            let read = async {
                self.txn(Txn::new().and_then([TxnOp::get(key.as_str(), None), first_key]))
                    .await
                    .map_err(failed("cannot read the lock key"))
            };
            let (session, answer) = tokio::try_join!(self.session(ttl, sent + ttl), read)?;
            let (mine, first) = mine_and_first(&answer);
            let Some(kv) = mine else {
                self.left_line(&key);
                return Ok(ExtendOutcome::from_answers(false, first.is_some()));
            };
            if kv.lease() != session.id {
                // A key on a lease that is not this client's session now (written by an
                // earlier session whose lease was replaced): keep that lease alive.
                let (mut keeper, mut stream) = client
                    .lease_keep_alive(kv.lease())
                    .await
                    .map_err(failed("cannot renew the lease"))?;
                keeper
                    .keep_alive()
                    .await
                    .map_err(failed("cannot renew the lease"))?;
                let renewed = stream
                    .message()
                    .await
                    .map_err(failed("cannot renew the lease"))?
                    .is_some_and(|answer| answer.ttl() > 0);
                if !renewed {
                    return Ok(ExtendOutcome::Lost(LossReason::Expired));
                }
            }
            // Still first? (A key of ours that is not first is not a lock.)
            match first {
                Some(first) if first.key() == kv.key() => {
                    self.deadlines().insert(key, sent + ttl);
                    Ok(ExtendOutcome::Extended)
                }
                _ => Ok(ExtendOutcome::Lost(LossReason::TakenOver)),
            }
        })
    }

    fn release<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
    ) -> BoxFuture<'a, Result<ReleaseOutcome>> {
        Box::pin(async move {
            let key = self.key(name, owner);
            let overdue = self.overdue(&key);
            self.left_line(&key);
            // Should this release fail, time out or be dropped unfinished (the lock core
            // gives a release a bound), the session keeper deletes the key a second from
            // now; a release that is answered takes that back.
            self.delete_later(key.clone(), Duration::from_secs(1));
            // In one round trip: our key, the name's first key (before the delete), and
            // the delete of ours.
            let first_key = self.in_line(name, 1);
            let answer = match self
                .txn(Txn::new().and_then([
                    TxnOp::get(key.as_str(), None),
                    first_key,
                    TxnOp::delete(key.as_str(), None),
                ]))
                .await
            {
                Ok(answer) => {
                    self.deadlines().remove(&key);
                    answer
                }
                Err(error) => return Err(failed("cannot release the lock")(error)),
            };
            let (mine, first) = mine_and_first(&answer);
            let Some(kv) = mine else {
                return Ok(if first.is_some() {
                    ReleaseOutcome::HeldByOther
                } else {
                    ReleaseOutcome::AlreadyExpired
                });
            };
            let ours = first.as_ref().is_some_and(|first| first.key() == kv.key());
            Ok(match (ours, overdue) {
                (true, false) => ReleaseOutcome::Released,
                // Our TTL had passed: whatever etcd still kept was no longer a lock.
                (true, true) => ReleaseOutcome::AlreadyExpired,
                (false, _) => ReleaseOutcome::HeldByOther,
            })
        })
    }

    fn inspect<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<LockInfo>>> {
        Box::pin(async move {
            match self.first(name).await? {
                Some(kv) => Ok(Some(self.info(&kv).await)),
                None => Ok(None),
            }
        })
    }

    /// Rewrites the holder's own key with the value after its owner id, on the same
    /// lease. A key first in line stays first until it is deleted, so the write is
    /// made only if the key that was read first is still there (the same create
    /// revision): then it still holds the lock.
    fn proclaim<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        value: &'a str,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let key = self.key(name, owner);
            let Some(first) = self.first(name).await? else {
                return Ok(false);
            };
            if first.key() != key.as_bytes() {
                return Ok(false);
            }
            let txn = Txn::new()
                .when([Compare::create_revision(
                    key.as_str(),
                    CompareOp::Equal,
                    first.create_revision(),
                )])
                .and_then([TxnOp::put(
                    key.as_str(),
                    format!("{owner}\u{1f}{value}"),
                    Some(PutOptions::new().with_ignore_lease()),
                )]);
            let answer = self
                .txn(txn)
                .await
                .map_err(failed("cannot store the holder's value"))?;
            Ok(answer.succeeded())
        })
    }

    fn inspect_with_value<'a>(
        &'a self,
        name: &'a LockName,
    ) -> BoxFuture<'a, Result<Option<HolderAndValue>>> {
        Box::pin(async move {
            let Some(kv) = self.first(name).await? else {
                return Ok(None);
            };
            let value = owner_and_value(&kv).1.map(str::to_owned);
            Ok(Some((self.info(&kv).await, value)))
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
            let key = self.permits_key(name);
            let txn = Txn::new()
                .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(key.as_str(), permits.to_string(), None)])
                .or_else([TxnOp::get(key.as_str(), None)]);
            let answer = self
                .txn(txn)
                .await
                .map_err(failed("cannot declare the semaphore's permits"))?;
            if answer.succeeded() {
                return Ok(permits);
            }
            let (stored, _) = mine_and_first(&answer);
            let text = stored
                .as_ref()
                .and_then(|kv| kv.value_str().ok())
                .unwrap_or_default();
            text.parse().map_err(|_| {
                Error::new(
                    ErrorKind::Store,
                    format!("the semaphore's permits key {key} holds {text:?}, not a number"),
                )
            })
        })
    }

    fn stored_permits<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<u32>>> {
        Box::pin(async move {
            let key = self.permits_key(name);
            let answer = self
                .txn(Txn::new().and_then([TxnOp::get(key.as_str(), None)]))
                .await
                .map_err(failed("cannot read the semaphore's permits"))?;
            let (stored, _) = mine_and_first(&answer);
            Ok(stored
                .as_ref()
                .and_then(|kv| kv.value_str().ok())
                .and_then(|text| text.parse().ok()))
        })
    }

    fn forget_permits<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<u32>>> {
        Box::pin(async move {
            let key = self.permits_key(name);
            let answer = self
                .txn(Txn::new().and_then([
                    TxnOp::get(key.as_str(), None),
                    TxnOp::delete(key.as_str(), None),
                ]))
                .await
                .map_err(failed("cannot forget the semaphore's permits"))?;
            let (stored, _) = mine_and_first(&answer);
            Ok(stored
                .as_ref()
                .and_then(|kv| kv.value_str().ok())
                .and_then(|text| text.parse().ok()))
        })
    }

    fn force_release<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<LockInfo>>> {
        Box::pin(async move {
            let Some(kv) = self.first(name).await? else {
                return Ok(None);
            };
            let info = self.info(&kv).await;
            // The key only: its lease is the holder's session, which may carry other locks.
            self.delete(kv.key_str().unwrap_or_default()).await;
            Ok(Some(info))
        })
    }

    fn watch_releases<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<ReleaseWatch>> {
        Box::pin(async move {
            // From the current revision (a past start revision would be served by etcd's
            // slow catch-up loop): the lock core checks the lock again once this
            // returns, so a release just before is not missed.
            let prefix = self.name_prefix(name);
            let mut stream = self
                .failover(|mut client| {
                    let prefix = prefix.clone();
                    async move {
                        client
                            .watch(prefix, Some(etcd_client::WatchOptions::new().with_prefix()))
                            .await
                    }
                })
                .await
                .map_err(failed("cannot watch the lock"))?;
            let (sender, receiver) = tokio::sync::watch::channel(0_u64);
            let task = tokio::spawn(async move {
                while let Ok(Some(response)) = stream.message().await {
                    // A deletion frees the lock; a key written again (not created: version
                    // above 1) is a holder's new value, which observers want to see. New
                    // keys joining the line wake nobody.
                    if response.events().iter().any(|event| {
                        event.event_type() == etcd_client::EventType::Delete
                            || event.kv().is_some_and(|kv| kv.version() > 1)
                    }) {
                        sender.send_modify(|count| *count = count.wrapping_add(1));
                    }
                }
                // The stream ended (connection lost): waiters check again now. Dropping
                // the sender closes the watch, so they subscribe afresh.
            });
            Ok(ReleaseWatch::new(receiver, WatchTask(task))
                .with_poll(Duration::from_millis(50), Duration::from_millis(500)))
        })
    }

    fn hand_over<'a>(
        &'a self,
        name: &'a LockName,
        from: &'a OwnerId,
        to: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(ReleaseOutcome, TryAcquire)>> {
        Box::pin(async move {
            let sent = Instant::now();
            let (from_key, to_key) = (self.key(name, from), self.key(name, to));
            if self.overdue(&from_key) || !self.is_in_line(&from_key) {
                return super::backend::release_then_acquire(self, name, from, to, ttl).await;
            }
            // One write: our key goes, and the next owner's joins the line at the back
            // (unless it waits there already), then its key and the first key are read.
            // A waiter elsewhere that was in line before comes first: the line, not a
            // pause, gives it its turn. Our key was first (no key can come before the
            // first later), provided it was still there: the transaction checks that.
            let session = self.session(ttl, sent + ttl).await?;
            let read_back = [TxnOp::get(to_key.as_str(), None), self.in_line(name, 1)];
            let mut writes = vec![TxnOp::delete(from_key.as_str(), None)];
            if !self.is_in_line(&to_key) {
                writes.push(TxnOp::put(
                    to_key.as_str(),
                    to.to_string(),
                    Some(PutOptions::new().with_lease(session.id)),
                ));
            }
            let txn = Txn::new()
                .when([Compare::create_revision(
                    from_key.as_str(),
                    CompareOp::Greater,
                    0,
                )])
                .and_then(writes.into_iter().chain(read_back).collect::<Vec<_>>());
            let answer = self
                .txn(txn)
                .await
                .map_err(failed("cannot hand the lock over"))?;
            if !answer.succeeded() {
                // Our key was gone (broken, or its lease expired): not a hand-over.
                return super::backend::release_then_acquire(self, name, from, to, ttl).await;
            }
            self.left_line(&from_key);
            let (mine, first) = mine_and_first(&answer);
            let acquired = match mine {
                Some(mine) => self.placed(to_key, &mine, first.as_ref(), sent + ttl),
                None => {
                    self.left_line(&to_key);
                    self.try_acquire(name, to, ttl).await?
                }
            };
            Ok((ReleaseOutcome::Released, acquired))
        })
    }

    fn keeps_waiters_in_line(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        self.url.clone()
    }
}
