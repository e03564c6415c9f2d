//! Dynamic batching through the C API: batch composition, delays, priorities, timeouts,
//! queue limits, cancellation and output selection.

mod common;
use common::*;
use infer::ffi::server::*;
use infer::ffi::*;
use std::time::{Duration, Instant};

fn enqueue_n(s: &Server, model: &str, c: &Collector, n: usize) -> Vec<u64> {
    (0..n)
        .map(|i| {
            let v = i as f32;
            s.enqueue(add_sub_request(s, model, [v; 4], [1.0; 4]), c)
                .unwrap()
        })
        .collect()
}

#[test]
fn paused_queue_forms_full_batches_on_resume() {
    let s = Server::new();
    s.load(
        "m",
        &add_sub_config("m", "dynamic_batching { }")
            .replace("max_batch_size: 64", "max_batch_size: 4"),
    );
    s.pause("m");
    let c = Collector::new();
    let ids = enqueue_n(&s, "m", &c, 10);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(c.finals(), 0, "a paused model must not execute");
    assert_eq!(s.stats("m")["models"][0]["pending"], 10);
    s.resume("m");
    c.wait(10);
    c.assert_exactly_once(&ids);
    assert_eq!(batch_sizes(&s.stats("m")), vec![(2, 1), (4, 2)]);
    // Every response sees only its own row.
    for r in c.take() {
        assert_eq!(r.status(), 0, "{}", r.error());
        let out = r.output_f32("OUTPUT0");
        let diff = r.output_f32("OUTPUT1");
        assert_eq!(out.len(), 4);
        assert_eq!(out[0] - 1.0, diff[0] + 1.0);
        assert_eq!(r.output("OUTPUT0").unwrap().0, vec![1, 4]);
    }
    let st = s.stats("m");
    assert_eq!(st["models"][0]["inference_count"], 10);
    assert_eq!(st["models"][0]["execution_count"], 3);
    assert_eq!(st["models"][0]["success_count"], 10);
    // Each execution's phases (input, infer, output) are counted once.
    for phase in ["compute_input_us", "compute_infer_us", "compute_output_us"] {
        assert_eq!(st["models"][0][phase]["count"], 3, "{phase}: {st}");
    }
}

#[test]
fn compute_phases_split_the_execution() {
    let s = Server::new();
    s.load(
        "m",
        &add_sub_config("m", "dynamic_batching { }").replace(
            "max_batch_size: 64",
            "max_batch_size: 4\nparameters { key: \"execute_delay_us\" value { string_value: \"3000\" } }",
        ),
    );
    let c = Collector::new();
    let ids = enqueue_n(&s, "m", &c, 2);
    c.wait(2);
    c.assert_exactly_once(&ids);
    let st = &s.stats("m")["models"][0];
    let n = st["execution_count"].as_u64().unwrap();
    assert!(n >= 1, "{st}");
    let total = |k: &str| st[k]["total"].as_u64().unwrap();
    // The backend's delay is in the infer phase, not in the others.
    assert!(total("compute_infer_us") >= 3000 * n, "{st}");
    assert!(total("compute_input_us") < 3000 * n, "{st}");
    assert!(total("compute_output_us") < 3000 * n, "{st}");
    let prom = prometheus_text(&s);
    assert!(
        prom.contains("infer_compute_infer_duration_us_total{model=\"m\""),
        "{prom}"
    );
}

#[test]
fn preferred_batch_size_is_sent_first() {
    let s = Server::new();
    let cfg = add_sub_config(
        "m",
        "dynamic_batching { preferred_batch_size: [ 2, 4 ] max_queue_delay_microseconds: 1000000 }",
    )
    .replace("max_batch_size: 64", "max_batch_size: 8");
    s.load("m", &cfg);
    s.pause("m");
    let c = Collector::new();
    enqueue_n(&s, "m", &c, 7);
    s.resume("m");
    // 7 queued: 4 (largest preferred) at once, then 2 (preferred) at once, then the last
    // one waits for the queue delay (1 s), which it must not reach within this test.
    let t0 = Instant::now();
    c.wait(6);
    assert!(t0.elapsed() < Duration::from_millis(500));
    assert_eq!(batch_sizes(&s.stats("m")), vec![(2, 1), (4, 1)]);
    assert_eq!(s.stats("m")["models"][0]["pending"], 1);
}

#[test]
fn queue_delay_holds_a_partial_batch() {
    let s = Server::new();
    let cfg = add_sub_config(
        "m",
        "dynamic_batching { max_queue_delay_microseconds: 150000 }",
    );
    s.load("m", &cfg);
    let c = Collector::new();
    let t0 = Instant::now();
    let ids = enqueue_n(&s, "m", &c, 3);
    c.wait(3);
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(140),
        "sent after {waited:?}, before the queue delay"
    );
    c.assert_exactly_once(&ids);
    assert_eq!(batch_sizes(&s.stats("m")), vec![(3, 1)]);
}

#[test]
fn zero_delay_sends_at_once() {
    let s = Server::new();
    s.load("m", &add_sub_config("m", "dynamic_batching { }"));
    let c = Collector::new();
    let t0 = Instant::now();
    enqueue_n(&s, "m", &c, 1);
    c.wait(1);
    assert!(t0.elapsed() < Duration::from_millis(100));
}

#[test]
fn higher_priority_runs_first() {
    let s = Server::new();
    let cfg = add_sub_config(
        "m",
        "dynamic_batching { priority_levels: 2 default_priority_level: 2 }",
    )
    .replace("max_batch_size: 64", "max_batch_size: 2");
    s.load("m", &cfg);
    s.pause("m");
    let c = Collector::new();
    let low: Vec<u64> = (0..3)
        .map(|_| {
            s.enqueue(add_sub_request(&s, "m", [0.; 4], [0.; 4]), &c)
                .unwrap()
        })
        .collect();
    let high: Vec<u64> = (0..2)
        .map(|_| {
            s.enqueue(add_sub_request(&s, "m", [0.; 4], [0.; 4]).priority(1), &c)
                .unwrap()
        })
        .collect();
    s.resume("m");
    c.wait(5);
    let order: Vec<u64> = c.take().iter().map(|r| r.id()).collect();
    let first_two: Vec<u64> = order[..2].to_vec();
    assert!(
        high.iter().all(|h| first_two.contains(h)),
        "order {order:?}, high {high:?}, low {low:?}"
    );
    // A priority beyond the configured levels is refused at enqueue.
    let err = s
        .enqueue(add_sub_request(&s, "m", [0.; 4], [0.; 4]).priority(3), &c)
        .unwrap_err();
    assert_eq!(err.0, INFER_STATUS_INVALID_ARGUMENT);
    assert!(
        err.1.contains("priority 3") && err.1.contains("'m'"),
        "{}",
        err.1
    );
}

#[test]
fn timeout_reject_while_queued() {
    let s = Server::new();
    s.load("m", &add_sub_config("m", "dynamic_batching { }"));
    s.pause("m");
    let c = Collector::new();
    let id = s
        .enqueue(
            add_sub_request(&s, "m", [0.; 4], [0.; 4]).timeout_us(20_000),
            &c,
        )
        .unwrap();
    let keep = s
        .enqueue(add_sub_request(&s, "m", [0.; 4], [0.; 4]), &c)
        .unwrap();
    // Timeouts apply while the model is paused.
    c.wait(1);
    let r = c.take().pop().unwrap();
    assert_eq!(r.id(), id);
    assert_eq!(r.status(), INFER_STATUS_DEADLINE_EXCEEDED);
    assert!(r.error().contains("timed out"), "{}", r.error());
    s.resume("m");
    c.wait(2);
    let r = c.take().pop().unwrap();
    assert_eq!((r.id(), r.status()), (keep, 0));
    assert_eq!(s.stats("m")["models"][0]["failure_count"], 1);
}

#[test]
fn timeout_delay_moves_request_behind() {
    let s = Server::new();
    let cfg = add_sub_config(
        "m",
        "dynamic_batching { default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 10000 } }",
    )
    .replace("max_batch_size: 64", "max_batch_size: 1");
    s.load("m", &cfg);
    s.pause("m");
    let c = Collector::new();
    let first = s
        .enqueue(add_sub_request(&s, "m", [0.; 4], [0.; 4]), &c)
        .unwrap();
    std::thread::sleep(Duration::from_millis(30));
    // `first` has timed out (DELAY): requests that have not timed out go before it.
    let second = s
        .enqueue(add_sub_request(&s, "m", [0.; 4], [0.; 4]), &c)
        .unwrap();
    std::thread::sleep(Duration::from_millis(2));
    s.resume("m");
    c.wait(2);
    let rs = c.take();
    assert!(
        rs.iter().all(|r| r.status() == 0),
        "DELAY must not fail requests"
    );
    assert_eq!(
        rs.iter().map(|r| r.id()).collect::<Vec<_>>(),
        vec![second, first]
    );
}

#[test]
fn queue_full_is_resource_exhausted() {
    let s = Server::new();
    s.load(
        "m",
        &add_sub_config(
            "m",
            "dynamic_batching { default_queue_policy { max_queue_size: 2 } }",
        ),
    );
    s.pause("m");
    let c = Collector::new();
    let ids = enqueue_n(&s, "m", &c, 2);
    let err = s
        .enqueue(add_sub_request(&s, "m", [0.; 4], [0.; 4]), &c)
        .unwrap_err();
    assert_eq!(err.0, INFER_STATUS_RESOURCE_EXHAUSTED);
    assert!(
        err.1.contains("queue is full") && err.1.contains("'m'"),
        "{}",
        err.1
    );
    s.resume("m");
    c.wait(2);
    c.assert_exactly_once(&ids);
}

#[test]
fn cancel_queued_request() {
    let s = Server::new();
    s.load("m", &add_sub_config("m", "dynamic_batching { }"));
    s.pause("m");
    let c = Collector::new();
    let ids = enqueue_n(&s, "m", &c, 3);
    ok(unsafe { infer_server_cancel(s.0, ids[1]) });
    c.wait(1);
    let r = &c.take()[0];
    assert_eq!((r.id(), r.status()), (ids[1], INFER_STATUS_CANCELLED));
    expect_status(
        unsafe { infer_server_cancel(s.0, ids[1]) },
        INFER_STATUS_NOT_FOUND,
    );
    expect_status(
        unsafe { infer_server_cancel(s.0, 999_999) },
        INFER_STATUS_NOT_FOUND,
    );
    s.resume("m");
    c.wait(3);
    assert_eq!(c.finals(), 3);
}

#[test]
fn different_requested_outputs_share_a_batch() {
    let s = Server::new();
    s.load("m", &add_sub_config("m", "dynamic_batching { }"));
    s.pause("m");
    let c = Collector::new();
    let a = s
        .enqueue(
            add_sub_request(&s, "m", [1.; 4], [2.; 4]).output("OUTPUT0"),
            &c,
        )
        .unwrap();
    let b = s
        .enqueue(
            add_sub_request(&s, "m", [1.; 4], [2.; 4]).output("OUTPUT1"),
            &c,
        )
        .unwrap();
    s.resume("m");
    c.wait(2);
    assert_eq!(batch_sizes(&s.stats("m")), vec![(2, 1)]);
    for r in c.take() {
        assert_eq!(r.output_count(), 1);
        if r.id() == a {
            assert_eq!(r.output_f32("OUTPUT0"), vec![3.; 4]);
            assert!(r.output("OUTPUT1").is_none());
        } else {
            assert_eq!(r.id(), b);
            assert_eq!(r.output_f32("OUTPUT1"), vec![-1.; 4]);
        }
    }
}

#[test]
fn different_shapes_do_not_share_a_batch() {
    let s = Server::new();
    let cfg = r#"
name: "v" backend: "identity" max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
dynamic_batching { }
"#;
    s.load("v", cfg);
    s.pause("v");
    let c = Collector::new();
    for n in [2usize, 2, 3, 2] {
        let r = s
            .request("v")
            .input_f32("IN", &[1, n as i64], &vec![n as f32; n]);
        s.enqueue(r, &c).unwrap();
    }
    s.resume("v");
    c.wait(4);
    // [2,2] batch together; the 3-wide one stops the batch; the last 2 goes after it.
    assert_eq!(batch_sizes(&s.stats("v")), vec![(1, 2), (2, 1)]);
    for r in c.take() {
        let v = r.output_f32("OUT");
        assert!(v.iter().all(|x| *x == v.len() as f32), "{v:?}");
    }
}

#[test]
fn requests_with_batch_size_above_one_are_split_back() {
    let s = Server::new();
    s.load("m", &add_sub_config("m", "dynamic_batching { }"));
    s.pause("m");
    let c = Collector::new();
    let r = s
        .request("m")
        .input_f32("INPUT0", &[3, 4], &[1.0; 12])
        .input_f32("INPUT1", &[3, 4], &[2.0; 12]);
    let big = s.enqueue(r, &c).unwrap();
    let small = s
        .enqueue(add_sub_request(&s, "m", [5.; 4], [5.; 4]), &c)
        .unwrap();
    s.resume("m");
    c.wait(2);
    assert_eq!(batch_sizes(&s.stats("m")), vec![(4, 1)]);
    // Triton's counts: inferences are rows (3 + 1), executions are batches.
    let st = s.stats("m");
    assert_eq!(st["models"][0]["inference_count"], 4, "{st}");
    assert_eq!(st["models"][0]["execution_count"], 1, "{st}");
    assert_eq!(st["models"][0]["success_count"], 2, "{st}");
    for r in c.take() {
        let (shape, _) = r.output("OUTPUT0").unwrap();
        if r.id() == big {
            assert_eq!(shape, vec![3, 4]);
            assert_eq!(r.output_f32("OUTPUT0"), vec![3.0; 12]);
        } else {
            assert_eq!(r.id(), small);
            assert_eq!(shape, vec![1, 4]);
            assert_eq!(r.output_f32("OUTPUT0"), vec![10.0; 4]);
        }
    }
}

#[test]
fn default_scheduler_runs_instances_in_parallel() {
    let s = Server::new();
    let cfg = add_sub_config(
        "m",
        r#"instance_group [ { count: 2 kind: KIND_CPU } ]
parameters { key: "execute_delay_us" value { string_value: "100000" } }"#,
    );
    s.load("m", &cfg);
    let c = Collector::new();
    let t0 = Instant::now();
    enqueue_n(&s, "m", &c, 2);
    c.wait(2);
    let took = t0.elapsed();
    assert!(
        took < Duration::from_millis(190),
        "two instances should overlap, took {took:?}"
    );
    assert_eq!(batch_sizes(&s.stats("m")), vec![(1, 2)]);
}

#[test]
fn preserve_ordering_across_instances() {
    let s = Server::new();
    let cfg = r#"
name: "p" backend: "identity" max_batch_size: 1
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 3 } ]
dynamic_batching { preserve_ordering: true }
parameters { key: "execute_delay_us" value { string_value: "3000" } }
"#;
    s.load("p", cfg);
    let c = Collector::new();
    let ids: Vec<u64> = (0..30)
        .map(|i| {
            s.enqueue(s.request("p").input_f32("IN", &[1, 1], &[i as f32]), &c)
                .unwrap()
        })
        .collect();
    c.wait(30);
    let got: Vec<u64> = c.take().iter().map(|r| r.id()).collect();
    assert_eq!(got, ids);
}

/// The server's Prometheus text.
fn prometheus_text(s: &Server) -> String {
    let mut text = std::ptr::null_mut();
    ok(unsafe { infer_server_metrics_prometheus(s.0, &mut text) });
    let metrics = unsafe { std::ffi::CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned();
    unsafe { infer_string_free(text) };
    metrics
}

static CACHED_EXECS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// OUT = 2 * IN; a negative IN[0] fails the batch. Counts executions.
fn doubler(b: &mut infer::backend::Batch) -> infer::status::Result<()> {
    CACHED_EXECS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let (t, data) = b.input("IN").expect("IN");
    let shape = t.shape.to_vec();
    let v: Vec<f32> = bytemuck::pod_collect_to_vec(data);
    if v.first().is_some_and(|x| *x < 0.0) {
        return Err(infer::status::Error::invalid("negative"));
    }
    let out = b.alloc_output("OUT", &shape, None)?;
    let doubled: Vec<f32> = v.iter().map(|x| x * 2.0).collect();
    out.copy_from_slice(bytemuck::cast_slice(&doubled));
    Ok(())
}

fn cache_server(bytes: u64) -> Server {
    let mut opts = std::ptr::null_mut();
    ok(unsafe { infer_server_options_new(&mut opts) });
    ok(unsafe { infer_server_options_set_response_cache_bytes(opts, bytes) });
    let s = Server::with_options(opts);
    unsafe { infer_server_options_free(opts) };
    s.register_fn_backend("doubler", doubler);
    s
}

const CACHED: &str = r#"backend: "doubler" max_batch_size: 4
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
dynamic_batching { }
response_cache { enable: true }"#;

/// Triton's response cache: a repeated request is answered with the stored outputs
/// without reaching the backend; failures are not stored; the least recently used
/// responses make room; hits and misses are counted.
#[test]
fn the_response_cache_answers_repeated_requests_without_the_backend() {
    use std::sync::atomic::Ordering::SeqCst;
    let s = cache_server(2048);
    s.load("c", CACHED);
    let execs = || CACHED_EXECS.load(SeqCst);
    let ask = |x: f32, output: bool| {
        let mut r = s.request("c").input_f32("IN", &[1, 4], &[x, 1.0, 2.0, 3.0]);
        if output {
            r = r.output("OUT");
        }
        let resp = s.infer(r);
        assert_eq!(resp.status(), 0, "{}", resp.error());
        resp.output_f32("OUT")
    };
    let before = execs();
    assert_eq!(ask(1.0, false), vec![2.0, 2.0, 4.0, 6.0]);
    assert_eq!(execs(), before + 1);
    // The same request: answered from the cache, the same outputs.
    assert_eq!(ask(1.0, false), vec![2.0, 2.0, 4.0, 6.0]);
    assert_eq!(execs(), before + 1);
    // Other inputs, or other requested outputs: another key.
    assert_eq!(ask(5.0, false), vec![10.0, 2.0, 4.0, 6.0]);
    assert_eq!(ask(1.0, true), vec![2.0, 2.0, 4.0, 6.0]);
    assert_eq!(execs(), before + 3);
    assert_eq!(ask(1.0, true), vec![2.0, 2.0, 4.0, 6.0]);
    assert_eq!(execs(), before + 3);
    // A failed request is not stored.
    for _ in 0..2 {
        let resp = s.infer(s.request("c").input_f32("IN", &[1, 4], &[-1.0; 4]));
        assert_ne!(resp.status(), 0);
    }
    assert_eq!(execs(), before + 5);
    let st = &s.stats("c")["models"][0];
    assert_eq!(st["success_count"], 5);
    assert_eq!(st["failure_count"], 2);
    assert_eq!(st["execution_count"], 5);
    assert_eq!(st["cache_hit_us"]["count"], 2);
    assert_eq!(st["cache_miss_us"]["count"], 3, "{st}");
    let metrics = prometheus_text(&s);
    assert!(
        metrics.contains("infer_cache_hit_total{model=\"c\",version=\"1\"} 2"),
        "{metrics}"
    );
    assert!(metrics.contains("infer_cache_entries{} 3"), "{metrics}");

    // 2048 bytes hold about a dozen entries: 30 more push the first ones out.
    for i in 0..30 {
        ask(100.0 + i as f32, false);
    }
    let n = execs();
    ask(1.0, false);
    assert_eq!(execs(), n + 1, "the oldest entry was not evicted");
    ask(129.0, false);
    assert_eq!(execs(), n + 1, "the newest entry was evicted");
    let metrics = prometheus_text(&s);
    let gauge = |name: &str| -> u64 {
        let line = metrics
            .lines()
            .find(|l| l.starts_with(&format!("{name}{{")))
            .unwrap_or_else(|| panic!("{name} in {metrics}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert!(gauge("infer_cache_bytes") <= 2048);
    assert!(gauge("infer_cache_evictions_total") >= 20, "{metrics}");

    // Many clients at once on a few keys: every answer right.
    let s = std::sync::Arc::new(s);
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let s = s.clone();
            std::thread::spawn(move || {
                for i in 0..50 {
                    let x = ((t + i) % 3) as f32;
                    let resp =
                        s.infer(s.request("c").input_f32("IN", &[1, 4], &[x, 1.0, 2.0, 3.0]));
                    assert_eq!(resp.status(), 0, "{}", resp.error());
                    assert_eq!(resp.output_f32("OUT"), vec![2.0 * x, 2.0, 4.0, 6.0]);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

/// Where the cache cannot serve a model, the load says why.
#[test]
fn the_response_cache_is_refused_where_it_cannot_serve() {
    let s = Server::new();
    s.register_fn_backend("doubler", doubler);
    assert_eq!(s.try_load("c", CACHED), INFER_STATUS_INVALID_ARGUMENT);
    let e = last_error();
    assert!(
        e.contains("response_cache.enable")
            && e.contains("infer_server_options_set_response_cache_bytes"),
        "{e}"
    );
    let s = cache_server(1 << 20);
    let sequence = CACHED.replace(
        "dynamic_batching { }",
        r#"sequence_batching { control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ] }"#,
    );
    assert_eq!(s.try_load("q", &sequence), INFER_STATUS_UNSUPPORTED);
    assert!(
        last_error().contains("response_cache.enable"),
        "{}",
        last_error()
    );
}

/// Triton's `metric_tags`: labels on every Prometheus sample of the model; a label name
/// Prometheus refuses, or one the library uses itself, is refused at load.
#[test]
fn metric_tags_label_the_model_metrics() {
    let s = Server::new();
    s.load(
        "t",
        &add_sub_config("t", r#"metric_tags { key: "team" value: "nlp \"a\"" } metric_tags { key: "tier" value: "gold" }"#),
    );
    let r = s.infer(add_sub_request(&s, "t", [1.; 4], [1.; 4]));
    assert_eq!(r.status(), 0);
    let metrics = prometheus_text(&s);
    assert!(
        metrics.contains(
            r#"infer_request_success_total{model="t",version="1",team="nlp \"a\"",tier="gold"} 1"#
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"infer_batch_size_bucket{model="t",version="1",team="nlp \"a\"",tier="gold",le="1"} 1"#),
        "{metrics}"
    );
    for (tag, says) in [
        (
            "bad-name",
            "metric_tags['bad-name']: not a Prometheus label name",
        ),
        ("__x", "metric_tags['__x']: not a Prometheus label name"),
        (
            "version",
            "metric_tags['version']: the label 'version' is the library's own",
        ),
    ] {
        let st = s.try_load(
            "u",
            &add_sub_config(
                "u",
                &format!(r#"metric_tags {{ key: "{tag}" value: "v" }}"#),
            ),
        );
        assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT);
        assert!(last_error().contains(says), "{}", last_error());
    }
}
