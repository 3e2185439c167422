//! `turnstile bench lock --raw-blocking`: the lock workload on bare Redis commands over
//! blocking connections, one per worker thread — the physical floor, with no async
//! runtime between the workload and the socket. The same commands as `--raw`: `SET NX
//! PX` with busy retry, a compare-and-delete script, and the counter's `GET` and `SET`.

use std::process::ExitCode;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use super::workload::{CoreClock, RAW_RELEASE, Uncontended, WorkerReport, Workload, report_json};
use crate::exit;

/// One blocking connection and the workload's commands on it.
struct Worker {
    connection: redis::Connection,
    release: redis::Script,
    counter_key: String,
    ttl_ms: u64,
    wait: Duration,
}

impl Worker {
    fn open(
        client: &redis::Client,
        counter_key: &str,
        work: &Workload,
    ) -> redis::RedisResult<Self> {
        let connection = client.get_connection()?;
        Ok(Worker {
            connection,
            release: redis::Script::new(RAW_RELEASE),
            counter_key: counter_key.to_owned(),
            ttl_ms: work.ttl_ms,
            wait: Duration::from_millis(work.acquire_timeout_ms),
        })
    }

    /// Takes `name` (busy retry until the wait bound): `Ok(Some(token))`, or `Ok(None)`
    /// on timeout.
    fn acquire(&mut self, name: &str) -> redis::RedisResult<Option<(String, String)>> {
        let key = format!("{name}:raw-lock");
        let token = format!("{:032x}", rand::random::<u128>());
        let deadline = Instant::now() + self.wait;
        loop {
            let set: Option<String> = redis::cmd("SET")
                .arg(&key)
                .arg(&token)
                .arg("NX")
                .arg("PX")
                .arg(self.ttl_ms)
                .query(&mut self.connection)?;
            if set.is_some() {
                return Ok(Some((key, token)));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
        }
    }

    fn release(&mut self, (key, token): (String, String)) -> redis::RedisResult<()> {
        self.release
            .key(key)
            .arg(token)
            .invoke::<i64>(&mut self.connection)
            .map(|_| ())
    }

    fn counter_get(&mut self) -> redis::RedisResult<i64> {
        redis::cmd("GET")
            .arg(&self.counter_key)
            .query::<Option<i64>>(&mut self.connection)
            .map(Option::unwrap_or_default)
    }

    fn counter_set(&mut self, value: i64) -> redis::RedisResult<()> {
        redis::cmd("SET")
            .arg(&self.counter_key)
            .arg(value)
            .query(&mut self.connection)
    }
}

/// Runs both phases on threads and prints the report; `url` must be `redis://`.
pub(crate) async fn run(url: &str, work: &Workload, run: &str) -> ExitCode {
    if !url.starts_with("redis://") {
        eprintln!("turnstile: --raw-blocking needs a redis:// store; got {url:?}");
        return ExitCode::from(exit::USAGE);
    }
    let client = match redis::Client::open(url) {
        Ok(client) => client,
        Err(error) => {
            eprintln!("turnstile: {url:?} is not a Redis URL: {error}");
            return ExitCode::from(exit::USAGE);
        }
    };
    let workload = Workload {
        secs: work.secs,
        workers: work.workers,
        ttl_ms: work.ttl_ms,
        acquire_timeout_ms: work.acquire_timeout_ms,
    };
    let run = run.to_owned();
    // The workload blocks: off the async runtime's threads.
    match tokio::task::spawn_blocking(move || measure(&client, &workload, &run)).await {
        Ok(Ok(report)) => {
            println!("{report}");
            ExitCode::SUCCESS
        }
        Ok(Err(error)) => {
            eprintln!("turnstile: {error}");
            ExitCode::from(exit::UNAVAILABLE)
        }
        Err(_) => ExitCode::from(exit::UNAVAILABLE),
    }
}

fn measure(
    client: &redis::Client,
    work: &Workload,
    run: &str,
) -> Result<serde_json::Value, String> {
    let counter_key = format!("{run}:counter");
    let failed = |error: redis::RedisError| format!("Redis failed: {error}");
    let mut first = Worker::open(client, &counter_key, work).map_err(failed)?;
    first.counter_set(0).map_err(failed)?;
    // Warm-up, not measured.
    if let Some(held) = first.acquire(&format!("{run}:warmup")).map_err(failed)? {
        first.release(held).map_err(failed)?;
    }

    // Phase A: one worker, a new lock name each cycle.
    let window = Duration::from_secs(work.secs);
    let cores = CoreClock::start();
    let started = Instant::now();
    let mut acquire_us = Vec::new();
    let mut errors = 0u64;
    let mut cycle = 0u64;
    while started.elapsed() < window {
        let name = format!("{run}:a:{cycle}");
        cycle += 1;
        let sent = Instant::now();
        match first.acquire(&name) {
            Ok(Some(held)) => {
                acquire_us.push(sent.elapsed().as_secs_f64() * 1e6);
                if first.release(held).is_err() {
                    errors += 1;
                }
            }
            Ok(None) | Err(_) => errors += 1,
        }
    }
    let uncontended = Uncontended {
        elapsed: started.elapsed().as_secs_f64(),
        acquire_us: {
            acquire_us.sort_by(f64::total_cmp);
            acquire_us
        },
        errors,
        cores: cores.finish(),
    };

    // Phase B: WORKERS threads on one hot lock.
    let hot = format!("{run}:hot");
    let barrier = Arc::new(Barrier::new(work.workers));
    let begun = Instant::now();
    let threads: Vec<_> = (0..work.workers)
        .map(|_| {
            let worker = Worker::open(client, &counter_key, work);
            let (barrier, hot, secs) = (Arc::clone(&barrier), hot.clone(), work.secs);
            std::thread::spawn(move || {
                let mut report = WorkerReport {
                    sections: 0,
                    waits_ms: Vec::new(),
                    timeouts: 0,
                    errors: 0,
                };
                let Ok(mut worker) = worker else {
                    barrier.wait();
                    report.errors += 1;
                    return report;
                };
                barrier.wait();
                let deadline = Instant::now() + Duration::from_secs(secs);
                while Instant::now() < deadline {
                    let asked = Instant::now();
                    let held = match worker.acquire(&hot) {
                        Ok(Some(held)) => held,
                        Ok(None) => {
                            report.timeouts += 1;
                            continue;
                        }
                        Err(_) => {
                            report.errors += 1;
                            continue;
                        }
                    };
                    report.waits_ms.push(asked.elapsed().as_secs_f64() * 1e3);
                    let counted = worker
                        .counter_get()
                        .and_then(|value| worker.counter_set(value + 1));
                    if counted.is_ok() {
                        report.sections += 1;
                    } else {
                        report.errors += 1;
                    }
                    if worker.release(held).is_err() {
                        report.errors += 1;
                    }
                }
                report
            })
        })
        .collect();
    let reports: Vec<WorkerReport> = threads
        .into_iter()
        .map(|thread| {
            thread.join().unwrap_or(WorkerReport {
                sections: 0,
                waits_ms: Vec::new(),
                timeouts: 0,
                errors: 1,
            })
        })
        .collect();
    let contended_elapsed = begun.elapsed().as_secs_f64();
    let counter_value = first.counter_get().unwrap_or(-1);
    Ok(report_json(
        "raw-blocking",
        "busy-retry-blocking",
        work,
        uncontended,
        &reports,
        contended_elapsed,
        counter_value,
    ))
}
