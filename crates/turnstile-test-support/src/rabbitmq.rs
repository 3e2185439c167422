//! `rabbitmq-server`, run directly (not through the Debian wrapper, which switches user
//! and reads `/etc/rabbitmq`), with a private `epmd`, in its own directory.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::{Process, find_binary, free_port, read_log, spawn_tied_to_process, wait_until_ready};

/// A real RabbitMQ node on a free loopback port (user `guest`, vhost `/`).
pub struct RabbitMqServer {
    port: Mutex<u16>,
    epmd_port: u16,
    dist_port: u16,
    node: String,
    dir: tempfile::TempDir,
    epmd: Process,
    process: Process,
}

impl RabbitMqServer {
    /// Starts a node and waits until it is ready (a few seconds).
    pub fn spawn() -> RabbitMqServer {
        let dir = crate::server_dir("rabbitmq");
        for (file, text) in [
            ("rabbitmq.conf", ""),
            ("rabbitmq-env.conf", ""),
            ("enabled_plugins", "[]."),
        ] {
            std::fs::write(dir.path().join(file), text).expect("cannot write the RabbitMQ config");
        }
        let epmd_port = free_port();
        let epmd = Process::default();
        let mut command =
            Command::new(find_binary("epmd", "erlang-base", &["/usr/lib/erlang/bin"]));
        command
            .args(["-port", &epmd_port.to_string(), "-address", "127.0.0.1"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        epmd.set(spawn_tied_to_process(command).expect("cannot start epmd"));
        let started = std::time::Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", epmd_port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "epmd did not start"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        static NODES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let server = RabbitMqServer {
            port: Mutex::new(0),
            epmd_port,
            dist_port: free_port(),
            node: format!(
                "turnstile-{}-{}@localhost",
                std::process::id(),
                NODES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            ),
            dir,
            epmd,
            process: Process::default(),
        };
        server.start(None);
        server
    }

    fn start(&self, port: Option<u16>) {
        let binary = find_binary(
            "rabbitmq-server",
            "rabbitmq-server",
            &["/usr/lib/rabbitmq/bin"],
        );
        // The script itself, not the /usr/sbin wrapper.
        let binary = if binary.starts_with("/usr/sbin") {
            PathBuf::from("/usr/lib/rabbitmq/bin/rabbitmq-server")
        } else {
            binary
        };
        let dir = self.dir.path();
        let mut last_log = String::new();
        for _ in 0..3 {
            let port = port.unwrap_or_else(free_port);
            let mut command = Command::new(&binary);
            command
                .env_clear()
                .env("PATH", "/usr/bin:/bin:/usr/sbin:/sbin:/usr/lib/erlang/bin")
                .env("HOME", dir)
                .env("LANG", "C.UTF-8")
                .env("RABBITMQ_NODENAME", &self.node)
                .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
                .env("RABBITMQ_NODE_PORT", port.to_string())
                .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
                .env("RABBITMQ_CONFIG_FILE", dir.join("rabbitmq.conf"))
                .env("RABBITMQ_CONF_ENV_FILE", dir.join("rabbitmq-env.conf"))
                .env("RABBITMQ_ADVANCED_CONFIG_FILE", dir.join("advanced.config"))
                .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("enabled_plugins"))
                .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
                .env("RABBITMQ_LOG_BASE", dir.join("log"))
                .env("ERL_EPMD_PORT", self.epmd_port.to_string())
                .env("ERL_EPMD_ADDRESS", "127.0.0.1")
                // The script then execs the VM, so the started process is the node
                // itself and dies with the test process.
                .env("RABBITMQ_ALLOW_INPUT", "1")
                .env(
                    "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                    "-noinput -start_epmd false -kernel inet_dist_use_interface {127,0,0,1}",
                )
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let log_from = crate::log_length(&self.log_path());
            let mut child = spawn_tied_to_process(command).expect("cannot start rabbitmq-server");
            if wait_until_ready(
                &self.log_path(),
                log_from,
                "Server startup complete",
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
            last_log = self.log();
        }
        panic!("rabbitmq-server did not start; its log:\n{last_log}");
    }

    /// The AMQP port.
    pub fn port(&self) -> u16 {
        *self.port.lock().unwrap()
    }

    /// `amqp://guest:guest@127.0.0.1:PORT/%2f`.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port())
    }

    fn log_path(&self) -> PathBuf {
        self.dir
            .path()
            .join("log")
            .join(format!("{}.log", self.node))
    }

    /// The node's log so far.
    pub fn log(&self) -> String {
        read_log(&self.log_path())
    }

    /// Stops the node (SIGTERM, a clean shutdown); durable queues and persistent
    /// messages stay on disk.
    pub fn stop(&self) {
        self.process
            .stop_with(libc::SIGTERM, Duration::from_secs(20));
    }

    /// Starts it again on the same port with the same data.
    pub fn start_again(&self) {
        self.start(Some(self.port()));
    }

    /// Kills the node with SIGKILL.
    pub fn kill(&self) {
        self.process.kill();
    }
}

impl Drop for RabbitMqServer {
    fn drop(&mut self) {
        crate::show_log_if_panicking("rabbitmq", &self.log_path());
        self.kill();
        self.epmd.kill();
    }
}

/// One node for the whole test binary (starting one takes seconds).
pub fn shared_rabbitmq() -> &'static RabbitMqServer {
    static SERVER: OnceLock<RabbitMqServer> = OnceLock::new();
    SERVER.get_or_init(RabbitMqServer::spawn)
}
