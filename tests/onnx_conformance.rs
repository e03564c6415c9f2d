//! ONNX's own node test cases, run through the C API on the ONNX backend.
//!
//! `scripts/onnx_conformance.py OUT` turns the node cases of the `onnx` Python package into
//! model folders (`OUT/<case>/config.pbtxt` with only name and platform, so the backend's
//! config auto-complete is exercised, `OUT/<case>/1/model.onnx`) and raw test data
//! (`OUT/<case>/data.json` + `.bin` files). This test reads `OUT` from the environment
//! variable `INFER_ONNX_CONFORMANCE_DIR` (without it the test passes with a skip notice)
//! and, on one server with explicit model control, for every case: loads the model, runs
//! the reference inputs twice on the same instance, compares every output of each run
//! with the reference and the second run's with the first's, unloads.
//!
//! Outcomes:
//! * passed: in both runs every output has the reference's datatype and shape and its
//!   values agree: integers, BOOL and BYTES exactly; floats element-wise with
//!   |got - want| <= atol + rtol * |want| (see [`tolerance`]), NaN equal to NaN,
//!   infinities equal only to themselves; and the second run's outputs are the first's,
//!   bit for bit (nothing a run leaves in the instance changes the next);
//! * skipped, unsupported: loading failed with UNSUPPORTED or INVALID_ARGUMENT (an operator,
//!   attribute or datatype the backend rejects; the reasons are listed, grouped);
//! * skipped, not representable: the prepare script found inputs or outputs that libinfer
//!   cannot carry (sequences, optionals, 8- and 4-bit types);
//! * failed: any other load error, a run-time error, a wrong output, a timeout or a panic.
//!   A failure listed in `tests/onnx_conformance_known.txt` (`case # reason`) is a known
//!   failure; a listed case that no longer fails fails the test, so the list stays true.
//!
//! Environment: `INFER_ONNX_CONFORMANCE_FILTER` (comma-separated substrings of case names
//! to run), `INFER_ONNX_CONFORMANCE_TIMEOUT_S` (per case, default 30). Every case's outcome
//! is also written to `OUT/report.tsv`.
//!
//! With `INFER_ONNX_CONFORMANCE_GPU=1` every case runs on a KIND_GPU instance (the GPU
//! executor of `src/onnx/gpu`) of a server whose GPU use is REQUIRED, the known failures
//! come from `tests/onnx_conformance_gpu_known.txt`, the report goes to
//! `OUT/report_gpu.tsv`, and the floor on passed cases is [`MIN_PASSED_GPU`]. A first run
//! refused with UNSUPPORTED also counts as unsupported there: the executor plans a model
//! whose shapes or operator parameters come from its inputs at the first request (its
//! value inputs), so that is where it refuses what it cannot run. scripts/test.sh runs
//! it against the stand-in CUDA libraries of tests/fixtures/ (kernels run on the host).
//!
//! Run: `cargo test --release --test onnx_conformance -- --nocapture`.

mod common;
use common::*;
use infer::ffi::request::*;
use infer::ffi::server::*;
use infer::ffi::*;
use std::collections::{BTreeMap, HashSet};
use std::ffi::{c_char, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

const DIR_ENV: &str = "INFER_ONNX_CONFORMANCE_DIR";
const FILTER_ENV: &str = "INFER_ONNX_CONFORMANCE_FILTER";
const TIMEOUT_ENV: &str = "INFER_ONNX_CONFORMANCE_TIMEOUT_S";
const KNOWN_CPU: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/onnx_conformance_known.txt"
);
const KNOWN_GPU: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/onnx_conformance_gpu_known.txt"
);
const KNOWN_ORT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/onnx_conformance_ort_known.txt"
);
const GPU_ENV: &str = "INFER_ONNX_CONFORMANCE_GPU";
const ENGINE_ENV: &str = "INFER_ONNX_CONFORMANCE_ENGINE";

/// Whether the cases run on the GPU executor.
fn on_gpu() -> bool {
    std::env::var_os(GPU_ENV).is_some_and(|v| v == "1")
}

/// Whether the cases run on ONNX Runtime (`INFER_ONNX_CONFORMANCE_ENGINE=onnxruntime`,
/// with the library from `INFER_ONNXRUNTIME_LIBRARY`; required, so a run that cannot
/// load it fails); otherwise the CPU cases run on tract (`backend: "tract"`).
fn on_ort() -> bool {
    !on_gpu() && std::env::var_os(ENGINE_ENV).is_some_and(|v| v == "onnxruntime")
}

/// Which engine the run is about, for the report and the summary line.
fn engine_tag() -> &'static str {
    if on_gpu() {
        " (GPU)"
    } else if on_ort() {
        " (ONNX Runtime)"
    } else {
        ""
    }
}
/// With every case of onnx [`MIN_PASSED_ONNX`] (the version scripts/test.sh pins) run, at
/// least this many must pass: a backend that starts refusing models it used to run
/// (counted as "unsupported") is caught here. Raise it when more cases pass.
const MIN_PASSED: usize = 969;
const MIN_PASSED_ONNX: &str = "1.19.1";
/// The same floor for the GPU executor (against the stand-in libraries).
const MIN_PASSED_GPU: usize = 1130;
/// The same floor for ONNX Runtime (CPU provider).
const MIN_PASSED_ORT: usize = 1382;
/// How a first run refused with UNSUPPORTED reads (see [`Outcome::Unsupported`]).
const RUN_UNSUPPORTED: &str = "run failed: UNSUPPORTED: ";
/// After this many timed-out cases the server is not trusted any more: the rest is not run.
const MAX_TIMEOUTS: usize = 3;

/// (rtol, atol) for a float datatype. FP32 and FP64 follow ONNX's own runner (rtol 1e-3)
/// with an atol of 1e-5 for values near zero (the references come from NumPy, often in
/// float64, and a backend may reorder sums); FP16 and BF16 get a few units of their last
/// place (FP16: 2^-10 ~ 1e-3, BF16: 2^-7 ~ 8e-3).
fn tolerance(datatype: &str) -> Option<(f64, f64)> {
    match datatype {
        "FP32" | "FP64" => Some((1e-3, 1e-5)),
        "FP16" => Some((1e-2, 1e-3)),
        "BF16" => Some((2e-2, 1e-2)),
        _ => None,
    }
}

#[derive(Clone, Debug)]
struct Tensor {
    name: String,
    datatype: String,
    shape: Vec<i64>,
    file: String,
}

fn tensors(v: &serde_json::Value, key: &str) -> Result<Vec<Tensor>, String> {
    let list = v[key]
        .as_array()
        .ok_or_else(|| format!("data.json has no '{key}' list"))?;
    list.iter()
        .map(|t| {
            let s = |k: &str| {
                t[k].as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| format!("data.json: {key} entry without '{k}'"))
            };
            let shape = t["shape"]
                .as_array()
                .ok_or_else(|| format!("data.json: {key} entry without 'shape'"))?
                .iter()
                .map(|d| d.as_i64().ok_or("data.json: shape is not integers"))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Tensor {
                name: s("name")?,
                datatype: s("datatype")?,
                shape,
                file: s("file")?,
            })
        })
        .collect()
}

/// Tensors with their bytes.
type TensorData = Vec<(Tensor, Vec<u8>)>;

enum Outcome {
    Passed,
    /// Load refused with UNSUPPORTED or INVALID_ARGUMENT: (status, message).
    Unsupported(String),
    Failed(String),
}

fn status_name(st: infer_status) -> String {
    unsafe { CStr::from_ptr(infer_status_string(st)) }
        .to_string_lossy()
        .into_owned()
}

/// What the worker thread is doing, for timeout messages.
type Stage = Arc<Mutex<&'static str>>;

fn set_stage(stage: &Stage, s: &'static str) {
    *stage.lock().unwrap() = s;
}

/// Loads, runs, compares and unloads one case.
fn run_case(server: &Server, name: &str, dir: &Path, stage: &Stage) -> Outcome {
    set_stage(stage, "reading the test data");
    let read = || -> Result<(String, TensorData, TensorData), String> {
        let mut config = std::fs::read_to_string(dir.join("config.pbtxt"))
            .map_err(|e| format!("config.pbtxt: {e}"))?;
        if on_gpu() {
            config.push_str("\ninstance_group [ { kind: KIND_GPU count: 1 gpus: [ 0 ] } ]\n");
        } else if !on_ort() {
            config = config.replace("platform: \"onnxruntime_onnx\"", "backend: \"tract\"");
        }
        let text = std::fs::read_to_string(dir.join("data.json"))
            .map_err(|e| format!("data.json: {e}"))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("data.json: {e}"))?;
        let with_bytes = |key: &str| -> Result<TensorData, String> {
            tensors(&v, key)?
                .into_iter()
                .map(|t| {
                    let b =
                        std::fs::read(dir.join(&t.file)).map_err(|e| format!("{}: {e}", t.file))?;
                    Ok((t, b))
                })
                .collect()
        };
        Ok((config, with_bytes("inputs")?, with_bytes("outputs")?))
    };
    let (config, inputs, outputs) = match read() {
        Ok(x) => x,
        Err(e) => return Outcome::Failed(format!("bad prepared data: {e}")),
    };

    set_stage(stage, "loading");
    let st = server.try_load_dir(name, &config, dir);
    if st != INFER_STATUS_OK {
        let msg = format!("{}: {}", status_name(st), last_error());
        return if st == INFER_STATUS_UNSUPPORTED || st == INFER_STATUS_INVALID_ARGUMENT {
            Outcome::Unsupported(msg)
        } else {
            Outcome::Failed(format!("load failed: {msg}"))
        };
    }
    let result = infer_and_compare(server, name, &inputs, &outputs, stage);
    set_stage(stage, "unloading");
    let st = unsafe { infer_server_unload_model(server.0, cs(name).as_ptr()) };
    let unload = if st == INFER_STATUS_OK {
        Ok(())
    } else {
        Err(format!(
            "unload failed: {}: {}",
            status_name(st),
            last_error()
        ))
    };
    match result.and(unload) {
        Ok(()) => Outcome::Passed,
        // The GPU executor plans a model whose shapes or parameters come from its inputs
        // at the first request: what it cannot run is refused there.
        Err(e) if on_gpu() && e.starts_with(RUN_UNSUPPORTED) => Outcome::Unsupported(e),
        Err(e) => Outcome::Failed(e),
    }
}

/// Runs the case twice on the same instance: each run must agree with the reference, and
/// the second must give the first one's outputs bit for bit (a run leaves nothing behind
/// that changes the next).
fn infer_and_compare(
    server: &Server,
    name: &str,
    inputs: &[(Tensor, Vec<u8>)],
    outputs: &[(Tensor, Vec<u8>)],
    stage: &Stage,
) -> Result<(), String> {
    let first = infer_checked(server, name, inputs, outputs, stage)?;
    let second = infer_checked(server, name, inputs, outputs, stage)
        .map_err(|e| format!("second run on the same instance: {e}"))?;
    for (want, _) in outputs {
        // Both runs read back without error in infer_checked.
        let (a, b) = (
            raw_output(&first, &want.name)?,
            raw_output(&second, &want.name)?,
        );
        if a != b {
            return Err(format!(
                "output '{}': the second run on the same instance differs from the first",
                want.name
            ));
        }
    }
    Ok(())
}

/// One run of the case, compared with the reference.
fn infer_checked(
    server: &Server,
    name: &str,
    inputs: &[(Tensor, Vec<u8>)],
    outputs: &[(Tensor, Vec<u8>)],
    stage: &Stage,
) -> Result<Resp, String> {
    set_stage(stage, "building the request");
    let mut r = std::ptr::null_mut();
    let st = unsafe { infer_request_new(server.0, cs(name).as_ptr(), -1, &mut r) };
    if st != INFER_STATUS_OK {
        return Err(format!("request: {}: {}", status_name(st), last_error()));
    }
    let req = Req(r);
    for (t, bytes) in inputs {
        let dt = unsafe { infer_datatype_from_string(cs(&t.datatype).as_ptr()) };
        // A scalar is served as dims [1] reshaped to [] (the config auto-complete makes,
        // as Triton's does).
        let served: &[i64] = if t.shape.is_empty() { &[1] } else { &t.shape };
        let st = req.try_input(&t.name, dt, served, bytes);
        if st != INFER_STATUS_OK {
            return Err(format!(
                "input '{}' ({} {:?}): {}: {}",
                t.name,
                t.datatype,
                t.shape,
                status_name(st),
                last_error()
            ));
        }
    }
    set_stage(stage, "running");
    let mut out = std::ptr::null_mut();
    let st = unsafe { infer_server_infer(server.0, req.take(), &mut out) };
    if st != INFER_STATUS_OK {
        return Err(format!("infer: {}: {}", status_name(st), last_error()));
    }
    let resp = Resp(out);
    if resp.status() != INFER_STATUS_OK {
        if resp.status() == INFER_STATUS_UNSUPPORTED {
            return Err(format!("{RUN_UNSUPPORTED}{}", resp.error()));
        }
        return Err(format!(
            "run failed: {}: {}",
            status_name(resp.status()),
            resp.error()
        ));
    }
    set_stage(stage, "comparing");
    let mut errors = Vec::new();
    for (want, want_bytes) in outputs {
        if let Err(e) = compare_output(&resp, want, want_bytes) {
            errors.push(format!("output '{}': {e}", want.name));
        }
    }
    if errors.is_empty() {
        Ok(resp)
    } else {
        Err(errors.join("\n"))
    }
}

/// An output's datatype name, shape and bytes.
fn raw_output(resp: &Resp, name: &str) -> Result<(String, Vec<i64>, Vec<u8>), String> {
    let (mut dt, mut shape, mut nd, mut data, mut bs) =
        (0, std::ptr::null(), 0usize, std::ptr::null(), 0usize);
    let st = unsafe {
        infer::ffi::response::infer_response_output_by_name(
            resp.0,
            cs(name).as_ptr(),
            &mut dt,
            &mut shape,
            &mut nd,
            &mut data,
            &mut bs,
        )
    };
    if st != INFER_STATUS_OK {
        return Err(format!("missing: {}: {}", status_name(st), last_error()));
    }
    let dt = unsafe { CStr::from_ptr(infer_datatype_string(dt)) }
        .to_string_lossy()
        .into_owned();
    let shape = if nd == 0 {
        Vec::new()
    } else {
        unsafe { std::slice::from_raw_parts(shape, nd) }.to_vec()
    };
    let bytes = if bs == 0 {
        Vec::new()
    } else {
        unsafe { std::slice::from_raw_parts(data as *const u8, bs) }.to_vec()
    };
    Ok((dt, shape, bytes))
}

fn compare_output(resp: &Resp, want: &Tensor, want_bytes: &[u8]) -> Result<(), String> {
    let (got_dt, got_shape, got) = raw_output(resp, &want.name)?;
    if got_dt != want.datatype {
        return Err(format!("datatype {got_dt}, expected {}", want.datatype));
    }
    let scalar_as_one = want.shape.is_empty() && got_shape == [1];
    if got_shape != want.shape && !scalar_as_one {
        return Err(format!("shape {got_shape:?}, expected {:?}", want.shape));
    }
    compare_values(&want.datatype, &want.shape, &got, want_bytes)
}

/// Decodes a float tensor to f64.
fn floats(datatype: &str, b: &[u8]) -> Vec<f64> {
    match datatype {
        "FP64" => b
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        "FP32" => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        "FP16" => b
            .chunks_exact(2)
            .map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])) as f64)
            .collect(),
        "BF16" => b
            .chunks_exact(2)
            .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16) as f64)
            .collect(),
        _ => unreachable!(),
    }
}

fn f16_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((h >> 10) & 0x1f) as i32;
    let man = (h & 0x3ff) as f32;
    match exp {
        0 => sign * man * 2f32.powi(-24),
        31 if man == 0.0 => sign * f32::INFINITY,
        31 => f32::NAN,
        _ => sign * (1.0 + man / 1024.0) * 2f32.powi(exp - 15),
    }
}

fn close(got: f64, want: f64, rtol: f64, atol: f64) -> bool {
    if got.is_nan() || want.is_nan() {
        return got.is_nan() && want.is_nan();
    }
    if got.is_infinite() || want.is_infinite() {
        return got == want;
    }
    (got - want).abs() <= atol + rtol * want.abs()
}

/// "[i,j,k]" of a flat index.
fn position(shape: &[i64], mut flat: usize) -> String {
    let mut idx = vec![0usize; shape.len()];
    for (i, d) in shape.iter().enumerate().rev() {
        let d = (*d).max(1) as usize;
        idx[i] = flat % d;
        flat /= d;
    }
    format!("{idx:?}")
}

/// Integers of any width (and BOOL) as i128 for exact comparison and printing.
fn integers(datatype: &str, b: &[u8]) -> Vec<i128> {
    fn le<const N: usize>(b: &[u8], f: fn([u8; N]) -> i128) -> Vec<i128> {
        b.chunks_exact(N)
            .map(|c| f(c.try_into().unwrap()))
            .collect()
    }
    match datatype {
        "BOOL" | "UINT8" => b.iter().map(|x| *x as i128).collect(),
        "INT8" => b.iter().map(|x| *x as i8 as i128).collect(),
        "UINT16" => le::<2>(b, |c| u16::from_le_bytes(c) as i128),
        "INT16" => le::<2>(b, |c| i16::from_le_bytes(c) as i128),
        "UINT32" => le::<4>(b, |c| u32::from_le_bytes(c) as i128),
        "INT32" => le::<4>(b, |c| i32::from_le_bytes(c) as i128),
        "UINT64" => le::<8>(b, |c| u64::from_le_bytes(c) as i128),
        "INT64" => le::<8>(b, |c| i64::from_le_bytes(c) as i128),
        _ => unreachable!(),
    }
}

/// BYTES elements (Triton layout: u32 length + bytes each).
fn byte_strings(b: &[u8]) -> Option<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    let mut rest = b;
    while !rest.is_empty() {
        let len = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
        out.push(rest.get(4..4 + len)?.to_vec());
        rest = &rest[4 + len..];
    }
    Some(out)
}

fn compare_values(datatype: &str, shape: &[i64], got: &[u8], want: &[u8]) -> Result<(), String> {
    if datatype == "BYTES" {
        let (Some(g), Some(w)) = (byte_strings(got), byte_strings(want)) else {
            return Err("malformed BYTES data".into());
        };
        if g.len() != w.len() {
            return Err(format!("{} elements, expected {}", g.len(), w.len()));
        }
        return match (0..w.len()).find(|&i| g[i] != w[i]) {
            None => Ok(()),
            Some(i) => Err(format!(
                "element {}: {:?}, expected {:?}",
                position(shape, i),
                String::from_utf8_lossy(&g[i]),
                String::from_utf8_lossy(&w[i])
            )),
        };
    }
    if got.len() != want.len() {
        return Err(format!("{} bytes, expected {}", got.len(), want.len()));
    }
    if let Some((rtol, atol)) = tolerance(datatype) {
        let (g, w) = (floats(datatype, got), floats(datatype, want));
        let bad: Vec<usize> = (0..w.len())
            .filter(|&i| !close(g[i], w[i], rtol, atol))
            .collect();
        if let Some(&i) = bad.first() {
            let worst = bad
                .iter()
                .map(|&i| (g[i] - w[i]).abs())
                .fold(0.0f64, |a, b| if b.is_nan() || b > a { b } else { a });
            return Err(format!(
                "{} of {} values differ beyond rtol {rtol:e} atol {atol:e}; first at {}: \
                 got {}, expected {}; largest difference {worst:e}",
                bad.len(),
                w.len(),
                position(shape, i),
                g[i],
                w[i]
            ));
        }
        return Ok(());
    }
    let (g, w) = (integers(datatype, got), integers(datatype, want));
    let bad: Vec<usize> = (0..w.len()).filter(|&i| g[i] != w[i]).collect();
    match bad.first() {
        None => Ok(()),
        Some(&i) => Err(format!(
            "{} of {} values differ; first at {}: got {}, expected {}",
            bad.len(),
            w.len(),
            position(shape, i),
            g[i],
            w[i]
        )),
    }
}

/// `case # reason` lines of the known-failures list.
fn known_failures() -> BTreeMap<String, String> {
    #[allow(non_snake_case)]
    let KNOWN = if on_gpu() {
        KNOWN_GPU
    } else if on_ort() {
        KNOWN_ORT
    } else {
        KNOWN_CPU
    };
    let text = std::fs::read_to_string(KNOWN).unwrap_or_else(|e| panic!("{KNOWN}: {e}"));
    let mut known = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (case, reason) = line.split_once('#').unwrap_or((line, ""));
        let (case, reason) = (case.trim(), reason.trim());
        assert!(
            !reason.is_empty() && !case.contains(char::is_whitespace),
            "{KNOWN}:{}: expected `case # reason`, got {line:?}",
            n + 1
        );
        assert!(
            known.insert(case.to_owned(), reason.to_owned()).is_none(),
            "{KNOWN}:{}: {case} is listed twice",
            n + 1
        );
    }
    known
}

/// WARN and ERROR log lines of the server, attached to the case that produced them.
static LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());

unsafe extern "C" fn log_line(_: *mut c_void, level: u32, msg: *const c_char) {
    let msg = CStr::from_ptr(msg).to_string_lossy().into_owned();
    let tag = if level == 1 { "ERROR" } else { "WARN" };
    LOG.lock().unwrap().push(format!("[{tag}] {msg}"));
}

/// The first `n` lines of `s`, each cut at 300 characters.
fn head(s: &str, n: usize) -> String {
    let mut lines: Vec<String> = s
        .lines()
        .take(n)
        .map(|l| {
            if l.chars().count() > 300 {
                format!("{}...", l.chars().take(300).collect::<String>())
            } else {
                l.to_owned()
            }
        })
        .collect();
    if s.lines().count() > n {
        lines.push("...".into());
    }
    lines.join("\n      ")
}

/// An unsupported-load message with the case's name taken out, to group equal reasons.
fn reason_key(case: &str, msg: &str) -> String {
    msg.replace(case, "<case>")
}

#[test]
fn onnx_node_test_cases() {
    let Some(root) = std::env::var_os(DIR_ENV).map(PathBuf::from) else {
        eprintln!(
            "onnx conformance: SKIPPED, {DIR_ENV} is not set (prepare a folder with \
             scripts/onnx_conformance.py OUT and set {DIR_ENV}=OUT; scripts/test.sh does both)"
        );
        return;
    };
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("index.json"))
            .unwrap_or_else(|e| panic!("{}/index.json: {e}", root.display())),
    )
    .expect("index.json");
    let filters: Vec<String> = std::env::var(FILTER_ENV)
        .map(|f| f.split(',').map(str::to_owned).collect())
        .unwrap_or_default();
    let timeout = Duration::from_secs(
        std::env::var(TIMEOUT_ENV)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(30),
    );
    let known = known_failures();

    let mut not_representable = Vec::new();
    let mut cases = Vec::new();
    for c in index["cases"].as_array().expect("index.json: cases") {
        let name = c["name"].as_str().expect("case name").to_owned();
        if !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        match c["skipped"].as_str() {
            Some(reason) => not_representable.push((name, reason.to_owned())),
            None => cases.push(name),
        }
    }

    let mut opts = std::ptr::null_mut();
    ok(unsafe { infer_server_options_new(&mut opts) });
    ok(unsafe { infer_server_options_set_model_control_explicit(opts, true) });
    if on_gpu() {
        ok(unsafe { infer_server_options_set_gpu(opts, INFER_GPU_REQUIRED) });
    }
    if on_ort() {
        ok(unsafe { infer_server_options_set_onnxruntime_required(opts, true) });
        // As in a direct call: one session thread each.
        ok(unsafe { infer_server_options_set_onnxruntime_threads(opts, 1, 1) });
    }
    ok(unsafe {
        infer_server_options_set_log_callback(opts, 2, Some(log_line), std::ptr::null_mut())
    });
    let server = Arc::new(Server::with_options(opts));
    unsafe { infer_server_options_free(opts) };

    println!(
        "onnx conformance: onnx {}, {} cases to run, {} not representable, timeout {}s per case",
        index["onnx_version"].as_str().unwrap_or("?"),
        cases.len(),
        not_representable.len(),
        timeout.as_secs()
    );
    let started = Instant::now();
    let mut results: Vec<(String, Outcome, Duration)> = Vec::new();
    let mut timeouts = 0;
    for (i, name) in cases.iter().enumerate() {
        if timeouts >= MAX_TIMEOUTS {
            results.push((
                name.clone(),
                Outcome::Failed(format!("not run: {timeouts} earlier cases timed out")),
                Duration::ZERO,
            ));
            continue;
        }
        LOG.lock().unwrap().clear();
        let t0 = Instant::now();
        let stage: Stage = Arc::new(Mutex::new("starting"));
        let (tx, rx) = mpsc::channel();
        let (s, n, st, dir) = (server.clone(), name.clone(), stage.clone(), root.join(name));
        std::thread::Builder::new()
            .name(format!("case {name}"))
            .spawn(move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    run_case(&s, &n, &dir, &st)
                }));
                let _ = tx.send(r.unwrap_or_else(|p| {
                    let msg = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    Outcome::Failed(format!("panicked: {msg}"))
                }));
            })
            .expect("spawn");
        let mut outcome = match rx.recv_timeout(timeout) {
            Ok(o) => o,
            Err(_) => {
                timeouts += 1;
                Outcome::Failed(format!(
                    "timed out after {}s while {}",
                    timeout.as_secs(),
                    stage.lock().unwrap()
                ))
            }
        };
        if let Outcome::Failed(msg) = &mut outcome {
            let log = LOG.lock().unwrap();
            if !log.is_empty() {
                msg.push_str(&format!("\nserver log: {}", log.join("\n")));
            }
        }
        results.push((name.clone(), outcome, t0.elapsed()));
        if (i + 1) % 200 == 0 {
            println!(
                "  {} of {} cases done ({:.0}s)",
                i + 1,
                cases.len(),
                started.elapsed().as_secs_f64()
            );
        }
    }
    let elapsed = started.elapsed();

    // Tally.
    let mut passed = 0;
    let mut unexpected = Vec::new(); // (case, message)
    let mut known_failing = Vec::new(); // (case, reason, message)
    let mut stale = Vec::new(); // (case, what it did instead)
    let mut unsupported: BTreeMap<String, Vec<String>> = BTreeMap::new(); // reason -> cases
    let mut report = String::from("case\toutcome\tmessage\n");
    for (name, outcome, took) in &results {
        let listed = known.get(name);
        let (kind, msg) = match outcome {
            Outcome::Passed => {
                passed += 1;
                if listed.is_some() {
                    stale.push((name.clone(), "passes".to_owned()));
                }
                ("passed", String::new())
            }
            Outcome::Unsupported(m) => {
                unsupported
                    .entry(reason_key(name, m))
                    .or_default()
                    .push(name.clone());
                if listed.is_some() {
                    stale.push((name.clone(), format!("is skipped as unsupported: {m}")));
                }
                ("unsupported", m.clone())
            }
            Outcome::Failed(m) => {
                match listed {
                    Some(reason) => known_failing.push((name.clone(), reason.clone(), m.clone())),
                    None => unexpected.push((name.clone(), m.clone())),
                }
                (
                    if listed.is_some() {
                        "known-failure"
                    } else {
                        "failed"
                    },
                    m.clone(),
                )
            }
        };
        report += &format!(
            "{name}\t{kind}\t{}\t{:.3}s\n",
            msg.replace(['\n', '\t'], " | "),
            took.as_secs_f64()
        );
    }
    for (name, reason) in &not_representable {
        report += &format!("{name}\tnot-representable\t{reason}\t0s\n");
    }
    let report_file = if on_gpu() {
        "report_gpu.tsv"
    } else if on_ort() {
        "report_ort.tsv"
    } else {
        "report.tsv"
    };
    if let Err(e) = std::fs::write(root.join(report_file), &report) {
        println!("(could not write {}/{report_file}: {e})", root.display());
    }
    let ran: HashSet<&str> = results.iter().map(|(n, ..)| n.as_str()).collect();
    let absent: Vec<&String> = known.keys().filter(|k| !ran.contains(k.as_str())).collect();

    // Report.
    let n_unsupported: usize = unsupported.values().map(Vec::len).sum();
    let mut groups: Vec<(&String, &Vec<String>)> = unsupported.iter().collect();
    groups.sort_by_key(|(_, v)| std::cmp::Reverse(v.len()));
    println!("\nskipped, unsupported by the backend ({n_unsupported}), by reason:");
    for (reason, names) in &groups {
        let more = if names.len() > 3 {
            format!(", ... ({} more)", names.len() - 3)
        } else {
            String::new()
        };
        println!(
            "  {:4} {}\n       e.g. {}{more}",
            names.len(),
            head(reason, 2),
            names.iter().take(3).cloned().collect::<Vec<_>>().join(", ")
        );
    }
    if !not_representable.is_empty() {
        println!(
            "\nskipped, not representable in libinfer ({}): see index.json",
            not_representable.len()
        );
    }
    if !known_failing.is_empty() {
        println!("\nknown failures ({}):", known_failing.len());
        for (name, reason, msg) in &known_failing {
            println!("  {name}  # {reason}\n      {}", head(msg, 2));
        }
    }
    let mut slowest: Vec<&(String, Outcome, Duration)> = results.iter().collect();
    slowest.sort_by_key(|r| std::cmp::Reverse(r.2));
    println!(
        "\nslowest cases: {}",
        slowest
            .iter()
            .take(5)
            .map(|(n, _, d)| format!("{n} {:.2}s", d.as_secs_f64()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if !unexpected.is_empty() {
        println!("\nFAILED ({}):", unexpected.len());
        for (name, msg) in &unexpected {
            println!("  {name}\n      {}", head(msg, 4));
        }
    }
    if !stale.is_empty() {
        println!(
            "\nlisted in tests/onnx_conformance_known.txt but no longer failing (remove them):"
        );
        for (name, what) in &stale {
            println!("  {name}: {}", head(what, 1));
        }
    }
    if !absent.is_empty() && filters.is_empty() {
        println!(
            "\nnote: listed in tests/onnx_conformance_known.txt but not among the cases run: {}",
            absent
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    println!(
        "\nonnx conformance{}: passed {passed}, failed {}, known failures {}, \
         skipped (unsupported) {n_unsupported}, skipped (not representable) {} in {:.0}s; \
         details in {}/{report_file}",
        engine_tag(),
        unexpected.len(),
        known_failing.len(),
        not_representable.len(),
        elapsed.as_secs_f64(),
        root.display()
    );

    if timeouts > 0 {
        // A timed-out execution may never finish: freeing the server would wait for it.
        std::mem::forget(server);
    }
    let floor = filters.is_empty() && index["onnx_version"].as_str() == Some(MIN_PASSED_ONNX);
    let min_passed = if on_gpu() {
        MIN_PASSED_GPU
    } else if on_ort() {
        MIN_PASSED_ORT
    } else {
        MIN_PASSED
    };
    if floor && passed < min_passed {
        println!(
            "\nonly {passed} cases passed, expected at least {min_passed}: compare {}/{report_file} \
             with an earlier run to see which now fail to load",
            root.display()
        );
    }
    assert!(
        unexpected.is_empty() && stale.is_empty() && (!floor || passed >= min_passed),
        "{} unexpected failures, {} stale entries in the known failures, \
         {passed} passed (at least {min_passed} expected; see above)",
        unexpected.len(),
        stale.len()
    );
}
