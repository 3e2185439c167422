//! The conformance suite every lock engine must pass, written once.
//!
//! An engine's test file implements [`TestStore`] (how to open another independent
//! client of the same store — a stand-in for another process) and invokes
//! `conformance_tests!(make_store)`.

#![allow(dead_code, unreachable_pub)]

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use turnstile::ErrorKind;
use turnstile::lock::{
    BoxFuture, ExtendOutcome, LockBackend, LockInfo, LockName, LockOptions, Locker, LossReason,
    OwnerId, ReleaseOutcome, ReleaseWatch, TryAcquire,
};

mod election;
mod rwlock;
mod semaphore;
#[allow(unused_imports)]
pub use election::*;
#[allow(unused_imports)]
pub use rwlock::*;
#[allow(unused_imports)]
pub use semaphore::*;

/// A store under test.
pub trait TestStore: Send + Sync + 'static {
    /// A new client with its own connections, as another process would have.
    fn locker(&self) -> Pin<Box<dyn Future<Output = Locker> + Send + '_>>;

    /// Whether waiters in other processes are woken by a notification (Redis Pub/Sub,
    /// PostgreSQL `LISTEN`) rather than by polling.
    fn notifies_other_processes(&self) -> bool {
        true
    }
}

fn name(label: &str) -> String {
    turnstile_test_support::unique_name(label)
}

fn options(ttl_ms: u64) -> LockOptions {
    LockOptions::new()
        .ttl(Duration::from_millis(ttl_ms))
        .wait(Duration::from_secs(10))
}

/// How long after its wait bound an `acquire` that gives up may return: the locker's
/// `LEAVE_LINE_GRACE` (100 ms, which a store that keeps waiters in line gets to take
/// the waiter out of it before the call returns), and 150 ms for a round trip to a
/// local store and the scheduling of a loaded two-core machine.
pub const PAST_THE_WAIT_BOUND: Duration = Duration::from_millis(250);

/// Asserts that an `acquire` with the wait bound `wait`, refused by a store that
/// answered, gave up at that bound: not before it, and no more than
/// [`PAST_THE_WAIT_BOUND`] after it.
#[track_caller]
pub fn assert_gave_up_at_the_wait_bound(waited: Duration, wait: Duration) {
    assert!(
        waited >= wait,
        "gave up after {waited:?}, before its wait bound of {wait:?}"
    );
    assert!(
        waited < wait + PAST_THE_WAIT_BOUND,
        "gave up only after {waited:?}, with a wait bound of {wait:?}"
    );
}

/// Asserts that an `acquire` with the wait bound `wait` returned no more than
/// [`PAST_THE_WAIT_BOUND`] after that bound, or after `MIN_ATTEMPT_TIME` if that is
/// longer (the least time a store gets to answer one request). A store that fails may
/// make it return sooner: a waiter gives up when its next retry would come too late.
#[track_caller]
pub fn assert_returned_by_the_wait_bound(waited: Duration, wait: Duration) {
    let bound = wait.max(turnstile::lock::MIN_ATTEMPT_TIME);
    assert!(
        waited < bound + PAST_THE_WAIT_BOUND,
        "returned only after {waited:?}, with a wait bound of {wait:?}"
    );
}

/// Many tasks in several clients run a read-modify-write that loses updates whenever
/// two of them are inside at once.
/// A new name's first token on an engine that floors tokens by its server's clock, on
/// a server whose wall clock is `clock`: within a minute of that server's clock in
/// microseconds, so more than 59 minutes from the host's.
pub fn assert_token_follows_the_servers_clock(
    token: turnstile::fence::FencingToken,
    clock: turnstile_test_support::ServerClock,
) {
    let host_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as i128;
    let server_us = host_us + i128::from(clock.offset_seconds()) * 1_000_000;
    let token = i128::from(token.get());
    assert!(
        (token - server_us).abs() < 60_000_000,
        "token {token} is {:.0} s from the server's clock ({clock:?}), {:.0} s from the host's",
        (token - server_us) as f64 / 1e6,
        (token - host_us) as f64 / 1e6,
    );
}

/// After a crash of the store's server: the first token issued is above every token
/// issued before the crash (the crash may have lost some of their commits).
pub fn assert_above_every_earlier_token(
    after: turnstile::FencingToken,
    before: &[turnstile::FencingToken],
) {
    let largest = before.iter().max().copied().unwrap();
    assert!(
        after > largest,
        "token {} after the crash, {largest} before",
        after.get()
    );
}

/// Holds `count` locks at once (`{name}-0`, `{name}-1`, …), then releases them all: on
/// a session engine, that leaves `count` sessions idle in its pool.
pub async fn hold_at_once_then_release(locker: &Locker, name: &str, count: usize) {
    let mut held = Vec::new();
    for n in 0..count {
        let one = format!("{name}-{n}");
        held.push(locker.acquire(&one, &LockOptions::new()).await.unwrap());
    }
    for guard in held {
        assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
    }
}

pub async fn mutual_exclusion_under_contention(store: impl TestStore) {
    let lock = name("mutex");
    let counter = Arc::new(AtomicU64::new(0));
    let inside = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let locker = store.locker().await;
        for _ in 0..4 {
            let (locker, lock) = (locker.clone(), lock.clone());
            let (counter, inside, overlaps) = (counter.clone(), inside.clone(), overlaps.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..5 {
                    let guard = locker
                        .acquire(&lock, &options(5_000).wait(Duration::from_secs(30)))
                        .await
                        .unwrap();
                    if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                        overlaps.fetch_add(1, Ordering::SeqCst);
                    }
                    let seen = counter.load(Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    counter.store(seen + 1, Ordering::SeqCst);
                    inside.fetch_sub(1, Ordering::SeqCst);
                    assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "two holders were inside at once"
    );
    assert_eq!(counter.load(Ordering::SeqCst), 60, "updates were lost");
}

/// A holder that vanishes without releasing frees the lock when its TTL runs out.
pub async fn expiry_frees_a_crashed_holder(store: impl TestStore) {
    let lock = name("crash");
    let ttl = Duration::from_secs(1);
    let crashed = store.locker().await;
    let sent = Instant::now();
    let guard = crashed
        .acquire(&lock, &options(1_000).watchdog(false))
        .await
        .unwrap();
    // A crash: no release, no renewals, the client is gone.
    std::mem::forget(guard);
    drop(crashed);
    let other = store.locker().await;
    assert!(
        other
            .try_acquire(&lock, &options(1_000))
            .await
            .unwrap()
            .is_none()
    );
    let guard = other.acquire(&lock, &options(5_000)).await.unwrap();
    // Freed by the expiry of the lease, no sooner, and promptly.
    let taken = sent.elapsed();
    assert!(
        taken >= ttl,
        "the lock was free {taken:?} after the acquire"
    );
    assert!(
        taken < ttl + Duration::from_millis(500),
        "the lock came free only {taken:?} after the acquire"
    );
    guard.release().await.unwrap();
}

/// Only the acquisition that holds the lock can extend or release it.
pub async fn a_non_owner_cannot_release_or_extend(store: impl TestStore) {
    let lock = LockName::new(name("owner")).unwrap();
    let locker = store.locker().await;
    let guard = locker.acquire(&lock, &options(5_000)).await.unwrap();
    let stranger = OwnerId::random();
    let backend = store.locker().await.backend().clone();
    assert_eq!(
        backend.release(&lock, &stranger).await.unwrap(),
        ReleaseOutcome::HeldByOther
    );
    assert_eq!(
        backend
            .extend(&lock, &stranger, Duration::from_secs(60))
            .await
            .unwrap(),
        ExtendOutcome::Lost(LossReason::TakenOver)
    );
    let status = locker.status(&lock).await.unwrap().expect("still held");
    assert_eq!(status.fencing_token, Some(guard.fencing_token()));
    assert_eq!(status.owner, guard.owner().to_hex());
    assert!(!guard.is_lost());
    assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
    assert!(locker.status(&lock).await.unwrap().is_none());
}

/// Releasing after the lease ran out says so, and never frees another holder's lock.
pub async fn release_after_expiry_reports_it(store: impl TestStore) {
    let lock = name("late");
    let locker = store.locker().await;
    let guard = locker
        .acquire(&lock, &options(100).watchdog(false))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(
        guard.release().await.unwrap(),
        ReleaseOutcome::AlreadyExpired
    );

    let late = locker
        .acquire(&lock, &options(100).watchdog(false))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(250)).await;
    let other = store.locker().await;
    let current = other.acquire(&lock, &options(5_000)).await.unwrap();
    assert_eq!(late.release().await.unwrap(), ReleaseOutcome::HeldByOther);
    let status = other
        .status(&lock)
        .await
        .unwrap()
        .expect("the new holder keeps it");
    assert_eq!(status.fencing_token, Some(current.fencing_token()));
    current.release().await.unwrap();
}

/// An explicit extend keeps the lock past its first lease.
pub async fn extend_works(store: impl TestStore) {
    let lock = name("extend");
    let locker = store.locker().await;
    let ttl = Duration::from_secs(1);
    let acquired = Instant::now();
    let guard = locker
        .acquire(&lock, &options(1_000).watchdog(false))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let sent = Instant::now();
    guard.extend().await.unwrap();
    // The local deadline moved with it: a full TTL from the extension, less the drift.
    let drift = options(1_000).get_clock_drift();
    assert!(
        guard.valid_until() >= sent + ttl - drift,
        "the extension did not move the deadline"
    );
    tokio::time::sleep_until(acquired + ttl + Duration::from_millis(200)).await;
    // 1.2 s after acquiring with a 1 s TTL: held only thanks to the extension.
    let status = locker
        .status(&lock)
        .await
        .unwrap()
        .expect("extended lease still held");
    assert_eq!(status.fencing_token, Some(guard.fencing_token()));
    assert!(!guard.is_lost());
    assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
}

/// The watchdog keeps a lock for many TTLs while the guard lives, and stops with it.
pub async fn watchdog_keeps_the_lock_past_several_ttls(store: impl TestStore) {
    let lock = name("watchdog");
    let locker = store.locker().await;
    let other = store.locker().await;
    // 600 ms: renewals every 200 ms, over three TTLs.
    let guard = locker.acquire(&lock, &options(600)).await.unwrap();
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            other
                .try_acquire(&lock, &options(600))
                .await
                .unwrap()
                .is_none()
        );
    }
    assert!(!guard.is_lost(), "lost: {:?}", guard.loss_reason());
    assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
    // Released: the watchdog must not bring it back (two renewal intervals).
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(other.status(&lock).await.unwrap().is_none());
}

/// When the lock is taken away (an operator breaks it, someone else takes it), the
/// holder's lost signal fires.
pub async fn lost_signal_fires_when_the_lock_is_taken_away(store: impl TestStore) {
    let lock = name("taken");
    let locker = store.locker().await;
    // The first renewal comes after TTL/3 = 1 s, long after the break and the takeover.
    let sent = Instant::now();
    let guard = locker.acquire(&lock, &options(3_000)).await.unwrap();
    let operator = store.locker().await;
    let broken = operator
        .force_release(&lock)
        .await
        .unwrap()
        .expect("it was held");
    assert_eq!(broken.fencing_token, Some(guard.fencing_token()));
    let thief = operator.acquire(&lock, &options(5_000)).await.unwrap();
    // Told at the first renewal, TTL/3 after the acquire.
    let mut lost = guard.lost();
    let reason = tokio::time::timeout_at(sent + Duration::from_millis(1_000 + 500), &mut lost)
        .await
        .expect("the lost signal did not fire at the first renewal");
    assert_eq!(reason, LossReason::TakenOver);
    // Polled again after firing (as in a `select!` loop): the same reason, at once.
    assert_eq!((&mut lost).await, LossReason::TakenOver);
    assert!(guard.lost_token().is_cancelled());
    assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::HeldByOther);
    thief.release().await.unwrap();
}

/// An unfenced acquisition excludes fenced and unfenced ones alike, is kept by its
/// watchdog past several leases, is handed to a waiter of its process, fires its lost
/// signal when the lock is taken away, and a fenced acquisition after it still gets a
/// token larger than every earlier one.
pub async fn unfenced_locks_keep_every_guarantee_but_the_token(store: impl TestStore) {
    let lock = name("unfenced");
    let locker = store.locker().await;
    let other = store.locker().await;
    let first = locker.acquire(&lock, &options(3_000)).await.unwrap();
    let before = first.fencing_token();
    first.release().await.unwrap();
    let guard = locker
        .acquire_unfenced(&lock, &options(1_000))
        .await
        .unwrap();
    assert!(
        other
            .try_acquire(&lock, &options(1_000))
            .await
            .unwrap()
            .is_none(),
        "a fenced acquire took a lock held unfenced"
    );
    assert!(
        other
            .try_acquire_unfenced(&lock, &options(1_000))
            .await
            .unwrap()
            .is_none()
    );
    let status = other.status(&lock).await.unwrap().expect("held");
    assert!(
        status.owner.is_empty() || status.owner == guard.owner().to_hex(),
        "{status:?}"
    );
    // Past several leases, the watchdog keeps it.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert!(!guard.is_lost());
    assert!(
        other
            .try_acquire_unfenced(&lock, &options(1_000))
            .await
            .unwrap()
            .is_none()
    );
    // A waiter of this process gets it at the release.
    let waiter = {
        let (locker, lock) = (locker.clone(), lock.clone());
        tokio::spawn(async move {
            locker
                .acquire_unfenced(&lock, &options(3_000))
                .await
                .unwrap()
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
    let next = waiter.await.unwrap();
    // Taken away: the lost signal fires at the first renewal (TTL/3 = 1 s).
    let sent = Instant::now();
    other
        .force_release(&lock)
        .await
        .unwrap()
        .expect("held by the waiter");
    let reason = tokio::time::timeout_at(sent + Duration::from_millis(1_500), next.lost())
        .await
        .expect("the lost signal did not fire at the first renewal");
    assert!(
        matches!(reason, LossReason::TakenOver | LossReason::Expired),
        "{reason:?}"
    );
    drop(next);
    let after = other.acquire(&lock, &options(3_000)).await.unwrap();
    assert!(after.fencing_token() > before);
    after.release().await.unwrap();
}

/// Every acquisition gets a token larger than all before it, whoever acquires.
pub async fn tokens_strictly_increase(store: impl TestStore) {
    let lock = name("tokens");
    let lockers = [store.locker().await, store.locker().await];
    let mut last = 0;
    for round in 0..20 {
        let guard = lockers[round % 2]
            .acquire(&lock, &options(5_000))
            .await
            .unwrap();
        let token = guard.fencing_token().get();
        assert!(token > last, "token {token} after {last}");
        last = token;
        guard.release().await.unwrap();
    }
}

/// A waiter wakes promptly when the holder releases, long before the holder's TTL.
pub async fn a_waiter_wakes_promptly_after_release(store: impl TestStore) {
    let lock = name("wake");
    let holder = store.locker().await;
    let guard = holder.acquire(&lock, &options(30_000)).await.unwrap();
    let (waiter, counting) = Counting::wrap(&store.locker().await);
    let waiting = {
        let lock = lock.clone();
        tokio::spawn(async move {
            let guard = waiter
                .acquire(&lock, &options(30_000).wait(Duration::from_secs(20)))
                .await
                .unwrap();
            let woke = Instant::now();
            guard.release().await.unwrap();
            woke
        })
    };
    // Release only once the waiter is asleep, or it would not need waking.
    contender_sleeps(&counting).await;
    let released = Instant::now();
    guard.release().await.unwrap();
    let woke = waiting.await.unwrap();
    // The holder's TTL is 30 s; a wake-up this soon can only come from a release
    // notification (or, where an engine polls, its poll of at most 100 ms).
    assert!(
        woke - released < Duration::from_millis(500),
        "woke {:?} after release",
        woke - released
    );
}

/// Waiters dropped mid-wait leave no holder and no queue behind.
pub async fn cancelled_waiters_leave_nothing_behind(store: impl TestStore) {
    let lock = name("cancel");
    let (locker, counting) = Counting::wrap(&store.locker().await);
    let guard = locker.acquire(&lock, &options(5_000)).await.unwrap();
    let mut waiters = Vec::new();
    for _ in 0..5 {
        let (locker, lock) = (locker.clone(), lock.clone());
        waiters.push(tokio::spawn(async move {
            locker
                .acquire(&lock, &options(5_000).wait(Duration::from_secs(30)))
                .await
        }));
    }
    // Cancel them while they wait, their contender asleep at the store.
    contender_sleeps(&counting).await;
    assert!(waiters.iter().all(|waiter| !waiter.is_finished()));
    for waiter in &waiters {
        waiter.abort();
    }
    for waiter in waiters {
        assert!(waiter.await.unwrap_err().is_cancelled());
    }
    // Timed-out waiters are cancelled waiters too.
    let started = Instant::now();
    let wait = Duration::from_millis(100);
    let error = locker
        .acquire(&lock, &options(5_000).wait(wait))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::AcquireTimeout);
    assert_gave_up_at_the_wait_bound(started.elapsed(), wait);
    assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        locker.status(&lock).await.unwrap().is_none(),
        "a cancelled waiter took the lock"
    );
    let next = locker
        .acquire(&lock, &options(5_000).wait(Duration::from_secs(1)))
        .await
        .unwrap();
    next.release().await.unwrap();
}

/// `acquire` gives up after its wait bound with a distinct error.
pub async fn acquire_times_out(store: impl TestStore) {
    let lock = name("timeout");
    let locker = store.locker().await;
    let guard = locker.acquire(&lock, &options(5_000)).await.unwrap();
    let other = store.locker().await;
    let started = Instant::now();
    let wait = Duration::from_millis(300);
    let error = other
        .acquire(&lock, &options(5_000).wait(wait))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::AcquireTimeout);
    assert!(error.is_retryable());
    assert_gave_up_at_the_wait_bound(started.elapsed(), wait);
    // No wait at all: one attempt, answered at once.
    let started = Instant::now();
    let error = other
        .acquire(&lock, &options(5_000).wait(Duration::ZERO))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::AcquireTimeout);
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "a call that may not wait took {:?}",
        started.elapsed()
    );
    guard.release().await.unwrap();
}

/// `with_lock` cancels the work when the lock is lost and says so.
pub async fn with_lock_cancels_work_when_the_lock_is_lost(store: impl TestStore) {
    let lock = name("with");
    let locker = store.locker().await;
    let operator = store.locker().await;
    // An operator breaks the lock as soon as the work holds it.
    let breaker = {
        let lock = lock.clone();
        tokio::spawn(async move {
            let until = Instant::now() + Duration::from_secs(5);
            while operator.status(&lock).await.unwrap().is_none() {
                assert!(Instant::now() < until, "the work never held the lock");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let broken = operator.force_release(&lock).await.unwrap();
            (broken, Instant::now())
        })
    };
    let finished = Arc::new(AtomicUsize::new(0));
    let flag = finished.clone();
    let error = locker
        .with_lock(&lock, &options(900), |_token| async move {
            tokio::time::sleep(Duration::from_secs(10)).await;
            flag.fetch_add(1, Ordering::SeqCst);
        })
        .await
        .unwrap_err();
    let stopped = Instant::now();
    assert_eq!(error.kind(), ErrorKind::LockLost);
    assert_eq!(error.loss_reason(), Some(LossReason::Expired));
    assert_eq!(finished.load(Ordering::SeqCst), 0);
    let (broken, broken_at) = breaker.await.unwrap();
    assert!(broken.is_some());
    // Cancelled at the first renewal after the break (every TTL/3 = 300 ms).
    assert!(
        stopped - broken_at < Duration::from_millis(300 + 300),
        "the work ran on {:?} after the break",
        stopped - broken_at
    );

    let value = locker
        .with_lock(&lock, &options(5_000), |token| async move { token.get() })
        .await
        .unwrap();
    assert!(value > 0);
    assert!(
        locker.status(&lock).await.unwrap().is_none(),
        "with_lock released"
    );
}

/// The cap on hold time fires the lost signal even though renewals succeed.
pub async fn max_hold_fires_the_lost_signal(store: impl TestStore) {
    let lock = name("cap");
    let locker = store.locker().await;
    let cap = Duration::from_millis(1_500);
    let sent = Instant::now();
    // Renewals every 200 ms succeed; the cap ends the hold after seven of them.
    let guard = locker
        .acquire(&lock, &options(600).max_hold(cap))
        .await
        .unwrap();
    let acquired = Instant::now();
    let reason = tokio::time::timeout(cap + Duration::from_secs(1), guard.lost())
        .await
        .expect("no signal");
    let fired = Instant::now();
    assert_eq!(reason, LossReason::MaxHoldReached);
    assert!(fired >= sent + cap, "fired {:?} early", sent + cap - fired);
    assert!(
        fired <= acquired + cap + Duration::from_millis(150),
        "fired {:?} late",
        fired - (acquired + cap)
    );
    guard.release().await.unwrap();
}

/// Without the watchdog the lost signal fires when the lease's local deadline passes,
/// before the store could give the lock to anyone else.
pub async fn lease_without_watchdog_signals_at_its_deadline(store: impl TestStore) {
    let lock = name("lease");
    let locker = store.locker().await;
    let other = store.locker().await;
    let guard = locker
        .acquire(&lock, &options(1_000).watchdog(false))
        .await
        .unwrap();
    let deadline = guard.valid_until();
    // A sampler sees the signal within a millisecond of its firing.
    let sampler = {
        let lost = guard.lost_token();
        tokio::spawn(async move {
            while !lost.is_cancelled() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Instant::now()
        })
    };
    // Another client polls until the store lets it in: the signal must have fired by
    // then.
    let taken = loop {
        if let Some(taken) = other.try_acquire(&lock, &options(5_000)).await.unwrap() {
            assert!(
                guard.is_lost(),
                "another client got the lock before the holder's lost signal fired"
            );
            break taken;
        }
        assert!(
            Instant::now() < deadline + Duration::from_secs(2),
            "the lease never ran out in the store"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let seen = sampler.await.unwrap();
    assert_eq!(guard.loss_reason(), Some(LossReason::LeaseElapsed));
    assert!(
        seen + Duration::from_millis(1) >= deadline,
        "the signal fired {:?} before the deadline",
        deadline - seen
    );
    assert!(
        seen <= deadline + Duration::from_millis(150),
        "the signal fired {:?} after the deadline",
        seen - deadline
    );
    taken.release().await.unwrap();
    guard.release().await.unwrap();
}

/// Bad input gets a specific error, never a panic.
pub async fn bad_input_is_refused(store: impl TestStore) {
    let locker = store.locker().await;
    let error = locker.acquire("", &LockOptions::new()).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidName);
    let error = locker
        .acquire("x".repeat(10_000), &LockOptions::new())
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidName);
    let error = locker
        .acquire(name("ttl"), &LockOptions::new().ttl(Duration::ZERO))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidOptions);
}

/// A guard moves between tasks: ownership is the acquisition's, not the task's.
pub async fn a_guard_can_move_between_tasks(store: impl TestStore) {
    let lock = name("move");
    let locker = store.locker().await;
    let guard = locker.acquire(&lock, &options(5_000)).await.unwrap();
    let outcome = tokio::spawn(async move { guard.release().await.unwrap() })
        .await
        .unwrap();
    assert_eq!(outcome, ReleaseOutcome::Released);
}

/// Dropping a guard releases in the background.
pub async fn dropping_a_guard_releases_it(store: impl TestStore) {
    let lock = name("drop");
    let locker = store.locker().await;
    drop(locker.acquire(&lock, &options(30_000)).await.unwrap());
    let dropped = Instant::now();
    let other = store.locker().await;
    let guard = other
        .acquire(&lock, &options(30_000).wait(Duration::from_secs(5)))
        .await
        .unwrap();
    // Released in the background at once, not left to its 30 s lease.
    assert!(
        dropped.elapsed() < Duration::from_secs(1),
        "free only {:?} after the drop",
        dropped.elapsed()
    );
    guard.release().await.unwrap();
}

/// Tasks of one client queue locally and all get their turns.
pub async fn local_waiters_take_turns(store: impl TestStore) {
    let lock = name("turns");
    let locker = store.locker().await;
    let turns = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for worker in 0..4 {
        let (locker, lock, turns) = (locker.clone(), lock.clone(), turns.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..5 {
                let guard = locker.acquire(&lock, &options(5_000)).await.unwrap();
                turns.lock().unwrap().push(worker);
                tokio::time::sleep(Duration::from_millis(5)).await;
                guard.release().await.unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let turns = turns.lock().unwrap();
    assert_eq!(turns.len(), 20);
    for worker in 0..4 {
        assert_eq!(turns.iter().filter(|w| **w == worker).count(), 5);
    }
}

/// A waiter in another process gets the lock even while tasks of one process keep
/// handing it to each other.
pub async fn a_remote_waiter_is_not_starved_by_local_handoffs(store: impl TestStore) {
    let lock = name("starve");
    let busy = store.locker().await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let (busy, lock, stop) = (busy.clone(), lock.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let guard = busy
                    .acquire(&lock, &options(5_000).wait(Duration::from_secs(30)))
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(1)).await;
                guard.release().await.unwrap();
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let remote = store.locker().await;
    let guard = remote
        .acquire(&lock, &options(5_000).wait(Duration::from_secs(10)))
        .await;
    stop.store(true, Ordering::SeqCst);
    guard
        .expect("the remote waiter starved")
        .release()
        .await
        .unwrap();
    for task in tasks {
        task.await.unwrap();
    }
}

/// An acquire whose request ran on the store but whose reply was lost is retried with
/// the same owner id: the retry gets the lock it already has, with the same token,
/// instead of waiting a whole TTL for itself.
pub async fn an_acquire_repeated_by_its_owner_gets_the_lock_it_has(store: impl TestStore) {
    let lock = LockName::new(name("again")).unwrap();
    let backend = store.locker().await.backend().clone();
    let owner = OwnerId::random();
    let ttl = Duration::from_secs(5);
    let first = backend.try_acquire(&lock, &owner, ttl).await.unwrap();
    let TryAcquire::Acquired { token } = first else {
        panic!("the lock was free: {first:?}");
    };
    assert_eq!(
        backend.try_acquire(&lock, &owner, ttl).await.unwrap(),
        TryAcquire::Acquired { token },
        "a repeated acquire by the holder must return its own token"
    );
    let other_owner = OwnerId::random();
    let other = backend.try_acquire(&lock, &other_owner, ttl).await.unwrap();
    assert!(matches!(other, TryAcquire::Held { .. }), "{other:?}");
    if backend.keeps_waiters_in_line() {
        // The refused owner waits in the store's line until it leaves it.
        assert_eq!(
            backend.release(&lock, &other_owner).await.unwrap(),
            ReleaseOutcome::HeldByOther
        );
    }
    assert_eq!(
        backend.release(&lock, &owner).await.unwrap(),
        ReleaseOutcome::Released
    );
    assert!(backend.inspect(&lock).await.unwrap().is_none());
}

/// Acquires dropped at every point of their request leave no lock behind: not in the
/// store, and not on a pooled connection that a later acquire would reuse (a session
/// lock is re-entrant, so a leaked one would let this client "acquire" and then keep
/// the lock held after its release).
pub async fn cancelled_acquires_leak_no_lock(store: impl TestStore) {
    let lock = name("leak");
    let locker = store.locker().await;
    let other = store.locker().await;
    // Calibrate: how long one uncontended acquire takes here.
    let started = Instant::now();
    locker
        .acquire(&lock, &options(5_000))
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let round_trip = started.elapsed().max(Duration::from_micros(200));
    // Cut acquires off at 40 points spread over two round trips.
    for step in 0..40u32 {
        let cut = round_trip * step / 20;
        match tokio::time::timeout(cut, locker.try_acquire(&lock, &options(5_000))).await {
            Ok(Ok(Some(guard))) => {
                guard.release().await.unwrap();
            }
            // Cut off (what this step is for), or refused: an earlier step's request,
            // cut off on this side, can still reach the store after the check below.
            Err(_) | Ok(Ok(None)) => {}
            // The store is up: an error here is what a cut-off request left behind
            // (a connection in a broken state, say).
            Ok(Err(error)) => panic!("step {step}: the acquire failed: {error}"),
        }
        // Undoing a cut-off acquire happens in the background: wait until the lock is
        // free again (bounded), as the next step expects.
        let free_by = Instant::now() + Duration::from_secs(5);
        while locker.status(&lock).await.unwrap().is_some() {
            assert!(
                Instant::now() < free_by,
                "step {step}: the lock stayed held"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    // The same client takes and releases the lock several times; after each release
    // another client must find it free.
    for round in 0..8 {
        let guard = locker.acquire(&lock, &options(5_000)).await.unwrap();
        assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
        let taken = other
            .try_acquire(&lock, &options(5_000))
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("round {round}: the lock is still held after its release"));
        taken.release().await.unwrap();
    }
}

/// Two processes, each with two tasks running 100 ms critical sections: both make
/// progress. (Hand-overs inside one process are capped; after the cap the process
/// stands back long enough for the other's waiter to get in.)
pub async fn two_processes_with_long_sections_both_make_progress(store: impl TestStore) {
    let lock = name("fair");
    let stop_at = Instant::now() + Duration::from_secs(4);
    let mut tasks = Vec::new();
    for process in 0..2 {
        let locker = store.locker().await;
        for _ in 0..2 {
            let (locker, lock) = (locker.clone(), lock.clone());
            tasks.push(tokio::spawn(async move {
                let mut sections = 0u32;
                while Instant::now() < stop_at {
                    let Ok(guard) = locker
                        .acquire(&lock, &options(5_000).wait(Duration::from_secs(10)))
                        .await
                    else {
                        continue;
                    };
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    guard.release().await.unwrap();
                    sections += 1;
                }
                (process, sections)
            }));
        }
    }
    let mut per_process = [0u32; 2];
    for task in tasks {
        let (process, sections) = task.await.unwrap();
        per_process[process] += sections;
    }
    let (fewest, most) = (
        per_process[0].min(per_process[1]),
        per_process[0].max(per_process[1]),
    );
    assert!(most >= 20, "too few sections ran at all: {per_process:?}");
    assert!(
        f64::from(fewest) / f64::from(most) >= 0.5,
        "one process starved the other: {per_process:?}"
    );
}

/// The notes' paused-holder scenario, for an engine's fenced store: A holds token N and
/// pauses past its lease; B acquires N+1 and writes; A's late write is rejected by the
/// store, and B may write again. `write(token, total)` makes one fenced write of
/// `total` to `resource`; `read()` returns its stored total. An election named after
/// the resource then runs beside it, and neither changes the other's data (on Redis the
/// leader's value and the resource's data once shared one key).
pub async fn a_paused_holders_late_write_is_rejected<W, WriteFut, R, ReadFut>(
    locker: &Locker,
    lease: LockOptions,
    resource: &str,
    write: W,
    read: R,
) where
    W: Fn(turnstile::FencingToken, i64) -> WriteFut,
    WriteFut: Future<Output = turnstile::FenceOutcome>,
    R: Fn() -> ReadFut,
    ReadFut: Future<Output = i64>,
{
    use turnstile::FenceOutcome;
    let lock = name("fenced");
    let a = locker
        .acquire(&lock, &lease.clone().watchdog(false))
        .await
        .unwrap();
    // A pauses (GC, swap) past its lease; B's acquire waits until the store frees it.
    tokio::time::sleep(lease.get_ttl() + Duration::from_millis(100)).await;
    let b = locker.acquire(&lock, &options(5_000)).await.unwrap();
    assert!(b.fencing_token() > a.fencing_token());
    assert_eq!(write(b.fencing_token(), 200).await, FenceOutcome::Applied);
    // A wakes up and writes, believing it still holds the lock.
    assert_eq!(
        write(a.fencing_token(), 100).await,
        FenceOutcome::Rejected {
            highest_seen: b.fencing_token()
        }
    );
    assert_eq!(read().await, 200);
    // The current holder may write again with its own token.
    assert_eq!(write(b.fencing_token(), 250).await, FenceOutcome::Applied);
    assert_eq!(read().await, 250);
    assert_eq!(a.release().await.unwrap(), ReleaseOutcome::HeldByOther);
    let election = turnstile::election::Election::new(locker.clone());
    // A store that keeps no leader values (MySQL) still runs the election, valueless.
    let (mut leadership, value) = match election
        .campaign(resource, "leader-A", &options(5_000))
        .await
    {
        Ok(leadership) => (leadership, Some("leader-A2")),
        Err(error) if error.kind() == ErrorKind::UnsupportedStore => {
            let leadership = election.campaign(resource, "", &options(5_000)).await;
            (leadership.unwrap(), None)
        }
        Err(error) => panic!("campaign failed: {error}"),
    };
    if let Some(value) = value {
        leadership.proclaim(value).await.unwrap();
    }
    assert_eq!(
        read().await,
        250,
        "the leader's value changed the fenced data"
    );
    assert_eq!(write(b.fencing_token(), 300).await, FenceOutcome::Applied);
    let leader = election.leader(resource).await.unwrap().expect("a leader");
    assert_eq!(
        leader.value.as_deref().filter(|value| !value.is_empty()),
        value,
        "the fenced write changed the leader's value"
    );
    leadership.resign().await.unwrap();
    assert_eq!(read().await, 300, "resigning changed the fenced data");
    b.release().await.unwrap();
}

/// Pruning forgets names unused for long enough, leaves held locks alone, and a
/// forgotten name's next token is still larger than its last one.
pub async fn pruning_forgets_unused_names_and_tokens_keep_increasing(store: impl TestStore) {
    let (unused, held) = (name("pruned"), name("kept"));
    let locker = store.locker().await;
    let first = locker.acquire(&unused, &options(5_000)).await.unwrap();
    let first_token = first.fencing_token();
    first.release().await.unwrap();
    let holding = locker.acquire(&held, &options(5_000)).await.unwrap();
    let error = locker.prune(Duration::from_millis(500)).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidOptions);
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let removed = locker.prune(Duration::from_secs(1)).await.unwrap();
    // Redis (and RedLock over it) and etcd keep nothing to prune: their keys expire;
    // ZooKeeper removes empty lock directories itself (container nodes). Every SQL store
    // had a row.
    let description = locker.backend().describe();
    let redis = description.starts_with("redis")
        || description.starts_with("redlock")
        || description.starts_with("etcd")
        || description.starts_with("zk");
    assert!(redis || removed >= 1, "nothing was pruned");
    let status = locker
        .status(&held)
        .await
        .unwrap()
        .expect("a held lock survives pruning");
    assert_eq!(status.fencing_token, Some(holding.fencing_token()));
    let again = locker.acquire(&unused, &options(5_000)).await.unwrap();
    assert!(
        again.fencing_token() > first_token,
        "token {} after pruning, {first_token} before",
        again.fencing_token()
    );
    again.release().await.unwrap();
    holding.release().await.unwrap();
}

/// A client whose runtime dies while it holds a lock (no release, no renewal, no
/// keep-alive: its process is gone) frees the lock when the store ends its session:
/// not before the TTL, and within `within` of the crash.
pub async fn a_crashed_clients_lock_frees_within<S>(store: S, ttl: Duration, within: Duration)
where
    S: TestStore + Clone + Send + 'static,
{
    let lock = name("crash");
    let crashed = (store.clone(), lock.clone());
    let crashed_at = std::thread::spawn(move || {
        let (store, lock) = crashed;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let locker = store.locker().await;
            let guard = locker
                .acquire(&lock, &LockOptions::new().ttl(ttl))
                .await
                .unwrap();
            // Neither released nor dropped: the process is about to vanish.
            std::mem::forget(guard);
            std::mem::forget(locker);
        });
        runtime.shutdown_background();
        std::time::Instant::now()
    })
    .join()
    .unwrap();
    let other = store.locker().await;
    let guard = other
        .acquire(&lock, &LockOptions::new().wait(Duration::from_secs(10)))
        .await
        .unwrap();
    let freed_after = crashed_at.elapsed();
    assert!(
        freed_after >= ttl,
        "the lock came free {freed_after:?} after the crash, before its TTL"
    );
    assert!(
        freed_after < within,
        "the lock came free only {freed_after:?} after the crash (bound {within:?})"
    );
    guard.release().await.unwrap();
}

/// The paused-holder scenario with the protected row in an SQLite database reached by
/// `pool` (the lock store's own, or, for a lock store without a fenced store of its own
/// such as etcd or ZooKeeper, any application database): the write is fenced in the
/// application's own transaction with `fence::sqlite::check_and_record`.
#[cfg(feature = "sqlite")]
pub async fn a_paused_holders_late_write_is_rejected_by_an_sqlite_fence(
    locker: &Locker,
    pool: &sqlx::SqlitePool,
) {
    use turnstile::fence::sqlite as fence;
    fence::create_table(pool).await.unwrap();
    sqlx::query("CREATE TABLE invoices (id TEXT PRIMARY KEY, total INTEGER)")
        .execute(pool)
        .await
        .unwrap();
    let write = |token: turnstile::FencingToken, total: i64| {
        let pool = pool.clone();
        async move {
            let mut transaction = pool.begin().await.unwrap();
            let outcome = fence::check_and_record(&mut transaction, "invoice:1", token)
                .await
                .unwrap();
            if outcome.is_applied() {
                sqlx::query("INSERT OR REPLACE INTO invoices (id, total) VALUES ('invoice:1', ?1)")
                    .bind(total)
                    .execute(&mut *transaction)
                    .await
                    .unwrap();
                transaction.commit().await.unwrap();
            }
            outcome
        }
    };
    let read = || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar("SELECT total FROM invoices")
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let lease = LockOptions::new().ttl(Duration::from_millis(500));
    a_paused_holders_late_write_is_rejected(locker, lease, "invoice:1", write, read).await;
}

/// A store wrapper that counts what reaches the store: which owners asked for the lock
/// (and when), how many release watches and hand-overs there were. Everything is passed
/// on unchanged (a hand-over stays one atomic step where the engine has one).
#[derive(Debug)]
pub struct Counting {
    inner: Arc<dyn LockBackend>,
    attempts: std::sync::Mutex<Vec<(Instant, String)>>,
    answered: Arc<AtomicUsize>,
    watches: AtomicUsize,
    hand_overs: AtomicUsize,
    fail_hand_over: AtomicBool,
    slow_hand_over: std::sync::Mutex<Option<Duration>>,
    slow_release: std::sync::Mutex<Option<Duration>>,
}

impl Counting {
    /// Wraps the store of `locker`; returns a locker over the wrapper (with a local
    /// queue of its own) and the counts.
    pub fn wrap(locker: &Locker) -> (Locker, Arc<Counting>) {
        let counting = Arc::new(Counting {
            inner: locker.backend().clone(),
            attempts: std::sync::Mutex::default(),
            answered: Arc::new(AtomicUsize::new(0)),
            watches: AtomicUsize::new(0),
            hand_overs: AtomicUsize::new(0),
            fail_hand_over: AtomicBool::new(false),
            slow_hand_over: std::sync::Mutex::new(None),
            slow_release: std::sync::Mutex::new(None),
        });
        let backend: Arc<dyn LockBackend> = counting.clone();
        (Locker::from_arc(backend), counting)
    }

    /// Every `try_acquire` so far: when it was sent, by which owner.
    pub fn attempts(&self) -> Vec<(Instant, String)> {
        self.attempts.lock().unwrap().clone()
    }

    /// How many `try_acquire` calls the store has answered.
    pub fn answered(&self) -> usize {
        self.answered.load(Ordering::SeqCst)
    }

    /// How many release watches were opened.
    pub fn watches(&self) -> usize {
        self.watches.load(Ordering::SeqCst)
    }

    /// How many hand-overs were sent.
    pub fn hand_overs(&self) -> usize {
        self.hand_overs.load(Ordering::SeqCst)
    }

    /// Makes the next hand-over fail the way a connection cut after the release ran
    /// fails: the store releases the lock, and the caller gets `StoreUnavailable`.
    pub fn fail_next_hand_over(&self) {
        self.fail_hand_over.store(true, Ordering::SeqCst);
    }

    /// Makes the next release reach the store only after `delay` (a store slow to take
    /// the request: a busy pool, a reconnection).
    pub fn delay_next_release(&self, delay: Duration) {
        *self.slow_release.lock().unwrap() = Some(delay);
    }

    /// Makes the next hand-over answer only after `delay` (a slow store).
    pub fn delay_next_hand_over(&self, delay: Duration) {
        *self.slow_hand_over.lock().unwrap() = Some(delay);
    }
}

impl LockBackend for Counting {
    fn try_acquire<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, turnstile::Result<TryAcquire>> {
        self.attempts
            .lock()
            .unwrap()
            .push((Instant::now(), owner.to_hex()));
        let answered = self.answered.clone();
        let attempt = self.inner.try_acquire(name, owner, ttl);
        Box::pin(async move {
            let answer = attempt.await;
            answered.fetch_add(1, Ordering::SeqCst);
            answer
        })
    }

    fn extend<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, turnstile::Result<ExtendOutcome>> {
        self.inner.extend(name, owner, ttl)
    }

    fn release<'a>(
        &'a self,
        name: &'a LockName,
        owner: &'a OwnerId,
    ) -> BoxFuture<'a, turnstile::Result<ReleaseOutcome>> {
        if let Some(delay) = self.slow_release.lock().unwrap().take() {
            return Box::pin(async move {
                tokio::time::sleep(delay).await;
                self.inner.release(name, owner).await
            });
        }
        self.inner.release(name, owner)
    }

    fn inspect<'a>(
        &'a self,
        name: &'a LockName,
    ) -> BoxFuture<'a, turnstile::Result<Option<LockInfo>>> {
        self.inner.inspect(name)
    }

    fn force_release<'a>(
        &'a self,
        name: &'a LockName,
    ) -> BoxFuture<'a, turnstile::Result<Option<LockInfo>>> {
        self.inner.force_release(name)
    }

    fn watch_releases<'a>(
        &'a self,
        name: &'a LockName,
    ) -> BoxFuture<'a, turnstile::Result<ReleaseWatch>> {
        self.watches.fetch_add(1, Ordering::SeqCst);
        self.inner.watch_releases(name)
    }

    fn keeps_waiters_in_line(&self) -> bool {
        self.inner.keeps_waiters_in_line()
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn migrate(&self) -> BoxFuture<'_, turnstile::Result<()>> {
        self.inner.migrate()
    }

    fn hand_over<'a>(
        &'a self,
        name: &'a LockName,
        from: &'a OwnerId,
        to: &'a OwnerId,
        ttl: Duration,
    ) -> BoxFuture<'a, turnstile::Result<(ReleaseOutcome, TryAcquire)>> {
        self.hand_overs.fetch_add(1, Ordering::SeqCst);
        if let Some(delay) = self.slow_hand_over.lock().unwrap().take() {
            return Box::pin(async move {
                let answer = self.inner.hand_over(name, from, to, ttl).await;
                tokio::time::sleep(delay).await;
                answer
            });
        }
        if self.fail_hand_over.swap(false, Ordering::SeqCst) {
            return Box::pin(async move {
                self.inner.release(name, from).await?;
                Err(turnstile::Error::new(
                    ErrorKind::StoreUnavailable,
                    "injected: the connection was cut after the release",
                ))
            });
        }
        self.inner.hand_over(name, from, to, ttl)
    }
}

/// Waits (bounded) until `condition` holds.
async fn eventually(what: &str, limit: Duration, mut condition: impl FnMut() -> bool) {
    let until = Instant::now() + limit;
    while !condition() {
        assert!(
            Instant::now() < until,
            "{what} did not happen within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Waits (bounded) until the one store contender of a counted locker sleeps: it has
/// asked, subscribed, and had the answer to asking again (the re-check after
/// subscribing). It goes to sleep, offering itself for a hand-over, in the same poll
/// that receives that answer; the short grace covers the hop between threads.
/// A task of this process that waits for `lock` (30 s TTL, waiting up to 20 s).
fn spawn_waiter(
    locker: &Locker,
    lock: &str,
) -> tokio::task::JoinHandle<turnstile::Result<turnstile::lock::LockGuard>> {
    let (locker, lock) = (locker.clone(), lock.to_owned());
    tokio::spawn(async move {
        locker
            .acquire(&lock, &options(30_000).wait(Duration::from_secs(20)))
            .await
    })
}

pub async fn contender_sleeps(counting: &Counting) {
    eventually(
        "the contender waiting at the store",
        Duration::from_secs(5),
        || counting.watches() >= 1 && counting.answered() >= 2,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(20)).await;
}

/// Tasks of one process that start waiting one after another get the lock in that
/// order.
pub async fn local_waiters_are_served_first_come_first_served(store: impl TestStore) {
    let lock = name("fifo");
    let (locker, counting) = Counting::wrap(&store.locker().await);
    let guard = locker.acquire(&lock, &options(30_000)).await.unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for waiter in 0..5 {
        let (locker, lock, order) = (locker.clone(), lock.clone(), order.clone());
        let (started, is_started) = tokio::sync::oneshot::channel();
        waiters.push(tokio::spawn(async move {
            let _ = started.send(());
            let guard = locker
                .acquire(&lock, &options(30_000).wait(Duration::from_secs(20)))
                .await
                .unwrap();
            order.lock().unwrap().push(waiter);
            tokio::time::sleep(Duration::from_millis(10)).await;
            guard.release().await.unwrap();
        }));
        is_started.await.unwrap();
        if waiter == 0 {
            // The first waiter is the one that talks to the store.
            contender_sleeps(&counting).await;
        } else {
            // Its acquire was entered in the same poll that sent `started`; the gap
            // only orders it before the next one.
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }
    guard.release().await.unwrap();
    for waiter in waiters {
        tokio::time::timeout(Duration::from_secs(20), waiter)
            .await
            .expect("a waiter never got the lock")
            .unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
}

/// However many tasks of one process wait for a name, the store sees one contender:
/// one owner asking, one release watch.
pub async fn one_store_contender_per_name_per_process(store: impl TestStore) {
    let lock = name("contender");
    let holder = store.locker().await;
    let guard = holder.acquire(&lock, &options(30_000)).await.unwrap();
    let (locker, counting) = Counting::wrap(&store.locker().await);
    let mut waiters = Vec::new();
    for _ in 0..5 {
        let (locker, lock) = (locker.clone(), lock.clone());
        waiters.push(tokio::spawn(async move {
            let guard = locker
                .acquire(&lock, &options(30_000).wait(Duration::from_secs(20)))
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(5)).await;
            guard.release().await.unwrap();
        }));
    }
    contender_sleeps(&counting).await;
    // A window in which polling engines poll several times, and in which any other
    // waiter that went to the store would show up.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let owners: std::collections::HashSet<String> = counting
        .attempts()
        .into_iter()
        .map(|(_, owner)| owner)
        .collect();
    assert_eq!(
        owners.len(),
        1,
        "several waiters of one process asked the store"
    );
    assert_eq!(
        counting.watches(),
        1,
        "several waiters of one process subscribed"
    );
    guard.release().await.unwrap();
    for waiter in waiters {
        tokio::time::timeout(Duration::from_secs(20), waiter)
            .await
            .expect("a waiter never got the lock")
            .unwrap();
    }
}

/// A hand-over that fails (the store released the lock, then the connection was cut)
/// leaves the queued waiter to take the lock on its own: it gets it promptly, with a
/// larger token, and the releasing holder hears of the failure.
pub async fn a_failed_hand_over_leaves_the_waiter_to_acquire(store: impl TestStore) {
    let lock = name("failedhandover");
    let (locker, counting) = Counting::wrap(&store.locker().await);
    let first = locker.acquire(&lock, &options(30_000)).await.unwrap();
    let first_token = first.fencing_token();
    let next = spawn_waiter(&locker, &lock);
    contender_sleeps(&counting).await;
    counting.fail_next_hand_over();
    let released = first.release().await;
    assert_eq!(counting.hand_overs(), 1, "no hand-over was tried");
    assert_eq!(
        released
            .expect_err("the failed hand-over was reported as a release")
            .kind(),
        ErrorKind::StoreUnavailable
    );
    let next = tokio::time::timeout(Duration::from_secs(5), next)
        .await
        .expect("the waiter did not get the lock after the failed hand-over")
        .expect("the waiter's task failed")
        .expect("the waiter got an error");
    assert!(next.fencing_token() > first_token);
    next.release().await.unwrap();
}

/// A same-process waiter does not keep sleeping behind a local guard whose lease was
/// lost (here broken by an operator) while the guard is still alive: once the guard
/// learns of the loss (its first renewal, TTL/3), the waiter asks the store again and
/// gets the lock, long before the broken lease's TTL.
pub async fn a_waiter_is_not_held_back_by_a_lost_local_guard(store: impl TestStore) {
    let lock = name("lostguard");
    let (locker, counting) = Counting::wrap(&store.locker().await);
    let guard = locker.acquire(&lock, &options(3_000)).await.unwrap();
    let waiter = spawn_waiter(&locker, &lock);
    contender_sleeps(&counting).await;
    let broken_at = Instant::now();
    store
        .locker()
        .await
        .force_release(&lock)
        .await
        .unwrap()
        .expect("it was held");
    let next = tokio::time::timeout(Duration::from_millis(2_500), waiter)
        .await
        .expect("the waiter slept behind the lost guard")
        .unwrap()
        .unwrap();
    assert!(next.fencing_token() > guard.fencing_token());
    // (On stores that announce a break, the waiter may get in before the guard's
    // renewal finds out; the guard learns it all the same.)
    tokio::time::timeout(Duration::from_secs(2), guard.lost())
        .await
        .expect("the broken guard never learned of the loss");
    assert!(broken_at.elapsed() < Duration::from_millis(2_500));
    drop(guard);
    next.release().await.unwrap();
}

/// A waiter whose acquire was dropped while it slept leaves no offer behind: the next
/// release goes to the store instead of handing the lock to nobody.
pub async fn a_dropped_waiter_is_not_handed_the_lock(store: impl TestStore) {
    let lock = name("droppedwaiter");
    let (locker, counting) = Counting::wrap(&store.locker().await);
    let first = locker.acquire(&lock, &options(30_000)).await.unwrap();
    let waiter = spawn_waiter(&locker, &lock);
    contender_sleeps(&counting).await;
    waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    assert_eq!(first.release().await.unwrap(), ReleaseOutcome::Released);
    assert_eq!(
        counting.hand_overs(),
        0,
        "the lock was handed to a dropped waiter"
    );
    let other = store.locker().await;
    let next = other
        .try_acquire(&lock, &options(30_000))
        .await
        .unwrap()
        .expect("the lock was not free after the release");
    next.release().await.unwrap();
}

/// A caller that stops waiting for a release (a timeout around it) before the store
/// took the request still frees the lock: the release goes on without it.
pub async fn a_release_cut_short_by_its_caller_still_releases(store: impl TestStore) {
    let lock = name("cutrelease");
    let (locker, counting) = Counting::wrap(&store.locker().await);
    let guard = locker.acquire(&lock, &options(30_000)).await.unwrap();
    counting.delay_next_release(Duration::from_millis(300));
    let cut = tokio::time::timeout(Duration::from_millis(50), guard.release()).await;
    assert!(cut.is_err(), "the release was not cut short");
    let other = store.locker().await;
    let next = other
        .acquire(&lock, &options(30_000).wait(Duration::from_secs(5)))
        .await
        .expect("the lock stayed held after a release its caller stopped waiting for");
    next.release().await.unwrap();
}

/// A waiter whose hand-over is under way when its wait bound passes (the store is
/// slow to answer the hand-over) gives up at its bound, not when the store answers;
/// the holder then undoes the hand-over, and the lock is free.
pub async fn a_slow_hand_over_does_not_stretch_the_wait_bound(store: impl TestStore) {
    let lock = name("slowhandover");
    let (locker, counting) = Counting::wrap(&store.locker().await);
    let first = locker.acquire(&lock, &options(30_000)).await.unwrap();
    let wait = Duration::from_millis(400);
    let waiter = {
        let (locker, lock) = (locker.clone(), lock.clone());
        tokio::spawn(async move {
            let started = Instant::now();
            let outcome = locker.acquire(&lock, &options(30_000).wait(wait)).await;
            (outcome, started.elapsed())
        })
    };
    contender_sleeps(&counting).await;
    counting.delay_next_hand_over(Duration::from_secs(2));
    let releasing = tokio::spawn(first.release());
    let (outcome, waited) = waiter.await.unwrap();
    assert_eq!(
        outcome.expect_err("the waiter got the lock").kind(),
        ErrorKind::AcquireTimeout
    );
    assert_gave_up_at_the_wait_bound(waited, wait);
    releasing.await.unwrap().unwrap();
    assert_eq!(counting.hand_overs(), 1);
    let other = store.locker().await;
    let next = other
        .acquire(&lock, &options(30_000).wait(Duration::from_secs(5)))
        .await
        .expect("the undone hand-over left the lock held");
    next.release().await.unwrap();
}

/// A release with a task of the same process waiting hands the lock straight over:
/// the next holder gets a new, larger token, and the store knows it as the holder.
pub async fn a_hand_over_issues_a_new_larger_token(store: impl TestStore) {
    let lock = name("handover");
    let (locker, counting) = Counting::wrap(&store.locker().await);
    let first = locker.acquire(&lock, &options(30_000)).await.unwrap();
    let first_owner = first.owner().clone();
    let first_token = first.fencing_token();
    let next = spawn_waiter(&locker, &lock);
    contender_sleeps(&counting).await;
    let asked = counting.attempts().len();
    assert_eq!(first.release().await.unwrap(), ReleaseOutcome::Released);
    let next = tokio::time::timeout(Duration::from_secs(5), next)
        .await
        .expect("the waiter did not get the lock")
        .unwrap()
        .unwrap();
    assert_eq!(counting.hand_overs(), 1, "the lock was not handed over");
    assert_eq!(
        counting.attempts().len(),
        asked,
        "the waiter asked the store again"
    );
    assert!(
        next.fencing_token() > first_token,
        "the hand-over gave token {} after {first_token}",
        next.fencing_token(),
    );
    let status = locker.status(&lock).await.unwrap().expect("held");
    assert_eq!(status.fencing_token, Some(next.fencing_token()));
    assert_eq!(status.owner, next.owner().to_hex());
    // The first owner holds nothing any more.
    assert_eq!(
        locker
            .backend()
            .extend(
                &LockName::new(&lock).unwrap(),
                &first_owner,
                Duration::from_secs(30)
            )
            .await
            .unwrap(),
        ExtendOutcome::Lost(LossReason::TakenOver)
    );
    assert_eq!(next.release().await.unwrap(), ReleaseOutcome::Released);
}

/// The longest poll interval of any engine whose waiters poll (PostgreSQL and MySQL:
/// 100 ms; SQLite: 50 ms).
const LONGEST_POLL_INTERVAL: Duration = Duration::from_millis(100);

/// With tasks of one process handing the lock to each other without a pause, a waiter
/// in another process gets in after at most nine of their sections (the one under way
/// when it started waiting and eight hand-overs), every time. After eight hand-overs
/// the busy process releases the lock to the store and stands back.
///
/// The pause is what a waiter elsewhere needs to notice, but at most an eighth of the
/// run it ends: a notified waiter needs a round trip or two, so 2 ms sections do. A
/// polling waiter needs one of its polls to land in the pause, which it does at every
/// pause only when the pause outlasts its poll interval: the locker's pause for polling
/// stores is one and a half of their longest poll interval, if an eighth of the run
/// allows. So polling engines run sections long enough for that (an eighth of nine of
/// them over 1.5 × [`LONGEST_POLL_INTERVAL`]), and their waiter's poll has half an
/// interval (25 ms on SQLite, 50 ms elsewhere) to reach the store before the pause
/// ends. With short sections a polling waiter gets in only when a poll happens to land
/// in a pause of a few milliseconds: that is chance, not a bound.
pub async fn a_remote_waiter_gets_in_within_nine_local_sections(store: impl TestStore) {
    let notified = store.notifies_other_processes();
    let section = if notified {
        Duration::from_millis(2)
    } else {
        LONGEST_POLL_INTERVAL * 3 / 2
    };
    let lock = name("cap");
    let busy = store.locker().await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let starts = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let (busy, lock, stop, starts) = (busy.clone(), lock.clone(), stop.clone(), starts.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let guard = busy
                    .acquire(&lock, &options(5_000).wait(Duration::from_secs(30)))
                    .await
                    .unwrap();
                starts.lock().unwrap().push(Instant::now());
                tokio::time::sleep(section).await;
                guard.release().await.unwrap();
            }
        }));
    }
    // Long enough for the sections asked for, and 5 s for a loaded machine.
    let at_work_within = |sections: u32| section * sections + Duration::from_secs(5);
    eventually("the busy process at work", at_work_within(20), || {
        starts.lock().unwrap().len() >= 20
    })
    .await;
    let (remote, counting) = Counting::wrap(&store.locker().await);
    for round in 0..3 {
        let asked_before = counting.attempts().len();
        let guard = remote
            .acquire(&lock, &options(5_000).wait(Duration::from_secs(10)))
            .await
            .unwrap_or_else(|error| panic!("round {round}: the remote waiter starved: {error}"));
        let got_in = Instant::now();
        let first_ask = counting.attempts()[asked_before].0;
        let local_sections = starts
            .lock()
            .unwrap()
            .iter()
            .filter(|start| **start > first_ask && **start < got_in)
            .count();
        assert!(
            local_sections <= 9,
            "round {round}: {local_sections} local sections before the remote waiter got in"
        );
        guard.release().await.unwrap();
        // Let the busy process chain hand-overs again before the next round.
        let seen = starts.lock().unwrap().len();
        eventually("the busy process at work again", at_work_within(10), || {
            starts.lock().unwrap().len() >= seen + 10
        })
        .await;
    }
    stop.store(true, Ordering::SeqCst);
    for task in tasks {
        task.await.unwrap();
    }
}

/// Generates one `#[tokio::test]` per conformance check for the store `$make` builds.
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr) => {
        $crate::conformance_tests!(@each $make;
            mutual_exclusion_under_contention,
            expiry_frees_a_crashed_holder,
            a_non_owner_cannot_release_or_extend,
            release_after_expiry_reports_it,
            extend_works,
            watchdog_keeps_the_lock_past_several_ttls,
            lost_signal_fires_when_the_lock_is_taken_away,
            tokens_strictly_increase,
            unfenced_locks_keep_every_guarantee_but_the_token,
            a_waiter_wakes_promptly_after_release,
            cancelled_waiters_leave_nothing_behind,
            acquire_times_out,
            with_lock_cancels_work_when_the_lock_is_lost,
            max_hold_fires_the_lost_signal,
            lease_without_watchdog_signals_at_its_deadline,
            bad_input_is_refused,
            a_guard_can_move_between_tasks,
            dropping_a_guard_releases_it,
            local_waiters_take_turns,
            a_remote_waiter_is_not_starved_by_local_handoffs,
            an_acquire_repeated_by_its_owner_gets_the_lock_it_has,
            cancelled_acquires_leak_no_lock,
            two_processes_with_long_sections_both_make_progress,
            pruning_forgets_unused_names_and_tokens_keep_increasing,
            local_waiters_are_served_first_come_first_served,
            one_store_contender_per_name_per_process,
            a_hand_over_issues_a_new_larger_token,
            a_failed_hand_over_leaves_the_waiter_to_acquire,
            a_dropped_waiter_is_not_handed_the_lock,
            a_waiter_is_not_held_back_by_a_lost_local_guard,
            a_release_cut_short_by_its_caller_still_releases,
            a_slow_hand_over_does_not_stretch_the_wait_bound,
            a_remote_waiter_gets_in_within_nine_local_sections,
            one_leader_at_a_time_with_growing_epochs,
            observers_see_every_change_of_leader,
            a_deposed_leader_knows_before_its_successor_leads,
            election_input_is_checked,
            a_cancelled_campaign_leaves_nothing,
            never_more_holders_than_permits,
            a_crashed_holders_permit_returns_after_its_lease,
            a_waiter_gets_a_released_permit_and_gives_up_at_its_bound,
            clients_that_disagree_on_the_permits_are_refused,
            a_cancelled_wait_takes_no_permit,
            writers_exclude_readers_and_each_other,
            a_waiting_writer_stops_new_readers,
            a_cancelled_writer_lets_readers_in,
        );
    };
    (@each $make:expr; $($check:ident),* $(,)?) => {
        mod conformance_checks {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $check() {
                    conformance::$check($make().await).await;
                }
            )*
        }
    };
}
