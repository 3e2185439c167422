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

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// A free TCP port on 127.0.0.1 (free when this returns; the server retries on a clash).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .expect("cannot bind a loopback port")
}

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Starts `command` from the spawner thread, which lives as long as the process, with
/// `PR_SET_PDEATHSIG = SIGKILL`: the child dies when the test process does.
pub fn spawn_tied_to_process(mut command: Command) -> std::io::Result<Child> {
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

fn signal(child: &Child, signal: libc::c_int) {
    let pid = libc::pid_t::try_from(child.id()).expect("pid fits pid_t");
    // SAFETY: sending a signal to our own child process.
    unsafe {
        libc::kill(pid, signal);
    }
}

fn read_log(path: &Path) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_else(|error| format!("(no log at {}: {error})", path.display()))
}

/// A real `redis-server` on a free loopback port, without persistence.
pub struct RedisServer {
    port: Mutex<u16>,
    extra_args: Vec<String>,
    tls: bool,
    dir: tempfile::TempDir,
    child: Mutex<Option<Child>>,
}

impl RedisServer {
    /// Starts a server and waits until it answers `PING`.
    pub fn spawn() -> RedisServer {
        RedisServer::spawn_with_args(&[])
    }

    /// Starts a server with extra command-line settings (`--cluster-enabled yes`, …).
    pub fn spawn_with_args(args: &[&str]) -> RedisServer {
        RedisServer::spawn_inner(args, false)
    }

    /// Starts a server that speaks only TLS, with a certificate for 127.0.0.1 signed by
    /// a throwaway CA (see [`ca_certificate`](Self::ca_certificate)). Needs `openssl`.
    pub fn spawn_tls() -> RedisServer {
        RedisServer::spawn_inner(&[], true)
    }

    fn spawn_inner(args: &[&str], tls: bool) -> RedisServer {
        let dir = tempfile::Builder::new()
            .prefix("turnstile-redis-")
            .tempdir()
            .expect("cannot make a temporary directory");
        let server = RedisServer {
            port: Mutex::new(0),
            extra_args: args.iter().map(|arg| (*arg).to_owned()).collect(),
            tls,
            dir,
            child: Mutex::new(None),
        };
        if tls {
            make_certificates(server.dir.path());
        }
        server.start(None);
        server
    }

    fn start(&self, port: Option<u16>) {
        let binary = find_binary("redis-server", "redis-server", &[]);
        let mut last_log = String::new();
        for _ in 0..5 {
            let port = port.unwrap_or_else(free_port);
            let mut command = Command::new(&binary);
            if self.tls {
                let dir = self.dir.path();
                command
                    .args([
                        "--port",
                        "0",
                        "--tls-port",
                        &port.to_string(),
                        "--tls-auth-clients",
                        "no",
                    ])
                    .arg("--tls-cert-file")
                    .arg(dir.join("server.pem"))
                    .arg("--tls-key-file")
                    .arg(dir.join("server.key"))
                    .arg("--tls-ca-cert-file")
                    .arg(dir.join("ca.pem"));
            } else {
                command.args(["--port", &port.to_string()]);
            }
            command
                .args(["--bind", "127.0.0.1"])
                .args(["--save", ""])
                .args(["--appendonly", "no"])
                .args(["--dir"])
                .arg(self.dir.path())
                .args(["--logfile"])
                .arg(self.log_path())
                .args(["--daemonize", "no"])
                .args(&self.extra_args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let mut child = spawn_tied_to_process(command).expect("cannot start redis-server");
            let ready = if self.tls {
                wait_for_log(
                    &self.log_path(),
                    "Ready to accept connections",
                    &mut child,
                    Duration::from_secs(10),
                )
            } else {
                wait_for_pong(port, &mut child, Duration::from_secs(10))
            };
            if ready {
                *self.port.lock().unwrap() = port;
                *self.child.lock().unwrap() = Some(child);
                return;
            }
            let _ = child.kill();
            let _ = child.wait();
            last_log = self.log();
        }
        panic!("redis-server did not start; its log:\n{last_log}");
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        *self.port.lock().unwrap()
    }

    /// `redis://127.0.0.1:PORT`, or `rediss://…` for a TLS server.
    pub fn url(&self) -> String {
        let scheme = if self.tls { "rediss" } else { "redis" };
        format!("{scheme}://127.0.0.1:{}", self.port())
    }

    /// The PEM file of the CA that signed a TLS server's certificate.
    pub fn ca_certificate(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("redis.log")
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        read_log(&self.log_path())
    }

    /// Kills the server with SIGKILL (all data is lost: there is no persistence).
    pub fn kill(&self) {
        if let Some(mut child) = self.child.lock().unwrap().take() {
            signal(&child, libc::SIGCONT);
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills the server and starts a new one on the same port, empty.
    pub fn restart(&self) {
        self.kill();
        self.start(Some(self.port()));
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        if let Some(child) = self.child.lock().unwrap().as_ref() {
            signal(child, libc::SIGSTOP);
        }
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&self) {
        if let Some(child) = self.child.lock().unwrap().as_ref() {
            signal(child, libc::SIGCONT);
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- redis-server log ({}) ---\n{}",
                self.dir.path().display(),
                self.log()
            );
        }
        self.kill();
    }
}

/// Makes a throwaway CA and a server certificate for 127.0.0.1 and localhost in `dir`.
fn make_certificates(dir: &Path) {
    let openssl = find_binary("openssl", "openssl", &[]);
    let run = |args: &[&str]| {
        let output = Command::new(&openssl)
            .args(args)
            .current_dir(dir)
            .output()
            .expect("cannot run openssl");
        assert!(
            output.status.success(),
            "openssl {args:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    };
    std::fs::write(
        dir.join("san.cnf"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .unwrap();
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=turnstile-test-ca",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
    ]);
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "san.cnf",
    ]);
}

fn wait_for_log(path: &Path, needle: &str, child: &mut Child, limit: Duration) -> bool {
    let started = Instant::now();
    while started.elapsed() < limit {
        if let Ok(Some(_)) = child.try_wait() {
            return false;
        }
        if read_log(path).contains(needle) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

fn wait_for_pong(port: u16, child: &mut Child, limit: Duration) -> bool {
    let started = Instant::now();
    while started.elapsed() < limit {
        if let Ok(Some(_)) = child.try_wait() {
            return false;
        }
        if let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
            let mut reply = [0u8; 7];
            if stream.write_all(b"PING\r\n").is_ok()
                && stream.read_exact(&mut reply).is_ok()
                && &reply == b"+PONG\r\n"
            {
                return true;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// One Redis server per test binary, started on first use and killed when the test
/// process exits. Tests that kill, restart or pause a server start their own instead.
pub fn shared_redis() -> &'static RedisServer {
    static SHARED: OnceLock<RedisServer> = OnceLock::new();
    SHARED.get_or_init(RedisServer::spawn)
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
