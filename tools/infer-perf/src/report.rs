//! What a load point reports: its summary, the printed tables and the CSV file.

use crate::inputs::ModelInfo;
use crate::load::{percentile_of, Load, Measured};
use crate::stats::ServerDelta;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Generative metrics of a point (milliseconds and tokens).
#[derive(Clone, Debug, Default)]
pub struct GenMetrics {
    pub ttft_avg_ms: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    /// Mean time between tokens within a request.
    pub itl_avg_ms: f64,
    pub itl_p50_ms: f64,
    pub itl_p99_ms: f64,
    pub output_tokens_per_s: f64,
    pub output_tokens_avg: f64,
}

/// The summary of one load point: what its stable windows measured together.
#[derive(Clone, Debug, Default)]
pub struct Point {
    /// Concurrency, or requests per second asked for.
    pub load: f64,
    pub rate_mode: bool,
    pub inferences_per_s: f64,
    pub requests_per_s: f64,
    /// Request latency, microseconds.
    pub p50_us: f64,
    pub p90_us: f64,
    pub p95_us: f64,
    pub p99_us: f64,
    pub avg_us: f64,
    /// Time inside `infer_server_enqueue` and reading the final response.
    pub client_send_us: f64,
    pub client_recv_us: f64,
    pub server: ServerDelta,
    /// An ensemble's composing models and what each did.
    pub composing: Vec<(String, ServerDelta)>,
    pub completed: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    pub stable: bool,
    pub trials: usize,
    pub sent_rate: Option<f64>,
    pub late_share: f64,
    pub lost: usize,
    pub generative: Option<GenMetrics>,
}

impl Point {
    pub fn of(load: &Load, m: Measured, batch: u64, model: &ModelInfo) -> Point {
        let generative = model.generative;
        let composing = model
            .composing
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let d = m.windows.iter().fold(ServerDelta::default(), |acc, w| {
                    w.composing.get(i).map_or(acc.clone(), |c| acc.merge(c))
                });
                (name.clone(), d)
            })
            .collect();
        let secs: f64 = m.windows.iter().map(|w| w.secs).sum();
        let ok: Vec<_> = m
            .windows
            .iter()
            .flat_map(|w| w.samples.iter())
            .filter(|s| s.ok)
            .copied()
            .collect();
        let mut lat: Vec<u64> = ok.iter().map(|s| s.end_ns - s.start_ns).collect();
        lat.sort_unstable();
        let us = |ns: u64| ns as f64 / 1e3;
        let avg_us = if lat.is_empty() {
            0.0
        } else {
            lat.iter().sum::<u64>() as f64 / lat.len() as f64 / 1e3
        };
        let sends: u64 = m.windows.iter().map(|w| w.sends).sum();
        let send_ns: u64 = m.windows.iter().map(|w| w.send_ns).sum();
        let recv_us = if ok.is_empty() {
            0.0
        } else {
            ok.iter().map(|s| s.recv_ns).sum::<u64>() as f64 / ok.len() as f64 / 1e3
        };
        let server = m
            .windows
            .iter()
            .fold(ServerDelta::default(), |acc, w| acc.merge(&w.server));
        let per_s = |n: f64| if secs > 0.0 { n / secs } else { 0.0 };
        let generative = generative.then(|| {
            let mut ttft: Vec<u64> = ok
                .iter()
                .filter(|s| s.first_ns > 0)
                .map(|s| s.first_ns - s.start_ns)
                .collect();
            ttft.sort_unstable();
            let mut itl: Vec<u64> = ok
                .iter()
                .filter(|s| s.tokens > s.first_tokens)
                // The gaps after the first response: its tokens came together.
                .map(|s| (s.last_ns - s.first_ns) / (s.tokens - s.first_tokens))
                .collect();
            itl.sort_unstable();
            let tokens: u64 = ok.iter().map(|s| s.tokens).sum();
            let mean = |v: &[u64]| {
                if v.is_empty() {
                    0.0
                } else {
                    v.iter().sum::<u64>() as f64 / v.len() as f64 / 1e6
                }
            };
            GenMetrics {
                ttft_avg_ms: mean(&ttft),
                ttft_p50_ms: percentile_of(&ttft, 50.0) as f64 / 1e6,
                ttft_p99_ms: percentile_of(&ttft, 99.0) as f64 / 1e6,
                itl_avg_ms: mean(&itl),
                itl_p50_ms: percentile_of(&itl, 50.0) as f64 / 1e6,
                itl_p99_ms: percentile_of(&itl, 99.0) as f64 / 1e6,
                output_tokens_per_s: per_s(tokens as f64),
                output_tokens_avg: if ok.is_empty() {
                    0.0
                } else {
                    tokens as f64 / ok.len() as f64
                },
            }
        });
        let (load_v, rate_mode) = match load {
            Load::Concurrency(n) => (*n as f64, false),
            Load::Rate { per_s, .. } => (*per_s, true),
        };
        Point {
            load: load_v,
            rate_mode,
            inferences_per_s: per_s((ok.len() as u64 * batch) as f64),
            requests_per_s: per_s(ok.len() as f64),
            p50_us: us(percentile_of(&lat, 50.0)),
            p90_us: us(percentile_of(&lat, 90.0)),
            p95_us: us(percentile_of(&lat, 95.0)),
            p99_us: us(percentile_of(&lat, 99.0)),
            avg_us,
            client_send_us: if sends == 0 {
                0.0
            } else {
                send_ns as f64 / sends as f64 / 1e3
            },
            client_recv_us: recv_us,
            completed: ok.len() as u64,
            errors: m.windows.iter().map(|w| w.errors).sum(),
            first_error: m.first_error,
            stable: m.stable,
            trials: m.trials,
            sent_rate: m.sent_rate,
            late_share: m.late_share,
            lost: m.lost,
            server,
            composing,
            generative,
        }
    }

    /// The latency the client saw that the server's timers do not account for: the
    /// library's hand-offs (enqueue to queue, batch to callback) in-process. None for a
    /// generative model, whose server times are per iteration, not per request.
    pub fn handoff_us(&self) -> Option<f64> {
        if self.generative.is_some() {
            return None;
        }
        Some(
            (self.avg_us
                - self.client_send_us
                - self.client_recv_us
                - self.server_means().iter().sum::<f64>())
            .max(0.0),
        )
    }

    /// Mean queue, compute input, infer and output microseconds: the model's own, or for
    /// an ensemble the sums over its composing models (a request passes each once).
    pub fn server_means(&self) -> [f64; 4] {
        let of = |d: &ServerDelta| {
            [
                d.queue.mean_us(),
                d.compute_input.mean_us(),
                d.compute_infer.mean_us(),
                d.compute_output.mean_us(),
            ]
        };
        if self.composing.is_empty() {
            return of(&self.server);
        }
        self.composing.iter().fold([0.0; 4], |mut acc, (_, d)| {
            for (a, v) in acc.iter_mut().zip(of(d)) {
                *a += v;
            }
            acc
        })
    }

    pub fn batch_histogram(&self) -> String {
        hist_text(&self.server.batch_sizes)
    }

    /// The latency a budget is compared with, microseconds.
    pub fn latency_at(&self, percentile: Option<f64>) -> f64 {
        match percentile.map(|p| p.round() as u32) {
            Some(50) => self.p50_us,
            Some(90) => self.p90_us,
            Some(95) => self.p95_us,
            None | Some(99) => self.p99_us,
            Some(_) => self.p99_us,
        }
    }
}

pub fn hist_text(h: &BTreeMap<u64, u64>) -> String {
    h.iter()
        .map(|(s, c)| format!("{s}:{c}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The lines printed after each point, as perf_analyzer prints them.
pub fn point_text(p: &Point) -> String {
    let mut s = String::new();
    let what = if p.rate_mode {
        format!("Request rate: {}", trim(p.load))
    } else {
        format!("Concurrency: {}", trim(p.load))
    };
    let _ = writeln!(
        s,
        "{what}{}",
        if p.stable {
            ""
        } else {
            " (not stable: the last three windows are reported)"
        }
    );
    let _ = writeln!(s, "  Client ({} measurement windows):", p.trials);
    let _ = writeln!(s, "    Request count: {}", p.completed);
    let _ = writeln!(
        s,
        "    Throughput: {:.1} infer/sec ({:.1} requests/sec)",
        p.inferences_per_s, p.requests_per_s
    );
    if let Some(r) = p.sent_rate {
        let _ = writeln!(
            s,
            "    Sent: {:.1} requests/sec ({:.1}% more than 1 ms late)",
            r,
            p.late_share * 100.0
        );
    }
    let _ = writeln!(
        s,
        "    Latency: p50 {:.0} usec, p90 {:.0} usec, p95 {:.0} usec, p99 {:.0} usec, avg {:.0} usec",
        p.p50_us, p.p90_us, p.p95_us, p.p99_us, p.avg_us
    );
    let handoff = p.handoff_us().map_or(
        "n/a (the server's times are per iteration)".to_owned(),
        |h| format!("{h:.1} usec"),
    );
    let _ = writeln!(
        s,
        "    Avg latency split: enqueue {:.1} usec, library hand-offs {handoff}, response read {:.1} usec",
        p.client_send_us, p.client_recv_us
    );
    if let Some(g) = &p.generative {
        let _ = writeln!(
            s,
            "    Time to first token: avg {:.2} ms, p50 {:.2} ms, p99 {:.2} ms",
            g.ttft_avg_ms, g.ttft_p50_ms, g.ttft_p99_ms
        );
        let _ = writeln!(
            s,
            "    Inter-token latency: avg {:.2} ms, p50 {:.2} ms, p99 {:.2} ms",
            g.itl_avg_ms, g.itl_p50_ms, g.itl_p99_ms
        );
        let _ = writeln!(
            s,
            "    Output tokens: {:.1} tokens/sec, {:.1} per request",
            g.output_tokens_per_s, g.output_tokens_avg
        );
    }
    if p.errors > 0 {
        let _ = writeln!(
            s,
            "    Errors: {} (first: {})",
            p.errors,
            p.first_error.as_deref().unwrap_or("?")
        );
    }
    if p.lost > 0 {
        let _ = writeln!(s, "    Unanswered after 60 s: {}", p.lost);
    }
    let d = &p.server;
    let _ = writeln!(s, "  Server:");
    let _ = writeln!(
        s,
        "    Inference count: {}, execution count: {}",
        d.inferences, d.executions
    );
    if p.composing.is_empty() {
        let _ = writeln!(
            s,
            "    Avg queue {:.1} usec (per request); compute input {:.1} usec, infer {:.1} usec, output {:.1} usec (per execution)",
            d.queue.mean_us(),
            d.compute_input.mean_us(),
            d.compute_infer.mean_us(),
            d.compute_output.mean_us()
        );
    } else {
        let m = p.server_means();
        let _ = writeln!(
            s,
            "    An ensemble: its steps' averages add up to queue {:.1} usec, compute input {:.1} usec, infer {:.1} usec, output {:.1} usec",
            m[0], m[1], m[2], m[3]
        );
    }
    let _ = writeln!(
        s,
        "    Batch sizes (size:executions): {}",
        p.batch_histogram()
    );
    for (name, d) in &p.composing {
        let _ = writeln!(s, "  Composing model {name}:");
        let _ = writeln!(
            s,
            "    Inference count: {}, execution count: {}, avg queue {:.1} usec; compute input {:.1} usec, infer {:.1} usec, output {:.1} usec",
            d.inferences,
            d.executions,
            d.queue.mean_us(),
            d.compute_input.mean_us(),
            d.compute_infer.mean_us(),
            d.compute_output.mean_us()
        );
        let _ = writeln!(
            s,
            "    Batch sizes (size:executions): {}",
            hist_text(&d.batch_sizes)
        );
    }
    s
}

fn trim(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

/// The summary table of all points.
pub fn table(points: &[Point]) -> String {
    let Some(first) = points.first() else {
        return String::new();
    };
    let generative = first.generative.is_some();
    let mut cols = vec![
        if first.rate_mode {
            "Request rate"
        } else {
            "Concurrency"
        },
        "Infer/s",
        "p50 us",
        "p90 us",
        "p95 us",
        "p99 us",
        "Avg us",
        "Queue us",
        "Input us",
        "Infer us",
        "Output us",
    ];
    if generative {
        cols.extend(["TTFT ms", "ITL ms", "Tokens/s"]);
    }
    cols.push("Batch sizes");
    let mut rows: Vec<Vec<String>> = Vec::new();
    for p in points {
        let server = p.server_means();
        let mut r = vec![
            format!("{}{}", trim(p.load), if p.stable { "" } else { "*" }),
            format!("{:.1}", p.inferences_per_s),
            format!("{:.0}", p.p50_us),
            format!("{:.0}", p.p90_us),
            format!("{:.0}", p.p95_us),
            format!("{:.0}", p.p99_us),
            format!("{:.0}", p.avg_us),
            format!("{:.0}", server[0]),
            format!("{:.0}", server[1]),
            format!("{:.0}", server[2]),
            format!("{:.0}", server[3]),
        ];
        if let Some(g) = &p.generative {
            r.push(format!("{:.2}", g.ttft_avg_ms));
            r.push(format!("{:.2}", g.itl_avg_ms));
            r.push(format!("{:.1}", g.output_tokens_per_s));
        }
        r.push(p.batch_histogram());
        rows.push(r);
    }
    let widths: Vec<usize> = (0..cols.len())
        .map(|i| {
            rows.iter()
                .map(|r| r[i].len())
                .chain([cols[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut s = String::new();
    let line = |cells: Vec<&str>, s: &mut String| {
        let n = cells.len();
        for (i, c) in cells.into_iter().enumerate() {
            if i + 1 == n {
                // The histogram, last, left-aligned.
                let _ = write!(s, "{c}");
            } else {
                let _ = write!(s, "{c:>w$}  ", w = widths[i]);
            }
        }
        s.push('\n');
    };
    line(cols.clone(), &mut s);
    for r in &rows {
        line(r.iter().map(|c| c.as_str()).collect(), &mut s);
    }
    if points.iter().any(|p| !p.stable) {
        s.push_str(
            "* not stable within the stability percentage: the last three windows are reported\n",
        );
    }
    s
}

/// The CSV columns, perf_analyzer's names first (latencies in microseconds).
pub fn csv_header(rate_mode: bool, generative: bool, config_col: bool) -> String {
    let mut c: Vec<&str> = Vec::new();
    if config_col {
        c.push("Config");
    }
    c.push(if rate_mode {
        "Request Rate"
    } else {
        "Concurrency"
    });
    c.extend([
        "Inferences/Second",
        "Client Send",
        "Network+Server Send/Recv",
        "Server Queue",
        "Server Compute Input",
        "Server Compute Infer",
        "Server Compute Output",
        "Client Recv",
        "p50 latency",
        "p90 latency",
        "p95 latency",
        "p99 latency",
        "Avg latency",
        "Requests/Second",
        "Request Count",
        "Errors",
        "Stable",
        "Batch Sizes",
    ]);
    if generative {
        c.extend([
            "Time To First Token Avg (ms)",
            "Time To First Token p50 (ms)",
            "Time To First Token p99 (ms)",
            "Inter Token Latency Avg (ms)",
            "Inter Token Latency p99 (ms)",
            "Output Token Throughput (per sec)",
        ]);
    }
    c.join(",")
}

pub fn csv_row(p: &Point, config: Option<&str>) -> String {
    let mut c: Vec<String> = Vec::new();
    if let Some(cfg) = config {
        c.push(format!("\"{}\"", cfg.replace('"', "\"\"")));
    }
    let f0 = |v: f64| format!("{v:.0}");
    let server = p.server_means();
    c.extend([
        trim(p.load),
        format!("{:.2}", p.inferences_per_s),
        f0(p.client_send_us),
        p.handoff_us().map_or(String::new(), f0),
        f0(server[0]),
        f0(server[1]),
        f0(server[2]),
        f0(server[3]),
        f0(p.client_recv_us),
        f0(p.p50_us),
        f0(p.p90_us),
        f0(p.p95_us),
        f0(p.p99_us),
        f0(p.avg_us),
        format!("{:.2}", p.requests_per_s),
        p.completed.to_string(),
        p.errors.to_string(),
        p.stable.to_string(),
        p.batch_histogram(),
    ]);
    if let Some(g) = &p.generative {
        c.extend([
            format!("{:.3}", g.ttft_avg_ms),
            format!("{:.3}", g.ttft_p50_ms),
            format!("{:.3}", g.ttft_p99_ms),
            format!("{:.3}", g.itl_avg_ms),
            format!("{:.3}", g.itl_p99_ms),
            format!("{:.2}", g.output_tokens_per_s),
        ]);
    }
    c.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_rows_match_the_header() {
        let p = Point {
            load: 4.0,
            stable: true,
            ..Point::default()
        };
        let h = csv_header(false, false, false);
        assert!(h.starts_with(
            "Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue"
        ));
        assert_eq!(h.split(',').count(), csv_row(&p, None).split(',').count());
        let g = Point {
            generative: Some(GenMetrics::default()),
            ..p.clone()
        };
        assert_eq!(
            csv_header(true, true, true).split(',').count(),
            csv_row(&g, Some("max_batch_size=8")).split(',').count()
        );
        assert!(table(&[p]).lines().next().unwrap().contains("Concurrency"));
    }
}
