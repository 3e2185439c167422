//! The checker: verdicts from a run's history and the fenced register alone.

use std::collections::BTreeMap;

use serde::Serialize;

use super::history::{Event, EventKind};

/// One write the fenced register accepted, in the order it accepted them.
#[derive(Debug, Clone)]
pub(crate) struct AcceptedWrite {
    pub(crate) worker: usize,
    pub(crate) token: u64,
    /// The permit whose register it went to (0 for a lock or an election).
    pub(crate) permit: u32,
}

/// What the checker needs to know about the run besides its history.
#[derive(Debug, Clone)]
pub(crate) struct RunFacts {
    pub(crate) started_ns: u64,
    pub(crate) ended_ns: u64,
    pub(crate) ttl_ns: u64,
    /// Faults whose effects the store's guarantees do not cover, so that an overlap they
    /// cause is expected (reported, not a violation): `pause` always (a frozen holder
    /// cannot act on its lost signal), `clock` always, `restart` where the engine keeps
    /// locks in memory, `kill-conn` where a lock lives in the holder's session.
    pub(crate) explaining_faults: Vec<String>,
    /// For `verify semaphore`: how many holders the semaphore admits. Each permit is
    /// checked as a lock of its own, and the holders of all permits together are
    /// checked against this number.
    pub(crate) permits: Option<u32>,
}

/// One acquisition, from `ok` to the end of its protected work.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Hold {
    pub(crate) worker: usize,
    pub(crate) token: u64,
    /// The permit held (0 for a lock or an election).
    pub(crate) permit: u32,
    /// When the worker asked for the lock (the attempt that got it).
    pub(crate) invoked: u64,
    pub(crate) start: u64,
    /// End of the protected work: the lost signal or the end of the section.
    pub(crate) end: u64,
    pub(crate) lost_at: Option<u64>,
    pub(crate) released_at: Option<u64>,
    pub(crate) rejected_writes: Vec<u64>,
}

/// A fault window.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct FaultWindow {
    pub(crate) fault: String,
    pub(crate) target: Option<usize>,
    pub(crate) start: u64,
    pub(crate) end: u64,
}

/// Two holders at once.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Overlap {
    /// The permit both held (0 for a lock or an election).
    pub(crate) permit: u32,
    /// The holder with the smaller token (the one whose lease had ended).
    pub(crate) stale_worker: usize,
    pub(crate) stale_token: u64,
    pub(crate) newer_worker: usize,
    pub(crate) newer_token: u64,
    pub(crate) start: u64,
    pub(crate) end: u64,
    /// The fault that explains it, if one does.
    pub(crate) explained_by: Option<String>,
    /// The stale holder tried to write during or after the overlap and the fence
    /// refused it.
    pub(crate) stopped_by_fence: bool,
}

/// A check's verdict.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Verdict {
    pub(crate) check: &'static str,
    pub(crate) passed: bool,
    pub(crate) detail: String,
}

/// Everything the checker found in one run.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RunCheck {
    pub(crate) acquisitions: usize,
    pub(crate) failed_acquires: usize,
    pub(crate) writes_accepted: usize,
    pub(crate) writes_rejected: usize,
    pub(crate) faults: BTreeMap<String, usize>,
    pub(crate) overlaps: Vec<Overlap>,
    /// Per lost signal: how long before the next holder got the lock it fired, in
    /// milliseconds (negative: after; such a case is also an overlap).
    pub(crate) lost_signal_margins_ms: Vec<f64>,
    /// Hand-over gaps (end of one hold to start of the next), in milliseconds.
    pub(crate) handover_gaps_ms: Vec<f64>,
    pub(crate) verdicts: Vec<Verdict>,
    #[serde(skip)]
    pub(crate) holds: Vec<Hold>,
    #[serde(skip)]
    pub(crate) fault_windows: Vec<FaultWindow>,
}

impl RunCheck {
    /// Whether every safety and liveness check passed.
    pub(crate) fn passed(&self) -> bool {
        self.verdicts.iter().all(|verdict| verdict.passed)
    }
}

fn ms(ns: u64, since: u64) -> f64 {
    (ns as f64 - since as f64) / 1e6
}

/// Rebuilds holds and fault windows from the history.
fn holds_and_faults(events: &[Event], facts: &RunFacts) -> (Vec<Hold>, Vec<FaultWindow>, usize) {
    let mut holds: Vec<Hold> = Vec::new();
    // Per worker: its open hold (index into `holds`) and its last invoke.
    let mut open: BTreeMap<usize, usize> = BTreeMap::new();
    let mut invoked: BTreeMap<usize, u64> = BTreeMap::new();
    let mut faults: Vec<FaultWindow> = Vec::new();
    let mut open_faults: Vec<usize> = Vec::new();
    let mut failed = 0;
    for event in events {
        let worker = event.worker.unwrap_or(usize::MAX);
        match event.kind {
            EventKind::Invoke => {
                invoked.insert(worker, event.t);
            }
            EventKind::Fail => failed += 1,
            EventKind::Ok => {
                holds.push(Hold {
                    worker,
                    token: event.token.unwrap_or(0),
                    permit: event.permit.unwrap_or(0),
                    invoked: invoked.get(&worker).copied().unwrap_or(event.t),
                    start: event.t,
                    end: facts.ended_ns.max(event.t),
                    lost_at: None,
                    released_at: None,
                    rejected_writes: Vec::new(),
                });
                open.insert(worker, holds.len() - 1);
            }
            EventKind::Lost => {
                if let Some(&index) = open.get(&worker) {
                    let hold = &mut holds[index];
                    hold.lost_at.get_or_insert(event.t);
                    hold.end = hold.end.min(event.t);
                }
            }
            EventKind::Write => {
                if event.outcome.as_deref() == Some("rejected")
                    && let Some(&index) = open.get(&worker)
                {
                    holds[index].rejected_writes.push(event.t);
                }
            }
            EventKind::SectionEnd => {
                if let Some(&index) = open.get(&worker) {
                    let hold = &mut holds[index];
                    hold.end = hold.end.min(event.t);
                }
            }
            EventKind::Released => {
                if let Some(index) = open.remove(&worker) {
                    holds[index].released_at = Some(event.t);
                }
            }
            EventKind::FaultStart if event.fault.as_deref() == Some("killed") => {
                // A worker killed at the end of a run stops its work there.
                if let Some(index) = open.remove(&worker) {
                    holds[index].end = holds[index].end.min(event.t);
                }
            }
            EventKind::FaultStart => {
                faults.push(FaultWindow {
                    fault: event.fault.clone().unwrap_or_default(),
                    target: event.worker,
                    start: event.t,
                    end: facts.ended_ns.max(event.t),
                });
                open_faults.push(faults.len() - 1);
            }
            EventKind::FaultEnd => {
                let fault = event.fault.clone().unwrap_or_default();
                if let Some(position) = open_faults
                    .iter()
                    .position(|&i| faults[i].fault == fault && faults[i].target == event.worker)
                {
                    let index = open_faults.remove(position);
                    faults[index].end = event.t;
                }
            }
        }
    }
    (holds, faults, failed)
}

/// Checks one run.
pub(crate) fn check(events: &[Event], register: &[AcceptedWrite], facts: &RunFacts) -> RunCheck {
    let (mut holds, fault_windows, failed_acquires) = holds_and_faults(events, facts);
    holds.sort_by_key(|hold| hold.start);
    let mut verdicts = Vec::new();

    // 1. The fenced register never accepted a token smaller than one it had accepted.
    // Each permit has a register of its own.
    let mut last_accepted: BTreeMap<u32, &AcceptedWrite> = BTreeMap::new();
    let mut regressions: Vec<String> = Vec::new();
    for write in register {
        if let Some(last) = last_accepted.insert(write.permit, write)
            && write.token < last.token
        {
            regressions.push(format!(
                "token {} (worker {}) accepted after {} (worker {}){}",
                write.token,
                write.worker,
                last.token,
                last.worker,
                of_permit(facts, write.permit)
            ));
        }
    }
    verdicts.push(Verdict {
        check: "fenced register monotonic",
        passed: regressions.is_empty(),
        detail: if regressions.is_empty() {
            format!("{} writes accepted in token order", register.len())
        } else {
            regressions.join("; ")
        },
    });

    // 2. Overlaps of holders, each explained by a fault the store does not promise to
    // survive, or a violation.
    let mut overlaps = Vec::new();
    for (i, a) in holds.iter().enumerate() {
        for b in holds.iter().skip(i + 1) {
            if b.start >= a.end {
                // Holds are sorted by start, but a long one can still overlap later ones.
                continue;
            }
            if a.worker == b.worker || a.permit != b.permit {
                continue;
            }
            let (stale, newer) = if a.token <= b.token { (a, b) } else { (b, a) };
            let start = a.start.max(b.start);
            let end = a.end.min(b.end);
            let window_from = stale.start.saturating_sub(facts.ttl_ns);
            let explained_by = fault_windows
                .iter()
                .filter(|fault| facts.explaining_faults.contains(&fault.fault))
                .filter(|fault| fault.target.is_none_or(|target| target == stale.worker))
                .find(|fault| fault.start <= start && fault.end >= window_from)
                .map(|fault| fault.fault.clone());
            overlaps.push(Overlap {
                permit: a.permit,
                stale_worker: stale.worker,
                stale_token: stale.token,
                newer_worker: newer.worker,
                newer_token: newer.token,
                start,
                end,
                explained_by,
                stopped_by_fence: stale.rejected_writes.iter().any(|&t| t >= start),
            });
        }
    }
    let unexplained: Vec<String> = overlaps
        .iter()
        .filter(|overlap| overlap.explained_by.is_none())
        .map(|overlap| {
            format!(
                "workers {} (token {}) and {} (token {}) both held the lock{} from {:.1} ms to {:.1} ms with no fault to explain it",
                overlap.stale_worker,
                overlap.stale_token,
                overlap.newer_worker,
                overlap.newer_token,
                of_permit(facts, overlap.permit),
                ms(overlap.start, facts.started_ns),
                ms(overlap.end, facts.started_ns)
            )
        })
        .collect();
    verdicts.push(Verdict {
        check: "no unexplained overlap",
        passed: unexplained.is_empty(),
        detail: if unexplained.is_empty() {
            format!(
                "{} overlaps, each under a fault the engine does not promise to survive; {} stopped by the fence",
                overlaps.len(),
                overlaps.iter().filter(|o| o.stopped_by_fence).count()
            )
        } else {
            unexplained.join("; ")
        },
    });

    // 2b. A semaphore: never more holders than permits, beyond what explained overlaps
    // account for.
    if let Some(permits) = facts.permits {
        let (violations, most) = over_admitted(&holds, &overlaps, permits, facts.started_ns);
        verdicts.push(Verdict {
            check: "at most N holders",
            passed: violations.is_empty(),
            detail: if violations.is_empty() && most > permits as usize {
                format!(
                    "at most {most} holders at once of {permits} permits; more than {permits} \
                     only inside overlaps a fault explains"
                )
            } else if violations.is_empty() {
                format!("at most {most} holders at once of {permits} permits")
            } else {
                violations.join("; ")
            },
        });
    }

    // 3. Lost signals: how long before the next holder each fired.
    let lost_signal_margins_ms: Vec<f64> = holds
        .iter()
        .filter_map(|hold| {
            let lost_at = hold.lost_at?;
            let next = holds
                .iter()
                .filter(|other| other.permit == hold.permit)
                .filter(|other| other.worker != hold.worker && other.start > hold.start)
                .map(|other| other.start)
                .min()?;
            Some((next as f64 - lost_at as f64) / 1e6)
        })
        .collect();

    // 4. Tokens: a hold that began after another was released has a larger token.
    // Per permit: each is a lock of its own, with tokens of its own.
    let mut token_regressions = Vec::new();
    let permits: std::collections::BTreeSet<u32> = holds.iter().map(|hold| hold.permit).collect();
    for permit in permits {
        let of_this: Vec<&Hold> = holds.iter().filter(|hold| hold.permit == permit).collect();
        token_regressions.extend(
            regressed_tokens(&of_this)
                .into_iter()
                .map(|regression| format!("{regression}{}", of_permit(facts, permit))),
        );
    }
    verdicts.push(Verdict {
        check: "tokens increase",
        passed: token_regressions.is_empty(),
        detail: if token_regressions.is_empty() {
            format!(
                "{} acquisitions; every one that began after a release has a larger token",
                holds.len()
            )
        } else {
            token_regressions.join("; ")
        },
    });

    // 5. Liveness: an acquisition in every fault-free window long enough to expect one
    // (faults widened by two TTLs and two seconds of recovery).
    let recovery = 2 * facts.ttl_ns + 2_000_000_000;
    let mut busy: Vec<(u64, u64)> = fault_windows
        .iter()
        .map(|fault| (fault.start, fault.end.saturating_add(recovery)))
        .collect();
    busy.push((facts.started_ns, facts.started_ns + 2_000_000_000));
    busy.sort_unstable();
    let mut windows = Vec::new();
    let mut cursor = facts.started_ns;
    for (start, end) in busy {
        if start > cursor {
            windows.push((cursor, start));
        }
        cursor = cursor.max(end);
    }
    let run_end = facts.ended_ns.saturating_sub(500_000_000);
    if run_end > cursor {
        windows.push((cursor, run_end));
    }
    let needed = 3_000_000_000u64.max(4 * facts.ttl_ns);
    let long_windows: Vec<(u64, u64)> = windows
        .into_iter()
        .filter(|(start, end)| end - start >= needed)
        .collect();
    // A stretch of a fault-free window at least `needed` long with no acquisition in it
    // is a stall, wherever it falls: a window that made progress only at its start
    // stalled all the same.
    let mut stalled = Vec::new();
    for (start, end) in &long_windows {
        let mut points: Vec<u64> = holds
            .iter()
            .map(|hold| hold.start)
            .filter(|at| at >= start && at < end)
            .collect();
        points.sort_unstable();
        points.insert(0, *start);
        points.push(*end);
        for pair in points.windows(2) {
            if pair[1] - pair[0] >= needed {
                stalled.push(format!(
                    "no acquisition between {:.0} ms and {:.0} ms (no fault)",
                    ms(pair[0], facts.started_ns),
                    ms(pair[1], facts.started_ns)
                ));
            }
        }
    }
    verdicts.push(Verdict {
        check: "progress without faults",
        passed: stalled.is_empty(),
        detail: if stalled.is_empty() {
            format!(
                "{} fault-free windows, each with acquisitions",
                long_windows.len()
            )
        } else {
            stalled.join("; ")
        },
    });

    let mut handover_gaps_ms = Vec::new();
    let mut previous_end: BTreeMap<u32, u64> = BTreeMap::new();
    for hold in &holds {
        let Some(end) = previous_end.insert(hold.permit, hold.end) else {
            continue;
        };
        let gap = hold.start as f64 - end as f64;
        if gap >= 0.0 {
            handover_gaps_ms.push(gap / 1e6);
        }
    }
    let mut faults = BTreeMap::new();
    for fault in &fault_windows {
        *faults.entry(fault.fault.clone()).or_insert(0) += 1;
    }
    let writes = events.iter().filter(|e| e.kind == EventKind::Write);
    let (mut writes_accepted, mut writes_rejected) = (0, 0);
    for write in writes {
        match write.outcome.as_deref() {
            Some("accepted") => writes_accepted += 1,
            Some("rejected") => writes_rejected += 1,
            _ => {}
        }
    }
    RunCheck {
        acquisitions: holds.len(),
        failed_acquires,
        writes_accepted,
        writes_rejected,
        faults,
        overlaps,
        lost_signal_margins_ms,
        handover_gaps_ms,
        verdicts,
        holds,
        fault_windows,
    }
}

/// The acquisitions among `holds` (of one lock) that began after another was released
/// and got a token no larger than the largest released before they asked.
fn regressed_tokens(holds: &[&Hold]) -> Vec<String> {
    let mut by_release: Vec<(u64, u64, usize)> = holds
        .iter()
        .filter_map(|hold| hold.released_at.map(|at| (at, hold.token, hold.worker)))
        .collect();
    by_release.sort_unstable();
    let mut by_invoke: Vec<&Hold> = holds.to_vec();
    by_invoke.sort_by_key(|hold| hold.invoked);
    let mut highest_released: Option<(u64, usize)> = None;
    let mut released = by_release.iter().peekable();
    let mut regressions = Vec::new();
    for hold in by_invoke {
        while let Some(&&(at, token, worker)) = released.peek() {
            if at >= hold.invoked {
                break;
            }
            if highest_released.is_none_or(|(highest, _)| token > highest) {
                highest_released = Some((token, worker));
            }
            released.next();
        }
        if let Some((highest, worker)) = highest_released
            && hold.token <= highest
        {
            regressions.push(format!(
                "worker {} got token {} after worker {worker} had released token {highest}",
                hold.worker, hold.token
            ));
        }
    }
    regressions
}

/// " (permit N)" for a semaphore's permit, nothing for a lock.
fn of_permit(facts: &RunFacts, permit: u32) -> String {
    if facts.permits.is_some() {
        format!(" (permit {permit})")
    } else {
        String::new()
    }
}

/// For a semaphore of `permits`: the moments when more holders than that held at
/// once, each not inside an overlap a fault explains; and the most holders seen at
/// once.
fn over_admitted(
    holds: &[Hold],
    overlaps: &[Overlap],
    permits: u32,
    started_ns: u64,
) -> (Vec<String>, usize) {
    let mut changes: Vec<(u64, i64)> = holds
        .iter()
        .filter(|hold| hold.end > hold.start)
        .flat_map(|hold| [(hold.start, 1), (hold.end, -1)])
        .collect();
    // Ends before starts at the same instant: a hand-over is not two holders.
    changes.sort_unstable();
    let (mut inside, mut most) = (0i64, 0i64);
    let mut violations = Vec::new();
    for (at, change) in changes {
        inside += change;
        most = most.max(inside);
        if change > 0 && inside > i64::from(permits) {
            let explained = overlaps
                .iter()
                .any(|o| o.explained_by.is_some() && o.start <= at && at < o.end);
            if !explained {
                violations.push(format!(
                    "{inside} holders of {permits} permits at once at {:.1} ms with no fault to explain it",
                    ms(at, started_ns)
                ));
            }
        }
    }
    (violations, usize::try_from(most).unwrap_or(0))
}

/// The `p`th percentile (0–100) of `values`, by nearest rank.
pub(crate) fn percentile(values: &[f64], p: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(t: u64, kind: EventKind, worker: usize, token: Option<u64>) -> Event {
        let mut event = Event::now(kind, Some(worker));
        event.t = t;
        event.token = token;
        event
    }

    fn facts(explaining: &[&str]) -> RunFacts {
        RunFacts {
            started_ns: 0,
            ended_ns: 20_000_000_000,
            ttl_ns: 1_000_000_000,
            explaining_faults: explaining.iter().map(|s| s.to_string()).collect(),
            permits: None,
        }
    }

    fn semaphore(permits: u32) -> RunFacts {
        RunFacts {
            permits: Some(permits),
            ..facts(&["pause"])
        }
    }

    fn verdict<'a>(run: &'a RunCheck, name: &str) -> &'a Verdict {
        run.verdicts.iter().find(|v| v.check == name).unwrap()
    }

    /// `overlapping()` with worker 1's events on permit 1 instead of permit 0.
    fn on_two_permits() -> Vec<Event> {
        overlapping()
            .into_iter()
            .map(|event| {
                let permit = (event.worker == Some(1) && event.kind != EventKind::Invoke)
                    .then_some(1)
                    .or(Some(0));
                event.permit(permit)
            })
            .collect()
    }

    #[test]
    fn holders_of_different_permits_do_not_overlap_but_count_against_the_permits() {
        let run = check(&on_two_permits(), &[], &semaphore(2));
        assert!(run.overlaps.is_empty(), "{:?}", run.overlaps);
        assert!(verdict(&run, "no unexplained overlap").passed);
        assert!(
            verdict(&run, "at most N holders")
                .detail
                .starts_with("at most 2 holders")
        );
        // The same history is two holders too many for a semaphore of one permit.
        let run = check(&on_two_permits(), &[], &semaphore(1));
        assert!(!verdict(&run, "at most N holders").passed);
        // Two holders of one permit are an overlap, as two holders of a lock are.
        let run = check(&overlapping(), &[], &semaphore(2));
        assert_eq!(run.overlaps.len(), 1);
        assert!(!verdict(&run, "no unexplained overlap").passed);
    }

    #[test]
    fn each_permit_has_its_own_register() {
        let writes = [
            AcceptedWrite {
                worker: 0,
                token: 5,
                permit: 0,
            },
            AcceptedWrite {
                worker: 1,
                token: 4,
                permit: 1,
            },
        ];
        let run = check(&[], &writes, &semaphore(2));
        assert!(verdict(&run, "fenced register monotonic").passed);
        let writes = [
            writes[0].clone(),
            AcceptedWrite {
                permit: 0,
                ..writes[1].clone()
            },
        ];
        let run = check(&[], &writes, &semaphore(2));
        assert!(!verdict(&run, "fenced register monotonic").passed);
    }

    const MS: u64 = 1_000_000;

    /// Worker 0 holds token 1 from 100 to 900 ms; worker 1 takes token 2 at 500 ms.
    fn overlapping() -> Vec<Event> {
        vec![
            event(50 * MS, EventKind::Invoke, 0, None),
            event(100 * MS, EventKind::Ok, 0, Some(1)),
            event(450 * MS, EventKind::Invoke, 1, None),
            event(500 * MS, EventKind::Ok, 1, Some(2)),
            event(600 * MS, EventKind::SectionEnd, 1, Some(2)),
            event(610 * MS, EventKind::Released, 1, Some(2)),
            event(900 * MS, EventKind::SectionEnd, 0, Some(1)),
            event(910 * MS, EventKind::Released, 0, Some(1)),
        ]
    }

    #[test]
    fn an_overlap_without_a_fault_is_a_violation() {
        let run = check(&overlapping(), &[], &facts(&["pause"]));
        assert_eq!(run.overlaps.len(), 1);
        assert!(!run.passed());
        let verdict = run
            .verdicts
            .iter()
            .find(|v| v.check == "no unexplained overlap")
            .unwrap();
        assert!(!verdict.passed, "{verdict:?}");
    }

    #[test]
    fn an_overlap_under_a_pause_of_the_stale_holder_is_explained() {
        let mut events = overlapping();
        let mut pause = event(200 * MS, EventKind::FaultStart, 0, None);
        pause.fault = Some("pause".into());
        let mut resume = event(800 * MS, EventKind::FaultEnd, 0, None);
        resume.fault = Some("pause".into());
        events.extend([pause, resume]);
        events.sort_by_key(|e| e.t);
        let run = check(&events, &[], &facts(&["pause"]));
        assert_eq!(run.overlaps[0].explained_by.as_deref(), Some("pause"));
        // A partition explains nothing: the lock core must stop the holder in time.
        let run = check(&events, &[], &facts(&[]));
        assert!(run.overlaps[0].explained_by.is_none());
    }

    #[test]
    fn the_register_must_accept_tokens_in_order() {
        let writes = [
            AcceptedWrite {
                worker: 0,
                token: 5,
                permit: 0,
            },
            AcceptedWrite {
                worker: 1,
                token: 4,
                permit: 0,
            },
        ];
        let run = check(&[], &writes, &facts(&[]));
        let verdict = run
            .verdicts
            .iter()
            .find(|v| v.check == "fenced register monotonic")
            .unwrap();
        assert!(!verdict.passed);
    }

    #[test]
    fn a_smaller_token_after_a_release_is_a_violation() {
        let events = vec![
            event(100 * MS, EventKind::Invoke, 0, None),
            event(110 * MS, EventKind::Ok, 0, Some(9)),
            event(120 * MS, EventKind::SectionEnd, 0, Some(9)),
            event(130 * MS, EventKind::Released, 0, Some(9)),
            event(140 * MS, EventKind::Invoke, 1, None),
            event(150 * MS, EventKind::Ok, 1, Some(3)),
        ];
        let run = check(&events, &[], &facts(&[]));
        let verdict = run
            .verdicts
            .iter()
            .find(|v| v.check == "tokens increase")
            .unwrap();
        assert!(!verdict.passed);
    }

    #[test]
    fn a_fault_free_window_without_acquisitions_fails_liveness() {
        // Acquisitions every 200 ms through the run; then only in its first 10 s.
        let events: Vec<Event> = (0..88)
            .flat_map(|i| {
                let t = 2_000 * MS + i * 200 * MS;
                [
                    event(t, EventKind::Invoke, 0, None),
                    event(t + MS, EventKind::Ok, 0, Some(i + 1)),
                    event(t + 2 * MS, EventKind::SectionEnd, 0, Some(i + 1)),
                    event(t + 3 * MS, EventKind::Released, 0, Some(i + 1)),
                ]
            })
            .collect();
        let run = check(&events, &[], &facts(&[]));
        let verdict = run
            .verdicts
            .iter()
            .find(|v| v.check == "progress without faults")
            .unwrap();
        assert!(verdict.passed, "{verdict:?}");
        let stalled = check(&events[..160], &[], &facts(&[]));
        let verdict = stalled
            .verdicts
            .iter()
            .find(|v| v.check == "progress without faults")
            .unwrap();
        assert!(!verdict.passed, "{verdict:?}");
    }
}
