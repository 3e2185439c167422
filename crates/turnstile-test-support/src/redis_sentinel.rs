//! Redis behind Sentinel: a master, a replica and three sentinels, each a real
//! `redis-server` on a free loopback port.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{Process, RedisServer, free_port, read_log, spawn_tied_to_process};

/// The master name the sentinels monitor.
pub const SENTINEL_MASTER: &str = "turnstile";

/// One sentinel process.
struct Sentinel {
    port: u16,
    dir: tempfile::TempDir,
    process: Process,
}

impl Sentinel {
    fn spawn(master_port: u16) -> Sentinel {
        let dir = crate::server_dir("sentinel");
        let binary = crate::find_binary("redis-server", "redis-server", &[]);
        let mut last_log = String::new();
        for _ in 0..5 {
            let port = free_port();
            let config = dir.path().join("sentinel.conf");
            std::fs::write(
                &config,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {}\nlogfile {}\n\
                     sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {master_port} 2\n\
                     sentinel down-after-milliseconds {SENTINEL_MASTER} 500\n\
                     sentinel failover-timeout {SENTINEL_MASTER} 2000\n\
                     sentinel parallel-syncs {SENTINEL_MASTER} 1\n",
                    dir.path().display(),
                    dir.path().join("sentinel.log").display()
                ),
            )
            .expect("cannot write sentinel.conf");
            let mut command = Command::new(&binary);
            command
                .arg(&config)
                .arg("--sentinel")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let mut child = spawn_tied_to_process(command).expect("cannot start redis sentinel");
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(10) {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                if redis_cli(
                    port,
                    &["sentinel", "get-master-addr-by-name", SENTINEL_MASTER],
                )
                .contains(&master_port.to_string())
                {
                    let process = Process::default();
                    process.set(child);
                    return Sentinel { port, dir, process };
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
            last_log = read_log(&dir.path().join("sentinel.log"));
        }
        panic!("redis sentinel did not start; its log:\n{last_log}");
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("sentinel.log")
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- sentinel log ---\n{}", read_log(&self.log_path()));
        }
        self.process.kill();
    }
}

fn redis_cli(port: u16, words: &[&str]) -> String {
    Command::new(crate::find_binary("redis-cli", "redis-tools", &[]))
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(words)
        .output()
        .map(|output| String::from_utf8_lossy(&output.stdout).into_owned())
        .unwrap_or_default()
}

/// A master, its replica and three sentinels (quorum two, a master counts as down after
/// 500 ms without an answer).
pub struct RedisSentinelGroup {
    servers: Vec<RedisServer>,
    sentinels: Vec<Sentinel>,
}

impl RedisSentinelGroup {
    /// Starts the group and waits until the replica is in sync and every sentinel
    /// knows both.
    pub fn spawn() -> RedisSentinelGroup {
        let master = RedisServer::spawn();
        let replica = RedisServer::spawn_with_args(&[
            "--replicaof",
            "127.0.0.1",
            &master.port().to_string(),
            "--repl-diskless-sync-delay",
            "0",
        ]);
        let started = Instant::now();
        while !redis_cli(replica.port(), &["info", "replication"]).contains("master_link_status:up")
        {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the replica did not sync within 30 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let sentinels: Vec<Sentinel> = (0..3).map(|_| Sentinel::spawn(master.port())).collect();
        let group = RedisSentinelGroup {
            servers: vec![master, replica],
            sentinels,
        };
        // Every sentinel has found the replica (it is what a failover promotes).
        let started = Instant::now();
        while !group.sentinels.iter().all(|sentinel| {
            redis_cli(sentinel.port, &["sentinel", "replicas", SENTINEL_MASTER])
                .contains(&group.servers[1].port().to_string())
        }) {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the sentinels did not find the replica within 30 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        group
    }

    /// `redis+sentinel://127.0.0.1:S1,…/turnstile`.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|sentinel| format!("127.0.0.1:{}", sentinel.port))
            .collect();
        format!("redis+sentinel://{}/{SENTINEL_MASTER}", hosts.join(","))
    }

    /// The port of the master the first answering sentinel names.
    pub fn master_port(&self) -> u16 {
        for sentinel in &self.sentinels {
            let answer = redis_cli(
                sentinel.port,
                &["sentinel", "get-master-addr-by-name", SENTINEL_MASTER],
            );
            if let Some(port) = answer
                .lines()
                .nth(1)
                .and_then(|line| line.trim().parse().ok())
            {
                return port;
            }
        }
        panic!("no sentinel names a master");
    }

    /// Kills the master and waits (up to `limit`) until the sentinels name the replica.
    pub fn fail_over(&self, limit: Duration) {
        let old = self.kill_master();
        self.wait_for_a_new_master(old, limit);
    }

    /// Kills the master and returns its port. The sentinels go on naming it until they
    /// agree that it is down (after 500 ms without an answer), and then promote the
    /// replica: see [`wait_for_a_new_master`](Self::wait_for_a_new_master).
    pub fn kill_master(&self) -> u16 {
        let old = self.master_port();
        self.servers
            .iter()
            .find(|server| server.port() == old)
            .expect("the master is one of the group's servers")
            .kill();
        old
    }

    /// Starts the group's server on `port` again (empty, as it was killed), and waits
    /// (up to `limit`) until the sentinels have made it a replica: until then it is a
    /// second, empty master that a client may still be sent to.
    pub fn start_again(&self, port: u16, limit: Duration) {
        self.servers
            .iter()
            .find(|server| server.port() == port)
            .expect("the port is one of the group's servers")
            .restart();
        let started = Instant::now();
        while !redis_cli(port, &["info", "replication"]).contains("role:slave") {
            assert!(
                started.elapsed() < limit,
                "the sentinels did not make the restarted server a replica within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits (up to `limit`) until the sentinels name a master other than the one on
    /// port `old`, and it takes writes.
    pub fn wait_for_a_new_master(&self, old: u16, limit: Duration) {
        let started = Instant::now();
        while self.master_port() == old {
            assert!(
                started.elapsed() < limit,
                "the sentinels did not promote the replica within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        // The promoted replica accepts writes.
        let new = self.master_port();
        while !redis_cli(new, &["info", "replication"]).contains("role:master") {
            assert!(
                started.elapsed() < limit,
                "the new master did not take writes"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
