//! Real servers for Turnstile's tests, hermetically.
//!
//! Every server is started on a free loopback port in its own temporary directory,
//! with no persistence, and stopped when its handle is dropped. Each has fault hooks
//! ([`kill`](RedisServer::kill), [`restart`](RedisServer::restart),
//! [`pause`](RedisServer::pause)/[`resume`](RedisServer::resume)) so that loss of a lock
//! can be tested for real, and prints its log when the test that owns it panics.
//!
//! Children are started from one long-lived thread with `PR_SET_PDEATHSIG`, so even a
//! server kept in a `static` dies with the test process instead of outliving it.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

mod clock;
mod etcd;
mod mariadb;
mod nats;
mod postgres;
mod proxy;
mod rabbitmq;
mod redis;
mod redis_cluster;
mod redis_sentinel;
mod zookeeper;

pub use clock::{ServerClock, SteppableClock};
pub use etcd::{EtcdCluster, EtcdServer, shared_etcd};
pub use mariadb::{MariaDbServer, shared_mariadb, shared_mariadb_on};
pub use nats::NatsServer;
pub use postgres::{PostgresServer, shared_postgres, shared_postgres_on};
pub use proxy::TcpProxy;
pub use rabbitmq::{RabbitMqServer, shared_rabbitmq};
pub use redis::{RedisServer, shared_redis};
pub use redis_cluster::RedisCluster;
pub use redis_sentinel::{RedisSentinelGroup, SENTINEL_MASTER};
pub use zookeeper::{ZooKeeperEnsemble, ZooKeeperServer, shared_zookeeper};

/// A free TCP port on 127.0.0.1 (free when this returns; the server retries on a clash).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .expect("cannot bind a loopback port")
}

/// A loopback port that stays closed while this lives: a socket is bound to it but does
/// not listen, so connections to it are refused and no server (of this test process or
/// another) can take the port meanwhile, as one can a port that [`free_port`] found free.
pub struct ClosedPort {
    _socket: std::os::fd::OwnedFd,
    port: u16,
}

impl ClosedPort {
    /// Binds a socket to a free port on 127.0.0.1 without listening on it.
    pub fn bind() -> ClosedPort {
        use std::os::fd::FromRawFd;
        // SAFETY: plain socket calls on a descriptor this function owns; `address` and
        // `length` outlive the calls that use them.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
            let socket = std::os::fd::OwnedFd::from_raw_fd(fd);
            let mut address: libc::sockaddr_in = std::mem::zeroed();
            address.sin_family = libc::AF_INET as libc::sa_family_t;
            address.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
            address.sin_port = 0;
            let mut length = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            let raw = std::ptr::from_mut(&mut address).cast::<libc::sockaddr>();
            assert_eq!(
                libc::bind(fd, raw, length),
                0,
                "bind: {}",
                std::io::Error::last_os_error()
            );
            assert_eq!(
                libc::getsockname(fd, raw, &mut length),
                0,
                "getsockname: {}",
                std::io::Error::last_os_error()
            );
            ClosedPort {
                _socket: socket,
                port: u16::from_be(address.sin_port),
            }
        }
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }
}

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Starts `command` from the spawner thread, which lives as long as the process, with
/// `PR_SET_PDEATHSIG = SIGKILL`: the child dies when the test process does.
pub fn spawn_tied_to_process(command: Command) -> std::io::Result<Child> {
    spawn_tied_to_process_as(command, None)
}

/// Like [`spawn_tied_to_process`], running the child as the user `(uid, gid)` (servers
/// such as PostgreSQL refuse to run as root).
pub fn spawn_tied_to_process_as(
    mut command: Command,
    run_as: Option<(u32, u32)>,
) -> std::io::Result<Child> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (sender, receiver) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("test-server-spawner".into())
            .spawn(move || {
                for (mut command, reply) in receiver {
                    let _ = reply.send(command.spawn());
                }
            })
            .expect("cannot start the spawner thread");
        Mutex::new(sender)
    });
    // SAFETY: prctl and getppid are async-signal-safe and touch no memory of the parent.
    unsafe {
        use std::os::unix::process::CommandExt;
        let parent = libc::getpid();
        command.pre_exec(move || {
            if let Some((uid, gid)) = run_as
                && (libc::setgroups(0, std::ptr::null()) != 0
                    || libc::setgid(gid) != 0
                    || libc::setuid(uid) != 0)
            {
                return Err(std::io::Error::last_os_error());
            }
            // After setuid: a change of credentials clears the parent-death signal.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died between fork and prctl.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    let (reply, answer) = mpsc::channel();
    spawner
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .send((command, reply))
        .expect("the spawner thread is gone");
    answer.recv().expect("the spawner thread is gone")
}

/// Finds a server binary on `PATH` (or in `extra_dirs`), or panics with a message that
/// says how to install it.
pub fn find_binary(name: &str, package: &str, extra_dirs: &[&str]) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(extra_dirs.iter().map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| {
            panic!(
                "`{name}` is not installed; install the Debian package `{package}` \
                 (the README's test command does this: ./scripts/test)"
            )
        })
}

pub(crate) fn signal(child: &Child, signal: libc::c_int) {
    let pid = libc::pid_t::try_from(child.id()).expect("pid fits pid_t");
    // SAFETY: sending a signal to our own child process.
    unsafe {
        libc::kill(pid, signal);
    }
}

pub(crate) fn read_log(path: &Path) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_else(|error| format!("(no log at {}: {error})", path.display()))
}

/// A name no other test (or earlier run) uses, for key prefixes and lock names.
pub fn unique_name(label: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    format!(
        "{label}-{}-{nanos:x}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// A started server process with fault hooks: kill, pause, resume.
#[derive(Default)]
pub(crate) struct Process {
    child: Mutex<Option<Child>>,
}

impl Process {
    pub(crate) fn set(&self, child: Child) {
        *self.child.lock().unwrap() = Some(child);
    }

    /// SIGKILL and reap; a paused process is thawed first so it can die.
    pub(crate) fn kill(&self) {
        if let Some(mut child) = self.child.lock().unwrap().take() {
            signal(&child, libc::SIGCONT);
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends `signal_number` and waits for the process to exit, up to `limit`, then kills it.
    pub(crate) fn stop_with(&self, signal_number: libc::c_int, limit: Duration) {
        if let Some(mut child) = self.child.lock().unwrap().take() {
            signal(&child, signal_number);
            let started = Instant::now();
            while started.elapsed() < limit {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The process id of the running server, if it runs.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.lock().unwrap().as_ref().map(Child::id)
    }

    pub(crate) fn signal(&self, signal_number: libc::c_int) {
        if let Some(child) = self.child.lock().unwrap().as_ref() {
            signal(child, signal_number);
        }
    }
}

/// The length of the log at `path` now (0 if there is none yet): where the lines of a
/// server about to start will begin.
pub(crate) fn log_length(path: &Path) -> usize {
    std::fs::metadata(path).map_or(0, |metadata| {
        usize::try_from(metadata.len()).unwrap_or(usize::MAX)
    })
}

/// Waits until `needle` shows up in the log at `path` after its first `log_from` bytes
/// (a restarted server appends to the log of its predecessor, whose lines must not
/// count) and `port` accepts connections.
pub(crate) fn wait_until_ready(
    path: &Path,
    log_from: usize,
    needle: &str,
    port: Option<u16>,
    child: &mut Child,
    limit: Duration,
) -> bool {
    let started = Instant::now();
    while started.elapsed() < limit {
        if let Ok(Some(_)) = child.try_wait() {
            return false;
        }
        let log = read_log(path);
        let fresh = log.as_bytes().get(log_from..).unwrap_or_default();
        if fresh
            .windows(needle.len())
            .any(|window| window == needle.as_bytes())
            && port.is_none_or(|port| TcpStream::connect(("127.0.0.1", port)).is_ok())
        {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// The uid and gid of `user`, if it exists.
pub(crate) fn user_ids(user: &str) -> Option<(u32, u32)> {
    let name = std::ffi::CString::new(user).ok()?;
    // SAFETY: getpwnam returns a pointer to static storage or null; read it at once.
    unsafe {
        let entry = libc::getpwnam(name.as_ptr());
        if entry.is_null() {
            None
        } else {
            Some(((*entry).pw_uid, (*entry).pw_gid))
        }
    }
}

/// Whether this process runs as root.
pub(crate) fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Prints a server's log when the server is dropped while its thread panics: the
/// failing test that owned it shows what the server saw.
pub(crate) fn show_log_if_panicking(label: &str, log_path: &Path) {
    if std::thread::panicking() {
        eprintln!(
            "--- {label} log ({}) ---\n{}",
            log_path.display(),
            read_log(log_path)
        );
    }
}

/// Prints the end of a shared server's log when any test of this process panics:
/// shared servers live in statics, which are never dropped, so their `Drop` cannot.
pub(crate) fn show_log_on_panic(label: &'static str, path: PathBuf) {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        previous(info);
        let log = read_log(&path);
        let tail: Vec<&str> = log.lines().rev().take(30).collect();
        eprintln!(
            "--- last lines of the shared {label} log ({}) ---",
            path.display()
        );
        for line in tail.iter().rev() {
            eprintln!("{line}");
        }
    }));
}

/// A temporary directory for a server, named after this process.
///
/// Shared servers live in statics, which are never dropped, so their directories
/// outlive the test process; the first call in each process removes those left by
/// processes that are gone.
pub(crate) fn server_dir(kind: &str) -> tempfile::TempDir {
    static SWEPT: OnceLock<()> = OnceLock::new();
    SWEPT.get_or_init(sweep_leftover_dirs);
    tempfile::Builder::new()
        .prefix(&format!("turnstile-{kind}-{}-", std::process::id()))
        .tempdir()
        .expect("cannot make a temporary directory")
}

/// Removes `turnstile-KIND-PID-*` directories whose process no longer runs.
fn sweep_leftover_dirs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name();
        let Some(rest) = name
            .to_str()
            .and_then(|name| name.strip_prefix("turnstile-"))
        else {
            continue;
        };
        let pid = rest
            .split('-')
            .nth(1)
            .and_then(|pid| pid.parse::<u32>().ok());
        if let Some(pid) = pid
            && pid != std::process::id()
            && !Path::new(&format!("/proc/{pid}")).exists()
        {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}
