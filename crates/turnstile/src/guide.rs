//! The guides of the repository's `docs/` folder, one page each, so that they can be
//! read beside the API they describe and their Rust examples are compiled as doc tests.

#[doc = include_str!("../../../docs/locks.md")]
pub mod locks {}

#[doc = include_str!("../../../docs/elections.md")]
pub mod elections {}

#[doc = include_str!("../../../docs/semaphores.md")]
pub mod semaphores {}

#[doc = include_str!("../../../docs/idempotency.md")]
pub mod idempotency {}

#[doc = include_str!("../../../docs/outbox.md")]
pub mod outbox {}

#[doc = include_str!("../../../docs/service.md")]
pub mod service {}

#[doc = include_str!("../../../docs/cli.md")]
pub mod cli {}

#[doc = include_str!("../../../docs/verify.md")]
pub mod verify {}

#[doc = include_str!("../../../docs/store-urls.md")]
pub mod store_urls {}

#[doc = include_str!("../../../docs/guarantees.md")]
pub mod guarantees {}

#[doc = include_str!("../../../docs/operations.md")]
pub mod operations {}
