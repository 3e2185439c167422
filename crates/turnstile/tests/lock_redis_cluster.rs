//! The Redis engine at scale: on a Redis Cluster (three masters, three replicas) the
//! conformance suite, a slot moving under a held lock and a master failover; behind
//! Redis Sentinel (a master, a replica, three sentinels) a failover under a held lock.

mod conformance;

use std::future::Future;
use std::pin::Pin;
use std::sync::OnceLock;
use std::time::Duration;

use conformance::TestStore;
use turnstile::lock::redis::RedisLockStore;
use turnstile::lock::{LockOptions, Locker, LossReason};
use turnstile_test_support::{RedisCluster, RedisSentinelGroup, unique_name};

/// One cluster for the whole binary (six servers).
fn shared_cluster() -> &'static RedisCluster {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    CLUSTER.get_or_init(RedisCluster::spawn)
}

struct Shared {
    url: String,
}

impl TestStore for Shared {
    fn locker(&self) -> Pin<Box<dyn Future<Output = Locker> + Send + '_>> {
        Box::pin(async move { Locker::new(RedisLockStore::connect(&self.url).await.unwrap()) })
    }
}

async fn shared() -> Shared {
    Shared {
        url: format!(
            "{}?turnstile_prefix={}",
            shared_cluster().url(),
            unique_name("t")
        ),
    }
}

conformance_tests!(super::shared);

/// The conformance suite again, behind Sentinel.
mod behind_sentinel {
    use super::*;

    /// One group for the whole binary (two servers, three sentinels).
    fn shared_group() -> &'static RedisSentinelGroup {
        static GROUP: OnceLock<RedisSentinelGroup> = OnceLock::new();
        GROUP.get_or_init(RedisSentinelGroup::spawn)
    }

    pub(super) async fn shared() -> Shared {
        Shared {
            url: format!(
                "{}?turnstile_prefix={}",
                shared_group().url(),
                unique_name("s")
            ),
        }
    }

    conformance_tests!(super::shared);
}

/// Locks on many names land on every master (the `{name}` hash tag spreads them over
/// the slots), and each works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_spread_over_every_master() {
    let cluster = shared_cluster();
    let store = shared().await;
    let locker = store.locker().await;
    let mut masters = std::collections::HashSet::new();
    for index in 0..30 {
        let name = format!("spread-{index}");
        let guard = locker.acquire(&name, &LockOptions::new()).await.unwrap();
        let key = format!("x:{{{name}}}:lock");
        masters.insert(cluster.master_of(&key).port());
        guard.release().await.unwrap();
    }
    assert_eq!(masters.len(), 3, "locks reached only {masters:?}");
}

/// The master holding a lock dies; its replica takes over. Replication is asynchronous,
/// so the lock may or may not survive: if it vanished, the holder's lost signal fires
/// (within TTL/3 of the failover); either way, the next holder's token is larger than
/// the first holder's, and the store keeps working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_failover_keeps_tokens_growing_and_the_store_working() {
    let cluster = RedisCluster::spawn();
    let url = format!("{}?turnstile_prefix=failover", cluster.url());
    let locker = Locker::new(RedisLockStore::connect(&url).await.unwrap());
    // Longer than a failover takes (detection after the 1 s node timeout, then the
    // election), so that renewals can resume on the new master before the deadline.
    let ttl = Duration::from_secs(10);
    let guard = locker
        .acquire("job", &LockOptions::new().ttl(ttl))
        .await
        .unwrap();
    let token = guard.fencing_token();
    // Let the replica catch up, as it usually has; the failover may still lose it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    cluster.fail_over("failover:{job}:lock", Duration::from_secs(30));
    // Whatever the failover kept, the store answers again.
    held_or_lost_after_failover(&locker, guard, token, ttl).await;
    let next = locker
        .acquire("job", &LockOptions::new().wait(Duration::from_secs(10)))
        .await
        .unwrap();
    assert!(next.fencing_token() > token);
    next.release().await.unwrap();
}

/// After a failover under `guard` (a lock on `job` with `token` and `ttl`): the store
/// answers again within 20 s, and either the promoted replica had the lock (same
/// token; renewals reach the new master, so it is still held half a TTL later) or the
/// lock was lost and the holder's lost signal fires within the TTL — found gone by a
/// renewal, or (a failover slower than the TTL on a loaded machine) renewals failing
/// until the deadline. Releases the lock if it survived.
async fn held_or_lost_after_failover(
    locker: &Locker,
    guard: turnstile::LockGuard,
    token: turnstile::FencingToken,
    ttl: Duration,
) {
    let status = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match locker.status("job").await {
                Ok(status) => return status,
                Err(error) => eprintln!("after the failover: {error}"),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("the store did not answer within 20 s of the failover");
    match status {
        Some(info) => {
            eprintln!("the promoted replica had the lock");
            assert_eq!(info.fencing_token, token);
            tokio::time::sleep(ttl / 2).await;
            assert!(!guard.is_lost(), "{:?}", guard.loss_reason());
            guard.release().await.unwrap();
        }
        None => {
            let reason = tokio::time::timeout(ttl, guard.lost())
                .await
                .expect("the holder's lost signal did not fire");
            eprintln!("the lock was lost in the failover ({reason:?})");
            assert!(
                matches!(
                    reason,
                    LossReason::Expired | LossReason::TakenOver | LossReason::RenewalFailed
                ),
                "{reason:?}"
            );
        }
    }
}

/// CRC16 (XMODEM), as Redis Cluster hashes keys into slots.
fn slot_of(tag: &str) -> u16 {
    let mut crc: u16 = 0;
    for byte in tag.bytes() {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16_384
}

/// A held lock's slot moves to another master (`redis-cli --cluster reshard`, keys
/// included): the client follows the `MOVED` redirections, so renewals keep the lock,
/// a second client stays out, the release works, and the next token is larger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lock_survives_its_slot_moving_to_another_master() {
    let cluster = shared_cluster();
    // A name in slot 0, the first of its master's range, which reshard moves first.
    let name = (0..)
        .map(|index| format!("moving-{index}"))
        .find(|name| slot_of(name) == 0)
        .unwrap();
    let url = format!("{}?turnstile_prefix=moving", cluster.url());
    let holder = Locker::new(RedisLockStore::connect(&url).await.unwrap());
    let other = Locker::new(RedisLockStore::connect(&url).await.unwrap());
    let ttl = Duration::from_secs(2);
    let guard = holder
        .acquire(&name, &LockOptions::new().ttl(ttl))
        .await
        .unwrap();
    let token = guard.fencing_token();
    let key = format!("moving:{{{name}}}:lock");
    let cluster_ref = cluster;
    let key_for_move = key.clone();
    tokio::task::spawn_blocking(move || cluster_ref.move_slot_of(&key_for_move))
        .await
        .unwrap();
    // Past several renewals after the move.
    tokio::time::sleep(ttl * 2).await;
    assert!(!guard.is_lost(), "{:?}", guard.loss_reason());
    assert!(
        other
            .try_acquire(&name, &LockOptions::new())
            .await
            .unwrap()
            .is_none()
    );
    guard.release().await.unwrap();
    let next = other
        .acquire(&name, &LockOptions::new().wait(Duration::from_secs(5)))
        .await
        .unwrap();
    assert!(next.fencing_token() > token);
    next.release().await.unwrap();
}

/// Behind Sentinel, the master dies under a held lock and the replica is promoted: the
/// store asks the sentinels again and works on the new master (the lock kept or lost as
/// replication had it, the next token larger), and release notifications come from the
/// new master: a waiter gets the lock promptly after a release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_store_follows_the_master_across_a_failover() {
    let group = RedisSentinelGroup::spawn();
    let url = format!("{}?turnstile_prefix=sentinel", group.url());
    let locker = Locker::new(RedisLockStore::connect(&url).await.unwrap());
    // Longer than a failover takes here (a second or two), so renewals can resume on
    // the new master before the holder's deadline.
    let ttl = Duration::from_secs(10);
    let guard = locker
        .acquire("job", &LockOptions::new().ttl(ttl))
        .await
        .unwrap();
    let token = guard.fencing_token();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The group comes back from the blocking task: dropping it would stop every server.
    let _group = tokio::task::spawn_blocking(move || {
        group.fail_over(Duration::from_secs(30));
        group
    })
    .await
    .unwrap();
    held_or_lost_after_failover(&locker, guard, token, ttl).await;
    // Notifications from the new master: a waiter in another client gets the lock
    // promptly after the holder's release.
    let other = Locker::new(RedisLockStore::connect(&url).await.unwrap());
    let holder = locker
        .acquire("job", &LockOptions::new().wait(Duration::from_secs(10)))
        .await
        .unwrap();
    assert!(holder.fencing_token() > token);
    let waiter = tokio::spawn(async move {
        let guard = other
            .acquire("job", &LockOptions::new().wait(Duration::from_secs(10)))
            .await
            .unwrap();
        (tokio::time::Instant::now(), guard)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released_at = tokio::time::Instant::now();
    let last_token = holder.fencing_token();
    holder.release().await.unwrap();
    let (got_at, guard) = waiter.await.unwrap();
    assert!(
        got_at - released_at < Duration::from_millis(500),
        "the waiter got the lock {:?} after the release",
        got_at - released_at
    );
    assert!(guard.fencing_token() > last_token);
    guard.release().await.unwrap();
}
