//! `turnstile bench lock --rslock`: the workload on the rslock crate (RedLock, here on
//! the one Redis node of `--store`), the Rust crate the library's Redis engine is
//! measured against. rslock is used as its README shows: `lock` called again until it
//! succeeds, each call making up to three attempts with a random pause of up to 200 ms
//! between them (its defaults).

use std::time::Duration;

use tokio::time::Instant;

/// An rslock manager on the Redis of `url`, and a connection for the counter.
pub(crate) struct Rslock {
    manager: rslock::LockManager,
    pub(crate) connection: redis::aio::MultiplexedConnection,
}

/// What `lock` gave back.
pub(crate) struct RslockHeld(rslock::Lock);

impl Rslock {
    pub(crate) async fn open(url: &str) -> Result<Rslock, String> {
        let client = redis::Client::open(url).map_err(|e| format!("bad Redis URL {url:?}: {e}"))?;
        let connection = tokio::time::timeout(
            Duration::from_secs(3),
            client.get_multiplexed_async_connection(),
        )
        .await
        .map_err(|_| format!("cannot reach {url} in 3s"))?
        .map_err(|e| format!("cannot reach {url}: {e}"))?;
        Ok(Rslock {
            manager: rslock::LockManager::from_clients(vec![client]),
            connection,
        })
    }

    /// Takes `name`, calling `lock` again until it succeeds or `wait` has passed.
    pub(crate) async fn acquire(
        &self,
        name: &str,
        ttl: Duration,
        wait: Duration,
    ) -> Result<Option<RslockHeld>, String> {
        let resource = format!("{name}:rslock");
        let deadline = Instant::now() + wait;
        loop {
            match self.manager.lock(resource.as_bytes(), ttl).await {
                Ok(lock) => return Ok(Some(RslockHeld(lock))),
                Err(rslock::LockError::Unavailable) if Instant::now() < deadline => {}
                Err(rslock::LockError::Unavailable) => return Ok(None),
                Err(error) => return Err(error.to_string()),
            }
        }
    }

    /// Unlocks (rslock's unlock is best effort and reports nothing).
    pub(crate) async fn release(&self, held: RslockHeld) {
        self.manager.unlock(&held.0).await;
    }
}
