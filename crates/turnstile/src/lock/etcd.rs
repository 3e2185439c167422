//! Locks in etcd (`etcd://host:port[,host:port…]`, feature `etcd`).
//!
//! Each acquisition is a key `{prefix}/{name}/{owner}` attached to a lease of its own
//! (granted for the TTL, in whole seconds rounded up: etcd's leases count seconds); the
//! key with the smallest create revision under the name holds the lock. An acquisition
//! that does not come first deletes its key again and answers "held", so nobody waits
//! in etcd's queue: waiting is the lock core's.
//!
//! # Guarantees
//! - **Atomicity and order**: etcd's Raft log; revisions grow cluster-wide.
//! - **Fencing tokens**: the holder key's create revision — grows with every write to
//!   the cluster, survives restarts and leader changes (it is in the replicated log).
//! - **Expiry**: the lease, by the etcd leader's clock, in whole seconds; a renewal is a
//!   lease keep-alive. A lease that expired fires the holder's lost signal at its next
//!   renewal; renewals that fail fire it at the local validity deadline.
//! - **Partition / leader change**: a holder cut off from a quorum cannot renew and
//!   stops at its local deadline; a leader change keeps leases (their TTL restarts on
//!   the new leader, so a lease may outlive its TTL, never the reverse).
//! - **Waiting**: a waiter watches the name's keys from the current revision and is
//!   woken by a deletion (a release, an expired lease); it also re-checks with a backoff
//!   from 50 ms to 500 ms in case a notification is lost.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
    TxnOpResponse,
};

use super::{
    BoxFuture, ExtendOutcome, LockBackend, LockInfo, LockName, LossReason, OwnerId, ReleaseOutcome,
    ReleaseWatch, TryAcquire,
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

/// Locks in etcd.
#[derive(Clone)]
pub struct EtcdLockStore {
    client: Client,
    prefix: String,
    url: String,
    /// When each lock this client holds stops being trusted without a renewal (sent +
    /// TTL): etcd's leases count whole seconds, so a key can outlive a shorter TTL by
    /// up to a second, and the client must not take that time as still holding.
    deadlines: Arc<Mutex<HashMap<String, Instant>>>,
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

fn token(revision: i64) -> FencingToken {
    FencingToken::new(u64::try_from(revision).unwrap_or(0))
}

impl EtcdLockStore {
    /// Connects to the endpoints of `etcd://host:port[,host:port…]` (`turnstile_prefix`
    /// in the query sets the key prefix, `turnstile` by default).
    pub async fn connect(url: &str) -> Result<Self> {
        let (base, options) = crate::store::split_url_options(url);
        let mut prefix = "turnstile".to_owned();
        for (key, value) in &options {
            match key.as_str() {
                "prefix" => prefix = value.clone(),
                _ => return Err(crate::store::unknown_option(key, value, "turnstile_prefix")),
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
        })
    }

    fn name_prefix(&self, name: &LockName) -> String {
        format!("{}/{}/", self.prefix, name.as_str())
    }

    fn key(&self, name: &LockName, owner: &OwnerId) -> String {
        format!("{}{owner}", self.name_prefix(name))
    }

    /// The holder: the key under `name` with the smallest create revision.
    async fn first(&self, name: &LockName) -> Result<Option<etcd_client::KeyValue>> {
        let response = self
            .client
            .clone()
            .get(
                self.name_prefix(name),
                Some(
                    GetOptions::new()
                        .with_prefix()
                        .with_sort(SortTarget::Create, SortOrder::Ascend)
                        .with_limit(1),
                ),
            )
            .await
            .map_err(failed("cannot read the lock"))?;
        Ok(response.kvs().first().cloned())
    }

    fn deadlines(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        self.deadlines
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether this client's TTL for `key` has passed without a renewal.
    fn overdue(&self, key: &str) -> bool {
        self.deadlines()
            .get(key)
            .is_some_and(|deadline| Instant::now() >= *deadline)
    }

    async fn lease_left(&self, lease: i64) -> Option<Duration> {
        let response = self
            .client
            .clone()
            .lease_time_to_live(lease, None)
            .await
            .ok()?;
        u64::try_from(response.ttl()).ok().map(Duration::from_secs)
    }

    async fn info(&self, kv: &etcd_client::KeyValue) -> LockInfo {
        LockInfo {
            owner: kv.value_str().unwrap_or_default().to_owned(),
            fencing_token: token(kv.create_revision()),
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
            let mut client = self.client.clone();
            let key = self.key(name, owner);
            // Look before writing: a waiter that wrote its key and deleted it again would
            // wake every watcher of the name (a deletion is what they wait for).
            if let Some(holder) = self.first(name).await?
                && holder.key_str().unwrap_or_default() != key
            {
                return Ok(TryAcquire::Held {
                    remaining_ttl: self.lease_left(holder.lease()).await,
                });
            }
            let lease = client
                .lease_grant(whole_seconds(ttl), None)
                .await
                .map_err(failed("cannot take a lease"))?
                .id();
            // Our key, unless we hold one already (an acquire repeated by its owner), and
            // the name's first key, in one round trip.
            let first_key = TxnOp::get(
                self.name_prefix(name),
                Some(
                    GetOptions::new()
                        .with_prefix()
                        .with_sort(SortTarget::Create, SortOrder::Ascend)
                        .with_limit(1),
                ),
            );
            let txn = Txn::new()
                .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
                .and_then([
                    TxnOp::put(
                        key.as_str(),
                        owner.to_string(),
                        Some(PutOptions::new().with_lease(lease)),
                    ),
                    first_key.clone(),
                ])
                .or_else([first_key]);
            let answer = client
                .txn(txn)
                .await
                .map_err(failed("cannot write the lock key"))?;
            let created = answer.succeeded();
            if !created {
                let _ = client.lease_revoke(lease).await;
            }
            let first = answer
                .op_responses()
                .into_iter()
                .find_map(|response| match response {
                    TxnOpResponse::Get(got) => Some(got.kvs().first().cloned()),
                    _ => None,
                });
            let first = match first {
                Some(first) => first,
                None => self.first(name).await?,
            };
            match first {
                Some(kv) if kv.key_str().unwrap_or_default() == key => {
                    self.deadlines().insert(key, sent + ttl);
                    Ok(TryAcquire::Acquired {
                        token: token(kv.create_revision()),
                    })
                }
                holder => {
                    // Not first: take our key back out of the line.
                    if created {
                        let _ = client.delete(key.as_str(), None).await;
                        let _ = client.lease_revoke(lease).await;
                    }
                    let remaining_ttl = match holder {
                        Some(kv) => self.lease_left(kv.lease()).await,
                        None => None,
                    };
                    Ok(TryAcquire::Held { remaining_ttl })
                }
            }
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
                let _ = client.delete(key.as_str(), None).await;
                self.deadlines().remove(&key);
                return Ok(ExtendOutcome::Lost(LossReason::Expired));
            }
            let response = client
                .get(key.as_str(), None)
                .await
                .map_err(failed("cannot read the lock key"))?;
            let Some(kv) = response.kvs().first() else {
                let taken = self.first(name).await?.is_some();
                return Ok(ExtendOutcome::Lost(if taken {
                    LossReason::TakenOver
                } else {
                    LossReason::Expired
                }));
            };
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
            // Still first? (A key of ours that is not first is not a lock.)
            match self.first(name).await? {
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
            let mut client = self.client.clone();
            let key = self.key(name, owner);
            let overdue = self.overdue(&key);
            self.deadlines().remove(&key);
            // In one round trip: our key, the name's first key (before the delete), and
            // the delete of ours.
            let first_key = TxnOp::get(
                self.name_prefix(name),
                Some(
                    GetOptions::new()
                        .with_prefix()
                        .with_sort(SortTarget::Create, SortOrder::Ascend)
                        .with_limit(1),
                ),
            );
            let answer = client
                .txn(Txn::new().and_then([
                    TxnOp::get(key.as_str(), None),
                    first_key,
                    TxnOp::delete(key.as_str(), None),
                ]))
                .await
                .map_err(failed("cannot release the lock"))?;
            let mut got = answer
                .op_responses()
                .into_iter()
                .filter_map(|response| match response {
                    TxnOpResponse::Get(got) => Some(got.kvs().first().cloned()),
                    _ => None,
                });
            let (mine, first) = (got.next().flatten(), got.next().flatten());
            let Some(kv) = mine else {
                return Ok(if first.is_some() {
                    ReleaseOutcome::HeldByOther
                } else {
                    ReleaseOutcome::AlreadyExpired
                });
            };
            let ours = first.as_ref().is_some_and(|first| first.key() == kv.key());
            let _ = client.lease_revoke(kv.lease()).await;
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

    fn force_release<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<LockInfo>>> {
        Box::pin(async move {
            let Some(kv) = self.first(name).await? else {
                return Ok(None);
            };
            let info = self.info(&kv).await;
            let mut client = self.client.clone();
            let _ = client.delete(kv.key().to_vec(), None).await;
            let _ = client.lease_revoke(kv.lease()).await;
            Ok(Some(info))
        })
    }

    fn watch_releases<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<ReleaseWatch>> {
        Box::pin(async move {
            // From the current revision (a past start revision would be served by etcd's
            // slow catch-up loop): the lock core checks the lock again once this
            // returns, so a release just before is not missed.
            let mut stream = self
                .client
                .clone()
                .watch(
                    self.name_prefix(name),
                    Some(etcd_client::WatchOptions::new().with_prefix()),
                )
                .await
                .map_err(failed("cannot watch the lock"))?;
            let (sender, receiver) = tokio::sync::watch::channel(0_u64);
            let task = tokio::spawn(async move {
                while let Ok(Some(response)) = stream.message().await {
                    if response
                        .events()
                        .iter()
                        .any(|event| event.event_type() == etcd_client::EventType::Delete)
                    {
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

    fn describe(&self) -> String {
        self.url.clone()
    }
}
