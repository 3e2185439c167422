//! The report: one line per run on the terminal, and one HTML file (no network, no
//! scripts) with a timeline per run, the hand-over gap histogram and the verdicts.
//!
//! The pieces every pillar's page is made of (the page's head, a verdict table, a time
//! axis with shaded fault windows, a histogram) are here; `verify outbox` and `verify
//! idempotency` draw their own charts with them.

use std::fmt::Write;

use svg::Document;
use svg::node::element::{Group, Line, Rectangle, Text, Title};

use super::check::{FaultWindow, RunCheck, Verdict, percentile};

/// What the HTML page shows.
pub(crate) struct View<'a> {
    /// `lock`, `election` or `semaphore`.
    pub(crate) primitive: &'a str,
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

pub(crate) fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The start of a page: its title, its style and a heading with the verdict.
pub(crate) fn page_head(title: &str, passed: bool) -> String {
    format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>{title}</title>\
         <style>body{{font-family:sans-serif;margin:2em;color:#102a43}}table{{border-collapse:collapse}}\
         td,th{{border:1px solid #bcccdc;padding:3px 8px;text-align:left}}.fail{{color:#d64545;font-weight:bold}}\
         .pass{{color:#27ab83}}</style></head><body>\
         <h1>{title}: <span class=\"{class}\">{verdict}</span></h1>",
        title = escape(title),
        class = if passed { "pass" } else { "fail" },
        verdict = if passed { "passed" } else { "FAILED" },
    )
}

/// A run's heading and its verdicts, one row per check.
pub(crate) fn run_verdicts(run: u32, verdicts: &[Verdict]) -> String {
    let passed = verdicts.iter().all(|verdict| verdict.passed);
    let mut table = format!(
        "<h2>Run {run}: <span class=\"{}\">{}</span></h2><table><tr><th>check</th><th>verdict</th><th>detail</th></tr>",
        if passed { "pass" } else { "fail" },
        if passed { "passed" } else { "FAILED" },
    );
    for verdict in verdicts {
        let _ = write!(
            table,
            "<tr><td>{}</td><td class=\"{}\">{}</td><td>{}</td></tr>",
            escape(verdict.check),
            if verdict.passed { "pass" } else { "fail" },
            if verdict.passed { "pass" } else { "FAIL" },
            escape(&verdict.detail),
        );
    }
    table.push_str("</table>");
    table
}

/// The width of a timeline, the room for row labels on its left, and one row's height.
pub(crate) const WIDTH: f64 = 1100.0;
pub(crate) const LEFT: f64 = 80.0;
pub(crate) const ROW: f64 = 16.0;

/// Where a moment of the host's monotonic clock goes on a timeline that spans
/// `origin..end`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TimeAxis {
    origin: u64,
    span_ms: f64,
}

impl TimeAxis {
    /// The axis over every moment given (at least a nanosecond wide); `None` if there is
    /// none.
    pub(crate) fn spanning(moments: impl IntoIterator<Item = u64>) -> Option<TimeAxis> {
        let (mut first, mut last) = (u64::MAX, 0);
        for moment in moments {
            first = first.min(moment);
            last = last.max(moment);
        }
        (first <= last).then(|| TimeAxis {
            origin: first,
            span_ms: (last.max(first + 1) - first) as f64 / 1e6,
        })
    }

    /// The horizontal position of `t`.
    pub(crate) fn x(&self, t: u64) -> f64 {
        LEFT + (t.saturating_sub(self.origin) as f64 / 1e6) / self.span_ms * (WIDTH - LEFT - 10.0)
    }

    /// The axis' length in milliseconds, written in the bottom right corner.
    pub(crate) fn length_label(&self, height: f64) -> Text {
        Text::new(format!("{:.0} ms", self.span_ms))
            .set("x", WIDTH - 60.0)
            .set("y", height - 4.0)
    }
}

/// Fault windows shaded grey behind a timeline whose first row starts at `top`: over
/// their target's row, or over all `rows` when they hit no one row (the store, the
/// broker).
pub(crate) fn fault_bands(
    axis: &TimeAxis,
    faults: &[FaultWindow],
    top: f64,
    row: f64,
    rows: usize,
) -> Group {
    let mut bands = Group::new();
    for fault in faults {
        let (band_top, band_rows) = match fault.target {
            Some(target) => (top + row * target as f64, 1.0),
            None => (top, rows as f64),
        };
        bands = bands
            .add(
                Rectangle::new()
                    .set("x", axis.x(fault.start))
                    .set("y", band_top)
                    .set("width", (axis.x(fault.end) - axis.x(fault.start)).max(2.0))
                    .set("height", row * band_rows)
                    .set("fill", "#9aa5b1")
                    .set("opacity", 0.45)
                    .add(Title::new(format!(
                        "{} {} ms",
                        fault.fault,
                        (fault.end - fault.start) / 1_000_000
                    ))),
            )
            .add(
                Text::new(fault.fault.clone())
                    .set("x", axis.x(fault.start) + 2.0)
                    .set("y", top - 6.0),
            );
    }
    bands
}

/// An SVG timeline `rows` rows high, with a label per row on the left.
pub(crate) fn timeline_frame(labels: &[String]) -> (Document, f64) {
    let height = 30.0 + ROW * labels.len() as f64 + 20.0;
    let mut document = Document::new()
        .set("width", WIDTH)
        .set("height", height)
        .set("viewBox", (0, 0, WIDTH, height))
        .set("font-family", "sans-serif")
        .set("font-size", 10);
    for (row, label) in labels.iter().enumerate() {
        document = document.add(
            Text::new(label.clone())
                .set("x", 4)
                .set("y", 20.0 + ROW * row as f64 + 11.0),
        );
    }
    (document, height)
}

/// A histogram of `values` (milliseconds) over `buckets` (upper limits, the last one
/// infinite); `what` names one value in a bar's tool tip ("hand-overs").
pub(crate) fn histogram(buckets: &[f64], values: &[f64], what: &str) -> Document {
    let mut counts = vec![0usize; buckets.len()];
    for &value in values {
        let bucket = buckets
            .iter()
            .position(|&limit| value < limit)
            .unwrap_or(buckets.len().saturating_sub(1));
        if let Some(count) = counts.get_mut(bucket) {
            *count += 1;
        }
    }
    let tallest = counts.iter().copied().max().unwrap_or(0).max(1) as f64;
    let (bar, height) = (48.0, 120.0);
    let mut document = Document::new()
        .set("width", bar * buckets.len() as f64 + 20.0)
        .set("height", height + 30.0)
        .set("font-family", "sans-serif")
        .set("font-size", 10);
    let mut low = 0.0;
    for (i, (&limit, &count)) in buckets.iter().zip(&counts).enumerate() {
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
                    .add(Title::new(format!("{count} {what}, {label} ms"))),
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

/// The timeline of one run: a row per worker with its holds (green; amber when the lost
/// signal fired; red when part of an unexplained overlap), lost signals (red ticks),
/// writes the fence refused (black ticks), and fault windows shaded behind.
fn timeline(check: &RunCheck, workers: usize) -> Document {
    let Some(axis) = TimeAxis::spanning(
        check
            .holds
            .iter()
            .flat_map(|h| [h.invoked, h.end])
            .chain(check.fault_windows.iter().flat_map(|f| [f.start, f.end])),
    ) else {
        return Document::new().set("width", 10).set("height", 10);
    };
    let labels: Vec<String> = (0..workers)
        .map(|worker| format!("worker {worker}"))
        .collect();
    let (document, height) = timeline_frame(&labels);
    let mut document = document.add(fault_bands(&axis, &check.fault_windows, 20.0, ROW, workers));
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
                .set("x", axis.x(hold.start))
                .set("y", top)
                .set("width", (axis.x(hold.end) - axis.x(hold.start)).max(1.0))
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
                    .set("x1", axis.x(at))
                    .set("x2", axis.x(at))
                    .set("y1", top - 2.0)
                    .set("y2", top + ROW - 2.0)
                    .set("stroke", colour)
                    .set("stroke-width", 2),
            );
        }
    }
    document = document.add(holds);
    document.add(axis.length_label(height))
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

/// The whole page.
pub(crate) fn html(view: &View<'_>) -> String {
    let mut page = page_head(
        &format!("turnstile verify {} — {}", view.primitive, view.engine),
        view.passed,
    );
    let _ = write!(
        page,
        "<p>Store {store}; {workers} worker processes; TTL {ttl} ms; {runs} runs.</p>",
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
        histogram(&GAP_BUCKETS, &gaps, "hand-overs")
    );
    page.push_str(
        "<p>Timelines: a row per worker; green a hold, amber a hold whose lost signal fired (red tick), \
         red a hold in an overlap no fault explains; black ticks are writes the fence refused; grey, faults.</p>",
    );
    for (run, check) in &view.runs {
        page.push_str(&run_verdicts(*run, &check.verdicts));
        let _ = write!(
            page,
            "<p>{} acquisitions, {} failed acquires, {} writes accepted, {} refused by the fence.</p>{}",
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
