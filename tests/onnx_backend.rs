//! The ONNX backend (`platform: "onnxruntime_onnx"` / `backend: "onnxruntime"`, run by
//! tract) through the C API, on small models built here with the ONNX protobuf types:
//! load errors (missing file, garbage, unknown operators), config-versus-model
//! mismatches, config auto-complete (batching, fixed shapes, partial configs, no config
//! file at all), version policies, reloading, explicit model control with start-up
//! models, BOOL / INT64 tensors, requested outputs, variable dims, and concurrent
//! dynamically batched requests.

mod common;
use common::*;
use infer::ffi::request::*;
use infer::ffi::response::*;
use infer::ffi::server::*;
use infer::ffi::*;
use prost::Message;
use serde_json::Value;
use std::ffi::CStr;
use std::path::{Path, PathBuf};
use tract_onnx::pb;
use tract_onnx::pb::tensor_proto::DataType as T;
use tract_onnx::pb::tensor_shape_proto::dimension::Value as DimValue;

// ---------------------------------------------------------------------------------------
// Building ONNX models
// ---------------------------------------------------------------------------------------

/// A tensor value-info: `dims` entries that parse as integers are fixed sizes, any other
/// text is a `dim_param` (a named symbolic size).
fn tensor(name: &str, elem: T, dims: &[&str]) -> pb::ValueInfoProto {
    let dim = dims
        .iter()
        .map(|d| pb::tensor_shape_proto::Dimension {
            value: Some(match d.parse::<i64>() {
                Ok(v) => DimValue::DimValue(v),
                Err(_) => DimValue::DimParam((*d).to_owned()),
            }),
            ..Default::default()
        })
        .collect();
    typed_value(name, elem, Some(pb::TensorShapeProto { dim }))
}

/// A tensor value-info that says its datatype but not its shape.
fn tensor_no_shape(name: &str, elem: T) -> pb::ValueInfoProto {
    typed_value(name, elem, None)
}

fn typed_value(name: &str, elem: T, shape: Option<pb::TensorShapeProto>) -> pb::ValueInfoProto {
    pb::ValueInfoProto {
        name: name.to_owned(),
        r#type: Some(pb::TypeProto {
            value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                elem_type: elem as i32,
                shape,
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn node(op: &str, name: &str, inputs: &[&str], outputs: &[&str]) -> pb::NodeProto {
    pb::NodeProto {
        op_type: op.to_owned(),
        name: name.to_owned(),
        input: inputs.iter().map(|s| (*s).to_owned()).collect(),
        output: outputs.iter().map(|s| (*s).to_owned()).collect(),
        ..Default::default()
    }
}

/// A node with one integer attribute (e.g. Cast's `to`).
fn node_int_attr(
    op: &str,
    name: &str,
    inputs: &[&str],
    outputs: &[&str],
    key: &str,
    value: i64,
) -> pb::NodeProto {
    let mut n = node(op, name, inputs, outputs);
    n.attribute.push(pb::AttributeProto {
        name: key.to_owned(),
        r#type: pb::attribute_proto::AttributeType::Int as i32,
        i: value,
        ..Default::default()
    });
    n
}

fn init_f32(name: &str, dims: &[i64], data: &[f32]) -> pb::TensorProto {
    assert_eq!(dims.iter().product::<i64>() as usize, data.len(), "{name}");
    pb::TensorProto {
        name: name.to_owned(),
        dims: dims.to_vec(),
        data_type: T::Float as i32,
        float_data: data.to_vec(),
        ..Default::default()
    }
}

fn init_i64(name: &str, dims: &[i64], data: &[i64]) -> pb::TensorProto {
    assert_eq!(dims.iter().product::<i64>() as usize, data.len(), "{name}");
    pb::TensorProto {
        name: name.to_owned(),
        dims: dims.to_vec(),
        data_type: T::Int64 as i32,
        int64_data: data.to_vec(),
        ..Default::default()
    }
}

/// A model of opset 17, IR version 8.
fn model(
    inputs: Vec<pb::ValueInfoProto>,
    outputs: Vec<pb::ValueInfoProto>,
    nodes: Vec<pb::NodeProto>,
    initializers: Vec<pb::TensorProto>,
) -> pb::ModelProto {
    pb::ModelProto {
        ir_version: 8,
        opset_import: vec![pb::OperatorSetIdProto {
            domain: String::new(),
            version: 17,
        }],
        producer_name: "libinfer tests/onnx_backend.rs".to_owned(),
        graph: Some(pb::GraphProto {
            name: "g".to_owned(),
            node: nodes,
            initializer: initializers,
            input: inputs,
            output: outputs,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// `Y = X + k` (FP32), X and Y of the given dims.
fn add_const(k: f32, dims: &[&str]) -> pb::ModelProto {
    model(
        vec![tensor("X", T::Float, dims)],
        vec![tensor("Y", T::Float, dims)],
        vec![node("Add", "add", &["X", "K"], &["Y"])],
        vec![init_f32("K", &[], &[k])],
    )
}

/// `Y = X * k` (FP32), X and Y of the given dims.
fn mul_const(k: f32, dims: &[&str]) -> pb::ModelProto {
    model(
        vec![tensor("X", T::Float, dims)],
        vec![tensor("Y", T::Float, dims)],
        vec![node("Mul", "mul", &["X", "K"], &["Y"])],
        vec![init_f32("K", &[], &[k])],
    )
}

/// Writes `<dir>/<version>/<file>`.
fn write_file(dir: &Path, version: i64, file: &str, bytes: &[u8]) {
    let d = dir.join(version.to_string());
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join(file), bytes).unwrap();
}

/// Writes `<dir>/<version>/model.onnx`.
fn write_model(dir: &Path, version: i64, m: &pb::ModelProto) {
    write_file(dir, version, "model.onnx", &m.encode_to_vec());
}

/// A model folder holding `m` as version 1.
fn model_dir(tag: &str, m: &pb::ModelProto) -> PathBuf {
    let d = temp_dir(tag);
    write_model(&d, 1, m);
    d
}

// ---------------------------------------------------------------------------------------
// Servers, requests, responses
// ---------------------------------------------------------------------------------------

const PLATFORM: &str = "platform: \"onnxruntime_onnx\"";

/// The status and message of loading `name` with config text from `dir`.
fn load_dir(s: &Server, name: &str, config: &str, dir: &Path) -> (infer_status, String) {
    let st = s.try_load_dir(name, config, dir);
    let msg = if st == INFER_STATUS_OK {
        String::new()
    } else {
        last_error()
    };
    (st, msg)
}

/// Loads and asserts success.
#[track_caller]
fn load_ok(s: &Server, name: &str, config: &str, dir: &Path) {
    let (st, msg) = load_dir(s, name, config, dir);
    assert_eq!(
        st,
        INFER_STATUS_OK,
        "loading '{name}' from {}: {msg}\nconfig: {config}",
        dir.display()
    );
}

/// Loading must fail with `want`; returns the message.
#[track_caller]
fn load_fails(s: &Server, name: &str, config: &str, dir: &Path, want: infer_status) -> String {
    let (st, msg) = load_dir(s, name, config, dir);
    assert_eq!(
        st, want,
        "loading '{name}' should fail with status {want}, got {st} ({msg})\nconfig: {config}"
    );
    assert!(!msg.is_empty(), "a failed load must say why");
    // A failed load leaves nothing loaded under the name.
    assert!(!ready(s, name, -1), "'{name}' is ready after a failed load");
    msg
}

#[track_caller]
fn assert_mentions(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "message should mention {p:?}: {msg}");
    }
}

fn ready(s: &Server, name: &str, version: i64) -> bool {
    let mut r = false;
    ok(unsafe { infer_server_model_ready(s.0, cs(name).as_ptr(), version, &mut r) });
    r
}

fn config_json(s: &Server, name: &str) -> Value {
    let mut out = std::ptr::null_mut();
    ok(unsafe { infer_server_model_config_json(s.0, cs(name).as_ptr(), -1, &mut out) });
    let text = unsafe { CStr::from_ptr(out) }.to_str().unwrap().to_owned();
    unsafe { infer_string_free(out) };
    serde_json::from_str(&text).unwrap()
}

/// One request input.
struct In {
    name: &'static str,
    dt: infer_datatype,
    shape: Vec<i64>,
    bytes: Vec<u8>,
}

fn f32_in(name: &'static str, shape: &[i64], data: &[f32]) -> In {
    In {
        name,
        dt: INFER_DATATYPE_FP32,
        shape: shape.to_vec(),
        bytes: bytemuck::cast_slice(data).to_vec(),
    }
}

fn i64_in(name: &'static str, shape: &[i64], data: &[i64]) -> In {
    In {
        name,
        dt: INFER_DATATYPE_INT64,
        shape: shape.to_vec(),
        bytes: bytemuck::cast_slice(data).to_vec(),
    }
}

fn bool_in(name: &'static str, shape: &[i64], data: &[u8]) -> In {
    In {
        name,
        dt: INFER_DATATYPE_BOOL,
        shape: shape.to_vec(),
        bytes: data.to_vec(),
    }
}

/// A request to `version` of `model` with `inputs` (and `outputs` requested; none: all).
fn make_request(
    s: &Server,
    model: &str,
    version: i64,
    inputs: &[In],
    outputs: &[&str],
) -> Result<Req, (infer_status, String)> {
    let mut r = std::ptr::null_mut();
    let st = unsafe { infer_request_new(s.0, cs(model).as_ptr(), version, &mut r) };
    if st != INFER_STATUS_OK {
        return Err((st, last_error()));
    }
    let req = Req(r);
    for i in inputs {
        let st = req.try_input(i.name, i.dt, &i.shape, &i.bytes);
        if st != INFER_STATUS_OK {
            return Err((st, last_error()));
        }
    }
    for o in outputs {
        let st = unsafe { infer_request_add_requested_output(req.0, cs(o).as_ptr()) };
        if st != INFER_STATUS_OK {
            return Err((st, last_error()));
        }
    }
    Ok(req)
}

/// Runs one request to the end: the response when it succeeded, else the status and
/// message of wherever it was refused (creating it, adding inputs, enqueue, the model).
fn call(
    s: &Server,
    model: &str,
    version: i64,
    inputs: &[In],
    outputs: &[&str],
) -> Result<Resp, (infer_status, String)> {
    let req = make_request(s, model, version, inputs, outputs)?;
    let mut out = std::ptr::null_mut();
    let st = unsafe { infer_server_infer(s.0, req.take(), &mut out) };
    if st != INFER_STATUS_OK {
        return Err((st, last_error()));
    }
    let resp = Resp(out);
    if resp.status() != INFER_STATUS_OK {
        return Err((resp.status(), resp.error()));
    }
    Ok(resp)
}

/// Runs a request that must succeed.
#[track_caller]
fn run(s: &Server, model: &str, version: i64, inputs: &[In]) -> Resp {
    call(s, model, version, inputs, &[])
        .unwrap_or_else(|(st, msg)| panic!("request to '{model}' v{version}: status {st}: {msg}"))
}

/// The shape and FP32 data of an output.
#[track_caller]
fn out_f32(r: &Resp, name: &str) -> (Vec<i64>, Vec<f32>) {
    let (shape, bytes) = r
        .output(name)
        .unwrap_or_else(|| panic!("no output '{name}' ({} outputs)", r.output_count()));
    (shape, bytemuck::pod_collect_to_vec(&bytes))
}

/// The datatype of an output.
fn out_dtype(r: &Resp, name: &str) -> infer_datatype {
    let mut dt = 0;
    let (mut shape, mut nd, mut data, mut bs) = (std::ptr::null(), 0usize, std::ptr::null(), 0);
    ok(unsafe {
        infer_response_output_by_name(
            r.0,
            cs(name).as_ptr(),
            &mut dt,
            &mut shape,
            &mut nd,
            &mut data,
            &mut bs,
        )
    });
    dt
}

fn version_of(r: &Resp) -> i64 {
    unsafe { infer_response_model_version(r.0) }
}

/// A server on a model repository: `explicit` model control with `startup` models.
fn repo_server(
    repo: &Path,
    explicit: bool,
    startup: &[&str],
) -> Result<Server, (infer_status, String)> {
    let mut opts = std::ptr::null_mut();
    ok(unsafe { infer_server_options_new(&mut opts) });
    ok(unsafe {
        infer_server_options_set_model_repository(opts, cs(repo.to_str().unwrap()).as_ptr())
    });
    ok(unsafe { infer_server_options_set_model_control_explicit(opts, explicit) });
    for m in startup {
        ok(unsafe { infer_server_options_add_startup_model(opts, cs(m).as_ptr()) });
    }
    let mut s = std::ptr::null_mut();
    let st = unsafe { infer_server_new(opts, &mut s) };
    let msg = last_error();
    unsafe { infer_server_options_free(opts) };
    if st != INFER_STATUS_OK {
        assert!(
            s.is_null(),
            "infer_server_new wrote its out-parameter on failure"
        );
        return Err((st, msg));
    }
    Ok(Server(s))
}

/// `(name, data_type, dims)` of the config JSON's inputs or outputs.
fn tensors_of(cfg: &Value, key: &str) -> Vec<(String, String, Vec<i64>)> {
    cfg[key]
        .as_array()
        .unwrap_or_else(|| panic!("no '{key}' in {cfg}"))
        .iter()
        .map(|t| {
            (
                t["name"].as_str().unwrap().to_owned(),
                t["data_type"].as_str().unwrap_or("").to_owned(),
                t["dims"]
                    .as_array()
                    .map(|d| d.iter().map(|x| x.as_i64().unwrap()).collect())
                    .unwrap_or_default(),
            )
        })
        .collect()
}

fn t(name: &str, dt: &str, dims: &[i64]) -> (String, String, Vec<i64>) {
    (name.to_owned(), dt.to_owned(), dims.to_vec())
}

/// A complete config: `max_batch_size`, one FP32 input X and output Y of `dims`.
fn xy_config(name: &str, mbs: u32, dims: &str, extra: &str) -> String {
    format!(
        r#"name: "{name}" {PLATFORM} max_batch_size: {mbs}
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ {dims} ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ {dims} ] }} ]
{extra}"#
    )
}

// ---------------------------------------------------------------------------------------
// 1. Model files that cannot be run
// ---------------------------------------------------------------------------------------

#[test]
fn missing_model_file_is_not_found_naming_the_path() {
    let s = Server::new();
    // A complete config and a folder without any version.
    let dir = temp_dir("onnx-missing");
    let cfg = xy_config("m", 0, "3", "");
    let msg = load_fails(&s, "m", &cfg, &dir, INFER_STATUS_NOT_FOUND);
    let want = dir.join("1").join("model.onnx");
    assert_mentions(&msg, &[want.to_str().unwrap(), "'m'"]);

    // An empty version folder: the same.
    std::fs::create_dir_all(dir.join("1")).unwrap();
    let msg = load_fails(&s, "m", &cfg, &dir, INFER_STATUS_NOT_FOUND);
    assert_mentions(&msg, &[want.to_str().unwrap()]);

    // A config that needs auto-complete: no version folder holds the model.
    let msg = load_fails(
        &s,
        "m",
        &format!("name: \"m\" {PLATFORM}"),
        &dir,
        INFER_STATUS_NOT_FOUND,
    );
    assert_mentions(&msg, &[dir.to_str().unwrap(), "model.onnx"]);

    // default_model_filename names the file looked for.
    write_model(&dir, 1, &add_const(1.0, &["3"]));
    let named = xy_config("m", 0, "3", "default_model_filename: \"net.onnx\"");
    let msg = load_fails(&s, "m", &named, &dir, INFER_STATUS_NOT_FOUND);
    assert_mentions(&msg, &[dir.join("1").join("net.onnx").to_str().unwrap()]);
    // ... and is read when present.
    write_file(&dir, 1, "net.onnx", &add_const(7.0, &["3"]).encode_to_vec());
    load_ok(&s, "m", &named, &dir);
    let r = run(&s, "m", -1, &[f32_in("X", &[3], &[1., 2., 3.])]);
    assert_eq!(out_f32(&r, "Y"), (vec![3], vec![8., 9., 10.]));
}

#[test]
fn garbage_bytes_are_not_an_onnx_model() {
    let s = Server::new();
    let dir = temp_dir("onnx-garbage");
    // 0xff.. is not a valid protobuf field key.
    write_file(
        &dir,
        1,
        "model.onnx",
        b"\xff\xff\xff\xff\xff this is not a protobuf message at all \x00\x01",
    );
    let file = dir.join("1").join("model.onnx");
    for cfg in [
        xy_config("g", 0, "3", ""),
        format!("name: \"g\" {PLATFORM}"),
    ] {
        let msg = load_fails(&s, "g", &cfg, &dir, INFER_STATUS_INVALID_ARGUMENT);
        assert_mentions(&msg, &["not an ONNX model", file.to_str().unwrap(), "'g'"]);
    }
    // An empty file is not a model either (it decodes as an empty message: no graph).
    write_file(&dir, 1, "model.onnx", b"");
    let (st, msg) = load_dir(&s, "g", &xy_config("g", 0, "3", ""), &dir);
    assert_ne!(st, INFER_STATUS_OK, "an empty model.onnx loaded");
    assert_ne!(st, INFER_STATUS_INTERNAL, "an empty model.onnx: {msg}");
}

#[test]
fn unknown_operator_is_unsupported_naming_operator_and_node() {
    let s = Server::new();
    let m = model(
        vec![tensor("X", T::Float, &["3"])],
        vec![tensor("Y", T::Float, &["3"])],
        vec![
            node("Relu", "fine", &["X"], &["R"]),
            node("NoSuchOp", "weird", &["R"], &["Y"]),
        ],
        vec![],
    );
    let dir = model_dir("onnx-unknown-op", &m);
    for cfg in [
        xy_config("u", 0, "3", ""),
        format!("name: \"u\" {PLATFORM}"),
    ] {
        let msg = load_fails(&s, "u", &cfg, &dir, INFER_STATUS_UNSUPPORTED);
        assert_mentions(&msg, &["NoSuchOp", "weird", "'u'"]);
        assert!(!msg.contains("'fine'"), "a supported node is named: {msg}");
    }
}

// ---------------------------------------------------------------------------------------
// 2. The config against the model
// ---------------------------------------------------------------------------------------

#[test]
fn datatype_mismatch_names_the_tensor_and_both_datatypes() {
    let s = Server::new();
    let m = model(
        vec![tensor("X", T::Int64, &["3"])],
        vec![tensor("Y", T::Int64, &["3"])],
        vec![node("Neg", "neg", &["X"], &["Y"])],
        vec![],
    );
    let dir = model_dir("onnx-dtype", &m);
    let msg = load_fails(
        &s,
        "d",
        &xy_config("d", 0, "3", ""),
        &dir,
        INFER_STATUS_INVALID_ARGUMENT,
    );
    assert_mentions(&msg, &["'X'", "FP32", "INT64"]);

    // Input right, output wrong.
    let cfg = format!(
        r#"name: "d" {PLATFORM}
input [ {{ name: "X" data_type: TYPE_INT64 dims: [ 3 ] }} ]
output [ {{ name: "Y" data_type: TYPE_INT32 dims: [ 3 ] }} ]"#
    );
    let msg = load_fails(&s, "d", &cfg, &dir, INFER_STATUS_INVALID_ARGUMENT);
    assert_mentions(&msg, &["'Y'", "INT32", "INT64"]);

    // The right types load and run.
    let ok_cfg = cfg.replace("TYPE_INT32", "TYPE_INT64");
    load_ok(&s, "d", &ok_cfg, &dir);
    let r = run(&s, "d", -1, &[i64_in("X", &[3], &[1, -2, 3])]);
    assert_eq!(r.output_i64("Y"), vec![-1, 2, -3]);
}

#[test]
fn dims_mismatch_names_the_tensor_and_both_shapes() {
    let s = Server::new();
    let dir = model_dir("onnx-dims", &add_const(1.0, &["3"]));
    let msg = load_fails(
        &s,
        "d",
        &xy_config("d", 0, "4", ""),
        &dir,
        INFER_STATUS_INVALID_ARGUMENT,
    );
    assert_mentions(&msg, &["'X'", "[4]", "[3]"]);

    // Rank mismatch.
    let msg = load_fails(
        &s,
        "d",
        &xy_config("d", 0, "1, 3", ""),
        &dir,
        INFER_STATUS_INVALID_ARGUMENT,
    );
    assert_mentions(&msg, &["'X'", "[1,3]", "[3]"]);

    // Only the output is wrong.
    let cfg = format!(
        r#"name: "d" {PLATFORM}
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 3 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 5 ] }} ]"#
    );
    let msg = load_fails(&s, "d", &cfg, &dir, INFER_STATUS_INVALID_ARGUMENT);
    assert_mentions(&msg, &["'Y'", "[5]", "[3]"]);
}

#[test]
fn config_input_that_the_model_lacks_is_named() {
    let s = Server::new();
    let dir = model_dir("onnx-extra-input", &add_const(1.0, &["3"]));
    let cfg = format!(
        r#"name: "e" {PLATFORM}
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 3 ] }},
        {{ name: "EXTRA" data_type: TYPE_FP32 dims: [ 3 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 3 ] }} ]"#
    );
    let msg = load_fails(&s, "e", &cfg, &dir, INFER_STATUS_INVALID_ARGUMENT);
    // The unknown name and what the model has instead.
    assert_mentions(&msg, &["'EXTRA'", "X"]);
}

#[test]
fn model_input_that_the_config_lacks_is_named() {
    let s = Server::new();
    let m = model(
        vec![tensor("X", T::Float, &["3"]), tensor("W", T::Float, &["3"])],
        vec![tensor("Y", T::Float, &["3"])],
        vec![node("Mul", "mul", &["X", "W"], &["Y"])],
        vec![],
    );
    let dir = model_dir("onnx-missing-input", &m);
    let msg = load_fails(
        &s,
        "w",
        &xy_config("w", 0, "3", ""),
        &dir,
        INFER_STATUS_INVALID_ARGUMENT,
    );
    assert_mentions(&msg, &["'W'", "X"]);
}

#[test]
fn config_output_that_the_model_lacks_is_named() {
    let s = Server::new();
    let dir = model_dir("onnx-extra-output", &add_const(1.0, &["3"]));
    let cfg = format!(
        r#"name: "o" {PLATFORM}
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 3 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 3 ] }},
         {{ name: "NOPE" data_type: TYPE_FP32 dims: [ 3 ] }} ]"#
    );
    let msg = load_fails(&s, "o", &cfg, &dir, INFER_STATUS_INVALID_ARGUMENT);
    assert_mentions(&msg, &["'NOPE'", "Y"]);
}

#[test]
fn batching_needs_a_symbolic_first_dim() {
    let s = Server::new();
    let dir = model_dir("onnx-fixed-batch", &add_const(1.0, &["2", "3"]));
    let msg = load_fails(
        &s,
        "b",
        &xy_config("b", 8, "3", ""),
        &dir,
        INFER_STATUS_INVALID_ARGUMENT,
    );
    assert_mentions(&msg, &["'X'", "dim 0", "2", "max_batch_size"]);
    // Without batching, the full shape loads and runs.
    load_ok(&s, "b", &xy_config("b", 0, "2, 3", ""), &dir);
    let r = run(
        &s,
        "b",
        -1,
        &[f32_in("X", &[2, 3], &[0., 1., 2., 3., 4., 5.])],
    );
    assert_eq!(out_f32(&r, "Y"), (vec![2, 3], vec![1., 2., 3., 4., 5., 6.]));
}

/// BYTES on tract (`backend: "tract"`): UNSUPPORTED naming the tensor. (On ONNX Runtime
/// BYTES are its strings: `bytes_tensors_round_trip_on_onnxruntime`.)
#[test]
fn bytes_tensors_are_unsupported_on_tract() {
    let s = Server::new();
    // The config says BYTES for an FP32 model input.
    let dir = model_dir("onnx-bytes", &add_const(1.0, &["3"]));
    let cfg = r#"name: "s" backend: "tract"
input [ { name: "X" data_type: TYPE_STRING dims: [ 3 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 3 ] } ]"#;
    let msg = load_fails(&s, "s", cfg, &dir, INFER_STATUS_UNSUPPORTED);
    assert_mentions(&msg, &["'X'", "BYTES"]);
    // On either engine a BYTES config for an FP32 model input is refused.
    let cfg = cfg.replace("backend: \"tract\"", PLATFORM);
    let (st, msg) = load_dir(&s, "s", &cfg, &dir);
    assert!(
        st == INFER_STATUS_UNSUPPORTED || st == INFER_STATUS_INVALID_ARGUMENT,
        "{st}: {msg}"
    );
    assert_mentions(&msg, &["'X'", "BYTES"]);

    // A model with a string input, configured as BYTES or completed from the model.
    let dir = model_dir("onnx-string", &string_identity());
    let cfg = r#"name: "s" backend: "tract"
input [ { name: "S" data_type: TYPE_STRING dims: [ 2 ] } ]
output [ { name: "O" data_type: TYPE_STRING dims: [ 2 ] } ]"#;
    let msg = load_fails(&s, "s", cfg, &dir, INFER_STATUS_UNSUPPORTED);
    assert_mentions(&msg, &["'S'", "BYTES"]);
    let msg = load_fails(
        &s,
        "s",
        "name: \"s\" backend: \"tract\"",
        &dir,
        INFER_STATUS_UNSUPPORTED,
    );
    assert_mentions(&msg, &["'S'"]);
}

fn string_identity() -> pb::ModelProto {
    model(
        vec![tensor("S", T::String, &["2"])],
        vec![tensor("O", T::String, &["2"])],
        vec![node("Identity", "id", &["S"], &["O"])],
        vec![],
    )
}

/// Triton's BYTES elements (4-byte length, then the bytes).
fn bytes_elements(items: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for i in items {
        out.extend_from_slice(&(i.len() as u32).to_le_bytes());
        out.extend_from_slice(i);
    }
    out
}

/// On ONNX Runtime (run by scripts/test.sh with INFER_ONNXRUNTIME_LIBRARY), BYTES are its
/// strings: completed from the model as TYPE_STRING, carried both ways; elements ONNX
/// Runtime's strings cannot hold (not UTF-8, a NUL) are refused naming the tensor.
#[test]
fn bytes_tensors_round_trip_on_onnxruntime() {
    if std::env::var_os("INFER_ONNXRUNTIME_LIBRARY").is_none() {
        return;
    }
    let s = Server::new();
    let dir = model_dir("onnx-string-ort", &string_identity());
    load_ok(&s, "s", &format!("name: \"s\" {PLATFORM}"), &dir);
    let cfg = config_json(&s, "s");
    assert_eq!(tensors_of(&cfg, "input"), vec![t("S", "TYPE_STRING", &[2])]);
    let input = |items: &[&[u8]]| In {
        name: "S",
        dt: INFER_DATATYPE_BYTES,
        shape: vec![2],
        bytes: bytes_elements(items),
    };
    let r = run(&s, "s", -1, &[input(&[b"h\xc3\xa9llo", b""])]);
    let (shape, got) = r.output("O").expect("output O");
    assert_eq!(shape, vec![2]);
    assert_eq!(got, bytes_elements(&[b"h\xc3\xa9llo", b""]));
    for bad in [&b"\xff\xfe"[..], &b"a\0b"[..]] {
        let Err((st, msg)) = call(&s, "s", -1, &[input(&[bad, b"x"])], &[]) else {
            panic!("{bad:?} was accepted");
        };
        assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{msg}");
        assert_mentions(&msg, &["'S'", "BYTES element 0"]);
    }
}

/// A config dim of -1 where the model fixes the size: the model's size is the only one
/// that can run, so a request of another size must be refused as the client's error
/// (INVALID_ARGUMENT), never reach tract and come back INTERNAL.
#[test]
fn wildcard_config_dim_over_a_fixed_model_dim_refuses_other_sizes() {
    let s = Server::new();
    let dir = model_dir("onnx-wild-fixed", &add_const(1.0, &["N", "3"]));
    let (st, msg) = load_dir(&s, "w", &xy_config("w", 4, "-1", ""), &dir);
    if st != INFER_STATUS_OK {
        // Refusing the config at load is right too, if it names the tensor.
        assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{msg}");
        assert_mentions(&msg, &["'X'"]);
        return;
    }
    let r = run(&s, "w", -1, &[f32_in("X", &[1, 3], &[1., 2., 3.])]);
    assert_eq!(out_f32(&r, "Y"), (vec![1, 3], vec![2., 3., 4.]));
    let err = call(&s, "w", -1, &[f32_in("X", &[1, 5], &[0.; 5])], &[])
        .err()
        .expect("a [1,5] request to a model that fixes dim 1 to 3 succeeded");
    assert_eq!(
        err.0, INFER_STATUS_INVALID_ARGUMENT,
        "a [1,5] request to a model that fixes dim 1 to 3: {}",
        err.1
    );
    assert_mentions(&err.1, &["'X'"]);
}

// ---------------------------------------------------------------------------------------
// 3. Auto-complete
// ---------------------------------------------------------------------------------------

#[test]
fn autocomplete_batching_model_from_dim_params() {
    let s = Server::new();
    let m = model(
        vec![
            tensor("X", T::Float, &["batch", "3"]),
            tensor("C", T::Int64, &["batch", "2"]),
        ],
        vec![
            tensor("Y", T::Float, &["batch", "3"]),
            tensor("D", T::Int64, &["batch", "2"]),
        ],
        vec![
            node("Add", "add", &["X", "K"], &["Y"]),
            node("Neg", "neg", &["C"], &["D"]),
        ],
        vec![init_f32("K", &[3], &[10., 20., 30.])],
    );
    let dir = model_dir("onnx-auto-batch", &m);
    load_ok(&s, "ab", &format!("name: \"ab\" {PLATFORM}"), &dir);
    let cfg = config_json(&s, "ab");
    assert_eq!(cfg["max_batch_size"], 4, "{cfg}");
    assert!(cfg.get("dynamic_batching").is_some(), "{cfg}");
    assert_eq!(
        tensors_of(&cfg, "input"),
        vec![t("X", "TYPE_FP32", &[3]), t("C", "TYPE_INT64", &[2])],
        "{cfg}"
    );
    assert_eq!(
        tensors_of(&cfg, "output"),
        vec![t("Y", "TYPE_FP32", &[3]), t("D", "TYPE_INT64", &[2])],
        "{cfg}"
    );

    for n in 1..=4i64 {
        let x: Vec<f32> = (0..n * 3).map(|i| i as f32).collect();
        let c: Vec<i64> = (0..n * 2).map(|i| i * 7 - 3).collect();
        let r = run(
            &s,
            "ab",
            -1,
            &[f32_in("X", &[n, 3], &x), i64_in("C", &[n, 2], &c)],
        );
        let want: Vec<f32> = x
            .iter()
            .enumerate()
            .map(|(i, v)| v + [10., 20., 30.][i % 3])
            .collect();
        assert_eq!(out_f32(&r, "Y"), (vec![n, 3], want), "batch {n}");
        assert_eq!(r.output("D").unwrap().0, vec![n, 2], "batch {n}");
        assert_eq!(
            r.output_i64("D"),
            c.iter().map(|v| -v).collect::<Vec<_>>(),
            "batch {n}"
        );
    }
    let err = call(
        &s,
        "ab",
        -1,
        &[
            f32_in("X", &[5, 3], &[0.; 15]),
            i64_in("C", &[5, 2], &[0; 10]),
        ],
        &[],
    )
    .err()
    .expect("a batch of 5 ran on max_batch_size 4");
    assert_eq!(err.0, INFER_STATUS_INVALID_ARGUMENT, "{}", err.1);
}

/// The model declares its output's datatype but no shape: the dims come from analysis.
#[test]
fn autocomplete_output_shape_from_analysis() {
    let s = Server::new();
    let m = model(
        vec![tensor("X", T::Float, &["n", "2", "3"])],
        vec![tensor_no_shape("S", T::Float)],
        vec![node_int_attr(
            "ReduceSum",
            "sum",
            &["X", "AX"],
            &["S"],
            "keepdims",
            0,
        )],
        vec![init_i64("AX", &[1], &[2])],
    );
    let dir = model_dir("onnx-auto-analysed", &m);
    load_ok(&s, "an", &format!("name: \"an\" {PLATFORM}"), &dir);
    let cfg = config_json(&s, "an");
    assert_eq!(cfg["max_batch_size"], 4, "{cfg}");
    assert_eq!(
        tensors_of(&cfg, "input"),
        vec![t("X", "TYPE_FP32", &[2, 3])]
    );
    assert_eq!(tensors_of(&cfg, "output"), vec![t("S", "TYPE_FP32", &[2])]);
    let r = run(
        &s,
        "an",
        -1,
        &[f32_in("X", &[1, 2, 3], &[1., 2., 3., 4., 5., 6.])],
    );
    assert_eq!(out_f32(&r, "S"), (vec![1, 2], vec![6., 15.]));
}

#[test]
fn autocomplete_fixed_dims_does_not_batch() {
    let s = Server::new();
    let dir = model_dir("onnx-auto-fixed", &add_const(0.5, &["2", "3"]));
    load_ok(&s, "af", &format!("name: \"af\" {PLATFORM}"), &dir);
    let cfg = config_json(&s, "af");
    assert_eq!(cfg["max_batch_size"].as_i64().unwrap_or(0), 0, "{cfg}");
    assert!(cfg.get("dynamic_batching").is_none(), "{cfg}");
    assert_eq!(
        tensors_of(&cfg, "input"),
        vec![t("X", "TYPE_FP32", &[2, 3])]
    );
    assert_eq!(
        tensors_of(&cfg, "output"),
        vec![t("Y", "TYPE_FP32", &[2, 3])]
    );
    let r = run(
        &s,
        "af",
        -1,
        &[f32_in("X", &[2, 3], &[0., 1., 2., 3., 4., 5.])],
    );
    assert_eq!(
        out_f32(&r, "Y"),
        (vec![2, 3], vec![0.5, 1.5, 2.5, 3.5, 4.5, 5.5])
    );
    // The completed dims are enforced.
    let err = call(&s, "af", -1, &[f32_in("X", &[3, 3], &[0.; 9])], &[])
        .err()
        .expect("a [3,3] request ran on a [2,3] model");
    assert_eq!(err.0, INFER_STATUS_INVALID_ARGUMENT, "{}", err.1);
}

#[test]
fn autocomplete_fills_a_partial_config() {
    let s = Server::new();
    let m = model(
        vec![
            tensor("A", T::Float, &["b", "4"]),
            tensor("B", T::Int64, &["b", "4"]),
        ],
        vec![tensor("Z", T::Float, &["b", "4"])],
        vec![
            node_int_attr("Cast", "cast", &["B"], &["BF"], "to", T::Float as i64),
            node("Sub", "sub", &["A", "BF"], &["Z"]),
        ],
        vec![],
    );
    let dir = model_dir("onnx-auto-partial", &m);
    // A's datatype, B's dims and all of Z are left to the model; max_batch_size is given.
    let cfg = format!(
        r#"name: "p" {PLATFORM} max_batch_size: 2
input [ {{ name: "A" dims: [ 4 ] }}, {{ name: "B" data_type: TYPE_INT64 }} ]
output [ {{ name: "Z" }} ]"#
    );
    load_ok(&s, "p", &cfg, &dir);
    let cfg = config_json(&s, "p");
    assert_eq!(cfg["max_batch_size"], 2, "{cfg}");
    assert_eq!(
        tensors_of(&cfg, "input"),
        vec![t("A", "TYPE_FP32", &[4]), t("B", "TYPE_INT64", &[4])],
        "{cfg}"
    );
    assert_eq!(tensors_of(&cfg, "output"), vec![t("Z", "TYPE_FP32", &[4])]);
    let r = run(
        &s,
        "p",
        -1,
        &[
            f32_in("A", &[2, 4], &[1., 2., 3., 4., 5., 6., 7., 8.]),
            i64_in("B", &[2, 4], &[1, 1, 1, 1, 10, 20, 30, 40]),
        ],
    );
    assert_eq!(
        out_f32(&r, "Z"),
        (vec![2, 4], vec![0., 1., 2., 3., -5., -14., -23., -32.])
    );
}

/// Initializers that the graph also lists as inputs (older exporters do) are constants,
/// not inputs a request must give.
#[test]
fn initializers_listed_as_graph_inputs_are_not_inputs() {
    let s = Server::new();
    let m = model(
        vec![
            tensor("X", T::Float, &["n", "2"]),
            tensor("W", T::Float, &["2"]),
        ],
        vec![tensor("Y", T::Float, &["n", "2"])],
        vec![node("Mul", "mul", &["X", "W"], &["Y"])],
        vec![init_f32("W", &[2], &[3., -1.])],
    );
    let dir = model_dir("onnx-init-inputs", &m);
    load_ok(&s, "iw", &format!("name: \"iw\" {PLATFORM}"), &dir);
    let cfg = config_json(&s, "iw");
    assert_eq!(
        tensors_of(&cfg, "input"),
        vec![t("X", "TYPE_FP32", &[2])],
        "{cfg}"
    );
    let r = run(&s, "iw", -1, &[f32_in("X", &[2, 2], &[1., 2., 3., 4.])]);
    assert_eq!(out_f32(&r, "Y"), (vec![2, 2], vec![3., -2., 9., -4.]));
    // A config that lists it as an input is refused, naming it.
    let cfg = format!(
        r#"name: "iw" {PLATFORM} max_batch_size: 4
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 2 ] }},
        {{ name: "W" data_type: TYPE_FP32 dims: [ 2 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 2 ] }} ]"#
    );
    let msg = load_fails(
        &s,
        "iw2",
        &cfg.replace("\"iw\"", "\"iw2\""),
        &dir,
        INFER_STATUS_INVALID_ARGUMENT,
    );
    assert_mentions(&msg, &["'W'"]);
}

/// An input whose rank the model does not declare: auto-complete cannot give its dims
/// and says so; with dims in the config it runs.
#[test]
fn input_of_unknown_rank_needs_dims_in_the_config() {
    let s = Server::new();
    let m = model(
        vec![tensor_no_shape("X", T::Float)],
        vec![tensor_no_shape("Y", T::Float)],
        vec![node("Abs", "abs", &["X"], &["Y"])],
        vec![],
    );
    let dir = model_dir("onnx-no-rank", &m);
    let msg = load_fails(
        &s,
        "nr",
        &format!("name: \"nr\" {PLATFORM}"),
        &dir,
        INFER_STATUS_INVALID_ARGUMENT,
    );
    assert_mentions(&msg, &["'X'", "dims"]);
    load_ok(&s, "nr", &xy_config("nr", 2, "2", ""), &dir);
    let r = run(&s, "nr", -1, &[f32_in("X", &[2, 2], &[-1., 2., -3., 4.])]);
    assert_eq!(out_f32(&r, "Y"), (vec![2, 2], vec![1., 2., 3., 4.]));
}

/// A config that gives max_batch_size 0 and the full dims of every tensor is complete:
/// auto-complete must not turn batching on because the model's first dim is symbolic
/// (the config's dims would then mean one dim more than the model has).
#[test]
fn explicit_non_batching_config_over_a_symbolic_first_dim_is_kept() {
    let s = Server::new();
    let dir = model_dir("onnx-explicit-nobatch", &mul_const(2.0, &["len"]));
    let cfg = xy_config("nb", 0, "-1", "");
    load_ok(&s, "nb", &cfg, &dir);
    let cfg = config_json(&s, "nb");
    assert_eq!(cfg["max_batch_size"].as_i64().unwrap_or(0), 0, "{cfg}");
    for len in [2usize, 5] {
        let x: Vec<f32> = (0..len).map(|i| i as f32 + 0.5).collect();
        let r = run(&s, "nb", -1, &[f32_in("X", &[len as i64], &x)]);
        let want: Vec<f32> = x.iter().map(|v| v * 2.).collect();
        assert_eq!(out_f32(&r, "Y"), (vec![len as i64], want));
    }
}

/// A repository model folder with no config file at all: everything comes from the model,
/// at start-up and when loaded by name.
#[test]
fn model_folder_without_config_loads_from_the_model() {
    let repo = temp_dir("onnx-noconfig-repo");
    write_model(&repo.join("bare"), 1, &add_const(2.0, &["batch", "3"]));
    let check = |s: &Server| {
        assert!(ready(s, "bare", -1));
        let cfg = config_json(s, "bare");
        assert_eq!(cfg["name"], "bare", "{cfg}");
        assert_eq!(cfg["max_batch_size"], 4, "{cfg}");
        assert_eq!(tensors_of(&cfg, "input"), vec![t("X", "TYPE_FP32", &[3])]);
        assert_eq!(tensors_of(&cfg, "output"), vec![t("Y", "TYPE_FP32", &[3])]);
        let r = run(
            s,
            "bare",
            -1,
            &[f32_in("X", &[2, 3], &[1., 2., 3., 4., 5., 6.])],
        );
        assert_eq!(out_f32(&r, "Y"), (vec![2, 3], vec![3., 4., 5., 6., 7., 8.]));
    };
    // Loaded at start-up.
    let s = repo_server(&repo, false, &[]).unwrap_or_else(|(st, m)| panic!("{st}: {m}"));
    check(&s);
    drop(s);
    // Loaded by name, with neither config text nor folder.
    let s = repo_server(&repo, true, &[]).unwrap_or_else(|(st, m)| panic!("{st}: {m}"));
    assert!(!ready(&s, "bare", -1), "explicit control loaded a model");
    ok(unsafe {
        infer_server_load_model(s.0, cs("bare").as_ptr(), std::ptr::null(), std::ptr::null())
    });
    check(&s);
}

// ---------------------------------------------------------------------------------------
// 4. Versions
// ---------------------------------------------------------------------------------------

/// Folders 1, 2, 3: version k adds k.
fn versioned_dir(tag: &str) -> PathBuf {
    let d = temp_dir(tag);
    for v in 1..=3 {
        write_model(&d, v, &add_const(v as f32, &["3"]));
    }
    d
}

/// Runs X = [0, 10, 20] on `version` and returns (served version, what was added).
fn added_by(s: &Server, name: &str, version: i64) -> Result<(i64, f32), (infer_status, String)> {
    let r = call(s, name, version, &[f32_in("X", &[3], &[0., 10., 20.])], &[])?;
    let (_, y) = out_f32(&r, "Y");
    assert!(
        y[1] - y[0] == 10. && y[2] - y[0] == 20.,
        "version {version}: {y:?}"
    );
    Ok((version_of(&r), y[0]))
}

#[track_caller]
fn assert_unserved(s: &Server, name: &str, version: i64) {
    assert!(!ready(s, name, version), "version {version} is ready");
    match added_by(s, name, version) {
        Ok(got) => panic!("version {version} is served: {got:?}"),
        Err((st, msg)) => {
            assert_eq!(st, INFER_STATUS_NOT_FOUND, "version {version}: {msg}");
            assert_mentions(&msg, &[&version.to_string(), name]);
        }
    }
}

#[test]
fn default_version_policy_serves_the_latest_only() {
    let s = Server::new();
    let dir = versioned_dir("onnx-versions-latest");
    load_ok(&s, "v", &xy_config("v", 0, "3", ""), &dir);
    assert_eq!(added_by(&s, "v", -1).unwrap(), (3, 3.));
    assert_eq!(added_by(&s, "v", 3).unwrap(), (3, 3.));
    assert_unserved(&s, "v", 1);
    assert_unserved(&s, "v", 2);

    // latest { num_versions: 2 }
    let cfg = xy_config(
        "v",
        0,
        "3",
        "version_policy: { latest { num_versions: 2 } }",
    );
    load_ok(&s, "v", &cfg, &dir);
    assert_eq!(added_by(&s, "v", 2).unwrap(), (2, 2.));
    assert_eq!(added_by(&s, "v", 3).unwrap(), (3, 3.));
    assert_unserved(&s, "v", 1);

    // Auto-complete reads the latest version too.
    load_ok(&s, "v", &format!("name: \"v\" {PLATFORM}"), &dir);
    assert_eq!(added_by(&s, "v", -1).unwrap(), (3, 3.));
    assert_unserved(&s, "v", 1);
}

#[test]
fn all_versions_policy_serves_each_computation() {
    let s = Server::new();
    let dir = versioned_dir("onnx-versions-all");
    load_ok(
        &s,
        "v",
        &xy_config("v", 0, "3", "version_policy: { all {} }"),
        &dir,
    );
    for v in 1..=3 {
        assert!(ready(&s, "v", v));
        assert_eq!(added_by(&s, "v", v).unwrap(), (v, v as f32), "version {v}");
    }
    assert_eq!(added_by(&s, "v", -1).unwrap(), (3, 3.));
    assert_unserved(&s, "v", 4);
    // Statistics are kept per version.
    let st = s.stats("v");
    let per_version: Vec<(i64, u64)> = st["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["version"].as_i64().unwrap(),
                m["inference_count"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(per_version, vec![(1, 1), (2, 1), (3, 2)], "{st}");
}

#[test]
fn specific_versions_policy_serves_those_listed() {
    let s = Server::new();
    let dir = versioned_dir("onnx-versions-specific");
    load_ok(
        &s,
        "v",
        &xy_config(
            "v",
            0,
            "3",
            "version_policy: { specific { versions: [1, 3] } }",
        ),
        &dir,
    );
    assert_eq!(added_by(&s, "v", 1).unwrap(), (1, 1.));
    assert_eq!(added_by(&s, "v", 3).unwrap(), (3, 3.));
    assert_eq!(added_by(&s, "v", -1).unwrap(), (3, 3.));
    assert_unserved(&s, "v", 2);

    // A listed version without a folder.
    let msg = load_fails(
        &s,
        "w",
        &xy_config(
            "w",
            0,
            "3",
            "version_policy: { specific { versions: [2, 7] } }",
        ),
        &dir,
        INFER_STATUS_NOT_FOUND,
    );
    assert_mentions(&msg, &["7"]);
}

/// Auto-complete must read a version that the policy serves: with versions 1 ([3]) and
/// 2 ([4]) and a policy serving only 1, the config is version 1's.
#[test]
fn autocomplete_reads_a_served_version() {
    let s = Server::new();
    let dir = temp_dir("onnx-versions-auto");
    write_model(&dir, 1, &add_const(1.0, &["3"]));
    write_model(&dir, 2, &add_const(2.0, &["4"]));
    let cfg = format!("name: \"va\" {PLATFORM} version_policy: {{ specific {{ versions: [1] }} }}");
    load_ok(&s, "va", &cfg, &dir);
    let c = config_json(&s, "va");
    assert_eq!(
        tensors_of(&c, "input"),
        vec![t("X", "TYPE_FP32", &[3])],
        "{c}"
    );
    let r = run(&s, "va", 1, &[f32_in("X", &[3], &[0., 10., 20.])]);
    assert_eq!(out_f32(&r, "Y"), (vec![3], vec![1., 11., 21.]));
    assert_unserved(&s, "va", 2);
}

#[test]
fn a_broken_version_fails_the_whole_load() {
    let s = Server::new();
    let dir = versioned_dir("onnx-versions-broken");
    write_file(&dir, 2, "model.onnx", b"\xff\xff\xff\xff not a model");
    let msg = load_fails(
        &s,
        "v",
        &xy_config("v", 0, "3", "version_policy: { all {} }"),
        &dir,
        INFER_STATUS_INVALID_ARGUMENT,
    );
    assert_mentions(&msg, &["version 2"]);
    // Serving only the good ones works.
    load_ok(
        &s,
        "v",
        &xy_config(
            "v",
            0,
            "3",
            "version_policy: { specific { versions: [1, 3] } }",
        ),
        &dir,
    );
    assert_eq!(added_by(&s, "v", 1).unwrap(), (1, 1.));
}

// ---------------------------------------------------------------------------------------
// 5. Reload
// ---------------------------------------------------------------------------------------

#[test]
fn reload_picks_up_a_new_model_file_and_config() {
    let s = Server::new();
    let dir = model_dir("onnx-reload", &add_const(1.0, &["3"]));
    load_ok(&s, "r", &xy_config("r", 0, "3", ""), &dir);
    let r = run(&s, "r", -1, &[f32_in("X", &[3], &[1., 2., 3.])]);
    assert_eq!(out_f32(&r, "Y"), (vec![3], vec![2., 3., 4.]));
    drop(r);

    // Same file name, another computation and shape, and a batching config.
    write_model(&dir, 1, &mul_const(3.0, &["batch", "2"]));
    load_ok(
        &s,
        "r",
        &xy_config("r", 8, "2", "dynamic_batching { }"),
        &dir,
    );
    assert_eq!(config_json(&s, "r")["max_batch_size"], 8);
    let r = run(
        &s,
        "r",
        -1,
        &[f32_in("X", &[3, 2], &[1., 2., 3., 4., 5., 6.])],
    );
    assert_eq!(
        out_f32(&r, "Y"),
        (vec![3, 2], vec![3., 6., 9., 12., 15., 18.])
    );
    // The old shape is refused now.
    let err = call(&s, "r", -1, &[f32_in("X", &[3], &[1., 2., 3.])], &[])
        .err()
        .expect("the replaced model's shape still runs");
    assert_eq!(err.0, INFER_STATUS_INVALID_ARGUMENT, "{}", err.1);

    // Reload with an auto-completed config picks up yet another file.
    write_model(&dir, 1, &add_const(-1.0, &["4"]));
    load_ok(&s, "r", &format!("name: \"r\" {PLATFORM}"), &dir);
    let cfg = config_json(&s, "r");
    assert_eq!(tensors_of(&cfg, "input"), vec![t("X", "TYPE_FP32", &[4])]);
    let r = run(&s, "r", -1, &[f32_in("X", &[4], &[1., 2., 3., 4.])]);
    assert_eq!(out_f32(&r, "Y"), (vec![4], vec![0., 1., 2., 3.]));

    // A failed reload keeps serving the loaded model.
    write_file(&dir, 1, "model.onnx", b"\xff\xff\xff garbage");
    let (st, msg) = load_dir(&s, "r", &format!("name: \"r\" {PLATFORM}"), &dir);
    assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{msg}");
    let r = run(&s, "r", -1, &[f32_in("X", &[4], &[1., 2., 3., 4.])]);
    assert_eq!(out_f32(&r, "Y"), (vec![4], vec![0., 1., 2., 3.]));
}

// ---------------------------------------------------------------------------------------
// 6. Explicit model control with start-up models
// ---------------------------------------------------------------------------------------

#[test]
fn startup_models_are_the_only_ones_loaded() {
    let repo = temp_dir("onnx-startup-repo");
    for (name, k) in [("one", 1.0), ("two", 2.0), ("three", 3.0)] {
        write_model(&repo.join(name), 1, &add_const(k, &["3"]));
    }
    // "two" has a config file; the others none.
    std::fs::write(
        repo.join("two").join("config.pbtxt"),
        xy_config("two", 0, "3", ""),
    )
    .unwrap();

    let s =
        repo_server(&repo, true, &["three", "two"]).unwrap_or_else(|(st, m)| panic!("{st}: {m}"));
    assert!(!ready(&s, "one", -1), "'one' was not listed");
    for (name, k) in [("two", 2.0), ("three", 3.0)] {
        assert!(ready(&s, name, -1), "{name}");
        let r = run(&s, name, -1, &[f32_in("X", &[3], &[0., 0., 1.])]);
        assert_eq!(out_f32(&r, "Y").1, vec![k, k, k + 1.], "{name}");
    }
    let err = call(&s, "one", -1, &[f32_in("X", &[3], &[0.; 3])], &[])
        .err()
        .expect("an unlisted model answered");
    assert_eq!(err.0, INFER_STATUS_NOT_FOUND, "{}", err.1);
    // It can still be loaded by name.
    ok(unsafe {
        infer_server_load_model(s.0, cs("one").as_ptr(), std::ptr::null(), std::ptr::null())
    });
    let r = run(&s, "one", -1, &[f32_in("X", &[3], &[0., 0., 1.])]);
    assert_eq!(out_f32(&r, "Y").1, vec![1., 1., 2.]);
    drop(s);

    // Without explicit control every model loads.
    let s = repo_server(&repo, false, &[]).unwrap_or_else(|(st, m)| panic!("{st}: {m}"));
    for name in ["one", "two", "three"] {
        assert!(ready(&s, name, -1), "{name}");
    }
    drop(s);

    // Explicit control without start-up models loads nothing.
    let s = repo_server(&repo, true, &[]).unwrap_or_else(|(st, m)| panic!("{st}: {m}"));
    for name in ["one", "two", "three"] {
        assert!(!ready(&s, name, -1), "{name}");
    }
}

#[test]
fn a_missing_startup_model_fails_server_creation_naming_it() {
    let repo = temp_dir("onnx-startup-missing");
    write_model(&repo.join("present"), 1, &add_const(1.0, &["3"]));
    let (st, msg) = match repo_server(&repo, true, &["present", "ghost"]) {
        Ok(_) => panic!("a server started with a start-up model that does not exist"),
        Err(e) => e,
    };
    assert_eq!(st, INFER_STATUS_NOT_FOUND, "{msg}");
    assert_mentions(&msg, &["ghost"]);

    // A listed model that exists but cannot load fails it too, naming that model.
    write_file(&repo.join("broken"), 1, "model.onnx", b"\xff\xff\xff junk");
    let (st, msg) = match repo_server(&repo, true, &["broken", "present"]) {
        Ok(_) => panic!("a server started with a broken start-up model"),
        Err(e) => e,
    };
    assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{msg}");
    assert_mentions(&msg, &["'broken'"]);
}

// ---------------------------------------------------------------------------------------
// 7. Datatypes, requested outputs, variable dims
// ---------------------------------------------------------------------------------------

#[test]
fn bool_and_int64_tensors_round_trip() {
    let s = Server::new();
    let m = model(
        vec![
            tensor("X", T::Float, &["n", "4"]),
            tensor("K", T::Int64, &["n", "4"]),
            tensor("M", T::Bool, &["n", "4"]),
        ],
        vec![
            tensor("GT", T::Bool, &["n", "4"]),
            tensor("XI", T::Int64, &["n", "4"]),
            tensor("K3", T::Int64, &["n", "4"]),
            tensor("NM", T::Bool, &["n", "4"]),
        ],
        vec![
            node("Greater", "gt", &["X", "HALF"], &["GT"]),
            node_int_attr("Cast", "cast", &["X"], &["XI"], "to", T::Int64 as i64),
            node("Mul", "mul", &["K", "THREE"], &["K3"]),
            node("Not", "not", &["M"], &["NM"]),
        ],
        vec![init_f32("HALF", &[], &[0.5]), init_i64("THREE", &[], &[3])],
    );
    let dir = model_dir("onnx-types", &m);
    load_ok(&s, "ty", &format!("name: \"ty\" {PLATFORM}"), &dir);
    let cfg = config_json(&s, "ty");
    assert_eq!(
        tensors_of(&cfg, "input"),
        vec![
            t("X", "TYPE_FP32", &[4]),
            t("K", "TYPE_INT64", &[4]),
            t("M", "TYPE_BOOL", &[4]),
        ],
        "{cfg}"
    );
    assert_eq!(
        tensors_of(&cfg, "output"),
        vec![
            t("GT", "TYPE_BOOL", &[4]),
            t("XI", "TYPE_INT64", &[4]),
            t("K3", "TYPE_INT64", &[4]),
            t("NM", "TYPE_BOOL", &[4]),
        ],
        "{cfg}"
    );
    let big = 1i64 << 40; // beyond INT32
    let r = run(
        &s,
        "ty",
        -1,
        &[
            f32_in("X", &[2, 4], &[0.0, 1.0, 0.5, 7.0, -3.0, 2.0, 0.75, 100.0]),
            i64_in("K", &[2, 4], &[1, -2, big, 0, 5, -big, 7, 11]),
            bool_in("M", &[2, 4], &[1, 0, 0, 1, 0, 0, 1, 1]),
        ],
    );
    let (shape, gt) = r.output("GT").unwrap();
    assert_eq!(shape, vec![2, 4]);
    assert_eq!(out_dtype(&r, "GT"), INFER_DATATYPE_BOOL);
    assert_eq!(gt, vec![0, 1, 0, 1, 0, 1, 1, 1]);
    assert_eq!(out_dtype(&r, "XI"), INFER_DATATYPE_INT64);
    assert_eq!(r.output_i64("XI"), vec![0, 1, 0, 7, -3, 2, 0, 100]);
    assert_eq!(out_dtype(&r, "K3"), INFER_DATATYPE_INT64);
    assert_eq!(
        r.output_i64("K3"),
        vec![3, -6, 3 * big, 0, 15, -3 * big, 21, 33]
    );
    assert_eq!(out_dtype(&r, "NM"), INFER_DATATYPE_BOOL);
    assert_eq!(r.output("NM").unwrap().1, vec![0, 1, 1, 0, 1, 1, 0, 0]);
}

#[test]
fn fp16_uint8_and_int32_tensors_round_trip() {
    let s = Server::new();
    let m = model(
        vec![
            tensor("H", T::Float16, &["n", "3"]),
            tensor("U", T::Uint8, &["n", "3"]),
        ],
        vec![
            tensor("H2", T::Float16, &["n", "3"]),
            tensor("UI", T::Int32, &["n", "3"]),
        ],
        vec![
            node("Add", "double", &["H", "H"], &["H2"]),
            node_int_attr("Cast", "widen", &["U"], &["UI"], "to", T::Int32 as i64),
        ],
        vec![],
    );
    let dir = model_dir("onnx-fp16", &m);
    load_ok(&s, "h", &format!("name: \"h\" {PLATFORM}"), &dir);
    let cfg = config_json(&s, "h");
    assert_eq!(
        tensors_of(&cfg, "input"),
        vec![t("H", "TYPE_FP16", &[3]), t("U", "TYPE_UINT8", &[3])],
        "{cfg}"
    );
    assert_eq!(
        tensors_of(&cfg, "output"),
        vec![t("H2", "TYPE_FP16", &[3]), t("UI", "TYPE_INT32", &[3])],
        "{cfg}"
    );
    // FP16 bits: 1.0 0x3C00, 0.5 0x3800, -2.0 0xC000; doubled: 2.0 0x4000, 1.0, -4.0 0xC400.
    let h: [u16; 3] = [0x3C00, 0x3800, 0xC000];
    let r = run(
        &s,
        "h",
        -1,
        &[
            In {
                name: "H",
                dt: INFER_DATATYPE_FP16,
                shape: vec![1, 3],
                bytes: bytemuck::cast_slice(&h).to_vec(),
            },
            In {
                name: "U",
                dt: INFER_DATATYPE_UINT8,
                shape: vec![1, 3],
                bytes: vec![0, 200, 255],
            },
        ],
    );
    assert_eq!(out_dtype(&r, "H2"), INFER_DATATYPE_FP16);
    let (shape, bytes) = r.output("H2").unwrap();
    assert_eq!(shape, vec![1, 3]);
    let h2: Vec<u16> = bytemuck::pod_collect_to_vec(&bytes);
    assert_eq!(h2, vec![0x4000, 0x3C00, 0xC400]);
    assert_eq!(out_dtype(&r, "UI"), INFER_DATATYPE_INT32);
    assert_eq!(r.output_i32("UI"), vec![0, 200, 255]);
}

/// A BOOL byte other than 0 and 1 is either refused as the client's error or read as
/// true; it never reaches the model as an invalid bool.
#[test]
fn bool_input_bytes_other_than_zero_and_one() {
    let s = Server::new();
    let m = model(
        vec![tensor("M", T::Bool, &["4"])],
        vec![tensor("NM", T::Bool, &["4"])],
        vec![node("Not", "not", &["M"], &["NM"])],
        vec![],
    );
    let dir = model_dir("onnx-bool-bytes", &m);
    load_ok(&s, "b", &format!("name: \"b\" {PLATFORM}"), &dir);
    match call(&s, "b", -1, &[bool_in("M", &[4], &[0, 2, 255, 1])], &[]) {
        Ok(r) => assert_eq!(r.output("NM").unwrap().1, vec![1, 0, 0, 0]),
        Err((st, msg)) => assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{msg}"),
    }
}

#[test]
fn a_request_may_ask_for_one_of_two_outputs() {
    let s = Server::new();
    let m = model(
        vec![tensor("X", T::Float, &["n", "3"])],
        vec![
            tensor("PLUS", T::Float, &["n", "3"]),
            tensor("TIMES", T::Float, &["n", "3"]),
        ],
        vec![
            node("Add", "add", &["X", "K"], &["PLUS"]),
            node("Mul", "mul", &["X", "K"], &["TIMES"]),
        ],
        vec![init_f32("K", &[], &[4.0])],
    );
    let dir = model_dir("onnx-two-outputs", &m);
    load_ok(&s, "two", &format!("name: \"two\" {PLATFORM}"), &dir);
    let x = f32_in("X", &[1, 3], &[1., 2., 3.]);
    let r = call(&s, "two", -1, &[x], &["TIMES"]).unwrap_or_else(|e| panic!("{e:?}"));
    assert_eq!(r.output_count(), 1);
    assert!(r.output("PLUS").is_none());
    assert_eq!(out_f32(&r, "TIMES"), (vec![1, 3], vec![4., 8., 12.]));
    let x = f32_in("X", &[1, 3], &[1., 2., 3.]);
    let r = call(&s, "two", -1, &[x], &["PLUS"]).unwrap_or_else(|e| panic!("{e:?}"));
    assert_eq!(r.output_count(), 1);
    assert_eq!(out_f32(&r, "PLUS"), (vec![1, 3], vec![5., 6., 7.]));
    // Both by default.
    let r = run(&s, "two", -1, &[f32_in("X", &[1, 3], &[0., 1., 2.])]);
    assert_eq!(r.output_count(), 2);
    assert_eq!(out_f32(&r, "PLUS").1, vec![4., 5., 6.]);
    assert_eq!(out_f32(&r, "TIMES").1, vec![0., 4., 8.]);

    // A config listing only one output: the model runs, the other is never returned.
    let cfg = format!(
        r#"name: "one" {PLATFORM} max_batch_size: 4
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 3 ] }} ]
output [ {{ name: "TIMES" data_type: TYPE_FP32 dims: [ 3 ] }} ]"#
    );
    load_ok(&s, "one", &cfg, &dir);
    let r = run(&s, "one", -1, &[f32_in("X", &[1, 3], &[1., 1., 2.])]);
    assert_eq!(r.output_count(), 1);
    assert_eq!(out_f32(&r, "TIMES").1, vec![4., 4., 8.]);
}

#[test]
fn a_variable_non_batch_dim_runs_with_different_lengths() {
    let s = Server::new();
    let m = model(
        vec![tensor("X", T::Float, &["batch", "len"])],
        vec![
            tensor("Y", T::Float, &["batch", "len"]),
            tensor("S", T::Float, &["batch", "1"]),
        ],
        vec![
            node("Mul", "mul", &["X", "TWO"], &["Y"]),
            node_int_attr("ReduceSum", "sum", &["X", "AX"], &["S"], "keepdims", 1),
        ],
        vec![init_f32("TWO", &[], &[2.0]), init_i64("AX", &[1], &[1])],
    );
    let dir = model_dir("onnx-var-dim", &m);
    // Auto-completed, and configured with -1.
    let configs = [
        format!("name: \"vl\" {PLATFORM}"),
        r#"name: "vl" backend: "onnxruntime" max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] },
         { name: "S" data_type: TYPE_FP32 dims: [ 1 ] } ]"#
            .to_owned(),
    ];
    for cfg in &configs {
        load_ok(&s, "vl", cfg, &dir);
        let c = config_json(&s, "vl");
        assert_eq!(tensors_of(&c, "input"), vec![t("X", "TYPE_FP32", &[-1])]);
        for (rows, len) in [(1i64, 3i64), (2, 7), (1, 1)] {
            let x: Vec<f32> = (0..rows * len).map(|i| (i * i) as f32).collect();
            let r = run(&s, "vl", -1, &[f32_in("X", &[rows, len], &x)]);
            let want: Vec<f32> = x.iter().map(|v| v * 2.).collect();
            assert_eq!(out_f32(&r, "Y"), (vec![rows, len], want), "{rows}x{len}");
            let sums: Vec<f32> = x.chunks(len as usize).map(|row| row.iter().sum()).collect();
            assert_eq!(out_f32(&r, "S"), (vec![rows, 1], sums), "{rows}x{len}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// 8. Concurrency with dynamic batching
// ---------------------------------------------------------------------------------------

/// `Y = X @ W + B`, X [batch, 3], W [3, 2]: every output mixes a whole row, so rows
/// swapped or shifted within a batch give wrong answers.
const W: [[f32; 2]; 3] = [[1., -1.], [10., 0.5], [100., 2.]];
const B: [f32; 2] = [0.25, -7.];

fn linear(x: &[f32; 3]) -> [f32; 2] {
    let mut y = B;
    for (j, yj) in y.iter_mut().enumerate() {
        for (i, xi) in x.iter().enumerate() {
            *yj += xi * W[i][j];
        }
    }
    y
}

/// Enqueues `per_thread` requests from each of `threads` threads (row i of thread t is
/// distinct), then checks every response against its own input.
fn concurrent_round(s: &Server, name: &str, threads: usize, per_thread: usize, base: usize) {
    let c = Collector::new();
    let sent: Vec<(u64, [f32; 3])> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..threads)
            .map(|th| {
                let c = c.clone();
                sc.spawn(move || {
                    (0..per_thread)
                        .map(|i| {
                            let k = (base + th * per_thread + i) as f32;
                            let x = [k, -0.5 * k, k / 8.];
                            let r = s.request(name).input_f32("X", &[1, 3], &x);
                            let id = s.enqueue(r, &c).unwrap_or_else(|e| panic!("{e:?}"));
                            (id, x)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    let n = threads * per_thread;
    c.wait(n);
    let ids: Vec<u64> = sent.iter().map(|(id, _)| *id).collect();
    c.assert_exactly_once(&ids);
    let by_id: std::collections::HashMap<u64, [f32; 3]> = sent.into_iter().collect();
    for r in c.take() {
        assert_eq!(r.status(), INFER_STATUS_OK, "{}", r.error());
        let x = by_id[&r.id()];
        let (shape, y) = out_f32(&r, "Y");
        assert_eq!(shape, vec![1, 2], "request {}", r.id());
        let want = linear(&x);
        for j in 0..2 {
            assert!(
                (y[j] - want[j]).abs() <= 1e-3 * want[j].abs().max(1.),
                "request {} with X {x:?}: got {y:?}, want {want:?}",
                r.id()
            );
        }
    }
}

#[test]
fn concurrent_requests_are_batched_and_answered_correctly() {
    let s = Server::new();
    let m = model(
        vec![tensor("X", T::Float, &["batch", "3"])],
        vec![tensor("Y", T::Float, &["batch", "2"])],
        vec![
            node("MatMul", "mm", &["X", "W"], &["XW"]),
            node("Add", "bias", &["XW", "B"], &["Y"]),
        ],
        vec![init_f32("W", &[3, 2], &W.concat()), init_f32("B", &[2], &B)],
    );
    let dir = model_dir("onnx-concurrent", &m);
    let cfg = format!(
        r#"name: "mm" {PLATFORM} max_batch_size: 16
dynamic_batching {{ max_queue_delay_microseconds: 20000 }}
instance_group [ {{ count: 2 kind: KIND_CPU }} ]"#
    );
    load_ok(&s, "mm", &cfg, &dir);
    assert_eq!(
        tensors_of(&config_json(&s, "mm"), "output"),
        vec![t("Y", "TYPE_FP32", &[2])]
    );

    // Free-running: 4 threads x 16 requests.
    concurrent_round(&s, "mm", 4, 16, 0);
    // Paused while 64 more arrive, so batches must form.
    s.pause("mm");
    let resume = std::thread::scope(|sc| {
        let h = sc.spawn(|| concurrent_round(&s, "mm", 8, 8, 1000));
        // Resume once all 64 are queued.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let st = s.stats("mm");
            if st["models"][0]["pending"].as_u64().unwrap_or(0) >= 64 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "64 never queued: {st}"
            );
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        s.resume("mm");
        h.join()
    });
    resume.unwrap();

    let st = s.stats("mm");
    let m = &st["models"][0];
    assert_eq!(m["inference_count"], 128, "{st}");
    assert_eq!(m["success_count"], 128, "{st}");
    let sizes = batch_sizes(&st);
    let rows: u64 = sizes.iter().map(|(n, c)| n * c).sum();
    assert_eq!(rows, 128, "{st}");
    assert!(sizes.iter().all(|(n, _)| *n <= 16), "{st}");
    assert!(
        sizes.iter().any(|(n, _)| *n > 1),
        "no batch of more than one request: {st}"
    );
    let execs = m["execution_count"].as_u64().unwrap();
    assert!(execs < 128, "{st}");
}

// ---------------------------------------------------------------------------------------
// 9. Every run from a fresh state
// ---------------------------------------------------------------------------------------

/// Fixed-seed weights in [-0.5, 0.5).
struct Weights(u64);
impl Weights {
    fn take(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                (self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect()
    }
}

const REC_IN: i64 = 3;
const REC_HIDDEN: i64 = 5;

/// One ONNX recurrent layer (`LSTM`, `GRU` or `RNN`) of batch 1, random weights:
/// X [seq, 1, 3] -> Y [seq, 1, 1, 5] and Y_h [1, 1, 5]. With `state`, the initial hidden
/// (and LSTM cell) state are the inputs H_IN (C_IN) and the last ones the outputs H_OUT
/// (C_OUT), for the sequence batcher's implicit state; without, the initial state is
/// zeros, as in the exported speech and OCR models that carry an LSTM.
fn recurrent(op: &str, state: bool) -> pb::ModelProto {
    let gates = match op {
        "LSTM" => 4,
        "GRU" => 3,
        _ => 1,
    };
    let (i, h) = (REC_IN, REC_HIDDEN);
    let mut w = Weights(0x5eed_0000 + gates as u64);
    let inits = vec![
        init_f32("W", &[1, gates * h, i], &w.take((gates * h * i) as usize)),
        init_f32("R", &[1, gates * h, h], &w.take((gates * h * h) as usize)),
        init_f32("B", &[1, 2 * gates * h], &w.take((2 * gates * h) as usize)),
    ];
    let lstm = op == "LSTM";
    let mut ins = vec!["X", "W", "R", "B"];
    let mut outs = vec!["Y", if state { "H_OUT" } else { "Y_h" }];
    let mut inputs = vec![tensor("X", T::Float, &["seq", "1", "3"])];
    let mut outputs = vec![
        tensor("Y", T::Float, &["seq", "1", "1", "5"]),
        tensor(outs[1], T::Float, &["1", "1", "5"]),
    ];
    if state {
        ins.extend(["", "H_IN"]);
        inputs.push(tensor("H_IN", T::Float, &["1", "1", "5"]));
        if lstm {
            ins.push("C_IN");
            outs.push("C_OUT");
            inputs.push(tensor("C_IN", T::Float, &["1", "1", "5"]));
            outputs.push(tensor("C_OUT", T::Float, &["1", "1", "5"]));
        }
    }
    let n = node_int_attr(op, "rec", &ins, &outs, "hidden_size", h);
    model(inputs, outputs, vec![n], inits)
}

/// X [seq, 1, 3] with values from `seed`.
fn rec_input(seq: i64, seed: u64) -> In {
    let x = Weights(seed).take((seq * REC_IN) as usize);
    f32_in(
        "X",
        &[seq, 1, REC_IN],
        &x.iter().map(|v| v * 4.).collect::<Vec<_>>(),
    )
}

/// Every output of a response, as raw bytes, for bit-exact comparisons.
fn all_bytes(r: &Resp, names: &[&str]) -> Vec<(Vec<i64>, Vec<u8>)> {
    names
        .iter()
        .map(|n| r.output(n).unwrap_or_else(|| panic!("no output '{n}'")))
        .collect()
}

/// ONNX LSTM, GRU and RNN layers, which tract runs with a hidden state that it keeps from
/// one run to the next: the same request, sent again and again between requests of
/// other sizes and values, answers bit for bit the same, and as a fresh instance does.
#[test]
fn recurrent_layers_answer_every_request_from_a_fresh_state() {
    let s = Server::new();
    for op in ["LSTM", "GRU", "RNN"] {
        let dir = model_dir(&format!("onnx-rec-{op}"), &recurrent(op, false));
        let name = op.to_lowercase();
        let config = format!(
            r#"name: "{name}" {PLATFORM} max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ -1, 1, 3 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1, 1, 1, 5 ] }},
         {{ name: "Y_h" data_type: TYPE_FP32 dims: [ 1, 1, 5 ] }} ]"#
        );
        load_ok(&s, &name, &config, &dir);
        let names = ["Y", "Y_h"];
        let a = || rec_input(4, 11);
        let first = all_bytes(&run(&s, &name, -1, &[a()]), &names);
        assert_eq!(first[0].0, vec![4, 1, 1, 5], "{op}");
        let others = [rec_input(6, 12), rec_input(4, 13), rec_input(1, 14)];
        for (k, other) in others.iter().enumerate() {
            for _ in 0..2 {
                let again = all_bytes(&run(&s, &name, -1, &[a()]), &names);
                assert!(
                    again == first,
                    "{op}: the request answered differently after {k} other requests"
                );
            }
            let o = run(&s, &name, -1, std::slice::from_ref(other));
            // The other request's answer is its own, not one continued from a: the same
            // again gives the same.
            let o2 = run(&s, &name, -1, std::slice::from_ref(other));
            assert!(
                all_bytes(&o, &names) == all_bytes(&o2, &names),
                "{op}: request {k} answered twice differently"
            );
        }
        let last = all_bytes(&run(&s, &name, -1, &[a()]), &names);
        assert!(
            last == first,
            "{op}: the request answered differently at the end"
        );
        // A fresh instance's first answer.
        let fresh = format!("{name}_fresh");
        load_ok(
            &s,
            &fresh,
            &config.replace(&format!("\"{name}\""), &format!("\"{fresh}\"")),
            &dir,
        );
        let f = all_bytes(&run(&s, &fresh, -1, &[a()]), &names);
        assert!(f == first, "{op}: a fresh instance answers differently");
    }
}

/// An LSTM whose hidden and cell states are the sequence batcher's implicit state: a
/// sequence sent in chunks answers as the whole sequence run at once, and two sequences
/// interleaved keep their own states.
#[test]
fn a_recurrent_sequence_keeps_its_state_in_the_sequence_batcher() {
    let s = Server::new();
    let dir = model_dir("onnx-rec-seq", &recurrent("LSTM", true));
    let seq_config = format!(
        r#"name: "lstm_seq" {PLATFORM} max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ -1, 1, 3 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1, 1, 1, 5 ] }} ]
sequence_batching {{
  state [ {{ input_name: "H_IN" output_name: "H_OUT" data_type: TYPE_FP32 dims: [ 1, 1, 5 ] }},
          {{ input_name: "C_IN" output_name: "C_OUT" data_type: TYPE_FP32 dims: [ 1, 1, 5 ] }} ]
}}
instance_group [ {{ count: 2 kind: KIND_CPU }} ]"#
    );
    load_ok(&s, "lstm_seq", &seq_config, &dir);
    let whole_config = format!(
        r#"name: "lstm_whole" {PLATFORM} max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ -1, 1, 3 ] }},
        {{ name: "H_IN" data_type: TYPE_FP32 dims: [ 1, 1, 5 ] }},
        {{ name: "C_IN" data_type: TYPE_FP32 dims: [ 1, 1, 5 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1, 1, 1, 5 ] }} ]"#
    );
    load_ok(&s, "lstm_whole", &whole_config, &dir);

    // Two sequences of 6 steps, in chunks of 2, 3 and 1, sent alternately.
    let xs = [
        Weights(21).take(6 * REC_IN as usize),
        Weights(22).take(6 * REC_IN as usize),
    ];
    let zeros = vec![0f32; REC_HIDDEN as usize];
    let h = REC_HIDDEN as usize;
    let want: Vec<Vec<f32>> = xs
        .iter()
        .map(|x| {
            let r = run(
                &s,
                "lstm_whole",
                -1,
                &[
                    f32_in("X", &[6, 1, REC_IN], x),
                    f32_in("H_IN", &[1, 1, REC_HIDDEN], &zeros),
                    f32_in("C_IN", &[1, 1, REC_HIDDEN], &zeros),
                ],
            );
            out_f32(&r, "Y").1
        })
        .collect();
    let mut got = [Vec::new(), Vec::new()];
    let chunks = [(0usize, 2usize), (2, 5), (5, 6)];
    for (k, &(from, to)) in chunks.iter().enumerate() {
        for (q, x) in xs.iter().enumerate() {
            let mut flags = 0;
            if k == 0 {
                flags |= INFER_REQUEST_FLAG_SEQUENCE_START;
            }
            if k == chunks.len() - 1 {
                flags |= INFER_REQUEST_FLAG_SEQUENCE_END;
            }
            let chunk = &x[from * REC_IN as usize..to * REC_IN as usize];
            let r = s.infer(
                s.request("lstm_seq")
                    .input_f32("X", &[(to - from) as i64, 1, REC_IN], chunk)
                    .correlation_id(100 + q as u64)
                    .flags(flags),
            );
            assert_eq!(r.status(), INFER_STATUS_OK, "{}", r.error());
            got[q].extend(r.output_f32("Y"));
        }
    }
    for q in 0..2 {
        assert_eq!(got[q].len(), 6 * h);
        for (i, (g, w)) in got[q].iter().zip(&want[q]).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 + 1e-5 * w.abs(),
                "sequence {q}, step {}, unit {}: {g} in chunks, {w} at once",
                i / h,
                i % h
            );
        }
    }
}

/// `Y = Gather(X, I)` along axis 0, X [n, 3] and I [k] of any sizes.
fn gather_model() -> pb::ModelProto {
    model(
        vec![
            tensor("X", T::Float, &["n", "3"]),
            tensor("I", T::Int64, &["k"]),
        ],
        vec![tensor("Y", T::Float, &["k", "3"])],
        vec![node("Gather", "gather", &["X", "I"], &["Y"])],
        vec![],
    )
}

/// A run that fails part-way (an index out of range, which tract may answer with a
/// panic) fails only its request: the requests after it, of other sizes, are answered
/// correctly by the same instance.
#[test]
fn a_failed_run_leaves_the_instance_as_good_as_new() {
    let s = Server::new();
    let dir = model_dir("onnx-gather-fail", &gather_model());
    let config = format!(
        r#"name: "g" {PLATFORM} max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ -1, 3 ] }},
        {{ name: "I" data_type: TYPE_INT64 dims: [ -1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1, 3 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]"#
    );
    load_ok(&s, "g", &config, &dir);
    let gather = |n: i64, idx: &[i64]| -> Result<(Vec<i64>, Vec<f32>), (infer_status, String)> {
        let x: Vec<f32> = (0..n * 3).map(|v| v as f32).collect();
        call(
            &s,
            "g",
            -1,
            &[
                f32_in("X", &[n, 3], &x),
                i64_in("I", &[idx.len() as i64], idx),
            ],
            &[],
        )
        .map(|r| out_f32(&r, "Y"))
    };
    let want = |idx: &[i64]| -> (Vec<i64>, Vec<f32>) {
        let v = idx
            .iter()
            .flat_map(|&i| (0..3).map(move |c| (i * 3 + c) as f32))
            .collect();
        (vec![idx.len() as i64, 3], v)
    };
    assert_eq!(gather(4, &[3, 0]).unwrap(), want(&[3, 0]));
    for bad in [&[0, 9][..], &[-9][..], &[1 << 40][..]] {
        let (st, msg) = gather(4, bad).expect_err("an index out of range must fail");
        assert_ne!(st, INFER_STATUS_OK);
        assert!(msg.contains("'g'"), "the message names the model: {msg}");
        for (n, idx) in [(8, &[7, 5, 1][..]), (2, &[1][..]), (4, &[3, 0][..])] {
            assert_eq!(
                gather(n, idx).unwrap_or_else(|e| panic!("after {bad:?}: n={n}: {e:?}")),
                want(idx),
                "after {bad:?}: n={n}"
            );
        }
    }
}

/// tract panics while analysing an LSTM without an initial state over a symbolic batch:
/// the load is refused as UNSUPPORTED naming the stage, not failed as an internal error.
#[test]
fn a_model_tract_panics_on_is_unsupported() {
    let s = Server::new();
    let mut m = recurrent("LSTM", false);
    let g = m.graph.as_mut().unwrap();
    g.input = vec![tensor("X", T::Float, &["seq", "batch", "3"])];
    g.output = vec![
        tensor("Y", T::Float, &["seq", "1", "batch", "5"]),
        tensor("Y_h", T::Float, &["1", "batch", "5"]),
    ];
    let dir = model_dir("onnx-tract-panics", &m);
    // tract only: ONNX Runtime serves this model.
    let config = r#"name: "lp" backend: "tract" max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1, -1, 3 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1, 1, -1, 5 ] },
         { name: "Y_h" data_type: TYPE_FP32 dims: [ 1, -1, 5 ] } ]"#;
    let msg = load_fails(&s, "lp", config, &dir, INFER_STATUS_UNSUPPORTED);
    assert_mentions(&msg, &["'lp'", "tract", "analyse", "tract failed"]);
}

static ORT_LOG: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

unsafe extern "C" fn ort_log_line(
    _: *mut std::ffi::c_void,
    _level: u32,
    msg: *const std::ffi::c_char,
) {
    let msg = unsafe { CStr::from_ptr(msg) }
        .to_string_lossy()
        .into_owned();
    ORT_LOG.lock().unwrap().push(msg);
}

/// On ONNX Runtime: a file whose declared output shape the graph does not compute is
/// served (the config states the output), and ONNX Runtime's warning about it reaches
/// the server's log once, however many requests repeat it.
#[test]
fn onnxruntime_warnings_reach_the_log_once() {
    if std::env::var_os("INFER_ONNXRUNTIME_LIBRARY").is_none() {
        return;
    }
    let mut opts = std::ptr::null_mut();
    ok(unsafe { infer_server_options_new(&mut opts) });
    ok(unsafe {
        infer_server_options_set_log_callback(
            opts,
            INFER_LOG_WARN,
            Some(ort_log_line),
            std::ptr::null_mut(),
        )
    });
    let s = Server::with_options(opts);
    // Declared [n, 7]; computes [3]. (An output name no other test uses.)
    let m = model(
        vec![tensor("X", T::Float, &["3"])],
        vec![tensor("WARNED", T::Float, &["n", "7"])],
        vec![node("Relu", "r", &["X"], &["WARNED"])],
        vec![],
    );
    let dir = model_dir("onnx-ort-warning", &m);
    let cfg = format!(
        r#"name: "w" {PLATFORM} max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 3 ] }} ]
output [ {{ name: "WARNED" data_type: TYPE_FP32 dims: [ 3 ] }} ]"#
    );
    load_ok(&s, "w", &cfg, &dir);
    for _ in 0..5 {
        let r = run(&s, "w", -1, &[f32_in("X", &[3], &[-1., 0., 2.])]);
        assert_eq!(out_f32(&r, "WARNED"), (vec![3], vec![0., 0., 2.]));
    }
    let log = ORT_LOG.lock().unwrap().clone();
    // (Messages of other tests' models reach this log too: ONNX Runtime's messages are
    // process-wide.)
    let said: Vec<&String> = log
        .iter()
        .filter(|l| l.starts_with("ONNX Runtime: ") && l.contains("'WARNED'"))
        .collect();
    assert_eq!(said.len(), 1, "{log:#?}");
}

/// On ONNX Runtime, a request whose sizes the graph cannot take (allowed by a -1 in the
/// config) fails with ONNX Runtime's message, naming the model and the node (INTERNAL:
/// a kernel's failure does not say whose fault it is); the next request is served.
#[test]
fn onnxruntime_refuses_sizes_the_graph_cannot_take() {
    if std::env::var_os("INFER_ONNXRUNTIME_LIBRARY").is_none() {
        return;
    }
    let s = Server::new();
    // Y = X + B with B of 3 elements: X must have 3 columns.
    let m = model(
        vec![tensor("X", T::Float, &["n"])],
        vec![tensor("Y", T::Float, &["n"])],
        vec![node("Add", "add", &["X", "B"], &["Y"])],
        vec![init_f32("B", &[3], &[1., 2., 3.])],
    );
    let dir = model_dir("onnx-ort-sizes", &m);
    load_ok(&s, "z", &xy_config("z", 0, "-1", ""), &dir);
    let Err((st, msg)) = call(&s, "z", -1, &[f32_in("X", &[4], &[0.; 4])], &[]) else {
        panic!("a size the graph cannot take was served");
    };
    assert!(
        st == INFER_STATUS_INTERNAL || st == INFER_STATUS_INVALID_ARGUMENT,
        "{st}: {msg}"
    );
    assert_mentions(&msg, &["'z'", "add"]);
    let r = run(&s, "z", -1, &[f32_in("X", &[3], &[1., 1., 1.])]);
    assert_eq!(out_f32(&r, "Y"), (vec![3], vec![2., 3., 4.]));
}

/// Ragged batching on an ONNX model: a batch input is a graph input the library fills;
/// a ragged input must keep the config's rank in the model (it is not handed over
/// flattened yet), and a model declaring it flattened fails to load, naming it.
#[test]
fn onnx_batch_inputs_and_ragged_inputs() {
    let s = Server::new();
    // Y = X * ACC[0]: ACC (BATCH_ELEMENT_COUNT) is the element count of each request.
    let m = model(
        vec![
            tensor("X", T::Float, &["b", "n"]),
            tensor("ACC", T::Float, &["r"]),
        ],
        vec![tensor("Y", T::Float, &["b", "n"])],
        vec![node("Mul", "mul", &["X", "ACC"], &["Y"])],
        vec![],
    );
    let dir = model_dir("onnx-batch-input", &m);
    let config = |x_dims: &str| {
        format!(
            r#"backend: "tract" max_batch_size: 8
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ {x_dims} ] allow_ragged_batch: true }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }} ]
batch_input [ {{ kind: BATCH_ELEMENT_COUNT target_name: "ACC" data_type: TYPE_FP32 source_input: "X" }} ]"#
        )
    };
    load_ok(&s, "bi", &config("-1"), &dir);
    let r = s.infer(s.request("bi").input_f32("X", &[1, 3], &[1.0, 2.0, 3.0]));
    assert_eq!(r.status(), 0, "{}", r.error());
    assert_eq!(
        r.output_f32("Y"),
        vec![3.0, 6.0, 9.0],
        "X times its element count"
    );
    // The same file with X declared flattened, [n]: refused, naming X.
    let flat = model(
        vec![
            tensor("X", T::Float, &["n"]),
            tensor("ACC", T::Float, &["r"]),
        ],
        vec![tensor("Y", T::Float, &["n"])],
        vec![node("Mul", "mul", &["X", "ACC"], &["Y"])],
        vec![],
    );
    let dir = model_dir("onnx-ragged-flat", &flat);
    let msg = load_fails(
        &s,
        "flat",
        &config("-1"),
        &dir,
        INFER_STATUS_INVALID_ARGUMENT,
    );
    assert_mentions(&msg, &["'X'"]);
}
