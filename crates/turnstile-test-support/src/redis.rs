//! `redis-server`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::{Process, find_binary, free_port, read_log, spawn_tied_to_process, wait_until_ready};

/// A real `redis-server` on a free loopback port, without persistence.
pub struct RedisServer {
    port: Mutex<u16>,
    extra_args: Vec<String>,
    tls: bool,
    dir: tempfile::TempDir,
    process: Process,
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
        let dir = crate::server_dir("redis");
        let server = RedisServer {
            port: Mutex::new(0),
            extra_args: args.iter().map(|arg| (*arg).to_owned()).collect(),
            tls,
            dir,
            process: Process::default(),
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
            let log_from = crate::log_length(&self.log_path());
            let mut child = spawn_tied_to_process(command).expect("cannot start redis-server");
            let ready = if self.tls {
                wait_until_ready(
                    &self.log_path(),
                    log_from,
                    "Ready to accept connections",
                    Some(port),
                    &mut child,
                    Duration::from_secs(10),
                )
            } else {
                wait_for_pong(port, &mut child, Duration::from_secs(10))
            };
            if ready {
                *self.port.lock().unwrap() = port;
                self.process.set(child);
                return;
            }
            let _ = child.kill();
            let _ = child.wait();
            last_log = self.log();
        }
        panic!("redis-server did not start; its log:\n{last_log}");
    }

    /// The server's process id while it runs (`None` after [`kill`](Self::kill)).
    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
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
        self.process.kill();
    }

    /// Kills the server and starts a new one on the same port, empty.
    pub fn restart(&self) {
        self.kill();
        self.start(Some(self.port()));
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        self.process.signal(libc::SIGSTOP);
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&self) {
        self.process.signal(libc::SIGCONT);
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        crate::show_log_if_panicking("redis-server", &self.log_path());
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
    SHARED.get_or_init(|| {
        let server = RedisServer::spawn();
        crate::show_log_on_panic("redis-server", server.log_path());
        server
    })
}
