//! The etcd engine on a three-member cluster that loses members.

mod conformance;
mod faults;

use std::time::Duration;

use turnstile::lock::etcd::EtcdLockStore;
use turnstile::lock::{LockOptions, Locker, LossReason, ReleaseOutcome};
use turnstile_test_support::EtcdCluster;

/// On a three-member cluster, a held lock survives the death of a member: the holder's
/// renewals reach the other two, a new holder's token is larger, and a second client
/// is still kept out. With a second member dead there is no quorum: an acquire fails
/// within its wait bound (no hang) and the holder's lost signal fires at its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_member_cluster_keeps_its_locks_when_a_member_dies() {
    let cluster = EtcdCluster::spawn(3);
    let locker = Locker::new(EtcdLockStore::connect(&cluster.url()).await.unwrap());
    let other = Locker::new(EtcdLockStore::connect(&cluster.url()).await.unwrap());
    let ttl = Duration::from_secs(2);
    let options = LockOptions::new().ttl(ttl).wait(Duration::from_secs(15));
    let guard = locker.acquire("job", &options).await.unwrap();
    let first_token = guard.fencing_token();

    cluster.member(0).kill();
    // Longer than two TTLs: only renewals that reached the survivors keep the lock.
    tokio::time::sleep(2 * ttl + Duration::from_millis(500)).await;
    assert!(
        !guard.is_lost(),
        "the holder lost its lock when one member of three died: {:?}",
        guard.loss_reason()
    );
    assert!(
        other
            .try_acquire("job", &LockOptions::new().ttl(ttl))
            .await
            .unwrap()
            .is_none(),
        "a second client got the lock while it was held"
    );
    assert_eq!(guard.release().await.unwrap(), ReleaseOutcome::Released);
    let guard = other.acquire("job", &options).await.unwrap();
    assert!(guard.fencing_token() > first_token);

    cluster.member(1).kill();
    let started = std::time::Instant::now();
    let wait = Duration::from_secs(2);
    let refused = locker
        .acquire("another", &LockOptions::new().ttl(ttl).wait(wait))
        .await;
    assert!(refused.is_err(), "an acquire without a quorum succeeded");
    conformance::assert_returned_by_the_wait_bound(started.elapsed(), wait);
    // Renewals fail from the second death on (a member alone answers nothing that
    // needs the quorum), so the signal comes at the holder's local deadline.
    let (reason, seen) = faults::first_seen_lost(&guard, 2 * ttl).await;
    assert_eq!(reason, LossReason::RenewalFailed);
    faults::assert_at_deadline(seen, guard.valid_until());
}
