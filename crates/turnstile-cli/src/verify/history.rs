//! The history of a verification run: one JSON line per event, one file per worker
//! process and one for the nemesis, every event stamped with the host's monotonic
//! clock (shared by all processes on one host, so events of different workers compare).

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

/// Nanoseconds on the host's monotonic clock (`CLOCK_MONOTONIC`): the same clock in
/// every process, unaffected by steps of the wall clock.
pub(crate) fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec for the call to fill in.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    u64::try_from(now.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(now.tv_nsec).unwrap_or(0)
}

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum EventKind {
    /// A worker asks for the lock.
    Invoke,
    /// The lock is held, with `token`.
    Ok,
    /// The acquire failed (`detail` says why).
    Fail,
    /// A write to the fenced register; `outcome` is `accepted` or `rejected`.
    Write,
    /// The lost signal fired (`detail`: the reason).
    Lost,
    /// The worker stopped its protected work (end of the unfenced section).
    SectionEnd,
    /// The release came back (`outcome`: what it found).
    Released,
    /// The nemesis started a fault (`fault`, `target` worker if any).
    FaultStart,
    /// The nemesis ended a fault.
    FaultEnd,
}

/// One event of the history.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Event {
    /// When, in nanoseconds on the host's monotonic clock.
    pub(crate) t: u64,
    pub(crate) kind: EventKind,
    /// The worker it happened to (`None` for a fault on the store itself).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub(crate) worker: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub(crate) token: Option<u64>,
    /// The permit held, for `verify semaphore` (a lock or an election has one).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub(crate) permit: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub(crate) outcome: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub(crate) fault: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub(crate) detail: Option<String>,
}

impl Event {
    pub(crate) fn now(kind: EventKind, worker: Option<usize>) -> Event {
        Event {
            t: monotonic_ns(),
            kind,
            worker,
            token: None,
            permit: None,
            outcome: None,
            fault: None,
            detail: None,
        }
    }

    pub(crate) fn token(mut self, token: u64) -> Event {
        self.token = Some(token);
        self
    }

    pub(crate) fn permit(mut self, permit: Option<u32>) -> Event {
        self.permit = permit;
        self
    }

    pub(crate) fn outcome(mut self, outcome: impl Into<String>) -> Event {
        self.outcome = Some(outcome.into());
        self
    }

    pub(crate) fn fault(mut self, fault: impl Into<String>) -> Event {
        self.fault = Some(fault.into());
        self
    }

    pub(crate) fn detail(mut self, detail: impl Into<String>) -> Event {
        self.detail = Some(detail.into());
        self
    }
}

/// Appends events to a history file, each flushed as it is written: a worker that is
/// killed loses nothing it recorded.
pub(crate) struct HistoryWriter {
    file: File,
}

impl HistoryWriter {
    pub(crate) fn create(path: &Path) -> std::io::Result<HistoryWriter> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(HistoryWriter { file })
    }

    pub(crate) fn record(&mut self, event: &Event) {
        let mut line = serde_json::to_vec(event).unwrap_or_default();
        line.push(b'\n');
        // One write per line (the file is opened for appending): lines never interleave.
        if let Err(error) = self.file.write_all(&line) {
            eprintln!("turnstile verify: cannot record an event: {error}");
        }
    }
}

/// Every event in the `.jsonl` files of `dir`, in time order. A line cut short (a
/// worker killed while writing it) is skipped.
pub(crate) fn read_all(dir: &Path) -> std::io::Result<Vec<Event>> {
    let mut events = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_none_or(|ext| ext != "jsonl") {
            continue;
        }
        for line in BufReader::new(File::open(&path)?).lines() {
            if let Ok(event) = serde_json::from_str::<Event>(&line?) {
                events.push(event);
            }
        }
    }
    events.sort_by_key(|event| event.t);
    Ok(events)
}
