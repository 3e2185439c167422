//! A TCP proxy on loopback that a test can cut: a network partition on demand.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often blocked reads and the accept loop look at the stop flag.
const TICK: Duration = Duration::from_millis(10);

/// A TCP proxy from a free port on 127.0.0.1 to `127.0.0.1:target_port`, which a test
/// can [`cut`](Self::cut) (a partition: nothing passes, nothing is reset) and
/// [`heal`](Self::heal).
///
/// While cut, bytes already sent wait in the sockets and new connections are accepted
/// but not connected onwards, so clients see silence, as behind a partition where
/// packets vanish, not a refusal or a reset. After [`heal`](Self::heal) everything
/// held back is delivered, as TCP retransmission would once a partition ends.
/// [`close_connections`](Self::close_connections) closes every current connection
/// instead (both ends see the connection end).
///
/// Threads, sockets and connections all end when the proxy is dropped.
pub struct TcpProxy {
    shared: Arc<Shared>,
    port: u16,
    accept: Option<JoinHandle<()>>,
}

struct Shared {
    target_port: u16,
    gate: Mutex<Gate>,
    changed: Condvar,
    /// Writes being made right now; [`TcpProxy::cut`] waits for them to finish.
    writing: AtomicUsize,
    connections: Mutex<HashMap<u64, Connection>>,
    next_id: AtomicU64,
    threads: Mutex<Vec<JoinHandle<()>>>,
    accepted: AtomicUsize,
    to_target: AtomicU64,
    to_client: AtomicU64,
}

#[derive(Default)]
struct Gate {
    cut: bool,
    stopped: bool,
}

/// Both sockets of one proxied connection (the upstream one once connected).
struct Connection {
    client: TcpStream,
    upstream: Option<TcpStream>,
}

impl Shared {
    fn gate(&self) -> MutexGuard<'_, Gate> {
        self.gate.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn stopped(&self) -> bool {
        self.gate().stopped
    }

    /// Blocks while the proxy is cut; `false` once it is stopped.
    fn wait_open(&self) -> bool {
        let mut gate = self.gate();
        while gate.cut && !gate.stopped {
            gate = self.changed.wait(gate).unwrap_or_else(|p| p.into_inner());
        }
        !gate.stopped
    }

    /// Writes `bytes` to `to` unless the proxy is cut, in which case it waits for the
    /// heal first. `false` when the connection or the proxy is finished.
    fn forward(&self, to: &mut TcpStream, bytes: &[u8], counter: &AtomicU64) -> bool {
        loop {
            // Announce the write before looking at the gate, and `cut` sets the gate
            // before counting writes: either this write sees the cut, or the cut
            // waits for this write.
            self.writing.fetch_add(1, Ordering::SeqCst);
            if !self.gate().cut {
                // Counted first, so whoever sees the bytes' effect sees them counted.
                counter.fetch_add(bytes.len() as u64, Ordering::SeqCst);
                let written = to.write_all(bytes).is_ok();
                self.writing.fetch_sub(1, Ordering::SeqCst);
                return written;
            }
            self.writing.fetch_sub(1, Ordering::SeqCst);
            if !self.wait_open() {
                return false;
            }
        }
    }

    fn connections(&self) -> MutexGuard<'_, HashMap<u64, Connection>> {
        self.connections.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn spawn(self: &Arc<Self>, name: &str, work: impl FnOnce(Arc<Shared>) + Send + 'static) {
        let shared = Arc::clone(self);
        let handle = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || work(shared))
            .expect("cannot start a proxy thread");
        let mut threads = self.threads.lock().unwrap_or_else(|p| p.into_inner());
        threads.retain(|thread| !thread.is_finished());
        threads.push(handle);
    }
}

impl TcpProxy {
    /// Starts a proxy on a free loopback port to `127.0.0.1:target_port`.
    pub fn start(target_port: u16) -> TcpProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("cannot bind a loopback port");
        let port = listener.local_addr().expect("a bound listener").port();
        listener
            .set_nonblocking(true)
            .expect("cannot make the listener non-blocking");
        let shared = Arc::new(Shared {
            target_port,
            gate: Mutex::new(Gate::default()),
            changed: Condvar::new(),
            writing: AtomicUsize::new(0),
            connections: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            threads: Mutex::new(Vec::new()),
            accepted: AtomicUsize::new(0),
            to_target: AtomicU64::new(0),
            to_client: AtomicU64::new(0),
        });
        let accept = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("proxy-{port}-accept"))
                .spawn(move || accept_loop(&shared, &listener))
                .expect("cannot start the proxy's accept thread")
        };
        TcpProxy {
            shared,
            port,
            accept: Some(accept),
        }
    }

    /// The port the proxy listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The port it forwards to.
    pub fn target_port(&self) -> u16 {
        self.shared.target_port
    }

    /// `url` with its `127.0.0.1:TARGET` (or `localhost:TARGET`) replaced by
    /// `127.0.0.1:PORT` of this proxy, so a client of that URL goes through the proxy.
    ///
    /// # Panics
    /// If `url` does not name the target's port on loopback.
    pub fn url_for(&self, url: &str) -> String {
        let target = self.shared.target_port;
        for host in ["127.0.0.1", "localhost"] {
            let address = format!("{host}:{target}");
            if let Some(at) = url.find(&address) {
                let end = at + address.len();
                // Not a longer port that merely starts with the target's digits.
                if !url[end..].starts_with(|c: char| c.is_ascii_digit()) {
                    return format!("{}127.0.0.1:{}{}", &url[..at], self.port, &url[end..]);
                }
            }
        }
        panic!("{url} does not name 127.0.0.1:{target}, the proxy's target");
    }

    /// Partitions the network: from the moment this returns no byte passes in either
    /// direction and new connections get no further than the proxy. Nothing is closed
    /// or reset.
    pub fn cut(&self) {
        self.shared.gate().cut = true;
        // A write that started before the gate closed may still be under way.
        let until = Instant::now() + Duration::from_secs(5);
        while self.shared.writing.load(Ordering::SeqCst) != 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// Ends the partition: what was held back is delivered and new connections go
    /// through.
    pub fn heal(&self) {
        self.shared.gate().cut = false;
        self.shared.changed.notify_all();
    }

    /// Whether the proxy is cut.
    pub fn is_cut(&self) -> bool {
        self.shared.gate().cut
    }

    /// Closes every current connection, both the client's and the upstream side (new
    /// ones are still accepted).
    pub fn close_connections(&self) {
        let connections = std::mem::take(&mut *self.shared.connections());
        for connection in connections.into_values() {
            let _ = connection.client.shutdown(Shutdown::Both);
            if let Some(upstream) = connection.upstream {
                let _ = upstream.shutdown(Shutdown::Both);
            }
        }
    }

    /// How many connections the proxy has accepted so far.
    pub fn accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// How many bytes have been passed on to the target so far.
    pub fn bytes_to_target(&self) -> u64 {
        self.shared.to_target.load(Ordering::SeqCst)
    }

    /// How many bytes have been passed back to clients so far.
    pub fn bytes_to_client(&self) -> u64 {
        self.shared.to_client.load(Ordering::SeqCst)
    }

    /// The local addresses of the proxy's open connections to the target: how the
    /// target sees these clients (to find them in `CLIENT LIST`, `pg_stat_activity`, …).
    pub fn upstream_addresses(&self) -> Vec<SocketAddr> {
        self.shared
            .connections()
            .values()
            .filter_map(|connection| connection.upstream.as_ref()?.local_addr().ok())
            .collect()
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        {
            let mut gate = self.shared.gate();
            gate.stopped = true;
        }
        self.shared.changed.notify_all();
        self.close_connections();
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
        let threads = std::mem::take(
            &mut *self
                .shared
                .threads
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        for thread in threads {
            let _ = thread.join();
        }
        // Connections accepted while the threads were stopping.
        self.close_connections();
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
    while !shared.stopped() {
        match listener.accept() {
            Ok((client, _)) => {
                shared.accepted.fetch_add(1, Ordering::SeqCst);
                shared.spawn("proxy-connection", move |shared| serve(&shared, client));
            }
            Err(error) if error.kind() == ErrorKind::WouldBlock => std::thread::sleep(TICK),
            Err(_) => std::thread::sleep(TICK),
        }
    }
}

/// One connection: waits out a cut, connects onwards, and pumps both ways.
fn serve(shared: &Arc<Shared>, client: TcpStream) {
    let _ = client.set_nonblocking(false);
    let _ = client.set_nodelay(true);
    let Ok(client_copy) = client.try_clone() else {
        return;
    };
    let id = shared.next_id.fetch_add(1, Ordering::SeqCst);
    shared.connections().insert(
        id,
        Connection {
            client: client_copy,
            upstream: None,
        },
    );
    pass_on(shared, id, client);
    shared.connections().remove(&id);
}

fn pass_on(shared: &Arc<Shared>, id: u64, client: TcpStream) {
    // Behind a cut a new connection hangs here: accepted, never answered.
    if !shared.wait_open() {
        return;
    }
    let Ok(upstream) = TcpStream::connect(("127.0.0.1", shared.target_port)) else {
        // Nothing listens: the client sees its connection end.
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    let _ = upstream.set_nodelay(true);
    let (Ok(client_in), Ok(upstream_in), Ok(upstream_copy)) = (
        client.try_clone(),
        upstream.try_clone(),
        upstream.try_clone(),
    ) else {
        return;
    };
    match shared.connections().get_mut(&id) {
        Some(connection) => connection.upstream = Some(upstream_copy),
        // Closed meanwhile by `close_connections` or the drop.
        None => {
            let _ = client.shutdown(Shutdown::Both);
            let _ = upstream.shutdown(Shutdown::Both);
            return;
        }
    }
    shared.spawn("proxy-pump", move |shared| {
        pump(&shared, upstream_in, client, &shared.to_client);
    });
    pump(shared, client_in, upstream, &shared.to_target);
}

/// Copies `from` to `to` until either ends or the proxy stops, holding bytes back
/// while the proxy is cut; then closes both.
fn pump(shared: &Shared, mut from: TcpStream, mut to: TcpStream, counter: &AtomicU64) {
    let _ = from.set_read_timeout(Some(TICK));
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        // While cut, do not even read: bytes stay in the sockets until the heal.
        if !shared.wait_open() {
            break;
        }
        match from.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => {
                if !shared.forward(&mut to, &buffer[..n], counter) {
                    break;
                }
            }
            Err(error)
                if matches!(
                    error.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
