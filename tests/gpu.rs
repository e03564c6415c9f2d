//! GPU modes, KIND_GPU instance groups and the GPU-memory calls of C API section 10,
//! through the C API. Without a usable GPU every GPU request fails with the reason and
//! models serve on the CPU; checks that need a GPU print "SKIP: <reason>" and pass.

mod common;
use common::*;
use infer::ffi::backend::*;
use infer::ffi::memory::*;
use infer::ffi::request::*;
use infer::ffi::server::*;
use infer::ffi::*;
use std::ffi::c_void;
use std::ptr::{null, null_mut};

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
    let mut cc = std::process::Command::new("cc");
    cc.args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&lib)
        .arg(src);
    if only_version {
        cc.arg("-DONLY_VERSION");
    }
    match cc.output() {
        Ok(out) if out.status.success() => {}
        Ok(out) => return Err(String::from_utf8_lossy(&out.stderr).into_owned()),
        Err(e) => return Err(format!("cc: {e}")),
    }
    std::fs::copy(&lib, dir.join("libcuda.so")).map_err(|e| e.to_string())?;
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
        register_copy_backend(&s);
        expect_msg(
            s.try_load(
                "c",
                &copy_config("c", "instance_group [ { kind: KIND_GPU } ]"),
            ),
            INFER_STATUS_UNSUPPORTED,
            &["'c'", "not implemented yet"],
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
            expect_msg(
                infer_request_set_output_memory(r.0, INFER_MEMORY_GPU, 0),
                INFER_STATUS_UNSUPPORTED,
                &["not implemented yet"],
            );
        }
        let resp = s.infer(r);
        assert_eq!(resp.output_f32("OUTPUT0"), vec![3.; 4]);
    }
    println!("fake driver '{scenario}': checked");
}
