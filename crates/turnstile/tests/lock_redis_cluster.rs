//! The Redis engine at scale: on a Redis Cluster (three masters, three replicas) the
//! conformance suite, a slot moving under a held lock and a master failover; behind
//! Redis Sentinel (a master, a replica, three sentinels) a failover under a held lock.

mod conformance;

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::OnceLock;
use std::time::Duration;

use conformance::TestStore;
use tokio::time::Instant;
use turnstile::ErrorKind;
use turnstile::lock::redis::RedisLockStore;
use turnstile::lock::{LockName, LockOptions, Locker, LossReason, ReleaseOutcome};
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
/// the slots), each lock's keys on one master and in one slot, and each lock works. The
/// keys are read from the masters themselves (whatever each acquisition wrote under the
/// store's prefix), so a change of the store's key layout that puts one lock's keys on
/// several masters, or every lock on one, fails here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_spread_over_every_master() {
    let cluster = shared_cluster();
    let prefix = unique_name("spread");
    let url = format!("{}?turnstile_prefix={prefix}", cluster.url());
    let locker = Locker::new(RedisLockStore::connect(&url).await.unwrap());
    let mut masters = HashSet::new();
    for index in 0..30 {
        let name = format!("spread-{index}");
        let before = keys_on_masters(cluster, &prefix).await;
        let guard = locker.acquire(&name, &LockOptions::new()).await.unwrap();
        let after = keys_on_masters(cluster, &prefix).await;
        let written: Vec<&(u16, String)> = after.difference(&before).collect();
        assert!(
            !written.is_empty(),
            "acquiring {name} wrote no key under {prefix} on any master"
        );
        let ports: HashSet<u16> = written.iter().map(|(port, _)| *port).collect();
        assert_eq!(
            ports.len(),
            1,
            "the keys of {name} are on several masters: {written:?}"
        );
        let mut slots = HashSet::new();
        for (port, key) in &written {
            slots.insert(key_slot(*port, key).await);
        }
        assert_eq!(
            slots.len(),
            1,
            "the keys of {name} are in several slots: {written:?}"
        );
        masters.extend(ports);
        guard.release().await.unwrap();
    }
    assert_eq!(
        masters.len(),
        3,
        "locks reached only the masters on {masters:?}"
    );
}

/// Every key under `prefix` on every running master, as (the master's port, key). A
/// replica holds copies of its master's keys, so only masters are asked.
async fn keys_on_masters(cluster: &RedisCluster, prefix: &str) -> HashSet<(u16, String)> {
    let mut found = HashSet::new();
    for node in cluster.nodes().iter().filter(|node| node.pid().is_some()) {
        let client = redis::Client::open(node.url()).unwrap();
        let mut connection = client.get_multiplexed_async_connection().await.unwrap();
        let role: Vec<redis::Value> = redis::cmd("ROLE")
            .query_async(&mut connection)
            .await
            .unwrap();
        let is_master = match role.first() {
            Some(redis::Value::BulkString(role)) => role == b"master",
            Some(redis::Value::SimpleString(role)) => role == "master",
            _ => false,
        };
        if !is_master {
            continue;
        }
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}*"))
            .query_async(&mut connection)
            .await
            .unwrap();
        found.extend(keys.into_iter().map(|key| (node.port(), key)));
    }
    found
}

/// The slot the node on `port` computes for `key`.
async fn key_slot(port: u16, key: &str) -> u16 {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(key)
        .query_async(&mut connection)
        .await
        .unwrap()
}

/// The master holding a lock dies; its replica takes over. Replication is asynchronous,
/// so the lock may or may not survive; either way the store answers at once, what the
/// holder is told matches what the new master has (see `held_or_lost_after_failover`),
/// the next holder's token is larger than the first holder's, and the store keeps
/// working.
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
    // The master to kill is the one that has the lock's keys.
    let (_, key) = keys_on_masters(&cluster, "failover:")
        .await
        .into_iter()
        .next()
        .expect("the lock wrote no key");
    cluster.fail_over(&key, Duration::from_secs(30));
    held_or_lost_after_failover(&url, &locker, guard, token, ttl).await;
    let next = locker
        .acquire("job", &LockOptions::new().wait(Duration::from_secs(10)))
        .await
        .unwrap();
    assert!(next.fencing_token() > token);
    next.release().await.unwrap();
}

/// `RedisLockConfig`'s connect and response timeouts (its defaults, which these stores
/// use): the shortest time any of the engine's waits can take to give up.
const ENGINE_TIMEOUT: Duration = Duration::from_secs(3);

/// How late after its local deadline a `RenewalFailed` signal may be seen (the
/// watchdog's timer and this test's polling).
const DEADLINE_SLACK: Duration = Duration::from_millis(150);

/// After a failover under `guard` (a lock on `job` with `token` and `ttl`, taken
/// through `locker`), called once the new master takes writes; releases the lock if it
/// survived. What must then be true:
/// - The store answers at once: the first call succeeds, sooner than any of the
///   engine's timeouts could have run out. Every server here is on loopback, where a
///   dead one refuses a connection at once and a live one answers at once, so a call
///   that needed a timeout to expire, or a second try, did not follow the failover by
///   itself.
/// - If the promoted replica had the lock, it is the same lease (owner and token): a
///   renewal goes through on the new master, another client is still kept out, and the
///   holder's release finds its lock.
/// - If the lock was lost, the holder's lost signal fires by its local deadline, which
///   no renewal can move any more (at the deadline: `RenewalFailed`), or sooner, when a
///   renewal finds the lock gone (`Expired`, `TakenOver`). Another client then gets
///   the lock at once, with a larger token.
///
/// A renewal reaches the new master within TTL/3 + [`ENGINE_TIMEOUT`] of the store
/// answering: the watchdog tries at least every TTL/3 (sooner after an error), and a
/// try still waiting on the dead master gives up within a timeout.
async fn held_or_lost_after_failover(
    url: &str,
    locker: &Locker,
    guard: turnstile::LockGuard,
    token: turnstile::FencingToken,
    ttl: Duration,
) {
    let asked = Instant::now();
    let status = locker
        .status("job")
        .await
        .unwrap_or_else(|error| panic!("the first call after the failover failed: {error}"));
    let answered = Instant::now();
    eprintln!(
        "the store answered {:?} after the failover",
        answered - asked
    );
    assert!(
        answered - asked < ENGINE_TIMEOUT,
        "the first call after the failover took {:?}",
        answered - asked
    );
    let renewal_by = answered + ttl / 3 + ENGINE_TIMEOUT;
    let other = Locker::new(RedisLockStore::connect(url).await.unwrap());
    match status {
        Some(info) => {
            eprintln!("the promoted replica had the lock");
            assert_eq!(info.fencing_token, Some(token));
            assert_eq!(info.owner, guard.owner().to_hex());
            // A renewal that ends after this moment went to the new master.
            let before = guard.valid_until();
            while guard.valid_until() <= before {
                assert!(
                    !guard.is_lost(),
                    "the holder lost a lock the new master has: {:?}",
                    guard.loss_reason()
                );
                assert!(
                    Instant::now() < renewal_by,
                    "no renewal reached the new master within {:?}",
                    renewal_by - answered
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert!(
                other
                    .try_acquire("job", &LockOptions::new())
                    .await
                    .unwrap()
                    .is_none(),
                "another client got the lock the new master has"
            );
            assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
        }
        None => {
            // The lock is gone, so no renewal can move the deadline any more.
            let deadline = guard.valid_until();
            let give_up = (deadline + DEADLINE_SLACK).min(renewal_by);
            while !guard.is_lost() {
                assert!(
                    Instant::now() < give_up,
                    "the holder's lost signal did not fire by its deadline, nor at a \
                     renewal after the store answered again"
                );
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let seen = Instant::now();
            let reason = guard.loss_reason().expect("lost");
            eprintln!("the lock was lost in the failover ({reason:?})");
            match reason {
                LossReason::Expired | LossReason::TakenOver => {}
                LossReason::RenewalFailed => assert!(
                    seen + Duration::from_millis(1) >= deadline,
                    "RenewalFailed {:?} before the local deadline",
                    deadline - seen
                ),
                other => panic!("the holder lost its lock with {other:?}"),
            }
            let next = other
                .try_acquire("job", &LockOptions::new())
                .await
                .unwrap()
                .expect("the lost lock is still held");
            assert!(next.fencing_token() > token);
            next.release().await.unwrap();
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
    // The lock's keys as the store wrote them: in slot 0, or this test moves nothing.
    let written = keys_on_masters(cluster, "moving:").await;
    let (port, key) = written
        .iter()
        .find(|(_, key)| key.contains(&name))
        .cloned()
        .unwrap_or_else(|| panic!("no key of {name} on any master: {written:?}"));
    assert_eq!(
        key_slot(port, &key).await,
        0,
        "{key} is not in {name}'s slot"
    );
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
/// store asks the sentinels again and works on the new master at once (the lock kept or
/// lost as replication had it, the next token larger), and release notifications come
/// from the new master: a client that listened on the old master subscribes on the new
/// one and gets the lock promptly after a release.
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
    // Another client, listening for releases on the old master before the failover:
    // its Pub/Sub connection has to follow the master (a client made afterwards would
    // find the new master by itself).
    let other_store = RedisLockStore::connect(&url).await.unwrap();
    let channel = other_store.release_channel(&LockName::new("job").unwrap());
    let other = Locker::new(other_store);
    let refused = other
        .acquire("job", &LockOptions::new().wait(Duration::from_millis(200)))
        .await
        .expect_err("the lock is held");
    assert_eq!(refused.kind(), ErrorKind::AcquireTimeout, "{refused}");
    // The group comes back from the blocking task: dropping it would stop every server.
    let group = tokio::task::spawn_blocking(move || {
        group.fail_over(Duration::from_secs(30));
        group
    })
    .await
    .unwrap();
    held_or_lost_after_failover(&url, &locker, guard, token, ttl).await;
    // Notifications from the new master: the other client's waiter subscribes there,
    // and gets the lock promptly after the holder's release.
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
    let new_master =
        redis::Client::open(format!("redis://127.0.0.1:{}", group.master_port())).unwrap();
    let mut admin = new_master.get_multiplexed_async_connection().await.unwrap();
    let subscribed_by = Instant::now() + Duration::from_secs(5);
    loop {
        let (_, subscribers): (String, i64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(&channel)
            .query_async(&mut admin)
            .await
            .unwrap();
        if subscribers > 0 {
            break;
        }
        assert!(
            Instant::now() < subscribed_by,
            "the waiter never subscribed to {channel} on the new master"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
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
