//! What the SQL outbox stores (SQLite, PostgreSQL, MySQL) share: the checks before
//! an enqueue or a skip, the key table's added columns, the URL option they all read,
//! and a message's stored form.

use std::time::Duration;

use super::{Message, PRODUCER_HEADER};
use crate::error::{Error, ErrorKind, Result};

/// Refuses, before anything is written, a message larger than the broker it is bound
/// for takes (`limit`, when the application told the store): such a message would
/// otherwise be stored, fail at every publish, and park its key.
pub(crate) fn check_size(message: &Message, limit: Option<usize>) -> Result<()> {
    // Only an outbox told a limit pays for measuring the headers.
    let Some(limit) = limit else {
        return Ok(());
    };
    let size = message.payload().len() + message.headers_json().len();
    if size > limit {
        return Err(Error::new(
            ErrorKind::InvalidOptions,
            format!(
                "outbox message {} is {size} bytes (payload and headers), more than the {limit} \
                 bytes this outbox was told its broker takes; it was not enqueued",
                message.id()
            ),
        ));
    }
    Ok(())
}

/// Why `skip` refuses: the key is unknown, not parked, or `seq` is not its head.
pub(crate) fn check_skip(key: &str, seq: u64, head: Option<(u64, bool)>) -> Result<()> {
    let refuse = |message: String| Err(Error::new(ErrorKind::InvalidOptions, message));
    match head {
        None => refuse(format!("the outbox has no key {key:?}")),
        Some((_, false)) => refuse(format!(
            "key {key:?} is not parked: only a parked key's head message can be skipped \
             (a relay may be publishing it now)"
        )),
        Some((next, true)) if next != seq => refuse(format!(
            "message {seq} is not key {key:?}'s head: its next undelivered message is {next}"
        )),
        Some(_) => Ok(()),
    }
}

/// Columns every SQL store added to its key table after the table's first release:
/// the head message's permanent failures (only those park a key), and the lease token
/// last settled (a settlement tried again after a lost commit reply changes nothing).
pub(crate) const ADDED_KEY_COLUMNS: [&str; 2] = ["permanent_failures", "settled_token"];

/// Refuses to work on key tables made by an earlier release that lack one of the
/// [`ADDED_KEY_COLUMNS`], when the store was told not to migrate: its settlements would fail every
/// round, and every round would be published again. No table at all (`columns` empty)
/// is left to fail where it is used, as before.
pub(crate) fn check_key_columns(columns: &[String]) -> Result<()> {
    if columns.is_empty() {
        return Ok(());
    }
    let missing: Vec<&str> = ADDED_KEY_COLUMNS
        .into_iter()
        .filter(|column| !columns.iter().any(|name| name == column))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::Configuration,
        format!(
            "the outbox's key table was made by an earlier release and lacks the column(s) {}: \
             open the outbox once with migrations on (turnstile_migrate=on, the default), \
             which adds them without rewriting the table",
            missing.join(", ")
        ),
    ))
}

/// Refuses a skip whose message already has an audit copy (`copied`) under its key and
/// number in `table` (the outbox's sequences started again since): that copy is never
/// dropped or overwritten.
pub(crate) fn check_no_audit_copy(copied: bool, key: &str, seq: u64, table: &str) -> Result<()> {
    if !copied {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::Conflict,
        format!(
            "message {seq} of key {key:?} already has an audit copy in {table} (from an \
             earlier skip, before the outbox's sequence numbers started again): move that \
             row out of {table}, then skip again; nothing was changed"
        ),
    ))
}

/// Splits `turnstile_keep_delivered=SECONDS` off a store URL: the URL without it, and
/// the retention.
pub(crate) fn keep_delivered_option(url: &str) -> Result<(String, Option<Duration>)> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), None));
    };
    let mut keep = None;
    let mut rest = Vec::new();
    for pair in query.split('&').filter(|pair| !pair.is_empty()) {
        match pair.split_once('=') {
            Some(("turnstile_keep_delivered", value)) => {
                let seconds: u64 = value.parse().map_err(|_| {
                    Error::new(
                        ErrorKind::InvalidUrl,
                        format!(
                            "turnstile_keep_delivered={value:?} must be a whole number of seconds"
                        ),
                    )
                })?;
                keep = Some(Duration::from_secs(seconds));
            }
            _ => rest.push(pair),
        }
    }
    let url = if rest.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", rest.join("&"))
    };
    Ok((url, keep))
}

impl Message {
    /// The headers as stored, with the producing outbox's identity added when it has
    /// one.
    pub(super) fn headers_json_from(&self, producer: Option<&str>) -> String {
        let mut map = self.headers_map();
        if let Some(producer) = producer {
            map.insert(
                PRODUCER_HEADER.to_owned(),
                serde_json::Value::String(producer.to_owned()),
            );
        }
        serde_json::Value::Object(map).to_string()
    }

    /// A message as a store read it back.
    pub(super) fn from_stored(
        id: String,
        topic: String,
        key: String,
        headers: &str,
        payload: Vec<u8>,
    ) -> Self {
        let headers = serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(headers)
            .map(|map| {
                map.into_iter()
                    .filter_map(|(name, value)| value.as_str().map(|v| (name, v.to_owned())))
                    .collect()
            })
            .unwrap_or_default();
        Message {
            id,
            topic,
            key,
            headers,
            payload,
        }
    }
}
