//! `etcd` on free loopback ports: a single member, or a cluster of several.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::{Process, find_binary, free_port, read_log, spawn_tied_to_process, wait_until_ready};

/// The data directory of a member, in memory where the machine has `/dev/shm`: every
/// etcd write is an fsync, which the tests do not need to pay for.
fn data_dir() -> tempfile::TempDir {
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir() {
        tempfile::Builder::new()
            .prefix("turnstile-etcd-data-")
            .tempdir_in(shm)
            .expect("cannot make a directory in /dev/shm")
    } else {
        crate::server_dir("etcd-data")
    }
}

/// A real etcd member: alone (a single-member cluster), or one of an [`EtcdCluster`].
/// Alone it runs with a short heartbeat (10 ms) and election timeout (100 ms) so that
/// short leases are honoured; in a cluster with 50 ms and 500 ms, so that a loaded
/// machine does not make the members call elections all the time.
pub struct EtcdServer {
    /// The member's name, and the `--initial-cluster` it starts with.
    name: String,
    initial_cluster: Option<String>,
    ports: Mutex<(u16, u16)>,
    dir: tempfile::TempDir,
    /// The data directory (see [`data_dir`]).
    data: tempfile::TempDir,
    process: Process,
}

impl EtcdServer {
    /// Starts a member and waits until it serves clients.
    pub fn spawn() -> EtcdServer {
        let data = data_dir();
        let server = EtcdServer::unstarted("turnstile".to_owned(), None, data);
        server.start(None);
        server
    }

    fn unstarted(name: String, initial_cluster: Option<String>, data: tempfile::TempDir) -> Self {
        EtcdServer {
            name,
            initial_cluster,
            ports: Mutex::new((0, 0)),
            dir: crate::server_dir("etcd"),
            data,
            process: Process::default(),
        }
    }

    fn start(&self, ports: Option<(u16, u16)>) {
        let mut last_log = String::new();
        for _ in 0..5 {
            let (client, peer) = ports.unwrap_or_else(|| (free_port(), free_port()));
            let (mut child, log_from) = self.launch(client, peer);
            if self.ready(&mut child, log_from, client) {
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

    /// Starts the process, and returns it with where its log stood.
    fn launch(&self, client: u16, peer: u16) -> (std::process::Child, usize) {
        let binary = find_binary("etcd", "etcd-server", &[]);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("cannot open the etcd log");
        let initial_cluster = self
            .initial_cluster
            .clone()
            .unwrap_or_else(|| format!("{}=http://127.0.0.1:{peer}", self.name));
        let mut command = Command::new(&binary);
        command
            .args(["--name", &self.name])
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
            .args(["--initial-cluster", &initial_cluster])
            .args(if self.initial_cluster.is_some() {
                ["--heartbeat-interval", "50", "--election-timeout", "500"]
            } else {
                ["--heartbeat-interval", "10", "--election-timeout", "100"]
            })
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        let log_from = crate::log_length(&self.log_path());
        let child = spawn_tied_to_process(command).expect("cannot start etcd");
        (child, log_from)
    }

    /// Waits until the member serves clients (in a cluster: once there is a leader).
    fn ready(&self, child: &mut std::process::Child, log_from: usize, client: u16) -> bool {
        wait_until_ready(
            &self.log_path(),
            log_from,
            "ready to serve client requests",
            Some(client),
            child,
            Duration::from_secs(20),
        )
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
        crate::show_log_if_panicking("etcd", &self.log_path());
        self.kill();
    }
}

/// One member for the whole test binary.
pub fn shared_etcd() -> &'static EtcdServer {
    static SERVER: OnceLock<EtcdServer> = OnceLock::new();
    SERVER.get_or_init(EtcdServer::spawn)
}

/// A cluster of etcd members on one machine, for tests that kill members.
pub struct EtcdCluster {
    members: Vec<EtcdServer>,
}

impl EtcdCluster {
    /// Starts `size` members together (each is ready once a quorum has elected a
    /// leader) and waits until all serve clients.
    pub fn spawn(size: usize) -> EtcdCluster {
        assert!(size >= 1, "a cluster has at least one member");
        let mut last_log = String::new();
        // A port taken between choosing it and binding it makes a member exit: start the
        // whole cluster again on new ports.
        for _ in 0..4 {
            match EtcdCluster::try_spawn(size) {
                Ok(cluster) => return cluster,
                Err(log) => last_log = log,
            }
        }
        panic!("the etcd cluster did not start; the log of a member that did not:\n{last_log}");
    }

    fn try_spawn(size: usize) -> Result<EtcdCluster, String> {
        let mut ports: Vec<u16> = Vec::new();
        while ports.len() < 2 * size {
            let port = free_port();
            if !ports.contains(&port) {
                ports.push(port);
            }
        }
        let ports: Vec<(u16, u16)> = ports.chunks(2).map(|pair| (pair[0], pair[1])).collect();
        let initial_cluster = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let members: Vec<EtcdServer> = (0..size)
            .map(|i| {
                EtcdServer::unstarted(format!("m{i}"), Some(initial_cluster.clone()), data_dir())
            })
            .collect();
        let mut children: Vec<(std::process::Child, usize)> = members
            .iter()
            .zip(&ports)
            .map(|(member, (client, peer))| member.launch(*client, *peer))
            .collect();
        for ((member, (child, log_from)), (client, peer)) in
            members.iter().zip(children.iter_mut()).zip(&ports)
        {
            if !member.ready(child, *log_from, *client) {
                for (child, _) in &mut children {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                return Err(member.log());
            }
            *member.ports.lock().unwrap() = (*client, *peer);
        }
        for (member, (child, _)) in members.iter().zip(children) {
            member.process.set(child);
        }
        Ok(EtcdCluster { members })
    }

    /// `etcd://127.0.0.1:P1,127.0.0.1:P2,…`, every member.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .members
            .iter()
            .map(|member| format!("127.0.0.1:{}", member.port()))
            .collect();
        format!("etcd://{}", hosts.join(","))
    }

    /// Member `index`.
    pub fn member(&self, index: usize) -> &EtcdServer {
        &self.members[index]
    }
}
