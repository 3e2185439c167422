//! A local Redis Cluster: three masters and three replicas, each a real `redis-server`
//! on a free loopback port, joined with `redis-cli --cluster create`.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::RedisServer;

/// A Redis Cluster of six nodes (three masters, one replica each), with a short node
/// timeout (1 s) so that a failover happens within seconds.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

/// Runs `redis-cli -p PORT WORDS…` and returns its output.
fn redis_cli(port: u16, words: &[&str]) -> String {
    let output = Command::new(crate::find_binary("redis-cli", "redis-tools", &[]))
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(words)
        .output()
        .expect("cannot run redis-cli");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

impl RedisCluster {
    /// Starts six nodes, creates the cluster and waits until every node reports it ok.
    pub fn spawn() -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..6)
            .map(|_| {
                RedisServer::spawn_with_args(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "1000",
                    // A replica may take over whatever its data's age, and a master
                    // syncs a new replica at once (not after the default 5 s wait).
                    "--cluster-replica-validity-factor",
                    "0",
                    "--repl-diskless-sync-delay",
                    "0",
                ])
            })
            .collect();
        let addresses: Vec<String> = nodes
            .iter()
            .map(|node| format!("127.0.0.1:{}", node.port()))
            .collect();
        let output = Command::new(crate::find_binary("redis-cli", "redis-tools", &[]))
            .arg("--cluster")
            .arg("create")
            .args(&addresses)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("cannot run redis-cli --cluster create");
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let cluster = RedisCluster { nodes };
        cluster.wait_until_ok(Duration::from_secs(30));
        // Every replica in sync with its master, so that a failover has data to keep.
        let started = Instant::now();
        while !cluster.nodes.iter().all(|node| {
            let info = redis_cli(node.port(), &["info", "replication"]);
            info.contains("role:master") || info.contains("master_link_status:up")
        }) {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the replicas did not sync with their masters within 30 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        cluster
    }

    /// Waits until every running node says `cluster_state:ok` and knows three masters.
    pub fn wait_until_ok(&self, limit: Duration) {
        let started = Instant::now();
        loop {
            let ok = self
                .nodes
                .iter()
                .filter(|node| node.pid().is_some())
                .all(|node| {
                    redis_cli(node.port(), &["cluster", "info"]).contains("cluster_state:ok")
                        && redis_cli(node.port(), &["cluster", "nodes"])
                            .lines()
                            .filter(|line| line.contains("master") && !line.contains("fail"))
                            .count()
                            == 3
                });
            if ok {
                return;
            }
            assert!(
                started.elapsed() < limit,
                "the Redis cluster was not ok within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `redis+cluster://127.0.0.1:P1,…` naming every node.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|node| format!("127.0.0.1:{}", node.port()))
            .collect();
        format!("redis+cluster://{}", hosts.join(","))
    }

    /// Kills the master serving `key` and waits (up to `limit`) until its replica has
    /// taken over: another running node serves the key's slot and every running node
    /// says the cluster is ok.
    pub fn fail_over(&self, key: &str, limit: Duration) {
        let old = self.master_of(key).port();
        self.master_of(key).kill();
        self.wait_for_new_master(key, old, limit);
    }

    /// Waits (up to `limit`) until a node other than the one on `old_port` serves
    /// `key`'s slot and the cluster is ok.
    pub fn wait_for_new_master(&self, key: &str, old: u16, limit: Duration) {
        let started = Instant::now();
        loop {
            let moved = self
                .try_master_of(key)
                .is_some_and(|node| node.port() != old);
            if moved {
                self.wait_until_ok(limit.saturating_sub(started.elapsed()));
                return;
            }
            assert!(
                started.elapsed() < limit,
                "no replica took over {key}'s slot within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The node serving `key` as master now.
    pub fn master_of(&self, key: &str) -> &RedisServer {
        self.try_master_of(key)
            .unwrap_or_else(|| panic!("no running master serves {key}"))
    }

    fn try_master_of(&self, key: &str) -> Option<&RedisServer> {
        let running = self.nodes.iter().find(|node| node.pid().is_some())?;
        let slot: u16 = redis_cli(running.port(), &["cluster", "keyslot", key])
            .trim()
            .parse()
            .ok()?;
        for node in self.nodes.iter().filter(|node| node.pid().is_some()) {
            let info = redis_cli(node.port(), &["cluster", "nodes"]);
            for line in info.lines().filter(|line| line.contains("myself")) {
                if !line.contains("master") {
                    continue;
                }
                let serves = line.split_whitespace().skip(8).any(|range| {
                    let (low, high) = range.split_once('-').unwrap_or((range, range));
                    match (low.parse::<u16>(), high.parse::<u16>()) {
                        (Ok(low), Ok(high)) => (low..=high).contains(&slot),
                        _ => false,
                    }
                });
                if serves {
                    return Some(node);
                }
            }
        }
        None
    }

    /// Moves `key`'s slot to another master with `redis-cli --cluster reshard` (keys
    /// included), and returns the port of the master that serves it afterwards. The
    /// slot must be the first one of its master's range (reshard moves slots from the
    /// start of the range).
    pub fn move_slot_of(&self, key: &str) -> u16 {
        let from = self.master_of(key);
        let id_of = |node: &RedisServer| {
            redis_cli(node.port(), &["cluster", "myid"])
                .trim()
                .to_owned()
        };
        let to = self
            .nodes
            .iter()
            .filter(|node| node.pid().is_some() && node.port() != from.port())
            .find(|node| redis_cli(node.port(), &["info", "replication"]).contains("role:master"))
            .expect("another master");
        let output = Command::new(crate::find_binary("redis-cli", "redis-tools", &[]))
            .args([
                "--cluster",
                "reshard",
                &format!("127.0.0.1:{}", from.port()),
            ])
            .args(["--cluster-from", &id_of(from), "--cluster-to", &id_of(to)])
            .args(["--cluster-slots", "1", "--cluster-yes"])
            .output()
            .expect("cannot run redis-cli --cluster reshard");
        assert!(
            output.status.success(),
            "redis-cli --cluster reshard failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        self.wait_until_ok(Duration::from_secs(30));
        let now = self.master_of(key).port();
        assert_eq!(now, to.port(), "the slot of {key} did not move");
        now
    }

    /// Every node.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }
}
