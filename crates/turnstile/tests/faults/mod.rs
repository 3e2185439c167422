//! Fault checks written once for the engines that have a server: a partition bounded
//! from both sides, and mutual exclusion with fenced writes while a fault is injected.

#![allow(dead_code, unreachable_pub)]

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use turnstile::fence::{FenceOutcome, FencingToken};
use turnstile::lock::{LockOptions, Locker, LossReason, ReleaseOutcome};
use turnstile_test_support::TcpProxy;

/// Waits (bounded) until `condition` holds, checking every few milliseconds.
pub async fn eventually(what: &str, limit: Duration, mut condition: impl FnMut() -> bool) {
    let until = Instant::now() + limit;
    while !condition() {
        assert!(
            Instant::now() < until,
            "{what} did not happen within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// The promise "a holder cut off by a partition stops before the next holder starts",
/// bounded from both sides.
///
/// `holder` reaches the store through `proxy`, `direct` without it. The holder takes
/// the lock with a `ttl` lease; right after a renewal the proxy is cut. Then:
/// - the holder's lost signal fires with [`LossReason::RenewalFailed`];
/// - not before its local deadline (`valid_until()` read just before the cut): a task
///   samples the signal every millisecond, and the first sample that sees it is no
///   earlier than the deadline;
/// - and no later than the store's own expiry: `direct` polls `try_acquire` every
///   10 ms, and when it gets the lock the holder's signal has fired already.
///
/// The store must free the lock within `expiry_after_deadline` of the holder's
/// deadline: a third of the TTL where the store's lease is the lock's own (Redis,
/// PostgreSQL); longer where locks live on a session that outlasts the TTL by design
/// (etcd: the TTL rounded up plus a second; ZooKeeper: the TTL rounded up).
pub async fn a_partitioned_holder_stops_before_the_next_holder_starts(
    proxy: &TcpProxy,
    holder: &Locker,
    direct: &Locker,
    ttl: Duration,
    expiry_after_deadline: Duration,
) {
    let name = turnstile_test_support::unique_name("partition");
    let options = LockOptions::new().ttl(ttl).wait(Duration::from_secs(5));
    let connections_before = proxy.accepted();
    let guard = holder.acquire(&name, &options).await.unwrap();
    assert!(
        proxy.accepted() > 0 || connections_before > 0,
        "the holder does not go through the proxy"
    );
    // Right after a renewal: the deadline moves when a renewal succeeds.
    let acquired_deadline = guard.valid_until();
    eventually("a renewal", ttl, || guard.valid_until() > acquired_deadline).await;
    let deadline = guard.valid_until();
    proxy.cut();
    let cut_at = Instant::now();
    assert!(
        deadline > cut_at + ttl / 2,
        "the renewal was seen too late to test anything"
    );

    // Samples the signal every millisecond: the first sample that sees it fired.
    let sampler = {
        let lost = guard.lost_token();
        tokio::spawn(async move {
            while !lost.is_cancelled() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Instant::now()
        })
    };
    // The second client polls the store directly.
    let give_up = deadline + ttl;
    let mut last_refused = None;
    let (taken, taken_at, lost_when_taken) = loop {
        let asked = Instant::now();
        if let Some(taken) = direct.try_acquire(&name, &options).await.unwrap() {
            break (taken, Instant::now(), guard.is_lost());
        }
        last_refused = Some(asked);
        assert!(
            Instant::now() < give_up,
            "the lock never came free after the cut (deadline {:?} ago)",
            Instant::now() - deadline
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let seen_lost_at = tokio::time::timeout(Duration::from_secs(5), sampler)
        .await
        .expect("the lost signal never fired")
        .unwrap();
    let reason = guard.loss_reason().expect("lost");

    assert_eq!(reason, LossReason::RenewalFailed);
    // (b) Not before the local deadline (timers round up to the millisecond, never down).
    assert!(
        seen_lost_at + Duration::from_millis(1) >= deadline,
        "the lost signal fired {:?} before the local deadline",
        deadline - seen_lost_at
    );
    assert!(
        seen_lost_at <= deadline + Duration::from_millis(250),
        "the lost signal fired {:?} after the local deadline",
        seen_lost_at - deadline
    );
    // (c) Not after the store gave the lock to someone else.
    assert!(
        lost_when_taken,
        "the second client got the lock {:?} after the holder's deadline, before the \
         holder's lost signal fired",
        taken_at.saturating_duration_since(deadline)
    );
    // The lock came free by the store's own expiry, about one TTL after the last
    // renewal, and the polling saw that moment to within a few polls.
    assert!(
        taken_at <= deadline + expiry_after_deadline,
        "the store freed the lock only {:?} after the holder's deadline",
        taken_at - deadline
    );
    let last_refused = last_refused.expect("the lock was free at once after the cut");
    assert!(
        taken_at - last_refused < Duration::from_millis(200),
        "polling too coarse to measure: {:?} between the last refusal and the take",
        taken_at - last_refused
    );

    proxy.heal();
    taken.release().await.unwrap();
    // The lost guard's release cannot release anyone's lock; it may find the proxy's
    // connections still cut (an error), which changes nothing either.
    match tokio::time::timeout(Duration::from_secs(5), guard.release()).await {
        Ok(Ok(ReleaseOutcome::Released)) => panic!("a lost guard released the lock"),
        Ok(Ok(_)) => {}
        Ok(Err(error)) => eprintln!("the lost guard's release after the heal failed: {error}"),
        Err(_) => panic!("the lost guard's release did not end within 5 s"),
    }
}

/// A fenced write of the protected resource with a token: `Ok(outcome)`, or an error
/// (the store is down) as text.
pub type Write = Arc<
    dyn Fn(FencingToken) -> Pin<Box<dyn Future<Output = Result<FenceOutcome, String>> + Send>>
        + Send
        + Sync,
>;

/// One contender: a client of its own (another process) and its fenced write.
pub struct Contender {
    pub locker: Locker,
    pub write: Write,
}

/// One fenced write a holder made.
#[derive(Debug, Clone)]
pub struct WriteRecord {
    pub sent: Instant,
    pub done: Instant,
    pub outcome: Result<FenceOutcome, String>,
}

/// One critical section: from the moment `acquire` returned to the moment the holder
/// stopped working (its work done, or its lost signal seen).
#[derive(Debug, Clone)]
pub struct Section {
    pub contender: usize,
    pub token: FencingToken,
    /// When the acquire that got this token was called: the token may have been issued
    /// any time from then until `start`.
    pub asked: Instant,
    pub start: Instant,
    pub end: Instant,
    pub writes: Vec<WriteRecord>,
    /// The lost signal, when it fired during the section: reason, when it was seen,
    /// and the local deadline at that moment. This is the only way a holder is told
    /// in time: a release that finds the lock gone comes after the work.
    pub loss: Option<(LossReason, Instant, Instant)>,
    pub release: Result<ReleaseOutcome, String>,
}

#[derive(Default)]
struct Shared {
    sections: Mutex<Vec<Section>>,
    /// The contender inside its section now, if any, and how many sections started.
    current: Mutex<(Option<usize>, usize)>,
    acquire_errors: Mutex<Vec<String>>,
}

/// Contenders looping acquire → fenced writes → release on one name, while the test
/// injects a fault.
pub struct Exercise {
    stop: Arc<AtomicBool>,
    shared: Arc<Shared>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    ttl: Duration,
}

/// What a holder does in its section: `writes` fenced writes that the store answered
/// (a write that fails, the store being down, is tried again and does not count), with
/// `pause` before each but the first. A holder keeps at it until it is done or its lost
/// signal fires, as a real worker would.
#[derive(Clone, Copy, Debug)]
pub struct Work {
    pub writes: usize,
    pub pause: Duration,
}

impl Work {
    /// Short sections, many of them: three writes 40 ms apart.
    pub const SHORT: Work = Work {
        writes: 3,
        pause: Duration::from_millis(40),
    };
}

impl Exercise {
    /// Starts every contender on lock `name` with `options` (keep the wait bound a few
    /// seconds, so that a waiter notices when the test stops it).
    pub fn start(
        name: &str,
        options: &LockOptions,
        work: Work,
        contenders: Vec<Contender>,
    ) -> Exercise {
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared::default());
        let tasks = contenders
            .into_iter()
            .enumerate()
            .map(|(index, contender)| {
                let (stop, shared) = (stop.clone(), shared.clone());
                let (name, options) = (name.to_owned(), options.clone());
                tokio::spawn(contend(index, contender, name, options, work, stop, shared))
            })
            .collect();
        Exercise {
            stop,
            shared,
            tasks,
            ttl: options.get_ttl(),
        }
    }

    /// Waits (bounded) until a contender starts a section, and says which: a fault
    /// injected now hits it with most of its section ahead.
    pub async fn new_holder(&self) -> usize {
        let until = Instant::now() + Duration::from_secs(10);
        let started = self.shared.current.lock().unwrap().1;
        loop {
            if let (Some(index), now) = *self.shared.current.lock().unwrap()
                && now > started
            {
                return index;
            }
            assert!(Instant::now() < until, "nobody got the lock");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Stops the contenders and returns what they did.
    pub async fn finish(self) -> Report {
        self.stop.store(true, Ordering::SeqCst);
        for task in self.tasks {
            tokio::time::timeout(Duration::from_secs(15), task)
                .await
                .expect("a contender did not stop")
                .unwrap();
        }
        let mut sections = self.shared.sections.lock().unwrap().clone();
        sections.sort_by_key(|section| section.start);
        Report {
            sections,
            acquire_errors: self.shared.acquire_errors.lock().unwrap().clone(),
            ttl: self.ttl,
        }
    }
}

async fn contend(
    index: usize,
    contender: Contender,
    name: String,
    options: LockOptions,
    work: Work,
    stop: Arc<AtomicBool>,
    shared: Arc<Shared>,
) {
    while !stop.load(Ordering::SeqCst) {
        let asked = Instant::now();
        let guard = match contender.locker.acquire(&name, &options).await {
            Ok(guard) => guard,
            Err(error) => {
                shared
                    .acquire_errors
                    .lock()
                    .unwrap()
                    .push(error.to_string());
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let start = Instant::now();
        {
            let mut current = shared.current.lock().unwrap();
            *current = (Some(index), current.1 + 1);
        }
        let token = guard.fencing_token();
        let mut lost = std::pin::pin!(guard.lost());
        let mut writes = Vec::new();
        let mut loss = None;
        let mut answered = 0;
        let mut attempts = 0;
        while answered < work.writes && attempts < work.writes + 200 {
            if attempts > 0 {
                tokio::select! {
                    biased;
                    reason = &mut lost => {
                        loss = Some((reason, Instant::now(), guard.valid_until()));
                        break;
                    }
                    () = tokio::time::sleep(work.pause) => {}
                }
            }
            attempts += 1;
            let sent = Instant::now();
            tokio::select! {
                biased;
                reason = &mut lost => {
                    loss = Some((reason, Instant::now(), guard.valid_until()));
                    break;
                }
                outcome = (contender.write)(token) => {
                    answered += usize::from(outcome.is_ok());
                    writes.push(WriteRecord {
                        sent,
                        done: Instant::now(),
                        outcome,
                    });
                }
            }
        }
        let end = Instant::now();
        shared.current.lock().unwrap().0 = None;
        let release = match tokio::time::timeout(Duration::from_secs(5), guard.release()).await {
            Ok(Ok(outcome)) => Ok(outcome),
            Ok(Err(error)) => Err(error.to_string()),
            Err(_) => Err("the release did not finish in 5 s".to_owned()),
        };
        shared.sections.lock().unwrap().push(Section {
            contender: index,
            token,
            asked,
            start,
            end,
            writes,
            loss,
            release,
        });
    }
}

/// What the contenders did.
#[derive(Debug)]
pub struct Report {
    pub sections: Vec<Section>,
    pub acquire_errors: Vec<String>,
    ttl: Duration,
}

/// What a fault may do.
pub struct Expect<'a> {
    /// No two sections overlap in time. Without it (a fault that frees the lock in the
    /// store while its holder cannot know yet: a restart that loses the data, a killed
    /// session) sections may overlap, but only where the earlier holder had lost the
    /// lock and its lost signal fired while it still worked, and fencing keeps its late
    /// writes out.
    pub exclusive: bool,
    /// The loss reasons a holder hit by the fault may see; empty: nobody loses the lock.
    pub reasons: &'a [LossReason],
    /// At least one holder must lose its lock (the fault hit a holder).
    pub someone_loses: bool,
    /// When each fault was over (the store answering again, the kill done): a
    /// `TakenOver` or `Expired` loss must be seen within TTL/3 + `detect_slack` of
    /// the last of them before it.
    pub faults: &'a [Instant],
    pub detect_slack: Duration,
}

/// A `RenewalFailed` signal is seen at the local deadline, and this much after it at most.
const DEADLINE_SLACK: Duration = Duration::from_millis(150);

impl Report {
    /// Checks every promise against what happened; panics with the sections on a
    /// violation.
    pub fn check(&self, expect: &Expect<'_>) {
        let fail = |message: String| -> ! {
            let mut text = String::new();
            let origin = self.sections.first().map(|s| s.start);
            for section in &self.sections {
                let at = |t: Instant| origin.map_or(0, |o| t.duration_since(o).as_millis());
                text.push_str(&format!(
                    "  #{} token {} [{} ms, {} ms] writes {:?} loss {:?} release {:?}\n",
                    section.contender,
                    section.token,
                    at(section.start),
                    at(section.end),
                    section
                        .writes
                        .iter()
                        .map(|w| (at(w.sent), at(w.done), w.outcome.clone()))
                        .collect::<Vec<_>>(),
                    section
                        .loss
                        .map(|(r, seen, deadline)| (r, at(seen), at(deadline))),
                    section.release,
                ));
            }
            panic!(
                "{message}\nsections (times from the first start):\n{text}acquire errors: {:?}",
                self.acquire_errors
            );
        };
        let sections = &self.sections;
        // The store errors the contenders met (expected while a fault lasts), counted
        // where a reader of the test's output sees them, failing or not.
        let write_errors = sections
            .iter()
            .flat_map(|s| &s.writes)
            .filter(|w| w.outcome.is_err())
            .count();
        let release_errors = sections.iter().filter(|s| s.release.is_err()).count();
        eprintln!(
            "{} sections, {} lost; store errors: {} acquires, {write_errors} writes, \
             {release_errors} releases",
            sections.len(),
            sections.iter().filter(|s| s.loss.is_some()).count(),
            self.acquire_errors.len()
        );
        if sections.len() < 4 {
            fail(format!(
                "too few sections to prove anything: {}",
                sections.len()
            ));
        }
        if let Some(last_fault) = expect.faults.iter().max()
            && sections.iter().filter(|s| s.start > *last_fault).count() < 2
        {
            fail("the contenders did not recover after the fault".to_owned());
        }
        let losses: Vec<&Section> = sections.iter().filter(|s| s.loss.is_some()).collect();
        if expect.someone_loses && losses.is_empty() {
            fail("the fault hit no holder: nobody lost the lock".to_owned());
        }

        // Tokens strictly increase in acquisition order.
        for pair in sections.windows(2) {
            if pair[1].token <= pair[0].token {
                fail(format!(
                    "token {} was issued after token {}",
                    pair[1].token, pair[0].token
                ));
            }
        }

        // Sections do not overlap; or, where a fault allows it, only behind a holder
        // that had lost the lock and was told.
        for (i, earlier) in sections.iter().enumerate() {
            for later in &sections[i + 1..] {
                if later.start >= earlier.end {
                    continue;
                }
                if expect.exclusive {
                    fail(format!(
                        "tokens {} and {} were inside at once",
                        earlier.token, later.token
                    ));
                }
                if earlier.loss.is_none() {
                    fail(format!(
                        "token {} overlapped token {} and its lost signal never fired while \
                         it worked (its release: {:?})",
                        earlier.token, later.token, earlier.release
                    ));
                }
            }
        }

        // Fenced writes: a write sent before any larger token was asked for must
        // apply; a rejection names a larger token that was asked for before it ended.
        // (A token is issued somewhere between its acquire's call and return: a fault
        // can hand the lock on while a holder's first write is in flight.)
        for section in sections {
            let next_start = sections
                .iter()
                .filter(|other| other.token > section.token)
                .map(|other| other.asked)
                .min();
            for write in &section.writes {
                match &write.outcome {
                    Ok(FenceOutcome::Applied) => {}
                    Ok(FenceOutcome::Rejected { highest_seen }) => {
                        if next_start.is_none_or(|next| write.sent < next) {
                            fail(format!(
                                "token {}'s write was rejected (highest seen {highest_seen}) \
                                 while it was the newest token",
                                section.token
                            ));
                        }
                        let beaten_by = sections.iter().find(|s| s.token == *highest_seen);
                        if *highest_seen <= section.token
                            || beaten_by.is_none_or(|s| s.asked > write.done)
                        {
                            fail(format!(
                                "token {}'s write was rejected for {highest_seen}, \
                                 which no earlier holder had",
                                section.token
                            ));
                        }
                        if section.loss.is_none() {
                            fail(format!(
                                "token {} was fenced out yet its lost signal never fired \
                                 while it worked (its release: {:?})",
                                section.token, section.release
                            ));
                        }
                    }
                    Ok(other) => fail(format!("unexpected fence outcome {other:?}")),
                    Err(_) => {}
                }
            }
        }
        // An applied write never follows an applied write of a larger token.
        let applied: Vec<(FencingToken, &WriteRecord)> = sections
            .iter()
            .flat_map(|s| s.writes.iter().map(move |w| (s.token, w)))
            .filter(|(_, w)| matches!(w.outcome, Ok(FenceOutcome::Applied)))
            .collect();
        for (token, write) in &applied {
            for (other_token, other) in &applied {
                if other.done < write.sent && other_token > token {
                    fail(format!(
                        "token {token}'s write applied after token {other_token}'s had"
                    ));
                }
            }
        }

        // Each loss: an expected reason, seen within its bound.
        for section in losses {
            let (reason, seen, deadline) = section.loss.unwrap();
            if !expect.reasons.contains(&reason) {
                fail(format!(
                    "token {} lost its lock with {reason:?}; expected one of {:?}",
                    section.token, expect.reasons
                ));
            }
            match reason {
                LossReason::RenewalFailed => {
                    if seen + Duration::from_millis(1) < deadline {
                        fail(format!(
                            "token {}: RenewalFailed {:?} before its local deadline",
                            section.token,
                            deadline - seen
                        ));
                    }
                    if seen > deadline + DEADLINE_SLACK {
                        fail(format!(
                            "token {}: RenewalFailed {:?} after its local deadline",
                            section.token,
                            seen - deadline
                        ));
                    }
                }
                LossReason::TakenOver | LossReason::Expired => {
                    let Some(fault) = expect.faults.iter().filter(|f| **f <= seen).max() else {
                        fail(format!(
                            "token {} lost its lock ({reason:?}) before any fault",
                            section.token
                        ));
                    };
                    let since = (*fault).max(section.start);
                    let bound = self.ttl / 3 + expect.detect_slack;
                    if seen - since > bound {
                        fail(format!(
                            "token {}: {reason:?} seen {:?} after the fault; the bound is {bound:?}",
                            section.token,
                            seen - since
                        ));
                    }
                }
                other => fail(format!("token {}: unexpected {other:?}", section.token)),
            }
        }
    }
}

/// Waits (up to `limit`) for the lost signal, sampling it every millisecond; returns
/// the reason and the first sample that saw it (no earlier than the signal).
pub async fn first_seen_lost(
    guard: &turnstile::lock::LockGuard,
    limit: Duration,
) -> (LossReason, Instant) {
    let until = Instant::now() + limit;
    while !guard.is_lost() {
        assert!(
            Instant::now() < until,
            "the lost signal did not fire within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    (guard.loss_reason().expect("lost"), Instant::now())
}

/// Waits (bounded by the TTL) until the watchdog has renewed `guard` once: right after
/// that, no renewal is in flight for TTL/3.
pub async fn right_after_a_renewal(guard: &turnstile::lock::LockGuard, ttl: Duration) {
    let before = guard.valid_until();
    eventually("a renewal", ttl, || guard.valid_until() > before).await;
}

/// Asserts that a `RenewalFailed` signal came at the local deadline: not before it,
/// and not later than [`DEADLINE_SLACK`] after it.
pub fn assert_at_deadline(seen: Instant, deadline: Instant) {
    assert!(
        seen + Duration::from_millis(1) >= deadline,
        "the lost signal fired {:?} before the local deadline",
        deadline - seen
    );
    assert!(
        seen <= deadline + DEADLINE_SLACK,
        "the lost signal fired {:?} after the local deadline",
        seen - deadline
    );
}
