//! Turnstile keeps a fleet of servers from doing the same work twice.
//!
//! This crate provides **distributed locks with fencing tokens** over real stores:
//! embedded SQLite (the default, no server needed), Redis, PostgreSQL (lease mode and
//! session-level advisory locks) and MySQL / MariaDB (`GET_LOCK` named locks), plus the
//! database tools the design notes name: transaction-scoped locks, fenced writes and
//! optimistic (version-checked) updates. On the same locks: [leader election](election)
//! with a fencing epoch per leader, [leased semaphores](semaphore) and [read-write
//! locks](rwlock).
//!
//! ```
//! # #[cfg(feature = "sqlite")]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> turnstile::Result<()> {
//! use std::time::Duration;
//! use turnstile::lock::{Locker, LockOptions};
//!
//! # let dir = tempfile::tempdir().unwrap();
//! # let url = format!("sqlite://{}", dir.path().join("locks.db").display());
//! let locker = Locker::connect(&url).await?; // or "redis://127.0.0.1:6379"
//! let options = LockOptions::new()
//!     .ttl(Duration::from_secs(15))   // a crashed holder frees the lock after 15 s
//!     .wait(Duration::from_secs(5));  // give up waiting after 5 s
//!
//! let guard = locker.acquire("order:123", &options).await?;
//! let token = guard.fencing_token(); // send with every write to the protected store
//! tokio::select! {
//!     reason = guard.lost() => eprintln!("lock lost ({reason}); stop writing"),
//!     () = async { /* the critical section, using `token` */ } => {}
//! }
//! guard.release().await?;
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "sqlite"))]
//! # fn main() {}
//! ```
//!
//! # What a lock gives you
//! - **Atomic acquire**: of many simultaneous requests exactly one wins.
//! - **Ownership** by a random 128-bit id per acquisition, never a thread.
//! - **Expiry**: a TTL frees the lock of a holder that crashed or was cut off; while a
//!   [`LockGuard`] lives a watchdog renews it every TTL/3.
//! - **Safe release**: "is it still mine?" and delete in one atomic step.
//! - **A lost-lock signal** that fires the moment ownership can no longer be assumed.
//! - **Fencing tokens** ([`fence`]), so that a holder paused past its lease is stopped by
//!   the protected store.
//!
//! # Crate features
//! - `sqlite` (default): the embedded SQLite engine, [`lock::sqlite`].
//! - `redis`: the Redis engine, [`lock::redis`], and Redis fenced writes.
//! - `redis-tls`: `rediss://` URLs.
//! - `postgres`: the PostgreSQL engines, [`lock::postgres`] and
//!   [`lock::postgres_session`], and PostgreSQL fenced writes.
//! - `mysql`: the MySQL / MariaDB engine, [`lock::mysql`], and MySQL fenced writes.
//!
//! # Guarantees
//! Each engine documents what it guarantees — where its fencing tokens come from and
//! whether they survive a restart, whose clock decides expiry, what a partition or a
//! failover does — in its module docs and in the table of [`guide::guarantees`]. In short: no
//! lock service can make a paused process notice in time that its lease ran out; the
//! lost signal narrows the window and fencing tokens close it on the protected side.

mod clock;
pub mod election;
mod engine;
pub mod error;
pub mod fence;
mod future;
pub mod guide;
#[cfg_attr(
    not(any(feature = "redis", feature = "mysql", feature = "axum")),
    allow(dead_code)
)]
mod hex;
pub mod idempotency;
pub mod lock;
mod name;
mod notify;
pub mod optimistic;
pub mod outbox;
pub mod rwlock;
pub mod semaphore;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
mod sql;
pub mod store;
mod url;

pub use error::{Error, ErrorKind, Result};

/// The `sqlx` this crate was built with (0.9): its types appear in the API of the SQL
/// engines (pools, connections, transactions). Use it, or the same version in your
/// own `Cargo.toml`, so that your transaction is the type Turnstile takes.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub use sqlx;

pub use fence::{FenceOutcome, FencingToken};
pub use lock::{LockGuard, LockOptions, Locker};
/// The `redis` crate this crate was built with (1.x): its connection type appears in the
/// API of the Redis engine.
#[cfg(feature = "redis")]
pub use redis;
