//! The scheduler against a stand-in model whose every output depends on the whole token
//! prefix read back through the paged cache: a block-table or accounting mistake changes
//! the tokens, so "equal to the request run alone" checks the paging too.

use super::settings::{Policy, Settings};
use super::*;
use crate::request::{ParamValue, Request, Response, ResponseSink};
use crate::tensor::{Shape, Tensor, TensorData};
use std::sync::mpsc;

const VOCAB: usize = 50;

/// Per step: (start, token count) of each work item.
type Steps = Arc<Mutex<Vec<Vec<(usize, usize)>>>>;
/// Steps (counted from the first, over all instances) that fail after writing to the
/// cache: (step, true to panic instead of returning an error).
type Faults = Arc<Mutex<Vec<(usize, bool)>>>;
/// A bad request: prompt, parameters, and what the error must say.
type BadCase<'a> = (Vec<i32>, Vec<(&'a str, ParamValue)>, &'a str);

struct Toy {
    tpb: usize,
    /// Per cache slot: the state of the prefix ending there (None: never written).
    cache: Vec<Option<u64>>,
    steps: Steps,
    faults: Faults,
    delay: Duration,
}

fn mix(prev: u64, token: u32) -> u64 {
    let mut x = prev ^ (u64::from(token) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 31;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^ (x >> 29)
}

impl Executor for Toy {
    fn step(&mut self, work: &[Work<'_>], logits: &mut Vec<f32>) -> Result<()> {
        logits.clear();
        let step = {
            let mut steps = self.steps.lock();
            steps.push(work.iter().map(|w| (w.start, w.tokens.len())).collect());
            steps.len() - 1
        };
        for w in work {
            let mut state = if w.start == 0 {
                7
            } else {
                let p = w.start - 1;
                let slot = w.blocks[p / self.tpb] as usize * self.tpb + p % self.tpb;
                self.cache[slot]
                    .ok_or_else(|| Error::internal(format!("slot {slot} read before written")))?
            };
            for (k, &t) in w.tokens.iter().enumerate() {
                let p = w.start + k;
                let block = *w
                    .blocks
                    .get(p / self.tpb)
                    .ok_or_else(|| Error::internal("block table too short"))?;
                state = mix(state, t);
                self.cache[block as usize * self.tpb + p % self.tpb] = Some(state);
            }
            if w.logits {
                let mut row = vec![0.0f32; VOCAB];
                row[(state % VOCAB as u64) as usize] = 1.0;
                // A second-best token, so sampling has a choice.
                row[((state >> 20) % VOCAB as u64) as usize] += 0.5;
                logits.extend_from_slice(&row);
            }
        }
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
        let fault = {
            let mut faults = self.faults.lock();
            let at = faults.iter().position(|(s, _)| *s == step);
            at.map(|i| faults.swap_remove(i).1)
        };
        match fault {
            Some(true) => panic!("toy step {step} panics"),
            Some(false) => Err(Error::internal(format!("toy step {step} fails"))),
            None => Ok(()),
        }
    }
}

fn settings(policy: Policy) -> Settings {
    Settings {
        policy,
        max_num_sequences: 8,
        max_num_tokens: 64,
        max_queue_size: 0,
        tokens_per_block: 4,
        kv_blocks: 64,
        chunked_context: false,
        prefix_reuse: false,
        threads: 1,
        default_max_tokens: 16,
    }
}

struct Harness {
    sched: Arc<Scheduler>,
    steps: Steps,
    faults: Faults,
    next_id: u64,
}

const CONFIG: &str = r#"
name: "toy"
backend: "gpt2"
input [ { name: "input_ids" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "output_ids" data_type: TYPE_INT32 dims: [ -1 ] },
         { name: "output_log_probs" data_type: TYPE_FP32 dims: [ -1 ] } ]
"#;

fn harness(s: Settings, instances: usize, delay: Duration) -> Harness {
    let config = Arc::new(crate::config::parse_config(CONFIG).expect("config"));
    let steps = Arc::new(Mutex::new(Vec::new()));
    let faults: Faults = Arc::default();
    let execs: Vec<Box<dyn Executor>> = (0..instances)
        .map(|_| {
            Box::new(Toy {
                tpb: s.tokens_per_block,
                cache: vec![None; s.tokens_per_block * s.kv_blocks],
                steps: steps.clone(),
                faults: faults.clone(),
                delay,
            }) as Box<dyn Executor>
        })
        .collect();
    let limits = ModelLimits {
        vocab_size: VOCAB,
        n_positions: 100,
    };
    let engine = Engine::new(&config, s, limits, Default::default()).unwrap();
    let sched = Scheduler::start_generative(
        ModelIdentity::new("toy", 1),
        config,
        engine,
        execs,
        crate::log::Logger::default(),
    )
    .expect("start");
    Harness {
        sched,
        steps,
        faults,
        next_id: 1,
    }
}

/// What a request got: the responses' tokens, status and finish reason.
#[derive(Debug, Default, Clone)]
struct Got {
    chunks: Vec<Vec<i32>>,
    status: Option<Code>,
    error: String,
    reason: String,
    cached: i64,
    log_probs: Vec<f32>,
}

impl Got {
    fn tokens(&self) -> Vec<i32> {
        self.chunks.concat()
    }
}

fn read(resp: &Response) -> (Vec<i32>, Vec<f32>) {
    let ids = resp
        .output("output_ids")
        .map(|o| {
            o.data
                .as_slice()
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        })
        .unwrap_or_default();
    let lp = resp
        .output("output_log_probs")
        .map(|o| {
            o.data
                .as_slice()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        })
        .unwrap_or_default();
    (ids, lp)
}

impl Harness {
    fn request(
        &mut self,
        prompt: &[i32],
        params: &[(&str, ParamValue)],
    ) -> (Box<Request>, mpsc::Receiver<Got>) {
        let mut r = Box::new(Request::new("toy", 1, None));
        r.id = self.next_id;
        self.next_id += 1;
        let bytes: Vec<u8> = prompt.iter().flat_map(|t| t.to_le_bytes()).collect();
        r.inputs.push(Tensor {
            name: Arc::from("input_ids"),
            dtype: DataType::Int32,
            shape: Shape::from_slice(&[prompt.len() as i64]),
            data: TensorData::Owned(bytes),
        });
        for (k, v) in params {
            r.parameters.push(((*k).to_owned(), v.clone()));
        }
        let (tx, rx) = mpsc::channel();
        let mut got = Got::default();
        let mut sink = ResponseSink::rust(move |resp: Box<Response>, flags| {
            let (ids, lp) = read(&resp);
            got.chunks.push(ids);
            got.log_probs.extend(lp);
            if flags & crate::request::RESPONSE_FLAG_FINAL != 0 {
                got.status = Some(resp.status);
                got.error = (resp.error.as_ref())
                    .map(|e| e.to_string_lossy().into_owned())
                    .unwrap_or_default();
                for (k, v) in &resp.parameters {
                    match (k.to_str().unwrap_or(""), v) {
                        ("finish_reason", ParamValue::Str(s)) => {
                            got.reason = s.to_string_lossy().into_owned()
                        }
                        ("cached_tokens", ParamValue::Int(n)) => got.cached = *n,
                        _ => {}
                    }
                }
                let _ = tx.send(std::mem::take(&mut got));
            }
        });
        sink.set_fallback(r.id, ModelIdentity::new("toy", 1));
        r.sink = Some(sink);
        (r, rx)
    }

    fn enqueue(
        &mut self,
        prompt: &[i32],
        params: &[(&str, ParamValue)],
    ) -> (u64, mpsc::Receiver<Got>) {
        let (r, rx) = self.request(prompt, params);
        let id = r.id;
        if let Err((mut r, e)) = self.sched.enqueue(r, None) {
            if let Some(s) = r.sink.as_mut() {
                s.disarm();
            }
            panic!("enqueue failed: {e}");
        }
        (id, rx)
    }

    fn run(&mut self, prompt: &[i32], params: &[(&str, ParamValue)]) -> Got {
        let (_, rx) = self.enqueue(prompt, params);
        rx.recv_timeout(Duration::from_secs(10)).expect("a FINAL")
    }

    fn stop(&self) {
        self.sched.close();
        self.sched.join();
    }

    /// KV blocks referenced by a request (the statistics' gauge).
    fn kv_blocks_used(&self) -> Option<u64> {
        let gen = self.sched.generative()?;
        let j: serde_json::Value = serde_json::from_str(&gen.gen_stats.json()).ok()?;
        j["kv_blocks_used"].as_u64()
    }
}

fn max_tokens(n: i64) -> (&'static str, ParamValue) {
    ("max_tokens", ParamValue::Int(n))
}

/// Prompts of mixed lengths, several sharing a prefix.
fn workload() -> Vec<(Vec<i32>, i64)> {
    let shared: Vec<i32> = (0..13).map(|i| (i * 7 + 3) % VOCAB as i32).collect();
    let mut w = Vec::new();
    for i in 0..12i32 {
        let len = [1, 3, 4, 5, 9, 17, 30][i as usize % 7];
        let mut p: Vec<i32> = if i % 3 == 0 {
            shared.clone()
        } else {
            Vec::new()
        };
        p.extend((0..len).map(|k| (k * 11 + i * 5) % VOCAB as i32));
        w.push((p, 3 + (i as i64 * 5) % 20));
    }
    w
}

fn alone(w: &[(Vec<i32>, i64)]) -> Vec<Vec<i32>> {
    let mut h = harness(settings(Policy::GuaranteedNoEvict), 1, Duration::ZERO);
    let out = w
        .iter()
        .map(|(p, n)| {
            let g = h.run(p, &[max_tokens(*n)]);
            assert_eq!(g.status, Some(Code::Ok));
            assert_eq!(g.reason, "length");
            assert_eq!(g.tokens().len(), *n as usize);
            g.tokens()
        })
        .collect();
    h.stop();
    out
}

fn together(s: Settings, instances: usize, w: &[(Vec<i32>, i64)]) -> (Vec<Got>, Harness) {
    let mut h = harness(s, instances, Duration::ZERO);
    h.sched.set_paused(true);
    // Every other request streams: preemption and chunking must not change what it sees.
    let rxs: Vec<_> = w
        .iter()
        .enumerate()
        .map(|(i, (p, n))| {
            let streaming = ("streaming", ParamValue::Bool(i % 2 == 1));
            h.enqueue(p, &[max_tokens(*n), streaming]).1
        })
        .collect();
    h.sched.set_paused(false);
    let got = rxs
        .iter()
        .map(|rx| rx.recv_timeout(Duration::from_secs(10)).expect("a FINAL"))
        .collect();
    (got, h)
}

#[test]
fn batched_output_equals_output_alone_under_every_policy() {
    let w = workload();
    let want = alone(&w);
    let mut variants: Vec<(&str, Settings, usize)> = Vec::new();
    for policy in [
        Policy::GuaranteedNoEvict,
        Policy::MaxUtilization,
        Policy::StaticBatch,
    ] {
        variants.push((policy.as_str(), settings(policy), 1));
    }
    let mut chunked = settings(Policy::GuaranteedNoEvict);
    chunked.chunked_context = true;
    chunked.max_num_tokens = 8;
    variants.push(("chunked, 8 tokens per iteration", chunked, 1));
    let mut small = settings(Policy::MaxUtilization);
    small.kv_blocks = 14;
    variants.push(("max_utilization, 14 blocks (preemption)", small, 1));
    let mut reuse = settings(Policy::GuaranteedNoEvict);
    reuse.prefix_reuse = true;
    variants.push(("prefix reuse", reuse, 1));
    let mut all = settings(Policy::MaxUtilization);
    all.prefix_reuse = true;
    all.chunked_context = true;
    all.max_num_tokens = 8;
    all.kv_blocks = 14;
    variants.push(("everything at once", all, 1));
    variants.push(("two instances", settings(Policy::GuaranteedNoEvict), 2));
    for (what, s, instances) in variants {
        let reuse = s.prefix_reuse;
        let (got, h) = together(s, instances, &w);
        for (i, g) in got.iter().enumerate() {
            assert_eq!(g.status, Some(Code::Ok), "{what}: request {i}: {g:?}");
            assert_eq!(g.tokens(), want[i], "{what}: request {i}");
            if i % 2 == 1 {
                assert!(
                    g.chunks.iter().all(|c| c.len() == 1),
                    "{what}: request {i}: {g:?}"
                );
            }
        }
        let stats = h.sched.stats_json("toy", 1);
        let v: serde_json::Value = serde_json::from_str(&stats).expect("stats JSON");
        if what.contains("preemption") || what.contains("everything") {
            assert!(
                v["generation"]["preemptions"].as_u64() > Some(0),
                "{what}: {stats}"
            );
        }
        if reuse {
            assert!(
                got.iter().any(|g| g.cached > 0),
                "{what}: no prefix was reused"
            );
        }
        h.stop();
    }
}

#[test]
fn requests_join_and_leave_the_running_batch() {
    for policy in [Policy::GuaranteedNoEvict, Policy::StaticBatch] {
        let mut h = harness(settings(policy), 1, Duration::from_millis(2));
        let (_, a) = h.enqueue(&[1, 2, 3], &[max_tokens(30)]);
        // Let A run a few iterations, then B arrives.
        while h.steps.lock().len() < 3 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let (_, b) = h.enqueue(&[4, 5], &[max_tokens(3)]);
        let ga = a.recv_timeout(Duration::from_secs(10)).unwrap();
        let gb = b.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!((ga.tokens().len(), gb.tokens().len()), (30, 3));
        let steps = h.steps.lock().clone();
        let max_batch = steps.iter().map(|s| s.len()).max().unwrap_or(0);
        match policy {
            // B joined while A ran, and left after 3 tokens while A went on.
            Policy::GuaranteedNoEvict => {
                assert_eq!(max_batch, 2, "{steps:?}");
                let last_two = steps.iter().rposition(|s| s.len() == 2).unwrap();
                assert!(last_two < steps.len() - 5, "B left at once: {steps:?}");
            }
            // B waited for A's batch to end.
            _ => assert_eq!(max_batch, 1, "{steps:?}"),
        }
        h.stop();
    }
}

#[test]
fn streaming_sends_one_token_per_iteration_and_final_last() {
    let mut h = harness(settings(Policy::GuaranteedNoEvict), 1, Duration::ZERO);
    let plain = h.run(&[9, 8, 7], &[max_tokens(6)]);
    let streamed = h.run(
        &[9, 8, 7],
        &[max_tokens(6), ("streaming", ParamValue::Bool(true))],
    );
    assert_eq!(streamed.chunks.len(), 6, "{streamed:?}");
    assert!(streamed.chunks.iter().all(|c| c.len() == 1));
    assert_eq!(streamed.tokens(), plain.tokens());
    assert_eq!(streamed.reason, "length");
    assert_eq!(plain.chunks.len(), 1);
    assert_eq!(plain.log_probs.len(), 6);
    assert!(plain.log_probs.iter().all(|l| *l <= 0.0));
    h.stop();
}

#[test]
fn end_id_stops_generation_without_returning_it() {
    let mut h = harness(settings(Policy::GuaranteedNoEvict), 1, Duration::ZERO);
    let full = h.run(&[3, 1, 4, 1, 5], &[max_tokens(12)]).tokens();
    // The first token that does not occur earlier in the output.
    let k = (1..full.len())
        .find(|&k| !full[..k].contains(&full[k]))
        .unwrap();
    let g = h.run(
        &[3, 1, 4, 1, 5],
        &[max_tokens(12), ("end_id", ParamValue::Int(full[k] as i64))],
    );
    assert_eq!(g.reason, "end_id");
    assert_eq!(g.status, Some(Code::Ok));
    assert_eq!(g.tokens(), full[..k]);
    let s = h.run(
        &[3, 1, 4, 1, 5],
        &[
            max_tokens(12),
            ("end_id", ParamValue::Int(full[k] as i64)),
            ("streaming", ParamValue::Bool(true)),
        ],
    );
    assert_eq!(s.tokens(), full[..k]);
    assert_eq!(
        s.chunks.last().map(Vec::len),
        Some(0),
        "the FINAL carries no token: {s:?}"
    );
    h.stop();
}

#[test]
fn the_context_limit_ends_generation_with_length() {
    let mut s = settings(Policy::MaxUtilization);
    s.max_num_tokens = 128;
    let mut h = harness(s, 1, Duration::ZERO);
    let prompt: Vec<i32> = (0..95).map(|i| i % VOCAB as i32).collect();
    let g = h.run(&prompt, &[max_tokens(50)]);
    assert_eq!((g.reason.as_str(), g.tokens().len()), ("length", 5));
    h.stop();
}

#[test]
fn seeded_sampling_is_reproducible_and_batching_invariant() {
    let sample = [
        max_tokens(20),
        ("temperature", ParamValue::Double(5.0)),
        ("seed", ParamValue::Int(42)),
    ];
    let mut h = harness(settings(Policy::GuaranteedNoEvict), 1, Duration::ZERO);
    let a = h.run(&[1, 2], &sample).tokens();
    let greedy = h.run(&[1, 2], &[max_tokens(20)]).tokens();
    assert_ne!(
        a, greedy,
        "temperature 5 on two candidates should stray from greedy"
    );
    h.sched.set_paused(true);
    let rxs: Vec<_> = (0..5).map(|_| h.enqueue(&[1, 2], &sample).1).collect();
    let (_, other) = h.enqueue(
        &[3],
        &[max_tokens(20), ("temperature", ParamValue::Double(1.0))],
    );
    h.sched.set_paused(false);
    for rx in rxs {
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(10)).unwrap().tokens(),
            a
        );
    }
    assert_eq!(
        other.recv_timeout(Duration::from_secs(10)).unwrap().status,
        Some(Code::Ok)
    );
    h.stop();
}

#[test]
fn cancel_running_and_queued_requests() {
    let mut s = settings(Policy::GuaranteedNoEvict);
    s.max_num_sequences = 1;
    let mut h = harness(s, 1, Duration::from_millis(1));
    let (a, ra) = h.enqueue(
        &[1],
        &[
            max_tokens(10_000 / 200),
            ("streaming", ParamValue::Bool(true)),
        ],
    );
    let (b, rb) = h.enqueue(&[2], &[max_tokens(5)]);
    while h.steps.lock().len() < 3 {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(h.sched.cancel(b), CancelOutcome::Cancelled, "B is queued");
    assert_eq!(h.sched.cancel(a), CancelOutcome::Running);
    let ga = ra.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(
        (ga.status, ga.reason.as_str()),
        (Some(Code::Cancelled), "cancelled")
    );
    assert!(!ga.tokens().is_empty() && ga.tokens().len() < 50);
    let gb = rb.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(gb.status, Some(Code::Cancelled));
    assert_eq!(h.sched.cancel(a), CancelOutcome::NotFound);
    h.stop();
}

#[test]
fn queue_limits_timeouts_and_bad_requests() {
    let mut s = settings(Policy::GuaranteedNoEvict);
    s.max_queue_size = 2;
    s.kv_blocks = 20;
    let mut h = harness(s, 1, Duration::ZERO);
    h.sched.set_paused(true);
    let (_, r1) = h.enqueue(&[1], &[max_tokens(2)]);
    let (mut timed, rt) = h.request(&[1], &[max_tokens(2)]);
    timed.timeout_us = 1000;
    assert!(h.sched.enqueue(timed, None).is_ok());
    let (third, _) = h.request(&[1], &[max_tokens(2)]);
    let (mut r, e) = h.sched.enqueue(third, None).unwrap_err();
    r.sink.as_mut().unwrap().disarm();
    assert_eq!(e.code, Code::ResourceExhausted, "{e}");
    // Paused: the timed request expires in the queue.
    let gt = rt.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(gt.status, Some(Code::DeadlineExceeded));
    h.sched.set_paused(false);
    assert_eq!(
        r1.recv_timeout(Duration::from_secs(10)).unwrap().status,
        Some(Code::Ok)
    );
    let bad: Vec<BadCase> = vec![
        (vec![], vec![], "non-empty"),
        (vec![50], vec![], "not a token id"),
        (vec![-1], vec![], "not a token id"),
        (
            (0..100)
                .collect::<Vec<i32>>()
                .iter()
                .map(|t| t % 50)
                .collect(),
            vec![],
            "no room",
        ),
        (vec![1], vec![max_tokens(0)], "max_tokens"),
        (
            vec![1],
            vec![("max_token", ParamValue::Int(3))],
            "unknown request parameter 'max_token'",
        ),
        (
            vec![1],
            vec![("streaming", ParamValue::Int(1))],
            "'streaming' must be a bool",
        ),
        (vec![1], vec![("top_p", ParamValue::Double(0.0))], "top_p"),
        (
            vec![1],
            vec![("temperature", ParamValue::Double(-1.0))],
            "temperature",
        ),
        (vec![1], vec![max_tokens(1000)], "KV blocks"),
    ];
    for (prompt, params, want) in bad {
        let (mut r, _) = h.request(&prompt, &params);
        if prompt.is_empty() {
            r.inputs[0].shape = Shape::from_slice(&[0]);
        }
        let (mut r, e) = h.sched.enqueue(r, None).unwrap_err();
        r.sink.as_mut().unwrap().disarm();
        assert_eq!(e.code, Code::InvalidArgument, "{want}: {e}");
        assert!(e.message.contains(want), "{want}: {e}");
    }
    h.stop();
}

#[test]
fn unload_finishes_the_running_and_queued_requests_and_cancel_all_ends_them() {
    let mut h = harness(settings(Policy::GuaranteedNoEvict), 1, Duration::ZERO);
    let rxs: Vec<_> = (0..20)
        .map(|i| h.enqueue(&[i % 50], &[max_tokens(5)]).1)
        .collect();
    h.stop();
    for rx in rxs {
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(10)).unwrap().status,
            Some(Code::Ok)
        );
    }
    let mut h = harness(
        settings(Policy::GuaranteedNoEvict),
        1,
        Duration::from_millis(1),
    );
    let rxs: Vec<_> = (0..20)
        .map(|i| h.enqueue(&[i % 50], &[max_tokens(50)]).1)
        .collect();
    std::thread::sleep(Duration::from_millis(5));
    h.sched.cancel_all("shutting down");
    h.stop();
    for rx in rxs {
        let g = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(
            (g.status, g.reason.as_str()),
            (Some(Code::Cancelled), "cancelled")
        );
    }
}

#[test]
fn iteration_statistics_reach_the_callback() {
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut h = harness(settings(Policy::GuaranteedNoEvict), 1, Duration::ZERO);
    let sched = h.sched.clone();
    let gen = sched.generative().unwrap();
    let sink = seen.clone();
    let collect: Arc<StatsCallback> = Arc::new(move |json: &str| sink.lock().push(json.to_owned()));
    gen.set_stats_callback(Some(collect));
    h.run(&[1, 2, 3, 4, 5, 6], &[max_tokens(4)]);
    gen.set_stats_callback(None);
    h.run(&[1], &[max_tokens(4)]);
    let seen = seen.lock();
    assert_eq!(seen.len(), 4, "{seen:?}");
    let first: serde_json::Value = serde_json::from_str(&seen[0]).unwrap();
    for k in [
        "timestamp_us",
        "iteration",
        "active_requests",
        "max_requests",
        "context_requests",
        "generation_requests",
        "context_tokens",
        "kv_blocks_max",
        "kv_blocks_used",
        "kv_blocks_free",
        "tokens_per_block",
        "paused_requests",
    ] {
        assert!(first.get(k).is_some(), "{k} missing in {first}");
    }
    assert_eq!(first["context_tokens"], 6);
    assert_eq!(first["context_requests"], 1);
    assert_eq!(first["kv_blocks_used"], 2);
    let second: serde_json::Value = serde_json::from_str(&seen[1]).unwrap();
    assert_eq!(
        (
            second["generation_requests"].as_u64(),
            second["context_tokens"].as_u64()
        ),
        (Some(1), Some(0))
    );
    h.stop();
}

#[test]
fn a_running_request_past_its_timeout_ends_with_deadline_exceeded() {
    let mut h = harness(
        settings(Policy::GuaranteedNoEvict),
        1,
        Duration::from_millis(1),
    );
    let (mut r, rx) = h.request(
        &[1, 2],
        &[max_tokens(90), ("streaming", ParamValue::Bool(true))],
    );
    r.timeout_us = 20_000;
    assert!(h.sched.enqueue(r, None).is_ok());
    let g = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(
        (g.status, g.reason.as_str()),
        (Some(Code::DeadlineExceeded), "error"),
        "{g:?}"
    );
    let n = g.tokens().len();
    assert!(n > 0 && n < 90, "stopped midway: {n} tokens");
    // The cache is free again: a request needing all of it runs.
    let g = h.run(&[3], &[max_tokens(90)]);
    assert_eq!(g.tokens().len(), 90);
    h.stop();
}

#[test]
fn a_request_that_outgrows_the_whole_cache_ends_with_resource_exhausted() {
    let mut s = settings(Policy::MaxUtilization);
    s.kv_blocks = 3; // 12 positions
    let mut h = harness(s, 1, Duration::ZERO);
    let g = h.run(&[1, 2], &[max_tokens(20)]);
    assert_eq!(g.status, Some(Code::ResourceExhausted), "{g:?}");
    assert_eq!(g.reason, "error");
    // 12 positions hold the prompt and 10 tokens; the 11th comes from the last logits.
    assert_eq!(g.tokens().len(), 11, "the tokens that fitted: {g:?}");
    // The instance goes on serving.
    let g = h.run(&[1, 2], &[max_tokens(5)]);
    assert_eq!((g.status, g.tokens().len()), (Some(Code::Ok), 5));
    h.stop();
}

/// A step that fails, or panics, after it wrote to the cache ends exactly the requests
/// it scheduled (INTERNAL, naming the model and saying what happened); their blocks go
/// back, nothing they wrote is reused as a prefix, and the other requests, then the same
/// workload again, answer as each request does alone.
#[test]
fn a_failed_or_panicking_step_ends_its_requests_and_leaves_the_cache_sound() {
    let w = workload();
    let want = alone(&w);
    let mut s = settings(Policy::MaxUtilization);
    s.prefix_reuse = true;
    s.chunked_context = true;
    s.max_num_tokens = 16;
    let mut h = harness(s, 1, Duration::ZERO);
    h.faults.lock().extend([(2, false), (6, true)]);
    for round in 0..2 {
        h.sched.set_paused(true);
        let rxs: Vec<_> = w
            .iter()
            .map(|(p, n)| h.enqueue(p, &[max_tokens(*n)]).1)
            .collect();
        h.sched.set_paused(false);
        let mut failed = Vec::new();
        for (i, rx) in rxs.iter().enumerate() {
            let g = rx.recv_timeout(Duration::from_secs(10)).expect("a FINAL");
            match g.status {
                Some(Code::Ok) => assert_eq!(g.tokens(), want[i], "round {round}, request {i}"),
                Some(Code::Internal) if round == 0 => {
                    assert!(g.error.contains("model 'toy'"), "{}", g.error);
                    failed.push(g.error);
                }
                _ => panic!("round {round}, request {i}: {g:?}"),
            }
        }
        if round == 0 {
            assert!(
                failed.iter().any(|e| e.contains("toy step 2 fails"))
                    && failed
                        .iter()
                        .any(|e| e.contains("panicked: toy step 6 panics")),
                "{failed:?}"
            );
            assert!(h.faults.lock().is_empty());
        }
        assert_eq!(
            h.kv_blocks_used(),
            Some(0),
            "round {round}: blocks not freed"
        );
    }
    h.stop();
}

/// Requests cancelled while they run give their blocks back mid-generation: with prefix
/// reuse on, the workload run again afterwards answers as each request does alone, and
/// no block stays referenced.
#[test]
fn cancelled_requests_leave_the_cache_sound() {
    let w = workload();
    let want = alone(&w);
    let mut s = settings(Policy::MaxUtilization);
    s.prefix_reuse = true;
    let mut h = harness(s, 1, Duration::from_millis(1));
    let running: Vec<_> = w
        .iter()
        .map(|(p, n)| h.enqueue(p, &[max_tokens(*n)]))
        .collect();
    while h.steps.lock().len() < 4 {
        std::thread::sleep(Duration::from_millis(1));
    }
    for (id, _) in running.iter().step_by(2) {
        h.sched.cancel(*id);
    }
    for (i, (_, rx)) in running.iter().enumerate() {
        let g = rx.recv_timeout(Duration::from_secs(10)).expect("a FINAL");
        match g.status {
            Some(Code::Ok) => assert_eq!(g.tokens(), want[i], "request {i}"),
            Some(Code::Cancelled) => assert_eq!(i % 2, 0, "request {i} was not cancelled"),
            _ => panic!("request {i}: {g:?}"),
        }
    }
    for (i, (p, n)) in w.iter().enumerate() {
        let g = h.run(p, &[max_tokens(*n)]);
        assert_eq!(
            (g.status, g.tokens()),
            (Some(Code::Ok), want[i].clone()),
            "request {i} after the cancellations"
        );
    }
    assert_eq!(h.kv_blocks_used(), Some(0));
    h.stop();
}
