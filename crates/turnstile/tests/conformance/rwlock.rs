//! The read-write lock section of the conformance suite, on every engine that keeps
//! semaphores (RedLock refuses them, and so read-write locks).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Mutex;
use turnstile::ErrorKind;
use turnstile::lock::LockOptions;
use turnstile::rwlock::RwLock;

use super::{TestStore, name};

fn rw_options() -> LockOptions {
    LockOptions::new()
        .ttl(Duration::from_secs(5))
        .wait(Duration::from_secs(30))
}

/// Whether the store keeps read-write locks; on one that does not (RedLock), checks
/// that it refuses them with a clear error.
async fn keeps_rwlocks(locks: &RwLock, lock_name: &str) -> bool {
    match locks.read(lock_name, 4, &rw_options()).await {
        Ok(guard) => {
            guard.release().await.unwrap();
            true
        }
        Err(error) => {
            assert_eq!(error.kind(), ErrorKind::UnsupportedStore, "{error}");
            false
        }
    }
}

/// Readers and writers in three clients (stand-ins for three processes) take the lock
/// over and over: a writer is never inside with a reader or another writer, readers
/// are inside together at times, and writers' tokens grow in the order they wrote.
pub async fn writers_exclude_readers_and_each_other(store: impl TestStore) {
    let lock_name = name("rwlock");
    if !keeps_rwlocks(
        &RwLock::new(store.locker().await),
        &format!("{lock_name}-probe"),
    )
    .await
    {
        return;
    }
    let readers = Arc::new(AtomicUsize::new(0));
    let most_readers = Arc::new(AtomicUsize::new(0));
    let writing = Arc::new(AtomicBool::new(false));
    let violations = Arc::new(AtomicUsize::new(0));
    let writer_tokens = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let locks = RwLock::new(store.locker().await);
        for role in ["reader", "reader", "writer"] {
            let (locks, lock_name) = (locks.clone(), lock_name.clone());
            let (readers, most_readers, writing, violations, writer_tokens) = (
                readers.clone(),
                most_readers.clone(),
                writing.clone(),
                violations.clone(),
                writer_tokens.clone(),
            );
            tasks.push(tokio::spawn(async move {
                for _ in 0..3 {
                    if role == "reader" {
                        let guard = locks.read(&lock_name, 4, &rw_options()).await.unwrap();
                        let now = readers.fetch_add(1, Ordering::SeqCst) + 1;
                        most_readers.fetch_max(now, Ordering::SeqCst);
                        if writing.load(Ordering::SeqCst) {
                            violations.fetch_add(1, Ordering::SeqCst);
                        }
                        tokio::time::sleep(Duration::from_millis(30)).await;
                        readers.fetch_sub(1, Ordering::SeqCst);
                        guard.release().await.unwrap();
                    } else {
                        let guard = locks.write(&lock_name, 4, &rw_options()).await.unwrap();
                        if writing.swap(true, Ordering::SeqCst)
                            || readers.load(Ordering::SeqCst) != 0
                        {
                            violations.fetch_add(1, Ordering::SeqCst);
                        }
                        writer_tokens.lock().await.push(guard.fencing_token());
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        writing.store(false, Ordering::SeqCst);
                        guard.release().await.unwrap();
                    }
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(
        violations.load(Ordering::SeqCst),
        0,
        "a writer was inside with a reader or another writer"
    );
    assert!(
        most_readers.load(Ordering::SeqCst) >= 2,
        "readers never shared the lock"
    );
    let tokens = writer_tokens.lock().await;
    assert_eq!(tokens.len(), 9);
    for pair in tokens.windows(2) {
        assert!(
            pair[1] > pair[0],
            "writer token {} after {}",
            pair[1].get(),
            pair[0].get()
        );
    }
}

/// Once a writer waits, a new reader waits too (no writer starvation): the writer gets
/// in when the reader inside leaves, with a token above that reader's, and the new
/// reader after it, with a token above the writer's.
pub async fn a_waiting_writer_stops_new_readers(store: impl TestStore) {
    let lock_name = name("rw-priority");
    let first = RwLock::new(store.locker().await);
    if !keeps_rwlocks(&first, &format!("{lock_name}-probe")).await {
        return;
    }
    let writer_client = RwLock::new(store.locker().await);
    let late_reader = RwLock::new(store.locker().await);
    let reading = first.read(&lock_name, 4, &rw_options()).await.unwrap();
    let read_token = reading.fencing_token();
    let writer = tokio::spawn({
        let lock_name = lock_name.clone();
        async move { writer_client.write(&lock_name, 4, &rw_options()).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!writer.is_finished(), "a writer got in beside a reader");
    let refused = late_reader
        .read(
            &lock_name,
            4,
            &rw_options().wait(Duration::from_millis(300)),
        )
        .await
        .unwrap_err();
    assert_eq!(
        refused.kind(),
        ErrorKind::AcquireTimeout,
        "a new reader got in while a writer waited: {refused}"
    );
    reading.release().await.unwrap();
    let writing = tokio::time::timeout(Duration::from_secs(10), writer)
        .await
        .expect("the writer never got in after the reader left")
        .unwrap()
        .unwrap();
    assert!(writing.fencing_token() > read_token);
    let write_token = writing.fencing_token();
    writing.release().await.unwrap();
    let reading = late_reader
        .read(&lock_name, 4, &rw_options())
        .await
        .unwrap();
    assert!(reading.fencing_token() > write_token);
    reading.release().await.unwrap();
}

/// A writer dropped while it waits for a reader to leave holds the writer gate; it
/// must leave it behind: a new reader gets in within a moment, not after the gate's
/// lease, and once everyone has left a writer gets in without waiting for a lease.
pub async fn a_cancelled_writer_lets_readers_in(store: impl TestStore) {
    let lock_name = name("rw-cancel");
    let reader = RwLock::new(store.locker().await);
    if !keeps_rwlocks(&reader, &format!("{lock_name}-probe")).await {
        return;
    }
    let cancelled = RwLock::new(store.locker().await);
    let second_reader = RwLock::new(store.locker().await);
    let reading = reader.read(&lock_name, 4, &rw_options()).await.unwrap();
    let options = rw_options();
    let writing = cancelled.write(&lock_name, 4, &options);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), writing)
            .await
            .is_err(),
        "a writer got in beside a reader"
    );
    // The gate's lease is 5 s: a reader in within 3 s got in because the gate was let go.
    let started = std::time::Instant::now();
    let second = second_reader
        .read(&lock_name, 4, &rw_options().wait(Duration::from_secs(3)))
        .await
        .expect("a cancelled writer left the gate held");
    assert!(started.elapsed() < Duration::from_secs(3));
    second.release().await.unwrap();
    reading.release().await.unwrap();
    // The cancelled writer's permits are given back by background tasks, which may
    // still be on their way: a writer waits for them, but well within their 5 s lease.
    let started = std::time::Instant::now();
    let writer = cancelled
        .write(&lock_name, 4, &rw_options().wait(Duration::from_secs(3)))
        .await
        .expect("the cancelled writer's permits were left held until their lease");
    assert!(started.elapsed() < Duration::from_secs(3));
    writer.release().await.unwrap();
}
