//! ZooKeeper servers (Debian `zookeeper`, run on the machine's Java) on free loopback
//! ports: standalone, or as an ensemble.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::{Process, free_port, read_log, spawn_tied_to_process};

/// Where Debian's `zookeeper` package puts the server's jar; its manifest names the
/// jars it needs.
const ZOOKEEPER_JAR: &str = "/usr/share/java/zookeeper.jar";

/// A logger for ZooKeeper's SLF4J calls, when installed (Debian `libslf4j-java`);
/// without it the server logs nothing.
const SLF4J_SIMPLE_JAR: &str = "/usr/share/java/slf4j-simple.jar";

const LOG_FILE: &str = "zookeeper.log";

/// A real ZooKeeper server with a short tick (100 ms), so sessions can be as short as
/// 200 ms and as long as two minutes: standalone ([`spawn`](Self::spawn)), or one
/// server of a [`ZooKeeperEnsemble`].
pub struct ZooKeeperServer {
    port: Mutex<u16>,
    dir: tempfile::TempDir,
    process: Process,
    /// For a server of an ensemble: the `server.N=…` lines of every server (its own id
    /// is in `data/myid`).
    ensemble: Option<String>,
}

impl ZooKeeperServer {
    /// Starts a standalone server and waits until it serves clients.
    pub fn spawn() -> ZooKeeperServer {
        let server = ZooKeeperServer::unstarted(None);
        server.start(None);
        server
    }

    fn unstarted(ensemble: Option<String>) -> ZooKeeperServer {
        let dir = crate::server_dir("zookeeper");
        std::fs::create_dir_all(dir.path().join("data")).expect("cannot make the data dir");
        ZooKeeperServer {
            port: Mutex::new(0),
            dir,
            process: Process::default(),
            ensemble,
        }
    }

    /// Starts the server on `port` (a free one if `None`) and waits until it serves,
    /// trying new ports if a chosen one turns out to be taken.
    fn start(&self, port: Option<u16>) {
        let mut last_log = String::new();
        for _ in 0..5 {
            let port = port.unwrap_or_else(free_port);
            let mut child = self.launch(port);
            if ready(&mut child, port, Duration::from_secs(60)) {
                *self.port.lock().unwrap() = port;
                self.process.set(child);
                return;
            }
            let _ = child.kill();
            let _ = child.wait();
            last_log = self.log();
        }
        panic!("ZooKeeper did not start; its log:\n{last_log}");
    }

    /// Starts the server's process on client port `port`, without waiting for it.
    fn launch(&self, port: u16) -> std::process::Child {
        assert!(
            Path::new(ZOOKEEPER_JAR).is_file(),
            "ZooKeeper is not installed; install the Debian package `zookeeper` \
             (the README's test command does this: ./scripts/test)"
        );
        let java = crate::find_binary("java", "default-jre", &[]);
        let mut config = format!(
            "tickTime=100\nminSessionTimeout=200\nmaxSessionTimeout=120000\n\
             dataDir={}\nclientPort={port}\nclientPortAddress=127.0.0.1\n\
             admin.enableServer=false\n4lw.commands.whitelist=ruok,srvr\n",
            self.dir.path().join("data").display()
        );
        let main_class = match &self.ensemble {
            Some(servers) => {
                config.push_str("initLimit=50\nsyncLimit=20\n");
                config.push_str(servers);
                "org.apache.zookeeper.server.quorum.QuorumPeerMain"
            }
            None => "org.apache.zookeeper.server.ZooKeeperServerMain",
        };
        let config_path = self.dir.path().join("zoo.cfg");
        std::fs::write(&config_path, config).expect("cannot write zoo.cfg");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("cannot open the ZooKeeper log");
        let mut classpath = ZOOKEEPER_JAR.to_owned();
        if Path::new(SLF4J_SIMPLE_JAR).is_file() {
            classpath = format!("{classpath}:{SLF4J_SIMPLE_JAR}");
        }
        let mut command = Command::new(&java);
        command
            .args(["-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1"])
            .arg("-cp")
            .arg(&classpath)
            .arg("-Dorg.slf4j.simpleLogger.defaultLogLevel=warn")
            .arg(main_class)
            .arg(&config_path)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().expect("cannot share the log")))
            .stderr(Stdio::from(log));
        spawn_tied_to_process(command).expect("cannot start ZooKeeper")
    }

    /// The client port.
    pub fn port(&self) -> u16 {
        *self.port.lock().unwrap()
    }

    /// `zk://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("zk://127.0.0.1:{}", self.port())
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join(LOG_FILE)
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        read_log(&self.log_path())
    }

    /// Kills the server with SIGKILL.
    pub fn kill(&self) {
        self.process.kill();
    }

    /// Starts a killed server again on the same port with the same data (a server of
    /// an ensemble serves again once it has rejoined a quorum).
    pub fn start_again(&self) {
        let port = self.port();
        self.kill();
        self.start(Some(port));
    }

    /// Whether this server leads its ensemble now.
    pub fn is_leader(&self) -> bool {
        four_letter(self.port(), "srvr").is_some_and(|answer| answer.contains("Mode: leader"))
    }
}

/// The server's answer to a four-letter command, if it answers.
fn four_letter(port: u16, command: &str) -> Option<String> {
    TcpStream::connect(("127.0.0.1", port))
        .and_then(|mut stream| {
            stream.set_read_timeout(Some(Duration::from_secs(1)))?;
            stream.write_all(command.as_bytes())?;
            let mut answer = String::new();
            stream.read_to_string(&mut answer)?;
            Ok(answer)
        })
        .ok()
}

/// Whether the server serves clients within `limit`: `srvr` reports its mode (a
/// server of an ensemble without a quorum answers that it is not serving).
fn ready(child: &mut std::process::Child, port: u16, limit: Duration) -> bool {
    let started = Instant::now();
    while started.elapsed() < limit {
        if let Ok(Some(_)) = child.try_wait() {
            return false;
        }
        if four_letter(port, "srvr").is_some_and(|answer| answer.contains("Mode: ")) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

impl Drop for ZooKeeperServer {
    fn drop(&mut self) {
        crate::show_log_if_panicking("ZooKeeper", &self.log_path());
        self.kill();
    }
}

/// One server for the whole test binary.
pub fn shared_zookeeper() -> &'static ZooKeeperServer {
    static SERVER: OnceLock<ZooKeeperServer> = OnceLock::new();
    SERVER.get_or_init(|| {
        let server = ZooKeeperServer::spawn();
        crate::show_log_on_panic("ZooKeeper", server.log_path());
        server
    })
}

/// A ZooKeeper ensemble of real servers on loopback, for tests that kill servers.
pub struct ZooKeeperEnsemble {
    servers: Vec<ZooKeeperServer>,
}

impl ZooKeeperEnsemble {
    /// Starts `size` servers together and waits until every one serves clients (a
    /// quorum elected a leader and each joined it).
    pub fn spawn(size: usize) -> ZooKeeperEnsemble {
        assert!(size >= 1, "an ensemble has at least one server");
        let mut last_log = String::new();
        // A port taken between choosing it and binding it stops a server: start the
        // whole ensemble again on new ports.
        for _ in 0..3 {
            match ZooKeeperEnsemble::try_spawn(size) {
                Ok(ensemble) => return ensemble,
                Err(log) => last_log = log,
            }
        }
        panic!("the ZooKeeper ensemble did not start; a server's log:\n{last_log}");
    }

    fn try_spawn(size: usize) -> Result<ZooKeeperEnsemble, String> {
        let mut ports: Vec<u16> = Vec::new();
        while ports.len() < 3 * size {
            let port = free_port();
            if !ports.contains(&port) {
                ports.push(port);
            }
        }
        // Per server: the client port, the quorum port, the election port.
        let servers_config: String = ports
            .chunks(3)
            .enumerate()
            .map(|(i, p)| format!("server.{}=127.0.0.1:{}:{}\n", i + 1, p[1], p[2]))
            .collect();
        let servers: Vec<ZooKeeperServer> = (0..size)
            .map(|i| {
                let server = ZooKeeperServer::unstarted(Some(servers_config.clone()));
                std::fs::write(server.dir.path().join("data/myid"), format!("{}\n", i + 1))
                    .expect("cannot write myid");
                server
            })
            .collect();
        // All at once: none serves before a quorum is up.
        let mut children: Vec<std::process::Child> = servers
            .iter()
            .zip(ports.chunks(3))
            .map(|(server, p)| server.launch(p[0]))
            .collect();
        for ((server, child), p) in servers.iter().zip(&mut children).zip(ports.chunks(3)) {
            if !ready(child, p[0], Duration::from_secs(60)) {
                for child in &mut children {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                return Err(server.log());
            }
        }
        for ((server, child), p) in servers.iter().zip(children).zip(ports.chunks(3)) {
            *server.port.lock().unwrap() = p[0];
            server.process.set(child);
        }
        Ok(ZooKeeperEnsemble { servers })
    }

    /// `zk://127.0.0.1:PORT,127.0.0.1:PORT,…`: every server.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .servers
            .iter()
            .map(|server| format!("127.0.0.1:{}", server.port()))
            .collect();
        format!("zk://{}", hosts.join(","))
    }

    /// The `index`th server.
    pub fn member(&self, index: usize) -> &ZooKeeperServer {
        &self.servers[index]
    }

    /// The index of the server that leads now, if one does.
    pub fn leader(&self) -> Option<usize> {
        self.servers.iter().position(ZooKeeperServer::is_leader)
    }
}
