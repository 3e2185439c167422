//! Time on the ground floor: the host's wall clock, which every engine that reads time
//! on the host shares (the SQLite stores take it as the store's clock, the Redis
//! idempotency store moves it onto the server's clock for a first claim's token), and
//! durations as the whole milliseconds stores are given.

use std::time::Duration;

/// Milliseconds and microseconds since the Unix epoch on the host's wall clock: the
/// clock every process on the host shares (and so an SQLite store's clock).
#[cfg(any(feature = "sqlite", feature = "redis"))]
pub(crate) fn wall_clock() -> (i64, i64) {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (
        i64::try_from(since_epoch.as_millis()).unwrap_or(i64::MAX),
        i64::try_from(since_epoch.as_micros()).unwrap_or(i64::MAX),
    )
}

/// Duration as whole milliseconds for a store, rounded up so a lease is never shorter
/// than asked.
// Unused in a build with only the MySQL engine, whose leases are whole seconds.
#[cfg_attr(
    not(any(feature = "redis", feature = "sqlite", feature = "postgres")),
    allow(dead_code)
)]
pub(crate) fn ceil_millis(duration: Duration) -> u64 {
    let millis = duration.as_millis();
    let rounded = if duration.as_nanos().is_multiple_of(1_000_000) {
        millis
    } else {
        millis + 1
    };
    u64::try_from(rounded).unwrap_or(u64::MAX)
}
