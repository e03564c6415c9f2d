//! Ragged batching: `batch_input` (the tensors the library computes for each batch so a
//! backend can tell where each request's elements are in a ragged input) and
//! `batch_output` (each request gets back the elements, and the shape, of its input).

mod common;
use common::*;
use infer::backend::Batch;
use infer::ffi::*;
use std::sync::Mutex;

/// A batch input as the backend saw it: name, shape, values as i64.
type Seen = (String, Vec<i64>, Vec<i64>);

/// What the backend saw of each batch input.
static SEEN: Mutex<Vec<Seen>> = Mutex::new(Vec::new());
static TURN: Mutex<()> = Mutex::new(());

fn values(batch: &Batch, name: &str) -> (Vec<i64>, Vec<i64>) {
    let (i, data) = batch.input(name).expect(name);
    let v = match i.dtype {
        infer::tensor::DataType::Int32 => data
            .chunks(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64)
            .collect(),
        infer::tensor::DataType::Int64 => data
            .chunks(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        _ => data
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as i64)
            .collect(),
    };
    (i.shape.to_vec(), v)
}

/// Y = 2 X over the flattened ragged X; records the batch inputs. A batch whose X
/// holds a 99 writes one element too few.
fn doubler(batch: &mut Batch) -> infer::status::Result<()> {
    let mut seen = SEEN.lock().unwrap();
    seen.clear();
    for n in ["N", "ACC", "ACC0", "MAX", "IS", "ISF", "ISF2"] {
        let (shape, v) = values(batch, n);
        seen.push((n.to_owned(), shape, v));
    }
    drop(seen);
    let x: Vec<f32> = {
        let (_, data) = batch.input("X").unwrap();
        data.chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let n = x.len() - usize::from(x.contains(&99.0));
    let out = batch.alloc_output("Y", &[n as i64], None)?;
    for (o, v) in out.chunks_mut(4).zip(&x) {
        o.copy_from_slice(&(2.0 * v).to_le_bytes());
    }
    Ok(())
}

const RAGGED: &str = r#"
name: "rag" backend: "doubler" max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
batch_input [
  { kind: BATCH_ELEMENT_COUNT target_name: "N" data_type: TYPE_INT32 source_input: "X" },
  { kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "ACC" data_type: TYPE_INT64 source_input: "X" },
  { kind: BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO target_name: "ACC0" data_type: TYPE_FP32 source_input: "X" },
  { kind: BATCH_MAX_ELEMENT_COUNT_AS_SHAPE target_name: "MAX" data_type: TYPE_INT32 source_input: "X" },
  { kind: BATCH_ITEM_SHAPE target_name: "IS" data_type: TYPE_INT32 source_input: "X" },
  { kind: BATCH_ITEM_SHAPE_FLATTEN target_name: [ "ISF", "ISF2" ] data_type: TYPE_INT32 source_input: "X" }
]
batch_output [ { kind: BATCH_SCATTER_WITH_INPUT_SHAPE target_name: "Y" source_input: "X" } ]
dynamic_batching { }
"#;

fn seen(name: &str) -> (Vec<i64>, Vec<i64>) {
    let s = SEEN.lock().unwrap();
    let (_, shape, v) = s.iter().find(|(n, _, _)| n == name).unwrap().clone();
    (shape, v)
}

#[test]
fn batch_inputs_describe_a_ragged_batch_and_batch_outputs_split_it_back() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let s = Server::new();
    s.register_fn_backend("doubler", doubler);
    s.load("rag", RAGGED);
    s.pause("rag");
    let c = Collector::new();
    let shapes: [&[i64]; 3] = [&[1, 3], &[1, 4], &[2, 5]];
    let mut ids = Vec::new();
    let mut next = 0.0f32;
    let mut sent = Vec::new();
    for sh in shapes {
        let n = sh.iter().product::<i64>() as usize;
        let x: Vec<f32> = (0..n).map(|k| next + k as f32).collect();
        next += n as f32;
        ids.push(
            s.enqueue(s.request("rag").input_f32("X", sh, &x), &c)
                .unwrap(),
        );
        sent.push(x);
    }
    s.resume("rag");
    c.wait(3);
    c.assert_exactly_once(&ids);
    assert_eq!(
        batch_sizes(&s.stats("rag")),
        vec![(4, 1)],
        "one batch of 4 rows"
    );
    assert_eq!(seen("N"), (vec![3], vec![3, 4, 10]));
    assert_eq!(seen("ACC"), (vec![3], vec![3, 7, 17]));
    assert_eq!(seen("ACC0"), (vec![4], vec![0, 3, 7, 17]));
    assert_eq!(seen("MAX").0, vec![10]);
    assert_eq!(seen("IS"), (vec![4, 1], vec![3, 4, 5, 5]));
    assert_eq!(seen("ISF"), (vec![4], vec![3, 4, 5, 5]));
    assert_eq!(seen("ISF2"), seen("ISF"), "every target gets the tensor");
    for r in c.take() {
        let i = ids.iter().position(|id| *id == r.id()).unwrap();
        assert_eq!(r.status(), 0, "{}", r.error());
        let (shape, _) = r.output("Y").unwrap();
        assert_eq!(shape, shapes[i].to_vec(), "the request's own input shape");
        let want: Vec<f32> = sent[i].iter().map(|v| 2.0 * v).collect();
        assert_eq!(r.output_f32("Y"), want);
    }

    // An output that does not hold the requests' elements fails the batch, naming it.
    let r = s.infer(s.request("rag").input_f32("X", &[1, 2], &[99.0, 1.0]));
    assert_eq!(r.status(), INFER_STATUS_INTERNAL);
    assert!(
        r.error().contains("batch output 'Y' holds 1 elements") && r.error().contains("'X' has 2"),
        "{}",
        r.error()
    );
}

#[test]
fn batch_io_configs_that_cannot_work_are_refused() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let s = Server::new();
    s.register_fn_backend("doubler", doubler);
    let cases: [(&str, &str, infer_status, &str); 6] = [
        (
            "source_input: \"X\" },\n  { kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: \"ACC\"",
            "source_input: \"Z\" },\n  { kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: \"ACC\"",
            INFER_STATUS_INVALID_ARGUMENT,
            "batch_input[0].source_input: 'Z' is not an input of the config",
        ),
        (
            "target_name: \"ACC\"",
            "target_name: \"X\"",
            INFER_STATUS_INVALID_ARGUMENT,
            "batch_input[1].target_name: 'X' is empty or already names an input",
        ),
        (
            "data_type: TYPE_INT64",
            "data_type: TYPE_FP16",
            INFER_STATUS_INVALID_ARGUMENT,
            "batch_input[1].data_type: FP16",
        ),
        (
            "max_batch_size: 8",
            "max_batch_size: 0",
            INFER_STATUS_INVALID_ARGUMENT,
            "batch_input: needs a model that batches",
        ),
        (
            "target_name: \"Y\" source_input",
            "target_name: \"W\" source_input",
            INFER_STATUS_INVALID_ARGUMENT,
            "batch_output[0].target_name: 'W' is not an output of the config",
        ),
        (
            "dynamic_batching { }",
            "sequence_batching { }",
            INFER_STATUS_UNSUPPORTED,
            "batch_input with sequence_batching",
        ),
    ];
    for (from, to, code, want) in cases {
        assert!(RAGGED.contains(from), "{from}");
        let st = s.try_load("rag", &RAGGED.replacen(from, to, 1));
        let msg = expect_status(st, code);
        assert!(msg.contains(want), "{to}: {msg}");
    }
}
