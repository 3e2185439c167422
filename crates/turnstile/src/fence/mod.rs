//! Fencing tokens, and writes that the protected store accepts only in token order.
//!
//! A lock alone cannot stop a holder that was paused (GC, swap, a stopped VM) past its
//! lease from writing when it wakes up: it still believes it holds the lock. Every
//! acquisition therefore carries a [`FencingToken`] larger than every token issued
//! before it for that lock name. The protected store remembers the largest token it
//! has seen per resource and refuses a write carrying a smaller one. The late writer is
//! stopped by the store, not by hope.
//!
//! The engine-specific modules — [`sqlite`], [`redis`], [`postgres`] and [`mysql`], each
//! behind its cargo feature — implement that check atomically on the protected side:
//! the SQL ones inside the application's own transaction, Redis in a script that
//! writes the value too.

use std::fmt;

use crate::error::{Error, ErrorKind, Result};

#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "sqlite")]
pub mod sqlite;

/// A number that grows with every acquisition of one lock name.
///
/// Compare tokens to order writes: a write carrying a smaller token than one the
/// protected store has already accepted comes from a holder that lost the lock.
/// Tokens of *different* lock names are not comparable in any useful way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a raw token, for example one passed to a child process in
    /// `TURNSTILE_FENCING_TOKEN`.
    pub const fn new(value: u64) -> Self {
        FencingToken(value)
    }

    /// The raw number.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The token as the signed 64-bit integer SQL databases store; tokens above
    /// `i64::MAX` are refused rather than wrapped, since a wrapped token would sort wrong.
    pub fn to_i64(self) -> Result<i64> {
        i64::try_from(self.0).map_err(|_| {
            Error::new(
                ErrorKind::Fencing,
                format!(
                    "fencing token {} does not fit in a signed 64-bit column",
                    self.0
                ),
            )
        })
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::str::FromStr for FencingToken {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        text.trim().parse::<u64>().map(FencingToken).map_err(|_| {
            Error::new(
                ErrorKind::Fencing,
                format!("{text:?} is not a fencing token (expected a non-negative integer)"),
            )
        })
    }
}

/// What the protected store did with a fenced write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FenceOutcome {
    /// The token was not smaller than any seen before for the resource; the write applied.
    Applied,
    /// A larger token has already been seen for the resource: the writer has lost its lock,
    /// and nothing was written.
    Rejected {
        /// The largest token the resource has accepted so far.
        highest_seen: FencingToken,
    },
}

impl FenceOutcome {
    /// Whether the write applied.
    pub fn is_applied(self) -> bool {
        matches!(self, FenceOutcome::Applied)
    }
}

/// Checks a resource name used by fenced writes: the same rules as lock names, with
/// an error that speaks of a resource.
#[cfg_attr(
    not(any(
        feature = "sqlite",
        feature = "redis",
        feature = "postgres",
        feature = "mysql"
    )),
    allow(dead_code)
)]
pub(crate) fn validate_resource(resource: &str) -> Result<()> {
    crate::name::LockName::new(resource).map(|_| ()).map_err(|error| {
        Error::new(
            ErrorKind::InvalidName,
            format!("invalid fenced resource name {resource:?}: 1 to {} bytes of text without control characters", crate::name::MAX_NAME_LEN),
        )
        .with_source(error)
    })
}
