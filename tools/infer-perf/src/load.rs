//! Load generation and measurement: a closed loop of N requests in flight
//! (concurrency) or requests sent on a schedule (request rate, constant or Poisson),
//! measured in windows until three in a row agree (perf_analyzer's stability rule).

use crate::capi::{self, Server};
use crate::inputs::{build, DataSet, ModelInfo};
use crate::stats::{ServerDelta, ServerSnapshot};
use parking_lot::Mutex;
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Nanoseconds since the tool started (one clock for every thread).
pub fn now_ns() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    BASE.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// One finished request.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sample {
    pub start_ns: u64,
    pub end_ns: u64,
    /// How long reading the final response took.
    pub recv_ns: u64,
    pub ok: bool,
    /// Tokens received (generative models): elements of the counted output.
    pub tokens: u64,
    /// When the first and the last responses carrying tokens arrived, and how many
    /// tokens the first one carried.
    pub first_ns: u64,
    pub last_ns: u64,
    pub first_tokens: u64,
    pub responses: u32,
}

/// How requests are sent.
#[derive(Clone, Debug, PartialEq)]
pub enum Load {
    Concurrency(usize),
    /// Requests per second; Poisson arrivals when `poisson`.
    Rate {
        per_s: f64,
        poisson: bool,
    },
}

/// Settings of a run that do not change between load points.
#[derive(Clone, Debug)]
pub struct Settings {
    pub measurement_ms: u64,
    pub stability_pct: f64,
    pub max_trials: usize,
    /// Latency percentile the stability rule compares (None: the average).
    pub percentile: Option<f64>,
    pub sequence_length: usize,
    pub num_sequences: usize,
    /// Generative models: tokens to generate per request.
    pub output_tokens: i64,
    pub batch_size: u64,
}

/// One sequence a slot is sending.
#[derive(Clone, Copy, Default)]
struct SeqState {
    corr: u64,
    stream: usize,
    pos: usize,
}

/// State shared by the tool's threads and the response callbacks of one load point.
pub struct Run {
    server: Arc<Server>,
    model: String,
    data: Arc<DataSet>,
    /// (stream, step) of every request's inputs, used in turn without sequences.
    flat: Vec<(usize, usize)>,
    sequence: bool,
    generative: bool,
    count_output: Option<CString>,
    settings: Settings,
    closed_loop: bool,
    stop: AtomicBool,
    outstanding: AtomicUsize,
    samples: Mutex<Vec<Sample>>,
    errors: AtomicU64,
    first_error: Mutex<Option<String>>,
    next_step: AtomicUsize,
    next_stream: AtomicUsize,
    seqs: Vec<Mutex<SeqState>>,
    /// Closed-loop slots whose last enqueue failed, retried by the measuring thread.
    idle: Mutex<Vec<usize>>,
}

/// One request in flight; the callback's user data.
struct Flight {
    run: Arc<Run>,
    slot: usize,
    sample: Sample,
}

const STREAMING: &std::ffi::CStr = c"streaming";
const MAX_TOKENS: &std::ffi::CStr = c"max_tokens";
const IGNORE_EOS: &std::ffi::CStr = c"ignore_eos";

impl Run {
    pub fn new(
        server: Arc<Server>,
        model: &ModelInfo,
        data: Arc<DataSet>,
        settings: Settings,
        load: &Load,
    ) -> Arc<Run> {
        let flat = data.flat();
        let slots = match load {
            Load::Concurrency(n) => *n,
            Load::Rate { .. } => settings.num_sequences.max(1),
        };
        Arc::new(Run {
            server,
            model: model.name.clone(),
            data,
            flat,
            sequence: model.sequence,
            generative: model.generative,
            count_output: model.generative.then(|| c"output_ids".to_owned()),
            settings,
            closed_loop: matches!(load, Load::Concurrency(_)),
            stop: AtomicBool::new(false),
            outstanding: AtomicUsize::new(0),
            samples: Mutex::new(Vec::new()),
            errors: AtomicU64::new(0),
            first_error: Mutex::new(None),
            next_step: AtomicUsize::new(0),
            next_stream: AtomicUsize::new(0),
            seqs: (0..slots)
                .map(|_| Mutex::new(SeqState::default()))
                .collect(),
            idle: Mutex::new(Vec::new()),
        })
    }

    fn error(&self, e: String) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        let mut f = self.first_error.lock();
        if f.is_none() {
            *f = Some(e);
        }
    }

    /// Whether slot `slot` is inside a sequence (one must not stop there: an open
    /// sequence would hold a slot of the model's sequence batcher).
    fn mid_sequence(&self, slot: usize) -> bool {
        self.sequence && self.seqs.get(slot).is_some_and(|s| s.lock().pos != 0)
    }

    /// Sends the next request of `slot`; false when it could not be sent (a sequence's
    /// position is then as it was: the step is sent again on the next try). Only one
    /// thread issues for a slot at a time: its callback, or the measuring thread for an
    /// idle slot, in a closed loop; the pacer in request-rate mode.
    fn issue(self: &Arc<Self>, slot: usize) -> bool {
        let mut undo: Option<SeqState> = None;
        let built = (|| {
            let mut r;
            if self.sequence {
                let mut st = self.seqs[slot % self.seqs.len()].lock();
                undo = Some(*st);
                if st.pos == 0 {
                    // Correlation IDs are never reused in a process: a sequence of an
                    // earlier point cannot be continued by mistake.
                    st.corr = NEXT_CORRELATION_ID.fetch_add(1, Ordering::Relaxed);
                    st.stream =
                        self.next_stream.fetch_add(1, Ordering::Relaxed) % self.data.streams.len();
                }
                let stream = &self.data.streams[st.stream];
                // A stream of one step (synthetic data) repeats it for the sequence length.
                let len = if stream.len() == 1 {
                    self.settings.sequence_length.max(1)
                } else {
                    stream.len()
                };
                let step = &stream[st.pos.min(stream.len() - 1)];
                r = build(&self.server, &self.model, step)?;
                let mut flags = 0;
                if st.pos == 0 {
                    flags |= capi::SEQUENCE_START;
                }
                if st.pos + 1 >= len {
                    flags |= capi::SEQUENCE_END;
                    st.pos = 0;
                } else {
                    st.pos += 1;
                }
                r.sequence(st.corr, flags)?;
            } else {
                let i = self.next_step.fetch_add(1, Ordering::Relaxed) % self.flat.len();
                let (st, step) = self.flat[i];
                r = build(&self.server, &self.model, &self.data.streams[st][step])?;
            }
            if self.generative {
                r.param_bool(STREAMING, true)?;
                r.param_int(MAX_TOKENS, self.settings.output_tokens)?;
                r.param_bool(IGNORE_EOS, true)?;
            }
            Ok::<_, String>(r)
        })();
        let r = match built {
            Ok(r) => r,
            Err(e) => {
                self.error(e);
                return false;
            }
        };
        self.outstanding.fetch_add(1, Ordering::SeqCst);
        let start = now_ns();
        let flight = Box::into_raw(Box::new(Flight {
            run: self.clone(),
            slot,
            sample: Sample {
                start_ns: start,
                ok: true,
                ..Sample::default()
            },
        }));
        // SAFETY: `flight` stays alive until the FINAL response, whose callback frees it;
        // on failure the callback is never called and it is freed here.
        let sent = unsafe { self.server.enqueue(r, Some(on_response), flight.cast()) };
        let send_ns = now_ns() - start;
        match sent {
            Ok(()) => {
                // The callback may have run already: only the atomics are touched now.
                SEND_NS.fetch_add(send_ns, Ordering::Relaxed);
                SENDS.fetch_add(1, Ordering::Relaxed);
                true
            }
            Err((_, e)) => {
                // SAFETY: not enqueued, so still ours.
                drop(unsafe { Box::from_raw(flight) });
                if let Some(u) = undo {
                    *self.seqs[slot % self.seqs.len()].lock() = u;
                }
                self.outstanding.fetch_sub(1, Ordering::SeqCst);
                // A full queue (RESOURCE_EXHAUSTED) is back-pressure: counted as an
                // error; a closed-loop slot is retried.
                self.error(format!("enqueue: {e}"));
                false
            }
        }
    }
}

static NEXT_CORRELATION_ID: AtomicU64 = AtomicU64::new(1);

/// Enqueue times are summed apart from the samples: the FINAL response can arrive
/// before `infer_server_enqueue` returns.
static SEND_NS: AtomicU64 = AtomicU64::new(0);
static SENDS: AtomicU64 = AtomicU64::new(0);

/// SAFETY: called by the library with the user data of `Run::issue` (a live `Flight`)
/// and a response the callee owns.
unsafe extern "C" fn on_response(ud: *mut c_void, resp: *mut infer::request::Response, flags: u32) {
    let f = ud.cast::<Flight>();
    let now = now_ns();
    // SAFETY: the responses of one request are delivered one at a time.
    let fl = &mut *f;
    let count = fl.run.count_output.as_deref();
    let answer = capi::read_response(resp, count);
    fl.sample.responses += 1;
    if answer.counted > 0 {
        if fl.sample.first_ns == 0 {
            fl.sample.first_ns = now;
            fl.sample.first_tokens = answer.counted as u64;
        }
        fl.sample.last_ns = now;
        fl.sample.tokens += answer.counted as u64;
    }
    if let Some(e) = answer.error {
        fl.sample.ok = false;
        fl.run.error(e);
    }
    if flags & capi::FINAL == 0 {
        return;
    }
    // SAFETY: the FINAL response is the last call for this request.
    let fl = *Box::from_raw(f);
    let mut sample = fl.sample;
    // The request ends when the client has read its answer.
    sample.end_ns = now_ns();
    sample.recv_ns = sample.end_ns - now;
    let run = fl.run;
    run.samples.lock().push(sample);
    // The next request is sent before this one stops counting as outstanding, so that a
    // drain never sees zero while a slot still has a step to send.
    if run.closed_loop
        && (!run.stop.load(Ordering::SeqCst) || run.mid_sequence(fl.slot))
        && !run.issue(fl.slot)
    {
        run.idle.lock().push(fl.slot);
    }
    run.outstanding.fetch_sub(1, Ordering::SeqCst);
}

/// The measurements of one window.
#[derive(Debug, Default, Clone)]
pub struct Window {
    pub secs: f64,
    pub samples: Vec<Sample>,
    pub errors: u64,
    pub server: ServerDelta,
    /// An ensemble's composing models, in `ModelInfo::composing` order.
    pub composing: Vec<ServerDelta>,
    pub send_ns: u64,
    pub sends: u64,
}

impl Window {
    /// Successful inferences per second.
    pub fn throughput(&self, batch: u64) -> f64 {
        let ok = self.samples.iter().filter(|s| s.ok).count() as u64;
        if self.secs > 0.0 {
            (ok * batch) as f64 / self.secs
        } else {
            0.0
        }
    }

    /// The latency the stability rule compares, in microseconds.
    pub fn latency(&self, percentile: Option<f64>) -> f64 {
        let mut l: Vec<u64> = self
            .samples
            .iter()
            .filter(|s| s.ok)
            .map(|s| s.end_ns - s.start_ns)
            .collect();
        if l.is_empty() {
            return 0.0;
        }
        match percentile {
            Some(p) => {
                l.sort_unstable();
                percentile_of(&l, p) as f64 / 1e3
            }
            None => l.iter().sum::<u64>() as f64 / l.len() as f64 / 1e3,
        }
    }
}

/// The `p`-th percentile (0..=100) of sorted values, nearest rank.
pub fn percentile_of(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// perf_analyzer's rule: the last three windows are stable when each one's throughput
/// and latency are within `pct` percent of the three's average.
pub fn stable(windows: &[(f64, f64)], pct: f64) -> bool {
    if windows.len() < 3 {
        return false;
    }
    let last = &windows[windows.len() - 3..];
    let within = |vals: [f64; 3]| {
        let avg = vals.iter().sum::<f64>() / 3.0;
        if avg <= 0.0 {
            return vals.iter().all(|v| *v == 0.0);
        }
        vals.iter().all(|v| ((v - avg) / avg).abs() * 100.0 <= pct)
    };
    within([last[0].0, last[1].0, last[2].0]) && within([last[0].1, last[1].1, last[2].1])
}

/// What a load point measured: its last three windows (or fewer, unstable).
pub struct Measured {
    pub windows: Vec<Window>,
    pub stable: bool,
    pub trials: usize,
    pub first_error: Option<String>,
    /// Request rate mode: the rate achieved and the share of requests sent more than a
    /// millisecond late.
    pub sent_rate: Option<f64>,
    pub late_share: f64,
    /// Requests still unanswered when the point ended (after the drain timeout).
    pub lost: usize,
}

/// Progress of a point, for the display.
pub trait Progress {
    fn window(&self, trial: usize, throughput: f64, latency_us: f64);
}

/// Runs one load point until stable (or `max_trials` windows) and returns its
/// measurements. The first window is warm-up and is not counted.
pub fn measure(
    server: &Arc<Server>,
    model: &ModelInfo,
    data: &Arc<DataSet>,
    settings: &Settings,
    load: &Load,
    progress: &dyn Progress,
) -> Result<Measured, String> {
    let run = Run::new(server.clone(), model, data.clone(), settings.clone(), load);
    let interval = Duration::from_millis(settings.measurement_ms.max(10));
    let late = Arc::new(AtomicU64::new(0));
    let sent = Arc::new(AtomicU64::new(0));
    let pacer = match load {
        Load::Concurrency(n) => {
            for slot in 0..*n {
                if !run.issue(slot) {
                    run.idle.lock().push(slot);
                }
            }
            None
        }
        Load::Rate { per_s, poisson } => {
            if !(*per_s > 0.0 && per_s.is_finite()) {
                return Err(format!("request rate {per_s} must be above 0"));
            }
            let (run, per_s, poisson) = (run.clone(), *per_s, *poisson);
            let (late, sent) = (late.clone(), sent.clone());
            Some(std::thread::spawn(move || {
                pace(&run, per_s, poisson, &late, &sent)
            }))
        }
    };
    let model_name = model.name.as_str();
    let snapshot = || -> Result<Vec<ServerSnapshot>, String> {
        std::iter::once(model_name)
            .chain(model.composing.iter().map(String::as_str))
            .map(|m| ServerSnapshot::take(server, m))
            .collect()
    };
    let mut windows: Vec<Window> = Vec::new();
    let mut trials = 0;
    let mut stable_now = false;
    let mut sent_at_start = 0;
    let mut rate_started = Instant::now();
    // Warm-up window, then up to max_trials measured ones. An error (the statistics
    // could not be read) still stops the load and drains it below.
    let measured = (|| -> Result<(), String> {
        let mut snap = snapshot()?;
        let mut began = Instant::now();
        let mut points: Vec<(f64, f64)> = Vec::new();
        for w in 0..=settings.max_trials.max(3) {
            wait_window(&run, began + interval);
            let secs = began.elapsed().as_secs_f64();
            began = Instant::now();
            let samples = std::mem::take(&mut *run.samples.lock());
            let errors = run.errors.swap(0, Ordering::Relaxed);
            let send_ns = SEND_NS.swap(0, Ordering::Relaxed);
            let sends = SENDS.swap(0, Ordering::Relaxed);
            let next = snapshot()?;
            let mut deltas: Vec<ServerDelta> =
                next.iter().zip(&snap).map(|(a, b)| a.since(b)).collect();
            snap = next;
            let server_delta = deltas.remove(0);
            if w == 0 {
                sent_at_start = sent.load(Ordering::Relaxed);
                late.store(0, Ordering::Relaxed);
                rate_started = Instant::now();
                continue;
            }
            trials = w;
            let win = Window {
                secs,
                samples,
                errors,
                server: server_delta,
                composing: deltas,
                send_ns,
                sends,
            };
            let t = win.throughput(settings.batch_size);
            let l = win.latency(settings.percentile);
            progress.window(w, t, l);
            points.push((t, l));
            windows.push(win);
            if stable(&points, settings.stability_pct) {
                stable_now = true;
                break;
            }
        }
        Ok(())
    })();
    let sent_total = sent.load(Ordering::Relaxed).saturating_sub(sent_at_start);
    let sent_secs = rate_started.elapsed().as_secs_f64();
    let late_n = late.load(Ordering::Relaxed);
    run.stop.store(true, Ordering::SeqCst);
    if let Some(p) = pacer {
        let _ = p.join();
    }
    // Drain: every request answered and every sequence ended before the next point (60 s
    // at most).
    let open = || {
        run.outstanding.load(Ordering::SeqCst)
            + run
                .idle
                .lock()
                .iter()
                .filter(|&&s| run.mid_sequence(s))
                .count()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while open() > 0 && Instant::now() < deadline {
        retry_idle(&run);
        std::thread::sleep(Duration::from_millis(1));
    }
    let lost = open();
    measured?;
    let keep = windows.len().min(3);
    let windows = windows.split_off(windows.len() - keep);
    let first_error = run.first_error.lock().take();
    Ok(Measured {
        windows,
        stable: stable_now,
        trials,
        first_error,
        sent_rate: matches!(load, Load::Rate { .. })
            .then(|| sent_total as f64 / sent_secs.max(1e-9)),
        late_share: if sent_total > 0 {
            late_n as f64 / sent_total as f64
        } else {
            0.0
        },
        lost,
    })
}

/// Re-sends closed-loop slots whose enqueue failed, where they should still run.
fn retry_idle(run: &Arc<Run>) {
    let slots = std::mem::take(&mut *run.idle.lock());
    for slot in slots {
        if (!run.stop.load(Ordering::Relaxed) || run.mid_sequence(slot)) && !run.issue(slot) {
            run.idle.lock().push(slot);
        }
    }
}

/// Sleeps until `until`, re-sending failed slots every few milliseconds.
fn wait_window(run: &Arc<Run>, until: Instant) {
    loop {
        let now = Instant::now();
        if now >= until {
            return;
        }
        std::thread::sleep((until - now).min(Duration::from_millis(5)));
        if run.closed_loop {
            retry_idle(run);
        }
    }
}

/// Sends requests at `per_s` a second (exponential gaps when `poisson`) until stopped,
/// then ends the sequences still open.
fn pace(run: &Arc<Run>, per_s: f64, poisson: bool, late: &AtomicU64, sent: &AtomicU64) {
    let mut rng = fastrand::Rng::with_seed(0x5eed);
    let begin = Instant::now();
    let mut due = 0.0f64;
    let mut slot = 0usize;
    let slots = run.seqs.len().max(1);
    while !run.stop.load(Ordering::Relaxed) {
        let gap = if poisson {
            // Inverse transform of the exponential distribution; 1 - U is in (0, 1].
            -(1.0 - rng.f64()).ln() / per_s
        } else {
            1.0 / per_s
        };
        due += gap;
        let at = begin + Duration::from_secs_f64(due);
        loop {
            let now = Instant::now();
            if now >= at || run.stop.load(Ordering::Relaxed) {
                break;
            }
            std::thread::sleep((at - now).min(Duration::from_millis(5)));
        }
        if run.stop.load(Ordering::Relaxed) {
            break;
        }
        if Instant::now().duration_since(at) > Duration::from_millis(1) {
            late.fetch_add(1, Ordering::Relaxed);
        }
        if run.issue(slot) {
            sent.fetch_add(1, Ordering::Relaxed);
        }
        slot = (slot + 1) % slots;
    }
    // The sequences still open get their remaining steps (10 s at most).
    let deadline = Instant::now() + Duration::from_secs(10);
    for s in 0..slots {
        while run.mid_sequence(s) && Instant::now() < deadline {
            if !run.issue(s) {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stability_needs_three_windows_within_the_percentage() {
        assert!(!stable(&[(100.0, 10.0), (100.0, 10.0)], 10.0));
        assert!(stable(&[(100.0, 10.0), (105.0, 10.5), (95.0, 9.6)], 10.0));
        // Throughput off by more than 10% of the average.
        assert!(!stable(
            &[(100.0, 10.0), (100.0, 10.0), (130.0, 10.0)],
            10.0
        ));
        // Latency off.
        assert!(!stable(
            &[(100.0, 10.0), (100.0, 10.0), (100.0, 14.0)],
            10.0
        ));
        // Only the last three count.
        assert!(stable(
            &[(1.0, 99.0), (100.0, 10.0), (100.0, 10.0), (100.0, 10.0)],
            10.0
        ));
        assert!(stable(&[(0.0, 0.0), (0.0, 0.0), (0.0, 0.0)], 10.0));
    }

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile_of(&v, 50.0), 50);
        assert_eq!(percentile_of(&v, 99.0), 99);
        assert_eq!(percentile_of(&v, 100.0), 100);
        assert_eq!(percentile_of(&[7], 90.0), 7);
        assert_eq!(percentile_of(&[], 90.0), 0);
    }
}
