//! The etcd side of `turnstile bench lock`: a counter in etcd for the contended phase,
//! and `--raw`: etcd's own lock RPC (the `v3lock` service, which queues waiters in the
//! server), the peer the library is measured against; and `--raw-writes`: only the
//! writes a section needs (a put to take, a delete to give back) with the exclusion
//! done in the process, the floor of what the store itself costs per section.

use std::time::Duration;

use etcd_client::{Client, LockOptions};

/// The etcd client for `etcd://host:port[,…]`.
pub(crate) async fn connect(url: &str) -> Result<Client, String> {
    let hosts = url
        .strip_prefix("etcd://")
        .map(|rest| rest.split(['?', '/']).next().unwrap_or_default())
        .ok_or_else(|| format!("{url:?} is not an etcd URL"))?;
    let endpoints: Vec<String> = hosts
        .split(',')
        .map(|host| format!("http://{host}"))
        .collect();
    Client::connect(&endpoints, None)
        .await
        .map_err(|error| error.to_string())
}

/// A counter kept in one etcd key (two round trips per increment, like the others).
pub(crate) struct EtcdCounter {
    pub(crate) client: Client,
    pub(crate) key: String,
}

impl EtcdCounter {
    pub(crate) async fn get(&self) -> Result<i64, String> {
        let response = self
            .client
            .clone()
            .get(self.key.as_str(), None)
            .await
            .map_err(|error| error.to_string())?;
        Ok(response
            .kvs()
            .first()
            .and_then(|kv| kv.value_str().ok())
            .and_then(|text| text.parse().ok())
            .unwrap_or(0))
    }

    pub(crate) async fn set(&self, value: i64) -> Result<(), String> {
        self.client
            .clone()
            .put(self.key.as_str(), value.to_string(), None)
            .await
            .map(|_| ())
            .map_err(|error| error.to_string())
    }
}

/// A lock taken with etcd's lock RPC: its key and its lease.
pub(crate) struct RawEtcdHeld {
    key: Vec<u8>,
    lease: i64,
}

/// Takes `name` with etcd's lock RPC on a lease of `ttl` (whole seconds), waiting in
/// the server's queue up to `wait`.
pub(crate) async fn raw_acquire(
    client: &Client,
    name: &str,
    ttl: Duration,
    wait: Duration,
) -> Result<Option<RawEtcdHeld>, String> {
    let mut client = client.clone();
    let seconds = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
    let lease = client
        .lease_grant(seconds, None)
        .await
        .map_err(|error| error.to_string())?
        .id();
    match tokio::time::timeout(
        wait,
        client.lock(
            format!("raw/{name}"),
            Some(LockOptions::new().with_lease(lease)),
        ),
    )
    .await
    {
        Ok(Ok(response)) => Ok(Some(RawEtcdHeld {
            key: response.key().to_vec(),
            lease,
        })),
        Ok(Err(error)) => {
            let _ = client.lease_revoke(lease).await;
            Err(error.to_string())
        }
        Err(_) => {
            let _ = client.lease_revoke(lease).await;
            Ok(None)
        }
    }
}

/// Unlocks and revokes the lease.
pub(crate) async fn raw_release(client: &Client, held: RawEtcdHeld) -> Result<(), String> {
    let mut client = client.clone();
    client
        .unlock(held.key)
        .await
        .map_err(|error| error.to_string())?;
    client
        .lease_revoke(held.lease)
        .await
        .map(|_| ())
        .map_err(|error| error.to_string())
}

/// The writes-only floor: one local FIFO mutex stands in for the lock (every worker of
/// the benchmark is in this process), and each section costs the store a put of the
/// lock's key and a delete of it, as the lightest lock over etcd would.
pub(crate) struct EtcdWrites {
    client: Client,
    prefix: String,
    local: std::sync::Arc<tokio::sync::Mutex<()>>,
}

/// A section of the writes-only floor: its key and the local mutex.
pub(crate) struct EtcdWritesHeld {
    key: String,
    _section: tokio::sync::OwnedMutexGuard<()>,
}

impl EtcdWrites {
    pub(crate) fn new(client: Client, run: &str) -> Self {
        EtcdWrites {
            client,
            prefix: format!("{run}:writes/"),
            local: std::sync::Arc::default(),
        }
    }

    /// Waits (in line, in this process) up to `wait` for the section, then puts its key.
    pub(crate) async fn acquire(
        &self,
        name: &str,
        wait: Duration,
    ) -> Result<Option<EtcdWritesHeld>, String> {
        let Ok(section) =
            tokio::time::timeout(wait, std::sync::Arc::clone(&self.local).lock_owned()).await
        else {
            return Ok(None);
        };
        let key = format!("{}{name}", self.prefix);
        self.client
            .clone()
            .put(key.as_str(), "held", None)
            .await
            .map_err(|error| error.to_string())?;
        Ok(Some(EtcdWritesHeld {
            key,
            _section: section,
        }))
    }

    /// Deletes the key, then lets the next section in.
    pub(crate) async fn release(&self, held: EtcdWritesHeld) -> Result<(), String> {
        self.client
            .clone()
            .delete(held.key.as_str(), None)
            .await
            .map(|_| ())
            .map_err(|error| error.to_string())
    }
}
