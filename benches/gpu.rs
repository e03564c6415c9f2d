//! ONNX models on an NVIDIA GPU (the GPU executor of `src/onnx/gpu`), through the C API.
//!
//! Run with `cargo bench --bench gpu`. Without a usable GPU (`infer_server_new` with
//! `INFER_GPU_REQUIRED` fails) it prints `SKIP: <reason>` and exits 0. See
//! docs/PERFORMANCE.md ("GPU"); `python3 benches/torch_reference.py` times PyTorch eager
//! on the same architectures and prints the same columns.
//!
//! Models, on one `KIND_GPU` instance on GPU 0, `max_batch_size: 256`:
//! * `mlp`: 4 Gemm layers 4096 -> 4096 with Relu between, input `FEATURES` [batch, 4096],
//!   random FP32 weights from a fixed seed, written as ONNX (opset 17, IR 8) to a
//!   temporary folder (removed at the end).
//! * `cnn`: the repository's `models/cnn` (Conv 3x3 8ch, Relu, MaxPool 2, Conv 3x3 16ch,
//!   Relu, MaxPool 2, Flatten, Gemm 784 -> 10; input `PIXELS` [batch, 1, 28, 28]), with a
//!   config written here (the shipped one leaves max_batch_size to the model's default).
//!
//! Parts:
//! * `check`: one batch through the GPU and through a CPU server (tract), compared.
//! * `latency`: `infer_server_infer`, one request in flight, batch 1, 8, 64, 256: p50,
//!   mean and p99 of the call, samples/s, the MLP's effective TFLOP/s
//!   (2 * batch * 4096 * 4096 * 4 flop per inference) and the library's own `compute_us`.
//! * `e2e`: the MLP with `dynamic_batching { max_queue_delay_microseconds: 100 }` on two
//!   GPU instances; N client threads, each sending batch-1 requests back to back
//!   (`infer_server_enqueue`, waiting for the FINAL callback): requests/s, latency and the
//!   mean executed batch (`inference_count / execution_count` of the statistics JSON).
//! * `cublas`: the executor's GEMM shape called directly through cuBLAS
//!   (`infer::cuda::cublas::Blas`), 4096 x 4096 x batch, timed with a stream
//!   synchronize after every block of calls: the TFLOP/s the MLP's GEMMs could reach.
//!
//! Knobs (environment): INFER_BENCH_SECONDS (measured seconds per row, 2),
//! INFER_BENCH_WARMUP_SECONDS (0.5), INFER_BENCH_MIN_ITERS (20), INFER_BENCH_BATCHES
//! (1,8,64,256), INFER_BENCH_CLIENTS (16,64,256), INFER_BENCH_MODELS (mlp,cnn),
//! INFER_BENCH_PARTS (check,latency,e2e,cublas), INFER_BENCH_MLP_WIDTH (4096),
//! INFER_BENCH_TF32 (0: FP32 GEMMs; 1 sets the model parameter `allow_tf32` and TF32 in
//! the cuBLAS reference), INFER_BENCH_MAX_QUEUE_DELAY_US (100),
//! INFER_BENCH_CUDA_GRAPH_MAX_BATCH (unset: no CUDA graphs; N sets the model parameter
//! `cuda_graph_max_batch` on the GPU models, to compare batches of up to N rows with and
//! without graphs), INFER_BENCH_PRECISION (unset: FP32; FP16 or BF16 sets the model
//! parameter `precision`, computing the FP32 models in 16 bits on tensor cores; the
//! `check` tolerance widens to 2e-2 of the largest value for FP16 and 6e-2 for BF16).

use infer::ffi::request::*;
use infer::ffi::response::*;
use infer::ffi::server::*;
use infer::ffi::*;
use infer::request::{Request, Response};
use infer::server::ServerOptions;
use prost::Message;
use std::ffi::{c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};
use tract_onnx::pb;

// ---------------------------------------------------------------------------------------
// Knobs.

fn env_f64(name: &str, default: f64) -> f64 {
    match std::env::var(name) {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            fail(&format!("{name}={v:?}: expected a number"));
        }),
        Err(_) => default,
    }
}

fn env_usizes(name: &str, default: &[usize]) -> Vec<usize> {
    match std::env::var(name) {
        Ok(v) => v
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|s| {
                s.trim()
                    .parse()
                    .ok()
                    .filter(|&n: &usize| n > 0)
                    .unwrap_or_else(|| fail(&format!("{name}={v:?}: expected numbers > 0")))
            })
            .collect(),
        Err(_) => default.to_vec(),
    }
}

fn env_words(name: &str, default: &[&str]) -> Vec<String> {
    match std::env::var(name) {
        Ok(v) => v
            .split(',')
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .collect(),
        Err(_) => default.iter().map(|s| s.to_string()).collect(),
    }
}

struct Knobs {
    secs: f64,
    warmup_secs: f64,
    min_iters: usize,
    batches: Vec<usize>,
    clients: Vec<usize>,
    models: Vec<String>,
    parts: Vec<String>,
    width: usize,
    tf32: bool,
    delay_us: u64,
}

impl Knobs {
    fn from_env() -> Knobs {
        let tf32 = std::env::var("INFER_BENCH_TF32")
            .is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
        Knobs {
            secs: env_f64("INFER_BENCH_SECONDS", 2.0),
            warmup_secs: env_f64("INFER_BENCH_WARMUP_SECONDS", 0.5),
            min_iters: env_f64("INFER_BENCH_MIN_ITERS", 20.0).max(1.0) as usize,
            batches: env_usizes("INFER_BENCH_BATCHES", &[1, 8, 64, 256]),
            clients: env_usizes("INFER_BENCH_CLIENTS", &[16, 64, 256]),
            models: env_words("INFER_BENCH_MODELS", &["mlp", "cnn"]),
            parts: env_words("INFER_BENCH_PARTS", &["check", "latency", "e2e", "cublas"]),
            width: env_usizes("INFER_BENCH_MLP_WIDTH", &[4096])[0],
            tf32,
            delay_us: env_f64("INFER_BENCH_MAX_QUEUE_DELAY_US", 100.0) as u64,
        }
    }
    fn part(&self, p: &str) -> bool {
        self.parts.iter().any(|x| x == p)
    }
    fn model(&self, m: &str) -> bool {
        self.models.iter().any(|x| x == m)
    }
    fn max_batch(&self) -> usize {
        self.batches.iter().copied().max().unwrap_or(1).max(256)
    }
}

// ---------------------------------------------------------------------------------------
// Errors: the temporary folder goes too.

static TEMP_DIR: OnceLock<PathBuf> = OnceLock::new();

fn fail(msg: &str) -> ! {
    eprintln!("{msg}");
    if let Some(d) = TEMP_DIR.get() {
        let _ = std::fs::remove_dir_all(d);
    }
    std::process::exit(1);
}

fn last_error() -> String {
    unsafe { CStr::from_ptr(infer_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// INFER_BENCH_PRECISION, when set to something other than FP32.
fn precision() -> Option<String> {
    std::env::var("INFER_BENCH_PRECISION")
        .ok()
        .filter(|p| !p.is_empty() && !p.eq_ignore_ascii_case("FP32"))
}

fn check(st: infer_status, what: &str) {
    if st != INFER_STATUS_OK {
        fail(&format!("{what} failed: status {st}: {}", last_error()));
    }
}

// ---------------------------------------------------------------------------------------
// The server through the C API.

struct Server(*mut ServerHandle);
unsafe impl Send for Server {}
unsafe impl Sync for Server {}

impl Server {
    /// A server in GPU `mode`; Err is the library's message.
    fn new(mode: u32) -> Result<Server, String> {
        unsafe {
            let mut o: *mut ServerOptions = std::ptr::null_mut();
            check(infer_server_options_new(&mut o), "infer_server_options_new");
            check(infer_server_options_set_gpu(o, mode), "set_gpu");
            let mut s = std::ptr::null_mut();
            let st = infer_server_new(o, &mut s);
            let msg = last_error();
            infer_server_options_free(o);
            if st == INFER_STATUS_OK {
                Ok(Server(s))
            } else {
                Err(msg)
            }
        }
    }

    fn load(&self, name: &str, config: &str, dir: &Path) {
        let n = CString::new(name).unwrap();
        let c = CString::new(config).unwrap();
        let d = CString::new(dir.to_str().unwrap()).unwrap();
        let st = unsafe { infer_server_load_model(self.0, n.as_ptr(), c.as_ptr(), d.as_ptr()) };
        if st != INFER_STATUS_OK {
            fail(&format!(
                "loading '{name}' from {} failed: status {st}: {}\nconfig:\n{config}",
                dir.display(),
                last_error()
            ));
        }
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

    fn request(&self, model: &CStr, input: &CStr, shape: &[i64], data: &[f32]) -> *mut Request {
        self.request_in(model, input, shape, data, INFER_MEMORY_CPU)
    }

    /// A request whose input lies in host memory of type `mem` (INFER_MEMORY_CPU, or
    /// INFER_MEMORY_CPU_PINNED for page-locked memory).
    fn request_in(
        &self,
        model: &CStr,
        input: &CStr,
        shape: &[i64],
        data: &[f32],
        mem: u32,
    ) -> *mut Request {
        unsafe {
            let mut r = std::ptr::null_mut();
            check(
                infer_request_new(self.0, model.as_ptr(), -1, &mut r),
                "infer_request_new",
            );
            let bytes = std::mem::size_of_val(data);
            let status = if copy_input() {
                infer_request_add_input(
                    r,
                    input.as_ptr(),
                    INFER_DATATYPE_FP32,
                    shape.as_ptr(),
                    shape.len(),
                    data.as_ptr() as *const c_void,
                    bytes,
                )
            } else {
                // The caller's rows are read in place (they outlive the request).
                infer_request_add_input_borrowed(
                    r,
                    input.as_ptr(),
                    INFER_DATATYPE_FP32,
                    shape.as_ptr(),
                    shape.len(),
                    data.as_ptr() as *const c_void,
                    bytes,
                    mem,
                    0,
                    None,
                    std::ptr::null_mut(),
                )
            };
            check(status, "infer_request_add_input");
            r
        }
    }

    /// `infer_server_infer`; the response, checked OK.
    fn infer(&self, r: *mut Request) -> *mut Response {
        let mut resp = std::ptr::null_mut();
        check(
            unsafe { infer_server_infer(self.0, r, &mut resp) },
            "infer_server_infer",
        );
        ok_response(resp);
        resp
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        unsafe { infer_server_free(self.0) };
    }
}

fn ok_response(resp: *mut Response) {
    let st = unsafe { infer_response_status(resp) };
    if st != INFER_STATUS_OK {
        let msg = unsafe { CStr::from_ptr(infer_response_error_message(resp)) };
        fail(&format!(
            "request failed: status {st}: {}",
            msg.to_string_lossy()
        ));
    }
}

/// The FP32 output `name` of a response (copied out).
fn output_f32(resp: *mut Response, name: &CStr) -> Vec<f32> {
    let (mut dt, mut shape, mut nd, mut data, mut bytes) =
        (0, std::ptr::null(), 0usize, std::ptr::null(), 0usize);
    check(
        unsafe {
            infer_response_output_by_name(
                resp,
                name.as_ptr(),
                &mut dt,
                &mut shape,
                &mut nd,
                &mut data,
                &mut bytes,
            )
        },
        "infer_response_output_by_name",
    );
    let raw = unsafe { std::slice::from_raw_parts(data as *const u8, bytes) };
    bytemuck::pod_collect_to_vec(raw)
}

// ---------------------------------------------------------------------------------------
// The models.

struct XorShift(u64);
impl XorShift {
    /// Uniform in [-1, 1).
    fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// A model to time: its folder, input and output names, per-sample input shape, and the
/// flop of one sample (None: not reported).
struct BenchModel {
    name: String,
    dir: PathBuf,
    input: &'static str,
    row: Vec<i64>,
    output: &'static str,
    out_row: Vec<i64>,
    flop_per_sample: Option<f64>,
}

impl BenchModel {
    fn row_elems(&self) -> usize {
        self.row.iter().product::<i64>() as usize
    }

    /// A complete config: nothing is left to be filled in from the model (which would
    /// also add a dynamic batcher).
    fn config(
        &self,
        name: &str,
        max_batch: usize,
        gpu_instances: Option<u32>,
        dynamic: Option<u64>,
        tf32: bool,
    ) -> String {
        let dims = |d: &[i64]| {
            d.iter()
                .map(|v| v.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut c = format!(
            "name: \"{name}\"\nplatform: \"onnxruntime_onnx\"\nmax_batch_size: {max_batch}\n\
             input [ {{ name: \"{}\" data_type: TYPE_FP32 dims: [ {} ] }} ]\n\
             output [ {{ name: \"{}\" data_type: TYPE_FP32 dims: [ {} ] }} ]\n",
            self.input,
            dims(&self.row),
            self.output,
            dims(&self.out_row),
        );
        if let Some(n) = gpu_instances {
            c += &format!("instance_group [ {{ kind: KIND_GPU count: {n} gpus: [ 0 ] }} ]\n");
        }
        if let Some(us) = dynamic {
            c += &format!("dynamic_batching {{ max_queue_delay_microseconds: {us} }}\n");
        }
        if tf32 {
            c += "parameters { key: \"allow_tf32\" value: { string_value: \"true\" } }\n";
        }
        if let (Some(_), Some(p)) = (gpu_instances, precision()) {
            c += &format!(
                "parameters {{ key: \"precision\" value: {{ string_value: \"{p}\" }} }}\n"
            );
        }
        if let (Some(_), Ok(n)) = (
            gpu_instances,
            std::env::var("INFER_BENCH_CUDA_GRAPH_MAX_BATCH"),
        ) {
            c += &format!(
                "parameters {{ key: \"cuda_graph_max_batch\" value: {{ string_value: \"{n}\" }} }}\n"
            );
        }
        c
    }

    fn inputs(&self, batch: usize) -> Vec<f32> {
        let mut rng = XorShift(0x1234_5678 + batch as u64);
        (0..batch * self.row_elems())
            .map(|_| rng.next_f32())
            .collect()
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

const MLP_LAYERS: usize = 4;

/// Writes the MLP (`MLP_LAYERS` Gemm layers width -> width, Relu between) to
/// `dir/1/model.onnx`. Weights uniform in +-sqrt(6 / width) (activations keep their
/// scale through the Relus), biases in +-0.01, from a fixed seed.
fn write_mlp(dir: &Path, width: usize) -> std::io::Result<()> {
    let mut rng = XorShift(0x5eed_4096_abcd_0001);
    let scale = (6.0 / width as f32).sqrt();
    let (mut nodes, mut inits) = (Vec::new(), Vec::new());
    let mut prev = "FEATURES".to_owned();
    for l in 0..MLP_LAYERS {
        let w: Vec<f32> = (0..width * width).map(|_| rng.next_f32() * scale).collect();
        let b: Vec<f32> = (0..width).map(|_| rng.next_f32() * 0.01).collect();
        for (name, dims, data) in [
            (format!("w{l}"), vec![width as i64, width as i64], w),
            (format!("b{l}"), vec![width as i64], b),
        ] {
            inits.push(pb::TensorProto {
                name,
                dims,
                data_type: pb::tensor_proto::DataType::Float as i32,
                float_data: data,
                ..Default::default()
            });
        }
        let last = l == MLP_LAYERS - 1;
        let gemm_out = if last {
            "OUTPUT".to_owned()
        } else {
            format!("g{l}")
        };
        nodes.push(pb::NodeProto {
            op_type: "Gemm".into(),
            name: format!("gemm{l}"),
            input: vec![prev.clone(), format!("w{l}"), format!("b{l}")],
            output: vec![gemm_out.clone()],
            ..Default::default()
        });
        prev = gemm_out;
        if !last {
            let out = format!("h{l}");
            nodes.push(pb::NodeProto {
                op_type: "Relu".into(),
                name: format!("relu{l}"),
                input: vec![prev.clone()],
                output: vec![out.clone()],
                ..Default::default()
            });
            prev = out;
        }
    }
    let w = width as i64;
    let model = pb::ModelProto {
        ir_version: 8,
        opset_import: vec![pb::OperatorSetIdProto {
            domain: String::new(),
            version: 17,
        }],
        graph: Some(pb::GraphProto {
            name: "mlp".into(),
            node: nodes,
            initializer: inits,
            input: vec![value_info("FEATURES", &[None, Some(w)])],
            output: vec![value_info("OUTPUT", &[None, Some(w)])],
            ..Default::default()
        }),
        ..Default::default()
    };
    std::fs::create_dir_all(dir.join("1"))?;
    std::fs::write(dir.join("1").join("model.onnx"), model.encode_to_vec())
}

// ---------------------------------------------------------------------------------------
// Helpers for figures.

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

/// Whether requests copy their input (`infer_request_add_input`) rather than lend it
/// (`infer_request_add_input_borrowed`, the default): `INFER_BENCH_COPY_INPUT=1`.
fn copy_input() -> bool {
    static COPY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *COPY.get_or_init(|| {
        std::env::var("INFER_BENCH_COPY_INPUT")
            .is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
    })
}

/// Whether the latency part's inputs lie in page-locked memory, lent as
/// INFER_MEMORY_CPU_PINNED (copied up from where they are): `INFER_BENCH_PINNED_INPUT=1`.
fn pinned_input() -> bool {
    std::env::var("INFER_BENCH_PINNED_INPUT")
        .is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}

fn count(v: &serde_json::Value, k: &str) -> f64 {
    v["models"][0][k].as_f64().unwrap_or(0.0)
}

/// `k` summed over the model's GPU instances (the statistics JSON's `gpu` section).
fn gpu_total(v: &serde_json::Value, k: &str) -> f64 {
    v["models"][0]["gpu"]["instances"]
        .as_array()
        .map_or(0.0, |a| a.iter().filter_map(|i| i[k].as_f64()).sum())
}

fn compute_total(v: &serde_json::Value, k: &str) -> f64 {
    v["models"][0]["compute_us"][k].as_f64().unwrap_or(0.0)
}

fn tflops(flop: f64, us: f64) -> f64 {
    flop / us / 1e6
}

// ---------------------------------------------------------------------------------------
// check: the GPU against the CPU.

fn check_against_cpu(gpu: &Server, models: &[BenchModel], knobs: &Knobs) {
    println!("## check: one batch on the GPU against the CPU (tract)");
    let cpu = Server::new(INFER_GPU_OFF).unwrap_or_else(|e| fail(&e));
    let tol = match precision().as_deref() {
        Some(p) if p.eq_ignore_ascii_case("BF16") => 6e-2,
        Some(p) if p.eq_ignore_ascii_case("FP16") => 2e-2,
        _ if knobs.tf32 => 2e-2,
        _ => 1e-3,
    };
    for m in models {
        let cpu_name = format!("{}_cpu", m.name);
        cpu.load(
            &cpu_name,
            &m.config(&cpu_name, knobs.max_batch(), None, None, false),
            &m.dir,
        );
        let batch = 8;
        let data = m.inputs(batch);
        let mut shape: Vec<i64> = vec![batch as i64];
        shape.extend(&m.row);
        let input = CString::new(m.input).unwrap();
        let output = CString::new(m.output).unwrap();
        let get = |s: &Server, name: &str| {
            let n = CString::new(name).unwrap();
            let resp = s.infer(s.request(&n, &input, &shape, &data));
            let v = output_f32(resp, &output);
            unsafe { infer_response_free(resp) };
            v
        };
        let (want, got) = (get(&cpu, &cpu_name), get(gpu, &m.name));
        if want.len() != got.len() {
            fail(&format!(
                "{}: {} output values on the GPU, {} on the CPU",
                m.name,
                got.len(),
                want.len()
            ));
        }
        let scale = want.iter().fold(1f32, |a, v| a.max(v.abs()));
        let worst = want
            .iter()
            .zip(&got)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        if worst.is_nan() || worst > tol * scale {
            fail(&format!(
                "{}: the GPU differs from the CPU by {worst} (largest |value| {scale}, tolerance {tol} of it)",
                m.name
            ));
        }
        println!(
            "{}: batch {batch}, GPU matches CPU (largest difference {worst:.3e}, largest |value| {scale:.3})",
            m.name
        );
    }
    println!();
}

// ---------------------------------------------------------------------------------------
// latency: infer_server_infer, one request at a time.

fn latency(gpu: &Server, models: &[BenchModel], knobs: &Knobs) -> Vec<(String, usize, f64, f64)> {
    println!("## latency: infer_server_infer, one request in flight, 1 KIND_GPU instance, no dynamic batching");
    println!(
        "Time of the whole call as the caller sees it (request built from host memory ({}), staged through pinned memory, computed, output copied back, response freed). Stream: the instance's timing events per batch (inputs' way up from when the stream reached the batch, the backend's work, the copies down).",
        if pinned_input() {
            "page-locked, lent as INFER_MEMORY_CPU_PINNED"
        } else if copy_input() {
            "copied by infer_request_add_input"
        } else {
            "lent, infer_request_add_input_borrowed"
        }
    );
    println!("| model | batch | iters | p50 (us) | mean (us) | p99 (us) | samples/s | TFLOP/s | library compute_us (mean) | stream: up / backend / down (us) |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    // (model, batch, mean us, compute us) for the cuBLAS comparison.
    let mut rows = Vec::new();
    for m in models {
        let name = CString::new(m.name.as_str()).unwrap();
        let input = CString::new(m.input).unwrap();
        for &batch in &knobs.batches {
            let data = m.inputs(batch);
            let mut shape: Vec<i64> = vec![batch as i64];
            shape.extend(&m.row);
            // With INFER_BENCH_PINNED_INPUT, the rows in page-locked memory of GPU 0's
            // context.
            let locked = pinned_input().then(|| {
                let ctx = infer::cuda::context(0).unwrap_or_else(|e| fail(&e.message));
                ctx.bind().unwrap_or_else(|e| fail(&e.message));
                let pool = infer::cuda::MemoryPool::new(&ctx);
                let mut buf = pool
                    .pinned(std::mem::size_of_val(&data[..]))
                    .unwrap_or_else(|e| fail(&e.message));
                for (d, v) in buf.as_mut_slice().chunks_exact_mut(4).zip(&data) {
                    d.copy_from_slice(&v.to_ne_bytes());
                }
                buf
            });
            let (values, mem) = match &locked {
                // SAFETY: page-locked memory from cuMemHostAlloc (page-aligned) holding
                // the rows' f32 values.
                Some(b) => (
                    unsafe { std::slice::from_raw_parts(b.as_ptr() as *const f32, data.len()) },
                    INFER_MEMORY_CPU_PINNED,
                ),
                None => (&data[..], INFER_MEMORY_CPU),
            };
            let call = || {
                let resp = gpu.infer(gpu.request_in(&name, &input, &shape, values, mem));
                unsafe { infer_response_free(resp) };
            };
            // Warm-up (the first call at a batch size plans the graph for that shape).
            let start = Instant::now();
            let mut n = 0;
            while n < 3 || start.elapsed().as_secs_f64() < knobs.warmup_secs {
                call();
                n += 1;
            }
            let before = gpu.stats(&m.name);
            let mut lat = Vec::new();
            let start = Instant::now();
            while lat.len() < knobs.min_iters || start.elapsed().as_secs_f64() < knobs.secs {
                let t = Instant::now();
                call();
                lat.push(t.elapsed().as_secs_f64() * 1e6);
            }
            let after = gpu.stats(&m.name);
            let compute = (compute_total(&after, "total") - compute_total(&before, "total"))
                / (compute_total(&after, "count") - compute_total(&before, "count")).max(1.0);
            let timed =
                (gpu_total(&after, "timed_batches") - gpu_total(&before, "timed_batches")).max(1.0);
            let stream_us = |k: &str| (gpu_total(&after, k) - gpu_total(&before, k)) / timed / 1e3;
            let stream = format!(
                "{:.1} / {:.1} / {:.1}",
                stream_us("h2d_ns"),
                stream_us("compute_ns"),
                stream_us("d2h_ns")
            );
            let mean = lat.iter().sum::<f64>() / lat.len() as f64;
            lat.sort_by(f64::total_cmp);
            let tf = m.flop_per_sample.map_or("-".to_owned(), |f| {
                format!("{:.2}", tflops(f * batch as f64, mean))
            });
            println!(
                "| {} | {batch} | {} | {:.1} | {mean:.1} | {:.1} | {:.0} | {tf} | {compute:.1} | {stream} |",
                m.name,
                lat.len(),
                percentile(&lat, 0.5),
                percentile(&lat, 0.99),
                batch as f64 / mean * 1e6,
            );
            rows.push((m.name.clone(), batch, mean, compute));
        }
    }
    println!();
    rows
}

// ---------------------------------------------------------------------------------------
// e2e: closed-loop clients with dynamic batching.

struct Slot {
    done: AtomicBool,
    resp: AtomicPtr<Response>,
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

fn e2e(gpu: &Server, mlp: &BenchModel, knobs: &Knobs) {
    let name = format!("{}_dynamic", mlp.name);
    gpu.load(
        &name,
        &mlp.config(
            &name,
            knobs.max_batch(),
            Some(2),
            Some(knobs.delay_us),
            knobs.tf32,
        ),
        &mlp.dir,
    );
    println!(
        "## e2e: {} with dynamic_batching {{ max_queue_delay_microseconds: {} }}, 2 KIND_GPU instances, max_batch_size {}",
        mlp.name,
        knobs.delay_us,
        knobs.max_batch()
    );
    println!("Each client thread sends batch-1 requests back to back (infer_server_enqueue, waits for the FINAL callback: spins 20 us, then parks).");
    println!("GPU busy: the instances' streams' busy time (first to last event of each batch, statistics JSON `gpu`) over the measured wall time, averaged over the 2 instances; copies: the share of that busy time in H2D and D2H copies.");
    println!(
        "| clients | requests/s | p50 (us) | p99 (us) | mean batch | executions/s | TFLOP/s | GPU busy | copies |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let cname = CString::new(name.as_str()).unwrap();
    let input = CString::new(mlp.input).unwrap();
    let data = mlp.inputs(1);
    let mut shape: Vec<i64> = vec![1];
    shape.extend(&mlp.row);
    for &clients in &knobs.clients {
        let stop = AtomicBool::new(false);
        let measuring = AtomicBool::new(false);
        let completed = AtomicU64::new(0);
        let lat_all: Mutex<Vec<f64>> = Mutex::new(Vec::new());
        let (mut before, mut after) = (serde_json::Value::Null, serde_json::Value::Null);
        let (mut n0, mut n1, mut elapsed) = (0, 0, 0.0);
        std::thread::scope(|sc| {
            for _ in 0..clients {
                sc.spawn(|| {
                    let slot = Slot {
                        done: AtomicBool::new(false),
                        resp: AtomicPtr::new(std::ptr::null_mut()),
                        client: std::thread::current(),
                    };
                    let mut lat = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        let r = gpu.request(&cname, &input, &shape, &data);
                        slot.done.store(false, Ordering::Relaxed);
                        let t = Instant::now();
                        check(
                            unsafe {
                                infer_server_enqueue(
                                    gpu.0,
                                    r,
                                    Some(slot_cb),
                                    &slot as *const Slot as *mut c_void,
                                    std::ptr::null_mut(),
                                )
                            },
                            "infer_server_enqueue",
                        );
                        let spin_until = t + Duration::from_micros(20);
                        while !slot.done.load(Ordering::Acquire) {
                            if Instant::now() < spin_until {
                                std::hint::spin_loop();
                            } else {
                                std::thread::park_timeout(Duration::from_millis(1));
                            }
                        }
                        let us = t.elapsed().as_secs_f64() * 1e6;
                        let resp = slot.resp.load(Ordering::Relaxed);
                        ok_response(resp);
                        unsafe { infer_response_free(resp) };
                        completed.fetch_add(1, Ordering::Relaxed);
                        if measuring.load(Ordering::Relaxed) {
                            lat.push(us);
                        }
                    }
                    lat_all.lock().unwrap().extend(lat);
                });
            }
            std::thread::sleep(Duration::from_secs_f64(knobs.warmup_secs.max(0.2)));
            before = gpu.stats(&name);
            n0 = completed.load(Ordering::Relaxed);
            let t0 = Instant::now();
            measuring.store(true, Ordering::Relaxed);
            std::thread::sleep(Duration::from_secs_f64(knobs.secs));
            measuring.store(false, Ordering::Relaxed);
            n1 = completed.load(Ordering::Relaxed);
            elapsed = t0.elapsed().as_secs_f64();
            after = gpu.stats(&name);
            stop.store(true, Ordering::Relaxed);
        });
        let mut lat = lat_all.into_inner().unwrap();
        lat.sort_by(f64::total_cmp);
        let execs = count(&after, "execution_count") - count(&before, "execution_count");
        let infs = count(&after, "inference_count") - count(&before, "inference_count");
        let rps = (n1 - n0) as f64 / elapsed;
        let tf = mlp
            .flop_per_sample
            .map_or("-".to_owned(), |f| format!("{:.2}", f * rps / 1e12));
        let delta = |k: &str| gpu_total(&after, k) - gpu_total(&before, k);
        let busy = delta("busy_ns");
        let instances = after["models"][0]["gpu"]["instances"]
            .as_array()
            .map_or(1, |a| a.len().max(1)) as f64;
        let busy_frac = busy / (elapsed * 1e9 * instances);
        let copies = (delta("h2d_ns") + delta("d2h_ns")) / busy.max(1.0);
        println!(
            "| {clients} | {rps:.0} | {:.0} | {:.0} | {:.1} | {:.0} | {tf} | {:.1}% | {:.1}% |",
            percentile(&lat, 0.5),
            percentile(&lat, 0.99),
            infs / execs.max(1.0),
            execs / elapsed,
            busy_frac * 100.0,
            copies * 100.0,
        );
    }
    println!();
}

// ---------------------------------------------------------------------------------------
// cublas: the executor's GEMM, directly.

/// (batch, mean us per GEMM, calls) for each batch size: C[width x batch] = W[width x
/// width] X[width x batch] + C, column-major, as the plan maps a row-major Gemm
/// (Y[batch, n] = X[batch, k] W[k, n] + bias) onto cuBLAS.
fn cublas_gemms(width: usize, knobs: &Knobs) -> infer::status::Result<Vec<(usize, f64, usize)>> {
    use infer::cuda::cublas::{Blas, GemmArgs};
    use infer::cuda::driver::{DeviceMem, Stream};
    let ctx = infer::cuda::context(0)?;
    ctx.bind()?;
    let stream = Stream::new(&ctx)?;
    let blas = Blas::new(stream.raw(), knobs.tf32)?;
    let mut rng = XorShift(0xb1a5_0000_0000_0001);
    // The element type of the GEMM: FP32, or the 16-bit type INFER_BENCH_PRECISION asks for.
    let dt = match precision().as_deref() {
        Some(p) if p.eq_ignore_ascii_case("FP16") => 1,
        Some(p) if p.eq_ignore_ascii_case("BF16") => 2,
        _ => 0,
    };
    let random = |rng: &mut XorShift, n: usize| -> Vec<u8> {
        let v: Vec<f32> = (0..n).map(|_| rng.next_f32()).collect();
        match dt {
            1 => v
                .iter()
                .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                .collect(),
            2 => v
                .iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                .collect(),
            _ => bytemuck::cast_slice(&v).to_vec(),
        }
    };
    let w = DeviceMem::upload(&ctx, &random(&mut rng, width * width))?;
    let mut out = Vec::new();
    for &batch in &knobs.batches {
        let x = DeviceMem::upload(&ctx, &random(&mut rng, width * batch))?;
        let c = DeviceMem::upload(&ctx, &random(&mut rng, width * batch))?;
        let g = GemmArgs {
            trans_a: false,
            trans_b: false,
            m: width as i32,
            n: batch as i32,
            k: width as i32,
            lda: width as i32,
            ldb: width as i32,
            ldc: width as i32,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
            batch: 1,
            alpha: 1.0,
            beta: 1.0,
            dt,
        };
        // Calls are queued in blocks and the stream synchronized after each block, so the
        // host never waits on a single call.
        let block = 50;
        let run = |n: usize| -> infer::status::Result<()> {
            for _ in 0..n {
                blas.gemm(&g, w.ptr(), x.ptr(), c.ptr())?;
            }
            stream.synchronize()
        };
        let start = Instant::now();
        run(5)?;
        while start.elapsed().as_secs_f64() < knobs.warmup_secs {
            run(block)?;
        }
        let mut calls = 0;
        let start = Instant::now();
        while calls < knobs.min_iters || start.elapsed().as_secs_f64() < knobs.secs {
            run(block)?;
            calls += block;
        }
        out.push((
            batch,
            start.elapsed().as_secs_f64() * 1e6 / calls as f64,
            calls,
        ));
    }
    Ok(out)
}

fn cublas(width: usize, mlp_rows: &[(String, usize, f64, f64)], knobs: &Knobs) {
    println!(
        "## cublas: the MLP's GEMM through cuBLAS directly ({}), {width} x {width} weights",
        match precision() {
            Some(p) => format!("cublasGemmStridedBatchedEx, {p} with FP32 accumulation"),
            None if knobs.tf32 => "cublasSgemmStridedBatched, TF32 tensor-op math".to_owned(),
            None => "cublasSgemmStridedBatched, FP32, default math".to_owned(),
        }
    );
    println!("MLP TFLOP/s: the whole inference's flop (4 GEMMs) over its mean time from the latency table (the call as the caller sees it) and over the library's compute_us.");
    println!("| batch | GEMM (m x n x k) | calls | mean per GEMM (us) | cuBLAS TFLOP/s | MLP TFLOP/s (call) | MLP TFLOP/s (compute_us) | MLP (compute_us) / cuBLAS |");
    println!("|---:|---|---:|---:|---:|---:|---:|---:|");
    match cublas_gemms(width, knobs) {
        Err(e) => println!("cuBLAS could not be timed: {e}"),
        Ok(rows) => {
            for (batch, us, calls) in rows {
                let flop = 2.0 * batch as f64 * (width * width) as f64;
                let cu = tflops(flop, us);
                let mlp = mlp_rows.iter().find(|r| r.0 == "mlp" && r.1 == batch);
                let (call, comp, ratio) = match mlp {
                    Some(r) => {
                        let f = flop * MLP_LAYERS as f64;
                        let comp = tflops(f, r.3);
                        (
                            format!("{:.2}", tflops(f, r.2)),
                            format!("{comp:.2}"),
                            format!("{:.2}", comp / cu),
                        )
                    }
                    None => ("-".into(), "-".into(), "-".into()),
                };
                println!(
                    "| {batch} | {width} x {batch} x {width} | {calls} | {us:.1} | {cu:.2} | {call} | {comp} | {ratio} |"
                );
            }
        }
    }
    println!();
}

// ---------------------------------------------------------------------------------------

fn main() {
    if std::env::args().any(|a| a == "-h" || a == "--help") {
        println!("cargo bench --bench gpu   (knobs: see the top of benches/gpu.rs)");
        return;
    }
    let knobs = Knobs::from_env();
    let gpu = match Server::new(INFER_GPU_REQUIRED) {
        Ok(s) => s,
        Err(why) => {
            println!("SKIP: {why}");
            return;
        }
    };
    let describe = infer::cuda::GpuState::for_mode(infer::cuda::GpuMode::Required)
        .runtime()
        .map_or_else(|| "?".to_owned(), |r| r.describe());
    println!("# libinfer GPU benchmark");
    println!("{describe}");
    println!(
        "measured {} s per row after {} s of warm-up (at least {} calls); batches {:?}; clients {:?}; GEMMs {}",
        knobs.secs,
        knobs.warmup_secs,
        knobs.min_iters,
        knobs.batches,
        knobs.clients,
        if knobs.tf32 { "TF32 allowed" } else { "FP32 (no TF32)" }
    );
    println!();

    let tmp = std::env::temp_dir().join(format!("infer-gpu-bench-{}", std::process::id()));
    let _ = TEMP_DIR.set(tmp.clone());
    let width = knobs.width;
    let mut models = Vec::new();
    if knobs.model("mlp") {
        let dir = tmp.join("mlp");
        if let Err(e) = write_mlp(&dir, width) {
            fail(&format!("cannot write {}: {e}", dir.display()));
        }
        models.push(BenchModel {
            name: "mlp".into(),
            dir,
            input: "FEATURES",
            row: vec![width as i64],
            output: "OUTPUT",
            out_row: vec![width as i64],
            flop_per_sample: Some(2.0 * (width * width * MLP_LAYERS) as f64),
        });
    }
    if knobs.model("cnn") {
        models.push(BenchModel {
            name: "cnn".into(),
            dir: PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("models")
                .join("cnn"),
            input: "PIXELS",
            row: vec![1, 28, 28],
            output: "LOGITS",
            out_row: vec![10],
            flop_per_sample: None,
        });
    }
    for m in &models {
        gpu.load(
            &m.name,
            &m.config(&m.name, knobs.max_batch(), Some(1), None, knobs.tf32),
            &m.dir,
        );
    }

    if knobs.part("check") {
        check_against_cpu(&gpu, &models, &knobs);
    }
    let mut rows = Vec::new();
    if knobs.part("latency") {
        rows = latency(&gpu, &models, &knobs);
    }
    let mlp = models.iter().find(|m| m.name == "mlp");
    if knobs.part("e2e") {
        match mlp {
            Some(m) => e2e(&gpu, m, &knobs),
            None => println!("e2e: skipped (the MLP is not among INFER_BENCH_MODELS)\n"),
        }
    }
    if knobs.part("cublas") {
        cublas(width, &rows, &knobs);
    }
    drop(gpu);
    let _ = std::fs::remove_dir_all(&tmp);
}
