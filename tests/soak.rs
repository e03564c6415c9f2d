//! A fault-injection soak through the C API: a backend that fails batches, fails rows,
//! panics and sleeps; requests with queue timeouts; cancels; the model replaced, unloaded
//! and loaded again throughout. Every accepted request must get exactly one FINAL, and
//! resident memory must stay flat. `INFER_SOAK_REQUESTS` sets the number of accepted
//! requests (default 40,000, quick enough for every test run; the soak proper is
//! `INFER_SOAK_REQUESTS=1000000`).

mod common;
use common::*;
use infer::backend::Batch;
use infer::ffi::server::*;
use infer::ffi::*;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CONFIG: &str = r#"name: "soak" backend: "faulty" max_batch_size: 16
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
dynamic_batching { max_queue_delay_microseconds: 50
  default_queue_policy { allow_timeout_override: true } }"#;

/// What a request asks the backend to do, by its input value.
const FAIL_BATCH: f32 = 1.0;
const FAIL_ROW: f32 = 2.0;
const PANIC: f32 = 3.0;
const SLEEP: f32 = 4.0;

fn faulty(b: &mut Batch) -> infer::status::Result<()> {
    let vals: Vec<f32> = match b.input("IN") {
        Some((_, data)) => bytemuck::pod_collect_to_vec(data),
        None => Vec::new(),
    };
    if vals.contains(&PANIC) {
        panic!("soak: a panicking backend");
    }
    if vals.contains(&FAIL_BATCH) {
        return Err(infer::status::Error::internal("soak: a failed batch"));
    }
    if vals.contains(&SLEEP) {
        std::thread::sleep(Duration::from_micros(300));
    }
    let n = vals.len() as i64;
    let out = b.alloc_output("OUT", &[n, 1], None)?;
    out.copy_from_slice(bytemuck::cast_slice(&vals));
    for (row, v) in vals.iter().enumerate() {
        if *v == FAIL_ROW {
            b.set_row_error(
                row as u32,
                infer::status::Error::invalid("soak: a failed row"),
            )?;
        }
    }
    Ok(())
}

/// FINAL counts by request id, the accepted ids, and how many requests are still
/// unanswered (all allocated up front: resident memory then measures the library).
struct Tally {
    finals: Vec<AtomicU8>,
    accepted: Vec<AtomicU8>,
    outstanding: AtomicUsize,
    extra: AtomicUsize,
}

unsafe extern "C" fn count(ud: *mut c_void, resp: *mut Response, flags: u32) {
    let t = unsafe { &*(ud as *const Tally) };
    let id = unsafe { infer::ffi::response::infer_response_request_id(resp) } as usize;
    unsafe { infer::ffi::response::infer_response_free(resp) };
    if flags & INFER_RESPONSE_FLAG_FINAL == 0 {
        t.extra.fetch_add(1, Ordering::Relaxed);
        return;
    }
    match t.finals.get(id) {
        Some(c) => {
            c.fetch_add(1, Ordering::Relaxed);
        }
        None => {
            t.extra.fetch_add(1, Ordering::Relaxed);
        }
    }
    t.outstanding.fetch_sub(1, Ordering::Release);
}

fn rss_mib() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: f64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    pages * 4096.0 / (1 << 20) as f64
}

#[test]
fn faults_cancels_timeouts_and_reloads_lose_no_request() {
    let total: usize = std::env::var("INFER_SOAK_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40_000);
    // The backend's own panics are expected: keep them out of the output.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let planned = info
            .payload()
            .downcast_ref::<&str>()
            .is_some_and(|m| m.starts_with("soak: "));
        if !planned {
            default_hook(info);
        }
    }));
    let s = Server::new();
    s.register_fn_backend("faulty", faulty);
    s.load("soak", CONFIG);
    // Request ids are the server's, from 1, one per enqueue attempt that got one; room
    // for the refused ones too.
    let room = total * 4 + 16;
    let tally = Arc::new(Tally {
        finals: (0..room).map(|_| AtomicU8::new(0)).collect(),
        accepted: (0..room).map(|_| AtomicU8::new(0)).collect(),
        outstanding: AtomicUsize::new(0),
        extra: AtomicUsize::new(0),
    });
    // Touch every page now: zeroed memory is mapped lazily, and the bookkeeping would
    // otherwise grow the resident memory this test measures.
    for a in tally.finals.iter().chain(&tally.accepted) {
        a.store(0, Ordering::Relaxed);
    }
    let accepted = AtomicU64::new(0);
    let refused = AtomicU64::new(0);
    let done = AtomicBool::new(false);
    let mut rss = Vec::new();
    let start = Instant::now();
    std::thread::scope(|scope| {
        // The model is replaced, or unloaded and loaded again, all the time.
        let (server, stop) = (&s, &done);
        scope.spawn(move || {
            let (s, done) = (server, stop);
            let mut k = 0u64;
            while !done.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(20));
                k += 1;
                if k.is_multiple_of(3) {
                    let _ = unsafe { infer_server_unload_model(s.0, c"soak".as_ptr()) };
                }
                let _ = s.try_load("soak", CONFIG);
            }
        });
        // Clients: a window of requests each, some with timeouts, some cancelled.
        for client in 0..2u64 {
            let (s, tally, accepted, refused) = (&s, &tally, &accepted, &refused);
            scope.spawn(move || {
                let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ client;
                while (accepted.load(Ordering::Relaxed) as usize) < total {
                    while tally.outstanding.load(Ordering::Acquire) > 256 {
                        std::thread::yield_now();
                    }
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    let value = match rng % 100 {
                        0..=2 => FAIL_BATCH,
                        3..=7 => FAIL_ROW,
                        8 => PANIC,
                        9..=14 => SLEEP,
                        _ => 0.0,
                    };
                    let mut r = std::ptr::null_mut();
                    if unsafe {
                        infer::ffi::request::infer_request_new(s.0, c"soak".as_ptr(), -1, &mut r)
                    } != INFER_STATUS_OK
                    {
                        refused.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    let r = Req(r).input_f32("IN", &[1, 1], &[value]);
                    let r = if rng.is_multiple_of(10) {
                        r.timeout_us(100)
                    } else {
                        r
                    };
                    let mut id = 0u64;
                    tally.outstanding.fetch_add(1, Ordering::AcqRel);
                    let ud = Arc::as_ptr(tally) as *mut c_void;
                    let st =
                        unsafe { infer_server_enqueue(s.0, r.take(), Some(count), ud, &mut id) };
                    if st != INFER_STATUS_OK {
                        tally.outstanding.fetch_sub(1, Ordering::Release);
                        refused.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    accepted.fetch_add(1, Ordering::Relaxed);
                    if let Some(a) = tally.accepted.get(id as usize) {
                        a.store(1, Ordering::Relaxed);
                    }
                    if rng % 20 == 1 {
                        let _ = unsafe { infer_server_cancel(s.0, id) };
                    }
                }
            });
        }
        // Resident memory after a tenth and at the end.
        while (accepted.load(Ordering::Relaxed) as usize) < total {
            if rss.is_empty() && accepted.load(Ordering::Relaxed) as usize >= total / 10 {
                rss.push(rss_mib());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        done.store(true, Ordering::Release);
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while tally.outstanding.load(Ordering::Acquire) > 0 {
        assert!(
            Instant::now() < deadline,
            "{} requests were never answered",
            tally.outstanding.load(Ordering::Acquire)
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    rss.push(rss_mib());
    let (mut lost, mut twice, mut unasked) = (0usize, 0usize, 0usize);
    for (a, f) in tally.accepted.iter().zip(&tally.finals) {
        match (a.load(Ordering::Relaxed), f.load(Ordering::Relaxed)) {
            (1, 0) => lost += 1,
            (1, 1) | (0, 0) => {}
            (1, _) => twice += 1,
            _ => unasked += 1,
        }
    }
    eprintln!(
        "soak: {} accepted, {} refused (model reloading) in {:.1}s; lost {lost}, answered twice {twice}, stray responses {}; RSS {:.1} MiB after a tenth, {:.1} MiB at the end",
        accepted.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
        start.elapsed().as_secs_f64(),
        tally.extra.load(Ordering::Relaxed),
        rss.first().copied().unwrap_or(0.0),
        rss.last().copied().unwrap_or(0.0),
    );
    assert_eq!(lost, 0);
    assert_eq!(twice, 0);
    assert_eq!(unasked, 0, "FINALs for requests that were not accepted");
    assert_eq!(tally.extra.load(Ordering::Relaxed), 0);
    if let [first, last] = rss[..] {
        assert!(
            last - first < 64.0,
            "RSS grew from {first:.1} to {last:.1} MiB"
        );
    }
}
