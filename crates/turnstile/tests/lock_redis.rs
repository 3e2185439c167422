//! The Redis engine: the conformance suite against a real redis-server, plus faults.

mod conformance;
mod faults;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use conformance::TestStore;
use turnstile::ErrorKind;
use turnstile::fence::FenceOutcome;
use turnstile::fence::redis::RedisFencedStore;
use turnstile::lock::redis::{RedisLockConfig, RedisLockStore};
use turnstile::lock::{LockName, LockOptions, Locker, LossReason, ReleaseOutcome};
use turnstile_test_support::{
    RedisSentinelGroup, RedisServer, TcpProxy, shared_redis, unique_name,
};

/// Clients of one Redis server under a key prefix of their own.
struct RedisPrefix {
    url: String,
    prefix: String,
}

impl TestStore for RedisPrefix {
    fn locker(&self) -> Pin<Box<dyn Future<Output = Locker> + Send + '_>> {
        Box::pin(async move { Locker::new(connect(&self.url, &self.prefix).await) })
    }
}

async fn connect(url: &str, prefix: &str) -> RedisLockStore {
    RedisLockStore::connect_with(url, RedisLockConfig::new().prefix(prefix))
        .await
        .unwrap()
}

async fn shared() -> RedisPrefix {
    RedisPrefix {
        url: shared_redis().url(),
        prefix: unique_name("t"),
    }
}

conformance_tests!(super::shared);

/// How late past a timer a test may see it fire: the scheduling of a loaded two-core
/// machine.
const SCHEDULING_SLACK: Duration = Duration::from_millis(150);

fn short_lease() -> LockOptions {
    LockOptions::new()
        .ttl(Duration::from_secs(1))
        .wait(Duration::from_secs(5))
}

/// A server that dies leaves its holder unable to renew: the lost signal fires with
/// `RenewalFailed` at the local deadline, not before and not much after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_server_fires_the_lost_signal() {
    let server = RedisServer::spawn();
    let locker = Locker::new(RedisLockStore::connect(&server.url()).await.unwrap());
    let guard = locker.acquire("job", &short_lease()).await.unwrap();
    faults::right_after_a_renewal(&guard, short_lease().get_ttl()).await;
    server.kill();
    // No renewal can succeed from here on: this is the deadline.
    let deadline = guard.valid_until();
    assert!(!guard.is_lost());
    let (reason, seen) = faults::first_seen_lost(&guard, short_lease().get_ttl()).await;
    assert_eq!(reason, LossReason::RenewalFailed);
    faults::assert_at_deadline(seen, deadline);
}

/// A frozen server (SIGSTOP: connections open, nothing answers) is the same: the lost
/// signal fires with `RenewalFailed` at the local deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pausing_the_server_fires_the_lost_signal_at_the_deadline() {
    let server = RedisServer::spawn();
    let locker = Locker::new(RedisLockStore::connect(&server.url()).await.unwrap());
    let guard = locker.acquire("job", &short_lease()).await.unwrap();
    faults::right_after_a_renewal(&guard, short_lease().get_ttl()).await;
    server.pause();
    let deadline = guard.valid_until();
    let lost = faults::first_seen_lost(&guard, short_lease().get_ttl()).await;
    server.resume();
    let (reason, seen) = lost;
    assert_eq!(reason, LossReason::RenewalFailed);
    faults::assert_at_deadline(seen, deadline);
}

/// Every command on the store's connection (the store's own scripts and the
/// application's commands alike) is cut off at the response timeout when the server
/// stops answering, and the connection works again once it answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_to_a_frozen_server_end_at_the_response_timeout() {
    let server = RedisServer::spawn();
    let timeout = Duration::from_millis(300);
    let store = RedisLockStore::connect_with(
        &server.url(),
        RedisLockConfig::new().response_timeout(timeout),
    )
    .await
    .unwrap();
    let mut connection = store.connection().clone();
    let locker = Locker::new(store);
    server.pause();
    let started = tokio::time::Instant::now();
    let error = redis::cmd("PING")
        .query_async::<String>(&mut connection)
        .await
        .unwrap_err();
    let took = started.elapsed();
    assert!(error.is_timeout(), "{error}");
    // At the timeout, not a second try's worth later.
    let at_the_timeout = |took: Duration| took >= timeout && took < timeout + SCHEDULING_SLACK;
    assert!(at_the_timeout(took), "{took:?}");
    let started = tokio::time::Instant::now();
    let error = locker.status("frozen").await.unwrap_err();
    let took = started.elapsed();
    assert_eq!(error.kind(), ErrorKind::StoreUnavailable, "{error}");
    assert!(at_the_timeout(took), "{took:?}");
    server.resume();
    let pong: String = redis::cmd("PING")
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(pong, "PONG");
    assert!(locker.status("frozen").await.unwrap().is_none());
}

/// A restart that loses every key frees the lock; the old holder's next renewal finds
/// the new holder and says so (`TakenOver`) within TTL/3 of the restart, plus the
/// reconnection; tokens keep increasing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_that_loses_all_data_frees_the_lock_and_tokens_keep_increasing() {
    let server = RedisServer::spawn();
    let locker = Locker::new(RedisLockStore::connect(&server.url()).await.unwrap());
    let ttl = Duration::from_secs(3);
    let guard = locker
        .acquire("job", &LockOptions::new().ttl(ttl))
        .await
        .unwrap();
    let before = guard.fencing_token();
    server.restart();
    let restarted = tokio::time::Instant::now();
    // The restarted server knows nothing: another client can take the lock, and its
    // token is still larger than every token issued before the restart.
    let other = Locker::new(RedisLockStore::connect(&server.url()).await.unwrap());
    let taken = other.acquire("job", &short_lease()).await.unwrap();
    assert!(
        taken.fencing_token() > before,
        "{} after {}",
        taken.fencing_token(),
        before
    );
    let (reason, seen) = faults::first_seen_lost(&guard, ttl).await;
    assert_eq!(reason, LossReason::TakenOver);
    assert!(
        seen - restarted <= ttl / 3 + Duration::from_millis(600),
        "the loss was seen {:?} after the restart",
        seen - restarted
    );
    taken.release().await.unwrap();
}

#[tokio::test]
async fn an_unreachable_server_is_reported_within_seconds() {
    // A port nobody can listen on while the test runs (a merely free port may be taken
    // by another test's server at once).
    let closed = turnstile_test_support::ClosedPort::bind();
    let started = std::time::Instant::now();
    let error = Locker::connect(&format!("redis://127.0.0.1:{}", closed.port()))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::StoreUnavailable, "{error}");
    // A refused connection is known at once; no need to wait for the 3 s timeout.
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );
    let error = Locker::connect("redis://no host/").await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidUrl, "{error}");
}

#[tokio::test]
async fn scripts_are_reloaded_after_a_script_flush() {
    // A server of its own: SCRIPT FLUSH on the shared one would hit the other tests.
    let server = RedisServer::spawn();
    let locker = Locker::new(RedisLockStore::connect(&server.url()).await.unwrap());
    // The scripts are loaded and in use before the flush.
    locker
        .acquire("before-flush", &LockOptions::new())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let client = redis::Client::open(server.url()).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut connection)
        .await
        .unwrap();
    let guard = locker
        .acquire("after-flush", &LockOptions::new())
        .await
        .unwrap();
    assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
}

#[tokio::test]
async fn all_keys_of_a_lock_share_one_cluster_slot() {
    let server = RedisServer::spawn_with_args(&["--cluster-enabled", "yes"]);
    let client = redis::Client::open(server.url()).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    let store = RedisLockStore::connect(&shared_redis().url())
        .await
        .unwrap();
    for name in ["order:123", "a}b", "{x}", "注文"] {
        let name = LockName::new(name).unwrap();
        let mut slots = Vec::new();
        for key in [
            store.lock_key(&name),
            store.fence_key(&name),
            store.release_channel(&name),
        ] {
            let slot: i64 = redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(&key)
                .query_async(&mut connection)
                .await
                .unwrap();
            slots.push(slot);
        }
        assert!(
            slots.windows(2).all(|pair| pair[0] == pair[1]),
            "{name}: {slots:?}"
        );
    }
}

#[tokio::test]
async fn bad_prefixes_are_refused() {
    let error =
        RedisLockStore::connect_with(&shared_redis().url(), RedisLockConfig::new().prefix("a{b"))
            .await
            .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidOptions);
}

/// The notes' paused-holder scenario, stopped by a fenced Redis write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_holders_late_write_is_rejected() {
    let store = shared().await;
    // Under the lock's own prefix, so the election beside it could reach the same keys.
    let fenced =
        RedisFencedStore::connect(&format!("{}?turnstile_prefix={}", store.url, store.prefix))
            .await
            .unwrap();
    let resource = unique_name("account");
    let write = |token: turnstile::FencingToken, total: i64| {
        let (fenced, resource) = (fenced.clone(), resource.clone());
        async move {
            fenced
                .write(&resource, token, total.to_string().as_bytes())
                .await
                .unwrap()
        }
    };
    let read = || {
        let (fenced, resource) = (fenced.clone(), resource.clone());
        async move {
            let value = fenced.read(&resource).await.unwrap().unwrap();
            String::from_utf8(value).unwrap().parse().unwrap()
        }
    };
    let lease = LockOptions::new().ttl(Duration::from_millis(500));
    conformance::a_paused_holders_late_write_is_rejected(
        &store.locker().await,
        lease,
        &resource,
        write,
        read,
    )
    .await;
}

#[tokio::test]
async fn fenced_writes_compare_large_tokens_exactly() {
    let store = shared().await;
    let fenced = RedisFencedStore::connect(&store.url).await.unwrap();
    let resource = unique_name("big");
    use turnstile::FencingToken;
    // Adjacent values above 2^53, where a float comparison would call them equal.
    let high = FencingToken::new(u64::MAX - 1);
    let higher = FencingToken::new(u64::MAX);
    assert_eq!(
        fenced.write(&resource, higher, b"1").await.unwrap(),
        FenceOutcome::Applied
    );
    assert_eq!(
        fenced.write(&resource, high, b"2").await.unwrap(),
        FenceOutcome::Rejected {
            highest_seen: higher
        }
    );
    // Fewer digits is smaller, though "9" > "1" as text.
    assert_eq!(
        fenced
            .write(&resource, FencingToken::new(9), b"3")
            .await
            .unwrap(),
        FenceOutcome::Rejected {
            highest_seen: higher
        }
    );
    // The same token again is allowed (the holder may write more than once).
    assert_eq!(
        fenced.write(&resource, higher, b"4").await.unwrap(),
        FenceOutcome::Applied
    );
    assert_eq!(fenced.read(&resource).await.unwrap().unwrap(), b"4");
}

#[cfg(feature = "redis-tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_work_over_tls() {
    let server = RedisServer::spawn_tls();
    assert!(server.url().starts_with("rediss://"));
    let ca = std::fs::read(server.ca_certificate()).unwrap();
    let config = RedisLockConfig::new().tls_root_certificate(ca);
    let locker = Locker::new(
        RedisLockStore::connect_with(&server.url(), config)
            .await
            .unwrap(),
    );
    let guard = locker
        .acquire("over-tls", &LockOptions::new())
        .await
        .unwrap();
    assert!(guard.fencing_token().get() > 0);
    assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
    // Without trusting the test CA, the server's certificate is refused.
    // (Which kind of error it is: see the ignored test below.)
    let error = RedisLockStore::connect(&server.url()).await.unwrap_err();
    assert!(error.to_string().contains("certificate"), "{error}");
}

/// An untrusted server certificate will not become trusted by trying again: it is a
/// configuration error, like wrong credentials, not an unreachable store.
#[cfg(feature = "redis-tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_certificate_is_a_configuration_error() {
    let server = RedisServer::spawn_tls();
    let error = RedisLockStore::connect(&server.url()).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Configuration, "{error}");
    assert!(!error.is_retryable());
    assert!(!error.to_string().contains("is it running"), "{error}");
}

/// An acquire dropped while its request is in flight leaves no lock behind: the request
/// still reaches the server, and the undo that the drop sends follows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_dropped_mid_request_leaves_no_lock_behind() {
    let server = RedisServer::spawn();
    // Through a proxy, to see the request leave for the server.
    let proxy = TcpProxy::start(server.port());
    let locker = Locker::new(
        RedisLockStore::connect(&proxy.url_for(&server.url()))
            .await
            .unwrap(),
    );
    server.pause();
    let sent_before = proxy.bytes_to_target();
    let pending = {
        let locker = locker.clone();
        tokio::spawn(async move {
            locker
                .acquire(
                    "in-flight",
                    &LockOptions::new().ttl(Duration::from_secs(30)),
                )
                .await
        })
    };
    // The request is written and waits in the frozen server's socket.
    faults::eventually("the acquire sent", Duration::from_secs(5), || {
        proxy.bytes_to_target() > sent_before
    })
    .await;
    let sent_acquire = proxy.bytes_to_target();
    pending.abort();
    assert!(pending.await.unwrap_err().is_cancelled());
    // The undo the drop spawned follows it on the same connection.
    faults::eventually("the undo sent", Duration::from_secs(5), || {
        proxy.bytes_to_target() > sent_acquire
    })
    .await;
    server.resume();
    // The server runs the acquire, then the undo, then this (one connection, in order):
    // the lock must be free, not held for 30 s.
    assert_eq!(locker.status("in-flight").await.unwrap(), None);
}

/// A waiter whose notification connection drops (the server restarted and lost the
/// lock) re-checks at once instead of sleeping out the old holder's TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_recovers_promptly_from_a_server_restart() {
    let server = RedisServer::spawn();
    let holder = Locker::new(RedisLockStore::connect(&server.url()).await.unwrap());
    let guard = holder
        .acquire(
            "restart",
            &LockOptions::new()
                .ttl(Duration::from_secs(30))
                .watchdog(false),
        )
        .await
        .unwrap();
    let waiter_store = RedisLockStore::connect(&server.url()).await.unwrap();
    let channel = waiter_store.release_channel(&LockName::new("restart").unwrap());
    let waiter = Locker::new(waiter_store);
    let waiting = tokio::spawn(async move {
        waiter
            .acquire(
                "restart",
                &LockOptions::new()
                    .ttl(Duration::from_secs(30))
                    .wait(Duration::from_secs(20)),
            )
            .await
    });
    // Restart once the waiter listens for the release.
    let client = redis::Client::open(server.url()).unwrap();
    let mut admin = client.get_multiplexed_async_connection().await.unwrap();
    let until = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (_, subscribers): (String, i64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(&channel)
            .query_async(&mut admin)
            .await
            .unwrap();
        if subscribers == 1 {
            break;
        }
        assert!(
            std::time::Instant::now() < until,
            "the waiter never subscribed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let restarted = std::time::Instant::now();
    server.restart();
    let taken = waiting.await.unwrap().expect("the waiter got the lock");
    // The old holder's lease had 30 s left; the waiter's backoff while the server is
    // down is at most 1 s.
    assert!(
        restarted.elapsed() < Duration::from_secs(3),
        "woke after {:?}",
        restarted.elapsed()
    );
    assert!(taken.fencing_token() > guard.fencing_token());
    drop(guard);
}

/// Waiters on many names keep hearing releases after their Pub/Sub connection is
/// killed while other waiters are subscribing: every channel of the dead connection is
/// closed, whoever notices the failure first, so its waiters subscribe again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_on_many_names_survive_a_pubsub_connection_kill() {
    let server = RedisServer::spawn();
    let client = redis::Client::open(server.url()).unwrap();
    let mut admin = client.get_multiplexed_async_connection().await.unwrap();
    let holder = Locker::new(RedisLockStore::connect(&server.url()).await.unwrap());
    let waiter = Locker::new(RedisLockStore::connect(&server.url()).await.unwrap());
    let long = LockOptions::new()
        .ttl(Duration::from_secs(30))
        .wait(Duration::from_secs(25));
    let names: Vec<String> = (0..40).map(|i| format!("many-{i}")).collect();
    let mut guards = Vec::new();
    for name in &names {
        guards.push(holder.acquire(name, &long).await.unwrap());
    }
    let start_waiters = |names: &[String]| {
        names
            .iter()
            .map(|name| {
                let (waiter, name, long) = (waiter.clone(), name.clone(), long.clone());
                tokio::spawn(async move { waiter.acquire(&name, &long).await })
            })
            .collect::<Vec<_>>()
    };
    let mut waiting = start_waiters(&names[..20]);
    // Wait until the first 20 are subscribed.
    let subscribed_by = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let channels: Vec<String> = redis::cmd("PUBSUB")
            .arg("CHANNELS")
            .query_async(&mut admin)
            .await
            .unwrap();
        if channels.len() >= 20 {
            break;
        }
        assert!(
            std::time::Instant::now() < subscribed_by,
            "waiters never subscribed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Kill the Pub/Sub connection while 20 more waiters subscribe.
    let kill = {
        let mut admin = admin.clone();
        tokio::spawn(async move {
            let _: redis::Value = redis::cmd("CLIENT")
                .arg(&["KILL", "TYPE", "pubsub"])
                .query_async(&mut admin)
                .await
                .unwrap();
        })
    };
    waiting.extend(start_waiters(&names[20..]));
    kill.await.unwrap();
    // Every waiter listens again (on a new connection) before the releases.
    let resubscribed_by = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let channels: Vec<String> = redis::cmd("PUBSUB")
            .arg("CHANNELS")
            .query_async(&mut admin)
            .await
            .unwrap();
        if channels.len() == names.len() {
            break;
        }
        assert!(
            std::time::Instant::now() < resubscribed_by,
            "only {} of {} waiters listen again",
            channels.len(),
            names.len()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let released = std::time::Instant::now();
    for guard in guards {
        guard.release().await.unwrap();
    }
    for task in waiting {
        let guard = task.await.unwrap().expect("the waiter got its lock");
        guard.release().await.unwrap();
    }
    // The holders' TTL is 30 s: only release notifications (or the re-check after a
    // closed watch) wake waiters this fast.
    assert!(
        released.elapsed() < Duration::from_secs(5),
        "waiters woke {:?} after the releases",
        released.elapsed()
    );
}

/// `turnstile_prefix` in a Redis URL puts the keys under that prefix, for locks and
/// fenced writes alike; an unknown `turnstile_*` option is refused.
#[tokio::test]
async fn the_url_sets_the_key_prefix() {
    let server = shared_redis();
    let prefix = unique_name("urlprefix");
    let url = format!("{}?turnstile_prefix={prefix}", server.url());
    let store = RedisLockStore::connect(&url).await.unwrap();
    assert_eq!(store.prefix(), prefix);
    let locker = Locker::new(store);
    let guard = locker.acquire("k", &LockOptions::new()).await.unwrap();
    let client = redis::Client::open(server.url()).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    let exists: bool = redis::cmd("EXISTS")
        .arg(format!("{prefix}:{{k}}:lock"))
        .query_async(&mut connection)
        .await
        .unwrap();
    assert!(exists, "the lock key is not under the URL's prefix");
    let fenced = RedisFencedStore::connect(&url).await.unwrap();
    fenced
        .write("res", guard.fencing_token(), b"v")
        .await
        .unwrap();
    let exists: bool = redis::cmd("EXISTS")
        .arg(format!("{prefix}:{{res}}:fenced-value"))
        .query_async(&mut connection)
        .await
        .unwrap();
    assert!(exists, "the fenced value is not under the URL's prefix");
    guard.release().await.unwrap();
    let error = RedisLockStore::connect(&format!("{}?turnstile_prefx=x", server.url()))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidUrl);
}

/// Against a store that stops answering, the wait bound decides when `acquire` returns
/// (not the driver's 3 s response timeout), and the error names the lock and the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wait_bound_beats_a_paused_server() {
    let server = RedisServer::spawn();
    let locker = Locker::new(RedisLockStore::connect(&server.url()).await.unwrap());
    let holder = Locker::new(RedisLockStore::connect(&server.url()).await.unwrap());
    let held = holder
        .acquire(
            "paused-wait",
            &LockOptions::new().ttl(Duration::from_secs(30)),
        )
        .await
        .unwrap();
    server.pause();
    let started = std::time::Instant::now();
    let wait = Duration::from_millis(1_500);
    let error = locker
        .acquire("paused-wait", &LockOptions::new().wait(wait))
        .await
        .unwrap_err();
    let took = started.elapsed();
    server.resume();
    // The one request, unanswered, is cut off at the bound, not before.
    assert!(took >= wait, "returned after {took:?}");
    conformance::assert_returned_by_the_wait_bound(took, wait);
    assert_eq!(error.kind(), ErrorKind::StoreUnavailable, "{error}");
    let text = error.to_string();
    assert!(
        text.contains("paused-wait") && text.contains("redis://"),
        "{text}"
    );
    drop(held);
}

/// A holder cut off by a partition stops before the next holder starts: its lost
/// signal fires at its local deadline, and a client polling the server directly gets
/// the lock only after that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_holder_stops_before_the_next_holder_starts() {
    let server = shared_redis();
    let prefix = unique_name("partition");
    let proxy = TcpProxy::start(server.port());
    let holder = Locker::new(connect(&proxy.url_for(&server.url()), &prefix).await);
    let direct = Locker::new(connect(&server.url(), &prefix).await);
    faults::a_partitioned_holder_stops_before_the_next_holder_starts(
        &proxy,
        &holder,
        &direct,
        Duration::from_secs(3),
        Duration::from_secs(3) / 3,
    )
    .await;
}

/// The lease of the fault exercises: long enough for a noisy machine, short enough to
/// run out a few times within seconds.
const FAULT_TTL: Duration = Duration::from_millis(1_500);

fn fault_lease() -> LockOptions {
    LockOptions::new()
        .ttl(FAULT_TTL)
        .wait(Duration::from_secs(2))
}

/// Three clients of `server`, each through a proxy of its own (so that the test can
/// find its connections on the server), writing one resource through a fenced store.
async fn redis_contenders(server: &RedisServer) -> (Vec<faults::Contender>, Vec<TcpProxy>) {
    let prefix = unique_name("faults");
    let fenced = RedisFencedStore::connect(&format!("{}?turnstile_prefix={prefix}", server.url()))
        .await
        .unwrap();
    let resource = unique_name("resource");
    let mut contenders = Vec::new();
    let mut proxies = Vec::new();
    for _ in 0..3 {
        let proxy = TcpProxy::start(server.port());
        let locker = Locker::new(connect(&proxy.url_for(&server.url()), &prefix).await);
        let (fenced, resource) = (fenced.clone(), resource.clone());
        let write: faults::Write = std::sync::Arc::new(move |token| {
            let (fenced, resource) = (fenced.clone(), resource.clone());
            Box::pin(async move {
                fenced
                    .write(&resource, token, token.to_string().as_bytes())
                    .await
                    .map_err(|error| error.to_string())
            })
        });
        contenders.push(faults::Contender { locker, write });
        proxies.push(proxy);
    }
    (contenders, proxies)
}

/// The server is killed for longer than the lease, then comes back empty: the holder
/// stops at its local deadline (`RenewalFailed`), nobody is inside meanwhile, and
/// holders after the restart get larger tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion_holds_when_the_server_is_killed() {
    let server = RedisServer::spawn();
    let (contenders, _proxies) = redis_contenders(&server).await;
    let exercise = faults::Exercise::start(
        &unique_name("killed"),
        &fault_lease(),
        faults::Work::SHORT,
        contenders,
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    exercise.new_holder().await;
    server.kill();
    tokio::time::sleep(FAULT_TTL + Duration::from_millis(300)).await;
    server.restart();
    let back = tokio::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    exercise.finish().await.check(&faults::Expect {
        exclusive: true,
        reasons: &[LossReason::RenewalFailed],
        someone_loses: true,
        faults: &[back],
        detect_slack: Duration::ZERO,
    });
}

/// A restart that loses every key frees the lock at once, so a new holder may start
/// while the old one cannot know yet: the old one learns at its next renewal (within
/// TTL/3 of the restart, plus the reconnection) and its late writes are fenced out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_that_loses_the_lock_is_fenced_and_noticed_within_a_third_of_the_ttl() {
    let server = RedisServer::spawn();
    let (contenders, _proxies) = redis_contenders(&server).await;
    // Sections longer than the renewal interval, so the holder hit by the restart is
    // still at work when its next renewal finds the lock gone.
    let work = faults::Work {
        writes: 8,
        pause: Duration::from_millis(120),
    };
    let exercise =
        faults::Exercise::start(&unique_name("restart"), &fault_lease(), work, contenders);
    tokio::time::sleep(Duration::from_secs(1)).await;
    exercise.new_holder().await;
    server.restart();
    let back = tokio::time::Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    exercise.finish().await.check(&faults::Expect {
        exclusive: false,
        reasons: &[LossReason::Expired, LossReason::TakenOver],
        someone_loses: true,
        faults: &[back],
        detect_slack: Duration::from_millis(600),
    });
}

/// A server frozen (SIGSTOP) for longer than the lease: the holder stops at its local
/// deadline (`RenewalFailed`), before the server, thawed, lets anyone else in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion_holds_when_the_server_is_paused_past_the_lease() {
    let server = RedisServer::spawn();
    let (contenders, _proxies) = redis_contenders(&server).await;
    let exercise = faults::Exercise::start(
        &unique_name("paused"),
        &fault_lease(),
        faults::Work::SHORT,
        contenders,
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    exercise.new_holder().await;
    server.pause();
    tokio::time::sleep(FAULT_TTL + Duration::from_millis(500)).await;
    server.resume();
    let back = tokio::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    exercise.finish().await.check(&faults::Expect {
        exclusive: true,
        reasons: &[LossReason::RenewalFailed],
        someone_loses: true,
        faults: &[back],
        detect_slack: Duration::ZERO,
    });
}

/// `CLIENT KILL` of the current holder's connections: the lock lives in the server,
/// the client reconnects, and nobody loses the lock or shares it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion_holds_and_nobody_loses_when_the_holders_connection_is_killed() {
    let server = RedisServer::spawn();
    let client = redis::Client::open(server.url()).unwrap();
    let mut admin = client.get_multiplexed_async_connection().await.unwrap();
    let (contenders, proxies) = redis_contenders(&server).await;
    let exercise = faults::Exercise::start(
        &unique_name("clientkill"),
        &fault_lease(),
        faults::Work::SHORT,
        contenders,
    );
    tokio::time::sleep(Duration::from_millis(800)).await;
    let mut kills = Vec::new();
    for _ in 0..3 {
        let holder = exercise.new_holder().await;
        let mut killed = 0;
        for address in proxies[holder].upstream_addresses() {
            killed += redis::cmd("CLIENT")
                .arg("KILL")
                .arg("ADDR")
                .arg(address.to_string())
                .query_async::<i64>(&mut admin)
                .await
                .unwrap_or(0);
        }
        assert!(killed > 0, "no connection of the holder was found");
        kills.push(tokio::time::Instant::now());
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    exercise.finish().await.check(&faults::Expect {
        exclusive: true,
        reasons: &[],
        someone_loses: false,
        faults: &kills,
        detect_slack: Duration::ZERO,
    });
}

/// A release says whether its notification reached another store (another process)
/// than the releasing one: not when only the releasing store itself listens.
#[tokio::test]
async fn a_release_says_whether_it_woke_waiters_elsewhere() {
    use turnstile::lock::{LockBackend, OwnerId, TryAcquire};
    let url = shared_redis().url();
    let prefix = unique_name("woke");
    let (holder_store, other_store) = (connect(&url, &prefix).await, connect(&url, &prefix).await);
    let ttl = Duration::from_secs(30);
    let name = LockName::new("busy").unwrap();
    let holder = OwnerId::random();
    // One acquire and release by the holder's store: what the release says.
    let cycle = || async {
        let answer = holder_store.try_acquire(&name, &holder, ttl).await.unwrap();
        assert!(matches!(answer, TryAcquire::Acquired { .. }));
        holder_store
            .release_waking_others(&name, &holder)
            .await
            .unwrap()
    };

    assert_eq!(cycle().await, (ReleaseOutcome::Released, Some(false)));

    // Only the releasing store listens: nobody elsewhere.
    let own_watch = holder_store.watch_releases(&name).await.unwrap();
    assert_eq!(cycle().await, (ReleaseOutcome::Released, Some(false)));

    let other_watch = other_store.watch_releases(&name).await.unwrap();
    assert_eq!(cycle().await, (ReleaseOutcome::Released, Some(true)));
    drop((own_watch, other_watch));
    // Released already: nothing was released, so nobody was woken.
    assert_eq!(
        holder_store
            .release_waking_others(&name, &holder)
            .await
            .unwrap(),
        (ReleaseOutcome::AlreadyExpired, None)
    );
}

/// The last token of a name is kept for the fence retention, 7 days by default, after
/// the name's last acquisition: the fence key's expiry, read from the server, is 7 days
/// just after an acquisition, has run down while nobody acquires, and is 7 days again
/// after the next acquisition. (A renewal does not move it: retention counts from the
/// last acquisition.)
#[tokio::test]
async fn the_last_token_is_kept_seven_days_after_each_acquisition() {
    const SEVEN_DAYS: Duration = Duration::from_secs(7 * 24 * 3600);
    // A read that follows an acquisition on loopback comes well within this.
    const READ_SLACK: Duration = Duration::from_millis(500);
    // How long the key sits between the two acquisitions: longer than the slack, so
    // that an expiry not set again by the second acquisition is seen to have run down.
    const IDLE: Duration = Duration::from_millis(1_500);
    let shared = shared().await;
    let store = connect(&shared.url, &shared.prefix).await;
    let fence_key = store.fence_key(&LockName::new("kept").unwrap());
    let locker = Locker::new(store);
    let client = redis::Client::open(shared.url.as_str()).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    let mut remaining = async || -> Duration {
        let millis: i64 = redis::cmd("PTTL")
            .arg(&fence_key)
            .query_async(&mut connection)
            .await
            .unwrap();
        assert!(millis > 0, "{fence_key} has no expiry (PTTL {millis})");
        Duration::from_millis(millis as u64)
    };
    let just_after_an_acquisition = |left: Duration| {
        assert!(
            left <= SEVEN_DAYS && left >= SEVEN_DAYS - READ_SLACK,
            "the token is kept {left:?} after an acquisition, not 7 days"
        );
    };

    let first = locker.acquire("kept", &LockOptions::new()).await.unwrap();
    just_after_an_acquisition(remaining().await);
    first.release().await.unwrap();
    tokio::time::sleep(IDLE).await;
    let run_down = remaining().await;
    assert!(
        run_down <= SEVEN_DAYS - IDLE,
        "the expiry did not run down while nobody acquired: {run_down:?}"
    );

    let second = locker.acquire("kept", &LockOptions::new()).await.unwrap();
    just_after_an_acquisition(remaining().await);
    second.release().await.unwrap();
}

/// Behind Sentinel, a command that finds its master gone makes the store ask the
/// sentinels for the master again, and is sent **once** more, to the master they name
/// then:
/// - right after the master dies, the sentinels still name it (they agree it is down
///   only after 500 ms without an answer): the command fails at once, it is not retried
///   until some master answers;
/// - once they name the promoted replica, the first command sent finds the old
///   connection dead and gets its answer from the new master, where it ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_sentinel_a_command_that_finds_its_master_gone_is_sent_once_more() {
    // Well inside the 500 ms after which the sentinels call the master down.
    const BEFORE_THE_SENTINELS_AGREE: Duration = Duration::from_millis(300);
    let group = std::sync::Arc::new(
        tokio::task::spawn_blocking(RedisSentinelGroup::spawn)
            .await
            .unwrap(),
    );
    let store = RedisLockStore::connect(&group.url()).await.unwrap();
    let mut connection = store.connection().clone();
    let key = unique_name("resent");
    let mut increment = async || {
        redis::cmd("INCR")
            .arg(&key)
            .query_async::<i64>(&mut connection)
            .await
    };
    assert_eq!(increment().await.unwrap(), 1);

    let old = tokio::task::spawn_blocking({
        let group = std::sync::Arc::clone(&group);
        move || group.kill_master()
    })
    .await
    .unwrap();
    let killed = tokio::time::Instant::now();
    let error = increment()
        .await
        .expect_err("a command succeeded with the master dead and no other named");
    assert!(
        killed.elapsed() < BEFORE_THE_SENTINELS_AGREE,
        "the command failed only {:?} after the master died: it was retried, not sent \
         once more ({error})",
        killed.elapsed()
    );

    tokio::task::spawn_blocking({
        let group = std::sync::Arc::clone(&group);
        move || group.wait_for_a_new_master(old, Duration::from_secs(30))
    })
    .await
    .unwrap();
    let answer = increment()
        .await
        .expect("the first command after the failover failed: it was not sent again");
    let new_master =
        redis::Client::open(format!("redis://127.0.0.1:{}", group.master_port())).unwrap();
    let mut direct = new_master.get_multiplexed_async_connection().await.unwrap();
    let stored: i64 = redis::cmd("GET")
        .arg(&key)
        .query_async(&mut direct)
        .await
        .unwrap();
    assert_eq!(
        stored, answer,
        "the command did not run once on the new master"
    );
}

/// On Redis an unfenced acquisition is a bare `SET NX PX` of the owner: no token is
/// issued or kept (the fence key is not touched), the status says there is none, and
/// the scripts that renew and release read the value as that owner's.
#[tokio::test]
async fn an_unfenced_lock_is_a_bare_set_with_no_token() {
    use turnstile::lock::LockBackend;
    let url = shared_redis().url();
    let store = RedisLockStore::connect(&url).await.unwrap();
    assert!(store.unfenced_is_cheaper());
    let client = redis::Client::open(url).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    let locker = Locker::new(store.clone());
    let name = LockName::new(unique_name("bare")).unwrap();
    let options = LockOptions::new().ttl(Duration::from_secs(2));
    let guard = locker.acquire_unfenced(&name, &options).await.unwrap();
    let value: String = redis::cmd("GET")
        .arg(store.lock_key(&name))
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(value, format!("{}:", guard.owner().to_hex()));
    let fence: Option<String> = redis::cmd("GET")
        .arg(store.fence_key(&name))
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(fence, None, "no token was issued");
    let status = locker.status(&name).await.unwrap().expect("held");
    assert_eq!(status.fencing_token, None);
    assert_eq!(status.owner, guard.owner().to_hex());
    guard.extend().await.unwrap();
    assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
    assert!(locker.status(&name).await.unwrap().is_none());
}

/// An election and a fenced resource of the same name keep their data apart: the
/// leader's value does not overwrite the resource's data (both used `P:{R}:value`), and
/// the resource's writes do not change the leader's value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_election_and_a_fenced_resource_of_one_name_keep_apart() {
    use turnstile::election::Election;
    let store = shared().await;
    // Under the election's own prefix, as an application that shares one would.
    let fenced =
        RedisFencedStore::connect(&format!("{}?turnstile_prefix={}", store.url, store.prefix))
            .await
            .unwrap();
    let name = unique_name("ledger");
    let election = Election::new(store.locker().await);
    let leadership = election
        .campaign(
            name.as_str(),
            "leader-A",
            &LockOptions::new().ttl(Duration::from_secs(5)),
        )
        .await
        .unwrap();
    assert_eq!(
        fenced
            .write(&name, leadership.epoch(), b"balance=10")
            .await
            .unwrap(),
        FenceOutcome::Applied
    );
    let mut leadership = leadership;
    leadership.proclaim("leader-A2").await.unwrap();
    assert_eq!(
        fenced.read(&name).await.unwrap().as_deref(),
        Some(&b"balance=10"[..]),
        "the leader's value overwrote the fenced data"
    );
    let leader = election.leader(name.as_str()).await.unwrap().unwrap();
    assert_eq!(leader.value.as_deref(), Some("leader-A2"));
    leadership.resign().await.unwrap();
}

/// A resource a version before the key split wrote (its value at `P:{R}:value`, with
/// no expiry) is still read until its next write, which moves it to its own key; a
/// leader's value at that key (always with an expiry) never is.
#[tokio::test]
async fn a_fenced_value_written_before_the_key_split_is_still_read() {
    let store = shared().await;
    // Under the election's own prefix, as an application that shares one would.
    let fenced =
        RedisFencedStore::connect(&format!("{}?turnstile_prefix={}", store.url, store.prefix))
            .await
            .unwrap();
    let resource = unique_name("old");
    let mut connection = redis::Client::open(store.url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let prefix = &store.prefix;
    let () = redis::pipe()
        .cmd("SET")
        .arg(format!("{prefix}:{{{resource}}}:fence-token"))
        .arg("5")
        .ignore()
        .cmd("SET")
        .arg(format!("{prefix}:{{{resource}}}:value"))
        .arg("old")
        .ignore()
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(
        fenced.read(&resource).await.unwrap().as_deref(),
        Some(&b"old"[..])
    );
    // An election of the same name proclaims there (its values always expire): that is
    // never read as the resource's data.
    let other = unique_name("oldelection");
    let () = redis::pipe()
        .cmd("SET")
        .arg(format!("{prefix}:{{{other}}}:fence-token"))
        .arg("5")
        .ignore()
        .cmd("SET")
        .arg(format!("{prefix}:{{{other}}}:value"))
        .arg("owner:leader-value")
        .arg("PX")
        .arg(604_800_000)
        .ignore()
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(
        fenced.read(&other).await.unwrap(),
        None,
        "a leader's value was read as the resource's data"
    );
    assert_eq!(
        fenced
            .write(&resource, turnstile::FencingToken::new(6), b"new")
            .await
            .unwrap(),
        FenceOutcome::Applied
    );
    assert_eq!(
        fenced.read(&resource).await.unwrap().as_deref(),
        Some(&b"new"[..])
    );
}
