//! What the session-based engines share: each held lock owns one database session, and
//! the lease is "the session stays alive and in contact".

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::OwnerId;

/// One held lock: its session (a pooled connection), how the server knows it, and when
/// it last heard from the server.
pub(crate) struct Session<C, K> {
    pub(crate) connection: Option<C>,
    /// The server's id for the session (MySQL `CONNECTION_ID()`, PostgreSQL backend pid).
    pub(crate) server_id: u64,
    pub(crate) key: K,
    pub(crate) ttl: Duration,
    pub(crate) last_contact: Instant,
}

impl<C, K> Session<C, K> {
    /// Whether the lease is still running by the client's clock: the TTL has not passed
    /// since the last contact with the server.
    pub(crate) fn in_contact(&self) -> bool {
        self.last_contact.elapsed() < self.ttl
    }
}

/// A held session, shared by the guard's renewals and its release.
pub(crate) type SharedSession<C, K> = Arc<tokio::sync::Mutex<Session<C, K>>>;

/// The sessions of the locks a store holds, by owner.
pub(crate) struct HeldSessions<C, K> {
    by_owner: Mutex<HashMap<String, SharedSession<C, K>>>,
}

impl<C, K> Default for HeldSessions<C, K> {
    fn default() -> Self {
        HeldSessions {
            by_owner: Mutex::new(HashMap::new()),
        }
    }
}

impl<C, K> HeldSessions<C, K> {
    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<String, SharedSession<C, K>>> {
        self.by_owner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn insert(&self, owner: &OwnerId, session: Session<C, K>) {
        self.table().insert(
            owner.as_str().to_owned(),
            Arc::new(tokio::sync::Mutex::new(session)),
        );
    }

    pub(crate) fn get(&self, owner: &OwnerId) -> Option<SharedSession<C, K>> {
        self.table().get(owner.as_str()).cloned()
    }

    pub(crate) fn forget(&self, owner: &OwnerId) {
        self.table().remove(owner.as_str());
    }
}
