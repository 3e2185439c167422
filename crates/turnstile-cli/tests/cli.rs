//! The `turnstile` command, run as a user would run it: real processes, a real SQLite
//! file, a real redis-server.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use turnstile_test_support::RedisServer;

struct Sandbox {
    dir: tempfile::TempDir,
}

impl Sandbox {
    fn new() -> Sandbox {
        Sandbox {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn store(&self) -> String {
        format!(
            "sqlite://{}",
            self.dir.path().join("locks.sqlite3").display()
        )
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `turnstile ARGS` with the sandbox's store in TURNSTILE_STORE.
    fn turnstile(&self, args: &[&str]) -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_turnstile"));
        command
            .args(args)
            .env("TURNSTILE_STORE", self.store())
            .env("XDG_STATE_HOME", self.path("state"))
            .stdin(Stdio::null());
        command
    }

    fn run(&self, args: &[&str]) -> Output {
        self.turnstile(args).output().unwrap()
    }
}

fn code(output: &Output) -> i32 {
    output.status.code().expect("exited normally")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn wait_for_file(path: &Path) {
    let started = Instant::now();
    while !path.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The pid a command wrote to `path`. Commands write it to `path.tmp` and rename it, so
/// the file is complete once it appears.
fn read_pid(path: &Path) -> libc::pid_t {
    wait_for_file(path);
    let text = std::fs::read_to_string(path).unwrap();
    text.trim()
        .parse()
        .unwrap_or_else(|_| panic!("{} holds {text:?}", path.display()))
}

/// Shell words that write the shell's value of `$pid` to `path` the way [`read_pid`]
/// expects.
fn write_pid(pid: &str, path: &Path) -> String {
    format!("echo {pid} > {0}.tmp; mv {0}.tmp {0}", path.display())
}

/// Whether `pid` has ended: gone, or a zombie not reaped yet (an orphan waits for
/// init to reap it).
fn has_ended(pid: libc::pid_t) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the command name, which is in parentheses.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_none_or(|state| state == "Z" || state == "X"),
    }
}

/// Waits up to `bound` for `pid` to end. If it does not, kills it, so a failing test
/// leaves nothing behind, and returns false.
fn ends_within(pid: libc::pid_t, bound: Duration) -> bool {
    let started = Instant::now();
    while started.elapsed() < bound {
        if has_ended(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: kill has no memory-safety preconditions.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
    false
}

/// Waits up to `bound` for `child` to exit; if it does not, kills it and returns None.
fn exit_within(
    child: &mut std::process::Child,
    bound: Duration,
) -> Option<std::process::ExitStatus> {
    let started = Instant::now();
    while started.elapsed() < bound {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// A `bash -c` script that writes its pid to `pid_path` (see [`read_pid`]) and runs
/// until it is killed. SIGTERM does not stop it: it notes when the signal came (the wall
/// clock, `$EPOCHREALTIME`, a builtin, in `termed_path`) and carries on. (Its stderr is
/// closed once it runs, or bash reports each `sleep` the signal ends.)
fn stubborn_script(pid_path: &Path, termed_path: &Path) -> String {
    format!(
        "trap 'echo $EPOCHREALTIME > {0}.tmp; mv {0}.tmp {0}' TERM; {1}; \
         exec 2>/dev/null; while true; do sleep 0.01; done",
        termed_path.display(),
        write_pid("$$", pid_path)
    )
}

/// When the script of [`stubborn_script`] got SIGTERM, or `None` if it has not.
fn termed_at(path: &Path) -> Option<SystemTime> {
    let text = std::fs::read_to_string(path).ok()?;
    let seconds: f64 = text
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("{} holds {text:?}", path.display()));
    Some(UNIX_EPOCH + Duration::from_secs_f64(seconds))
}

/// Watches `pid` every millisecond for up to `bound`, and returns when (wall clock) it
/// was first seen ended; if it does not end, kills it and returns `None`.
fn seen_ending_within(pid: libc::pid_t, bound: Duration) -> Option<SystemTime> {
    let started = Instant::now();
    while started.elapsed() < bound {
        if has_ended(pid) {
            return Some(SystemTime::now());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    // SAFETY: kill has no memory-safety preconditions.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
    None
}

/// How long after SIGTERM reached its group [`stubborn_script`] may note it: its
/// trap runs once the `sleep` it waits for has died of the same signal.
const TRAP_LATENCY: Duration = Duration::from_millis(20);

/// How long after its grace period a command may be seen dead: the supervisor's timer
/// and its SIGKILL, and this test's polling, on a loaded two-core machine.
const KILL_LATENESS: Duration = Duration::from_millis(150);

/// Asserts that a command that noted SIGTERM at `termed` and was seen dead at `died`
/// was killed `grace` after the SIGTERM: not before, and not long after.
fn assert_killed_after_the_grace(termed: SystemTime, died: SystemTime, grace: Duration) {
    let lived = died
        .duration_since(termed)
        .unwrap_or_else(|_| panic!("the command was seen dead before it noted SIGTERM"));
    assert!(
        lived + TRAP_LATENCY >= grace,
        "killed {lived:?} after SIGTERM, before the grace of {grace:?} was over"
    );
    assert!(
        lived <= grace + KILL_LATENESS,
        "killed only {lived:?} after SIGTERM, with a grace of {grace:?}"
    );
}

#[test]
fn exec_runs_the_command_with_its_token_and_passes_its_exit_code() {
    let sandbox = Sandbox::new();
    let output = sandbox.run(&[
        "lock",
        "exec",
        "report",
        "--",
        "sh",
        "-c",
        "echo \"$TURNSTILE_LOCK_NAME $TURNSTILE_FENCING_TOKEN\"; exit 7",
    ]);
    assert_eq!(code(&output), 7, "{}", stderr(&output));
    let printed = stdout(&output);
    let (name, token) = printed.trim().split_once(' ').unwrap();
    assert_eq!(name, "report");
    assert!(token.parse::<u64>().unwrap() > 0);
    // Released afterwards.
    assert!(stdout(&sandbox.run(&["lock", "status", "report"])).contains("is free"));
}

/// `--unfenced`: the command runs under the lock with no token in its environment
/// (never a made-up one), and a fenced `lock exec` of the same name is excluded meanwhile.
#[test]
fn exec_unfenced_sets_no_token_and_still_excludes() {
    let sandbox = Sandbox::new();
    let marker = sandbox.path("inside");
    let mut holder = sandbox
        .turnstile(&[
            "lock",
            "exec",
            "--unfenced",
            "job",
            "--",
            "sh",
            "-c",
            &format!(
                "echo \"${{TURNSTILE_FENCING_TOKEN-unset}}\" > {}; sleep 3",
                marker.display()
            ),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while !marker.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the command never ran"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let refused = sandbox.run(&["lock", "exec", "--no-wait", "job", "--", "true"]);
    assert_eq!(code(&refused), 75, "{}", stderr(&refused));
    assert_eq!(holder.wait().unwrap().code(), Some(0));
    assert_eq!(std::fs::read_to_string(&marker).unwrap().trim(), "unset");
    assert!(stdout(&sandbox.run(&["lock", "status", "job"])).contains("is free"));
}

#[test]
fn processes_exclude_each_other_through_the_default_sqlite_store() {
    let sandbox = Sandbox::new();
    let counter = sandbox.path("counter");
    std::fs::write(&counter, "0").unwrap();
    // A read-modify-write with a pause in the middle: without mutual exclusion across
    // processes, updates are lost.
    let script = format!(
        "v=$(cat {0}); sleep 0.02; echo $((v + 1)) > {0}",
        counter.display()
    );
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let mut command = sandbox.turnstile(&[]);
            command.env_remove("TURNSTILE_STORE");
            let binary = env!("CARGO_BIN_EXE_turnstile");
            let loop_script = format!(
                "for i in 1 2 3 4 5; do {binary} lock exec --wait 60s counter -- sh -c '{script}' || exit 1; done"
            );
            Command::new("sh")
                .args(["-c", &loop_script])
                .env("XDG_STATE_HOME", sandbox.path("state"))
                .env_remove("TURNSTILE_STORE")
                .spawn()
                .unwrap()
        })
        .collect();
    for mut worker in workers {
        assert!(worker.wait().unwrap().success());
    }
    assert_eq!(std::fs::read_to_string(&counter).unwrap().trim(), "20");
    // The default store is the per-user state directory.
    assert!(sandbox.path("state/turnstile/locks.sqlite3").exists());
}

#[test]
fn a_held_lock_gives_exit_75_with_no_wait_and_after_the_wait() {
    let sandbox = Sandbox::new();
    let started = sandbox.path("started");
    let mut holder = sandbox
        .turnstile(&[
            "lock",
            "exec",
            "nightly",
            "--",
            "sh",
            "-c",
            &format!("touch {}; exec sleep 30", started.display()),
        ])
        .spawn()
        .unwrap();
    wait_for_file(&started);

    let output = sandbox.run(&["lock", "exec", "--no-wait", "nightly", "--", "true"]);
    assert_eq!(code(&output), 75, "{}", stderr(&output));
    let before = Instant::now();
    let output = sandbox.run(&["lock", "exec", "--wait", "300ms", "nightly", "--", "true"]);
    assert_eq!(code(&output), 75, "{}", stderr(&output));
    assert!(before.elapsed() >= Duration::from_millis(300));
    assert!(
        stderr(&output).contains("still held"),
        "{}",
        stderr(&output)
    );

    let status = stdout(&sandbox.run(&["lock", "status", "nightly"]));
    assert!(status.contains("is held by owner"), "{status}");
    let json: serde_json::Value = serde_json::from_str(&stdout(
        &sandbox.run(&["lock", "status", "--json", "nightly"]),
    ))
    .unwrap();
    assert_eq!(json["held"], true);
    assert!(json["fencing_token"].as_u64().unwrap() > 0);
    // SIGTERM to turnstile is passed on to the command; its status is reported the way
    // shells report a signal, 128 + 15.
    // SAFETY: signalling a child process we started.
    unsafe {
        libc::kill(i32::try_from(holder.id()).unwrap(), libc::SIGTERM);
    }
    assert_eq!(holder.wait().unwrap().code(), Some(143));
    assert!(stdout(&sandbox.run(&["lock", "status", "nightly"])).contains("is free"));
}

#[test]
fn breaking_the_lock_terminates_the_command_with_exit_76() {
    let sandbox = Sandbox::new();
    let started = sandbox.path("started");
    let terminated = sandbox.path("terminated");
    let script = format!(
        "trap 'touch {}; exit 0' TERM; touch {}; while true; do sleep 0.05; done",
        terminated.display(),
        started.display()
    );
    // TTL 600ms: the watchdog renews every 200ms and notices the break at once.
    let holder = sandbox
        .turnstile(&[
            "lock", "exec", "--ttl", "600ms", "deploy", "--", "sh", "-c", &script,
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_file(&started);
    let broke = sandbox.run(&["lock", "break", "deploy"]);
    assert_eq!(code(&broke), 0);
    assert!(
        stdout(&broke).contains("broke \"deploy\""),
        "{}",
        stdout(&broke)
    );
    let output = holder.wait_with_output().unwrap();
    assert_eq!(code(&output), 76, "{}", stderr(&output));
    assert!(stderr(&output).contains("lost"), "{}", stderr(&output));
    assert!(terminated.exists(), "the command did not get SIGTERM");
    // Nothing left to break.
    assert!(stdout(&sandbox.run(&["lock", "break", "deploy"])).contains("was not held"));
}

/// A broken lock sends SIGTERM to the command; one that ignores it is killed
/// --kill-after later, and not long after.
#[test]
fn a_command_that_ignores_sigterm_is_killed_after_the_grace_period() {
    let sandbox = Sandbox::new();
    let started = sandbox.path("command.pid");
    let termed = sandbox.path("termed");
    // A TTL long enough that the lease, which also bounds the grace, outlasts it: the
    // break is noticed at the next renewal (a second at most), 2 s before the lease
    // as known here runs out.
    let grace = Duration::from_millis(300);
    let mut holder = sandbox
        .turnstile(&[
            "lock",
            "exec",
            "--ttl",
            "3s",
            "--kill-after",
            "300ms",
            "stubborn",
            "--",
            "bash",
            "-c",
            &stubborn_script(&started, &termed),
        ])
        .spawn()
        .unwrap();
    let command = read_pid(&started);
    assert_eq!(code(&sandbox.run(&["lock", "break", "stubborn"])), 0);
    let died = seen_ending_within(command, Duration::from_secs(10));
    let status = exit_within(&mut holder, Duration::from_secs(10));
    let died = died.expect("the command outlived the grace period by seconds");
    let termed = termed_at(&termed).expect("the command never got SIGTERM");
    assert_killed_after_the_grace(termed, died, grace);
    assert_eq!(status.and_then(|status| status.code()), Some(76));
}

#[test]
fn losing_the_lock_terminates_the_commands_background_jobs_too() {
    let sandbox = Sandbox::new();
    let first = sandbox.path("first.pid");
    let second = sandbox.path("second.pid");
    // The jobs' output goes elsewhere, so that they do not hold turnstile's stderr open.
    let script = format!(
        "sleep 60 >/dev/null 2>&1 & {}; sleep 60 >/dev/null 2>&1 & {}; wait",
        write_pid("$!", &first),
        write_pid("$!", &second)
    );
    let mut holder = sandbox
        .turnstile(&[
            "lock", "exec", "--ttl", "600ms", "jobs", "--", "sh", "-c", &script,
        ])
        .spawn()
        .unwrap();
    let jobs = [read_pid(&first), read_pid(&second)];
    assert_eq!(code(&sandbox.run(&["lock", "break", "jobs"])), 0);
    let status = exit_within(&mut holder, Duration::from_secs(10));
    // Every job is waited for (and killed if need be) before anything is asserted.
    let outlived: Vec<_> = jobs
        .into_iter()
        .filter(|&job| !ends_within(job, Duration::from_secs(5)))
        .collect();
    assert_eq!(status.and_then(|status| status.code()), Some(76));
    assert!(
        outlived.is_empty(),
        "background jobs {outlived:?} outlived the lock"
    );
}

#[test]
fn sigint_to_turnstile_reaches_the_command() {
    let sandbox = Sandbox::new();
    let started = sandbox.path("started.pid");
    let interrupted = sandbox.path("interrupted");
    let script = format!(
        "trap 'touch {}; exit 3' INT; {}; while true; do sleep 0.05; done",
        interrupted.display(),
        write_pid("$$", &started)
    );
    let mut holder = sandbox
        .turnstile(&["lock", "exec", "ctrl-c", "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    let command = read_pid(&started);
    // SAFETY: signalling a child process we started.
    unsafe {
        libc::kill(i32::try_from(holder.id()).unwrap(), libc::SIGINT);
    }
    let status = exit_within(&mut holder, Duration::from_secs(10));
    let command_ended = ends_within(command, Duration::from_secs(5));
    assert_eq!(status.and_then(|status| status.code()), Some(3));
    assert!(interrupted.exists());
    assert!(command_ended);
}

#[test]
fn killing_turnstile_with_sigkill_kills_the_command() {
    let sandbox = Sandbox::new();
    let started = sandbox.path("command.pid");
    let script = format!("{}; exec sleep 60", write_pid("$$", &started));
    let mut holder = sandbox
        .turnstile(&["lock", "exec", "orphan", "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    let command = read_pid(&started);
    holder.kill().unwrap();
    holder.wait().unwrap();
    assert!(
        ends_within(command, Duration::from_secs(5)),
        "the command outlived turnstile"
    );
}

/// The pids a command appended to `path`, one a line (`echo $! >> path`), once there
/// are `count` complete lines.
fn read_pids(path: &Path, count: usize) -> Vec<libc::pid_t> {
    let started = Instant::now();
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        // A line is complete once its newline is there.
        let lines: Vec<&str> = text.split_inclusive('\n').collect();
        if lines.len() >= count && lines[..count].iter().all(|line| line.ends_with('\n')) {
            return lines[..count]
                .iter()
                .map(|line| {
                    line.trim()
                        .parse()
                        .unwrap_or_else(|_| panic!("{} holds {text:?}", path.display()))
                })
                .collect();
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{} holds {text:?}, not {count} pids",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn killing_turnstile_with_sigkill_kills_what_the_command_started_too() {
    let sandbox = Sandbox::new();
    let shell = sandbox.path("shell.pid");
    let parent = sandbox.path("parent.pid");
    let jobs = sandbox.path("jobs.pids");
    // Most real commands are `sh -c` or a script: the shell's children, not the shell,
    // do the work. Their output goes elsewhere, so that they hold no pipe of the test's.
    let script = format!(
        "{}; {}; sleep 1000 >/dev/null 2>&1 & echo $! >> {jobs}; \
         sleep 1000 >/dev/null 2>&1 & echo $! >> {jobs}; wait",
        write_pid("$$", &shell),
        write_pid("$PPID", &parent),
        jobs = jobs.display()
    );
    let mut holder = sandbox
        .turnstile(&[
            "lock", "exec", "--ttl", "5s", "orphans", "--", "sh", "-c", &script,
        ])
        .spawn()
        .unwrap();
    let mut pids = read_pids(&jobs, 2);
    pids.push(read_pid(&shell));
    // Whatever runs the shell for turnstile (turnstile itself, or a process between
    // them) must not outlive turnstile either.
    pids.push(read_pid(&parent));
    holder.kill().unwrap();
    holder.wait().unwrap();
    // Every pid is waited for (and killed if need be) before anything is asserted.
    let outlived: Vec<_> = pids
        .iter()
        .copied()
        .filter(|&pid| !ends_within(pid, Duration::from_secs(5)))
        .collect();
    assert!(
        outlived.is_empty(),
        "processes {outlived:?} of {pids:?} (jobs, shell, parent) outlived a kill -9 of turnstile"
    );
    // No one renews the lock any more: its 5s lease runs out, counted from the last
    // renewal (at most TTL/3 before the kill), with a second of margin for the checks.
    let killed = Instant::now();
    loop {
        let output = sandbox.run(&["lock", "status", "--json", "orphans"]);
        let status: serde_json::Value = serde_json::from_str(&stdout(&output))
            .unwrap_or_else(|_| panic!("{}", stderr(&output)));
        if status["held"] == false {
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(6),
            "the lock is still renewed after turnstile was killed: {status}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        killed.elapsed() >= Duration::from_millis(3300),
        "the lock was free {:?} after the kill, before its lease could end",
        killed.elapsed()
    );
}

#[test]
fn a_finished_command_leaves_nothing_of_turnstiles_running() {
    let sandbox = Sandbox::new();
    let output = sandbox.run(&["lock", "exec", "tidy", "--", "sh", "-c", "echo $PPID"]);
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    // The command's parent: turnstile, or a process between them, which turnstile has
    // waited for before exiting.
    let parent: libc::pid_t = stdout(&output).trim().parse().unwrap();
    assert!(
        ends_within(parent, Duration::from_secs(1)),
        "the command's parent {parent} outlived turnstile"
    );
}

#[test]
fn losing_the_redis_server_terminates_the_command_with_exit_76() {
    let server = RedisServer::spawn();
    let sandbox = Sandbox::new();
    let started = sandbox.path("started");
    let holder = sandbox
        .turnstile(&[
            "lock",
            "exec",
            "--store",
            &server.url(),
            "--ttl",
            "600ms",
            "job",
            "--",
            "sh",
            "-c",
            &format!("touch {}; exec sleep 30", started.display()),
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_file(&started);
    server.kill();
    let output = holder.wait_with_output().unwrap();
    assert_eq!(code(&output), 76, "{}", stderr(&output));
}

/// Waits until the lock's lease was renewed a moment ago: the store says nearly all of
/// `ttl` is left.
fn wait_for_a_fresh_renewal(sandbox: &Sandbox, store: &str, name: &str, ttl: Duration) {
    let started = Instant::now();
    loop {
        let output = sandbox.run(&["lock", "status", "--json", "--store", store, name]);
        let status: serde_json::Value = serde_json::from_str(&stdout(&output))
            .unwrap_or_else(|_| panic!("{}", stderr(&output)));
        let left = status["remaining_ttl_ms"]
            .as_u64()
            .map(Duration::from_millis);
        if left.is_some_and(|left| left + Duration::from_millis(150) >= ttl) {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no renewal seen: {status}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_store_that_stops_answering_gets_the_command_killed_before_the_lease_runs_out() {
    let server = RedisServer::spawn();
    let sandbox = Sandbox::new();
    let started = sandbox.path("command.pid");
    let termed = sandbox.path("termed");
    // The command ignores SIGTERM: only the SIGKILL ends it.
    let script = stubborn_script(&started, &termed);
    let ttl = Duration::from_secs(3);
    let grace = Duration::from_millis(1_500);
    let mut holder = sandbox
        .turnstile(&[
            "lock",
            "exec",
            "--store",
            &server.url(),
            "--ttl",
            "3s",
            "--kill-after",
            "1500ms",
            "partitioned",
            "--",
            "bash",
            "-c",
            &script,
        ])
        .spawn()
        .unwrap();
    let command = read_pid(&started);
    // Freeze the store right after a renewal, so the lease has nearly its whole TTL
    // left. Sending SIGTERM only when the lease had run out, and SIGKILL --kill-after
    // later, would end the command about TTL + 1.5s from here.
    wait_for_a_fresh_renewal(&sandbox, &server.url(), "partitioned", ttl);
    server.pause();
    let died = seen_ending_within(command, ttl + Duration::from_millis(500));
    server.resume();
    let status = exit_within(&mut holder, Duration::from_secs(10));
    let died = died.expect("the command was still running 500ms after its lease ran out");
    // SIGTERM went out --kill-after before the local deadline, SIGKILL at it.
    let termed = termed_at(&termed).expect("the command never got SIGTERM");
    assert_killed_after_the_grace(termed, died, grace);
    assert_eq!(status.and_then(|status| status.code()), Some(76));
}

/// Sends one command to the Redis server on `port` and returns its first reply line.
fn redis_command(port: u16, words: &[&str]) -> String {
    use std::io::{BufRead, BufReader, Write};
    let mut request = format!("*{}\r\n", words.len());
    for word in words {
        request.push_str(&format!("${}\r\n{word}\r\n", word.len()));
    }
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.write_all(request.as_bytes()).unwrap();
    let mut reply = String::new();
    BufReader::new(stream).read_line(&mut reply).unwrap();
    reply.trim_end().to_owned()
}

#[test]
fn a_lease_that_ran_out_during_the_acquire_does_not_start_the_command() {
    let server = RedisServer::spawn();
    let sandbox = Sandbox::new();
    let ran = sandbox.path("ran");
    // Writes, the acquire script among them, wait 2s: the acquire then succeeds, but
    // its 500ms lease, counted from when it was sent, has long run out.
    assert_eq!(
        redis_command(server.port(), &["CLIENT", "PAUSE", "2000", "WRITE"]),
        "+OK"
    );
    let output = sandbox.run(&[
        "lock",
        "exec",
        "--store",
        &server.url(),
        "--ttl",
        "500ms",
        "late",
        "--",
        "touch",
        &ran.display().to_string(),
    ]);
    assert_eq!(code(&output), 76, "{}", stderr(&output));
    assert!(
        stderr(&output).contains("not running the command"),
        "{}",
        stderr(&output)
    );
    assert!(!ran.exists(), "the command ran");
    // The lock was released, not left to expire.
    let status = sandbox.run(&["lock", "status", "--store", &server.url(), "late"]);
    assert!(stdout(&status).contains("is free"), "{}", stdout(&status));
}

#[test]
fn a_kill_grace_that_does_not_fit_in_the_ttl_is_refused() {
    let sandbox = Sandbox::new();
    let output = sandbox.run(&[
        "lock",
        "exec",
        "--ttl",
        "3s",
        "--kill-after",
        "2s",
        "grace",
        "--",
        "true",
    ]);
    assert_eq!(code(&output), 64, "{}", stderr(&output));
    assert!(
        stderr(&output).contains("--kill-after 2s does not fit in --ttl 3s"),
        "{}",
        stderr(&output)
    );
    // Without --kill-after, a short TTL gets a grace of TTL/3 instead of 10s.
    let output = sandbox.run(&["lock", "exec", "--ttl", "3s", "grace", "--", "true"]);
    assert_eq!(code(&output), 0, "{}", stderr(&output));
}

#[test]
fn bad_input_gets_a_specific_error_and_a_documented_code() {
    let sandbox = Sandbox::new();
    let cases: &[(&[&str], i32, &str)] = &[
        (&["lock", "exec", "", "--", "true"], 64, "must not be empty"),
        (
            &["lock", "exec", &"x".repeat(600), "--", "true"],
            64,
            "at most 512 bytes",
        ),
        (
            &["lock", "exec", "--ttl", "0s", "a", "--", "true"],
            64,
            "greater than zero",
        ),
        (
            &["lock", "exec", "--ttl", "10", "a", "--", "true"],
            64,
            "no unit",
        ),
        (
            &["lock", "exec", "--ttl", "soon", "a", "--", "true"],
            64,
            "not a duration",
        ),
        (&["lock", "exec", "a"], 64, "no command given"),
        (
            &["lock", "exec", "--store", "mongodb://x", "a", "--", "true"],
            64,
            "unknown store scheme",
        ),
        (
            &["lock", "exec", "--store", "sqlite://", "a", "--", "true"],
            64,
            "names no file",
        ),
        (
            &["lock", "exec", "a", "--", "/no/such/program"],
            127,
            "cannot run",
        ),
        (&["lock", "frobnicate"], 64, "unrecognized subcommand"),
    ];
    for (args, expected, message) in cases {
        let output = sandbox.run(args);
        assert_eq!(code(&output), *expected, "{args:?}: {}", stderr(&output));
        assert!(
            stderr(&output).contains(message),
            "{args:?}: {}",
            stderr(&output)
        );
    }
}

#[test]
fn absurdly_long_durations_are_refused_with_exit_64_not_a_panic() {
    let sandbox = Sandbox::new();
    let huge = "10000000000000000000s";
    for (flag, limit) in [
        ("--ttl", "at most 365 days"),
        (
            "--wait",
            "at most 100 years, or omit --wait to wait forever",
        ),
        ("--max-hold", "at most 100 years"),
        ("--kill-after", "at most 100 years"),
    ] {
        let output = sandbox.run(&["lock", "exec", flag, huge, "long", "--", "true"]);
        let message = stderr(&output);
        assert_eq!(code(&output), 64, "{flag}: {message}");
        assert!(
            message.contains(flag) && message.contains(huge) && message.contains(limit),
            "{flag}: {message}"
        );
        assert!(!message.contains("panicked"), "{flag}: {message}");
    }
}

#[test]
fn an_unreachable_store_is_reported_within_seconds() {
    let sandbox = Sandbox::new();
    let port = turnstile_test_support::free_port();
    let started = Instant::now();
    let output = sandbox.run(&[
        "lock",
        "status",
        "--store",
        &format!("redis://127.0.0.1:{port}"),
        "a",
    ]);
    assert_eq!(code(&output), 69, "{}", stderr(&output));
    assert!(
        stderr(&output).contains("cannot reach Redis"),
        "{}",
        stderr(&output)
    );
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn the_bench_runs_its_workload_and_prints_one_json_line() {
    let server = RedisServer::spawn();
    for raw in [false, true] {
        let mut command = Command::new(env!("CARGO_BIN_EXE_turnstile"));
        command.args(["bench", "lock"]);
        if raw {
            command.arg("--raw");
        }
        let output = command
            .env("REDIS_PORT", server.port().to_string())
            .env("BENCH_SECS", "1")
            .env("WORKERS", "3")
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", stderr(&output));
        let report: serde_json::Value = serde_json::from_str(stdout(&output).trim()).unwrap();
        assert_eq!(report["peer"], if raw { "raw" } else { "turnstile" });
        assert_eq!(report["counter_ok"], true, "{report}");
        assert!(report["uncontended_cycles"].as_u64().unwrap() > 0);
        assert!(report["contended_sections"].as_u64().unwrap() > 0);
        assert_eq!(report["workers"], 3);
    }
}

#[test]
fn rediss_urls_work_with_a_ca_from_ssl_cert_file() {
    let server = RedisServer::spawn_tls();
    let sandbox = Sandbox::new();
    let output = sandbox
        .turnstile(&[
            "lock",
            "exec",
            "--store",
            &server.url(),
            "tls-job",
            "--",
            "true",
        ])
        .env("SSL_CERT_FILE", server.ca_certificate())
        .output()
        .unwrap();
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    // The same server without the CA: its certificate is not trusted.
    let output = sandbox
        .turnstile(&["lock", "status", "--store", &server.url(), "tls-job"])
        .env_remove("SSL_CERT_FILE")
        .output()
        .unwrap();
    assert_eq!(code(&output), 78, "{}", stderr(&output));
    assert!(
        stderr(&output).contains("does not trust"),
        "{}",
        stderr(&output)
    );
}

/// The same commands against the database stores, as an operator would use them.
fn exec_status_break_round_trip(store: &str) {
    let sandbox = Sandbox::new();
    let migrate = sandbox.run(&["migrate", "--store", store]);
    assert_eq!(code(&migrate), 0, "{}", stderr(&migrate));
    assert!(stdout(&migrate).contains("tables ready"));

    let output = sandbox.run(&[
        "lock",
        "exec",
        "--store",
        store,
        "db-job",
        "--",
        "sh",
        "-c",
        "echo $TURNSTILE_FENCING_TOKEN",
    ]);
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let first: u64 = stdout(&output).trim().parse().unwrap();

    let started = sandbox.path("started");
    let holder = sandbox
        .turnstile(&[
            "lock",
            "exec",
            "--store",
            store,
            "--ttl",
            "1s",
            "db-job",
            "--",
            "sh",
            "-c",
            &format!(
                "echo $TURNSTILE_FENCING_TOKEN > {}; exec sleep 30",
                started.display()
            ),
        ])
        .spawn()
        .unwrap();
    wait_for_file(&started);
    let status: serde_json::Value = serde_json::from_str(&stdout(
        &sandbox.run(&["lock", "status", "--json", "--store", store, "db-job"]),
    ))
    .unwrap();
    assert_eq!(status["held"], true, "{status}");
    assert!(status["fencing_token"].as_u64().unwrap() > first);
    let output = sandbox.run(&[
        "lock",
        "exec",
        "--store",
        store,
        "--no-wait",
        "db-job",
        "--",
        "true",
    ]);
    assert_eq!(code(&output), 75);
    let broke = sandbox.run(&["lock", "break", "--store", store, "db-job"]);
    assert_eq!(code(&broke), 0, "{}", stderr(&broke));
    assert_eq!(code(&holder.wait_with_output().unwrap()), 76);
}

#[test]
fn postgres_stores_work_from_the_command_line() {
    exec_status_break_round_trip(&turnstile_test_support::shared_postgres().fresh_database("cli"));
}

#[test]
fn mysql_stores_work_from_the_command_line() {
    exec_status_break_round_trip(&turnstile_test_support::shared_mariadb().fresh_database("cli"));
}

#[cfg(feature = "zookeeper")]
#[test]
fn zookeeper_stores_work_from_the_command_line() {
    exec_status_break_round_trip(&format!(
        "{}/{}",
        turnstile_test_support::shared_zookeeper().url(),
        turnstile_test_support::unique_name("cli")
    ));
}

#[cfg(feature = "etcd")]
#[test]
fn etcd_stores_work_from_the_command_line() {
    exec_status_break_round_trip(&format!(
        "{}?turnstile_prefix={}",
        turnstile_test_support::shared_etcd().url(),
        turnstile_test_support::unique_name("cli")
    ));
}

#[test]
fn prune_forgets_names_unused_long_enough() {
    let sandbox = Sandbox::new();
    let output = sandbox.run(&["lock", "exec", "nightly", "--", "true"]);
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    std::thread::sleep(Duration::from_millis(1_100));
    let output = sandbox.run(&["lock", "prune", "--unused-for", "1s", "--json"]);
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let answer: serde_json::Value = serde_json::from_str(stdout(&output).trim()).unwrap();
    assert_eq!(answer["pruned"], 1, "{answer}");
    let output = sandbox.run(&["lock", "prune", "--unused-for", "10ms"]);
    assert_eq!(code(&output), 64, "{}", stderr(&output));
    assert!(
        stderr(&output).contains("at least 1s"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn status_and_break_create_nothing() {
    let sandbox = Sandbox::new();
    for command in ["status", "break"] {
        let output = sandbox.run(&["lock", command, "nothing-yet"]);
        assert_eq!(code(&output), 0, "{}", stderr(&output));
        assert!(
            stdout(&output).contains("free") || stdout(&output).contains("not held"),
            "{}",
            stdout(&output)
        );
    }
    assert!(
        !sandbox.path("locks.sqlite3").exists(),
        "a read-only look created the store"
    );
    // An existing store without that lock: still nothing created or changed.
    let output = sandbox.run(&["lock", "exec", "other", "--", "true"]);
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let output = sandbox.run(&["lock", "status", "--json", "nothing-yet"]);
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    assert!(
        stdout(&output).contains("\"held\":false"),
        "{}",
        stdout(&output)
    );
}

#[test]
fn idempotency_records_can_be_shown_listed_forgotten_and_swept() {
    use turnstile::idempotency::{Fingerprint, Idempotency, IdempotencyKey, Scope};
    let sandbox = Sandbox::new();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let scope = Scope::new("tenant-1").unwrap();
    runtime.block_on(async {
        let keys = Idempotency::connect(&sandbox.store()).await.unwrap();
        let fingerprint = Fingerprint::of(&[b"x"]);
        let done = IdempotencyKey::new("done").unwrap();
        let _: u32 = keys
            .run_once(&scope, &done, &fingerprint, |_| async {
                Ok::<_, turnstile::Error>(1)
            })
            .await
            .unwrap();
        let stale = IdempotencyKey::new("stale").unwrap();
        keys.store()
            .claim(
                &scope,
                &stale,
                &fingerprint,
                Duration::from_secs(1),
                Duration::from_secs(60),
            )
            .await
            .unwrap();
    });
    std::thread::sleep(Duration::from_millis(1_200));
    let output = sandbox.run(&[
        "idempotency",
        "show",
        "--scope",
        "tenant-1",
        "--json",
        "done",
    ]);
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let shown: serde_json::Value = serde_json::from_str(stdout(&output).trim()).unwrap();
    assert_eq!(shown["state"], "completed", "{shown}");
    assert_eq!(shown["outcome_bytes"], 1);
    let output = sandbox.run(&["idempotency", "stale", "--json"]);
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    assert!(
        stdout(&output).contains("\"key\":\"stale\""),
        "{}",
        stdout(&output)
    );
    let output = sandbox.run(&[
        "idempotency",
        "forget",
        "--scope",
        "tenant-1",
        "--json",
        "done",
    ]);
    let forgotten: serde_json::Value = serde_json::from_str(stdout(&output).trim()).unwrap();
    assert_eq!(forgotten["forgotten"], true, "{forgotten}");
    let output = sandbox.run(&[
        "idempotency",
        "show",
        "--scope",
        "tenant-1",
        "--json",
        "done",
    ]);
    assert!(
        stdout(&output).contains("\"state\":\"absent\""),
        "{}",
        stdout(&output)
    );
    let output = sandbox.run(&["idempotency", "sweep", "--json"]);
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let output = sandbox.run(&["idempotency", "show", "--scope", "tenant-1", "bad key\u{7}"]);
    assert_eq!(code(&output), 64, "{}", stderr(&output));
}

#[test]
fn migrate_creates_the_idempotency_table_too() {
    let sandbox = Sandbox::new();
    let output = sandbox.run(&["migrate"]);
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let tables: i64 = runtime.block_on(async {
        // Opened without creating anything: the table must already be there.
        let url = format!("{}?turnstile_migrate=off", sandbox.store());
        let store = turnstile::idempotency::sqlite::SqliteIdempotencyStore::open_url(&url)
            .await
            .unwrap();
        sqlx::query_scalar(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'turnstile_idempotency'",
        )
        .fetch_one(store.pool())
        .await
        .unwrap()
    });
    assert_eq!(
        tables, 1,
        "turnstile migrate did not create the idempotency table"
    );
}

/// `turnstile lead`: the leader runs the command with its epoch and value, `turnstile
/// leader` shows it, a second candidate waits, and takes over with a larger epoch when
/// the first is stopped by a signal; with `--once` it exits with the command's status.
#[test]
fn lead_runs_the_command_while_leading_and_hands_over_on_a_signal() {
    let sandbox = Sandbox::new();
    let first_started = sandbox.path("first");
    let second_started = sandbox.path("second");
    let mut first = sandbox
        .turnstile(&[
            "lead",
            "--value",
            "host-a:8080",
            "scheduler",
            "--",
            "sh",
            "-c",
            &format!(
                "echo \"$TURNSTILE_LEADER_EPOCH $TURNSTILE_LEADER_VALUE\" > {0}.tmp; mv {0}.tmp {0}; exec sleep 60",
                first_started.display()
            ),
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_file(&first_started);
    let started = std::fs::read_to_string(&first_started).unwrap();
    let (epoch, value) = started.trim().split_once(' ').unwrap();
    let first_epoch: u64 = epoch.parse().unwrap();
    assert_eq!(value, "host-a:8080");

    let shown = sandbox.run(&["leader", "--json", "scheduler"]);
    assert_eq!(code(&shown), 0, "{}", stderr(&shown));
    let shown: serde_json::Value = serde_json::from_str(stdout(&shown).trim()).unwrap();
    assert_eq!(shown["leading"], true);
    assert_eq!(shown["epoch"], first_epoch);
    assert_eq!(shown["value"], "host-a:8080");

    let second = sandbox
        .turnstile(&[
            "lead",
            "--once",
            "--value",
            "host-b:8080",
            "scheduler",
            "--",
            "sh",
            "-c",
            &format!(
                "echo \"$TURNSTILE_LEADER_EPOCH\" > {0}.tmp; mv {0}.tmp {0}; exit 3",
                second_started.display()
            ),
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !second_started.exists(),
        "the second candidate ran while the first led"
    );
    // SAFETY: kill has no memory-safety preconditions.
    unsafe {
        libc::kill(first.id() as libc::pid_t, libc::SIGTERM);
    }
    let status = exit_within(&mut first, Duration::from_secs(10)).expect("the first leader exits");
    assert!(
        !status.success(),
        "the signalled command's status: {status:?}"
    );
    let output = second.wait_with_output().unwrap();
    assert_eq!(code(&output), 3, "{}", stderr(&output));
    let second_epoch: u64 = std::fs::read_to_string(&second_started)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        second_epoch > first_epoch,
        "{second_epoch} after {first_epoch}"
    );
    let shown = sandbox.run(&["leader", "scheduler"]);
    assert!(
        stdout(&shown).contains("has no leader"),
        "{}",
        stdout(&shown)
    );
}

/// Without `--once`, a term that ends is followed by a new campaign after
/// `--retry-period`, each term with a larger epoch; a signal while campaigning or
/// between terms stops it with status 0.
#[test]
fn lead_campaigns_again_after_each_term() {
    let sandbox = Sandbox::new();
    let terms = sandbox.path("terms");
    let mut candidate = sandbox
        .turnstile(&[
            "lead",
            "--retry-period",
            "200ms",
            "compactor",
            "--",
            "sh",
            "-c",
            &format!("echo \"$TURNSTILE_LEADER_EPOCH\" >> {}", terms.display()),
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let epochs = loop {
        let epochs: Vec<u64> = std::fs::read_to_string(&terms)
            .unwrap_or_default()
            .lines()
            .map(|line| line.parse().unwrap())
            .collect();
        if epochs.len() >= 3 {
            break epochs;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "only {} terms in 20s",
            epochs.len()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    for pair in epochs.windows(2) {
        assert!(pair[1] > pair[0], "epoch {} after {}", pair[1], pair[0]);
    }
    // SAFETY: kill has no memory-safety preconditions.
    unsafe {
        libc::kill(candidate.id() as libc::pid_t, libc::SIGTERM);
    }
    exit_within(&mut candidate, Duration::from_secs(10)).expect("the candidate stops");
    // Stopped, it leads no more: the election is free for the next candidate.
    let shown = sandbox.run(&["leader", "compactor"]);
    assert!(
        stdout(&shown).contains("has no leader"),
        "{}",
        stdout(&shown)
    );
}

/// `turnstile leader --watch --json` prints the state at once and then every change:
/// two leaders one after the other show up in order, with growing epochs.
#[test]
fn leader_watch_prints_every_change() {
    use std::io::BufRead;
    let sandbox = Sandbox::new();
    // The store exists before the watcher looks (a look creates nothing).
    let first = sandbox.run(&["lead", "--once", "--value", "one", "etl", "--", "true"]);
    assert_eq!(code(&first), 0, "{}", stderr(&first));
    let mut watcher = sandbox
        .turnstile(&["leader", "--watch", "--json", "etl"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (lines_sent, lines) = std::sync::mpsc::channel();
    let stdout = watcher.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if lines_sent.send(line).is_err() {
                break;
            }
        }
    });
    let next = |what: &str| -> serde_json::Value {
        let line = lines
            .recv_timeout(Duration::from_secs(10))
            .unwrap_or_else(|_| panic!("the watcher printed no line for {what}"));
        serde_json::from_str(&line).unwrap()
    };
    assert_eq!(next("the start")["leading"], false);
    let hold = sandbox.path("held");
    let mut leader = sandbox
        .turnstile(&[
            "lead",
            "--once",
            "--value",
            "two",
            "etl",
            "--",
            "sh",
            "-c",
            &format!("touch {}; sleep 1", hold.display()),
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let seen = next("the first leader");
    assert_eq!(seen["leading"], true);
    assert_eq!(seen["value"], "two");
    let first_epoch = seen["epoch"].as_u64().unwrap();
    assert_eq!(leader.wait().unwrap().code(), Some(0));
    assert_eq!(next("the end of the term")["leading"], false);
    let output = sandbox.run(&[
        "lead", "--once", "--value", "three", "etl", "--", "sleep", "1",
    ]);
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let seen = next("the second leader");
    assert_eq!(seen["value"], "three");
    assert!(seen["epoch"].as_u64().unwrap() > first_epoch);
    let _ = watcher.kill();
    let _ = watcher.wait();
}

/// `lock exec --permits 2`: two commands run at once under the semaphore, a third is
/// refused with `--no-wait` (exit 75), another number of permits is refused (exit 64),
/// `semaphore status` shows both holders, and `semaphore forget` lets a new number in.
#[test]
fn exec_with_permits_runs_at_most_that_many_at_once() {
    let sandbox = Sandbox::new();
    let mut holders = Vec::new();
    let mut markers = Vec::new();
    for n in 0..2 {
        let marker = sandbox.path(&format!("holder-{n}"));
        holders.push(
            sandbox
                .turnstile(&[
                    "lock",
                    "exec",
                    "--permits",
                    "2",
                    "exports",
                    "--",
                    "sh",
                    "-c",
                    &format!(
                        "echo \"$TURNSTILE_SEMAPHORE $TURNSTILE_PERMIT $TURNSTILE_LOCK_NAME\" > {0}.tmp; mv {0}.tmp {0}; sleep 3",
                        marker.display()
                    ),
                ])
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        markers.push(marker);
    }
    let mut permits = Vec::new();
    for marker in &markers {
        wait_for_file(marker);
        let seen = std::fs::read_to_string(marker).unwrap();
        let words: Vec<&str> = seen.split_whitespace().collect();
        assert_eq!(words[0], "exports");
        assert_eq!(words[2], format!("exports#{}", words[1]));
        permits.push(words[1].to_owned());
    }
    permits.sort();
    assert_eq!(permits, ["0", "1"], "the two commands hold the two permits");

    let third = sandbox.run(&[
        "lock",
        "exec",
        "--permits",
        "2",
        "--no-wait",
        "exports",
        "--",
        "true",
    ]);
    assert_eq!(code(&third), 75, "{}", stderr(&third));
    let other_number = sandbox.run(&["lock", "exec", "--permits", "3", "exports", "--", "true"]);
    assert_eq!(code(&other_number), 64, "{}", stderr(&other_number));
    assert!(
        stderr(&other_number).contains("has 2 permits"),
        "{}",
        stderr(&other_number)
    );

    let status = sandbox.run(&["semaphore", "status", "--json", "exports"]);
    assert_eq!(code(&status), 0, "{}", stderr(&status));
    let status: serde_json::Value = serde_json::from_str(stdout(&status).trim()).unwrap();
    assert_eq!(status["permits"], 2);
    assert_eq!(status["held"], 2);

    for mut holder in holders {
        assert_eq!(holder.wait().unwrap().code(), Some(0));
    }
    let forgot = sandbox.run(&["semaphore", "forget", "exports"]);
    assert!(
        stdout(&forgot).contains("has 2 permits"),
        "{}",
        stdout(&forgot)
    );
    let three = sandbox.run(&["lock", "exec", "--permits", "3", "exports", "--", "true"]);
    assert_eq!(code(&three), 0, "{}", stderr(&three));
}
