//! Custom backends through `infer_backend` (C callbacks, here written in Rust with the C
//! ABI) and Rust backends: batched inputs, output allocation, per-row and per-batch
//! errors, panics, instance lifecycle and finalize.

mod common;
use common::*;
use infer::ffi::backend::*;
use infer::ffi::custom::infer_backend;
use infer::ffi::server::*;
use infer::ffi::*;
use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

#[derive(Default)]
struct Counters {
    inits: AtomicUsize,
    finis: AtomicUsize,
    finalized: AtomicUsize,
    executes: AtomicUsize,
}

unsafe extern "C" fn init(
    ud: *mut c_void,
    model: *const c_char,
    json: *const c_char,
    index: u32,
    gpu: i32,
    state: *mut *mut c_void,
) -> u32 {
    let c = &*(ud as *const Counters);
    assert_eq!(CStr::from_ptr(model).to_str().unwrap(), "neg");
    let json: serde_json::Value =
        serde_json::from_str(CStr::from_ptr(json).to_str().unwrap()).unwrap();
    assert_eq!(json["max_batch_size"], 8);
    assert_eq!(gpu, -1);
    c.inits.fetch_add(1, Ordering::SeqCst);
    *state = ud;
    let _ = index;
    0
}

/// OUT = -IN for FP32; a row whose value is 13 fails; a batch containing 666 fails whole.
unsafe extern "C" fn execute(state: *mut c_void, b: *mut Batch) -> u32 {
    let c = &*(state as *const Counters);
    c.executes.fetch_add(1, Ordering::SeqCst);
    let (mut dt, mut shape, mut nd, mut data, mut bytes) =
        (0u32, std::ptr::null(), 0usize, std::ptr::null(), 0usize);
    let st = infer_batch_input(
        b,
        c"IN".as_ptr(),
        &mut dt,
        &mut shape,
        &mut nd,
        &mut data,
        &mut bytes,
    );
    if st != 0 {
        return st;
    }
    let shape = std::slice::from_raw_parts(shape, nd).to_vec();
    assert_eq!(shape[0], infer_batch_size(b) as i64);
    let vals = std::slice::from_raw_parts(data as *const f32, bytes / 4).to_vec();
    if vals.contains(&666.0) {
        infer_batch_set_error_message(b, c"the devil's number".as_ptr());
        return INFER_STATUS_UNSUPPORTED;
    }
    let mut out: *mut c_void = std::ptr::null_mut();
    let st = infer_batch_output(b, c"OUT".as_ptr(), shape.as_ptr(), shape.len(), &mut out);
    if st != 0 {
        return st;
    }
    let out = std::slice::from_raw_parts_mut(out as *mut f32, vals.len());
    let row_len = vals.len() / shape[0] as usize;
    for (i, v) in vals.iter().enumerate() {
        out[i] = -v;
        if *v == 13.0 {
            infer_batch_set_request_error(
                b,
                (i / row_len) as u32,
                INFER_STATUS_INVALID_ARGUMENT,
                c"unlucky row".as_ptr(),
            );
        }
    }
    0
}

unsafe extern "C" fn fini(state: *mut c_void) {
    (*(state as *const Counters))
        .finis
        .fetch_add(1, Ordering::SeqCst);
}

unsafe extern "C" fn finalize(ud: *mut c_void) {
    let c = Arc::from_raw(ud as *const Counters);
    c.finalized.fetch_add(1, Ordering::SeqCst);
}

const NEG: &str = r#"
name: "neg" backend: "negate" max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
instance_group [ { count: 2 } ]
dynamic_batching { }
"#;

fn vtable() -> infer_backend {
    infer_backend {
        struct_size: std::mem::size_of::<infer_backend>() as u32,
        instance_init: Some(init),
        execute: Some(execute),
        instance_fini: Some(fini),
        finalize: Some(finalize),
    }
}

#[test]
fn c_backend_batches_rows_errors_and_lifecycle() {
    let counters = Arc::new(Counters::default());
    let s = Server::new();
    let vt = vtable();
    let ud = Arc::into_raw(counters.clone()) as *mut c_void;
    ok(unsafe { infer_server_register_backend(s.0, c"negate".as_ptr(), &vt, ud) });
    let again = unsafe {
        infer_server_register_backend(s.0, c"negate".as_ptr(), &vt, std::ptr::null_mut())
    };
    let msg = expect_status(again, INFER_STATUS_ALREADY_EXISTS);
    assert!(msg.contains("negate"), "{msg}");
    s.load("neg", NEG);
    assert_eq!(counters.inits.load(Ordering::SeqCst), 2);

    s.pause("neg");
    let c = Collector::new();
    let vals = [1.0f32, 13.0, 3.0];
    let ids: Vec<u64> = vals
        .iter()
        .map(|v| {
            s.enqueue(s.request("neg").input_f32("IN", &[1, 2], &[*v, *v]), &c)
                .unwrap()
        })
        .collect();
    s.resume("neg");
    c.wait(3);
    c.assert_exactly_once(&ids);
    for r in c.take() {
        let i = ids.iter().position(|id| *id == r.id()).unwrap();
        if vals[i] == 13.0 {
            assert_eq!(r.status(), INFER_STATUS_INVALID_ARGUMENT);
            assert_eq!(r.error(), "unlucky row");
        } else {
            assert_eq!(r.status(), 0, "{}", r.error());
            assert_eq!(r.output_f32("OUT"), vec![-vals[i]; 2]);
        }
    }
    assert_eq!(batch_sizes(&s.stats("neg")), vec![(3, 1)]);

    // A failing execute fails the whole batch with its status and message; the instance
    // keeps serving.
    s.pause("neg");
    let c = Collector::new();
    s.enqueue(s.request("neg").input_f32("IN", &[1, 2], &[666.0; 2]), &c)
        .unwrap();
    s.enqueue(s.request("neg").input_f32("IN", &[1, 2], &[1.0; 2]), &c)
        .unwrap();
    s.resume("neg");
    c.wait(2);
    for r in c.take() {
        assert_eq!(r.status(), INFER_STATUS_UNSUPPORTED);
        assert_eq!(r.error(), "the devil's number");
    }
    let r = s.infer(s.request("neg").input_f32("IN", &[1, 2], &[2.0; 2]));
    assert_eq!(r.output_f32("OUT"), vec![-2.0; 2]);
    let st = s.stats("neg");
    assert_eq!(st["models"][0]["failure_count"], 3);
    assert_eq!(st["models"][0]["success_count"], 3);

    // Replacing the model re-creates instances; finalize only when the server is gone.
    s.load("neg", NEG);
    assert_eq!(counters.inits.load(Ordering::SeqCst), 4);
    assert_eq!(counters.finis.load(Ordering::SeqCst), 2);
    drop(s);
    assert_eq!(counters.finis.load(Ordering::SeqCst), 4);
    assert_eq!(counters.finalized.load(Ordering::SeqCst), 1);
}

unsafe extern "C" fn failing_init(
    _: *mut c_void,
    _: *const c_char,
    _: *const c_char,
    index: u32,
    _: i32,
    _: *mut *mut c_void,
) -> u32 {
    if index == 1 {
        if infer_backend_set_init_error(c"no room for a second instance".as_ptr())
            != INFER_STATUS_OK
        {
            return INFER_STATUS_INTERNAL;
        }
        INFER_STATUS_RESOURCE_EXHAUSTED
    } else {
        0
    }
}

#[test]
fn instance_init_failure_fails_the_load() {
    let s = Server::new();
    let vt = infer_backend {
        instance_init: Some(failing_init),
        instance_fini: None,
        finalize: None,
        ..vtable()
    };
    ok(unsafe {
        infer_server_register_backend(s.0, c"negate".as_ptr(), &vt, std::ptr::null_mut())
    });
    let msg = expect_status(s.try_load("neg", NEG), INFER_STATUS_RESOURCE_EXHAUSTED);
    assert!(msg.contains("instance 1") && msg.contains("'neg'"), "{msg}");
    assert!(msg.contains("no room for a second instance"), "{msg}");
    // A message left over from a failed init does not leak into the next load's error.
    let msg = expect_status(s.try_load("neg", NEG), INFER_STATUS_RESOURCE_EXHAUSTED);
    assert_eq!(msg.matches("no room").count(), 1, "{msg}");
    assert_eq!(
        unsafe { infer_backend_set_init_error(std::ptr::null()) },
        INFER_STATUS_INVALID_ARGUMENT
    );
    let mut ready = true;
    ok(unsafe { infer_server_model_ready(s.0, c"neg".as_ptr(), -1, &mut ready) });
    assert!(!ready);
}

#[test]
fn bad_backend_registrations() {
    let s = Server::new();
    let mut vt = vtable();
    vt.execute = None;
    let msg = expect_status(
        unsafe { infer_server_register_backend(s.0, c"x".as_ptr(), &vt, std::ptr::null_mut()) },
        INFER_STATUS_INVALID_ARGUMENT,
    );
    assert!(msg.contains("execute"), "{msg}");
    let mut vt = vtable();
    vt.struct_size = 4;
    let msg = expect_status(
        unsafe { infer_server_register_backend(s.0, c"x".as_ptr(), &vt, std::ptr::null_mut()) },
        INFER_STATUS_INVALID_ARGUMENT,
    );
    assert!(msg.contains("struct_size"), "{msg}");
    expect_status(
        unsafe {
            infer_server_register_backend(
                s.0,
                c"x".as_ptr(),
                std::ptr::null(),
                std::ptr::null_mut(),
            )
        },
        INFER_STATUS_INVALID_ARGUMENT,
    );
    // A model naming an unregistered backend fails to load, naming it.
    let msg = expect_status(s.try_load("neg", NEG), INFER_STATUS_UNSUPPORTED);
    assert!(msg.contains("'negate'"), "{msg}");
}

/// Negates, but panics on a marker value.
fn negate_or_panic(batch: &mut infer::backend::Batch) -> infer::status::Result<()> {
    let (_, data) = batch.input("IN").unwrap();
    let v: Vec<f32> = bytemuck::pod_collect_to_vec(data);
    if v.contains(&-1.0) {
        panic!("cannot negate -1");
    }
    let shape = batch.inputs[0].shape.clone();
    let out = batch.alloc_output("OUT", &shape, None)?;
    let neg: Vec<f32> = v.iter().map(|x| -x).collect();
    out.copy_from_slice(bytemuck::cast_slice(&neg));
    Ok(())
}

#[test]
fn panicking_backend_fails_only_that_batch() {
    let s = Server::new();
    s.register_fn_backend("negate", negate_or_panic);
    s.load("neg", NEG);
    let r = s.infer(s.request("neg").input_f32("IN", &[1, 2], &[-1.0; 2]));
    assert_eq!(r.status(), INFER_STATUS_INTERNAL);
    assert!(
        r.error().contains("panicked") && r.error().contains("cannot negate -1"),
        "{}",
        r.error()
    );
    let r = s.infer(s.request("neg").input_f32("IN", &[1, 2], &[4.0; 2]));
    assert_eq!(r.status(), 0);
    assert_eq!(r.output_f32("OUT"), vec![-4.0; 2]);
}

#[test]
fn backend_registered_on_options_serves_repository_models() {
    let dir = std::env::temp_dir().join(format!("infer-opts-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("neg")).unwrap();
    std::fs::write(dir.join("neg/config.pbtxt"), NEG).unwrap();
    let counters = Arc::new(Counters::default());
    let mut opts = std::ptr::null_mut();
    ok(unsafe { infer_server_options_new(&mut opts) });
    let vt = vtable();
    ok(unsafe {
        infer_server_options_register_backend(
            opts,
            c"negate".as_ptr(),
            &vt,
            Arc::into_raw(counters.clone()) as *mut c_void,
        )
    });
    ok(unsafe {
        infer_server_options_set_model_repository(
            opts,
            std::ffi::CString::new(dir.to_str().unwrap())
                .unwrap()
                .as_ptr(),
        )
    });
    let s = Server::with_options(opts);
    unsafe { infer_server_options_free(opts) };
    let r = s.infer(s.request("neg").input_f32("IN", &[1, 2], &[5.0; 2]));
    assert_eq!(r.output_f32("OUT"), vec![-5.0; 2]);
    assert_eq!(counters.finalized.load(Ordering::SeqCst), 0);
    drop(r);
    drop(s);
    assert_eq!(counters.finalized.load(Ordering::SeqCst), 1);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn fields_past_struct_size_are_not_read() {
    // A caller built against an older, shorter struct: only instance_init and execute.
    let counters = Arc::new(Counters::default());
    let mut vt = vtable();
    vt.struct_size =
        (std::mem::offset_of!(infer_backend, execute) + std::mem::size_of::<usize>()) as u32;
    let ud = Arc::into_raw(counters.clone()) as *mut c_void;
    let s = Server::new();
    ok(unsafe { infer_server_register_backend(s.0, c"negate".as_ptr(), &vt, ud) });
    s.load("neg", NEG);
    let r = s.infer(s.request("neg").input_f32("IN", &[1, 2], &[1.0; 2]));
    assert_eq!(r.output_f32("OUT"), vec![-1.0; 2]);
    drop(r);
    drop(s);
    // instance_fini and finalize lay past struct_size: never called.
    assert_eq!(counters.finis.load(Ordering::SeqCst), 0);
    assert_eq!(counters.finalized.load(Ordering::SeqCst), 0);
    unsafe { drop(Arc::from_raw(ud as *const Counters)) };
}

/// Writes one BYTES element fewer than the output shape says.
fn short_bytes(batch: &mut infer::backend::Batch) -> infer::status::Result<()> {
    let n = batch.size as i64;
    let mut bytes = Vec::new();
    for _ in 0..(n * 2 - 1) {
        bytes.extend_from_slice(&1u32.to_le_bytes());
        bytes.push(b'x');
    }
    batch
        .alloc_output("OUT", &[n, 2], Some(bytes.len()))?
        .copy_from_slice(&bytes);
    Ok(())
}

#[test]
fn bytes_output_not_matching_its_shape_fails_the_batch() {
    let s = Server::new();
    s.register_fn_backend("short", short_bytes);
    s.load(
        "b",
        r#"name: "b" backend: "short" max_batch_size: 4
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ 2 ] } ]"#,
    );
    let r = s.infer(s.request("b").input_f32("IN", &[1, 1], &[0.0]));
    assert_eq!(r.status(), INFER_STATUS_INTERNAL);
    assert!(
        r.error().contains("'OUT'") && r.error().contains("holds 1 BYTES elements"),
        "{}",
        r.error()
    );
}
