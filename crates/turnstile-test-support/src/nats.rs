//! `nats-server` with JetStream.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use crate::{Process, find_binary, free_port, read_log, spawn_tied_to_process, wait_until_ready};

/// A real `nats-server` with JetStream (file storage in its temporary directory) on a
/// free loopback port.
pub struct NatsServer {
    port: Mutex<u16>,
    dir: tempfile::TempDir,
    process: Process,
    jetstream: bool,
}

impl NatsServer {
    /// Starts a server and waits until it is ready.
    pub fn spawn() -> NatsServer {
        NatsServer::spawn_with(true)
    }

    /// Starts a server without JetStream (core NATS only): it answers PINGs and
    /// publishes, but no JetStream request.
    pub fn spawn_without_jetstream() -> NatsServer {
        NatsServer::spawn_with(false)
    }

    fn spawn_with(jetstream: bool) -> NatsServer {
        let server = NatsServer {
            port: Mutex::new(0),
            dir: crate::server_dir("nats"),
            process: Process::default(),
            jetstream,
        };
        server.start(None);
        server
    }

    fn start(&self, port: Option<u16>) {
        let binary = find_binary("nats-server", "nats-server", &["/usr/sbin"]);
        let mut last_log = String::new();
        for _ in 0..5 {
            let port = port.unwrap_or_else(free_port);
            let mut command = Command::new(&binary);
            command.args(["-a", "127.0.0.1", "-p", &port.to_string()]);
            if self.jetstream {
                command
                    .arg("-js")
                    .arg("-sd")
                    .arg(self.dir.path().join("jetstream"));
            }
            command
                .arg("-l")
                .arg(self.log_path())
                .args([
                    "--server_name",
                    &format!("turnstile-{}", std::process::id()),
                ])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let log_from = crate::log_length(&self.log_path());
            let mut child = spawn_tied_to_process(command).expect("cannot start nats-server");
            if wait_until_ready(
                &self.log_path(),
                log_from,
                "Server is ready",
                Some(port),
                &mut child,
                Duration::from_secs(10),
            ) {
                *self.port.lock().unwrap() = port;
                self.process.set(child);
                return;
            }
            let _ = child.kill();
            let _ = child.wait();
            last_log = self.log();
        }
        panic!("nats-server did not start; its log:\n{last_log}");
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        *self.port.lock().unwrap()
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port())
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("nats.log")
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        read_log(&self.log_path())
    }

    /// Stops the server (SIGTERM, a clean shutdown); its streams stay on disk.
    pub fn stop(&self) {
        self.process
            .stop_with(libc::SIGTERM, Duration::from_secs(5));
    }

    /// Starts it again on the same port with the same streams.
    pub fn start_again(&self) {
        self.start(Some(self.port()));
    }

    /// Kills the server with SIGKILL.
    pub fn kill(&self) {
        self.process.kill();
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

impl Drop for NatsServer {
    fn drop(&mut self) {
        crate::show_log_if_panicking("nats-server", &self.log_path());
        self.kill();
    }
}
