//! Read-write locks with leases: many readers or one writer.
//!
//! A [`RwLock`] named `NAME` is built from the lock core's locks, like the
//! [semaphores](crate::semaphore) it uses:
//!
//! - the **writer gate**, the lock `NAME#w`: a writer holds it for its whole section,
//!   and a reader holds it only while it enters;
//! - the **read permits**, a [semaphore](crate::semaphore) `NAME#r` with as many permits
//!   as readers may hold the lock at once (`max_readers`): a reader holds one, a writer
//!   holds all of them.
//!
//! So a writer excludes every reader and every other writer (it holds every permit and
//! the gate), readers share the lock up to `max_readers` at once, and each part has the
//! lock core's lease, watchdog and lost signal: a crashed holder's part comes back when
//! its lease ends, and a guard's lost signal fires when any of its parts is lost.
//!
//! **No writer starvation**: a waiting writer holds the gate while it collects the
//! permits, and readers enter through the gate, so once a writer waits no new reader
//! gets in; the readers inside finish and the writer goes next.
//!
//! **Fencing tokens**: a writer's token is the gate's, larger than every earlier
//! writer's *and reader's*. A reader's token is the gate's token of its entry: larger
//! than the token of every write that ended before it entered, smaller than every later
//! writer's. A fenced resource that keeps the largest token it has seen can therefore
//! refuse a write from a deposed writer, and tell a reader that a later writer has
//! written since it entered (the reader's token is below the resource's).
//!
//! The number of readers is stored with the lock, as a semaphore's permits are: the
//! first client's number wins, another is refused with [`ErrorKind::InvalidOptions`]. A
//! writer takes one permit per reader, so the number bounds a write's requests: keep it
//! to what readers need (the default for the command line is 16).
//!
//! ```
//! # #[cfg(feature = "sqlite")]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> turnstile::Result<()> {
//! use std::time::Duration;
//! use turnstile::lock::LockOptions;
//! use turnstile::rwlock::RwLock;
//!
//! # let dir = tempfile::tempdir().unwrap();
//! # let url = format!("sqlite://{}", dir.path().join("locks.db").display());
//! let locks = RwLock::connect(&url).await?;
//! let options = LockOptions::new().ttl(Duration::from_secs(30)).wait(Duration::from_secs(5));
//!
//! let first = locks.read("catalog", 8, &options).await?;
//! let second = locks.read("catalog", 8, &options).await?; // readers share
//! assert!(locks.try_write("catalog", 8, &options).await?.is_none()); // a writer waits
//! let read_at = second.fencing_token();
//! first.release().await?;
//! second.release().await?;
//!
//! let writer = locks.write("catalog", 8, &options).await?;
//! assert!(writer.fencing_token() > read_at); // later than every reader's entry
//! writer.release().await?;
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "sqlite"))]
//! # fn main() {}
//! ```

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, ErrorKind, Result};
use crate::fence::FencingToken;
use crate::lock::{
    IntoLockName, LockGuard, LockName, LockOptions, Locker, LossReason, ReleaseOutcome,
};
use crate::semaphore::{Permit, Semaphore};

/// Read-write locks kept in one store.
///
/// Cheap to clone; clones share the [`Locker`] and the [`Semaphore`] of the read
/// permits.
#[derive(Debug, Clone)]
pub struct RwLock {
    locker: Locker,
    semaphore: Semaphore,
}

/// The two parts of a read-write lock: its writer gate and its semaphore of read
/// permits.
fn parts(name: &LockName) -> Result<(LockName, LockName)> {
    let part = |suffix: &str| {
        LockName::new(format!("{name}#{suffix}")).map_err(|error| {
            Error::new(
                ErrorKind::InvalidName,
                format!(
                    "read-write lock \"{name}\": its parts are the locks NAME#w and NAME#r#N, \
                     longer than a lock name may be ({} bytes); use a shorter name",
                    crate::lock::MAX_NAME_LEN
                ),
            )
            .with_source(error)
        })
    };
    Ok((part("w")?, part("r")?))
}

impl RwLock {
    /// Read-write locks in the store `locker` keeps its locks in.
    pub fn new(locker: Locker) -> Self {
        RwLock {
            semaphore: Semaphore::new(locker.clone()),
            locker,
        }
    }

    /// The locker the parts are taken through.
    pub fn locker(&self) -> &Locker {
        &self.locker
    }

    /// Takes the lock `name` for reading, alongside other readers (at most
    /// `max_readers` at once), waiting up to the options' wait bound while a writer
    /// holds it or waits for it.
    ///
    /// Errors: [`ErrorKind::AcquireTimeout`] at the wait bound;
    /// [`ErrorKind::InvalidOptions`] for a `max_readers` other than the stored one (or
    /// outside 1 to [`MAX_PERMITS`](crate::semaphore::MAX_PERMITS)); the lock core's
    /// errors otherwise. Nothing is left held on an error.
    pub async fn read<N: IntoLockName>(
        &self,
        name: N,
        max_readers: u32,
        options: &LockOptions,
    ) -> Result<ReadGuard> {
        let name = name.into_lock_name()?;
        let (gate_name, permits_name) = parts(&name)?;
        let started = Instant::now();
        let gate = self.locker.acquire(&gate_name, options).await?;
        let entered = gate.fencing_token();
        let permit = self
            .semaphore
            .acquire(&permits_name, max_readers, &remaining(options, started))
            .await;
        // The gate is only for entering: other readers (and a writer) may pass now.
        if let Err(error) = gate.release().await {
            tracing::warn!(lock = %name, %error, "the read gate could not be released; it expires on its own");
        }
        let permit = permit?;
        telemetry::entered(&name, "read", started.elapsed());
        Ok(ReadGuard {
            name,
            permit: Some(permit),
            token: entered,
        })
    }

    /// Takes the lock `name` for writing, alone, waiting up to the options' wait bound
    /// for the readers inside and any earlier writer; new readers wait from the moment
    /// this call holds the gate. Errors as for [`read`](Self::read).
    pub async fn write<N: IntoLockName>(
        &self,
        name: N,
        max_readers: u32,
        options: &LockOptions,
    ) -> Result<WriteGuard> {
        self.write_within(name, max_readers, options, true)
            .await?
            .ok_or_else(|| Error::new(ErrorKind::AcquireTimeout, "the write lock was not taken"))
    }

    /// Tries once to take the lock for writing: `Ok(None)` if a reader or a writer
    /// holds it.
    pub async fn try_write<N: IntoLockName>(
        &self,
        name: N,
        max_readers: u32,
        options: &LockOptions,
    ) -> Result<Option<WriteGuard>> {
        self.write_within(name, max_readers, options, false).await
    }

    async fn write_within<N: IntoLockName>(
        &self,
        name: N,
        max_readers: u32,
        options: &LockOptions,
        waits: bool,
    ) -> Result<Option<WriteGuard>> {
        let name = name.into_lock_name()?;
        let (gate_name, permits_name) = parts(&name)?;
        let started = Instant::now();
        let gate = if waits {
            self.locker.acquire(&gate_name, options).await?
        } else {
            match self.locker.try_acquire(&gate_name, options).await? {
                Some(gate) => gate,
                None => return Ok(None),
            }
        };
        let mut permits = Vec::new();
        for _ in 0..max_readers.max(1) {
            let taken = if waits {
                self.semaphore
                    .acquire(&permits_name, max_readers, &remaining(options, started))
                    .await
                    .map(Some)
            } else {
                self.semaphore
                    .try_acquire(&permits_name, max_readers, options)
                    .await
            };
            match taken {
                Ok(Some(permit)) => permits.push(permit),
                other => {
                    // Give back what was taken, the gate last (new readers wait until
                    // then, which is short).
                    for permit in permits {
                        let _ = permit.release().await;
                    }
                    let _ = gate.release().await;
                    return other.map(|_| None);
                }
            }
        }
        telemetry::entered(&name, "write", started.elapsed());
        let lost = watch_parts(&gate, &permits);
        Ok(Some(WriteGuard {
            name,
            gate: Some(gate),
            permits,
            lost,
        }))
    }
}

/// The options with the wait bound that is left of them since `started`.
fn remaining(options: &LockOptions, started: Instant) -> LockOptions {
    match options.get_wait() {
        Some(wait) => options.clone().wait(wait.saturating_sub(started.elapsed())),
        None => options.clone(),
    }
}

/// A token cancelled when any of a writer's parts is lost, kept by a task of its own.
fn watch_parts(gate: &LockGuard, permits: &[Permit]) -> LostParts {
    let token = CancellationToken::new();
    let mut signals = vec![gate.lost()];
    signals.extend(permits.iter().map(Permit::lost));
    let reason = std::sync::Arc::new(std::sync::OnceLock::new());
    let task = tokio::runtime::Handle::try_current().ok().map(|runtime| {
        let (token, reason) = (token.clone(), std::sync::Arc::clone(&reason));
        runtime.spawn(async move {
            let lost = crate::future::first_of(&mut signals).await;
            let _ = reason.set(lost);
            token.cancel();
        })
    });
    LostParts {
        token,
        reason,
        task,
    }
}

#[derive(Debug)]
struct LostParts {
    token: CancellationToken,
    reason: std::sync::Arc<std::sync::OnceLock<LossReason>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for LostParts {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Holding a read-write lock for reading: what [`RwLock::read`] returns. Dropping it
/// releases it in the background.
#[derive(Debug)]
pub struct ReadGuard {
    name: LockName,
    // `None` only once released.
    permit: Option<Permit>,
    token: FencingToken,
}

impl ReadGuard {
    fn permit(&self) -> &Permit {
        self.permit
            .as_ref()
            .expect("a ReadGuard keeps its permit until it is released")
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        &self.name
    }

    /// The writer gate's token when this reader entered: above every write that ended
    /// before, below every later writer's.
    pub fn fencing_token(&self) -> FencingToken {
        self.token
    }

    /// Until when the read permit is certainly held (see [`LockGuard::valid_until`]).
    pub fn valid_until(&self) -> Instant {
        self.permit().valid_until()
    }

    /// Whether the read permit is lost.
    pub fn is_lost(&self) -> bool {
        self.permit().is_lost()
    }

    /// Why it was lost, once it has been.
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.permit().loss_reason()
    }

    /// Completes, with the reason, the moment reading can no longer be assumed safe.
    pub fn lost(&self) -> crate::lock::LostSignal {
        self.permit().lost()
    }

    /// Cancelled when the read permit is lost.
    pub fn lost_token(&self) -> CancellationToken {
        self.permit().lost_token()
    }

    /// Stops reading: gives the read permit back.
    pub async fn release(mut self) -> Result<ReleaseOutcome> {
        let permit = self
            .permit
            .take()
            .expect("a ReadGuard keeps its permit until it is released");
        permit.release().await
    }
}

/// Holding a read-write lock for writing: what [`RwLock::write`] returns. Dropping it
/// releases every part in the background.
#[derive(Debug)]
pub struct WriteGuard {
    name: LockName,
    // `None` only once released.
    gate: Option<LockGuard>,
    permits: Vec<Permit>,
    lost: LostParts,
}

impl WriteGuard {
    fn gate(&self) -> &LockGuard {
        self.gate
            .as_ref()
            .expect("a WriteGuard keeps its gate until it is released")
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        &self.name
    }

    /// This writer's fencing token: larger than every earlier writer's and reader's.
    pub fn fencing_token(&self) -> FencingToken {
        self.gate().fencing_token()
    }

    /// Until when every part is certainly held, by this host's monotonic clock.
    pub fn valid_until(&self) -> Instant {
        self.permits
            .iter()
            .map(Permit::valid_until)
            .fold(self.gate().valid_until(), Instant::min)
    }

    /// Whether any part (the gate or a read permit) is lost.
    pub fn is_lost(&self) -> bool {
        self.gate().is_lost() || self.permits.iter().any(Permit::is_lost)
    }

    /// Why the first lost part was lost, once one has been.
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.lost.reason.get().copied().or_else(|| {
            self.gate()
                .loss_reason()
                .or_else(|| self.permits.iter().find_map(Permit::loss_reason))
        })
    }

    /// Cancelled the moment any part is lost: hand it to the writer's work.
    pub fn lost_token(&self) -> CancellationToken {
        self.lost.token.clone()
    }

    /// Completes, with the reason, the moment writing can no longer be assumed
    /// exclusive; never, if the writer releases the lock.
    pub async fn lost(&self) -> LossReason {
        self.lost.token.cancelled().await;
        self.loss_reason().unwrap_or(LossReason::Expired)
    }

    /// Stops writing: gives back every read permit, then the gate.
    pub async fn release(mut self) -> Result<ReleaseOutcome> {
        if let Some(task) = self.lost.task.take() {
            task.abort();
        }
        let mut outcome = ReleaseOutcome::Released;
        for permit in std::mem::take(&mut self.permits) {
            let released = permit.release().await?;
            if released != ReleaseOutcome::Released {
                outcome = released;
            }
        }
        let gate = self
            .gate
            .take()
            .expect("a WriteGuard keeps its gate until it is released");
        let released = gate.release().await?;
        Ok(if released == ReleaseOutcome::Released {
            outcome
        } else {
            released
        })
    }
}

mod telemetry {
    use std::time::Duration;

    use crate::lock::LockName;

    /// A read or write lock taken (`turnstile_rwlock_acquired_total{mode}`,
    /// `turnstile_rwlock_acquire_wait_seconds{mode}`).
    pub(super) fn entered(name: &LockName, mode: &'static str, waited: Duration) {
        metrics::counter!("turnstile_rwlock_acquired_total", "mode" => mode).increment(1);
        metrics::histogram!("turnstile_rwlock_acquire_wait_seconds", "mode" => mode)
            .record(waited.as_secs_f64());
        tracing::debug!(lock = %name, mode, waited = ?waited, "read-write lock taken");
    }
}
