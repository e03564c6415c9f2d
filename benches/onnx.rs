//! ONNX models on the CPU: what the library adds over tract called directly, and what
//! dynamic batching gains on the CNN.
//!
//! Run with `cargo bench --bench onnx -- [--secs S] [overhead] [batching] [ort]
//! [ort-batching]`; without a scenario the first three run (`ort` and `ort-batching` need
//! `INFER_ONNXRUNTIME_LIBRARY`; see [`ort_vs_direct`] and [`ort_batching`]). Models: the shipped `models/mlp` and `models/cnn`, and `mlp_wide`
//! (4 layers of 512, random weights with a fixed seed) written by this program to
//! `target/onnx-bench/` so that `benches/onnx_ort.py` can time onnxruntime on the same
//! files. See docs/PERFORMANCE.md.
//!
//! `lstm` (one LSTM layer, random weights, also written there) times the reset of the
//! run state before each run: tract called directly keeps the LSTM's state (wrong for
//! a server, the cost without the reset), the library starts every run afresh.
//!
//! * `overhead`: per model and batch size (1, 8, 64), mean time of one call with one
//!   request in flight: tract's plan run directly (input tensor built from the caller's
//!   slice, as an application would; on one run state kept from run to run, and on a
//!   fresh run state per run) vs the same model through the C API (request
//!   built, enqueued, FINAL response received), and the library's own measure of the
//!   execution (`compute_us`). Each is the median of 15 alternating rounds. The client
//!   spins `--spin-us` (20) waiting for the FINAL, then parks (a client that spins all
//!   along slows the worker down when the two vCPUs share a physical core);
//!   `--blocking` uses `infer_server_infer` instead.
//! * `batching`: the CNN with 64 requests of batch 1 in flight from one client, without
//!   a batcher and with dynamic batching: throughput, p50/p99 latency, mean batch.

use infer::ffi::request::*;
use infer::ffi::response::*;
use infer::ffi::server::*;
use infer::ffi::*;
use infer::request::{Request, Response};
use infer::server::ServerOptions;
use prost::Message;
use std::ffi::{c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};
use tract_onnx::pb;
use tract_onnx::prelude::*;

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
        let n = CString::new(name).unwrap();
        let c = CString::new(config).unwrap();
        let d = CString::new(dir.to_str().unwrap()).unwrap();
        check(
            unsafe { infer_server_load_model(self.0, n.as_ptr(), c.as_ptr(), d.as_ptr()) },
            "infer_server_load_model",
        );
    }

    fn stats(&self, model: &str) -> serde_json::Value {
        let n = CString::new(model).unwrap();
        let mut out = std::ptr::null_mut();
        check(
            unsafe { infer_server_statistics_json(self.0, n.as_ptr(), &mut out) },
            "infer_server_statistics_json",
        );
        let text = unsafe { CStr::from_ptr(out) }.to_str().unwrap().to_owned();
        unsafe { infer_string_free(out) };
        serde_json::from_str(&text).unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        unsafe { infer_server_free(self.0) };
    }
}

/// A model to time: its folder, input name and per-row input shape.
struct BenchModel {
    name: &'static str,
    dir: PathBuf,
    input: &'static str,
    row: Vec<i64>,
    output: &'static str,
}

impl BenchModel {
    fn row_elems(&self) -> usize {
        self.row.iter().product::<i64>() as usize
    }
    fn config(&self, dynamic: Option<u64>) -> String {
        let dims: Vec<String> = self.row.iter().map(|d| d.to_string()).collect();
        let batching = dynamic.map_or(String::new(), |us| {
            format!("dynamic_batching {{ max_queue_delay_microseconds: {us} }}")
        });
        format!(
            "name: \"{}\" platform: \"onnxruntime_onnx\" max_batch_size: 64\n\
             input [ {{ name: \"{}\" data_type: TYPE_FP32 dims: [ {} ] }} ]\n\
             output [ {{ name: \"{}\" data_type: TYPE_FP32 dims: [ -1 ] }} ]\n{batching}\n",
            self.name,
            self.input,
            dims.join(", "),
            self.output
        )
    }
}

// ---------------------------------------------------------------------------------------
// The wide MLP, written as ONNX with fixed-seed weights.

struct XorShift(u64);
impl XorShift {
    fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
    }
}

fn value_info(name: &str, dims: &[Option<i64>]) -> pb::ValueInfoProto {
    use pb::tensor_shape_proto::dimension::Value as D;
    let dim = dims
        .iter()
        .map(|d| pb::tensor_shape_proto::Dimension {
            value: Some(match d {
                Some(v) => D::DimValue(*v),
                None => D::DimParam("batch".into()),
            }),
            ..Default::default()
        })
        .collect();
    pb::ValueInfoProto {
        name: name.into(),
        r#type: Some(pb::TypeProto {
            value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                elem_type: pb::tensor_proto::DataType::Float as i32,
                shape: Some(pb::TensorShapeProto { dim }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn write_wide_mlp(dir: &Path) -> std::io::Result<()> {
    let widths = [512usize, 512, 512, 512, 10];
    let mut rng = XorShift(0x5eed_1234_abcd_0001);
    let mut nodes = Vec::new();
    let mut inits = Vec::new();
    let mut prev = "FEATURES".to_owned();
    for l in 0..widths.len() - 1 {
        let (k, n) = (widths[l], widths[l + 1]);
        let w: Vec<f32> = (0..k * n).map(|_| rng.next_f32()).collect();
        let b: Vec<f32> = (0..n).map(|_| rng.next_f32()).collect();
        for (name, dims, data) in [
            (format!("w{l}"), vec![k as i64, n as i64], w),
            (format!("b{l}"), vec![n as i64], b),
        ] {
            inits.push(pb::TensorProto {
                name,
                dims,
                data_type: pb::tensor_proto::DataType::Float as i32,
                float_data: data,
                ..Default::default()
            });
        }
        let last = l == widths.len() - 2;
        let out = if last {
            "LOGITS".to_owned()
        } else {
            format!("h{l}")
        };
        let gemm_out = if last { out.clone() } else { format!("g{l}") };
        nodes.push(pb::NodeProto {
            op_type: "Gemm".into(),
            name: format!("gemm{l}"),
            input: vec![prev.clone(), format!("w{l}"), format!("b{l}")],
            output: vec![gemm_out.clone()],
            ..Default::default()
        });
        if !last {
            nodes.push(pb::NodeProto {
                op_type: "Relu".into(),
                name: format!("relu{l}"),
                input: vec![gemm_out],
                output: vec![out.clone()],
                ..Default::default()
            });
        }
        prev = out;
    }
    write_model(
        dir,
        "mlp_wide",
        nodes,
        inits,
        value_info("FEATURES", &[None, Some(512)]),
        value_info("LOGITS", &[None, Some(10)]),
    )
}

/// One LSTM layer (batch first, 16 steps of 32 features, 64 hidden units, fixed-seed
/// weights) with its last hidden state flattened: X [batch, 16, 32] -> H [batch, 64].
/// Its initial states are zeros of the batch's size, made from X (tract needs them given
/// when the batch size is symbolic); ONNX's sequence-first layout, transposed around. tract keeps an LSTM's state between runs, so the
/// library resets it before each one; this model times that reset.
fn write_lstm(dir: &Path) -> std::io::Result<()> {
    let (steps, input, hidden) = (16i64, 32i64, 64i64);
    let mut rng = XorShift(0x5eed_1234_abcd_0002);
    let mut init = |name: &str, dims: Vec<i64>| pb::TensorProto {
        name: name.into(),
        float_data: (0..dims.iter().product::<i64>())
            .map(|_| rng.next_f32() * 4.0)
            .collect(),
        dims,
        data_type: pb::tensor_proto::DataType::Float as i32,
        ..Default::default()
    };
    let ints = |name: &str, v: &[i64]| pb::TensorProto {
        name: name.into(),
        dims: vec![v.len() as i64],
        data_type: pb::tensor_proto::DataType::Int64 as i32,
        int64_data: v.to_vec(),
        ..Default::default()
    };
    let inits = vec![
        init("W", vec![1, 4 * hidden, input]),
        init("R", vec![1, 4 * hidden, hidden]),
        init("B", vec![1, 8 * hidden]),
        pb::TensorProto {
            name: "ZERO".into(),
            dims: vec![input, hidden],
            data_type: pb::tensor_proto::DataType::Float as i32,
            float_data: vec![0.0; (input * hidden) as usize],
            ..Default::default()
        },
        ints("S0", &[0]),
        ints("S1", &[1]),
    ];
    let int_attr = |name: &str, i: i64| pb::AttributeProto {
        name: name.into(),
        r#type: pb::attribute_proto::AttributeType::Int as i32,
        i,
        ..Default::default()
    };
    let node = |op: &str, inputs: &[&str], output: &str| pb::NodeProto {
        op_type: op.into(),
        name: output.to_lowercase(),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: vec![output.into()],
        ..Default::default()
    };
    // ONNX's LSTM is sequence first ([steps, batch, ...]): onnxruntime runs no other
    // layout, so the batch-first input and output are transposed around it.
    let swap01 = |input: &str, output: &str| pb::NodeProto {
        attribute: vec![pb::AttributeProto {
            name: "perm".into(),
            r#type: pb::attribute_proto::AttributeType::Ints as i32,
            ints: vec![1, 0, 2],
            ..Default::default()
        }],
        ..node("Transpose", &[input], output)
    };
    let nodes = vec![
        swap01("X", "XT"),
        // [1, batch, 64] zeros: X's first step times a zero matrix.
        node("Slice", &["X", "S0", "S1", "S1"], "X0"),
        node("MatMul", &["X0", "ZERO"], "H0B"),
        swap01("H0B", "H0"),
        pb::NodeProto {
            op_type: "LSTM".into(),
            name: "lstm".into(),
            input: ["XT", "W", "R", "B", "", "H0", "H0"]
                .map(String::from)
                .to_vec(),
            output: vec![String::new(), "Y_h".into()],
            attribute: vec![int_attr("hidden_size", hidden)],
            ..Default::default()
        },
        swap01("Y_h", "Y_hB"),
        pb::NodeProto {
            attribute: vec![int_attr("axis", 1)],
            ..node("Flatten", &["Y_hB"], "H")
        },
    ];
    write_model(
        dir,
        "lstm",
        nodes,
        inits,
        value_info("X", &[None, Some(steps), Some(input)]),
        value_info("H", &[None, Some(hidden)]),
    )
}

/// Writes `<dir>/1/model.onnx`: one graph of opset 17 with one input and one output.
fn write_model(
    dir: &Path,
    name: &str,
    nodes: Vec<pb::NodeProto>,
    inits: Vec<pb::TensorProto>,
    input: pb::ValueInfoProto,
    output: pb::ValueInfoProto,
) -> std::io::Result<()> {
    let model = pb::ModelProto {
        ir_version: 8,
        opset_import: vec![pb::OperatorSetIdProto {
            domain: String::new(),
            version: 17,
        }],
        graph: Some(pb::GraphProto {
            name: name.into(),
            node: nodes,
            initializer: inits,
            input: vec![input],
            output: vec![output],
            ..Default::default()
        }),
        ..Default::default()
    };
    std::fs::create_dir_all(dir.join("1"))?;
    std::fs::write(dir.join("1").join("model.onnx"), model.encode_to_vec())
}

// ---------------------------------------------------------------------------------------
// tract called directly, planned the way the library plans (symbolic batch).

struct Direct {
    plan: Arc<TypedRunnableModel>,
    state: TypedSimpleState,
}

impl Direct {
    fn new(m: &BenchModel) -> TractResult<Direct> {
        let mut model = tract_onnx::onnx().model_for_path(m.dir.join("1").join("model.onnx"))?;
        let batch = model.symbols.sym("batch_size");
        let mut shape: TVec<TDim> = tvec![batch.to_dim()];
        shape.extend(m.row.iter().map(|&d| TDim::from(d)));
        model.set_input_fact(0, InferenceFact::dt_shape(f32::datum_type(), shape))?;
        let plan = model.into_optimized()?.into_runnable()?;
        Ok(Direct {
            state: plan.spawn()?,
            plan,
        })
    }

    /// One run on the state kept from run to run (what tract keeps in it, such as an
    /// LSTM's last state, carries over).
    fn run(&mut self, shape: &[usize], data: &[f32]) -> TractResult<f32> {
        let t = Tensor::from_shape(shape, data)?;
        let out = self.state.run(tvec![t.into_tvalue()])?;
        first_value(&out)
    }

    /// One run on a run state of its own (`SimplePlan::run` spawns one), as a tract user
    /// who needs every run to start afresh writes it.
    fn run_fresh(&self, shape: &[usize], data: &[f32]) -> TractResult<f32> {
        let t = Tensor::from_shape(shape, data)?;
        let out = self.plan.run(tvec![t.into_tvalue()])?;
        first_value(&out)
    }
}

fn first_value(out: &[TValue]) -> TractResult<f32> {
    Ok(out[0]
        .to_plain_array_view::<f32>()?
        .iter()
        .next()
        .copied()
        .unwrap_or(f32::NAN))
}

// ---------------------------------------------------------------------------------------
// One request in flight through the C API.

struct Slot {
    done: AtomicBool,
    resp: AtomicPtr<Response>,
    /// The client thread, parked once it has spun for a while.
    client: std::thread::Thread,
}

unsafe extern "C" fn slot_cb(ud: *mut c_void, resp: *mut Response, flags: u32) {
    if flags & INFER_RESPONSE_FLAG_FINAL == 0 {
        infer_response_free(resp);
        return;
    }
    let slot = &*(ud as *const Slot);
    slot.resp.store(resp, Ordering::Relaxed);
    let client = slot.client.clone();
    slot.done.store(true, Ordering::Release);
    client.unpark();
}

fn build_request(s: &Server, m: &CStr, input: &CStr, shape: &[i64], data: &[f32]) -> *mut Request {
    unsafe {
        let mut r = std::ptr::null_mut();
        check(
            infer_request_new(s.0, m.as_ptr(), -1, &mut r),
            "infer_request_new",
        );
        check(
            infer_request_add_input(
                r,
                input.as_ptr(),
                INFER_DATATYPE_FP32,
                shape.as_ptr(),
                shape.len(),
                data.as_ptr() as *const c_void,
                std::mem::size_of_val(data),
            ),
            "infer_request_add_input",
        );
        r
    }
}

fn first_output(resp: *mut Response, name: &CStr) -> f32 {
    unsafe {
        let st = infer_response_status(resp);
        if st != INFER_STATUS_OK {
            let msg = CStr::from_ptr(infer_response_error_message(resp));
            eprintln!("request failed: {st}: {}", msg.to_string_lossy());
            std::process::exit(1);
        }
        let (mut dt, mut shape, mut nd, mut data, mut bs) =
            (0, std::ptr::null(), 0usize, std::ptr::null(), 0usize);
        check(
            infer_response_output_by_name(
                resp,
                name.as_ptr(),
                &mut dt,
                &mut shape,
                &mut nd,
                &mut data,
                &mut bs,
            ),
            "infer_response_output_by_name",
        );
        let v = *(data as *const f32);
        infer_response_free(resp);
        v
    }
}

fn inputs(m: &BenchModel, batch: usize) -> Vec<f32> {
    let mut rng = XorShift(0x1234_5678 + batch as u64);
    (0..batch * m.row_elems())
        .map(|_| rng.next_f32() * 10.0)
        .collect()
}

/// Rounds each side of the overhead comparison is timed in.
const ROUNDS: usize = 15;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Times `f` for about `secs` (at least 20 calls) after a warm-up; mean microseconds.
fn time_mean(secs: f64, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    let start = Instant::now();
    let mut n = 0u64;
    while n < 20 || start.elapsed().as_secs_f64() < secs {
        f();
        n += 1;
    }
    start.elapsed().as_secs_f64() * 1e6 / n as f64
}

fn overhead(models: &[BenchModel], secs: f64, blocking: bool, spin_us: u64) {
    let how = if blocking {
        "infer_server_infer (the caller blocks)"
    } else {
        "enqueue + callback (the caller spins, then parks)"
    };
    println!("## overhead: one request in flight, {how}, mean microseconds per call");
    println!("| model | batch | tract direct (us) | tract direct, fresh state (us) | compute inside libinfer (us) | libinfer C API (us) | overhead (us) | overhead (%) |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let s = Server::new();
    for m in models {
        s.load(m.name, &m.config(None), &m.dir);
        let name = CString::new(m.name).unwrap();
        let input = CString::new(m.input).unwrap();
        let output = CString::new(m.output).unwrap();
        for batch in [1usize, 8, 64] {
            // A run state of its own per batch size: the LSTM's, which carries its hidden
            // state from run to run, then only ever sees this size.
            let mut direct = match Direct::new(m) {
                Ok(d) => d,
                Err(e) => {
                    eprintln!("tract cannot plan {}: {e:#}", m.name);
                    std::process::exit(1);
                }
            };
            let data = inputs(m, batch);
            let mut shape_i: Vec<i64> = vec![batch as i64];
            shape_i.extend(&m.row);
            let shape_u: Vec<usize> = shape_i.iter().map(|&d| d as usize).collect();
            // Both paths must compute the same thing.
            let want = direct.run(&shape_u, &data).unwrap_or(f32::NAN);
            let slot = Slot {
                done: AtomicBool::new(false),
                resp: AtomicPtr::new(std::ptr::null_mut()),
                client: std::thread::current(),
            };
            let call = || {
                let r = build_request(&s, &name, &input, &shape_i, &data);
                if blocking {
                    // infer_server_infer: the caller sleeps on a condition variable.
                    let mut resp = std::ptr::null_mut();
                    check(
                        unsafe { infer_server_infer(s.0, r, &mut resp) },
                        "infer_server_infer",
                    );
                    return first_output(resp, &output);
                }
                slot.done.store(false, Ordering::Relaxed);
                check(
                    unsafe {
                        infer_server_enqueue(
                            s.0,
                            r,
                            Some(slot_cb),
                            &slot as *const Slot as *mut c_void,
                            std::ptr::null_mut(),
                        )
                    },
                    "infer_server_enqueue",
                );
                // Spin for `spin_us` (short calls answer fastest that way), then park so
                // that a spinning client does not slow the worker down on a shared core.
                let spin_until = Instant::now() + Duration::from_micros(spin_us);
                while !slot.done.load(Ordering::Acquire) {
                    if Instant::now() < spin_until {
                        std::hint::spin_loop();
                    } else {
                        std::thread::park_timeout(Duration::from_millis(1));
                    }
                }
                first_output(slot.resp.load(Ordering::Relaxed), &output)
            };
            let got = call();
            if (got - want).abs() > 1e-4 * want.abs().max(1.0) {
                eprintln!(
                    "{} batch {batch}: libinfer gives {got}, tract {want}",
                    m.name
                );
                std::process::exit(1);
            }
            // Alternate short rounds of the two so drifts of the machine hit both alike;
            // the median round of each resists bursts of other work on the machine.
            let before = s.stats(m.name);
            let (mut tds, mut tfs, mut tls) = (Vec::new(), Vec::new(), Vec::new());
            let slice = secs / (3.0 * ROUNDS as f64);
            for _ in 0..ROUNDS {
                tds.push(time_mean(slice, || {
                    std::hint::black_box(direct.run(&shape_u, &data).unwrap_or(0.0));
                }));
                tfs.push(time_mean(slice, || {
                    std::hint::black_box(direct.run_fresh(&shape_u, &data).unwrap_or(0.0));
                }));
                tls.push(time_mean(slice, || {
                    std::hint::black_box(call());
                }));
            }
            let (td, tf, tl) = (median(&mut tds), median(&mut tfs), median(&mut tls));
            let after = s.stats(m.name);
            let total = |v: &serde_json::Value, k: &str| {
                v["models"][0]["compute_us"][k].as_f64().unwrap_or(0.0)
            };
            let compute = (total(&after, "total") - total(&before, "total"))
                / (total(&after, "count") - total(&before, "count")).max(1.0);
            println!(
                "| {} | {batch} | {td:.1} | {tf:.1} | {compute:.1} | {tl:.1} | {:.1} | {:.1} |",
                m.name,
                tl - td,
                (tl - td) / td * 100.0
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// 64 requests in flight on the CNN.

struct Window {
    state: Mutex<(usize, Vec<u64>)>,
    cv: Condvar,
}

struct Tag {
    window: *const Window,
    start: Instant,
}

unsafe extern "C" fn window_cb(ud: *mut c_void, resp: *mut Response, flags: u32) {
    let final_ = flags & INFER_RESPONSE_FLAG_FINAL != 0;
    if final_ && infer_response_status(resp) != INFER_STATUS_OK {
        let msg = CStr::from_ptr(infer_response_error_message(resp));
        eprintln!("request failed: {}", msg.to_string_lossy());
        std::process::exit(1);
    }
    infer_response_free(resp);
    if !final_ {
        return;
    }
    let tag = Box::from_raw(ud as *mut Tag);
    let w = &*tag.window;
    let us = tag.start.elapsed().as_micros() as u64;
    let mut st = w.state.lock().unwrap();
    st.0 -= 1;
    st.1.push(us);
    drop(st);
    w.cv.notify_one();
}

/// Returns the best requests/s with dynamic batching.
fn batching(cnn: &BenchModel, secs: f64) -> f64 {
    let mut best = 0f64;
    println!(
        "## batching: {}, 64 requests of batch 1 in flight, one instance",
        cnn.name
    );
    println!("| scheduler | requests/s | p50 (us) | p99 (us) | mean batch |");
    println!("|---|---:|---:|---:|---:|");
    let cases: [(&str, Option<u64>); 3] = [
        ("none (default scheduler)", None),
        ("dynamic, delay 0", Some(0)),
        ("dynamic, delay 500 us", Some(500)),
    ];
    let data = inputs(cnn, 1);
    let mut shape: Vec<i64> = vec![1];
    shape.extend(&cnn.row);
    let input = CString::new(cnn.input).unwrap();
    for (label, dynamic) in cases {
        let s = Server::new();
        s.load(cnn.name, &cnn.config(dynamic), &cnn.dir);
        let name = CString::new(cnn.name).unwrap();
        let w = Window {
            state: Mutex::new((0, Vec::new())),
            cv: Condvar::new(),
        };
        let run = |dur: Duration| -> (u64, Vec<u64>) {
            w.state.lock().unwrap().1.clear();
            let start = Instant::now();
            let mut sent = 0u64;
            while start.elapsed() < dur {
                {
                    let mut st = w.state.lock().unwrap();
                    while st.0 >= 64 {
                        st = w.cv.wait(st).unwrap();
                    }
                    st.0 += 1;
                }
                let r = build_request(&s, &name, &input, &shape, &data);
                let tag = Box::into_raw(Box::new(Tag {
                    window: &w,
                    start: Instant::now(),
                }));
                check(
                    unsafe {
                        infer_server_enqueue(
                            s.0,
                            r,
                            Some(window_cb),
                            tag as *mut c_void,
                            std::ptr::null_mut(),
                        )
                    },
                    "infer_server_enqueue",
                );
                sent += 1;
            }
            let mut st = w.state.lock().unwrap();
            while st.0 > 0 {
                st = w.cv.wait(st).unwrap();
            }
            let lat = std::mem::take(&mut st.1);
            (sent, lat)
        };
        run(Duration::from_secs_f64(0.3));
        let before = s.stats(cnn.name);
        let t0 = Instant::now();
        let (sent, mut lat) = run(Duration::from_secs_f64(secs));
        let elapsed = t0.elapsed().as_secs_f64();
        let after = s.stats(cnn.name);
        lat.sort_unstable();
        let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
        let count = |v: &serde_json::Value, k: &str| v["models"][0][k].as_u64().unwrap_or(0);
        let execs = count(&after, "execution_count") - count(&before, "execution_count");
        let infs = count(&after, "inference_count") - count(&before, "inference_count");
        println!(
            "| {label} | {:.0} | {} | {} | {:.1} |",
            sent as f64 / elapsed,
            pct(0.50),
            pct(0.99),
            infs as f64 / execs.max(1) as f64
        );
        if dynamic.is_some() {
            best = best.max(sent as f64 / elapsed);
        }
    }
    best
}

/// `ort-batching`: on ONNX Runtime, dynamic batching with 64 requests in flight against
/// ONNX Runtime called directly one request at a time (its default threads on both
/// sides), on the CNN and, with `INFER_PACKAGED_MODELS_DIR`, PP-OCR's direction
/// classifier (a MobileNet) at 3x48x192.
fn ort_batching(cnn: &BenchModel, secs: f64) {
    use infer::onnx::onnxruntime::{runtime, RuntimeOptions};
    let Ok(rt) = runtime(&RuntimeOptions::default(), &infer::log::Logger::default()) else {
        println!("ort-batching: SKIPPED: ONNX Runtime is not loaded");
        return;
    };
    let mut models = vec![BenchModel {
        name: cnn.name,
        dir: cnn.dir.clone(),
        input: cnn.input,
        row: cnn.row.clone(),
        output: cnn.output,
    }];
    if let Some(root) = std::env::var_os("INFER_PACKAGED_MODELS_DIR").map(PathBuf::from) {
        if root.join("ppocr_cls").is_dir() {
            models.push(BenchModel {
                name: "ppocr_cls",
                dir: root.join("ppocr_cls"),
                input: "x",
                row: vec![3, 48, 192],
                output: "save_infer_model/scale_0.tmp_1",
            });
        }
    }
    for m in &models {
        let file = m.dir.join("1").join("model.onnx");
        let mut direct = match ort::session::Session::builder(&rt.env)
            .and_then(|mut b| b.commit_from_file(&file))
        {
            Ok(d) => d,
            Err(e) => {
                println!("{}: direct session: {e}", m.name);
                continue;
            }
        };
        let x = inputs(m, 1);
        let shape: Vec<i64> = std::iter::once(1).chain(m.row.iter().copied()).collect();
        let us = time_mean(secs, || {
            let t = ort::value::TensorRef::<f32>::from_array_view((shape.clone(), &x[..]))
                .expect("input");
            let o = direct.run(vec![(m.input, t)]).expect("direct run");
            std::hint::black_box(&o);
        });
        let direct_rps = 1e6 / us;
        println!(
            "\n{}: ONNX Runtime called directly, one request at a time: {direct_rps:.0} requests/s",
            m.name
        );
        let best = batching(m, secs);
        println!(
            "{}: dynamic batching through libinfer, best: {best:.0} requests/s = {:.2}x the direct calls",
            m.name,
            best / direct_rps
        );
    }
}

/// A model the `ort` scenario times: its folder, config, one input and one output.
struct OrtCase {
    name: String,
    dir: PathBuf,
    config: String,
    input: String,
    shape: Vec<i64>,
    output: String,
}

/// The bench models at batch 1, then the real models of `INFER_PACKAGED_MODELS_DIR`
/// (scripts/packaged_models.py) with one FP32 input, at their first case's shape.
fn ort_cases(models: &[BenchModel]) -> Vec<OrtCase> {
    let mut cases: Vec<OrtCase> = models
        .iter()
        .map(|m| OrtCase {
            name: m.name.to_owned(),
            dir: m.dir.clone(),
            config: m.config(None),
            input: m.input.to_owned(),
            shape: std::iter::once(1).chain(m.row.iter().copied()).collect(),
            output: m.output.to_owned(),
        })
        .collect();
    let Some(root) = std::env::var_os("INFER_PACKAGED_MODELS_DIR").map(PathBuf::from) else {
        return cases;
    };
    for name in [
        "ppocr_cls",
        "ppocr_det",
        "ppocr_rec",
        "ddddocr_common",
        "ddddocr_det",
    ] {
        let dir = root.join(name);
        let (Ok(config), Ok(text)) = (
            std::fs::read_to_string(dir.join("config.pbtxt")),
            std::fs::read_to_string(dir.join("cases.json")),
        ) else {
            continue;
        };
        let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        let case = &v["cases"][0];
        let (Some(input), Some(output)) = (
            case["inputs"][0].as_object(),
            case["outputs"][0].as_object(),
        ) else {
            continue;
        };
        let shape: Vec<i64> = input["shape"]
            .as_array()
            .map(|a| a.iter().filter_map(|d| d.as_i64()).collect())
            .unwrap_or_default();
        cases.push(OrtCase {
            name: name.to_owned(),
            dir,
            config,
            input: input["name"].as_str().unwrap_or_default().to_owned(),
            shape,
            output: output["name"].as_str().unwrap_or_default().to_owned(),
        });
    }
    cases
}

/// `ort`: the ONNX Runtime engine through the C API against ONNX Runtime called directly
/// (the same library, the same model file, one intra-op thread each), batch 1, one request
/// in flight, interleaved: per round the mean call time of each side, then the median of
/// the per-round ratios with their range. Needs `INFER_ONNXRUNTIME_LIBRARY`; with
/// `INFER_PACKAGED_MODELS_DIR`, also the real models of scripts/packaged_models.py.
fn ort_vs_direct(models: &[BenchModel], secs: f64) {
    use infer::onnx::onnxruntime::{runtime, RuntimeOptions};
    let log = infer::log::Logger::default();
    let rt = match runtime(&RuntimeOptions::default(), &log) {
        Ok(rt) => rt,
        Err(e) => {
            println!("ort: SKIPPED: {e}");
            return;
        }
    };
    println!(
        "\n== ort: libinfer's ONNX Runtime engine vs ONNX Runtime {} called directly (1 intra-op thread each, batch 1, {ROUNDS} interleaved rounds)",
        rt.version
    );
    println!(
        "{:<15} {:>12} {:>12} {:>8} {:>16}",
        "model", "direct µs", "libinfer µs", "ratio", "ratio range"
    );
    let s = Server::new();
    for m in ort_cases(models) {
        let file = m.dir.join("1").join("model.onnx");
        let name = format!("{}_ort", m.name);
        let config = m.config.replacen(
            &format!("name: \"{}\"", m.name),
            &format!("name: \"{name}\""),
            1,
        )
            + "\nparameters { key: \"intra_op_thread_count\" value: { string_value: \"1\" } }\n\
             parameters { key: \"onnxruntime_required\" value: { string_value: \"1\" } }\n";
        s.load(&name, &config, &m.dir);
        let mut direct = match ort::session::Session::builder(&rt.env)
            .and_then(|b| Ok(b.with_intra_threads(1)?))
            .and_then(|mut b| b.commit_from_file(&file))
        {
            Ok(d) => d,
            Err(e) => {
                println!("{}: direct session: {e}", m.name);
                continue;
            }
        };
        let n: i64 = m.shape.iter().product();
        let mut rng = XorShift(0x1234_5678);
        let x: Vec<f32> = (0..n).map(|_| rng.next_f32()).collect();
        let shape = m.shape.clone();
        let mn = CString::new(name.as_str()).unwrap();
        let inp = CString::new(m.input.as_str()).unwrap();
        let out = CString::new(m.output.as_str()).unwrap();
        let (mut d_us, mut l_us, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let d = time_mean(secs / ROUNDS as f64, || {
                let t = ort::value::TensorRef::<f32>::from_array_view((shape.clone(), &x[..]))
                    .expect("input");
                let o = direct.run(vec![(m.input.as_str(), t)]).expect("direct run");
                std::hint::black_box(&o);
            });
            let l = time_mean(secs / ROUNDS as f64, || {
                let r = build_request(&s, &mn, &inp, &shape, &x);
                let mut resp = std::ptr::null_mut();
                check(
                    unsafe { infer_server_infer(s.0, r, &mut resp) },
                    "infer_server_infer",
                );
                std::hint::black_box(first_output(resp, &out));
            });
            d_us.push(d);
            l_us.push(l);
            ratios.push(l / d);
        }
        let (lo, hi) = ratios
            .iter()
            .fold((f64::MAX, 0f64), |(a, b), &r| (a.min(r), b.max(r)));
        println!(
            "{:<15} {:>12.1} {:>12.1} {:>8.3} {:>7.3} – {:<7.3}",
            m.name,
            median(&mut d_us),
            median(&mut l_us),
            median(&mut ratios),
            lo,
            hi
        );
    }
}

fn main() {
    let mut secs = 3.0;
    let mut blocking = false;
    let mut spin_us = 20u64;
    let mut scenarios: Vec<String> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--secs" => secs = args.next().and_then(|v| v.parse().ok()).unwrap_or(secs),
            "--bench" => {}
            "--blocking" => blocking = true,
            "--spin-us" => spin_us = args.next().and_then(|v| v.parse().ok()).unwrap_or(spin_us),
            "-h" | "--help" => {
                println!(
                    "cargo bench --bench onnx -- [--secs S] [--blocking] [--spin-us N] [overhead] [batching] [ort] [ort-batching]"
                );
                return;
            }
            s if s.starts_with('-') => {}
            s => scenarios.push(s.to_owned()),
        }
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let wide = root.join("target").join("onnx-bench").join("mlp_wide");
    if let Err(e) = write_wide_mlp(&wide) {
        eprintln!("cannot write {}: {e}", wide.display());
        std::process::exit(1);
    }
    let lstm = root.join("target").join("onnx-bench").join("lstm");
    if let Err(e) = write_lstm(&lstm) {
        eprintln!("cannot write {}: {e}", lstm.display());
        std::process::exit(1);
    }
    let models = [
        BenchModel {
            name: "mlp",
            dir: root.join("models").join("mlp"),
            input: "FEATURES",
            row: vec![64],
            output: "LOGITS",
        },
        BenchModel {
            name: "cnn",
            dir: root.join("models").join("cnn"),
            input: "PIXELS",
            row: vec![1, 28, 28],
            output: "LOGITS",
        },
        BenchModel {
            name: "mlp_wide",
            dir: wide,
            input: "FEATURES",
            row: vec![512],
            output: "LOGITS",
        },
        BenchModel {
            name: "lstm",
            dir: lstm,
            input: "X",
            row: vec![16, 32],
            output: "H",
        },
    ];
    let all = scenarios.is_empty();
    if all || scenarios.iter().any(|s| s == "overhead") {
        overhead(&models, secs, blocking, spin_us);
    }
    if all || scenarios.iter().any(|s| s == "batching") {
        batching(&models[1], secs);
    }
    if scenarios.iter().any(|s| s == "ort-batching") {
        ort_batching(&models[1], secs);
    }
    if all || scenarios.iter().any(|s| s == "ort") {
        ort_vs_direct(&models[..3], secs);
    }
}
