//! `etcd`, a single member on free loopback ports.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::{Process, find_binary, free_port, read_log, spawn_tied_to_process, wait_until_ready};

/// A real single-member etcd cluster, with a short heartbeat (10 ms) and election
/// timeout (100 ms) so that short leases are honoured.
pub struct EtcdServer {
    ports: Mutex<(u16, u16)>,
    dir: tempfile::TempDir,
    /// The data directory, in memory where the machine has `/dev/shm`: every etcd write
    /// is an fsync, which the tests do not need to pay for.
    data: tempfile::TempDir,
    process: Process,
}

impl EtcdServer {
    /// Starts a member and waits until it serves clients.
    pub fn spawn() -> EtcdServer {
        let shm = std::path::Path::new("/dev/shm");
        let data = if shm.is_dir() {
            tempfile::Builder::new()
                .prefix("turnstile-etcd-data-")
                .tempdir_in(shm)
                .expect("cannot make a directory in /dev/shm")
        } else {
            crate::server_dir("etcd-data")
        };
        let server = EtcdServer {
            ports: Mutex::new((0, 0)),
            dir: crate::server_dir("etcd"),
            data,
            process: Process::default(),
        };
        server.start(None);
        server
    }

    fn start(&self, ports: Option<(u16, u16)>) {
        let binary = find_binary("etcd", "etcd-server", &[]);
        let mut last_log = String::new();
        for _ in 0..5 {
            let (client, peer) = ports.unwrap_or_else(|| (free_port(), free_port()));
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.log_path())
                .expect("cannot open the etcd log");
            let mut command = Command::new(&binary);
            command
                .args(["--name", "turnstile"])
                .arg("--data-dir")
                .arg(self.data.path().join("member"))
                .args([
                    "--listen-client-urls",
                    &format!("http://127.0.0.1:{client}"),
                ])
                .args([
                    "--advertise-client-urls",
                    &format!("http://127.0.0.1:{client}"),
                ])
                .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
                .args([
                    "--initial-advertise-peer-urls",
                    &format!("http://127.0.0.1:{peer}"),
                ])
                .args([
                    "--initial-cluster",
                    &format!("turnstile=http://127.0.0.1:{peer}"),
                ])
                .args(["--heartbeat-interval", "10", "--election-timeout", "100"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::from(log));
            let log_from = crate::log_length(&self.log_path());
            let mut child = spawn_tied_to_process(command).expect("cannot start etcd");
            if wait_until_ready(
                &self.log_path(),
                log_from,
                "ready to serve client requests",
                Some(client),
                &mut child,
                Duration::from_secs(20),
            ) {
                *self.ports.lock().unwrap() = (client, peer);
                self.process.set(child);
                return;
            }
            let _ = child.kill();
            let _ = child.wait();
            last_log = self.log();
        }
        panic!("etcd did not start; its log:\n{last_log}");
    }

    /// The client port.
    pub fn port(&self) -> u16 {
        self.ports.lock().unwrap().0
    }

    /// `etcd://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("etcd://127.0.0.1:{}", self.port())
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    /// The member's log so far.
    pub fn log(&self) -> String {
        read_log(&self.log_path())
    }

    /// Kills the member with SIGKILL.
    pub fn kill(&self) {
        self.process.kill();
    }

    /// Kills it and starts it again on the same ports with the same data.
    pub fn restart(&self) {
        let ports = *self.ports.lock().unwrap();
        self.kill();
        self.start(Some(ports));
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- etcd log ({}) ---\n{}",
                self.dir.path().display(),
                self.log()
            );
        }
        self.kill();
    }
}

/// One member for the whole test binary.
pub fn shared_etcd() -> &'static EtcdServer {
    static SERVER: OnceLock<EtcdServer> = OnceLock::new();
    SERVER.get_or_init(EtcdServer::spawn)
}
