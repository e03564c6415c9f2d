//! Per model-version statistics: lock-free counters and log-bucketed latency histograms,
//! rendered as JSON and Prometheus text.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Sub-buckets per power of two: bucket error is at most 1/SUB (about 6%).
const SUB: u64 = 16;
const OCTAVES: u64 = 40;

/// A latency histogram in microseconds with percentile estimates.
pub struct Histogram {
    buckets: Box<[AtomicU64]>,
    count: AtomicU64,
    total: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: (0..(SUB * OCTAVES)).map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            total: AtomicU64::new(0),
        }
    }
}

fn bucket_of(v: u64) -> usize {
    if v < SUB {
        return v as usize;
    }
    let octave = 63 - v.leading_zeros() as u64; // >= 4
    let shift = octave - 4;
    let sub = (v >> shift) - SUB; // 0..SUB
    (((octave - 3) * SUB + sub) as usize).min((SUB * OCTAVES - 1) as usize)
}

/// Upper bound of the values in a bucket (inclusive).
fn bucket_upper(b: usize) -> u64 {
    let b = b as u64;
    if b < SUB {
        return b;
    }
    let octave = b / SUB + 3;
    let sub = b % SUB;
    let shift = octave - 4;
    ((SUB + sub + 1) << shift) - 1
}

impl Histogram {
    pub fn record(&self, us: u64) {
        self.buckets[bucket_of(us)].fetch_add(1, Relaxed);
        self.count.fetch_add(1, Relaxed);
        self.total.fetch_add(us, Relaxed);
    }
    pub fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }
    pub fn total(&self) -> u64 {
        self.total.load(Relaxed)
    }
    pub fn percentile(&self, p: f64) -> u64 {
        let n = self.count();
        if n == 0 {
            return 0;
        }
        let rank = ((p * n as f64).ceil() as u64).clamp(1, n);
        let mut seen = 0;
        for (i, b) in self.buckets.iter().enumerate() {
            seen += b.load(Relaxed);
            if seen >= rank {
                return bucket_upper(i);
            }
        }
        bucket_upper(self.buckets.len() - 1)
    }
    pub(crate) fn json(&self) -> String {
        format!(
            "{{\"count\":{},\"total\":{},\"p50\":{},\"p99\":{}}}",
            self.count(),
            self.total(),
            self.percentile(0.50),
            self.percentile(0.99)
        )
    }
}

/// Counters of one model version.
pub struct ModelStats {
    pub inference_count: AtomicU64,
    pub execution_count: AtomicU64,
    pub success_count: AtomicU64,
    pub failure_count: AtomicU64,
    pub queue_us: Histogram,
    pub compute_us: Histogram,
    /// An execution's phases, as Triton's compute input / infer / output: assembling the
    /// batch's inputs, the backend's execution, and splitting its outputs into responses.
    pub compute_input_us: Histogram,
    pub compute_infer_us: Histogram,
    pub compute_output_us: Histogram,
    /// Index = executed batch size.
    batch_sizes: Box<[AtomicU64]>,
    /// The response cache (when the model uses it): lookups that hit (their time), and
    /// lookups that missed (lookup and insertion time).
    pub cache_enabled: std::sync::atomic::AtomicBool,
    pub cache_hit_us: Histogram,
    pub cache_miss_us: Histogram,
}

impl ModelStats {
    pub fn new(max_batch_size: u32) -> ModelStats {
        ModelStats {
            inference_count: AtomicU64::new(0),
            execution_count: AtomicU64::new(0),
            success_count: AtomicU64::new(0),
            failure_count: AtomicU64::new(0),
            queue_us: Histogram::default(),
            compute_us: Histogram::default(),
            compute_input_us: Histogram::default(),
            compute_infer_us: Histogram::default(),
            compute_output_us: Histogram::default(),
            batch_sizes: (0..=max_batch_size.max(1) as usize)
                .map(|_| AtomicU64::new(0))
                .collect(),
            cache_enabled: std::sync::atomic::AtomicBool::new(false),
            cache_hit_us: Histogram::default(),
            cache_miss_us: Histogram::default(),
        }
    }

    /// One execution of `batch_size` rows that holds `inferences` inferences (the rows of
    /// its requests: Triton's `inference_count`).
    pub fn record_execution(&self, batch_size: u32, inferences: u64, compute_us: u64) {
        self.execution_count.fetch_add(1, Relaxed);
        self.inference_count.fetch_add(inferences, Relaxed);
        self.compute_us.record(compute_us);
        let i = (batch_size as usize).min(self.batch_sizes.len() - 1);
        self.batch_sizes[i].fetch_add(1, Relaxed);
    }

    /// The phases of one execution (see `compute_input_us`); a wait for the rate limiter
    /// between the first two is in none of them.
    pub fn record_phases(&self, input: Duration, infer: Duration, output: Duration) {
        self.compute_input_us.record(input.as_micros() as u64);
        self.compute_infer_us.record(infer.as_micros() as u64);
        self.compute_output_us.record(output.as_micros() as u64);
    }

    /// (executed size, count) for every size seen.
    pub fn batch_sizes(&self) -> Vec<(usize, u64)> {
        self.batch_sizes
            .iter()
            .enumerate()
            .map(|(s, c)| (s, c.load(Relaxed)))
            .filter(|(_, c)| *c > 0)
            .collect()
    }

    pub fn json(&self, name: &str, version: i64, pending: usize) -> String {
        let sizes: Vec<String> = self
            .batch_sizes()
            .iter()
            .map(|(s, c)| format!("{{\"size\":{s},\"count\":{c}}}"))
            .collect();
        let cache = if self.cache_enabled.load(Relaxed) {
            format!(
                ",\"cache_hit_us\":{},\"cache_miss_us\":{}",
                self.cache_hit_us.json(),
                self.cache_miss_us.json()
            )
        } else {
            String::new()
        };
        format!(
            "{{\"name\":{},\"version\":{version},\"inference_count\":{},\"execution_count\":{},\"success_count\":{},\"failure_count\":{},\"queue_us\":{},\"compute_us\":{},\"compute_input_us\":{},\"compute_infer_us\":{},\"compute_output_us\":{},\"batch_sizes\":[{}],\"pending\":{pending}{cache}}}",
            serde_json::Value::String(name.to_owned()),
            self.inference_count.load(Relaxed),
            self.execution_count.load(Relaxed),
            self.success_count.load(Relaxed),
            self.failure_count.load(Relaxed),
            self.queue_us.json(),
            self.compute_us.json(),
            self.compute_input_us.json(),
            self.compute_infer_us.json(),
            self.compute_output_us.json(),
            sizes.join(",")
        )
    }

    /// Appends this version's samples, labelled with `labels` (see [`labels`]), to
    /// Prometheus families (name -> lines).
    pub fn prometheus(&self, out: &mut PromText, labels: &str, pending: usize) {
        let c = |a: &AtomicU64| a.load(Relaxed);
        out.sample(
            "infer_request_success_total",
            "counter",
            "Requests that ended successfully",
            labels,
            c(&self.success_count),
        );
        out.sample(
            "infer_request_failure_total",
            "counter",
            "Requests that ended with an error",
            labels,
            c(&self.failure_count),
        );
        out.sample(
            "infer_inference_count_total",
            "counter",
            "Requests executed (padding excluded)",
            labels,
            c(&self.inference_count),
        );
        out.sample(
            "infer_execution_total",
            "counter",
            "Backend executions",
            labels,
            c(&self.execution_count),
        );
        out.sample(
            "infer_queue_duration_us_total",
            "counter",
            "Microseconds requests spent queued",
            labels,
            self.queue_us.total(),
        );
        out.sample(
            "infer_compute_duration_us_total",
            "counter",
            "Microseconds spent in backend executions",
            labels,
            self.compute_us.total(),
        );
        for (phase, h) in [
            ("input", &self.compute_input_us),
            ("infer", &self.compute_infer_us),
            ("output", &self.compute_output_us),
        ] {
            out.sample(
                &format!("infer_compute_{phase}_duration_us_total"),
                "counter",
                &format!("Microseconds spent in the {phase} phase of executions"),
                labels,
                h.total(),
            );
        }
        if self.cache_enabled.load(Relaxed) {
            out.sample(
                "infer_cache_hit_total",
                "counter",
                "Requests answered from the response cache",
                labels,
                self.cache_hit_us.count(),
            );
            out.sample(
                "infer_cache_miss_total",
                "counter",
                "Response cache lookups that missed",
                labels,
                self.cache_miss_us.count(),
            );
            out.sample(
                "infer_cache_hit_duration_us_total",
                "counter",
                "Microseconds spent on response cache hits",
                labels,
                self.cache_hit_us.total(),
            );
            out.sample(
                "infer_cache_miss_duration_us_total",
                "counter",
                "Microseconds spent on response cache misses (lookup and insertion)",
                labels,
                self.cache_miss_us.total(),
            );
        }
        out.sample(
            "infer_pending_requests",
            "gauge",
            "Requests queued and not yet executing",
            labels,
            pending as u64,
        );
        let mut cum = 0;
        let sizes = self.batch_sizes();
        let mut sum = 0;
        for (s, n) in &sizes {
            cum += n;
            sum += *s as u64 * n;
            out.sample(
                "infer_batch_size",
                "histogram",
                "Executed batch sizes",
                &format!("{labels},le=\"{s}\""),
                cum,
            );
        }
        out.sample(
            "infer_batch_size",
            "histogram",
            "Executed batch sizes",
            &format!("{labels},le=\"+Inf\""),
            cum,
        );
        out.suffixed("infer_batch_size", "_sum", labels, sum);
        out.suffixed("infer_batch_size", "_count", labels, cum);
    }
}

/// The GPU times of one batch, in nanoseconds of stream time between its timing events
/// (see `backend::gpu_instance`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchTimes {
    /// Before the input copies to after them.
    pub h2d_ns: u64,
    /// After the input copies to after the backend's work.
    pub compute_ns: u64,
    /// After the backend's work to after the output copies.
    pub d2h_ns: u64,
    /// First event to last.
    pub busy_ns: u64,
}

/// Data-path counters of one model instance on a GPU: batches, bytes copied, and stream
/// time measured with CUDA events. Lock-free; read without a lock, so figures read while
/// a batch completes may be one batch apart.
pub struct GpuInstanceStats {
    device: i32,
    timed_batches: AtomicU64,
    untimed_batches: AtomicU64,
    h2d_copies: AtomicU64,
    h2d_bytes: AtomicU64,
    d2d_copies: AtomicU64,
    d2d_bytes: AtomicU64,
    d2h_copies: AtomicU64,
    d2h_bytes: AtomicU64,
    h2d_ns: AtomicU64,
    compute_ns: AtomicU64,
    d2h_ns: AtomicU64,
    busy_ns: AtomicU64,
    /// When the instance started its first batch (host clock).
    first_batch: std::sync::OnceLock<std::time::Instant>,
}

impl GpuInstanceStats {
    pub fn new(device: i32) -> GpuInstanceStats {
        let z = || AtomicU64::new(0);
        GpuInstanceStats {
            device,
            timed_batches: z(),
            untimed_batches: z(),
            h2d_copies: z(),
            h2d_bytes: z(),
            d2d_copies: z(),
            d2d_bytes: z(),
            d2h_copies: z(),
            d2h_bytes: z(),
            h2d_ns: z(),
            compute_ns: z(),
            d2h_ns: z(),
            busy_ns: z(),
            first_batch: std::sync::OnceLock::new(),
        }
    }

    pub fn device(&self) -> i32 {
        self.device
    }

    /// A batch starts (the first one starts the wall clock).
    pub fn batch_started(&self) {
        self.first_batch.get_or_init(std::time::Instant::now);
    }

    /// A host-to-device copy of `bytes` was queued.
    pub fn h2d(&self, bytes: usize) {
        self.h2d_copies.fetch_add(1, Relaxed);
        self.h2d_bytes.fetch_add(bytes as u64, Relaxed);
    }

    /// A device-to-device copy of an input already in device memory was queued.
    pub fn d2d(&self, bytes: usize) {
        self.d2d_copies.fetch_add(1, Relaxed);
        self.d2d_bytes.fetch_add(bytes as u64, Relaxed);
    }

    /// A device-to-host copy of `bytes` was queued.
    pub fn d2h(&self, bytes: usize) {
        self.d2h_copies.fetch_add(1, Relaxed);
        self.d2h_bytes.fetch_add(bytes as u64, Relaxed);
    }

    /// A batch's work has completed: with its times, or None when it could not be timed.
    pub fn batch_done(&self, times: Option<BatchTimes>) {
        let Some(t) = times else {
            self.untimed_batches.fetch_add(1, Relaxed);
            return;
        };
        self.h2d_ns.fetch_add(t.h2d_ns, Relaxed);
        self.compute_ns.fetch_add(t.compute_ns, Relaxed);
        self.d2h_ns.fetch_add(t.d2h_ns, Relaxed);
        self.busy_ns.fetch_add(t.busy_ns, Relaxed);
        self.timed_batches.fetch_add(1, Relaxed);
    }

    /// This instance's counters as Prometheus samples, labelled with the model's `labels`,
    /// the instance and its device.
    pub fn prometheus(&self, out: &mut PromText, labels: &str, instance: usize) {
        let c = |a: &AtomicU64| a.load(Relaxed);
        let l = format!(
            "{labels},instance=\"{instance}\",device=\"{}\"",
            self.device
        );
        out.sample(
            "infer_gpu_batches_total",
            "counter",
            "Batches a GPU instance ran (timed and untimed).",
            &l,
            c(&self.timed_batches) + c(&self.untimed_batches),
        );
        for (dir, copies, bytes) in [
            ("h2d", &self.h2d_copies, &self.h2d_bytes),
            ("d2d", &self.d2d_copies, &self.d2d_bytes),
            ("d2h", &self.d2h_copies, &self.d2h_bytes),
        ] {
            let ld = format!("{l},direction=\"{dir}\"");
            out.sample(
                "infer_gpu_copies_total",
                "counter",
                "Copies a GPU instance queued for batch inputs and outputs, by direction.",
                &ld,
                c(copies),
            );
            out.sample(
                "infer_gpu_copy_bytes_total",
                "counter",
                "Bytes a GPU instance copied for batch inputs and outputs, by direction.",
                &ld,
                c(bytes),
            );
        }
        for (phase, ns) in [
            ("h2d", &self.h2d_ns),
            ("compute", &self.compute_ns),
            ("d2h", &self.d2h_ns),
            ("busy", &self.busy_ns),
        ] {
            out.sample(
                "infer_gpu_stream_ns_total",
                "counter",
                "Stream time of a GPU instance's timed batches (CUDA events), by phase; busy is first to last event.",
                &format!("{l},phase=\"{phase}\""),
                c(ns),
            );
        }
    }

    /// This instance's figures as a JSON object (`instance` is its index in the model).
    pub fn json(&self, instance: usize) -> String {
        let c = |a: &AtomicU64| a.load(Relaxed);
        let (timed, untimed) = (c(&self.timed_batches), c(&self.untimed_batches));
        let (h2d, compute, d2h, busy) = (
            c(&self.h2d_ns),
            c(&self.compute_ns),
            c(&self.d2h_ns),
            c(&self.busy_ns),
        );
        let wall = self
            .first_batch
            .get()
            .map_or(0, |t| t.elapsed().as_nanos() as u64);
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        format!(
            "{{\"instance\":{instance},\"device\":{},\"batches\":{},\"timed_batches\":{timed},\"untimed_batches\":{untimed},\"h2d_copies\":{},\"h2d_bytes\":{},\"d2d_copies\":{},\"d2d_bytes\":{},\"d2h_copies\":{},\"d2h_bytes\":{},\"h2d_ns\":{h2d},\"compute_ns\":{compute},\"d2h_ns\":{d2h},\"busy_ns\":{busy},\"wall_ns\":{wall},\"busy_fraction\":{:.6},\"copy_share\":{:.6}}}",
            self.device,
            timed + untimed,
            c(&self.h2d_copies),
            c(&self.h2d_bytes),
            c(&self.d2d_copies),
            c(&self.d2d_bytes),
            c(&self.d2h_copies),
            c(&self.d2h_bytes),
            // Clamped like the share below; busy_ns and wall_ns are as measured.
            ratio(busy, wall).min(1.0),
            // Each part is its own elapsed time: their sum may pass the whole by a rounding.
            ratio(h2d + d2h, busy).min(1.0),
        )
    }
}

/// The labels of one model version's samples.
pub fn labels(name: &str, version: i64) -> String {
    format!("model=\"{}\",version=\"{version}\"", escape_label(name))
}

/// [`labels`] followed by a model's `metric_tags` (label names checked at load).
pub fn labels_tagged(name: &str, version: i64, tags: &[(String, String)]) -> String {
    let mut l = labels(name, version);
    for (k, v) in tags {
        l.push_str(&format!(",{k}=\"{}\"", escape_label(v)));
    }
    l
}

fn escape_label(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Prometheus text exposition, grouped by metric family.
#[derive(Default)]
pub struct PromText {
    families: Vec<(String, String, String, Vec<String>)>,
}

impl PromText {
    fn family(&mut self, name: &str, kind: &str, help: &str) -> &mut Vec<String> {
        let i = match self.families.iter().position(|f| f.0 == name) {
            Some(i) => i,
            None => {
                self.families.push((
                    name.to_owned(),
                    kind.to_owned(),
                    help.to_owned(),
                    Vec::new(),
                ));
                self.families.len() - 1
            }
        };
        &mut self.families[i].3
    }
    pub(crate) fn sample(&mut self, name: &str, kind: &str, help: &str, labels: &str, v: u64) {
        let metric = if kind == "histogram" {
            format!("{name}_bucket")
        } else {
            name.to_owned()
        };
        self.family(name, kind, help)
            .push(format!("{metric}{{{labels}}} {v}"));
    }
    fn suffixed(&mut self, name: &str, suffix: &str, labels: &str, v: u64) {
        self.family(name, "histogram", "")
            .push(format!("{name}{suffix}{{{labels}}} {v}"));
    }
    pub fn render(&self) -> String {
        let mut s = String::new();
        for (name, kind, help, lines) in &self.families {
            let _ = writeln!(s, "# HELP {name} {help}");
            let _ = writeln!(s, "# TYPE {name} {kind}");
            for l in lines {
                let _ = writeln!(s, "{l}");
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_monotonic_and_tight() {
        let mut last = 0;
        for v in [0u64, 1, 15, 16, 17, 31, 32, 100, 1000, 12345, 1 << 30] {
            let b = bucket_of(v);
            assert!(b >= last);
            last = b;
            let up = bucket_upper(b);
            assert!(up >= v, "v={v} upper={up}");
            assert!(up as f64 <= v as f64 * 1.07 + 1.0, "v={v} upper={up}");
        }
    }

    #[test]
    fn percentiles() {
        let h = Histogram::default();
        for v in 1..=100 {
            h.record(v);
        }
        assert_eq!(h.count(), 100);
        assert_eq!(h.total(), 5050);
        let p50 = h.percentile(0.5);
        assert!((50..=53).contains(&p50), "{p50}");
        let p99 = h.percentile(0.99);
        assert!((99..=103).contains(&p99), "{p99}");
    }

    #[test]
    fn gpu_instance_prometheus() {
        let g = GpuInstanceStats::new(2);
        g.batch_started();
        g.h2d(10);
        g.d2h(4);
        g.d2h(4);
        g.batch_done(Some(BatchTimes {
            h2d_ns: 5,
            compute_ns: 7,
            d2h_ns: 3,
            busy_ns: 15,
        }));
        g.batch_done(None);
        let mut p = PromText::default();
        g.prometheus(&mut p, &labels("m", 1), 0);
        let t = p.render();
        let l = "model=\"m\",version=\"1\",instance=\"0\",device=\"2\"";
        for line in [
            format!("infer_gpu_batches_total{{{l}}} 2"),
            format!("infer_gpu_copies_total{{{l},direction=\"h2d\"}} 1"),
            format!("infer_gpu_copy_bytes_total{{{l},direction=\"d2h\"}} 8"),
            format!("infer_gpu_copies_total{{{l},direction=\"d2d\"}} 0"),
            format!("infer_gpu_stream_ns_total{{{l},phase=\"compute\"}} 7"),
            format!("infer_gpu_stream_ns_total{{{l},phase=\"busy\"}} 15"),
        ] {
            assert!(t.lines().any(|x| x == line), "{line} missing from:\n{t}");
        }
        assert_eq!(
            t.matches("# TYPE infer_gpu_stream_ns_total counter")
                .count(),
            1
        );
    }

    #[test]
    fn gpu_instance_json() {
        let g = GpuInstanceStats::new(1);
        let j: serde_json::Value = serde_json::from_str(&g.json(3)).unwrap();
        assert_eq!(
            (j["instance"].as_u64(), j["device"].as_u64()),
            (Some(3), Some(1))
        );
        assert_eq!(
            (j["batches"].as_u64(), j["wall_ns"].as_u64()),
            (Some(0), Some(0))
        );
        assert_eq!(j["busy_fraction"].as_f64(), Some(0.0));
        g.batch_started();
        g.h2d(16);
        g.h2d(48);
        g.d2d(8);
        g.d2h(32);
        let t = BatchTimes {
            h2d_ns: 100,
            compute_ns: 600,
            d2h_ns: 300,
            busy_ns: 1000,
        };
        g.batch_done(Some(t));
        g.batch_done(None);
        g.batch_done(Some(t));
        std::thread::sleep(std::time::Duration::from_millis(1));
        let j: serde_json::Value = serde_json::from_str(&g.json(0)).unwrap();
        let u = |k: &str| j[k].as_u64().unwrap();
        assert_eq!(
            (u("batches"), u("timed_batches"), u("untimed_batches")),
            (3, 2, 1)
        );
        assert_eq!((u("h2d_copies"), u("h2d_bytes")), (2, 64));
        assert_eq!((u("d2d_copies"), u("d2d_bytes")), (1, 8));
        assert_eq!((u("d2h_copies"), u("d2h_bytes")), (1, 32));
        assert_eq!(
            (u("h2d_ns"), u("compute_ns"), u("d2h_ns"), u("busy_ns")),
            (200, 1200, 600, 2000)
        );
        assert!(u("wall_ns") >= 1_000_000);
        let busy_fraction = j["busy_fraction"].as_f64().unwrap();
        assert!(busy_fraction > 0.0 && busy_fraction <= 2000.0 / 1e6);
        assert_eq!(j["copy_share"].as_f64(), Some(0.4));
    }

    #[test]
    fn prometheus_text() {
        let s = ModelStats::new(8);
        s.record_execution(4, 4, 10);
        s.record_execution(8, 8, 10);
        s.success_count.fetch_add(12, Relaxed);
        let mut p = PromText::default();
        s.prometheus(&mut p, &labels("m", 1), 0);
        let t = p.render();
        assert!(t.contains("infer_request_success_total{model=\"m\",version=\"1\"} 12"));
        assert!(t.contains("infer_batch_size_bucket{model=\"m\",version=\"1\",le=\"4\"} 1"));
        assert!(t.contains("infer_batch_size_bucket{model=\"m\",version=\"1\",le=\"8\"} 2"));
        assert!(t.contains("infer_batch_size_count{model=\"m\",version=\"1\"} 2"));
        assert!(t.contains("infer_batch_size_sum{model=\"m\",version=\"1\"} 12"));
        assert_eq!(t.matches("# TYPE infer_batch_size histogram").count(), 1);
    }
}
