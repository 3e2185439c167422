//! Two workers compete for one lock in the embedded SQLite store; each critical section
//! runs alone and carries a larger fencing token than the one before.
//!
//! Run: `cargo run -p turnstile --example lock [sqlite://PATH | redis://HOST:PORT]`

use std::time::Duration;

use turnstile::lock::{LockOptions, Locker};

#[tokio::main(flavor = "current_thread")]
async fn main() -> turnstile::Result<()> {
    let dir = std::env::temp_dir().join("turnstile-example");
    std::fs::create_dir_all(&dir).expect("cannot create the example directory");
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| format!("sqlite://{}", dir.join("locks.sqlite3").display()));
    let locker = Locker::connect(&url).await?;
    println!("store: {}", locker.backend().describe());

    let options = LockOptions::new()
        .ttl(Duration::from_secs(5))
        .wait(Duration::from_secs(10));
    let workers = (1..=2).map(|worker| {
        let (locker, options) = (locker.clone(), options.clone());
        tokio::spawn(async move {
            for round in 1..=3 {
                let guard = locker.acquire("example:report", &options).await?;
                println!(
                    "worker {worker}, round {round}: fencing token {}",
                    guard.fencing_token()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
                guard.release().await?;
            }
            Ok::<_, turnstile::Error>(())
        })
    });
    for worker in workers.collect::<Vec<_>>() {
        worker.await.expect("worker panicked")?;
    }
    Ok(())
}
