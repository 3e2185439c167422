//! Leader election: one instance of a fleet leads, with a fencing epoch.
//!
//! An [`Election`] is built on the lock core, not beside it: a campaign is an
//! acquisition of the lock named after the election, so a leader has everything a
//! [`LockGuard`] has (the watchdog that renews its lease, the lost signal that fires the
//! moment leadership can no longer be assumed, a cancellation token to stop its work,
//! waiting woken by the store's notifications) and an **epoch** that is the lock's
//! fencing token: strictly increasing from one leader to the next, across restarts and
//! failovers on the engines whose guarantees table says tokens are (see
//! [`guide::guarantees`](crate::guide::guarantees)). Pass the epoch with every write the
//! leader makes, and a deposed leader that wakes from a pause is refused by the
//! protected store ([`crate::fence`]).
//!
//! A leader may advertise a value (its address, an instance id) that everyone can read
//! with [`Election::leader`] and follow with [`Election::observe`]. The value lives with
//! the leadership in the store and is written only while its writer leads, in one
//! atomic step, so a deposed leader cannot overwrite its successor's. SQLite, Redis
//! (single node, Sentinel, Cluster), PostgreSQL in lease mode, etcd and ZooKeeper keep
//! values; on the other engines an election works the same with an empty value, and a campaign with a
//! value is refused with [`ErrorKind::UnsupportedStore`] (see
//! [`LockBackend::keeps_holder_values`]).
//!
//! An election's name is a lock name, in the same namespace as the locks of the store:
//! `turnstile lock status NAME` shows the leader, and `turnstile lock break NAME`
//! deposes it.
//!
//! ```
//! # #[cfg(feature = "sqlite")]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> turnstile::Result<()> {
//! use std::time::Duration;
//! use turnstile::election::Election;
//! use turnstile::lock::LockOptions;
//!
//! # let dir = tempfile::tempdir().unwrap();
//! # let url = format!("sqlite://{}", dir.path().join("locks.db").display());
//! let election = Election::connect(&url).await?;
//! let options = LockOptions::new().ttl(Duration::from_secs(15)).wait_forever();
//!
//! let leadership = election.campaign("scheduler", "10.0.0.7:8080", &options).await?;
//! let epoch = leadership.epoch(); // send with every write the leader makes
//!
//! let leader = election.leader("scheduler").await?.expect("someone leads");
//! assert_eq!(leader.value.as_deref(), Some("10.0.0.7:8080"));
//! assert_eq!(leader.epoch, Some(epoch));
//!
//! tokio::select! {
//!     reason = leadership.lost() => eprintln!("no longer leading ({reason}); stop"),
//!     () = async { /* the leader's work, fenced with `epoch` */ } => {}
//! }
//! leadership.resign().await?;
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "sqlite"))]
//! # fn main() {}
//! ```
//!
//! # The timings of Kubernetes' leader election
//! `client-go`'s `LeaseDuration`, `RenewDeadline` and `RetryPeriod` map to the lock's
//! options: the lease duration is the TTL ([`LockOptions::ttl`]); the watchdog renews
//! every TTL/3, and a leader whose renewals fail stops at its validity deadline (the TTL
//! from the last renewal sent, less the drift allowance), which plays the part of the
//! renew deadline but never outlasts the lease; candidates do not retry on a period:
//! they wait for the store's release notification (where the engine sends one, or poll
//! at its interval) and for the holder's lease to run out, bounded by
//! [`LockOptions::wait`]. `turnstile lead` waits `--retry-period` after a term ends
//! before it campaigns again.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, ErrorKind, Result};
use crate::fence::FencingToken;
use crate::lock::{
    IntoLockName, LockBackend, LockGuard, LockInfo, LockName, LockOptions, Locker, LossReason,
    LostSignal, OwnerId, ReleaseOutcome,
};

pub mod telemetry;

/// The longest value a leader may advertise, in bytes.
pub const MAX_VALUE_LEN: usize = 16 * 1024;

/// How long an observer waits at most before it looks again, when no notification
/// comes: a lease that runs out with nobody there to take it sends none.
const OBSERVE_RECHECK_MAX: Duration = Duration::from_secs(1);

/// After a change, the first look again: a release is often followed at once by the
/// next leader's acquire, which not every engine announces.
const OBSERVE_RECHECK_MIN: Duration = Duration::from_millis(10);

/// Elections kept in one store.
///
/// Cheap to clone; clones share the [`Locker`], its connections and its local queue.
#[derive(Debug, Clone)]
pub struct Election {
    locker: Locker,
}

impl Election {
    /// Elections in the store `locker` keeps its locks in.
    pub fn new(locker: Locker) -> Self {
        Election { locker }
    }

    /// The locker campaigns go through.
    pub fn locker(&self) -> &Locker {
        &self.locker
    }

    fn backend(&self) -> &Arc<dyn LockBackend> {
        self.locker.backend()
    }

    /// Waits to lead the election `name` (as long as `options` lets an acquire wait:
    /// [`LockOptions::wait_forever`] to wait as long as it takes), then advertises
    /// `value` and returns the [`Leadership`].
    ///
    /// Errors: those of [`Locker::acquire`] ([`ErrorKind::AcquireTimeout`] when another
    /// instance still leads at the wait bound), [`ErrorKind::InvalidOptions`] for a value
    /// longer than [`MAX_VALUE_LEN`] or holding a NUL character,
    /// [`ErrorKind::UnsupportedStore`] for a non-empty value on an engine that keeps
    /// none (checked before campaigning), and [`ErrorKind::LockLost`] when the
    /// leadership was lost before its value could be written.
    pub async fn campaign<N: IntoLockName>(
        &self,
        name: N,
        value: impl Into<String>,
        options: &LockOptions,
    ) -> Result<Leadership> {
        let name = name.into_lock_name()?;
        let value = value.into();
        validate_value(&value)?;
        let keeps_values = self.backend().keeps_holder_values();
        if !value.is_empty() && !keeps_values {
            // The store's own refusal, before anything is acquired.
            return Err(self
                .backend()
                .proclaim(&name, &OwnerId::random(), &value)
                .await
                .err()
                .unwrap_or_else(|| {
                    Error::new(ErrorKind::UnsupportedStore, "this store keeps no values")
                }));
        }
        let started = Instant::now();
        telemetry::campaigning(&name);
        let guard = self.locker.acquire(name.clone(), options).await?;
        // Written even when empty where values are kept: a value row from an earlier
        // leader is never read, and the write wakes observers at once on engines whose
        // releases only notify waiters.
        if keeps_values
            && !self
                .backend()
                .proclaim(&name, guard.owner(), &value)
                .await?
        {
            let reason = guard.loss_reason().unwrap_or(LossReason::TakenOver);
            let _ = guard.release().await;
            return Err(Error::new(
                ErrorKind::LockLost,
                format!(
                    "election \"{name}\": leadership was lost ({reason}) before its value could be written"
                ),
            ));
        }
        telemetry::elected(&name, guard.fencing_token(), started.elapsed());
        let watcher = watch_for_loss(&guard);
        Ok(Leadership {
            guard: Some(guard),
            value,
            election: self.clone(),
            watcher,
        })
    }

    /// Advertises `value` for the leadership that `owner` holds, without a
    /// [`Leadership`] in this process: for a leadership taken by
    /// [`campaign`](Election::campaign) and then handed on as a detached lease
    /// ([`LockGuard::detach`] of [`Leadership::into_guard`]), as `turnstile serve` does
    /// for its HTTP clients. Applies only while `owner` leads, in one atomic step.
    ///
    /// Errors: [`ErrorKind::LockLost`] if `owner` does not lead `name` (nothing was
    /// written), [`ErrorKind::InvalidOptions`] for a bad value,
    /// [`ErrorKind::UnsupportedStore`] on an engine that keeps no values.
    pub async fn proclaim_detached<N: IntoLockName>(
        &self,
        name: N,
        owner: &OwnerId,
        value: &str,
    ) -> Result<()> {
        let name = name.into_lock_name()?;
        validate_value(value)?;
        if !self.backend().proclaim(&name, owner, value).await? {
            return Err(Error::new(
                ErrorKind::LockLost,
                format!(
                    "election \"{name}\": that owner id does not lead it (its lease ended, or it was broken); nothing was written"
                ),
            ));
        }
        telemetry::proclaimed(&name, None);
        Ok(())
    }

    /// Who leads `name` now, if anyone: one read of the store.
    pub async fn leader<N: IntoLockName>(&self, name: N) -> Result<Option<Leader>> {
        let name = name.into_lock_name()?;
        Ok(self
            .backend()
            .inspect_with_value(&name)
            .await?
            .map(|(info, value)| Leader::from_store(info, value, SystemTime::now())))
    }

    /// Follows the leadership of `name`: a [`LeaderWatch`] whose
    /// [`changed`](LeaderWatch::changed) answers the current state at once, then every
    /// change after it (a new leader, a new value, nobody leading). It is woken by the
    /// store's release notifications where the engine sends them, and looks again at
    /// least every second, since a lease that runs out with nobody waiting announces
    /// nothing.
    ///
    /// A campaign takes the lock, then writes its value, so a new leader may be seen
    /// first with `value: None` and at once after with its value (never with another
    /// leader's).
    pub async fn observe<N: IntoLockName>(&self, name: N) -> Result<LeaderWatch> {
        let name = name.into_lock_name()?;
        Ok(LeaderWatch {
            election: self.clone(),
            name,
            watch: None,
            last: None,
            recheck: OBSERVE_RECHECK_MIN,
        })
    }
}

fn validate_value(value: &str) -> Result<()> {
    if value.len() > MAX_VALUE_LEN {
        return Err(Error::new(
            ErrorKind::InvalidOptions,
            format!(
                "a leader's value is at most {MAX_VALUE_LEN} bytes; got {} (advertise an address or an id, not a payload)",
                value.len()
            ),
        ));
    }
    if value.contains('\0') {
        return Err(Error::new(
            ErrorKind::InvalidOptions,
            "a leader's value cannot hold a NUL character (SQL text columns refuse it)",
        ));
    }
    Ok(())
}

/// Counts a leadership that ended by loss rather than by resigning, from a task of its
/// own: the guard's lost signal fires in the watchdog, whoever holds the guard.
fn watch_for_loss(guard: &LockGuard) -> Option<tokio::task::JoinHandle<()>> {
    let lost = guard.lost();
    let name = guard.name().clone();
    let epoch = guard.fencing_token();
    let runtime = tokio::runtime::Handle::try_current().ok()?;
    Some(runtime.spawn(async move {
        let reason = lost.await;
        telemetry::deposed(&name, epoch, reason);
    }))
}

/// The leader of an election, as the store sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Leader {
    /// The leading acquisition's owner id (32 hex digits).
    pub owner: String,
    /// The leader's epoch: its lock's fencing token. `None` only for a holder that took
    /// the name as an unfenced lock, not by campaigning.
    pub epoch: Option<FencingToken>,
    /// What the leader advertises; `None` when it advertised nothing (or the engine
    /// keeps no values).
    pub value: Option<String>,
    /// How long its lease has left, by the store's clock, when the store says.
    pub remaining_ttl: Option<Duration>,
    /// When this process first saw this leader (for [`Election::leader`], when it
    /// asked): leadership is kept by the store's clock, which the reader cannot see.
    pub seen_since: SystemTime,
}

impl Leader {
    fn from_store(info: LockInfo, value: Option<String>, seen_since: SystemTime) -> Self {
        Leader {
            owner: info.owner,
            epoch: info.fencing_token,
            value,
            remaining_ttl: info.remaining_ttl,
            seen_since,
        }
    }

    /// Whether `self` and `other` are the same leadership with the same value (their
    /// remaining leases may differ).
    fn same_as(&self, other: &Leader) -> bool {
        self.owner == other.owner && self.epoch == other.epoch && self.value == other.value
    }
}

/// A change of leadership followed by [`Election::observe`].
#[derive(Debug)]
pub struct LeaderWatch {
    election: Election,
    name: LockName,
    watch: Option<crate::lock::ReleaseWatch>,
    /// What the last answer reported (`Some(None)`: nobody led).
    last: Option<Option<Leader>>,
    recheck: Duration,
}

impl LeaderWatch {
    /// The election followed.
    pub fn name(&self) -> &LockName {
        &self.name
    }

    /// The first call answers who leads now; every later call waits for the next
    /// change and answers it: `Some(leader)` for a new leader or a new value, `None`
    /// when nobody leads. A store that cannot be reached is an error; the watch stays
    /// usable, and the next call tries again.
    pub async fn changed(&mut self) -> Result<Option<Leader>> {
        loop {
            // Subscribed before reading, so a change between the read and the wait is
            // not missed.
            if self.watch.as_ref().is_none_or(|watch| watch.is_closed()) {
                self.watch = Some(self.election.backend().watch_releases(&self.name).await?);
            }
            // Nothing answered yet: the first answer is who leads now, without waiting.
            if self.last.is_some() {
                let limit = match &self.last {
                    Some(Some(leader)) => leader
                        .remaining_ttl
                        .map_or(OBSERVE_RECHECK_MAX, |left| left + Duration::from_millis(1)),
                    _ => OBSERVE_RECHECK_MAX,
                }
                .min(self.recheck);
                if let Some(watch) = self.watch.as_mut() {
                    watch.wait(limit, true).await;
                }
                self.recheck = (self.recheck * 2).min(OBSERVE_RECHECK_MAX);
            }
            let now = self
                .election
                .backend()
                .inspect_with_value(&self.name)
                .await?
                .map(|(info, value)| Leader::from_store(info, value, SystemTime::now()));
            let changed = match (&self.last, &now) {
                (None, _) => true,
                (Some(None), None) => false,
                (Some(Some(before)), Some(now)) => !before.same_as(now),
                _ => true,
            };
            if changed {
                self.recheck = OBSERVE_RECHECK_MIN;
                telemetry::observed_change(&self.name, now.as_ref());
                self.last = Some(now.clone());
                return Ok(now);
            }
        }
    }
}

/// Leading an election: what [`Election::campaign`] returns.
///
/// It holds the election's lock, renewed by the watchdog; dropping it resigns in the
/// background, as dropping a [`LockGuard`] releases.
#[derive(Debug)]
pub struct Leadership {
    // `None` only once resigned or turned into its guard.
    guard: Option<LockGuard>,
    value: String,
    election: Election,
    watcher: Option<tokio::task::JoinHandle<()>>,
}

impl Leadership {
    fn guard_ref(&self) -> &LockGuard {
        self.guard
            .as_ref()
            .expect("a Leadership keeps its guard until it is consumed")
    }

    /// The election's name.
    pub fn name(&self) -> &LockName {
        self.guard_ref().name()
    }

    /// This leadership's epoch: larger than every earlier leader's of this election.
    /// Pass it with every write the leader makes (see [`crate::fence`]).
    pub fn epoch(&self) -> FencingToken {
        self.guard_ref().fencing_token()
    }

    /// This leadership's owner id.
    pub fn owner(&self) -> &OwnerId {
        self.guard_ref().owner()
    }

    /// The value advertised now.
    pub fn value(&self) -> &str {
        &self.value
    }

    /// Until when leadership is certain by this host's monotonic clock (see
    /// [`LockGuard::valid_until`]).
    pub fn valid_until(&self) -> Instant {
        self.guard_ref().valid_until()
    }

    /// Whether leadership is in doubt: renewals are not getting through (see
    /// [`LockGuard::is_suspended`]).
    pub fn is_suspended(&self) -> bool {
        self.guard_ref().is_suspended()
    }

    /// Whether leadership is lost.
    pub fn is_lost(&self) -> bool {
        self.guard_ref().is_lost()
    }

    /// Why leadership was lost, once it has been.
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.guard_ref().loss_reason()
    }

    /// Completes, with the reason, the moment leadership can no longer be assumed;
    /// never, if the leader resigns.
    pub fn lost(&self) -> LostSignal {
        self.guard_ref().lost()
    }

    /// Cancelled when leadership is lost: hand it to the leader's work.
    pub fn lost_token(&self) -> CancellationToken {
        self.guard_ref().lost_token()
    }

    /// The lock guard underneath.
    pub fn guard(&self) -> &LockGuard {
        self.guard_ref()
    }

    /// Advertises `value` instead, in one atomic step that applies only while this
    /// leadership lasts; observers are told. Errors: [`ErrorKind::LockLost`] if it has
    /// ended (nothing was written), [`ErrorKind::InvalidOptions`] for a bad value,
    /// [`ErrorKind::UnsupportedStore`] on an engine that keeps no values.
    pub async fn proclaim(&mut self, value: impl Into<String>) -> Result<()> {
        let value = value.into();
        validate_value(&value)?;
        let guard = self.guard_ref();
        if let Some(reason) = guard.loss_reason() {
            return Err(lost_error(guard.name(), reason));
        }
        let backend = self.election.backend();
        if !backend
            .proclaim(guard.name(), guard.owner(), &value)
            .await?
        {
            let reason = guard.loss_reason().unwrap_or(LossReason::TakenOver);
            return Err(lost_error(guard.name(), reason));
        }
        telemetry::proclaimed(guard.name(), Some(guard.fencing_token()));
        self.value = value;
        Ok(())
    }

    /// Stops leading: releases the election's lock, so the next candidate takes over
    /// at once (woken by the store's notification where the engine sends one).
    pub async fn resign(mut self) -> Result<ReleaseOutcome> {
        self.stop_watcher();
        let guard = self
            .guard
            .take()
            .expect("a Leadership keeps its guard until it is consumed");
        let (name, epoch) = (guard.name().clone(), guard.fencing_token());
        let outcome = guard.release().await?;
        telemetry::resigned(&name, epoch, outcome);
        Ok(outcome)
    }

    /// The lock guard underneath, to run the leader's work as any lock holder does
    /// (`turnstile lead` hands it to the code of `lock exec`). Losses are then counted
    /// as the lock's only.
    pub fn into_guard(mut self) -> LockGuard {
        self.stop_watcher();
        self.guard
            .take()
            .expect("a Leadership keeps its guard until it is consumed")
    }

    fn stop_watcher(&mut self) {
        if let Some(watcher) = self.watcher.take() {
            watcher.abort();
        }
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.stop_watcher();
    }
}

fn lost_error(name: &LockName, reason: LossReason) -> Error {
    Error::new(
        ErrorKind::LockLost,
        format!("election \"{name}\": no longer leading ({reason}); nothing was written"),
    )
}
