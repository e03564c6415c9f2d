//! Tensor handling end to end: BYTES tensors, reshape, borrowed inputs, ragged batches,
//! and ordering of responses.

mod common;
use common::*;
use infer::ffi::request::*;
use infer::ffi::*;
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};

fn bytes_tensor(items: &[&str]) -> Vec<u8> {
    let mut b = Vec::new();
    for s in items {
        b.extend_from_slice(&(s.len() as u32).to_le_bytes());
        b.extend_from_slice(s.as_bytes());
    }
    b
}

#[test]
fn bytes_tensors_batch_and_split() {
    let s = Server::new();
    s.load(
        "echo",
        r#"name: "echo" backend: "identity" max_batch_size: 8
input [ { name: "IN" data_type: TYPE_STRING dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ 2 ] } ]
dynamic_batching { }"#,
    );
    s.pause("echo");
    let c = Collector::new();
    let texts = [["a", "bb"], ["", "hello"], ["xyz", "q"]];
    let mut ids = Vec::new();
    for t in &texts {
        let r = s.request("echo");
        ok(r.try_input("IN", INFER_DATATYPE_BYTES, &[1, 2], &bytes_tensor(t)));
        ids.push(s.enqueue(r, &c).unwrap());
    }
    s.resume("echo");
    c.wait(3);
    assert_eq!(batch_sizes(&s.stats("echo")), vec![(3, 1)]);
    for r in c.take() {
        let i = ids.iter().position(|id| *id == r.id()).unwrap();
        let (shape, bytes) = r.output("OUT").unwrap();
        assert_eq!(shape, vec![1, 2]);
        assert_eq!(bytes, bytes_tensor(&texts[i]));
    }
    // A BYTES buffer whose element count does not match the shape is refused.
    let r = s.request("echo");
    let msg = expect_status(
        r.try_input("IN", INFER_DATATYPE_BYTES, &[1, 2], &bytes_tensor(&["one"])),
        1,
    );
    assert!(
        msg.contains("expected 2 BYTES elements") && msg.contains("got 1"),
        "{msg}"
    );
    let msg = expect_status(
        r.try_input("IN", INFER_DATATYPE_BYTES, &[1, 2], &[9, 0, 0, 0, b'x']),
        1,
    );
    assert!(msg.contains("runs past the end"), "{msg}");
}

#[test]
fn reshape_in_and_out() {
    let s = Server::new();
    s.load(
        "r",
        r#"name: "r" backend: "identity" max_batch_size: 4
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 6 ] reshape { shape: [ 2, 3 ] } } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 6 ] reshape { shape: [ 2, 3 ] } } ]"#,
    );
    let r = s.infer(s.request("r").input_i32("IN", &[1, 6], &[1, 2, 3, 4, 5, 6]));
    assert_eq!(r.status(), 0, "{}", r.error());
    let (shape, bytes) = r.output("OUT").unwrap();
    assert_eq!(shape, vec![1, 6]);
    assert_eq!(
        bytemuck::pod_collect_to_vec::<u8, i32>(&bytes),
        vec![1, 2, 3, 4, 5, 6]
    );
}

static RELEASED: AtomicUsize = AtomicUsize::new(0);
unsafe extern "C" fn release(ud: *mut c_void) {
    assert_eq!(ud as usize, 42);
    RELEASED.fetch_add(1, Ordering::SeqCst);
}

#[test]
fn borrowed_inputs_are_released_once() {
    let s = Server::new();
    s.load("m", &add_sub_config("m", "dynamic_batching { }"));
    let a = [1.0f32; 4];
    let b = [2.0f32; 4];
    let shape = [1i64, 4];
    let add = |r: &Req, name: &std::ffi::CStr, data: &[f32; 4]| unsafe {
        infer_request_add_input_borrowed(
            r.0,
            name.as_ptr(),
            INFER_DATATYPE_FP32,
            shape.as_ptr(),
            2,
            data.as_ptr() as *const c_void,
            16,
            INFER_MEMORY_CPU,
            0,
            Some(release),
            42 as *mut c_void,
        )
    };
    let r = s.request("m");
    ok(add(&r, c"INPUT0", &a));
    ok(add(&r, c"INPUT1", &b));
    // A failed borrowed add does not take (or release) the buffer.
    assert_eq!(add(&r, c"INPUT1", &b), INFER_STATUS_ALREADY_EXISTS);
    assert_eq!(RELEASED.load(Ordering::SeqCst), 0);
    let resp = s.infer(r);
    assert_eq!(resp.output_f32("OUTPUT0"), vec![3.0; 4]);
    assert_eq!(RELEASED.load(Ordering::SeqCst), 2);
    // A request freed without being enqueued releases too.
    let r = s.request("m");
    ok(add(&r, c"INPUT0", &a));
    drop(r);
    assert_eq!(RELEASED.load(Ordering::SeqCst), 3);
}

#[test]
fn ragged_inputs_batch_together() {
    let s = Server::new();
    s.load(
        "rag",
        r#"name: "rag" backend: "identity" max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
dynamic_batching { }"#,
    );
    s.pause("rag");
    let c = Collector::new();
    for n in [1usize, 3] {
        s.enqueue(
            s.request("rag")
                .input_f32("IN", &[1, n as i64], &vec![1.0; n]),
            &c,
        )
        .unwrap();
    }
    s.resume("rag");
    c.wait(2);
    // Both went in one execution, flattened to [4]. Identity cannot split a flattened
    // output back into rows: the library refuses its output (dim 0 must be the batch
    // size) instead of handing out wrong rows.
    assert_eq!(batch_sizes(&s.stats("rag")), vec![(2, 1)]);
    for r in c.take() {
        assert_eq!(r.status(), INFER_STATUS_INVALID_ARGUMENT);
        assert!(r.error().contains("batch size 2"), "{}", r.error());
    }
}

/// Sleeps longer for smaller values, so later requests finish first.
fn slow_echo(batch: &mut infer::backend::Batch) -> infer::status::Result<()> {
    let (i, data) = batch.input("IN").unwrap();
    let shape = i.shape.clone();
    let v: Vec<f32> = bytemuck::pod_collect_to_vec(data);
    std::thread::sleep(std::time::Duration::from_millis(
        (12.0 - v[0] * 5.0).max(0.0) as u64,
    ));
    batch
        .alloc_output("OUT", &shape, None)?
        .copy_from_slice(bytemuck::cast_slice(&v));
    Ok(())
}

fn ordering_run(preserve: bool) -> (Vec<u64>, Vec<u64>) {
    let s = Server::new();
    s.register_fn_backend("slow", slow_echo);
    let cfg = format!(
        r#"name: "o" backend: "slow" max_batch_size: 1
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
instance_group [ {{ count: 3 }} ]
dynamic_batching {{ preserve_ordering: {preserve} }}"#
    );
    s.load("o", &cfg);
    let c = Collector::new();
    let ids: Vec<u64> = (0..12)
        .map(|i| {
            s.enqueue(
                s.request("o").input_f32("IN", &[1, 1], &[(i % 3) as f32]),
                &c,
            )
            .unwrap()
        })
        .collect();
    c.wait(12);
    let got = c.take().iter().map(|r| r.id()).collect();
    (ids, got)
}

#[test]
fn preserve_ordering_reorders_out_of_order_completions() {
    let (ids, got) = ordering_run(false);
    assert_ne!(
        ids, got,
        "the backend should finish out of order without preserve_ordering"
    );
    let (ids, got) = ordering_run(true);
    assert_eq!(ids, got);
}

#[test]
fn optional_ragged_inputs_only_batch_with_the_same_inputs() {
    let s = Server::new();
    s.load(
        "opt",
        r#"name: "opt" backend: "identity" max_batch_size: 8
input [ { name: "A" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true },
        { name: "B" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true optional: true } ]
output [ { name: "OA" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "OB" data_type: TYPE_FP32 dims: [ -1 ] } ]
dynamic_batching { }"#,
    );
    s.pause("opt");
    let c = Collector::new();
    let only_a = s
        .enqueue(s.request("opt").input_f32("A", &[1, 2], &[1.0; 2]), &c)
        .unwrap();
    let both = s
        .enqueue(
            s.request("opt")
                .input_f32("A", &[1, 2], &[2.0; 2])
                .input_f32("B", &[1, 2], &[3.0; 2]),
            &c,
        )
        .unwrap();
    s.resume("opt");
    c.wait(2);
    assert_eq!(batch_sizes(&s.stats("opt")), vec![(1, 2)]);
    for r in c.take() {
        assert_eq!(r.status(), 0, "{}", r.error());
        if r.id() == only_a {
            assert_eq!(r.output_f32("OA"), vec![1.0; 2]);
            assert!(r.output("OB").is_none());
        } else {
            assert_eq!(r.id(), both);
            assert_eq!(r.output_f32("OB"), vec![3.0; 2]);
        }
    }
}
