//! Decoupled custom backends (`model_transaction_policy { decoupled: true }`): a backend
//! takes a request's response sender in `execute` and sends it 0..n responses and the
//! FINAL from its own threads, after `execute` returned, as Triton's decoupled backends
//! do. Also each request's rows and own inputs in a batch.

mod common;
use common::*;
use infer::ffi::backend::*;
use infer::ffi::custom::infer_backend;
use infer::ffi::server::*;
use infer::ffi::*;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

/// A sender handle that may cross threads (the C API allows any thread).
struct SendPtr(*mut ResponseSender);
unsafe impl Send for SendPtr {}

/// What the repeat backend's threads saw, for the tests to check.
static LATE_SEND_STATUS: AtomicU32 = AtomicU32::new(u32::MAX);
static SAW_CANCEL: AtomicBool = AtomicBool::new(false);
/// The tests that read those take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sends `n` responses OUT = [k] (k = 0..n) and then a FINAL without outputs, after a
/// pause of `pause_ms` before each; n = -1 waits until the request is cancelled (or the
/// sender is ended) and then ends it with CANCELLED.
fn stream(s: SendPtr, n: i32, pause_ms: u64) {
    let s = s.0;
    if n < 0 {
        for _ in 0..4000 {
            if unsafe { infer_response_sender_is_cancelled(s) } {
                SAW_CANCEL.store(true, Ordering::SeqCst);
                break;
            }
            // A shutdown that gave up on the request makes sends fail.
            let st = unsafe { infer_response_sender_send(s, 0) };
            if st != 0 {
                LATE_SEND_STATUS.store(st, Ordering::SeqCst);
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        unsafe { infer_response_sender_send_error(s, INFER_STATUS_CANCELLED, c"stopped".as_ptr()) };
        return;
    }
    for k in 0..n {
        std::thread::sleep(Duration::from_millis(pause_ms));
        let mut out: *mut c_void = std::ptr::null_mut();
        let shape = [1i64, 1];
        let st = unsafe {
            infer_response_sender_output(s, c"OUT".as_ptr(), shape.as_ptr(), 2, &mut out)
        };
        if st != 0 {
            LATE_SEND_STATUS.store(st, Ordering::SeqCst);
            unsafe { infer_response_sender_send(s, INFER_RESPONSE_FLAG_FINAL) };
            return;
        }
        unsafe { *(out as *mut i32) = k };
        let st = unsafe { infer_response_sender_send(s, 0) };
        if st != 0 {
            LATE_SEND_STATUS.store(st, Ordering::SeqCst);
        }
    }
    std::thread::sleep(Duration::from_millis(pause_ms));
    let st = unsafe { infer_response_sender_send(s, INFER_RESPONSE_FLAG_FINAL) };
    if n > 0 && st != 0 {
        LATE_SEND_STATUS.store(st, Ordering::SeqCst);
    }
}

/// IN = [n, pause_ms, fail]: streams n responses from a thread of its own per request.
/// The first response of a request with n >= 10 is sent inside execute (before the
/// library holds the request's sink). fail = 1 fails the batch after taking the senders.
unsafe extern "C" fn repeat(_state: *mut c_void, b: *mut Batch) -> u32 {
    let n = infer_batch_request_count(b);
    let mut fail = false;
    for i in 0..n {
        let (mut shape, mut nd, mut data) = (std::ptr::null(), 0usize, std::ptr::null());
        let st = infer_batch_request_input(
            b,
            i,
            c"IN".as_ptr(),
            std::ptr::null_mut(),
            &mut shape,
            &mut nd,
            &mut data,
            std::ptr::null_mut(),
        );
        if st != 0 {
            return st;
        }
        let v = std::slice::from_raw_parts(data as *const i32, 3).to_vec();
        assert_eq!(std::slice::from_raw_parts(shape, nd), &[1, 3]);
        let (mut first, mut rows) = (u32::MAX, 0u32);
        assert_eq!(infer_batch_request_rows(b, i, &mut first, &mut rows), 0);
        assert_eq!((first, rows), (i, 1));
        let mut s: *mut ResponseSender = std::ptr::null_mut();
        let st = infer_batch_response_sender(b, i, &mut s);
        if st != 0 {
            return st;
        }
        // Taking it twice is refused.
        let mut again: *mut ResponseSender = std::ptr::null_mut();
        assert_eq!(
            infer_batch_response_sender(b, i, &mut again),
            INFER_STATUS_INVALID_ARGUMENT
        );
        let (count, pause) = (v[0], v[1] as u64);
        fail |= v[2] == 1;
        let mut rest = count;
        if count >= 10 {
            let mut out: *mut c_void = std::ptr::null_mut();
            let one = [1i64, 1];
            assert_eq!(
                infer_response_sender_output(s, c"OUT".as_ptr(), one.as_ptr(), 2, &mut out),
                0
            );
            *(out as *mut i32) = -1;
            assert_eq!(infer_response_sender_send(s, 0), 0);
            rest = count - 10;
        }
        let p = SendPtr(s);
        std::thread::spawn(move || stream(p, rest, pause));
    }
    if fail {
        infer_batch_set_error_message(b, c"the batch failed".as_ptr());
        return INFER_STATUS_INTERNAL;
    }
    0
}

fn repeat_vtable() -> infer_backend {
    infer_backend {
        struct_size: std::mem::size_of::<infer_backend>() as u32,
        instance_init: None,
        execute: Some(repeat),
        instance_fini: None,
        finalize: None,
    }
}

const REPEAT: &str = r#"
name: "rep" backend: "repeat" max_batch_size: 4
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 3 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
model_transaction_policy { decoupled: true }
dynamic_batching { }
"#;

fn server() -> Server {
    let s = Server::new();
    let vt = repeat_vtable();
    ok(unsafe {
        infer_server_register_backend(s.0, c"repeat".as_ptr(), &vt, std::ptr::null_mut())
    });
    s.load("rep", REPEAT);
    s
}

fn rep(s: &Server, n: i32, pause_ms: i32, fail: i32) -> Req {
    s.request("rep")
        .input_i32("IN", &[1, 3], &[n, pause_ms, fail])
}

/// The responses of request `id` in order: (OUT values or None, status, final).
fn of(c: &Collector, id: u64) -> Vec<(Option<i32>, infer_status, bool)> {
    let g = c.0.state.lock().unwrap();
    g.responses
        .iter()
        .filter(|(r, _)| r.id() == id)
        .map(|(r, f)| {
            let v = r
                .output("OUT")
                .map(|(_, b)| i32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            (v, r.status(), f & INFER_RESPONSE_FLAG_FINAL != 0)
        })
        .collect()
}

#[test]
fn a_decoupled_backend_streams_responses_from_its_own_threads() {
    let s = server();
    s.pause("rep");
    let c = Collector::new();
    let a = s.enqueue(rep(&s, 3, 20, 0), &c).unwrap();
    let b = s.enqueue(rep(&s, 0, 0, 0), &c).unwrap();
    // One response inside execute, then two from the thread.
    let d = s.enqueue(rep(&s, 12, 10, 0), &c).unwrap();
    s.resume("rep");
    c.wait(3);
    let ok = |v: i32| (Some(v), 0, false);
    let fin = (None, 0, true);
    assert_eq!(of(&c, a), vec![ok(0), ok(1), ok(2), fin]);
    assert_eq!(of(&c, b), vec![fin]);
    assert_eq!(of(&c, d), vec![ok(-1), ok(0), ok(1), fin]);
    let g = c.0.state.lock().unwrap();
    assert!(g.after_final.is_empty(), "{:?}", g.after_final);
    drop(g);
    // One execution of three requests, each counted once.
    let st = s.stats("rep");
    assert_eq!(batch_sizes(&st), vec![(3, 1)]);
    assert_eq!(st["models"][0]["success_count"], 3);
    assert_eq!(st["models"][0]["inference_count"], 3);
}

#[test]
fn a_failed_batch_answers_its_requests_and_later_sends_fail() {
    let _turn = serial();
    LATE_SEND_STATUS.store(u32::MAX, Ordering::SeqCst);
    let s = server();
    let c = Collector::new();
    // The thread sends after 100 ms, when the batch has failed.
    let id = s.enqueue(rep(&s, 1, 100, 1), &c).unwrap();
    c.wait(1);
    assert_eq!(
        of(&c, id),
        vec![(None, INFER_STATUS_INTERNAL, true)],
        "one FINAL with the batch's error"
    );
    c.assert_exactly_once(&[id]);
    let r = &c.take()[0];
    assert_eq!(r.error(), "the batch failed");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while LATE_SEND_STATUS.load(Ordering::SeqCst) == u32::MAX {
        assert!(
            std::time::Instant::now() < deadline,
            "the late send never ran"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        LATE_SEND_STATUS.load(Ordering::SeqCst),
        INFER_STATUS_UNAVAILABLE
    );
    assert_eq!(c.finals(), 1);
}

#[test]
fn unload_waits_for_the_backend_to_finish_and_cancel_reaches_it() {
    let _turn = serial();
    SAW_CANCEL.store(false, Ordering::SeqCst);
    let s = server();
    let c = Collector::new();
    let id = s.enqueue(rep(&s, 2, 150, 0), &c).unwrap();
    // Wait until the batch was split, then unload: it returns only once the backend sent
    // its FINAL.
    std::thread::sleep(Duration::from_millis(50));
    let name = cs("rep");
    ok(unsafe { infer_server_unload_model(s.0, name.as_ptr()) });
    assert_eq!(c.finals(), 1, "unload returned before the FINAL");
    assert_eq!(of(&c, id).len(), 3);

    s.load("rep", REPEAT);
    let c = Collector::new();
    let id = s.enqueue(rep(&s, -1, 0, 0), &c).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    ok(unsafe { infer_server_cancel(s.0, id) });
    c.wait(1);
    let rs = of(&c, id);
    let last = rs.last().unwrap();
    assert_eq!((last.1, last.2), (INFER_STATUS_CANCELLED, true));
    assert!(SAW_CANCEL.load(Ordering::SeqCst));
    let g = c.0.state.lock().unwrap();
    assert_eq!(g.finals_by_id.get(&id), Some(&1));
}

#[test]
fn a_shutdown_answers_what_a_stuck_decoupled_backend_holds() {
    let _turn = serial();
    LATE_SEND_STATUS.store(u32::MAX, Ordering::SeqCst);
    let s = server();
    let c = Collector::new();
    // Never ends by itself (until cancelled or its sends fail).
    let id = s.enqueue(rep(&s, -1, 0, 0), &c).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    ok(unsafe { infer_server_shutdown(s.0, 100) });
    c.wait(1);
    let rs = of(&c, id);
    let last = rs.last().unwrap();
    assert_eq!((last.1, last.2), (INFER_STATUS_CANCELLED, true), "{rs:?}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while LATE_SEND_STATUS.load(Ordering::SeqCst) == u32::MAX {
        assert!(
            std::time::Instant::now() < deadline,
            "the backend kept sending"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        LATE_SEND_STATUS.load(Ordering::SeqCst),
        INFER_STATUS_UNAVAILABLE
    );
    // Let the backend's thread end its sender before the server goes.
    std::thread::sleep(Duration::from_millis(50));
    let g = c.0.state.lock().unwrap();
    assert_eq!(g.finals_by_id.get(&id), Some(&1));
    assert!(g.after_final.is_empty());
}

/// Checks what a decoupled backend may not do; answers every request with OUT = [7].
unsafe extern "C" fn checker(_state: *mut c_void, b: *mut Batch) -> u32 {
    for i in 0..infer_batch_request_count(b) {
        let mut s: *mut ResponseSender = std::ptr::null_mut();
        assert_eq!(infer_batch_response_sender(b, i, &mut s), 0);
        let mut out: *mut c_void = std::ptr::null_mut();
        let bad = [1i64, 2, 3];
        let st = infer_response_sender_output(s, c"OUT".as_ptr(), bad.as_ptr(), 3, &mut out);
        assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT);
        assert!(last_error().contains("does not match the config's dims"));
        let st = infer_response_sender_output(s, c"NOPE".as_ptr(), bad.as_ptr(), 1, &mut out);
        assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT);
        assert_eq!(
            infer_response_sender_send(s, 2),
            INFER_STATUS_INVALID_ARGUMENT
        );
        let one = [1i64];
        assert_eq!(
            infer_response_sender_output(s, c"OUT".as_ptr(), one.as_ptr(), 1, &mut out),
            0
        );
        *(out as *mut i32) = 7;
        assert_eq!(
            infer_response_sender_output(s, c"OTHER".as_ptr(), one.as_ptr(), 1, &mut out),
            0
        );
        assert_eq!(infer_response_sender_send(s, INFER_RESPONSE_FLAG_FINAL), 0);
    }
    let mut s: *mut ResponseSender = std::ptr::null_mut();
    let n = infer_batch_request_count(b);
    assert_eq!(
        infer_batch_response_sender(b, n, &mut s),
        INFER_STATUS_INVALID_ARGUMENT
    );
    assert_eq!(
        infer_batch_request_rows(b, n, std::ptr::null_mut(), std::ptr::null_mut()),
        INFER_STATUS_INVALID_ARGUMENT
    );
    0
}

#[test]
fn sender_checks_and_requested_outputs() {
    let s = Server::new();
    let vt = infer_backend {
        execute: Some(checker),
        ..repeat_vtable()
    };
    ok(unsafe {
        infer_server_register_backend(s.0, c"checker".as_ptr(), &vt, std::ptr::null_mut())
    });
    let cfg = r#"
name: "chk" backend: "checker" max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 3 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "OTHER" data_type: TYPE_INT32 dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
"#;
    s.load("chk", cfg);
    // The FINAL carries only the output the request asked for.
    let r = s.infer(
        s.request("chk")
            .input_i32("IN", &[3], &[0, 0, 0])
            .output("OUT"),
    );
    assert_eq!(r.status(), 0, "{}", r.error());
    assert_eq!(r.output_count(), 1);
    assert_eq!(r.output_i32("OUT"), vec![7]);
    let r = s.infer(s.request("chk").input_i32("IN", &[3], &[0, 0, 0]));
    assert_eq!(r.output_count(), 2);
}

/// Takes a sender on a model that is not decoupled.
unsafe extern "C" fn not_decoupled(_state: *mut c_void, b: *mut Batch) -> u32 {
    let mut s: *mut ResponseSender = std::ptr::null_mut();
    let st = infer_batch_response_sender(b, 0, &mut s);
    infer_batch_set_error_message(b, infer::ffi::infer_last_error_message());
    st
}

#[test]
fn decoupled_configs_that_cannot_work_are_refused() {
    let s = server();
    // A built-in backend cannot send responses apart.
    let st = s.try_load(
        "idd",
        r#"name: "idd" backend: "identity" max_batch_size: 4
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }"#,
    );
    let msg = expect_status(st, INFER_STATUS_UNSUPPORTED);
    assert!(
        msg.contains("model_transaction_policy.decoupled") && msg.contains("'identity'"),
        "{msg}"
    );
    // Ordering across requests cannot be kept.
    let st = s.try_load(
        "rep2",
        &REPEAT
            .replace(
                "dynamic_batching { }",
                "dynamic_batching { preserve_ordering: true }",
            )
            .replace("\"rep\"", "\"rep2\""),
    );
    let msg = expect_status(st, INFER_STATUS_UNSUPPORTED);
    assert!(msg.contains("dynamic_batching.preserve_ordering"), "{msg}");
    // An ensemble takes one response per step.
    let st = s.try_load(
        "ens",
        r#"name: "ens" platform: "ensemble" max_batch_size: 4
input [ { name: "X" data_type: TYPE_INT32 dims: [ 3 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ -1 ] } ]
ensemble_scheduling { step [ { model_name: "rep" model_version: -1
  input_map { key: "IN" value: "X" } output_map { key: "OUT" value: "Y" } } ] }"#,
    );
    let msg = expect_status(st, INFER_STATUS_UNSUPPORTED);
    assert!(msg.contains("composing model 'rep' is decoupled"), "{msg}");
    // A backend of a model that is not decoupled cannot take a sender.
    let vt = infer_backend {
        execute: Some(not_decoupled),
        ..repeat_vtable()
    };
    ok(unsafe { infer_server_register_backend(s.0, c"nd".as_ptr(), &vt, std::ptr::null_mut()) });
    s.load(
        "nd",
        r#"name: "nd" backend: "nd" max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]"#,
    );
    let r = s.infer(s.request("nd").input_i32("IN", &[1], &[1]));
    assert_eq!(r.status(), INFER_STATUS_INVALID_ARGUMENT);
    assert!(
        r.error().contains("model 'nd' is not decoupled"),
        "{}",
        r.error()
    );
}
