//! GPU modes, KIND_GPU instance groups and the GPU-memory calls of C API section 10,
//! through the C API. Without a usable GPU every GPU request fails with the reason and
//! models serve on the CPU; checks that need a GPU print "SKIP: <reason>" and pass.

mod common;
use common::*;
use infer::ffi::backend::*;
use infer::ffi::memory::*;
use infer::ffi::request::*;
use infer::ffi::response::*;
use infer::ffi::server::*;
use infer::ffi::*;
use std::ffi::c_void;
use std::ptr::{null, null_mut};
use tract_onnx::pb;

#[track_caller]
fn expect_msg(st: infer_status, want: infer_status, parts: &[&str]) -> String {
    let msg = expect_status(st, want);
    for p in parts {
        assert!(msg.contains(p), "message {msg:?} lacks {p:?}");
    }
    msg
}

fn server_in(mode: u32) -> std::result::Result<Server, (infer_status, String)> {
    let mut opts = null_mut();
    let mut s = null_mut();
    unsafe {
        ok(infer_server_options_new(&mut opts));
        ok(infer_server_options_set_gpu(opts, mode));
        let st = infer_server_new(opts, &mut s);
        let msg = last_error();
        infer_server_options_free(opts);
        if st == INFER_STATUS_OK {
            Ok(Server(s))
        } else {
            assert!(s.is_null(), "out-parameters are written only on success");
            Err((st, msg))
        }
    }
}

/// Why this machine has no usable GPU (None when it has one).
fn no_gpu_reason() -> Option<String> {
    server_in(INFER_GPU_REQUIRED).err().map(|(_, why)| why)
}

fn gpu_config(name: &str, group: &str) -> String {
    add_sub_config(name, &format!("instance_group [ {group} ]"))
}

#[test]
fn required_fails_without_a_gpu_and_starts_with_one() {
    match server_in(INFER_GPU_REQUIRED) {
        Err((st, msg)) => {
            assert_eq!(st, INFER_STATUS_UNAVAILABLE, "{msg}");
            assert!(msg.starts_with("GPU required but "), "{msg}");
            // The reason, not just the refusal.
            assert!(msg.len() > "GPU required but ".len() + 10, "{msg}");
        }
        Ok(s) => {
            s.load("m", &add_sub_config("m", ""));
            let r = s.infer(add_sub_request(&s, "m", [1.; 4], [2.; 4]));
            assert_eq!(r.output_f32("OUTPUT0"), vec![3.; 4]);
        }
    }
}

#[test]
fn auto_serves_on_the_cpu() {
    let s = server_in(INFER_GPU_AUTO).unwrap_or_else(|(st, m)| panic!("AUTO failed: {st} {m}"));
    s.load(
        "m",
        &add_sub_config("m", "instance_group [ { kind: KIND_AUTO count: 2 } ]"),
    );
    let r = s.infer(add_sub_request(&s, "m", [1.; 4], [2.; 4]));
    assert_eq!(r.output_f32("OUTPUT0"), vec![3.; 4]);
    assert_eq!(r.output_f32("OUTPUT1"), vec![-1.; 4]);
}

/// Run in a child process (see `off_never_maps_the_cuda_driver`): other tests of this
/// binary may load the driver into their process.
#[test]
fn off_server_in_a_fresh_process() {
    if std::env::var_os("INFER_TEST_GPU_OFF_CHILD").is_none() {
        return;
    }
    let s = server_in(INFER_GPU_OFF).unwrap_or_else(|(st, m)| panic!("OFF failed: {st} {m}"));
    s.load("m", &add_sub_config("m", ""));
    let r = s.infer(add_sub_request(&s, "m", [1.; 4], [2.; 4]));
    assert_eq!(r.output_f32("OUTPUT0"), vec![3.; 4]);
    let st = s.try_load("g", &gpu_config("g", "{ kind: KIND_GPU }"));
    expect_msg(st, INFER_STATUS_UNAVAILABLE, &["OFF"]);
    let maps = std::fs::read_to_string("/proc/self/maps").expect("reading /proc/self/maps");
    assert!(
        !maps.contains("libcuda") && !maps.contains("libnvcuda"),
        "a server with GPU use OFF loaded the CUDA driver"
    );
    println!("OFF child: no CUDA driver mapped");
}

#[test]
fn off_never_maps_the_cuda_driver() {
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = std::process::Command::new(exe)
        .args(["--exact", "off_server_in_a_fresh_process", "--nocapture"])
        .env("INFER_TEST_GPU_OFF_CHILD", "1")
        .output()
        .expect("running the test binary again");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("OFF child: no CUDA driver mapped"),
        "{stdout}"
    );
}

#[test]
fn kind_gpu_without_a_gpu_names_the_model_group_and_reason() {
    let off = server_in(INFER_GPU_OFF).unwrap_or_else(|(st, m)| panic!("{st} {m}"));
    let cfg = gpu_config("m", "{ name: \"fast\" kind: KIND_GPU gpus: [ 0 ] }");
    expect_msg(
        off.try_load("m", &cfg),
        INFER_STATUS_UNAVAILABLE,
        &["'m'", "'fast'", "KIND_GPU", "GPU use is OFF"],
    );
    // A KIND_CPU group next to it does not help: the model does not load half-way.
    let mixed = gpu_config("m", "{ kind: KIND_CPU }, { name: \"g\" kind: KIND_GPU }");
    expect_msg(
        off.try_load("m", &mixed),
        INFER_STATUS_UNAVAILABLE,
        &["'g'"],
    );
    let mut ready = true;
    ok(unsafe { infer_server_model_ready(off.0, c"m".as_ptr(), -1, &mut ready) });
    assert!(!ready);

    let Some(why) = no_gpu_reason() else {
        println!("SKIP: a GPU is present; the no-GPU AUTO case cannot be checked");
        return;
    };
    let auto = Server::new();
    let msg = expect_msg(
        auto.try_load("m", &cfg),
        INFER_STATUS_UNAVAILABLE,
        &["'m'", "'fast'", "no usable GPU"],
    );
    let reason = why.trim_start_matches("GPU required but ");
    assert!(
        msg.contains(reason),
        "{msg:?} lacks the probe's reason {reason:?}"
    );
}

#[test]
fn kind_gpu_with_a_gpu_refuses_what_cannot_run_there() {
    if let Some(why) = no_gpu_reason() {
        println!("SKIP: needs a GPU ({why})");
        return;
    }
    let s = Server::new();
    expect_msg(
        s.try_load("m", &gpu_config("m", "{ kind: KIND_GPU gpus: [ 4096 ] }")),
        INFER_STATUS_INVALID_ARGUMENT,
        &["'m'", "GPU 4096", "does not exist"],
    );
    expect_msg(
        s.try_load("m", &gpu_config("m", "{ kind: KIND_GPU }")),
        INFER_STATUS_UNSUPPORTED,
        &[
            "backend 'add_sub' cannot run on a GPU",
            "KIND_CPU or KIND_AUTO",
        ],
    );
    // `backend: "tract"` names a CPU engine: refused on KIND_GPU, on the CPU under KIND_AUTO.
    let tract =
        gpu_config_of("mlp").replace("platform: \"onnxruntime_onnx\"", "backend: \"tract\"");
    let dir = model_dir_of("mlp");
    let load = |config: &str| unsafe {
        infer_server_load_model(s.0, cs("mlp").as_ptr(), cs(config).as_ptr(), dir.as_ptr())
    };
    expect_msg(
        load(&tract),
        INFER_STATUS_UNSUPPORTED,
        &[
            "backend 'tract' cannot run on a GPU",
            "KIND_CPU or KIND_AUTO",
        ],
    );
    ok(load(&tract.replace("KIND_GPU", "KIND_AUTO")));
    let st = s.stats("mlp");
    assert!(
        st["models"][0].get("gpu").is_none(),
        "a tract model under KIND_AUTO was placed on a GPU: {st}"
    );
}

#[test]
fn custom_backend_on_kind_gpu_without_a_gpu_is_unavailable() {
    let off = server_in(INFER_GPU_OFF).unwrap_or_else(|(st, m)| panic!("{st} {m}"));
    register_copy_backend(&off);
    expect_msg(
        off.try_load(
            "c",
            &copy_config("c", "instance_group [ { kind: KIND_GPU } ]"),
        ),
        INFER_STATUS_UNAVAILABLE,
        &["'c'", "KIND_GPU", "OFF"],
    );
    // The same backend serves on the CPU.
    off.load("c", &copy_config("c", ""));
    let r = off.infer(off.request("c").input_f32("IN", &[1, 2], &[1., 2.]));
    assert_eq!(r.status(), INFER_STATUS_OK, "{}", r.error());
    assert_eq!(r.output_f32("OUT"), vec![1., 2.]);
}

// ---- a custom C backend that checks the section-10 calls from inside execute ----

fn copy_config(name: &str, extra: &str) -> String {
    format!(
        r#"name: "{name}" backend: "copy" max_batch_size: 8
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 2 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] }} ]
{extra}"#
    )
}

fn register_copy_backend(s: &Server) {
    let vt = infer_backend {
        struct_size: std::mem::size_of::<infer_backend>() as u32,
        instance_init: None,
        execute: Some(copy_execute),
        instance_fini: None,
        finalize: None,
    };
    ok(unsafe { infer_server_register_backend(s.0, c"copy".as_ptr(), &vt, null_mut()) });
}

/// Fails the batch with the first section-10 answer that is not the CPU's.
fn check_cpu_batch(b: *mut Batch) -> std::result::Result<(), String> {
    unsafe {
        let (mut mem, mut dev) = (99u32, 99i64);
        let st = infer_batch_input_memory(b, c"IN".as_ptr(), &mut mem, &mut dev);
        if st != INFER_STATUS_OK || mem != INFER_MEMORY_CPU || dev != 0 {
            return Err(format!("input memory: {st} {mem} {dev} {}", last_error()));
        }
        let st = infer_batch_input_memory(b, c"NOPE".as_ptr(), &mut mem, &mut dev);
        if st != INFER_STATUS_NOT_FOUND {
            return Err(format!("missing input: {st}"));
        }
        let st = infer_batch_input_memory(b, c"IN".as_ptr(), null_mut(), &mut dev);
        if st != INFER_STATUS_INVALID_ARGUMENT {
            return Err(format!("NULL mem: {st}"));
        }
        let rows = infer_batch_size(b) as i64;
        let mut dptr = null_mut();
        let st = infer_batch_output_device(b, c"OUT".as_ptr(), [rows, 2].as_ptr(), 2, &mut dptr);
        if st != INFER_STATUS_INVALID_ARGUMENT
            || !last_error().contains("infer_batch_output")
            || !dptr.is_null()
        {
            return Err(format!("output device: {st} {}", last_error()));
        }
        if !infer_batch_cuda_stream(b).is_null() || !infer_batch_cuda_stream(null()).is_null() {
            return Err("a CUDA stream on the CPU".into());
        }
        let mut data: *const c_void = null();
        let mut bytes = 0usize;
        let st = infer_batch_input(
            b,
            c"IN".as_ptr(),
            null_mut(),
            null_mut(),
            null_mut(),
            &mut data,
            &mut bytes,
        );
        if st != INFER_STATUS_OK {
            return Err(format!("input: {}", last_error()));
        }
        let mut out = null_mut();
        let st = infer_batch_output(b, c"OUT".as_ptr(), [rows, 2].as_ptr(), 2, &mut out);
        if st != INFER_STATUS_OK {
            return Err(format!("output: {}", last_error()));
        }
        std::ptr::copy_nonoverlapping(data as *const u8, out as *mut u8, bytes);
    }
    Ok(())
}

unsafe extern "C" fn copy_execute(_: *mut c_void, b: *mut Batch) -> u32 {
    match check_cpu_batch(b) {
        Ok(()) => INFER_STATUS_OK,
        Err(why) => {
            let msg = cs(&why);
            infer_batch_set_error_message(b, msg.as_ptr());
            INFER_STATUS_INTERNAL
        }
    }
}

// ---- requests and responses ----

#[test]
fn request_output_memory_without_a_gpu() {
    let off = server_in(INFER_GPU_OFF).unwrap_or_else(|(st, m)| panic!("{st} {m}"));
    off.load("m", &add_sub_config("m", ""));
    let r = add_sub_request(&off, "m", [1.; 4], [2.; 4]);
    unsafe {
        ok(infer_request_set_output_memory(r.0, INFER_MEMORY_CPU, 0));
        ok(infer_request_set_output_memory(
            r.0,
            INFER_MEMORY_CPU_PINNED,
            0,
        ));
        expect_msg(
            infer_request_set_output_memory(r.0, INFER_MEMORY_GPU, 0),
            INFER_STATUS_UNAVAILABLE,
            &["'m'", "GPU 0", "GPU use is OFF"],
        );
        expect_msg(
            infer_request_set_output_memory(r.0, 7, 0),
            INFER_STATUS_INVALID_ARGUMENT,
            &["memory type 7"],
        );
        expect_msg(
            infer_request_set_output_memory(null_mut(), INFER_MEMORY_CPU, 0),
            INFER_STATUS_INVALID_ARGUMENT,
            &["'r'"],
        );
    }
    // The refused calls left the request usable; its outputs are in host memory.
    let resp = off.infer(r);
    assert_eq!(resp.output_f32("OUTPUT0"), vec![3.; 4]);
    unsafe {
        for i in 0..2 {
            let (mut mem, mut dev) = (99u32, 99i64);
            ok(infer_response_output_memory(resp.0, i, &mut mem, &mut dev));
            assert_eq!((mem, dev), (INFER_MEMORY_CPU, 0));
        }
        let (mut mem, mut dev) = (99u32, 99i64);
        expect_msg(
            infer_response_output_memory(resp.0, 2, &mut mem, &mut dev),
            INFER_STATUS_INVALID_ARGUMENT,
            &["index 2", "2 outputs"],
        );
        assert_eq!(
            (mem, dev),
            (99, 99),
            "out-parameters are written only on success"
        );
        expect_msg(
            infer_response_output_memory(resp.0, 0, null_mut(), &mut dev),
            INFER_STATUS_INVALID_ARGUMENT,
            &["'mem'"],
        );
        expect_msg(
            infer_response_output_memory(null(), 0, &mut mem, &mut dev),
            INFER_STATUS_INVALID_ARGUMENT,
            &["'r'"],
        );
    }

    // AUTO without a GPU: the probe's reason.
    if let Some(why) = no_gpu_reason() {
        let auto = Server::new();
        auto.load("m", &add_sub_config("m", ""));
        let r = auto.request("m");
        let msg = expect_msg(
            unsafe { infer_request_set_output_memory(r.0, INFER_MEMORY_GPU, 0) },
            INFER_STATUS_UNAVAILABLE,
            &["no usable GPU"],
        );
        let reason = why.trim_start_matches("GPU required but ");
        assert!(msg.contains(reason), "{msg:?} lacks {reason:?}");
    } else {
        let auto = Server::new();
        auto.load("m", &add_sub_config("m", ""));
        let r = auto.request("m");
        unsafe {
            expect_msg(
                infer_request_set_output_memory(r.0, INFER_MEMORY_GPU, 4096),
                INFER_STATUS_INVALID_ARGUMENT,
                &["GPU 4096"],
            );
        }
        // A model on the CPU answers in the memory of the GPU asked for.
        let resp = auto.infer(ask_gpu(add_sub_request(&auto, "m", [1.; 4], [2.; 4]), 0));
        assert_eq!(resp.status(), INFER_STATUS_OK, "{}", resp.error());
        let (mem, dev, sum) = read_output(&resp, "OUTPUT0");
        assert_eq!((mem, dev), (INFER_MEMORY_GPU, 0));
        assert_eq!(sum, vec![3.; 4]);
    }
}

#[test]
fn borrowed_gpu_input_without_a_gpu() {
    let off = server_in(INFER_GPU_OFF).unwrap_or_else(|(st, m)| panic!("{st} {m}"));
    off.load("m", &add_sub_config("m", ""));
    let r = off.request("m");
    let data = [1f32; 4];
    let add = |mem: u32, dev: i64| unsafe {
        infer_request_add_input_borrowed(
            r.0,
            c"INPUT0".as_ptr(),
            INFER_DATATYPE_FP32,
            [1i64, 4].as_ptr(),
            2,
            data.as_ptr() as *const c_void,
            16,
            mem,
            dev,
            None,
            null_mut(),
        )
    };
    expect_msg(
        add(INFER_MEMORY_GPU, 0),
        INFER_STATUS_UNAVAILABLE,
        &["'INPUT0'", "'m'", "GPU use is OFF"],
    );
    expect_msg(add(9, 0), INFER_STATUS_INVALID_ARGUMENT, &["memory type 9"]);
    // Host memory, pinned or not, is taken.
    ok(add(INFER_MEMORY_CPU_PINNED, 0));
}

#[test]
fn custom_backend_sees_host_memory_on_a_cpu_instance() {
    let s = server_in(INFER_GPU_OFF).unwrap_or_else(|(st, m)| panic!("{st} {m}"));
    register_copy_backend(&s);
    s.load("c", &copy_config("c", "dynamic_batching { }"));
    let c = Collector::new();
    let mut ids = Vec::new();
    for i in 0..4 {
        let x = i as f32;
        let req = s.request("c").input_f32("IN", &[1, 2], &[x, x + 0.5]);
        ids.push(
            s.enqueue(req, &c)
                .unwrap_or_else(|(st, m)| panic!("{st} {m}")),
        );
    }
    c.wait(4);
    let responses = c.take();
    assert_eq!(responses.len(), ids.len());
    for resp in responses {
        assert_eq!(resp.status(), INFER_STATUS_OK, "{}", resp.error());
    }
}

// ---- the probe against a stand-in driver (tests/fixtures/fake_libcuda.c) ----

/// Builds the stand-in driver into `dir` as libcuda.so and libcuda.so.1; Err says why not.
fn build_fake_driver(dir: &std::path::Path, only_version: bool) -> Result<(), String> {
    if !only_version {
        return build_fakes(dir, 13);
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/fake_libcuda.c");
    let lib = dir.join("libcuda.so.1");
    let mut cc = std::process::Command::new("cc");
    cc.args([
        "-shared",
        "-fPIC",
        "-O1",
        "-pthread",
        "-DONLY_VERSION",
        "-o",
    ])
    .arg(&lib)
    .arg(src)
    .arg("-lm");
    match cc.output() {
        Ok(out) if out.status.success() => {}
        Ok(out) => return Err(String::from_utf8_lossy(&out.stderr).into_owned()),
        Err(e) => return Err(format!("cc: {e}")),
    }
    // A link, not a copy: the library may open either name and the tests open
    // libcuda.so.1; both must be the same loaded object (one set of driver state).
    let link = dir.join("libcuda.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink("libcuda.so.1", &link).map_err(|e| e.to_string())?;
    Ok(())
}

/// Runs `fake_driver_child` in a fresh process with the stand-in driver first on the
/// loader's path; returns its output.
fn run_with_fake_driver(dir: &std::path::Path, scenario: &str) -> String {
    run_child(
        "fake_driver_child",
        &[
            ("LD_LIBRARY_PATH", dir.as_os_str()),
            ("INFER_FAKE_CUDA", scenario.as_ref()),
        ],
        &format!("fake driver '{scenario}': checked"),
    )
}

#[test]
fn probe_against_a_stand_in_driver() {
    let base = std::env::temp_dir().join(format!("infer-fake-cuda-{}", std::process::id()));
    let (full, partial) = (base.join("full"), base.join("partial"));
    if let Err(why) =
        build_fake_driver(&full, false).and_then(|()| build_fake_driver(&partial, true))
    {
        println!("SKIP: cannot build the stand-in driver ({why})");
        return;
    }
    for scenario in ["old", "nodevice", "one"] {
        run_with_fake_driver(&full, scenario);
    }
    run_with_fake_driver(&partial, "partial");
    let _ = std::fs::remove_dir_all(&base);
}

/// The child of `probe_against_a_stand_in_driver` (does nothing in a normal run).
#[test]
fn fake_driver_child() {
    let Some(scenario) = std::env::var_os("INFER_FAKE_CUDA") else {
        return;
    };
    let scenario = scenario.to_string_lossy().into_owned();
    let required = server_in(INFER_GPU_REQUIRED);
    let want = match scenario.as_str() {
        "old" => Some("supports CUDA 11.8; this build needs 12.0"),
        "nodevice" => Some("cuInit failed: CUDA_ERROR_NO_DEVICE"),
        "partial" => Some("the CUDA driver could not be used"),
        _ => None,
    };
    if let Some(want) = want {
        let (st, msg) = required
            .err()
            .expect("REQUIRED started without a usable GPU");
        assert_eq!(st, INFER_STATUS_UNAVAILABLE, "{msg}");
        assert!(
            msg.starts_with("GPU required but ") && msg.contains(want),
            "{msg}"
        );
        // AUTO still serves, on the CPU.
        let s = Server::new();
        s.load("m", &add_sub_config("m", ""));
        let r = s.infer(add_sub_request(&s, "m", [1.; 4], [2.; 4]));
        assert_eq!(r.output_f32("OUTPUT0"), vec![3.; 4]);
        expect_msg(
            s.try_load("g", &gpu_config("g", "{ kind: KIND_GPU }")),
            INFER_STATUS_UNAVAILABLE,
            &["'g'", want],
        );
    } else {
        // "one": a GPU is there, and nothing can run on it yet.
        let s = required.unwrap_or_else(|(st, m)| panic!("REQUIRED with one GPU: {st} {m}"));
        expect_msg(
            s.try_load("m", &gpu_config("m", "{ kind: KIND_GPU gpus: [ 1 ] }")),
            INFER_STATUS_INVALID_ARGUMENT,
            &["'m'", "GPU 1", "does not exist", "ids 0 to 0"],
        );
        expect_msg(
            s.try_load("m", &gpu_config("m", "{ kind: KIND_GPU gpus: [ 0 ] }")),
            INFER_STATUS_UNSUPPORTED,
            &[
                "backend 'add_sub' cannot run on a GPU",
                "KIND_CPU or KIND_AUTO",
            ],
        );
        s.load(
            "m",
            &add_sub_config("m", "instance_group [ { kind: KIND_AUTO } ]"),
        );
        let r = add_sub_request(&s, "m", [1.; 4], [2.; 4]);
        unsafe {
            expect_msg(
                infer_request_set_output_memory(r.0, INFER_MEMORY_GPU, 1),
                INFER_STATUS_INVALID_ARGUMENT,
                &["GPU 1"],
            );
            ok(infer_request_set_output_memory(r.0, INFER_MEMORY_GPU, 0));
        }
        // A model on the CPU computes in host memory; its outputs are copied to the GPU
        // asked for, and it says so.
        let resp = s.infer(r);
        assert_eq!(
            read_output(&resp, "OUTPUT0"),
            (INFER_MEMORY_GPU, 0, vec![3.; 4])
        );
        // Without asking, host memory.
        let resp = s.infer(add_sub_request(&s, "m", [1.; 4], [2.; 4]));
        assert_eq!(resp.output_f32("OUTPUT0"), vec![3.; 4]);
        let (mut mem, mut dev) = (99u32, 99i64);
        ok(unsafe { infer_response_output_memory(resp.0, 0, &mut mem, &mut dev) });
        assert_eq!((mem, dev), (INFER_MEMORY_CPU, 0));
    }
    println!("fake driver '{scenario}': checked");
}

// ---- the data path of GPU instances, against the stand-in driver ----
//
// The stand-in driver keeps "device" memory in host RAM and runs each stream's copies on
// a thread of its own, each after a delay, so a library that reads results before
// waiting for its stream sees the stand-in's poison bytes. It counts allocations and
// copies, so the tests can check that the steady state allocates nothing and that every
// asynchronous copy uses pinned memory.

/// The stand-in driver's counters (`struct fake_cuda_counters`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct FakeCounters {
    mem_alloc: u64,
    mem_free: u64,
    host_alloc: u64,
    host_free: u64,
    async_copies: u64,
    pageable_async_copies: u64,
    sync_copies: u64,
    memsets: u64,
    host_funcs: u64,
    stream_creates: u64,
    stream_destroys: u64,
    event_records: u64,
    invalid_calls: u64,
    live_device_bytes: u64,
    live_host_bytes: u64,
    kernel_launches: u64,
    graph_launches: u64,
    graph_nodes: u64,
}

type HostFn = unsafe extern "C" fn(*mut c_void);

/// Driver calls the tests make themselves (the stand-in's, in the child process).
struct Driver {
    /// The stand-in's own functions (None with a real driver).
    counters: Option<unsafe extern "C" fn(*mut FakeCounters)>,
    reset: Option<unsafe extern "C" fn()>,
    context_state: Option<unsafe extern "C" fn(i32, *mut i32) -> i32>,
    retain: unsafe extern "C" fn(*mut *mut c_void, i32) -> i32,
    set_current: unsafe extern "C" fn(*mut c_void) -> i32,
    mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> i32,
    mem_free: unsafe extern "C" fn(u64) -> i32,
    htod: unsafe extern "C" fn(u64, *const c_void, usize) -> i32,
    stream_sync: unsafe extern "C" fn(*mut c_void) -> i32,
    dtoh: unsafe extern "C" fn(*mut c_void, u64, usize) -> i32,
    dtod_async: unsafe extern "C" fn(u64, u64, usize, *mut c_void) -> i32,
    host_func: unsafe extern "C" fn(*mut c_void, HostFn, *mut c_void) -> i32,
    pointer_attr: unsafe extern "C" fn(*mut c_void, i32, u64) -> i32,
    begin_capture: unsafe extern "C" fn(*mut c_void, i32) -> i32,
    get_current: unsafe extern "C" fn(*mut *mut c_void) -> i32,
    stream_create: unsafe extern "C" fn(*mut *mut c_void, u32) -> i32,
    stream_destroy: unsafe extern "C" fn(*mut c_void) -> i32,
    dtoh_async: unsafe extern "C" fn(*mut c_void, u64, usize, *mut c_void) -> i32,
    mem_host_alloc: unsafe extern "C" fn(*mut *mut c_void, usize, u32) -> i32,
    mem_free_host: unsafe extern "C" fn(*mut c_void) -> i32,
    /// The stand-in's `fake_cuda_inject_fault(dev, code)` (None with a real driver).
    inject_fault: Option<unsafe extern "C" fn(i32, i32)>,
    module_load_data: unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> i32,
    module_get_function:
        unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const std::ffi::c_char) -> i32,
    #[allow(clippy::type_complexity)]
    launch_kernel: unsafe extern "C" fn(
        *mut c_void,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        *mut c_void,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> i32,
}

/// Streams (created, destroyed) counted before the last reset of the counters.
static TOTAL_STREAMS: std::sync::Mutex<(u64, u64)> = std::sync::Mutex::new((0, 0));

#[allow(clippy::missing_transmute_annotations)] // each field's type says what it is
fn driver() -> &'static Driver {
    static D: std::sync::OnceLock<Driver> = std::sync::OnceLock::new();
    D.get_or_init(|| unsafe {
        let h = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW);
        assert!(!h.is_null(), "no CUDA driver on the loader's path");
        let sym = |name: &std::ffi::CStr| {
            let p = libc::dlsym(h, name.as_ptr());
            assert!(!p.is_null(), "the CUDA driver lacks {name:?}");
            p
        };
        let optional = |name: &std::ffi::CStr| libc::dlsym(h, name.as_ptr());
        use std::mem::transmute as t;
        Driver {
            counters: t(optional(c"fake_cuda_counters")),
            reset: t(optional(c"fake_cuda_reset_counters")),
            context_state: t(optional(c"fake_cuda_context_state")),
            retain: t(sym(c"cuDevicePrimaryCtxRetain")),
            set_current: t(sym(c"cuCtxSetCurrent")),
            mem_alloc: t(sym(c"cuMemAlloc_v2")),
            mem_free: t(sym(c"cuMemFree_v2")),
            htod: t(sym(c"cuMemcpyHtoD_v2")),
            stream_sync: t(sym(c"cuStreamSynchronize")),
            dtoh: t(sym(c"cuMemcpyDtoH_v2")),
            dtod_async: t(sym(c"cuMemcpyDtoDAsync_v2")),
            host_func: t(sym(c"cuLaunchHostFunc")),
            pointer_attr: t(sym(c"cuPointerGetAttribute")),
            begin_capture: t(sym(c"cuStreamBeginCapture_v2")),
            get_current: t(sym(c"cuCtxGetCurrent")),
            stream_create: t(sym(c"cuStreamCreate")),
            stream_destroy: t(sym(c"cuStreamDestroy_v2")),
            dtoh_async: t(sym(c"cuMemcpyDtoHAsync_v2")),
            mem_host_alloc: t(sym(c"cuMemHostAlloc")),
            mem_free_host: t(sym(c"cuMemFreeHost")),
            inject_fault: t(optional(c"fake_cuda_inject_fault")),
            module_load_data: t(sym(c"cuModuleLoadData")),
            module_get_function: t(sym(c"cuModuleGetFunction")),
            launch_kernel: t(sym(c"cuLaunchKernel")),
        }
    })
}

impl Driver {
    /// Whether this is a real CUDA driver (it has no counters): checks that count
    /// launches, copies or bytes are the stand-in's alone.
    fn real(&self) -> bool {
        self.counters.is_none()
    }
    /// The stand-in's counters (all zero on a real driver: see [`Driver::real`]).
    fn counters(&self) -> FakeCounters {
        let mut c = FakeCounters::default();
        if let Some(f) = self.counters {
            unsafe { f(&mut c) };
        }
        c
    }
    fn reset(&self) {
        let f = self.reset.expect("the stand-in driver's counters");
        let now = self.counters();
        let mut t = TOTAL_STREAMS.lock().unwrap();
        t.0 += now.stream_creates;
        t.1 += now.stream_destroys;
        unsafe { f() };
    }
    /// Streams created and destroyed since the process started (across resets).
    fn streams(&self) -> (u64, u64) {
        let now = self.counters();
        let t = TOTAL_STREAMS.lock().unwrap();
        (t.0 + now.stream_creates, t.1 + now.stream_destroys)
    }
    /// Makes GPU `dev`'s primary context current on this thread.
    fn bind(&self, dev: i32) {
        let mut ctx = null_mut();
        unsafe {
            assert_eq!((self.retain)(&mut ctx, dev), 0);
            assert_eq!((self.set_current)(ctx), 0);
        }
    }
    /// Device memory on the bound device holding `data`.
    fn upload(&self, data: &[f32]) -> u64 {
        let mut p = 0u64;
        unsafe {
            assert_eq!((self.mem_alloc)(&mut p, data.len() * 4), 0);
            assert_eq!(
                (self.htod)(p, data.as_ptr() as *const c_void, data.len() * 4),
                0
            );
            // From pageable memory the copy may still be in flight when it returns; the
            // library's streams are non-blocking: wait for the legacy stream.
            assert_eq!((self.stream_sync)(null_mut()), 0);
        }
        p
    }
    fn download(&self, p: u64, n: usize) -> Vec<f32> {
        let mut v = vec![0f32; n];
        assert_eq!(
            unsafe { (self.dtoh)(v.as_mut_ptr() as *mut c_void, p, n * 4) },
            0
        );
        v
    }
    /// (memory type, device ordinal) of an address: 2 = device, 1 = host.
    fn place(&self, p: u64) -> (u32, i32) {
        let (mut ty, mut dev) = (0u32, -1i32);
        unsafe {
            assert_eq!(
                (self.pointer_attr)(&mut ty as *mut u32 as *mut c_void, 2, p),
                0
            );
            assert_eq!(
                (self.pointer_attr)(&mut dev as *mut i32 as *mut c_void, 9, p),
                0
            );
        }
        (ty, dev)
    }
}

/// A model whose backend computes Y = 2 X + 1 and X_COPY = X on the GPU instance's
/// stream: X_COPY with a device-to-device copy, Y with a host function queued on the
/// stream (the stand-in's device memory is host memory).
fn affine_config(name: &str, group: &str, extra: &str) -> String {
    format!(
        r#"name: "{name}" backend: "gpu_affine" max_batch_size: 8
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }},
         {{ name: "X_COPY" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {group} ]
{extra}"#
    )
}

unsafe extern "C" fn affine_init(
    _: *mut c_void,
    _: *const std::ffi::c_char,
    _: *const std::ffi::c_char,
    _: u32,
    gpu: i32,
    state: *mut *mut c_void,
) -> u32 {
    *state = Box::into_raw(Box::new(gpu)) as *mut c_void;
    INFER_STATUS_OK
}

unsafe extern "C" fn affine_fini(state: *mut c_void) {
    drop(Box::from_raw(state as *mut i32));
}

struct AffineJob {
    x: u64,
    y: u64,
    n: usize,
}

/// How long the "kernel" takes (to observe batches overlapping), and what overlapped.
static KERNEL_US: AtomicU64 = AtomicU64::new(0);
static KERNELS_DONE: AtomicU64 = AtomicU64::new(0);
static EXECUTES: AtomicU64 = AtomicU64::new(0);
/// Executes that began while an earlier batch's kernel had not run yet.
static OVERLAPPED: AtomicU64 = AtomicU64::new(0);
/// The next execute begins a CUDA graph capture on the instance's stream, queues its
/// work into it and returns without ending it (a backend bug the library must survive).
static LEAVE_CAPTURE_OPEN: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

unsafe extern "C" fn affine_kernel(job: *mut c_void) {
    let job = Box::from_raw(job as *mut AffineJob);
    let us = KERNEL_US.load(SeqCst);
    if us > 0 {
        std::thread::sleep(std::time::Duration::from_micros(us));
    }
    let x = std::slice::from_raw_parts(job.x as *const f32, job.n);
    let y = std::slice::from_raw_parts_mut(job.y as *mut f32, job.n);
    for (y, x) in y.iter_mut().zip(x) {
        *y = 2. * x + 1.;
    }
    KERNELS_DONE.fetch_add(1, SeqCst);
}

fn affine_batch(gpu: i32, b: *mut Batch) -> std::result::Result<(), String> {
    let d = driver();
    if EXECUTES.fetch_add(1, SeqCst) > KERNELS_DONE.load(SeqCst) {
        OVERLAPPED.fetch_add(1, SeqCst);
    }
    unsafe {
        let stream = infer_batch_cuda_stream(b);
        if stream.is_null() {
            return Err("no stream on a GPU instance".into());
        }
        let (mut mem, mut dev) = (99u32, 99i64);
        ok(infer_batch_input_memory(
            b,
            c"X".as_ptr(),
            &mut mem,
            &mut dev,
        ));
        if (mem, dev) != (INFER_MEMORY_GPU, gpu as i64) {
            return Err(format!(
                "input memory {mem} on {dev}, instance on GPU {gpu}"
            ));
        }
        let (mut shape, mut nd, mut data, mut bytes) = (null(), 0usize, null(), 0usize);
        ok(infer_batch_input(
            b,
            c"X".as_ptr(),
            null_mut(),
            &mut shape,
            &mut nd,
            &mut data,
            &mut bytes,
        ));
        let x = data as u64;
        let (ty, on) = d.place(x);
        if ty != 2 || on != gpu {
            return Err(format!("input X at {x:#x}: memory type {ty} on GPU {on}"));
        }
        let rows = infer_batch_size(b) as i64;
        // [rows, 4] for the affine models, [rows, any width] for `wide_config`'s.
        let dims = std::slice::from_raw_parts(shape, nd);
        let width = dims.get(1).copied().unwrap_or(-1);
        if nd != 2 || dims[0] != rows || width < 0 || bytes != (rows * width) as usize * 4 {
            return Err(format!("input X: shape {dims:?}, {bytes} bytes"));
        }
        let (mut y, mut xc) = (null_mut(), null_mut());
        ok(infer_batch_output_device(
            b,
            c"Y".as_ptr(),
            [rows, width].as_ptr(),
            2,
            &mut y,
        ));
        ok(infer_batch_output_device(
            b,
            c"X_COPY".as_ptr(),
            [rows, width].as_ptr(),
            2,
            &mut xc,
        ));
        if d.place(y as u64) != (2, gpu) {
            return Err("output Y is not on the instance's GPU".into());
        }
        // The same output twice, and BYTES-free checks of the section-10 calls.
        let mut again = null_mut();
        let st = infer_batch_output_device(b, c"Y".as_ptr(), [rows, width].as_ptr(), 2, &mut again);
        if st != INFER_STATUS_INVALID_ARGUMENT || !last_error().contains("already allocated") {
            return Err(format!("second Y: {st} {}", last_error()));
        }
        if LEAVE_CAPTURE_OPEN.swap(false, SeqCst) {
            // Relaxed mode (2): the library's own calls on other streams go on.
            assert_eq!((d.begin_capture)(stream, 2), 0);
            assert_eq!((d.dtod_async)(xc as u64, x, bytes, stream), 0);
            assert_eq!((d.dtod_async)(y as u64, x, bytes, stream), 0);
            KERNELS_DONE.fetch_add(1, SeqCst);
            return Ok(());
        }
        assert_eq!((d.dtod_async)(xc as u64, x, bytes, stream), 0);
        let job = Box::new(AffineJob {
            x,
            y: y as u64,
            n: (rows * width) as usize,
        });
        assert_eq!(
            (d.host_func)(stream, affine_kernel, Box::into_raw(job) as *mut c_void),
            0
        );
    }
    Ok(())
}

unsafe extern "C" fn affine_execute(state: *mut c_void, b: *mut Batch) -> u32 {
    match affine_batch(*(state as *const i32), b) {
        Ok(()) => INFER_STATUS_OK,
        Err(why) => {
            let msg = cs(&why);
            infer_batch_set_error_message(b, msg.as_ptr());
            INFER_STATUS_INTERNAL
        }
    }
}

fn register_affine_backend(s: &Server) {
    let vt = infer_backend {
        struct_size: std::mem::size_of::<infer_backend>() as u32,
        instance_init: Some(affine_init),
        execute: Some(affine_execute),
        instance_fini: Some(affine_fini),
        finalize: None,
    };
    ok(unsafe { infer_server_register_backend(s.0, c"gpu_affine".as_ptr(), &vt, null_mut()) });
}

fn x_of(i: usize) -> [f32; 4] {
    let b = i as f32;
    [b, b + 0.25, -b, b * 0.5]
}

/// Where output `name` of a response is, and its values (read from the device when it
/// is there).
fn read_output(resp: &Resp, name: &str) -> (u32, i64, Vec<f32>) {
    let (i, data, bytes) = output_bytes(resp, name);
    let (mut mem, mut dev) = (99u32, 99i64);
    ok(unsafe { infer_response_output_memory(resp.0, i, &mut mem, &mut dev) });
    let values = if mem == INFER_MEMORY_GPU {
        assert_eq!(driver().place(data as u64), (2, dev as i32));
        driver().bind(dev as i32);
        driver().download(data as u64, bytes / 4)
    } else {
        // SAFETY: the response holds `bytes` bytes of host memory at `data`.
        bytemuck::pod_collect_to_vec(unsafe {
            std::slice::from_raw_parts(data as *const u8, bytes)
        })
    };
    (mem, dev, values)
}

/// Output `name` of `resp`: its index, where its bytes lie, and how many there are.
fn output_bytes(resp: &Resp, name: &str) -> (usize, *const c_void, usize) {
    unsafe {
        for i in 0..infer_response_output_count(resp.0) {
            let (mut oname, mut data, mut bytes) = (null(), null(), 0usize);
            ok(infer_response_output(
                resp.0,
                i,
                &mut oname,
                null_mut(),
                null_mut(),
                null_mut(),
                &mut data,
                &mut bytes,
            ));
            if std::ffi::CStr::from_ptr(oname).to_str() == Ok(name) {
                return (i, data, bytes);
            }
        }
    }
    panic!("no output {name}: {}", resp.error())
}

fn affine_request(s: &Server, model: &str, x: [f32; 4], on_gpu: Option<i64>) -> Req {
    let r = s.request(model).input_f32("X", &[1, 4], &x);
    if let Some(dev) = on_gpu {
        ok(unsafe { infer_request_set_output_memory(r.0, INFER_MEMORY_GPU, dev) });
    }
    r
}

fn check_affine(resp: &Resp, x: [f32; 4], want_mem: u32) -> i64 {
    assert_eq!(resp.status(), INFER_STATUS_OK, "{}", resp.error());
    let (mem, dev, y) = read_output(resp, "Y");
    assert_eq!(mem, want_mem);
    assert_eq!(y, x.map(|v| 2. * v + 1.).to_vec());
    let (mem2, dev2, xc) = read_output(resp, "X_COPY");
    assert_eq!((mem2, dev2), (mem, dev));
    assert_eq!(xc, x.to_vec());
    dev
}

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};

/// Callbacks of `unload_p` that ran (the first unloads "p"; all three must be answered).
static UNLOADED: AtomicU64 = AtomicU64::new(0);

unsafe extern "C" fn unload_p(server: *mut c_void, resp: *mut Response, _: u32) {
    if UNLOADED.load(SeqCst) == 0 {
        let st = infer_server_unload_model(server as *mut ServerHandle, c"p".as_ptr());
        assert_eq!(st, INFER_STATUS_OK, "{}", last_error());
    }
    infer_response_free(resp);
    UNLOADED.fetch_add(1, SeqCst);
}

static RELEASED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

unsafe extern "C" fn count_release(_: *mut c_void) {
    RELEASED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
}

/// Adds input `name` from device memory `p` (GPU `dev`) with a counting release.
fn device_input(r: &Req, name: &str, p: u64, bytes: usize, dev: i64) -> infer_status {
    unsafe {
        infer_request_add_input_borrowed(
            r.0,
            cs(name).as_ptr(),
            INFER_DATATYPE_FP32,
            [1i64, 4].as_ptr(),
            2,
            p as *const c_void,
            bytes,
            INFER_MEMORY_GPU,
            dev,
            Some(count_release),
            null_mut(),
        )
    }
}

/// One GPU: batching, outputs on the host and on the device, device inputs, the steady
/// state, bad device memory.
fn rate_limited_gpu_instances_take_turns() {
    let mut o = null_mut();
    let mut p = null_mut();
    unsafe {
        ok(infer_server_options_new(&mut o));
        ok(infer_server_options_set_gpu(o, INFER_GPU_REQUIRED));
        ok(infer_server_options_set_rate_limit(
            o,
            INFER_RATE_LIMIT_EXECUTION_COUNT,
        ));
        ok(infer_server_new(o, &mut p));
        infer_server_options_free(o);
    }
    let s = Server(p);
    register_affine_backend(&s);
    s.load(
        "r",
        &affine_config(
            "r",
            r#"{ kind: KIND_GPU count: 2 gpus: [ 0 ] rate_limiter { resources [ { name: "R" count: 1 } ] } }"#,
            "dynamic_batching { max_queue_delay_microseconds: 500 }",
        ),
    );
    let c = Collector::new();
    let ids: Vec<u64> = (0..32)
        .map(|i| {
            s.enqueue(affine_request(&s, "r", x_of(i), None), &c)
                .unwrap()
        })
        .collect();
    c.wait(ids.len());
    c.assert_exactly_once(&ids);
    for resp in c.take() {
        let i = ids.iter().position(|&id| id == resp.id()).unwrap();
        check_affine(&resp, x_of(i), INFER_MEMORY_CPU_PINNED);
    }
}

fn data_path_one_gpu() {
    let d = driver();
    let s = server_in(INFER_GPU_REQUIRED).unwrap_or_else(|(st, m)| panic!("{st} {m}"));
    register_affine_backend(&s);
    s.load(
        "g",
        &affine_config(
            "g",
            "{ kind: KIND_GPU count: 2 gpus: [ 0 ] }",
            "dynamic_batching { max_queue_delay_microseconds: 3000 }",
        ),
    );

    // Concurrent requests, batched; every third wants its outputs on the device.
    let c = Collector::new();
    let n = 48;
    let mut ids = Vec::new();
    for i in 0..n {
        let gpu = (i % 3 == 0).then_some(0);
        ids.push(
            s.enqueue(affine_request(&s, "g", x_of(i), gpu), &c)
                .unwrap(),
        );
    }
    c.wait(n);
    c.assert_exactly_once(&ids);
    let mut batched = false;
    for resp in c.take() {
        let i = ids.iter().position(|&id| id == resp.id()).unwrap();
        let mem = if i % 3 == 0 {
            INFER_MEMORY_GPU
        } else {
            INFER_MEMORY_CPU_PINNED
        };
        check_affine(&resp, x_of(i), mem);
        batched = true;
    }
    assert!(batched);
    let st = s.stats("g");
    let execs = st["models"][0]["execution_count"].as_u64().unwrap_or(0);
    println!("48 requests in {execs} executions");
    assert!(execs < 48, "no batch had more than one request: {st}");

    // With the rate limiter on, a GPU instance that overlaps two batches holds the
    // resource of one: it finishes that batch before it takes the resource again (else it
    // would wait for itself), and the two instances sharing the GPU's one unit take turns.
    rate_limited_gpu_instances_take_turns();

    // The steady state: requests one at a time to one instance, sizes repeating: no
    // allocation, and every asynchronous copy from or to pinned memory.
    s.load(
        "s1",
        &affine_config("s1", "{ kind: KIND_GPU count: 1 gpus: [ 0 ] }", ""),
    );
    for round in 0..12 {
        if round == 2 {
            d.reset();
        }
        let gpu = (round % 2 == 0).then_some(0);
        let resp = s.infer(affine_request(&s, "s1", x_of(round), gpu));
        check_affine(
            &resp,
            x_of(round),
            if gpu.is_some() {
                INFER_MEMORY_GPU
            } else {
                INFER_MEMORY_CPU_PINNED
            },
        );
    }
    let c = d.counters();
    assert_eq!((c.mem_alloc, c.host_alloc), (0, 0), "{c:?}");
    assert!(c.async_copies >= 10 * 2, "{c:?}");
    assert_eq!(c.pageable_async_copies, 0, "{c:?}");
    assert_eq!(c.invalid_calls, 0, "{c:?}");

    // Double buffering: with slow kernels, the next batch starts (its inputs staged and
    // its work queued) while the previous one is still running.
    s.load(
        "p",
        &affine_config("p", "{ kind: KIND_GPU count: 1 gpus: [ 0 ] }", ""),
    );
    KERNEL_US.store(20_000, SeqCst);
    let (executes, kernels) = (EXECUTES.load(SeqCst), KERNELS_DONE.load(SeqCst));
    assert_eq!(executes, kernels);
    OVERLAPPED.store(0, SeqCst);
    let c = Collector::new();
    let mut ids = Vec::new();
    for i in 0..6 {
        ids.push(
            s.enqueue(affine_request(&s, "p", x_of(i), None), &c)
                .unwrap(),
        );
    }
    c.wait(6);
    c.assert_exactly_once(&ids);
    for resp in c.take() {
        let i = ids.iter().position(|&id| id == resp.id()).unwrap();
        check_affine(&resp, x_of(i), INFER_MEMORY_CPU_PINNED);
    }
    KERNEL_US.store(0, SeqCst);
    let overlapped = OVERLAPPED.load(SeqCst);
    println!("6 batches, {overlapped} started while the previous one ran");
    assert!(
        overlapped >= 1,
        "no batch started before the previous one finished"
    );

    // A callback that unloads its own model (on the worker that runs the batches)
    // while a second batch is in flight.
    KERNEL_US.store(5_000, SeqCst);
    UNLOADED.store(0, SeqCst);
    for i in 0..3 {
        let r = affine_request(&s, "p", x_of(i), None);
        let mut id = 0;
        ok(unsafe {
            infer_server_enqueue(s.0, r.take(), Some(unload_p), s.0 as *mut c_void, &mut id)
        });
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while UNLOADED.load(SeqCst) < 3 {
        assert!(
            std::time::Instant::now() < deadline,
            "callbacks did not finish"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    KERNEL_US.store(0, SeqCst);
    expect_msg(
        unsafe { infer_server_unload_model(s.0, c"p".as_ptr()) },
        INFER_STATUS_NOT_FOUND,
        &["'p'"],
    );

    // Inputs already on the device: read in place by the GPU model (no copy to it), and
    // copied to the host for a model on the CPU; released exactly once either way.
    d.bind(0);
    let x = x_of(7);
    let p = d.upload(&x);
    RELEASED.store(0, std::sync::atomic::Ordering::SeqCst);
    d.reset();
    let r = s.request("g");
    ok(device_input(&r, "X", p, 16, 0));
    let resp = s.infer(r);
    check_affine(&resp, x, INFER_MEMORY_CPU_PINNED);
    let c = d.counters();
    // Down: Y and X_COPY; up: nothing (X was used in place).
    assert_eq!(c.async_copies, 3, "{c:?}"); // + the backend's own device-to-device copy
    drop(resp);
    assert_eq!(RELEASED.load(std::sync::atomic::Ordering::SeqCst), 1);
    // Not 256-byte aligned: copied into the batch's buffer instead of read in place.
    let wide = d.upload(&[x_of(8), x_of(9)].concat());
    d.reset();
    let r = s.request("g");
    ok(device_input(&r, "X", wide + 16, 16, 0));
    let resp = s.infer(r);
    check_affine(&resp, x_of(9), INFER_MEMORY_CPU_PINNED);
    assert_eq!(d.counters().async_copies, 4, "{:?}", d.counters());
    drop(resp);
    assert_eq!(RELEASED.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert_eq!(unsafe { (d.mem_free)(wide) }, 0);

    s.load("cpu", &add_sub_config("cpu", ""));
    let (a, b) = ([1., 2., 3., 4.], [0.5; 4]);
    let (pa, pb) = (d.upload(&a), d.upload(&b));
    let r = s.request("cpu");
    ok(device_input(&r, "INPUT0", pa, 16, 0));
    ok(device_input(&r, "INPUT1", pb, 16, 0));
    let resp = s.infer(r);
    assert_eq!(resp.output_f32("OUTPUT0"), vec![1.5, 2.5, 3.5, 4.5]);
    assert_eq!(resp.output_f32("OUTPUT1"), vec![0.5, 1.5, 2.5, 3.5]);
    assert_eq!(RELEASED.load(std::sync::atomic::Ordering::SeqCst), 4);

    // Bad device memory is refused with the reason, and not taken.
    let host = [0f32; 4];
    let r = s.request("g");
    expect_msg(
        device_input(&r, "X", host.as_ptr() as u64, 16, 0),
        INFER_STATUS_INVALID_ARGUMENT,
        &["input 'X' of model 'g' on GPU 0", "not device memory"],
    );
    expect_msg(
        device_input(&r, "X", p + 8, 16, 0),
        INFER_STATUS_INVALID_ARGUMENT,
        &[
            "16 bytes at",
            "run past the end of its allocation (16 bytes",
        ],
    );
    expect_msg(
        device_input(&r, "X", p, 16, 1),
        INFER_STATUS_INVALID_ARGUMENT,
        &["GPU 1 does not exist"],
    );
    expect_msg(
        device_input(&r, "X", p, 12, 0),
        INFER_STATUS_INVALID_ARGUMENT,
        &["'X'", "16 bytes"],
    );
    assert_eq!(RELEASED.load(std::sync::atomic::Ordering::SeqCst), 4);
    drop(r);

    // A backend on a CPU instance cannot allocate device outputs (and sees host memory).
    register_copy_backend(&s);
    s.load(
        "c",
        &copy_config("c", "instance_group [ { kind: KIND_CPU } ]"),
    );
    let resp = s.infer(s.request("c").input_f32("IN", &[1, 2], &[1., 2.]));
    assert_eq!(resp.output_f32("OUT"), vec![1., 2.]);

    gpu_statistics_one_gpu(&s);
    outputs_read_after_free(&s);
    frees_keep_the_callers_context(&s);
    host_outputs_on_the_device(&s);
    wide_rows_staged_in_chunks_and_outputs_lent(&s);

    // A backend that leaves a CUDA graph capture open on the instance's stream fails its
    // own batch, naming the capture; the instance then serves as before (the capture is
    // ended and what it recorded dropped, so the stream runs work again).
    s.load(
        "cap",
        &affine_config("cap", "{ kind: KIND_GPU count: 1 gpus: [ 0 ] }", ""),
    );
    check_affine(
        &s.infer(affine_request(&s, "cap", x_of(1), None)),
        x_of(1),
        INFER_MEMORY_CPU_PINNED,
    );
    LEAVE_CAPTURE_OPEN.store(true, SeqCst);
    let resp = s.infer(affine_request(&s, "cap", x_of(2), None));
    assert_eq!(resp.status(), INFER_STATUS_INTERNAL, "{}", resp.error());
    assert!(
        resp.error().contains("capture") && resp.error().contains("'cap'"),
        "{}",
        resp.error()
    );
    for i in 3..6 {
        let gpu = (i % 2 == 0).then_some(0);
        let want = if gpu.is_some() {
            INFER_MEMORY_GPU
        } else {
            INFER_MEMORY_CPU_PINNED
        };
        check_affine(
            &s.infer(affine_request(&s, "cap", x_of(i), gpu)),
            x_of(i),
            want,
        );
    }
    s.unload("cap");

    drop(s);
    unsafe {
        for q in [p, pa, pb] {
            assert_eq!((d.mem_free)(q), 0);
        }
    }
    // Everything the server allocated went back to the driver.
    let c = d.counters();
    assert_eq!((c.live_device_bytes, c.live_host_bytes), (0, 0), "{c:?}");
    // Every instance's stream was destroyed (the unloaded "p" included).
    let (made, destroyed) = d.streams();
    assert!(
        made >= 4 && made == destroyed,
        "{made} streams made, {destroyed} destroyed"
    );
}

/// The "gpu" section of the model statistics (README "GPU statistics"), against a known
/// workload: batches, copies and bytes exactly; the stream times measured with timing
/// events against what the stand-in makes each step take (INFER_FAKE_CUDA_DELAY_US per
/// copy, KERNEL_US per "kernel"); busy <= wall; the two fractions. Needs the models "g"
/// (two instances, after its batched requests), "cpu" and "c" of `data_path_one_gpu`.
fn gpu_statistics_one_gpu(s: &Server) {
    let d = driver();
    let delay_ns: u64 = std::env::var("INFER_FAKE_CUDA_DELAY_US")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .expect("INFER_FAKE_CUDA_DELAY_US")
        * 1000;
    assert!(delay_ns > 0);
    let kernel_us = 10_000u64;
    let kernel_ns = kernel_us * 1000;
    let u = |v: &serde_json::Value, k: &str| {
        v[k].as_u64()
            .unwrap_or_else(|| panic!("no integer '{k}' in {v}"))
    };
    let f = |v: &serde_json::Value, k: &str| {
        v[k].as_f64()
            .unwrap_or_else(|| panic!("no number '{k}' in {v}"))
    };

    // A fresh model, one instance, one request per batch (no dynamic batching).
    s.load(
        "gs",
        &affine_config("gs", "{ kind: KIND_GPU count: 1 gpus: [ 0 ] }", ""),
    );
    let st = s.stats("gs");
    let inst = &st["models"][0]["gpu"]["instances"];
    assert_eq!(inst.as_array().map(Vec::len), Some(1), "{st}");
    assert_eq!(
        (u(&inst[0], "batches"), u(&inst[0], "wall_ns")),
        (0, 0),
        "before any batch: {st}"
    );
    assert_eq!(f(&inst[0], "busy_fraction"), 0.0, "{st}");

    let began = std::time::Instant::now();
    KERNEL_US.store(kernel_us, SeqCst);
    // 4 requests with host outputs: 1 copy up (X, 16 bytes), 2 down (Y, X_COPY).
    for i in 0..4 {
        check_affine(
            &s.infer(affine_request(s, "gs", x_of(i), None)),
            x_of(i),
            INFER_MEMORY_CPU_PINNED,
        );
    }
    // 2 with device outputs: 1 copy up, none down.
    for i in 4..6 {
        check_affine(
            &s.infer(affine_request(s, "gs", x_of(i), Some(0))),
            x_of(i),
            INFER_MEMORY_GPU,
        );
    }
    // X already on the device: in place (no copy up), then misaligned (one copy from
    // device memory); 2 copies down each.
    d.bind(0);
    let aligned = d.upload(&x_of(6));
    let wide = d.upload(&[x_of(7), x_of(8)].concat());
    for (p, x) in [(aligned, x_of(6)), (wide + 16, x_of(8))] {
        let r = s.request("gs");
        ok(device_input(&r, "X", p, 16, 0));
        check_affine(&s.infer(r), x, INFER_MEMORY_CPU_PINNED);
    }
    KERNEL_US.store(0, SeqCst);
    let st = s.stats("gs");
    let host_elapsed = began.elapsed().as_nanos() as u64;
    unsafe {
        assert_eq!((d.mem_free)(aligned), 0);
        assert_eq!((d.mem_free)(wide), 0);
    }
    let m = &st["models"][0];
    let g = &m["gpu"]["instances"][0];
    println!("GPU statistics of 8 batches: {g}");
    // The same counters in the Prometheus text.
    let mut text = null_mut();
    ok(unsafe { infer_server_metrics_prometheus(s.0, &mut text) });
    let prom = unsafe { std::ffi::CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned();
    unsafe { infer_string_free(text) };
    let l = "model=\"gs\",version=\"1\",instance=\"0\",device=\"0\"";
    for line in [
        format!("infer_gpu_batches_total{{{l}}} 8"),
        format!("infer_gpu_copy_bytes_total{{{l},direction=\"h2d\"}} 96"),
        format!("infer_gpu_copies_total{{{l},direction=\"d2h\"}} 12"),
    ] {
        assert!(prom.lines().any(|x| x == line), "{line} missing:\n{prom}");
    }
    assert_eq!((u(g, "instance"), u(g, "device")), (0, 0), "{st}");
    assert_eq!(u(g, "batches"), 8, "{st}");
    assert_eq!(u(g, "batches"), u(m, "execution_count"), "{st}");
    assert_eq!(
        (u(g, "timed_batches"), u(g, "untimed_batches")),
        (8, 0),
        "{st}"
    );
    assert_eq!((u(g, "h2d_copies"), u(g, "h2d_bytes")), (6, 6 * 16), "{st}");
    assert_eq!((u(g, "d2d_copies"), u(g, "d2d_bytes")), (1, 16), "{st}");
    assert_eq!(
        (u(g, "d2h_copies"), u(g, "d2h_bytes")),
        (12, 12 * 16),
        "{st}"
    );
    let (h2d, compute, d2h, busy, wall) = (
        u(g, "h2d_ns"),
        u(g, "compute_ns"),
        u(g, "d2h_ns"),
        u(g, "busy_ns"),
        u(g, "wall_ns"),
    );
    // Each copy up (or across) takes the delay, and so does each copy down; the
    // "kernel" takes kernel_us after the backend's own copy.
    assert!(h2d >= 7 * delay_ns, "h2d {h2d} ns: {st}");
    assert!(d2h >= 12 * delay_ns, "d2h {d2h} ns: {st}");
    assert!(
        compute >= 8 * (delay_ns + kernel_ns),
        "compute {compute} ns: {st}"
    );
    // The marks are where they belong: the kernels are in neither copy segment.
    assert!(h2d < 8 * kernel_ns, "h2d {h2d} ns holds kernel time: {st}");
    assert!(d2h < 8 * kernel_ns, "d2h {d2h} ns holds kernel time: {st}");
    // First to last event: the three segments (to a float rounding of each).
    let parts = h2d + compute + d2h;
    assert!(
        busy.abs_diff(parts) <= 8 * 4_000,
        "busy {busy} vs {parts}: {st}"
    );
    assert!(busy <= wall, "busy {busy} > wall {wall}: {st}");
    // Wall time is since the first batch (not since the load), up to the read.
    assert!(
        wall <= host_elapsed,
        "wall {wall} > {host_elapsed} elapsed: {st}"
    );
    let (busy_fraction, copy_share) = (f(g, "busy_fraction"), f(g, "copy_share"));
    for v in [busy_fraction, copy_share] {
        assert!((0.0..=1.0).contains(&v), "{v}: {st}");
    }
    assert!(
        (busy_fraction - busy as f64 / wall as f64).abs() < 1e-5,
        "busy_fraction {busy_fraction}: {st}"
    );
    assert!(
        (copy_share - (h2d + d2h) as f64 / busy as f64).abs() < 1e-5,
        "copy_share {copy_share}: {st}"
    );
    // Requests one at a time: the stream idles in between.
    assert!(busy_fraction < 1.0 && copy_share > 0.0, "{st}");

    // Two instances: one entry each; their batches are the model's executions, the bytes
    // up are exactly the requests' host inputs (48 of 16 bytes) and one misaligned
    // device input went across.
    let st = s.stats("g");
    let m = &st["models"][0];
    let inst = m["gpu"]["instances"].as_array().expect("instances");
    assert_eq!(inst.len(), 2, "{st}");
    let sum = |k: &str| inst.iter().map(|g| u(g, k)).sum::<u64>();
    assert_eq!(sum("batches"), u(m, "execution_count"), "{st}");
    assert_eq!(sum("timed_batches"), sum("batches"), "{st}");
    assert_eq!(sum("h2d_bytes"), 48 * 16, "{st}");
    assert_eq!((sum("d2d_copies"), sum("d2d_bytes")), (1, 16), "{st}");
    // Down: Y and X_COPY of every request with host outputs, and of the requests
    // batched with them.
    let down = sum("d2h_bytes");
    assert!(
        (34 * 32..=50 * 32).contains(&down),
        "{down} bytes down: {st}"
    );
    for (i, g) in inst.iter().enumerate() {
        assert_eq!((u(g, "instance"), u(g, "device")), (i as u64, 0), "{st}");
        assert!(u(g, "busy_ns") <= u(g, "wall_ns"), "{st}");
        assert!(u(g, "batches") == 0 || u(g, "h2d_ns") >= u(g, "h2d_copies") * delay_ns);
        assert!(u(g, "d2h_ns") >= u(g, "d2h_copies") * delay_ns, "{st}");
    }

    // Models on the CPU have no "gpu" section.
    for name in ["cpu", "c"] {
        let st = s.stats(name);
        assert!(
            st["models"][0]["execution_count"].as_u64() > Some(0),
            "{st}"
        );
        assert!(st["models"][0].get("gpu").is_none(), "{name}: {st}");
    }
}

/// Two GPUs: an instance on each; outputs on the device of the instance that ran them;
/// device memory named with the wrong GPU.
fn data_path_two_gpus() {
    let d = driver();
    let s = server_in(INFER_GPU_REQUIRED).unwrap_or_else(|(st, m)| panic!("{st} {m}"));
    register_affine_backend(&s);
    s.load(
        "g",
        &affine_config(
            "g",
            "{ kind: KIND_GPU count: 1 gpus: [ 0, 1 ] }",
            "dynamic_batching { max_queue_delay_microseconds: 500 }",
        ),
    );
    let c = Collector::new();
    let n = 40;
    let mut ids = Vec::new();
    for i in 0..n {
        ids.push(
            s.enqueue(affine_request(&s, "g", x_of(i), Some(1)), &c)
                .unwrap(),
        );
    }
    c.wait(n);
    let mut devices = std::collections::BTreeSet::new();
    for resp in c.take() {
        let i = ids.iter().position(|&id| id == resp.id()).unwrap();
        devices.insert(check_affine(&resp, x_of(i), INFER_MEMORY_GPU));
    }
    assert!(devices.iter().all(|d| *d == 0 || *d == 1), "{devices:?}");
    println!("outputs on GPUs {devices:?}");

    d.bind(1);
    let x = x_of(3);
    let p = d.upload(&x);
    let r = s.request("g");
    expect_msg(
        device_input(&r, "X", p, 16, 0),
        INFER_STATUS_INVALID_ARGUMENT,
        &["memory of GPU 1, not of GPU 0"],
    );
    ok(device_input(&r, "X", p, 16, 1));
    let resp = s.infer(r);
    check_affine(&resp, x, INFER_MEMORY_CPU_PINNED);
    drop(resp);
    host_outputs_on_the_asked_gpu(&s);
    pinned_outputs_lent_to_the_other_gpu(&s);
    drop(s);
    assert_eq!(unsafe { (d.mem_free)(p) }, 0);
    let c = d.counters();
    assert_eq!((c.live_device_bytes, c.live_host_bytes), (0, 0), "{c:?}");
    assert_eq!(c.pageable_async_copies, 0, "{c:?}");
}

/// A page-locked output of an instance on GPU 0, lent as input to an instance on GPU 1,
/// goes up from where it lies in one asynchronous copy: the instances' pinned buffers
/// are page-locked for every context (CU_MEMHOSTALLOC_PORTABLE), where the driver would
/// otherwise treat GPU 0's buffer as pageable in GPU 1's context and stage the copy.
fn pinned_outputs_lent_to_the_other_gpu(s: &Server) {
    let d = driver();
    s.load("w0", &wide_config("w0"));
    s.load(
        "w1",
        &wide_config("w1").replace("gpus: [ 0 ]", "gpus: [ 1 ]"),
    );
    let x = wide_row(4, 100_000);
    let first = s.infer(s.request("w0").input_f32("X", &[1, x.len() as i64], &x));
    assert_eq!(check_wide(&first, &x), [INFER_MEMORY_CPU_PINNED; 2]);
    let (_, data, bytes) = output_bytes(&first, "X_COPY");
    assert_eq!(bytes, x.len() * 4);
    let pageable = (!d.real()).then(|| d.counters().pageable_async_copies);
    let before = h2d_of(s, "w1");
    let r = s.request("w1");
    ok(lend_row(&r, data, x.len(), INFER_MEMORY_CPU_PINNED));
    assert_eq!(check_wide(&s.infer(r), &x), [INFER_MEMORY_CPU_PINNED; 2]);
    let after = h2d_of(s, "w1");
    assert_eq!(
        (after.0 - before.0, after.1 - before.1),
        (1, bytes as u64),
        "GPU 0's page-locked output did not go up to GPU 1 in one copy from where it is"
    );
    if let Some(pageable) = pageable {
        assert_eq!(
            d.counters().pageable_async_copies,
            pageable,
            "GPU 0's pinned buffer is not page-locked in GPU 1's context (allocated without CU_MEMHOSTALLOC_PORTABLE)"
        );
    }
    drop(first);
    s.unload("w0");
    s.unload("w1");
}

// ---- host outputs delivered on the GPU a request asked for ----

/// Y = 3 X + 1 (FP32, any length) and TEXT = "y0=<first Y of the row>" per row (BYTES),
/// computed in host memory on CPU instances.
fn host_mixed_config(name: &str) -> String {
    format!(
        r#"name: "{name}" backend: "host_mixed" max_batch_size: 8
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }},
         {{ name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 2 }} ]
dynamic_batching {{ max_queue_delay_microseconds: 2000 }}"#
    )
}

fn host_mixed(b: &mut Batch) -> infer::status::Result<()> {
    let (x, data) = b.input("X").expect("input X");
    let shape = x.shape.clone();
    let y: Vec<f32> = bytemuck::pod_collect_to_vec::<u8, f32>(data)
        .iter()
        .map(|v| 3. * v + 1.)
        .collect();
    b.alloc_output("Y", &shape, None)?
        .copy_from_slice(bytemuck::cast_slice(&y));
    let rows = b.size as usize;
    let per_row = y.len() / rows.max(1);
    let mut text = Vec::new();
    for r in 0..rows {
        let s = format!("y0={}", y[r * per_row]);
        text.extend_from_slice(&(s.len() as u32).to_le_bytes());
        text.extend_from_slice(s.as_bytes());
    }
    let len = text.len();
    b.alloc_output("TEXT", &[rows as i64, 1], Some(len))?
        .copy_from_slice(&text);
    Ok(())
}

/// One output as a callback saw it: name, memory type, device and bytes (read from the
/// device inside the callback when it is there).
#[derive(Clone, Debug)]
struct SeenOutput {
    name: String,
    mem: u32,
    dev: i64,
    bytes: Vec<u8>,
}

/// One response as a callback saw it.
#[derive(Clone, Debug)]
struct Seen {
    id: u64,
    flags: u32,
    status: infer_status,
    error: String,
    outputs: Vec<SeenOutput>,
}

impl Seen {
    fn output(&self, name: &str) -> &SeenOutput {
        self.outputs
            .iter()
            .find(|o| o.name == name)
            .unwrap_or_else(|| panic!("no output {name}: {self:?}"))
    }
    fn f32s(&self, name: &str) -> Vec<f32> {
        bytemuck::pod_collect_to_vec(&self.output(name).bytes)
    }
}

/// Reads every output of a response where it is: device outputs are checked to be device
/// memory of the device the response names, and downloaded.
fn see(resp: &Resp) -> Vec<SeenOutput> {
    let d = driver();
    let mut out = Vec::new();
    unsafe {
        for i in 0..infer_response_output_count(resp.0) {
            let (mut name, mut data, mut n) = (null(), null(), 0usize);
            ok(infer_response_output(
                resp.0,
                i,
                &mut name,
                null_mut(),
                null_mut(),
                null_mut(),
                &mut data,
                &mut n,
            ));
            let name = std::ffi::CStr::from_ptr(name)
                .to_string_lossy()
                .into_owned();
            let (mut mem, mut dev) = (99u32, 99i64);
            ok(infer_response_output_memory(resp.0, i, &mut mem, &mut dev));
            let mut bytes = vec![0u8; n];
            if mem == INFER_MEMORY_GPU {
                assert_eq!(d.place(data as u64), (2, dev as i32), "output {name}");
                d.bind(dev as i32);
                if n > 0 {
                    assert_eq!(
                        (d.dtoh)(bytes.as_mut_ptr() as *mut c_void, data as u64, n),
                        0
                    );
                }
            } else if n > 0 {
                bytes.copy_from_slice(std::slice::from_raw_parts(data as *const u8, n));
            }
            out.push(SeenOutput {
                name,
                mem,
                dev,
                bytes,
            });
        }
    }
    out
}

/// Responses seen by `see_response` (the checks of one scenario run one at a time).
static SEEN: std::sync::Mutex<Vec<Seen>> = std::sync::Mutex::new(Vec::new());
static SEEN_CV: std::sync::Condvar = std::sync::Condvar::new();

/// A callback that reads each response's outputs before it returns (a device output not
/// complete by then would show the stand-in's poison bytes), then frees it.
unsafe extern "C" fn see_response(_: *mut c_void, resp: *mut Response, flags: u32) {
    let r = Resp(resp);
    let seen = Seen {
        id: r.id(),
        flags,
        status: r.status(),
        error: r.error(),
        outputs: see(&r),
    };
    drop(r);
    SEEN.lock().unwrap().push(seen);
    SEEN_CV.notify_all();
}

fn enqueue_seen(s: &Server, r: Req) -> u64 {
    let mut id = 0;
    ok(unsafe { infer_server_enqueue(s.0, r.take(), Some(see_response), null_mut(), &mut id) });
    id
}

/// Waits for the FINAL responses of `ids` and returns every response of theirs, in order
/// of arrival (taken out of SEEN).
fn wait_seen(ids: &[u64]) -> Vec<Seen> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut g = SEEN.lock().unwrap();
    loop {
        let finals = g
            .iter()
            .filter(|r| ids.contains(&r.id) && r.flags & INFER_RESPONSE_FLAG_FINAL != 0)
            .count();
        if finals == ids.len() {
            break;
        }
        let now = std::time::Instant::now();
        assert!(now < deadline, "{finals} of {} FINAL responses", ids.len());
        g = SEEN_CV.wait_timeout(g, deadline - now).unwrap().0;
    }
    let (mine, rest) = std::mem::take(&mut *g)
        .into_iter()
        .partition(|r| ids.contains(&r.id));
    *g = rest;
    mine
}

fn ask_gpu(r: Req, dev: i64) -> Req {
    ok(unsafe { infer_request_set_output_memory(r.0, INFER_MEMORY_GPU, dev) });
    r
}

fn decode_bytes(b: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + 4 <= b.len() {
        let n = u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize;
        out.push(String::from_utf8_lossy(&b[at + 4..at + 4 + n]).into_owned());
        at += 4 + n;
    }
    out
}

unsafe extern "C" fn sleep_30ms(_: *mut c_void) {
    std::thread::sleep(std::time::Duration::from_millis(30));
}

/// A caller that queues a read of a GPU output on its own stream and frees the response
/// before the read has run: the output's buffer is not handed to the next batch (which
/// would write into it) until the read has run. `infer_response_free` covers reads on
/// blocking streams (they synchronize with the legacy stream it fences on);
/// `infer_response_free_after_stream` covers any stream. The read waits 30 ms behind a
/// host function on the stream, so that the next request's batch runs first. Needs the
/// model "s1" (gpu_affine, one instance on GPU 0) of `data_path_one_gpu`.
fn outputs_read_after_free(s: &Server) {
    let d = driver();
    for (flags, after_stream) in [(0u32, false), (1, true), (0, true)] {
        d.bind(0);
        let mut stream = null_mut();
        assert_eq!(unsafe { (d.stream_create)(&mut stream, flags) }, 0);
        let (x1, x2) = ([1.0f32, 2., 3., 4.], [-5.0f32, -6., -7., -8.]);
        let r1 = s.infer(affine_request(s, "s1", x1, Some(0)));
        let (mut data, mut bytes) = (null(), 0usize);
        let y = (0..unsafe { infer_response_output_count(r1.0) })
            .find(|&i| {
                let mut name = null();
                ok(unsafe {
                    infer_response_output(
                        r1.0,
                        i,
                        &mut name,
                        null_mut(),
                        null_mut(),
                        null_mut(),
                        &mut data,
                        &mut bytes,
                    )
                });
                unsafe { std::ffi::CStr::from_ptr(name) }.to_bytes() == b"Y"
            })
            .expect("output Y");
        let mut host = vec![0f32; bytes / 4];
        let y1 = data as u64;
        unsafe {
            assert_eq!((d.host_func)(stream, sleep_30ms, null_mut()), 0);
            assert_eq!(
                (d.dtoh_async)(host.as_mut_ptr() as *mut c_void, y1, bytes, stream),
                0
            );
        }
        let _ = y;
        let raw = r1.0;
        std::mem::forget(r1);
        unsafe {
            if after_stream {
                infer_response_free_after_stream(raw, stream);
            } else {
                infer_response_free(raw);
            }
        }
        // The next request's output, computed while the read still waits.
        let r2 = s.infer(affine_request(s, "s1", x2, Some(0)));
        assert_eq!(read_output(&r2, "Y").2, x2.map(|v| 2. * v + 1.).to_vec());
        d.bind(0);
        assert_eq!(unsafe { (d.stream_sync)(stream) }, 0);
        assert_eq!(
            host,
            x1.map(|v| 2. * v + 1.).to_vec(),
            "the read of a freed response's output (stream flags {flags}, {}) saw the next batch's data",
            if after_stream { "infer_response_free_after_stream" } else { "infer_response_free" }
        );
        assert_eq!(unsafe { (d.stream_destroy)(stream) }, 0);
    }
    println!("outputs read after free: blocking and non-blocking streams checked");
}

/// The affine backend's model over rows of any width (inputs of megabytes).
fn wide_config(name: &str) -> String {
    format!(
        r#"name: "{name}" backend: "gpu_affine" max_batch_size: 8
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }},
         {{ name: "X_COPY" data_type: TYPE_FP32 dims: [ -1 ] }} ]
instance_group [ {{ kind: KIND_GPU count: 1 gpus: [ 0 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 200000 }}"#
    )
}

/// Row `i` of width `w`: values exact in f32 and different in every row and column.
fn wide_row(i: usize, w: usize) -> Vec<f32> {
    (0..w)
        .map(|j| (i * 7919 + j % 65_536) as f32 * 0.5 - 1000.0)
        .collect()
}

#[track_caller]
/// Checks a response of `wide_config`'s model to `x`; returns where its outputs Y and
/// X_COPY are (host memory: page-locked where the instance lent it, else ordinary).
fn check_wide(resp: &Resp, x: &[f32]) -> [u32; 2] {
    assert_eq!(resp.status(), INFER_STATUS_OK, "{}", resp.error());
    let (mem, _, y) = read_output(resp, "Y");
    let (mem_copy, _, xc) = read_output(resp, "X_COPY");
    for m in [mem, mem_copy] {
        assert!(
            m == INFER_MEMORY_CPU_PINNED || m == INFER_MEMORY_CPU,
            "an output in memory {m}"
        );
    }
    let bad = y.iter().zip(x).position(|(y, x)| *y != 2. * x + 1.);
    assert!(
        y.len() == x.len() && bad.is_none(),
        "Y differs at {bad:?} of {}",
        x.len()
    );
    assert!(xc == x, "X_COPY differs");
    [mem, mem_copy]
}

/// Copies (count, bytes) up, or down, by the GPU instances of `model`.
fn copies_of(s: &Server, model: &str, way: &str) -> (u64, u64) {
    let st = s.stats(model);
    let sum = |k: &str| {
        st["models"][0]["gpu"]["instances"]
            .as_array()
            .map_or(0, |a| a.iter().filter_map(|i| i[k].as_u64()).sum::<u64>())
    };
    (sum(&format!("{way}_copies")), sum(&format!("{way}_bytes")))
}

fn h2d_of(s: &Server, model: &str) -> (u64, u64) {
    copies_of(s, model, "h2d")
}

fn d2h_of(s: &Server, model: &str) -> (u64, u64) {
    copies_of(s, model, "d2h")
}

/// Lends `len` f32s at `p` (in memory `mem`, of GPU 0 for device memory) as input X of
/// shape [1, len], never released.
fn lend_row(r: &Req, p: *const c_void, len: usize, mem: u32) -> infer_status {
    unsafe {
        infer_request_add_input_borrowed(
            r.0,
            c"X".as_ptr(),
            INFER_DATATYPE_FP32,
            [1i64, len as i64].as_ptr(),
            2,
            p,
            len * 4,
            mem,
            0,
            None,
            null_mut(),
        )
    }
}

/// Inputs of megabytes are staged in chunks, each copied up while the host stages the
/// next: rows that cross chunks, several requests in one batch, a request whose input is
/// on the device between host ones. Outputs copied down are lent to the responses up to
/// the instance's limit (64 MiB), and copied out past it: responses held by the caller
/// read right either way, and the page-locked memory stays bounded. Inputs in
/// page-locked memory (lent as such, or an ensemble step's output lent by the GPU
/// instance before) go up from where they lie. Between ensemble steps on one GPU, and
/// from an ensemble's input lent there to its outputs wanted there, tensors stay on the
/// device.
fn wide_rows_staged_in_chunks_and_outputs_lent(s: &Server) {
    let d = driver();
    s.load("w", &wide_config("w"));
    // 8 rows of 100,000 floats (400,000 bytes: chunk edges fall inside rows); row 5's
    // input lent from device memory.
    let w = 100_000;
    let c = Collector::new();
    let mut ids = Vec::new();
    let mut on_device = Vec::new();
    for i in 0..8 {
        let x = wide_row(i, w);
        let r = s.request("w");
        let r = if i == 5 {
            d.bind(0);
            let p = d.upload(&x);
            on_device.push(p);
            ok(lend_row(&r, p as *const c_void, w, INFER_MEMORY_GPU));
            r
        } else {
            r.input_f32("X", &[1, w as i64], &x)
        };
        ids.push(s.enqueue(r, &c).unwrap());
    }
    c.wait(8);
    c.assert_exactly_once(&ids);
    for resp in c.take() {
        let i = ids.iter().position(|&id| id == resp.id()).unwrap();
        assert_eq!(
            check_wide(&resp, &wide_row(i, w)),
            [INFER_MEMORY_CPU_PINNED; 2]
        );
    }
    let st = s.stats("w");
    let execs = st["models"][0]["execution_count"].as_u64().unwrap_or(0);
    assert!(execs < 8, "the rows were not batched: {st}");
    // One input of 4.4 MB (nine chunks).
    let x = wide_row(9, 1_100_000);
    check_wide(
        &s.infer(s.request("w").input_f32("X", &[1, x.len() as i64], &x)),
        &x,
    );
    // A page-locked input (INFER_MEMORY_CPU_PINNED) of 1.2 MB goes up from the caller's
    // buffer in one copy (staged, it would take three).
    let x = wide_row(11, 300_000);
    let mut locked = null_mut();
    d.bind(0);
    assert_eq!(
        unsafe { (d.mem_host_alloc)(&mut locked, x.len() * 4, 0) },
        0
    );
    unsafe { std::ptr::copy_nonoverlapping(x.as_ptr(), locked as *mut f32, x.len()) };
    let before = h2d_of(s, "w");
    let r = s.request("w");
    ok(lend_row(&r, locked, x.len(), INFER_MEMORY_CPU_PINNED));
    assert_eq!(check_wide(&s.infer(r), &x), [INFER_MEMORY_CPU_PINNED; 2]);
    let after = h2d_of(s, "w");
    assert_eq!(
        (after.0 - before.0, after.1 - before.1),
        (1, x.len() as u64 * 4),
        "a page-locked input was not copied up in one copy from where it is"
    );
    assert_eq!(unsafe { (d.mem_free_host)(locked) }, 0);

    // Responses the caller keeps: 2 outputs of 1.2 MB each, 40 times (96 MB lent
    // without a limit).
    let w = 300_000;
    let host0 = d.counters().live_host_bytes;
    let held: Vec<(Resp, Vec<f32>)> = (0..40)
        .map(|i| {
            let x = wide_row(100 + i, w);
            (
                s.infer(s.request("w").input_f32("X", &[1, w as i64], &x)),
                x,
            )
        })
        .collect();
    let grown = d.counters().live_host_bytes.saturating_sub(host0);
    let mems: Vec<u32> = held
        .iter()
        .flat_map(|(resp, x)| check_wide(resp, x))
        .collect();
    // Outputs of 1.25 MiB (their size class): the first 51 are lent, the rest copied out.
    let lent = mems
        .iter()
        .take_while(|&&m| m == INFER_MEMORY_CPU_PINNED)
        .count();
    assert!(
        (40..=51).contains(&lent) && mems[lent..].iter().all(|&m| m == INFER_MEMORY_CPU),
        "outputs in memory {mems:?}: not lent up to 64 MiB, then copied out"
    );
    if d.real() {
        drop(held);
        s.unload("w");
        return;
    }
    assert!(
        grown <= (64 + 8) << 20,
        "{grown} bytes of page-locked memory for 40 responses held: the lending limit (64 MiB) did not hold"
    );
    assert!(
        grown >= 32 << 20,
        "{grown} bytes of page-locked memory for 40 responses held: outputs were not lent"
    );
    drop(held);
    // Freed responses gave their buffers back: the same again allocates nothing.
    let again = d.counters().live_host_bytes;
    let held: Vec<Resp> = (0..40)
        .map(|i| {
            s.infer(
                s.request("w")
                    .input_f32("X", &[1, w as i64], &wide_row(i, w)),
            )
        })
        .collect();
    assert_eq!(
        d.counters().live_host_bytes,
        again,
        "lent buffers were not reused"
    );
    drop(held);
    d.bind(0);
    for p in on_device {
        assert_eq!(unsafe { (d.mem_free)(p) }, 0);
    }

    // An ensemble of two GPU models on GPU 0: w's output Y (1.2 MB) is w2's input X and
    // the ensemble's output MID.
    s.load("w2", &wide_config("w2"));
    s.load(
        "ww",
        r#"name: "ww" platform: "ensemble" max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] },
         { name: "MID" data_type: TYPE_FP32 dims: [ -1 ] } ]
ensemble_scheduling { step [
  { model_name: "w" model_version: -1 input_map { key: "X" value: "X" }
    output_map { key: "Y" value: "MID" } },
  { model_name: "w2" model_version: -1 input_map { key: "X" value: "MID" }
    output_map { key: "Y" value: "Y" } } ] }"#,
    );
    let x = wide_row(12, 300_000);
    let bytes = x.len() as u64 * 4;
    let want_mid: Vec<f32> = x.iter().map(|x| 2. * x + 1.).collect();
    let want_y: Vec<f32> = want_mid.iter().map(|m| 2. * m + 1.).collect();
    // Copies (up, down) by each model's instances during `run`.
    let copies = |run: &mut dyn FnMut()| {
        let before = ["w", "w2"].map(|m| (h2d_of(s, m), d2h_of(s, m)));
        run();
        let after = ["w", "w2"].map(|m| (h2d_of(s, m), d2h_of(s, m)));
        let delta = |a: (u64, u64), b: (u64, u64)| (a.0 - b.0, a.1 - b.1);
        [0, 1].map(|i| {
            (
                delta(after[i].0, before[i].0),
                delta(after[i].1, before[i].1),
            )
        })
    };
    let check = |resp: &Resp, want: &[(&str, &[f32])], mem: u32| {
        assert_eq!(resp.status(), INFER_STATUS_OK, "{}", resp.error());
        assert_eq!(resp.output_count(), want.len());
        for (name, values) in want {
            let (m, dev, got) = read_output(resp, name);
            assert_eq!(
                (m == INFER_MEMORY_GPU, dev),
                (mem == INFER_MEMORY_GPU, 0),
                "{name}"
            );
            assert!(got == *values, "the ensemble's output {name} differs");
        }
    };
    // MID wanted in host memory: w's output comes down (lent to the step's response in
    // page-locked memory) and goes up to w2 from where it lies, in one copy (staged, it
    // would take three).
    let mut resp = None;
    let [_, (w2_up, _)] = copies(&mut || {
        resp = Some(s.infer(s.request("ww").input_f32("X", &[1, x.len() as i64], &x)));
    });
    let resp = resp.take().unwrap();
    check(
        &resp,
        &[("Y", &want_y), ("MID", &want_mid)],
        INFER_MEMORY_CPU,
    );
    assert_eq!(
        w2_up,
        (1, bytes),
        "an ensemble step's page-locked output was not copied up to the next step from where it lies"
    );
    drop(resp);
    // Only Y wanted: MID stays on the GPU from w to w2 (nothing comes down from w,
    // nothing goes up to w2).
    let mut resp = None;
    let [(_, w_down), (w2_up, _)] = copies(&mut || {
        let r = s
            .request("ww")
            .input_f32("X", &[1, x.len() as i64], &x)
            .output("Y");
        resp = Some(s.infer(r));
    });
    check(&resp.take().unwrap(), &[("Y", &want_y)], INFER_MEMORY_CPU);
    assert_eq!(
        (w_down, w2_up),
        ((0, 0), (0, 0)),
        "an intermediate between two steps on one GPU left the device"
    );
    // Both outputs wanted on GPU 0, and the input lent there: nothing crosses.
    d.bind(0);
    let p = d.upload(&x);
    let moved = copies(&mut || {
        let r = s.request("ww");
        ok(lend_row(&r, p as *const c_void, x.len(), INFER_MEMORY_GPU));
        ok(unsafe { infer_request_set_output_memory(r.0, INFER_MEMORY_GPU, 0) });
        resp = Some(s.infer(r));
    });
    let resp = resp.take().unwrap();
    check(
        &resp,
        &[("Y", &want_y), ("MID", &want_mid)],
        INFER_MEMORY_GPU,
    );
    assert_eq!(
        moved,
        [((0, 0), (0, 0)); 2],
        "an ensemble on one GPU, its input and outputs there, copied (up, down) per step"
    );
    drop(resp);
    assert_eq!(unsafe { (d.mem_free)(p) }, 0);
    s.unload("ww");
    s.unload("w2");
    s.unload("w");
    println!("wide rows staged in chunks; outputs lent up to the limit ({grown} bytes held)");
}

/// The library's clean-up (a pool, its streams, events and memory, let go of on the
/// caller's thread when the last response holding its memory is freed after the model
/// was unloaded) leaves the calling thread's current context as it was: the
/// application's own CUDA code on that thread keeps its context (here: none). Needs the
/// backend "gpu_affine" of `data_path_one_gpu`.
fn frees_keep_the_callers_context(s: &Server) {
    let d = driver();
    s.load(
        "ctx_keep",
        &affine_config("ctx_keep", "{ kind: KIND_GPU count: 1 gpus: [ 0 ] }", ""),
    );
    let r = s.infer(affine_request(s, "ctx_keep", [1., 2., 3., 4.], Some(0)));
    assert_eq!(read_output(&r, "Y").0, INFER_MEMORY_GPU);
    s.unload("ctx_keep");
    let current = || {
        let mut c = null_mut();
        assert_eq!(unsafe { (d.get_current)(&mut c) }, 0);
        c
    };
    assert_eq!(unsafe { (d.set_current)(null_mut()) }, 0);
    drop(r); // the instance's pool goes with its last buffer
    assert!(
        current().is_null(),
        "freeing a response changed the calling thread's current context"
    );
    println!("frees keep the caller's context");
}

/// Models on the CPU (a Rust backend with a BYTES output, the built-in add_sub, an
/// ensemble, a streaming generative model) asked for GPU outputs on the stand-in's GPU 0:
/// the outputs come in device memory of GPU 0, complete when the callback runs, equal to
/// the host result; BYTES outputs stay on the host; the steady state allocates nothing;
/// no device memory is an error response naming the model, the output and the device.
/// Needs the model "cpu" (add_sub) of `data_path_one_gpu`.
fn host_outputs_on_the_device(s: &Server) {
    let d = driver();
    s.register_fn_backend("host_mixed", host_mixed);
    s.load("hm", &host_mixed_config("hm"));
    let x_at = |i: usize| {
        let v = i as f32;
        [v, v + 0.5, -v, 2. * v, 0.25, v * v]
    };

    // Concurrent requests, batched together; every other one wants GPU outputs.
    let n = 24;
    let ids: Vec<u64> = (0..n)
        .map(|i| {
            let r = s.request("hm").input_f32("X", &[1, 6], &x_at(i));
            enqueue_seen(s, if i % 2 == 0 { ask_gpu(r, 0) } else { r })
        })
        .collect();
    let seen = wait_seen(&ids);
    assert_eq!(seen.len(), n);
    for r in &seen {
        let i = ids.iter().position(|&id| id == r.id).unwrap();
        assert_eq!(r.status, INFER_STATUS_OK, "{}", r.error);
        let want: Vec<f32> = x_at(i).iter().map(|v| 3. * v + 1.).collect();
        let y = r.output("Y");
        let want_mem = if i % 2 == 0 {
            (INFER_MEMORY_GPU, 0)
        } else {
            (INFER_MEMORY_CPU, 0)
        };
        assert_eq!((y.mem, y.dev), want_mem, "request {i}");
        assert_eq!(r.f32s("Y"), want, "request {i}");
        // BYTES stays in host memory.
        let text = r.output("TEXT");
        assert_eq!((text.mem, text.dev), (INFER_MEMORY_CPU, 0), "request {i}");
        assert_eq!(decode_bytes(&text.bytes), vec![format!("y0={}", want[0])]);
    }
    let execs = s.stats("hm")["models"][0]["execution_count"]
        .as_u64()
        .unwrap_or(0);
    println!("host outputs to GPU 0: {n} requests in {execs} executions");

    // The built-in add_sub: both outputs on GPU 0, as the host computes them.
    let (a, b) = ([1., 2., 3., 4.], [0.5, -1., 2., 8.]);
    let host = s.infer(add_sub_request(s, "cpu", a, b));
    let resp = s.infer(ask_gpu(add_sub_request(s, "cpu", a, b), 0));
    assert_eq!(resp.status(), INFER_STATUS_OK, "{}", resp.error());
    for name in ["OUTPUT0", "OUTPUT1"] {
        let (mem, dev, got) = read_output(&resp, name);
        assert_eq!((mem, dev), (INFER_MEMORY_GPU, 0), "{name}");
        assert_eq!(got, host.output_f32(name), "{name}");
    }
    drop(resp);

    // The steady state: one request at a time, the response freed before the next: no
    // device or pinned allocation, no new stream, one pinned-to-device copy per output.
    let rounds = 10u64;
    for round in 0..rounds + 2 {
        if round == 2 {
            d.reset();
        }
        let x = [round as f32, 1., 2., 3.];
        let resp = s.infer(ask_gpu(add_sub_request(s, "cpu", x, [1.; 4]), 0));
        let (mem, _, sum) = read_output(&resp, "OUTPUT0");
        assert_eq!(mem, INFER_MEMORY_GPU);
        assert_eq!(sum, x.map(|v| v + 1.).to_vec());
    }
    let c = d.counters();
    assert_eq!(
        (c.mem_alloc, c.host_alloc, c.stream_creates),
        (0, 0, 0),
        "{c:?}"
    );
    assert_eq!(c.async_copies, 2 * rounds, "{c:?}");
    assert_eq!((c.pageable_async_copies, c.invalid_calls), (0, 0), "{c:?}");

    // An ensemble over add_sub: its final outputs (2A and 2B) on GPU 0.
    s.load(
        "ens_cpu",
        r#"name: "ens_cpu" platform: "ensemble" max_batch_size: 64
input [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "B" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "A2" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "B2" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "cpu" model_version: -1
    input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
    output_map { key: "OUTPUT0" value: "sum" } output_map { key: "OUTPUT1" value: "diff" } },
  { model_name: "cpu" model_version: -1
    input_map { key: "INPUT0" value: "sum" } input_map { key: "INPUT1" value: "diff" }
    output_map { key: "OUTPUT0" value: "A2" } output_map { key: "OUTPUT1" value: "B2" } } ] }"#,
    );
    let r = s
        .request("ens_cpu")
        .input_f32("A", &[1, 4], &a)
        .input_f32("B", &[1, 4], &b);
    let id = enqueue_seen(s, ask_gpu(r, 0));
    let seen = wait_seen(&[id]);
    let r = &seen[0];
    assert_eq!(r.status, INFER_STATUS_OK, "{}", r.error);
    for (name, v) in [("A2", a), ("B2", b)] {
        let o = r.output(name);
        assert_eq!((o.mem, o.dev), (INFER_MEMORY_GPU, 0), "{name}");
        assert_eq!(r.f32s(name), v.map(|x| 2. * x).to_vec(), "{name}");
    }

    // A streaming generative model: every response's outputs on GPU 0, the tokens those
    // of the same request answered in host memory.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tiny_gpt2");
    let config = std::fs::read_to_string(dir.join("config.pbtxt")).unwrap();
    ok(s.try_load_dir("tiny_gpt2", &config, &dir));
    let generate = |gpu: bool| {
        let r = s
            .request("tiny_gpt2")
            .input_i32("input_ids", &[4], &[5, 17, 42, 9]);
        unsafe {
            ok(infer_request_set_parameter_int(
                r.0,
                c"max_tokens".as_ptr(),
                6,
            ));
            ok(infer_request_set_parameter_bool(
                r.0,
                c"streaming".as_ptr(),
                true,
            ));
        }
        let id = enqueue_seen(s, if gpu { ask_gpu(r, 0) } else { r });
        wait_seen(&[id])
    };
    let tokens = |responses: &[Seen], want_mem: u32| {
        let mut t: Vec<i32> = Vec::new();
        for r in responses {
            assert_eq!(r.status, INFER_STATUS_OK, "{}", r.error);
            for o in &r.outputs {
                assert_eq!(o.mem, want_mem, "{}: {r:?}", o.name);
            }
            if let Some(o) = r.outputs.iter().find(|o| o.name == "output_ids") {
                t.extend(bytemuck::pod_collect_to_vec::<u8, i32>(&o.bytes));
            }
        }
        t
    };
    let on_host = generate(false);
    let on_gpu = generate(true);
    let streamed = on_gpu.iter().filter(|r| !r.outputs.is_empty()).count();
    assert!(streamed >= 2, "{on_gpu:?}");
    let want = tokens(&on_host, INFER_MEMORY_CPU);
    assert_eq!(want.len(), 6, "{on_host:?}");
    assert_eq!(tokens(&on_gpu, INFER_MEMORY_GPU), want);
    println!("generative: {streamed} streamed responses with their outputs on GPU 0");

    // No device memory left for the copy: the response is an error that names the
    // model, the output and the device (the request is answered, nothing is lost).
    let big: Vec<f32> = (0..65536).map(|i| i as f32).collect(); // 256 KiB of Y
    d.bind(0);
    let live = d.counters().live_device_bytes;
    let mut filler = 0u64;
    let spare = 128 << 10;
    assert_eq!(
        unsafe { (d.mem_alloc)(&mut filler, (1usize << 30) - live as usize - spare) },
        0
    );
    let id = enqueue_seen(
        s,
        ask_gpu(s.request("hm").input_f32("X", &[1, 65536], &big), 0),
    );
    let seen = wait_seen(&[id]);
    assert_eq!(
        seen[0].status, INFER_STATUS_RESOURCE_EXHAUSTED,
        "{}",
        seen[0].error
    );
    for part in ["model 'hm'", "'Y'", "GPU 0"] {
        assert!(
            seen[0].error.contains(part),
            "{:?} lacks {part:?}",
            seen[0].error
        );
    }
    assert!(seen[0].outputs.is_empty(), "{:?}", seen[0].outputs);
    assert_eq!(unsafe { (d.mem_free)(filler) }, 0);
    let id = enqueue_seen(
        s,
        ask_gpu(s.request("hm").input_f32("X", &[1, 65536], &big), 0),
    );
    let seen = wait_seen(&[id]);
    assert_eq!(seen[0].status, INFER_STATUS_OK, "{}", seen[0].error);
    assert_eq!(seen[0].output("Y").mem, INFER_MEMORY_GPU);
    let y = seen[0].f32s("Y");
    assert!(y.iter().zip(&big).all(|(y, x)| *y == 3. * x + 1.));
    d.reset();
    println!("host outputs to GPU 0: checked");
}

/// Two GPUs: a model on the CPU answers on the GPU each request asked for.
fn host_outputs_on_the_asked_gpu(s: &Server) {
    s.load("cpu2", &add_sub_config("cpu2", ""));
    let (a, b) = ([1., 2., 3., 4.], [4., 3., 2., 1.]);
    for dev in [1i64, 0] {
        let resp = s.infer(ask_gpu(add_sub_request(s, "cpu2", a, b), dev));
        assert_eq!(resp.status(), INFER_STATUS_OK, "{}", resp.error());
        let (mem, on, sum) = read_output(&resp, "OUTPUT0");
        assert_eq!((mem, on), (INFER_MEMORY_GPU, dev));
        assert_eq!(sum, vec![5.; 4]);
    }
}

/// Runs the test `test` of this binary alone in a fresh process with `envs` added, and
/// asserts that it passed and printed `done`; returns all it printed.
fn run_child(test: &str, envs: &[(&str, &std::ffi::OsStr)], done: &str) -> String {
    let all = run_test_child(test, envs);
    assert!(all.contains(done), "{test} ({done}): {all}");
    all
}

/// Runs `gpu_data_path_child` under the stand-in driver with `scenario` (the checks of
/// "onnx" run with one device); returns its output.
fn run_data_path(dir: &std::path::Path, scenario: &str) -> String {
    let devices = if scenario == "two" { "two" } else { "one" };
    let all = run_child(
        "gpu_data_path_child",
        &[
            ("LD_LIBRARY_PATH", dir.as_os_str()),
            ("INFER_FAKE_CUDA", devices.as_ref()),
            ("INFER_DATA_PATH_CHECKS", scenario.as_ref()),
            ("INFER_FAKE_CUDA_DELAY_US", "300".as_ref()),
        ],
        &format!("data path '{scenario}': checked"),
    );
    for line in all.lines().filter(|l| {
        l.contains(" in ")
            || l.contains("on GPUs")
            || l.contains("batches,")
            || l.contains("matches CPU")
            || l.contains("KIND_AUTO")
            || l.contains("implicit state")
    }) {
        println!("{scenario}: {line}");
    }
    all
}

/// A machine with a CUDA 12 driver (the stand-in reporting 12.2, without the symbols of
/// 12.8 and later) where CUDA 12 and CUDA 13 libraries are both installed, the 13s also
/// under the unversioned names: GPU instances serve there, with NVRTC 12 and cuBLAS 12
/// (the driver refuses NVRTC 13's images, and cuBLAS 13 cannot start on it), and the log
/// says which files; event timing (the statistics' `gpu` section) uses the driver's
/// original cuEventElapsedTime.
#[test]
fn gpu_instances_on_a_cuda_12_driver() {
    if std::env::var_os("INFER_FAKE_CUDA").is_some() {
        return; // a child, or a run against the stand-ins already
    }
    let dir = std::env::temp_dir().join(format!("infer-fake-cuda12-{}", std::process::id()));
    if let Err(why) = build_fakes(&dir, 12) {
        println!("SKIP: cannot build the stand-in driver ({why})");
        return;
    }
    run_data_path(&dir, "one");
    let all = run_data_path(&dir, "onnx");
    let said = all
        .lines()
        .find(|l| l.starts_with("CUDA libraries in use: "))
        .unwrap_or_else(|| panic!("no library line in {all}"));
    for want in [
        "/libnvrtc.so.12",
        "/libcublas.so.12",
        "NVRTC 12.0 (libnvrtc.so.12)",
        "cuBLAS 12.0 (libcublas.so.12)",
    ] {
        assert!(said.contains(want), "{want} not in {said}");
    }
    assert!(!said.contains(".so.13"), "{said}");
    // Only CUDA 13 libraries there: KIND_GPU is UNAVAILABLE naming the file refused and
    // why, and KIND_AUTO serves on the CPU.
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        if e.file_name().to_string_lossy().ends_with(".so.12") {
            std::fs::remove_file(e.path()).unwrap();
        }
    }
    run_child(
        "executor_start_child",
        &[
            ("LD_LIBRARY_PATH", dir.as_os_str()),
            ("INFER_FAKE_CUDA", "one".as_ref()),
            ("INFER_EXECUTOR_START", "cuda13-libraries".as_ref()),
        ],
        "executor start 'cuda13-libraries': checked",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- a sticky device fault ----

/// A kernel that stores to address `p`: given an address that maps to nothing, the GPU
/// faults (CUDA_ERROR_ILLEGAL_ADDRESS), and the device's context is lost for good. PTX,
/// which the driver compiles itself, so no NVRTC is needed.
const FAULT_PTX: &std::ffi::CStr = c".version 7.0
.target sm_75
.address_size 64
.visible .entry infer_test_fault(.param .u64 p)
{
    .reg .b64 %rd<2>;
    .reg .b32 %r<2>;
    ld.param.u64 %rd1, [p];
    mov.u32 %r1, 1;
    st.global.u32 [%rd1], %r1;
    ret;
}
";

/// A backend whose batches fault the device: on the stand-in through its fault
/// injection, on a real GPU with a kernel that stores to an unmapped address. Its
/// output is allocated and never written (the batch cannot succeed).
unsafe extern "C" fn faulty_execute(_: *mut c_void, b: *mut Batch) -> u32 {
    let d = driver();
    let stream = infer_batch_cuda_stream(b);
    let mut out = null_mut();
    let rows = infer_batch_size(b) as i64;
    let st = infer_batch_output_device(b, c"Y".as_ptr(), [rows, 4].as_ptr(), 2, &mut out);
    if st != INFER_STATUS_OK || stream.is_null() {
        return INFER_STATUS_INTERNAL;
    }
    if let Some(inject) = d.inject_fault {
        inject(0, 700);
        return INFER_STATUS_OK;
    }
    let (mut module, mut f) = (null_mut(), null_mut());
    if (d.module_load_data)(&mut module, FAULT_PTX.as_ptr() as *const c_void) != 0
        || (d.module_get_function)(&mut f, module, c"infer_test_fault".as_ptr()) != 0
    {
        return INFER_STATUS_INTERNAL;
    }
    let mut p: u64 = 0xdead_0000;
    let mut params = [&mut p as *mut u64 as *mut c_void];
    let launched = (d.launch_kernel)(
        f,
        1,
        1,
        1,
        1,
        1,
        1,
        0,
        stream,
        params.as_mut_ptr(),
        null_mut(),
    );
    if launched != 0 {
        return INFER_STATUS_INTERNAL;
    }
    INFER_STATUS_OK
}

/// A GPU that has a sticky fault (a kernel's illegal address) is marked unusable, in a
/// child process each (the fault is process-wide): the stand-in's injected fault, and a
/// real fault on a real GPU. Requests in flight and later requests on that GPU end with
/// UNAVAILABLE naming the device and the fault (none is lost), GPU loads there are
/// UNAVAILABLE, KIND_AUTO serves on the CPU, CPU models keep serving, and the statistics
/// and the log say what happened.
#[test]
fn a_device_fault_marks_the_gpu_unusable() {
    if std::env::var_os("INFER_FAKE_CUDA").is_some()
        || std::env::var_os("INFER_FAULT_CHILD").is_some()
    {
        return; // a child, or a run against the stand-ins already
    }
    let dir = std::env::temp_dir().join(format!("infer-fake-cuda-fault-{}", std::process::id()));
    match build_fakes(&dir, 13) {
        Err(why) => println!("SKIP: cannot build the stand-in driver ({why})"),
        Ok(()) => {
            let all = run_child(
                "device_fault_child",
                &[
                    ("LD_LIBRARY_PATH", dir.as_os_str()),
                    ("INFER_FAKE_CUDA", "one".as_ref()),
                    ("INFER_FAULT_CHILD", "1".as_ref()),
                    ("INFER_FAKE_CUDA_DELAY_US", "300".as_ref()),
                ],
                "device fault: checked",
            );
            for l in all.lines().filter(|l| l.starts_with("device fault")) {
                println!("stand-in: {l}");
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    match no_gpu_reason() {
        Some(why) => println!("SKIP (real GPU): {why}"),
        None => {
            let all = run_child(
                "device_fault_child",
                &[("INFER_FAULT_CHILD", "1".as_ref())],
                "device fault: checked",
            );
            for l in all.lines().filter(|l| l.starts_with("device fault")) {
                println!("real GPU: {l}");
            }
        }
    }
}

/// The child of `a_device_fault_marks_the_gpu_unusable`.
#[test]
fn device_fault_child() {
    if std::env::var_os("INFER_FAULT_CHILD").is_none() {
        return;
    }
    let s = {
        let mut opts = null_mut();
        ok(unsafe { infer_server_options_new(&mut opts) });
        ok(unsafe { infer_server_options_set_gpu(opts, INFER_GPU_REQUIRED) });
        ok(unsafe {
            infer_server_options_set_log_callback(
                opts,
                INFER_LOG_INFO,
                Some(gpu_log_line),
                null_mut(),
            )
        });
        let s = Server::with_options(opts);
        unsafe { infer_server_options_free(opts) };
        s
    };
    s.load(
        "cpu",
        &add_sub_config("cpu", "instance_group [ { kind: KIND_CPU } ]"),
    );
    load_from_models(&s, "mlp", Some(&gpu_config_of("mlp")));
    let vt = infer_backend {
        struct_size: std::mem::size_of::<infer_backend>() as u32,
        instance_init: Some(affine_init),
        execute: Some(faulty_execute),
        instance_fini: Some(affine_fini),
        finalize: None,
    };
    ok(unsafe { infer_server_register_backend(s.0, c"faulty".as_ptr(), &vt, null_mut()) });
    s.load(
        "faulty",
        r#"name: "faulty" backend: "faulty" max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { kind: KIND_GPU gpus: [ 0 ] } ]"#,
    );
    let mut rng = Rand(11);
    let r = s.infer(random_request(&s, "mlp", 2, &mut rng));
    assert_eq!(r.status(), INFER_STATUS_OK, "{}", r.error());

    let is_fault = |status: u32, error: &str| {
        status == INFER_STATUS_UNAVAILABLE
            && error.contains("GPU 0 is unusable")
            && error.contains("CUDA_ERROR_")
    };
    // The fault, with requests of the ONNX model in flight on the same GPU.
    let mut ids = vec![enqueue_seen(
        &s,
        s.request("faulty").input_f32("X", &[1, 4], &[1.; 4]),
    )];
    for _ in 0..8 {
        ids.push(enqueue_seen(&s, random_request(&s, "mlp", 1, &mut rng)));
    }
    let seen = wait_seen(&ids);
    assert_eq!(seen.len(), ids.len(), "every request is answered once");
    let (mut failed, mut served) = (0, 0);
    for r in &seen {
        if r.id == ids[0] {
            assert!(
                is_fault(r.status, &r.error),
                "faulty: {} {}",
                r.status,
                r.error
            );
        } else if r.status == INFER_STATUS_OK {
            served += 1;
        } else {
            assert!(
                is_fault(r.status, &r.error),
                "mlp: {} {}",
                r.status,
                r.error
            );
            failed += 1;
        }
    }
    let fault = seen
        .iter()
        .find(|r| r.id == ids[0])
        .map(|r| r.error.clone());
    let fault = fault.unwrap_or_default();
    println!("device fault: {fault}");
    println!(
        "device fault: in flight on the ONNX model: {served} served before it, {failed} failed"
    );
    // Later requests on that GPU: UNAVAILABLE, naming it.
    for _ in 0..3 {
        let r = s.infer(random_request(&s, "mlp", 1, &mut rng));
        assert!(
            is_fault(r.status(), &r.error()),
            "{} {}",
            r.status(),
            r.error()
        );
        let r = s.infer(s.request("faulty").input_f32("X", &[1, 4], &[1.; 4]));
        assert!(
            is_fault(r.status(), &r.error()),
            "{} {}",
            r.status(),
            r.error()
        );
    }
    // The CPU keeps serving.
    let r = s.infer(add_sub_request(&s, "cpu", [1.; 4], [2.; 4]));
    assert_eq!(r.output_f32("OUTPUT0"), vec![3.; 4]);
    // Loads on that GPU are refused; KIND_AUTO serves on the CPU.
    let dir = model_dir_of("cnn");
    let load = |config: &str| unsafe {
        infer_server_load_model(s.0, cs("cnn").as_ptr(), cs(config).as_ptr(), dir.as_ptr())
    };
    let st = load(&gpu_config_of("cnn"));
    let msg = last_error();
    assert_eq!(st, INFER_STATUS_UNAVAILABLE, "{msg}");
    assert!(
        msg.contains("GPU 0 is unusable") && msg.contains("'cnn'"),
        "{msg}"
    );
    ok(load(&gpu_config_of("cnn").replace("KIND_GPU", "KIND_AUTO")));
    assert!(s.stats("cnn")["models"][0].get("gpu").is_none());
    let r = s.infer(random_request(&s, "cnn", 1, &mut rng));
    assert_eq!(r.status(), INFER_STATUS_OK, "{}", r.error());
    // The statistics and the log say what happened, once per model.
    let stats = s.stats("mlp");
    let faults = &stats["models"][0]["gpu"]["faults"];
    assert_eq!(faults[0]["device"], 0, "{stats}");
    assert!(
        faults[0]["error"]
            .as_str()
            .unwrap_or("")
            .contains("GPU 0 is unusable"),
        "{stats}"
    );
    let log = GPU_LOG.lock().unwrap().clone();
    for m in ["faulty", "mlp"] {
        let n = log
            .iter()
            .filter(|l| l.starts_with(&format!("model '{m}': GPU 0 is unusable")))
            .count();
        assert_eq!(n, 1, "model '{m}' in the log: {log:?}");
    }
    println!("device fault: checked");
}

#[test]
fn gpu_instances_against_a_stand_in_driver() {
    let dir = std::env::temp_dir().join(format!("infer-fake-cuda-dp-{}", std::process::id()));
    if let Err(why) = build_fake_driver(&dir, false) {
        println!("SKIP: cannot build the stand-in driver ({why})");
        return;
    }
    // The stand-in's own self-check first: a stand-in that does not emulate what it
    // claims would make the checks below meaningless.
    let check = dir.join("fake_cuda_check");
    let src = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/fake_cuda_check.c"
    );
    let built = std::process::Command::new("cc")
        .args(["-O1", "-pthread", "-o"])
        .arg(&check)
        .arg(src)
        .arg("-ldl")
        .output()
        .expect("running cc");
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let out = std::process::Command::new(&check)
        .arg(dir.join("libcuda.so.1"))
        .output()
        .expect("running the stand-in's self-check");
    let all =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && all.contains("fake cuda: all checks passed"),
        "{all}"
    );
    // The kernels as the stand-in runs them, against reference loops, and the stand-in
    // NVRTC and cuBLAS.
    let kcheck = dir.join("kernels_check");
    let src = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/kernels_check.c"
    );
    let built = std::process::Command::new("cc")
        .args(["-O1", "-pthread", "-o"])
        .arg(&kcheck)
        .arg(src)
        .args(["-ldl", "-lm"])
        .output()
        .expect("running cc");
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let out = std::process::Command::new(&kcheck)
        .arg(&dir)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/src/onnx/gpu/kernels.cu"
        ))
        .output()
        .expect("running the kernels' check");
    let all =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{all}");
    run_data_path(&dir, "one");
    run_data_path(&dir, "two");
    run_data_path(&dir, "onnx");
    run_data_path(&dir, "release");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A GPU worker waits for the device asleep: while batches compute (the stand-in makes
/// each step take 20 ms), the process uses far less CPU time than wall time. The
/// stand-in spins the waiting thread on events not created with CU_EVENT_BLOCKING_SYNC,
/// as the driver does by default: a worker would then burn a core of the host
/// application for as long as the device computes.
#[test]
fn gpu_workers_wait_for_the_device_asleep() {
    if std::env::var_os("INFER_FAKE_CUDA").is_some() {
        return; // a child, or a run against the stand-ins already
    }
    let dir = std::env::temp_dir().join(format!("infer-fake-cuda-wait-{}", std::process::id()));
    if let Err(why) = build_fake_driver(&dir, false) {
        println!("SKIP: cannot build the stand-in driver ({why})");
        return;
    }
    let all = run_child(
        "gpu_data_path_child",
        &[
            ("LD_LIBRARY_PATH", dir.as_os_str()),
            ("INFER_FAKE_CUDA", "one".as_ref()),
            ("INFER_DATA_PATH_CHECKS", "wait".as_ref()),
            ("INFER_FAKE_CUDA_DELAY_US", "20000".as_ref()),
        ],
        "data path 'wait': checked",
    );
    for line in all.lines().filter(|l| l.starts_with("waits:")) {
        println!("{line}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn process_cpu_seconds() -> f64 {
    // SAFETY: a valid out-pointer.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) }, 0);
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

fn workers_wait_asleep() {
    let s = server_in(INFER_GPU_REQUIRED).unwrap_or_else(|(st, m)| panic!("{st} {m}"));
    load_from_models(&s, "mlp", Some(&gpu_config_of("mlp")));
    // The first request plans the graph and warms cuBLAS up.
    let resp = s.infer(random_request(&s, "mlp", 1, &mut Rand(1)));
    assert_eq!(resp.status(), INFER_STATUS_OK, "{}", resp.error());
    let (cpu0, t0) = (process_cpu_seconds(), std::time::Instant::now());
    for k in 0..3 {
        let resp = s.infer(random_request(&s, "mlp", 2, &mut Rand(10 + k)));
        assert_eq!(resp.status(), INFER_STATUS_OK, "{}", resp.error());
    }
    let (cpu, wall) = (process_cpu_seconds() - cpu0, t0.elapsed().as_secs_f64());
    assert!(
        wall > 0.1,
        "3 requests took {wall} s: the stand-in's delay did not apply"
    );
    assert!(
        cpu < 0.5 * wall,
        "{cpu:.3} s of CPU over {wall:.3} s of wall time: a thread spins while the device computes"
    );
    println!("waits: {cpu:.3} s of CPU over {wall:.3} s of wall time for 3 requests");
    // Host outputs copied to the GPU for the response: the delivering thread (here, the
    // caller's) waits for the copy asleep too.
    s.load(
        "cpu",
        &add_sub_config("cpu", "instance_group [ { kind: KIND_CPU } ]"),
    );
    let (cpu0, t0) = (process_cpu_seconds(), std::time::Instant::now());
    for _ in 0..3 {
        let r = add_sub_request(&s, "cpu", [1.; 4], [2.; 4]);
        ok(unsafe { infer_request_set_output_memory(r.0, INFER_MEMORY_GPU, 0) });
        let resp = s.infer(r);
        assert_eq!(resp.status(), INFER_STATUS_OK, "{}", resp.error());
    }
    let (cpu, wall) = (process_cpu_seconds() - cpu0, t0.elapsed().as_secs_f64());
    assert!(
        wall > 0.05,
        "3 requests took {wall} s: the stand-in's delay did not apply"
    );
    assert!(
        cpu < 0.5 * wall,
        "{cpu:.3} s of CPU over {wall:.3} s of wall time: the thread that copies outputs to the GPU spins"
    );
    println!(
        "output copies to the GPU: {cpu:.3} s of CPU over {wall:.3} s of wall time for 3 requests"
    );
}

/// The ONNX checks of the "onnx" scenario on a real GPU: every model, precision, fused
/// chain, encoder, implicit state, KIND_AUTO placement and CUDA graph against the CPU
/// (what only the stand-in can count, launches and bytes, is left out there).
#[test]
fn onnx_on_a_real_gpu() {
    if std::env::var_os("INFER_FAKE_CUDA").is_some() {
        println!("SKIP: the stand-in driver is loaded (gpu_instances_against_a_stand_in_driver covers it)");
        return;
    }
    if let Some(why) = no_gpu_reason() {
        println!("SKIP: needs a GPU ({why})");
        return;
    }
    let all = run_child(
        "gpu_data_path_child",
        &[("INFER_DATA_PATH_CHECKS", "onnx".as_ref())],
        "data path 'onnx': checked",
    );
    for line in all.lines().filter(|l| {
        l.contains("matches CPU")
            || l.contains("equal to the CPU")
            || l.contains("KIND_AUTO")
            || l.contains("implicit state")
            || l.contains("within")
            || l.contains("CUDA graphs")
            || l.starts_with("CUDA libraries in use")
    }) {
        println!("real GPU: {line}");
    }
}

/// When this machine's CUDA cannot start the GPU executor (no cuBLAS; an NVRTC that
/// cannot compile the kernels), KIND_GPU is UNAVAILABLE at load naming what is missing
/// and KIND_AUTO serves the model on the CPU: never a load that fails where the CPU
/// would serve, nor a load that succeeds and then fails every request.
#[test]
fn gpu_executor_that_cannot_start_leaves_kind_auto_on_the_cpu() {
    if std::env::var_os("INFER_FAKE_CUDA").is_some() {
        return; // a child, or a run against the stand-ins already
    }
    let base = std::env::temp_dir().join(format!("infer-fake-cuda-start-{}", std::process::id()));
    let (no_blas, full) = (base.join("no_cublas"), base.join("full"));
    if let Err(why) =
        build_fake_driver(&no_blas, false).and_then(|()| build_fake_driver(&full, false))
    {
        println!("SKIP: cannot build the stand-in driver ({why})");
        return;
    }
    for e in std::fs::read_dir(&no_blas).unwrap().flatten() {
        if e.file_name().to_string_lossy().starts_with("libcublas") {
            std::fs::remove_file(e.path()).unwrap();
        }
    }
    for (dir, case, nvrtc_fails) in [(&no_blas, "cublas", "0"), (&full, "nvrtc", "1")] {
        run_child(
            "executor_start_child",
            &[
                ("LD_LIBRARY_PATH", dir.as_os_str()),
                ("INFER_FAKE_CUDA", "one".as_ref()),
                ("INFER_EXECUTOR_START", case.as_ref()),
                ("INFER_FAKE_NVRTC_FAIL", nvrtc_fails.as_ref()),
            ],
            &format!("executor start '{case}': checked"),
        );
    }
    let _ = std::fs::remove_dir_all(&base);
}

/// Compiled kernels are kept on disk (src/cuda/kernel_cache.rs), across processes on the
/// stand-ins: the first process compiles and saves, the next reads the file and compiles
/// nothing, a file whose CUBIN the driver refuses is compiled again and replaced, two
/// processes that start at once compile once between them, and `INFER_KERNEL_CACHE=off`
/// compiles every time and writes nothing.
#[test]
fn compiled_kernels_are_kept_on_disk_across_processes() {
    if std::env::var_os("INFER_FAKE_CUDA").is_some() {
        return; // a child, or a run against the stand-ins already
    }
    let base = std::env::temp_dir().join(format!("infer-kernel-cache-{}", std::process::id()));
    let (fakes, cache) = (base.join("fakes"), base.join("cache"));
    if let Err(why) = build_fake_driver(&fakes, false) {
        println!("SKIP: cannot build the stand-in driver ({why})");
        return;
    }
    let spawn = |cache: &std::ffi::OsStr, delay_ms: &str| {
        std::process::Command::new(std::env::current_exe().expect("the test binary's path"))
            .args(["--exact", "kernel_cache_child", "--nocapture"])
            .env("LD_LIBRARY_PATH", &fakes)
            .env("INFER_FAKE_CUDA", "one")
            .env("INFER_KERNEL_CACHE_CHILD", "1")
            .env("INFER_KERNEL_CACHE", cache)
            .env("INFER_FAKE_NVRTC_DELAY_MS", delay_ms)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("running the test binary again")
    };
    // (compiles, notes) of a finished child.
    let finish = |child: std::process::Child| -> (u64, String) {
        let out = child.wait_with_output().expect("the child's output");
        let all = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        let compiles = all
            .lines()
            .find_map(|l| l.strip_prefix("kernel cache child: compiles "))
            .and_then(|n| n.trim().parse().ok());
        match (out.status.success(), compiles) {
            (true, Some(n)) => (n, all),
            _ => panic!("kernel_cache_child: {all}"),
        }
    };
    let files = || -> Vec<std::path::PathBuf> {
        let mut f: Vec<_> = std::fs::read_dir(&cache)
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        f.retain(|p| p.extension().is_some_and(|e| e == "cubin"));
        f
    };
    let run = |delay_ms: &str| finish(spawn(cache.as_os_str(), delay_ms));

    let (n, all) = run("0");
    assert_eq!(n, 1, "{all}");
    assert!(
        all.contains("compiled with NVRTC in") && all.contains("saved to"),
        "{all}"
    );
    let saved = files();
    assert_eq!(saved.len(), 1, "{saved:?}");
    let good = std::fs::read(&saved[0]).unwrap();

    let (n, all) = run("0");
    assert_eq!(n, 0, "{all}");
    assert!(all.contains("read from the kernel cache"), "{all}");

    // The header is right but the CUBIN is not one this driver loads.
    let header_end = good
        .iter()
        .enumerate()
        .filter(|(_, b)| **b == b'\n')
        .nth(1)
        .map(|(i, _)| i + 1)
        .unwrap();
    let mut damaged = good[..header_end].to_vec();
    damaged.extend_from_slice(b"NOT-A-CUBIN");
    std::fs::write(&saved[0], &damaged).unwrap();
    let (n, all) = run("0");
    assert_eq!(n, 1, "{all}");
    assert_eq!(
        std::fs::read(&saved[0]).unwrap(),
        good,
        "the file is replaced"
    );

    // Two processes at once, each compile taking 400 ms: one compiles, the other waits
    // for its file.
    std::fs::remove_dir_all(&cache).unwrap();
    let (a, b) = (
        spawn(cache.as_os_str(), "400"),
        spawn(cache.as_os_str(), "400"),
    );
    let ((na, all_a), (nb, all_b)) = (finish(a), finish(b));
    assert_eq!(na + nb, 1, "{all_a}\n{all_b}");
    assert_eq!(files().len(), 1);

    let off = base.join("off");
    let (n, all) = finish(spawn("off".as_ref(), "0"));
    assert_eq!(n, 1, "{all}");
    assert!(all.contains("no kernel cache"), "{all}");
    assert!(!off.exists());
    let _ = std::fs::remove_dir_all(&base);
}

/// The memory pools of GPU instances (src/cuda/driver.rs), on the stand-in driver: a
/// buffer is at most an eighth larger than asked (powers of two gave 64 MiB for 33), a
/// slightly smaller request reuses a free one, and free device and pinned buffers unused
/// for the idle time go back to the driver at the next allocation.
#[test]
fn memory_pools_fit_sizes_and_give_back_idle_buffers() {
    if std::env::var_os("INFER_FAKE_CUDA").is_some() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("infer-fake-cuda-pool-{}", std::process::id()));
    if let Err(why) = build_fake_driver(&dir, false) {
        println!("SKIP: cannot build the stand-in driver ({why})");
        return;
    }
    run_child(
        "pool_child",
        &[
            ("LD_LIBRARY_PATH", dir.as_os_str()),
            ("INFER_FAKE_CUDA", "one".as_ref()),
            ("INFER_POOL_CHILD", "1".as_ref()),
        ],
        "pool: checked",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The child of `memory_pools_fit_sizes_and_give_back_idle_buffers`.
#[test]
fn pool_child() {
    if std::env::var_os("INFER_POOL_CHILD").is_none() {
        return;
    }
    let _s = server_in(INFER_GPU_REQUIRED).unwrap_or_else(|(st, m)| panic!("{st} {m}"));
    let ctx = infer::cuda::context(0).unwrap();
    ctx.bind().unwrap();
    let pool = infer::cuda::MemoryPool::new(&ctx);
    let d = driver();
    let (dev0, host0) = {
        let c = d.counters();
        (c.live_device_bytes, c.live_host_bytes)
    };
    let live = || {
        let c = d.counters();
        (c.live_device_bytes - dev0, c.live_host_bytes - host0)
    };
    let asked = 33usize << 20;
    let (a, b) = (pool.device(asked).unwrap(), pool.pinned(asked).unwrap());
    let (dev, host) = live();
    for got in [dev, host] {
        assert!(
            got >= asked as u64 && got <= (asked + asked / 8) as u64,
            "{got} bytes for {asked}"
        );
    }
    drop((a, b));
    // A little less is served from the free buffers.
    let (a, b) = (
        pool.device(asked - (1 << 20)).unwrap(),
        pool.pinned(asked - (1 << 20)).unwrap(),
    );
    assert_eq!(live(), (dev, host));
    drop((a, b));
    pool.set_idle_release(std::time::Duration::from_millis(50));
    std::thread::sleep(std::time::Duration::from_millis(150));
    let small = (pool.device(256).unwrap(), pool.pinned(256).unwrap());
    assert_eq!(live(), (256, 256), "the idle buffers went back");
    drop(small);
    println!("pool: checked");
}

/// The child of `compiled_kernels_are_kept_on_disk_across_processes`: loads a model on
/// the stand-in GPU and prints how many compiles the stand-in NVRTC saw and the notes on
/// where the kernels came from.
#[test]
fn kernel_cache_child() {
    if std::env::var_os("INFER_KERNEL_CACHE_CHILD").is_none() {
        return;
    }
    let s = server_in(INFER_GPU_REQUIRED).unwrap_or_else(|(st, m)| panic!("{st} {m}"));
    load_from_models(&s, "mlp", Some(&gpu_config_of("mlp")));
    // SAFETY: the stand-in NVRTC the server loaded (RTLD_NOLOAD: never a second copy),
    // and its counter function of the documented signature.
    let compiles = unsafe {
        let h = libc::dlopen(
            c"libnvrtc.so.13".as_ptr(),
            libc::RTLD_NOW | libc::RTLD_NOLOAD,
        );
        assert!(!h.is_null(), "NVRTC is not loaded");
        let f = libc::dlsym(h, c"fake_nvrtc_compiles".as_ptr());
        assert!(!f.is_null(), "not the stand-in NVRTC");
        let f: extern "C" fn() -> u64 = std::mem::transmute(f);
        f()
    };
    println!("kernel cache child: compiles {compiles}");
    for n in infer::cuda::kernel_cache::notes() {
        println!("note: {n}");
    }
}

/// The child of `gpu_executor_that_cannot_start_leaves_kind_auto_on_the_cpu`.
#[test]
fn executor_start_child() {
    let Some(case) = std::env::var_os("INFER_EXECUTOR_START") else {
        return;
    };
    let case = case.to_string_lossy().into_owned();
    let s = server_in(INFER_GPU_REQUIRED).unwrap_or_else(|(st, m)| panic!("{st} {m}"));
    let dir = model_dir_of("mlp");
    let load = |config: &str| unsafe {
        infer_server_load_model(s.0, cs("mlp").as_ptr(), cs(config).as_ptr(), dir.as_ptr())
    };
    let st = load(&gpu_config_of("mlp"));
    let msg = last_error();
    assert_eq!(st, INFER_STATUS_UNAVAILABLE, "{msg}");
    let want: &[&str] = match case.as_str() {
        "cublas" => &["cublas"],
        "cuda13-libraries" => &[
            "nvrtc",
            "libnvrtc.so is version 13.0, which needs a cuda 13 driver (this one is cuda 12)",
        ],
        _ => &["nvrtc"],
    };
    assert!(
        want.iter().all(|w| msg.to_ascii_lowercase().contains(w))
            && msg.contains("'mlp'")
            && msg.contains("GPU 0"),
        "{msg}"
    );
    ok(load(&gpu_config_of("mlp").replace("KIND_GPU", "KIND_AUTO")));
    let placed = s.stats("mlp");
    assert!(
        placed["models"][0].get("gpu").is_none(),
        "mlp is on the GPU: {placed}"
    );
    let resp = s.infer(random_request(&s, "mlp", 2, &mut Rand(5)));
    assert_eq!(resp.status(), INFER_STATUS_OK, "{}", resp.error());
    println!("executor start '{case}': checked ({msg})");
}

/// GPU 0's primary context and what lives in it, from the stand-in: (retains,
/// allocations, streams, events, modules, graphs).
fn context_state() -> [i32; 6] {
    let f = driver()
        .context_state
        .expect("the stand-in driver's fake_cuda_context_state");
    let mut out = [0i32; 6];
    assert_eq!(unsafe { f(0, out.as_mut_ptr()) }, 0);
    out
}

/// A process whose servers are gone holds no GPU context: the primary context goes back
/// to the driver with the last thing that works there (here a response's device buffer,
/// freed after its server), with nothing of the library's left in it (the stand-in counts
/// anything left as an invalid call: a GPU destroys it with the context). A new server
/// then retains it again, and its models serve.
fn contexts_go_with_the_last_server() {
    let d = driver();
    assert_eq!(context_state(), [0; 6], "before any server");
    let invalid = d.counters().invalid_calls;
    for round in 0..2 {
        let s = server_in(INFER_GPU_REQUIRED).unwrap_or_else(|(st, m)| panic!("{st} {m}"));
        load_from_models(&s, "mlp", Some(&gpu_config_of("mlp")));
        let resp = s.infer(random_request(&s, "mlp", 3, &mut Rand(7)));
        assert_eq!(resp.status(), INFER_STATUS_OK, "{}", resp.error());
        let on_gpu = s.infer(ask_gpu(random_request(&s, "mlp", 2, &mut Rand(8)), 0));
        assert_eq!(on_gpu.status(), INFER_STATUS_OK, "{}", on_gpu.error());
        let (mut mem, mut dev) = (99u32, 99i64);
        ok(unsafe { infer_response_output_memory(on_gpu.0, 0, &mut mem, &mut dev) });
        assert_eq!((mem, dev), (INFER_MEMORY_GPU, 0));
        let busy = context_state();
        assert!(busy[0] >= 1 && busy[4] >= 1, "round {round}: {busy:?}");
        drop(resp);
        drop(s);
        // The response's device buffer still holds the context.
        let held = context_state();
        assert!(
            held[0] >= 1 && held[1] >= 1,
            "round {round}, after the server: {held:?}"
        );
        drop(on_gpu);
        assert_eq!(
            context_state(),
            [0; 6],
            "round {round}, after the last response"
        );
    }
    assert_eq!(d.counters().invalid_calls, invalid);
    println!("release: contexts released with the last server and response, twice");
}

/// The child of `gpu_instances_against_a_stand_in_driver` (does nothing in a normal run).
#[test]
fn gpu_data_path_child() {
    let Some(scenario) = std::env::var_os("INFER_DATA_PATH_CHECKS") else {
        return;
    };
    let scenario = scenario.to_string_lossy().into_owned();
    match scenario.as_str() {
        "one" => data_path_one_gpu(),
        "two" => data_path_two_gpus(),
        "onnx" => onnx_on_the_stand_in(),
        "wait" => workers_wait_asleep(),
        "release" => contexts_go_with_the_last_server(),
        other => panic!("no data path checks for scenario {other}"),
    }
    println!("data path '{scenario}': checked");
}

// ---- on a real GPU (skips without one) ----

/// Y = X and X_COPY = X with device-to-device copies on the instance's stream: work a
/// real GPU can do without kernels of its own.
unsafe extern "C" fn copy_on_gpu_execute(state: *mut c_void, b: *mut Batch) -> u32 {
    let gpu = *(state as *const i32);
    let d = driver();
    let stream = infer_batch_cuda_stream(b);
    let (mut mem, mut dev) = (99u32, 99i64);
    let st = infer_batch_input_memory(b, c"X".as_ptr(), &mut mem, &mut dev);
    if stream.is_null() || st != INFER_STATUS_OK || (mem, dev) != (INFER_MEMORY_GPU, gpu as i64) {
        return INFER_STATUS_INTERNAL;
    }
    let (mut data, mut bytes) = (null(), 0usize);
    let st = infer_batch_input(
        b,
        c"X".as_ptr(),
        null_mut(),
        null_mut(),
        null_mut(),
        &mut data,
        &mut bytes,
    );
    if st != INFER_STATUS_OK {
        return st;
    }
    let rows = infer_batch_size(b) as i64;
    for name in [c"Y", c"X_COPY"] {
        let mut out = null_mut();
        let st = infer_batch_output_device(b, name.as_ptr(), [rows, 4].as_ptr(), 2, &mut out);
        if st != INFER_STATUS_OK {
            return st;
        }
        if (d.dtod_async)(out as u64, data as u64, bytes, stream) != 0 {
            return INFER_STATUS_INTERNAL;
        }
    }
    INFER_STATUS_OK
}

#[test]
fn custom_backend_on_a_real_gpu() {
    if std::env::var_os("INFER_FAKE_CUDA").is_some() {
        return; // a child process of the stand-in tests
    }
    if let Some(why) = no_gpu_reason() {
        println!("SKIP: {why}");
        return;
    }
    let s = server_in(INFER_GPU_REQUIRED).unwrap_or_else(|(st, m)| panic!("{st} {m}"));
    let vt = infer_backend {
        struct_size: std::mem::size_of::<infer_backend>() as u32,
        instance_init: Some(affine_init),
        execute: Some(copy_on_gpu_execute),
        instance_fini: Some(affine_fini),
        finalize: None,
    };
    ok(unsafe { infer_server_register_backend(s.0, c"gpu_affine".as_ptr(), &vt, null_mut()) });
    s.load(
        "g",
        &affine_config(
            "g",
            "{ kind: KIND_GPU count: 2 gpus: [ 0 ] }",
            "dynamic_batching { max_queue_delay_microseconds: 2000 }",
        ),
    );
    let c = Collector::new();
    let mut ids = Vec::new();
    for i in 0..64 {
        let gpu = (i % 2 == 0).then_some(0);
        ids.push(
            s.enqueue(affine_request(&s, "g", x_of(i), gpu), &c)
                .unwrap(),
        );
    }
    c.wait(64);
    c.assert_exactly_once(&ids);
    for resp in c.take() {
        let i = ids.iter().position(|&id| id == resp.id()).unwrap();
        assert_eq!(resp.status(), INFER_STATUS_OK, "{}", resp.error());
        for name in ["Y", "X_COPY"] {
            let (mem, dev, v) = read_output(&resp, name);
            let want = if i % 2 == 0 {
                INFER_MEMORY_GPU
            } else {
                INFER_MEMORY_CPU
            };
            assert_eq!((mem, dev), (want, 0));
            assert_eq!(v, x_of(i).to_vec());
        }
    }
    // An input already on the device.
    let d = driver();
    d.bind(0);
    let p = d.upload(&x_of(9));
    let r = s.request("g");
    ok(device_input(&r, "X", p, 16, 0));
    let resp = s.infer(r);
    assert_eq!(read_output(&resp, "Y").2, x_of(9).to_vec());
    drop(resp);
    assert_eq!(unsafe { (d.mem_free)(p) }, 0);
}

// ---- the GPU executor for ONNX models, against the stand-ins ----
//
// The stand-in driver runs the kernels of src/onnx/gpu/kernels.cu compiled for the
// host, the stand-in NVRTC "compiles" them, and the stand-in cuBLAS computes GEMMs on
// the host: every model of models/ on a KIND_GPU instance must give what it gives on
// the CPU.

/// The config of `models/<name>` with its instances on GPU 0.
fn gpu_config_of(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(name)
        .join("config.pbtxt");
    let text = std::fs::read_to_string(&path).unwrap();
    if text.contains("instance_group") {
        assert!(text.contains("KIND_AUTO"), "{}", path.display());
        text.replace("KIND_AUTO", "KIND_GPU")
    } else {
        format!("{text}\ninstance_group [ {{ kind: KIND_GPU count: 1 gpus: [ 0 ] }} ]\n")
    }
}

fn model_dir_of(name: &str) -> std::ffi::CString {
    cs(std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(name)
        .to_str()
        .unwrap())
}

fn load_from_models(s: &Server, name: &str, config: Option<&str>) {
    let c = config.map(cs);
    ok(unsafe {
        infer_server_load_model(
            s.0,
            cs(name).as_ptr(),
            c.as_ref().map_or(null(), |c| c.as_ptr()),
            model_dir_of(name).as_ptr(),
        )
    });
}

/// A small deterministic generator (xorshift).
struct Rand(u64);
impl Rand {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn f32s(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| (self.next() % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }
}

/// (name, datatype, dims without the batch dim) of the inputs of each model tested.
fn inputs_of(model: &str) -> Vec<(&'static str, infer_datatype, Vec<i64>)> {
    match model {
        "add_sub" => vec![
            ("INPUT0", INFER_DATATYPE_FP32, vec![16]),
            ("INPUT1", INFER_DATATYPE_FP32, vec![16]),
        ],
        "mlp" => vec![("FEATURES", INFER_DATATYPE_FP32, vec![64])],
        "cnn" => vec![("PIXELS", INFER_DATATYPE_FP32, vec![1, 28, 28])],
        "preprocess" => vec![("IMAGE", INFER_DATATYPE_UINT8, vec![28, 28])],
        "postprocess" => vec![("LOGITS", INFER_DATATYPE_FP32, vec![10])],
        "image_classifier" => vec![("IMAGE", INFER_DATATYPE_UINT8, vec![28, 28])],
        other => panic!("no inputs for {other}"),
    }
}

fn random_request(s: &Server, model: &str, batch: i64, rng: &mut Rand) -> Req {
    random_request_as(s, model, model, batch, rng)
}

/// A request to `name` with the inputs of `model`.
fn random_request_as(s: &Server, name: &str, model: &str, batch: i64, rng: &mut Rand) -> Req {
    let r = s.request(name);
    for (name, dt, dims) in inputs_of(model) {
        let mut shape = vec![batch];
        shape.extend(&dims);
        let n = shape.iter().product::<i64>() as usize;
        let bytes: Vec<u8> = if dt == INFER_DATATYPE_UINT8 {
            (0..n).map(|_| rng.next() as u8).collect()
        } else {
            bytemuck::cast_slice(&rng.f32s(n)).to_vec()
        };
        ok(r.try_input(name, dt, &shape, &bytes));
    }
    r
}

/// Every output of a response: name -> (shape, bytes).
fn all_outputs(resp: &Resp) -> std::collections::BTreeMap<String, (Vec<i64>, Vec<u8>)> {
    assert_eq!(resp.status(), INFER_STATUS_OK, "{}", resp.error());
    let mut out = std::collections::BTreeMap::new();
    for i in 0..resp.output_count() {
        let (mut name, mut shape, mut nd, mut data, mut bytes) = (null(), null(), 0, null(), 0);
        ok(unsafe {
            infer_response_output(
                resp.0,
                i,
                &mut name,
                null_mut(),
                &mut shape,
                &mut nd,
                &mut data,
                &mut bytes,
            )
        });
        let (mut mem, mut dev) = (99u32, 99i64);
        ok(unsafe { infer_response_output_memory(resp.0, i, &mut mem, &mut dev) });
        // Host memory: page-locked where a GPU instance lent its landing buffer.
        assert!(
            mem == INFER_MEMORY_CPU || mem == INFER_MEMORY_CPU_PINNED,
            "memory {mem}"
        );
        let name = unsafe { std::ffi::CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        let shape = unsafe { std::slice::from_raw_parts(shape, nd) }.to_vec();
        let data = unsafe { std::slice::from_raw_parts(data as *const u8, bytes) }.to_vec();
        out.insert(name, (shape, data));
    }
    out
}

fn assert_close(model: &str, name: &str, want: &[u8], got: &[u8], int64: bool) {
    assert_eq!(want.len(), got.len(), "{model}.{name}");
    if int64 {
        assert_eq!(want, got, "{model}.{name}");
        return;
    }
    let (w, g): (Vec<f32>, Vec<f32>) = (
        bytemuck::pod_collect_to_vec(want),
        bytemuck::pod_collect_to_vec(got),
    );
    for (i, (a, b)) in w.iter().zip(&g).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 + 1e-4 * a.abs(),
            "{model}.{name}[{i}]: CPU {a}, GPU {b}"
        );
    }
}

/// `precision: FP16` / `BF16`: FLOAT models computed in 16 bits (GEMMs through
/// cublasGemmStridedBatchedEx, kernels on 16-bit storage) stay within the documented
/// tolerance of the CPU's FP32 results, and are not the FP32 results (the parameter is
/// not ignored). Tolerance: |gpu - cpu| <= tol * (|cpu| + mean |cpu| of the output), tol
/// 1e-2 for FP16 and 4e-2 for BF16 (README "Reduced precision").
fn reduced_precision_on_the_stand_in(cpu: &Server, gpu: &Server) {
    let models = ["add_sub", "mlp", "cnn", "postprocess"];
    for (precision, tol) in [("FP16", 1e-2f32), ("BF16", 4e-2f32)] {
        for m in models {
            let name = format!("{m}_{}", precision.to_lowercase());
            let config = gpu_config_of(m)
                .replace(&format!("name: \"{m}\""), &format!("name: \"{name}\""))
                .replace(
                    "instance_group",
                    &format!(
                        "parameters {{ key: \"precision\" value: {{ string_value: \"{precision}\" }} }}\ninstance_group"
                    ),
                );
            let c = cs(&config);
            ok(unsafe {
                infer_server_load_model(
                    gpu.0,
                    cs(&name).as_ptr(),
                    c.as_ptr(),
                    model_dir_of(m).as_ptr(),
                )
            });
            let mut differs = false;
            for batch in [1i64, 4] {
                let seed = 0x5eed + batch as u64;
                let want = all_outputs(&cpu.infer(random_request(cpu, m, batch, &mut Rand(seed))));
                let got = all_outputs(&gpu.infer(random_request_as(
                    gpu,
                    &name,
                    m,
                    batch,
                    &mut Rand(seed),
                )));
                for (out, (shape, bytes)) in &want {
                    let (gshape, gbytes) = &got[out];
                    assert_eq!(shape, gshape, "{name}.{out}");
                    let (w, g): (Vec<f32>, Vec<f32>) = (
                        bytemuck::pod_collect_to_vec(bytes),
                        bytemuck::pod_collect_to_vec(gbytes),
                    );
                    let scale = w.iter().map(|v| v.abs()).sum::<f32>() / w.len().max(1) as f32;
                    for (i, (a, b)) in w.iter().zip(&g).enumerate() {
                        assert!(
                            (a - b).abs() <= tol * (a.abs() + scale),
                            "{name}.{out}[{i}] at batch {batch}: CPU {a}, GPU in {precision} {b}"
                        );
                    }
                    differs |= w != g;
                }
            }
            assert!(
                differs,
                "{name}: exactly the FP32 results; was {precision} used?"
            );
            println!("{name}: {precision} within {tol} of the CPU");
        }
    }
    // An unknown precision names the value.
    let bad = gpu_config_of("mlp")
        .replace("name: \"mlp\"", "name: \"mlp_fp8\"")
        .replace(
            "instance_group",
            "parameters { key: \"precision\" value: { string_value: \"FP8\" } }\ninstance_group",
        );
    let c = cs(&bad);
    let st = unsafe {
        infer_server_load_model(
            gpu.0,
            cs("mlp_fp8").as_ptr(),
            c.as_ptr(),
            model_dir_of("mlp").as_ptr(),
        )
    };
    expect_msg(
        st,
        INFER_STATUS_INVALID_ARGUMENT,
        &["mlp_fp8", "precision", "FP8"],
    );
}

/// Values in ONNX element type `ty` (1 FLOAT, 10 FLOAT16, 16 BFLOAT16), little endian.
fn float_bytes(v: &[f32], ty: i32) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| match ty {
            10 => half::f16::from_f32(x).to_le_bytes().to_vec(),
            16 => half::bf16::from_f32(x).to_le_bytes().to_vec(),
            _ => x.to_le_bytes().to_vec(),
        })
        .collect()
}

fn floats_of(b: &[u8], ty: i32) -> Vec<f32> {
    match ty {
        10 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        16 => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => bytemuck::pod_collect_to_vec(b),
    }
}

/// A small transformer-style block in element type `ty`: MatMul, Add, Relu,
/// LayerNormalization, MatMul, Softmax (Y), and a ReduceMean of the hidden layer (Z);
/// plus a Conv, MaxPool and GlobalAveragePool branch on X seen as an image (P).
fn block_model(ty: i32, rng: &mut Rand) -> pb::ModelProto {
    let init = |name: &str, dims: &[i64], rng: &mut Rand, scale: f32| pb::TensorProto {
        name: name.to_owned(),
        dims: dims.to_vec(),
        data_type: ty,
        raw_data: float_bytes(
            &rng.f32s(dims.iter().product::<i64>() as usize)
                .iter()
                .map(|v| v * scale)
                .collect::<Vec<_>>(),
            ty,
        ),
        ..Default::default()
    };
    let node = |op: &str, ins: &[&str], out: &str, attrs: Vec<pb::AttributeProto>| pb::NodeProto {
        op_type: op.into(),
        name: out.into(),
        input: ins.iter().map(|s| s.to_string()).collect(),
        output: vec![out.into()],
        attribute: attrs,
        ..Default::default()
    };
    let ints = |name: &str, v: &[i64]| pb::AttributeProto {
        name: name.into(),
        ints: v.to_vec(),
        r#type: 7,
        ..Default::default()
    };
    let int = |name: &str, v: i64| pb::AttributeProto {
        name: name.into(),
        i: v,
        r#type: 2,
        ..Default::default()
    };
    pb::ModelProto {
        ir_version: 8,
        opset_import: vec![pb::OperatorSetIdProto {
            domain: String::new(),
            version: 17,
        }],
        graph: Some(pb::GraphProto {
            name: "block".into(),
            node: vec![
                node("MatMul", &["X", "W1"], "h1", vec![]),
                node("Add", &["h1", "B1"], "h2", vec![]),
                node("Relu", &["h2"], "h3", vec![]),
                node(
                    "LayerNormalization",
                    &["h3", "S", "T"],
                    "h4",
                    vec![int("axis", -1)],
                ),
                node("MatMul", &["h4", "W2"], "h5", vec![]),
                node("Softmax", &["h5"], "Y", vec![int("axis", -1)]),
                node(
                    "ReduceMean",
                    &["h3"],
                    "Z",
                    vec![ints("axes", &[1]), int("keepdims", 0)],
                ),
                node("Reshape", &["X", "IMG"], "x4", vec![]),
                node(
                    "Conv",
                    &["x4", "K", "KB"],
                    "c1",
                    vec![ints("pads", &[1, 1, 1, 1])],
                ),
                node(
                    "MaxPool",
                    &["c1"],
                    "c2",
                    vec![ints("kernel_shape", &[2, 2]), ints("strides", &[2, 2])],
                ),
                node("GlobalAveragePool", &["c2"], "P", vec![]),
            ],
            initializer: vec![
                init("W1", &[32, 48], rng, 0.3),
                init("B1", &[48], rng, 0.1),
                init("S", &[48], rng, 1.0),
                init("T", &[48], rng, 0.1),
                init("W2", &[48, 16], rng, 0.5),
                init("K", &[3, 2, 3, 3], rng, 0.4),
                init("KB", &[3], rng, 0.1),
                pb::TensorProto {
                    name: "IMG".into(),
                    dims: vec![4],
                    data_type: 7,
                    int64_data: vec![4, 2, 4, 4],
                    ..Default::default()
                },
            ],
            input: vec![value_info_of("X", &["4", "32"], ty)],
            output: vec![
                value_info_of("Y", &["4", "16"], ty),
                value_info_of("Z", &["4"], ty),
                value_info_of("P", &["4", "3", "1", "1"], ty),
            ],
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Models whose tensors are FLOAT16 or BFLOAT16 (inputs and outputs included) run on the
/// GPU executor with 16-bit requests and responses, within the tolerance of the
/// reduced-precision check of the same graph in FLOAT.
fn native_16_bit_models_on_the_stand_in(gpu: &Server) {
    let dir = temp_dir("gpu-native16");
    let mut outs: Vec<std::collections::BTreeMap<String, Vec<f32>>> = Vec::new();
    let x = Rand(77).f32s(4 * 32);
    for (ty, tname) in [(1, "FP32"), (10, "FP16"), (16, "BF16")] {
        let name = format!("block_{}", tname.to_lowercase());
        let mdir = dir.join(&name);
        std::fs::create_dir_all(mdir.join("1")).unwrap();
        let model = block_model(ty, &mut Rand(1234));
        std::fs::write(
            mdir.join("1/model.onnx"),
            prost::Message::encode_to_vec(&model),
        )
        .unwrap();
        let config = format!(
            r#"name: "{name}" platform: "onnxruntime_onnx" max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_{tname} dims: [ 4, 32 ] }} ]
output [ {{ name: "Y" data_type: TYPE_{tname} dims: [ 4, 16 ] }},
         {{ name: "Z" data_type: TYPE_{tname} dims: [ 4 ] }},
         {{ name: "P" data_type: TYPE_{tname} dims: [ 4, 3, 1, 1 ] }} ]
instance_group [ {{ kind: KIND_GPU count: 1 gpus: [ 0 ] }} ]"#
        );
        let c = cs(&config);
        ok(unsafe {
            infer_server_load_model(
                gpu.0,
                cs(&name).as_ptr(),
                c.as_ptr(),
                cs(mdir.to_str().unwrap()).as_ptr(),
            )
        });
        let dt = match ty {
            10 => INFER_DATATYPE_FP16,
            16 => INFER_DATATYPE_BF16,
            _ => INFER_DATATYPE_FP32,
        };
        let r = gpu.request(&name);
        ok(r.try_input("X", dt, &[4, 32], &float_bytes(&x, ty)));
        let got = all_outputs(&gpu.infer(r));
        let mut vals = std::collections::BTreeMap::new();
        for (out, (shape, bytes)) in got {
            let n: i64 = shape.iter().product();
            assert_eq!(
                bytes.len() as i64,
                n * if ty == 1 { 4 } else { 2 },
                "{name}.{out}"
            );
            vals.insert(out, floats_of(&bytes, ty));
        }
        outs.push(vals);
    }
    for (k, (tname, tol)) in [(1, ("FP16", 1e-2f32)), (2, ("BF16", 4e-2f32))] {
        for (out, want) in &outs[0] {
            let got = &outs[k][out];
            let scale = want.iter().map(|v| v.abs()).sum::<f32>() / want.len() as f32;
            assert!(scale > 0.0, "{out}: all zero");
            for (i, (a, b)) in want.iter().zip(got).enumerate() {
                assert!(
                    (a - b).abs() <= tol * (a.abs() + scale),
                    "block_{tname}.{out}[{i}]: FP32 {a}, {tname} {b}"
                );
            }
        }
        println!("a {tname} model: within {tol} of the same model in FP32");
    }
}

/// A GELU exported as Div, Erf, Add, Mul, Mul (scalar constants) and a Sub with a
/// broadcast vector followed by a Sigmoid: each chain is one launch, and the results are
/// the CPU's. A chain whose intermediate is also an output is not fused into one.
fn fused_element_wise_chains_on_the_stand_in(cpu: &Server, gpu: &Server) {
    let d = driver();
    let scalar = |name: &str, v: f32| pb::TensorProto {
        name: name.into(),
        dims: vec![],
        data_type: 1,
        float_data: vec![v],
        ..Default::default()
    };
    let node = |op: &str, ins: &[&str], out: &str| pb::NodeProto {
        op_type: op.into(),
        name: out.into(),
        input: ins.iter().map(|s| s.to_string()).collect(),
        output: vec![out.into()],
        ..Default::default()
    };
    let model = |extra_output: bool| pb::ModelProto {
        ir_version: 8,
        opset_import: vec![pb::OperatorSetIdProto {
            domain: String::new(),
            version: 17,
        }],
        graph: Some(pb::GraphProto {
            name: "chains".into(),
            node: vec![
                node("Div", &["X", "SQRT2"], "g1"),
                node("Erf", &["g1"], "g2"),
                node("Add", &["g2", "ONE"], "g3"),
                node("Mul", &["X", "g3"], "g4"),
                node("Mul", &["g4", "HALF"], "Y"),
                node("Sub", &["X", "B"], "s1"),
                node("Sigmoid", &["s1"], "Z"),
            ],
            initializer: vec![
                scalar("SQRT2", std::f32::consts::SQRT_2),
                scalar("ONE", 1.0),
                scalar("HALF", 0.5),
                pb::TensorProto {
                    name: "B".into(),
                    dims: vec![32],
                    data_type: 1,
                    float_data: Rand(5).f32s(32),
                    ..Default::default()
                },
            ],
            input: vec![value_info("X", &["4", "32"])],
            output: [value_info("Y", &["4", "32"]), value_info("Z", &["4", "32"])]
                .into_iter()
                .chain(extra_output.then(|| value_info("g3", &["4", "32"])))
                .collect(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let dir = temp_dir("gpu-fused");
    for (name, extra, launches) in [("chains", false, 2), ("chains_shared", true, 3)] {
        let mdir = dir.join(name);
        std::fs::create_dir_all(mdir.join("1")).unwrap();
        std::fs::write(
            mdir.join("1/model.onnx"),
            prost::Message::encode_to_vec(&model(extra)),
        )
        .unwrap();
        let outs = if extra {
            ", { name: \"g3\" data_type: TYPE_FP32 dims: [ 4, 32 ] }"
        } else {
            ""
        };
        let cfg = |kind: &str| {
            format!(
                r#"name: "{name}" platform: "onnxruntime_onnx" max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4, 32 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 4, 32 ] }},
         {{ name: "Z" data_type: TYPE_FP32 dims: [ 4, 32 ] }}{outs} ]
instance_group [ {{ kind: {kind} }} ]"#
            )
        };
        for (s, kind) in [(cpu, "KIND_CPU"), (gpu, "KIND_GPU")] {
            let c = cs(&cfg(kind));
            ok(unsafe {
                infer_server_load_model(
                    s.0,
                    cs(name).as_ptr(),
                    c.as_ptr(),
                    cs(mdir.to_str().unwrap()).as_ptr(),
                )
            });
        }
        let x: Vec<f32> = Rand(11).f32s(128).iter().map(|v| v * 3.0).collect();
        let want = all_outputs(&cpu.infer(cpu.request(name).input_f32("X", &[4, 32], &x)));
        let before = d.counters().kernel_launches;
        let got = all_outputs(&gpu.infer(gpu.request(name).input_f32("X", &[4, 32], &x)));
        let ran = d.counters().kernel_launches - before;
        if !d.real() {
            assert_eq!(ran, launches, "{name}: kernel launches");
        }
        for (out, (shape, bytes)) in &want {
            assert_eq!(&got[out].0, shape, "{name}.{out}");
            assert_close(name, out, bytes, &got[out].1, false);
        }
        if d.real() {
            println!("{name}: element-wise chains equal to the CPU");
        } else {
            println!("{name}: element-wise chains in {ran} launches, equal to the CPU");
        }
    }
    // 20 operations: 15 fit one launch (the program's limit), the other 5 another.
    let nodes: Vec<pb::NodeProto> = (0..20)
        .map(|i| {
            let input = if i == 0 {
                "X".to_owned()
            } else {
                format!("t{}", i - 1)
            };
            let output = if i == 19 {
                "Y".to_owned()
            } else {
                format!("t{i}")
            };
            node(
                if i % 2 == 0 { "Neg" } else { "Sigmoid" },
                &[&input],
                &output,
            )
        })
        .collect();
    let long = pb::ModelProto {
        ir_version: 8,
        opset_import: vec![pb::OperatorSetIdProto {
            domain: String::new(),
            version: 17,
        }],
        graph: Some(pb::GraphProto {
            name: "long".into(),
            node: nodes,
            input: vec![value_info("X", &["4", "32"])],
            output: vec![value_info("Y", &["4", "32"])],
            ..Default::default()
        }),
        ..Default::default()
    };
    let mdir = dir.join("long_chain");
    std::fs::create_dir_all(mdir.join("1")).unwrap();
    std::fs::write(
        mdir.join("1/model.onnx"),
        prost::Message::encode_to_vec(&long),
    )
    .unwrap();
    for (s, kind) in [(cpu, "KIND_CPU"), (gpu, "KIND_GPU")] {
        let c = cs(&format!(
            r#"name: "long_chain" platform: "onnxruntime_onnx" max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4, 32 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 4, 32 ] }} ]
instance_group [ {{ kind: {kind} }} ]"#
        ));
        ok(unsafe {
            infer_server_load_model(
                s.0,
                cs("long_chain").as_ptr(),
                c.as_ptr(),
                cs(mdir.to_str().unwrap()).as_ptr(),
            )
        });
    }
    let x = Rand(12).f32s(128);
    let want = all_outputs(&cpu.infer(cpu.request("long_chain").input_f32("X", &[4, 32], &x)));
    let before = d.counters().kernel_launches;
    let got = all_outputs(&gpu.infer(gpu.request("long_chain").input_f32("X", &[4, 32], &x)));
    if !d.real() {
        assert_eq!(
            d.counters().kernel_launches - before,
            2,
            "long_chain: kernel launches"
        );
    }
    assert_close("long_chain", "Y", &want["Y"].1, &got["Y"].1, false);
    println!("long_chain: 20 element-wise operations, equal to the CPU");
}

/// Weights live once per device: three more instances of `mlp` (already loaded on the
/// GPU) upload none of them again.
fn constants_shared_on_a_device(gpu: &Server) {
    let d = driver();
    let weights = std::fs::metadata(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/mlp/1/model.onnx"),
    )
    .unwrap()
    .len();
    let before = d.counters().live_device_bytes;
    let config = gpu_config_of("mlp")
        .replace("name: \"mlp\"", "name: \"mlp_three\"")
        .replace("count: 1", "count: 3");
    assert!(config.contains("count: 3"), "{config}");
    let c = cs(&config);
    ok(unsafe {
        infer_server_load_model(
            gpu.0,
            cs("mlp_three").as_ptr(),
            c.as_ptr(),
            model_dir_of("mlp").as_ptr(),
        )
    });
    let added = d.counters().live_device_bytes - before;
    assert!(
        d.real() || added < weights / 2,
        "3 instances of mlp added {added} device bytes; its weights are about {weights}"
    );
    let resp = gpu.infer(random_request_as(gpu, "mlp_three", "mlp", 2, &mut Rand(3)));
    assert_eq!(resp.status(), INFER_STATUS_OK, "{}", resp.error());
    println!("constants: 3 more instances of mlp added {added} device bytes (weights: {weights})");
}

/// A pre-LN transformer encoder layer as PyTorch exports one (opset 17): LayerNorm,
/// Q/K/V projections, heads split by Reshape/Transpose, scaled scores plus an additive
/// mask made from an INT64 attention mask (Unsqueeze, Cast, Sub, Mul), Softmax, the
/// heads merged back, the output projection and residual, LayerNorm, a feed-forward
/// block with a GELU exported as Div/Erf/Add/Mul/Mul, and the second residual. Batch and
/// sequence dims are symbolic. The GPU executor must give the CPU's results at several
/// batch sizes, in FP32 and (within the documented tolerance) in FP16 and BF16.
fn encoder_model() -> pb::ModelProto {
    const D: i64 = 32;
    const H: i64 = 4;
    const F: i64 = 64;
    let mut rng = Rand(2024);
    let mut inits: Vec<pb::TensorProto> = Vec::new();
    let mut f32_init = |name: &str, dims: &[i64], scale: f32, offset: f32| {
        let n = dims.iter().product::<i64>() as usize;
        inits.push(pb::TensorProto {
            name: name.into(),
            dims: dims.to_vec(),
            data_type: 1,
            float_data: rng.f32s(n).iter().map(|v| v * scale + offset).collect(),
            ..Default::default()
        });
    };
    let w = 1.0 / (D as f32).sqrt();
    f32_init("ln1_g", &[D], 0.2, 1.0);
    f32_init("ln1_b", &[D], 0.1, 0.0);
    for p in ["q", "k", "v", "o"] {
        f32_init(&format!("W{p}"), &[D, D], w, 0.0);
        f32_init(&format!("b{p}"), &[D], 0.05, 0.0);
    }
    f32_init("ln2_g", &[D], 0.2, 1.0);
    f32_init("ln2_b", &[D], 0.1, 0.0);
    f32_init("W1", &[D, F], w, 0.0);
    f32_init("b1", &[F], 0.05, 0.0);
    f32_init("W2", &[F, D], 1.0 / (F as f32).sqrt(), 0.0);
    f32_init("b2", &[D], 0.05, 0.0);
    let scalar = |name: &str, v: f32| pb::TensorProto {
        name: name.into(),
        data_type: 1,
        float_data: vec![v],
        ..Default::default()
    };
    let ints = |name: &str, v: &[i64]| pb::TensorProto {
        name: name.into(),
        dims: vec![v.len() as i64],
        data_type: 7,
        int64_data: v.to_vec(),
        ..Default::default()
    };
    inits.extend([
        scalar("scale", 1.0 / ((D / H) as f32).sqrt()),
        scalar("one", 1.0),
        scalar("neg_big", -10000.0),
        scalar("sqrt2", std::f32::consts::SQRT_2),
        scalar("half", 0.5),
        ints("split_heads", &[0, 0, H, D / H]),
        ints("merge_heads", &[0, 0, D]),
        ints("mask_axes", &[1, 2]),
    ]);
    let attr_i = |name: &str, v: i64| pb::AttributeProto {
        name: name.into(),
        i: v,
        r#type: 2,
        ..Default::default()
    };
    let attr_ints = |name: &str, v: &[i64]| pb::AttributeProto {
        name: name.into(),
        ints: v.to_vec(),
        r#type: 7,
        ..Default::default()
    };
    let n = |op: &str, ins: &[&str], out: &str, attrs: Vec<pb::AttributeProto>| pb::NodeProto {
        op_type: op.into(),
        name: format!("{op}_{out}"),
        input: ins.iter().map(|s| s.to_string()).collect(),
        output: vec![out.into()],
        attribute: attrs,
        ..Default::default()
    };
    let mut nodes = vec![n(
        "LayerNormalization",
        &["X", "ln1_g", "ln1_b"],
        "ln1",
        vec![attr_i("axis", -1)],
    )];
    for p in ["q", "k", "v"] {
        nodes.push(n(
            "MatMul",
            &["ln1", &format!("W{p}")],
            &format!("{p}0"),
            vec![],
        ));
        nodes.push(n(
            "Add",
            &[&format!("{p}0"), &format!("b{p}")],
            &format!("{p}1"),
            vec![],
        ));
        nodes.push(n(
            "Reshape",
            &[&format!("{p}1"), "split_heads"],
            &format!("{p}2"),
            vec![],
        ));
    }
    nodes.extend([
        n(
            "Transpose",
            &["q2"],
            "qh",
            vec![attr_ints("perm", &[0, 2, 1, 3])],
        ),
        n(
            "Transpose",
            &["k2"],
            "kt",
            vec![attr_ints("perm", &[0, 2, 3, 1])],
        ),
        n(
            "Transpose",
            &["v2"],
            "vh",
            vec![attr_ints("perm", &[0, 2, 1, 3])],
        ),
        n("MatMul", &["qh", "kt"], "s0", vec![]),
        n("Mul", &["s0", "scale"], "s1", vec![]),
        n("Unsqueeze", &["MASK", "mask_axes"], "m0", vec![]),
        n("Cast", &["m0"], "m1", vec![attr_i("to", 1)]),
        n("Sub", &["one", "m1"], "m2", vec![]),
        n("Mul", &["m2", "neg_big"], "m3", vec![]),
        n("Add", &["s1", "m3"], "s2", vec![]),
        n("Softmax", &["s2"], "p", vec![attr_i("axis", -1)]),
        n("MatMul", &["p", "vh"], "c0", vec![]),
        n(
            "Transpose",
            &["c0"],
            "c1",
            vec![attr_ints("perm", &[0, 2, 1, 3])],
        ),
        n("Reshape", &["c1", "merge_heads"], "c2", vec![]),
        n("MatMul", &["c2", "Wo"], "o0", vec![]),
        n("Add", &["o0", "bo"], "o1", vec![]),
        n("Add", &["X", "o1"], "h", vec![]),
        n(
            "LayerNormalization",
            &["h", "ln2_g", "ln2_b"],
            "ln2",
            vec![attr_i("axis", -1)],
        ),
        n("MatMul", &["ln2", "W1"], "f0", vec![]),
        n("Add", &["f0", "b1"], "f1", vec![]),
        n("Div", &["f1", "sqrt2"], "g0", vec![]),
        n("Erf", &["g0"], "g1", vec![]),
        n("Add", &["g1", "one"], "g2", vec![]),
        n("Mul", &["f1", "g2"], "g3", vec![]),
        n("Mul", &["g3", "half"], "g4", vec![]),
        n("MatMul", &["g4", "W2"], "f2", vec![]),
        n("Add", &["f2", "b2"], "f3", vec![]),
        n("Add", &["h", "f3"], "Y", vec![]),
    ]);
    pb::ModelProto {
        ir_version: 8,
        opset_import: vec![pb::OperatorSetIdProto {
            domain: String::new(),
            version: 17,
        }],
        graph: Some(pb::GraphProto {
            name: "encoder".into(),
            node: nodes,
            initializer: inits,
            input: vec![
                value_info_of("X", &["batch", "seq", "32"], 1),
                value_info_of("MASK", &["batch", "seq"], 7),
            ],
            output: vec![value_info_of("Y", &["batch", "seq", "32"], 1)],
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn transformer_encoder_on_the_stand_in(cpu: &Server, gpu: &Server) {
    let d = driver();
    let dir = temp_dir("gpu-encoder");
    std::fs::create_dir_all(dir.join("1")).unwrap();
    std::fs::write(
        dir.join("1/model.onnx"),
        prost::Message::encode_to_vec(&encoder_model()),
    )
    .unwrap();
    let config = |name: &str, kind: &str, extra: &str| {
        format!(
            r#"name: "{name}" platform: "onnxruntime_onnx" max_batch_size: 4
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ -1, 32 ] }},
        {{ name: "MASK" data_type: TYPE_INT64 dims: [ -1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1, 32 ] }} ]
{extra}
instance_group [ {{ kind: {kind} }} ]"#
        )
    };
    let load = |s: &Server, name: &str, kind: &str, extra: &str| {
        let c = cs(&config(name, kind, extra));
        ok(unsafe {
            infer_server_load_model(
                s.0,
                cs(name).as_ptr(),
                c.as_ptr(),
                cs(dir.to_str().unwrap()).as_ptr(),
            )
        });
    };
    load(cpu, "encoder", "KIND_CPU", "");
    let variants = [
        ("encoder", "", 0.0f32),
        (
            "encoder_fp16",
            "parameters { key: \"precision\" value: { string_value: \"FP16\" } }",
            1e-2,
        ),
        (
            "encoder_bf16",
            "parameters { key: \"precision\" value: { string_value: \"BF16\" } }",
            4e-2,
        ),
    ];
    for (name, extra, _) in variants {
        load(gpu, name, "KIND_GPU", extra);
    }
    let request = |s: &Server, name: &str, batch: i64, seq: i64, seed: u64| {
        let mut rng = Rand(seed);
        let x = rng.f32s((batch * seq * 32) as usize);
        // Each row keeps a prefix of its positions (at least one).
        let mask: Vec<i64> = (0..batch)
            .flat_map(|b| {
                let keep = 1 + (b + seed as i64) % seq;
                (0..seq).map(move |j| i64::from(j < keep))
            })
            .collect();
        let r = s.request(name);
        ok(r.try_input(
            "X",
            INFER_DATATYPE_FP32,
            &[batch, seq, 32],
            bytemuck::cast_slice(&x),
        ));
        ok(r.try_input(
            "MASK",
            INFER_DATATYPE_INT64,
            &[batch, seq],
            bytemuck::cast_slice(&mask),
        ));
        r
    };
    for (batch, seq) in [(1i64, 8i64), (3, 5), (4, 16)] {
        let seed = (batch * 100 + seq) as u64;
        let want = all_outputs(&cpu.infer(request(cpu, "encoder", batch, seq, seed)));
        let w: Vec<f32> = bytemuck::pod_collect_to_vec(&want["Y"].1);
        for (name, _, tol) in variants {
            let before = d.counters().kernel_launches;
            let got = all_outputs(&gpu.infer(request(gpu, name, batch, seq, seed)));
            let launches = d.counters().kernel_launches - before;
            assert_eq!(got["Y"].0, want["Y"].0, "{name}");
            if tol == 0.0 {
                assert_close(name, "Y", &want["Y"].1, &got["Y"].1, false);
            } else {
                let g: Vec<f32> = bytemuck::pod_collect_to_vec(&got["Y"].1);
                let scale = w.iter().map(|v| v.abs()).sum::<f32>() / w.len() as f32;
                for (i, (a, b)) in w.iter().zip(&g).enumerate() {
                    assert!(
                        (a - b).abs() <= tol * (a.abs() + scale),
                        "{name}.Y[{i}] at batch {batch}, seq {seq}: CPU {a}, GPU {b}"
                    );
                }
            }
            if d.real() {
                println!("{name}: batch {batch}, seq {seq}: GPU matches CPU");
            } else {
                println!(
                    "{name}: batch {batch}, seq {seq}: GPU matches CPU in {launches} kernel launches"
                );
            }
        }
    }
}

/// numpy-style padding of a row-major `x` of `shape` (negative pads crop).
fn pad_reference(
    x: &[f32],
    shape: &[i64],
    before: &[i64],
    after: &[i64],
    mode: &str,
    value: f32,
) -> (Vec<i64>, Vec<f32>) {
    let out: Vec<i64> = (0..shape.len())
        .map(|d| shape[d] + before[d] + after[d])
        .collect();
    let n: i64 = out.iter().product();
    let mut y = Vec::with_capacity(n as usize);
    for i in 0..n {
        let (mut rem, mut src, mut outside) = (i, 0i64, false);
        let mut stride = 1i64;
        for d in (0..shape.len()).rev() {
            let xd = rem % out[d];
            rem /= out[d];
            let len = shape[d];
            let mut j = xd - before[d];
            if j < 0 || j >= len {
                match mode {
                    "reflect" => {
                        let period = 2 * (len - 1);
                        j = if period == 0 { 0 } else { j.rem_euclid(period) };
                        if j >= len {
                            j = period - j;
                        }
                    }
                    "edge" => j = j.clamp(0, len - 1),
                    "wrap" => j = j.rem_euclid(len),
                    _ => outside = true,
                }
            }
            src += j * stride;
            stride *= len;
        }
        y.push(if outside { value } else { x[src as usize] });
    }
    (out, y)
}

/// Pad in its four modes (pads from initializers, some negative, one case over a subset
/// of axes) and Tile, against a reference.
fn pad_and_tile_on_the_stand_in(gpu: &Server) {
    let dir = temp_dir("gpu-pad");
    let shape = [2i64, 3, 4];
    let x: Vec<f32> = (0..24).map(|v| v as f32 * 0.5 - 3.0).collect();
    // (name, op, mode, pads before, pads after, axes (None: all), tile repeats)
    type Case<'a> = (
        &'a str,
        &'a str,
        &'a str,
        [i64; 3],
        [i64; 3],
        Option<Vec<i64>>,
        [i64; 3],
    );
    let cases: Vec<Case> = vec![
        (
            "pad_constant",
            "Pad",
            "constant",
            [0, 1, 2],
            [1, 0, 3],
            None,
            [1; 3],
        ),
        (
            "pad_reflect",
            "Pad",
            "reflect",
            [0, 2, 3],
            [0, 1, 2],
            None,
            [1; 3],
        ),
        (
            "pad_edge",
            "Pad",
            "edge",
            [1, 0, 2],
            [0, 2, 5],
            None,
            [1; 3],
        ),
        (
            "pad_wrap",
            "Pad",
            "wrap",
            [1, 2, 5],
            [2, 1, 1],
            None,
            [1; 3],
        ),
        (
            "pad_crop",
            "Pad",
            "constant",
            [0, -1, 2],
            [0, 1, -2],
            None,
            [1; 3],
        ),
        (
            "pad_axes",
            "Pad",
            "reflect",
            [0, 0, 2],
            [0, 0, 1],
            Some(vec![-1]),
            [1; 3],
        ),
        ("tile", "Tile", "", [0; 3], [0; 3], None, [2, 1, 3]),
    ];
    for (name, op, mode, before, after, axes, reps) in cases {
        let ints = |n: &str, v: &[i64]| pb::TensorProto {
            name: n.into(),
            dims: vec![v.len() as i64],
            data_type: 7,
            int64_data: v.to_vec(),
            ..Default::default()
        };
        let (mut inputs, mut inits) = (vec!["X".to_string()], Vec::new());
        if op == "Tile" {
            inputs.push("R".into());
            inits.push(ints("R", &reps));
        } else {
            let pads: Vec<i64> = match &axes {
                Some(a) => a
                    .iter()
                    .map(|&d| before[(d + 3) as usize % 3])
                    .chain(a.iter().map(|&d| after[(d + 3) as usize % 3]))
                    .collect(),
                None => before.iter().chain(&after).copied().collect(),
            };
            inits.push(ints("P", &pads));
            inits.push(pb::TensorProto {
                name: "V".into(),
                data_type: 1,
                float_data: vec![7.25],
                ..Default::default()
            });
            inputs.extend(["P".to_string(), "V".to_string()]);
            if let Some(a) = &axes {
                inits.push(ints("A", a));
                inputs.push("A".into());
            }
        }
        let (out_shape, want) = if op == "Tile" {
            let after: Vec<i64> = (0..3).map(|d| shape[d] * (reps[d] - 1)).collect();
            pad_reference(&x, &shape, &[0; 3], &after, "wrap", 0.0)
        } else {
            pad_reference(&x, &shape, &before, &after, mode, 7.25)
        };
        let dims: Vec<String> = out_shape.iter().map(|d| d.to_string()).collect();
        let dims: Vec<&str> = dims.iter().map(String::as_str).collect();
        let model = pb::ModelProto {
            ir_version: 9,
            opset_import: vec![pb::OperatorSetIdProto {
                domain: String::new(),
                version: 19,
            }],
            graph: Some(pb::GraphProto {
                name: name.into(),
                node: vec![pb::NodeProto {
                    op_type: op.into(),
                    name: name.into(),
                    input: inputs,
                    output: vec!["Y".into()],
                    attribute: if op == "Pad" {
                        vec![pb::AttributeProto {
                            name: "mode".into(),
                            s: mode.as_bytes().to_vec(),
                            r#type: 3,
                            ..Default::default()
                        }]
                    } else {
                        vec![]
                    },
                    ..Default::default()
                }],
                initializer: inits,
                input: vec![value_info("X", &["2", "3", "4"])],
                output: vec![value_info("Y", &dims)],
                ..Default::default()
            }),
            ..Default::default()
        };
        let mdir = dir.join(name);
        std::fs::create_dir_all(mdir.join("1")).unwrap();
        std::fs::write(
            mdir.join("1/model.onnx"),
            prost::Message::encode_to_vec(&model),
        )
        .unwrap();
        let odims = out_shape
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(", ");
        let c = cs(&format!(
            r#"name: "{name}" platform: "onnxruntime_onnx" max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 2, 3, 4 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ {odims} ] }} ]
instance_group [ {{ kind: KIND_GPU }} ]"#
        ));
        ok(unsafe {
            infer_server_load_model(
                gpu.0,
                cs(name).as_ptr(),
                c.as_ptr(),
                cs(mdir.to_str().unwrap()).as_ptr(),
            )
        });
        let got = gpu
            .infer(gpu.request(name).input_f32("X", &shape, &x))
            .output_f32("Y");
        assert_eq!(got, want, "{name}");
    }
    println!("Pad (constant, reflect, edge, wrap, cropping, axes) and Tile match the reference");
}

/// ConvTranspose (strides, pads, output_padding, dilations, groups, bias, 1-D) on the
/// GPU against the CPU (tract), at batch 1 and 3.
fn conv_transpose_on_the_stand_in(cpu: &Server, gpu: &Server) {
    let dir = temp_dir("gpu-convt");
    // (name, x dims without batch, w dims, strides, pads, output_padding, dilations, group, bias)
    type Case<'a> = (
        &'a str,
        Vec<i64>,
        Vec<i64>,
        Vec<i64>,
        Vec<i64>,
        Vec<i64>,
        Vec<i64>,
        i64,
        bool,
    );
    let cases: Vec<Case> = vec![
        (
            "convt_basic",
            vec![2, 5, 4],
            vec![2, 3, 3, 3],
            vec![1, 1],
            vec![0, 0, 0, 0],
            vec![0, 0],
            vec![1, 1],
            1,
            false,
        ),
        (
            "convt_stride",
            vec![3, 4, 5],
            vec![3, 2, 3, 2],
            vec![2, 3],
            vec![1, 0, 1, 1],
            vec![1, 2],
            vec![1, 1],
            1,
            true,
        ),
        (
            "convt_dilated",
            vec![2, 4, 4],
            vec![2, 2, 2, 3],
            vec![2, 1],
            vec![0, 1, 0, 0],
            vec![0, 0],
            vec![2, 2],
            1,
            true,
        ),
        (
            "convt_groups",
            vec![4, 3, 3],
            vec![4, 3, 3, 3],
            vec![2, 2],
            vec![1, 1, 1, 1],
            vec![1, 1],
            vec![1, 1],
            2,
            true,
        ),
        (
            "convt_1d",
            vec![3, 7],
            vec![3, 2, 4],
            vec![3],
            vec![1, 2],
            vec![2],
            vec![1],
            1,
            true,
        ),
    ];
    let mut rng = Rand(99);
    for (name, xd, wd, strides, pads, opad, dil, group, bias) in cases {
        let kout = wd[1] * group;
        let ints = |n: &str, v: &[i64]| pb::AttributeProto {
            name: n.into(),
            ints: v.to_vec(),
            r#type: 7,
            ..Default::default()
        };
        let mut inits = vec![pb::TensorProto {
            name: "W".into(),
            dims: wd.clone(),
            data_type: 1,
            float_data: rng.f32s(wd.iter().product::<i64>() as usize),
            ..Default::default()
        }];
        let mut inputs = vec!["X".to_string(), "W".to_string()];
        if bias {
            inits.push(pb::TensorProto {
                name: "B".into(),
                dims: vec![kout],
                data_type: 1,
                float_data: rng.f32s(kout as usize),
                ..Default::default()
            });
            inputs.push("B".into());
        }
        // The output's spatial dims.
        let spatial: Vec<i64> = (0..xd.len() - 1)
            .map(|d| {
                let (n, k) = (xd[1 + d], wd[2 + d]);
                let sp = xd.len() - 1;
                strides[d] * (n - 1) + opad[d] + (k - 1) * dil[d] + 1 - pads[d] - pads[sp + d]
            })
            .collect();
        let mut out_dims = vec![kout];
        out_dims.extend(&spatial);
        let in_dims: Vec<String> = std::iter::once("N".to_string())
            .chain(xd.iter().map(|d| d.to_string()))
            .collect();
        let o_dims: Vec<String> = std::iter::once("N".to_string())
            .chain(out_dims.iter().map(|d| d.to_string()))
            .collect();
        let (in_refs, o_refs): (Vec<&str>, Vec<&str>) = (
            in_dims.iter().map(String::as_str).collect(),
            o_dims.iter().map(String::as_str).collect(),
        );
        let model = pb::ModelProto {
            ir_version: 8,
            opset_import: vec![pb::OperatorSetIdProto {
                domain: String::new(),
                version: 17,
            }],
            graph: Some(pb::GraphProto {
                name: name.into(),
                node: vec![pb::NodeProto {
                    op_type: "ConvTranspose".into(),
                    name: name.into(),
                    input: inputs,
                    output: vec!["Y".into()],
                    attribute: vec![
                        ints("strides", &strides),
                        ints("pads", &pads),
                        ints("output_padding", &opad),
                        ints("dilations", &dil),
                        ints("kernel_shape", &wd[2..]),
                        pb::AttributeProto {
                            name: "group".into(),
                            i: group,
                            r#type: 2,
                            ..Default::default()
                        },
                    ],
                    ..Default::default()
                }],
                initializer: inits,
                input: vec![value_info_of("X", &in_refs, 1)],
                output: vec![value_info_of("Y", &o_refs, 1)],
                ..Default::default()
            }),
            ..Default::default()
        };
        let mdir = dir.join(name);
        std::fs::create_dir_all(mdir.join("1")).unwrap();
        std::fs::write(
            mdir.join("1/model.onnx"),
            prost::Message::encode_to_vec(&model),
        )
        .unwrap();
        let join = |v: &[i64]| {
            v.iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        for (s, kind) in [(cpu, "KIND_CPU"), (gpu, "KIND_GPU")] {
            let c = cs(&format!(
                r#"name: "{name}" platform: "onnxruntime_onnx" max_batch_size: 4
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ {} ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ {} ] }} ]
instance_group [ {{ kind: {kind} }} ]"#,
                join(&xd),
                join(&out_dims)
            ));
            ok(unsafe {
                infer_server_load_model(
                    s.0,
                    cs(name).as_ptr(),
                    c.as_ptr(),
                    cs(mdir.to_str().unwrap()).as_ptr(),
                )
            });
        }
        for batch in [1i64, 3] {
            let mut shape = vec![batch];
            shape.extend(&xd);
            let x = rng.f32s(shape.iter().product::<i64>() as usize);
            let want = all_outputs(&cpu.infer(cpu.request(name).input_f32("X", &shape, &x)));
            let got = all_outputs(&gpu.infer(gpu.request(name).input_f32("X", &shape, &x)));
            assert_eq!(got["Y"].0, want["Y"].0, "{name}");
            assert_close(name, "Y", &want["Y"].1, &got["Y"].1, false);
        }
    }
    println!("ConvTranspose (strides, pads, output_padding, dilations, groups, bias, 1-D) matches the CPU");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Resize, nearest and linear, over the coordinate transformations the executor maps
/// (half_pixel, pytorch_half_pixel, align_corners, asymmetric), from scales or sizes,
/// up and down, on the GPU against the CPU (tract). Scales are ones the output size
/// gives back exactly (tract's coordinates follow output / input where ONNX takes the
/// given scale; the executor follows ONNX).
fn resize_on_the_stand_in(cpu: &Server, gpu: &Server) {
    let dir = temp_dir("gpu-resize");
    // (name, mode, coordinate mode, nearest mode, scales, sizes)
    type Case<'a> = (
        &'a str,
        &'a str,
        &'a str,
        &'a str,
        Option<Vec<f32>>,
        Option<Vec<i64>>,
    );
    let cases: Vec<Case> = vec![
        (
            "rs_nearest_up",
            "nearest",
            "asymmetric",
            "floor",
            Some(vec![1.0, 1.0, 2.0, 3.0]),
            None,
        ),
        (
            "rs_nearest_half",
            "nearest",
            "half_pixel",
            "round_prefer_floor",
            Some(vec![1.0, 1.0, 2.0, 0.5]),
            None,
        ),
        (
            "rs_nearest_ceil",
            "nearest",
            "align_corners",
            "round_prefer_ceil",
            None,
            Some(vec![2, 3, 7, 3]),
        ),
        (
            "rs_linear_up",
            "linear",
            "half_pixel",
            "",
            Some(vec![1.0, 1.0, 2.0, 2.0]),
            None,
        ),
        (
            "rs_linear_down",
            "linear",
            "align_corners",
            "",
            None,
            Some(vec![2, 3, 3, 2]),
        ),
        (
            "rs_linear_torch",
            "linear",
            "pytorch_half_pixel",
            "",
            None,
            Some(vec![2, 3, 1, 9]),
        ),
        (
            "rs_linear_asym",
            "linear",
            "asymmetric",
            "",
            Some(vec![1.0, 1.0, 0.6, 1.75]),
            None,
        ),
    ];
    let shape = [2i64, 3, 5, 4];
    let x = Rand(17).f32s(120);
    for (name, mode, ctm, nearest, scales, sizes) in cases {
        let out: Vec<i64> = match (&scales, &sizes) {
            (Some(s), _) => (0..4)
                .map(|d| (shape[d] as f32 * s[d]).floor() as i64)
                .collect(),
            (_, Some(z)) => z.clone(),
            _ => unreachable!(),
        };
        let mut inits = vec![pb::TensorProto {
            name: "roi".into(),
            dims: vec![0],
            data_type: 1,
            ..Default::default()
        }];
        let mut inputs = vec!["X".to_string(), "roi".to_string()];
        match (&scales, &sizes) {
            (Some(s), _) => {
                inits.push(pb::TensorProto {
                    name: "scales".into(),
                    dims: vec![4],
                    data_type: 1,
                    float_data: s.clone(),
                    ..Default::default()
                });
                inputs.push("scales".into());
            }
            (_, Some(z)) => {
                inits.push(pb::TensorProto {
                    name: "sizes".into(),
                    dims: vec![4],
                    data_type: 7,
                    int64_data: z.clone(),
                    ..Default::default()
                });
                inputs.extend(["".to_string(), "sizes".to_string()]);
            }
            _ => unreachable!(),
        }
        let attr_s = |n: &str, v: &str| pb::AttributeProto {
            name: n.into(),
            s: v.as_bytes().to_vec(),
            r#type: 3,
            ..Default::default()
        };
        let mut attrs = vec![
            attr_s("mode", mode),
            attr_s("coordinate_transformation_mode", ctm),
        ];
        if !nearest.is_empty() {
            attrs.push(attr_s("nearest_mode", nearest));
        }
        let dims: Vec<String> = out.iter().map(|d| d.to_string()).collect();
        let dims: Vec<&str> = dims.iter().map(String::as_str).collect();
        let model = pb::ModelProto {
            ir_version: 8,
            opset_import: vec![pb::OperatorSetIdProto {
                domain: String::new(),
                version: 13,
            }],
            graph: Some(pb::GraphProto {
                name: name.into(),
                node: vec![pb::NodeProto {
                    op_type: "Resize".into(),
                    name: name.into(),
                    input: inputs,
                    output: vec!["Y".into()],
                    attribute: attrs,
                    ..Default::default()
                }],
                initializer: inits,
                input: vec![value_info("X", &["2", "3", "5", "4"])],
                output: vec![value_info("Y", &dims)],
                ..Default::default()
            }),
            ..Default::default()
        };
        let mdir = dir.join(name);
        std::fs::create_dir_all(mdir.join("1")).unwrap();
        std::fs::write(
            mdir.join("1/model.onnx"),
            prost::Message::encode_to_vec(&model),
        )
        .unwrap();
        let odims = out
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(", ");
        for (s, kind) in [(cpu, "KIND_CPU"), (gpu, "KIND_GPU")] {
            let c = cs(&format!(
                r#"name: "{name}" platform: "onnxruntime_onnx" max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 2, 3, 5, 4 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ {odims} ] }} ]
instance_group [ {{ kind: {kind} }} ]"#
            ));
            ok(unsafe {
                infer_server_load_model(
                    s.0,
                    cs(name).as_ptr(),
                    c.as_ptr(),
                    cs(mdir.to_str().unwrap()).as_ptr(),
                )
            });
        }
        let want = all_outputs(&cpu.infer(cpu.request(name).input_f32("X", &shape, &x)));
        let got = all_outputs(&gpu.infer(gpu.request(name).input_f32("X", &shape, &x)));
        assert_eq!(got["Y"].0, want["Y"].0, "{name}");
        assert_close(name, "Y", &want["Y"].1, &got["Y"].1, false);
    }
    println!("Resize (nearest and linear; half_pixel, pytorch_half_pixel, align_corners, asymmetric; scales and sizes) matches the CPU");
}

/// TopK, CumSum and ScatterElements with a reduction on lines long enough to be shared by
/// a block's threads ([4, 300, 3] along the middle axis): the cooperative TopK and scan
/// and the line-parallel scatter give the CPU's results, on a model as a user writes it.
/// Indices repeat (the scatter adds and takes maxima of several updates per element).
fn topk_cumsum_and_scatter_on_the_stand_in(cpu: &Server, gpu: &Server) {
    let dir = temp_dir("gpu-topk-scan-scatter");
    let node =
        |op: &str, ins: &[&str], outs: &[&str], attrs: Vec<pb::AttributeProto>| pb::NodeProto {
            op_type: op.into(),
            name: outs[0].into(),
            input: ins.iter().map(|s| s.to_string()).collect(),
            output: outs.iter().map(|s| s.to_string()).collect(),
            attribute: attrs,
            ..Default::default()
        };
    let int = |name: &str, v: i64| pb::AttributeProto {
        name: name.into(),
        i: v,
        r#type: 2,
        ..Default::default()
    };
    let text = |name: &str, v: &str| pb::AttributeProto {
        name: name.into(),
        s: v.as_bytes().to_vec(),
        r#type: 3,
        ..Default::default()
    };
    let i64s = |name: &str, v: &[i64]| pb::TensorProto {
        name: name.into(),
        dims: vec![v.len() as i64],
        data_type: 7,
        int64_data: v.to_vec(),
        ..Default::default()
    };
    let model = pb::ModelProto {
        ir_version: 8,
        opset_import: vec![pb::OperatorSetIdProto {
            domain: String::new(),
            version: 18,
        }],
        graph: Some(pb::GraphProto {
            name: "tss".into(),
            node: vec![
                node("TopK", &["X", "K"], &["V", "I"], vec![int("axis", 1)]),
                node(
                    "TopK",
                    &["X", "K"],
                    &["VS", "IS"],
                    vec![int("axis", 1), int("largest", 0)],
                ),
                node("CumSum", &["X", "AX"], &["C"], vec![]),
                node(
                    "CumSum",
                    &["X", "AX"],
                    &["CR"],
                    vec![int("exclusive", 1), int("reverse", 1)],
                ),
                node(
                    "ScatterElements",
                    &["X", "IDX", "UPD"],
                    &["SA"],
                    vec![int("axis", 1), text("reduction", "add")],
                ),
                node(
                    "ScatterElements",
                    &["X", "IDX", "UPD"],
                    &["SM"],
                    vec![int("axis", 1), text("reduction", "max")],
                ),
            ],
            initializer: vec![
                i64s("K", &[9]),
                pb::TensorProto {
                    name: "AX".into(),
                    dims: vec![],
                    data_type: 7,
                    int64_data: vec![1],
                    ..Default::default()
                },
            ],
            input: vec![
                value_info("X", &["4", "300", "3"]),
                value_info_of("IDX", &["4", "50", "3"], 7),
                value_info("UPD", &["4", "50", "3"]),
            ],
            output: vec![
                value_info("V", &["4", "9", "3"]),
                value_info_of("I", &["4", "9", "3"], 7),
                value_info("VS", &["4", "9", "3"]),
                value_info_of("IS", &["4", "9", "3"], 7),
                value_info("C", &["4", "300", "3"]),
                value_info("CR", &["4", "300", "3"]),
                value_info("SA", &["4", "300", "3"]),
                value_info("SM", &["4", "300", "3"]),
            ],
            ..Default::default()
        }),
        ..Default::default()
    };
    let mdir = dir.join("tss");
    std::fs::create_dir_all(mdir.join("1")).unwrap();
    std::fs::write(
        mdir.join("1/model.onnx"),
        prost::Message::encode_to_vec(&model),
    )
    .unwrap();
    for (s, kind) in [(cpu, "KIND_CPU"), (gpu, "KIND_GPU")] {
        let c = cs(&format!(
            r#"name: "tss" platform: "onnxruntime_onnx" max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4, 300, 3 ] }},
        {{ name: "IDX" data_type: TYPE_INT64 dims: [ 4, 50, 3 ] }},
        {{ name: "UPD" data_type: TYPE_FP32 dims: [ 4, 50, 3 ] }} ]
output [ {{ name: "V" data_type: TYPE_FP32 dims: [ 4, 9, 3 ] }},
         {{ name: "I" data_type: TYPE_INT64 dims: [ 4, 9, 3 ] }},
         {{ name: "VS" data_type: TYPE_FP32 dims: [ 4, 9, 3 ] }},
         {{ name: "IS" data_type: TYPE_INT64 dims: [ 4, 9, 3 ] }},
         {{ name: "C" data_type: TYPE_FP32 dims: [ 4, 300, 3 ] }},
         {{ name: "CR" data_type: TYPE_FP32 dims: [ 4, 300, 3 ] }},
         {{ name: "SA" data_type: TYPE_FP32 dims: [ 4, 300, 3 ] }},
         {{ name: "SM" data_type: TYPE_FP32 dims: [ 4, 300, 3 ] }} ]
instance_group [ {{ kind: {kind} }} ]"#
        ));
        ok(unsafe {
            infer_server_load_model(
                s.0,
                cs("tss").as_ptr(),
                c.as_ptr(),
                cs(mdir.to_str().unwrap()).as_ptr(),
            )
        });
    }
    // Distinct values (7919 is prime to 3600), so the CPU's TopK order has no ties to
    // break; multiples of 1/4, so every partial sum is exact in f32, in any order.
    let x: Vec<f32> = (0..3600)
        .map(|i| ((i * 7919) % 3600) as f32 / 4.0 - 450.0)
        .collect();
    let mut rng = Rand(99);
    // Indices into 300 from 50 rows: many repeat within a line; some negative.
    let idx: Vec<i64> = (0..600).map(|_| (rng.next() % 40) as i64 - 10).collect();
    let upd = rng.f32s(600);
    let request = |s: &Server| {
        s.request("tss")
            .input_f32("X", &[4, 300, 3], &x)
            .input_i64("IDX", &[4, 50, 3], &idx)
            .input_f32("UPD", &[4, 50, 3], &upd)
    };
    let want = all_outputs(&cpu.infer(request(cpu)));
    let got = all_outputs(&gpu.infer(request(gpu)));
    for name in ["V", "I", "VS", "IS", "C", "CR", "SA", "SM"] {
        assert_eq!(got[name].0, want[name].0, "tss.{name}");
        assert_close(
            "tss",
            name,
            &want[name].1,
            &got[name].1,
            name.starts_with('I'),
        );
    }
    println!("TopK, CumSum and ScatterElements (add, max) on lines of 300 match the CPU");
}

/// Value inputs: graph inputs the planner reads (a Reshape's shape, a Slice's starts, a
/// Resize's scales) arrive with each request, from host or device memory; each distinct
/// value gets its own plan, and the results equal the CPU's. A bad value fails only its
/// request, naming the node.
fn value_inputs_on_the_stand_in(d: &Driver, cpu: &Server, gpu: &Server) {
    let dir = temp_dir("gpu-value-inputs");
    let i64s = |name: &str, v: &[i64]| pb::TensorProto {
        name: name.into(),
        dims: vec![v.len() as i64],
        data_type: 7,
        int64_data: v.to_vec(),
        ..Default::default()
    };
    let node = |op: &str, ins: &[&str], out: &str| pb::NodeProto {
        op_type: op.into(),
        name: out.into(),
        input: ins.iter().map(|s| s.to_string()).collect(),
        output: vec![out.into()],
        ..Default::default()
    };
    let mut resize = node("Resize", &["S", "", "scales"], "Y");
    resize.attribute.push(pb::AttributeProto {
        name: "mode".into(),
        s: b"linear".to_vec(),
        r#type: 3,
        ..Default::default()
    });
    let model = pb::ModelProto {
        ir_version: 8,
        opset_import: vec![pb::OperatorSetIdProto {
            domain: String::new(),
            version: 13,
        }],
        graph: Some(pb::GraphProto {
            name: "value_inputs".into(),
            node: vec![
                // The shape goes through a host computation first (Cast to INT64).
                pb::NodeProto {
                    attribute: vec![pb::AttributeProto {
                        name: "to".into(),
                        i: 7,
                        r#type: 2,
                        ..Default::default()
                    }],
                    ..node("Cast", &["shape"], "shape64")
                },
                node("Reshape", &["X", "shape64"], "R"),
                node("Slice", &["R", "starts", "ends", "axes"], "S"),
                resize,
            ],
            initializer: vec![i64s("ends", &[1 << 40]), i64s("axes", &[1])],
            input: vec![
                value_info("X", &["2", "3", "4"]),
                value_info_of("shape", &["3"], 6),
                value_info_of("starts", &["1"], 7),
                value_info("scales", &["3"]),
            ],
            output: vec![value_info("Y", &["a", "b", "c"])],
            ..Default::default()
        }),
        ..Default::default()
    };
    let mdir = dir.join("value_inputs");
    std::fs::create_dir_all(mdir.join("1")).unwrap();
    std::fs::write(
        mdir.join("1/model.onnx"),
        prost::Message::encode_to_vec(&model),
    )
    .unwrap();
    let c = cs(
        r#"name: "value_inputs" platform: "onnxruntime_onnx" max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 2, 3, 4 ] },
        { name: "shape" data_type: TYPE_INT32 dims: [ 3 ] },
        { name: "starts" data_type: TYPE_INT64 dims: [ 1 ] },
        { name: "scales" data_type: TYPE_FP32 dims: [ 3 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1, -1, -1 ] } ]
instance_group [ { kind: KIND_GPU } ]"#,
    );
    ok(unsafe {
        infer_server_load_model(
            gpu.0,
            cs("value_inputs").as_ptr(),
            c.as_ptr(),
            cs(mdir.to_str().unwrap()).as_ptr(),
        )
    });
    let x = Rand(23).f32s(24);
    // The reference: the same graph on the CPU with the values as constants (the CPU
    // backend wants shapes it can analyse at load).
    let reference = |k: usize, shape: &[i32], starts: i64, scales: &[f32]| -> Resp {
        let name = format!("value_inputs_ref{k}");
        let mut m = model.clone();
        let g = m.graph.as_mut().unwrap();
        g.input.truncate(1);
        g.initializer.extend([
            pb::TensorProto {
                name: "shape".into(),
                dims: vec![3],
                data_type: 6,
                int32_data: shape.to_vec(),
                ..Default::default()
            },
            i64s("starts", &[starts]),
            pb::TensorProto {
                name: "scales".into(),
                dims: vec![3],
                data_type: 1,
                float_data: scales.to_vec(),
                ..Default::default()
            },
        ]);
        let rdir = dir.join(&name);
        std::fs::create_dir_all(rdir.join("1")).unwrap();
        std::fs::write(rdir.join("1/model.onnx"), prost::Message::encode_to_vec(&m)).unwrap();
        let c = cs(&format!(
            r#"name: "{name}" platform: "onnxruntime_onnx" max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 2, 3, 4 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1, -1, -1 ] }} ]"#
        ));
        ok(unsafe {
            infer_server_load_model(
                cpu.0,
                cs(&name).as_ptr(),
                c.as_ptr(),
                cs(rdir.to_str().unwrap()).as_ptr(),
            )
        });
        cpu.infer(cpu.request(&name).input_f32("X", &[2, 3, 4], &x))
    };
    let run = |s: &Server, shape: &[i32], starts: i64, scales: &[f32]| {
        s.infer(
            s.request("value_inputs")
                .input_f32("X", &[2, 3, 4], &x)
                .input_i32("shape", &[3], shape)
                .input_i64("starts", &[1], &[starts])
                .input_f32("scales", &[3], scales),
        )
    };
    let cases: [(&[i32], i64, &[f32]); 5] = [
        (&[4, 3, 2], 1, &[1.0, 1.0, 2.0]),
        (&[2, 6, 2], 3, &[1.0, 0.5, 1.5]),
        (&[-1, 4, 3], 0, &[2.0, 1.0, 1.0]),
        (&[0, 12, 1], -5, &[1.0, 2.0, 3.0]),
        (&[4, 3, 2], 1, &[1.0, 1.0, 2.0]),
    ];
    for (k, (shape, starts, scales)) in cases.into_iter().enumerate() {
        let want = all_outputs(&reference(k, shape, starts, scales));
        let got = all_outputs(&run(gpu, shape, starts, scales));
        assert_eq!(got["Y"].0, want["Y"].0, "{shape:?} {starts} {scales:?}");
        assert_close("value_inputs", "Y", &want["Y"].1, &got["Y"].1, false);
    }
    // A shape that does not fit fails its request with the node named, and the next
    // request is served.
    let bad = run(gpu, &[5, 5, 1], 0, &[1.0, 1.0, 1.0]);
    assert_eq!(
        bad.status(),
        INFER_STATUS_INVALID_ARGUMENT,
        "{}",
        bad.error()
    );
    assert!(bad.error().contains("Reshape"), "{}", bad.error());
    assert_eq!(
        run(gpu, &[4, 3, 2], 1, &[1.0, 1.0, 2.0]).status(),
        INFER_STATUS_OK
    );

    // The shape from device memory: read back for planning, same result.
    let shape = [3i32, 4, 2];
    d.bind(0);
    let p = d.upload(&shape.map(|v| f32::from_bits(v as u32)));
    let r = gpu
        .request("value_inputs")
        .input_f32("X", &[2, 3, 4], &x)
        .input_i64("starts", &[1], &[1])
        .input_f32("scales", &[3], &[1.0, 1.0, 1.0]);
    ok(unsafe {
        infer_request_add_input_borrowed(
            r.0,
            cs("shape").as_ptr(),
            INFER_DATATYPE_INT32,
            [3i64].as_ptr(),
            1,
            p as *const c_void,
            12,
            INFER_MEMORY_GPU,
            0,
            None,
            null_mut(),
        )
    });
    let got = all_outputs(&gpu.infer(r));
    let want = all_outputs(&reference(9, &shape, 1, &[1.0, 1.0, 1.0]));
    assert_eq!(got["Y"].0, want["Y"].0);
    assert_close("value_inputs", "Y", &want["Y"].1, &got["Y"].1, false);

    // A value input read through a host computation (the first of many values as the
    // shape): more values than the planner reads are refused by name.
    let big_model = pb::ModelProto {
        graph: Some(pb::GraphProto {
            name: "value_inputs_big".into(),
            node: vec![
                node("Slice", &["big", "zero", "one"], "m64"),
                node("Reshape", &["X", "m64"], "Y"),
            ],
            initializer: vec![i64s("zero", &[0]), i64s("one", &[1])],
            input: vec![
                value_info("X", &["2", "3", "4"]),
                value_info_of("big", &["n"], 7),
            ],
            output: vec![value_info("Y", &["a"])],
            ..Default::default()
        }),
        ..model.clone()
    };
    let bdir = dir.join("value_inputs_big");
    std::fs::create_dir_all(bdir.join("1")).unwrap();
    std::fs::write(
        bdir.join("1/model.onnx"),
        prost::Message::encode_to_vec(&big_model),
    )
    .unwrap();
    let c = cs(
        r#"name: "value_inputs_big" platform: "onnxruntime_onnx" max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 2, 3, 4 ] },
        { name: "big" data_type: TYPE_INT64 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { kind: KIND_GPU } ]"#,
    );
    ok(unsafe {
        infer_server_load_model(
            gpu.0,
            cs("value_inputs_big").as_ptr(),
            c.as_ptr(),
            cs(bdir.to_str().unwrap()).as_ptr(),
        )
    });
    let big = |n: usize| {
        let mut v = vec![1i64; n];
        v[0] = 24;
        gpu.infer(
            gpu.request("value_inputs_big")
                .input_f32("X", &[2, 3, 4], &x)
                .input_i64("big", &[n as i64], &v),
        )
    };
    let small = big(100);
    assert_eq!(small.status(), INFER_STATUS_OK, "{}", small.error());
    assert_eq!(all_outputs(&small)["Y"].0, vec![24]);
    let r = big(5000);
    assert_eq!(r.status(), INFER_STATUS_UNSUPPORTED, "{}", r.error());
    assert!(
        r.error().contains("'big'") && r.error().contains("4096"),
        "{}",
        r.error()
    );
    // A shape from the request too large for any device: the request fails with
    // RESOURCE_EXHAUSTED naming the node, and the next one is served.
    let expand_model = pb::ModelProto {
        graph: Some(pb::GraphProto {
            name: "value_inputs_expand".into(),
            node: vec![node("Expand", &["X", "to"], "Y")],
            input: vec![value_info("X", &["1"]), value_info_of("to", &["2"], 7)],
            output: vec![value_info("Y", &["a", "b"])],
            ..Default::default()
        }),
        ..model.clone()
    };
    let edir = dir.join("value_inputs_expand");
    std::fs::create_dir_all(edir.join("1")).unwrap();
    std::fs::write(
        edir.join("1/model.onnx"),
        prost::Message::encode_to_vec(&expand_model),
    )
    .unwrap();
    let c = cs(
        r#"name: "value_inputs_expand" platform: "onnxruntime_onnx" max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] },
        { name: "to" data_type: TYPE_INT64 dims: [ 2 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1, -1 ] } ]
instance_group [ { kind: KIND_GPU } ]"#,
    );
    ok(unsafe {
        infer_server_load_model(
            gpu.0,
            cs("value_inputs_expand").as_ptr(),
            c.as_ptr(),
            cs(edir.to_str().unwrap()).as_ptr(),
        )
    });
    let expand = |to: [i64; 2]| {
        gpu.infer(
            gpu.request("value_inputs_expand")
                .input_f32("X", &[1], &[2.5])
                .input_i64("to", &[2], &to),
        )
    };
    let huge = expand([1 << 40, 1 << 30]);
    assert_eq!(
        huge.status(),
        INFER_STATUS_RESOURCE_EXHAUSTED,
        "{}",
        huge.error()
    );
    assert!(huge.error().contains("Expand"), "{}", huge.error());
    let fine = expand([2, 3]);
    assert_eq!(fine.status(), INFER_STATUS_OK, "{}", fine.error());
    assert_eq!(fine.output_f32("Y"), vec![2.5; 6]);
    println!("value inputs (Reshape shape, Slice starts, Resize scales; host and device memory) match the CPU; a shape too large is refused");
}

static GPU_LOG: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

unsafe extern "C" fn gpu_log_line(_: *mut c_void, _level: u32, msg: *const std::ffi::c_char) {
    let msg = unsafe { std::ffi::CStr::from_ptr(msg) }
        .to_string_lossy()
        .into_owned();
    GPU_LOG.lock().unwrap().push(msg);
}

fn onnx_on_the_stand_in() {
    let d = driver();
    let cpu = server_in(INFER_GPU_OFF).unwrap_or_else(|(st, m)| panic!("{st} {m}"));
    let gpu = {
        let mut opts = null_mut();
        ok(unsafe { infer_server_options_new(&mut opts) });
        ok(unsafe { infer_server_options_set_gpu(opts, INFER_GPU_REQUIRED) });
        ok(unsafe {
            infer_server_options_set_log_callback(
                opts,
                INFER_LOG_INFO,
                Some(gpu_log_line),
                null_mut(),
            )
        });
        let s = Server::with_options(opts);
        unsafe { infer_server_options_free(opts) };
        s
    };
    let models = ["add_sub", "mlp", "cnn", "preprocess", "postprocess"];
    for m in models {
        load_from_models(&cpu, m, None);
        load_from_models(&gpu, m, Some(&gpu_config_of(m)));
    }
    // The log names the CUDA files in use, once: the driver, NVRTC and cuBLAS.
    let said: Vec<String> = GPU_LOG
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.starts_with("CUDA libraries in use: "))
        .cloned()
        .collect();
    assert_eq!(said.len(), 1, "{said:?}");
    for lib in ["/libcuda.so", "/libnvrtc.so", "/libcublas.so"] {
        assert!(said[0].contains(lib), "{lib} not in {said:?}");
    }
    println!("{}", said[0]);
    // The ensemble over the GPU models.
    load_from_models(&cpu, "image_classifier", None);
    load_from_models(&gpu, "image_classifier", None);
    let mut rng = Rand(0x9e3779b97f4a7c15);
    for m in models.iter().chain(&["image_classifier"]) {
        for batch in [1i64, 3, 4] {
            let seed = rng.next();
            let resp_cpu = cpu.infer(random_request(&cpu, m, batch, &mut Rand(seed)));
            let resp_gpu = gpu.infer(random_request(&gpu, m, batch, &mut Rand(seed)));
            let (want, got) = (all_outputs(&resp_cpu), all_outputs(&resp_gpu));
            assert_eq!(
                want.keys().collect::<Vec<_>>(),
                got.keys().collect::<Vec<_>>()
            );
            for (name, (shape, bytes)) in &want {
                let (gshape, gbytes) = &got[name];
                assert_eq!(shape, gshape, "{m}.{name}");
                assert_close(m, name, bytes, gbytes, name == "LABEL");
            }
        }
        println!("{m}: GPU matches CPU at batch 1, 3, 4");
    }
    let c = d.counters();
    if !d.real() {
        assert!(c.kernel_launches > 0, "{c:?}");
        assert_eq!(c.pageable_async_copies, 0, "{c:?}");
        assert_eq!(c.invalid_calls, 0, "{c:?}");
    }

    reduced_precision_on_the_stand_in(&cpu, &gpu);
    native_16_bit_models_on_the_stand_in(&gpu);
    fused_element_wise_chains_on_the_stand_in(&cpu, &gpu);
    constants_shared_on_a_device(&gpu);
    transformer_encoder_on_the_stand_in(&cpu, &gpu);
    pad_and_tile_on_the_stand_in(&gpu);
    conv_transpose_on_the_stand_in(&cpu, &gpu);
    resize_on_the_stand_in(&cpu, &gpu);
    topk_cumsum_and_scatter_on_the_stand_in(&cpu, &gpu);
    value_inputs_on_the_stand_in(d, &cpu, &gpu);

    // Implicit state on the GPU: running sums of interleaved sequences. Then with the
    // state output listed as a model output too and every response asking for device
    // memory: the state still comes back to the sequence batcher.
    let listed = gpu_config_of("accumulator_onnx").replace(
        r#"{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] }"#,
        r#"{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] },
           { name: "OUTPUT_STATE" data_type: TYPE_FP32 dims: [ 1 ] }"#,
    );
    assert!(listed.contains("\"OUTPUT_STATE\" data_type"));
    for (config, on_gpu) in [(gpu_config_of("accumulator_onnx"), false), (listed, true)] {
        load_from_models(&gpu, "accumulator_onnx", Some(&config));
        let mut sums = [0f32; 2];
        for step in 0..5 {
            for (seq, sum) in sums.iter_mut().enumerate() {
                let v = (step * 2 + seq) as f32 + 0.5;
                let mut r = gpu
                    .request("accumulator_onnx")
                    .input_f32("INPUT", &[1, 1], &[v]);
                if on_gpu {
                    r = ask_gpu(r, 0);
                }
                let mut flags = 0;
                if step == 0 {
                    flags |= INFER_REQUEST_FLAG_SEQUENCE_START;
                }
                if step == 4 {
                    flags |= INFER_REQUEST_FLAG_SEQUENCE_END;
                }
                unsafe {
                    ok(infer_request_set_correlation_id(r.0, 100 + seq as u64));
                    ok(infer_request_set_flags(r.0, flags));
                }
                *sum += v;
                let resp = gpu.infer(r);
                assert_eq!(resp.status(), INFER_STATUS_OK, "{}", resp.error());
                let mut names = vec!["OUTPUT"];
                if on_gpu {
                    names.push("OUTPUT_STATE");
                }
                for name in names {
                    let (mem, _, got) = read_output(&resp, name);
                    // Host outputs read where the GPU instance copied them down.
                    let want_mem = if on_gpu {
                        INFER_MEMORY_GPU
                    } else {
                        INFER_MEMORY_CPU_PINNED
                    };
                    assert_eq!(mem, want_mem, "{name}");
                    assert_eq!(got, vec![*sum], "{name}: sequence {seq} step {step}");
                }
            }
        }
    }
    println!("accumulator_onnx: implicit state on the GPU matches the running sums");

    // KIND_AUTO: on the GPU when the executor runs the model, else on the CPU (logged);
    // KIND_GPU refuses what the executor cannot run, naming the operator.
    let auto = gpu_config_of("mlp").replace("KIND_GPU", "KIND_AUTO");
    load_from_models(&gpu, "mlp", Some(&auto));
    let before = d.counters().kernel_launches;
    let resp = gpu.infer(random_request(&gpu, "mlp", 2, &mut rng));
    assert_eq!(resp.status(), INFER_STATUS_OK, "{}", resp.error());
    assert!(
        d.real() || d.counters().kernel_launches > before,
        "KIND_AUTO mlp did not run on the GPU"
    );
    let placed = gpu.stats("mlp");
    assert!(
        placed["models"][0].get("gpu").is_some(),
        "KIND_AUTO mlp is not on the GPU: {placed}"
    );
    // NonZero: its output's shape depends on the values, which a plan made per input
    // shape cannot have.
    let nonzero = pb::ModelProto {
        ir_version: 8,
        opset_import: vec![pb::OperatorSetIdProto {
            domain: String::new(),
            version: 17,
        }],
        graph: Some(pb::GraphProto {
            name: "g".into(),
            node: vec![pb::NodeProto {
                op_type: "NonZero".into(),
                name: "nonzero".into(),
                input: vec!["X".into()],
                output: vec!["Y".into()],
                ..Default::default()
            }],
            input: vec![value_info("X", &["4"])],
            output: vec![value_info_of("Y", &["1", "n"], 7)],
            ..Default::default()
        }),
        ..Default::default()
    };
    let dir = temp_dir("gpu-nonzero");
    std::fs::create_dir_all(dir.join("1")).unwrap();
    std::fs::write(
        dir.join("1/model.onnx"),
        prost::Message::encode_to_vec(&nonzero),
    )
    .unwrap();
    let cfg = |kind: &str| {
        format!(
            r#"name: "nonzero" platform: "onnxruntime_onnx" max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "Y" data_type: TYPE_INT64 dims: [ 1, -1 ] }} ]
instance_group [ {{ kind: {kind} }} ]"#
        )
    };
    let load = |kind: &str| unsafe {
        infer_server_load_model(
            gpu.0,
            c"nonzero".as_ptr(),
            cs(&cfg(kind)).as_ptr(),
            cs(dir.to_str().unwrap()).as_ptr(),
        )
    };
    expect_msg(
        load("KIND_GPU"),
        INFER_STATUS_UNSUPPORTED,
        &[
            "'nonzero'",
            "operator NonZero is not supported by the GPU executor",
        ],
    );
    ok(load("KIND_AUTO"));
    let before = d.counters().kernel_launches;
    let resp = gpu.infer(
        gpu.request("nonzero")
            .input_f32("X", &[4], &[0.0, 1.0, -1.0, 0.5]),
    );
    assert_eq!(resp.status(), INFER_STATUS_OK, "{}", resp.error());
    assert_eq!(resp.output_i64("Y"), vec![1, 2, 3]);
    assert_eq!(
        d.counters().kernel_launches,
        before,
        "NonZero ran on the GPU"
    );
    let placed = gpu.stats("nonzero");
    assert!(
        placed["models"][0].get("gpu").is_none(),
        "KIND_AUTO nonzero is on the GPU: {placed}"
    );
    println!("KIND_AUTO: mlp on the GPU, a model with NonZero on the CPU");

    // CUDA graphs for batches of up to 4 rows: captured on a plan's second run, then
    // replayed with the inputs copied into the graph's slots.
    let graphs = gpu_config_of("mlp").replace(
        "instance_group",
        "parameters { key: \"cuda_graph_max_batch\" value: { string_value: \"4\" } }\ninstance_group",
    );
    load_from_models(&gpu, "mlp", Some(&graphs));
    let before = d.counters();
    for batch in [1i64, 1, 1, 3, 3, 3, 8, 8] {
        let seed = rng.next();
        let want = all_outputs(&cpu.infer(random_request(&cpu, "mlp", batch, &mut Rand(seed))));
        let got = all_outputs(&gpu.infer(random_request(&gpu, "mlp", batch, &mut Rand(seed))));
        for (name, (_, bytes)) in &want {
            assert_close("mlp (CUDA graphs)", name, bytes, &got[name].1, false);
        }
    }
    let after = d.counters();
    // Batch 1 and batch 3: captured on the second run, replayed on the third; batch 8
    // never (above the limit).
    if !d.real() {
        assert_eq!(after.graph_launches - before.graph_launches, 4, "{after:?}");
    }
    println!("CUDA graphs: mlp matches CPU with graphs at batch 1 and 3");

    // Triton's `optimization { cuda { graphs: true graph_spec [...] } }` does the same,
    // up to the largest graph_spec batch size.
    let triton = gpu_config_of("mlp").replace(
        "instance_group",
        "optimization { cuda { graphs: true graph_spec [ { batch_size: 2 } ] } }\ninstance_group",
    );
    load_from_models(&gpu, "mlp", Some(&triton));
    let before = d.counters();
    for batch in [2i64, 2, 2, 2, 3, 3, 3] {
        let seed = rng.next();
        let want = all_outputs(&cpu.infer(random_request(&cpu, "mlp", batch, &mut Rand(seed))));
        let got = all_outputs(&gpu.infer(random_request(&gpu, "mlp", batch, &mut Rand(seed))));
        for (name, (_, bytes)) in &want {
            assert_close("mlp (graphs: true)", name, bytes, &got[name].1, false);
        }
    }
    let after = d.counters();
    // Batch 2: captured on the second run, replayed on the third and fourth; 3 never.
    if !d.real() {
        assert_eq!(after.graph_launches - before.graph_launches, 3, "{after:?}");
    }
    println!("CUDA graphs: optimization {{ cuda {{ graphs: true }} }} for batches up to 2");
}

fn value_info(name: &str, dims: &[&str]) -> pb::ValueInfoProto {
    value_info_of(name, dims, 1)
}

fn value_info_of(name: &str, dims: &[&str], elem_type: i32) -> pb::ValueInfoProto {
    use pb::tensor_shape_proto::dimension::Value as DimValue;
    pb::ValueInfoProto {
        name: name.to_owned(),
        r#type: Some(pb::TypeProto {
            value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                elem_type,
                shape: Some(pb::TensorShapeProto {
                    dim: dims
                        .iter()
                        .map(|d| pb::tensor_shape_proto::Dimension {
                            // A number, else a symbolic dim of that name.
                            value: Some(match d.parse::<i64>() {
                                Ok(v) => DimValue::DimValue(v),
                                Err(_) => DimValue::DimParam(d.to_string()),
                            }),
                            ..Default::default()
                        })
                        .collect(),
                }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

// ---- the kernels through the real NVRTC (no GPU needed) ----

/// Compiles src/onnx/gpu/kernels.cu with the real NVRTC for the architectures the
/// library serves (`INFER_NVRTC_ARCHS`, e.g. "75,80,86,89,90", for an NVRTC that knows
/// fewer), in a child process whose loader path is `INFER_NVRTC_LIB_DIR`
/// (scripts/test.sh installs NVRTC 13 and NVRTC 12 from PyPI and runs this with each).
/// Without it: SKIP.
#[test]
fn kernels_compile_with_nvrtc() {
    if std::env::var_os("INFER_FAKE_CUDA").is_some()
        || std::env::var_os("INFER_NVRTC_CHILD").is_some()
    {
        return;
    }
    let Some(dir) = std::env::var_os("INFER_NVRTC_LIB_DIR") else {
        println!(
            "SKIP: INFER_NVRTC_LIB_DIR is not set (scripts/test.sh installs NVRTC and sets it)"
        );
        return;
    };
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut child = std::process::Command::new(exe);
    child
        .args(["--exact", "nvrtc_child", "--nocapture"])
        .env("LD_LIBRARY_PATH", &dir)
        .env("INFER_NVRTC_CHILD", "1");
    // An older NVRTC knows fewer architectures (NVRTC 12.2: up to sm_90).
    if let Some(archs) = std::env::var_os("INFER_NVRTC_ARCHS") {
        child.env("INFER_NVRTC_ARCHS", archs);
    }
    let out = child.output().expect("running the test binary again");
    let all =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && all.contains("kernels compiled"),
        "{all}"
    );
    for line in all
        .lines()
        .filter(|l| l.starts_with("sm_") || l.starts_with("kernels compiled"))
    {
        println!("{line}");
    }
}

/// The child of `kernels_compile_with_nvrtc`.
#[test]
fn nvrtc_child() {
    if std::env::var_os("INFER_NVRTC_CHILD").is_none() {
        return;
    }
    let archs = std::env::var("INFER_NVRTC_ARCHS").unwrap_or("75,80,86,89,90,100,120".into());
    let archs: Vec<(i32, i32)> = archs
        .split(',')
        .map(|a| {
            let n: i32 = a
                .trim()
                .parse()
                .expect("INFER_NVRTC_ARCHS: numbers such as 90");
            (n / 10, n % 10)
        })
        .collect();
    for cc in archs {
        let t = std::time::Instant::now();
        let cubin = infer::onnx::gpu::kernels::compile(cc)
            .unwrap_or_else(|e| panic!("sm_{}{}: {}", cc.0, cc.1, e.message));
        assert!(
            cubin.starts_with(b"\x7fELF"),
            "sm_{}{}: not an ELF CUBIN",
            cc.0,
            cc.1
        );
        println!(
            "sm_{}{}: CUBIN of {} bytes in {:.2} s",
            cc.0,
            cc.1,
            cubin.len(),
            t.elapsed().as_secs_f64()
        );
    }
    println!("kernels compiled with {}", infer::cuda::libs::describe());
}
