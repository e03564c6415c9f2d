//! The rate limiter (Triton's `--rate-limit=execution_count`): instances take the
//! resources their `instance_group.rate_limiter` names before each batch, across models,
//! and priorities weight their turns. Off (the default), the field has no effect.

mod common;
use common::*;
use infer::ffi::backend::*;
use infer::ffi::custom::infer_backend;
use infer::ffi::server::*;
use infer::ffi::*;
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Executions running now and the most seen at once.
static RUNNING: AtomicUsize = AtomicUsize::new(0);
static MOST: AtomicUsize = AtomicUsize::new(0);
/// Executions by instance index.
static BY_INSTANCE: [AtomicUsize; 4] = [const { AtomicUsize::new(0) }; 4];
static TURN: Mutex<()> = Mutex::new(());

unsafe extern "C" fn init(
    _ud: *mut c_void,
    _model: *const std::ffi::c_char,
    _json: *const std::ffi::c_char,
    index: u32,
    _gpu: i32,
    state: *mut *mut c_void,
) -> u32 {
    *state = index as usize as *mut c_void;
    0
}

/// Takes 3 ms; answers OUT = IN.
unsafe extern "C" fn slow(state: *mut c_void, b: *mut Batch) -> u32 {
    let now = RUNNING.fetch_add(1, Ordering::SeqCst) + 1;
    MOST.fetch_max(now, Ordering::SeqCst);
    std::thread::sleep(std::time::Duration::from_millis(3));
    RUNNING.fetch_sub(1, Ordering::SeqCst);
    if let Some(n) = BY_INSTANCE.get(state as usize) {
        n.fetch_add(1, Ordering::SeqCst);
    }
    let (mut shape, mut nd, mut data, mut bytes) =
        (std::ptr::null(), 0usize, std::ptr::null(), 0usize);
    let st = infer_batch_input(
        b,
        c"IN".as_ptr(),
        std::ptr::null_mut(),
        &mut shape,
        &mut nd,
        &mut data,
        &mut bytes,
    );
    if st != 0 {
        return st;
    }
    let mut out: *mut c_void = std::ptr::null_mut();
    let st = infer_batch_output(b, c"OUT".as_ptr(), shape, nd, &mut out);
    if st != 0 {
        return st;
    }
    std::ptr::copy_nonoverlapping(data as *const u8, out as *mut u8, bytes);
    0
}

fn server(rate_limit: u32, resources: &[(&str, u32, i32)]) -> Server {
    let mut o = std::ptr::null_mut();
    ok(unsafe { infer_server_options_new(&mut o) });
    ok(unsafe { infer_server_options_set_rate_limit(o, rate_limit) });
    for (name, count, device) in resources {
        ok(unsafe {
            infer_server_options_add_rate_limit_resource(o, cs(name).as_ptr(), *count, *device)
        });
    }
    let s = Server::with_options(o);
    unsafe { infer_server_options_free(o) };
    let vt = infer_backend {
        struct_size: std::mem::size_of::<infer_backend>() as u32,
        instance_init: Some(init),
        execute: Some(slow),
        instance_fini: None,
        finalize: None,
    };
    ok(unsafe { infer_server_register_backend(s.0, c"slow".as_ptr(), &vt, std::ptr::null_mut()) });
    s
}

fn config(name: &str, groups: &str) -> String {
    format!(
        r#"name: "{name}" backend: "slow" max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
instance_group [ {groups} ]"#
    )
}

const ONE_R: &str = r#"{ count: 1 kind: KIND_CPU rate_limiter { resources [ { name: "R" global: true count: 1 } ] } }"#;

/// Sends `n` requests to each model at once and waits for them; the most executions
/// seen running at once.
fn most_at_once(s: &Server, models: &[&str], n: usize) -> usize {
    RUNNING.store(0, Ordering::SeqCst);
    MOST.store(0, Ordering::SeqCst);
    let c = Collector::new();
    for _ in 0..n {
        for m in models {
            s.enqueue(s.request(m).input_f32("IN", &[1], &[1.0]), &c)
                .unwrap();
        }
    }
    c.wait(n * models.len());
    for r in c.take() {
        assert_eq!(r.status(), 0, "{}", r.error());
    }
    MOST.load(Ordering::SeqCst)
}

#[test]
fn models_sharing_a_resource_take_turns() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    // On: R has room for the largest need (1), so the two models run one at a time.
    let s = server(INFER_RATE_LIMIT_EXECUTION_COUNT, &[]);
    s.load("a", &config("a", ONE_R));
    s.load("b", &config("b", ONE_R));
    assert_eq!(most_at_once(&s, &["a", "b"], 20), 1);
    // The wait for a turn is in compute_us (as the execution's wall time) but not in
    // its infer phase: taking turns, each execution waits about as long as it runs.
    let (mut compute, mut infer) = (0, 0);
    for m in ["a", "b"] {
        let st = &s.stats(m)["models"][0];
        compute += st["compute_us"]["total"].as_u64().unwrap();
        infer += st["compute_infer_us"]["total"].as_u64().unwrap();
        assert!(
            st["compute_infer_us"]["total"].as_u64().unwrap() >= 20 * 3000,
            "{st}"
        );
    }
    assert!(
        (infer as f64) < 0.8 * compute as f64,
        "infer {infer} us, compute {compute} us"
    );
    drop(s);
    // Given 2 units of R, two of three models run at once, never three.
    let s = server(INFER_RATE_LIMIT_EXECUTION_COUNT, &[("R", 2, -1)]);
    for m in ["a", "b", "c"] {
        s.load(m, &config(m, ONE_R));
    }
    assert_eq!(most_at_once(&s, &["a", "b", "c"], 20), 2);
    drop(s);
    // Off (Triton's default): the field has no effect.
    let s = server(INFER_RATE_LIMIT_OFF, &[]);
    s.load("a", &config("a", ONE_R));
    s.load("b", &config("b", ONE_R));
    assert_eq!(most_at_once(&s, &["a", "b"], 20), 2);
}

#[test]
fn priority_2_gets_half_the_turns_of_priority_1() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let s = server(INFER_RATE_LIMIT_EXECUTION_COUNT, &[]);
    let group = |p: u32| {
        format!(
            r#"{{ count: 2 kind: KIND_CPU rate_limiter {{ resources [ {{ name: "R" global: true count: 1 }} ] priority: {p} }} }}"#
        )
    };
    // Instances 0 and 1 have priority 1, instances 2 and 3 priority 2.
    s.load("p", &config("p", &format!("{}, {}", group(1), group(2))));
    for n in &BY_INSTANCE {
        n.store(0, Ordering::SeqCst);
    }
    s.pause("p");
    let c = Collector::new();
    for _ in 0..150 {
        s.enqueue(s.request("p").input_f32("IN", &[1], &[1.0]), &c)
            .unwrap();
    }
    s.resume("p");
    c.wait(150);
    let count = |i: usize| BY_INSTANCE[i].load(Ordering::SeqCst);
    let (one, two) = (count(0) + count(1), count(2) + count(3));
    assert_eq!(one + two, 150);
    // While all four wait, turns go 2:1; the queue's tail is shared as it comes.
    let ratio = one as f64 / two as f64;
    assert!(
        (1.5..=2.6).contains(&ratio),
        "priority 1: {one}, priority 2: {two}"
    );
}

#[test]
fn bad_rate_limit_settings_are_refused() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let mut o = std::ptr::null_mut();
    ok(unsafe { infer_server_options_new(&mut o) });
    let msg = expect_status(
        unsafe { infer_server_options_set_rate_limit(o, 7) },
        INFER_STATUS_INVALID_ARGUMENT,
    );
    assert!(msg.contains("rate limit mode 7"), "{msg}");
    let msg = expect_status(
        unsafe { infer_server_options_add_rate_limit_resource(o, c"R".as_ptr(), 1, -2) },
        INFER_STATUS_INVALID_ARGUMENT,
    );
    assert!(msg.contains("device -2"), "{msg}");
    unsafe { infer_server_options_free(o) };
    // An instance that needs more than the server gives could never run.
    let s = server(INFER_RATE_LIMIT_EXECUTION_COUNT, &[("R", 1, -1)]);
    let two = ONE_R.replace("count: 1 } ]", "count: 2 } ]");
    let msg = expect_status(
        s.try_load("a", &config("a", &two)),
        INFER_STATUS_INVALID_ARGUMENT,
    );
    assert!(
        msg.contains("model 'a': instance_group 'a_0': rate_limiter resource 'R' needs 2, but the server gives it 1 (global)"),
        "{msg}"
    );
    // A resource listed twice in one group.
    let twice = r#"{ count: 1 kind: KIND_CPU rate_limiter { resources [ { name: "R" count: 1 }, { name: "R" count: 2 } ] } }"#;
    let msg = expect_status(
        s.try_load("b", &config("b", twice)),
        INFER_STATUS_INVALID_ARGUMENT,
    );
    assert!(
        msg.contains("rate_limiter.resources[1].name: 'R' is listed twice"),
        "{msg}"
    );
}
