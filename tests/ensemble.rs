//! Ensembles (`platform: "ensemble"`, Triton's `ensemble_scheduling`) through the C API:
//! pipelines, fan-out/fan-in, output pruning, nesting, step errors, sequences, batching of
//! internal requests, per-step in-flight limits, unload, cancel and load-time validation.

mod common;
use common::*;
use infer::ffi::server::*;
use infer::ffi::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

// ---------------------------------------------------------------------------------------
// Configs
// ---------------------------------------------------------------------------------------

/// One step: `model`, input map (composing input, ensemble tensor), output map
/// (composing output, ensemble tensor), `max_inflight_requests` (0: omitted).
fn step(model: &str, ins: &[(&str, &str)], outs: &[(&str, &str)], max_inflight: u32) -> String {
    let mut s = format!("{{ model_name: \"{model}\" model_version: -1\n");
    for (k, v) in ins {
        s += &format!("  input_map {{ key: \"{k}\" value: \"{v}\" }}\n");
    }
    for (k, v) in outs {
        s += &format!("  output_map {{ key: \"{k}\" value: \"{v}\" }}\n");
    }
    if max_inflight > 0 {
        s += &format!("  max_inflight_requests: {max_inflight}\n");
    }
    s + "}"
}

/// Tensor list entries `{ name data_type dims }`.
fn tensors(ts: &[(&str, &str, &str)]) -> String {
    ts.iter()
        .map(|(n, dt, dims)| format!("{{ name: \"{n}\" data_type: {dt} dims: [ {dims} ] }}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// An ensemble config.
fn ens(
    name: &str,
    mbs: u32,
    inputs: &[(&str, &str, &str)],
    outputs: &[(&str, &str, &str)],
    steps: &[String],
) -> String {
    format!(
        r#"name: "{name}" platform: "ensemble" max_batch_size: {mbs}
input [ {} ]
output [ {} ]
ensemble_scheduling {{ step [ {} ] }}
"#,
        tensors(inputs),
        tensors(outputs),
        steps.join(", ")
    )
}

const F4: &str = "TYPE_FP32";

/// FP32 [4] tensors.
fn f4(names: &[&'static str]) -> Vec<(&'static str, &'static str, &'static str)> {
    names.iter().map(|n| (*n, F4, "4")).collect()
}

/// An add_sub step: INPUT0 <- a, INPUT1 <- b, OUTPUT0 -> sum, OUTPUT1 -> diff (either
/// output left out when "").
fn add_sub_step(model: &str, a: &str, b: &str, sum: &str, diff: &str) -> String {
    let mut outs = vec![];
    if !sum.is_empty() {
        outs.push(("OUTPUT0", sum));
    }
    if !diff.is_empty() {
        outs.push(("OUTPUT1", diff));
    }
    step(model, &[("INPUT0", a), ("INPUT1", b)], &outs, 0)
}

/// A one-in one-out FP32 [4] model (IN -> OUT) on `backend`, batching up to 64.
fn unary(name: &str, backend: &str, extra: &str) -> String {
    format!(
        r#"name: "{name}" backend: "{backend}" max_batch_size: 64
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] }} ]
{extra}
"#
    )
}

/// The built-in identity as a unary model.
fn identity(name: &str) -> String {
    unary(name, "identity", "")
}

fn infer_count(s: &Server, model: &str) -> u64 {
    s.stats(model)["models"][0]["inference_count"]
        .as_u64()
        .unwrap()
}

fn cancel(s: &Server, id: u64) -> infer_status {
    unsafe { infer_server_cancel(s.0, id) }
}

// ---------------------------------------------------------------------------------------
// Rust test backends (fn pointers: per-test state lives in statics)
// ---------------------------------------------------------------------------------------

fn copy_in_out(batch: &mut Batch) -> infer::status::Result<()> {
    let (i, data) = batch.input("IN").unwrap();
    let shape = i.shape.clone();
    let v = data.to_vec();
    batch.alloc_output("OUT", &shape, None)?.copy_from_slice(&v);
    Ok(())
}

fn always_fail(_: &mut Batch) -> infer::status::Result<()> {
    Err(infer::status::Error::invalid("boom from the failing step"))
}

static SLOW_CUR: AtomicUsize = AtomicUsize::new(0);
static SLOW_MAX: AtomicUsize = AtomicUsize::new(0);
static SLOW_RUNS: AtomicUsize = AtomicUsize::new(0);

/// Copies IN to OUT after 20 ms, recording the peak number of concurrent executions.
fn slow_counting(batch: &mut Batch) -> infer::status::Result<()> {
    let now = SLOW_CUR.fetch_add(1, Ordering::SeqCst) + 1;
    SLOW_MAX.fetch_max(now, Ordering::SeqCst);
    SLOW_RUNS.fetch_add(1, Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(20));
    SLOW_CUR.fetch_sub(1, Ordering::SeqCst);
    copy_in_out(batch)
}

/// Copies IN to OUT after 30 ms (no shared state).
fn slow_copy(batch: &mut Batch) -> infer::status::Result<()> {
    std::thread::sleep(Duration::from_millis(30));
    copy_in_out(batch)
}

// ---------------------------------------------------------------------------------------
// Data flow
// ---------------------------------------------------------------------------------------

#[test]
fn linear_pipeline_of_three_steps() {
    let s = Server::new();
    for m in ["p1", "p2", "p3"] {
        s.load(m, &add_sub_config(m, ""));
    }
    // s1 = a+b, d1 = a-b; s2 = s1+d1 = 2a, d2 = s1-d1 = 2b; OUT0 = 2a+2b, OUT1 = 2a-2b.
    let cfg = ens(
        "pipe",
        8,
        &f4(&["A", "B"]),
        &f4(&["OUT0", "OUT1"]),
        &[
            add_sub_step("p1", "A", "B", "s1", "d1"),
            add_sub_step("p2", "s1", "d1", "s2", "d2"),
            add_sub_step("p3", "s2", "d2", "OUT0", "OUT1"),
        ],
    );
    s.load("pipe", &cfg);
    let r = s.infer(
        s.request("pipe")
            .input_f32("A", &[1, 4], &[1., 2., 3., 4.])
            .input_f32("B", &[1, 4], &[10., 20., 30., 40.]),
    );
    assert_eq!(r.status(), 0, "{}", r.error());
    assert_eq!(r.output_count(), 2);
    assert_eq!(r.output_f32("OUT0"), vec![22., 44., 66., 88.]);
    assert_eq!(r.output_f32("OUT1"), vec![-18., -36., -54., -72.]);
    assert_eq!(r.output("OUT0").unwrap().0, vec![1, 4]);
    // Intermediate tensors are not returned.
    assert!(r.output("s1").is_none());
    for m in ["p1", "p2", "p3"] {
        assert_eq!(infer_count(&s, m), 1, "{m}");
    }
    let st = s.stats("pipe");
    assert_eq!(st["models"][0]["success_count"], 1);

    // A batch of 2 rows goes through as one request per step.
    let r = s.infer(
        s.request("pipe")
            .input_f32("A", &[2, 4], &[1., 1., 1., 1., 2., 2., 2., 2.])
            .input_f32("B", &[2, 4], &[0.; 8]),
    );
    assert_eq!(r.status(), 0, "{}", r.error());
    assert_eq!(r.output_f32("OUT0"), vec![2., 2., 2., 2., 4., 4., 4., 4.]);
    assert_eq!(r.output("OUT1").unwrap().0, vec![2, 4]);
}

#[test]
fn diamond_fans_out_and_in() {
    let s = Server::new();
    s.load("top", &add_sub_config("top", ""));
    s.load("left", &identity("left"));
    s.load("right", &identity("right"));
    s.load("bottom", &add_sub_config("bottom", ""));
    // S = x+y, D = x-y; L = S, R = D; OUT0 = L+R = 2x, OUT1 = L-R = 2y.
    let cfg = ens(
        "diamond",
        4,
        &f4(&["X", "Y"]),
        &f4(&["OUT0", "OUT1"]),
        &[
            add_sub_step("bottom", "L", "R", "OUT0", "OUT1"),
            step("left", &[("IN", "S")], &[("OUT", "L")], 0),
            step("right", &[("IN", "D")], &[("OUT", "R")], 0),
            add_sub_step("top", "X", "Y", "S", "D"),
        ],
    );
    s.load("diamond", &cfg);
    let c = Collector::new();
    let ids: Vec<u64> = (0..16)
        .map(|i| {
            let v = i as f32;
            s.enqueue(
                s.request("diamond")
                    .input_f32("X", &[1, 4], &[v; 4])
                    .input_f32("Y", &[1, 4], &[1., 2., 3., 4.]),
                &c,
            )
            .unwrap()
        })
        .collect();
    c.wait(16);
    c.assert_exactly_once(&ids);
    for r in c.take() {
        assert_eq!(r.status(), 0, "{}", r.error());
        let i = ids.iter().position(|&id| id == r.id()).unwrap() as f32;
        assert_eq!(r.output_f32("OUT0"), vec![2. * i; 4]);
        assert_eq!(r.output_f32("OUT1"), vec![2., 4., 6., 8.]);
    }
    for m in ["top", "left", "right", "bottom"] {
        assert_eq!(infer_count(&s, m), 16, "{m}");
    }
}

#[test]
fn only_steps_for_requested_outputs_run() {
    let s = Server::new();
    s.load("need", &add_sub_config("need", ""));
    s.load("extra", &add_sub_config("extra", ""));
    s.load("extra2", &identity("extra2"));
    // SUM needs only "need"; OTHER needs "extra" then "extra2".
    let cfg = ens(
        "prune",
        4,
        &f4(&["A", "B"]),
        &f4(&["SUM", "OTHER"]),
        &[
            add_sub_step("need", "A", "B", "SUM", ""),
            add_sub_step("extra", "A", "B", "", "T"),
            step("extra2", &[("IN", "T")], &[("OUT", "OTHER")], 0),
        ],
    );
    s.load("prune", &cfg);
    let r = s.infer(
        s.request("prune")
            .input_f32("A", &[1, 4], &[1.; 4])
            .input_f32("B", &[1, 4], &[2.; 4])
            .output("SUM"),
    );
    assert_eq!(r.status(), 0, "{}", r.error());
    assert_eq!(r.output_count(), 1);
    assert_eq!(r.output_f32("SUM"), vec![3.; 4]);
    assert!(r.output("OTHER").is_none());
    assert_eq!(infer_count(&s, "need"), 1);
    assert_eq!(infer_count(&s, "extra"), 0);
    assert_eq!(infer_count(&s, "extra2"), 0);

    // Only OTHER: "need" does not run.
    let r = s.infer(
        s.request("prune")
            .input_f32("A", &[1, 4], &[1.; 4])
            .input_f32("B", &[1, 4], &[2.; 4])
            .output("OTHER"),
    );
    assert_eq!(r.status(), 0, "{}", r.error());
    assert_eq!(r.output_count(), 1);
    assert_eq!(r.output_f32("OTHER"), vec![-1.; 4]);
    assert_eq!(infer_count(&s, "need"), 1);
    assert_eq!(infer_count(&s, "extra"), 1);
    assert_eq!(infer_count(&s, "extra2"), 1);

    // No requested output: all of them.
    let r = s.infer(
        s.request("prune")
            .input_f32("A", &[1, 4], &[1.; 4])
            .input_f32("B", &[1, 4], &[2.; 4]),
    );
    assert_eq!(r.status(), 0, "{}", r.error());
    assert_eq!(r.output_count(), 2);
    assert_eq!(infer_count(&s, "need"), 2);
    assert_eq!(infer_count(&s, "extra2"), 2);
}

#[test]
fn nested_ensemble_step() {
    let s = Server::new();
    s.load("leaf", &add_sub_config("leaf", ""));
    s.load("post", &add_sub_config("post", ""));
    let inner = ens(
        "inner",
        8,
        &f4(&["IA", "IB"]),
        &f4(&["IS", "ID"]),
        &[add_sub_step("leaf", "IA", "IB", "IS", "ID")],
    );
    s.load("inner", &inner);
    // inner: S = a+b, D = a-b; post: OUT0 = S+D = 2a, OUT1 = S-D = 2b.
    let outer = ens(
        "outer",
        8,
        &f4(&["A", "B"]),
        &f4(&["OUT0", "OUT1"]),
        &[
            step(
                "inner",
                &[("IA", "A"), ("IB", "B")],
                &[("IS", "S"), ("ID", "D")],
                0,
            ),
            add_sub_step("post", "S", "D", "OUT0", "OUT1"),
        ],
    );
    s.load("outer", &outer);
    let r = s.infer(
        s.request("outer")
            .input_f32("A", &[1, 4], &[1., 2., 3., 4.])
            .input_f32("B", &[1, 4], &[5.; 4]),
    );
    assert_eq!(r.status(), 0, "{}", r.error());
    assert_eq!(r.output_f32("OUT0"), vec![2., 4., 6., 8.]);
    assert_eq!(r.output_f32("OUT1"), vec![10.; 4]);
    assert_eq!(infer_count(&s, "leaf"), 1);
    assert_eq!(infer_count(&s, "post"), 1);
    assert_eq!(s.stats("inner")["models"][0]["success_count"], 1);
}

// ---------------------------------------------------------------------------------------
// Errors of steps
// ---------------------------------------------------------------------------------------

/// A chain of three unary steps, the one at `fail_at` failing.
fn error_at(fail_at: usize) {
    let s = Server::new();
    s.register_fn_backend("copy", copy_in_out);
    s.register_fn_backend("fail", always_fail);
    let names = ["c0", "c1", "c2"];
    for (i, m) in names.iter().enumerate() {
        let backend = if i == fail_at { "fail" } else { "copy" };
        s.load(m, &unary(m, backend, ""));
    }
    let cfg = ens(
        "chain",
        4,
        &f4(&["X"]),
        &f4(&["Y"]),
        &[
            step("c0", &[("IN", "X")], &[("OUT", "t0")], 0),
            step("c1", &[("IN", "t0")], &[("OUT", "t1")], 0),
            step("c2", &[("IN", "t1")], &[("OUT", "Y")], 0),
        ],
    );
    s.load("chain", &cfg);
    let c = Collector::new();
    let id = s
        .enqueue(s.request("chain").input_f32("X", &[1, 4], &[1.; 4]), &c)
        .unwrap();
    c.wait(1);
    std::thread::sleep(Duration::from_millis(50));
    c.assert_exactly_once(&[id]);
    let r = c.take().pop().unwrap();
    assert_eq!(r.status(), INFER_STATUS_INVALID_ARGUMENT, "{}", r.error());
    let want = format!("in ensemble 'chain', step '{}': ", names[fail_at]);
    assert!(r.error().starts_with(&want), "{:?} vs {want:?}", r.error());
    assert!(
        r.error().contains("boom from the failing step"),
        "{}",
        r.error()
    );
    assert_eq!(r.output_count(), 0);
    for (i, m) in names.iter().enumerate() {
        if i == fail_at {
            // The failing model executed once and counts the failure.
            assert_eq!(s.stats(m)["models"][0]["failure_count"], 1, "{m}");
            continue;
        }
        let want = if i < fail_at { 1 } else { 0 };
        assert_eq!(infer_count(&s, m), want, "{m} (failing step {fail_at})");
    }
    assert_eq!(s.stats("chain")["models"][0]["failure_count"], 1);
    // The ensemble keeps serving.
    let r = s.infer(s.request("chain").input_f32("X", &[1, 4], &[1.; 4]));
    assert_ne!(r.status(), 0);
}

#[test]
fn error_in_first_step() {
    error_at(0);
}

#[test]
fn error_in_middle_step() {
    error_at(1);
}

#[test]
fn error_in_last_step() {
    error_at(2);
}

#[test]
fn error_in_one_branch_gives_one_final() {
    let s = Server::new();
    s.register_fn_backend("fail", always_fail);
    s.register_fn_backend("slow", slow_copy);
    s.load("bad", &unary("bad", "fail", ""));
    s.load("slowb", &unary("slowb", "slow", ""));
    s.load("join", &add_sub_config("join", ""));
    let cfg = ens(
        "branchy",
        4,
        &f4(&["X"]),
        &f4(&["Y"]),
        &[
            step("bad", &[("IN", "X")], &[("OUT", "a")], 0),
            step("slowb", &[("IN", "X")], &[("OUT", "b")], 0),
            add_sub_step("join", "a", "b", "Y", ""),
        ],
    );
    s.load("branchy", &cfg);
    let c = Collector::new();
    let ids: Vec<u64> = (0..4)
        .map(|_| {
            s.enqueue(s.request("branchy").input_f32("X", &[1, 4], &[1.; 4]), &c)
                .unwrap()
        })
        .collect();
    c.wait(4);
    // The slow branch finishes after the failure: no second FINAL.
    std::thread::sleep(Duration::from_millis(200));
    c.assert_exactly_once(&ids);
    for r in c.take() {
        assert!(
            r.error().starts_with("in ensemble 'branchy', step 'bad': "),
            "{}",
            r.error()
        );
    }
    assert_eq!(infer_count(&s, "join"), 0);
}

#[test]
fn request_to_missing_input_is_refused() {
    let s = Server::new();
    s.load("m", &add_sub_config("m", ""));
    s.load(
        "e",
        &ens(
            "e",
            4,
            &f4(&["A", "B"]),
            &f4(&["S"]),
            &[add_sub_step("m", "A", "B", "S", "")],
        ),
    );
    let c = Collector::new();
    match s.enqueue(s.request("e").input_f32("A", &[1, 4], &[1.; 4]), &c) {
        Err((st, msg)) => {
            assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{msg}");
        }
        Ok(id) => {
            c.wait(1);
            c.assert_exactly_once(&[id]);
            let r = c.take().pop().unwrap();
            assert_eq!(r.status(), INFER_STATUS_INVALID_ARGUMENT, "{}", r.error());
        }
    }
    assert_eq!(infer_count(&s, "m"), 0);
}

// ---------------------------------------------------------------------------------------
// Sequences, batching, in-flight limits
// ---------------------------------------------------------------------------------------

#[test]
fn sequence_model_inside_an_ensemble() {
    let s = Server::new();
    let acc = r#"name: "acc" backend: "accumulator" max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  direct { }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
}
"#;
    s.load("acc", acc);
    s.load(
        "idi",
        r#"name: "idi" backend: "identity" max_batch_size: 4
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]"#,
    );
    let cfg = ens(
        "seq",
        4,
        &[("X", "TYPE_INT32", "1")],
        &[("SUM", "TYPE_INT32", "1")],
        &[
            step("acc", &[("INPUT", "X")], &[("OUTPUT", "s")], 0),
            step("idi", &[("IN", "s")], &[("OUT", "SUM")], 0),
        ],
    );
    s.load("seq", &cfg);
    let start = INFER_REQUEST_FLAG_SEQUENCE_START;
    let end = INFER_REQUEST_FLAG_SEQUENCE_END;
    // Three sequences, interleaved, synchronously (so order within each is fixed).
    let seqs: [(u64, [i32; 4]); 3] = [
        (11, [1, 2, 3, 4]),
        (22, [10, 20, 30, 40]),
        (33, [5, 5, 5, 5]),
    ];
    let mut sums = [0i32; 3];
    for k in 0..4 {
        for (j, (corr, vals)) in seqs.iter().enumerate() {
            let flags = match k {
                0 => start,
                3 => end,
                _ => 0,
            };
            let r = s.infer(
                s.request("seq")
                    .input_i32("X", &[1, 1], &[vals[k]])
                    .correlation_id(*corr)
                    .flags(flags),
            );
            assert_eq!(r.status(), 0, "{}", r.error());
            sums[j] += vals[k];
            assert_eq!(r.output_i32("SUM"), vec![sums[j]], "seq {corr} step {k}");
            assert_eq!(r.correlation_id(), *corr);
        }
    }
    // A restart with START resets the sum.
    let r = s.infer(
        s.request("seq")
            .input_i32("X", &[1, 1], &[7])
            .correlation_id(11)
            .flags(start | end),
    );
    assert_eq!(r.status(), 0, "{}", r.error());
    assert_eq!(r.output_i32("SUM"), vec![7]);

    // Asynchronous, round robin: the first step keeps arrival order per sequence.
    let c = Collector::new();
    let mut expected = std::collections::HashMap::new();
    for k in 0..5 {
        for corr in [101u64, 202] {
            let flags = match k {
                0 => start,
                4 => end,
                _ => 0,
            };
            let v = (corr as i32) * (k + 1);
            let id = s
                .enqueue(
                    s.request("seq")
                        .input_i32("X", &[1, 1], &[v])
                        .correlation_id(corr)
                        .flags(flags),
                    &c,
                )
                .unwrap();
            let prev: i32 = (1..=k + 1).map(|q| corr as i32 * q).sum();
            expected.insert(id, prev);
        }
    }
    c.wait(10);
    let ids: Vec<u64> = expected.keys().copied().collect();
    c.assert_exactly_once(&ids);
    for r in c.take() {
        assert_eq!(r.status(), 0, "{}", r.error());
        assert_eq!(
            r.output_i32("SUM"),
            vec![expected[&r.id()]],
            "request {}",
            r.id()
        );
    }
}

#[test]
fn internal_requests_of_many_ensemble_requests_batch_together() {
    let s = Server::new();
    s.load("b", &add_sub_config("b", "dynamic_batching { }"));
    s.load(
        "be",
        &ens(
            "be",
            8,
            &f4(&["A", "B"]),
            &f4(&["S", "D"]),
            &[add_sub_step("b", "A", "B", "S", "D")],
        ),
    );
    s.pause("b");
    let c = Collector::new();
    let ids: Vec<u64> = (0..8)
        .map(|i| {
            s.enqueue(
                s.request("be")
                    .input_f32("A", &[1, 4], &[i as f32; 4])
                    .input_f32("B", &[1, 4], &[1.; 4]),
                &c,
            )
            .unwrap()
        })
        .collect();
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(c.finals(), 0);
    assert_eq!(s.stats("b")["models"][0]["pending"], 8);
    s.resume("b");
    c.wait(8);
    c.assert_exactly_once(&ids);
    let sizes = batch_sizes(&s.stats("b"));
    assert!(sizes.iter().any(|(n, _)| *n > 1), "batch sizes {sizes:?}");
    assert_eq!(sizes, vec![(8, 1)]);
    for r in c.take() {
        assert_eq!(r.status(), 0, "{}", r.error());
        let i = ids.iter().position(|&id| id == r.id()).unwrap() as f32;
        assert_eq!(r.output_f32("S"), vec![i + 1.; 4]);
        assert_eq!(r.output_f32("D"), vec![i - 1.; 4]);
        assert_eq!(r.output("S").unwrap().0, vec![1, 4]);
    }
}

#[test]
fn max_inflight_requests_bounds_a_slow_step() {
    let s = Server::new();
    s.register_fn_backend("slowc", slow_counting);
    // Four instances: without the limit, requests would run in parallel.
    s.load(
        "slow",
        &unary("slow", "slowc", "instance_group [ { count: 4 } ]"),
    );
    s.load("fast", &identity("fast"));
    let cfg = ens(
        "bp",
        4,
        &f4(&["X"]),
        &f4(&["Y"]),
        &[
            step("fast", &[("IN", "X")], &[("OUT", "t")], 0),
            step("slow", &[("IN", "t")], &[("OUT", "Y")], 1),
        ],
    );
    s.load("bp", &cfg);
    let c = Collector::new();
    let ids: Vec<u64> = (0..8)
        .map(|i| {
            s.enqueue(s.request("bp").input_f32("X", &[1, 4], &[i as f32; 4]), &c)
                .unwrap()
        })
        .collect();
    c.wait(8);
    c.assert_exactly_once(&ids);
    for r in c.take() {
        assert_eq!(r.status(), 0, "{}", r.error());
        let i = ids.iter().position(|&id| id == r.id()).unwrap() as f32;
        assert_eq!(r.output_f32("Y"), vec![i; 4]);
    }
    assert_eq!(SLOW_RUNS.load(Ordering::SeqCst), 8);
    assert_eq!(SLOW_MAX.load(Ordering::SeqCst), 1, "concurrent slow steps");
}

#[test]
fn max_queue_size_bounds_the_requests_waiting_for_a_step() {
    let s = Server::new();
    s.register_fn_backend("slowq", slow_copy);
    s.load("slowq", &unary("slowq", "slowq", ""));
    s.load("fastq", &identity("fastq"));
    let with_queue = |name: &str, extra: &str| {
        ens(
            name,
            4,
            &f4(&["X"]),
            &f4(&["Y"]),
            &[
                step("fastq", &[("IN", "X")], &[("OUT", "t")], 0),
                step("slowq", &[("IN", "t")], &[("OUT", "Y")], 1).replace(
                    "max_inflight_requests: 1",
                    &format!("max_inflight_requests: 1 {extra}"),
                ),
            ],
        )
    };
    s.load("bq", &with_queue("bq", "max_queue_size: 2"));
    let c = Collector::new();
    // One in flight and two waiting fit; the slow step takes 30 ms, so most of the rest,
    // sent at once, find the queue full.
    let ids: Vec<u64> = (0..12)
        .map(|i| {
            s.enqueue(s.request("bq").input_f32("X", &[1, 4], &[i as f32; 4]), &c)
                .unwrap()
        })
        .collect();
    assert!(
        c.wait_for(12, Duration::from_secs(30)),
        "only {} answered",
        c.finals()
    );
    c.assert_exactly_once(&ids);
    let (mut ok, mut full) = (0, 0);
    for r in c.take() {
        if r.status() == 0 {
            let i = ids.iter().position(|&id| id == r.id()).unwrap() as f32;
            assert_eq!(r.output_f32("Y"), vec![i; 4]);
            ok += 1;
        } else {
            assert_eq!(r.status(), INFER_STATUS_RESOURCE_EXHAUSTED, "{}", r.error());
            let msg = r.error();
            assert!(
                msg.contains("in ensemble 'bq'")
                    && msg.contains("'slowq'")
                    && msg.contains("max_queue_size 2"),
                "{msg}"
            );
            full += 1;
        }
    }
    assert!(ok >= 3, "{ok} succeeded");
    assert!(full >= 1, "no request found the queue full");
    // A queue bound without an in-flight limit has nothing to bound.
    let cfg = with_queue("bq2", "").replace("max_inflight_requests: 1", "max_queue_size: 2");
    let msg = expect_status(s.try_load("bq2", &cfg), INFER_STATUS_INVALID_ARGUMENT);
    assert!(
        msg.contains("max_queue_size") && msg.contains("max_inflight_requests"),
        "{msg}"
    );
}

// ---------------------------------------------------------------------------------------
// Unload and cancel
// ---------------------------------------------------------------------------------------

#[test]
fn unloading_a_composing_model_in_flight_answers_every_request_once() {
    let s = Server::new();
    s.register_fn_backend("slow", slow_copy);
    s.load("u", &unary("u", "slow", ""));
    s.load("u2", &identity("u2"));
    let cfg = ens(
        "ue",
        4,
        &f4(&["X"]),
        &f4(&["Y"]),
        &[
            step("u", &[("IN", "X")], &[("OUT", "t")], 0),
            step("u2", &[("IN", "t")], &[("OUT", "Y")], 0),
        ],
    );
    s.load("ue", &cfg);
    let c = Collector::new();
    let ids: Vec<u64> = (0..10)
        .map(|i| {
            s.enqueue(s.request("ue").input_f32("X", &[1, 4], &[i as f32; 4]), &c)
                .unwrap()
        })
        .collect();
    std::thread::sleep(Duration::from_millis(10));
    s.unload("u2");
    s.unload("u");
    assert!(
        c.wait_for(10, Duration::from_secs(30)),
        "only {} of 10 answered",
        c.finals()
    );
    std::thread::sleep(Duration::from_millis(100));
    c.assert_exactly_once(&ids);
    for r in c.take() {
        if r.status() != 0 {
            assert!(r.error().starts_with("in ensemble 'ue'"), "{}", r.error());
        }
    }
    // Later requests fail (at enqueue or with one FINAL).
    let c = Collector::new();
    match s.enqueue(s.request("ue").input_f32("X", &[1, 4], &[0.; 4]), &c) {
        Err((st, _)) => assert_ne!(st, 0),
        Ok(id) => {
            c.wait(1);
            c.assert_exactly_once(&[id]);
            let r = c.take().pop().unwrap();
            assert_ne!(r.status(), 0);
            assert!(r.error().contains("in ensemble 'ue'"), "{}", r.error());
        }
    }
}

#[test]
fn cancel_of_an_ensemble_request_gives_one_final() {
    let s = Server::new();
    s.register_fn_backend("slow", slow_copy);
    s.load("cs", &unary("cs", "slow", ""));
    s.load("cs2", &unary("cs2", "slow", ""));
    let cfg = ens(
        "ce",
        4,
        &f4(&["X"]),
        &f4(&["Y"]),
        &[
            step("cs", &[("IN", "X")], &[("OUT", "t")], 0),
            step("cs2", &[("IN", "t")], &[("OUT", "Y")], 0),
        ],
    );
    s.load("ce", &cfg);
    let c = Collector::new();
    let ids: Vec<u64> = (0..3)
        .map(|_| {
            s.enqueue(s.request("ce").input_f32("X", &[1, 4], &[1.; 4]), &c)
                .unwrap()
        })
        .collect();
    std::thread::sleep(Duration::from_millis(5));
    ok(cancel(&s, ids[1]));
    c.wait(3);
    std::thread::sleep(Duration::from_millis(200));
    c.assert_exactly_once(&ids);
    for r in c.take() {
        if r.id() == ids[1] {
            assert!(
                r.status() == INFER_STATUS_CANCELLED || r.status() == 0,
                "{} {}",
                r.status(),
                r.error()
            );
        } else {
            assert_eq!(r.status(), 0, "{}", r.error());
        }
    }
    // Cancel after completion: no second FINAL.
    let _ = cancel(&s, ids[0]);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(c.finals(), 3);
}

// ---------------------------------------------------------------------------------------
// Load-time validation
// ---------------------------------------------------------------------------------------

/// Loads `cfg` as "bad" and checks INVALID_ARGUMENT naming the model and `parts`.
#[track_caller]
fn refused(s: &Server, name: &str, cfg: &str, parts: &[&str]) {
    let msg = expect_status(s.try_load(name, cfg), INFER_STATUS_INVALID_ARGUMENT);
    assert!(msg.contains(&format!("'{name}'")), "{msg}");
    for p in parts {
        assert!(msg.contains(p), "{msg:?} lacks {p:?}");
    }
}

fn validation_server() -> Server {
    let s = Server::new();
    s.load("as", &add_sub_config("as", ""));
    s.load("id", &identity("id"));
    s
}

#[test]
fn validation_no_steps() {
    let s = validation_server();
    let cfg = r#"name: "bad" platform: "ensemble" max_batch_size: 4
input [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { }"#;
    refused(&s, "bad", cfg, &["ensemble_scheduling"]);
}

#[test]
fn validation_step_names_the_ensemble_itself() {
    let s = validation_server();
    let cfg = ens(
        "bad",
        4,
        &f4(&["X"]),
        &f4(&["Y"]),
        &[step("bad", &[("IN", "X")], &[("OUT", "Y")], 0)],
    );
    refused(&s, "bad", &cfg, &["step[0].model_name", "cycle"]);
}

#[test]
fn validation_cycle_between_steps() {
    let s = validation_server();
    let cfg = ens(
        "bad",
        4,
        &f4(&["X"]),
        &f4(&["Y"]),
        &[
            add_sub_step("as", "X", "b", "a", ""),
            step("id", &[("IN", "a")], &[("OUT", "b")], 0),
            step("id", &[("IN", "a")], &[("OUT", "Y")], 0),
        ],
    );
    refused(&s, "bad", &cfg, &["cycle"]);
}

#[test]
fn validation_tensor_written_twice() {
    let s = validation_server();
    let cfg = ens(
        "bad",
        4,
        &f4(&["X"]),
        &f4(&["Y"]),
        &[
            step("id", &[("IN", "X")], &[("OUT", "Y")], 0),
            step("id", &[("IN", "X")], &[("OUT", "Y")], 0),
        ],
    );
    refused(&s, "bad", &cfg, &["step[1].output_map", "'Y'", "twice"]);
}

#[test]
fn validation_step_writes_an_ensemble_input() {
    let s = validation_server();
    let cfg = ens(
        "bad",
        4,
        &f4(&["X", "Z"]),
        &f4(&["Y"]),
        &[add_sub_step("as", "X", "Z", "Y", "Z")],
    );
    refused(
        &s,
        "bad",
        &cfg,
        &["step[0].output_map", "'Z'", "ensemble input"],
    );
}

#[test]
fn validation_step_input_not_produced() {
    let s = validation_server();
    let cfg = ens(
        "bad",
        4,
        &f4(&["X"]),
        &f4(&["Y"]),
        &[
            step("id", &[("IN", "X")], &[("OUT", "Y")], 0),
            step("id", &[("IN", "nowhere")], &[("OUT", "W")], 0),
        ],
    );
    refused(&s, "bad", &cfg, &["step[1].input_map", "'nowhere'"]);
}

#[test]
fn validation_ensemble_output_not_produced() {
    let s = validation_server();
    let cfg = ens(
        "bad",
        4,
        &f4(&["X"]),
        &f4(&["Y", "LOST"]),
        &[step("id", &[("IN", "X")], &[("OUT", "Y")], 0)],
    );
    refused(&s, "bad", &cfg, &["output", "'LOST'"]);
}

#[test]
fn validation_ensemble_input_not_used() {
    let s = validation_server();
    let cfg = ens(
        "bad",
        4,
        &f4(&["X", "UNUSED"]),
        &f4(&["Y"]),
        &[step("id", &[("IN", "X")], &[("OUT", "Y")], 0)],
    );
    refused(&s, "bad", &cfg, &["input", "'UNUSED'"]);
}

#[test]
fn validation_composing_model_not_loaded() {
    let s = validation_server();
    let cfg = ens(
        "bad",
        4,
        &f4(&["X"]),
        &f4(&["Y"]),
        &[step("ghost", &[("IN", "X")], &[("OUT", "Y")], 0)],
    );
    refused(
        &s,
        "bad",
        &cfg,
        &["step[0].model_name", "'ghost'", "not loaded"],
    );
    // Loading it first makes the same ensemble valid.
    s.load("ghost", &identity("ghost"));
    s.load("bad", &cfg);
}

#[test]
fn validation_map_key_not_in_composing_model() {
    let s = validation_server();
    let cfg = ens(
        "bad",
        4,
        &f4(&["X"]),
        &f4(&["Y"]),
        &[step(
            "id",
            &[("IN", "X"), ("NOPE", "X")],
            &[("OUT", "Y")],
            0,
        )],
    );
    refused(
        &s,
        "bad",
        &cfg,
        &["step[0].input_map[NOPE]", "no input 'NOPE'"],
    );
    let cfg = ens(
        "bad",
        4,
        &f4(&["X"]),
        &f4(&["Y"]),
        &[step("id", &[("IN", "X")], &[("NOTOUT", "Y")], 0)],
    );
    refused(
        &s,
        "bad",
        &cfg,
        &["step[0].output_map[NOTOUT]", "no output 'NOTOUT'"],
    );
}

/// A tensor a step writes that no step reads and that is not an ensemble output: refused
/// at load with Triton's text.
#[test]
fn validation_unused_tensor() {
    let s = validation_server();
    let cfg = ens(
        "dangling",
        4,
        &f4(&["A", "B"]),
        &f4(&["SUM"]),
        &[add_sub_step("as", "A", "B", "SUM", "DIFF")],
    );
    refused(
        &s,
        "dangling",
        &cfg,
        &[
            "step[0].output_map[OUTPUT1]",
            "ensemble tensor 'DIFF' is unused in ensemble 'dangling'",
        ],
    );
}

/// IN -> A (a copy); B only when IN[0] >= 0.
fn a_and_sometimes_b(batch: &mut Batch) -> infer::status::Result<()> {
    let (i, data) = batch.input("IN").unwrap();
    let shape = i.shape.clone();
    let v = data.to_vec();
    let first = f32::from_le_bytes([v[0], v[1], v[2], v[3]]);
    batch.alloc_output("A", &shape, None)?.copy_from_slice(&v);
    if first >= 0.0 {
        batch.alloc_output("B", &shape, None)?.copy_from_slice(&v);
    }
    Ok(())
}

/// A composing model that does not produce an output the ensemble maps: the ensemble
/// answers without that output (as Triton does); asked of the composing model directly
/// by name, the missing output still fails the request.
#[test]
fn an_output_a_step_does_not_produce_is_left_out() {
    let s = Server::new();
    s.register_fn_backend("a_and_b", a_and_sometimes_b);
    s.load(
        "ab",
        r#"name: "ab" backend: "a_and_b" max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "B" data_type: TYPE_FP32 dims: [ 4 ] } ]"#,
    );
    let cfg = ens(
        "ens_ab",
        8,
        &f4(&["X"]),
        &f4(&["EA", "EB"]),
        &[step("ab", &[("IN", "X")], &[("A", "EA"), ("B", "EB")], 0)],
    );
    s.load("ens_ab", &cfg);
    let r = s.infer(
        s.request("ens_ab")
            .input_f32("X", &[1, 4], &[1.0, 2.0, 3.0, 4.0]),
    );
    assert_eq!(r.status(), 0, "{}", r.error());
    assert_eq!(r.output_count(), 2);
    let r = s.infer(
        s.request("ens_ab")
            .input_f32("X", &[1, 4], &[-1.0, 2.0, 3.0, 4.0]),
    );
    assert_eq!(r.status(), 0, "{}", r.error());
    assert_eq!(r.output_count(), 1, "EB is left out");
    assert_eq!(r.output_f32("EA"), vec![-1.0, 2.0, 3.0, 4.0]);
    assert!(r.output("EB").is_none());
    // Asked directly, the composing model's missing output fails the request.
    let r = s.infer(
        s.request("ab")
            .input_f32("IN", &[1, 4], &[-1.0, 2.0, 3.0, 4.0])
            .output("A")
            .output("B"),
    );
    assert_eq!(r.status(), INFER_STATUS_INTERNAL, "{}", r.error());
    assert!(
        r.error().contains("did not produce output 'B'"),
        "{}",
        r.error()
    );
}

#[test]
fn validation_composing_input_not_mapped() {
    let s = validation_server();
    let cfg = ens(
        "bad",
        4,
        &f4(&["X"]),
        &f4(&["Y"]),
        &[step("as", &[("INPUT0", "X")], &[("OUTPUT0", "Y")], 0)],
    );
    refused(
        &s,
        "bad",
        &cfg,
        &["step[0].input_map", "'INPUT1'", "not mapped"],
    );
}

#[test]
fn validation_datatype_and_shape_mismatch() {
    let s = validation_server();
    // Ensemble input INT32 feeding an FP32 input.
    let cfg = ens(
        "bad",
        4,
        &[("X", "TYPE_INT32", "4")],
        &f4(&["Y"]),
        &[step("id", &[("IN", "X")], &[("OUT", "Y")], 0)],
    );
    refused(&s, "bad", &cfg, &["step[0].input_map[IN]", "'X'"]);
    // Ensemble input of the wrong shape.
    let cfg = ens(
        "bad",
        4,
        &[("X", "TYPE_FP32", "3")],
        &f4(&["Y"]),
        &[step("id", &[("IN", "X")], &[("OUT", "Y")], 0)],
    );
    refused(&s, "bad", &cfg, &["step[0].input_map[IN]", "'X'"]);
    // Producer and consumer disagree (an intermediate tensor).
    s.load(
        "id3",
        r#"name: "id3" backend: "identity" max_batch_size: 64
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 3 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 3 ] } ]"#,
    );
    let cfg = ens(
        "bad",
        4,
        &f4(&["X"]),
        &[("Y", "TYPE_FP32", "3")],
        &[
            step("id", &[("IN", "X")], &[("OUT", "t")], 0),
            step("id3", &[("IN", "t")], &[("OUT", "Y")], 0),
        ],
    );
    refused(&s, "bad", &cfg, &["step[1].input_map[IN]", "'t'"]);
    // Ensemble output declared with another datatype than its producer gives.
    let cfg = ens(
        "bad",
        4,
        &f4(&["X"]),
        &[("Y", "TYPE_INT32", "4")],
        &[step("id", &[("IN", "X")], &[("OUT", "Y")], 0)],
    );
    refused(&s, "bad", &cfg, &["output", "'Y'"]);
}

#[test]
fn validation_max_batch_size_larger_than_composing() {
    let s = validation_server();
    let cfg = ens(
        "bad",
        128,
        &f4(&["X"]),
        &f4(&["Y"]),
        &[step("id", &[("IN", "X")], &[("OUT", "Y")], 0)],
    );
    refused(&s, "bad", &cfg, &["max_batch_size", "'id'"]);
    // Equal is fine.
    s.load(
        "bad",
        &cfg.replace("max_batch_size: 128", "max_batch_size: 64"),
    );
}

#[test]
fn validation_nested_ensemble_cycle() {
    let s = validation_server();
    let e2 = ens(
        "e2",
        4,
        &f4(&["X"]),
        &f4(&["Y"]),
        &[step("id", &[("IN", "X")], &[("OUT", "Y")], 0)],
    );
    s.load("e2", &e2);
    let e1 = ens(
        "e1",
        4,
        &f4(&["X"]),
        &f4(&["Y"]),
        &[step("e2", &[("X", "X")], &[("Y", "Y")], 0)],
    );
    s.load("e1", &e1);
    // e2 replaced by one that calls e1: a cycle.
    let e2_cycle = ens(
        "e2",
        4,
        &f4(&["X"]),
        &f4(&["Y"]),
        &[step("e1", &[("X", "X")], &[("Y", "Y")], 0)],
    );
    refused(&s, "e2", &e2_cycle, &["cycle"]);
    // The old e2 still serves e1.
    let r = s.infer(s.request("e1").input_f32("X", &[1, 4], &[3.; 4]));
    assert_eq!(r.status(), 0, "{}", r.error());
    assert_eq!(r.output_f32("Y"), vec![3.; 4]);
}

// ---------------------------------------------------------------------------------------
// Request properties reach the composing requests
// ---------------------------------------------------------------------------------------

#[test]
fn timeout_passes_to_composing_requests() {
    let s = Server::new();
    s.load("t", &add_sub_config("t", "dynamic_batching { }"));
    s.load(
        "te",
        &ens(
            "te",
            8,
            &f4(&["A", "B"]),
            &f4(&["S"]),
            &[add_sub_step("t", "A", "B", "S", "")],
        ),
    );
    s.pause("t");
    let c = Collector::new();
    let id = s
        .enqueue(
            s.request("te")
                .input_f32("A", &[1, 4], &[1.; 4])
                .input_f32("B", &[1, 4], &[1.; 4])
                .timeout_us(20_000),
            &c,
        )
        .unwrap();
    // The composing model is paused: its queue times the internal request out.
    c.wait(1);
    c.assert_exactly_once(&[id]);
    let r = c.take().pop().unwrap();
    assert_eq!(r.status(), INFER_STATUS_DEADLINE_EXCEEDED, "{}", r.error());
    assert!(
        r.error().starts_with("in ensemble 'te', step 't': "),
        "{}",
        r.error()
    );
    s.resume("t");
}

#[test]
fn priority_passes_to_composing_requests() {
    let s = Server::new();
    let cfg = add_sub_config(
        "pr",
        "dynamic_batching { priority_levels: 2 default_priority_level: 2 }",
    )
    .replace("max_batch_size: 64", "max_batch_size: 1");
    s.load("pr", &cfg);
    s.load(
        "pe",
        &ens(
            "pe",
            1,
            &f4(&["A", "B"]),
            &f4(&["S"]),
            &[add_sub_step("pr", "A", "B", "S", "")],
        ),
    );
    s.pause("pr");
    let c = Collector::new();
    let req = |p: u32| {
        let r = s
            .request("pe")
            .input_f32("A", &[1, 4], &[1.; 4])
            .input_f32("B", &[1, 4], &[1.; 4]);
        if p > 0 {
            r.priority(p)
        } else {
            r
        }
    };
    let low: Vec<u64> = (0..3).map(|_| s.enqueue(req(0), &c).unwrap()).collect();
    let high = s.enqueue(req(1), &c).unwrap();
    std::thread::sleep(Duration::from_millis(10));
    s.resume("pr");
    c.wait(4);
    let order = c.ids_in_order();
    assert_eq!(order[0], high, "order {order:?}, low {low:?}");
}

#[test]
fn flags_and_correlation_id_reach_every_step() {
    // Two accumulators in parallel on the same ensemble input: both see the sequence.
    let s = Server::new();
    for m in ["acc1", "acc2"] {
        s.load(
            m,
            &format!(
                r#"name: "{m}" backend: "accumulator" max_batch_size: 2
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
sequence_batching {{
  max_sequence_idle_microseconds: 5000000
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING }} ] }}
  ]
}}"#
            ),
        );
    }
    let cfg = ens(
        "two",
        2,
        &[("X", "TYPE_INT32", "1")],
        &[("S1", "TYPE_INT32", "1"), ("S2", "TYPE_INT32", "1")],
        &[
            step("acc1", &[("INPUT", "X")], &[("OUTPUT", "S1")], 0),
            step("acc2", &[("INPUT", "X")], &[("OUTPUT", "S2")], 0),
        ],
    );
    s.load("two", &cfg);
    let start = INFER_REQUEST_FLAG_SEQUENCE_START;
    let end = INFER_REQUEST_FLAG_SEQUENCE_END;
    let mut sum = 0;
    for (k, v) in [3, 4, 5].into_iter().enumerate() {
        let flags = match k {
            0 => start,
            2 => end,
            _ => 0,
        };
        let r = s.infer(
            s.request("two")
                .input_i32("X", &[1, 1], &[v])
                .correlation_id_str("seq-a")
                .flags(flags),
        );
        assert_eq!(r.status(), 0, "{}", r.error());
        sum += v;
        assert_eq!(r.output_i32("S1"), vec![sum]);
        assert_eq!(r.output_i32("S2"), vec![sum]);
    }
}

// ---------------------------------------------------------------------------------------
// Composing models from the repository (explicit model control)
// ---------------------------------------------------------------------------------------

/// A server on `repo` with explicit model control, loading `startup` at start.
fn explicit_server(repo: &std::path::Path, startup: &[&str]) -> Server {
    let mut opts = std::ptr::null_mut();
    ok(unsafe { infer_server_options_new(&mut opts) });
    ok(unsafe {
        infer_server_options_set_model_repository(opts, cs(repo.to_str().unwrap()).as_ptr())
    });
    ok(unsafe { infer_server_options_set_model_control_explicit(opts, true) });
    for m in startup {
        ok(unsafe { infer_server_options_add_startup_model(opts, cs(m).as_ptr()) });
    }
    let s = Server::with_options(opts);
    unsafe { infer_server_options_free(opts) };
    s
}

fn load_from_repo(s: &Server, name: &str) -> infer_status {
    unsafe { infer_server_load_model(s.0, cs(name).as_ptr(), std::ptr::null(), std::ptr::null()) }
}

fn loaded(s: &Server, name: &str) -> bool {
    let mut ready = false;
    let st = unsafe { infer_server_model_ready(s.0, cs(name).as_ptr(), -1, &mut ready) };
    st == INFER_STATUS_OK && ready
}

/// Which of `names` are loaded.
fn which(s: &Server, names: &[&'static str]) -> Vec<&'static str> {
    names.iter().copied().filter(|n| loaded(s, n)).collect()
}

/// A repository: identity models `id1`, `id2`; `bad` (an unknown backend); ensembles
/// `chain` (id1 then id2), `pair` (id2 alone), `chain_bad` (id1 then bad) and `nest`
/// (chain as a step).
fn ensemble_repo() -> std::path::PathBuf {
    let t = temp_dir("ens-repo");
    let put = |name: &str, config: String| {
        std::fs::create_dir_all(t.join(name).join("1")).unwrap();
        std::fs::write(t.join(name).join("config.pbtxt"), config).unwrap();
    };
    put("id1", identity("id1"));
    put("id2", identity("id2"));
    put("bad", unary("bad", "no_such_backend", ""));
    let one = |e: &str, models: &[&str]| {
        let mut steps = Vec::new();
        let mut from = "X".to_string();
        for (k, m) in models.iter().enumerate() {
            let to = if k + 1 == models.len() {
                "Y".to_string()
            } else {
                format!("T{k}")
            };
            let (i, o) = if m.starts_with("chain") {
                ("X", "Y")
            } else {
                ("IN", "OUT")
            };
            steps.push(step(m, &[(i, &from)], &[(o, &to)], 0));
            from = to;
        }
        ens(e, 64, &f4(&["X"]), &f4(&["Y"]), &steps)
    };
    put("chain", one("chain", &["id1", "id2"]));
    put("pair", one("pair", &["id2"]));
    put("chain_bad", one("chain_bad", &["id1", "bad"]));
    put("nest", one("nest", &["chain"]));
    t
}

/// With explicit model control, loading an ensemble loads the composing models that are
/// not loaded from the repository (nested ensembles too), as Triton's explicit mode does,
/// and unloading it unloads those it loaded: not the ones the application loaded itself
/// (before or after), nor those another loaded ensemble uses.
#[test]
fn an_ensemble_loads_its_composing_models_from_the_repository() {
    let repo = ensemble_repo();
    let all = ["chain", "pair", "nest", "id1", "id2", "bad", "chain_bad"];
    let s = explicit_server(&repo, &[]);
    assert!(which(&s, &all).is_empty());
    ok(load_from_repo(&s, "chain"));
    assert_eq!(which(&s, &all), vec!["chain", "id1", "id2"]);
    let r = s.infer(
        s.request("chain")
            .input_f32("X", &[1, 4], &[1.0, 2.0, 3.0, 4.0]),
    );
    assert_eq!(r.status(), 0, "{}", r.error());
    assert_eq!(r.output_f32("Y"), vec![1.0, 2.0, 3.0, 4.0]);
    s.unload("chain");
    assert!(which(&s, &all).is_empty(), "{:?}", which(&s, &all));
    // The application's own model stays: before the ensemble, and after.
    ok(load_from_repo(&s, "id1"));
    ok(load_from_repo(&s, "chain"));
    ok(load_from_repo(&s, "id2"));
    s.unload("chain");
    assert_eq!(which(&s, &all), vec!["id1", "id2"]);
    s.unload("id1");
    s.unload("id2");
    // One that another loaded ensemble uses stays until that one goes.
    ok(load_from_repo(&s, "chain"));
    ok(load_from_repo(&s, "pair"));
    s.unload("chain");
    assert_eq!(which(&s, &all), vec!["pair", "id2"]);
    s.unload("pair");
    s.unload("id2");
    // A composing model that fails to load fails the ensemble, and what was loaded for
    // it goes again (with the composing model's own status: UNSUPPORTED, no such backend).
    let msg = expect_status(load_from_repo(&s, "chain_bad"), INFER_STATUS_UNSUPPORTED);
    assert!(
        msg.contains("'chain_bad'") && msg.contains("composing model 'bad'"),
        "{msg}"
    );
    assert!(which(&s, &all).is_empty(), "{:?}", which(&s, &all));
    // Nested: the inner ensemble's models too, and all go with the outer one.
    ok(load_from_repo(&s, "nest"));
    assert_eq!(which(&s, &all), vec!["chain", "nest", "id1", "id2"]);
    let r = s.infer(
        s.request("nest")
            .input_f32("X", &[1, 4], &[4.0, 3.0, 2.0, 1.0]),
    );
    assert_eq!(r.output_f32("Y"), vec![4.0, 3.0, 2.0, 1.0]);
    s.unload("nest");
    assert!(which(&s, &all).is_empty(), "{:?}", which(&s, &all));
    drop(s);
    // At start-up: a composing model also named is loaded once, and is the application's.
    let s = explicit_server(&repo, &["chain", "id2"]);
    assert_eq!(which(&s, &all), vec!["chain", "id1", "id2"]);
    s.unload("chain");
    assert_eq!(which(&s, &all), vec!["id2"]);
    drop(s);
    let _ = std::fs::remove_dir_all(&repo);
}
