//! Lock names, validated once: what every concept that keys something by a lock's name
//! (the locks, the fenced resources beside them) shares.

use std::fmt;

use crate::error::{Error, ErrorKind, Result};

/// The longest lock name accepted, in bytes.
pub const MAX_NAME_LEN: usize = 512;

/// A validated lock name: 1 to [`MAX_NAME_LEN`] bytes of UTF-8 without control characters.
///
/// Names are what operators see in `turnstile lock status`, so anything printable is
/// allowed (`order:123`, `reports/daily`, `日次集計`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockName(String);

impl LockName {
    /// Validates `name`.
    ///
    /// ```
    /// use turnstile::lock::LockName;
    /// assert!(LockName::new("order:123").is_ok());
    /// assert!(LockName::new("").is_err());
    /// ```
    pub fn new(name: impl Into<String>) -> Result<Self> {
        let name = name.into();
        if name.is_empty() {
            return Err(Error::new(
                ErrorKind::InvalidName,
                "a lock name must not be empty",
            ));
        }
        if name.len() > MAX_NAME_LEN {
            return Err(Error::new(
                ErrorKind::InvalidName,
                format!(
                    "a lock name is at most {MAX_NAME_LEN} bytes; this one has {} (hash long identifiers first)",
                    name.len()
                ),
            ));
        }
        if let Some(bad) = name.chars().find(|c| c.is_control()) {
            return Err(Error::new(
                ErrorKind::InvalidName,
                format!("a lock name must not contain control characters; found {bad:?}"),
            ));
        }
        Ok(LockName(name))
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LockName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<&str> for LockName {
    type Error = Error;
    fn try_from(name: &str) -> Result<Self> {
        LockName::new(name)
    }
}

impl TryFrom<String> for LockName {
    type Error = Error;
    fn try_from(name: String) -> Result<Self> {
        LockName::new(name)
    }
}
