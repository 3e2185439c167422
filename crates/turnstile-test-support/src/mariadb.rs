//! MariaDB (or MySQL): `mariadb-install-db` into a temporary directory, `mariadbd` on a
//! free port.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::{
    Process, ServerClock, find_binary, free_port, read_log, spawn_tied_to_process, wait_until_ready,
};

const SBIN: &[&str] = &["/usr/sbin", "/usr/local/sbin", "/usr/local/mysql/bin"];

/// A real MariaDB server on a free loopback port with a user `turnstile` (no password)
/// that may do anything. [`spawn`](MariaDbServer::spawn)'s InnoDB flushes its log once a
/// second (a server crash keeps every commit, an OS crash could lose the last second);
/// [`spawn_durable`](MariaDbServer::spawn_durable)'s flushes every commit.
pub struct MariaDbServer {
    dir: tempfile::TempDir,
    port: Mutex<u16>,
    process: Process,
    /// `innodb_flush_log_at_trx_commit = 1` (every commit flushed and synced).
    durable: bool,
    clock: ServerClock,
}

impl MariaDbServer {
    /// Installs a data directory and starts the server; waits until it accepts
    /// connections.
    pub fn spawn() -> MariaDbServer {
        MariaDbServer::spawn_with(false, ServerClock::Host)
    }

    /// A server whose wall clock (`NOW()`, `SYSDATE()`, `UNIX_TIMESTAMP()`) is `clock`,
    /// not the host's: see [`ServerClock`].
    pub fn spawn_on(clock: ServerClock) -> MariaDbServer {
        MariaDbServer::spawn_with(false, clock)
    }

    /// A server with a production's durability settings: every commit's log flushed and
    /// synced to the disk (`innodb_flush_log_at_trx_commit = 1`, MariaDB's default).
    /// A server crash (`kill -9`) keeps every commit with either setting; this one is
    /// for the tests that claim durability, so they run as a user's server would.
    pub fn spawn_durable() -> MariaDbServer {
        MariaDbServer::spawn_with(true, ServerClock::Host)
    }

    fn spawn_with(durable: bool, clock: ServerClock) -> MariaDbServer {
        let dir = crate::server_dir("mariadb");
        let server = MariaDbServer {
            dir,
            port: Mutex::new(0),
            process: Process::default(),
            durable,
            clock,
        };
        let install = find_binary(
            "mariadb-install-db",
            "mariadb-server",
            &["/usr/bin", "/usr/local/bin"],
        );
        std::fs::create_dir_all(server.tmp_dir()).expect("cannot create MariaDB's tmpdir");
        let output = Command::new(install)
            .arg("--no-defaults")
            .arg(format!("--datadir={}", server.data_dir().display()))
            // Passed on to the bootstrap server: its temporary tables in /tmp collided
            // with another server's when several were installed at once.
            .arg(format!("--tmpdir={}", server.tmp_dir().display()))
            .args([
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
                "--user=root",
            ])
            .stdin(Stdio::null())
            .output()
            .expect("cannot run mariadb-install-db");
        assert!(
            output.status.success(),
            "mariadb-install-db failed:\n{}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        server.start(None);
        server.sql("CREATE USER 'turnstile'@'%'; GRANT ALL ON *.* TO 'turnstile'@'%' WITH GRANT OPTION; CREATE DATABASE test;");
        server
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("mariadb.log")
    }

    /// The server's own directory for temporary tables and files.
    fn tmp_dir(&self) -> PathBuf {
        self.dir.path().join("tmp")
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("mariadb.sock")
    }

    fn start(&self, port: Option<u16>) {
        let binary = find_binary("mariadbd", "mariadb-server", SBIN);
        for _ in 0..5 {
            let port = port.unwrap_or_else(free_port);
            let mut command = Command::new(&binary);
            command
                .arg("--no-defaults")
                .arg(format!("--datadir={}", self.data_dir().display()))
                .arg(format!("--port={port}"))
                .arg("--bind-address=127.0.0.1")
                .arg(format!("--socket={}", self.socket().display()))
                .arg(format!(
                    "--pid-file={}",
                    self.dir.path().join("mariadb.pid").display()
                ))
                .arg(format!("--log-error={}", self.log_path().display()))
                .arg(format!("--tmpdir={}", self.tmp_dir().display()))
                .args(["--user=root", "--skip-log-bin", "--skip-name-resolve"])
                .args([
                    "--innodb-buffer-pool-size=32M",
                    "--innodb-log-file-size=16M",
                ])
                .arg(if self.durable {
                    "--innodb-flush-log-at-trx-commit=1"
                } else {
                    "--innodb-flush-log-at-trx-commit=2"
                })
                .arg("--max-connections=300");
            self.clock.apply(&mut command);
            command
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let log_from = crate::log_length(&self.log_path());
            let mut child = spawn_tied_to_process(command).expect("cannot start mariadbd");
            if wait_until_ready(
                &self.log_path(),
                log_from,
                &format!("port: {port}"),
                Some(port),
                &mut child,
                Duration::from_secs(60),
            ) {
                *self.port.lock().unwrap() = port;
                self.process.set(child);
                return;
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("mariadbd did not start; its log:\n{}", self.log());
    }

    /// Runs SQL as root over the server's socket.
    pub fn sql(&self, statements: &str) -> String {
        let client = find_binary("mariadb", "mariadb-client", &["/usr/bin"]);
        let output = Command::new(client)
            .arg("--no-defaults")
            .arg(format!("--socket={}", self.socket().display()))
            .args(["-u", "root", "-N", "-B", "-e", statements])
            .output()
            .expect("cannot run the mariadb client");
        assert!(
            output.status.success(),
            "SQL failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// The server's process id while it runs (`None` after [`kill`](Self::kill)).
    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        *self.port.lock().unwrap()
    }

    /// `mysql://turnstile@127.0.0.1:PORT/test`.
    pub fn url(&self) -> String {
        format!("mysql://turnstile@127.0.0.1:{}/test", self.port())
    }

    /// Creates a fresh database and returns its URL (one per test keeps tests apart).
    pub fn fresh_database(&self, label: &str) -> String {
        let name = crate::unique_name(label).replace('-', "_").to_lowercase();
        self.sql(&format!("CREATE DATABASE {name}"));
        format!("mysql://turnstile@127.0.0.1:{}/{name}", self.port())
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        read_log(&self.log_path())
    }

    /// Kills the server with SIGKILL: a crash.
    pub fn kill(&self) {
        self.process.kill();
    }

    /// Stops the server cleanly and starts it again on the same port, with its data.
    pub fn restart(&self) {
        self.process
            .stop_with(libc::SIGTERM, Duration::from_secs(30));
        self.start(Some(self.port()));
    }
}

impl Drop for MariaDbServer {
    fn drop(&mut self) {
        crate::show_log_if_panicking("mariadb", &self.log_path());
        self.process.kill();
    }
}

/// One MariaDB server per test binary and clock, started on first use, gone with the
/// process: [`shared_mariadb`] on a wall clock that is not the host's.
pub fn shared_mariadb_on(clock: ServerClock) -> &'static MariaDbServer {
    static AHEAD: OnceLock<MariaDbServer> = OnceLock::new();
    static BEHIND: OnceLock<MariaDbServer> = OnceLock::new();
    let shared = match clock {
        ServerClock::Host => return shared_mariadb(),
        ServerClock::HourAhead => &AHEAD,
        ServerClock::HourBehind => &BEHIND,
    };
    shared.get_or_init(|| {
        let server = MariaDbServer::spawn_on(clock);
        crate::show_log_on_panic("mariadb", server.log_path());
        server
    })
}

/// One MariaDB server per test binary, started on first use, gone with the process.
pub fn shared_mariadb() -> &'static MariaDbServer {
    static SHARED: OnceLock<MariaDbServer> = OnceLock::new();
    SHARED.get_or_init(|| {
        let server = MariaDbServer::spawn();
        crate::show_log_on_panic("mariadb", server.log_path());
        server
    })
}
