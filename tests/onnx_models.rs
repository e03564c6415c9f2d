//! The example model repository `models/` (ONNX models run by the `onnxruntime_onnx`
//! platform) through the C API: every model's reference cases from
//! `tests/fixtures/models/` (inputs and onnxruntime's outputs, written by
//! `models/generate.py`), the config auto-complete of `cnn`, the implicit-state
//! `accumulator_onnx` as interleaved sequences, the `image_classifier` ensemble, and
//! dynamic batching of concurrent `mlp` requests against one-by-one results.

mod common;
use common::*;
use infer::ffi::response::*;
use infer::ffi::server::*;
use infer::ffi::*;
use serde_json::Value;
use std::collections::HashMap;
use std::ffi::CStr;
use std::path::{Path, PathBuf};

const S: u32 = INFER_REQUEST_FLAG_SEQUENCE_START;
const E: u32 = INFER_REQUEST_FLAG_SEQUENCE_END;

/// Float outputs match when |got - want| <= ABS_TOL + REL_TOL * |want|.
const REL_TOL: f32 = 1e-4;
const ABS_TOL: f32 = 1e-5;

/// Every model of the repository (`tiny_gpt2` is generative: tests/generative.rs runs it).
const MODELS: [&str; 8] = [
    "accumulator_onnx",
    "add_sub",
    "cnn",
    "image_classifier",
    "mlp",
    "postprocess",
    "preprocess",
    "tiny_gpt2",
];

// ---------------------------------------------------------------------------------------
// Repository, fixtures, tensors
// ---------------------------------------------------------------------------------------

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models")
}

/// A server that loaded every model of `models/` at start-up.
fn repo_server() -> Server {
    let mut opts = std::ptr::null_mut();
    ok(unsafe { infer_server_options_new(&mut opts) });
    ok(unsafe {
        infer_server_options_set_model_repository(opts, cs(repo().to_str().unwrap()).as_ptr())
    });
    let mut s = std::ptr::null_mut();
    let st = unsafe { infer_server_new(opts, &mut s) };
    let msg = last_error();
    unsafe { infer_server_options_free(opts) };
    assert_eq!(
        st,
        INFER_STATUS_OK,
        "starting a server on {}: {msg}",
        repo().display()
    );
    Server(s)
}

fn fixture(model: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(format!("{model}.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run python3 models/generate.py)", path.display()));
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["model"], model, "{}", path.display());
    v
}

/// A tensor of a fixture, its data as little-endian bytes.
#[derive(Clone, Debug)]
struct Tensor {
    name: String,
    dtype: infer_datatype,
    shape: Vec<i64>,
    bytes: Vec<u8>,
}

impl Tensor {
    fn from_json(v: &Value) -> Tensor {
        let name = v["name"].as_str().unwrap().to_owned();
        let dt_name = v["datatype"].as_str().unwrap();
        let dtype = unsafe { infer_datatype_from_string(cs(dt_name).as_ptr()) };
        let shape: Vec<i64> = v["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_i64().unwrap())
            .collect();
        let data = v["data"].as_array().unwrap();
        let mut bytes = Vec::new();
        for x in data {
            match dtype {
                INFER_DATATYPE_FP32 => {
                    bytes.extend((x.as_f64().unwrap() as f32).to_le_bytes());
                }
                INFER_DATATYPE_INT64 => bytes.extend(x.as_i64().unwrap().to_le_bytes()),
                INFER_DATATYPE_INT32 => {
                    bytes.extend(i32::try_from(x.as_i64().unwrap()).unwrap().to_le_bytes())
                }
                INFER_DATATYPE_UINT8 => bytes.push(u8::try_from(x.as_u64().unwrap()).unwrap()),
                _ => panic!("tensor '{name}': datatype {dt_name} not handled by the tests"),
            }
        }
        let t = Tensor {
            name,
            dtype,
            shape,
            bytes,
        };
        assert_eq!(
            t.elements(),
            data.len(),
            "tensor '{}': shape {:?} against {} values",
            t.name,
            t.shape,
            data.len()
        );
        t
    }

    fn elements(&self) -> usize {
        self.shape.iter().product::<i64>() as usize
    }

    fn f32s(&self) -> Vec<f32> {
        assert_eq!(self.dtype, INFER_DATATYPE_FP32, "tensor '{}'", self.name);
        bytemuck::pod_collect_to_vec(&self.bytes)
    }

    /// Row `i` (of the first dimension) as a tensor of batch size 1.
    fn row(&self, i: usize) -> Tensor {
        let n = self.shape[0] as usize;
        let len = self.bytes.len() / n;
        let mut shape = self.shape.clone();
        shape[0] = 1;
        Tensor {
            name: self.name.clone(),
            dtype: self.dtype,
            shape,
            bytes: self.bytes[i * len..(i + 1) * len].to_vec(),
        }
    }
}

fn tensors(v: &Value) -> Vec<Tensor> {
    v.as_array()
        .unwrap()
        .iter()
        .map(Tensor::from_json)
        .collect()
}

/// A fixture case: inputs and the expected outputs.
struct Case {
    inputs: Vec<Tensor>,
    outputs: Vec<Tensor>,
}

fn cases(model: &str) -> Vec<Case> {
    let f = fixture(model);
    let cases: Vec<Case> = f["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            inputs: tensors(&c["inputs"]),
            outputs: tensors(&c["outputs"]),
        })
        .collect();
    assert!(!cases.is_empty(), "no cases for {model}");
    cases
}

fn request(s: &Server, model: &str, inputs: &[Tensor]) -> Req {
    let r = s.request(model);
    for t in inputs {
        let st = r.try_input(&t.name, t.dtype, &t.shape, &t.bytes);
        assert_eq!(
            st,
            INFER_STATUS_OK,
            "adding input '{}' {:?} to a request for '{model}': {}",
            t.name,
            t.shape,
            last_error()
        );
    }
    r
}

/// An output of a response: datatype, shape, bytes.
fn output(r: &Resp, name: &str) -> (infer_datatype, Vec<i64>, Vec<u8>) {
    let (mut dt, mut shape, mut nd, mut data, mut bs) =
        (0, std::ptr::null(), 0usize, std::ptr::null(), 0usize);
    let st = unsafe {
        infer_response_output_by_name(
            r.0,
            cs(name).as_ptr(),
            &mut dt,
            &mut shape,
            &mut nd,
            &mut data,
            &mut bs,
        )
    };
    assert_eq!(
        st,
        INFER_STATUS_OK,
        "response has no output '{name}': {}",
        last_error()
    );
    let shape = unsafe { std::slice::from_raw_parts(shape, nd) }.to_vec();
    let bytes = if bs == 0 {
        Vec::new()
    } else {
        unsafe { std::slice::from_raw_parts(data as *const u8, bs) }.to_vec()
    };
    (dt, shape, bytes)
}

/// Compares float data element by element; panics naming the first element out of
/// tolerance and how many are.
#[track_caller]
fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: element count");
    let bad: Vec<usize> = (0..got.len())
        .filter(|&i| {
            let diff = (got[i] - want[i]).abs();
            diff.is_nan() || diff > ABS_TOL + REL_TOL * want[i].abs()
        })
        .collect();
    if let Some(&i) = bad.first() {
        panic!(
            "{what}: {} of {} elements out of tolerance ({ABS_TOL} + {REL_TOL} x |expected|); element {i} is {} but should be {}",
            bad.len(),
            got.len(),
            got[i],
            want[i]
        );
    }
}

/// Checks a successful response against the expected outputs (floats within the
/// tolerance, integers exactly) and that it holds no other output.
#[track_caller]
fn check_response(what: &str, r: &Resp, want: &[Tensor]) {
    assert_eq!(r.status(), INFER_STATUS_OK, "{what}: {}", r.error());
    assert_eq!(r.output_count(), want.len(), "{what}: output count");
    for w in want {
        let (dt, shape, bytes) = output(r, &w.name);
        let what = format!("{what}, output '{}'", w.name);
        assert_eq!(dt, w.dtype, "{what}: datatype");
        assert_eq!(shape, w.shape, "{what}: shape");
        if w.dtype == INFER_DATATYPE_FP32 {
            let got: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
            assert_close(&what, &got, &w.f32s());
        } else {
            assert_eq!(bytes, w.bytes, "{what}: integer data differs");
        }
    }
}

/// Runs every fixture case of `model` (one blocking request each) and checks the outputs.
fn run_fixture(model: &str) {
    let s = repo_server();
    let cases = cases(model);
    for (i, c) in cases.iter().enumerate() {
        let r = s.infer(request(&s, model, &c.inputs));
        let batch = c.inputs[0].shape[0];
        check_response(&format!("{model} case {i} (batch {batch})"), &r, &c.outputs);
    }
    let inferences = s.stats(model)["models"][0]["inference_count"]
        .as_u64()
        .unwrap();
    assert!(inferences > 0, "no inference counted for {model}");
}

fn config_json(s: &Server, model: &str) -> Value {
    let mut out = std::ptr::null_mut();
    ok(unsafe { infer_server_model_config_json(s.0, cs(model).as_ptr(), -1, &mut out) });
    let text = unsafe { CStr::from_ptr(out) }.to_str().unwrap().to_owned();
    unsafe { infer_string_free(out) };
    serde_json::from_str(&text).unwrap()
}

fn batch_size_counts(s: &Server, model: &str) -> Vec<(u64, u64)> {
    batch_sizes(&s.stats(model))
}

// ---------------------------------------------------------------------------------------
// The repository
// ---------------------------------------------------------------------------------------

#[test]
fn every_model_of_the_repository_loads_and_has_a_fixture() {
    let s = repo_server();
    for m in MODELS {
        let mut ready = false;
        ok(unsafe { infer_server_model_ready(s.0, cs(m).as_ptr(), -1, &mut ready) });
        assert!(ready, "model '{m}' is not ready");
        assert!(
            repo().join(m).join("config.pbtxt").is_file(),
            "models/{m}/config.pbtxt"
        );
        fixture(m);
    }
    // Nothing else in the repository: a new model needs its tests here.
    let mut dirs: Vec<String> = std::fs::read_dir(repo())
        .unwrap()
        .flatten()
        .filter(|e| e.path().join("config.pbtxt").is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    dirs.sort();
    assert_eq!(dirs, MODELS);
}

// ---------------------------------------------------------------------------------------
// Reference cases
// ---------------------------------------------------------------------------------------

#[test]
fn add_sub_matches_onnxruntime() {
    run_fixture("add_sub");
}

#[test]
fn mlp_matches_onnxruntime() {
    run_fixture("mlp");
}

#[test]
fn cnn_matches_onnxruntime() {
    run_fixture("cnn");
}

#[test]
fn preprocess_matches_onnxruntime() {
    run_fixture("preprocess");
}

#[test]
fn postprocess_matches_onnxruntime() {
    run_fixture("postprocess");
}

/// preprocess -> cnn -> postprocess as one model, against onnxruntime's sessions chained.
#[test]
fn image_classifier_ensemble_matches_chained_onnxruntime() {
    let s = repo_server();
    let cases = cases("image_classifier");
    for (i, c) in cases.iter().enumerate() {
        let r = s.infer(request(&s, "image_classifier", &c.inputs));
        let batch = c.inputs[0].shape[0];
        check_response(
            &format!("image_classifier case {i} (batch {batch})"),
            &r,
            &c.outputs,
        );
    }
    let ensemble = &s.stats("image_classifier")["models"][0];
    assert_eq!(ensemble["success_count"], cases.len() as u64, "{ensemble}");
    // Each composing model ran once per case, and counts each case's rows as inferences
    // (Triton's inference_count), as the ensemble does.
    let rows: i64 = cases.iter().map(|c| c.inputs[0].shape[0]).sum();
    assert_eq!(ensemble["inference_count"], rows, "{ensemble}");
    for m in ["preprocess", "cnn", "postprocess"] {
        let st = &s.stats(m)["models"][0];
        assert_eq!(
            st["execution_count"],
            cases.len() as u64,
            "executions of '{m}'"
        );
        assert_eq!(st["inference_count"], rows, "inferences of '{m}'");
    }
}

/// The ensemble's rows one request each, sent together: each answer is its own row's.
#[test]
fn image_classifier_concurrent_rows_keep_their_answers() {
    let s = repo_server();
    let c = cases("image_classifier")
        .into_iter()
        .max_by_key(|c| c.inputs[0].shape[0])
        .unwrap();
    let rows = c.inputs[0].shape[0] as usize;
    assert!(rows > 1);
    let col = Collector::new();
    let mut expected = HashMap::new();
    for round in 0..4 {
        for i in 0..rows {
            let id = s
                .enqueue(request(&s, "image_classifier", &[c.inputs[0].row(i)]), &col)
                .unwrap_or_else(|e| panic!("enqueue round {round} row {i}: {e:?}"));
            expected.insert(id, i);
        }
    }
    col.wait(expected.len());
    col.assert_exactly_once(&expected.keys().copied().collect::<Vec<_>>());
    for r in col.take() {
        let i = expected[&r.id()];
        let want: Vec<Tensor> = c.outputs.iter().map(|t| t.row(i)).collect();
        check_response(&format!("image_classifier row {i}"), &r, &want);
    }
}

// ---------------------------------------------------------------------------------------
// Config auto-complete
// ---------------------------------------------------------------------------------------

/// models/cnn/config.pbtxt names only the model and its platform; the backend completes
/// inputs, outputs and max_batch_size (4: every input and output has a symbolic first
/// dim) from model.onnx.
#[test]
fn cnn_config_is_completed_from_the_model() {
    let on_disk = std::fs::read_to_string(repo().join("cnn/config.pbtxt")).unwrap();
    for absent in ["input", "output", "max_batch_size", "dims"] {
        let mut config_lines = on_disk.lines().filter(|l| !l.trim_start().starts_with('#'));
        assert!(
            !config_lines.any(|l| l.contains(absent)),
            "models/cnn/config.pbtxt must leave '{absent}' to auto-complete"
        );
    }
    let s = repo_server();
    let cfg = config_json(&s, "cnn");
    assert_eq!(cfg["name"], "cnn", "{cfg}");
    assert_eq!(cfg["max_batch_size"], 4, "{cfg}");
    let inputs = cfg["input"].as_array().unwrap_or_else(|| panic!("{cfg}"));
    assert_eq!(inputs.len(), 1, "{cfg}");
    assert_eq!(inputs[0]["name"], "PIXELS", "{cfg}");
    assert_eq!(inputs[0]["data_type"], "TYPE_FP32", "{cfg}");
    assert_eq!(inputs[0]["dims"], serde_json::json!([1, 28, 28]), "{cfg}");
    let outputs = cfg["output"].as_array().unwrap_or_else(|| panic!("{cfg}"));
    assert_eq!(outputs.len(), 1, "{cfg}");
    assert_eq!(outputs[0]["name"], "LOGITS", "{cfg}");
    assert_eq!(outputs[0]["data_type"], "TYPE_FP32", "{cfg}");
    assert_eq!(outputs[0]["dims"], serde_json::json!([10]), "{cfg}");
    // As Triton does, a max_batch_size set by auto-complete comes with dynamic batching.
    assert!(cfg["dynamic_batching"].is_object(), "{cfg}");

    // The completed config is enforced: 4 rows run, 5 do not, nor a wrong image size.
    let four = cases("cnn")
        .into_iter()
        .find(|c| c.inputs[0].shape[0] == 4)
        .expect("a cnn case of batch 4");
    let r = s.infer(request(&s, "cnn", &four.inputs));
    check_response("cnn batch 4", &r, &four.outputs);
    let px = vec![0u8; 5 * 28 * 28 * 4];
    let st = refusal(&s, "cnn", "PIXELS", &[5, 1, 28, 28], &px);
    assert_eq!(
        st, INFER_STATUS_INVALID_ARGUMENT,
        "a batch of 5 for cnn (max_batch_size 4)"
    );
    let st = refusal(&s, "cnn", "PIXELS", &[1, 1, 27, 28], &px[..27 * 28 * 4]);
    assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "a 27x28 image for cnn");
}

/// The status of a one-input FP32 request, wherever it is refused: when the input is
/// added, at enqueue, or in the response (OK if it ran).
fn refusal(s: &Server, model: &str, input: &str, shape: &[i64], bytes: &[u8]) -> infer_status {
    let r = s.request(model);
    let st = r.try_input(input, INFER_DATATYPE_FP32, shape, bytes);
    if st != INFER_STATUS_OK {
        return st;
    }
    let c = Collector::new();
    match s.enqueue(r, &c) {
        Err((st, _)) => st,
        Ok(_) => {
            c.wait(1);
            c.take().remove(0).status()
        }
    }
}

/// The explicit configs stay as written (auto-complete adds nothing that conflicts).
#[test]
fn explicit_configs_are_kept() {
    let s = repo_server();
    let mlp = config_json(&s, "mlp");
    assert_eq!(mlp["max_batch_size"], 64, "{mlp}");
    assert_eq!(mlp["input"][0]["name"], "FEATURES", "{mlp}");
    assert_eq!(mlp["input"][0]["dims"], serde_json::json!([64]), "{mlp}");
    assert_eq!(mlp["output"][0]["dims"], serde_json::json!([10]), "{mlp}");
    let acc = config_json(&s, "accumulator_onnx");
    // The state tensors are fed by the library: never listed as inputs or outputs.
    let names = |k: &str| -> Vec<String> {
        acc[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(names("input"), ["INPUT"], "{acc}");
    assert_eq!(names("output"), ["OUTPUT"], "{acc}");
}

// ---------------------------------------------------------------------------------------
// The implicit-state accumulator
// ---------------------------------------------------------------------------------------

/// One request of a fixture sequence.
struct Step {
    corrid: u64,
    flags: u32,
    input: Tensor,
    output: Tensor,
}

/// The fixture's sequences, each a list of steps.
fn sequences() -> Vec<Vec<Step>> {
    let f = fixture("accumulator_onnx");
    let seqs: Vec<Vec<Step>> = f["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| {
            let corrid = q["correlation_id"].as_u64().unwrap();
            q["steps"]
                .as_array()
                .unwrap()
                .iter()
                .map(|st| {
                    let mut flags = 0;
                    if st["start"].as_bool().unwrap() {
                        flags |= S;
                    }
                    if st["end"].as_bool().unwrap() {
                        flags |= E;
                    }
                    Step {
                        corrid,
                        flags,
                        input: tensors(&st["inputs"]).remove(0),
                        output: tensors(&st["outputs"]).remove(0),
                    }
                })
                .collect()
        })
        .collect();
    // Two sequences to interleave, then the first ID again, with a restarted sum.
    assert!(seqs.len() >= 3, "the fixture needs three sequences");
    assert_ne!(seqs[0][0].corrid, seqs[1][0].corrid);
    assert_eq!(seqs[0][0].corrid, seqs[2][0].corrid);
    for q in &seqs {
        assert!(q.len() >= 2);
        assert_eq!(q[0].flags & S, S);
        assert_eq!(q.last().unwrap().flags & E, E);
    }
    seqs
}

fn step_request(s: &Server, st: &Step) -> Req {
    request(s, "accumulator_onnx", std::slice::from_ref(&st.input))
        .correlation_id(st.corrid)
        .flags(st.flags)
}

/// The steps of `a` and `b` alternating (then the rest of the longer one).
fn interleave<'a>(a: &'a [Step], b: &'a [Step]) -> Vec<&'a Step> {
    let mut out = Vec::new();
    for k in 0..a.len().max(b.len()) {
        out.extend(a.get(k));
        out.extend(b.get(k));
    }
    out
}

fn check_step(what: &str, r: &Resp, st: &Step) {
    check_response(
        &format!("{what}: sequence {} flags {}", st.corrid, st.flags),
        r,
        std::slice::from_ref(&st.output),
    );
    assert_eq!(r.correlation_id(), st.corrid, "{what}");
}

/// Two sequences sent one request at a time, alternating, then the first correlation ID
/// started again: every answer is that sequence's running sum.
#[test]
fn accumulator_interleaved_sequences_one_request_at_a_time() {
    let s = repo_server();
    let seqs = sequences();
    for (k, st) in interleave(&seqs[0], &seqs[1]).into_iter().enumerate() {
        let r = s.infer(step_request(&s, st));
        check_step(&format!("request {k}"), &r, st);
    }
    for (k, st) in seqs[2].iter().enumerate() {
        let r = s.infer(step_request(&s, st));
        check_step(&format!("restarted sequence, request {k}"), &r, st);
    }
}

/// Both sequences queued at once while the model is paused: they run side by side as
/// rows of the same executions, each row with its own state.
#[test]
fn accumulator_sequences_batched_together_keep_their_own_state() {
    let s = repo_server();
    let seqs = sequences();
    let c = Collector::new();
    s.pause("accumulator_onnx");
    let mut expected: HashMap<u64, &Step> = HashMap::new();
    for st in interleave(&seqs[0], &seqs[1]) {
        let id = s
            .enqueue(step_request(&s, st), &c)
            .unwrap_or_else(|e| panic!("enqueue of sequence {}: {e:?}", st.corrid));
        expected.insert(id, st);
    }
    s.resume("accumulator_onnx");
    c.wait(expected.len());
    c.assert_exactly_once(&expected.keys().copied().collect::<Vec<_>>());
    for r in c.take() {
        check_step("batched", &r, expected[&r.id()]);
    }
    let sizes = batch_size_counts(&s, "accumulator_onnx");
    assert!(
        sizes.iter().any(|&(size, _)| size >= 2),
        "the two sequences never shared an execution: {sizes:?}"
    );

    // The first ID again, with START: the sum restarts from zero (the earlier sum would
    // otherwise carry over).
    let c = Collector::new();
    let mut expected: HashMap<u64, &Step> = HashMap::new();
    for st in &seqs[2] {
        expected.insert(s.enqueue(step_request(&s, st), &c).unwrap(), st);
    }
    c.wait(expected.len());
    for r in c.take() {
        check_step("restarted", &r, expected[&r.id()]);
    }
}

/// A sequence that runs without START on its first request is refused; the state of a
/// running one is untouched by that.
#[test]
fn accumulator_first_request_needs_start() {
    let s = repo_server();
    let seqs = sequences();
    let first = &seqs[0][1];
    assert_eq!(first.flags & S, 0);
    let c = Collector::new();
    match s.enqueue(step_request(&s, first), &c) {
        Err((st, msg)) => assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{msg}"),
        Ok(_) => {
            c.wait(1);
            let r = c.take().remove(0);
            assert_eq!(r.status(), INFER_STATUS_INVALID_ARGUMENT, "{}", r.error());
        }
    }
    for st in &seqs[0] {
        let r = s.infer(step_request(&s, st));
        check_step("after the refused request", &r, st);
    }
}

// ---------------------------------------------------------------------------------------
// Dynamic batching on mlp
// ---------------------------------------------------------------------------------------

/// The rows of mlp's largest fixture case, one request each: (input, expected output).
fn mlp_rows() -> Vec<(Tensor, Tensor)> {
    let c = cases("mlp")
        .into_iter()
        .max_by_key(|c| c.inputs[0].shape[0])
        .unwrap();
    let n = c.inputs[0].shape[0] as usize;
    assert!(n >= 32, "mlp's largest case has only {n} rows");
    (0..n)
        .map(|i| (c.inputs[0].row(i), c.outputs[0].row(i)))
        .collect()
}

fn logits(r: &Resp) -> Vec<f32> {
    assert_eq!(r.status(), INFER_STATUS_OK, "{}", r.error());
    let (dt, shape, bytes) = output(r, "LOGITS");
    assert_eq!(dt, INFER_DATATYPE_FP32);
    assert_eq!(shape, [1, 10]);
    bytemuck::pod_collect_to_vec(&bytes)
}

/// Requests sent together are batched by the dynamic batcher; each gets the same answer
/// as when it ran alone (and as onnxruntime's).
#[test]
fn mlp_dynamic_batching_matches_one_by_one() {
    let s = repo_server();
    let rows = mlp_rows();

    // One by one.
    let alone: Vec<Vec<f32>> = rows
        .iter()
        .enumerate()
        .map(|(i, (x, want))| {
            let r = s.infer(request(&s, "mlp", std::slice::from_ref(x)));
            check_response(
                &format!("mlp row {i} alone"),
                &r,
                std::slice::from_ref(want),
            );
            logits(&r)
        })
        .collect();
    let before = batch_size_counts(&s, "mlp");
    assert_eq!(
        before,
        vec![(1, rows.len() as u64)],
        "one-by-one requests ran batched"
    );

    // All queued while paused from four threads, then released at once.
    s.pause("mlp");
    let c = Collector::new();
    let ids: Vec<(u64, usize)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4)
            .map(|t| {
                let (s, c, rows) = (&s, &c, &rows);
                scope.spawn(move || {
                    (t..rows.len())
                        .step_by(4)
                        .map(|i| {
                            let req = request(s, "mlp", std::slice::from_ref(&rows[i].0));
                            (s.enqueue(req, c).unwrap(), i)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    s.resume("mlp");
    c.wait(ids.len());
    c.assert_exactly_once(&ids.iter().map(|p| p.0).collect::<Vec<_>>());
    let row_of: HashMap<u64, usize> = ids.into_iter().collect();
    for r in c.take() {
        let i = row_of[&r.id()];
        assert_close(&format!("mlp row {i} batched"), &logits(&r), &alone[i]);
        check_response(
            &format!("mlp row {i} batched"),
            &r,
            std::slice::from_ref(&rows[i].1),
        );
    }
    let after = batch_size_counts(&s, "mlp");
    let largest = after.iter().map(|b| b.0).max().unwrap();
    assert!(
        largest > 1,
        "the queued requests were not batched: {after:?}"
    );
    let executions: u64 = after.iter().map(|b| b.1).sum::<u64>() - rows.len() as u64;
    assert!(
        executions < rows.len() as u64,
        "{} requests took {executions} executions: {after:?}",
        rows.len()
    );

    // Eight threads sending blocking requests at the same time, several rounds.
    std::thread::scope(|scope| {
        for t in 0..8 {
            let (s, rows, alone) = (&s, &rows, &alone);
            scope.spawn(move || {
                for round in 0..3 {
                    for i in (t..rows.len()).step_by(8) {
                        let r = s.infer(request(s, "mlp", std::slice::from_ref(&rows[i].0)));
                        assert_close(
                            &format!("mlp row {i} concurrent (thread {t}, round {round})"),
                            &logits(&r),
                            &alone[i],
                        );
                    }
                }
            });
        }
    });
    let inferences = s.stats("mlp")["models"][0]["inference_count"]
        .as_u64()
        .unwrap();
    assert_eq!(inferences, 5 * rows.len() as u64);
}
