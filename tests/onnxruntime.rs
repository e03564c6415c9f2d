//! The ONNX Runtime engine through the C API: the shipped ONNX models of `models/` on ONNX
//! Runtime against the same models on tract (`backend: "tract"`, an independent engine),
//! dynamic batching into one run, sequence batching with implicit state, the config's ONNX
//! Runtime settings, and the log line naming the library.
//!
//! Needs ONNX Runtime: scripts/test.sh runs it with `INFER_ONNXRUNTIME_LIBRARY` set to the
//! pinned wheel's library; without it each test passes with a skip notice.
//!
//! Run: `INFER_ONNXRUNTIME_LIBRARY=.../libonnxruntime.so.1.32.0 cargo test --release --test onnxruntime`.

mod common;
use common::*;
use infer::ffi::server::*;
use infer::ffi::*;
use std::ffi::{c_char, c_void, CStr};
use std::path::PathBuf;
use std::sync::Mutex;

fn have_ort() -> bool {
    let set = std::env::var_os("INFER_ONNXRUNTIME_LIBRARY").is_some_and(|p| !p.is_empty());
    if !set {
        eprintln!(
            "onnxruntime: SKIPPED, INFER_ONNXRUNTIME_LIBRARY is not set (scripts/test.sh sets it)"
        );
    }
    set
}

fn model_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(name)
}

/// The shipped config of `model`, served as `as_name`, with `replace` applied. Its
/// instances are KIND_CPU: these are ONNX Runtime's CPU checks, also on a machine with a
/// GPU (where KIND_AUTO would place them on the GPU).
fn config(model: &str, as_name: &str, replace: &[(&str, &str)]) -> String {
    let mut c = std::fs::read_to_string(model_dir(model).join("config.pbtxt")).unwrap();
    c = c.replace(
        &format!("name: \"{model}\""),
        &format!("name: \"{as_name}\""),
    );
    c = c.replace("KIND_AUTO", "KIND_CPU");
    for (a, b) in replace {
        assert!(c.contains(a), "{model}: {a} not in the config");
        c = c.replace(a, b);
    }
    c
}

/// Loads `config` from `dir` as `name`; it must succeed.
#[track_caller]
fn load_ok(s: &Server, name: &str, config: &str, dir: &std::path::Path) {
    assert_eq!(
        s.try_load_dir(name, config, dir),
        INFER_STATUS_OK,
        "{name}: {}",
        last_error()
    );
}

const TRACT: (&str, &str) = ("platform: \"onnxruntime_onnx\"", "backend: \"tract\"");

static LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());

unsafe extern "C" fn log_line(_: *mut c_void, _level: u32, msg: *const c_char) {
    let msg = unsafe { CStr::from_ptr(msg) }
        .to_string_lossy()
        .into_owned();
    LOG.lock().unwrap().push(msg);
}

fn server_with(threads: Option<(u32, u32)>) -> Server {
    let mut opts = std::ptr::null_mut();
    ok(unsafe { infer_server_options_new(&mut opts) });
    ok(unsafe { infer_server_options_set_onnxruntime_required(opts, true) });
    if let Some((a, b)) = threads {
        ok(unsafe { infer_server_options_set_onnxruntime_threads(opts, a, b) });
    }
    ok(unsafe {
        infer_server_options_set_log_callback(
            opts,
            INFER_LOG_INFO,
            Some(log_line),
            std::ptr::null_mut(),
        )
    });
    Server::with_options(opts)
}

fn features(seed: u32, rows: usize) -> Vec<f32> {
    (0..rows * 64)
        .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
        .collect()
}

fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-4 + 1e-4 * y.abs(),
            "{what}: element {i}: {x} vs {y}"
        );
    }
}

#[test]
fn mlp_on_onnxruntime_matches_tract_and_the_log_names_the_library() {
    if !have_ort() {
        return;
    }
    let s = server_with(None);
    let dir = model_dir("mlp");
    load_ok(&s, "mlp", &config("mlp", "mlp", &[]), &dir);
    let tract = config("mlp", "mlp_tract", &[TRACT]);
    load_ok(&s, "mlp_tract", &tract, &dir);
    for rows in [1usize, 3, 8] {
        let x = features(rows as u32, rows);
        let a = s.infer(
            s.request("mlp")
                .input_f32("FEATURES", &[rows as i64, 64], &x),
        );
        let b = s.infer(
            s.request("mlp_tract")
                .input_f32("FEATURES", &[rows as i64, 64], &x),
        );
        assert_eq!(a.status(), INFER_STATUS_OK, "{}", a.error());
        assert_eq!(b.status(), INFER_STATUS_OK, "{}", b.error());
        close(
            &a.output_f32("LOGITS"),
            &b.output_f32("LOGITS"),
            "mlp LOGITS",
        );
    }
    let log = LOG.lock().unwrap().join("\n");
    assert!(log.contains("ONNX models run on ONNX Runtime 1."), "{log}");
    assert!(log.contains("libonnxruntime.so"), "{log}");
}

#[test]
fn dynamic_batching_runs_many_requests_in_one_session_run() {
    if !have_ort() {
        return;
    }
    let s = server_with(Some((1, 1)));
    let dir = model_dir("mlp");
    load_ok(&s, "mlpb", &config("mlp", "mlpb", &[]), &dir);
    // Each request alone first, then all of them queued while paused: one batch.
    let singles: Vec<Vec<f32>> = (0..16)
        .map(|i| {
            s.infer(
                s.request("mlpb")
                    .input_f32("FEATURES", &[1, 64], &features(i, 1)),
            )
            .output_f32("LOGITS")
        })
        .collect();
    s.pause("mlpb");
    let c = Collector::new();
    for i in 0..16u32 {
        s.enqueue(
            s.request("mlpb")
                .input_f32("FEATURES", &[1, 64], &features(i, 1)),
            &c,
        )
        .unwrap();
    }
    s.resume("mlpb");
    c.wait(16);
    let mut got = c.take();
    got.sort_by_key(|r| r.id());
    for (i, r) in got.iter().enumerate() {
        assert_eq!(r.status(), INFER_STATUS_OK, "{}", r.error());
        close(&r.output_f32("LOGITS"), &singles[i], "batched LOGITS");
    }
    let sizes = batch_sizes(&s.stats("mlpb"));
    assert!(
        sizes.iter().any(|&(size, _)| size >= 8),
        "no batch of 8 or more: {sizes:?}"
    );
}

#[test]
fn sequences_with_implicit_state_match_tract() {
    if !have_ort() {
        return;
    }
    let s = server_with(None);
    let dir = model_dir("accumulator_onnx");
    let ort = config("accumulator_onnx", "acc", &[]);
    let tract = config("accumulator_onnx", "acc_tract", &[TRACT]);
    load_ok(&s, "acc", &ort, &dir);
    load_ok(&s, "acc_tract", &tract, &dir);
    for model in ["acc", "acc_tract"] {
        let mut outs = Vec::new();
        for (k, v) in [1.0f32, 2.0, 3.5, -1.0].iter().enumerate() {
            let flags = if k == 0 {
                INFER_REQUEST_FLAG_SEQUENCE_START
            } else {
                0
            };
            let r =
                s.request(model)
                    .correlation_id(7)
                    .flags(flags)
                    .input_f32("INPUT", &[1, 1], &[*v]);
            let resp = s.infer(r);
            assert_eq!(resp.status(), INFER_STATUS_OK, "{model}: {}", resp.error());
            outs.push(resp.output_f32("OUTPUT")[0]);
        }
        LOG.lock().unwrap().push(format!("{model}: {outs:?}"));
    }
    let log = LOG.lock().unwrap().clone();
    let of = |m: &str| {
        log.iter()
            .rev()
            .find(|l| l.starts_with(&format!("{m}: ")))
            .cloned()
            .unwrap()
    };
    assert_eq!(
        of("acc")["acc".len()..],
        of("acc_tract")["acc_tract".len()..]
    );
    // The state carries: the outputs are not just the inputs.
    assert!(
        !of("acc").ends_with("[1.0, 2.0, 3.5, -1.0]"),
        "{}",
        of("acc")
    );
}

#[test]
fn the_configs_onnxruntime_settings_apply_or_are_refused_by_name() {
    if !have_ort() {
        return;
    }
    let s = server_with(None);
    let dir = model_dir("mlp");
    let with = |name: &str, extra: &str| {
        let c = format!("{}\n{extra}\n", config("mlp", name, &[]));
        let st = s.try_load_dir(name, &c, &dir);
        (
            st,
            if st == INFER_STATUS_OK {
                String::new()
            } else {
                last_error()
            },
        )
    };
    let (st, e) = with(
        "set",
        r#"parameters { key: "intra_op_thread_count" value: { string_value: "2" } }
parameters { key: "inter_op_thread_count" value: { string_value: "1" } }
parameters { key: "execution_mode" value: { string_value: "1" } }
parameters { key: "enable_mem_arena" value: { string_value: "1" } }
parameters { key: "enable_mem_pattern" value: { string_value: "1" } }
parameters { key: "memory.enable_memory_arena_shrinkage" value: { string_value: "cpu:0" } }
parameters { key: "session.intra_op.allow_spinning" value: { string_value: "0" } }
optimization { graph { level: -1 } }"#,
    );
    assert_eq!(st, INFER_STATUS_OK, "{e}");
    let x = features(5, 2);
    let r = s.infer(s.request("set").input_f32("FEATURES", &[2, 64], &x));
    assert_eq!(r.status(), INFER_STATUS_OK, "{}", r.error());

    let (st, e) = with(
        "bad_key",
        r#"parameters { key: "num_threads" value: { string_value: "2" } }"#,
    );
    assert_eq!(st, INFER_STATUS_UNSUPPORTED, "{e}");
    assert!(e.contains("parameters.num_threads"), "{e}");
    let (st, e) = with("bad_level", "optimization { graph { level: 5 } }");
    assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{e}");
    assert!(e.contains("optimization.graph.level: 5"), "{e}");
    // The CPU wheel has no OpenVINO provider: UNAVAILABLE naming it.
    let (st, e) = with(
        "ov",
        r#"optimization { execution_accelerators { cpu_execution_accelerator [ { name: "openvino" } ] } }"#,
    );
    assert_eq!(st, INFER_STATUS_UNAVAILABLE, "{e}");
    assert!(
        e.contains("'openvino'") && e.contains("libonnxruntime"),
        "{e}"
    );
    // On tract the OpenVINO accelerator is refused naming the field.
    let c = format!(
        "{}\noptimization {{ execution_accelerators {{ cpu_execution_accelerator [ {{ name: \"openvino\" }} ] }} }}\n",
        config("mlp", "ov_tract", &[TRACT])
    );
    assert_eq!(
        s.try_load_dir("ov_tract", &c, &dir),
        INFER_STATUS_UNSUPPORTED
    );
    assert!(
        last_error().contains("cpu_execution_accelerator"),
        "{}",
        last_error()
    );
}

/// Without ONNX Runtime (the main test run): ONNX models run on tract, said once in the
/// log, unless ONNX Runtime is required, which fails the load with UNAVAILABLE saying
/// where it looked.
#[test]
fn without_onnxruntime_models_fall_back_to_tract_unless_required() {
    if std::env::var_os("INFER_ONNXRUNTIME_LIBRARY").is_some() {
        eprintln!("onnxruntime: the fallback is tested where ONNX Runtime is not set");
        return;
    }
    let dir = model_dir("mlp");
    let mut opts = std::ptr::null_mut();
    ok(unsafe { infer_server_options_new(&mut opts) });
    let missing = cs("/nonexistent/libonnxruntime.so.1.32.0");
    ok(unsafe { infer_server_options_set_onnxruntime_library(opts, missing.as_ptr()) });
    ok(unsafe {
        infer_server_options_set_log_callback(
            opts,
            INFER_LOG_INFO,
            Some(log_line),
            std::ptr::null_mut(),
        )
    });
    let s = Server::with_options(opts);
    load_ok(&s, "fb", &config("mlp", "fb", &[]), &dir);
    let r = s.infer(
        s.request("fb")
            .input_f32("FEATURES", &[1, 64], &features(1, 1)),
    );
    assert_eq!(r.status(), INFER_STATUS_OK, "{}", r.error());
    let log = LOG.lock().unwrap().join("\n");
    assert!(log.contains("ONNX models run on tract"), "{log}");
    assert!(
        log.contains("/nonexistent/libonnxruntime.so.1.32.0"),
        "{log}"
    );

    // Required by the model's parameter.
    let c = format!(
        "{}\nparameters {{ key: \"onnxruntime_required\" value: {{ string_value: \"true\" }} }}\n",
        config("mlp", "req", &[])
    );
    assert_eq!(s.try_load_dir("req", &c, &dir), INFER_STATUS_UNAVAILABLE);
    let e = last_error();
    assert!(
        e.contains("parameters.onnxruntime_required") && e.contains("could not be loaded"),
        "{e}"
    );

    // Required by the server option.
    let mut opts = std::ptr::null_mut();
    ok(unsafe { infer_server_options_new(&mut opts) });
    ok(unsafe { infer_server_options_set_onnxruntime_required(opts, true) });
    let s2 = Server::with_options(opts);
    assert_eq!(
        s2.try_load_dir("mlp", &config("mlp", "mlp", &[]), &dir),
        INFER_STATUS_UNAVAILABLE
    );
    assert!(
        last_error().contains("the server option"),
        "{}",
        last_error()
    );
    // backend: "tract" never needs it.
    load_ok(&s2, "t", &config("mlp", "t", &[TRACT]), &dir);
}

/// tract takes `intra_op_thread_count` as ONNX Runtime does: the instance's matrix
/// products run on a pool of that many threads, with the same answers.
#[test]
fn tract_with_a_thread_pool_answers_as_without() {
    let s = Server::new();
    let dir = model_dir("mlp");
    let one = config("mlp", "t1", &[TRACT]);
    let two = format!(
        "{}\nparameters {{ key: \"intra_op_thread_count\" value: {{ string_value: \"2\" }} }}\n",
        config("mlp", "t2", &[TRACT])
    );
    load_ok(&s, "t1", &one, &dir);
    load_ok(&s, "t2", &two, &dir);
    let x = features(9, 64);
    let a = s.infer(s.request("t1").input_f32("FEATURES", &[64, 64], &x));
    let b = s.infer(s.request("t2").input_f32("FEATURES", &[64, 64], &x));
    assert_eq!(b.status(), INFER_STATUS_OK, "{}", b.error());
    close(
        &b.output_f32("LOGITS"),
        &a.output_f32("LOGITS"),
        "tract with 2 threads",
    );
    // A bad count is refused naming the parameter.
    let bad = format!(
        "{}\nparameters {{ key: \"intra_op_thread_count\" value: {{ string_value: \"-2\" }} }}\n",
        config("mlp", "t3", &[TRACT])
    );
    assert_eq!(
        s.try_load_dir("t3", &bad, &dir),
        INFER_STATUS_INVALID_ARGUMENT
    );
    assert!(
        last_error().contains("parameters.intra_op_thread_count"),
        "{}",
        last_error()
    );
}

/// `parameters { key: "gpu_executor" }` picks the engine of an ONNX model's GPU
/// instances, on a machine with a GPU (the stand-in CUDA libraries), each case in a
/// process of its own (ONNX Runtime loads once per process):
/// * with the CPU wheel's ONNX Runtime (no CUDA provider), `gpu_executor_child`:
///   "libinfer" serves on libinfer's own executor, as the default does there;
///   "onnxruntime" is UNAVAILABLE on KIND_GPU naming the provider and the library, and
///   KIND_AUTO then serves on ONNX Runtime on the CPU; a value that names no engine is
///   INVALID_ARGUMENT; tract, a CPU engine, refuses it;
/// * with onnxruntime-gpu's library (`INFER_ONNXRUNTIME_GPU_LIBRARY`, which scripts/test.sh
///   sets), `onnxruntime_gpu_child`.
#[test]
fn gpu_executor_picks_the_engine_of_gpu_instances() {
    if !have_ort() || std::env::var_os("INFER_FAKE_CUDA").is_some() {
        return; // no ONNX Runtime; or a child, or a run against the stand-ins already
    }
    let dir = std::env::temp_dir().join(format!("infer-ort-fakes-{}", std::process::id()));
    if let Err(why) = build_fakes(&dir, 13) {
        println!("SKIP: cannot build the stand-in CUDA libraries ({why})");
        return;
    }
    let stand_in = [
        ("LD_LIBRARY_PATH", dir.as_os_str()),
        ("INFER_FAKE_CUDA", "one".as_ref()),
    ];
    let child = |test: &str, extra: (&str, &std::ffi::OsStr)| {
        let mut envs = stand_in.to_vec();
        envs.push(extra);
        envs.push(("INFER_ENGINE_CHILD", test.as_ref()));
        let all = run_test_child(test, &envs);
        assert!(all.contains(&format!("{test}: checked")), "{all}");
        all
    };
    let lib = std::env::var_os("INFER_ONNXRUNTIME_LIBRARY").unwrap_or_default();
    child("gpu_executor_child", ("INFER_ONNXRUNTIME_LIBRARY", &lib));
    match std::env::var_os("INFER_ONNXRUNTIME_GPU_LIBRARY") {
        Some(gpu_lib) => {
            let all = child(
                "onnxruntime_gpu_child",
                ("INFER_ONNXRUNTIME_LIBRARY", &gpu_lib),
            );
            for line in all.lines().filter(|l| l.starts_with("onnxruntime-gpu:")) {
                println!("{line}");
            }
        }
        None => println!(
            "SKIP: INFER_ONNXRUNTIME_GPU_LIBRARY is not set: onnxruntime-gpu's engine choice is not checked"
        ),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The mlp served under several names and engine choices, and what a CPU instance of
/// ONNX Runtime answers (the children's common part).
struct Engines {
    s: Server,
    dir: PathBuf,
    x: Vec<f32>,
    want: Vec<f32>,
}

impl Engines {
    fn new() -> Engines {
        let s = server_with(None);
        let dir = model_dir("mlp");
        load_ok(&s, "cpu", &config("mlp", "cpu", &[]), &dir);
        let mut e = Engines {
            s,
            dir,
            x: features(3, 2),
            want: Vec::new(),
        };
        e.want = e.answer("cpu");
        e
    }

    /// The mlp's config as `name`, its instances of `kind`, with `extra` parameters.
    fn config(&self, name: &str, kind: &str, extra: &[(&str, &str)]) -> String {
        let mut c = config("mlp", name, &[("KIND_CPU", kind)]);
        for (k, v) in extra {
            c += &format!("\nparameters {{ key: \"{k}\" value: {{ string_value: \"{v}\" }} }}\n");
        }
        c
    }

    /// Loads the model; Err has the status and the message.
    fn load(&self, name: &str, kind: &str, extra: &[(&str, &str)]) -> Result<(), (u32, String)> {
        let c = self.config(name, kind, extra);
        match self.s.try_load_dir(name, &c, &self.dir) {
            INFER_STATUS_OK => Ok(()),
            st => Err((st, last_error())),
        }
    }

    fn on_gpu(&self, name: &str) -> bool {
        self.s.stats(name)["models"][0].get("gpu").is_some()
    }

    fn answer(&self, name: &str) -> Vec<f32> {
        let r = self.s.infer(
            self.s
                .request(name)
                .input_f32("FEATURES", &[2, 64], &self.x),
        );
        assert_eq!(r.status(), INFER_STATUS_OK, "{name}: {}", r.error());
        r.output_f32("LOGITS")
    }

    /// Loads the model (it must load), then checks that it serves where `gpu` says.
    #[track_caller]
    fn load_serving(&self, name: &str, kind: &str, extra: &[(&str, &str)], gpu: bool) {
        if let Err((st, msg)) = self.load(name, kind, extra) {
            panic!("{name}: status {st}: {msg}");
        }
        self.serves(name, gpu);
    }

    /// The model serves on a GPU (`gpu`) or the CPU, answering as the CPU instance does.
    #[track_caller]
    fn serves(&self, name: &str, gpu: bool) {
        assert_eq!(self.on_gpu(name), gpu, "{name}: {}", self.s.stats(name));
        close(&self.answer(name), &self.want, name);
    }
}

/// The child of `gpu_executor_picks_the_engine_of_gpu_instances` with the CPU wheel's
/// ONNX Runtime.
#[test]
fn gpu_executor_child() {
    if std::env::var_os("INFER_ENGINE_CHILD").is_none_or(|t| t != "gpu_executor_child") {
        return;
    }
    let e = Engines::new();
    // No CUDA provider: GPU instances run on libinfer's executor by default, and when the
    // config picks it.
    e.load_serving("default", "KIND_GPU", &[], true);
    e.load_serving("own", "KIND_GPU", &[("gpu_executor", "libinfer")], true);
    // ONNX Runtime's CUDA provider, asked for where it is missing.
    let (st, msg) = e
        .load("ort", "KIND_GPU", &[("gpu_executor", "onnxruntime")])
        .unwrap_err();
    assert_eq!(st, INFER_STATUS_UNAVAILABLE, "{msg}");
    assert!(
        msg.contains("'ort'")
            && msg.contains("parameters.gpu_executor is \"onnxruntime\"")
            && msg.contains("no CUDA execution provider")
            && msg.contains("libonnxruntime.so"),
        "{msg}"
    );
    e.load_serving(
        "ort_auto",
        "KIND_AUTO",
        &[("gpu_executor", "onnxruntime")],
        false,
    );
    let log = LOG.lock().unwrap().join("\n");
    assert!(
        log.contains("model 'ort_auto': instance_group") && log.contains("runs on the CPU"),
        "{log}"
    );
    // Values that name no engine, and tract.
    let (st, msg) = e
        .load("bad", "KIND_GPU", &[("gpu_executor", "cuda")])
        .unwrap_err();
    assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{msg}");
    assert!(msg.contains("parameters.gpu_executor: 'cuda'"), "{msg}");
    let c = e
        .config("t", "KIND_AUTO", &[("gpu_executor", "libinfer")])
        .replace(TRACT.0, TRACT.1);
    assert_eq!(e.s.try_load_dir("t", &c, &e.dir), INFER_STATUS_UNSUPPORTED);
    let msg = last_error();
    assert!(
        msg.contains("backend \"tract\" runs on the CPU only"),
        "{msg}"
    );
    println!("gpu_executor_child: checked");
}

/// The child of `gpu_executor_picks_the_engine_of_gpu_instances` with onnxruntime-gpu's
/// library, on the stand-in CUDA: ONNX Runtime lists its CUDA provider, so it runs GPU
/// instances by default, but the provider cannot start here (no CUDA runtime, cuBLASLt or
/// cuDNN: a machine whose CUDA does not match the wheel's): KIND_GPU is UNAVAILABLE
/// saying why, KIND_AUTO serves on the CPU, and `gpu_executor: "libinfer"` serves on the
/// GPU. The executor's own settings are refused by default (ONNX Runtime would ignore
/// them) and taken with "libinfer".
#[test]
fn onnxruntime_gpu_child() {
    if std::env::var_os("INFER_ENGINE_CHILD").is_none_or(|t| t != "onnxruntime_gpu_child") {
        return;
    }
    let e = Engines::new();
    let log = LOG.lock().unwrap().join("\n");
    assert!(log.contains("CUDAExecutionProvider"), "{log}");
    for extra in [vec![], vec![("gpu_executor", "onnxruntime")]] {
        let (st, msg) = e.load("ort", "KIND_GPU", &extra).unwrap_err();
        assert_eq!(st, INFER_STATUS_UNAVAILABLE, "{msg}");
        assert!(
            msg.contains("model 'ort'")
                && msg.contains("cannot start on GPU 0")
                && msg.contains("libonnxruntime_providers_cuda.so")
                && msg.contains("gpu_executor: \"libinfer\""),
            "{msg}"
        );
        println!("onnxruntime-gpu: KIND_GPU {extra:?}: {msg}");
    }
    e.load_serving("auto", "KIND_AUTO", &[], false);
    e.load_serving("own", "KIND_GPU", &[("gpu_executor", "libinfer")], true);
    let (st, msg) = e
        .load("fp16", "KIND_AUTO", &[("precision", "FP16")])
        .unwrap_err();
    assert_eq!(st, INFER_STATUS_UNSUPPORTED, "{msg}");
    assert!(
        msg.contains("parameters.precision")
            && msg.contains("ONNX Runtime's CUDA provider")
            && msg.contains("gpu_executor: \"libinfer\""),
        "{msg}"
    );
    e.load_serving(
        "fp16_own",
        "KIND_GPU",
        &[("precision", "FP32"), ("gpu_executor", "libinfer")],
        true,
    );
    println!("onnxruntime_gpu_child: checked");
}
