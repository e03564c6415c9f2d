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
    register_copy_backend(&s);
    expect_msg(
        s.try_load(
            "c",
            &copy_config("c", "instance_group [ { kind: KIND_GPU } ]"),
        ),
        INFER_STATUS_UNSUPPORTED,
        &["'c'", "not implemented yet"],
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
            expect_msg(
                infer_request_set_output_memory(r.0, INFER_MEMORY_GPU, 0),
                INFER_STATUS_UNSUPPORTED,
                &["not implemented yet"],
            );
        }
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
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/fake_libcuda.c");
    let lib = dir.join("libcuda.so.1");
    if !only_version {
        // The driver with the kernels built for the host, NVRTC and cuBLAS.
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/build_fakes.sh");
        let out = std::process::Command::new("sh")
            .arg(script)
            .arg(dir)
            .output()
            .map_err(|e| format!("sh: {e}"))?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        return Ok(());
    }
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
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = std::process::Command::new(exe)
        .args(["--exact", "fake_driver_child", "--nocapture"])
        .env("LD_LIBRARY_PATH", dir)
        .env("INFER_FAKE_CUDA", scenario)
        .output()
        .expect("running the test binary again");
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "scenario {scenario}: {all}");
    assert!(
        all.contains(&format!("fake driver '{scenario}': checked")),
        "{all}"
    );
    all
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
        "old" => Some("supports CUDA 12.8; this build needs 13.0"),
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
        // A model on the CPU computes in host memory, and says so.
        let resp = s.infer(r);
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
    retain: unsafe extern "C" fn(*mut *mut c_void, i32) -> i32,
    set_current: unsafe extern "C" fn(*mut c_void) -> i32,
    mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> i32,
    mem_free: unsafe extern "C" fn(u64) -> i32,
    htod: unsafe extern "C" fn(u64, *const c_void, usize) -> i32,
    dtoh: unsafe extern "C" fn(*mut c_void, u64, usize) -> i32,
    dtod_async: unsafe extern "C" fn(u64, u64, usize, *mut c_void) -> i32,
    host_func: unsafe extern "C" fn(*mut c_void, HostFn, *mut c_void) -> i32,
    pointer_attr: unsafe extern "C" fn(*mut c_void, i32, u64) -> i32,
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
            retain: t(sym(c"cuDevicePrimaryCtxRetain")),
            set_current: t(sym(c"cuCtxSetCurrent")),
            mem_alloc: t(sym(c"cuMemAlloc_v2")),
            mem_free: t(sym(c"cuMemFree_v2")),
            htod: t(sym(c"cuMemcpyHtoD_v2")),
            dtoh: t(sym(c"cuMemcpyDtoH_v2")),
            dtod_async: t(sym(c"cuMemcpyDtoDAsync_v2")),
            host_func: t(sym(c"cuLaunchHostFunc")),
            pointer_attr: t(sym(c"cuPointerGetAttribute")),
        }
    })
}

impl Driver {
    fn counters(&self) -> FakeCounters {
        let mut c = FakeCounters::default();
        let f = self.counters.expect("the stand-in driver's counters");
        unsafe { f(&mut c) };
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
        if std::slice::from_raw_parts(shape, nd) != [rows, 4] || bytes != rows as usize * 16 {
            return Err(format!("input X: {bytes} bytes"));
        }
        let (mut y, mut xc) = (null_mut(), null_mut());
        ok(infer_batch_output_device(
            b,
            c"Y".as_ptr(),
            [rows, 4].as_ptr(),
            2,
            &mut y,
        ));
        ok(infer_batch_output_device(
            b,
            c"X_COPY".as_ptr(),
            [rows, 4].as_ptr(),
            2,
            &mut xc,
        ));
        if d.place(y as u64) != (2, gpu) {
            return Err("output Y is not on the instance's GPU".into());
        }
        // The same output twice, and BYTES-free checks of the section-10 calls.
        let mut again = null_mut();
        let st = infer_batch_output_device(b, c"Y".as_ptr(), [rows, 4].as_ptr(), 2, &mut again);
        if st != INFER_STATUS_INVALID_ARGUMENT || !last_error().contains("already allocated") {
            return Err(format!("second Y: {st} {}", last_error()));
        }
        assert_eq!((d.dtod_async)(xc as u64, x, bytes, stream), 0);
        let job = Box::new(AffineJob {
            x,
            y: y as u64,
            n: rows as usize * 4,
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
    unsafe {
        let n = infer_response_output_count(resp.0);
        for i in 0..n {
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
            if std::ffi::CStr::from_ptr(oname).to_str() != Ok(name) {
                continue;
            }
            let (mut mem, mut dev) = (99u32, 99i64);
            ok(infer_response_output_memory(resp.0, i, &mut mem, &mut dev));
            let values = if mem == INFER_MEMORY_GPU {
                assert_eq!(driver().place(data as u64), (2, dev as i32));
                driver().bind(dev as i32);
                driver().download(data as u64, bytes / 4)
            } else {
                bytemuck::pod_collect_to_vec(std::slice::from_raw_parts(data as *const u8, bytes))
            };
            return (mem, dev, values);
        }
    }
    panic!("no output {name}: {}", resp.error());
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
            INFER_MEMORY_CPU
        };
        check_affine(&resp, x_of(i), mem);
        batched = true;
    }
    assert!(batched);
    let st = s.stats("g");
    let execs = st["models"][0]["execution_count"].as_u64().unwrap_or(0);
    println!("48 requests in {execs} executions");
    assert!(execs < 48, "no batch had more than one request: {st}");

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
                INFER_MEMORY_CPU
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
        check_affine(&resp, x_of(i), INFER_MEMORY_CPU);
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
    check_affine(&resp, x, INFER_MEMORY_CPU);
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
    check_affine(&resp, x_of(9), INFER_MEMORY_CPU);
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
    check_affine(&resp, x, INFER_MEMORY_CPU);
    drop(resp);
    drop(s);
    assert_eq!(unsafe { (d.mem_free)(p) }, 0);
    let c = d.counters();
    assert_eq!((c.live_device_bytes, c.live_host_bytes), (0, 0), "{c:?}");
    assert_eq!(c.pageable_async_copies, 0, "{c:?}");
}

/// Runs `gpu_data_path_child` under the stand-in driver with `scenario` (the checks of
/// "onnx" run with one device).
fn run_data_path(dir: &std::path::Path, scenario: &str) {
    let exe = std::env::current_exe().expect("the test binary's path");
    let devices = if scenario == "two" { "two" } else { "one" };
    let out = std::process::Command::new(exe)
        .args(["--exact", "gpu_data_path_child", "--nocapture"])
        .env("LD_LIBRARY_PATH", dir)
        .env("INFER_FAKE_CUDA", devices)
        .env("INFER_DATA_PATH_CHECKS", scenario)
        .env("INFER_FAKE_CUDA_DELAY_US", "300")
        .output()
        .expect("running the test binary again");
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "scenario {scenario}: {all}");
    assert!(
        all.contains(&format!("data path '{scenario}': checked")),
        "{all}"
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
            "/src/gpu/kernels/kernels.cu"
        ))
        .output()
        .expect("running the kernels' check");
    let all =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{all}");
    run_data_path(&dir, "one");
    run_data_path(&dir, "two");
    run_data_path(&dir, "onnx");
    let _ = std::fs::remove_dir_all(&dir);
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
// The stand-in driver runs the kernels of src/gpu/kernels/kernels.cu compiled for the
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
    let r = s.request(model);
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
        assert_eq!(mem, INFER_MEMORY_CPU);
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

fn onnx_on_the_stand_in() {
    let d = driver();
    let cpu = server_in(INFER_GPU_OFF).unwrap_or_else(|(st, m)| panic!("{st} {m}"));
    let gpu = server_in(INFER_GPU_REQUIRED).unwrap_or_else(|(st, m)| panic!("{st} {m}"));
    let models = ["add_sub", "mlp", "cnn", "preprocess", "postprocess"];
    for m in models {
        load_from_models(&cpu, m, None);
        load_from_models(&gpu, m, Some(&gpu_config_of(m)));
    }
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
    assert!(c.kernel_launches > 0, "{c:?}");
    assert_eq!(c.pageable_async_copies, 0, "{c:?}");
    assert_eq!(c.invalid_calls, 0, "{c:?}");

    // Implicit state on the GPU: running sums of interleaved sequences.
    load_from_models(
        &gpu,
        "accumulator_onnx",
        Some(&gpu_config_of("accumulator_onnx")),
    );
    let mut sums = [0f32; 2];
    for step in 0..5 {
        for (seq, sum) in sums.iter_mut().enumerate() {
            let v = (step * 2 + seq) as f32 + 0.5;
            let r = gpu
                .request("accumulator_onnx")
                .input_f32("INPUT", &[1, 1], &[v]);
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
            assert_eq!(
                gpu.infer(r).output_f32("OUTPUT"),
                vec![*sum],
                "sequence {seq} step {step}"
            );
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
        d.counters().kernel_launches > before,
        "KIND_AUTO mlp did not run on the GPU"
    );
    let dims = ["4"];
    let round = pb::ModelProto {
        ir_version: 8,
        opset_import: vec![pb::OperatorSetIdProto {
            domain: String::new(),
            version: 17,
        }],
        graph: Some(pb::GraphProto {
            name: "g".into(),
            node: vec![pb::NodeProto {
                op_type: "Round".into(),
                name: "round".into(),
                input: vec!["X".into()],
                output: vec!["Y".into()],
                ..Default::default()
            }],
            input: vec![value_info("X", &dims)],
            output: vec![value_info("Y", &dims)],
            ..Default::default()
        }),
        ..Default::default()
    };
    let dir = temp_dir("gpu-round");
    std::fs::create_dir_all(dir.join("1")).unwrap();
    std::fs::write(
        dir.join("1/model.onnx"),
        prost::Message::encode_to_vec(&round),
    )
    .unwrap();
    let cfg = |kind: &str| {
        format!(
            r#"name: "round" platform: "onnxruntime_onnx" max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ kind: {kind} }} ]"#
        )
    };
    let load = |kind: &str| unsafe {
        infer_server_load_model(
            gpu.0,
            c"round".as_ptr(),
            cs(&cfg(kind)).as_ptr(),
            cs(dir.to_str().unwrap()).as_ptr(),
        )
    };
    expect_msg(
        load("KIND_GPU"),
        INFER_STATUS_UNSUPPORTED,
        &[
            "'round'",
            "operator Round is not supported by the GPU executor",
        ],
    );
    ok(load("KIND_AUTO"));
    let before = d.counters().kernel_launches;
    let resp = gpu.infer(
        gpu.request("round")
            .input_f32("X", &[4], &[0.4, 1.6, -2.5, 3.0]),
    );
    assert_eq!(resp.output_f32("Y"), vec![0.0, 2.0, -2.0, 3.0]);
    assert_eq!(d.counters().kernel_launches, before, "Round ran on the GPU");
    println!("KIND_AUTO: mlp on the GPU, a model with Round on the CPU");

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
    assert_eq!(after.graph_launches - before.graph_launches, 4, "{after:?}");
    println!("CUDA graphs: mlp matches CPU with graphs at batch 1 and 3");
}

fn value_info(name: &str, dims: &[&str]) -> pb::ValueInfoProto {
    use pb::tensor_shape_proto::dimension::Value as DimValue;
    pb::ValueInfoProto {
        name: name.to_owned(),
        r#type: Some(pb::TypeProto {
            value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                elem_type: 1,
                shape: Some(pb::TensorShapeProto {
                    dim: dims
                        .iter()
                        .map(|d| pb::tensor_shape_proto::Dimension {
                            value: Some(DimValue::DimValue(d.parse().unwrap())),
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

/// Compiles src/gpu/kernels/kernels.cu with the real NVRTC for the architectures the
/// library serves, in a child process whose loader path starts with
/// `INFER_NVRTC_LIB_DIR` (scripts/test.sh installs NVRTC from PyPI there). Without it:
/// SKIP.
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
    let out = std::process::Command::new(exe)
        .args(["--exact", "nvrtc_child", "--nocapture"])
        .env("LD_LIBRARY_PATH", &dir)
        .env("INFER_NVRTC_CHILD", "1")
        .output()
        .expect("running the test binary again");
    let all =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && all.contains("kernels compiled"),
        "{all}"
    );
    for line in all.lines().filter(|l| l.starts_with("sm_")) {
        println!("{line}");
    }
}

/// The child of `kernels_compile_with_nvrtc`.
#[test]
fn nvrtc_child() {
    if std::env::var_os("INFER_NVRTC_CHILD").is_none() {
        return;
    }
    for cc in [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)] {
        let cubin = infer::gpu::onnx::runtime::compile(cc)
            .unwrap_or_else(|e| panic!("sm_{}{}: {}", cc.0, cc.1, e.message));
        assert!(
            cubin.starts_with(b"\x7fELF"),
            "sm_{}{}: not an ELF CUBIN",
            cc.0,
            cc.1
        );
        println!("sm_{}{}: CUBIN of {} bytes", cc.0, cc.1, cubin.len());
    }
    println!("kernels compiled");
}
