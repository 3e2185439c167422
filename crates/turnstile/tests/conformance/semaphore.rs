//! The semaphore section of the conformance suite: leased semaphores on every lock
//! engine that can store their number of permits (RedLock refuses them).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use turnstile::ErrorKind;
use turnstile::lock::{LockOptions, ReleaseOutcome};
use turnstile::semaphore::Semaphore;

use super::{TestStore, name};

fn permit_options(ttl_ms: u64) -> LockOptions {
    LockOptions::new()
        .ttl(Duration::from_millis(ttl_ms))
        .wait(Duration::from_secs(30))
}

/// Whether the store keeps semaphores; on one that does not (RedLock), checks that it
/// refuses them with a clear error.
async fn keeps_semaphores(semaphore: &Semaphore, semaphore_name: &str) -> bool {
    match semaphore.declare_permits(semaphore_name, 1).await {
        Ok(_) => true,
        Err(error) => {
            assert_eq!(error.kind(), ErrorKind::UnsupportedStore, "{error}");
            assert_eq!(
                semaphore
                    .acquire(semaphore_name, 1, &permit_options(5_000))
                    .await
                    .unwrap_err()
                    .kind(),
                ErrorKind::UnsupportedStore
            );
            false
        }
    }
}

/// Nine tasks in three clients (stand-ins for three processes) take permits of a
/// semaphore with three over and over: never more than three hold at once (a shared
/// count checked at every entry), and more than one do at times (it is no mutex).
pub async fn never_more_holders_than_permits(store: impl TestStore) {
    let semaphore_name = name("semaphore");
    let probe = Semaphore::new(store.locker().await);
    if !keeps_semaphores(&probe, &format!("{semaphore_name}-probe")).await {
        return;
    }
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let semaphore = Semaphore::new(store.locker().await);
        for _ in 0..3 {
            let (semaphore, semaphore_name) = (semaphore.clone(), semaphore_name.clone());
            let (inside, most) = (inside.clone(), most.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..4 {
                    let permit = semaphore
                        .acquire(&semaphore_name, 3, &permit_options(5_000))
                        .await
                        .unwrap();
                    assert!(permit.slot() < 3);
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    assert_eq!(permit.release().await.unwrap(), ReleaseOutcome::Released);
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    let most = most.load(Ordering::SeqCst);
    assert!(most <= 3, "{most} holders at once with 3 permits");
    assert!(
        most >= 2,
        "never more than one holder at once: a mutex, not a semaphore"
    );
}

/// A holder that vanishes without releasing (its permit detached: nobody renews it)
/// gives its permit back when the lease ends, and a waiter then gets it; while every
/// permit is held a try answers `None`.
pub async fn a_crashed_holders_permit_returns_after_its_lease(store: impl TestStore) {
    let semaphore_name = name("crashed-permit");
    let crashed = Semaphore::new(store.locker().await);
    if !keeps_semaphores(&crashed, &format!("{semaphore_name}-probe")).await {
        return;
    }
    let waiter = Semaphore::new(store.locker().await);
    let ttl = Duration::from_millis(800);
    let mut held = Vec::new();
    for _ in 0..2 {
        let permit = crashed
            .acquire(&semaphore_name, 2, &LockOptions::new().ttl(ttl))
            .await
            .unwrap();
        held.push(permit.into_guard().detach());
    }
    assert!(
        waiter
            .try_acquire(&semaphore_name, 2, &permit_options(5_000))
            .await
            .unwrap()
            .is_none(),
        "a third holder got in with both permits held"
    );
    let started = Instant::now();
    let permit = waiter
        .acquire(&semaphore_name, 2, &permit_options(5_000))
        .await
        .unwrap();
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(10),
        "the permit came back only after {waited:?}"
    );
    permit.release().await.unwrap();
}

/// A waiter in another client gets the permit a release gives back, and its wait bound
/// is kept when none comes.
pub async fn a_waiter_gets_a_released_permit_and_gives_up_at_its_bound(store: impl TestStore) {
    let semaphore_name = name("waited-permit");
    let holder = Semaphore::new(store.locker().await);
    if !keeps_semaphores(&holder, &format!("{semaphore_name}-probe")).await {
        return;
    }
    let waiter = Semaphore::new(store.locker().await);
    let permit = holder
        .acquire(&semaphore_name, 1, &permit_options(5_000))
        .await
        .unwrap();
    let wait = Duration::from_millis(300);
    let started = Instant::now();
    let refused = waiter
        .acquire(&semaphore_name, 1, &permit_options(5_000).wait(wait))
        .await
        .unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::AcquireTimeout, "{refused}");
    super::assert_returned_by_the_wait_bound(started.elapsed(), wait);

    let waiting = tokio::spawn({
        let (waiter, semaphore_name) = (waiter.clone(), semaphore_name.clone());
        async move {
            waiter
                .acquire(&semaphore_name, 1, &permit_options(5_000))
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiting.is_finished(), "the waiter got a held permit");
    permit.release().await.unwrap();
    let permit = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the waiter never got the released permit")
        .unwrap()
        .unwrap();
    permit.release().await.unwrap();
}

/// The number of permits is the store's: a client that asks for another gets an error
/// that names the stored number, until the number is forgotten. Bad numbers are refused.
pub async fn clients_that_disagree_on_the_permits_are_refused(store: impl TestStore) {
    let semaphore_name = name("disputed");
    let first = Semaphore::new(store.locker().await);
    if !keeps_semaphores(&first, &format!("{semaphore_name}-probe")).await {
        return;
    }
    let second = Semaphore::new(store.locker().await);
    let options = permit_options(5_000);
    let permit = first.acquire(&semaphore_name, 2, &options).await.unwrap();
    let refused = second
        .acquire(&semaphore_name, 4, &options)
        .await
        .unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::InvalidOptions);
    assert!(refused.to_string().contains("has 2 permits"), "{refused}");
    permit.release().await.unwrap();
    assert_eq!(
        second.forget_permits(&semaphore_name).await.unwrap(),
        Some(2)
    );
    let permit = second.acquire(&semaphore_name, 4, &options).await.unwrap();
    permit.release().await.unwrap();
    for bad in [0, turnstile::semaphore::MAX_PERMITS + 1] {
        assert_eq!(
            second
                .acquire(&name("bad-permits"), bad, &options)
                .await
                .unwrap_err()
                .kind(),
            ErrorKind::InvalidOptions
        );
    }
    assert_eq!(
        second
            .acquire("x".repeat(turnstile::lock::MAX_NAME_LEN), 2, &options)
            .await
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidName
    );
}

/// A waiter dropped while every permit is held takes nothing with it: once the holder
/// releases, another client gets the permit within a moment (anything the cancelled
/// wait took meanwhile is released in the background), and after that client releases
/// the store shows no holder.
pub async fn a_cancelled_wait_takes_no_permit(store: impl TestStore) {
    let semaphore_name = name("semaphore-cancel");
    let holder = Semaphore::new(store.locker().await);
    if !keeps_semaphores(&holder, &format!("{semaphore_name}-probe")).await {
        return;
    }
    let cancelled = Semaphore::new(store.locker().await);
    let later = Semaphore::new(store.locker().await);
    let held = holder
        .acquire(&semaphore_name, 1, &permit_options(10_000))
        .await
        .unwrap();
    let options = permit_options(10_000);
    let waiting = cancelled.acquire(&semaphore_name, 1, &options);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), waiting)
            .await
            .is_err(),
        "a waiter got a permit that was held"
    );
    assert_eq!(held.release().await.unwrap(), ReleaseOutcome::Released);
    let started = Instant::now();
    let next = later
        .acquire(
            &semaphore_name,
            1,
            &permit_options(10_000).wait(Duration::from_secs(5)),
        )
        .await
        .expect("the permit a cancelled waiter left must be free");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    let holders = later.holders(&semaphore_name, 1).await.unwrap();
    assert_eq!(holders.len(), 1);
    assert_eq!(holders[0].1.owner, next.owner().as_str());
    next.release().await.unwrap();
    assert!(later.holders(&semaphore_name, 1).await.unwrap().is_empty());
}
