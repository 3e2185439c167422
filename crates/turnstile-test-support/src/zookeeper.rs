//! A standalone ZooKeeper server (Debian `zookeeper`, run on the machine's Java) on a
//! free loopback port.

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

/// A real ZooKeeper server, standalone, with a short tick (100 ms), so sessions can be
/// as short as 200 ms and as long as two minutes.
pub struct ZooKeeperServer {
    port: Mutex<u16>,
    dir: tempfile::TempDir,
    process: Process,
}

impl ZooKeeperServer {
    /// Starts a server and waits until it answers `ruok`.
    pub fn spawn() -> ZooKeeperServer {
        let server = ZooKeeperServer {
            port: Mutex::new(0),
            dir: crate::server_dir("zookeeper"),
            process: Process::default(),
        };
        server.start(None);
        server
    }

    fn start(&self, port: Option<u16>) {
        let mut last_log = String::new();
        for _ in 0..5 {
            let port = port.unwrap_or_else(free_port);
            let config = format!(
                "tickTime=100\nminSessionTimeout=200\nmaxSessionTimeout=120000\n\
                 dataDir={}\nclientPort={port}\nclientPortAddress=127.0.0.1\n\
                 admin.enableServer=false\n4lw.commands.whitelist=ruok,srvr\n",
                self.dir.path().join("data").display()
            );
            let mut child = launch(
                self.dir.path(),
                &config,
                "org.apache.zookeeper.server.ZooKeeperServerMain",
            );
            if ready(&mut child, port, Duration::from_secs(30)) {
                *self.port.lock().unwrap() = port;
                self.process.set(child);
                return;
            }
            let _ = child.kill();
            let _ = child.wait();
            last_log = read_log(&self.dir.path().join(LOG_FILE));
        }
        panic!("ZooKeeper did not start; its log:\n{last_log}");
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

    /// Starts a killed server again on the same port with the same data.
    pub fn start_again(&self) {
        let port = self.port();
        self.kill();
        self.start(Some(port));
    }
}

const LOG_FILE: &str = "zookeeper.log";

/// Starts a ZooKeeper server (`main_class`) in `dir` with `config` as its `zoo.cfg`,
/// logging to `dir/zookeeper.log`.
fn launch(dir: &Path, config: &str, main_class: &str) -> std::process::Child {
    assert!(
        Path::new(ZOOKEEPER_JAR).is_file(),
        "ZooKeeper is not installed; install the Debian package `zookeeper` \
         (the README's test command does this: ./scripts/test)"
    );
    let java = crate::find_binary("java", "default-jre", &[]);
    std::fs::create_dir_all(dir.join("data")).expect("cannot make the data dir");
    let config_path = dir.join("zoo.cfg");
    std::fs::write(&config_path, config).expect("cannot write zoo.cfg");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(LOG_FILE))
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
/// member of an ensemble without a quorum answers that it is not serving).
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

/// A ZooKeeper ensemble of real servers on loopback (tick 100 ms, as the standalone
/// server), for tests that kill members.
pub struct ZooKeeperEnsemble {
    members: Vec<EnsembleMember>,
}

/// One server of a [`ZooKeeperEnsemble`].
pub struct EnsembleMember {
    client_port: u16,
    config: String,
    dir: tempfile::TempDir,
    process: Process,
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
        let servers: String = ports
            .chunks(3)
            .enumerate()
            .map(|(i, p)| format!("server.{}=127.0.0.1:{}:{}\n", i + 1, p[1], p[2]))
            .collect();
        let mut members = Vec::new();
        let mut children = Vec::new();
        for (i, p) in ports.chunks(3).enumerate() {
            let dir = crate::server_dir("zookeeper");
            std::fs::create_dir_all(dir.path().join("data")).expect("cannot make the data dir");
            std::fs::write(dir.path().join("data/myid"), format!("{}\n", i + 1))
                .expect("cannot write myid");
            let config = format!(
                "tickTime=100\ninitLimit=50\nsyncLimit=20\nminSessionTimeout=200\n\
                 maxSessionTimeout=120000\ndataDir={}\nclientPort={}\n\
                 clientPortAddress=127.0.0.1\nadmin.enableServer=false\n\
                 4lw.commands.whitelist=ruok,srvr\n{servers}",
                dir.path().join("data").display(),
                p[0]
            );
            children.push(launch(
                dir.path(),
                &config,
                "org.apache.zookeeper.server.quorum.QuorumPeerMain",
            ));
            members.push(EnsembleMember {
                client_port: p[0],
                config,
                dir,
                process: Process::default(),
            });
        }
        for (member, child) in members.iter().zip(&mut children) {
            if !ready(child, member.client_port, Duration::from_secs(60)) {
                for child in &mut children {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                return Err(member.log());
            }
        }
        for (member, child) in members.iter().zip(children) {
            member.process.set(child);
        }
        Ok(ZooKeeperEnsemble { members })
    }

    /// `zk://127.0.0.1:PORT,127.0.0.1:PORT,…`: every server.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .members
            .iter()
            .map(|member| format!("127.0.0.1:{}", member.client_port))
            .collect();
        format!("zk://{}", hosts.join(","))
    }

    /// The `index`th server.
    pub fn member(&self, index: usize) -> &EnsembleMember {
        &self.members[index]
    }

    /// The index of the server that leads now, if one does.
    pub fn leader(&self) -> Option<usize> {
        self.members.iter().position(EnsembleMember::is_leader)
    }
}

impl EnsembleMember {
    /// Kills the server with SIGKILL.
    pub fn kill(&self) {
        self.process.kill();
    }

    /// Starts a killed server again with its data and ports, and waits until it
    /// serves (which needs a quorum).
    pub fn start_again(&self) {
        self.kill();
        let mut child = launch(
            self.dir.path(),
            &self.config,
            "org.apache.zookeeper.server.quorum.QuorumPeerMain",
        );
        assert!(
            ready(&mut child, self.client_port, Duration::from_secs(60)),
            "a restarted ZooKeeper server did not rejoin; its log:\n{}",
            self.log()
        );
        self.process.set(child);
    }

    /// Whether this server is the ensemble's leader now.
    pub fn is_leader(&self) -> bool {
        four_letter(self.client_port, "srvr").is_some_and(|answer| answer.contains("Mode: leader"))
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        read_log(&self.dir.path().join(LOG_FILE))
    }
}

impl Drop for EnsembleMember {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- ZooKeeper ensemble server log ({}) ---\n{}",
                self.dir.path().display(),
                self.log()
            );
        }
        self.kill();
    }
}

impl Drop for ZooKeeperServer {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- ZooKeeper log ({}) ---\n{}",
                self.dir.path().display(),
                self.log()
            );
        }
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
