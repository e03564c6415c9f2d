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

fn ready(s: &Server, name: &str, version: i64) -> bool {
    let mut r = false;
    ok(unsafe { infer_server_model_ready(s.0, cs(name).as_ptr(), version, &mut r) });
    r
}

/// The repository index as (name, version, state, reason) tuples.
fn index(s: &Server, ready_only: bool) -> Vec<(String, String, String, String)> {
    let mut out = std::ptr::null_mut();
    ok(unsafe { infer_server_repository_index_json(s.0, ready_only, &mut out) });
    let text = unsafe { std::ffi::CStr::from_ptr(out) }
        .to_str()
        .unwrap()
        .to_owned();
    unsafe { infer_string_free(out) };
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let f = |k: &str| e.get(k).and_then(|x| x.as_str()).unwrap_or("").to_owned();
            (f("name"), f("version"), f("state"), f("reason"))
        })
        .collect()
}

fn repository_options(repo: &std::path::Path, explicit: bool, poll_ms: u64) -> *mut ServerOptions {
    let mut opts = std::ptr::null_mut();
    ok(unsafe { infer_server_options_new(&mut opts) });
    ok(unsafe {
        infer_server_options_set_model_repository(opts, cs(repo.to_str().unwrap()).as_ptr())
    });
    ok(unsafe { infer_server_options_set_model_control_explicit(opts, explicit) });
    ok(unsafe { infer_server_options_set_repository_poll_ms(opts, poll_ms) });
    opts
}

fn write_model(repo: &std::path::Path, name: &str, config: &str, versions: &[&str]) {
    let d = repo.join(name);
    std::fs::create_dir_all(&d).unwrap();
    for v in versions {
        std::fs::create_dir_all(d.join(v)).unwrap();
    }
    std::fs::write(d.join("config.pbtxt"), config).unwrap();
}

/// Triton's repository index: every model of the repository and every loaded one, each
/// version with its state, and the reason of the last failure.
#[test]
fn the_repository_index_names_every_model_its_state_and_reason() {
    let repo = temp_dir("index");
    write_model(
        &repo,
        "a",
        &add_sub_config("a", "version_policy { all { } }"),
        &["1", "2"],
    );
    write_model(
        &repo,
        "b",
        "name: \"b\" backend: \"add_sub\" max_batch_size: -3",
        &[],
    );
    write_model(&repo, "c", &add_sub_config("c", ""), &[]);
    let opts = repository_options(&repo, true, 0);
    ok(unsafe { infer_server_options_add_startup_model(opts, c"a".as_ptr()) });
    let s = Server::with_options(opts);
    unsafe { infer_server_options_free(opts) };
    let e = |n: &str, v: &str, st: &str, r: &str| (n.into(), v.into(), st.into(), r.into());
    assert_eq!(
        index(&s, false),
        vec![
            e("a", "1", "READY", ""),
            e("a", "2", "READY", ""),
            e("b", "", "UNAVAILABLE", "not loaded"),
            e("c", "", "UNAVAILABLE", "not loaded"),
        ]
    );
    // A failed load: its reason, until a load succeeds.
    let from_repository =
        unsafe { infer_server_load_model(s.0, c"b".as_ptr(), std::ptr::null(), std::ptr::null()) };
    assert_ne!(from_repository, INFER_STATUS_OK);
    let err = last_error();
    let b = index(&s, false).into_iter().find(|x| x.0 == "b").unwrap();
    assert_eq!((b.2.as_str(), b.3.as_str()), ("UNAVAILABLE", err.as_str()));
    assert!(err.contains("max_batch_size"), "{err}");
    // Loaded with a config of the application's own (Triton's load with a config
    // override), and one that has no folder at all.
    s.load("c", &add_sub_config("c", ""));
    s.load("z", &add_sub_config("z", ""));
    s.unload("a");
    assert_eq!(
        index(&s, false),
        vec![
            e("a", "", "UNAVAILABLE", "unloaded"),
            e("b", "", "UNAVAILABLE", &err),
            e("c", "1", "READY", ""),
            e("z", "1", "READY", ""),
        ]
    );
    assert_eq!(
        index(&s, true),
        vec![e("c", "1", "READY", ""), e("z", "1", "READY", "")]
    );
    // A reload that fails leaves the model serving and says why.
    assert_ne!(
        s.try_load("c", "name: \"c\" backend: \"add_sub\" max_batch_size: -1"),
        INFER_STATUS_OK
    );
    let c = index(&s, false).into_iter().find(|x| x.0 == "c").unwrap();
    assert_eq!(c.2, "READY");
    assert!(
        c.3.starts_with("serving; its last load failed: "),
        "{}",
        c.3
    );
    assert!(ready(&s, "c", 1));

    // LOADING while a load runs (a warmup of 0.4 s), UNLOADING while a request drains.
    let slow = add_sub_config(
        "slow",
        r#"parameters { key: "execute_delay_us" value { string_value: "400000" } }
model_warmup [ { name: "w" batch_size: 1 inputs { key: "INPUT0" value { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } } inputs { key: "INPUT1" value { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } } } ]"#,
    );
    let s = Arc::new(s);
    let seen = |s: &Arc<Server>, name: &str, state: &str, during: std::thread::JoinHandle<()>| {
        let mut found = false;
        while !during.is_finished() {
            found |= index(s, false).iter().any(|x| x.0 == name && x.2 == state);
            std::thread::sleep(Duration::from_millis(5));
        }
        during.join().unwrap();
        found
    };
    let loader = {
        let (s, slow) = (s.clone(), slow.clone());
        std::thread::spawn(move || s.load("slow", &slow))
    };
    assert!(seen(&s, "slow", "LOADING", loader), "no LOADING entry seen");
    let c = Collector::new();
    let id = s
        .enqueue(add_sub_request(&s, "slow", [1.; 4], [1.; 4]), &c)
        .unwrap();
    let unloader = {
        let s = s.clone();
        std::thread::spawn(move || s.unload("slow"))
    };
    assert!(
        seen(&s, "slow", "UNLOADING", unloader),
        "no UNLOADING entry seen"
    );
    c.wait(1);
    c.assert_exactly_once(&[id]);
    assert!(c.take().iter().all(|r| r.status() == 0));
    assert!(!index(&s, false)
        .iter()
        .any(|x| x.0 == "slow" && x.2 != "UNAVAILABLE"));
    drop(s);
    let _ = std::fs::remove_dir_all(repo);
}

/// Polling the repository: new folders load, changed ones reload, removed ones unload,
/// and a request sent all the while is never refused or failed.
#[test]
fn polling_follows_the_repository_without_failing_a_request() {
    let repo = temp_dir("poll");
    write_model(&repo, "m", &delayed_config(200), &[]);
    let s = Arc::new(Server::with_options({
        let o = repository_options(&repo, false, 0);
        // Poll by hand here; the option is checked below.
        ok(unsafe { infer_server_options_set_repository_poll_ms(o, 0) });
        o
    }));
    let poll = |s: &Server| unsafe { infer_server_poll_repository(s.0) };
    let c = Collector::new();
    let stop = Arc::new(AtomicBool::new(false));
    let gens = load_generator(&s, "m", &c, &stop, 2);
    ok(poll(&s)); // Nothing changed.

    write_model(&repo, "n", &add_sub_config("n", ""), &[]);
    assert!(!ready(&s, "n", -1));
    ok(poll(&s));
    assert!(ready(&s, "n", -1));

    // m changes: a second version and a policy that serves both.
    std::thread::sleep(Duration::from_millis(30));
    write_model(
        &repo,
        "m",
        &format!("{}\nversion_policy {{ all {{ }} }}", delayed_config(150)),
        &["1", "2"],
    );
    ok(poll(&s));
    assert!(ready(&s, "m", 1) && ready(&s, "m", 2));

    // n's folder goes: unloaded.
    std::fs::remove_dir_all(repo.join("n")).unwrap();
    ok(poll(&s));
    assert!(!ready(&s, "n", -1));
    assert!(!index(&s, false).iter().any(|x| x.0 == "n"));

    // A broken folder: the poll says which and why, and does not try it again until
    // it changes.
    write_model(
        &repo,
        "x",
        "name: \"x\" backend: \"add_sub\" max_batch_size: -2",
        &[],
    );
    assert_eq!(poll(&s), INFER_STATUS_INVALID_ARGUMENT);
    let err = last_error();
    assert!(
        err.starts_with("repository poll: ") && err.contains("'x'"),
        "{err}"
    );
    ok(poll(&s));
    std::thread::sleep(Duration::from_millis(30));
    write_model(&repo, "x", &add_sub_config("x", ""), &[]);
    ok(poll(&s));
    assert!(ready(&s, "x", -1));

    // The application's unload stands until the folder changes.
    s.unload("x");
    ok(poll(&s));
    assert!(!ready(&s, "x", -1));
    assert!(index(&s, false).contains(&(
        "x".into(),
        "".into(),
        "UNAVAILABLE".into(),
        "unloaded".into()
    )));
    // A model the application loaded with its own config is not the poll's.
    s.load("n", &add_sub_config("n", ""));
    ok(poll(&s));
    assert!(ready(&s, "n", -1));

    stop.store(true, Ordering::Relaxed);
    let mut ids = Vec::new();
    for g in gens {
        let (mut i, refused) = g.join().unwrap();
        assert!(refused.is_empty(), "refused while polling: {refused:?}");
        ids.append(&mut i);
    }
    c.wait(ids.len());
    std::thread::sleep(Duration::from_millis(20));
    c.assert_exactly_once(&ids);
    assert!(c.take().iter().all(|r| r.status() == 0));
    drop(s);

    // A poll period: a new folder is found without a call.
    let s = Server::with_options(repository_options(&repo, false, 20));
    write_model(&repo, "later", &add_sub_config("later", ""), &[]);
    let t0 = std::time::Instant::now();
    while !ready(&s, "later", -1) && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        ready(&s, "later", -1),
        "the poll thread did not load 'later'"
    );
    drop(s);

    // Explicit model control: no polling, and no poll period.
    let o = repository_options(&repo, true, 0);
    let s = Server::with_options(o);
    assert_eq!(poll(&s), INFER_STATUS_UNAVAILABLE);
    assert!(last_error().contains("explicit model control"));
    drop(s);
    ok(unsafe { infer_server_options_set_repository_poll_ms(o, 100) });
    let mut raw = std::ptr::null_mut();
    assert_eq!(
        unsafe { infer_server_new(o, &mut raw) },
        INFER_STATUS_INVALID_ARGUMENT
    );
    assert!(last_error().contains("explicit model control"));
    unsafe { infer_server_options_free(o) };
    let _ = std::fs::remove_dir_all(repo);
}

/// Triton's version_policy over several version folders, with the config given by the
/// application and the files read from the repository.
#[test]
fn version_policies_choose_among_version_folders() {
    let repo = temp_dir("versions");
    write_model(&repo, "m", &add_sub_config("m", ""), &["1", "2", "3", "10"]);
    let s = Server::with_options(repository_options(&repo, true, 0));
    let served = |s: &Server| -> Vec<i64> {
        [1, 2, 3, 10]
            .into_iter()
            .filter(|&v| ready(s, "m", v))
            .collect()
    };
    for (policy, want) in [
        ("", vec![10]),
        (
            "version_policy { latest { num_versions: 3 } }",
            vec![2, 3, 10],
        ),
        ("version_policy { all { } }", vec![1, 2, 3, 10]),
        (
            "version_policy { specific { versions: [ 1, 3 ] } }",
            vec![1, 3],
        ),
    ] {
        s.load("m", &add_sub_config("m", policy));
        assert_eq!(served(&s), want, "{policy}");
        let newest = *want.last().unwrap();
        let r = s.infer(add_sub_request(&s, "m", [1.; 4], [1.; 4]));
        assert_eq!(
            unsafe { infer::ffi::response::infer_response_model_version(r.0) },
            newest
        );
    }
    assert_eq!(
        s.try_load(
            "m",
            &add_sub_config("m", "version_policy { specific { versions: [ 4 ] } }")
        ),
        INFER_STATUS_NOT_FOUND
    );
    assert!(last_error().contains("version 4"), "{}", last_error());
    assert_eq!(served(&s), vec![1, 3]);
    drop(s);
    let _ = std::fs::remove_dir_all(repo);
}

/// The private folders of models loaded from memory, of this process.
fn memory_folders() -> usize {
    let prefix = format!("libinfer-model-{}-", std::process::id());
    std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .count()
}

/// A file for `infer_server_load_model_files`: path, contents (None: NULL), size.
type MemFile<'a> = (&'a str, Option<&'a [u8]>, usize);

fn load_files(s: &Server, name: &str, config: &str, files: &[MemFile<'_>]) -> infer_status {
    let paths: Vec<std::ffi::CString> = files.iter().map(|f| cs(f.0)).collect();
    let path_ptrs: Vec<*const std::ffi::c_char> = paths.iter().map(|p| p.as_ptr()).collect();
    let data: Vec<*const u8> = files
        .iter()
        .map(|f| f.1.map_or(std::ptr::null(), |d| d.as_ptr()))
        .collect();
    let sizes: Vec<usize> = files.iter().map(|f| f.2).collect();
    unsafe {
        infer_server_load_model_files(
            s.0,
            cs(name).as_ptr(),
            cs(config).as_ptr(),
            path_ptrs.as_ptr(),
            data.as_ptr(),
            sizes.as_ptr(),
            files.len(),
        )
    }
}

/// Triton's load with files in memory (`file:1/model.onnx`): the model serves from a
/// private copy that goes with it.
#[test]
fn a_model_loads_from_files_in_memory() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/add_sub");
    let onnx = std::fs::read(root.join("1/model.onnx")).unwrap();
    let config = std::fs::read_to_string(root.join("config.pbtxt"))
        .unwrap()
        .replace("name: \"add_sub\"", "name: \"mem\"");
    let s = Server::new();
    assert_eq!(memory_folders(), 0);
    ok(load_files(
        &s,
        "mem",
        &config,
        &[("file:1/model.onnx", Some(&onnx), onnx.len())],
    ));
    assert_eq!(memory_folders(), 1);
    let a: Vec<f32> = (0..16).map(|i| i as f32).collect();
    let r = s.infer(
        s.request("mem")
            .input_f32("INPUT0", &[1, 16], &a)
            .input_f32("INPUT1", &[1, 16], &[1.0; 16]),
    );
    assert_eq!(r.status(), 0, "{}", r.error());
    let want: Vec<f32> = a.iter().map(|x| x + 1.0).collect();
    assert_eq!(r.output_f32("OUTPUT0"), want);
    drop(r);
    // Replaced from memory again: the old copy goes once the new one serves.
    ok(load_files(
        &s,
        "mem",
        &config,
        &[("1/model.onnx", Some(&onnx), onnx.len())],
    ));
    assert_eq!(memory_folders(), 1);
    s.unload("mem");
    assert_eq!(memory_folders(), 0);

    // Refused, naming the file at fault; nothing is left behind.
    let cases: [(&[MemFile<'_>], infer_status, &str); 5] = [
        (
            &[("../model.onnx", Some(&onnx), onnx.len())],
            INFER_STATUS_INVALID_ARGUMENT,
            "'../model.onnx'",
        ),
        (
            &[("/1/model.onnx", Some(&onnx), onnx.len())],
            INFER_STATUS_INVALID_ARGUMENT,
            "'/1/model.onnx'",
        ),
        (
            &[
                ("1/model.onnx", Some(&onnx), onnx.len()),
                ("file:1/model.onnx", Some(&onnx), 1),
            ],
            INFER_STATUS_INVALID_ARGUMENT,
            "given twice",
        ),
        (
            &[("1/model.onnx", None, 5)],
            INFER_STATUS_INVALID_ARGUMENT,
            "contents[0]",
        ),
        (
            &[("1/model.onnx", Some(&onnx[..100]), 100)],
            INFER_STATUS_INVALID_ARGUMENT,
            "mem",
        ),
    ];
    for (files, want, says) in cases {
        let st = load_files(&s, "mem", &config, files);
        let err = last_error();
        assert_eq!(st, want, "{err}");
        assert!(err.contains(says), "{err}");
        assert_eq!(memory_folders(), 0, "{err}");
    }
    let st = unsafe {
        infer_server_load_model_files(
            s.0,
            c"mem".as_ptr(),
            std::ptr::null(),
            std::ptr::null(),
            std::ptr::null(),
            std::ptr::null(),
            0,
        )
    };
    assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT);
    assert!(last_error().contains("config_text"));
}
