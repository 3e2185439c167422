//! Locks in ZooKeeper (`zk://host:port[,host:port…][/path]`, feature `zookeeper`).
//!
//! Each acquisition is an **ephemeral sequential node** `{path}/{name}/{owner}-{sequence}`
//! (`path` is `/turnstile` unless the URL gives one; the name is escaped into one path
//! component). The node with the lowest sequence holds the lock. The owner id in the
//! node's name is the acquisition's own random id, so an acquisition whose create reply
//! was lost (a dropped connection) finds its node again by name rather than leaving it
//! behind. The create and the listing of the name's nodes go out together (ZooKeeper
//! answers one session's requests in order), so an acquisition is one round trip; one
//! that does not come first deletes its node again and answers "held": waiting is the
//! lock core's, not a queue in ZooKeeper.
//!
//! Nodes live on a **session** of this client: one per whole-second TTL in use, whose
//! timeout is that TTL rounded up. The name's directory is a container node, which
//! ZooKeeper removes by itself once it has been empty for a while, so nothing needs
//! pruning.
//!
//! # Guarantees
//! - **Atomicity and order**: ZooKeeper's atomic broadcast; the ensemble gives
//!   sequence numbers in order, and every session sees its own requests answered in
//!   the order it sent them.
//! - **Fencing tokens**: the holder node's creation zxid (`czxid`): ZooKeeper's
//!   transaction id, which grows with every write to the ensemble and across restarts
//!   and leader elections (the epoch is its high 32 bits).
//! - **Expiry of a crashed or cut-off holder**: its session, by the ZooKeeper
//!   leader's clock: the node goes when the session has not been heard from for its
//!   timeout (the TTL rounded up to whole seconds, or the server's
//!   `minSessionTimeout` if that is longer). A holder that is alive but stops renewing
//!   a lock (no watchdog, or past its deadline) has its node deleted by its own client
//!   at its deadline (within 100 ms), since its session lives on.
//! - **Sessions must outlast the TTL**: if the server grants a session shorter than
//!   the lock's TTL (its `maxSessionTimeout` is lower), the acquire fails with
//!   [`ErrorKind::InvalidOptions`]: a holder cut off from the ensemble would otherwise
//!   lose its node to session expiry before its local deadline.
//! - **Suspended connection** (the client lost its server; the session may still be
//!   alive): requests fail, so renewals fail and the guard keeps the lock only until its
//!   local validity deadline, when the lost signal fires with
//!   [`LossReason::RenewalFailed`]. A session that ZooKeeper expired meanwhile has lost
//!   its nodes: the next renewal that gets through reports [`LossReason::Expired`]. The
//!   session timeout is at least the TTL, so the node cannot vanish before the deadline.
//! - **Partition / leader change**: a holder cut off from a quorum cannot renew and
//!   stops at its local deadline; its session (and node) outlives that deadline on the
//!   ensemble, since the session timeout is at least the TTL.
//! - **Waiting**: a waiter watches the name's nodes (one persistent recursive watch) and
//!   is woken only when the node that was first goes (a release, an expired session, a
//!   break), not when another waiter withdraws; it also re-checks with a backoff from
//!   50 ms to 500 ms in case a notification is lost (ZooKeeper may drop events during a
//!   reconnection: a reconnection wakes waiters too).
//! - **Breaking** a lock deletes the holder's node; the holder's session and its other
//!   locks stay.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use zookeeper_client as zk;

use super::{
    BoxFuture, ExtendOutcome, HolderAndValue, LockBackend, LockInfo, LockName, LossReason, OwnerId,
    ReleaseOutcome, ReleaseWatch, TryAcquire,
};
use crate::error::{Error, ErrorKind, Result};
use crate::fence::FencingToken;

/// How often this client looks for its own nodes whose deadline passed.
const DEADLINE_CHECK_EVERY: Duration = Duration::from_millis(100);

/// How long connecting a session may take before the store counts as unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The session timeout of the session opened at connect, used for reads.
const FIRST_SESSION_SECS: u64 = 30;

/// How often an acquisition tries again when the name's directory vanished under it
/// (an empty container node that ZooKeeper removed just then).
const DIRECTORY_ATTEMPTS: usize = 5;

/// How many lock directories a store remembers as existing before it starts over (a
/// forgotten one costs a directory create, which fails harmlessly, on its next use).
const KNOWN_DIRECTORIES: usize = 4096;

/// Ends a watch's task when the watch is dropped.
struct WatchTask(tokio::task::JoinHandle<()>);

impl Drop for WatchTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn locked<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn failed(what: &str) -> impl Fn(zk::Error) -> Error + '_ {
    move |error| {
        let kind = match error {
            zk::Error::ConnectionLoss
            | zk::Error::SessionExpired
            | zk::Error::Timeout
            | zk::Error::NoHosts
            | zk::Error::ClientClosed
            | zk::Error::Throttled => ErrorKind::StoreUnavailable,
            _ => ErrorKind::Store,
        };
        Error::new(kind, format!("{what}: {error}"))
    }
}

/// A node under a name's directory: `{owner}-{sequence}`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Node {
    sequence: i64,
    owner: String,
}

impl Node {
    fn parse(child: &str) -> Option<Node> {
        let (owner, sequence) = child.rsplit_once('-')?;
        Some(Node {
            sequence: sequence.parse().ok()?,
            owner: owner.to_owned(),
        })
    }

    /// The node's name under its directory, as ZooKeeper wrote it (ten digits, or
    /// nineteen past `i32::MAX`).
    fn child(&self) -> String {
        if self.sequence <= i64::from(i32::MAX) {
            format!("{}-{:010}", self.owner, self.sequence)
        } else {
            format!("{}-{:019}", self.owner, self.sequence)
        }
    }
}

/// A name's nodes, lowest sequence first (children that are not ours are ignored).
fn in_line(children: &[String]) -> Vec<Node> {
    let mut nodes: Vec<Node> = children.iter().filter_map(|c| Node::parse(c)).collect();
    nodes.sort();
    nodes
}

/// A lock name as one path component: ASCII letters, digits and `_.:@+=,-` stay, every
/// other byte is `%HH` (so `/`, `%` and characters ZooKeeper refuses in paths cannot
/// reach it); `.` and `..` alone are escaped too.
fn path_component(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for byte in name.bytes() {
        if byte.is_ascii_alphanumeric() || b"_.:@+=,-".contains(&byte) {
            out.push(char::from(byte));
        } else {
            out.push('%');
            crate::hex::push_hex(&mut out, &[byte]);
        }
    }
    if out == "." || out == ".." {
        out = out.replace('.', "%2e");
    }
    out
}

fn token(stat: &zk::Stat) -> FencingToken {
    FencingToken::new(u64::try_from(stat.czxid).unwrap_or(0))
}

/// A node of this client's in a name's line: where it is, and its creation zxid (the
/// fencing token it holds the lock with once it is first).
#[derive(Debug, Clone)]
struct Placed {
    node: Node,
    path: String,
    token: FencingToken,
}

fn ephemeral_sequential() -> zk::CreateOptions<'static> {
    zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all())
}

struct Inner {
    /// The connect string: `host:port[,host:port…]`.
    hosts: String,
    /// Where lock directories live (`/turnstile` by default).
    base: String,
    url: String,
    /// The sessions, by their timeout in whole seconds.
    sessions: tokio::sync::Mutex<HashMap<u64, zk::Client>>,
    /// The session used last: reads and deletions go there.
    last: Mutex<zk::Client>,
    /// The node each acquisition of this client holds or waits with, by directory and
    /// owner.
    nodes: Mutex<HashMap<(String, String), Placed>>,
    /// When each node this client holds stops being trusted without a renewal (sent +
    /// TTL). The session outlives every lock's TTL, so past its deadline a node is this
    /// client's to delete.
    deadlines: Mutex<HashMap<String, Instant>>,
    /// Lock directories this client saw exist: an acquisition under any other sends the
    /// directory's create ahead of its node's.
    known_directories: Mutex<HashSet<String>>,
}

/// Locks in ZooKeeper.
#[derive(Clone)]
pub struct ZooKeeperLockStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ZooKeeperLockStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZooKeeperLockStore")
            .field("url", &self.inner.url)
            .finish()
    }
}

/// Opens a session with a timeout of `secs` seconds (ZooKeeper may grant another).
async fn open_session(hosts: &str, secs: u64) -> Result<zk::Client> {
    let connecting = zk::Client::connector()
        .with_session_timeout(Duration::from_secs(secs))
        .with_connection_timeout(Duration::from_secs(3))
        .connect(hosts);
    match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(error)) => Err(failed(&format!("cannot connect to ZooKeeper at {hosts}"))(
            error,
        )),
        Err(_) => Err(Error::new(
            ErrorKind::StoreUnavailable,
            format!("cannot connect to ZooKeeper at {hosts}: no answer within {CONNECT_TIMEOUT:?}"),
        )),
    }
}

/// Deletes this client's nodes whose deadline passed without a renewal; ends with the
/// store.
async fn delete_overdue(inner: Weak<Inner>) {
    loop {
        tokio::time::sleep(DEADLINE_CHECK_EVERY).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let now = Instant::now();
        let overdue: Vec<String> = locked(&inner.deadlines)
            .iter()
            .filter(|(_, deadline)| now >= **deadline)
            .map(|(path, _)| path.clone())
            .collect();
        if overdue.is_empty() {
            continue;
        }
        let client = inner.last();
        for path in overdue {
            match client.delete(&path, None).await {
                // Gone already (a release, a break, an expired session) counts as done.
                Ok(()) | Err(zk::Error::NoNode) => {
                    let mut deadlines = locked(&inner.deadlines);
                    if deadlines
                        .get(&path)
                        .is_some_and(|deadline| now >= *deadline)
                    {
                        deadlines.remove(&path);
                    }
                }
                // Tried again at the next check.
                Err(_) => {}
            }
        }
    }
}

impl Inner {
    fn last(&self) -> zk::Client {
        locked(&self.last).clone()
    }

    fn dir(&self, name: &LockName) -> String {
        format!("{}/{}", self.base, path_component(name.as_str()))
    }

    fn overdue(&self, path: &str) -> bool {
        locked(&self.deadlines)
            .get(path)
            .is_some_and(|deadline| Instant::now() >= *deadline)
    }
}

impl ZooKeeperLockStore {
    /// Connects to the servers of `zk://host:port[,host:port…][/path]`; lock nodes live
    /// under `/path` (`/turnstile` by default), which is created as needed.
    pub async fn connect(url: &str) -> Result<Self> {
        let (base_url, options) = crate::url::split_url_options(url);
        if let Some((key, value)) = options.first() {
            return Err(crate::url::unknown_option(key, value, "none"));
        }
        let invalid = || {
            Error::new(
                ErrorKind::InvalidUrl,
                format!("{url:?} is not a ZooKeeper URL (zk://host:port[,host:port…][/path])"),
            )
        };
        let rest = base_url
            .strip_prefix("zk://")
            .or_else(|| base_url.strip_prefix("zookeeper://"))
            .ok_or_else(invalid)?;
        let (hosts, path) = match rest.split_once('/') {
            Some((hosts, path)) => (hosts, path.trim_end_matches('/')),
            None => (rest, ""),
        };
        if hosts.is_empty()
            || hosts.contains('@')
            || hosts.split(',').any(|host| {
                host.rsplit_once(':')
                    .is_none_or(|(host, port)| host.is_empty() || port.parse::<u16>().is_err())
            })
        {
            return Err(invalid());
        }
        let base = if path.is_empty() {
            "/turnstile".to_owned()
        } else {
            if path
                .split('/')
                .any(|part| part.is_empty() || part == "." || part == "..")
            {
                return Err(Error::new(
                    ErrorKind::InvalidUrl,
                    format!("{url:?}: the path must be /a/b/c, with no empty, . or .. parts"),
                ));
            }
            format!("/{path}")
        };
        let first = open_session(hosts, FIRST_SESSION_SECS).await?;
        let mut sessions = HashMap::new();
        sessions.insert(FIRST_SESSION_SECS, first.clone());
        let inner = Arc::new(Inner {
            hosts: hosts.to_owned(),
            url: format!("zk://{hosts}{}", if path.is_empty() { "" } else { &base }),
            base,
            sessions: tokio::sync::Mutex::new(sessions),
            last: Mutex::new(first),
            nodes: Mutex::default(),
            deadlines: Mutex::default(),
            known_directories: Mutex::default(),
        });
        tokio::spawn(delete_overdue(Arc::downgrade(&inner)));
        Ok(ZooKeeperLockStore { inner })
    }

    /// The live session for locks of `ttl` (opened now if there is none, or the last one
    /// expired).
    async fn session(&self, ttl: Duration) -> Result<zk::Client> {
        let secs = u64::try_from(ttl.as_millis().div_ceil(1000))
            .unwrap_or(u64::MAX)
            .max(1);
        let mut sessions = self.inner.sessions.lock().await;
        let client = match sessions.get(&secs) {
            Some(client) if !client.state().is_terminated() => client.clone(),
            _ => {
                let client = open_session(&self.inner.hosts, secs).await?;
                sessions.insert(secs, client.clone());
                client
            }
        };
        drop(sessions);
        if client.session_timeout() < ttl {
            return Err(Error::new(
                ErrorKind::InvalidOptions,
                format!(
                    "ZooKeeper at {} grants sessions of at most {:?} (its maxSessionTimeout), \
                     shorter than the lock's TTL of {ttl:?}: a holder cut off from the \
                     ensemble would lose its node before its deadline; use a shorter TTL \
                     or raise maxSessionTimeout",
                    self.inner.hosts,
                    client.session_timeout()
                ),
            ));
        }
        *locked(&self.inner.last) = client.clone();
        Ok(client)
    }

    /// A live session for reads and deletions.
    async fn reader(&self) -> Result<zk::Client> {
        let last = self.inner.last();
        if !last.state().is_terminated() {
            return Ok(last);
        }
        self.session(Duration::from_secs(FIRST_SESSION_SECS)).await
    }

    /// The name's nodes, lowest sequence first (none if the directory is gone).
    async fn nodes(&self, client: &zk::Client, dir: &str) -> Result<Vec<Node>> {
        match client.list_children(dir).await {
            Ok(children) => Ok(in_line(&children)),
            Err(zk::Error::NoNode) => Ok(Vec::new()),
            Err(error) => Err(failed("cannot list the lock's nodes")(error)),
        }
    }

    /// Deletes nodes, best effort (a node that stays behind is not first, or its
    /// session takes it).
    async fn delete_all(client: &zk::Client, dir: &str, nodes: &[&Node]) {
        let deletions = nodes
            .iter()
            .map(|node| client.delete(&format!("{dir}/{}", node.child()), None))
            .collect::<Vec<_>>();
        for deletion in deletions {
            let _ = deletion.await;
        }
    }

    async fn info(&self, client: &zk::Client, dir: &str, node: &Node) -> Result<Option<LockInfo>> {
        match client
            .check_stat(&format!("{dir}/{}", node.child()))
            .await
            .map_err(failed("cannot read the lock's node"))?
        {
            Some(stat) => Ok(Some(LockInfo {
                owner: node.owner.clone(),
                fencing_token: Some(token(&stat)),
                remaining_ttl: None,
            })),
            None => Ok(None),
        }
    }

    fn placed(&self, dir: &str, owner: &str) -> Option<Placed> {
        locked(&self.inner.nodes)
            .get(&(dir.to_owned(), owner.to_owned()))
            .cloned()
    }

    fn forget(&self, dir: &str, owner: &str) -> Option<Placed> {
        let placed = locked(&self.inner.nodes).remove(&(dir.to_owned(), owner.to_owned()));
        if let Some(placed) = &placed {
            locked(&self.inner.deadlines).remove(&placed.path);
        }
        placed
    }

    /// Decides an acquisition from our node `mine` (just created, or already waiting in
    /// line) and a listing sent after it: our oldest node in line is our place (a later
    /// one of ours, from a create whose reply was lost, goes); it holds the lock if it
    /// is first, and otherwise stays in line. `None` when our node is no longer there (its
    /// session expired, or the lock was broken): the caller creates another.
    async fn settle(
        &self,
        client: &zk::Client,
        dir: &str,
        mine: Placed,
        listed: std::result::Result<Vec<String>, zk::Error>,
        deadline: Instant,
    ) -> Result<Option<TryAcquire>> {
        let owner = mine.node.owner.clone();
        let nodes = match listed {
            Ok(children) => in_line(&children),
            Err(zk::Error::NoNode) => Vec::new(),
            Err(error) => {
                // Our node stays known, so that a release (the lock core's, when it
                // stops waiting) finds and deletes it.
                locked(&self.inner.nodes).insert((dir.to_owned(), owner), mine);
                return Err(failed("cannot list the lock's nodes")(error));
            }
        };
        let ours: Vec<&Node> = nodes.iter().filter(|node| node.owner == owner).collect();
        let Some(oldest) = ours.first().copied() else {
            self.forget(dir, &owner);
            return Ok(None);
        };
        Self::delete_all(client, dir, &ours[1..]).await;
        let placed = if *oldest == mine.node {
            mine
        } else {
            // Every ZooKeeper holder has a token: its node's creation zxid.
            match self.info(client, dir, oldest).await? {
                Some(LockInfo {
                    fencing_token: Some(token),
                    ..
                }) => Placed {
                    node: oldest.clone(),
                    path: format!("{dir}/{}", oldest.child()),
                    token,
                },
                _ => {
                    self.forget(dir, &owner);
                    return Ok(None);
                }
            }
        };
        let first = nodes.first() == Some(oldest);
        if first {
            locked(&self.inner.deadlines).insert(placed.path.clone(), deadline);
        }
        let token = placed.token;
        locked(&self.inner.nodes).insert((dir.to_owned(), owner), placed);
        Ok(Some(if first {
            TryAcquire::Acquired { token }
        } else {
            TryAcquire::Held {
                remaining_ttl: None,
            }
        }))
    }

    /// Creates a node for `owner` at the back of the line (and the name's directory if
    /// it is missing), and settles the acquisition with a listing sent right behind it.
    async fn join_line(
        &self,
        client: &zk::Client,
        dir: &str,
        owner: &str,
        deadline: Instant,
    ) -> Result<TryAcquire> {
        let prefix = format!("{dir}/{owner}-");
        let container = zk::CreateMode::Container.with_acls(zk::Acls::anyone_all());
        // A directory not known to exist (a name's first use by this client) is created
        // in the same pipeline as the node, ahead of it, so that a new name costs one
        // round of writes that ZooKeeper syncs together, not three one after another (a
        // create that fails for the missing directory, the directory, the create again).
        // Its create failing because the directory exists is harmless.
        let mut send_directory = !locked(&self.inner.known_directories).contains(dir);
        for _ in 0..DIRECTORY_ATTEMPTS {
            // Each request leaves when it is called, so in this order: the directory
            // before our node, and the listing after it sees our node.
            let directory = send_directory.then(|| client.create(dir, &[], &container));
            let directory = async {
                if let Some(directory) = directory {
                    let _ = directory.await;
                }
            };
            let create = client.create(&prefix, owner.as_bytes(), &ephemeral_sequential());
            let list = client.list_children(dir);
            let ((), created, listed) = tokio::join!(directory, create, list);
            let (stat, sequence) = match created {
                Ok(created) => created,
                // Known, but ZooKeeper removed it since (an empty container goes).
                Err(zk::Error::NoNode) if !send_directory => {
                    locked(&self.inner.known_directories).remove(dir);
                    send_directory = true;
                    continue;
                }
                // Its create failed: ask again on its own, for the reason.
                Err(zk::Error::NoNode) => {
                    client
                        .mkdir(dir, &container)
                        .await
                        .map_err(failed("cannot create the lock's directory"))?;
                    continue;
                }
                Err(error) => return Err(failed("cannot create the lock's node")(error)),
            };
            if send_directory {
                let mut known = locked(&self.inner.known_directories);
                if known.len() >= KNOWN_DIRECTORIES {
                    known.clear();
                }
                known.insert(dir.to_owned());
            }
            let node = Node {
                sequence: sequence.into_i64(),
                owner: owner.to_owned(),
            };
            let mine = Placed {
                path: format!("{dir}/{}", node.child()),
                node,
                token: token(&stat),
            };
            if let Some(answer) = self.settle(client, dir, mine, listed, deadline).await? {
                return Ok(answer);
            }
        }
        Err(Error::new(
            ErrorKind::Store,
            format!("the lock's directory {dir} kept vanishing while creating a node in it"),
        ))
    }
}

impl LockBackend for ZooKeeperLockStore {
    fn try_acquire<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<TryAcquire>> {
        Box::pin(async move {
            let sent = Instant::now();
            let client = self.session(ttl).await?;
            let dir = self.inner.dir(name);
            let owner_hex = owner.to_string();
            // Already in line (waiting, or holding and asking again): a read tells.
            if let Some(mine) = self.placed(&dir, &owner_hex) {
                let listed = client.list_children(&dir).await;
                if let Some(answer) = self.settle(&client, &dir, mine, listed, sent + ttl).await? {
                    return Ok(answer);
                }
            }
            self.join_line(&client, &dir, &owner_hex, sent + ttl).await
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
            let dir = self.inner.dir(name);
            let owner_hex = owner.to_string();
            if let Some(mine) = self.placed(&dir, &owner_hex)
                && self.inner.overdue(&mine.path)
            {
                // Past this client's TTL: the lock is not ours to renew any more.
                let _ = self.reader().await?.delete(&mine.path, None).await;
                self.forget(&dir, &owner_hex);
                return Ok(ExtendOutcome::Lost(LossReason::Expired));
            }
            // The session for this TTL must be alive (the node's own session, unless it
            // expired and took the node with it).
            let client = self.session(ttl).await?;
            let nodes = self.nodes(&client, &dir).await?;
            match nodes.first() {
                Some(first) if first.owner == owner_hex => {
                    let path = format!("{dir}/{}", first.child());
                    locked(&self.inner.deadlines).insert(path, sent + ttl);
                    Ok(ExtendOutcome::Extended)
                }
                first => {
                    self.forget(&dir, &owner_hex);
                    Ok(ExtendOutcome::from_answers(false, first.is_some()))
                }
            }
        })
    }

    /// Also what the lock core calls for an owner that stops waiting: its node leaves
    /// the line (answering `HeldByOther`, or `AlreadyExpired` if the line is empty).
    fn release<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
    ) -> BoxFuture<'a, Result<ReleaseOutcome>> {
        Box::pin(async move {
            let dir = self.inner.dir(name);
            let owner_hex = owner.to_string();
            let known = self.placed(&dir, &owner_hex);
            let overdue = known
                .as_ref()
                .is_some_and(|mine| self.inner.overdue(&mine.path));
            self.forget(&dir, &owner_hex);
            // Until the delete is answered, the node is the background task's to
            // delete: a release whose delete fails (the connection is suspended) or is
            // cut short by its caller must not leave the node in line on a session this
            // client keeps alive, where it would hold the lock for good once first.
            if let Some(mine) = &known {
                locked(&self.inner.deadlines).insert(mine.path.clone(), Instant::now());
            }
            let client = self.reader().await?;
            let nodes = match &known {
                // The listing (as it was before) and the delete leave together.
                Some(mine) => {
                    let list = client.list_children(&dir);
                    let delete = client.delete(&mine.path, None);
                    let (listed, deleted) = tokio::join!(list, delete);
                    if matches!(deleted, Ok(()) | Err(zk::Error::NoNode)) {
                        locked(&self.inner.deadlines).remove(&mine.path);
                    }
                    match listed {
                        Ok(children) => in_line(&children),
                        Err(zk::Error::NoNode) => Vec::new(),
                        // The session that held the node ended, and the node with it: who
                        // holds the lock now is read through a new session.
                        Err(zk::Error::SessionExpired) => {
                            let fresh = self
                                .session(Duration::from_secs(FIRST_SESSION_SECS))
                                .await?;
                            self.nodes(&fresh, &dir).await?
                        }
                        Err(error) => return Err(failed("cannot release the lock")(error)),
                    }
                }
                None => self.nodes(&client, &dir).await?,
            };
            let ours: Vec<&Node> = nodes
                .iter()
                .filter(|node| node.owner == owner_hex)
                .collect();
            // Nodes of ours this client did not know of (a create whose reply was lost).
            let unknown: Vec<&Node> = ours
                .iter()
                .copied()
                .filter(|node| known.as_ref().is_none_or(|mine| mine.node != **node))
                .collect();
            Self::delete_all(&client, &dir, &unknown).await;
            let first_is_ours = nodes.first().is_some_and(|first| first.owner == owner_hex);
            Ok(match (first_is_ours, overdue, nodes.is_empty()) {
                (true, false, _) => ReleaseOutcome::Released,
                // Our TTL had passed: whatever ZooKeeper still kept was no longer a lock.
                (true, true, _) | (false, _, true) => ReleaseOutcome::AlreadyExpired,
                (false, _, false) => ReleaseOutcome::HeldByOther,
            })
        })
    }

    fn inspect<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<LockInfo>>> {
        Box::pin(async move {
            let client = self.reader().await?;
            let dir = self.inner.dir(name);
            let nodes = self.nodes(&client, &dir).await?;
            match nodes.first() {
                Some(first) => self.info(&client, &dir, first).await,
                None => Ok(None),
            }
        })
    }

    /// Writes the value into the holder's own node, after its owner id. A node first in
    /// line stays first until it is deleted, and a deleted node cannot be written, so
    /// the write applies only while the lock is held.
    fn proclaim<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        value: &'a str,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let client = self.reader().await?;
            let dir = self.inner.dir(name);
            let owner_hex = owner.to_string();
            let nodes = self.nodes(&client, &dir).await?;
            let Some(first) = nodes.first().filter(|first| first.owner == owner_hex) else {
                return Ok(false);
            };
            let data = format!("{owner_hex}\u{1f}{value}");
            match client
                .set_data(&format!("{dir}/{}", first.child()), data.as_bytes(), None)
                .await
            {
                Ok(_) => Ok(true),
                Err(zk::Error::NoNode) => Ok(false),
                Err(error) => Err(failed("cannot store the holder's value")(error)),
            }
        })
    }

    fn inspect_with_value<'a>(
        &'a self,
        name: &'a LockName,
    ) -> BoxFuture<'a, Result<Option<HolderAndValue>>> {
        Box::pin(async move {
            let client = self.reader().await?;
            let dir = self.inner.dir(name);
            let nodes = self.nodes(&client, &dir).await?;
            let Some(first) = nodes.first() else {
                return Ok(None);
            };
            match client.get_data(&format!("{dir}/{}", first.child())).await {
                Ok((data, stat)) => {
                    let data = String::from_utf8_lossy(&data);
                    let value = data.split_once('\u{1f}').map(|(_, value)| value.to_owned());
                    let info = LockInfo {
                        owner: first.owner.clone(),
                        fencing_token: Some(token(&stat)),
                        remaining_ttl: None,
                    };
                    Ok(Some((info, value)))
                }
                // Released between the listing and the read.
                Err(zk::Error::NoNode) => Ok(None),
                Err(error) => Err(failed("cannot read the lock's node")(error)),
            }
        })
    }

    fn keeps_holder_values(&self) -> bool {
        true
    }

    /// A persistent node `{path}/%permits/{name}` holding the number: no name's
    /// directory can be called `%permits` (a name's `%` is always escaped as `%25`).
    /// Creating it is the atomic step: of clients that race, one creates it and the
    /// others read what it wrote.
    fn declare_permits<'a>(
        &'a self,
        name: &'a LockName,
        permits: u32,
    ) -> BoxFuture<'a, Result<u32>> {
        Box::pin(async move {
            let client = self.reader().await?;
            let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
            let parent = format!("{}/%permits", self.inner.base);
            // The base path and this node, each created unless it is there.
            let mut path_so_far = String::new();
            for part in parent.split('/').filter(|part| !part.is_empty()) {
                path_so_far.push('/');
                path_so_far.push_str(part);
                match client.create(&path_so_far, &[], &persistent).await {
                    Ok(_) | Err(zk::Error::NodeExists) => {}
                    Err(error) => {
                        return Err(failed("cannot create the semaphores' node")(error));
                    }
                }
            }
            let path = format!("{parent}/{}", path_component(name.as_str()));
            let text = permits.to_string();
            match client.create(&path, text.as_bytes(), &persistent).await {
                Ok(_) => return Ok(permits),
                Err(zk::Error::NodeExists) => {}
                Err(error) => {
                    return Err(failed("cannot declare the semaphore's permits")(error));
                }
            }
            let (data, _) = client
                .get_data(&path)
                .await
                .map_err(failed("cannot read the semaphore's permits"))?;
            let stored = String::from_utf8_lossy(&data);
            stored.parse().map_err(|_| {
                Error::new(
                    ErrorKind::Store,
                    format!("the semaphore's node {path} holds {stored:?}, not a number"),
                )
            })
        })
    }

    fn stored_permits<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<u32>>> {
        Box::pin(async move {
            let client = self.reader().await?;
            let path = format!(
                "{}/%permits/{}",
                self.inner.base,
                path_component(name.as_str())
            );
            match client.get_data(&path).await {
                Ok((data, _)) => Ok(String::from_utf8_lossy(&data).parse().ok()),
                Err(zk::Error::NoNode) => Ok(None),
                Err(error) => Err(failed("cannot read the semaphore's permits")(error)),
            }
        })
    }

    fn forget_permits<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<u32>>> {
        Box::pin(async move {
            let client = self.reader().await?;
            let path = format!(
                "{}/%permits/{}",
                self.inner.base,
                path_component(name.as_str())
            );
            let stored = match client.get_data(&path).await {
                Ok((data, _)) => String::from_utf8_lossy(&data).parse().ok(),
                Err(zk::Error::NoNode) => return Ok(None),
                Err(error) => return Err(failed("cannot read the semaphore's permits")(error)),
            };
            match client.delete(&path, None).await {
                Ok(()) | Err(zk::Error::NoNode) => Ok(stored),
                Err(error) => Err(failed("cannot forget the semaphore's permits")(error)),
            }
        })
    }

    fn force_release<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Option<LockInfo>>> {
        Box::pin(async move {
            let client = self.reader().await?;
            let dir = self.inner.dir(name);
            let nodes = self.nodes(&client, &dir).await?;
            let Some(first) = nodes.first() else {
                return Ok(None);
            };
            let info = self.info(&client, &dir, first).await?;
            // The node only: its session is the holder's, which may carry other locks.
            match client
                .delete(&format!("{dir}/{}", first.child()), None)
                .await
            {
                Ok(()) | Err(zk::Error::NoNode) => Ok(info),
                Err(error) => Err(failed("cannot delete the lock's node")(error)),
            }
        })
    }

    fn watch_releases<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<ReleaseWatch>> {
        Box::pin(async move {
            let client = self.reader().await?;
            let dir = self.inner.dir(name);
            let mut watcher = client
                .watch(&dir, zk::AddWatchMode::PersistentRecursive)
                .await
                .map_err(failed("cannot watch the lock"))?;
            // Listed after the watch is in place: events from then on update the line.
            let mut line: BTreeSet<i64> = self
                .nodes(&client, &dir)
                .await?
                .into_iter()
                .map(|node| node.sequence)
                .collect();
            let (sender, receiver) = tokio::sync::watch::channel(0_u64);
            let task = tokio::spawn(async move {
                let announce = || sender.send_modify(|count| *count = count.wrapping_add(1));
                let child_of_dir = |path: &str| {
                    path.strip_prefix(dir.as_str())
                        .and_then(|rest| rest.strip_prefix('/'))
                        .filter(|child| !child.contains('/'))
                        .and_then(Node::parse)
                };
                loop {
                    let event = watcher.changed().await;
                    match event.event_type {
                        zk::EventType::NodeCreated => {
                            if let Some(node) = child_of_dir(&event.path) {
                                line.insert(node.sequence);
                            }
                        }
                        zk::EventType::NodeDeleted => {
                            if let Some(node) = child_of_dir(&event.path) {
                                // Only the first node's going frees the lock; a waiter
                                // that withdraws its node wakes nobody.
                                let was_first =
                                    line.first().is_none_or(|first| node.sequence <= *first);
                                line.remove(&node.sequence);
                                if was_first {
                                    announce();
                                }
                            }
                        }
                        // A holder's new value, for observers of an election.
                        zk::EventType::NodeDataChanged if child_of_dir(&event.path).is_some() => {
                            announce();
                        }
                        zk::EventType::Session => {
                            if event.session_state.is_terminated() {
                                // The session is over (no more events can come, and
                                // the watcher must not be asked again): waiters check
                                // now and subscribe afresh.
                                return;
                            }
                            if event.session_state == zk::SessionState::SyncConnected {
                                // Events during the disconnection may be lost.
                                announce();
                            }
                        }
                        _ => {}
                    }
                }
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
            let dir = self.inner.dir(name);
            let (from_hex, to_hex) = (from.to_string(), to.to_string());
            let Some(ours) = self
                .placed(&dir, &from_hex)
                .filter(|ours| !self.inner.overdue(&ours.path))
            else {
                return super::backend::release_then_acquire(self, name, from, to, ttl).await;
            };
            // Our node was first (we were first when we took it, and no node can come
            // before it later), so deleting it is a release. The next owner's node, if it
            // is not in line yet, is created in the same write; the listing leaves right
            // behind, and whoever is first then holds — a waiter elsewhere that was in
            // line before the next owner comes first.
            let client = self.session(ttl).await?;
            let waiting = self.placed(&dir, &to_hex);
            let mut writer = client.new_multi_writer();
            writer
                .add_delete(&ours.path, None)
                .map_err(failed("cannot hand the lock over"))?;
            if waiting.is_none() {
                writer
                    .add_create(
                        &format!("{dir}/{to_hex}-"),
                        to_hex.as_bytes(),
                        &ephemeral_sequential(),
                    )
                    .map_err(failed("cannot hand the lock over"))?;
            }
            let commit = writer.commit();
            let list = client.list_children(&dir);
            let (committed, listed) = tokio::join!(commit, list);
            let created = match committed {
                Ok(results) => results.into_iter().find_map(|result| match result {
                    zk::MultiWriteResult::Create { path, stat } => Some((path, stat)),
                    _ => None,
                }),
                // Our node was gone (broken, or its session expired): not a hand-over.
                Err(zk::MultiWriteError::OperationFailed {
                    source: zk::Error::NoNode,
                    ..
                }) => {
                    return super::backend::release_then_acquire(self, name, from, to, ttl).await;
                }
                Err(error) => return Err(failed("cannot hand the lock over")(error.into())),
            };
            self.forget(&dir, &from_hex);
            let mine = match (waiting, created) {
                (Some(waiting), _) => waiting,
                (None, Some((path, stat))) => {
                    let node = path
                        .rsplit_once('/')
                        .and_then(|(_, child)| Node::parse(child))
                        .ok_or_else(|| {
                            Error::new(
                                ErrorKind::Store,
                                format!("ZooKeeper answered with an unexpected node path {path:?}"),
                            )
                        })?;
                    // A multi's create may answer with an invalid stat (ZOOKEEPER-4026).
                    let token = if stat.is_invalid() {
                        match client
                            .check_stat(&path)
                            .await
                            .map_err(failed("cannot read the lock's node"))?
                        {
                            Some(stat) => token(&stat),
                            None => FencingToken::new(0),
                        }
                    } else {
                        token(&stat)
                    };
                    Placed { node, path, token }
                }
                (None, None) => {
                    return Err(Error::new(
                        ErrorKind::Store,
                        "ZooKeeper did not report the node it created",
                    ));
                }
            };
            let acquired = match self.settle(&client, &dir, mine, listed, sent + ttl).await? {
                Some(acquired) => acquired,
                None => self.try_acquire(name, to, ttl).await?,
            };
            Ok((ReleaseOutcome::Released, acquired))
        })
    }

    fn keeps_waiters_in_line(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        self.inner.url.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_become_one_safe_path_component() {
        assert_eq!(path_component("orders:42"), "orders:42");
        assert_eq!(path_component("a/b"), "a%2fb");
        assert_eq!(path_component("100%"), "100%25");
        assert_eq!(path_component(".."), "%2e%2e");
        assert_eq!(path_component("é"), "%c3%a9");
    }

    #[test]
    fn nodes_sort_by_sequence_and_print_as_zookeeper_wrote_them() {
        let children = vec![
            "b".repeat(32) + "-0000000012",
            "a".repeat(32) + "-0000000003",
            "junk".to_owned(),
        ];
        let line = in_line(&children);
        assert_eq!(line.len(), 2);
        assert_eq!(line[0].sequence, 3);
        assert_eq!(line[0].child(), "a".repeat(32) + "-0000000003");
    }
}
