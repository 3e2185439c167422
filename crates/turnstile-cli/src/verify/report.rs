//! The report: one line per run on the terminal, and one HTML file (no network, no
//! scripts) with a timeline per run, the hand-over gap histogram and the verdicts.

use std::fmt::Write;

use svg::Document;
use svg::node::element::{Group, Line, Rectangle, Text, Title};

use super::check::{RunCheck, percentile};

/// What the HTML page shows.
pub(crate) struct View<'a> {
    pub(crate) engine: &'a str,
    pub(crate) store: &'a str,
    pub(crate) workers: usize,
    pub(crate) ttl_ms: u128,
    pub(crate) passed: bool,
    pub(crate) skipped_faults: &'a [String],
    pub(crate) runs: Vec<(u32, &'a RunCheck)>,
}

/// `run 3/10: passed — 142 acquisitions, faults pause×1, 1 overlap (explained: 1, stopped by the fence: 1)`.
pub(crate) fn one_line(run: u32, runs: u32, check: &RunCheck) -> String {
    let faults: Vec<String> = check
        .faults
        .iter()
        .map(|(fault, count)| format!("{fault}×{count}"))
        .collect();
    let explained = check
        .overlaps
        .iter()
        .filter(|o| o.explained_by.is_some())
        .count();
    let stopped = check.overlaps.iter().filter(|o| o.stopped_by_fence).count();
    let mut line = format!(
        "run {run}/{runs}: {} — {} acquisitions, faults {}, {} overlaps (explained {explained}, stopped by the fence {stopped})",
        if check.passed() { "passed" } else { "FAILED" },
        check.acquisitions,
        if faults.is_empty() {
            "none".to_owned()
        } else {
            faults.join(" ")
        },
        check.overlaps.len(),
    );
    for verdict in check.verdicts.iter().filter(|v| !v.passed) {
        let _ = write!(line, "\n  {}: {}", verdict.check, verdict.detail);
    }
    line
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

const WIDTH: f64 = 1100.0;
const LEFT: f64 = 80.0;
const ROW: f64 = 16.0;

/// The timeline of one run: a row per worker with its holds (green; amber when the lost
/// signal fired; red when part of an unexplained overlap), lost signals (red ticks),
/// writes the fence refused (black ticks), and fault windows shaded behind.
fn timeline(check: &RunCheck, workers: usize) -> Document {
    let Some(origin) = check
        .holds
        .iter()
        .map(|h| h.invoked)
        .chain(check.fault_windows.iter().map(|f| f.start))
        .min()
    else {
        return Document::new().set("width", 10).set("height", 10);
    };
    let end = check
        .holds
        .iter()
        .map(|h| h.end)
        .chain(check.fault_windows.iter().map(|f| f.end))
        .max()
        .unwrap_or(origin + 1)
        .max(origin + 1);
    let span_ms = (end - origin) as f64 / 1e6;
    let x =
        |t: u64| LEFT + (t.saturating_sub(origin) as f64 / 1e6) / span_ms * (WIDTH - LEFT - 10.0);
    let height = 30.0 + ROW * workers as f64 + 20.0;
    let mut document = Document::new()
        .set("width", WIDTH)
        .set("height", height)
        .set("viewBox", (0, 0, WIDTH, height))
        .set("font-family", "sans-serif")
        .set("font-size", 10);
    let mut faults = Group::new();
    for fault in &check.fault_windows {
        let (top, rows) = match fault.target {
            Some(worker) => (20.0 + ROW * worker as f64, 1.0),
            None => (20.0, workers as f64),
        };
        faults = faults.add(
            Rectangle::new()
                .set("x", x(fault.start))
                .set("y", top)
                .set("width", (x(fault.end) - x(fault.start)).max(2.0))
                .set("height", ROW * rows)
                .set("fill", "#9aa5b1")
                .set("opacity", 0.45)
                .add(Title::new(format!(
                    "{} {} ms",
                    fault.fault,
                    (fault.end - fault.start) / 1_000_000
                ))),
        );
        faults = faults.add(
            Text::new(fault.fault.clone())
                .set("x", x(fault.start) + 2.0)
                .set("y", 14.0),
        );
    }
    document = document.add(faults);
    let unexplained: Vec<(usize, u64)> = check
        .overlaps
        .iter()
        .filter(|o| o.explained_by.is_none())
        .flat_map(|o| {
            [
                (o.stale_worker, o.stale_token),
                (o.newer_worker, o.newer_token),
            ]
        })
        .collect();
    for worker in 0..workers {
        document = document.add(
            Text::new(format!("worker {worker}"))
                .set("x", 4)
                .set("y", 20.0 + ROW * worker as f64 + 11.0),
        );
    }
    let mut holds = Group::new();
    for hold in &check.holds {
        let top = 20.0 + ROW * hold.worker as f64 + 2.0;
        let colour = if unexplained.contains(&(hold.worker, hold.token)) {
            "#d64545"
        } else if hold.lost_at.is_some() {
            "#f0b429"
        } else {
            "#3ebd93"
        };
        holds = holds.add(
            Rectangle::new()
                .set("x", x(hold.start))
                .set("y", top)
                .set("width", (x(hold.end) - x(hold.start)).max(1.0))
                .set("height", ROW - 4.0)
                .set("fill", colour)
                .add(Title::new(format!(
                    "worker {} token {} held {} ms{}",
                    hold.worker,
                    hold.token,
                    (hold.end - hold.start) / 1_000_000,
                    if hold.lost_at.is_some() { ", lost" } else { "" }
                ))),
        );
        for (at, colour) in hold
            .lost_at
            .iter()
            .map(|&t| (t, "#d64545"))
            .chain(hold.rejected_writes.iter().map(|&t| (t, "#102a43")))
        {
            holds = holds.add(
                Line::new()
                    .set("x1", x(at))
                    .set("x2", x(at))
                    .set("y1", top - 2.0)
                    .set("y2", top + ROW - 2.0)
                    .set("stroke", colour)
                    .set("stroke-width", 2),
            );
        }
    }
    document = document.add(holds);
    document.add(
        Text::new(format!("{span_ms:.0} ms"))
            .set("x", WIDTH - 60.0)
            .set("y", height - 4.0),
    )
}

/// Buckets of hand-over gaps, in milliseconds.
const GAP_BUCKETS: [f64; 10] = [
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    50.0,
    100.0,
    200.0,
    500.0,
    f64::INFINITY,
];

fn gap_histogram(gaps: &[f64]) -> Document {
    let mut counts = [0usize; GAP_BUCKETS.len()];
    for &gap in gaps {
        let bucket = GAP_BUCKETS
            .iter()
            .position(|&limit| gap < limit)
            .unwrap_or(GAP_BUCKETS.len() - 1);
        counts[bucket] += 1;
    }
    let tallest = counts.iter().copied().max().unwrap_or(0).max(1) as f64;
    let (bar, height) = (48.0, 120.0);
    let mut document = Document::new()
        .set("width", bar * GAP_BUCKETS.len() as f64 + 20.0)
        .set("height", height + 30.0)
        .set("font-family", "sans-serif")
        .set("font-size", 10);
    let mut low = 0.0;
    for (i, (&limit, &count)) in GAP_BUCKETS.iter().zip(&counts).enumerate() {
        let h = count as f64 / tallest * height;
        let label = if limit.is_finite() {
            format!("<{limit}")
        } else {
            format!("≥{low}")
        };
        document = document
            .add(
                Rectangle::new()
                    .set("x", 10.0 + bar * i as f64)
                    .set("y", height - h + 10.0)
                    .set("width", bar - 6.0)
                    .set("height", h)
                    .set("fill", "#4098d7")
                    .add(Title::new(format!("{count} hand-overs, {label} ms"))),
            )
            .add(
                Text::new(label)
                    .set("x", 10.0 + bar * i as f64)
                    .set("y", height + 24.0),
            )
            .add(
                Text::new(count.to_string())
                    .set("x", 10.0 + bar * i as f64)
                    .set("y", height - h + 8.0),
            );
        low = limit;
    }
    document
}

/// The whole page.
pub(crate) fn html(view: &View<'_>) -> String {
    let mut page = String::new();
    let _ = write!(
        page,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>turnstile verify lock: {engine}</title>\
         <style>body{{font-family:sans-serif;margin:2em;color:#102a43}}table{{border-collapse:collapse}}\
         td,th{{border:1px solid #bcccdc;padding:3px 8px;text-align:left}}.fail{{color:#d64545;font-weight:bold}}\
         .pass{{color:#27ab83}}</style></head><body>\
         <h1>turnstile verify lock — {engine}: <span class=\"{class}\">{verdict}</span></h1>\
         <p>Store {store}; {workers} worker processes; TTL {ttl} ms; {runs} runs.</p>",
        engine = escape(view.engine),
        class = if view.passed { "pass" } else { "fail" },
        verdict = if view.passed { "passed" } else { "FAILED" },
        store = escape(view.store),
        workers = view.workers,
        ttl = view.ttl_ms,
        runs = view.runs.len(),
    );
    if !view.skipped_faults.is_empty() {
        let _ = write!(
            page,
            "<p>Faults not injected: {}</p>",
            escape(&view.skipped_faults.join("; "))
        );
    }
    let margins: Vec<f64> = view
        .runs
        .iter()
        .flat_map(|(_, check)| check.lost_signal_margins_ms.iter().copied())
        .collect();
    if !margins.is_empty() {
        let show = |p| percentile(&margins, p).map_or("-".to_owned(), |v| format!("{v:.1}"));
        let _ = write!(
            page,
            "<p>Lost signals: {} fired; before the next holder got the lock by (ms): min {}, p50 {}, p90 {}, p99 {} \
             (negative: the signal fired after, which a pause explains).</p>",
            margins.len(),
            show(0.0),
            show(50.0),
            show(90.0),
            show(99.0),
        );
    }
    let gaps: Vec<f64> = view
        .runs
        .iter()
        .flat_map(|(_, check)| check.handover_gaps_ms.iter().copied())
        .collect();
    let _ = write!(
        page,
        "<h2>Hand-over gaps (ms), all runs</h2>{}",
        gap_histogram(&gaps)
    );
    page.push_str(
        "<p>Timelines: a row per worker; green a hold, amber a hold whose lost signal fired (red tick), \
         red a hold in an overlap no fault explains; black ticks are writes the fence refused; grey, faults.</p>",
    );
    for (run, check) in &view.runs {
        let _ = write!(
            page,
            "<h2>Run {run}: <span class=\"{}\">{}</span></h2><table><tr><th>check</th><th>verdict</th><th>detail</th></tr>",
            if check.passed() { "pass" } else { "fail" },
            if check.passed() { "passed" } else { "FAILED" },
        );
        for verdict in &check.verdicts {
            let _ = write!(
                page,
                "<tr><td>{}</td><td class=\"{}\">{}</td><td>{}</td></tr>",
                escape(verdict.check),
                if verdict.passed { "pass" } else { "fail" },
                if verdict.passed { "pass" } else { "FAIL" },
                escape(&verdict.detail),
            );
        }
        let _ = write!(
            page,
            "</table><p>{} acquisitions, {} failed acquires, {} writes accepted, {} refused by the fence.</p>{}",
            check.acquisitions,
            check.failed_acquires,
            check.writes_accepted,
            check.writes_rejected,
            timeline(check, view.workers),
        );
    }
    page.push_str("</body></html>\n");
    page
}
