//! The boxed future every engine trait returns.

use std::future::Future;
use std::pin::Pin;

/// A boxed, sendable future: what [`LockBackend`](crate::lock::LockBackend) methods (and
/// every other engine trait's) return, so the traits stay object-safe and a store can be
/// chosen at run time from a URL.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
