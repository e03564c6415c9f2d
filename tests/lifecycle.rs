//! Model lifecycle under load: replace, unload and shutdown never lose or fail an accepted
//! request, and every accepted request gets exactly one FINAL.

mod common;
use common::*;
use infer::ffi::server::*;
use infer::ffi::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

const MAX_PER_THREAD: usize = 5_000;

/// What one load-generator thread saw: accepted ids, and refused enqueues.
type GeneratorResult = (Vec<u64>, Vec<(infer_status, String)>);

/// Enqueues from `threads` threads until `stop`; returns the accepted ids and the
/// statuses of refused enqueues.
fn load_generator(
    s: &Arc<Server>,
    model: &'static str,
    c: &Collector,
    stop: &Arc<AtomicBool>,
    threads: usize,
) -> Vec<std::thread::JoinHandle<GeneratorResult>> {
    (0..threads)
        .map(|_| {
            let (s, c, stop) = (s.clone(), c.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut ids = Vec::new();
                let mut refused = Vec::new();
                // Bounded, so a slow machine does not make the test slower still.
                while !stop.load(Ordering::Relaxed) && ids.len() + refused.len() < MAX_PER_THREAD {
                    let mut r = std::ptr::null_mut();
                    let st = unsafe {
                        infer::ffi::request::infer_request_new(s.0, cs(model).as_ptr(), -1, &mut r)
                    };
                    if st != 0 {
                        refused.push((st, last_error()));
                        continue;
                    }
                    let req = Req(r).input_f32("INPUT0", &[1, 4], &[1.0; 4]).input_f32(
                        "INPUT1",
                        &[1, 4],
                        &[1.0; 4],
                    );
                    match s.enqueue(req, &c) {
                        Ok(id) => ids.push(id),
                        Err(e) => refused.push(e),
                    }
                    // Paced so that the load spans the lifecycle changes under test.
                    if (ids.len() + refused.len()) % 16 == 0 {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
                (ids, refused)
            })
        })
        .collect()
}

fn delayed_config(delay_us: u32) -> String {
    add_sub_config(
        "m",
        &format!(
            r#"dynamic_batching {{ max_queue_delay_microseconds: 100 }}
instance_group [ {{ count: 2 }} ]
parameters {{ key: "execute_delay_us" value {{ string_value: "{delay_us}" }} }}"#
        ),
    )
}

#[test]
fn replace_under_load_loses_nothing() {
    let s = Arc::new(Server::new());
    s.load("m", &delayed_config(300));
    let c = Collector::new();
    let stop = Arc::new(AtomicBool::new(false));
    let gens = load_generator(&s, "m", &c, &stop, 3);
    for i in 0..5 {
        std::thread::sleep(Duration::from_millis(40));
        s.load("m", &delayed_config(200 + i * 50));
    }
    stop.store(true, Ordering::Relaxed);
    let mut ids = Vec::new();
    for g in gens {
        let (mut i, refused) = g.join().unwrap();
        assert!(refused.is_empty(), "refused during replace: {refused:?}");
        ids.append(&mut i);
    }
    assert!(ids.len() > 100, "too little load: {}", ids.len());
    c.wait(ids.len());
    std::thread::sleep(Duration::from_millis(20));
    c.assert_exactly_once(&ids);
    assert!(c.take().iter().all(|r| r.status() == 0));
}

#[test]
fn unload_under_load_answers_every_accepted_request() {
    let s = Arc::new(Server::new());
    s.load("m", &delayed_config(500));
    let c = Collector::new();
    let stop = Arc::new(AtomicBool::new(false));
    let gens = load_generator(&s, "m", &c, &stop, 2);
    std::thread::sleep(Duration::from_millis(50));
    ok(unsafe { infer_server_unload_model(s.0, cs("m").as_ptr()) });
    std::thread::sleep(Duration::from_millis(10));
    stop.store(true, Ordering::Relaxed);
    let mut ids = Vec::new();
    for g in gens {
        let (mut i, refused) = g.join().unwrap();
        for (st, msg) in refused {
            assert!(
                st == INFER_STATUS_NOT_FOUND || st == INFER_STATUS_UNAVAILABLE,
                "{st}: {msg}"
            );
            assert!(msg.contains("'m'"), "{msg}");
        }
        ids.append(&mut i);
    }
    c.wait(ids.len());
    std::thread::sleep(Duration::from_millis(20));
    c.assert_exactly_once(&ids);
    // Unload drains: everything accepted before it ran.
    assert!(c.take().iter().all(|r| r.status() == 0));
    let mut ready = true;
    ok(unsafe { infer_server_model_ready(s.0, cs("m").as_ptr(), -1, &mut ready) });
    assert!(!ready);
    expect_status(
        unsafe { infer_server_unload_model(s.0, cs("m").as_ptr()) },
        INFER_STATUS_NOT_FOUND,
    );
}

#[test]
fn shutdown_under_load_is_exactly_once() {
    let s = Arc::new(Server::new());
    s.load("m", &delayed_config(1000));
    let c = Collector::new();
    let stop = Arc::new(AtomicBool::new(false));
    let gens = load_generator(&s, "m", &c, &stop, 2);
    std::thread::sleep(Duration::from_millis(50));
    ok(unsafe { infer_server_shutdown(s.0, 5) });
    stop.store(true, Ordering::Relaxed);
    let mut ids = Vec::new();
    for g in gens {
        let (mut i, refused) = g.join().unwrap();
        for (st, _) in refused {
            assert!(
                st == INFER_STATUS_UNAVAILABLE || st == INFER_STATUS_NOT_FOUND,
                "status {st}"
            );
        }
        ids.append(&mut i);
    }
    // shutdown returned: every accepted request already has its FINAL.
    assert_eq!(c.finals(), ids.len());
    c.assert_exactly_once(&ids);
    for r in c.take() {
        assert!(
            r.status() == 0 || r.status() == INFER_STATUS_CANCELLED,
            "{}",
            r.error()
        );
    }
    // Idempotent, and enqueue is refused afterwards.
    ok(unsafe { infer_server_shutdown(s.0, 5) });
    let mut r = std::ptr::null_mut();
    let st = unsafe { infer::ffi::request::infer_request_new(s.0, cs("m").as_ptr(), -1, &mut r) };
    assert_ne!(st, 0);
}

#[test]
fn shutdown_cancels_what_cannot_finish_in_time() {
    let s = Server::new();
    s.load("m", &add_sub_config("m", "dynamic_batching { }"));
    s.pause("m");
    let c = Collector::new();
    let ids: Vec<u64> = (0..5)
        .map(|_| {
            s.enqueue(add_sub_request(&s, "m", [0.; 4], [0.; 4]), &c)
                .unwrap()
        })
        .collect();
    // Shutdown resumes a paused model to drain it; with a zero timeout what is still
    // queued is cancelled. Either way each request ends exactly once.
    ok(unsafe { infer_server_shutdown(s.0, 0) });
    c.assert_exactly_once(&ids);
    let r = s.request_after_shutdown();
    assert_eq!(r, INFER_STATUS_UNAVAILABLE);
}

#[test]
fn enqueue_after_shutdown_is_unavailable() {
    let s = Server::new();
    s.load("m", &add_sub_config("m", "dynamic_batching { }"));
    let req = add_sub_request(&s, "m", [0.; 4], [0.; 4]);
    ok(unsafe { infer_server_shutdown(s.0, 100) });
    let c = Collector::new();
    let (st, msg) = s.enqueue(req, &c).unwrap_err();
    assert_eq!(st, INFER_STATUS_UNAVAILABLE);
    assert!(msg.contains("shutting down"), "{msg}");
    std::thread::sleep(Duration::from_millis(5));
    assert_eq!(c.finals(), 0, "a refused enqueue must never call back");
}

#[test]
fn replace_with_a_bad_config_keeps_the_old_model() {
    let s = Server::new();
    s.load("m", &add_sub_config("m", ""));
    let bad = add_sub_config("m", "").replace("TYPE_FP32", "TYPE_NOPE");
    assert_ne!(s.try_load("m", &bad), 0);
    let r = s.infer(add_sub_request(&s, "m", [1.; 4], [1.; 4]));
    assert_eq!(r.status(), 0);
}

#[test]
fn versions_from_a_repository() {
    let dir = std::env::temp_dir().join(format!("infer-repo-{}", std::process::id()));
    let model = dir.join("m");
    for v in ["1", "2", "3"] {
        std::fs::create_dir_all(model.join(v)).unwrap();
    }
    std::fs::write(
        model.join("config.pbtxt"),
        add_sub_config("m", "version_policy { latest { num_versions: 2 } }"),
    )
    .unwrap();
    let mut opts = std::ptr::null_mut();
    ok(unsafe { infer_server_options_new(&mut opts) });
    ok(unsafe {
        infer_server_options_set_model_repository(opts, cs(dir.to_str().unwrap()).as_ptr())
    });
    let s = Server::with_options(opts);
    unsafe { infer_server_options_free(opts) };
    let ready = |v: i64| {
        let mut r = false;
        ok(unsafe { infer_server_model_ready(s.0, cs("m").as_ptr(), v, &mut r) });
        r
    };
    assert!(!ready(1));
    assert!(ready(2));
    assert!(ready(3));
    assert!(ready(-1));
    let r = s.infer(add_sub_request(&s, "m", [1.; 4], [1.; 4]));
    assert_eq!(
        unsafe { infer::ffi::response::infer_response_model_version(r.0) },
        3
    );
    let mut req = std::ptr::null_mut();
    ok(unsafe { infer::ffi::request::infer_request_new(s.0, cs("m").as_ptr(), 1, &mut req) });
    let req =
        Req(req)
            .input_f32("INPUT0", &[1, 4], &[0.; 4])
            .input_f32("INPUT1", &[1, 4], &[0.; 4]);
    let (st, msg) = s.enqueue(req, &Collector::new()).unwrap_err();
    assert_eq!(st, INFER_STATUS_NOT_FOUND);
    assert!(msg.contains("version 1"), "{msg}");
    drop(s);
    let _ = std::fs::remove_dir_all(dir);
}

trait AfterShutdown {
    fn request_after_shutdown(&self) -> infer_status;
}
impl AfterShutdown for Server {
    fn request_after_shutdown(&self) -> infer_status {
        let mut r = std::ptr::null_mut();
        unsafe { infer::ffi::request::infer_request_new(self.0, cs("m").as_ptr(), -1, &mut r) }
    }
}

unsafe extern "C" fn unload_other_then_free(
    ud: *mut std::ffi::c_void,
    resp: *mut Response,
    _flags: u32,
) {
    std::thread::sleep(Duration::from_millis(50));
    let s = ud as *mut ServerHandle;
    let st = infer_server_unload_model(s, c"other".as_ptr());
    CALLBACK_UNLOAD.store(st, Ordering::SeqCst);
    infer::ffi::response::infer_response_free(resp);
}

/// Status of the last unload a callback made (99 = none yet).
static CALLBACK_UNLOAD: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(99);

/// Runs `f` on a thread and fails the test if it does not finish in 10 s (a deadlock).
fn finishes<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(10))
        .unwrap_or_else(|_| panic!("{what} did not finish: deadlock"))
}

/// Loads "a" and "other", and enqueues to "a" a request whose callback unloads "other".
fn callback_will_unload_other(s: &Server) {
    s.load("a", &add_sub_config("a", "dynamic_batching { }"));
    s.load("other", &add_sub_config("other", "dynamic_batching { }"));
    let r = add_sub_request(s, "a", [0.; 4], [0.; 4]);
    let ud = s.0 as *mut std::ffi::c_void;
    let f = Some(unload_other_then_free as unsafe extern "C" fn(_, _, _));
    ok(unsafe { infer_server_enqueue(s.0, r.take(), f, ud, std::ptr::null_mut()) });
    std::thread::sleep(Duration::from_millis(10));
}

#[test]
fn lifecycle_calls_from_callbacks_do_not_deadlock() {
    let s = Arc::new(Server::new());
    callback_will_unload_other(&s);
    // Unloading "a" waits for its callback, which unloads "other".
    let s2 = s.clone();
    let st = finishes("unload(a)", move || unsafe {
        infer_server_unload_model(s2.0, cs("a").as_ptr())
    });
    assert_eq!(st, 0);
    assert_eq!(CALLBACK_UNLOAD.load(Ordering::SeqCst), 0);
    let mut ready = true;
    ok(unsafe { infer_server_model_ready(s.0, cs("other").as_ptr(), -1, &mut ready) });
    assert!(!ready);

    // The same during shutdown.
    callback_will_unload_other(&s);
    let s2 = s.clone();
    let st = finishes("shutdown", move || unsafe {
        infer_server_shutdown(s2.0, 1000)
    });
    assert_eq!(st, 0);
    // Shutdown took the models out of the registry first: the callback's unload found
    // nothing to do, and did not block.
    assert_eq!(
        CALLBACK_UNLOAD.load(Ordering::SeqCst),
        INFER_STATUS_NOT_FOUND
    );
}

unsafe extern "C" fn log_unloads(
    ud: *mut std::ffi::c_void,
    _level: u32,
    msg: *const std::ffi::c_char,
) {
    let msg = std::ffi::CStr::from_ptr(msg).to_string_lossy();
    if msg.contains("'x' loaded") {
        let s = *(ud as *const *mut ServerHandle);
        infer_server_unload_model(s, c"x".as_ptr());
    }
}

#[test]
fn log_callback_may_call_back_into_the_server() {
    let handle: Box<*mut ServerHandle> = Box::new(std::ptr::null_mut());
    let hp = Box::into_raw(handle);
    let mut opts = std::ptr::null_mut();
    ok(unsafe { infer_server_options_new(&mut opts) });
    ok(unsafe {
        infer_server_options_set_log_callback(
            opts,
            INFER_LOG_INFO,
            Some(log_unloads),
            hp as *mut std::ffi::c_void,
        )
    });
    let s = Arc::new(Server::with_options(opts));
    unsafe { infer_server_options_free(opts) };
    unsafe { *hp = s.0 };
    let s2 = s.clone();
    let st = finishes("load(x)", move || {
        s2.try_load("x", &add_sub_config("x", ""))
    });
    assert_eq!(st, 0);
    drop(s);
    unsafe { drop(Box::from_raw(hp)) };
}

#[test]
fn request_created_before_a_replace_runs_on_the_new_version() {
    let s = Server::new();
    let cfg = r#"name: "r" backend: "identity" max_batch_size: 4
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] reshape { shape: [ 2, 2 ] } } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] reshape { shape: [ 2, 2 ] } } ]"#;
    s.load("r", cfg);
    let req = s.request("r").input_f32("X", &[1, 4], &[1., 2., 3., 4.]);
    s.load("r", cfg);
    let c = Collector::new();
    let id = s.enqueue(req, &c).unwrap();
    c.wait(1);
    c.assert_exactly_once(&[id]);
    let r = c.take().pop().unwrap();
    assert_eq!(r.status(), 0, "{}", r.error());
    assert_eq!(r.output("Y").unwrap().0, vec![1, 4]);
    assert_eq!(r.output_f32("Y"), vec![1., 2., 3., 4.]);
}

static WARM_CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static WARM_ROWS: std::sync::Mutex<Vec<(u32, Vec<f32>)>> = std::sync::Mutex::new(Vec::new());

/// Records each batch's size and IN values; IN[0] == 7 fails the batch. OUT = IN.
fn warm_record(b: &mut infer::backend::Batch) -> infer::status::Result<()> {
    WARM_CALLS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let (t, data) = b.input("IN").expect("IN");
    let shape = t.shape.to_vec();
    let v: Vec<f32> = bytemuck::pod_collect_to_vec(data);
    WARM_ROWS.lock().unwrap().push((b.size, v.clone()));
    if v.first() == Some(&7.0) {
        return Err(infer::status::Error::invalid("seven is not warm"));
    }
    let out = b.alloc_output("OUT", &shape, None)?;
    out.copy_from_slice(bytemuck::cast_slice(&v));
    Ok(())
}

/// `model_warmup` as Triton runs it: each instance executes each sample `count` times
/// before the model is ready (zeros, random values, or a file under `warmup/`), and a
/// sample that fails fails the load naming it and the instance.
#[test]
fn model_warmup_runs_every_sample_on_every_instance_before_ready() {
    use std::sync::atomic::Ordering::SeqCst;
    let s = Server::new();
    s.register_fn_backend("warm", warm_record);
    let dir = temp_dir("warmup");
    std::fs::create_dir_all(dir.join("1")).unwrap();
    std::fs::create_dir_all(dir.join("warmup")).unwrap();
    let seven: Vec<u8> = [7.0f32, 1.0, 2.0, 3.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let ones: Vec<u8> = [1.0f32; 8].iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(dir.join("warmup/seven"), &seven).unwrap();
    std::fs::write(dir.join("warmup/ones"), &ones).unwrap();
    let config = |samples: &str| {
        format!(
            r#"name: "w" backend: "warm" max_batch_size: 4
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ count: 2 kind: KIND_CPU }} ]
model_warmup [ {samples} ]"#
        )
    };
    let sample = |name: &str, batch: u32, count: u32, data: &str| {
        format!(
            r#"{{ name: "{name}" batch_size: {batch} count: {count} inputs {{ key: "IN" value {{ data_type: TYPE_FP32 dims: [ 4 ] {data} }} }} }}"#
        )
    };
    let ok_samples = [
        sample("zeros", 3, 2, "zero_data: true"),
        sample("noise", 1, 0, "random_data: true"),
        sample("file", 2, 1, r#"input_data_file: "ones""#),
    ]
    .join(", ");
    WARM_CALLS.store(0, SeqCst);
    WARM_ROWS.lock().unwrap().clear();
    assert_eq!(
        s.try_load_dir("w", &config(&ok_samples), &dir),
        INFER_STATUS_OK,
        "{}",
        last_error()
    );
    // 2 instances x (2 + 1 + 1) executions, before the load returned.
    assert_eq!(WARM_CALLS.load(SeqCst), 8);
    let rows = WARM_ROWS.lock().unwrap().clone();
    assert_eq!(
        rows.iter()
            .filter(|(n, v)| *n == 3 && v.iter().all(|&x| x == 0.0))
            .count(),
        4
    );
    let noise: Vec<_> = rows.iter().filter(|(n, _)| *n == 1).collect();
    assert_eq!(noise.len(), 2);
    assert!(
        noise[0].1.iter().all(|x| (-1.0..1.0).contains(x)) && noise[0].1.iter().any(|&x| x != 0.0)
    );
    assert_eq!(
        rows.iter()
            .filter(|(n, v)| *n == 2 && v.iter().all(|&x| x == 1.0))
            .count(),
        2
    );
    // Warmup executions are not counted as inferences.
    assert_eq!(s.stats("w")["models"][0]["inference_count"], 0);
    // A failing sample fails the load, naming it; the model is not loaded.
    let bad = [
        sample("zeros", 1, 1, "zero_data: true"),
        sample("sevens", 1, 1, r#"input_data_file: "seven""#),
    ]
    .join(", ");
    s.unload("w");
    let st = s.try_load_dir("w", &config(&bad), &dir);
    let msg = last_error();
    assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{msg}");
    assert!(
        msg.contains("warmup sample 'sevens'") && msg.contains("seven is not warm"),
        "{msg}"
    );
    // Bad samples are refused at load, naming the field.
    for (samples, want) in [
        (sample("big", 9, 1, "zero_data: true"), "batch_size"),
        (sample("nodata", 1, 1, ""), "no data"),
        (sample("short", 4, 1, r#"input_data_file: "seven""#), "has 16 bytes"),
        (sample("missing", 1, 1, r#"input_data_file: "nope""#), "nope"),
        (
            r#"{ name: "other" batch_size: 1 inputs { key: "X" value { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } } }"#.to_string(),
            "not an input",
        ),
    ] {
        let st = s.try_load_dir("w", &config(&samples), &dir);
        let msg = last_error();
        assert_ne!(st, INFER_STATUS_OK, "{samples}");
        assert!(msg.contains(want), "{samples}: {msg}");
    }
    // An ensemble's warmup is refused, naming the field.
    let ens = r#"name: "e" platform: "ensemble" max_batch_size: 4
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [ { model_name: "w" model_version: -1 input_map { key: "IN" value: "X" } output_map { key: "OUT" value: "Y" } } ] }
model_warmup [ { name: "z" batch_size: 1 inputs { key: "X" value { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } } } ]"#;
    assert_eq!(s.try_load("e", ens), INFER_STATUS_UNSUPPORTED);
    assert!(last_error().contains("model_warmup"), "{}", last_error());
    let _ = std::fs::remove_dir_all(&dir);
}
