//! A server whose wall clock is not the host's: the server process runs with
//! libfaketime preloaded, its wall clock (`CLOCK_REALTIME`, `gettimeofday`, `time`)
//! an hour ahead of or behind the host's, running at the same rate. Its monotonic
//! clock is left alone, so the server's own timers and timeouts behave as usual.
//!
//! A test that runs a store against such a server tells the two clocks apart: an
//! engine that compared a deadline written by the host's clock with the server's (or
//! the other way round) would see every lease expired at once, or alive for an hour.

use std::path::PathBuf;
use std::process::Command;

/// Whose wall clock a server runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ServerClock {
    /// The host's, as every other server here.
    Host,
    /// An hour ahead of the host's.
    HourAhead,
    /// An hour behind the host's.
    HourBehind,
}

impl ServerClock {
    /// How far the server's wall clock is from the host's, in seconds.
    pub fn offset_seconds(self) -> i64 {
        match self {
            ServerClock::Host => 0,
            ServerClock::HourAhead => 3600,
            ServerClock::HourBehind => -3600,
        }
    }

    /// Sets `command` (a server about to start) to run on this clock.
    pub(crate) fn apply(self, command: &mut Command) {
        let offset = match self {
            ServerClock::Host => return,
            ServerClock::HourAhead => "+1h",
            ServerClock::HourBehind => "-1h",
        };
        command
            .env("LD_PRELOAD", libfaketime())
            .env("FAKETIME", offset)
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
    }
}

/// Debian's libfaketime (package `faketime`).
fn libfaketime() -> PathBuf {
    let candidates = [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/faketime/libfaketime.so.1",
        "/usr/local/lib/faketime/libfaketime.so.1",
    ];
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|path| path.is_file())
        .unwrap_or_else(|| {
            panic!(
                "libfaketime is not installed; install the Debian package `faketime` \
                 (the README's test command does this: ./scripts/test)"
            )
        })
}

/// A wall clock a test moves while a process runs (`redis-server` does not run under
/// libfaketime; `turnstile` does): the process reads its offset from the host's clock
/// from a file, on every reading (libfaketime's
/// `FAKETIME_TIMESTAMP_FILE` without its cache). Its monotonic clock is left alone.
pub struct SteppableClock {
    file: tempfile::NamedTempFile,
}

impl Default for SteppableClock {
    fn default() -> Self {
        SteppableClock::new()
    }
}

impl SteppableClock {
    /// A clock on the host's time, until [`set_offset`](Self::set_offset) moves it.
    pub fn new() -> SteppableClock {
        let clock = SteppableClock {
            file: tempfile::NamedTempFile::new().expect("cannot make the clock's file"),
        };
        clock.set_offset(0);
        clock
    }

    /// Puts the server's wall clock `seconds` ahead of the host's (behind if negative),
    /// from its next reading on.
    pub fn set_offset(&self, seconds: i64) {
        std::fs::write(self.file.path(), format!("{seconds:+}\n"))
            .expect("cannot write the clock's file");
    }

    /// Sets `command` (a process about to start) to run on this clock.
    pub fn apply(&self, command: &mut Command) {
        command
            .env("LD_PRELOAD", libfaketime())
            .env("FAKETIME_TIMESTAMP_FILE", self.file.path())
            .env("FAKETIME_NO_CACHE", "1")
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
    }
}
