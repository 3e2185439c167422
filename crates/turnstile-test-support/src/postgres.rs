//! PostgreSQL: `initdb` into a temporary directory, `postgres` on a free port.

use std::fs::File;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::{
    Process, ServerClock, free_port, read_log, running_as_root, spawn_tied_to_process_as, user_ids,
    wait_until_ready,
};

/// Where Debian and the upstream packages put the server binaries.
fn postgres_binary(name: &str) -> PathBuf {
    let mut dirs: Vec<String> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|entry| format!("{}/bin", entry.path().display()))
                .collect()
        })
        .unwrap_or_default();
    dirs.sort();
    dirs.reverse();
    let extra: Vec<&str> = dirs.iter().map(String::as_str).collect();
    crate::find_binary(name, "postgresql", &extra)
}

/// A real PostgreSQL server on a free loopback port, trust authentication, `fsync` off
/// ([`spawn_durable`](Self::spawn_durable): on, for tests of what reaches the disk).
///
/// When the tests run as root the server runs as the `postgres` user, since PostgreSQL
/// refuses to run as root.
pub struct PostgresServer {
    dir: tempfile::TempDir,
    port: Mutex<u16>,
    run_as: Option<(u32, u32)>,
    process: Process,
    durable: bool,
    clock: ServerClock,
}

impl PostgresServer {
    /// Initialises a cluster and starts it; waits until it accepts connections.
    pub fn spawn() -> PostgresServer {
        PostgresServer::spawn_with(false, ServerClock::Host)
    }

    /// A server whose wall clock (`now()`, `clock_timestamp()`) is `clock`, not the
    /// host's: see [`ServerClock`].
    pub fn spawn_on(clock: ServerClock) -> PostgresServer {
        PostgresServer::spawn_with(false, clock)
    }

    /// A server that writes to disk as a production one does (`fsync` and full page
    /// writes on), whose WAL writer waits 10 s between flushes: a commit that did not
    /// ask to wait for the disk is lost by a crash within that time, every time, so a
    /// test can tell a durable commit from a lucky one.
    pub fn spawn_durable() -> PostgresServer {
        PostgresServer::spawn_with(true, ServerClock::Host)
    }

    fn spawn_with(durable: bool, clock: ServerClock) -> PostgresServer {
        let dir = crate::server_dir("postgres");
        let run_as = if running_as_root() {
            Some(
                user_ids("postgres")
                    .expect("running as root needs a `postgres` user (install postgresql)"),
            )
        } else {
            None
        };
        if let Some((uid, gid)) = run_as {
            let path = std::ffi::CString::new(dir.path().as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: chown of a directory we just created.
            assert_eq!(
                unsafe { libc::chown(path.as_ptr(), uid, gid) },
                0,
                "cannot chown the data directory"
            );
        }
        let server = PostgresServer {
            dir,
            port: Mutex::new(0),
            run_as,
            process: Process::default(),
            durable,
            clock,
        };
        let log = File::create(server.log_path()).expect("cannot create the log");
        let mut initdb = Command::new(postgres_binary("initdb"));
        initdb
            .arg("-D")
            .arg(server.data_dir())
            .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        let status = spawn_tied_to_process_as(initdb, run_as)
            .expect("cannot run initdb")
            .wait()
            .expect("initdb did not finish");
        assert!(status.success(), "initdb failed:\n{}", server.log());
        server.start(None);
        server
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("postgres.log")
    }

    fn start(&self, port: Option<u16>) {
        for _ in 0..5 {
            let port = port.unwrap_or_else(free_port);
            let log = std::fs::OpenOptions::new()
                .append(true)
                .create(true)
                .open(self.log_path())
                .expect("cannot open the log");
            let mut command = Command::new(postgres_binary("postgres"));
            command
                .arg("-D")
                .arg(self.data_dir())
                .args(["-p", &port.to_string()])
                .arg("-k")
                .arg(self.dir.path())
                .args(["-c", "listen_addresses=127.0.0.1"])
                // synchronous_commit off as a server default on purpose: the engine must
                // ask for durable commits itself, and the crash test proves it does.
                .args(["-c", "synchronous_commit=off"]);
            if self.durable {
                command.args(["-c", "fsync=on", "-c", "full_page_writes=on"]);
                command.args(["-c", "wal_writer_delay=10000"]);
            } else {
                command.args(["-c", "fsync=off", "-c", "full_page_writes=off"]);
            }
            self.clock.apply(&mut command);
            command
                .args(["-c", "max_connections=200", "-c", "shared_buffers=32MB"])
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log);
            let log_from = crate::log_length(&self.log_path());
            let mut child =
                spawn_tied_to_process_as(command, self.run_as).expect("cannot start postgres");
            if wait_until_ready(
                &self.log_path(),
                log_from,
                "database system is ready to accept connections",
                Some(port),
                &mut child,
                Duration::from_secs(30),
            ) {
                *self.port.lock().unwrap() = port;
                self.process.set(child);
                return;
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("postgres did not start; its log:\n{}", self.log());
    }

    /// The server's process id while it runs (`None` after [`kill`](Self::kill)).
    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        *self.port.lock().unwrap()
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        self.url_for("postgres")
    }

    /// The URL of database `database` on this server.
    pub fn url_for(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port())
    }

    /// Runs SQL as `postgres` in `database` with `psql`; returns the rows, one per line
    /// with columns separated by `|`.
    pub fn sql(&self, database: &str, statements: &str) -> String {
        let output = Command::new(postgres_binary("psql"))
            .args(["-h", "127.0.0.1", "-p", &self.port().to_string()])
            .args(["-U", "postgres", "-d", database])
            .args(["-v", "ON_ERROR_STOP=1", "-X", "-A", "-t", "-q", "-c"])
            .arg(statements)
            .output()
            .expect("cannot run psql");
        assert!(
            output.status.success(),
            "SQL failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// Creates a fresh database and returns its URL (one per test keeps tests apart).
    pub fn fresh_database(&self, label: &str) -> String {
        let name = crate::unique_name(label).replace('-', "_").to_lowercase();
        self.sql("postgres", &format!("CREATE DATABASE {name}"));
        self.url_for(&name)
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        read_log(&self.log_path())
    }

    /// Kills the postmaster with SIGKILL: a crash. Backends exit when they notice.
    pub fn kill(&self) {
        self.process.kill();
    }

    /// Stops the server cleanly (fast shutdown) and starts it again on the same port,
    /// with its data.
    pub fn restart(&self) {
        self.process
            .stop_with(libc::SIGINT, Duration::from_secs(20));
        self.start(Some(self.port()));
    }

    /// Kills the server (a crash) and starts it again on the same port; it recovers its
    /// data from the write-ahead log.
    pub fn crash_and_restart(&self) {
        self.process.kill();
        // Backends of the killed postmaster may linger for a moment.
        std::thread::sleep(Duration::from_millis(300));
        self.start(Some(self.port()));
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        crate::show_log_if_panicking("postgres", &self.log_path());
        self.process
            .stop_with(libc::SIGQUIT, Duration::from_secs(5));
    }
}

/// One PostgreSQL server per test binary and clock, started on first use, gone with the
/// process: [`shared_postgres`] on a wall clock that is not the host's.
pub fn shared_postgres_on(clock: ServerClock) -> &'static PostgresServer {
    static AHEAD: OnceLock<PostgresServer> = OnceLock::new();
    static BEHIND: OnceLock<PostgresServer> = OnceLock::new();
    let shared = match clock {
        ServerClock::Host => return shared_postgres(),
        ServerClock::HourAhead => &AHEAD,
        ServerClock::HourBehind => &BEHIND,
    };
    shared.get_or_init(|| {
        let server = PostgresServer::spawn_on(clock);
        crate::show_log_on_panic("postgres", server.log_path());
        server
    })
}

/// One PostgreSQL server per test binary, started on first use, gone with the process.
pub fn shared_postgres() -> &'static PostgresServer {
    static SHARED: OnceLock<PostgresServer> = OnceLock::new();
    SHARED.get_or_init(|| {
        let server = PostgresServer::spawn();
        crate::show_log_on_panic("postgres", server.log_path());
        server
    })
}
