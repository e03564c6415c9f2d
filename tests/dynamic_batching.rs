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
