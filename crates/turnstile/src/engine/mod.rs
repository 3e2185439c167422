//! What every concept (locks, idempotency keys) shares about one storage engine:
//! opening it from a URL, its connection settings, its clock. A concept's own
//! statements and scripts live in the concept's folder; this is the one home of the
//! rest, so that concepts borrow from here and not from each other.

#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "redis")]
pub(crate) mod redis;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;
