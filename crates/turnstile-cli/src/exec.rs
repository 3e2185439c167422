//! `turnstile lock exec`: run a command while holding a lock.

use std::process::{ExitCode, ExitStatus, Stdio};
use std::time::Duration;

use tokio::process::{Child, Command};
use tokio::signal::unix::{SignalKind, signal};
use tokio::time::{Instant, sleep, sleep_until};
use turnstile::lock::{LockGuard, LockName, LockOptions, Locker};

use crate::{ExecArgs, exit, fail};

pub(crate) async fn run(args: ExecArgs) -> ExitCode {
    let Some((program, program_args)) = args.command.split_first() else {
        eprintln!(
            "turnstile: no command given; usage: turnstile lock exec [OPTIONS] NAME -- CMD [ARGS...]"
        );
        return ExitCode::from(exit::USAGE);
    };
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
    let guard = match locker.acquire(name.clone(), &options).await {
        Ok(guard) => guard,
        Err(error) => return fail(&error),
    };

    let mut command = Command::new(program);
    command
        .args(program_args)
        .env("TURNSTILE_FENCING_TOKEN", guard.fencing_token().to_string())
        .env("TURNSTILE_LOCK_NAME", name.as_str())
        .stdin(Stdio::inherit())
        .kill_on_drop(true)
        // Its own process group, so that everything the command starts (background
        // jobs, pipelines) is signalled with it; signalling only the direct child left
        // a shell's jobs running after the lock was lost.
        .process_group(0);
    #[cfg(target_os = "linux")]
    die_with_turnstile(&mut command);
    if let Some(why) = too_late_to_start(&guard, kill_after) {
        eprintln!(
            "turnstile: lock {:?} {why}; not running the command",
            guard.name().as_str()
        );
        let _ = guard.release().await;
        return ExitCode::from(exit::LOST);
    }
    let child = match command.spawn() {
        Ok(child) => child,
        Err(error) => {
            let _ = guard.release().await;
            let code = if error.kind() == std::io::ErrorKind::NotFound {
                exit::NOT_FOUND
            } else {
                exit::CANNOT_EXECUTE
            };
            eprintln!("turnstile: cannot run {program:?}: {error}");
            return ExitCode::from(code);
        }
    };
    let Some(group) = ProcessGroup::led_by(&child) else {
        // Only possible if the child was already reaped, which nothing here does.
        eprintln!("turnstile: lost track of the command right after starting it");
        let _ = guard.release().await;
        return ExitCode::from(exit::SOFTWARE);
    };
    supervise(child, group, guard, kill_after).await
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
fn kill_after_within(
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
fn too_late_to_start(guard: &LockGuard, kill_after: Duration) -> Option<String> {
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

/// Has the kernel SIGKILL the command when turnstile dies, so that a `kill -9` of
/// turnstile cannot leave the command running with no one renewing its lock (another
/// host would take the lock one TTL later and the two would overlap).
///
/// Only the direct child gets this signal: whatever it started survives a `kill -9` of
/// turnstile. When the lock is lost turnstile signals the whole process group itself,
/// so only turnstile dying abruptly leaves those processes running.
#[cfg(target_os = "linux")]
fn die_with_turnstile(command: &mut Command) {
    let turnstile = libc::pid_t::try_from(std::process::id()).unwrap_or(libc::pid_t::MAX);
    // SAFETY: the closure runs in the forked child before exec; it allocates nothing
    // and calls only async-signal-safe functions (prctl, getppid, _exit).
    unsafe {
        command.pre_exec(move || {
            // The signal fires when the *thread* that forked exits, not the process.
            // turnstile forks from the main thread (its runtime is current-thread),
            // which lives as long as the process does.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            // turnstile died between the fork and the prctl: the signal will never
            // come, and no one would renew the lock.
            if libc::getppid() != turnstile {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

/// Waits for the child, forwarding SIGINT, SIGTERM, SIGHUP and SIGQUIT to its process
/// group; terminates the group if the lock is lost, or `kill_after` before the lease
/// runs out if renewals have not extended it by then.
///
/// The command's group is not the terminal's foreground group, so the terminal's
/// SIGINT (Ctrl-C) and SIGQUIT reach only turnstile, which passes them on. SIGTSTP
/// (Ctrl-Z) is refused: it would stop turnstile, and so the renewals, while the command
/// ran on.
async fn supervise(
    mut child: Child,
    group: ProcessGroup,
    guard: LockGuard,
    kill_after: Duration,
) -> ExitCode {
    let (Ok(mut terminate), Ok(mut hangup), Ok(mut interrupt), Ok(mut quit), Ok(mut suspend)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::quit()),
        signal(SignalKind::from_raw(libc::SIGTSTP)),
    ) else {
        eprintln!("turnstile: cannot install signal handlers");
        group.signal(libc::SIGKILL);
        let _ = child.wait().await;
        let _ = guard.release().await;
        return ExitCode::from(exit::SOFTWARE);
    };
    let lost = guard.lost();
    tokio::pin!(lost);
    // The library fires the lost signal only when the lease has run out, too late for
    // any grace; so termination starts `kill_after` earlier unless a renewal moves the
    // lease on first.
    let mut terminate_at = termination_start(guard.valid_until(), kill_after);
    loop {
        tokio::select! {
            status = child.wait() => {
                let code = match status {
                    Ok(status) => exit_code_of(status),
                    Err(error) => {
                        eprintln!("turnstile: lost track of the command: {error}");
                        exit::SOFTWARE
                    }
                };
                if let Err(error) = guard.release().await {
                    eprintln!("turnstile: the command finished but the lock could not be released ({error}); it expires on its own");
                }
                return ExitCode::from(code);
            }
            reason = &mut lost => {
                eprintln!(
                    "turnstile: lock {:?} lost ({reason}); terminating the command",
                    guard.name().as_str()
                );
                // Whatever the reason, the grace never runs past the lease as known here.
                let kill_at = (Instant::now() + kill_after).min(guard.valid_until());
                terminate_group(&mut child, group, kill_at).await;
                let _ = guard.release().await;
                return ExitCode::from(exit::LOST);
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
                terminate_group(&mut child, group, valid_until).await;
                let _ = guard.release().await;
                return ExitCode::from(exit::LOST);
            }
            _ = terminate.recv() => group.signal(libc::SIGTERM),
            _ = hangup.recv() => group.signal(libc::SIGHUP),
            _ = interrupt.recv() => group.signal(libc::SIGINT),
            _ = quit.recv() => group.signal(libc::SIGQUIT),
            _ = suspend.recv() => eprintln!(
                "turnstile: not suspending: the command would run on while its lock went unrenewed"
            ),
        }
    }
}

/// A computed `duration` for a message, rounded down to the millisecond: "166ms 666us
/// 666ns" reads badly.
fn in_ms(duration: Duration) -> humantime::FormattedDuration {
    let millis = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
    humantime::format_duration(Duration::from_millis(millis))
}

/// When to start terminating the command if the lease is still to end at `valid_until`.
fn termination_start(valid_until: Instant, kill_after: Duration) -> Instant {
    valid_until
        .checked_sub(kill_after)
        .unwrap_or_else(Instant::now)
}

/// How often to look whether a terminated group has emptied once the child is reaped.
const GROUP_POLL: Duration = Duration::from_millis(20);

/// SIGTERM to the whole group; SIGKILL at `kill_at` to whatever of it still runs.
/// Returns once the child is reaped and the group has emptied, or after the SIGKILL.
async fn terminate_group(child: &mut Child, group: ProcessGroup, kill_at: Instant) {
    group.signal(libc::SIGTERM);
    // A stopped process acts on SIGTERM only once continued.
    group.signal(libc::SIGCONT);
    let mut reaped = false;
    loop {
        if reaped && group.is_empty() {
            return;
        }
        tokio::select! {
            // An error here means there is no child left to wait for.
            _ = child.wait(), if !reaped => reaped = true,
            () = sleep(GROUP_POLL), if reaped => {}
            () = sleep_until(kill_at) => break,
        }
    }
    group.signal(libc::SIGKILL);
    let _ = child.wait().await;
}

/// The process group the command leads (it was started with `process_group(0)`).
#[derive(Debug, Clone, Copy)]
struct ProcessGroup {
    id: libc::pid_t,
}

impl ProcessGroup {
    /// The group led by `child`, while the child has not been reaped.
    fn led_by(child: &Child) -> Option<ProcessGroup> {
        let id = libc::pid_t::try_from(child.id()?).ok()?;
        Some(ProcessGroup { id })
    }

    /// Sends `signal` to every process in the group.
    ///
    /// The group id is the child's pid, which the kernel does not hand out again while
    /// the child is unreaped or any process is still in the group; callers stop
    /// signalling once both are gone.
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
    use std::os::unix::process::ExitStatusExt;
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
