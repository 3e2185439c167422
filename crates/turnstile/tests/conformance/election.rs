//! The election section of the conformance suite: leader election on every lock engine.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::Instant;
use turnstile::ErrorKind;
use turnstile::election::Election;
use turnstile::lock::{LockOptions, ReleaseOutcome};

use super::{TestStore, name};

fn campaign_options(ttl_ms: u64) -> LockOptions {
    LockOptions::new()
        .ttl(Duration::from_millis(ttl_ms))
        .wait(Duration::from_secs(30))
}

/// The value a candidate advertises: its own where the engine keeps values, none
/// where it keeps none (a campaign with a value is refused there).
fn value_for(election: &Election, candidate: &str) -> String {
    if election.locker().backend().keeps_holder_values() {
        candidate.to_owned()
    } else {
        String::new()
    }
}

/// Candidates in three clients (stand-ins for three processes) campaign over and
/// over: never two leaders at once, each term's epoch larger than the one before, and
/// a fourth client that asks the store during a term sees that term's leader, epoch
/// and value.
pub async fn one_leader_at_a_time_with_growing_epochs(store: impl TestStore) {
    let election_name = name("election");
    let leading = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let epochs = Arc::new(Mutex::new(Vec::new()));
    let reader = Election::new(store.locker().await);
    let mut tasks = Vec::new();
    for client in 0..3 {
        let election = Election::new(store.locker().await);
        for candidate in 0..2 {
            let (election, election_name, reader) =
                (election.clone(), election_name.clone(), reader.clone());
            let (leading, overlaps, epochs) = (leading.clone(), overlaps.clone(), epochs.clone());
            let value = value_for(&election, &format!("client-{client}-candidate-{candidate}"));
            tasks.push(tokio::spawn(async move {
                for _ in 0..3 {
                    let leadership = election
                        .campaign(&election_name, value.clone(), &campaign_options(5_000))
                        .await
                        .unwrap();
                    if leading.fetch_add(1, Ordering::SeqCst) != 0 {
                        overlaps.fetch_add(1, Ordering::SeqCst);
                    }
                    epochs.lock().await.push(leadership.epoch());
                    let seen = reader.leader(&election_name).await.unwrap().unwrap();
                    assert_eq!(seen.owner, leadership.owner().as_str());
                    assert_eq!(seen.epoch, Some(leadership.epoch()));
                    if !value.is_empty() {
                        assert_eq!(seen.value.as_deref(), Some(value.as_str()));
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    leading.fetch_sub(1, Ordering::SeqCst);
                    assert_eq!(leadership.resign().await.unwrap(), ReleaseOutcome::Released);
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(overlaps.load(Ordering::SeqCst), 0, "two leaders at once");
    let epochs = epochs.lock().await;
    assert_eq!(epochs.len(), 18);
    for pair in epochs.windows(2) {
        assert!(
            pair[1] > pair[0],
            "epoch {} followed epoch {}",
            pair[1].get(),
            pair[0].get()
        );
    }
}

/// An observer in another client sees the current leader at once, then each change:
/// a new value (where values are kept), nobody leading after a resignation, and the
/// next leader with a larger epoch; each within a few seconds.
pub async fn observers_see_every_change_of_leader(store: impl TestStore) {
    let election_name = name("observed");
    let first = Election::new(store.locker().await);
    let second = Election::new(store.locker().await);
    let observer = Election::new(store.locker().await);
    let keeps_values = first.locker().backend().keeps_holder_values();
    let within = Duration::from_secs(5);

    let mut watch = observer.observe(&election_name).await.unwrap();
    assert_eq!(watch.changed().await.unwrap(), None, "nobody leads yet");

    let mut leadership = first
        .campaign(
            &election_name,
            value_for(&first, "first"),
            &campaign_options(5_000),
        )
        .await
        .unwrap();
    let seen = tokio::time::timeout(within, watch.changed())
        .await
        .expect("the observer did not see the first leader")
        .unwrap()
        .expect("a leader");
    assert_eq!(seen.owner, leadership.owner().as_str());
    assert_eq!(seen.epoch, Some(leadership.epoch()));
    let first_epoch = leadership.epoch();

    if keeps_values {
        assert_eq!(seen.value.as_deref(), Some("first"));
        leadership.proclaim("first, moved").await.unwrap();
        assert_eq!(leadership.value(), "first, moved");
        let seen = tokio::time::timeout(within, watch.changed())
            .await
            .expect("the observer did not see the new value")
            .unwrap()
            .expect("a leader");
        assert_eq!(seen.value.as_deref(), Some("first, moved"));
        assert_eq!(seen.epoch, Some(first_epoch));
    } else {
        assert_eq!(
            leadership.proclaim("anything").await.unwrap_err().kind(),
            ErrorKind::UnsupportedStore
        );
    }

    leadership.resign().await.unwrap();
    let seen = tokio::time::timeout(within, watch.changed())
        .await
        .expect("the observer did not see the resignation")
        .unwrap();
    assert_eq!(seen, None);

    let next = second
        .campaign(
            &election_name,
            value_for(&second, "second"),
            &campaign_options(5_000),
        )
        .await
        .unwrap();
    let seen = tokio::time::timeout(within, watch.changed())
        .await
        .expect("the observer did not see the next leader")
        .unwrap()
        .expect("a leader");
    assert_eq!(seen.owner, next.owner().as_str());
    assert!(seen.epoch.unwrap() > first_epoch);
    if keeps_values {
        assert_eq!(seen.value.as_deref(), Some("second"));
    }
    next.resign().await.unwrap();
}

/// A leader whose lease runs out unrenewed (a process paused past its TTL, played by
/// a leader with the watchdog off) knows it has lost before the next leader is
/// elected: its lost signal has fired by then. A deposed leader cannot change the
/// value its successor advertises.
pub async fn a_deposed_leader_knows_before_its_successor_leads(store: impl TestStore) {
    let election_name = name("deposed");
    let first = Election::new(store.locker().await);
    let second = Election::new(store.locker().await);
    let ttl = Duration::from_millis(600);
    let mut paused = first
        .campaign(
            &election_name,
            value_for(&first, "paused"),
            &LockOptions::new().ttl(ttl).watchdog(false),
        )
        .await
        .unwrap();
    let started = Instant::now();
    let successor = second
        .campaign(
            &election_name,
            value_for(&second, "successor"),
            &campaign_options(5_000),
        )
        .await
        .unwrap();
    assert!(
        paused.is_lost(),
        "the next leader was elected {:?} after the first, whose lost signal had not fired",
        started.elapsed()
    );
    assert!(successor.epoch() > paused.epoch());
    let proclaimed = paused.proclaim("still me").await;
    let kind = proclaimed.unwrap_err().kind();
    assert!(
        kind == ErrorKind::LockLost || kind == ErrorKind::UnsupportedStore,
        "a deposed leader's proclaim answered {kind:?}"
    );
    let seen = second.leader(&election_name).await.unwrap().unwrap();
    assert_eq!(seen.owner, successor.owner().as_str());
    if second.locker().backend().keeps_holder_values() {
        assert_eq!(seen.value.as_deref(), Some("successor"));
    }
    successor.resign().await.unwrap();
}

/// Bad values are refused before anything is held, and on an engine that keeps no
/// values a campaign with one is refused, with the election left free.
pub async fn election_input_is_checked(store: impl TestStore) {
    let election_name = name("checked");
    let election = Election::new(store.locker().await);
    let options = campaign_options(5_000).wait(Duration::ZERO);
    for bad in [
        "x".repeat(turnstile::election::MAX_VALUE_LEN + 1),
        "a\0b".to_owned(),
    ] {
        assert_eq!(
            election
                .campaign(&election_name, bad, &options)
                .await
                .unwrap_err()
                .kind(),
            ErrorKind::InvalidOptions
        );
    }
    assert_eq!(
        election
            .campaign("", "", &options)
            .await
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidName
    );
    if !election.locker().backend().keeps_holder_values() {
        assert_eq!(
            election
                .campaign(&election_name, "a value", &options)
                .await
                .unwrap_err()
                .kind(),
            ErrorKind::UnsupportedStore
        );
    }
    assert_eq!(election.leader(&election_name).await.unwrap(), None);
    let longest = "v".repeat(turnstile::election::MAX_VALUE_LEN);
    let value = value_for(&election, &longest);
    let leadership = election
        .campaign(&election_name, value.clone(), &options)
        .await
        .unwrap();
    let seen = election.leader(&election_name).await.unwrap().unwrap();
    if !value.is_empty() {
        assert_eq!(seen.value.as_deref(), Some(value.as_str()));
    }
    leadership.resign().await.unwrap();
}

/// A campaign dropped while another instance leads leaves nothing behind: after the
/// leader resigns nobody leads (within a moment: what the cancelled campaign took
/// meanwhile is released in the background), and the next candidate leads at once.
pub async fn a_cancelled_campaign_leaves_nothing(store: impl TestStore) {
    let election_name = name("election-cancel");
    let leader = Election::new(store.locker().await);
    let cancelled = Election::new(store.locker().await);
    let next = Election::new(store.locker().await);
    let options = LockOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Duration::from_secs(30));
    let leading = leader.campaign(&election_name, "", &options).await.unwrap();
    let campaign = cancelled.campaign(&election_name, "", &options);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), campaign)
            .await
            .is_err(),
        "two leaders at once"
    );
    leading.resign().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    while leader.leader(&election_name).await.unwrap().is_some() {
        assert!(
            Instant::now() < deadline,
            "a cancelled campaign still leads 3 s after the leader resigned"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let now_leading = next
        .campaign(
            &election_name,
            "",
            &options.clone().wait(Duration::from_secs(3)),
        )
        .await
        .expect("nobody leads: the next candidate leads at once");
    now_leading.resign().await.unwrap();
}
