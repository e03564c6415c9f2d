//! Performance scenarios that drive libinfer through its C API.
//!
//! Run with `cargo bench --bench perf -- [options] [scenario...]`; without a scenario
//! every one runs. Each scenario prints one result line on stdout (`sequences`: one per
//! execute_delay_us setting; `ensemble`: one per case; details go to stderr). See `--help`
//! and docs/PERFORMANCE.md.

use infer::ffi::request::*;
use infer::ffi::response::*;
use infer::ffi::server::*;
use infer::ffi::*;
use infer::request::{Request, Response};
use infer::server::ServerOptions;
use std::alloc::{GlobalAlloc, Layout, System};
use std::ffi::{c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------
// Counting allocator: counts heap allocations of the whole process (library threads
// included) while COUNTING is set. Off, it costs one relaxed load per call.

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicU64 = AtomicU64::new(0);
static REALLOCS: AtomicU64 = AtomicU64::new(0);
static ALLOC_BYTES: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
            ALLOC_BYTES.fetch_add(l.size() as u64, Ordering::Relaxed);
        }
        System.alloc(l)
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
            ALLOC_BYTES.fetch_add(l.size() as u64, Ordering::Relaxed);
        }
        System.alloc_zeroed(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            REALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        System.realloc(p, l, new)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// (allocations, reallocations, bytes) counted while `f` runs.
fn count_allocs(f: impl FnOnce()) -> (u64, u64, u64) {
    let (a0, r0, b0) = (
        ALLOCS.load(Ordering::SeqCst),
        REALLOCS.load(Ordering::SeqCst),
        ALLOC_BYTES.load(Ordering::SeqCst),
    );
    COUNTING.store(true, Ordering::SeqCst);
    f();
    COUNTING.store(false, Ordering::SeqCst);
    (
        ALLOCS.load(Ordering::SeqCst) - a0,
        REALLOCS.load(Ordering::SeqCst) - r0,
        ALLOC_BYTES.load(Ordering::SeqCst) - b0,
    )
}

// ---------------------------------------------------------------------------------------
// Thin wrappers over the C API.

fn last_error() -> String {
    unsafe { CStr::from_ptr(infer_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

#[track_caller]
fn check(st: infer_status, what: &str) {
    if st != INFER_STATUS_OK {
        panic!("{what} failed with status {st}: {}", last_error());
    }
}

fn now_ns() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    BASE.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Keeps a value on its own cache line so that per-client counters do not false-share.
#[repr(align(128))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

struct Server(*mut ServerHandle);
unsafe impl Send for Server {}
unsafe impl Sync for Server {}

impl Server {
    fn new() -> Server {
        Server::with_cache(0)
    }

    /// A server with a response cache of `bytes` (0: none).
    fn with_cache(bytes: u64) -> Server {
        Server::with_options(bytes, INFER_RATE_LIMIT_OFF)
    }

    /// A server with a response cache of `bytes` (0: none) and a rate limiter mode.
    fn with_options(bytes: u64, rate_limit: u32) -> Server {
        unsafe {
            let mut o: *mut ServerOptions = std::ptr::null_mut();
            check(infer_server_options_new(&mut o), "infer_server_options_new");
            check(infer_server_options_set_gpu(o, INFER_GPU_OFF), "set_gpu");
            check(
                infer_server_options_set_response_cache_bytes(o, bytes),
                "set_response_cache_bytes",
            );
            check(
                infer_server_options_set_rate_limit(o, rate_limit),
                "set_rate_limit",
            );
            let mut s = std::ptr::null_mut();
            check(infer_server_new(o, &mut s), "infer_server_new");
            infer_server_options_free(o);
            Server(s)
        }
    }

    fn load(&self, name: &str, config: &str) {
        let (n, c) = (CString::new(name).unwrap(), CString::new(config).unwrap());
        check(
            unsafe { infer_server_load_model(self.0, n.as_ptr(), c.as_ptr(), std::ptr::null()) },
            "infer_server_load_model",
        );
    }

    fn stats(&self, model: &str) -> Stats {
        let n = CString::new(model).unwrap();
        let mut out = std::ptr::null_mut();
        check(
            unsafe { infer_server_statistics_json(self.0, n.as_ptr(), &mut out) },
            "infer_server_statistics_json",
        );
        let text = unsafe { CStr::from_ptr(out) }.to_str().unwrap().to_owned();
        unsafe { infer_string_free(out) };
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let m = &v["models"][0];
        Stats {
            inferences: m["inference_count"].as_u64().unwrap_or(0),
            executions: m["execution_count"].as_u64().unwrap_or(0),
            failures: m["failure_count"].as_u64().unwrap_or(0),
            compute_us: m["compute_us"]["total"].as_u64().unwrap_or(0),
            batch_sizes: m["batch_sizes"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|b| (b["size"].as_u64().unwrap(), b["count"].as_u64().unwrap()))
                        .collect()
                })
                .unwrap_or_default(),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        unsafe { infer_server_free(self.0) };
    }
}

#[derive(Clone, Debug, Default)]
struct Stats {
    inferences: u64,
    executions: u64,
    failures: u64,
    /// Total microseconds of backend executions (as the library measures them).
    compute_us: u64,
    batch_sizes: Vec<(u64, u64)>,
}

impl Stats {
    /// Counters accumulated between `earlier` and `self`.
    fn since(&self, earlier: &Stats) -> Stats {
        let mut sizes = Vec::new();
        for &(s, c) in &self.batch_sizes {
            let before = earlier
                .batch_sizes
                .iter()
                .find(|(s0, _)| *s0 == s)
                .map_or(0, |x| x.1);
            if c > before {
                sizes.push((s, c - before));
            }
        }
        Stats {
            inferences: self.inferences - earlier.inferences,
            executions: self.executions - earlier.executions,
            failures: self.failures - earlier.failures,
            compute_us: self.compute_us - earlier.compute_us,
            batch_sizes: sizes,
        }
    }
    fn mean_batch(&self) -> f64 {
        let rows: u64 = self.batch_sizes.iter().map(|(s, c)| s * c).sum();
        let n: u64 = self.batch_sizes.iter().map(|(_, c)| c).sum();
        if n == 0 {
            0.0
        } else {
            rows as f64 / n as f64
        }
    }
    fn histogram(&self) -> String {
        let parts: Vec<String> = self
            .batch_sizes
            .iter()
            .map(|(s, c)| format!("{s}:{c}"))
            .collect();
        format!("{{{}}}", parts.join(" "))
    }
}

/// What a request carries: model name and (input name, values) pairs, all prepared
/// once so building a request allocates nothing on the client side.
struct RequestSpec {
    model: CString,
    inputs: Vec<(CString, Vec<f32>)>,
    shape: Vec<i64>,
}

impl RequestSpec {
    fn new(model: &str, inputs: &[&str], shape: &[i64]) -> RequestSpec {
        let elems: i64 = shape.iter().product();
        RequestSpec {
            model: CString::new(model).unwrap(),
            inputs: inputs
                .iter()
                .enumerate()
                .map(|(k, n)| {
                    let v = (0..elems).map(|i| (i + 100 * k as i64) as f32).collect();
                    (CString::new(*n).unwrap(), v)
                })
                .collect(),
            shape: shape.to_vec(),
        }
    }

    /// Creates the request and adds its inputs (copied): what a client does per request.
    #[inline]
    fn build(&self, s: *mut ServerHandle) -> *mut Request {
        unsafe {
            let mut r = std::ptr::null_mut();
            check(
                infer_request_new(s, self.model.as_ptr(), -1, &mut r),
                "infer_request_new",
            );
            for (name, data) in &self.inputs {
                check(
                    infer_request_add_input(
                        r,
                        name.as_ptr(),
                        INFER_DATATYPE_FP32,
                        self.shape.as_ptr(),
                        self.shape.len(),
                        data.as_ptr() as *const c_void,
                        data.len() * 4,
                    ),
                    "infer_request_add_input",
                );
            }
            r
        }
    }
}

/// Reads an FP32 output of a response.
fn output_f32(resp: *const Response, name: &str) -> Vec<f32> {
    let n = CString::new(name).unwrap();
    let (mut dt, mut shape, mut nd, mut data, mut bs) =
        (0, std::ptr::null(), 0usize, std::ptr::null(), 0usize);
    let st = unsafe {
        infer_response_output_by_name(
            resp,
            n.as_ptr(),
            &mut dt,
            &mut shape,
            &mut nd,
            &mut data,
            &mut bs,
        )
    };
    check(st, "infer_response_output_by_name");
    assert_eq!(dt, INFER_DATATYPE_FP32);
    let bytes = unsafe { std::slice::from_raw_parts(data as *const u8, bs) };
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn resident_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = s
        .split_whitespace()
        .nth(1)
        .and_then(|x| x.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// CPU time of this process and of the whole machine over a window, to tell whether
/// other processes competed for the cores while a scenario measured.
struct CpuWindow {
    at: Instant,
    ours: u64,
    busy: u64,
}

fn ticks() -> (u64, u64) {
    let me = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which is in parentheses): utime is the 12th, stime
    // the 13th.
    let rest = me.rsplit_once(')').map_or("", |x| x.1);
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    let ours = f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0);
    let all = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let cpu: Vec<u64> = all
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    let total: u64 = cpu.iter().take(8).sum();
    let idle = cpu.get(3).copied().unwrap_or(0) + cpu.get(4).copied().unwrap_or(0);
    (ours, total - idle)
}

impl CpuWindow {
    fn start() -> CpuWindow {
        let (ours, busy) = ticks();
        CpuWindow {
            at: Instant::now(),
            ours,
            busy,
        }
    }
    /// "cpu: this process X cores, others Y cores" over the window.
    fn report(&self) -> String {
        let (ours, busy) = ticks();
        let secs = self.at.elapsed().as_secs_f64().max(1e-9);
        let hz = 100.0; // USER_HZ
        let o = (ours - self.ours) as f64 / hz / secs;
        let b = (busy - self.busy) as f64 / hz / secs;
        format!(
            "cpu: this process {o:.2} cores, other processes {:.2} cores",
            (b - o).max(0.0)
        )
    }
}

/// Context switches (voluntary, involuntary) so far of the library's worker threads
/// (named "infer-<model>-<i>").
fn worker_switches() -> (u64, u64) {
    thread_switches("infer-")
}

/// Context switches (voluntary, involuntary) so far of this process's threads whose
/// name starts with `prefix`.
fn thread_switches(prefix: &str) -> (u64, u64) {
    let mut v = (0, 0);
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return v;
    };
    for t in dir.flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if !comm.starts_with(prefix) {
            continue;
        }
        let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
        for line in status.lines() {
            let num = |l: &str| -> u64 {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|x| x.parse().ok())
                    .unwrap_or(0)
            };
            if line.starts_with("voluntary_ctxt_switches") {
                v.0 += num(line);
            } else if line.starts_with("nonvoluntary_ctxt_switches") {
                v.1 += num(line);
            }
        }
    }
    v
}

/// Median round trip, in ns, of two threads bouncing a value through one atomic: the
/// machine's core-to-core latency right now (on a virtual machine it changes with where
/// the host places the virtual CPUs, and every scenario here depends on it).
fn core_round_trip_ns() -> u64 {
    let flag = Arc::new(AtomicU64::new(0));
    let f = flag.clone();
    let rounds = 2_000u64;
    let reps = 9;
    let h = std::thread::spawn(move || {
        for i in 0..rounds * reps {
            while f.load(Ordering::Acquire) != 2 * i + 1 {
                std::hint::spin_loop();
            }
            f.store(2 * i + 2, Ordering::Release);
        }
    });
    let mut samples = Vec::with_capacity(reps as usize);
    for r in 0..reps {
        let t = Instant::now();
        for j in 0..rounds {
            let i = r * rounds + j;
            flag.store(2 * i + 1, Ordering::Release);
            while flag.load(Ordering::Acquire) != 2 * i + 2 {
                std::hint::spin_loop();
            }
        }
        samples.push(t.elapsed().as_nanos() as u64 / rounds);
    }
    h.join().unwrap();
    samples.sort_unstable();
    samples[samples.len() / 2]
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

fn verdict(met: bool) -> &'static str {
    if met {
        "MET"
    } else {
        "NOT MET"
    }
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

// ---------------------------------------------------------------------------------------
// Model configurations.

fn identity_unbatched(name: &str) -> String {
    format!(
        r#"name: "{name}"
backend: "identity"
max_batch_size: 0
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 1, 16 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1, 16 ] }} ]
"#
    )
}

fn identity_batched(name: &str) -> String {
    format!(
        r#"name: "{name}"
backend: "identity"
max_batch_size: 64
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 100 }}
"#
    )
}

fn add_sub_delayed(name: &str, delay_us: u64) -> String {
    format!(
        r#"name: "{name}"
backend: "add_sub"
max_batch_size: 64
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }}, {{ name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }}, {{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 100 }}
parameters {{ key: "execute_delay_us" value {{ string_value: "{delay_us}" }} }}
"#
    )
}

// ---------------------------------------------------------------------------------------
// latency: one request at a time, enqueue -> FINAL callback.

struct LatencySlot {
    done: AtomicBool,
    at_ns: AtomicU64,
    resp: AtomicPtr<Response>,
}

unsafe extern "C" fn latency_cb(ud: *mut c_void, resp: *mut Response, flags: u32) {
    if flags & INFER_RESPONSE_FLAG_FINAL == 0 {
        infer_response_free(resp);
        return;
    }
    let t = now_ns();
    let slot = &*(ud as *const LatencySlot);
    slot.at_ns.store(t, Ordering::Relaxed);
    slot.resp.store(resp, Ordering::Relaxed);
    slot.done.store(true, Ordering::Release);
}

/// Sends one request and spins until its FINAL; returns (enqueue->FINAL ns, response).
#[inline]
fn round_trip(s: &Server, slot: &LatencySlot, r: *mut Request) -> (u64, *mut Response) {
    slot.done.store(false, Ordering::Relaxed);
    let t0 = now_ns();
    check(
        unsafe {
            infer_server_enqueue(
                s.0,
                r,
                Some(latency_cb),
                slot as *const LatencySlot as *mut c_void,
                std::ptr::null_mut(),
            )
        },
        "infer_server_enqueue",
    );
    while !slot.done.load(Ordering::Acquire) {
        std::hint::spin_loop();
    }
    let t1 = slot.at_ns.load(Ordering::Relaxed);
    (t1.saturating_sub(t0), slot.resp.load(Ordering::Relaxed))
}

fn latency(cfg: &Config) -> String {
    let s = Server::new();
    s.load("identity", &identity_unbatched("identity"));
    let spec = RequestSpec::new("identity", &["INPUT0"], &[1, 16]);
    let slot = LatencySlot {
        done: AtomicBool::new(false),
        at_ns: AtomicU64::new(0),
        resp: AtomicPtr::new(std::ptr::null_mut()),
    };
    // Warm-up, checking the output once.
    let warm_until = Instant::now() + cfg.warmup;
    let mut checked = false;
    while Instant::now() < warm_until {
        let (_, resp) = round_trip(&s, &slot, spec.build(s.0));
        if !checked {
            assert_eq!(unsafe { infer_response_status(resp) }, INFER_STATUS_OK);
            assert_eq!(output_f32(resp, "OUTPUT0"), spec.inputs[0].1);
            checked = true;
        }
        unsafe { infer_response_free(resp) };
    }
    let max_n = 1_000_000;
    let mut lat = Vec::with_capacity(max_n);
    let mut cycle = Vec::with_capacity(max_n);
    let cpu = CpuWindow::start();
    let start = Instant::now();
    let end = start + cfg.measure;
    while lat.len() < max_n && Instant::now() < end {
        let c0 = now_ns();
        let r = spec.build(s.0);
        let (ns, resp) = round_trip(&s, &slot, r);
        unsafe { infer_response_free(resp) };
        lat.push(ns);
        cycle.push(now_ns() - c0);
    }
    let elapsed = start.elapsed().as_secs_f64();
    let cpu = cpu.report();
    lat.sort_unstable();
    cycle.sort_unstable();
    let us = |ns: u64| ns as f64 / 1000.0;
    let p50 = us(percentile(&lat, 0.50));
    let p99 = us(percentile(&lat, 0.99));
    // Allocations per request on the unbatched path (one request at a time).
    let n_alloc = 20_000u64;
    let (a, ra, b) = count_allocs(|| {
        for _ in 0..n_alloc {
            let (_, resp) = round_trip(&s, &slot, spec.build(s.0));
            unsafe { infer_response_free(resp) };
        }
    });
    format!(
        "latency: p50={p50:.2}us p99={p99:.2}us p99.9={:.2}us max={:.1}us (enqueue->FINAL, n={}, {:.0} req/s serial); full cycle build+enqueue+FINAL+free p50={:.2}us p99={:.2}us; {:.2} allocs/req ({:.2} reallocs, {:.0} B); {cpu} | target p50<=5us: {}",
        us(percentile(&lat, 0.999)),
        us(*lat.last().unwrap_or(&0)),
        lat.len(),
        lat.len() as f64 / elapsed,
        us(percentile(&cycle, 0.50)),
        us(percentile(&cycle, 0.99)),
        a as f64 / n_alloc as f64,
        ra as f64 / n_alloc as f64,
        b as f64 / n_alloc as f64,
        verdict(p50 <= 5.0),
    )
}

// ---------------------------------------------------------------------------------------
// closed_loop: N client threads, each with one request in flight.

struct ClientSlot {
    done: AtomicBool,
    thread: OnceLock<std::thread::Thread>,
    completed: AtomicU64,
}

unsafe extern "C" fn closed_loop_cb(ud: *mut c_void, resp: *mut Response, flags: u32) {
    if flags & INFER_RESPONSE_FLAG_FINAL == 0 {
        infer_response_free(resp);
        return;
    }
    let slot = &*(ud as *const Padded<ClientSlot>);
    if infer_response_status(resp) != INFER_STATUS_OK {
        eprintln!(
            "closed_loop: request failed with status {}",
            infer_response_status(resp)
        );
    }
    infer_response_free(resp);
    slot.completed.fetch_add(1, Ordering::Relaxed);
    // The slot outlives the server (it is dropped after infer_server_free returns), so
    // touching it after `done` is safe.
    slot.done.store(true, Ordering::Release);
    if let Some(t) = slot.thread.get() {
        t.unpark();
    }
}

/// How a closed-loop client waits for its FINAL: `spin` busy iterations, then either
/// `yield_now` in a loop or park until the callback unparks it.
#[inline]
fn wait_for(done: &AtomicBool, spin: u32, yielding: bool) {
    let mut n = 0;
    while !done.load(Ordering::Acquire) {
        if n < spin {
            n += 1;
            std::hint::spin_loop();
        } else if yielding {
            std::thread::yield_now();
        } else {
            std::thread::park();
        }
    }
}

/// The same client threads and wake-up method with no library at all: each client
/// pushes its index on a mutex-protected Vec; one server thread takes everything queued
/// and answers each (set the flag, unpark). The best a closed loop with this many
/// blocking clients can do on this machine.
fn closed_loop_reference(cfg: &Config) -> f64 {
    struct Shared {
        queue: std::sync::Mutex<Vec<usize>>,
        cv: std::sync::Condvar,
        slots: Vec<Padded<ClientSlot>>,
        stop: AtomicBool,
    }
    let sh = Arc::new(Shared {
        queue: std::sync::Mutex::new(Vec::with_capacity(cfg.clients)),
        cv: std::sync::Condvar::new(),
        slots: (0..cfg.clients)
            .map(|_| {
                Padded(ClientSlot {
                    done: AtomicBool::new(false),
                    thread: OnceLock::new(),
                    completed: AtomicU64::new(0),
                })
            })
            .collect(),
        stop: AtomicBool::new(false),
    });
    let (spin, yielding) = (cfg.client_spin, cfg.client_yield);
    let mut handles: Vec<_> = (0..cfg.clients)
        .map(|i| {
            let sh = sh.clone();
            std::thread::spawn(move || {
                let slot = &sh.slots[i];
                let _ = slot.thread.set(std::thread::current());
                while !sh.stop.load(Ordering::Relaxed) {
                    slot.done.store(false, Ordering::Relaxed);
                    sh.queue.lock().unwrap().push(i);
                    sh.cv.notify_one();
                    wait_for(&slot.done, spin, yielding);
                    slot.completed.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let server = {
        let sh = sh.clone();
        std::thread::spawn(move || {
            let mut batch = Vec::with_capacity(sh.slots.len());
            loop {
                {
                    let mut q = sh.queue.lock().unwrap();
                    while q.is_empty() && !sh.stop.load(Ordering::Relaxed) {
                        q = sh.cv.wait_timeout(q, Duration::from_millis(1)).unwrap().0;
                    }
                    std::mem::swap(&mut *q, &mut batch);
                }
                if batch.is_empty() && sh.stop.load(Ordering::Relaxed) {
                    // Answer stragglers until every client has seen `stop`.
                    if sh.slots.iter().all(|s| s.done.load(Ordering::Acquire)) {
                        return;
                    }
                }
                for i in batch.drain(..) {
                    let s = &sh.slots[i];
                    s.done.store(true, Ordering::Release);
                    if let Some(t) = s.thread.get() {
                        t.unpark();
                    }
                }
            }
        })
    };
    let total = || -> u64 {
        sh.slots
            .iter()
            .map(|c| c.completed.load(Ordering::Relaxed))
            .sum()
    };
    std::thread::sleep(cfg.warmup.min(Duration::from_millis(500)));
    let (c0, t0) = (total(), Instant::now());
    std::thread::sleep(cfg.measure.min(Duration::from_secs(2)));
    let (c1, t1) = (total(), Instant::now());
    sh.stop.store(true, Ordering::Relaxed);
    for h in handles.drain(..) {
        h.join().unwrap();
    }
    server.join().unwrap();
    (c1 - c0) as f64 / (t1 - t0).as_secs_f64()
}

fn closed_loop(cfg: &Config) -> String {
    let clients = cfg.clients;
    let s = Arc::new(Server::new());
    s.load("identity", &identity_batched("identity"));
    let spec = Arc::new(RequestSpec::new("identity", &["INPUT0"], &[1, 16]));
    let slots: Vec<Arc<Padded<ClientSlot>>> = (0..clients)
        .map(|_| {
            Arc::new(Padded(ClientSlot {
                done: AtomicBool::new(false),
                thread: OnceLock::new(),
                completed: AtomicU64::new(0),
            }))
        })
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let spin = cfg.client_spin;
    let yielding = cfg.client_yield;
    let handles: Vec<_> = slots
        .iter()
        .map(|slot| {
            let (s, spec, slot, stop) = (s.clone(), spec.clone(), slot.clone(), stop.clone());
            std::thread::spawn(move || {
                let _ = slot.thread.set(std::thread::current());
                let ud = &**slot as *const ClientSlot as *mut c_void;
                while !stop.load(Ordering::Relaxed) {
                    let r = spec.build(s.0);
                    slot.done.store(false, Ordering::Relaxed);
                    check(
                        unsafe {
                            infer_server_enqueue(
                                s.0,
                                r,
                                Some(closed_loop_cb),
                                ud,
                                std::ptr::null_mut(),
                            )
                        },
                        "infer_server_enqueue",
                    );
                    wait_for(&slot.done, spin, yielding);
                }
            })
        })
        .collect();
    let total = || -> u64 {
        slots
            .iter()
            .map(|c| c.completed.load(Ordering::Relaxed))
            .sum()
    };
    std::thread::sleep(cfg.warmup);
    let (st0, c0, t0) = (s.stats("identity"), total(), Instant::now());
    let cpu = CpuWindow::start();
    let sw0 = worker_switches();
    std::thread::sleep(cfg.measure);
    let (c1, t1) = (total(), Instant::now());
    let sw1 = worker_switches();
    let cpu = cpu.report();
    let st1 = s.stats("identity");
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().unwrap();
    }
    let d = st1.since(&st0);
    let rate = (c1 - c0) as f64 / (t1 - t0).as_secs_f64();
    let mean_exec = if d.executions == 0 {
        0.0
    } else {
        d.inferences as f64 / d.executions as f64
    };
    drop(s);
    drop(slots);
    let reference = closed_loop_reference(cfg);
    let per_exec = |a: u64, b: u64| (b - a) as f64 / d.executions.max(1) as f64;
    format!(
        "closed_loop: {rate:.0} req/s with {clients} clients ({} wait), mean executed batch {mean_exec:.2} ({} executions in {:.1}s, failures {}); worker context switches per execution: {:.1} voluntary, {:.1} involuntary; {cpu}; reference without the library (same clients, one thread answering from a std Mutex<Vec>): {reference:.0} req/s | target >=400000 req/s: {}",
        if yielding { "yield" } else { "park" },
        d.executions,
        (t1 - t0).as_secs_f64(),
        d.failures,
        per_exec(sw0.0, sw1.0),
        per_exec(sw0.1, sw1.1),
        verdict(rate >= 400_000.0)
    )
}

// ---------------------------------------------------------------------------------------
// pipelined: a few client threads, each keeping a window of requests outstanding.

struct Window {
    outstanding: AtomicUsize,
    completed: AtomicU64,
    failed: AtomicU64,
}

unsafe extern "C" fn window_cb(ud: *mut c_void, resp: *mut Response, flags: u32) {
    if flags & INFER_RESPONSE_FLAG_FINAL == 0 {
        infer_response_free(resp);
        return;
    }
    let w = &*(ud as *const Padded<Window>);
    if infer_response_status(resp) != INFER_STATUS_OK {
        w.failed.fetch_add(1, Ordering::Relaxed);
    }
    infer_response_free(resp);
    w.completed.fetch_add(1, Ordering::Relaxed);
    w.outstanding.fetch_sub(1, Ordering::Release);
}

/// Client threads that keep `window` requests outstanding each, until `stop`, or until
/// their share of `limit` requests has been sent (0 = no limit).
struct Pipeline {
    /// Keeps the server alive while the clients run.
    _server: Arc<Server>,
    windows: Vec<Arc<Padded<Window>>>,
    stop: Arc<AtomicBool>,
    handles: Vec<std::thread::JoinHandle<()>>,
}

impl Pipeline {
    fn start(
        server: Arc<Server>,
        spec: Arc<RequestSpec>,
        threads: usize,
        window: usize,
        limit_per_thread: u64,
        sleep_when_full: bool,
    ) -> Pipeline {
        let windows: Vec<Arc<Padded<Window>>> = (0..threads)
            .map(|_| {
                Arc::new(Padded(Window {
                    outstanding: AtomicUsize::new(0),
                    completed: AtomicU64::new(0),
                    failed: AtomicU64::new(0),
                }))
            })
            .collect();
        let stop = Arc::new(AtomicBool::new(false));
        let handles = windows
            .iter()
            .map(|w| {
                let (s, spec, w, stop) = (server.clone(), spec.clone(), w.clone(), stop.clone());
                std::thread::spawn(move || {
                    let ud = &**w as *const Window as *mut c_void;
                    let mut sent = 0u64;
                    let mut waits = 0u32;
                    while !stop.load(Ordering::Relaxed)
                        && (limit_per_thread == 0 || sent < limit_per_thread)
                    {
                        if w.outstanding.load(Ordering::Acquire) >= window {
                            // Back off: spin a little, then give the CPU to the worker.
                            waits += 1;
                            if waits < 32 {
                                std::hint::spin_loop();
                            } else if sleep_when_full {
                                std::thread::sleep(Duration::from_micros(50));
                            } else {
                                std::thread::yield_now();
                            }
                            continue;
                        }
                        waits = 0;
                        let r = spec.build(s.0);
                        w.outstanding.fetch_add(1, Ordering::Relaxed);
                        let st = unsafe {
                            infer_server_enqueue(s.0, r, Some(window_cb), ud, std::ptr::null_mut())
                        };
                        if st != INFER_STATUS_OK {
                            w.outstanding.fetch_sub(1, Ordering::Relaxed);
                            w.failed.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        sent += 1;
                    }
                })
            })
            .collect();
        Pipeline {
            _server: server,
            windows,
            stop,
            handles,
        }
    }

    fn completed(&self) -> u64 {
        self.windows
            .iter()
            .map(|w| w.completed.load(Ordering::Relaxed))
            .sum()
    }

    fn failed(&self) -> u64 {
        self.windows
            .iter()
            .map(|w| w.failed.load(Ordering::Relaxed))
            .sum()
    }

    fn outstanding(&self) -> usize {
        self.windows
            .iter()
            .map(|w| w.outstanding.load(Ordering::Acquire))
            .sum()
    }

    /// Stops the clients and waits until every outstanding request has completed.
    fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        for h in self.handles {
            h.join().unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while self
            .windows
            .iter()
            .any(|w| w.outstanding.load(Ordering::Acquire) > 0)
        {
            assert!(Instant::now() < deadline, "requests never completed");
            std::thread::sleep(Duration::from_micros(200));
        }
        self.windows
            .iter()
            .map(|w| w.completed.load(Ordering::Relaxed))
            .sum()
    }
}

/// What a pipelined run measured.
struct Measured {
    rate: f64,
    /// Statistics over the measured window.
    stats: Stats,
    secs: f64,
    failed: u64,
    cpu: String,
    /// Worker context switches (voluntary, involuntary) over the window.
    switches: (u64, u64),
}

/// Runs a pipeline for warm-up + measurement.
fn run_pipeline(
    cfg: &Config,
    s: &Arc<Server>,
    model: &str,
    spec: RequestSpec,
    sleep_when_full: bool,
) -> Measured {
    let p = Pipeline::start(
        s.clone(),
        Arc::new(spec),
        cfg.threads,
        cfg.window,
        0,
        sleep_when_full,
    );
    std::thread::sleep(cfg.warmup);
    let (st0, c0, t0) = (s.stats(model), p.completed(), Instant::now());
    let cpu = CpuWindow::start();
    let sw0 = worker_switches();
    std::thread::sleep(cfg.measure);
    let (c1, t1) = (p.completed(), Instant::now());
    let sw1 = worker_switches();
    let cpu = cpu.report();
    let st1 = s.stats(model);
    let failed = p.failed();
    p.finish();
    let secs = (t1 - t0).as_secs_f64();
    Measured {
        rate: (c1 - c0) as f64 / secs,
        stats: st1.since(&st0),
        secs,
        failed,
        cpu,
        switches: (sw1.0 - sw0.0, sw1.1 - sw0.1),
    }
}

fn pipelined(cfg: &Config) -> String {
    let s = Arc::new(Server::new());
    s.load("identity", &identity_batched("identity"));
    let spec = RequestSpec::new("identity", &["INPUT0"], &[1, 16]);
    let Measured {
        rate,
        stats: d,
        secs,
        failed,
        cpu,
        switches: sw,
    } = run_pipeline(cfg, &s, "identity", spec, false);
    format!(
        "pipelined: {rate:.0} req/s with {} threads x {} outstanding, mean executed batch {:.2} ({} executions in {secs:.1}s, failures {failed}); worker context switches per execution: {:.1} voluntary, {:.1} involuntary; {cpu} | target >=1000000 req/s: {}",
        cfg.threads,
        cfg.window,
        d.mean_batch(),
        d.executions,
        sw.0 as f64 / d.executions.max(1) as f64,
        sw.1 as f64 / d.executions.max(1) as f64,
        verdict(rate >= 1_000_000.0)
    )
}

// ---------------------------------------------------------------------------------------
// batching_efficiency: add_sub with 2 ms per execution; is every batch full?

fn batching_efficiency(cfg: &Config) -> String {
    let delay_us = 2000u64;
    let s = Arc::new(Server::new());
    s.load("add_sub", &add_sub_delayed("add_sub", delay_us));
    let spec = RequestSpec::new("add_sub", &["INPUT0", "INPUT1"], &[1, 4]);
    {
        // Check the model's answer once.
        let slot = LatencySlot {
            done: AtomicBool::new(false),
            at_ns: AtomicU64::new(0),
            resp: AtomicPtr::new(std::ptr::null_mut()),
        };
        let (_, resp) = round_trip(&s, &slot, spec.build(s.0));
        let want: Vec<f32> = spec.inputs[0]
            .1
            .iter()
            .zip(&spec.inputs[1].1)
            .map(|(a, b)| a + b)
            .collect();
        assert_eq!(output_f32(resp, "OUTPUT0"), want);
        unsafe { infer_response_free(resp) };
    }
    let ideal = 64.0 * 1e6 / delay_us as f64;
    let Measured {
        rate,
        stats: d,
        secs,
        failed,
        cpu,
        switches: sw,
    } = run_pipeline(cfg, &s, "add_sub", spec, true);
    let eff = rate / ideal;
    let per_exec = d.compute_us as f64 / d.executions.max(1) as f64;
    let cycle = secs * 1e6 / d.executions.max(1) as f64;
    format!(
        "batching_efficiency: {rate:.0} req/s = {eff:.3} of ideal {ideal:.0} (64 per {delay_us} us); {} executions in {secs:.1}s, one every {cycle:.0} us of which {per_exec:.0} us inside execution (library compute_us) and {:.0} us between; mean batch {:.2}, histogram size:count {} failures {failed}; worker context switches per execution: {:.1} voluntary, {:.1} involuntary; {cpu} | target >=0.95: {}",
        d.executions,
        cycle - per_exec,
        d.mean_batch(),
        d.histogram(),
        sw.0 as f64 / d.executions.max(1) as f64,
        sw.1 as f64 / d.executions.max(1) as f64,
        verdict(eff >= 0.95)
    )
}

// ---------------------------------------------------------------------------------------
// memory: RSS after 1M and 10M pipelined requests; allocations per request.

fn memory(cfg: &Config) -> String {
    let s = Arc::new(Server::new());
    s.load("identity", &identity_batched("identity"));
    let spec = Arc::new(RequestSpec::new("identity", &["INPUT0"], &[1, 16]));

    // Allocations per request: exactly N requests through the pipelined path, counted
    // from a quiescent start to a quiescent end.
    let n_alloc = 200_000u64;
    let warm = Pipeline::start(
        s.clone(),
        spec.clone(),
        cfg.threads,
        cfg.window,
        50_000,
        false,
    );
    while warm.completed() < 50_000 * cfg.threads as u64 {
        std::thread::sleep(Duration::from_millis(1));
    }
    warm.finish();
    let (a, ra, b) = count_allocs(|| {
        let p = Pipeline::start(
            s.clone(),
            spec.clone(),
            cfg.threads,
            cfg.window,
            n_alloc / cfg.threads as u64,
            false,
        );
        while p.completed() < n_alloc {
            std::thread::sleep(Duration::from_micros(200));
        }
        p.finish();
    });
    // The pipeline threads' own start-up allocations (thread spawn, Arcs) are included;
    // they are a few dozen over N requests.
    let allocs_per_req = a as f64 / n_alloc as f64;

    let rss0 = resident_bytes();
    let target_big = cfg.memory_requests;
    let p = Pipeline::start(s.clone(), spec.clone(), cfg.threads, cfg.window, 0, false);
    let t0 = Instant::now();
    let cpu = CpuWindow::start();
    let time_cap = cfg.memory_cap;
    let mut rss_1m = None;
    let mut t_1m = 0.0;
    loop {
        let c = p.completed();
        if rss_1m.is_none() && c >= 1_000_000 {
            rss_1m = Some(resident_bytes());
            t_1m = t0.elapsed().as_secs_f64();
        }
        if c >= target_big || t0.elapsed() > time_cap {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let rss_end = resident_bytes();
    let reached = p.completed();
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu.report();
    let in_flight = p.outstanding();
    let failed = p.failed();
    p.finish();
    let rss_1m = rss_1m.unwrap_or(0);
    let scaled = if reached < target_big {
        format!(
            " (time cap {:.0}s hit: stopped at {reached} of {target_big})",
            time_cap.as_secs_f64()
        )
    } else {
        String::new()
    };
    format!(
        "memory: RSS {:.1} MiB before, {:.1} MiB after 1M requests ({t_1m:.1}s), {:.1} MiB after {:.1}M requests ({secs:.1}s{scaled}); growth 1M->end {:+.2} MiB ({:+.1} B/request); {allocs_per_req:.2} allocs/req ({:.3} reallocs/req, {:.0} B/req) over {n_alloc} pipelined requests; {in_flight} in flight when stopped, failures {failed}; {cpu}",
        mib(rss0),
        mib(rss_1m),
        mib(rss_end),
        reached as f64 / 1e6,
        mib(rss_end) - mib(rss_1m),
        (rss_end as f64 - rss_1m as f64) / (reached.saturating_sub(1_000_000).max(1)) as f64,
        ra as f64 / n_alloc as f64,
        b as f64 / n_alloc as f64,
    )
}

// ---------------------------------------------------------------------------------------
// sequences: the sequence batcher (Direct, 4 instances x 64 slots) under many closed-loop
// sequences, checked request by request, against the dynamic batcher at the same
// concurrency.

/// xorshift64*: a tiny deterministic PRNG (no dependency).
struct XorShift(u64);

impl XorShift {
    fn new(seed: u64) -> XorShift {
        // Never zero (a zero state stays zero).
        XorShift(seed ^ 0x9E37_79B9_7F4A_7C15 | 1)
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in lo..=hi (the modulo bias is negligible here).
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

fn accumulator_direct(name: &str, delay_us: u64) -> String {
    format!(
        r#"name: "{name}" backend: "accumulator" max_batch_size: 64
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ count: 4 kind: KIND_CPU }} ]
parameters {{ key: "execute_delay_us" value {{ string_value: "{delay_us}" }} }}
sequence_batching {{
  max_sequence_idle_microseconds: 60000000
  direct {{ }}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] }} ] }}
  ]
}}
"#
    )
}

/// The dynamic-batching counterpart of `accumulator_direct`: same tensors, instances,
/// batch size and simulated compute, OUTPUT a copy of INPUT.
fn identity_int32_dynamic(name: &str, delay_us: u64) -> String {
    format!(
        r#"name: "{name}" backend: "identity" max_batch_size: 64
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ count: 4 kind: KIND_CPU }} ]
parameters {{ key: "execute_delay_us" value {{ string_value: "{delay_us}" }} }}
dynamic_batching {{ }}
"#
    )
}

/// A FINAL response handed from a callback to the driver thread.
struct Completion {
    stream: u32,
    resp: *mut Response,
    at_ns: u64,
}

// SAFETY: a response may be read and freed on any thread (C API contract).
unsafe impl Send for Completion {}

/// Where callbacks leave FINAL responses for the driver (which then checks them and
/// sends the stream's next request), so a callback only takes the time, pushes and wakes.
struct Inbox {
    items: std::sync::Mutex<Vec<Completion>>,
    driver: std::thread::Thread,
    /// Callbacks that have returned: the driver keeps the inbox alive until all have.
    returned: AtomicU64,
}

/// The callback's user data: the inbox and the stream the request belongs to.
struct StreamTag {
    inbox: *const Inbox,
    stream: u32,
}

unsafe extern "C" fn stream_cb(ud: *mut c_void, resp: *mut Response, flags: u32) {
    if flags & INFER_RESPONSE_FLAG_FINAL == 0 {
        // Neither model sends anything before its FINAL response.
        infer_response_free(resp);
        return;
    }
    let at_ns = now_ns();
    let tag = &*(ud as *const StreamTag);
    let inbox = &*tag.inbox;
    inbox.items.lock().unwrap().push(Completion {
        stream: tag.stream,
        resp,
        at_ns,
    });
    inbox.driver.unpark();
    // The last touch of the inbox.
    inbox.returned.fetch_add(1, Ordering::Release);
}

/// One closed-loop stream of requests: a sequence (sequence batcher) or one of the
/// outstanding slots of the dynamic-batching comparison.
struct Stream {
    /// Requests this stream sends (sequences); 0 = until the shared total is reached.
    len: u32,
    sent: u32,
    /// What the next OUTPUT must be: the running sum (sequences) or the value sent.
    expect: i32,
    rng: XorShift,
    sent_at: u64,
}

/// What one driven run measured.
struct StreamRun {
    requests: u64,
    secs: f64,
    /// Enqueue -> FINAL of every request, and of the requests that were not the first of
    /// their sequence (sequences only), sorted, in ns.
    lat: Vec<u64>,
    lat_later: Vec<u64>,
    mismatches: u64,
    errors: u64,
    stats: Stats,
    cpu: String,
}

/// Reads the single INT32 element of output `name`.
fn output_i32(resp: *const Response, name: &CStr) -> Result<i32, String> {
    let (mut dt, mut shape, mut nd, mut data, mut bs) =
        (0, std::ptr::null(), 0usize, std::ptr::null(), 0usize);
    let st = unsafe {
        infer_response_output_by_name(
            resp,
            name.as_ptr(),
            &mut dt,
            &mut shape,
            &mut nd,
            &mut data,
            &mut bs,
        )
    };
    if st != INFER_STATUS_OK {
        return Err(format!("output {name:?}: status {st}: {}", last_error()));
    }
    if dt != INFER_DATATYPE_INT32 || bs != 4 {
        return Err(format!("output {name:?}: datatype {dt}, {bs} bytes"));
    }
    let b = unsafe { std::slice::from_raw_parts(data as *const u8, 4) };
    Ok(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Ends the process at once: while requests are in flight, their callbacks point into
/// the driver's stack, which unwinding would free.
fn die(msg: String) -> ! {
    eprintln!("{msg}");
    std::process::exit(1)
}

/// `check` for the driver: fails with `die`.
fn must(st: infer_status, what: &str) {
    if st != INFER_STATUS_OK {
        die(format!(
            "sequences: {what} failed with status {st}: {}",
            last_error()
        ));
    }
}

/// Drives closed-loop streams through `model` until every stream is done: with
/// `lens` (sequence lengths) each stream is a sequence with correlation ID `id_base + i`;
/// with `lens` empty, `clients` streams share `total` requests (no correlation ID).
/// Every response is checked. The driver runs on the calling thread.
fn drive_streams(
    s: &Server,
    model: &str,
    lens: &[u32],
    id_base: u64,
    clients: usize,
    total: u64,
    seed: u64,
) -> StreamRun {
    let sequences = !lens.is_empty();
    let model_c = CString::new(model).unwrap();
    let (in_name, out_name) = (c"INPUT", c"OUTPUT");
    let shape = [1i64, 1];
    let inbox = Inbox {
        items: std::sync::Mutex::new(Vec::with_capacity(1024)),
        driver: std::thread::current(),
        returned: AtomicU64::new(0),
    };
    let n = if sequences { lens.len() } else { clients };
    let total = if sequences {
        lens.iter().map(|&l| l as u64).sum()
    } else {
        total
    };
    let tags: Vec<StreamTag> = (0..n)
        .map(|i| StreamTag {
            inbox: &inbox,
            stream: i as u32,
        })
        .collect();
    let mut master = XorShift::new(seed);
    let mut streams: Vec<Stream> = (0..n)
        .map(|i| Stream {
            len: if sequences { lens[i] } else { 0 },
            sent: 0,
            expect: 0,
            rng: XorShift::new(master.next()),
            sent_at: 0,
        })
        .collect();
    let mut sent_total = 0u64;
    // Builds and enqueues stream i's next request.
    let send = |i: usize, streams: &mut [Stream], sent_total: &mut u64| {
        let st = &mut streams[i];
        let v = st.rng.range(0, 2000) as i32 - 1000;
        st.expect = if sequences {
            if st.sent == 0 {
                v
            } else {
                st.expect.wrapping_add(v)
            }
        } else {
            v
        };
        unsafe {
            let mut r = std::ptr::null_mut();
            must(
                infer_request_new(s.0, model_c.as_ptr(), -1, &mut r),
                "infer_request_new",
            );
            must(
                infer_request_add_input(
                    r,
                    in_name.as_ptr(),
                    INFER_DATATYPE_INT32,
                    shape.as_ptr(),
                    2,
                    &v as *const i32 as *const c_void,
                    4,
                ),
                "infer_request_add_input",
            );
            if sequences {
                let mut flags = 0;
                if st.sent == 0 {
                    flags |= INFER_REQUEST_FLAG_SEQUENCE_START;
                }
                if st.sent + 1 == st.len {
                    flags |= INFER_REQUEST_FLAG_SEQUENCE_END;
                }
                must(
                    infer_request_set_correlation_id(r, id_base + i as u64),
                    "infer_request_set_correlation_id",
                );
                must(infer_request_set_flags(r, flags), "infer_request_set_flags");
            }
            st.sent += 1;
            *sent_total += 1;
            st.sent_at = now_ns();
            must(
                infer_server_enqueue(
                    s.0,
                    r,
                    Some(stream_cb),
                    &tags[i] as *const StreamTag as *mut c_void,
                    std::ptr::null_mut(),
                ),
                "infer_server_enqueue",
            );
        }
    };

    let st0 = s.stats(model);
    let cpu = CpuWindow::start();
    let t0 = Instant::now();
    for i in 0..n {
        if sequences || sent_total < total {
            send(i, &mut streams, &mut sent_total);
        }
    }
    let mut lat = Vec::with_capacity(total as usize);
    let mut lat_later = Vec::with_capacity(total as usize);
    let (mut mismatches, mut errors, mut completed) = (0u64, 0u64, 0u64);
    let mut reported = 0;
    let mut batch: Vec<Completion> = Vec::with_capacity(1024);
    let mut idle_since = Instant::now();
    let mut spins = 0u32;
    while completed < total {
        std::mem::swap(&mut *inbox.items.lock().unwrap(), &mut batch);
        if batch.is_empty() {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::park_timeout(Duration::from_millis(10));
                if idle_since.elapsed() > Duration::from_secs(60) {
                    die(format!(
                        "sequences: no response for 60 s on '{model}' ({completed} of {total} completed, {sent_total} sent)"
                    ));
                }
            }
            continue;
        }
        spins = 0;
        idle_since = Instant::now();
        for c in batch.drain(..) {
            let i = c.stream as usize;
            let st = &streams[i];
            let ns = c.at_ns.saturating_sub(st.sent_at);
            lat.push(ns);
            if sequences && st.sent > 1 {
                lat_later.push(ns);
            }
            let status = unsafe { infer_response_status(c.resp) };
            let got = if status == INFER_STATUS_OK {
                output_i32(c.resp, out_name)
            } else {
                Err(format!("response status {status}"))
            };
            unsafe { infer_response_free(c.resp) };
            match got {
                Ok(v) if v == st.expect => {}
                Ok(v) => {
                    mismatches += 1;
                    if reported < 5 {
                        reported += 1;
                        eprintln!(
                            "sequences: '{model}' stream {i} request {} of {}: OUTPUT {v}, expected {}",
                            st.sent, st.len, st.expect
                        );
                    }
                }
                Err(e) => {
                    errors += 1;
                    if reported < 5 {
                        reported += 1;
                        eprintln!("sequences: '{model}' stream {i} request {}: {e}", st.sent);
                    }
                }
            }
            completed += 1;
            let more = if sequences {
                st.sent < st.len
            } else {
                sent_total < total
            };
            if more {
                send(i, &mut streams, &mut sent_total);
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu.report();
    while inbox.returned.load(Ordering::Acquire) < completed {
        std::thread::yield_now();
    }
    // The statistics are recorded before the responses go out; wait for the last.
    let mut stats = s.stats(model).since(&st0);
    let deadline = Instant::now() + Duration::from_secs(5);
    while stats.inferences < total && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
        stats = s.stats(model).since(&st0);
    }
    lat.sort_unstable();
    lat_later.sort_unstable();
    StreamRun {
        requests: completed,
        secs,
        lat,
        lat_later,
        mismatches,
        errors,
        stats,
        cpu,
    }
}

fn sequences(cfg: &Config) -> String {
    let n = cfg.sequences;
    let max_len = cfg.sequence_max_len.max(1);
    let rounds = cfg.sequence_rounds.max(1);
    let mut rng = XorShift::new(42);
    let lens: Vec<u32> = (0..n)
        .map(|_| rng.range(1, max_len as u64) as u32)
        .collect();
    let total: u64 = lens.iter().map(|&l| l as u64).sum();
    let warm_lens: Vec<u32> = (0..n.min(1000))
        .map(|_| rng.range(1, max_len as u64) as u32)
        .collect();
    let warm_total: u64 = warm_lens.iter().map(|&l| l as u64).sum();
    let us = |ns: u64| ns as f64 / 1000.0;
    let rate = |r: &StreamRun| r.requests as f64 / r.secs;
    let mut lines = Vec::new();
    let mut failed = Vec::new();
    for &delay in &cfg.sequence_delays {
        // Both models loaded side by side; the rounds alternate between them so that a
        // slow phase of the machine hits both.
        let sq = Server::new();
        sq.load("acc", &accumulator_direct("acc", delay));
        let sd = Server::new();
        sd.load("ident", &identity_int32_dynamic("ident", delay));
        drive_streams(&sq, "acc", &warm_lens, 1_000_001, 0, 0, 7);
        drive_streams(&sd, "ident", &[], 0, 256, warm_total, 7);
        let (mut qs, mut ds) = (Vec::new(), Vec::new());
        for r in 0..rounds as u64 {
            // Sequence batcher: every sequence, each request checked against its sum.
            qs.push(drive_streams(&sq, "acc", &lens, 1, 0, 0, 1 + r));
            // Dynamic batcher: the same number of requests, 256 outstanding.
            ds.push(drive_streams(&sd, "ident", &[], 0, 256, total, 1 + r));
        }
        drop(sq);
        drop(sd);

        let bad: u64 = qs.iter().chain(&ds).map(|r| r.mismatches + r.errors).sum();
        let ok = bad == 0
            && qs.iter().chain(&ds).all(|r| r.requests == total)
            && qs
                .iter()
                .all(|r| r.stats.inferences == total && r.stats.failures == 0);
        if !ok {
            failed.push(delay);
        }
        let (mismatches, errors) = (
            qs.iter().chain(&ds).map(|r| r.mismatches).sum::<u64>(),
            qs.iter().chain(&ds).map(|r| r.errors).sum::<u64>(),
        );
        // The round with the median rate stands for each side; the range shows the spread.
        qs.sort_by(|a, b| rate(a).total_cmp(&rate(b)));
        ds.sort_by(|a, b| rate(a).total_cmp(&rate(b)));
        let (q, d) = (&qs[qs.len() / 2], &ds[ds.len() / 2]);
        let (qr, dr) = (rate(q), rate(d));
        let range = |v: &[StreamRun]| format!("{:.0}-{:.0}", rate(&v[0]), rate(&v[v.len() - 1]));
        let rows: u64 = q.stats.batch_sizes.iter().map(|(s, c)| s * c).sum();
        let padding = rows.saturating_sub(q.stats.inferences) as f64 / rows.max(1) as f64;
        lines.push(format!(
            "sequences (execute_delay_us {delay}): sequence batcher Direct 4x64 slots, {n} sequences of 1-{max_len} requests all started at once: {} requests in {:.2}s = {qr:.0} req/s (median of {rounds} rounds, range {}); latency enqueue->FINAL p50={:.0}us p99={:.0}us, not first of sequence (n={}) p50={:.0}us p99={:.0}us; mean executed batch {:.2} ({} executions), padding {:.1}% of rows; {} || dynamic batcher (identity 4x64, 256 outstanding, closed loop), same {} requests: {:.2}s = {dr:.0} req/s (range {}; sequence/dynamic {:.2}x); p50={:.0}us p99={:.0}us; mean executed batch {:.2} ({} executions); {} || checked every response of {} rounds: {mismatches} mismatches, {errors} errors | target: every OUTPUT correct: {}",
            q.requests,
            q.secs,
            range(&qs),
            us(percentile(&q.lat, 0.50)),
            us(percentile(&q.lat, 0.99)),
            q.lat_later.len(),
            us(percentile(&q.lat_later, 0.50)),
            us(percentile(&q.lat_later, 0.99)),
            q.stats.mean_batch(),
            q.stats.executions,
            padding * 100.0,
            q.cpu,
            d.requests,
            d.secs,
            range(&ds),
            qr / dr,
            us(percentile(&d.lat, 0.50)),
            us(percentile(&d.lat, 0.99)),
            d.stats.mean_batch(),
            d.stats.executions,
            d.cpu,
            2 * rounds,
            verdict(ok),
        ));
    }
    if !failed.is_empty() {
        // Print what was measured, then fail loudly.
        for l in &lines {
            println!("{l}");
        }
        panic!("sequences: wrong or failed responses with execute_delay_us {failed:?} (see above and stderr)");
    }
    lines.join("\n")
}

// ---------------------------------------------------------------------------------------
// ensemble: (a) what an ensemble step costs against the application chaining the same
// models itself, one request at a time; (b) a 3-stage pipeline against its slowest stage.

/// An ensemble `name` chaining `models` (each INPUT0 -> OUTPUT0, FP32 `dims`): the
/// ensemble's INPUT0 goes to the first, each output to the next, the last one's output
/// is the ensemble's OUTPUT0.
fn chain_ensemble(name: &str, max_batch_size: u32, dims: &str, models: &[String]) -> String {
    let n = models.len();
    let tensor = |k: usize| match k {
        0 => "INPUT0".to_owned(),
        k if k == n => "OUTPUT0".to_owned(),
        k => format!("t{k}"),
    };
    let steps: Vec<String> = models
        .iter()
        .enumerate()
        .map(|(k, m)| {
            format!(
                r#"{{ model_name: "{m}" model_version: -1 input_map {{ key: "INPUT0" value: "{}" }} output_map {{ key: "OUTPUT0" value: "{}" }} }}"#,
                tensor(k),
                tensor(k + 1)
            )
        })
        .collect();
    format!(
        r#"name: "{name}" platform: "ensemble" max_batch_size: {max_batch_size}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {dims} ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {dims} ] }} ]
ensemble_scheduling {{ step [ {} ] }}
"#,
        steps.join(", ")
    )
}

/// A pipeline stage: identity FP32 [16], `max_batch_size: 8`, dynamic batching with a
/// 100 us queue delay, `instances` instances, `delay_us` simulated compute per execution.
fn identity_stage(name: &str, delay_us: u64, instances: u32) -> String {
    format!(
        r#"name: "{name}" backend: "identity" max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] }} ]
instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
dynamic_batching {{ max_queue_delay_microseconds: 100 }}
parameters {{ key: "execute_delay_us" value {{ string_value: "{delay_us}" }} }}
"#
    )
}

/// The data of output OUTPUT0 of a response, as bytes (valid until the response is freed).
fn output0_bytes<'a>(resp: *const Response) -> Result<&'a [u8], String> {
    let (mut dt, mut shape, mut nd, mut data, mut bs) =
        (0, std::ptr::null(), 0usize, std::ptr::null(), 0usize);
    unsafe {
        if infer_response_status(resp) != INFER_STATUS_OK {
            let m = infer_response_error_message(resp);
            let m = if m.is_null() {
                String::new()
            } else {
                CStr::from_ptr(m).to_string_lossy().into_owned()
            };
            return Err(format!("status {}: {m}", infer_response_status(resp)));
        }
        let st = infer_response_output_by_name(
            resp,
            c"OUTPUT0".as_ptr(),
            &mut dt,
            &mut shape,
            &mut nd,
            &mut data,
            &mut bs,
        );
        if st != INFER_STATUS_OK || dt != INFER_DATATYPE_FP32 {
            return Err(format!("OUTPUT0: status {st}, datatype {dt}"));
        }
        Ok(std::slice::from_raw_parts(data as *const u8, bs))
    }
}

/// Enqueues `r` and spins until its FINAL; returns the response and when its callback ran.
#[inline]
fn send_and_wait(s: &Server, slot: &LatencySlot, r: *mut Request) -> (*mut Response, u64) {
    slot.done.store(false, Ordering::Relaxed);
    check(
        unsafe {
            infer_server_enqueue(
                s.0,
                r,
                Some(latency_cb),
                slot as *const LatencySlot as *mut c_void,
                std::ptr::null_mut(),
            )
        },
        "infer_server_enqueue",
    );
    while !slot.done.load(Ordering::Acquire) {
        std::hint::spin_loop();
    }
    (
        slot.resp.load(Ordering::Relaxed),
        slot.at_ns.load(Ordering::Relaxed),
    )
}

/// The application's own chain: `first` (a request to models[0]) is sent, each output is
/// copied into a new request to the next model, and the last response is returned with
/// the time from the first enqueue to its FINAL.
fn app_chain(
    s: &Server,
    slot: &LatencySlot,
    first: *mut Request,
    models: &[CString],
    shape: &[i64],
) -> (u64, *mut Response) {
    let t0 = now_ns();
    let (mut resp, mut at) = send_and_wait(s, slot, first);
    for m in &models[1..] {
        let out = output0_bytes(resp).unwrap_or_else(|e| die(format!("ensemble: {e}")));
        let mut r = std::ptr::null_mut();
        unsafe {
            check(
                infer_request_new(s.0, m.as_ptr(), -1, &mut r),
                "infer_request_new",
            );
            check(
                infer_request_add_input(
                    r,
                    c"INPUT0".as_ptr(),
                    INFER_DATATYPE_FP32,
                    shape.as_ptr(),
                    shape.len(),
                    out.as_ptr() as *const c_void,
                    out.len(),
                ),
                "infer_request_add_input",
            );
            infer_response_free(resp);
        }
        (resp, at) = send_and_wait(s, slot, r);
    }
    (at.saturating_sub(t0), resp)
}

/// Latency samples (ns) summarised.
struct LatStats {
    n: usize,
    mean: f64,
    p50: f64,
    p99: f64,
}

impl LatStats {
    fn of(mut v: Vec<u64>) -> LatStats {
        v.sort_unstable();
        let us = |ns: u64| ns as f64 / 1000.0;
        LatStats {
            n: v.len(),
            mean: v.iter().sum::<u64>() as f64 / v.len().max(1) as f64 / 1000.0,
            p50: us(percentile(&v, 0.50)),
            p99: us(percentile(&v, 0.99)),
        }
    }
    fn show(&self) -> String {
        format!(
            "mean {:.2} p50 {:.2} p99 {:.2} us (n={})",
            self.mean, self.p50, self.p99, self.n
        )
    }
}

/// (a) for each chain length and each way of building the chain (N distinct models, each
/// with its own worker thread, or one model used N times): the ensemble and the
/// application's own chain, in alternating 100 ms blocks, every response checked.
fn ensemble_overhead(cfg: &Config) -> Vec<String> {
    let lens = [1usize, 2, 4];
    let max_len = *lens.iter().max().unwrap();
    let s = Server::new();
    let distinct: Vec<String> = (0..max_len).map(|k| format!("id{k}")).collect();
    for m in &distinct {
        s.load(m, &identity_unbatched(m));
    }
    s.load("same", &identity_unbatched("same"));
    let same: Vec<String> = vec!["same".to_owned(); max_len];
    let variants = [
        (
            "distinct",
            "a chain of N unbatched identity models",
            &distinct,
        ),
        ("same", "one unbatched identity model N times", &same),
    ];
    for (tag, _, models) in &variants {
        for &n in &lens {
            let name = format!("{tag}{n}");
            s.load(&name, &chain_ensemble(&name, 0, "1, 16", &models[..n]));
        }
    }
    let shape = [1i64, 16];
    let slot = LatencySlot {
        done: AtomicBool::new(false),
        at_ns: AtomicU64::new(0),
        resp: AtomicPtr::new(std::ptr::null_mut()),
    };
    let mut lines = Vec::new();
    for (tag, what, models) in &variants {
        if !cfg.ensemble_cases.contains('a') && !cfg.ensemble_cases.contains(&tag[..1]) {
            continue;
        }
        let c_models: Vec<CString> = models
            .iter()
            .map(|m| CString::new(m.as_str()).unwrap())
            .collect();
        let mut means = Vec::new();
        for &n in &lens {
            let ens_spec = RequestSpec::new(&format!("{tag}{n}"), &["INPUT0"], &shape);
            let app_spec = RequestSpec::new(&models[0], &["INPUT0"], &shape);
            let want: Vec<u8> = ens_spec.inputs[0]
                .1
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect();
            let verify = |resp: *mut Response, who: &str| {
                match output0_bytes(resp) {
                    Ok(b) if b == want.as_slice() => {}
                    Ok(_) => die(format!("ensemble: {who}, {tag} {n}: wrong OUTPUT0")),
                    Err(e) => die(format!("ensemble: {who}, {tag} {n}: {e}")),
                }
                unsafe { infer_response_free(resp) };
            };
            let run = |ens: &mut Vec<u64>, app: &mut Vec<u64>, secs: Duration| {
                let block = Duration::from_millis(100);
                let end = Instant::now() + secs;
                while Instant::now() < end {
                    let until = Instant::now() + block;
                    while Instant::now() < until {
                        let (ns, resp) = round_trip(&s, &slot, ens_spec.build(s.0));
                        verify(resp, "ensemble");
                        ens.push(ns);
                    }
                    let until = Instant::now() + block;
                    while Instant::now() < until {
                        let (ns, resp) =
                            app_chain(&s, &slot, app_spec.build(s.0), &c_models[..n], &shape);
                        verify(resp, "application chain");
                        app.push(ns);
                    }
                }
            };
            run(&mut Vec::new(), &mut Vec::new(), cfg.ensemble_warmup);
            let (mut ens, mut app) = (Vec::new(), Vec::new());
            let cpu = CpuWindow::start();
            run(&mut ens, &mut app, cfg.ensemble_secs);
            let cpu = cpu.report();
            let (e, a) = (LatStats::of(ens), LatStats::of(app));
            let step_mean = (e.mean - a.mean) / n as f64;
            let step_p50 = (e.p50 - a.p50) / n as f64;
            means.push((n, e.mean, a.mean, e.p50, a.p50));
            lines.push(format!(
                "ensemble overhead, {n} step(s), {what} ([1,16] FP32, 1 request in flight, enqueue->FINAL, every response checked): ensemble {}; application chaining the same calls itself {}; (ensemble - application) / steps: {step_mean:+.2} us (mean), {step_p50:+.2} us (p50); {cpu} | target <5 us per step: {}",
                e.show(),
                a.show(),
                verdict(step_mean < 5.0 && step_p50 < 5.0),
            ));
        }
        // How each side grows with the chain: the slope from the shortest to the longest.
        let (n0, e0, a0, ep0, ap0) = means[0];
        let (n1, e1, a1, ep1, ap1) = means[means.len() - 1];
        let dn = (n1 - n0) as f64;
        lines.push(format!(
            "ensemble overhead, {what}: latency added per extra step ({n0} -> {n1} steps): ensemble {:+.2} us mean, {:+.2} us p50; application chain {:+.2} us mean, {:+.2} us p50",
            (e1 - e0) / dn,
            (ep1 - ep0) / dn,
            (a1 - a0) / dn,
            (ap1 - ap0) / dn,
        ));
    }
    lines
}

/// What `saturate` measured.
struct Saturated {
    rate: f64,
    secs: f64,
    /// Statistics of the models asked for, over the measured window.
    stats: Vec<Stats>,
    failed: u64,
    cpu: String,
    /// Context switches (voluntary, involuntary) of the threads asked for.
    switches: (u64, u64),
}

/// Clients keep `threads x window` requests to `spec.model` outstanding; the rate over
/// the measured window and the statistics of `models` over it.
fn saturate(
    cfg: &Config,
    s: &Arc<Server>,
    spec: RequestSpec,
    models: &[&str],
    threads: &str,
) -> Saturated {
    let p = Pipeline::start(
        s.clone(),
        Arc::new(spec),
        cfg.threads,
        cfg.ensemble_window,
        0,
        true,
    );
    std::thread::sleep(cfg.ensemble_warmup);
    let st0: Vec<Stats> = models.iter().map(|m| s.stats(m)).collect();
    let (c0, t0) = (p.completed(), Instant::now());
    let cpu = CpuWindow::start();
    let sw0 = thread_switches(threads);
    std::thread::sleep(cfg.ensemble_secs);
    let (c1, t1) = (p.completed(), Instant::now());
    let sw1 = thread_switches(threads);
    let cpu = cpu.report();
    let stats: Vec<Stats> = models
        .iter()
        .zip(&st0)
        .map(|(m, a)| s.stats(m).since(a))
        .collect();
    let failed = p.failed();
    p.finish();
    let secs = (t1 - t0).as_secs_f64();
    Saturated {
        rate: (c1 - c0) as f64 / secs,
        secs,
        stats,
        failed,
        cpu,
        switches: (sw1.0 - sw0.0, sw1.1 - sw0.1),
    }
}

/// (b) a 3-stage pipeline (200 us / 1000 us / 300 us per execution, batches of up to 8)
/// with several instance counts, against its slowest stage driven alone at the same
/// concurrency.
fn ensemble_pipeline(cfg: &Config) -> Vec<String> {
    let delays = [200u64, 1000, 300];
    let names = ["s1", "s2", "s3"];
    // The built-in backends' simulated compute spins (at most) its last 500 us: the CPU
    // one execution of each stage burns.
    let spin_us: Vec<f64> = delays.iter().map(|&d| d.min(500) as f64).collect();
    let mut lines = Vec::new();
    for &inst in &cfg.ensemble_instances {
        let s = Arc::new(Server::new());
        for k in 0..3 {
            s.load(names[k], &identity_stage(names[k], delays[k], inst[k]));
        }
        let stages: Vec<String> = names.iter().map(|x| x.to_string()).collect();
        s.load("pipe", &chain_ensemble("pipe", 8, "16", &stages));
        // Capacity of each stage with full batches; the slowest one is driven alone.
        let cap: Vec<f64> = (0..3)
            .map(|k| inst[k] as f64 * 8.0 * 1e6 / delays[k] as f64)
            .collect();
        let slow = (0..3).min_by(|&a, &b| cap[a].total_cmp(&cap[b])).unwrap();
        let p = saturate(
            cfg,
            &s,
            RequestSpec::new("pipe", &["INPUT0"], &[1, 16]),
            &["pipe", "s1", "s2", "s3"],
            &format!("infer-{}-", names[slow]),
        );
        let a = saturate(
            cfg,
            &s,
            RequestSpec::new(names[slow], &["INPUT0"], &[1, 16]),
            &[names[slow]],
            &format!("infer-{}-", names[slow]),
        );
        drop(s);
        let ratio = p.rate / a.rate;
        let in_flight = cfg.threads * cfg.ensemble_window;
        let spin_cores: f64 = (0..3)
            .map(|k| p.stats[k + 1].executions as f64 * spin_us[k])
            .sum::<f64>()
            / 1e6
            / p.secs;
        // The slowest stage's cycle: time inside an execution and between executions.
        // The slowest stage's cycle, per instance: time inside an execution and between
        // executions.
        let cycle = |m: &Saturated, st: &Stats| {
            let n = st.executions.max(1) as f64;
            let inside = st.compute_us as f64 / n;
            format!(
                "{:.0} executions/s, {inside:.0} us inside each and {:.0} us between (per instance), worker context switches per execution {:.1} voluntary {:.1} involuntary",
                st.executions as f64 / m.secs,
                m.secs * 1e6 * inst[slow] as f64 / n - inside,
                m.switches.0 as f64 / n,
                m.switches.1 as f64 / n,
            )
        };
        let ok = ratio >= 0.9 && p.failed == 0 && a.failed == 0 && p.stats[0].failures == 0;
        lines.push(format!(
            "ensemble pipeline, 3 stages of {}/{}/{} us per execution, max_batch_size 8, instances {}/{}/{}, {in_flight} requests in flight: {:.0} req/s (stage mean batches {:.2}/{:.2}/{:.2}; {}: {}; simulated compute spins {spin_cores:.2} cores; failures {}; {}) || slowest stage {} alone, same concurrency: {:.0} req/s (ideal {:.0}, mean batch {:.2}, {}; failures {}; {}) || pipeline / slowest stage alone = {ratio:.3}, / ideal = {:.3} | target >=0.9: {}",
            delays[0],
            delays[1],
            delays[2],
            inst[0],
            inst[1],
            inst[2],
            p.rate,
            p.stats[1].mean_batch(),
            p.stats[2].mean_batch(),
            p.stats[3].mean_batch(),
            names[slow],
            cycle(&p, &p.stats[slow + 1]),
            p.failed + p.stats[0].failures,
            p.cpu,
            names[slow],
            a.rate,
            cap[slow],
            a.stats[0].mean_batch(),
            cycle(&a, &a.stats[0]),
            a.failed,
            a.cpu,
            p.rate / cap[slow],
            verdict(ok),
        ));
    }
    lines
}

fn ensemble(cfg: &Config) -> String {
    let mut lines = Vec::new();
    if cfg.ensemble_cases.contains(['a', 'd', 's']) {
        lines.extend(ensemble_overhead(cfg));
    }
    if cfg.ensemble_cases.contains('b') {
        lines.extend(ensemble_pipeline(cfg));
    }
    lines.join("\n")
}

// ---------------------------------------------------------------------------------------

struct Config {
    warmup: Duration,
    measure: Duration,
    clients: usize,
    client_spin: u32,
    client_yield: bool,
    threads: usize,
    window: usize,
    memory_requests: u64,
    memory_cap: Duration,
    sequences: usize,
    sequence_max_len: u32,
    sequence_delays: Vec<u64>,
    sequence_rounds: usize,
    ensemble_secs: Duration,
    ensemble_warmup: Duration,
    ensemble_window: usize,
    ensemble_cases: String,
    ensemble_instances: Vec<[u32; 3]>,
}

// cancel: infer_server_cancel with a long queue (the model paused).

/// Counts FINAL responses (`ud` is an AtomicUsize).
unsafe extern "C" fn count_cb(ud: *mut c_void, resp: *mut Response, flags: u32) {
    unsafe { infer_response_free(resp) };
    if flags & INFER_RESPONSE_FLAG_FINAL != 0 {
        // SAFETY: the counter outlives the server (the scenario frees the server first).
        unsafe { &*(ud as *const AtomicUsize) }.fetch_add(1, Ordering::Relaxed);
    }
}

fn cancel(_cfg: &Config) -> String {
    const QUEUED: usize = 1_000_000;
    const CANCELS: usize = 10_000;
    let finals = Box::new(AtomicUsize::new(0));
    let ud = &*finals as *const AtomicUsize as *mut c_void;
    let s = Server::new();
    s.load("identity", &identity_batched("identity"));
    let model = CString::new("identity").unwrap_or_default();
    check(
        unsafe { infer_server_pause_model(s.0, model.as_ptr()) },
        "pause",
    );
    let spec = RequestSpec::new("identity", &["INPUT0"], &[1, 16]);
    let mut ids = Vec::with_capacity(QUEUED);
    for _ in 0..QUEUED {
        let mut id = 0u64;
        check(
            unsafe { infer_server_enqueue(s.0, spec.build(s.0), Some(count_cb), ud, &mut id) },
            "infer_server_enqueue",
        );
        ids.push(id);
    }
    // Half of the cancels find a queued request, half an id that is not queued.
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut found = Vec::with_capacity(CANCELS);
    let mut missing = Vec::with_capacity(CANCELS);
    for k in 0..CANCELS {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let (id, into) = if k % 2 == 0 {
            (ids[(rng % QUEUED as u64) as usize], &mut found)
        } else {
            (u64::MAX - k as u64, &mut missing)
        };
        let t = Instant::now();
        let _ = unsafe { infer_server_cancel(s.0, id) };
        into.push(t.elapsed().as_nanos() as f64 / 1000.0);
    }
    check(
        unsafe { infer_server_resume_model(s.0, model.as_ptr()) },
        "resume",
    );
    drop(s);
    let p50 = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        (v[v.len() / 2], v[v.len() * 99 / 100])
    };
    let (f50, f99) = p50(&mut found);
    let (m50, m99) = p50(&mut missing);
    let answered = finals.load(Ordering::Relaxed);
    format!(
        "cancel: {QUEUED} requests queued (model paused); {CANCELS} cancels: of a queued request p50={f50:.1}us p99={f99:.1}us, of an id not queued p50={m50:.1}us p99={m99:.1}us; {answered} FINALs for {QUEUED} requests | target p99<=100us: {}",
        if f99 <= 100.0 && m99 <= 100.0 && answered == QUEUED { "MET" } else { "NOT MET" }
    )
}

/// The response cache: one request repeated, enqueue to FINAL, on the identity model
/// without the cache ("plain", every request executes) and with it ("cached", every
/// request after the first is a hit, answered on the cache's delivery thread), and on a
/// model whose execution takes 200 us (`execute_delay_us`), with and without. Rounds
/// alternate plain, cached, plain, cached... so that the shared machine's noise falls on
/// both; the line gives each side's p50 per round and the ratios.
fn cache(cfg: &Config) -> String {
    let s = Server::with_cache(1 << 20);
    let cached = |name: &str, delay: u32| {
        identity_unbatched(name).replace(
            "output [",
            &format!("parameters {{ key: \"execute_delay_us\" value {{ string_value: \"{delay}\" }} }}\nresponse_cache {{ enable: true }}\noutput ["),
        )
    };
    let plain = |name: &str, delay: u32| {
        identity_unbatched(name).replace(
            "output [",
            &format!("parameters {{ key: \"execute_delay_us\" value {{ string_value: \"{delay}\" }} }}\noutput ["),
        )
    };
    s.load("plain", &plain("plain", 0));
    s.load("cached", &cached("cached", 0));
    s.load("plain_slow", &plain("plain_slow", 200));
    s.load("cached_slow", &cached("cached_slow", 200));
    let slot = LatencySlot {
        done: AtomicBool::new(false),
        at_ns: AtomicU64::new(0),
        resp: AtomicPtr::new(std::ptr::null_mut()),
    };
    let rounds = 4;
    let window = cfg.measure.div_f64(2.0 * rounds as f64);
    let mut out = Vec::new();
    for (a, b) in [("plain", "cached"), ("plain_slow", "cached_slow")] {
        let specs = [
            RequestSpec::new(a, &["INPUT0"], &[1, 16]),
            RequestSpec::new(b, &["INPUT0"], &[1, 16]),
        ];
        // Warm-up (the cached model stores its answer here), checking the outputs.
        for spec in &specs {
            let warm_until = Instant::now() + cfg.warmup.div_f64(4.0);
            while Instant::now() < warm_until {
                let (_, resp) = round_trip(&s, &slot, spec.build(s.0));
                assert_eq!(unsafe { infer_response_status(resp) }, INFER_STATUS_OK);
                assert_eq!(output_f32(resp, "OUTPUT0"), spec.inputs[0].1);
                unsafe { infer_response_free(resp) };
            }
        }
        let mut p50s = [Vec::new(), Vec::new()];
        for _ in 0..rounds {
            for (k, spec) in specs.iter().enumerate() {
                let mut lat = Vec::new();
                let end = Instant::now() + window;
                while Instant::now() < end {
                    let (ns, resp) = round_trip(&s, &slot, spec.build(s.0));
                    unsafe { infer_response_free(resp) };
                    lat.push(ns);
                }
                lat.sort_unstable();
                p50s[k].push(percentile(&lat, 0.50) as f64 / 1000.0);
            }
        }
        let hits = s.stats(b);
        let ratios: Vec<String> = (0..rounds)
            .map(|r| format!("{:.2}", p50s[1][r] / p50s[0][r]))
            .collect();
        let fmt = |v: &[f64]| {
            v.iter()
                .map(|x| format!("{x:.1}"))
                .collect::<Vec<_>>()
                .join("/")
        };
        out.push(format!(
            "cache ({a} vs {b}): p50 us per round {} vs {}; cached/plain {} (executions of {b}: {})",
            fmt(&p50s[0]),
            fmt(&p50s[1]),
            ratios.join(" "),
            hits.executions
        ));
    }
    out.join("\n")
}

/// The rate limiter's cost: one request at a time, enqueue to FINAL, on the identity
/// model whose instance group names a resource, on a server with the rate limiter off
/// (the field has no effect) and on one with it on (each execution takes and gives back
/// the resource). Rounds alternate off, on, off, on...; the line gives each side's p50
/// per round and the ratios.
fn rate(cfg: &Config) -> String {
    let limited = identity_unbatched("lim").replace(
        "output [",
        "instance_group [ { count: 1 kind: KIND_CPU rate_limiter { resources [ { name: \"R\" global: true count: 1 } ] priority: 1 } } ]\noutput [",
    );
    let servers = [
        Server::with_options(0, INFER_RATE_LIMIT_OFF),
        Server::with_options(0, INFER_RATE_LIMIT_EXECUTION_COUNT),
    ];
    for s in &servers {
        s.load("lim", &limited);
    }
    let slot = LatencySlot {
        done: AtomicBool::new(false),
        at_ns: AtomicU64::new(0),
        resp: AtomicPtr::new(std::ptr::null_mut()),
    };
    let spec = RequestSpec::new("lim", &["INPUT0"], &[1, 16]);
    for s in &servers {
        let warm_until = Instant::now() + cfg.warmup.div_f64(2.0);
        while Instant::now() < warm_until {
            let (_, resp) = round_trip(s, &slot, spec.build(s.0));
            assert_eq!(unsafe { infer_response_status(resp) }, INFER_STATUS_OK);
            unsafe { infer_response_free(resp) };
        }
    }
    let rounds = 6;
    let window = cfg.measure.div_f64(2.0 * rounds as f64);
    let mut p50s = [Vec::new(), Vec::new()];
    for _ in 0..rounds {
        for (k, s) in servers.iter().enumerate() {
            let mut lat = Vec::new();
            let end = Instant::now() + window;
            while Instant::now() < end {
                let (ns, resp) = round_trip(s, &slot, spec.build(s.0));
                unsafe { infer_response_free(resp) };
                lat.push(ns);
            }
            lat.sort_unstable();
            p50s[k].push(percentile(&lat, 0.50) as f64 / 1000.0);
        }
    }
    let fmt = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.1}"))
            .collect::<Vec<_>>()
            .join("/")
    };
    let ratios: Vec<String> = (0..rounds)
        .map(|r| format!("{:.2}", p50s[1][r] / p50s[0][r]))
        .collect();
    format!(
        "rate (limiter off vs on): p50 us per round {} vs {}; on/off {}",
        fmt(&p50s[0]),
        fmt(&p50s[1]),
        ratios.join(" ")
    )
}

/// A scenario runs with the configuration and returns its result line.
type Scenario = fn(&Config) -> String;

const SCENARIOS: [(&str, Scenario); 10] = [
    ("latency", latency),
    ("closed_loop", closed_loop),
    ("pipelined", pipelined),
    ("batching_efficiency", batching_efficiency),
    ("memory", memory),
    ("sequences", sequences),
    ("ensemble", ensemble),
    ("cancel", cancel),
    ("cache", cache),
    ("rate", rate),
];

const USAGE: &str = "usage: cargo bench --bench perf -- [options] [scenario...]
scenarios: latency closed_loop pipelined batching_efficiency memory sequences ensemble cancel cache rate
           (default: all)
options:
  --warmup-secs F     warm-up per scenario (default 1)
  --secs F            measurement per scenario (default 3)
  --clients N         closed_loop client threads (default 64)
  --client-spin N     closed_loop: spins before a client waits (default 0)
  --client-wait W     closed_loop: how a client waits, park or yield (default park)
  --threads N         pipelined/batching/memory client threads (default 2)
  --window N          outstanding requests per pipelined thread (default 256)
  --memory-requests N memory: total requests (default 10000000)
  --memory-cap-secs F memory: time cap of the long run (default 100)
  --sequences N       sequences: sequences started at once (default 10000)
  --sequence-max-len N sequences: lengths are uniform in 1..=N (default 32)
  --sequence-delays L sequences: execute_delay_us values, comma-separated (default 0,200)
  --sequence-rounds N sequences: measured rounds per model and delay (default 3)
  --ensemble-secs F   ensemble: measurement per case (default 2; warm-up a quarter of it)
  --ensemble-window N ensemble: outstanding requests per client thread in the pipeline
                      cases (default 64; --threads sets the threads)
  --ensemble-cases C  ensemble: a = per-step overhead (d = chains of distinct models only,
                      s = one model N times only), b = pipeline throughput (default ab)
  --ensemble-instances L ensemble b: instance counts of the 3 stages, e.g. 1/1/1,2/1/2
                      (default 1/1/1,2/1/2,1/2/1)";

fn main() {
    let mut cfg = Config {
        warmup: Duration::from_secs(1),
        measure: Duration::from_secs(3),
        clients: 64,
        client_spin: 0,
        client_yield: false,
        threads: 2,
        window: 256,
        memory_requests: 10_000_000,
        memory_cap: Duration::from_secs(100),
        sequences: 10_000,
        sequence_max_len: 32,
        sequence_delays: vec![0, 200],
        sequence_rounds: 3,
        ensemble_secs: Duration::from_secs(2),
        ensemble_warmup: Duration::from_millis(500),
        ensemble_window: 64,
        ensemble_cases: "ab".to_owned(),
        ensemble_instances: vec![[1, 1, 1], [2, 1, 2], [1, 2, 1]],
    };
    let mut chosen: Vec<&str> = Vec::new();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    let value = |i: &mut usize| -> String {
        *i += 1;
        args.get(*i).cloned().unwrap_or_else(|| {
            eprintln!("{USAGE}");
            std::process::exit(2)
        })
    };
    let num = |s: String| -> f64 {
        s.parse().unwrap_or_else(|_| {
            eprintln!("not a number: {s}\n{USAGE}");
            std::process::exit(2)
        })
    };
    while i < args.len() {
        match args[i].as_str() {
            "--bench" => {} // passed by `cargo bench`
            "-h" | "--help" => {
                println!("{USAGE}");
                return;
            }
            "--warmup-secs" => cfg.warmup = Duration::from_secs_f64(num(value(&mut i))),
            "--secs" => cfg.measure = Duration::from_secs_f64(num(value(&mut i))),
            "--clients" => cfg.clients = num(value(&mut i)) as usize,
            "--client-spin" => cfg.client_spin = num(value(&mut i)) as u32,
            "--client-wait" => {
                cfg.client_yield = match value(&mut i).as_str() {
                    "park" => false,
                    "yield" => true,
                    w => {
                        eprintln!("--client-wait is park or yield, not '{w}'\n{USAGE}");
                        std::process::exit(2)
                    }
                }
            }
            "--threads" => cfg.threads = (num(value(&mut i)) as usize).max(1),
            "--window" => cfg.window = (num(value(&mut i)) as usize).max(1),
            "--memory-requests" => cfg.memory_requests = num(value(&mut i)) as u64,
            "--memory-cap-secs" => cfg.memory_cap = Duration::from_secs_f64(num(value(&mut i))),
            "--sequences" => cfg.sequences = (num(value(&mut i)) as usize).max(1),
            "--sequence-rounds" => cfg.sequence_rounds = (num(value(&mut i)) as usize).max(1),
            "--sequence-max-len" => cfg.sequence_max_len = (num(value(&mut i)) as u32).max(1),
            "--ensemble-secs" => {
                cfg.ensemble_secs = Duration::from_secs_f64(num(value(&mut i)));
                cfg.ensemble_warmup = cfg.ensemble_secs / 4;
            }
            "--ensemble-window" => cfg.ensemble_window = (num(value(&mut i)) as usize).max(1),
            "--ensemble-cases" => cfg.ensemble_cases = value(&mut i),
            "--ensemble-instances" => {
                cfg.ensemble_instances = value(&mut i)
                    .split(',')
                    .map(|case| {
                        let v: Vec<u32> = case
                            .split('/')
                            .map(|x| (num(x.trim().to_owned()) as u32).max(1))
                            .collect();
                        if v.len() != 3 {
                            eprintln!("--ensemble-instances takes a/b/c,...: '{case}'\n{USAGE}");
                            std::process::exit(2)
                        }
                        [v[0], v[1], v[2]]
                    })
                    .collect()
            }
            "--sequence-delays" => {
                cfg.sequence_delays = value(&mut i)
                    .split(',')
                    .map(|d| num(d.trim().to_owned()) as u64)
                    .collect()
            }
            a => match SCENARIOS.iter().find(|(n, _)| *n == a) {
                Some((n, _)) => chosen.push(n),
                None => {
                    eprintln!("unknown argument '{a}'\n{USAGE}");
                    std::process::exit(2);
                }
            },
        }
        i += 1;
    }
    if chosen.is_empty() {
        chosen = SCENARIOS.iter().map(|(n, _)| *n).collect();
    }
    now_ns();
    for name in chosen {
        let f = SCENARIOS.iter().find(|(n, _)| *n == name).unwrap().1;
        let before = core_round_trip_ns();
        let line = f(&cfg);
        let after = core_round_trip_ns();
        // A scenario may return several result lines (one per setting).
        for line in line.lines() {
            println!("{line} [core-to-core round trip {before} ns before, {after} ns after]");
        }
    }
}
