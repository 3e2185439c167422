//! The test servers themselves start, restart and stop.

use std::net::TcpStream;

use turnstile_test_support::{MariaDbServer, PostgresServer, RedisServer};

#[test]
fn redis_starts_restarts_and_dies_with_its_handle() {
    let server = RedisServer::spawn();
    let port = server.port();
    server.restart();
    assert_eq!(server.port(), port);
    assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
    drop(server);
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
}

#[test]
fn postgres_starts_keeps_data_across_restarts_and_dies_with_its_handle() {
    let server = PostgresServer::spawn();
    let url = server.fresh_database("support");
    assert!(url.starts_with("postgres://postgres@127.0.0.1:"));
    let port = server.port();
    server.restart();
    server.crash_and_restart();
    assert_eq!(server.port(), port);
    assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
    drop(server);
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
}

#[test]
fn mariadb_starts_keeps_data_across_restarts_and_dies_with_its_handle() {
    let server = MariaDbServer::spawn();
    server.sql("CREATE TABLE test.kept (id INT PRIMARY KEY); INSERT INTO test.kept VALUES (7);");
    let port = server.port();
    server.restart();
    assert_eq!(server.sql("SELECT id FROM test.kept").trim(), "7");
    assert_eq!(server.port(), port);
    drop(server);
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
}
