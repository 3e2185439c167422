//! Semaphores with leases: at most N holders at once.
//!
//! A [`Semaphore`] named `NAME` with N permits is N locks of the lock core, the
//! **permits** `NAME#0` … `NAME#{N-1}`: holding a permit is holding one of them. So each
//! permit has everything a [`LockGuard`] has (its own owner id, a lease renewed by the
//! watchdog every TTL/3, the lost signal and cancellation token, release by an atomic
//! step), a crashed holder's permit comes back when its lease ends, and no engine
//! needs a second, untested way of counting holders: at most N can hold because at
//! most one can hold each of N locks.
//!
//! **N is stored with the semaphore.** The first client to use a semaphore stores its
//! number of permits in one atomic step ([`LockBackend::declare_permits`]); a client
//! that asks for another number gets [`ErrorKind::InvalidOptions`] naming the stored
//! one, never a silent overcommit. To change N, stop the clients and forget the number
//! ([`Semaphore::forget_permits`], `turnstile semaphore forget NAME`). RedLock cannot
//! store it atomically and refuses semaphores with [`ErrorKind::UnsupportedStore`].
//!
//! **Waiting** is first come, first served among the tasks of one process (one of them
//! at a time tries the store for a name); across processes, a waiter tries the permits
//! in turn and then waits for a release of any of them, woken by the store's
//! notifications where the engine sends them, and looks again at least every second.
//!
//! **Fencing tokens** belong to a permit: `NAME#2`'s tokens grow from holder to holder
//! of that permit, but are not comparable with `NAME#3`'s. A resource that several
//! permit holders write at once needs no fence against each other; fence per permit
//! (the resource named after [`Permit::lock_name`]) where a holder paused past its
//! lease must be stopped.
//!
//! ```
//! # #[cfg(feature = "sqlite")]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> turnstile::Result<()> {
//! use std::time::Duration;
//! use turnstile::lock::LockOptions;
//! use turnstile::semaphore::Semaphore;
//!
//! # let dir = tempfile::tempdir().unwrap();
//! # let url = format!("sqlite://{}", dir.path().join("locks.db").display());
//! let semaphore = Semaphore::connect(&url).await?;
//! let options = LockOptions::new().ttl(Duration::from_secs(30)).wait(Duration::from_secs(5));
//!
//! // At most three exports run at once, across every process using this store.
//! let permit = semaphore.acquire("exports", 3, &options).await?;
//! println!("export running on permit {}", permit.slot());
//! tokio::select! {
//!     reason = permit.lost() => eprintln!("permit lost ({reason}); stop"),
//!     () = async { /* the export */ } => {}
//! }
//! permit.release().await?;
//!
//! // Another number of permits for the same semaphore is refused.
//! assert!(semaphore.acquire("exports", 5, &options).await.is_err());
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "sqlite"))]
//! # fn main() {}
//! ```

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, ErrorKind, Result};
use crate::fence::FencingToken;
use crate::lock::{
    IntoLockName, LockBackend, LockGuard, LockInfo, LockName, LockOptions, Locker, LossReason,
    LostSignal, OwnerId, ReleaseOutcome, ReleaseWatch, describe_wait,
};

pub mod telemetry;

/// The most permits a semaphore may have: a waiter tries each permit in turn, so the
/// number bounds the requests of one round.
pub const MAX_PERMITS: u32 = 1000;

/// How long a waiter waits at most before trying the permits again when no release is
/// announced: a lease that runs out announces nothing.
const RECHECK: Duration = Duration::from_secs(1);

/// Semaphores kept in one store.
///
/// Cheap to clone; clones share the [`Locker`], the numbers of permits already checked
/// with the store, and the per-process line of each semaphore.
#[derive(Debug, Clone)]
pub struct Semaphore {
    locker: Locker,
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    /// The number of permits the store holds for each semaphore used through this
    /// handle: checked once, then known.
    declared: Mutex<HashMap<LockName, u32>>,
    /// One line per semaphore: the task that holds its turn is the one trying the store.
    turns: Mutex<HashMap<LockName, Weak<tokio::sync::Mutex<()>>>>,
}

impl Semaphore {
    /// Semaphores in the store `locker` keeps its locks in.
    pub fn new(locker: Locker) -> Self {
        Semaphore {
            locker,
            shared: Arc::default(),
        }
    }

    /// The locker permits are taken through.
    pub fn locker(&self) -> &Locker {
        &self.locker
    }

    fn backend(&self) -> &Arc<dyn LockBackend> {
        self.locker.backend()
    }

    /// The lock that is permit `slot` of the semaphore `name`: `NAME#SLOT`.
    pub fn permit_lock_name(name: &LockName, slot: u32) -> Result<LockName> {
        LockName::new(format!("{name}#{slot}")).map_err(|error| {
            Error::new(
                ErrorKind::InvalidName,
                format!(
                    "semaphore \"{name}\": its permits are the locks NAME#0, NAME#1, …, and \
                     \"{name}#{slot}\" is longer than a lock name may be ({} bytes); use a shorter name",
                    crate::lock::MAX_NAME_LEN
                ),
            )
            .with_source(error)
        })
    }

    /// Takes one of the `permits` permits of the semaphore `name`, waiting up to the
    /// options' wait bound ([`LockOptions::wait_forever`] for no bound). The options'
    /// TTL, watchdog and hold cap apply to the permit as to a lock.
    ///
    /// Errors: [`ErrorKind::AcquireTimeout`] when every permit is still held at the wait
    /// bound; [`ErrorKind::InvalidOptions`] for `permits` of 0 or above [`MAX_PERMITS`],
    /// or other than the number the store holds for `name`;
    /// [`ErrorKind::UnsupportedStore`] on RedLock; the lock core's errors otherwise.
    pub async fn acquire<N: IntoLockName>(
        &self,
        name: N,
        permits: u32,
        options: &LockOptions,
    ) -> Result<Permit> {
        self.acquire_within(name, permits, options, true)
            .await?
            .ok_or_else(unreachable_timeout)
    }

    /// Tries once to take a permit: `Ok(None)` if all `permits` are held.
    pub async fn try_acquire<N: IntoLockName>(
        &self,
        name: N,
        permits: u32,
        options: &LockOptions,
    ) -> Result<Option<Permit>> {
        self.acquire_within(name, permits, options, false).await
    }

    async fn acquire_within<N: IntoLockName>(
        &self,
        name: N,
        permits: u32,
        options: &LockOptions,
        waits: bool,
    ) -> Result<Option<Permit>> {
        options.validate()?;
        let name = name.into_lock_name()?;
        let started = Instant::now();
        let result = self
            .acquire_checked(&name, permits, options, waits, started)
            .await;
        match &result {
            Ok(Some(permit)) => telemetry::acquired(&name, permit.slot, started.elapsed()),
            Ok(None) => telemetry::not_acquired(&name, "all_held", started.elapsed()),
            Err(error) => {
                let reason = if error.kind() == ErrorKind::AcquireTimeout {
                    "timeout"
                } else {
                    "error"
                };
                telemetry::not_acquired(&name, reason, started.elapsed());
            }
        }
        result
    }

    async fn acquire_checked(
        &self,
        name: &LockName,
        permits: u32,
        options: &LockOptions,
        waits: bool,
        started: Instant,
    ) -> Result<Option<Permit>> {
        let slots = (0..permits)
            .map(|slot| Semaphore::permit_lock_name(name, slot))
            .collect::<Result<Vec<_>>>()?;
        self.check_permits(name, permits).await?;
        let deadline = if waits {
            options
                .get_wait()
                .and_then(|wait| started.checked_add(wait))
        } else {
            Some(started)
        };
        let timed_out = || {
            Error::new(
                ErrorKind::AcquireTimeout,
                format!(
                    "semaphore \"{name}\": all {permits} permits are still held after waiting {}",
                    describe_wait(options.get_wait().unwrap_or_default())
                ),
            )
        };
        // First come, first served among this process's tasks: the one whose turn it
        // is tries the store; the others wait here (tokio's mutex is fair).
        // A try that may not wait does not queue: it tries the store at once.
        let turn = self.turn(name);
        let _turn = match deadline {
            _ if !waits => None,
            Some(deadline) => Some(
                tokio::time::timeout_at(deadline, turn.lock())
                    .await
                    .map_err(|_| timed_out())?,
            ),
            None => Some(turn.lock().await),
        };
        let each = options.clone().wait(Duration::ZERO);
        // Start at a different permit each time, so that waiters in several processes
        // do not all try the same one first.
        let start = rand::random::<u32>() % permits;
        let mut watches: Option<Vec<ReleaseWatch>> = None;
        loop {
            for offset in 0..permits {
                let slot = (start + offset) % permits;
                let lock_name = &slots[slot as usize];
                if let Some(guard) = self.locker.try_acquire(lock_name, &each).await? {
                    return Ok(Some(Permit {
                        guard: Some(guard),
                        name: name.clone(),
                        slot,
                        permits,
                    }));
                }
            }
            let now = Instant::now();
            if !waits {
                return Ok(None);
            }
            if deadline.is_some_and(|deadline| now >= deadline) {
                return Err(timed_out());
            }
            match watches.as_mut() {
                // Subscribed, then round again at once: a release between the round
                // and the subscription is not missed.
                None => {
                    let mut subscribed = Vec::with_capacity(slots.len());
                    for lock_name in &slots {
                        subscribed.push(self.backend().watch_releases(lock_name).await?);
                    }
                    watches = Some(subscribed);
                }
                Some(watches) => {
                    let limit = deadline.map_or(RECHECK, |deadline| {
                        deadline.saturating_duration_since(now).min(RECHECK)
                    });
                    any_release(watches, limit).await;
                    // A watch whose connection dropped is renewed before the next wait.
                    for (watch, lock_name) in watches.iter_mut().zip(&slots) {
                        if watch.is_closed() {
                            *watch = self.backend().watch_releases(lock_name).await?;
                        }
                    }
                }
            }
        }
    }

    /// Checks `permits` against the number the store holds for `name`, storing it
    /// there if none is (once per name per handle).
    async fn check_permits(&self, name: &LockName, permits: u32) -> Result<()> {
        if permits == 0 || permits > MAX_PERMITS {
            return Err(Error::new(
                ErrorKind::InvalidOptions,
                format!(
                    "semaphore \"{name}\": the number of permits must be from 1 to {MAX_PERMITS}; got {permits}"
                ),
            ));
        }
        let known = lock_map(&self.shared.declared).get(name).copied();
        let stored = match known {
            Some(stored) => stored,
            None => {
                let stored = self.backend().declare_permits(name, permits).await?;
                lock_map(&self.shared.declared).insert(name.clone(), stored);
                stored
            }
        };
        if stored != permits {
            return Err(Error::new(
                ErrorKind::InvalidOptions,
                format!(
                    "semaphore \"{name}\" has {stored} permits in the store {}, as the first client to use it \
                     declared; this client asked for {permits}. Use {stored}, or stop every client and \
                     forget the number (turnstile semaphore forget) to declare another",
                    self.backend().describe()
                ),
            ));
        }
        Ok(())
    }

    fn turn(&self, name: &LockName) -> Arc<tokio::sync::Mutex<()>> {
        let mut turns = lock_map(&self.shared.turns);
        if let Some(turn) = turns.get(name).and_then(Weak::upgrade) {
            return turn;
        }
        turns.retain(|_, turn| turn.strong_count() > 0);
        let turn = Arc::new(tokio::sync::Mutex::new(()));
        turns.insert(name.clone(), Arc::downgrade(&turn));
        turn
    }

    /// Who holds each permit of the semaphore `name` with `permits` permits, by permit
    /// number, as the store sees it (one read per permit).
    pub async fn holders<N: IntoLockName>(
        &self,
        name: N,
        permits: u32,
    ) -> Result<Vec<(u32, LockInfo)>> {
        let name = name.into_lock_name()?;
        let mut held = Vec::new();
        for slot in 0..permits.min(MAX_PERMITS) {
            let lock_name = Semaphore::permit_lock_name(&name, slot)?;
            if let Some(info) = self.locker.status(&lock_name).await? {
                held.push((slot, info));
            }
        }
        Ok(held)
    }

    /// The number of permits the store holds for `name`, storing `permits` if it holds
    /// none (what the first acquire does).
    pub async fn declare_permits<N: IntoLockName>(&self, name: N, permits: u32) -> Result<u32> {
        let name = name.into_lock_name()?;
        let stored = self.backend().declare_permits(&name, permits).await?;
        lock_map(&self.shared.declared).insert(name, stored);
        Ok(stored)
    }

    /// The number of permits the store holds for `name`, if a client has declared one
    /// (a read: nothing is stored).
    pub async fn stored_permits<N: IntoLockName>(&self, name: N) -> Result<Option<u32>> {
        let name = name.into_lock_name()?;
        self.backend().stored_permits(&name).await
    }

    /// Forgets the number of permits stored for `name`, so that the next client to use
    /// it declares the number anew; returns the number forgotten. Clients still running
    /// keep the number they checked: stop them first, or a larger and a smaller number
    /// can both be in use.
    pub async fn forget_permits<N: IntoLockName>(&self, name: N) -> Result<Option<u32>> {
        let name = name.into_lock_name()?;
        lock_map(&self.shared.declared).remove(&name);
        self.backend().forget_permits(&name).await
    }
}

fn unreachable_timeout() -> Error {
    Error::new(
        ErrorKind::AcquireTimeout,
        "the semaphore's wait ended without a permit",
    )
}

fn lock_map<K, V>(map: &Mutex<HashMap<K, V>>) -> std::sync::MutexGuard<'_, HashMap<K, V>> {
    map.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Waits until any of `watches` announces a release, or `limit` passes (each watch
/// also polls at its engine's interval where the engine has no notifications).
async fn any_release(watches: &mut [ReleaseWatch], limit: Duration) {
    let mut waits: Vec<Pin<Box<dyn Future<Output = bool> + Send + '_>>> = watches
        .iter_mut()
        .map(|watch| {
            Box::pin(watch.wait(limit, true)) as Pin<Box<dyn Future<Output = bool> + Send + '_>>
        })
        .collect();
    crate::future::first_of(&mut waits).await;
}

/// One permit of a semaphore: what [`Semaphore::acquire`] returns.
///
/// It holds the permit's lock, renewed by the watchdog; dropping it releases the
/// permit in the background, as dropping a [`LockGuard`] does.
#[derive(Debug)]
pub struct Permit {
    // `None` only once released or turned into its guard.
    guard: Option<LockGuard>,
    name: LockName,
    slot: u32,
    permits: u32,
}

impl Permit {
    fn guard_ref(&self) -> &LockGuard {
        self.guard
            .as_ref()
            .expect("a Permit keeps its guard until it is consumed")
    }

    /// The semaphore's name.
    pub fn name(&self) -> &LockName {
        &self.name
    }

    /// Which permit this is, from 0 to [`permits`](Self::permits) − 1.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The semaphore's number of permits.
    pub fn permits(&self) -> u32 {
        self.permits
    }

    /// The lock that is this permit (`NAME#SLOT`): its fencing tokens are this
    /// permit's, and `turnstile lock status` shows it.
    pub fn lock_name(&self) -> &LockName {
        self.guard_ref().name()
    }

    /// This acquisition's fencing token, larger than every earlier holder's **of this
    /// permit** (not comparable with other permits' tokens).
    pub fn fencing_token(&self) -> FencingToken {
        self.guard_ref().fencing_token()
    }

    /// This acquisition's owner id.
    pub fn owner(&self) -> &OwnerId {
        self.guard_ref().owner()
    }

    /// Until when the permit is certainly held by this host's monotonic clock (see
    /// [`LockGuard::valid_until`]).
    pub fn valid_until(&self) -> Instant {
        self.guard_ref().valid_until()
    }

    /// Whether renewals are not getting through (see [`LockGuard::is_suspended`]).
    pub fn is_suspended(&self) -> bool {
        self.guard_ref().is_suspended()
    }

    /// Whether the permit is lost.
    pub fn is_lost(&self) -> bool {
        self.guard_ref().is_lost()
    }

    /// Why the permit was lost, once it has been.
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.guard_ref().loss_reason()
    }

    /// Completes, with the reason, the moment the permit can no longer be assumed held.
    pub fn lost(&self) -> LostSignal {
        self.guard_ref().lost()
    }

    /// Cancelled when the permit is lost: hand it to the holder's work.
    pub fn lost_token(&self) -> CancellationToken {
        self.guard_ref().lost_token()
    }

    /// The lock guard underneath.
    pub fn guard(&self) -> &LockGuard {
        self.guard_ref()
    }

    /// Gives the permit back; a waiter elsewhere is woken by the store's notification.
    pub async fn release(mut self) -> Result<ReleaseOutcome> {
        let guard = self
            .guard
            .take()
            .expect("a Permit keeps its guard until it is consumed");
        let outcome = guard.release().await?;
        telemetry::released(&self.name, self.slot, outcome);
        Ok(outcome)
    }

    /// The lock guard underneath, to run work as any lock holder does (`turnstile lock
    /// exec --permits` hands it to the code of `lock exec`).
    pub fn into_guard(mut self) -> LockGuard {
        self.guard
            .take()
            .expect("a Permit keeps its guard until it is consumed")
    }
}
