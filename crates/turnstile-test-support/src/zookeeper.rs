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
        assert!(
            Path::new(ZOOKEEPER_JAR).is_file(),
            "ZooKeeper is not installed; install the Debian package `zookeeper` \
             (the README's test command does this: ./scripts/test)"
        );
        let java = crate::find_binary("java", "default-jre", &[]);
        let mut last_log = String::new();
        for _ in 0..5 {
            let port = port.unwrap_or_else(free_port);
            let config = self.dir.path().join("zoo.cfg");
            std::fs::create_dir_all(self.dir.path().join("data"))
                .expect("cannot make the data dir");
            std::fs::write(
                &config,
                format!(
                    "tickTime=100\nminSessionTimeout=200\nmaxSessionTimeout=120000\n\
                     dataDir={}\nclientPort={port}\nclientPortAddress=127.0.0.1\n\
                     admin.enableServer=false\n4lw.commands.whitelist=ruok\n",
                    self.dir.path().join("data").display()
                ),
            )
            .expect("cannot write zoo.cfg");
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
                .arg("org.apache.zookeeper.server.ZooKeeperServerMain")
                .arg(&config)
                .stdin(Stdio::null())
                .stdout(Stdio::from(log.try_clone().expect("cannot share the log")))
                .stderr(Stdio::from(log));
            let mut child = spawn_tied_to_process(command).expect("cannot start ZooKeeper");
            if ready(&mut child, port, Duration::from_secs(30)) {
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

    /// The client port.
    pub fn port(&self) -> u16 {
        *self.port.lock().unwrap()
    }

    /// `zk://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("zk://127.0.0.1:{}", self.port())
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("zookeeper.log")
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

/// Whether the server answers ZooKeeper's `ruok` with `imok` within `limit`.
fn ready(child: &mut std::process::Child, port: u16, limit: Duration) -> bool {
    let started = Instant::now();
    while started.elapsed() < limit {
        if let Ok(Some(_)) = child.try_wait() {
            return false;
        }
        let answer = TcpStream::connect(("127.0.0.1", port)).and_then(|mut stream| {
            stream.set_read_timeout(Some(Duration::from_secs(1)))?;
            stream.write_all(b"ruok")?;
            let mut answer = String::new();
            stream.read_to_string(&mut answer)?;
            Ok(answer)
        });
        if answer.is_ok_and(|answer| answer == "imok") {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
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
