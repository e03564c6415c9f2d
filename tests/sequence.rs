//! Sequence batching through the C API (Triton's `sequence_batching`): the Direct and
//! Oldest strategies, slots, padding rows, backlog, idle reaping, control tensors,
//! implicit state, correlation IDs, errors, unload and a bounded stress test.
//!
//! Batch compositions are made deterministic by pausing the model, enqueueing, then
//! resuming. Waits are generous; no test asserts an upper bound on time.

mod common;
use common::*;
use infer::backend::{Backend, ModelInstance};
use infer::config::ModelConfig;
use infer::ffi::*;
use infer::tensor::DataType;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const S: u32 = INFER_REQUEST_FLAG_SEQUENCE_START;
const E: u32 = INFER_REQUEST_FLAG_SEQUENCE_END;

// ---------------------------------------------------------------------------------------
// Configs and requests
// ---------------------------------------------------------------------------------------

/// START and READY controls, as the own-state accumulator needs them.
const START_READY: &str = r#"control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }
  ]"#;

/// START, READY and a CORRID control of type `dt` (the accumulator then keys by ID).
fn start_ready_corrid(dt: &str) -> String {
    format!(
        r#"control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: {dt} }} ] }}
  ]"#
    )
}

/// The implicit state of the accumulator (INT32 [1]) with an `initial_state` clause.
fn state_clause(initial: &str) -> String {
    format!(
        r#"state [ {{ input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_INT32 dims: [ 1 ] {initial} }} ]"#
    )
}

/// A model with INPUT/OUTPUT INT32 [1] and `sequence_batching { body }`.
fn model(name: &str, backend: &str, mbs: u32, instances: u32, body: &str, extra: &str) -> String {
    format!(
        r#"
name: "{name}" backend: "{backend}" max_batch_size: {mbs}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
sequence_batching {{
  {body}
}}
{extra}
"#
    )
}

/// The own-state accumulator, Direct, idle 5 s.
fn acc(name: &str, mbs: u32, instances: u32) -> String {
    model(
        name,
        "accumulator",
        mbs,
        instances,
        &format!("max_sequence_idle_microseconds: 5000000\n  direct {{ }}\n  {START_READY}"),
        "",
    )
}

/// The implicit-state accumulator, Direct, idle 5 s, no controls.
fn acc_state(name: &str, mbs: u32, instances: u32, initial: &str) -> String {
    model(
        name,
        "accumulator",
        mbs,
        instances,
        &format!(
            "max_sequence_idle_microseconds: 5000000\n  direct {{ }}\n  {}",
            state_clause(initial)
        ),
        "",
    )
}

#[derive(Clone, Debug)]
enum Id {
    N(u64),
    S(String),
}

impl Id {
    fn describe(&self) -> String {
        match self {
            Id::N(n) => n.to_string(),
            Id::S(s) => s.clone(),
        }
    }
}

fn with_id(r: Req, id: &Id) -> Req {
    match id {
        Id::N(n) => r.correlation_id(*n),
        Id::S(s) => r.correlation_id_str(s),
    }
}

/// One request of a sequence (batch size 1 for a batching model).
fn req(s: &Server, model: &str, id: u64, flags: u32, v: i32) -> Req {
    s.request(model)
        .input_i32("INPUT", &[1, 1], &[v])
        .correlation_id(id)
        .flags(flags)
}

fn req_id(s: &Server, model: &str, id: &Id, flags: u32, v: i32) -> Req {
    with_id(
        s.request(model)
            .input_i32("INPUT", &[1, 1], &[v])
            .flags(flags),
        id,
    )
}

fn seq_flags(k: usize, len: usize) -> u32 {
    let mut f = 0;
    if k == 0 {
        f |= S;
    }
    if k + 1 == len {
        f |= E;
    }
    f
}

/// Enqueues the sequences round-robin (one request of each in turn, first request with
/// START, last with END); returns request id -> expected running sum.
fn enqueue_rr(
    s: &Server,
    model: &str,
    c: &Collector,
    seqs: &[(Id, Vec<i32>)],
) -> BTreeMap<u64, i32> {
    let mut expected = BTreeMap::new();
    let mut sums = vec![0i32; seqs.len()];
    let longest = seqs.iter().map(|q| q.1.len()).max().unwrap_or(0);
    for k in 0..longest {
        for (i, (id, vals)) in seqs.iter().enumerate() {
            if k < vals.len() {
                sums[i] += vals[k];
                let rid = s
                    .enqueue(req_id(s, model, id, seq_flags(k, vals.len()), vals[k]), c)
                    .unwrap_or_else(|e| panic!("enqueue {id:?}[{k}]: {e:?}"));
                expected.insert(rid, sums[i]);
            }
        }
    }
    expected
}

/// Waits for every expected response; each is OK, answered once, with OUTPUT = its sum.
#[track_caller]
fn check_sums(c: &Collector, expected: &BTreeMap<u64, i32>) {
    c.wait(expected.len());
    c.assert_exactly_once(&expected.keys().copied().collect::<Vec<_>>());
    for r in c.take() {
        assert_eq!(r.status(), 0, "request {}: {}", r.id(), r.error());
        assert_eq!(
            r.output_i32("OUTPUT"),
            vec![expected[&r.id()]],
            "request {}",
            r.id()
        );
        assert_eq!(r.output("OUTPUT").unwrap().0, vec![1, 1]);
    }
}

fn stat(s: &Server, model: &str, key: &str) -> u64 {
    s.stats(model)["models"][0][key]
        .as_u64()
        .unwrap_or_else(|| panic!("no {key} in {}", s.stats(model)))
}

/// Executed batch sizes of the Direct strategy when `nseq` sequences of `len` requests
/// each, all known before anything runs, fill slots in the order (slot0,inst0),
/// (slot0,inst1), ..., (slot1,inst0), ...: sequence j is on instance j % instances.
fn direct_sizes(instances: usize, nseq: usize, len: usize) -> Vec<(u64, u64)> {
    let mut m: BTreeMap<u64, u64> = BTreeMap::new();
    for i in 0..instances {
        let n = (0..nseq).filter(|j| j % instances == i).count();
        if n > 0 {
            *m.entry(n as u64).or_default() += len as u64;
        }
    }
    m.into_iter().collect()
}

// ---------------------------------------------------------------------------------------
// A recording backend: keeps every batch's tensors (inputs, controls, state), the
// instance and the execution time; OUTPUT = INPUT.
// ---------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct Tensor {
    dtype: DataType,
    shape: Vec<i64>,
    data: Vec<u8>,
}

#[derive(Clone, Debug)]
struct Rec {
    model: String,
    instance: u32,
    size: u32,
    requests: usize,
    tensors: BTreeMap<String, Tensor>,
    start: Instant,
    end: Instant,
}

static RECORDS: Mutex<Vec<Rec>> = Mutex::new(Vec::new());

impl Rec {
    fn t(&self, name: &str) -> &Tensor {
        self.tensors.get(name).unwrap_or_else(|| {
            panic!(
                "batch has no tensor {name}; it has {:?}",
                self.tensors.keys().collect::<Vec<_>>()
            )
        })
    }
    /// The elements of a tensor, formatted (BYTES elements as the strings).
    fn vals(&self, name: &str) -> Vec<String> {
        decode(self.t(name))
    }
    fn shape(&self, name: &str) -> Vec<i64> {
        self.t(name).shape.clone()
    }
    fn dtype(&self, name: &str) -> DataType {
        self.t(name).dtype
    }
}

fn decode(t: &Tensor) -> Vec<String> {
    let d = &t.data;
    match t.dtype {
        DataType::Bool => d.iter().map(|b| (*b != 0).to_string()).collect(),
        DataType::Int32 => d
            .chunks(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()).to_string())
            .collect(),
        DataType::Uint32 => d
            .chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()).to_string())
            .collect(),
        DataType::Int64 => d
            .chunks(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()).to_string())
            .collect(),
        DataType::Uint64 => d
            .chunks(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()).to_string())
            .collect(),
        DataType::Fp32 => d
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()).to_string())
            .collect(),
        DataType::Bytes => {
            let mut out = Vec::new();
            let mut p = 0;
            while p + 4 <= d.len() {
                let n = u32::from_le_bytes(d[p..p + 4].try_into().unwrap()) as usize;
                out.push(String::from_utf8_lossy(&d[p + 4..p + 4 + n]).into_owned());
                p += 4 + n;
            }
            assert_eq!(p, d.len(), "malformed BYTES tensor");
            out
        }
        other => panic!("unexpected control/input type {other:?}"),
    }
}

fn records(model: &str) -> Vec<Rec> {
    let mut v: Vec<Rec> = RECORDS
        .lock()
        .unwrap()
        .iter()
        .filter(|r| r.model == model)
        .cloned()
        .collect();
    v.sort_by_key(|r| r.start);
    v
}

struct RecBackend;
struct RecInstance(u32);

impl Backend for RecBackend {
    fn create_instance(
        self: Arc<Self>,
        _: &Arc<ModelConfig>,
        index: u32,
        _: i32,
    ) -> infer::status::Result<Box<dyn ModelInstance>> {
        Ok(Box::new(RecInstance(index)))
    }
}

impl ModelInstance for RecInstance {
    fn execute(&mut self, b: &mut Batch) -> infer::status::Result<()> {
        let start = Instant::now();
        let delay: u64 = b
            .config
            .parameters
            .get("delay_us")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        if delay > 0 {
            std::thread::sleep(Duration::from_micros(delay));
        }
        let tensors = b
            .inputs
            .iter()
            .map(|i| {
                (
                    i.name.to_string(),
                    Tensor {
                        dtype: i.dtype,
                        shape: i.shape.to_vec(),
                        data: b.input_data(i).to_vec(),
                    },
                )
            })
            .collect();
        if b.config.output("OUTPUT").is_some() {
            if let Some(pos) = b.inputs.iter().position(|i| &*i.name == "INPUT") {
                b.copy_input_to_output(pos, "OUTPUT")?;
            }
        }
        RECORDS.lock().unwrap().push(Rec {
            model: b.config.name.clone(),
            instance: self.0,
            size: b.size,
            requests: b.requests.len(),
            tensors,
            start,
            end: Instant::now(),
        });
        Ok(())
    }
}

fn recorder_server() -> Server {
    let s = Server::new();
    unsafe { &*s.0 }
        .server()
        .register_backend("recorder", Arc::new(RecBackend))
        .unwrap();
    s
}

// ---------------------------------------------------------------------------------------
// A single sequence
// ---------------------------------------------------------------------------------------

#[test]
fn single_sequence_sums() {
    let s = Server::new();
    s.load("acc1", &acc("acc1", 4, 1));
    let vals = [1, 2, 3, 4];
    let mut sum = 0;
    for (k, v) in vals.iter().enumerate() {
        sum += v;
        let r = s.infer(req(&s, "acc1", 7, seq_flags(k, vals.len()), *v));
        assert_eq!(r.status(), 0, "{}", r.error());
        assert_eq!(r.output_i32("OUTPUT"), vec![sum]);
        assert_eq!(r.output("OUTPUT").unwrap().0, vec![1, 1]);
        assert_eq!(r.correlation_id(), 7);
    }
    // The same ID again after END, with START: a new sequence, the sum starts over.
    let r = s.infer(req(&s, "acc1", 7, S, 10));
    assert_eq!(r.output_i32("OUTPUT"), vec![10]);
    let r = s.infer(req(&s, "acc1", 7, E, -3));
    assert_eq!(r.output_i32("OUTPUT"), vec![7]);
    // One sequence on a 4-slot instance: batches of one row, no padding beyond slot 0.
    assert_eq!(batch_sizes(&s.stats("acc1")), vec![(1, 6)]);
    assert_eq!(stat(&s, "acc1", "inference_count"), 6);
    assert_eq!(stat(&s, "acc1", "execution_count"), 6);
}

#[test]
fn queued_requests_of_one_sequence_run_one_per_batch() {
    let s = Server::new();
    s.load("acc2", &acc("acc2", 4, 1));
    s.pause("acc2");
    let c = Collector::new();
    let expected = enqueue_rr(&s, "acc2", &c, &[(Id::N(3), vec![1, 2, 3, 4])]);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(c.finals(), 0, "a paused model must not execute");
    s.resume("acc2");
    check_sums(&c, &expected);
    // Never two requests of one sequence (one slot) in a batch.
    assert_eq!(batch_sizes(&s.stats("acc2")), vec![(1, 4)]);
    assert_eq!(stat(&s, "acc2", "execution_count"), 4);
}

#[test]
fn values_of_every_accumulator_type() {
    let s = Server::new();
    for (dt, name) in [
        ("TYPE_INT64", "acc_i64"),
        ("TYPE_FP32", "acc_f32"),
        ("TYPE_FP64", "acc_f64"),
    ] {
        let cfg =
            acc(name, 2, 1).replace("TYPE_INT32 dims: [ 1 ] }", &format!("{dt} dims: [ 3 ] }}"));
        s.load(name, &cfg);
    }
    let rows = [[1i64, 2, 3], [10, 20, 30], [-5, 0, 5]];
    let mut sum = [0i64; 3];
    for (k, row) in rows.iter().enumerate() {
        for i in 0..3 {
            sum[i] += row[i];
        }
        let f = seq_flags(k, rows.len());
        let r = s.infer(
            s.request("acc_i64")
                .input_i64("INPUT", &[1, 3], row)
                .correlation_id(5)
                .flags(f),
        );
        assert_eq!(r.status(), 0, "{}", r.error());
        assert_eq!(r.output_i64("OUTPUT"), sum.to_vec());
        let rf: Vec<f32> = row.iter().map(|x| *x as f32 + 0.5).collect();
        let r = s.infer(
            s.request("acc_f32")
                .input_f32("INPUT", &[1, 3], &rf)
                .correlation_id(5)
                .flags(f),
        );
        assert_eq!(r.status(), 0, "{}", r.error());
        let want: Vec<f32> = sum
            .iter()
            .map(|x| *x as f32 + 0.5 * (k + 1) as f32)
            .collect();
        assert_eq!(r.output_f32("OUTPUT"), want);
        let rd: Vec<f64> = row.iter().map(|x| *x as f64 * 0.25).collect();
        let r = s.infer(
            s.request("acc_f64")
                .input_f64("INPUT", &[1, 3], &rd)
                .correlation_id(5)
                .flags(f),
        );
        assert_eq!(r.status(), 0, "{}", r.error());
        let want: Vec<f64> = sum.iter().map(|x| *x as f64 * 0.25).collect();
        assert_eq!(r.output_f64("OUTPUT"), want);
        assert_eq!(r.output("OUTPUT").unwrap().0, vec![1, 3]);
    }
}

// ---------------------------------------------------------------------------------------
// Direct: slots, instances, padding
// ---------------------------------------------------------------------------------------

/// `nseq` sequences of `len` requests (all queued while paused) on `instances` instances
/// of `mbs` slots: per-sequence sums and executed batch sizes.
fn interleaved(name: &str, mbs: u32, instances: u32, nseq: usize, len: usize, implicit: bool) {
    let s = Server::new();
    let cfg = if implicit {
        acc_state(name, mbs, instances, "")
    } else {
        acc(name, mbs, instances)
    };
    s.load(name, &cfg);
    s.pause(name);
    let c = Collector::new();
    let seqs: Vec<(Id, Vec<i32>)> = (0..nseq)
        .map(|j| {
            let vals = (0..len).map(|k| (j as i32 + 1) * 100 + k as i32).collect();
            (Id::N(1000 + j as u64), vals)
        })
        .collect();
    let expected = enqueue_rr(&s, name, &c, &seqs);
    s.resume(name);
    check_sums(&c, &expected);
    let st = s.stats(name);
    assert_eq!(
        batch_sizes(&st),
        direct_sizes(instances as usize, nseq, len),
        "{mbs} slots x {instances} instances, {nseq} sequences: {st}"
    );
    assert_eq!(st["models"][0]["inference_count"], (nseq * len) as u64);
}

#[test]
fn interleaved_one_slot_one_instance() {
    interleaved("i11", 1, 1, 1, 5, false);
}

#[test]
fn interleaved_two_slots_one_instance() {
    interleaved("i21", 2, 1, 2, 5, false);
}

#[test]
fn interleaved_four_slots_one_instance() {
    interleaved("i41", 4, 1, 4, 5, false);
}

#[test]
fn interleaved_one_slot_two_instances() {
    interleaved("i12", 1, 2, 2, 5, false);
}

#[test]
fn interleaved_two_slots_two_instances() {
    interleaved("i22", 2, 2, 4, 5, false);
}

#[test]
fn interleaved_four_slots_four_instances() {
    interleaved("i44", 4, 4, 16, 4, false);
}

#[test]
fn new_sequences_spread_over_instances_before_second_slots() {
    // (slot0,inst0), (slot0,inst1), (slot1,inst0): instance 0 runs batches of 2 rows,
    // instance 1 batches of 1. Filling instance 0 first would give one batch size of 3.
    interleaved("spread3", 2, 2, 3, 4, false);
    // 5 sequences on 2 x 4 slots: 3 on instance 0 (slots 0..2), 2 on instance 1.
    interleaved("spread5", 4, 2, 5, 3, false);
}

#[test]
fn interleaved_implicit_state() {
    interleaved("is22", 2, 2, 4, 5, true);
    interleaved("is41", 4, 1, 3, 6, true);
}

#[test]
fn slot_order_seen_by_the_model() {
    // The recorder shows which instance and row each sequence occupies.
    let s = recorder_server();
    let cfg = model(
        "slots",
        "recorder",
        2,
        2,
        &format!(
            "max_sequence_idle_microseconds: 5000000\n direct {{ }}\n {}",
            start_ready_corrid("TYPE_UINT64")
        ),
        "",
    );
    s.load("slots", &cfg);
    s.pause("slots");
    let c = Collector::new();
    let seqs: Vec<(Id, Vec<i32>)> = (1..=4).map(|j| (Id::N(j), vec![j as i32; 2])).collect();
    let expected = enqueue_rr(&s, "slots", &c, &seqs);
    s.resume("slots");
    c.wait(expected.len());
    let recs = records("slots");
    assert_eq!(recs.len(), 4, "{recs:#?}");
    for r in &recs {
        let want = if r.instance == 0 {
            ["1", "3"]
        } else {
            ["2", "4"]
        };
        assert_eq!(r.vals("CORRID"), want, "instance {} rows", r.instance);
        assert_eq!(r.vals("READY"), ["1", "1"]);
    }
}

#[test]
fn padding_rows_count_in_batch_size() {
    let s = Server::new();
    s.load("pad", &acc("pad", 4, 1));
    s.pause("pad");
    let c = Collector::new();
    // A in slot 0 (3 requests), B in slot 1 (1 request), C in slot 2 (2 requests).
    let expected = enqueue_rr(
        &s,
        "pad",
        &c,
        &[
            (Id::N(1), vec![1, 2, 3]),
            (Id::N(2), vec![50]),
            (Id::N(3), vec![7, 8]),
        ],
    );
    s.resume("pad");
    check_sums(&c, &expected);
    // [A B C], [A pad C] (C still holds slot 2), [A].
    let st = s.stats("pad");
    assert_eq!(batch_sizes(&st), vec![(1, 1), (3, 2)], "{st}");
    assert_eq!(st["models"][0]["inference_count"], 6);
    assert_eq!(st["models"][0]["execution_count"], 3);
}

// ---------------------------------------------------------------------------------------
// Backlog
// ---------------------------------------------------------------------------------------

#[test]
fn backlog_is_fifo_and_takes_freed_slots_at_once() {
    let s = recorder_server();
    let cfg = model(
        "bl",
        "recorder",
        2,
        1,
        &format!(
            "max_sequence_idle_microseconds: 5000000\n direct {{ }}\n {}",
            start_ready_corrid("TYPE_UINT64")
        ),
        "",
    );
    s.load("bl", &cfg);
    s.pause("bl");
    let c = Collector::new();
    // A (1 request) and B (3) get the two slots; C (2) and D (2) wait, C first.
    let expected = enqueue_rr(
        &s,
        "bl",
        &c,
        &[
            (Id::N(1), vec![1]),
            (Id::N(2), vec![2, 2, 2]),
            (Id::N(3), vec![3, 3]),
            (Id::N(4), vec![4, 4]),
        ],
    );
    s.resume("bl");
    c.wait(expected.len());
    c.assert_exactly_once(&expected.keys().copied().collect::<Vec<_>>());
    let got: Vec<Vec<String>> = records("bl").iter().map(|r| r.vals("CORRID")).collect();
    // A's END frees slot 0 for C at once; C and B end together; D takes slot 0.
    let want: Vec<Vec<&str>> = vec![
        vec!["1", "2"],
        vec!["3", "2"],
        vec!["3", "2"],
        vec!["4"],
        vec!["4"],
    ];
    assert_eq!(got, want);
    assert_eq!(batch_sizes(&s.stats("bl")), vec![(1, 2), (2, 3)]);
}

#[test]
fn backlogged_sequence_starts_when_end_frees_the_slot() {
    let s = Server::new();
    s.load("bl2", &acc("bl2", 1, 1));
    let r = s.infer(req(&s, "bl2", 1, S, 5));
    assert_eq!(r.output_i32("OUTPUT"), vec![5]);
    let c = Collector::new();
    let b1 = s.enqueue(req(&s, "bl2", 2, S, 100), &c).unwrap();
    let b2 = s.enqueue(req(&s, "bl2", 2, E, 1), &c).unwrap();
    // Sequence 1 holds the only slot (idle limit 5 s): sequence 2 must wait.
    std::thread::sleep(Duration::from_millis(150));
    assert_eq!(
        c.finals(),
        0,
        "a backlogged sequence ran while its slot was taken"
    );
    let r = s.infer(req(&s, "bl2", 1, 0, 6));
    assert_eq!(r.output_i32("OUTPUT"), vec![11]);
    assert_eq!(c.finals(), 0);
    let r = s.infer(req(&s, "bl2", 1, E, 1));
    assert_eq!(r.output_i32("OUTPUT"), vec![12]);
    check_sums(&c, &BTreeMap::from([(b1, 100), (b2, 101)]));
}

// ---------------------------------------------------------------------------------------
// Idle reaping
// ---------------------------------------------------------------------------------------

fn idle_acc(name: &str, idle_us: u64, extra: &str) -> String {
    model(
        name,
        "accumulator",
        1,
        1,
        &format!("max_sequence_idle_microseconds: {idle_us}\n direct {{ }}\n {START_READY}"),
        extra,
    )
}

#[test]
fn idle_sequence_is_reaped_and_its_slot_given_to_the_backlog() {
    let s = Server::new();
    s.load("rp1", &idle_acc("rp1", 50_000, ""));
    let r = s.infer(req(&s, "rp1", 11, S, 5));
    assert_eq!(r.output_i32("OUTPUT"), vec![5]);
    // Sequence 22 waits for the only slot, which sequence 11 loses after 50 ms idle.
    let c = Collector::new();
    let b1 = s.enqueue(req(&s, "rp1", 22, S, 1), &c).unwrap();
    let b2 = s.enqueue(req(&s, "rp1", 22, E, 2), &c).unwrap();
    check_sums(&c, &BTreeMap::from([(b1, 1), (b2, 3)]));
    // Sequence 11 is gone: going on without START is refused.
    let err = s.enqueue(req(&s, "rp1", 11, 0, 1), &c).unwrap_err();
    assert_eq!(err.0, INFER_STATUS_INVALID_ARGUMENT, "{}", err.1);
    assert!(err.1.contains("rp1") && err.1.contains("11"), "{}", err.1);
    let err = s.enqueue(req(&s, "rp1", 11, E, 1), &c).unwrap_err();
    assert_eq!(err.0, INFER_STATUS_INVALID_ARGUMENT, "{}", err.1);
    // With START it is a new sequence.
    let r = s.infer(req(&s, "rp1", 11, S, 4));
    assert_eq!(r.output_i32("OUTPUT"), vec![4]);
    assert_eq!(c.finals(), 2);
}

#[test]
fn idle_sequence_without_backlog_is_reaped() {
    let s = Server::new();
    s.load("rp2", &idle_acc("rp2", 20_000, ""));
    let r = s.infer(req(&s, "rp2", 55, S, 5));
    assert_eq!(r.status(), 0, "{}", r.error());
    // Far past the 20 ms idle limit.
    std::thread::sleep(Duration::from_millis(1000));
    let c = Collector::new();
    let err = s.enqueue(req(&s, "rp2", 55, 0, 1), &c).unwrap_err();
    assert_eq!(err.0, INFER_STATUS_INVALID_ARGUMENT, "{}", err.1);
    assert!(err.1.contains("rp2") && err.1.contains("55"), "{}", err.1);
}

#[test]
fn busy_sequence_is_not_reaped() {
    // Each execution takes 100 ms, twice the idle limit: a sequence with a request queued
    // or executing is not idle.
    let s = Server::new();
    s.load(
        "busy",
        &idle_acc(
            "busy",
            50_000,
            r#"parameters { key: "execute_delay_us" value { string_value: "100000" } }"#,
        ),
    );
    let c = Collector::new();
    let expected = enqueue_rr(&s, "busy", &c, &[(Id::N(9), vec![1, 2, 3])]);
    check_sums(&c, &expected);
}

#[test]
fn sequence_whose_only_request_was_cancelled_is_reaped() {
    // Sequence 1 takes the only slot at enqueue (paused) and its request is cancelled
    // before it ran: with nothing queued or executing it is idle, and after 50 ms its
    // slot goes to the backlogged sequence 2.
    let s = Server::new();
    s.load("cx", &idle_acc("cx", 50_000, ""));
    s.pause("cx");
    let c = Collector::new();
    let a = s.enqueue(req(&s, "cx", 1, S, 5), &c).unwrap();
    ok(unsafe { infer::ffi::server::infer_server_cancel(s.0, a) });
    c.wait(1);
    assert_eq!(c.take()[0].status(), INFER_STATUS_CANCELLED);
    let c2 = Collector::new();
    let b = s.enqueue(req(&s, "cx", 2, S | E, 7), &c2).unwrap();
    s.resume("cx");
    assert!(
        c2.wait_for(1, Duration::from_secs(20)),
        "the backlogged sequence never got the slot of the idle sequence"
    );
    check_sums(&c2, &BTreeMap::from([(b, 7)]));
}

#[test]
fn backlogged_sequence_whose_requests_were_cancelled_is_reaped() {
    // As above, with the cancelled sequence in the backlog: when it gets a slot it has
    // nothing to run and must lose the slot again after the idle time.
    let s = Server::new();
    s.load("cx2", &idle_acc("cx2", 50_000, ""));
    s.pause("cx2");
    let c = Collector::new();
    let a = s.enqueue(req(&s, "cx2", 1, S | E, 1), &c).unwrap();
    let b = s.enqueue(req(&s, "cx2", 2, S, 2), &c).unwrap();
    ok(unsafe { infer::ffi::server::infer_server_cancel(s.0, b) });
    c.wait(1);
    let cc = s.enqueue(req(&s, "cx2", 3, S | E, 3), &c).unwrap();
    s.resume("cx2");
    assert!(
        c.wait_for(3, Duration::from_secs(20)),
        "sequence 3 never got a slot ({} of 3 answered)",
        c.finals()
    );
    c.assert_exactly_once(&[a, b, cc]);
    for r in c.take() {
        let want = if r.id() == b {
            INFER_STATUS_CANCELLED
        } else {
            0
        };
        assert_eq!(r.status(), want, "request {}: {}", r.id(), r.error());
    }
}

// ---------------------------------------------------------------------------------------
// Restart
// ---------------------------------------------------------------------------------------

fn restart(name: &str, cfg: &str) {
    let s = Server::new();
    s.load(name, cfg);
    s.pause(name);
    let c = Collector::new();
    let mut expected = BTreeMap::new();
    let mut e = |r: Req, want: i32| {
        expected.insert(s.enqueue(r, &c).unwrap(), want);
    };
    e(req(&s, name, 1, S, 5), 5);
    e(req(&s, name, 2, S, 100), 100);
    e(req(&s, name, 1, S, 10), 10); // restart: the sum starts over
    e(req(&s, name, 2, E, 1), 101);
    e(req(&s, name, 1, 0, 3), 13);
    e(req(&s, name, 1, E, 2), 15);
    s.resume(name);
    check_sums(&c, &expected);
    // [1 2], [1 2], [1], [1]: the restarted sequence kept slot 0.
    assert_eq!(batch_sizes(&s.stats(name)), vec![(1, 2), (2, 2)]);
}

#[test]
fn start_restarts_an_active_sequence() {
    restart("rs", &acc("rs", 2, 1));
}

#[test]
fn start_restarts_an_active_sequence_implicit_state() {
    restart("rs_state", &acc_state("rs_state", 2, 1, ""));
}

// ---------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------

#[track_caller]
fn refused(s: &Server, r: Req, words: &[&str]) -> String {
    let c = Collector::new();
    let err = s.enqueue(r, &c).unwrap_err();
    assert_eq!(err.0, INFER_STATUS_INVALID_ARGUMENT, "{}", err.1);
    for w in words {
        assert!(err.1.contains(w), "{:?} does not name {w:?}", err.1);
    }
    assert_eq!(c.finals(), 0);
    err.1
}

#[test]
fn invalid_sequence_requests_are_refused_at_enqueue() {
    let s = Server::new();
    s.load("errs", &acc("errs", 4, 1));
    let plain = || s.request("errs").input_i32("INPUT", &[1, 1], &[1]);
    // No correlation ID, ID 0, empty string ID.
    refused(&s, plain().flags(S), &["errs"]);
    refused(&s, plain().flags(S).correlation_id(0), &["errs"]);
    let r = plain().flags(S | E);
    let st = r.try_correlation_id_str("");
    if st == INFER_STATUS_OK {
        refused(&s, r, &["errs"]);
    } else {
        expect_status(st, INFER_STATUS_INVALID_ARGUMENT);
    }
    // The first request of a sequence needs START (also when it has END).
    refused(&s, req(&s, "errs", 41, 0, 1), &["errs", "41"]);
    refused(&s, req(&s, "errs", 41, E, 1), &["errs", "41"]);
    refused(
        &s,
        req_id(&s, "errs", &Id::S("word-x".into()), 0, 1),
        &["errs", "word-x"],
    );
    // Refused requests do not create the sequence: START still starts it.
    let r = s.infer(req(&s, "errs", 41, S, 2));
    assert_eq!(r.output_i32("OUTPUT"), vec![2]);
    // Batch size 2 in one request of a batching sequence model.
    refused(
        &s,
        s.request("errs")
            .input_i32("INPUT", &[2, 1], &[1, 2])
            .correlation_id(42)
            .flags(S),
        &["errs", "42"],
    );
    // ... also for an active sequence, which then goes on unharmed.
    refused(
        &s,
        s.request("errs")
            .input_i32("INPUT", &[2, 1], &[1, 2])
            .correlation_id(41),
        &["errs", "41"],
    );
    let r = s.infer(req(&s, "errs", 41, E, 3));
    assert_eq!(r.output_i32("OUTPUT"), vec![5]);
    // After END the sequence is gone.
    refused(&s, req(&s, "errs", 41, 0, 1), &["errs", "41"]);
    refused(&s, req(&s, "errs", 41, E, 1), &["errs", "41"]);
    let r = s.infer(req(&s, "errs", 41, S | E, 9));
    assert_eq!(r.output_i32("OUTPUT"), vec![9]);
    // String IDs: at most 128 bytes.
    let long = "x".repeat(129);
    let r = plain().flags(S | E);
    let st = r.try_correlation_id_str(&long);
    if st == INFER_STATUS_OK {
        refused(&s, r, &["errs"]);
    } else {
        expect_status(st, INFER_STATUS_INVALID_ARGUMENT);
    }
    let limit = "y".repeat(128);
    let r = s.infer(req_id(&s, "errs", &Id::S(limit), S | E, 4));
    assert_eq!(r.status(), 0, "{}", r.error());
    assert_eq!(r.output_i32("OUTPUT"), vec![4]);
    assert_eq!(stat(&s, "errs", "failure_count"), 0);
}

#[test]
fn correlation_id_type_must_match_the_corrid_control() {
    let s = Server::new();
    let numeric = model(
        "num",
        "accumulator",
        2,
        1,
        &format!("direct {{ }}\n {}", start_ready_corrid("TYPE_UINT64")),
        "",
    );
    s.load("num", &numeric);
    let msg = refused(
        &s,
        req_id(&s, "num", &Id::S("abc".into()), S, 1),
        &["num", "abc"],
    );
    let low = msg.to_lowercase();
    assert!(
        low.contains("uint64") && (low.contains("string") || low.contains("bytes")),
        "both types should be named: {msg}"
    );
    let stringy = model(
        "txt",
        "accumulator",
        2,
        1,
        &format!("direct {{ }}\n {}", start_ready_corrid("TYPE_STRING")),
        "",
    );
    s.load("txt", &stringy);
    let msg = refused(&s, req(&s, "txt", 77, S, 1), &["txt", "77"]);
    let low = msg.to_lowercase();
    assert!(
        (low.contains("string") || low.contains("bytes"))
            && ["uint64", "numeric", "integer", "number"]
                .iter()
                .any(|w| low.contains(w)),
        "both types should be named: {msg}"
    );
    // The matching kinds work, keyed by the ID value.
    let c = Collector::new();
    let expected = enqueue_rr(
        &s,
        "num",
        &c,
        &[(Id::N(u64::MAX), vec![1, 2, 3]), (Id::N(1), vec![10, 20])],
    );
    check_sums(&c, &expected);
    let c = Collector::new();
    let expected = enqueue_rr(
        &s,
        "txt",
        &c,
        &[
            (Id::S("abc".into()), vec![1, 2, 3]),
            (Id::S("abcd".into()), vec![10, 20, 30]),
        ],
    );
    check_sums(&c, &expected);
}

/// Where Triton has a well-known message for a refused sequence request, the error starts
/// with Triton's exact text (as its sequence batcher writes it), then says more.
#[test]
fn sequence_errors_start_with_tritons_texts() {
    let s = Server::new();
    s.load("tx", &acc("tx", 4, 1));
    let c = Collector::new();
    let refused = |r: Req, want: &str| {
        let (st, msg) = s.enqueue(r, &c).expect_err("refused at enqueue");
        assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{msg}");
        assert!(
            msg.starts_with(want),
            "{msg:?} does not start with {want:?}"
        );
    };
    let no_start = |id: &str| {
        format!("inference request for sequence {id} to model 'tx' must specify the START flag on the first request of the sequence (")
    };
    refused(req(&s, "tx", 7, 0, 1), &no_start("7"));
    refused(
        req_id(&s, "tx", &Id::S("walker".into()), E, 1),
        &no_start("walker"),
    );
    for id in [Id::N(0), Id::S(String::new())] {
        refused(
            req_id(&s, "tx", &id, S, 1),
            "inference request to model 'tx' must specify a non-zero or non-empty correlation ID (",
        );
    }
    refused(
        s.request("tx")
            .input_i32("INPUT", &[2, 1], &[1, 2])
            .correlation_id(9)
            .flags(S),
        "inference request to model 'tx' must specify batch-size 1 due to requirements of sequence batcher (",
    );
    // After its END, a sequence's next request without START is refused alike.
    let r = s.infer(req(&s, "tx", 8, S | E, 1));
    assert_eq!(r.status(), 0, "{}", r.error());
    refused(req(&s, "tx", 8, 0, 1), &no_start("8"));
    // A correlation ID of the other kind than the model's CORRID control.
    for (name, dt, id, want) in [
        (
            "txc",
            "TYPE_UINT64",
            Id::S("walker".into()),
            "'BYTES', but model 'txc' expects 'UINT64' (",
        ),
        (
            "txs",
            "TYPE_STRING",
            Id::N(5),
            "'UINT64', but model 'txs' expects 'BYTES' (",
        ),
    ] {
        let body = format!("direct {{ }}\n  {}", start_ready_corrid(dt));
        s.load(name, &model(name, "accumulator", 4, 1, &body, ""));
        refused(
            req_id(&s, name, &id, S, 1),
            &format!("sequence batching control 'CORRID' data-type is {want}"),
        );
    }
}

/// A START for a correlation ID whose previous sequence's END is still queued begins a
/// new sequence, as in Triton: it takes a free slot, or waits in the backlog behind the
/// sequences already there, while the old one finishes in its own slot.
#[test]
fn a_start_after_a_queued_end_begins_a_new_sequence() {
    // One slot: sequence 5 runs, 7 waits, then the second sequence 5 (behind 7).
    let s = Server::new();
    s.load("one", &acc("one", 1, 1));
    s.pause("one");
    let c = Collector::new();
    let mut ids = Vec::new();
    for (id, flags, v) in [
        (5, S, 1),
        (5, E, 2),
        (7, S, 100),
        (7, E, 200),
        (5, S, 10),
        (5, E, 20),
    ] {
        ids.push(s.enqueue(req(&s, "one", id, flags, v), &c).unwrap());
    }
    s.resume("one");
    c.wait(6);
    c.assert_exactly_once(&ids);
    let order = c.ids_in_order();
    let at = |k: usize| order.iter().position(|&x| x == ids[k]).unwrap();
    assert!(at(1) < at(2) && at(3) < at(4), "order {order:?} of {ids:?}");
    let sums: HashMap<u64, i32> = c
        .take()
        .iter()
        .map(|r| (r.id(), r.output_i32("OUTPUT")[0]))
        .collect();
    let want = [1, 3, 100, 300, 10, 30];
    for (k, w) in want.iter().enumerate() {
        assert_eq!(sums[&ids[k]], *w, "request {k}");
    }
    // Two slots: the new sequence 5 takes the free slot and runs beside the old one
    // (batches of 2 rows), instead of after it in the old one's slot.
    s.load("two", &acc("two", 2, 1));
    s.pause("two");
    let c = Collector::new();
    let mut ids = Vec::new();
    for (id, flags, v) in [(5, S, 1), (5, E, 2), (5, S, 10), (5, E, 20)] {
        ids.push(s.enqueue(req(&s, "two", id, flags, v), &c).unwrap());
    }
    s.resume("two");
    c.wait(4);
    let sums: HashMap<u64, i32> = c
        .take()
        .iter()
        .map(|r| (r.id(), r.output_i32("OUTPUT")[0]))
        .collect();
    for (k, w) in [1, 3, 10, 30].iter().enumerate() {
        assert_eq!(sums[&ids[k]], *w, "request {k}");
    }
    let st = s.stats("two");
    assert_eq!(st["models"][0]["execution_count"], 2, "{st}");
    assert_eq!(st["models"][0]["inference_count"], 4, "{st}");
}

#[test]
fn backlogged_sequence_times_out_with_all_its_requests() {
    let s = Server::new();
    s.load("bto", &acc("bto", 1, 1));
    let r = s.infer(req(&s, "bto", 1, S, 5));
    assert_eq!(r.output_i32("OUTPUT"), vec![5]);
    let c = Collector::new();
    let ids = vec![
        s.enqueue(req(&s, "bto", 2, S, 1).timeout_us(300_000), &c)
            .unwrap(),
        s.enqueue(req(&s, "bto", 2, 0, 2), &c).unwrap(),
        s.enqueue(req(&s, "bto", 2, E, 3), &c).unwrap(),
    ];
    c.wait(3);
    c.assert_exactly_once(&ids);
    for r in c.take() {
        assert_eq!(
            r.status(),
            INFER_STATUS_DEADLINE_EXCEEDED,
            "request {}: {}",
            r.id(),
            r.error()
        );
        // Triton's text first, then which sequence and why.
        assert!(
            r.error()
                .starts_with("timeout of the corresponding sequence has been expired: model 'bto': sequence 2 timed out in the backlog"),
            "{}",
            r.error()
        );
    }
    // Sequence 1 still holds its slot and goes on.
    let r = s.infer(req(&s, "bto", 1, E, 1));
    assert_eq!(r.output_i32("OUTPUT"), vec![6]);
    // The slot is free now: sequence 2 can start afresh.
    let r = s.infer(req(&s, "bto", 2, S | E, 8));
    assert_eq!(r.status(), 0, "{}", r.error());
    assert_eq!(r.output_i32("OUTPUT"), vec![8]);
}

// ---------------------------------------------------------------------------------------
// Oldest
// ---------------------------------------------------------------------------------------

const ALL_CONTROLS_U64: &str = r#"control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]"#;

#[test]
fn oldest_takes_one_request_per_sequence_per_batch() {
    let s = recorder_server();
    let cfg = model(
        "old1",
        "recorder",
        4,
        1,
        &format!(
            "max_sequence_idle_microseconds: 5000000\n oldest {{ max_candidate_sequences: 4 }}\n {ALL_CONTROLS_U64}"
        ),
        "",
    );
    s.load("old1", &cfg);
    s.pause("old1");
    let c = Collector::new();
    // Whole sequences one after the other: a plain dynamic batcher would put A's four
    // requests in one batch.
    let mut n = 0;
    for (id, len) in [(1u64, 4usize), (2, 4), (3, 2), (4, 1)] {
        for k in 0..len {
            s.enqueue(
                req(
                    &s,
                    "old1",
                    id,
                    seq_flags(k, len),
                    (id * 10 + k as u64) as i32,
                ),
                &c,
            )
            .unwrap();
            n += 1;
        }
    }
    s.resume("old1");
    c.wait(n);
    for r in c.take() {
        assert_eq!(r.status(), 0, "{}", r.error());
    }
    let recs = records("old1");
    let sets: Vec<BTreeSet<String>> = recs
        .iter()
        .map(|r| r.vals("CORRID").into_iter().collect())
        .collect();
    let want: Vec<BTreeSet<String>> = [
        vec!["1", "2", "3", "4"],
        vec!["1", "2", "3"],
        vec!["1", "2"],
        vec!["1", "2"],
    ]
    .iter()
    .map(|v| v.iter().map(|x| x.to_string()).collect())
    .collect();
    assert_eq!(sets, want, "{recs:#?}");
    check_oldest_records(&recs);
    // No padding: executed rows are real requests.
    let st = s.stats("old1");
    assert_eq!(batch_sizes(&st), vec![(2, 2), (3, 1), (4, 1)], "{st}");
    assert_eq!(st["models"][0]["inference_count"], n as u64);
}

/// Oldest batches: no CORRID twice in a batch, no padding, each sequence's requests in
/// order (INPUT = id * 10 + position) with START on the first and END on the last, and
/// never two executions of one sequence at the same time.
fn check_oldest_records(recs: &[Rec]) {
    let mut seen: HashMap<String, Vec<(i32, Instant, Instant, u32)>> = HashMap::new();
    for r in recs {
        let ids = r.vals("CORRID");
        assert_eq!(ids.len(), r.size as usize);
        assert_eq!(r.requests, r.size as usize, "padding in an Oldest batch");
        let uniq: BTreeSet<&String> = ids.iter().collect();
        assert_eq!(
            uniq.len(),
            ids.len(),
            "a sequence twice in one batch: {ids:?}"
        );
        assert!(r.vals("READY").iter().all(|v| v == "1"));
        let inputs = r.vals("INPUT");
        let starts = r.vals("START");
        let ends = r.vals("END");
        for (row, id) in ids.iter().enumerate() {
            let v: i32 = inputs[row].parse().unwrap();
            let idn: i32 = id.parse().unwrap();
            let pos = v - idn * 10;
            assert_eq!(
                starts[row],
                if pos == 0 { "1" } else { "0" },
                "START of {id}[{pos}]"
            );
            let _ = &ends[row];
            seen.entry(id.clone())
                .or_default()
                .push((pos, r.start, r.end, r.instance));
        }
    }
    for (id, mut v) in seen {
        v.sort_by_key(|x| x.1);
        let positions: Vec<i32> = v.iter().map(|x| x.0).collect();
        let want: Vec<i32> = (0..v.len() as i32).collect();
        assert_eq!(positions, want, "sequence {id} out of order");
        for w in v.windows(2) {
            assert!(
                w[1].1 >= w[0].2,
                "sequence {id} executed twice at the same time"
            );
        }
        assert!(
            v.iter().all(|x| x.3 == v[0].3),
            "sequence {id} moved between instances"
        );
    }
}

#[test]
fn oldest_two_instances_never_overlap_a_sequence() {
    let s = recorder_server();
    let cfg = model(
        "old2",
        "recorder",
        4,
        2,
        &format!(
            "max_sequence_idle_microseconds: 5000000\n oldest {{ max_candidate_sequences: 2 }}\n {ALL_CONTROLS_U64}"
        ),
        r#"parameters { key: "delay_us" value { string_value: "5000" } }"#,
    );
    s.load("old2", &cfg);
    let c = Collector::new();
    let mut n = 0;
    for id in 1..=6u64 {
        for k in 0..3usize {
            s.enqueue(
                req(&s, "old2", id, seq_flags(k, 3), (id * 10 + k as u64) as i32),
                &c,
            )
            .unwrap();
            n += 1;
        }
    }
    c.wait(n);
    for r in c.take() {
        assert_eq!(r.status(), 0, "{}", r.error());
    }
    let recs = records("old2");
    check_oldest_records(&recs);
    // Two candidate sequences per instance: at most two rows per batch.
    assert!(recs.iter().all(|r| r.size <= 2), "{recs:#?}");
    let ends: usize = recs
        .iter()
        .map(|r| r.vals("END").iter().filter(|v| *v == "1").count())
        .sum();
    assert_eq!(ends, 6);
}

#[test]
fn oldest_with_implicit_state_sums() {
    let s = Server::new();
    let cfg = model(
        "old3",
        "accumulator",
        4,
        2,
        &format!(
            "max_sequence_idle_microseconds: 5000000\n oldest {{ max_candidate_sequences: 3 preferred_batch_size: [ 2, 3 ] }}\n {}",
            state_clause("")
        ),
        "",
    );
    s.load("old3", &cfg);
    s.pause("old3");
    let c = Collector::new();
    let seqs: Vec<(Id, Vec<i32>)> = (1..=9)
        .map(|j| {
            (
                Id::N(j),
                (0..(j as i32 % 4 + 2)).map(|k| j as i32 * 7 + k).collect(),
            )
        })
        .collect();
    let expected = enqueue_rr(&s, "old3", &c, &seqs);
    s.resume("old3");
    check_sums(&c, &expected);
    let st = s.stats("old3");
    let rows: u64 = batch_sizes(&st).iter().map(|(sz, n)| sz * n).sum();
    assert_eq!(rows, expected.len() as u64, "Oldest pads no rows: {st}");
    assert!(batch_sizes(&st).iter().all(|(sz, _)| *sz <= 3), "{st}");
}

#[test]
fn oldest_with_corrid_accumulator_sums() {
    let s = Server::new();
    let cfg = model(
        "old4",
        "accumulator",
        4,
        1,
        &format!(
            "max_sequence_idle_microseconds: 5000000\n oldest {{ }}\n {}",
            start_ready_corrid("TYPE_UINT64")
        ),
        "",
    );
    s.load("old4", &cfg);
    s.pause("old4");
    let c = Collector::new();
    let seqs: Vec<(Id, Vec<i32>)> = (1..=6)
        .map(|j| {
            (
                Id::N(j * 1000),
                (0..(j as i32 + 1)).map(|k| k * j as i32 + 1).collect(),
            )
        })
        .collect();
    let expected = enqueue_rr(&s, "old4", &c, &seqs);
    s.resume("old4");
    check_sums(&c, &expected);
}

/// The own-state accumulator keeps sums per batch slot; under oldest a slot holds other
/// sequences from batch to batch, so without a correlation ID control (or an implicit
/// state) the model is refused instead of mixing sums.
#[test]
fn oldest_accumulator_without_a_correlation_id_is_refused() {
    let s = Server::new();
    let body = |controls: &str| {
        format!("max_sequence_idle_microseconds: 5000000\n oldest {{ max_candidate_sequences: 4 }}\n {controls}")
    };
    let cfg = model("old_nocorr", "accumulator", 4, 1, &body(START_READY), "");
    let msg = expect_status(
        s.try_load("old_nocorr", &cfg),
        INFER_STATUS_INVALID_ARGUMENT,
    );
    assert!(
        msg.contains("'old_nocorr'") && msg.contains("CONTROL_SEQUENCE_CORRID"),
        "{msg}"
    );
    // One row per batch: a slot is the sequence's for as long as its request runs.
    s.load(
        "old_one",
        &model("old_one", "accumulator", 1, 1, &body(START_READY), ""),
    );
    s.load(
        "old_corr",
        &model("old_corr", "accumulator", 4, 1, &body(ALL_CONTROLS_U64), ""),
    );
}

#[test]
fn oldest_waits_for_a_preferred_batch_size() {
    // Like the dynamic batcher: one ready sequence is below the preferred size 2, so the
    // batch waits for the queue delay (3 s); a second sequence completes it at once.
    let s = Server::new();
    let cfg = model(
        "old5",
        "accumulator",
        4,
        1,
        &format!(
            "max_sequence_idle_microseconds: 5000000\n oldest {{ preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 3000000 }}\n {}",
            state_clause("")
        ),
        "",
    );
    s.load("old5", &cfg);
    let c = Collector::new();
    let a = s.enqueue(req(&s, "old5", 1, S, 1), &c).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        c.finals(),
        0,
        "sent below the preferred batch size before the delay"
    );
    let b = s.enqueue(req(&s, "old5", 2, S, 2), &c).unwrap();
    check_sums(&c, &BTreeMap::from([(a, 1), (b, 2)]));
    assert_eq!(batch_sizes(&s.stats("old5")), vec![(2, 1)]);
}

// ---------------------------------------------------------------------------------------
// Control tensors as the model sees them
// ---------------------------------------------------------------------------------------

fn controls_config(name: &str, mbs: u32, start_end_ready: &str, corrid_dt: &str) -> String {
    let ctl = |n: &str, kind: &str| {
        format!(r#"{{ name: "{n}" control [ {{ kind: {kind} {start_end_ready} }} ] }}"#)
    };
    let body = format!(
        "max_sequence_idle_microseconds: 5000000\n direct {{ }}\n control_input [ {}, {}, {}, {{ name: \"CORRID\" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: {corrid_dt} }} ] }} ]",
        ctl("START", "CONTROL_SEQUENCE_START"),
        ctl("END", "CONTROL_SEQUENCE_END"),
        ctl("READY", "CONTROL_SEQUENCE_READY"),
    );
    model(name, "recorder", mbs, 1, &body, "")
}

/// A (3 requests, slot 0), B (1, slot 1), C (2, slot 2), round-robin while paused:
/// batches [A B C], [A pad C], [A]. `f`/`t` are the false/true strings of the controls,
/// `pad_id` the CORRID of a padding row.
fn check_controls(
    name: &str,
    start_end_ready: &str,
    corrid_dt: &str,
    ids: [Id; 3],
    [f, t, pad_id]: [&str; 3],
    dt: DataType,
) {
    let s = recorder_server();
    s.load(name, &controls_config(name, 4, start_end_ready, corrid_dt));
    s.pause(name);
    let c = Collector::new();
    let expected = enqueue_rr(
        &s,
        name,
        &c,
        &[
            (ids[0].clone(), vec![11, 12, 13]),
            (ids[1].clone(), vec![21]),
            (ids[2].clone(), vec![31, 32]),
        ],
    );
    s.resume(name);
    c.wait(expected.len());
    c.assert_exactly_once(&expected.keys().copied().collect::<Vec<_>>());
    for r in c.take() {
        assert_eq!(r.status(), 0, "{}", r.error());
    }
    let recs = records(name);
    assert_eq!(recs.len(), 3, "{recs:#?}");
    let (a, b, cc) = (ids[0].describe(), ids[1].describe(), ids[2].describe());
    let want: [(u32, [&[&str]; 5]); 3] = [
        (
            3,
            [
                &[t, t, t],
                &[f, t, f],
                &[t, t, t],
                &[a.as_str(), b.as_str(), cc.as_str()],
                &["11", "21", "31"],
            ],
        ),
        (
            3,
            [
                &[f, f, f],
                &[f, f, t],
                &[t, f, t],
                &[a.as_str(), pad_id, cc.as_str()],
                &["12", "0", "32"],
            ],
        ),
        (1, [&[f], &[t], &[t], &[a.as_str()], &["13"]]),
    ];
    for (i, (r, (rows, w))) in recs.iter().zip(want.iter()).enumerate() {
        assert_eq!(r.size, *rows, "batch {i}");
        for (k, n) in ["START", "END", "READY", "CORRID", "INPUT"]
            .iter()
            .enumerate()
        {
            assert_eq!(r.vals(n), w[k], "{n} of batch {i}");
            assert_eq!(
                r.shape(n),
                vec![*rows as i64, 1],
                "shape of {n} in batch {i}"
            );
        }
        for n in ["START", "END", "READY"] {
            assert_eq!(r.dtype(n), dt, "{n}");
        }
    }
}

#[test]
fn control_tensors_int32_with_uint64_corrid() {
    check_controls(
        "ctl_i32",
        "int32_false_true: [ 0, 1 ]",
        "TYPE_UINT64",
        [Id::N(u64::MAX - 1), Id::N(22), Id::N(33)],
        ["0", "1", "0"],
        DataType::Int32,
    );
    assert_eq!(records("ctl_i32")[0].dtype("CORRID"), DataType::Uint64);
}

#[test]
fn control_tensors_int32_custom_values() {
    // Not 0/1: the model gets exactly the configured false and true values, padding
    // rows included.
    check_controls(
        "ctl_i32b",
        "int32_false_true: [ -3, 42 ]",
        "TYPE_INT64",
        [Id::N(5), Id::N(6), Id::N(7)],
        ["-3", "42", "0"],
        DataType::Int32,
    );
    assert_eq!(records("ctl_i32b")[0].dtype("CORRID"), DataType::Int64);
}

#[test]
fn control_tensors_fp32_with_uint32_corrid() {
    check_controls(
        "ctl_f32",
        "fp32_false_true: [ 0.25, 0.75 ]",
        "TYPE_UINT32",
        [Id::N(1), Id::N(2), Id::N(4_000_000_000)],
        ["0.25", "0.75", "0"],
        DataType::Fp32,
    );
    assert_eq!(records("ctl_f32")[0].dtype("CORRID"), DataType::Uint32);
}

#[test]
fn control_tensors_bool_with_int32_corrid() {
    check_controls(
        "ctl_bool",
        "bool_false_true: [ false, true ]",
        "TYPE_INT32",
        [Id::N(100), Id::N(200), Id::N(300)],
        ["false", "true", "0"],
        DataType::Bool,
    );
    assert_eq!(records("ctl_bool")[0].dtype("CORRID"), DataType::Int32);
}

#[test]
fn control_tensors_with_string_corrid() {
    check_controls(
        "ctl_str",
        "int32_false_true: [ 0, 1 ]",
        "TYPE_STRING",
        [
            Id::S("alpha".into()),
            Id::S("b".into()),
            Id::S("gamma-33".into()),
        ],
        ["0", "1", ""],
        DataType::Int32,
    );
    assert_eq!(records("ctl_str")[0].dtype("CORRID"), DataType::Bytes);
}

#[test]
fn control_tensors_without_batching_have_shape_one() {
    let s = recorder_server();
    let cfg = controls_config("ctl_nb", 0, "int32_false_true: [ 0, 1 ]", "TYPE_UINT64");
    s.load("ctl_nb", &cfg);
    s.pause("ctl_nb");
    let c = Collector::new();
    let mut n = 0;
    for (id, flags, v) in [(11u64, S, 1), (22, S | E, 2), (11, E, 3)] {
        let r = s
            .request("ctl_nb")
            .input_i32("INPUT", &[1], &[v])
            .correlation_id(id)
            .flags(flags);
        s.enqueue(r, &c).unwrap();
        n += 1;
    }
    s.resume("ctl_nb");
    c.wait(n);
    for r in c.take() {
        assert_eq!(r.status(), 0, "{}", r.error());
        assert_eq!(r.output("OUTPUT").unwrap().0, vec![1]);
    }
    // One slot: 11 runs to its END, then the backlogged 22.
    let recs = records("ctl_nb");
    let got: Vec<[Vec<String>; 4]> = recs
        .iter()
        .map(|r| {
            [
                r.vals("START"),
                r.vals("END"),
                r.vals("READY"),
                r.vals("CORRID"),
            ]
        })
        .collect();
    let v = |x: &str| vec![x.to_string()];
    assert_eq!(
        got,
        vec![
            [v("1"), v("0"), v("1"), v("11")],
            [v("0"), v("1"), v("1"), v("11")],
            [v("1"), v("1"), v("1"), v("22")],
        ]
    );
    for r in &recs {
        for n in ["START", "END", "READY", "CORRID", "INPUT"] {
            assert_eq!(r.shape(n), vec![1], "{n}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// Implicit state
// ---------------------------------------------------------------------------------------

fn run_one_sequence(s: &Server, model: &str, id: u64, vals: &[i32]) -> Vec<i32> {
    vals.iter()
        .enumerate()
        .map(|(k, v)| {
            let r = s.infer(req(s, model, id, seq_flags(k, vals.len()), *v));
            assert_eq!(r.status(), 0, "{}", r.error());
            let o = r.output_i32("OUTPUT");
            assert_eq!(o.len(), 1);
            o[0]
        })
        .collect()
}

#[test]
fn implicit_state_initial_forms() {
    let s = Server::new();
    let dir = temp_dir("seqstate");
    std::fs::create_dir_all(dir.join("initial_state")).unwrap();
    std::fs::write(dir.join("initial_state/init.bin"), 100i32.to_le_bytes()).unwrap();

    s.load("st_none", &acc_state("st_none", 2, 1, ""));
    assert_eq!(
        run_one_sequence(&s, "st_none", 1, &[1, 2, 3]),
        vec![1, 3, 6]
    );

    let zero = r#"initial_state: { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "z" }"#;
    s.load("st_zero", &acc_state("st_zero", 2, 1, zero));
    assert_eq!(run_one_sequence(&s, "st_zero", 1, &[4, 5]), vec![4, 9]);

    let file =
        r#"initial_state: { data_type: TYPE_INT32 dims: [ 1 ] data_file: "init.bin" name: "f" }"#;
    ok(s.try_load_dir("st_file", &acc_state("st_file", 2, 1, file), &dir));
    assert_eq!(
        run_one_sequence(&s, "st_file", 1, &[1, 2, 3]),
        vec![101, 103, 106]
    );
    // Every new sequence starts from the file's data again, also two at once.
    s.pause("st_file");
    let c = Collector::new();
    let mut expected = enqueue_rr(
        &s,
        "st_file",
        &c,
        &[(Id::N(1), vec![1, 1]), (Id::N(2), vec![-100, 5])],
    );
    for v in expected.values_mut() {
        *v += 100;
    }
    s.resume("st_file");
    check_sums(&c, &expected);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn implicit_state_from_file_is_row_major() {
    let s = Server::new();
    let dir = temp_dir("seqstate2");
    std::fs::create_dir_all(dir.join("initial_state")).unwrap();
    let init: Vec<u8> = [100i32, -7, 3]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    std::fs::write(dir.join("initial_state/three.bin"), init).unwrap();
    let cfg = r#"
name: "st3" backend: "accumulator" max_batch_size: 2
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 3 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 3 ] } ]
sequence_batching {
  state [ { input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_INT32 dims: [ 3 ]
    initial_state: { data_type: TYPE_INT32 dims: [ 3 ] data_file: "three.bin" name: "f" } } ]
}
"#;
    ok(s.try_load_dir("st3", cfg, &dir));
    let r = s.infer(
        s.request("st3")
            .input_i32("INPUT", &[1, 3], &[1, 2, 3])
            .correlation_id(1)
            .flags(S),
    );
    assert_eq!(r.status(), 0, "{}", r.error());
    assert_eq!(r.output_i32("OUTPUT"), vec![101, -5, 6]);
    let r = s.infer(
        s.request("st3")
            .input_i32("INPUT", &[1, 3], &[1, 1, 1])
            .correlation_id(1)
            .flags(E),
    );
    assert_eq!(r.output_i32("OUTPUT"), vec![102, -4, 7]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_initial_state_files_fail_the_load() {
    let s = Server::new();
    let dir = temp_dir("seqstate3");
    std::fs::create_dir_all(dir.join("initial_state")).unwrap();
    std::fs::create_dir_all(dir.join("sub/initial_state")).unwrap();
    std::fs::write(dir.join("initial_state/short.bin"), [1u8, 2, 3]).unwrap();
    std::fs::write(dir.join("initial_state/long.bin"), [0u8; 8]).unwrap();
    std::fs::write(dir.join("initial_state/good.bin"), 5i32.to_le_bytes()).unwrap();
    // A file that exists, reached by escaping the folder.
    std::fs::write(dir.join("sub/outside.bin"), 5i32.to_le_bytes()).unwrap();
    let abs = dir.join("initial_state/good.bin");
    let sub = dir.join("sub");
    let cases: Vec<(&str, String, &std::path::Path)> = vec![
        ("escape", "../outside.bin".to_string(), &sub),
        ("absolute", abs.to_str().unwrap().to_string(), &dir),
        ("missing", "nope.bin".to_string(), &dir),
        ("short", "short.bin".to_string(), &dir),
        ("long", "long.bin".to_string(), &dir),
    ];
    for (what, file, d) in cases {
        let init = format!(
            r#"initial_state: {{ data_type: TYPE_INT32 dims: [ 1 ] data_file: "{file}" name: "f" }}"#
        );
        let name = format!("bad_{what}");
        let st = s.try_load_dir(&name, &acc_state(&name, 1, 1, &init), d);
        let msg = expect_status(st, INFER_STATUS_INVALID_ARGUMENT);
        assert!(msg.contains(&name), "{what}: {msg}");
    }
    // The good file loads.
    let init =
        r#"initial_state: { data_type: TYPE_INT32 dims: [ 1 ] data_file: "good.bin" name: "f" }"#;
    ok(s.try_load_dir("good", &acc_state("good", 1, 1, init), &dir));
    assert_eq!(run_one_sequence(&s, "good", 3, &[1]), vec![6]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn state_output_is_returned_only_when_listed() {
    let s = Server::new();
    s.load("hidden", &acc_state("hidden", 2, 1, ""));
    let listed = acc_state("listed", 2, 1, "").replace(
        r#"output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]"#,
        r#"output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] },
                    { name: "OUTPUT_STATE" data_type: TYPE_INT32 dims: [ 1 ] } ]"#,
    );
    assert!(listed.contains("OUTPUT_STATE\" data_type"));
    s.load("listed", &listed);
    let mut sum = 0;
    for (k, v) in [3, 4, 5].iter().enumerate() {
        sum += v;
        let f = seq_flags(k, 3);
        let r = s.infer(req(&s, "hidden", 1, f, *v));
        assert_eq!(r.status(), 0, "{}", r.error());
        assert_eq!(r.output_count(), 1);
        assert!(r.output("OUTPUT_STATE").is_none());
        assert!(r.output("INPUT_STATE").is_none());
        assert_eq!(r.output_i32("OUTPUT"), vec![sum]);
        let r = s.infer(req(&s, "listed", 1, f, *v));
        assert_eq!(r.status(), 0, "{}", r.error());
        assert_eq!(r.output_count(), 2);
        assert_eq!(r.output_i32("OUTPUT"), vec![sum]);
        assert_eq!(r.output_i32("OUTPUT_STATE"), vec![sum]);
        assert_eq!(r.output("OUTPUT_STATE").unwrap().0, vec![1, 1]);
        // Asking for OUTPUT alone leaves the state out.
        let r = s.infer(req(&s, "listed", 2, seq_flags(k, 3), *v).output("OUTPUT"));
        assert_eq!(r.output_count(), 1);
        assert_eq!(r.output_i32("OUTPUT"), vec![sum]);
    }
}

/// STATE_OUT = STATE_IN followed by INPUT (the state grows by one element per request);
/// OUTPUT = STATE_IN as the model saw it.
fn grow(b: &mut Batch) -> infer::status::Result<()> {
    let (st, sdata) = b.input("STATE_IN").expect("no STATE_IN");
    let shape = st.shape.to_vec();
    let sdata: Vec<i32> = bytemuck::pod_collect_to_vec(sdata);
    let (_, idata) = b.input("INPUT").expect("no INPUT");
    let idata: Vec<i32> = bytemuck::pod_collect_to_vec(idata);
    assert_eq!(shape.len(), 2, "state shape {shape:?}");
    let (rows, n) = (shape[0] as usize, shape[1] as usize);
    assert_eq!(rows, b.size as usize);
    let out = b.alloc_output("OUTPUT", &shape, None)?;
    out.copy_from_slice(bytemuck::cast_slice(&sdata));
    let mut next = Vec::with_capacity(rows * (n + 1));
    for r in 0..rows {
        next.extend_from_slice(&sdata[r * n..(r + 1) * n]);
        next.push(idata[r]);
    }
    let out = b.alloc_output("STATE_OUT", &[rows as i64, n as i64 + 1], None)?;
    out.copy_from_slice(bytemuck::cast_slice(&next));
    Ok(())
}

/// STATE_OUT = STATE_IN + INPUT and OUTPUT = STATE_IN + INPUT, except that a batch whose
/// first INPUT is negative writes OUTPUT = STATE_IN and no STATE_OUT at all.
fn sum_or_skip(b: &mut Batch) -> infer::status::Result<()> {
    let (_, sdata) = b.input("STATE_IN").expect("no STATE_IN");
    let state: Vec<i32> = bytemuck::pod_collect_to_vec(sdata);
    let (_, idata) = b.input("INPUT").expect("no INPUT");
    let input: Vec<i32> = bytemuck::pod_collect_to_vec(idata);
    let rows = b.size as i64;
    if input[0] < 0 {
        let out = b.alloc_output("OUTPUT", &[rows, 1], None)?;
        out.copy_from_slice(bytemuck::cast_slice(&state));
        return Ok(());
    }
    let next: Vec<i32> = state.iter().zip(&input).map(|(s, i)| s + i).collect();
    let out = b.alloc_output("OUTPUT", &[rows, 1], None)?;
    out.copy_from_slice(bytemuck::cast_slice(&next));
    let out = b.alloc_output("STATE_OUT", &[rows, 1], None)?;
    out.copy_from_slice(bytemuck::cast_slice(&next));
    Ok(())
}

/// A backend that writes no output state for a request leaves that state as it was, and
/// the request succeeds (Triton: the state is not updated).
#[test]
fn a_state_not_written_is_not_updated() {
    let s = Server::new();
    s.register_fn_backend("sum_or_skip", sum_or_skip);
    s.load(
        "skip",
        r#"
name: "skip" backend: "sum_or_skip" max_batch_size: 1
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching {
  state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
}
"#,
    );
    // 3, then a request that writes no state (sees 3, leaves 3), then 4: 7.
    let steps = [(S, 3, 3), (0, -1, 3), (0, -5, 3), (E, 4, 7)];
    for (k, (flags, v, want)) in steps.into_iter().enumerate() {
        let r = s.infer(req(&s, "skip", 12, flags, v));
        assert_eq!(r.status(), 0, "request {k}: {}", r.error());
        assert_eq!(r.output_i32("OUTPUT"), vec![want], "request {k}");
    }
    // A sequence whose first request writes no state keeps the initial (zero) state.
    for (k, (flags, v, want)) in [(S, -1, 0), (E, 2, 2)].into_iter().enumerate() {
        let r = s.infer(req(&s, "skip", 13, flags, v));
        assert_eq!(r.status(), 0, "request {k}: {}", r.error());
        assert_eq!(r.output_i32("OUTPUT"), vec![want], "request {k}");
    }
}

#[test]
fn variable_dims_state_grows() {
    let s = Server::new();
    s.register_fn_backend("grow", grow);
    let cfg = |name: &str, initial: &str| {
        format!(
            r#"
name: "{name}" backend: "grow" max_batch_size: 1
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ -1 ] }} ]
sequence_batching {{
  state [ {{ input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_INT32 dims: [ -1 ] {initial} }} ]
}}
"#
        )
    };
    s.load("grow1", &cfg("grow1", ""));
    s.load(
        "grow3",
        &cfg(
            "grow3",
            r#"initial_state: { data_type: TYPE_INT32 dims: [ 3 ] zero_data: true name: "z" }"#,
        ),
    );
    for (model, init) in [("grow1", vec![0]), ("grow3", vec![0, 0, 0])] {
        for round in 0..2 {
            let vals = [5, 6, 7, 8];
            let mut state = init.clone();
            for (k, v) in vals.iter().enumerate() {
                let r = s.infer(req(&s, model, 9, seq_flags(k, vals.len()), *v));
                assert_eq!(r.status(), 0, "{model}: {}", r.error());
                assert_eq!(
                    r.output_i32("OUTPUT"),
                    state,
                    "{model} round {round} request {k}"
                );
                assert_eq!(r.output("OUTPUT").unwrap().0, vec![1, state.len() as i64]);
                state.push(*v);
            }
        }
    }
}

/// A request answered with an error leaves its sequence's state as it was, also when
/// the backend ran and wrote a new state: here the request asks for an output the backend
/// does not produce, which fails it after execution. The next request sees the state of
/// the last request that succeeded, as in Triton.
#[test]
fn a_failed_request_does_not_advance_the_state() {
    let s = Server::new();
    s.register_fn_backend("grow", grow);
    let cfg = r#"
name: "grow_x" backend: "grow" max_batch_size: 1
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ -1 ] },
         { name: "EXTRA" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching {
  state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
}
"#;
    s.load("grow_x", cfg);
    let r = s.infer(req(&s, "grow_x", 4, S, 5));
    assert_eq!(r.status(), 0, "{}", r.error());
    assert_eq!(r.output_i32("OUTPUT"), vec![0]);
    for v in [6, 7] {
        let r = s.infer(req(&s, "grow_x", 4, 0, v).output("EXTRA"));
        assert_eq!(r.status(), INFER_STATUS_INTERNAL, "{}", r.error());
        assert!(r.error().contains("EXTRA"), "{}", r.error());
    }
    let r = s.infer(req(&s, "grow_x", 4, 0, 8));
    assert_eq!(r.status(), 0, "{}", r.error());
    assert_eq!(
        r.output_i32("OUTPUT"),
        vec![0, 5],
        "the failed requests changed the state"
    );
    let r = s.infer(req(&s, "grow_x", 4, E, 9));
    assert_eq!(r.output_i32("OUTPUT"), vec![0, 5, 8]);
}

#[test]
fn variable_dims_states_of_two_sequences_stay_apart() {
    // Two sequences on one 2-slot instance whose states have different lengths: each
    // sees only its own growing state.
    let s = Server::new();
    s.register_fn_backend("grow", grow);
    let cfg = r#"
name: "grow2" backend: "grow" max_batch_size: 2
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
}
"#;
    s.load("grow2", cfg);
    // Sequence 1 runs two requests alone first.
    for (k, v) in [1, 2].iter().enumerate() {
        let r = s.infer(req(&s, "grow2", 1, if k == 0 { S } else { 0 }, *v));
        assert_eq!(r.status(), 0, "{}", r.error());
    }
    s.pause("grow2");
    let c = Collector::new();
    let mut want: BTreeMap<u64, Vec<i32>> = BTreeMap::new();
    let (mut s1, mut s2) = (vec![0, 1, 2], vec![0]);
    for k in 0..3 {
        let f2 = if k == 0 {
            S
        } else if k == 2 {
            E
        } else {
            0
        };
        let f1 = if k == 2 { E } else { 0 };
        let v1 = 10 + k;
        let v2 = 20 + k;
        want.insert(
            s.enqueue(req(&s, "grow2", 1, f1, v1), &c).unwrap(),
            s1.clone(),
        );
        want.insert(
            s.enqueue(req(&s, "grow2", 2, f2, v2), &c).unwrap(),
            s2.clone(),
        );
        s1.push(v1);
        s2.push(v2);
    }
    s.resume("grow2");
    c.wait(want.len());
    c.assert_exactly_once(&want.keys().copied().collect::<Vec<_>>());
    for r in c.take() {
        assert_eq!(r.status(), 0, "{}", r.error());
        assert_eq!(r.output_i32("OUTPUT"), want[&r.id()], "request {}", r.id());
    }
}

// ---------------------------------------------------------------------------------------
// String correlation IDs
// ---------------------------------------------------------------------------------------

#[test]
fn string_correlation_ids() {
    let s = Server::new();
    // No CORRID control: string and numeric IDs both work (3 sequences, 2 slots).
    s.load("sid", &acc("sid", 2, 1));
    s.pause("sid");
    let c = Collector::new();
    let expected = enqueue_rr(
        &s,
        "sid",
        &c,
        &[
            (Id::S("alpha".into()), vec![1, 2, 3]),
            (Id::S("alphabet".into()), vec![10, 20]),
            (Id::N(7), vec![100, 200]),
        ],
    );
    s.resume("sid");
    c.wait(expected.len());
    // Responses report numeric IDs only.
    for (r, _) in c.0.state.lock().unwrap().responses.iter() {
        let want = if expected[&r.id()] >= 100 { 7 } else { 0 };
        assert_eq!(r.correlation_id(), want, "request {}", r.id());
    }
    check_sums(&c, &expected);
    // Distinct strings are distinct sequences, also when one is a prefix of the other.
    let r = s.infer(req_id(&s, "sid", &Id::S("k".into()), S, 1));
    assert_eq!(r.output_i32("OUTPUT"), vec![1]);
    let r = s.infer(req_id(&s, "sid", &Id::S("kk".into()), S, 2));
    assert_eq!(r.output_i32("OUTPUT"), vec![2]);
    let r = s.infer(req_id(&s, "sid", &Id::S("k".into()), E, 3));
    assert_eq!(r.output_i32("OUTPUT"), vec![4]);
    let r = s.infer(req_id(&s, "sid", &Id::S("kk".into()), E, 3));
    assert_eq!(r.output_i32("OUTPUT"), vec![5]);
}

// ---------------------------------------------------------------------------------------
// Unload and shutdown
// ---------------------------------------------------------------------------------------

fn enqueue_active_and_backlogged(s: &Server, model: &str, c: &Collector) -> Vec<u64> {
    let mut ids = Vec::new();
    // Sequence 1 holds the only slot with three requests and no END; 2 and 3 wait.
    for (id, flags, v) in [
        (1, S, 1),
        (2, S, 2),
        (1, 0, 1),
        (3, S, 3),
        (2, 0, 2),
        (1, 0, 1),
        (3, E, 3),
    ] {
        ids.push(s.enqueue(req(s, model, id, flags, v), c).unwrap());
    }
    ids
}

fn slow_acc(name: &str) -> String {
    model(
        name,
        "accumulator",
        1,
        1,
        &format!("max_sequence_idle_microseconds: 2000000\n direct {{ }}\n {START_READY}"),
        r#"parameters { key: "execute_delay_us" value { string_value: "20000" } }"#,
    )
}

#[test]
fn unload_answers_active_and_backlogged_sequences_once() {
    let s = Server::new();
    s.load("unl", &slow_acc("unl"));
    let c = Collector::new();
    let ids = enqueue_active_and_backlogged(&s, "unl", &c);
    s.unload("unl");
    c.wait(ids.len());
    std::thread::sleep(Duration::from_millis(50)); // a duplicate would arrive now
    c.assert_exactly_once(&ids);
    let mut bad = 0;
    for r in c.take() {
        if r.status() == 0 {
            assert_eq!(r.output_count(), 1);
        } else {
            assert!(!r.error().is_empty());
            bad += 1;
        }
    }
    eprintln!("unload: {} OK, {bad} failed", ids.len() - bad);
    let mut rq = std::ptr::null_mut();
    let st =
        unsafe { infer::ffi::request::infer_request_new(s.0, cs("unl").as_ptr(), -1, &mut rq) };
    assert_eq!(st, INFER_STATUS_NOT_FOUND);
}

#[test]
fn unload_paused_model_with_sequences() {
    let s = Server::new();
    s.load("unlp", &slow_acc("unlp"));
    s.pause("unlp");
    let c = Collector::new();
    let ids = enqueue_active_and_backlogged(&s, "unlp", &c);
    s.unload("unlp");
    c.wait(ids.len());
    std::thread::sleep(Duration::from_millis(50));
    c.assert_exactly_once(&ids);
}

#[test]
fn shutdown_answers_every_sequence_request_once() {
    let s = Server::new();
    s.load("shut", &slow_acc("shut"));
    let c = Collector::new();
    let ids = enqueue_active_and_backlogged(&s, "shut", &c);
    s.shutdown(0);
    assert_eq!(
        c.finals(),
        ids.len(),
        "shutdown returned before every request had its FINAL"
    );
    std::thread::sleep(Duration::from_millis(50));
    c.assert_exactly_once(&ids);
}

// ---------------------------------------------------------------------------------------
// Utilization (Direct)
// ---------------------------------------------------------------------------------------

#[test]
fn minimum_slot_utilization_waits_for_more_sequences() {
    let s = Server::new();
    let cfg = model(
        "util",
        "accumulator",
        4,
        1,
        &format!(
            "max_sequence_idle_microseconds: 5000000\n direct {{ max_queue_delay_microseconds: 3000000 minimum_slot_utilization: 0.5 }}\n {START_READY}"
        ),
        "",
    );
    s.load("util", &cfg);
    let c = Collector::new();
    let a = s.enqueue(req(&s, "util", 1, S, 1), &c).unwrap();
    // One ready slot of four is below 0.5: the batch waits (up to 3 s).
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(c.finals(), 0, "sent below the minimum slot utilization");
    let b = s.enqueue(req(&s, "util", 2, S, 2), &c).unwrap();
    check_sums(&c, &BTreeMap::from([(a, 1), (b, 2)]));
    assert_eq!(batch_sizes(&s.stats("util")), vec![(2, 1)]);

    // The delay runs out: a lone sequence goes alone.
    let cfg = cfg
        .replace("\"util\"", "\"util2\"")
        .replace("3000000", "100000")
        .replace("0.5", "1.0");
    s.load("util2", &cfg);
    let c = Collector::new();
    let a = s.enqueue(req(&s, "util2", 1, S | E, 4), &c).unwrap();
    check_sums(&c, &BTreeMap::from([(a, 4)]));
}

// ---------------------------------------------------------------------------------------
// Stress
// ---------------------------------------------------------------------------------------

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// `threads` threads each run `per_thread` random sequences (length 1..=20) at once,
/// interleaving their requests at random; every response's sum is checked.
fn stress(s: &Server, model: &str, threads: usize, per_thread: usize, seed: u64) {
    let c = Collector::new();
    let t0 = Instant::now();
    let expected: BTreeMap<u64, i32> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let c = c.clone();
                sc.spawn(move || {
                    let mut rng = Rng(seed + 7919 * (t as u64 + 1));
                    let mut seqs: Vec<(u64, usize, usize, i32)> = (0..per_thread)
                        .map(|i| {
                            let id = (t as u64 + 1) * 100_000 + i as u64 + 1;
                            (id, 1 + rng.below(20) as usize, 0, 0)
                        })
                        .collect();
                    let mut exp = BTreeMap::new();
                    while !seqs.is_empty() {
                        let i = rng.below(seqs.len() as u64) as usize;
                        let (id, len, k, sum) = &mut seqs[i];
                        let v = rng.below(201) as i32 - 100;
                        *sum += v;
                        let rid = s
                            .enqueue(req(s, model, *id, seq_flags(*k, *len), v), &c)
                            .unwrap_or_else(|e| panic!("sequence {id}[{k}]: {e:?}"));
                        exp.insert(rid, *sum);
                        *k += 1;
                        if *k == *len {
                            seqs.swap_remove(i);
                        }
                    }
                    exp
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    check_sums(&c, &expected);
    let st = s.stats(model);
    assert_eq!(st["models"][0]["inference_count"], expected.len() as u64);
    assert_eq!(st["models"][0]["failure_count"], 0);
    eprintln!(
        "{model}: {} requests of {} sequences in {} executions, {:?}",
        expected.len(),
        threads * per_thread,
        st["models"][0]["execution_count"],
        t0.elapsed()
    );
}

#[test]
fn stress_direct_random_sequences() {
    let s = Server::new();
    let cfg = model(
        "stress_d",
        "accumulator",
        8,
        2,
        &format!("max_sequence_idle_microseconds: 30000000\n direct {{ }}\n {START_READY}"),
        r#"parameters { key: "execute_delay_us" value { string_value: "200" } }"#,
    );
    s.load("stress_d", &cfg);
    stress(&s, "stress_d", 8, 25, 0x9E37_79B9_7F4A_7C15);
}

#[test]
fn stress_oldest_implicit_state_random_sequences() {
    let s = Server::new();
    let cfg = model(
        "stress_o",
        "accumulator",
        8,
        2,
        &format!(
            "max_sequence_idle_microseconds: 30000000\n oldest {{ max_candidate_sequences: 6 }}\n {}",
            state_clause("")
        ),
        r#"parameters { key: "execute_delay_us" value { string_value: "200" } }"#,
    );
    s.load("stress_o", &cfg);
    stress(&s, "stress_o", 4, 25, 0x1234_5678_9ABC_DEF1);
}
