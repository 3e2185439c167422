//! What the session-based engines share: each held lock owns one database session, and
//! the lease is "the session stays alive and in contact".

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::sql::{Lent, SessionFacts};
use tokio::time::Instant;

use super::{
    ExtendOutcome, LockName, LossReason, OwnerId, ReleaseOutcome, ReleaseSignals, TryAcquire,
};
use crate::error::Result;
use crate::fence::FencingToken;

/// How long a session engine may spend finding out *who* took a lock it knows it lost:
/// the loss itself is reported at once, this only refines its reason.
const LOSS_LOOKUP_LIMIT: Duration = Duration::from_millis(250);

/// A connection (taken from the engine's [`KeptConnections`](crate::sql::KeptConnections))
/// that may hold a session-level lock.
///
/// Dropped without [`recycle`](Self::recycle) — a cancelled acquire or release, a
/// statement that failed after the lock was taken — it is detached from its pool and
/// closed, so the server frees whatever it held. No later lock ever gets a connection
/// that might still hold one: it would "acquire" re-entrantly and its release would
/// leave the lock held.
pub(crate) struct Dedicated<DB: sqlx::Database> {
    connection: Option<Lent<DB>>,
}

impl<DB: sqlx::Database> Dedicated<DB> {
    pub(crate) fn new(connection: Lent<DB>) -> Self {
        Dedicated {
            connection: Some(connection),
        }
    }

    /// Puts the connection back for the next lock: only for one known to hold no lock.
    pub(crate) fn recycle(mut self) {
        if let Some(connection) = self.connection.take() {
            connection.keep();
        }
    }

    /// What is known of the session (see [`SessionFacts`]).
    pub(crate) fn facts(&self) -> SessionFacts {
        self.connection
            .as_ref()
            .map(Lent::facts)
            .unwrap_or_default()
    }

    /// Records what a statement established about the session.
    pub(crate) fn learn(&mut self, facts: SessionFacts) {
        if let Some(connection) = &mut self.connection {
            connection.learn(facts);
        }
    }

    /// Closes the connection politely, so the server frees its locks at once.
    pub(crate) async fn close(mut self) {
        if let Some(connection) = self.connection.take() {
            let _ = sqlx::Connection::close(connection.detach()).await;
        }
    }
}

impl<DB: sqlx::Database> std::ops::Deref for Dedicated<DB> {
    type Target = DB::Connection;
    fn deref(&self) -> &DB::Connection {
        self.connection
            .as_deref()
            .expect("a dedicated connection is present until consumed")
    }
}

impl<DB: sqlx::Database> std::ops::DerefMut for Dedicated<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        self.connection
            .as_deref_mut()
            .expect("a dedicated connection is present until consumed")
    }
}

impl<DB: sqlx::Database> Drop for Dedicated<DB> {
    fn drop(&mut self) {
        if let Some(connection) = self.connection.take() {
            // Dropping the detached connection closes its socket; the server ends the
            // session and frees its locks.
            drop(connection.detach());
        }
    }
}

/// One held lock: its session (a dedicated connection), how the server knows it, and
/// when it last heard from the server.
pub(crate) struct Session<C, K> {
    pub(crate) connection: Option<C>,
    /// The server's id for the session (MySQL `CONNECTION_ID()`, PostgreSQL backend pid).
    pub(crate) server_id: u64,
    pub(crate) key: K,
    /// `None` for a lock taken unfenced.
    pub(crate) token: Option<FencingToken>,
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

    /// How many locks this store holds now, each on a session of its own.
    pub(crate) fn len(&self) -> usize {
        self.table().len()
    }
}

/// What to say when no session could be had for a new lock: that every session holds a
/// lock, when they all do (the limit, not the server, is what stops it).
pub(crate) fn no_session_left(engine: &str, held: usize, limit: u32) -> String {
    if held >= limit as usize {
        format!(
            "cannot open a {engine} session for the lock: all {limit} sessions of this store \
             hold locks (one per held lock; `turnstile_max_held` sets how many); it gets one \
             when a lock is released"
        )
    } else {
        format!("cannot open a {engine} session for the lock")
    }
}

/// What a session-based engine supplies; [`extend`] and [`release`] are written once
/// on top of it.
pub(crate) trait SessionEngine: Send + Sync {
    /// A held session's connection.
    type Connection: Send;
    /// How the engine names a lock on the server.
    type Key: Send + Sync + Clone;

    /// The sessions of the locks this store holds.
    fn sessions(&self) -> &HeldSessions<Self::Connection, Self::Key>;

    /// Where same-process waiters hear of releases.
    fn signals(&self) -> &ReleaseSignals;

    /// Asks the session whether it is alive and still holds its lock.
    fn ping<'a>(
        &'a self,
        connection: &'a mut Self::Connection,
        key: &'a Self::Key,
    ) -> impl Future<Output = bool> + Send + 'a;

    /// Releases the lock on its session; `true` only if that session held it.
    fn unlock<'a>(
        &'a self,
        connection: &'a mut Self::Connection,
        name: &'a LockName,
        key: &'a Self::Key,
    ) -> impl Future<Output = bool> + Send + 'a;

    /// Returns a session that holds nothing to its pool.
    fn recycle(&self, connection: Self::Connection) -> impl Future<Output = ()> + Send;

    /// Ends a session for good; the server frees whatever it held.
    fn close(&self, connection: Self::Connection) -> impl Future<Output = ()> + Send;

    /// Gives the lock held on `connection` to `to` without letting go of it: issues a
    /// new token, records `to` as the holder and sets the session's lease to `ttl`
    /// (`held_ttl` is the lease the session has now, so an unchanged one need not be
    /// set again).
    fn reissue<'a>(
        &'a self,
        connection: &'a mut Self::Connection,
        name: &'a LockName,
        to: &'a OwnerId,
        ttl: Duration,
        held_ttl: Duration,
    ) -> impl Future<Output = Result<FencingToken>> + Send + 'a;

    /// The server id of the session that holds `name` now, if any.
    fn holder_id<'a>(
        &'a self,
        name: &'a LockName,
    ) -> impl Future<Output = Result<Option<u64>>> + Send + 'a;
}

/// Whether the session still holds its lock: in contact by the client's clock, and
/// answering a ping. A session that is not is closed.
async fn still_holds<E: SessionEngine>(
    engine: &E,
    session: &mut Session<E::Connection, E::Key>,
) -> bool {
    if session.in_contact()
        && let Some(connection) = session.connection.as_mut()
        && engine.ping(connection, &session.key).await
    {
        session.last_contact = Instant::now();
        return true;
    }
    if let Some(connection) = session.connection.take() {
        engine.close(connection).await;
    }
    false
}

/// Whether a session other than `ours` holds `name`.
async fn held_by_another<E: SessionEngine>(
    engine: &E,
    name: &LockName,
    ours: Option<u64>,
) -> Result<bool> {
    Ok(engine
        .holder_id(name)
        .await?
        .is_some_and(|holder| Some(holder) != ours))
}

/// A repeated acquire by an owner that already holds the lock (its first request ran
/// on the server, but the reply was lost): the token it already has, if its session
/// still holds the lock (`Some(None)` for a lock taken unfenced).
pub(crate) async fn already_held<E: SessionEngine>(
    engine: &E,
    owner: &OwnerId,
) -> Option<Option<FencingToken>> {
    let session = engine.sessions().get(owner)?;
    let mut session = session.lock().await;
    if still_holds(engine, &mut session).await {
        Some(session.token)
    } else {
        engine.sessions().forget(owner);
        None
    }
}

/// Renewal for session engines: a ping on the holder's session.
///
/// A session found dead is a certain loss — the server has freed the lock already — so
/// it is reported as one at once; asking who holds the lock now only names the reason,
/// and a failure or a slow answer there (pool exhausted, failover) does not turn the
/// loss into a passing error.
pub(crate) async fn extend<E: SessionEngine>(
    engine: &E,
    name: &LockName,
    owner: &OwnerId,
) -> Result<ExtendOutcome> {
    let mut ours = None;
    if let Some(session) = engine.sessions().get(owner) {
        let mut session = session.lock().await;
        if still_holds(engine, &mut session).await {
            return Ok(ExtendOutcome::Extended);
        }
        ours = Some(session.server_id);
        engine.sessions().forget(owner);
    }
    let taken = tokio::time::timeout(LOSS_LOOKUP_LIMIT, held_by_another(engine, name, ours)).await;
    Ok(ExtendOutcome::Lost(match taken {
        Ok(Ok(true)) => LossReason::TakenOver,
        _ => LossReason::Expired,
    }))
}

/// Hand-over for session engines: the holder's session keeps the lock and passes to
/// the next owner with a new token, so the lock is never free in between (a waiter
/// elsewhere cannot slip in, and there is no second round trip to take it again). If
/// `from` no longer holds the lock, it is a release followed by an acquire.
pub(crate) async fn hand_over<E: SessionEngine>(
    engine: &E,
    name: &LockName,
    from: &OwnerId,
    to: &OwnerId,
    ttl: Duration,
    acquire: impl Future<Output = Result<TryAcquire>>,
) -> Result<(ReleaseOutcome, TryAcquire)> {
    if let Some(shared) = engine.sessions().get(from) {
        let mut session = shared.lock().await;
        // No ping first: a live session keeps its lock, so the reissue answering is
        // itself the proof that the session still holds it, one round trip sooner.
        if session.in_contact()
            && let Some(mut connection) = session.connection.take()
        {
            let sent = Instant::now();
            // Dropped during the reissue, this future drops the connection too, which
            // ends the session and frees the lock: `from`'s entry must go with it.
            let forget_if_dropped = ForgetIfDropped {
                sessions: engine.sessions(),
                owner: from,
            };
            let reissued = engine
                .reissue(&mut connection, name, to, ttl, session.ttl)
                .await;
            std::mem::forget(forget_if_dropped);
            let token = match reissued {
                Ok(token) => token,
                Err(error) => {
                    // A dead session (its lock already freed), or in doubt about what it
                    // holds now: end it, freeing the lock, and let the next owner
                    // acquire the ordinary way.
                    tracing::debug!(lock = %name, %error, "hand-over failed; releasing instead");
                    engine.close(connection).await;
                    drop(session);
                    let released = release(engine, name, from).await?;
                    return Ok((released, acquire.await?));
                }
            };
            engine.sessions().forget(from);
            let moved = Session {
                connection: Some(connection),
                server_id: session.server_id,
                key: session.key.clone(),
                token: Some(token),
                ttl,
                last_contact: sent,
            };
            engine.sessions().insert(to, moved);
            return Ok((ReleaseOutcome::Released, TryAcquire::Acquired { token }));
        }
    }
    let released = release(engine, name, from).await?;
    Ok((released, acquire.await?))
}

/// Forgets an owner's held session when dropped; `std::mem::forget` it once the step
/// it guards has finished.
struct ForgetIfDropped<'a, C, K> {
    sessions: &'a HeldSessions<C, K>,
    owner: &'a OwnerId,
}

impl<C, K> Drop for ForgetIfDropped<'_, C, K> {
    fn drop(&mut self) {
        self.sessions.forget(self.owner);
    }
}

/// Release for session engines: unlock on the holder's session and recycle it, or, if
/// the lease ran out or the unlock fails, end the session.
pub(crate) async fn release<E: SessionEngine>(
    engine: &E,
    name: &LockName,
    owner: &OwnerId,
) -> Result<ReleaseOutcome> {
    let mut ours = None;
    if let Some(session) = engine.sessions().get(owner) {
        engine.sessions().forget(owner);
        let mut session = session.lock().await;
        ours = Some(session.server_id);
        // A lease that ran out without contact is given up, not released.
        let live = session.in_contact();
        let Session {
            connection, key, ..
        } = &mut *session;
        let unlocked = match connection.as_mut().filter(|_| live) {
            Some(connection) => engine.unlock(connection, name, key).await,
            None => false,
        };
        match session.connection.take() {
            Some(connection) if unlocked => {
                engine.recycle(connection).await;
                engine.signals().notify(name.as_str());
                return Ok(ReleaseOutcome::Released);
            }
            Some(connection) => engine.close(connection).await,
            None => {}
        }
        engine.signals().notify(name.as_str());
    }
    Ok(if held_by_another(engine, name, ours).await? {
        ReleaseOutcome::HeldByOther
    } else {
        ReleaseOutcome::AlreadyExpired
    })
}
