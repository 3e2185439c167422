//! The ZooKeeper side of `turnstile bench lock`: a counter in a znode for the
//! contended phase, and `--raw`: the zookeeper-client crate's own lock recipe (Curator's
//! layout: an ephemeral sequential node per contender, each waiting on its predecessor),
//! the peer the library is measured against.

use std::time::Duration;

use zookeeper_client as zk;

/// The connect string of `zk://host:port[,…][/path]`, and the path (`/turnstile-bench`
/// by default) under which the raw recipe and the counter keep their nodes.
fn parse(url: &str) -> Result<(String, String), String> {
    let rest = url
        .strip_prefix("zk://")
        .or_else(|| url.strip_prefix("zookeeper://"))
        .ok_or_else(|| format!("{url:?} is not a ZooKeeper URL"))?;
    let rest = rest.split('?').next().unwrap_or_default();
    Ok(match rest.split_once('/') {
        Some((hosts, path)) if !path.is_empty() => (hosts.to_owned(), format!("/{path}")),
        Some((hosts, _)) => (hosts.to_owned(), "/turnstile-bench".to_owned()),
        None => (rest.to_owned(), "/turnstile-bench".to_owned()),
    })
}

/// A ZooKeeper session (30 s) for `url`, and the path its nodes go under.
pub(crate) async fn connect(url: &str) -> Result<(zk::Client, String), String> {
    let (hosts, path) = parse(url)?;
    let client = tokio::time::timeout(
        Duration::from_secs(5),
        zk::Client::connector()
            .with_session_timeout(Duration::from_secs(30))
            .connect(&hosts),
    )
    .await
    .map_err(|_| format!("cannot reach ZooKeeper at {hosts} in 5 s"))?
    .map_err(|error| error.to_string())?;
    let directory = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
    client
        .mkdir(&path, &directory)
        .await
        .map_err(|error| error.to_string())?;
    Ok((client, path))
}

/// A counter kept in one znode's data (two round trips per increment, like the others).
pub(crate) struct ZooKeeperCounter {
    pub(crate) client: zk::Client,
    pub(crate) path: String,
    /// Where the raw recipe's lock directories go.
    pub(crate) directory: String,
}

impl ZooKeeperCounter {
    pub(crate) async fn get(&self) -> Result<i64, String> {
        match self.client.get_data(&self.path).await {
            Ok((data, _)) => Ok(String::from_utf8_lossy(&data).parse().unwrap_or(0)),
            Err(zk::Error::NoNode) => Ok(0),
            Err(error) => Err(error.to_string()),
        }
    }

    pub(crate) async fn set(&self, value: i64) -> Result<(), String> {
        let data = value.to_string();
        match self
            .client
            .set_data(&self.path, data.as_bytes(), None)
            .await
        {
            Ok(_) => Ok(()),
            Err(zk::Error::NoNode) => {
                let options = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
                self.client
                    .create(&self.path, data.as_bytes(), &options)
                    .await
                    .map(|_| ())
                    .map_err(|error| error.to_string())
            }
            Err(error) => Err(error.to_string()),
        }
    }
}

/// A lock taken with the recipe.
pub(crate) struct RawZooKeeperHeld(zk::OwnedLockClient);

/// Takes `name` with the zookeeper-client recipe, waiting on the predecessor up to
/// `wait` (the recipe's future is cancellation safe: a timed-out contender's node goes).
pub(crate) async fn raw_acquire(
    client: &zk::Client,
    path: &str,
    name: &str,
    wait: Duration,
) -> Result<Option<RawZooKeeperHeld>, String> {
    let dir = format!("{path}/raw-{name}");
    let prefix = zk::LockPrefix::new_curator(&dir, "lock-").map_err(|error| error.to_string())?;
    let options = zk::LockOptions::new(zk::Acls::anyone_all())
        .with_ancestor_options(zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all()))
        .map_err(|error| error.to_string())?;
    match tokio::time::timeout(wait, client.lock(prefix, b"", options)).await {
        Ok(Ok(held)) => Ok(Some(RawZooKeeperHeld(held.into_owned()))),
        Ok(Err(error)) => Err(error.to_string()),
        Err(_) => Ok(None),
    }
}

/// Deletes the lock node and waits for the answer, as the library's release does.
pub(crate) async fn raw_release(held: RawZooKeeperHeld) -> Result<(), String> {
    let result = held
        .0
        .delete(held.0.lock_path(), None)
        .await
        .map_err(|error| error.to_string());
    // Dropping the recipe's handle would delete the node again in the background (one
    // more request per cycle for this peer): the handle is forgotten instead, leaking
    // its path string.
    std::mem::forget(held);
    result
}
