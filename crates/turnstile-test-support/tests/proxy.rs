//! The cuttable TCP proxy forwards, blackholes when cut, delivers after a heal, and
//! stops with its handle.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use turnstile_test_support::{ClosedPort, TcpProxy};

/// An echo server on a free loopback port, one thread per connection.
fn echo_server() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            std::thread::spawn(move || {
                let mut buffer = [0u8; 1024];
                while let Ok(n) = stream.read(&mut buffer) {
                    if n == 0 || stream.write_all(&buffer[..n]).is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

fn connect(proxy: &TcpProxy) -> TcpStream {
    let stream = TcpStream::connect(("127.0.0.1", proxy.port())).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    stream
}

fn echo(stream: &mut TcpStream, message: &[u8]) -> std::io::Result<Vec<u8>> {
    stream.write_all(message)?;
    let mut reply = vec![0u8; message.len()];
    stream.read_exact(&mut reply)?;
    Ok(reply)
}

fn is_silence(error: &std::io::Error) -> bool {
    matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

#[test]
fn forwards_blackholes_when_cut_and_delivers_after_the_heal() {
    let proxy = TcpProxy::start(echo_server());
    let mut stream = connect(&proxy);
    assert_eq!(echo(&mut stream, b"one").unwrap(), b"one");
    assert_eq!(proxy.accepted(), 1);
    assert_eq!(proxy.bytes_to_target(), 3);
    assert_eq!(proxy.bytes_to_client(), 3);
    assert_eq!(proxy.upstream_addresses().len(), 1);

    proxy.cut();
    assert!(proxy.is_cut());
    // Silence, not a reset: the write succeeds, no reply comes.
    let error = echo(&mut stream, b"two").unwrap_err();
    assert!(is_silence(&error), "{error:?}");
    assert_eq!(proxy.bytes_to_target(), 3, "bytes passed a cut proxy");
    // A new connection is accepted but gets nowhere.
    let mut late = connect(&proxy);
    let error = echo(&mut late, b"new").unwrap_err();
    assert!(is_silence(&error), "{error:?}");

    proxy.heal();
    // What was held back arrives, in order, on both connections.
    let mut reply = [0u8; 3];
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    stream.read_exact(&mut reply).unwrap();
    assert_eq!(&reply, b"two");
    late.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    late.read_exact(&mut reply).unwrap();
    assert_eq!(&reply, b"new");
    assert_eq!(echo(&mut stream, b"three").unwrap(), b"three");
}

#[test]
fn url_for_points_a_url_at_the_proxy() {
    let proxy = TcpProxy::start(6379);
    let port = proxy.port();
    assert_eq!(
        proxy.url_for("redis://127.0.0.1:6379"),
        format!("redis://127.0.0.1:{port}")
    );
    assert_eq!(
        proxy.url_for("postgres://postgres@127.0.0.1:6379/db?x=1"),
        format!("postgres://postgres@127.0.0.1:{port}/db?x=1")
    );
    let wrong = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        proxy.url_for("redis://127.0.0.1:63790")
    }));
    assert!(wrong.is_err(), "a longer port is not the target's");
}

#[test]
fn closing_connections_ends_them_and_new_ones_still_work() {
    let proxy = TcpProxy::start(echo_server());
    let mut stream = connect(&proxy);
    assert_eq!(echo(&mut stream, b"a").unwrap(), b"a");
    proxy.close_connections();
    let mut buffer = [0u8; 1];
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    assert!(matches!(stream.read(&mut buffer), Ok(0) | Err(_)));
    let mut fresh = connect(&proxy);
    assert_eq!(echo(&mut fresh, b"b").unwrap(), b"b");
}

#[test]
fn a_dropped_proxy_closes_its_port_and_its_connections() {
    // Dropping must end every thread, even with a connection held behind a cut.
    let proxy = TcpProxy::start(echo_server());
    let mut stream = connect(&proxy);
    assert_eq!(echo(&mut stream, b"x").unwrap(), b"x");
    proxy.cut();
    let _parked = connect(&proxy);
    let started = Instant::now();
    drop(proxy);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the drop took {:?}",
        started.elapsed()
    );
    let mut buffer = [0u8; 1];
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    assert!(matches!(stream.read(&mut buffer), Ok(0) | Err(_)));
}

#[test]
fn a_target_that_is_down_ends_the_clients_connection() {
    let closed = ClosedPort::bind();
    let proxy = TcpProxy::start(closed.port());
    let mut stream = connect(&proxy);
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut buffer = [0u8; 1];
    assert!(matches!(stream.read(&mut buffer), Ok(0) | Err(_)));
}

#[test]
fn a_closed_port_refuses_connections_while_it_lives() {
    let closed = ClosedPort::bind();
    let error = TcpStream::connect(("127.0.0.1", closed.port())).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::ConnectionRefused);
    // Nobody else can take it meanwhile.
    assert!(TcpListener::bind(("127.0.0.1", closed.port())).is_err());
}
