//! `turnstile lock exec`: run a command while holding a lock.

use std::process::{ExitCode, ExitStatus, Stdio};
use std::time::Duration;

use tokio::process::{Child, Command};
use tokio::signal::unix::{SignalKind, signal};
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
        .kill_on_drop(true);
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
    supervise(child, guard, args.kill_after).await
}

/// Waits for the child, forwarding SIGTERM and SIGHUP to it; terminates it if the lock
/// is lost. SIGINT is not forwarded: a terminal already sends it to the child, which
/// shares our process group.
async fn supervise(mut child: Child, guard: LockGuard, kill_after: Duration) -> ExitCode {
    let (Ok(mut terminate), Ok(mut hangup), Ok(mut interrupt)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
        signal(SignalKind::interrupt()),
    ) else {
        eprintln!("turnstile: cannot install signal handlers");
        let _ = child.kill().await;
        return ExitCode::from(exit::SOFTWARE);
    };
    let lost = guard.lost();
    tokio::pin!(lost);
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
                terminate_child(&mut child, kill_after).await;
                let _ = guard.release().await;
                return ExitCode::from(exit::LOST);
            }
            _ = terminate.recv() => forward(&child, libc::SIGTERM),
            _ = hangup.recv() => forward(&child, libc::SIGHUP),
            _ = interrupt.recv() => {}
        }
    }
}

/// SIGTERM, then SIGKILL if the child is still running after `grace`.
async fn terminate_child(child: &mut Child, grace: Duration) {
    forward(child, libc::SIGTERM);
    if tokio::time::timeout(grace, child.wait()).await.is_err() {
        let _ = child.kill().await;
    }
}

fn forward(child: &Child, signal: libc::c_int) {
    if let Some(pid) = child.id().and_then(|pid| libc::pid_t::try_from(pid).ok()) {
        // SAFETY: signalling our own child, which we have not reaped yet.
        unsafe {
            libc::kill(pid, signal);
        }
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
