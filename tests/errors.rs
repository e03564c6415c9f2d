//! Every documented error path through the C API gives the documented status and a
//! message that names what is wrong; none crashes.

mod common;
use common::*;
use infer::ffi::request::*;
use infer::ffi::response::*;
use infer::ffi::server::*;
use infer::ffi::*;
use std::ffi::{c_void, CStr};
use std::ptr::{null, null_mut};

fn loaded() -> Server {
    let s = Server::new();
    s.load("m", &add_sub_config("m", "dynamic_batching { }"));
    s
}

#[track_caller]
fn expect_msg(st: infer_status, want: infer_status, parts: &[&str]) {
    let msg = expect_status(st, want);
    for p in parts {
        assert!(msg.contains(p), "message {msg:?} lacks {p:?}");
    }
}

/// For GPU memory that is host memory, whose status depends on the machine: UNAVAILABLE
/// or UNSUPPORTED without a usable GPU, INVALID_ARGUMENT with one (the driver does not
/// know the address); tests/gpu.rs pins each case.
#[track_caller]
fn expect_gpu_refusal(st: infer_status, parts: &[&str]) {
    let msg = last_error();
    assert!(
        st == INFER_STATUS_UNAVAILABLE
            || st == INFER_STATUS_UNSUPPORTED
            || (st == INFER_STATUS_INVALID_ARGUMENT && msg.contains("is not device memory")),
        "expected UNAVAILABLE or UNSUPPORTED (no GPU) or INVALID_ARGUMENT (not device memory), got {st} ({msg})"
    );
    for p in parts {
        assert!(msg.contains(p), "message {msg:?} lacks {p:?}");
    }
}

#[test]
fn null_arguments_are_invalid_argument() {
    let s = loaded();
    unsafe {
        expect_msg(infer_server_new(null(), null_mut()), 1, &["'out'"]);
        expect_msg(
            infer_server_load_model(null_mut(), c"m".as_ptr(), null(), null()),
            1,
            &["'s'"],
        );
        expect_msg(
            infer_server_load_model(s.0, null(), null(), null()),
            1,
            &["'name'"],
        );
        expect_msg(
            infer_request_new(s.0, null(), -1, &mut null_mut()),
            1,
            &["'model'"],
        );
        expect_msg(
            infer_request_new(s.0, c"m".as_ptr(), -1, null_mut()),
            1,
            &["'out'"],
        );
        expect_msg(
            infer_server_enqueue(s.0, null_mut(), None, null_mut(), null_mut()),
            1,
            &["'r'"],
        );
        let r = s.request("m");
        expect_msg(
            infer_server_enqueue(s.0, r.take(), None, null_mut(), null_mut()),
            1,
            &["on_response"],
        );
        expect_msg(infer_server_infer(s.0, null_mut(), null_mut()), 1, &["'r'"]);
        expect_msg(infer_server_cancel(null_mut(), 1), 1, &["'s'"]);
        expect_msg(
            infer_server_statistics_json(s.0, null(), null_mut()),
            1,
            &["json_out"],
        );
        expect_msg(
            infer_server_metrics_prometheus(s.0, null_mut()),
            1,
            &["text_out"],
        );
        expect_msg(
            infer_server_model_ready(s.0, c"m".as_ptr(), -1, null_mut()),
            1,
            &["'ready'"],
        );
        expect_msg(infer_server_pause_model(s.0, null()), 1, &["'name'"]);
        expect_msg(infer_request_set_flags(null_mut(), 0), 1, &["'r'"]);
        expect_msg(
            infer_request_add_input(null_mut(), c"x".as_ptr(), 11, null(), 0, null(), 0),
            1,
            &["'r'"],
        );
        expect_msg(infer_api_version(null_mut(), null_mut()), 1, &["major"]);
        expect_msg(
            infer_response_output(
                null(),
                0,
                null_mut(),
                null_mut(),
                null_mut(),
                null_mut(),
                null_mut(),
                null_mut(),
            ),
            1,
            &["'r'"],
        );
        expect_msg(infer_server_options_set_gpu(null_mut(), 0), 1, &["'opts'"]);
        expect_msg(infer_server_shutdown(null_mut(), 0), 1, &["'s'"]);
        // Non-status functions return a neutral value.
        assert_eq!(infer_response_request_id(null()), 0);
        assert_eq!(infer_response_output_count(null()), 0);
        assert!(infer_response_error_message(null()).is_null());
        assert_eq!(infer_datatype_from_string(null()), 0);
        infer_server_free(null_mut());
        infer_request_free(null_mut());
        infer_response_free(null_mut());
        infer_string_free(null_mut());
        infer_server_options_free(null_mut());
    }
}

#[test]
fn status_and_datatype_strings() {
    unsafe {
        let name = |st| CStr::from_ptr(infer_status_string(st)).to_str().unwrap();
        assert_eq!(name(0), "OK");
        assert_eq!(name(9), "RESOURCE_EXHAUSTED");
        assert_eq!(name(77), "UNKNOWN");
        assert_eq!(
            infer_datatype_from_string(c"TYPE_FP32".as_ptr()),
            INFER_DATATYPE_FP32
        );
        assert_eq!(
            infer_datatype_from_string(c"BF16".as_ptr()),
            INFER_DATATYPE_BF16
        );
        assert_eq!(infer_datatype_from_string(c"nope".as_ptr()), 0);
        assert_eq!(
            CStr::from_ptr(infer_datatype_string(INFER_DATATYPE_BYTES))
                .to_str()
                .unwrap(),
            "BYTES"
        );
        assert_eq!(infer_datatype_byte_size(INFER_DATATYPE_FP64), 8);
        assert_eq!(infer_datatype_byte_size(INFER_DATATYPE_BYTES), 0);
        let (mut a, mut b) = (9, 9);
        ok(infer_api_version(&mut a, &mut b));
        assert_eq!((a, b), (INFER_API_VERSION_MAJOR, INFER_API_VERSION_MINOR));
        assert_eq!(
            CStr::from_ptr(infer_version()).to_str().unwrap(),
            env!("CARGO_PKG_VERSION")
        );
    }
}

#[test]
fn input_errors_name_model_tensor_and_value() {
    let s = loaded();
    let r = s.request("m");
    let data = [0u8; 16];
    expect_msg(
        r.try_input("INPUT0", INFER_DATATYPE_INT32, &[1, 4], &data),
        1,
        &["'INPUT0'", "'m'", "FP32", "INT32"],
    );
    expect_msg(
        r.try_input("INPUT0", INFER_DATATYPE_FP32, &[1, 5], &[0u8; 20]),
        1,
        &["'INPUT0'", "[1,5]", "[-1,4]"],
    );
    expect_msg(
        r.try_input("INPUT0", INFER_DATATYPE_FP32, &[1, 4], &data[..15]),
        1,
        &["'INPUT0'", "expected 16 bytes", "got 15"],
    );
    expect_msg(
        r.try_input("INPUT9", INFER_DATATYPE_FP32, &[1, 4], &data),
        1,
        &["no input 'INPUT9'", "INPUT0, INPUT1"],
    );
    expect_msg(
        r.try_input("INPUT0", INFER_DATATYPE_FP32, &[65, 4], &[0u8; 65 * 16]),
        1,
        &["batch size 65", "1..=64"],
    );
    expect_msg(
        r.try_input("INPUT0", INFER_DATATYPE_FP32, &[4], &data),
        1,
        &["[4]"],
    );
    expect_msg(
        r.try_input("INPUT0", 99, &[1, 4], &data),
        1,
        &["datatype 99"],
    );
    expect_msg(
        r.try_input("INPUT0", INFER_DATATYPE_FP32, &[1, -4], &data),
        1,
        &["[1,-4]"],
    );
    expect_msg(
        r.try_input("INPUT0", INFER_DATATYPE_FP32, &[i64::MAX, i64::MAX], &data),
        1,
        &["INPUT0"],
    );
    unsafe {
        let shape = [1i64, 4];
        expect_msg(
            infer_request_add_input(
                r.0,
                c"INPUT0".as_ptr(),
                INFER_DATATYPE_FP32,
                shape.as_ptr(),
                2,
                null(),
                16,
            ),
            1,
            &["'data'"],
        );
        expect_msg(
            infer_request_add_input(
                r.0,
                c"INPUT0".as_ptr(),
                INFER_DATATYPE_FP32,
                null(),
                2,
                data.as_ptr() as *const c_void,
                16,
            ),
            1,
            &["'shape'"],
        );
    }
    ok(r.try_input("INPUT0", INFER_DATATYPE_FP32, &[1, 4], &data));
    expect_msg(
        r.try_input("INPUT0", INFER_DATATYPE_FP32, &[1, 4], &data),
        INFER_STATUS_ALREADY_EXISTS,
        &["already added"],
    );
    unsafe {
        expect_msg(
            infer_request_add_requested_output(r.0, c"OUTPUT7".as_ptr()),
            1,
            // Triton's text, then ours.
            &[
                "unexpected inference output 'OUTPUT7' for model '",
                "no output 'OUTPUT7'",
            ],
        );
        expect_msg(infer_request_set_flags(r.0, 8), 1, &["unknown bits"]);
        let long = std::ffi::CString::new("x".repeat(129)).unwrap();
        expect_msg(
            infer_request_set_correlation_id_str(r.0, long.as_ptr()),
            1,
            &["129 bytes", "128"],
        );
        expect_gpu_refusal(
            infer_request_add_input_borrowed(
                r.0,
                c"INPUT1".as_ptr(),
                11,
                [1i64, 4].as_ptr(),
                2,
                data.as_ptr() as *const c_void,
                16,
                INFER_MEMORY_GPU,
                0,
                None,
                null_mut(),
            ),
            &["'INPUT1'", "GPU 0"],
        );
    }
    // A request missing a required input is refused at enqueue, without a callback.
    let c = Collector::new();
    let (st, msg) = s.enqueue(r, &c).unwrap_err();
    assert_eq!(st, 1);
    assert!(msg.contains("required input 'INPUT1' is missing"), "{msg}");
    assert_eq!(c.finals(), 0);
}

#[test]
fn inconsistent_batch_sizes_are_refused() {
    let s = loaded();
    let r = s
        .request("m")
        .input_f32("INPUT0", &[2, 4], &[0.; 8])
        .input_f32("INPUT1", &[1, 4], &[0.; 4]);
    let (st, msg) = s.enqueue(r, &Collector::new()).unwrap_err();
    assert_eq!(st, 1);
    assert!(
        msg.contains("batch size") && msg.contains("'INPUT0' has 2"),
        "{msg}"
    );
}

#[test]
fn unknown_models_and_versions() {
    let s = loaded();
    let mut r = null_mut();
    unsafe {
        expect_msg(
            infer_request_new(s.0, c"nope".as_ptr(), -1, &mut r),
            2,
            &["'nope'"],
        );
        expect_msg(
            infer_request_new(s.0, c"m".as_ptr(), 0, &mut r),
            1,
            &["version 0"],
        );
        expect_msg(
            infer_server_unload_model(s.0, c"nope".as_ptr()),
            2,
            &["'nope'"],
        );
        expect_msg(
            infer_server_pause_model(s.0, c"nope".as_ptr()),
            2,
            &["'nope'"],
        );
        let mut json = null_mut();
        expect_msg(
            infer_server_statistics_json(s.0, c"nope".as_ptr(), &mut json),
            2,
            &["'nope'"],
        );
        expect_msg(
            infer_server_model_config_json(s.0, c"m".as_ptr(), 7, &mut json),
            2,
            &["version 7"],
        );
        ok(infer_server_model_config_json(
            s.0,
            c"m".as_ptr(),
            -1,
            &mut json,
        ));
        let cfg: serde_json::Value =
            serde_json::from_str(CStr::from_ptr(json).to_str().unwrap()).unwrap();
        infer_string_free(json);
        assert_eq!(cfg["name"], "m");
        assert_eq!(cfg["max_batch_size"], 64);
    }
}

#[test]
fn config_errors_and_unsupported_features() {
    let s = Server::new();
    let bad_syntax = "name: \"m\"\nbackend: \"add_sub\"\nmax_batch_size: [ 8";
    expect_msg(s.try_load("m", bad_syntax), 1, &["line 3:"]);
    let unknown = add_sub_config("m", "dynamic_batching { bogus_field: 1 }");
    expect_msg(s.try_load("m", &unknown), 1, &["bogus_field"]);
    let pref = add_sub_config("m", "dynamic_batching { preferred_batch_size: [ 128 ] }");
    expect_msg(
        s.try_load("m", &pref),
        1,
        &["preferred_batch_size", "128", "64"],
    );
    let seq = add_sub_config("m", "sequence_batching { iterative_sequence: true }");
    expect_msg(
        s.try_load("m", &seq),
        INFER_STATUS_UNSUPPORTED,
        &["'m'", "sequence_batching.iterative_sequence"],
    );
    let gpu = add_sub_config("m", "instance_group [ { kind: KIND_GPU } ]");
    expect_gpu_refusal(s.try_load("m", &gpu), &["'m'", "KIND_GPU"]);
    let backend =
        add_sub_config("m", "").replace("backend: \"add_sub\"", "backend: \"tensorflow\"");
    expect_msg(
        s.try_load("m", &backend),
        INFER_STATUS_UNSUPPORTED,
        &["'tensorflow'"],
    );
    let ens = r#"name: "e" platform: "ensemble" max_batch_size: 1
input [ { name: "I" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "O" data_type: TYPE_FP32 dims: [ 1 ] } ]
ensemble_scheduling { step [ { model_name: "m" model_version: -1 input_map { key: "INPUT0" value: "I" } output_map { key: "OUTPUT0" value: "O" } } ] }"#;
    expect_msg(
        s.try_load("e", ens),
        1,
        &["'e'", "composing model 'm'", "not loaded"],
    );
    let ns = ens.replace(
        "model_version: -1",
        "model_version: -1 model_namespace: \"x\"",
    );
    expect_msg(
        s.try_load("e", &ns),
        INFER_STATUS_UNSUPPORTED,
        &["model_namespace"],
    );
    let delay = add_sub_config(
        "m",
        r#"parameters { key: "execute_delay_us" value { string_value: "soon" } }"#,
    );
    expect_msg(s.try_load("m", &delay), 1, &["execute_delay_us", "soon"]);
    let other = add_sub_config("other", "");
    expect_msg(s.try_load("m", &other), 1, &["'other'", "'m'"]);
    let json_bad = "{\"name\": \"m\",\n \"backend\": }";
    expect_msg(s.try_load("m", json_bad), 1, &["line 2:"]);
    // None of the failed loads left a model behind.
    let mut ready = true;
    ok(unsafe { infer_server_model_ready(s.0, c"m".as_ptr(), -1, &mut ready) });
    assert!(!ready);
    // The JSON form of a good config loads.
    let json = r#"{"name": "j", "backend": "add_sub", "max_batch_size": 8,
      "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]}, {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [4]}],
      "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}, {"name": "OUTPUT1", "data_type": "TYPE_FP32", "dims": [4]}]}"#;
    s.load("j", json);
    let r = s.infer(add_sub_request(&s, "j", [1.; 4], [2.; 4]));
    assert_eq!(r.output_f32("OUTPUT0"), vec![3.; 4]);
}

#[test]
fn gpu_mode_is_validated_and_off_always_starts() {
    let mut opts = null_mut();
    unsafe {
        ok(infer_server_options_new(&mut opts));
        expect_msg(infer_server_options_set_gpu(opts, 7), 1, &["GPU mode 7"]);
        // REQUIRED depends on the machine: tests/gpu.rs.
        let mut s = null_mut();
        ok(infer_server_options_set_gpu(opts, INFER_GPU_OFF));
        ok(infer_server_new(opts, &mut s));
        infer_server_free(s);
        infer_server_options_free(opts);
    }
}

#[test]
fn repository_errors() {
    let mut opts = null_mut();
    unsafe {
        ok(infer_server_options_new(&mut opts));
        ok(infer_server_options_set_model_repository(
            opts,
            c"/nonexistent/repo".as_ptr(),
        ));
        let mut s = null_mut();
        expect_msg(
            infer_server_new(opts, &mut s),
            INFER_STATUS_NOT_FOUND,
            &["/nonexistent/repo"],
        );
        infer_server_options_free(opts);
    }
    let s = Server::new();
    expect_msg(
        unsafe { infer_server_load_model(s.0, c"m".as_ptr(), null(), null()) },
        1,
        &["'m'", "no model repository"],
    );
}

unsafe extern "C" fn free_server_in_callback(ud: *mut c_void, resp: *mut Response, _flags: u32) {
    let s = ud as *mut ServerHandle;
    infer_server_free(s); // refused: must not deadlock or free
    let msg = CStr::from_ptr(infer_last_error_message())
        .to_str()
        .unwrap()
        .to_owned();
    assert!(msg.contains("callback"));
    let mut out = null_mut();
    let st = infer_server_infer(s, null_mut(), &mut out);
    assert_eq!(st, 1);
    infer_response_free(resp);
}

#[test]
fn blocking_calls_from_a_callback_are_refused() {
    let s = loaded();
    let r = add_sub_request(&s, "m", [0.; 4], [0.; 4]);
    ok(unsafe {
        infer_server_enqueue(
            s.0,
            r.take(),
            Some(free_server_in_callback),
            s.0 as *mut c_void,
            null_mut(),
        )
    });
    std::thread::sleep(std::time::Duration::from_millis(50));
    // The server is still alive and serving.
    let r = s.infer(add_sub_request(&s, "m", [1.; 4], [1.; 4]));
    assert_eq!(r.status(), 0);
}

#[test]
fn response_accessor_errors() {
    let s = loaded();
    let r = s.infer(add_sub_request(&s, "m", [1.; 4], [1.; 4]));
    unsafe {
        expect_msg(
            infer_response_output(
                r.0,
                5,
                null_mut(),
                null_mut(),
                null_mut(),
                null_mut(),
                null_mut(),
                null_mut(),
            ),
            1,
            &["index 5", "2 outputs"],
        );
        let mut v = 0i64;
        expect_msg(
            infer_response_parameter_int(r.0, c"k".as_ptr(), &mut v),
            2,
            &["'k'"],
        );
        assert_eq!(
            CStr::from_ptr(infer_response_model_name(r.0))
                .to_str()
                .unwrap(),
            "m"
        );
        assert_eq!(infer_response_model_version(r.0), 1);
    }
    assert!(r.output("NOPE").is_none());
}

/// Triton config fields whose features the library does not implement are refused at
/// load with UNSUPPORTED naming the field, never parsed and ignored; a rate limiter (off
/// in Triton unless its server turns it on) loads, and the log says it has no effect. (The
/// response cache is implemented: tests/dynamic_batching.rs; ragged batching:
/// tests/ragged.rs; decoupled custom backends: tests/decoupled.rs.)
#[test]
fn unimplemented_triton_fields_are_refused_by_name() {
    let s = Server::new();
    for (extra, field) in [
        (
            "optimization { eager_batching: true }",
            "optimization.eager_batching",
        ),
        (
            r#"instance_group [ { count: 1 kind: KIND_CPU host_policy: "numa0" } ]"#,
            "instance_group.host_policy",
        ),
        (
            "model_transaction_policy { decoupled: true }",
            "model_transaction_policy.decoupled",
        ),
        (r#"runtime: "libtorch.so""#, "runtime"),
        (
            r#"cc_model_filenames [ { key: "8.6" value: "m86.onnx" } ]"#,
            "cc_model_filenames",
        ),
        (
            r#"model_operations { op_library_filename: [ "libops.so" ] }"#,
            "model_operations.op_library_filename",
        ),
        (
            r#"model_repository_agents { agents [ { name: "checksum" } ] }"#,
            "model_repository_agents",
        ),
    ] {
        expect_msg(
            s.try_load("m", &add_sub_config("m", extra)),
            INFER_STATUS_UNSUPPORTED,
            &["model 'm'", field, "not supported"],
        );
    }
    // Off: accepted.
    for extra in [
        "response_cache { enable: false }",
        "model_transaction_policy { decoupled: false }",
        r#"instance_group [ { count: 1 kind: KIND_CPU rate_limiter { resources [ { name: "R" count: 1 } ] priority: 2 } } ]"#,
    ] {
        assert_eq!(
            s.try_load("m", &add_sub_config("m", extra)),
            INFER_STATUS_OK,
            "{extra}: {}",
            last_error()
        );
    }
}
