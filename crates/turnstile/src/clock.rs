//! The host's wall clock, which every engine that reads time on the host shares: the
//! SQLite stores take it as the store's clock, the Redis idempotency store moves it onto
//! the server's clock for a first claim's token.

/// Milliseconds and microseconds since the Unix epoch on the host's wall clock: the
/// clock every process on the host shares (and so an SQLite store's clock).
pub(crate) fn wall_clock() -> (i64, i64) {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (
        i64::try_from(since_epoch.as_millis()).unwrap_or(i64::MAX),
        i64::try_from(since_epoch.as_micros()).unwrap_or(i64::MAX),
    )
}
