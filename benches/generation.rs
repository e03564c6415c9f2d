//! Generative models: in-flight batching against static batching on a mixed workload,
//! and the scheduler's own CPU time per iteration.
//!
//! Run with `cargo bench --bench generation -- [mixed] [overhead] [--requests N]
//! [--rate R] [--seed S] [--threads T] [--max-num-tokens N] [--policy P ...]`; without a
//! scenario both run (all three policies, max_num_tokens 2048, chunked prefill). See
//! docs/PERFORMANCE.md.
//!
//! * `mixed`: a GPT-2-small-sized model (12 layers, width 768, vocabulary 50257, random
//!   weights written once to `target/generation-bench/gpt2_small/`), N requests (default
//!   32) with prompts of 16..512 tokens and outputs of 8..256 tokens (uniform, fixed
//!   seed), arriving as a Poisson process at R requests/s (default 4), all streaming. Run
//!   once per policy (max_utilization, guaranteed_no_evict, static_batch) with the same
//!   workload: generated tokens/s over the run, time to first token and inter-token
//!   latency p50/p99, mean requests per iteration.
//! * `overhead`: the tiny model (`models/tiny_gpt2`) with 256 requests in flight: the
//!   scheduler's CPU time per iteration outside the model step and the sampling
//!   (`scheduler_us` of the iteration statistics), over the iterations with 256 active
//!   requests.

use infer::ffi::request::*;
use infer::ffi::response::*;
use infer::ffi::server::*;
use infer::ffi::*;
use infer::llm::{Gpt2, Gpt2Config};
use infer::request::Response;
use infer::server::ServerOptions;
use serde_json::Value;
use std::ffi::{c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

fn last_error() -> String {
    unsafe { CStr::from_ptr(infer_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

fn check(st: infer_status, what: &str) {
    if st != INFER_STATUS_OK {
        eprintln!("{what} failed: status {st}: {}", last_error());
        std::process::exit(1);
    }
}

fn cs(s: &str) -> CString {
    CString::new(s).unwrap()
}

struct Server(*mut ServerHandle);
unsafe impl Send for Server {}
unsafe impl Sync for Server {}

impl Server {
    fn new() -> Server {
        unsafe {
            let mut o: *mut ServerOptions = std::ptr::null_mut();
            check(infer_server_options_new(&mut o), "infer_server_options_new");
            check(infer_server_options_set_gpu(o, INFER_GPU_OFF), "set_gpu");
            let mut s = std::ptr::null_mut();
            check(infer_server_new(o, &mut s), "infer_server_new");
            infer_server_options_free(o);
            Server(s)
        }
    }
    fn load(&self, name: &str, config: &str, dir: &Path) {
        let d = cs(dir.to_str().unwrap());
        check(
            unsafe {
                infer_server_load_model(self.0, cs(name).as_ptr(), cs(config).as_ptr(), d.as_ptr())
            },
            "load",
        );
    }
    fn stats(&self, model: &str) -> Value {
        let mut out = std::ptr::null_mut();
        check(
            unsafe { infer_server_statistics_json(self.0, cs(model).as_ptr(), &mut out) },
            "statistics",
        );
        let s = unsafe { CStr::from_ptr(out) }.to_str().unwrap().to_owned();
        unsafe { infer_string_free(out) };
        serde_json::from_str(&s).unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        unsafe { infer_server_free(self.0) };
    }
}

/// Timestamps of one request's responses.
#[derive(Default)]
struct Track {
    enqueued: Option<Instant>,
    tokens: Vec<Instant>,
    done: bool,
    status: infer_status,
}

#[derive(Default)]
struct Board {
    tracks: Mutex<Vec<Track>>,
    cv: Condvar,
}

struct Ud {
    board: Arc<Board>,
    index: usize,
}

unsafe extern "C" fn on_response(ud: *mut c_void, resp: *mut Response, flags: u32) {
    let now = Instant::now();
    let u = &*(ud as *const Ud);
    let (mut dt, mut shape, mut nd, mut data, mut bs) =
        (0, std::ptr::null(), 0usize, std::ptr::null(), 0usize);
    let n = if infer_response_output_by_name(
        resp,
        c"output_ids".as_ptr(),
        &mut dt,
        &mut shape,
        &mut nd,
        &mut data,
        &mut bs,
    ) == INFER_STATUS_OK
    {
        bs / 4
    } else {
        0
    };
    let status = infer_response_status(resp);
    infer_response_free(resp);
    let mut t = u.board.tracks.lock().unwrap();
    let tr = &mut t[u.index];
    tr.tokens.extend(std::iter::repeat_n(now, n));
    if flags & INFER_RESPONSE_FLAG_FINAL != 0 {
        tr.done = true;
        tr.status = status;
        drop(t);
        u.board.cv.notify_all();
        drop(Box::from_raw(ud as *mut Ud));
    }
}

fn enqueue(
    s: &Server,
    model: &str,
    prompt: &[i32],
    max_tokens: i64,
    board: &Arc<Board>,
    index: usize,
) {
    unsafe {
        let mut r = std::ptr::null_mut();
        check(
            infer_request_new(s.0, cs(model).as_ptr(), -1, &mut r),
            "request",
        );
        check(
            infer_request_add_input(
                r,
                c"input_ids".as_ptr(),
                INFER_DATATYPE_INT32,
                [prompt.len() as i64].as_ptr(),
                1,
                prompt.as_ptr() as *const c_void,
                prompt.len() * 4,
            ),
            "input",
        );
        check(
            infer_request_set_parameter_int(r, c"max_tokens".as_ptr(), max_tokens),
            "max_tokens",
        );
        // Every request generates max_tokens, as llama-bench and llama-batched-bench do
        // (the model's end-of-sequence token would end a random-weight model's early).
        check(
            infer_request_set_parameter_bool(r, c"ignore_eos".as_ptr(), true),
            "ignore_eos",
        );
        check(
            infer_request_set_parameter_bool(r, c"streaming".as_ptr(), true),
            "streaming",
        );
        board.tracks.lock().unwrap()[index].enqueued = Some(Instant::now());
        let ud = Box::into_raw(Box::new(Ud {
            board: board.clone(),
            index,
        })) as *mut c_void;
        let st = infer_server_enqueue(s.0, r, Some(on_response), ud, std::ptr::null_mut());
        if st != INFER_STATUS_OK {
            drop(Box::from_raw(ud as *mut Ud));
            check(st, "enqueue");
        }
    }
}

/// A small deterministic generator (the workload must be the same for every policy).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 11
    }
    fn uniform(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
    fn unit(&mut self) -> f64 {
        (self.next() as f64 + 0.5) / (1u64 << 53) as f64
    }
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let rank = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

struct Args {
    scenarios: Vec<String>,
    /// `llama-cpp`: the GGUF files, llama.cpp's bin folder, rounds, stream counts.
    ggufs: Vec<String>,
    llama_bin: String,
    rounds: usize,
    streams: Vec<usize>,
    /// `llama-one`: what to measure (`tg`, `pp`, or a stream count).
    what: String,
    requests: usize,
    rate: f64,
    seed: u64,
    threads: usize,
    max_num_tokens: usize,
    policies: Vec<String>,
}

fn args() -> Args {
    let mut a = Args {
        scenarios: Vec::new(),
        ggufs: Vec::new(),
        llama_bin: "target/llama.cpp/bin".into(),
        rounds: 3,
        streams: vec![8, 32],
        what: String::new(),
        requests: 32,
        rate: 4.0,
        seed: 7,
        threads: 0,
        max_num_tokens: 2048,
        policies: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        let mut num = |what: &str| -> f64 {
            it.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{what} needs a number"))
        };
        match x.as_str() {
            "--requests" => a.requests = num("--requests") as usize,
            "--rate" => a.rate = num("--rate"),
            "--seed" => a.seed = num("--seed") as u64,
            "--threads" => a.threads = num("--threads") as usize,
            "--max-num-tokens" => a.max_num_tokens = num("--max-num-tokens") as usize,
            "--policy" => a.policies.push(it.next().expect("--policy needs a name")),
            "--gguf" => a.ggufs.push(it.next().expect("--gguf needs a path")),
            "--llama-bin" => a.llama_bin = it.next().expect("--llama-bin needs a folder"),
            "--rounds" => a.rounds = num("--rounds") as usize,
            "--streams" => {
                a.streams = it
                    .next()
                    .expect("--streams needs a list")
                    .split(',')
                    .map(|x| x.parse().expect("--streams: numbers"))
                    .collect()
            }
            "--what" => a.what = it.next().expect("--what needs tg, pp or a stream count"),
            "--bench" => {}
            s if !s.starts_with('-') => a.scenarios.push(s.to_owned()),
            s => panic!("unknown option {s}"),
        }
    }
    if a.policies.is_empty() {
        a.policies = ["max_utilization", "guaranteed_no_evict", "static_batch"]
            .map(String::from)
            .to_vec();
    }
    if a.scenarios.is_empty() {
        a.scenarios = vec!["mixed".into(), "overhead".into()];
    }
    a
}

fn small_model_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/generation-bench/gpt2_small");
    let v1 = dir.join("1");
    if !v1.join("model.safetensors").is_file() {
        eprintln!("writing random GPT-2-small weights to {}", v1.display());
        std::fs::create_dir_all(&v1).unwrap();
        let model = Gpt2::random(Gpt2Config::default(), 1);
        model
            .save(&v1)
            .unwrap_or_else(|e| panic!("saving the model: {e}"));
    }
    dir
}

fn mixed(a: &Args) {
    let dir = small_model_dir();
    let mut rng = Lcg(a.seed);
    let work: Vec<(Vec<i32>, i64, f64)> = {
        let mut t = 0.0;
        (0..a.requests)
            .map(|_| {
                let len = rng.uniform(16, 512) as usize;
                let prompt: Vec<i32> = (0..len).map(|_| rng.uniform(0, 50256) as i32).collect();
                let out = rng.uniform(8, 256) as i64;
                t += -rng.unit().ln() / a.rate;
                (prompt, out, t)
            })
            .collect()
    };
    let total_out: i64 = work.iter().map(|w| w.1).sum();
    let total_in: usize = work.iter().map(|w| w.0.len()).sum();
    println!(
        "mixed workload: {} requests, {total_in} prompt tokens, {total_out} output tokens, arrivals over {:.1} s (Poisson, {} req/s); GPT-2-small-sized random weights; {} compute threads",
        a.requests,
        work.last().map_or(0.0, |w| w.2),
        a.rate,
        if a.threads == 0 { "all cores as".to_owned() } else { a.threads.to_string() }
    );
    println!(
        "{:<22} {:>9} {:>8} {:>10} {:>10} {:>9} {:>9} {:>10}",
        "policy", "tokens/s", "wall s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "batch avg"
    );
    for policy in &a.policies {
        let config = format!(
            r#"name: "gpt" backend: "gpt2" max_batch_size: 0
parameters {{ key: "batch_scheduler_policy" value {{ string_value: "{policy}" }} }}
parameters {{ key: "max_num_sequences" value {{ string_value: "32" }} }}
parameters {{ key: "max_num_tokens" value {{ string_value: "{}" }} }}
parameters {{ key: "enable_chunked_context" value {{ string_value: "true" }} }}
parameters {{ key: "max_tokens_in_paged_kv_cache" value {{ string_value: "16384" }} }}
parameters {{ key: "intra_op_thread_count" value {{ string_value: "{}" }} }}"#,
            a.max_num_tokens, a.threads
        );
        let s = Server::new();
        s.load("gpt", &config, &dir);
        let board = Arc::new(Board::default());
        *board.tracks.lock().unwrap() = (0..work.len()).map(|_| Track::default()).collect();
        let start = Instant::now();
        for (i, (prompt, out, at)) in work.iter().enumerate() {
            let when = start + Duration::from_secs_f64(*at);
            if let Some(d) = when.checked_duration_since(Instant::now()) {
                std::thread::sleep(d);
            }
            enqueue(&s, "gpt", prompt, *out, &board, i);
        }
        let mut t = board.tracks.lock().unwrap();
        while !t.iter().all(|t| t.done) {
            t = board.cv.wait(t).unwrap();
        }
        let end = t
            .iter()
            .filter_map(|t| t.tokens.last().copied())
            .max()
            .unwrap_or(start);
        let wall = end.duration_since(start).as_secs_f64();
        let generated: usize = t.iter().map(|t| t.tokens.len()).sum();
        assert!(
            t.iter().all(|t| t.status == INFER_STATUS_OK),
            "a request failed"
        );
        assert_eq!(
            generated as i64, total_out,
            "every request gets max_tokens tokens"
        );
        let mut ttft: Vec<f64> = t
            .iter()
            .map(|t| {
                t.tokens[0]
                    .duration_since(t.enqueued.unwrap())
                    .as_secs_f64()
                    * 1e3
            })
            .collect();
        let mut itl: Vec<f64> = t
            .iter()
            .flat_map(|t| {
                t.tokens
                    .windows(2)
                    .map(|w| w[1].duration_since(w[0]).as_secs_f64() * 1e3)
            })
            .collect();
        drop(t);
        let st = s.stats("gpt");
        let m = &st["models"][0];
        let iters = m["execution_count"].as_f64().unwrap_or(1.0).max(1.0);
        let rows: f64 = m["batch_sizes"]
            .as_array()
            .map(|v| {
                v.iter()
                    .map(|b| b["size"].as_f64().unwrap() * b["count"].as_f64().unwrap())
                    .sum()
            })
            .unwrap_or(0.0);
        println!(
            "{:<22} {:>9.1} {:>8.1} {:>8.0}ms {:>8.0}ms {:>7.0}ms {:>7.0}ms {:>10.1}",
            policy,
            generated as f64 / wall,
            wall,
            percentile(&mut ttft, 0.5),
            percentile(&mut ttft, 0.99),
            percentile(&mut itl, 0.5),
            percentile(&mut itl, 0.99),
            rows / iters
        );
        println!(
            "{:<22} preemptions {}, iterations {}, scheduler_us p50 {} p99 {}",
            "",
            m["generation"]["preemptions"],
            m["generation"]["iterations"],
            m["generation"]["scheduler_us"]["p50"],
            m["generation"]["scheduler_us"]["p99"],
        );
    }
}

unsafe extern "C" fn on_iteration(ud: *mut c_void, json: *const std::ffi::c_char) {
    let v = &*(ud as *const Mutex<Vec<IterationSample>>);
    let j: Value = serde_json::from_str(CStr::from_ptr(json).to_str().unwrap()).unwrap();
    let g = |k: &str| j[k].as_u64().unwrap_or(0);
    v.lock().unwrap().push((
        g("active_requests"),
        g("scheduler_us"),
        g("step_us"),
        g("sample_us"),
    ));
}

/// Per iteration: active requests, scheduler_us, step_us, sample_us.
type IterationSample = (u64, u64, u64, u64);

fn overhead() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tiny_gpt2");
    let config = r#"name: "tiny" backend: "gpt2" max_batch_size: 0
parameters { key: "batch_scheduler_policy" value { string_value: "guaranteed_no_evict" } }
parameters { key: "max_num_sequences" value { string_value: "256" } }
parameters { key: "max_num_tokens" value { string_value: "8192" } }
parameters { key: "kv_cache_blocks" value { string_value: "2048" } }
parameters { key: "intra_op_thread_count" value { string_value: "1" } }"#;
    let s = Server::new();
    s.load("tiny", config, &dir);
    let seen: Box<Mutex<Vec<IterationSample>>> = Box::default();
    check(
        unsafe {
            infer_server_set_iteration_stats_callback(
                s.0,
                c"tiny".as_ptr(),
                Some(on_iteration),
                &*seen as *const _ as *mut c_void,
            )
        },
        "stats callback",
    );
    let board = Arc::new(Board::default());
    let n = 256;
    *board.tracks.lock().unwrap() = (0..n).map(|_| Track::default()).collect();
    check(
        unsafe { infer_server_pause_model(s.0, c"tiny".as_ptr()) },
        "pause",
    );
    let mut rng = Lcg(3);
    for i in 0..n {
        let prompt: Vec<i32> = (0..rng.uniform(8, 32))
            .map(|_| rng.uniform(0, 255) as i32)
            .collect();
        enqueue(&s, "tiny", &prompt, 64, &board, i);
    }
    check(
        unsafe { infer_server_resume_model(s.0, c"tiny".as_ptr()) },
        "resume",
    );
    let mut t = board.tracks.lock().unwrap();
    while !t.iter().all(|t| t.done) {
        t = board.cv.wait(t).unwrap();
    }
    drop(t);
    check(
        unsafe {
            infer_server_set_iteration_stats_callback(
                s.0,
                c"tiny".as_ptr(),
                None,
                std::ptr::null_mut(),
            )
        },
        "stats callback",
    );
    let seen = seen.lock().unwrap();
    let full: Vec<&IterationSample> = seen.iter().filter(|v| v.0 == n as u64).collect();
    let mut sched: Vec<f64> = full.iter().map(|v| v.1 as f64).collect();
    let mut step: Vec<f64> = full.iter().map(|v| v.2 as f64).collect();
    let mut sample: Vec<f64> = full.iter().map(|v| v.3 as f64).collect();
    let st = s.stats("tiny");
    let deliver = &st["models"][0]["generation"]["deliver_us"];
    println!(
        "delivery (responses built, callbacks run) per iteration, all iterations: p50 {} p99 {} us",
        deliver["p50"], deliver["p99"]
    );
    println!(
        "scheduler overhead, tiny model, {n} requests in flight: {} iterations at {n} active; scheduler_us p50 {:.0} p99 {:.0} mean {:.1}; model step_us p50 {:.0}; sampling_us p50 {:.0}",
        full.len(),
        percentile(&mut sched, 0.5),
        percentile(&mut sched, 0.99),
        sched.iter().sum::<f64>() / sched.len().max(1) as f64,
        percentile(&mut step, 0.5),
        percentile(&mut sample, 0.5),
    );
}

fn main() {
    let a = args();
    for sc in &a.scenarios {
        match sc.as_str() {
            "mixed" => mixed(&a),
            "overhead" => overhead(),
            "llama-cpp" => llama_cpp(&a),
            "llama-one" => llama_one(&a),
            other => panic!("unknown scenario {other} (mixed, overhead, llama-cpp)"),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Against llama.cpp on the same GGUF file
// ---------------------------------------------------------------------------------------

/// Peak resident memory of this process, in MiB (VmHWM).
fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// One measurement of libinfer in this (child) process, printed as one JSON line:
/// `tg` (one stream, 128 tokens after a 1-token prompt: tokens/s between the first and
/// the last token), `pp` (a 512-token prompt: prompt tokens/s to the first token), or a
/// stream count S (S requests of 128 prompt + 128 generated tokens at once: all tokens
/// over the wall time, as llama-batched-bench's `speed`; also the seconds until every
/// prompt's first token, in all, and the decoding steps' median and tenth percentile).
fn llama_one(a: &Args) {
    let gguf = PathBuf::from(&a.ggufs[0]);
    let dir = std::env::temp_dir().join(format!("infer-llama-bench-{}", std::process::id()));
    let v1 = dir.join("1");
    std::fs::create_dir_all(&v1).unwrap();
    let link = v1.join("model.gguf");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(std::fs::canonicalize(&gguf).unwrap(), &link).unwrap();
    let streams: usize = a.what.parse().unwrap_or(1);
    let config = format!(
        r#"backend: "llama"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
parameters {{ key: "intra_op_thread_count" value {{ string_value: "{}" }} }}
parameters {{ key: "max_num_sequences" value {{ string_value: "{}" }} }}
parameters {{ key: "max_num_tokens" value {{ string_value: "{}" }} }}
parameters {{ key: "max_tokens_in_paged_kv_cache" value {{ string_value: "{}" }} }}
parameters {{ key: "enable_chunked_context" value {{ string_value: "true" }} }}"#,
        a.threads.max(1),
        streams.max(1),
        512.max(streams * 128),
        (streams.max(1) * 640).max(1024),
    );
    let s = {
        let mut o: *mut ServerOptions = std::ptr::null_mut();
        unsafe {
            check(infer_server_options_new(&mut o), "options");
            check(infer_server_options_set_gpu(o, INFER_GPU_OFF), "gpu");
            check(
                infer_server_options_set_trusted_repository(o, true),
                "trusted",
            );
            let mut s = std::ptr::null_mut();
            check(infer_server_new(o, &mut s), "server");
            infer_server_options_free(o);
            Server(s)
        }
    };
    let t0 = Instant::now();
    s.load("lm", &config, &dir);
    let load_s = t0.elapsed().as_secs_f64();
    let mut rng = Lcg(11);
    let vocab = 32000;
    let run = |prompts: Vec<Vec<i32>>, max_tokens: i64| -> (Instant, Vec<Track>) {
        let board = Arc::new(Board::default());
        *board.tracks.lock().unwrap() = (0..prompts.len()).map(|_| Track::default()).collect();
        let start = Instant::now();
        for (i, p) in prompts.iter().enumerate() {
            enqueue(&s, "lm", p, max_tokens, &board, i);
        }
        let mut t = board.tracks.lock().unwrap();
        while !t.iter().all(|x| x.done) {
            t = board.cv.wait(t).unwrap();
        }
        assert!(
            t.iter().all(|x| x.status == INFER_STATUS_OK),
            "a request failed"
        );
        (start, std::mem::take(&mut *t))
    };
    let mut prompt =
        |n: usize| -> Vec<i32> { (0..n).map(|_| rng.uniform(0, vocab - 1) as i32).collect() };
    // Warm-up (pages the weights in, sizes the buffers), as llama-bench does.
    run(vec![prompt(16)], 4);
    let out = match a.what.as_str() {
        "tg" => {
            let (_, t) = run(vec![prompt(1)], 128);
            let tok = &t[0].tokens;
            let secs = (*tok.last().unwrap() - tok[0]).as_secs_f64();
            serde_json::json!({"tg_ts": (tok.len() - 1) as f64 / secs})
        }
        "pp" => {
            let (start, t) = run(vec![prompt(512)], 1);
            let secs = (t[0].tokens[0] - start).as_secs_f64();
            serde_json::json!({"pp_ts": 512.0 / secs})
        }
        _ => {
            let prompts: Vec<Vec<i32>> = (0..streams).map(|_| prompt(128)).collect();
            let (start, t) = run(prompts, 128);
            let end = t.iter().map(|x| *x.tokens.last().unwrap()).max().unwrap();
            // Every prompt's first token: the prompts' share of the time.
            let first = t.iter().map(|x| x.tokens[0]).max().unwrap();
            let total = streams * (128 + 128);
            // The decoding steps' times, from the gaps between one stream's tokens: their
            // median and tenth percentile move less with the host's other load than the
            // wall time does.
            let mut gaps: Vec<f64> = t[0]
                .tokens
                .windows(2)
                .map(|w| (w[1] - w[0]).as_secs_f64() * 1e3)
                .collect();
            gaps.sort_by(f64::total_cmp);
            let at = |q: f64| gaps.get((q * gaps.len() as f64) as usize).copied();
            serde_json::json!({
                "speed": total as f64 / (end - start).as_secs_f64(),
                "prompts_s": (first - start).as_secs_f64(),
                "all_s": (end - start).as_secs_f64(),
                "step_ms_median": at(0.5),
                "step_ms_p10": at(0.1),
            })
        }
    };
    let mut out = out;
    out["load_s"] = load_s.into();
    out["peak_rss_mib"] = peak_rss_mib().into();
    println!("{out}");
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `cmd`, returning its stdout and its peak resident memory in MiB.
/// Runs `cmd` to the end: its standard output and its own peak resident memory in MiB
/// (`wait4`'s, for this child alone: `RUSAGE_CHILDREN` keeps the largest of every
/// child so far).
fn run_measured(cmd: &mut std::process::Command) -> (String, f64) {
    match try_measured(cmd) {
        Ok(r) => r,
        Err(why) => panic!("{cmd:?} failed: {why}"),
    }
}

/// [`run_measured`], or how the child ended where it did not exit with 0.
#[allow(clippy::zombie_processes)]
fn try_measured(cmd: &mut std::process::Command) -> Result<(String, f64), String> {
    use std::io::Read;
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let mut out = String::new();
    if let Some(mut o) = child.stdout.take() {
        o.read_to_string(&mut out).unwrap();
    }
    let mut status = 0;
    // SAFETY: wait4 fills the status and the struct it is given; the child is ours and
    // not waited for elsewhere.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = unsafe { libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut ru) };
    if pid <= 0 {
        return Err(format!("wait4: {}", std::io::Error::last_os_error()));
    }
    // The child is reaped; std's own wait would find no child.
    std::mem::forget(child);
    if libc::WIFSIGNALED(status) {
        return Err(format!("killed by signal {}", libc::WTERMSIG(status)));
    }
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        return Err(format!("exit status {}: {out}", libc::WEXITSTATUS(status)));
    }
    Ok((out, ru.ru_maxrss as f64 / 1024.0))
}

/// Runs one of llama.cpp's tools with `args`; where it dies of a signal (its AMX
/// kernels raised SIGILL when a compiler dropped their tile configuration, which
/// `scripts/llama_cpp.sh` now prevents for GCC 12), once more with its weight
/// repacking off (`off`: the flag that turns it off), which keeps it to its AVX
/// kernels. Says so on stderr, once per tool.
fn run_llama_tool(bin: &Path, args: &[&str], off: &[&str]) -> (String, f64) {
    static WARNED: std::sync::Mutex<Vec<std::path::PathBuf>> = std::sync::Mutex::new(Vec::new());
    let mut cmd = std::process::Command::new(bin);
    match try_measured(cmd.args(args)) {
        Ok(r) => r,
        Err(why) if why.starts_with("killed") => {
            let mut warned = WARNED.lock().unwrap_or_else(|e| e.into_inner());
            if !warned.iter().any(|b| b == bin) {
                eprintln!(
                    "note: {} {why}; its runs that die so are rerun with {} (weight repacking, and with it AMX, off)",
                    bin.display(),
                    off.join(" ")
                );
                warned.push(bin.to_path_buf());
            }
            drop(warned);
            let mut again = std::process::Command::new(bin);
            run_measured(again.args(args).args(off))
        }
        Err(why) => panic!("{cmd:?} failed: {why}"),
    }
}

fn ours(a: &Args, gguf: &str, what: &str) -> Value {
    let exe = std::env::current_exe().unwrap();
    let (out, _) = run_measured(
        std::process::Command::new(exe)
            .args(["llama-one", "--gguf", gguf, "--what", what, "--threads"])
            .arg(a.threads.max(1).to_string()),
    );
    serde_json::from_str(out.lines().last().unwrap_or("{}")).unwrap()
}

fn theirs(a: &Args, gguf: &str, what: &str) -> Value {
    let bin = Path::new(&a.llama_bin);
    let t = a.threads.max(1).to_string();
    match what {
        "tg" | "pp" => {
            let (p, n) = if what == "tg" {
                ("0", "128")
            } else {
                ("512", "0")
            };
            let (out, rss) = run_llama_tool(
                &bin.join("llama-bench"),
                &[
                    "-m", gguf, "-p", p, "-n", n, "-t", &t, "-r", "1", "-o", "json",
                ],
                &["--repack", "0"],
            );
            let v: Value = serde_json::from_str(&out).expect("llama-bench JSON");
            let ts = v[0]["avg_ts"].as_f64().unwrap();
            let key = if what == "tg" { "tg_ts" } else { "pp_ts" };
            serde_json::json!({key: ts, "peak_rss_mib": rss})
        }
        s => {
            let (out, rss) = run_llama_tool(
                &bin.join("llama-batched-bench"),
                &[
                    "-m",
                    gguf,
                    "-c",
                    "16384",
                    "-b",
                    "2048",
                    "-ub",
                    "512",
                    "-npp",
                    "128",
                    "-ntg",
                    "128",
                    "-npl",
                    s,
                    "-t",
                    &t,
                    "--output-format",
                    "jsonl",
                ],
                &["--no-repack"],
            );
            let line = out
                .lines()
                .rev()
                .find(|l| l.starts_with('{'))
                .expect("jsonl");
            let v: Value = serde_json::from_str(line).unwrap();
            serde_json::json!({"speed": v["speed"].as_f64().unwrap(), "peak_rss_mib": rss})
        }
    }
}

/// libinfer against llama.cpp on each GGUF: single-stream generation (`llama-bench
/// -n 128`), prompt processing (`-p 512`) and S concurrent streams
/// (`llama-batched-bench -npp 128 -ntg 128 -npl S`), same threads, interleaved A, B,
/// B, A, ... over `--rounds`; prints each pair's ratio and the median and range.
/// Peak resident memory is each process's own (llama.cpp's is the most any of its
/// runs so far reached: RUSAGE_CHILDREN keeps a maximum).
fn llama_cpp(a: &Args) {
    assert!(
        !a.ggufs.is_empty(),
        "llama-cpp needs --gguf FILE (one or more)"
    );
    let mut whats: Vec<String> = vec!["tg".into(), "pp".into()];
    whats.extend(a.streams.iter().map(|s| s.to_string()));
    if !a.what.is_empty() {
        // `--what tg,pp,8`: only those measurements.
        whats = a.what.split(',').map(String::from).collect();
    }
    println!(
        "threads {}, {} rounds; ratio = libinfer / llama.cpp (tokens/s; higher is better)",
        a.threads.max(1),
        a.rounds
    );
    for gguf in &a.ggufs {
        for what in &whats {
            let key = match what.as_str() {
                "tg" => "tg_ts",
                "pp" => "pp_ts",
                _ => "speed",
            };
            let mut ratios = Vec::new();
            let (mut ours_v, mut theirs_v, mut rss) = (Vec::new(), Vec::new(), (0.0f64, 0.0f64));
            for r in 0..a.rounds {
                let (x, y) = if r % 2 == 0 {
                    let x = ours(a, gguf, what);
                    (x, theirs(a, gguf, what))
                } else {
                    let y = theirs(a, gguf, what);
                    (ours(a, gguf, what), y)
                };
                let (xv, yv) = (x[key].as_f64().unwrap(), y[key].as_f64().unwrap());
                ours_v.push(xv);
                theirs_v.push(yv);
                ratios.push(xv / yv);
                rss.0 = rss.0.max(x["peak_rss_mib"].as_f64().unwrap_or(0.0));
                rss.1 = rss.1.max(y["peak_rss_mib"].as_f64().unwrap_or(0.0));
            }
            let mut sorted = ratios.clone();
            let med = percentile(&mut sorted, 0.5);
            let label = match what.as_str() {
                "tg" => "tg128 (1 stream)".to_string(),
                "pp" => "pp512".to_string(),
                s => format!("{s} streams, 128+128"),
            };
            let name = Path::new(gguf).file_name().unwrap().to_string_lossy();
            println!(
                "{name} {label}: libinfer {:.1} tok/s, llama.cpp {:.1} tok/s; ratio median {med:.2} (range {:.2}-{:.2}); peak RSS {:.0} / {:.0} MiB",
                ours_v.iter().sum::<f64>() / ours_v.len() as f64,
                theirs_v.iter().sum::<f64>() / theirs_v.len() as f64,
                sorted[0],
                sorted[sorted.len() - 1],
                rss.0,
                rss.1,
            );
        }
    }
}
