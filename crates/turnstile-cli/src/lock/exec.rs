//! `turnstile lock exec`: run a command while holding a lock.
//!
//! turnstile does not start the command itself. It starts a small supervisor, the
//! turnstile binary run again as the hidden subcommand [`SUPERVISOR`], which starts the
//! command as the leader of a process group of its own and stays its parent:
//!
//! ```text
//! turnstile ──requests pipe──▶ supervisor ──▶ command (its own process group)
//!           ◀──reports pipe───                  └─ what it starts (same group)
//! ```
//!
//! turnstile holds the only write end of the requests pipe, so the pipe closes when
//! turnstile dies, however it dies (`kill -9` included). The supervisor then ends the
//! command's whole group, SIGTERM and SIGKILL after `--kill-after`, and exits: nothing
//! the command started runs on with no one renewing the lock. On Linux the supervisor
//! is also a child subreaper, so what left the group (a double fork, a new session) is
//! handed to it and ended too. This works on Linux and macOS alike; the kernel's
//! parent-death signal (Linux) only backs it up, killing the command should the
//! supervisor itself be killed.
//!
//! While turnstile lives, the supervisor does what it asks ([`Request`]: pass a signal
//! on, terminate, kill, done) and reports the command's pid and exit code
//! ([`Report`]); the decisions (lost lock, grace, signals) stay in turnstile.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{PipeWriter, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{ExitCode, ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;
use tokio::process::{Child, Command};
use tokio::signal::unix::{SignalKind, signal};
use tokio::time::{Instant, sleep, sleep_until};
use turnstile::lock::{
    LockGuard, LockName, LockOptions, Locker, LossReason, LostSignal, ReleaseOutcome, UnfencedGuard,
};

use super::ExecArgs;
use crate::{exit, fail};

pub(crate) async fn run(args: ExecArgs) -> ExitCode {
    if args.command.is_empty() {
        eprintln!(
            "turnstile: no command given; usage: turnstile lock exec [OPTIONS] NAME -- CMD [ARGS...]"
        );
        return ExitCode::from(exit::USAGE);
    }
    let name = match LockName::new(args.name.as_str()) {
        Ok(name) => name,
        Err(error) => return fail(&error),
    };
    let mut options = LockOptions::new().ttl(args.ttl);
    options = match (args.no_wait, args.wait) {
        (true, _) => options.wait(Duration::ZERO),
        (false, Some(wait)) => options.wait(wait),
        (false, None) => options.wait_forever(),
    };
    if let Some(cap) = args.max_hold {
        options = options.max_hold(cap);
    }
    if let Err(error) = options.validate() {
        return fail(&error);
    }
    let kill_after = match kill_after_within(args.ttl, options.get_clock_drift(), args.kill_after) {
        Ok(kill_after) => kill_after,
        Err(message) => {
            eprintln!("turnstile: {message}");
            return ExitCode::from(exit::USAGE);
        }
    };
    let locker: Locker = match args.store.locker().await {
        Ok(locker) => locker,
        Err(error) => return fail(&error),
    };
    // Under a semaphore, the lock held is one of its permits, `NAME#SLOT`.
    let mut environment = Vec::new();
    let acquired = if let Some(permits) = args.permits {
        turnstile::semaphore::Semaphore::new(locker)
            .acquire(name.clone(), permits, &options)
            .await
            .map(|permit| {
                environment.push(("TURNSTILE_SEMAPHORE", name.as_str().to_owned()));
                environment.push(("TURNSTILE_PERMIT", permit.slot().to_string()));
                HeldLock::Fenced(permit.into_guard())
            })
    } else if args.unfenced {
        locker
            .acquire_unfenced(name.clone(), &options)
            .await
            .map(HeldLock::Unfenced)
    } else {
        locker
            .acquire(name.clone(), &options)
            .await
            .map(HeldLock::Fenced)
    };
    let guard = match acquired {
        Ok(guard) => guard,
        Err(error) => return fail(&error),
    };
    environment.push(("TURNSTILE_LOCK_NAME", guard.name().as_str().to_owned()));
    // An unfenced lock has no token: the variable is not set, never made up.
    if let HeldLock::Fenced(guard) = &guard {
        environment.push(("TURNSTILE_FENCING_TOKEN", guard.fencing_token().to_string()));
    }
    ExitCode::from(
        run_held(guard, &args.command, &environment, kill_after)
            .await
            .code,
    )
}

/// How a command run under a lock ended.
pub(crate) struct Ended {
    /// turnstile's exit status: the command's own, or one of [`exit`]'s.
    pub(crate) code: u8,
    /// Whether turnstile was asked to stop (SIGINT, SIGTERM, SIGHUP or SIGQUIT, passed
    /// on to the command) while it ran.
    pub(crate) signalled: bool,
}

impl Ended {
    fn code(code: u8) -> Ended {
        Ended {
            code,
            signalled: false,
        }
    }
}

/// Runs `command` (non-empty) under `guard` with `environment` added, as `lock exec`
/// does once it holds the lock, and releases the lock when it ends.
pub(crate) async fn run_held(
    guard: HeldLock,
    command: &[String],
    environment: &[(&str, String)],
    kill_after: Duration,
) -> Ended {
    let program = command.first().map_or("", String::as_str);
    if let Some(why) = too_late_to_start(&guard, kill_after) {
        eprintln!(
            "turnstile: lock {:?} {why}; not running the command",
            guard.name().as_str()
        );
        let _ = guard.release().await;
        return Ended::code(exit::LOST);
    }
    let supervisor = match Supervisor::start(command, environment, kill_after) {
        Ok(supervisor) => supervisor,
        Err(error) => {
            eprintln!(
                "turnstile: cannot start the process that runs the command (the turnstile \
                 binary, run again): {error}"
            );
            let _ = guard.release().await;
            return Ended::code(exit::SOFTWARE);
        }
    };
    supervise(supervisor, program, guard, kill_after).await
}

/// The lock the command runs under: fenced (the default) or `--unfenced`.
pub(crate) enum HeldLock {
    Fenced(LockGuard),
    Unfenced(UnfencedGuard),
}

impl HeldLock {
    fn name(&self) -> &LockName {
        match self {
            HeldLock::Fenced(guard) => guard.name(),
            HeldLock::Unfenced(guard) => guard.name(),
        }
    }

    fn is_lost(&self) -> bool {
        match self {
            HeldLock::Fenced(guard) => guard.is_lost(),
            HeldLock::Unfenced(guard) => guard.is_lost(),
        }
    }

    fn loss_reason(&self) -> Option<LossReason> {
        match self {
            HeldLock::Fenced(guard) => guard.loss_reason(),
            HeldLock::Unfenced(guard) => guard.loss_reason(),
        }
    }

    fn valid_until(&self) -> Instant {
        match self {
            HeldLock::Fenced(guard) => guard.valid_until(),
            HeldLock::Unfenced(guard) => guard.valid_until(),
        }
    }

    fn lost(&self) -> LostSignal {
        match self {
            HeldLock::Fenced(guard) => guard.lost(),
            HeldLock::Unfenced(guard) => guard.lost(),
        }
    }

    async fn release(self) -> turnstile::Result<ReleaseOutcome> {
        match self {
            HeldLock::Fenced(guard) => guard.release().await,
            HeldLock::Unfenced(guard) => guard.release().await,
        }
    }
}

/// The default `--kill-after`, for TTLs long enough to fit it (see [`kill_after_within`]).
const DEFAULT_KILL_AFTER: Duration = Duration::from_secs(10);

/// The grace between SIGTERM and SIGKILL: `requested`, or by default 10 s or TTL/3,
/// whichever is shorter.
///
/// When renewals stop succeeding, termination starts `kill_after` before the lease
/// runs out, so that the SIGKILL lands before another holder can get the lock. The
/// watchdog renews every TTL/3, and the lease is counted from when a renewal was sent,
/// less the clock-drift allowance; termination must start after the next renewal is
/// due, or it would start every time. Hence `kill_after` < 2/3 TTL - drift.
pub(crate) fn kill_after_within(
    ttl: Duration,
    drift: Duration,
    requested: Option<Duration>,
) -> Result<Duration, String> {
    let limit = (ttl * 2 / 3).saturating_sub(drift);
    let Some(kill_after) = requested else {
        return Ok(DEFAULT_KILL_AFTER.min(ttl / 3));
    };
    if kill_after >= limit {
        return Err(format!(
            "--kill-after {} does not fit in --ttl {}: when renewals fail, SIGTERM goes out \
             --kill-after before the lease runs out, which must be later than the next \
             renewal (due at TTL/3); use a --kill-after under {} (two thirds of the TTL, \
             less the clock-drift allowance) or a longer --ttl",
            humantime::format_duration(kill_after),
            humantime::format_duration(ttl),
            in_ms(limit)
        ));
    }
    Ok(kill_after)
}

/// Why the command must not start, if the lock is already lost or the lease has too
/// little left: an acquire that took longer than the TTL to answer succeeds with a
/// lease counted from when it was sent. The command would only be terminated at once.
fn too_late_to_start(guard: &HeldLock, kill_after: Duration) -> Option<String> {
    if guard.is_lost() {
        let reason = guard
            .loss_reason()
            .map_or_else(|| "reason unknown".to_owned(), |reason| reason.to_string());
        return Some(format!(
            "was lost before the command could start ({reason})"
        ));
    }
    // The library notices an elapsed lease only when its keeper task next runs, which
    // on this single-threaded runtime is after the spawn; so look at the lease itself.
    let now = Instant::now();
    if termination_start(guard.valid_until(), kill_after) <= now {
        let left = guard.valid_until().saturating_duration_since(now);
        return Some(format!(
            "was acquired too late to use: the store answered so late that the lease \
             has {:.3}s left, less than the --kill-after grace of {}",
            left.as_secs_f64(),
            in_ms(kill_after)
        ));
    }
    None
}

/// Waits for the command, forwarding SIGINT, SIGTERM, SIGHUP and SIGQUIT to its process
/// group; terminates the group if the lock is lost, or `kill_after` before the lease
/// runs out if renewals have not extended it by then.
///
/// Neither the command's group nor the supervisor's is the terminal's foreground group,
/// so the terminal's SIGINT (Ctrl-C) and SIGQUIT reach only turnstile, which passes them
/// on. SIGTSTP (Ctrl-Z) is refused: it would stop turnstile, and so the renewals, while
/// the command ran on.
async fn supervise(
    mut supervisor: Supervisor,
    program: &str,
    guard: HeldLock,
    kill_after: Duration,
) -> Ended {
    let (Ok(mut terminate), Ok(mut hangup), Ok(mut interrupt), Ok(mut quit), Ok(mut suspend)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::quit()),
        signal(SignalKind::from_raw(libc::SIGTSTP)),
    ) else {
        eprintln!("turnstile: cannot install signal handlers");
        supervisor.kill().await;
        let _ = guard.release().await;
        return Ended::code(exit::SOFTWARE);
    };
    let lost = guard.lost();
    tokio::pin!(lost);
    let mut signalled = false;
    // The library fires the lost signal only when the lease has run out, too late for
    // any grace; so termination starts `kill_after` earlier unless a renewal moves the
    // lease on first.
    let mut terminate_at = termination_start(guard.valid_until(), kill_after);
    loop {
        tokio::select! {
            outcome = supervisor.outcome() => {
                let code = match outcome {
                    Outcome::Exited(code) => {
                        // What the command left running is left alone, as documented.
                        supervisor.ask(Request::Done);
                        let _ = supervisor.process.wait().await;
                        code
                    }
                    Outcome::Failed { code, message } => {
                        eprintln!("turnstile: cannot run {program:?}: {message}");
                        let _ = supervisor.process.wait().await;
                        let _ = guard.release().await;
                        return Ended { code, signalled };
                    }
                    Outcome::Silent => {
                        let status = match supervisor.process.wait().await {
                            Ok(status) => status.to_string(),
                            Err(error) => error.to_string(),
                        };
                        if supervisor.command.is_some() {
                            eprintln!(
                                "turnstile: lost track of the command: the process running \
                                 it ended unexpectedly ({status}); terminating what is left"
                            );
                        } else {
                            eprintln!(
                                "turnstile: the process that was to run the command ended \
                                 before starting it ({status})"
                            );
                        }
                        let kill_at = (Instant::now() + kill_after).min(guard.valid_until());
                        supervisor.end_group_directly(kill_at).await;
                        exit::SOFTWARE
                    }
                };
                if let Err(error) = guard.release().await {
                    eprintln!("turnstile: the command finished but the lock could not be released ({error}); it expires on its own");
                }
                return Ended { code, signalled };
            }
            reason = &mut lost => {
                eprintln!(
                    "turnstile: lock {:?} lost ({reason}); terminating the command",
                    guard.name().as_str()
                );
                // Whatever the reason, the grace never runs past the lease as known here.
                let kill_at = (Instant::now() + kill_after).min(guard.valid_until());
                supervisor.terminate(kill_at).await;
                let _ = guard.release().await;
                return Ended { code: exit::LOST, signalled };
            }
            () = sleep_until(terminate_at) => {
                let valid_until = guard.valid_until();
                let renewed_start = termination_start(valid_until, kill_after);
                if renewed_start > terminate_at {
                    terminate_at = renewed_start;
                    continue;
                }
                eprintln!(
                    "turnstile: lock {:?} not renewed in time (its lease runs out in {:.1}s); terminating the command",
                    guard.name().as_str(),
                    valid_until.saturating_duration_since(Instant::now()).as_secs_f64()
                );
                supervisor.terminate(valid_until).await;
                let _ = guard.release().await;
                return Ended { code: exit::LOST, signalled };
            }
            _ = terminate.recv() => { signalled = true; supervisor.ask(Request::SigTerm) }
            _ = hangup.recv() => { signalled = true; supervisor.ask(Request::SigHup) }
            _ = interrupt.recv() => { signalled = true; supervisor.ask(Request::SigInt) }
            _ = quit.recv() => { signalled = true; supervisor.ask(Request::SigQuit) }
            _ = suspend.recv() => eprintln!(
                "turnstile: not suspending: the command would run on while its lock went unrenewed"
            ),
        }
    }
}

/// A computed `duration` for a message, rounded down to the millisecond: "166ms 666us
/// 666ns" reads badly.
fn in_ms(duration: Duration) -> humantime::FormattedDuration {
    humantime::format_duration(Duration::from_millis(whole_ms(duration)))
}

/// `duration` in whole milliseconds.
fn whole_ms(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// When to start terminating the command if the lease is still to end at `valid_until`.
fn termination_start(valid_until: Instant, kill_after: Duration) -> Instant {
    valid_until
        .checked_sub(kill_after)
        .unwrap_or_else(Instant::now)
}

/// How often to look whether a terminated group has emptied once the command is reaped.
const GROUP_POLL: Duration = Duration::from_millis(20);

/// The hidden subcommand that runs the command for `lock exec` (see the module docs).
pub(crate) const SUPERVISOR: &str = "__exec-supervisor";

/// The arguments turnstile gives its supervisor.
#[derive(clap::Args, Debug)]
pub(crate) struct SupervisorArgs {
    /// The read end of the pipe turnstile sends its requests on; when it closes,
    /// turnstile is gone.
    #[arg(long, value_name = "FD")]
    requests_fd: RawFd,
    /// The write end of the pipe the supervisor reports on.
    #[arg(long, value_name = "FD")]
    reports_fd: RawFd,
    /// If turnstile dies: how long the command gets after SIGTERM before SIGKILL.
    #[arg(long, value_name = "MS")]
    grace_ms: u64,
    /// The command and its arguments (after `--`).
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<OsString>,
}

/// What turnstile asks of its supervisor: one byte each on the requests pipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Request {
    /// Pass SIGTERM on to the command's group (also SigHup, SigInt, SigQuit).
    SigTerm,
    SigHup,
    SigInt,
    SigQuit,
    /// SIGTERM (and SIGCONT) to everything the command started; the supervisor exits
    /// once all of it has ended.
    Terminate,
    /// SIGKILL to all of it, again until none is left; then the supervisor exits.
    Kill,
    /// turnstile has the command's exit code: exit, leaving alone whatever the command
    /// left running.
    Done,
}

impl Request {
    const ALL: [Request; 7] = [
        Request::SigTerm,
        Request::SigHup,
        Request::SigInt,
        Request::SigQuit,
        Request::Terminate,
        Request::Kill,
        Request::Done,
    ];

    fn byte(self) -> u8 {
        match self {
            Request::SigTerm => b't',
            Request::SigHup => b'h',
            Request::SigInt => b'i',
            Request::SigQuit => b'q',
            Request::Terminate => b'T',
            Request::Kill => b'K',
            Request::Done => b'D',
        }
    }

    fn from_byte(byte: u8) -> Option<Request> {
        Request::ALL
            .into_iter()
            .find(|request| request.byte() == byte)
    }

    /// The signal to pass on to the command's group, for the forwarding requests.
    fn forwarded_signal(self) -> Option<libc::c_int> {
        match self {
            Request::SigTerm => Some(libc::SIGTERM),
            Request::SigHup => Some(libc::SIGHUP),
            Request::SigInt => Some(libc::SIGINT),
            Request::SigQuit => Some(libc::SIGQUIT),
            Request::Terminate | Request::Kill | Request::Done => None,
        }
    }
}

/// What the supervisor tells turnstile, on the reports pipe.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Report {
    /// The command started; its pid, which is also its process group's id.
    Started(libc::pid_t),
    /// The command ended with this exit code (128 + the signal if a signal ended it).
    Exited(u8),
    /// The command could not be started: the exit code turnstile gives, and why.
    Failed { code: u8, message: String },
}

impl Report {
    fn encode(&self) -> Vec<u8> {
        match self {
            Report::Started(pid) => [&[b'S'][..], &pid.to_be_bytes()].concat(),
            Report::Exited(code) => vec![b'E', *code],
            Report::Failed { code, message } => {
                let length = u16::try_from(message.len()).unwrap_or(u16::MAX);
                let mut bytes = vec![b'F', *code];
                bytes.extend_from_slice(&length.to_be_bytes());
                bytes.extend_from_slice(&message.as_bytes()[..usize::from(length)]);
                bytes
            }
        }
    }

    /// The first report in `bytes` and how many bytes it takes, once it is all there;
    /// `None` inside for a byte that starts no report (skipped).
    fn decode(bytes: &[u8]) -> Option<(Option<Report>, usize)> {
        let (&tag, rest) = bytes.split_first()?;
        match tag {
            b'S' => {
                let pid = rest.get(..4)?.try_into().ok()?;
                Some((Some(Report::Started(libc::pid_t::from_be_bytes(pid))), 5))
            }
            b'E' => Some((Some(Report::Exited(*rest.first()?)), 2)),
            b'F' => {
                let (&code, rest) = rest.split_first()?;
                let length = usize::from(u16::from_be_bytes(rest.get(..2)?.try_into().ok()?));
                let message = String::from_utf8_lossy(rest.get(2..2 + length)?).into_owned();
                Some((Some(Report::Failed { code, message }), 4 + length))
            }
            _ => Some((None, 1)),
        }
    }
}

/// How the command's run ended, as its supervisor reported it.
enum Outcome {
    /// The command ended with this exit code.
    Exited(u8),
    /// The command could not be started.
    Failed { code: u8, message: String },
    /// The supervisor closed the reports pipe without saying: it died.
    Silent,
}

/// turnstile's end of the supervisor that runs the command.
struct Supervisor {
    process: Child,
    requests: PipeWriter,
    reports: pipe::Receiver,
    /// Report bytes read but not yet decoded.
    received: Vec<u8>,
    /// The command's process group, once the supervisor has started it.
    command: Option<ProcessGroup>,
}

impl Supervisor {
    /// Starts the supervisor, which starts `command` with `environment`; if turnstile
    /// dies, it gives the command `grace` between SIGTERM and SIGKILL.
    fn start(
        command: &[String],
        environment: &[(&str, String)],
        grace: Duration,
    ) -> std::io::Result<Supervisor> {
        // Both pipes are close-on-exec; only the supervisor's two ends are passed on.
        let (requests_end, requests) = std::io::pipe()?;
        let (reports, reports_end) = std::io::pipe()?;
        let reports = pipe::Receiver::from_owned_fd(OwnedFd::from(reports))?;
        let passed = [requests_end.as_raw_fd(), reports_end.as_raw_fd()];
        let mut process = Command::new(own_executable()?);
        process
            .arg0(
                std::env::args_os()
                    .next()
                    .unwrap_or_else(|| "turnstile".into()),
            )
            .arg(SUPERVISOR)
            .arg("--requests-fd")
            .arg(passed[0].to_string())
            .arg("--reports-fd")
            .arg(passed[1].to_string())
            .arg("--grace-ms")
            .arg(whole_ms(grace).to_string())
            .arg("--")
            .args(command)
            .stdin(Stdio::inherit())
            // A group of its own: the terminal's Ctrl-C and Ctrl-\ are for turnstile,
            // which passes them on; the supervisor must not get them as well.
            .process_group(0);
        for (key, value) in environment {
            process.env(key, value);
        }
        // SAFETY: the closure runs in the forked child before exec; it allocates
        // nothing and calls only fcntl, which is async-signal-safe.
        unsafe {
            process.pre_exec(move || {
                for fd in passed {
                    if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let process = process.spawn()?;
        // The supervisor's ends are its own now: the reports pipe closes when it exits,
        // and the requests pipe when turnstile does.
        drop((requests_end, reports_end));
        Ok(Supervisor {
            process,
            requests,
            reports,
            received: Vec::new(),
            command: None,
        })
    }

    /// Sends `request`. An error means the supervisor has gone, which
    /// [`Supervisor::outcome`] and its exit status tell.
    fn ask(&mut self, request: Request) {
        let _ = self.requests.write_all(&[request.byte()]);
    }

    /// Waits for the command's run to end. Cancel-safe: a report read is kept.
    async fn outcome(&mut self) -> Outcome {
        loop {
            while let Some((report, length)) = Report::decode(&self.received) {
                self.received.drain(..length);
                match report {
                    Some(Report::Started(pid)) => self.command = Some(ProcessGroup { id: pid }),
                    Some(Report::Exited(code)) => return Outcome::Exited(code),
                    Some(Report::Failed { code, message }) => {
                        return Outcome::Failed { code, message };
                    }
                    None => {}
                }
            }
            let mut chunk = [0; 64];
            match self.reports.read(&mut chunk).await {
                Ok(0) | Err(_) => return Outcome::Silent,
                Ok(read) => self.received.extend_from_slice(&chunk[..read]),
            }
        }
    }

    /// Has everything the command started terminated: SIGTERM now, SIGKILL at
    /// `kill_at` to whatever still runs. Returns once the supervisor has exited, which
    /// it does when all of it has ended or been killed.
    async fn terminate(&mut self, kill_at: Instant) {
        self.ask(Request::Terminate);
        let status = tokio::select! {
            status = self.process.wait() => status,
            () = sleep_until(kill_at) => {
                self.ask(Request::Kill);
                self.process.wait().await
            }
        };
        if !status.is_ok_and(|status| status.success()) {
            self.end_group_directly(kill_at).await;
        }
    }

    /// Has everything the command started killed at once.
    async fn kill(&mut self) {
        self.ask(Request::Kill);
        let status = self.process.wait().await;
        if !status.is_ok_and(|status| status.success()) {
            self.end_group_directly(Instant::now()).await;
        }
    }

    /// After the supervisor died: SIGTERM to the command's group, SIGKILL at `kill_at`
    /// if it has not emptied by then. Without the supervisor, the group is all that
    /// can be found; on Linux the command itself has already had a SIGKILL from the
    /// kernel (its parent-death signal).
    ///
    /// turnstile is not the command's parent, so the group's id could be reused once
    /// the group empties; it is signalled only while it is seen to exist.
    async fn end_group_directly(&self, kill_at: Instant) {
        let Some(group) = self.command else {
            return;
        };
        group.signal(libc::SIGTERM);
        group.signal(libc::SIGCONT);
        while !group.is_empty() {
            if Instant::now() >= kill_at {
                group.signal(libc::SIGKILL);
                return;
            }
            sleep(GROUP_POLL).await;
        }
    }
}

/// The turnstile binary, to run as the supervisor: on Linux through /proc, which
/// works even if the file has been replaced or removed since turnstile started.
fn own_executable() -> std::io::Result<PathBuf> {
    #[cfg(target_os = "linux")]
    {
        let proc_exe = PathBuf::from("/proc/self/exe");
        if proc_exe.exists() {
            return Ok(proc_exe);
        }
    }
    std::env::current_exe()
}

/// The longest grace the supervisor gives after turnstile dies: `--kill-after` is
/// shorter than two thirds of the longest TTL, 365 days.
const LONGEST_GRACE: Duration = Duration::from_secs(365 * 24 * 3600);

/// `turnstile __exec-supervisor`: runs the command for `lock exec`, between turnstile
/// and the command (see the module docs).
pub(crate) fn supervisor(args: SupervisorArgs) -> ExitCode {
    // Claimed before anything else opens a file: a number that is not an inherited
    // descriptor is refused instead of naming one of this process's own.
    let (requests, reports) = match claim(args.requests_fd, args.reports_fd) {
        Ok(pipes) => pipes,
        Err(message) => {
            eprintln!("turnstile: {SUPERVISOR} is internal to `turnstile lock exec`: {message}");
            return ExitCode::from(exit::USAGE);
        }
    };
    let Some((program, program_args)) = args.command.split_first() else {
        eprintln!("turnstile: {SUPERVISOR}: no command given");
        return ExitCode::from(exit::USAGE);
    };
    let grace = Duration::from_millis(args.grace_ms).min(LONGEST_GRACE);
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("turnstile: cannot start the async runtime: {error}");
            return ExitCode::from(exit::SOFTWARE);
        }
    };
    runtime.block_on(run_command(requests, reports, program, program_args, grace))
}

/// Takes the two inherited pipe ends, making sure they are open and that the command
/// does not inherit them in turn.
fn claim(requests: RawFd, reports: RawFd) -> Result<(OwnedFd, File), String> {
    if requests == reports {
        return Err("--requests-fd and --reports-fd must differ".to_owned());
    }
    for fd in [requests, reports] {
        if fd <= 2 {
            return Err(format!("file descriptor {fd} is a standard stream"));
        }
        // SAFETY: fcntl has no memory-safety preconditions; it fails on a closed fd.
        if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } == -1 {
            return Err(format!(
                "file descriptor {fd}: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    // SAFETY: both are open (fcntl succeeded on them), distinct, and owned by nothing
    // else: this process has opened no file yet, so they are inherited ones.
    let (requests, reports) = unsafe {
        (
            OwnedFd::from_raw_fd(requests),
            OwnedFd::from_raw_fd(reports),
        )
    };
    Ok((requests, File::from(reports)))
}

/// Where the supervisor is in the command's run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// The command runs; turnstile's signals are passed on to its group.
    Running,
    /// The command has ended and turnstile was told; waiting for its word.
    Ended,
    /// SIGTERM went out; SIGKILL follows at `kill_at`, or when turnstile asks (`None`).
    Terminating { kill_at: Option<Instant> },
    /// SIGKILL to whatever is left, again until nothing is.
    Killing,
}

/// The supervisor proper: starts the command as the leader of a process group of its
/// own, reports its pid and exit code, passes turnstile's requests on, and when the
/// requests pipe closes without a `Done` (turnstile died, even by SIGKILL) ends the
/// whole group, and on Linux all it left behind, then exits.
async fn run_command(
    requests: OwnedFd,
    mut reports: File,
    program: &OsStr,
    program_args: &[OsString],
    grace: Duration,
) -> ExitCode {
    let mut requests = match pipe::Receiver::from_owned_fd(requests) {
        Ok(requests) => requests,
        Err(error) => {
            eprintln!("turnstile: {SUPERVISOR}: --requests-fd: {error}");
            return ExitCode::from(exit::USAGE);
        }
    };
    #[cfg(target_os = "linux")]
    become_subreaper();
    // Listening before the command starts, so that no exit goes unnoticed.
    let Ok(mut exits) = signal(SignalKind::child()) else {
        eprintln!("turnstile: {SUPERVISOR}: cannot install signal handlers");
        return ExitCode::from(exit::SOFTWARE);
    };
    let mut command = std::process::Command::new(program);
    command.args(program_args).process_group(0);
    #[cfg(target_os = "linux")]
    die_with_supervisor(&mut command);
    let group = match command.spawn() {
        Ok(child) => match libc::pid_t::try_from(child.id()) {
            Ok(id) => ProcessGroup { id },
            // Pids fit in pid_t; this is here so that no input can panic.
            Err(_) => return ExitCode::from(exit::SOFTWARE),
        },
        Err(error) => {
            let code = if error.kind() == std::io::ErrorKind::NotFound {
                exit::NOT_FOUND
            } else {
                exit::CANNOT_EXECUTE
            };
            let message = error.to_string();
            report(&mut reports, &Report::Failed { code, message });
            return ExitCode::from(code);
        }
    };
    report(&mut reports, &Report::Started(group.id));
    // The signals turnstile passes on do not end the supervisor when they reach it too
    // (`killall turnstile`, a service manager stopping the whole service): dying would
    // only leave the command unwatched. Caught only now, so that the command inherited
    // the dispositions turnstile was started with (a SIGHUP ignored by nohup, say).
    let _caught = [
        SignalKind::terminate(),
        SignalKind::interrupt(),
        SignalKind::hangup(),
        SignalKind::quit(),
    ]
    .map(signal);

    let mut exit_code = None;
    let mut phase = Phase::Running;
    let mut turnstile_alive = true;
    let mut received = [0; 64];
    loop {
        let (status, children_left) = reap(group.id);
        if let Some(status) = status {
            let code = exit_code_of(status);
            exit_code = Some(code);
            report(&mut reports, &Report::Exited(code));
            if phase == Phase::Running {
                phase = Phase::Ended;
            }
        }
        if let Phase::Terminating {
            kill_at: Some(kill_at),
        } = phase
            && kill_at <= Instant::now()
        {
            phase = Phase::Killing;
        }
        let reaped = exit_code.is_some();
        match phase {
            Phase::Terminating { .. } | Phase::Killing
                if reaped && !children_left && group.is_empty() =>
            {
                return ExitCode::SUCCESS;
            }
            Phase::Killing => signal_everything(group, reaped, libc::SIGKILL),
            _ => {}
        }
        tokio::select! {
            read = requests.read(&mut received), if turnstile_alive => {
                // An error counts as the end: nothing more can come from turnstile.
                let read = read.unwrap_or_default();
                if read == 0 {
                    // turnstile is gone, however it died, and no one renews the lock.
                    turnstile_alive = false;
                    let kill_at = Some(Instant::now() + grace);
                    phase = match phase {
                        Phase::Running | Phase::Ended => {
                            start_terminating(group, reaped);
                            Phase::Terminating { kill_at }
                        }
                        Phase::Terminating { kill_at: None } => Phase::Terminating { kill_at },
                        other => other,
                    };
                }
                for request in received[..read].iter().filter_map(|&byte| Request::from_byte(byte)) {
                    match (request, phase) {
                        (Request::Done, Phase::Ended) => return ExitCode::SUCCESS,
                        (Request::Terminate, Phase::Running | Phase::Ended) => {
                            start_terminating(group, reaped);
                            phase = Phase::Terminating { kill_at: None };
                        }
                        (Request::Kill, _) => phase = Phase::Killing,
                        (request, Phase::Running) => {
                            if let Some(signal) = request.forwarded_signal() {
                                group.signal(signal);
                            }
                        }
                        _ => {}
                    }
                }
            }
            _ = exits.recv() => {}
            () = sleep(GROUP_POLL), if matches!(phase, Phase::Terminating { .. } | Phase::Killing) => {}
        }
    }
}

/// Writes `report` to turnstile. An error means turnstile is gone, which the requests
/// pipe tells.
fn report(reports: &mut File, report: &Report) {
    let _ = reports.write_all(&report.encode());
}

/// SIGTERM, then SIGCONT (a stopped process acts on SIGTERM only once continued), to
/// everything the command started.
fn start_terminating(group: ProcessGroup, command_reaped: bool) {
    signal_everything(group, command_reaped, libc::SIGTERM);
    signal_everything(group, command_reaped, libc::SIGCONT);
}

/// Sends `signal` to the command's process group and, on Linux, to every child of the
/// supervisor: as a subreaper it is handed what the command started and then left
/// (a double fork, a new session), once its parent has ended.
///
/// The group's id is the command's pid, which the kernel does not hand out again while
/// the command is unreaped or any process is still in the group; once the command is
/// reaped, the group is signalled only while it is seen to exist.
fn signal_everything(group: ProcessGroup, command_reaped: bool, signal: libc::c_int) {
    if !command_reaped || !group.is_empty() {
        group.signal(signal);
    }
    #[cfg(target_os = "linux")]
    for child in children() {
        // SAFETY: kill has no memory-safety preconditions; an unreaped child's pid is
        // not reused, and only this thread reaps.
        unsafe {
            libc::kill(child, signal);
        }
    }
}

/// Reaps every child that has ended: the command, and on Linux the orphans handed to
/// the supervisor. Returns the command's status if it was among them, and whether any
/// child is left.
fn reap(command: libc::pid_t) -> (Option<ExitStatus>, bool) {
    let mut status_of_command = None;
    loop {
        let mut status = 0;
        // SAFETY: waitpid writes only to `status`.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid > 0 {
            if pid == command {
                status_of_command = Some(ExitStatus::from_raw(status));
            }
            continue;
        }
        if pid == -1 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        // 0: children left, none ended yet; -1 (ECHILD): none left.
        return (status_of_command, pid == 0);
    }
}

/// Makes the supervisor the reaper of orphans among its descendants, so that what
/// the command started and left (a double fork, a new session) can still be found.
/// Without it (a kernel before 3.4), only the command's group is.
#[cfg(target_os = "linux")]
fn become_subreaper() {
    const ON: libc::c_ulong = 1;
    // SAFETY: this prctl only sets a flag of this process.
    unsafe {
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, ON);
    }
}

/// The supervisor's children, from /proc.
#[cfg(target_os = "linux")]
fn children() -> Vec<libc::pid_t> {
    let me = std::process::id().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| {
            let pid: libc::pid_t = entry.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // The parent's pid is the second field after the command name, which is in
            // parentheses.
            let parent = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?;
            (parent == me).then_some(pid)
        })
        .collect()
}

/// Has the kernel SIGKILL the command if the supervisor dies (killed, or crashed)
/// before it could end the command itself.
#[cfg(target_os = "linux")]
fn die_with_supervisor(command: &mut std::process::Command) {
    let supervisor = libc::pid_t::try_from(std::process::id()).unwrap_or(libc::pid_t::MAX);
    // SAFETY: the closure runs in the forked child before exec; it allocates nothing
    // and calls only async-signal-safe functions (prctl, getppid, _exit).
    unsafe {
        command.pre_exec(move || {
            // The signal fires when the *thread* that forked exits, not the process.
            // The supervisor forks from its only thread (its runtime is
            // current-thread), which lives as long as the process does.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            // The supervisor died between the fork and the prctl: the signal will
            // never come.
            if libc::getppid() != supervisor {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

/// The process group the command leads (it was started with `process_group(0)`).
#[derive(Debug, Clone, Copy)]
struct ProcessGroup {
    id: libc::pid_t,
}

impl ProcessGroup {
    /// Sends `signal` to every process in the group.
    fn signal(self, signal: libc::c_int) {
        // SAFETY: kill has no memory-safety preconditions; a negative pid names a group.
        unsafe {
            libc::kill(-self.id, signal);
        }
    }

    /// Whether no process (zombies included) is left in the group.
    fn is_empty(self) -> bool {
        // SAFETY: as in `signal`; signal 0 only checks that the group exists.
        let result = unsafe { libc::kill(-self.id, 0) };
        result == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
    }
}

/// The child's exit code, or 128 + the signal that killed it, as shells report it.
fn exit_code_of(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code & 0xff).unwrap_or(exit::SOFTWARE),
        (None, Some(signal)) => u8::try_from((128 + signal) & 0xff).unwrap_or(exit::SOFTWARE),
        (None, None) => exit::SOFTWARE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn requests_and_reports_survive_the_pipe() {
        for request in Request::ALL {
            assert_eq!(Request::from_byte(request.byte()), Some(request));
        }
        assert_eq!(Request::from_byte(b'?'), None);
        let reports = [
            Report::Started(4_194_304),
            Report::Exited(143),
            Report::Failed {
                code: 127,
                message: "No such file or directory (os error 2)".to_owned(),
            },
            Report::Failed {
                code: 126,
                message: "é".repeat(40_000),
            },
        ];
        let bytes: Vec<u8> = reports.iter().flat_map(Report::encode).collect();
        let mut rest = &bytes[..];
        for report in &reports {
            // A report cut short is not decoded yet.
            let (decoded, length) = Report::decode(rest).unwrap();
            assert!(Report::decode(&rest[..length - 1]).is_none());
            match (report, decoded.unwrap()) {
                // Messages are cut at 64 KiB, whole characters or not.
                (Report::Failed { message, .. }, Report::Failed { message: got, .. })
                    if message.len() > usize::from(u16::MAX) =>
                {
                    assert!(got.starts_with(&"é".repeat(32_767)), "{}", got.len());
                }
                (report, decoded) => assert_eq!(&decoded, report),
            }
            rest = &rest[length..];
        }
        assert!(rest.is_empty());
        assert_eq!(Report::decode(b"?E"), Some((None, 1)));
        assert_eq!(Report::decode(b""), None);
    }

    #[test]
    fn the_kill_grace_defaults_to_10s_or_a_third_of_the_ttl() {
        let drift = 302 * MS;
        assert_eq!(
            kill_after_within(Duration::from_secs(30), drift, None),
            Ok(Duration::from_secs(10))
        );
        assert_eq!(
            kill_after_within(Duration::from_secs(3), 32 * MS, None),
            Ok(Duration::from_secs(1))
        );
    }

    #[test]
    fn the_kill_grace_must_end_before_the_lease_can() {
        let ttl = Duration::from_secs(3);
        let drift = 32 * MS;
        assert_eq!(
            kill_after_within(ttl, drift, Some(1967 * MS)),
            Ok(1967 * MS)
        );
        let refused = kill_after_within(ttl, drift, Some(1968 * MS)).unwrap_err();
        assert!(refused.contains("--kill-after 1s 968ms"), "{refused}");
        assert!(refused.contains("--ttl 3s"), "{refused}");
        assert!(refused.contains("under 1s 968ms"), "{refused}");
        assert!(kill_after_within(ttl, drift, Some(Duration::from_secs(10))).is_err());
    }
}
