//! RedLock: one lock over several independent Redis servers (`redlock://host:port,…`,
//! an odd number, usually five).
//!
//! An acquisition asks every node at once (each node runs the single-node engine's
//! scripts) and holds the lock when a majority said yes; the lease is valid from when
//! the request was sent for the TTL less the clock-drift allowance, the validity window
//! RedLock prescribes (TTL − elapsed − drift), kept by the same watchdog as every other
//! engine. A failed acquisition is released on every node. Renewal and release go to
//! every node; the lost signal fires when a renewal no longer holds a majority. Nodes
//! that do not answer count as "no"; when too few answer to decide, the call fails
//! with [`ErrorKind::StoreUnavailable`] at once.
//!
//! # Guarantees (and what they are not)
//! - **Mutual exclusion** while the nodes' clocks run at about the same rate and no
//!   node loses a key it acknowledged: a Redis restart without persistence empties the
//!   node, and a holder's majority can then shrink to a minority that another client
//!   completes. Run the nodes with `appendfsync always`, or keep a restarted node out
//!   for longer than the TTL (the "delayed restart" of the Redis documentation).
//! - **Fencing tokens**: the largest of the tokens the majority issued (each node's are
//!   floored by its clock and grow per name). This is **efficiency-grade, not a safety
//!   guarantee** (Kleppmann's analysis, and the Redis documentation say as much): two
//!   majorities share at least one node, whose tokens grow, so a later holder's token
//!   is larger in the normal case, but after node failures and restarts nothing in
//!   RedLock itself proves it. Use a consensus store (PostgreSQL, etcd) where fenced
//!   writes must be safe.
//! - **Waiting**: waiters are woken by the first reachable node's release
//!   notifications, and poll as well (5 ms to 100 ms), so a node down costs at most
//!   the poll interval.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::redis::RedisLockStore;
use super::{
    BoxFuture, ExtendOutcome, LockBackend, LockInfo, LockName, LossReason, OwnerId, ReleaseOutcome,
    ReleaseWatch, TryAcquire,
};
use crate::error::{Error, ErrorKind, Result};
use crate::fence::FencingToken;

/// How often a node that was down at connect time is tried again.
const RECONNECT_EVERY: Duration = Duration::from_secs(1);

/// Locks held on a majority of independent Redis nodes.
#[derive(Clone)]
pub struct RedLockStore {
    nodes: Arc<Vec<Node>>,
    url: String,
}

struct Node {
    url: String,
    store: Mutex<Option<RedisLockStore>>,
}

impl std::fmt::Debug for RedLockStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedLockStore")
            .field("url", &self.url)
            .finish()
    }
}

fn unavailable(answered: usize, nodes: usize, what: &str) -> Error {
    Error::new(
        ErrorKind::StoreUnavailable,
        format!(
            "only {answered} of {nodes} RedLock nodes answered {what}; a majority ({}) is needed",
            nodes / 2 + 1
        ),
    )
}

/// `redlock://a:1,b:2,c:3/db?options` → the single-node URLs.
fn node_urls(url: &str) -> Result<Vec<String>> {
    let invalid = || {
        Error::new(
            ErrorKind::InvalidUrl,
            format!(
                "{} is not a RedLock URL; expected redlock://[user:password@]host:port,host:port,…[/db] \
                 with an odd number of nodes (3 or more)",
                crate::url::redact(url)
            ),
        )
    };
    let rest = url.strip_prefix("redlock://").ok_or_else(invalid)?;
    let (rest, query) = match rest.split_once('?') {
        Some((rest, query)) => (rest, format!("?{query}")),
        None => (rest, String::new()),
    };
    let (credentials, rest) = match rest.rsplit_once('@') {
        Some((credentials, rest)) => (format!("{credentials}@"), rest),
        None => (String::new(), rest),
    };
    let (hosts, path) = match rest.find('/') {
        Some(at) => rest.split_at(at),
        None => (rest, ""),
    };
    let urls: Vec<String> = hosts
        .split(',')
        .filter(|host| !host.is_empty())
        .map(|host| format!("redis://{credentials}{host}{path}{query}"))
        .collect();
    if urls.len() < 3 || urls.len().is_multiple_of(2) {
        return Err(invalid());
    }
    Ok(urls)
}

impl RedLockStore {
    /// Connects to the nodes of `redlock://host:port,host:port,…` (with the URL's
    /// `turnstile_*` options for every node). A majority must be reachable now; the
    /// others are tried again in the background.
    pub async fn connect(url: &str) -> Result<Self> {
        let urls = node_urls(url)?;
        let attempts =
            futures_util::future::join_all(urls.iter().map(|node| RedisLockStore::connect(node)))
                .await;
        let mut first_error = None;
        let mut nodes = Vec::with_capacity(urls.len());
        for (node_url, attempt) in urls.into_iter().zip(attempts) {
            let store = match attempt {
                Ok(store) => Some(store),
                Err(error) if error.kind() == ErrorKind::StoreUnavailable => {
                    first_error.get_or_insert(error);
                    None
                }
                Err(error) => return Err(error),
            };
            nodes.push(Node {
                url: node_url,
                store: Mutex::new(store),
            });
        }
        let reachable = nodes.iter().filter(|node| node.get().is_some()).count();
        if reachable <= nodes.len() / 2 {
            let error = unavailable(reachable, nodes.len(), "at connect time");
            return Err(match first_error {
                Some(cause) => error.with_source(cause),
                None => error,
            });
        }
        let store = RedLockStore {
            nodes: Arc::new(nodes),
            url: crate::url::redact(url),
        };
        store.reconnect_missing();
        Ok(store)
    }

    /// Keeps trying nodes that were down at connect time, once a second, for as long as
    /// a clone of the store lives.
    fn reconnect_missing(&self) {
        if self.nodes.iter().all(|node| node.get().is_some()) {
            return;
        }
        let nodes = Arc::downgrade(&self.nodes);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(RECONNECT_EVERY).await;
                let Some(nodes) = nodes.upgrade() else { return };
                let mut missing = 0;
                for node in nodes.iter().filter(|node| node.get().is_none()) {
                    match RedisLockStore::connect(&node.url).await {
                        Ok(store) => node.set(store),
                        Err(_) => missing += 1,
                    }
                }
                if missing == 0 {
                    return;
                }
            }
        });
    }

    fn majority(&self) -> usize {
        self.nodes.len() / 2 + 1
    }

    /// Runs `call` on every connected node at once; `None` for a node that is not
    /// connected or failed.
    async fn on_all<'a, T, F>(&'a self, call: F) -> Vec<Option<T>>
    where
        F: Fn(RedisLockStore) -> BoxFuture<'a, Result<T>>,
    {
        let calls = self.nodes.iter().map(|node| {
            let store = node.get();
            let future = store.map(&call);
            async move {
                match future {
                    Some(future) => future.await.ok(),
                    None => None,
                }
            }
        });
        futures_util::future::join_all(calls).await
    }
}

impl Node {
    fn get(&self) -> Option<RedisLockStore> {
        self.store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn set(&self, store: RedisLockStore) {
        *self
            .store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(store);
    }
}

impl LockBackend for RedLockStore {
    fn try_acquire<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<TryAcquire>> {
        Box::pin(async move {
            let answers = self
                .on_all(|store| Box::pin(async move { store.try_acquire(name, owner, ttl).await }))
                .await;
            let answered = answers.iter().flatten().count();
            let tokens: Vec<FencingToken> = answers
                .iter()
                .flatten()
                .filter_map(|answer| match answer {
                    TryAcquire::Acquired { token } => Some(*token),
                    TryAcquire::Held { .. } => None,
                })
                .collect();
            if tokens.len() >= self.majority() {
                let token = tokens.into_iter().max().unwrap_or(FencingToken::new(0));
                return Ok(TryAcquire::Acquired { token });
            }
            // No majority: give back what we got, on every node (a node whose reply
            // was lost may hold it for us too).
            let _ = self
                .on_all(|store| Box::pin(async move { store.release(name, owner).await }))
                .await;
            if answered < self.majority() {
                return Err(unavailable(answered, self.nodes.len(), "the acquisition"));
            }
            let remaining_ttl = answers
                .iter()
                .flatten()
                .filter_map(|answer| match answer {
                    TryAcquire::Held { remaining_ttl } => *remaining_ttl,
                    TryAcquire::Acquired { .. } => None,
                })
                .max();
            Ok(TryAcquire::Held { remaining_ttl })
        })
    }

    fn extend<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<ExtendOutcome>> {
        Box::pin(async move {
            let answers = self
                .on_all(|store| Box::pin(async move { store.extend(name, owner, ttl).await }))
                .await;
            let answered = answers.iter().flatten().count();
            let extended = answers
                .iter()
                .flatten()
                .filter(|answer| **answer == ExtendOutcome::Extended)
                .count();
            if extended >= self.majority() {
                return Ok(ExtendOutcome::Extended);
            }
            if answered < self.majority() {
                // Not enough nodes to tell: the renewal failed, and the watchdog's
                // deadline decides.
                return Err(unavailable(answered, self.nodes.len(), "the renewal"));
            }
            let taken = answers
                .iter()
                .flatten()
                .any(|answer| *answer == ExtendOutcome::Lost(LossReason::TakenOver));
            Ok(ExtendOutcome::from_answers(false, taken))
        })
    }

    fn release<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
    ) -> BoxFuture<'a, Result<ReleaseOutcome>> {
        Box::pin(async move {
            let answers = self
                .on_all(|store| Box::pin(async move { store.release(name, owner).await }))
                .await;
            let answered = answers.iter().flatten().count();
            let released = answers
                .iter()
                .flatten()
                .filter(|answer| **answer == ReleaseOutcome::Released)
                .count();
            if released >= self.majority() {
                return Ok(ReleaseOutcome::Released);
            }
            if answered < self.majority() {
                return Err(unavailable(answered, self.nodes.len(), "the release"));
            }
            let others = answers
                .iter()
                .flatten()
                .filter(|answer| **answer == ReleaseOutcome::HeldByOther)
                .count();
            // Ours on a minority at most: it was no longer a lock.
            Ok(if others >= self.majority() {
                ReleaseOutcome::HeldByOther
            } else {
                ReleaseOutcome::AlreadyExpired
            })
        })
    }

    fn inspect<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<LockInfo>>> {
        Box::pin(async move {
            let answers = self
                .on_all(|store| Box::pin(async move { store.inspect(name).await }))
                .await;
            let answered = answers.iter().flatten().count();
            if answered < self.majority() {
                return Err(unavailable(answered, self.nodes.len(), "the inspection"));
            }
            Ok(majority_holder(&answers, self.majority()))
        })
    }

    fn force_release<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<LockInfo>>> {
        Box::pin(async move {
            let answers = self
                .on_all(|store| Box::pin(async move { store.force_release(name).await }))
                .await;
            let answered = answers.iter().flatten().count();
            if answered < self.majority() {
                return Err(unavailable(
                    answered,
                    self.nodes.len(),
                    "the forced release",
                ));
            }
            Ok(majority_holder(&answers, self.majority()))
        })
    }

    fn watch_releases<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<ReleaseWatch>> {
        Box::pin(async move {
            for node in self.nodes.iter() {
                if let Some(store) = node.get()
                    && let Ok(watch) = store.watch_releases(name).await
                {
                    return Ok(
                        watch.with_poll(Duration::from_millis(5), Duration::from_millis(100))
                    );
                }
            }
            Ok(ReleaseWatch::polling(
                Duration::from_millis(5),
                Duration::from_millis(100),
            ))
        })
    }

    fn describe(&self) -> String {
        self.url.clone()
    }
}

/// The holder a majority of nodes report, with the largest token among them.
fn majority_holder(answers: &[Option<Option<LockInfo>>], majority: usize) -> Option<LockInfo> {
    let holders: Vec<&LockInfo> = answers.iter().flatten().flatten().collect();
    holders.iter().find_map(|candidate| {
        let same: Vec<&&LockInfo> = holders
            .iter()
            .filter(|info| info.owner == candidate.owner)
            .collect();
        (same.len() >= majority).then(|| LockInfo {
            owner: candidate.owner.clone(),
            fencing_token: same
                .iter()
                .map(|info| info.fencing_token)
                .max()
                .unwrap_or(candidate.fencing_token),
            remaining_ttl: same.iter().filter_map(|info| info.remaining_ttl).min(),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_an_odd_number_of_nodes() {
        assert_eq!(
            node_urls("redlock://a:1,b:2,c:3/2?turnstile_prefix=x").unwrap(),
            vec![
                "redis://a:1/2?turnstile_prefix=x",
                "redis://b:2/2?turnstile_prefix=x",
                "redis://c:3/2?turnstile_prefix=x"
            ]
        );
        assert_eq!(
            node_urls("redlock://u:p@a:1,b:2,c:3").unwrap()[1],
            "redis://u:p@b:2"
        );
        for bad in [
            "redlock://a:1,b:2",
            "redlock://a:1",
            "redis://a:1,b:2,c:3",
            "redlock://",
        ] {
            assert_eq!(
                node_urls(bad).unwrap_err().kind(),
                ErrorKind::InvalidUrl,
                "{bad}"
            );
        }
    }
}
