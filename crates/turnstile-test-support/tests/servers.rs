//! The test servers themselves start, restart and stop.

use std::net::TcpStream;
use std::path::Path;

use turnstile_test_support::{MariaDbServer, PostgresServer, RedisServer};

/// Whether process `pid` is gone (its port may be reused by another server at once, so
/// a closed port proves nothing).
fn gone(pid: u32) -> bool {
    !Path::new(&format!("/proc/{pid}")).exists()
}

#[test]
fn redis_starts_restarts_and_dies_with_its_handle() {
    let server = RedisServer::spawn();
    let port = server.port();
    let first = server.pid().unwrap();
    server.restart();
    assert_eq!(server.port(), port);
    assert!(gone(first), "the first redis-server outlived its restart");
    assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
    let second = server.pid().unwrap();
    drop(server);
    assert!(gone(second), "redis-server outlived its handle");
}

#[test]
fn postgres_starts_keeps_data_across_restarts_and_dies_with_its_handle() {
    let server = PostgresServer::spawn();
    let url = server.fresh_database("support");
    assert!(url.starts_with("postgres://postgres@127.0.0.1:"));
    let database = url.rsplit('/').next().unwrap();
    server.sql(
        database,
        "CREATE TABLE kept (id INT PRIMARY KEY); INSERT INTO kept VALUES (7);",
    );
    let port = server.port();
    server.restart();
    assert_eq!(server.sql(database, "SELECT id FROM kept").trim(), "7");
    // The server commits asynchronously by default; this commit asks to be durable.
    server.sql(
        database,
        "SET synchronous_commit = on; INSERT INTO kept VALUES (8);",
    );
    server.crash_and_restart();
    // Committed before the crash: recovered from the write-ahead log.
    assert_eq!(
        server
            .sql(database, "SELECT id FROM kept ORDER BY id")
            .trim(),
        "7\n8"
    );
    assert_eq!(server.port(), port);
    assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
    let pid = server.pid().unwrap();
    drop(server);
    assert!(gone(pid), "postgres outlived its handle");
}

#[test]
fn mariadb_starts_keeps_data_across_restarts_and_dies_with_its_handle() {
    let server = MariaDbServer::spawn();
    server.sql("CREATE TABLE test.kept (id INT PRIMARY KEY); INSERT INTO test.kept VALUES (7);");
    let port = server.port();
    server.restart();
    assert_eq!(server.sql("SELECT id FROM test.kept").trim(), "7");
    assert_eq!(server.port(), port);
    let pid = server.pid().unwrap();
    drop(server);
    assert!(gone(pid), "mariadbd outlived its handle");
}
