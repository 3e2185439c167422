//! What every lock benchmark runs and reports: the workload (from the environment),
//! the raw floor's release script, each worker's measurements, the CPU time per core,
//! and the JSON line a run prints.

use turnstile::{Error, ErrorKind};

pub(crate) struct Workload {
    pub(crate) secs: u64,
    pub(crate) workers: usize,
    pub(crate) ttl_ms: u64,
    pub(crate) acquire_timeout_ms: u64,
}

pub(crate) fn env_number(name: &str, default: u64) -> Result<u64, Error> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(text) => match text.trim().parse::<u64>() {
            Ok(value) if value > 0 => Ok(value),
            _ => Err(Error::new(
                ErrorKind::InvalidOptions,
                format!("{name}={text:?} must be a positive whole number"),
            )),
        },
    }
}

impl Workload {
    pub(crate) fn from_env() -> Result<Workload, Error> {
        Ok(Workload {
            secs: env_number("BENCH_SECS", 5)?,
            workers: usize::try_from(env_number("WORKERS", 8)?).unwrap_or(8),
            ttl_ms: env_number("LOCK_TTL_MS", 10_000)?,
            acquire_timeout_ms: env_number("ACQUIRE_TIMEOUT_MS", 5_000)?,
        })
    }
}

#[cfg(feature = "redis")]
pub(crate) const RAW_RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

/// Prints the first failure of a run to stderr; later ones only count.
pub(crate) fn report_first_error(error: &str) {
    static REPORTED: std::sync::Once = std::sync::Once::new();
    REPORTED.call_once(|| eprintln!("turnstile: bench: first error: {error}"));
}

/// Nearest-rank percentile of sorted samples.
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

pub(crate) fn round(value: f64, places: i32) -> f64 {
    let scale = 10f64.powi(places);
    (value * scale).round() / scale
}

pub(crate) struct WorkerReport {
    pub(crate) sections: u64,
    pub(crate) waits_ms: Vec<f64>,
    pub(crate) timeouts: u64,
    pub(crate) errors: u64,
}

/// What phase A (one worker, a new lock each cycle) measured.
pub(crate) struct Uncontended {
    /// Acquire latencies in µs, sorted.
    pub(crate) acquire_us: Vec<f64>,
    pub(crate) elapsed: f64,
    pub(crate) errors: u64,
    /// How busy each core of `BENCH_CPU_CORES` was during the phase.
    pub(crate) cores: Vec<CoreBusy>,
}

/// A core's busy share over a phase, from `/proc/stat`: with the server pinned to one
/// core and the client to another, what each side spends on a cycle, which latency
/// alone cannot tell (a loopback round trip here is mostly waiting).
pub(crate) struct CoreBusy {
    pub(crate) core: usize,
    /// Busy ticks / all ticks of that core over the phase.
    pub(crate) share: f64,
}

/// Counts the ticks of the cores in `BENCH_CPU_CORES` from `start` to `finish`.
pub(crate) struct CoreClock {
    started: Vec<(usize, u64, u64)>,
}

impl CoreClock {
    /// Starts counting; counts nothing where `/proc/stat` or the variable is missing.
    pub(crate) fn start() -> CoreClock {
        let cores: Vec<usize> = std::env::var("BENCH_CPU_CORES")
            .unwrap_or_default()
            .split(',')
            .filter_map(|core| core.trim().parse().ok())
            .collect();
        let ticks = core_ticks();
        CoreClock {
            started: cores
                .into_iter()
                .filter_map(|core| ticks.iter().find(|(c, ..)| *c == core).copied())
                .collect(),
        }
    }

    /// The busy share of each counted core since `start`.
    pub(crate) fn finish(&self) -> Vec<CoreBusy> {
        let now = core_ticks();
        self.started
            .iter()
            .filter_map(|&(core, busy, total)| {
                let &(_, busy_now, total_now) = now.iter().find(|(c, ..)| *c == core)?;
                let all = total_now.checked_sub(total).filter(|all| *all > 0)?;
                Some(CoreBusy {
                    core,
                    share: busy_now.saturating_sub(busy) as f64 / all as f64,
                })
            })
            .collect()
    }
}

/// (core, busy ticks, all ticks) of every core in `/proc/stat`. Busy is user, nice,
/// system, irq and softirq; idle, iowait and steal (the hypervisor's) are not.
pub(crate) fn core_ticks() -> Vec<(usize, u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    stat.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let core = fields.next()?.strip_prefix("cpu")?.parse().ok()?;
            let ticks: Vec<u64> = fields.take(8).filter_map(|f| f.parse().ok()).collect();
            let &[user, nice, system, idle, iowait, irq, softirq, steal] = ticks.as_slice() else {
                return None;
            };
            let busy = user + nice + system + irq + softirq;
            Some((core, busy, busy + idle + iowait + steal))
        })
        .collect()
}

/// The workload's JSON report (one line), the same for every peer.
pub(crate) fn report_json(
    peer: &str,
    wait_strategy: &str,
    work: &Workload,
    uncontended: Uncontended,
    reports: &[WorkerReport],
    contended_elapsed: f64,
    counter_value: i64,
) -> serde_json::Value {
    let Uncontended {
        acquire_us,
        elapsed: uncontended_elapsed,
        errors: uncontended_errors,
        cores,
    } = uncontended;
    let uncontended_cycles = acquire_us.len() as u64;
    let contended_sections: u64 = reports.iter().map(|r| r.sections).sum();
    let mut waits: Vec<f64> = reports
        .iter()
        .flat_map(|r| r.waits_ms.iter().copied())
        .collect();
    waits.sort_by(f64::total_cmp);
    let per_worker: Vec<u64> = reports.iter().map(|r| r.sections).collect();
    let mut report = serde_json::json!({
        "peer": peer,
        "lang": "rust",
        "version": env!("CARGO_PKG_VERSION"),
        "workers": work.workers,
        "window_s": work.secs,
        "lock_ttl_ms": work.ttl_ms,
        "uncontended_cycles": uncontended_cycles,
        "uncontended_elapsed_s": round(uncontended_elapsed, 3),
        "uncontended_cycles_per_s": round(uncontended_cycles as f64 / uncontended_elapsed, 1),
        "acquire_p50_us": round(percentile(&acquire_us, 50.0), 1),
        "acquire_p99_us": round(percentile(&acquire_us, 99.0), 1),
        "uncontended_errors": uncontended_errors,
        "contended_sections": contended_sections,
        "contended_elapsed_s": round(contended_elapsed, 3),
        "contended_sections_per_s": round(contended_sections as f64 / contended_elapsed.max(f64::EPSILON), 1),
        "counter_value": counter_value,
        "counter_ok": u64::try_from(counter_value).is_ok_and(|value| value == contended_sections),
        "acquire_timeouts": reports.iter().map(|r| r.timeouts).sum::<u64>(),
        "contended_errors": reports.iter().map(|r| r.errors).sum::<u64>(),
        "per_worker_min": per_worker.iter().min().copied().unwrap_or(0),
        "per_worker_max": per_worker.iter().max().copied().unwrap_or(0),
        "contended_wait_p50_ms": round(percentile(&waits, 50.0), 3),
        "contended_wait_p99_ms": round(percentile(&waits, 99.0), 3),
        "contended_wait_max_ms": round(waits.last().copied().unwrap_or(0.0), 3),
        "wait_strategy": wait_strategy,
    });
    for CoreBusy { core, share } in cores {
        let busy_us = share * uncontended_elapsed * 1e6 / uncontended_cycles.max(1) as f64;
        report[format!("uncontended_core{core}_busy_us_per_cycle")] = round(busy_us, 1).into();
    }
    report
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let samples: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&samples, 50.0), 50.0);
        assert_eq!(percentile(&samples, 99.0), 99.0);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }
}
