//! The boxed future every engine trait returns, and waiting for the first of several.

use std::future::Future;
use std::pin::Pin;

/// A boxed, sendable future: what [`LockBackend`](crate::lock::LockBackend) methods (and
/// every other engine trait's) return, so the traits stay object-safe and a store can be
/// chosen at run time from a URL.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Waits until the first of `futures` completes and answers its output (pending
/// forever if there are none). The others are left where they were.
pub(crate) async fn first_of<F: Future + Unpin>(futures: &mut [F]) -> F::Output {
    std::future::poll_fn(|context| {
        for future in futures.iter_mut() {
            if let std::task::Poll::Ready(output) = Pin::new(future).poll(context) {
                return std::task::Poll::Ready(output);
            }
        }
        std::task::Poll::Pending
    })
    .await
}
