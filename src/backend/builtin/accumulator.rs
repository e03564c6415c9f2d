//! `accumulator`: a stateful model for sequence batching. OUTPUT is the running sum of
//! INPUT (INT32, INT64, FP32 or FP64, any dims) over a sequence; integers wrap on
//! overflow. The config needs `sequence_batching`; the mode is chosen from it:
//!
//! - Implicit state (`sequence_batching.state` given): the first state carries the sum.
//!   OUTPUT = INPUT + state input, element-wise, and the state output gets the same
//!   values. A state of one element per row is broadcast. The library supplies the
//!   initial state when a sequence starts, so no control is needed.
//! - Own state (no state configured): the instance keeps the sums, keyed by the row's
//!   CONTROL_SEQUENCE_CORRID value when that control is configured, else by batch slot
//!   (row index). CONTROL_SEQUENCE_START (required) resets a sum; a row whose
//!   CONTROL_SEQUENCE_READY is false is padding: its sum is left alone and its OUTPUT
//!   row is zeros; CONTROL_SEQUENCE_END forgets a correlation ID's sum.

use super::typed;
use crate::backend::{simulate_compute, Backend, Batch, ModelInstance};
use crate::config::{ControlKind, ModelConfig, SequenceBatching, SequenceStrategy};
use crate::status::{Error, Result};
use crate::tensor::{
    bytes_element_offsets, count_bytes_elements, element_count, shape_string, DataType,
};
use std::collections::HashMap;
use std::ops::Add;
use std::sync::Arc;

pub struct Accumulator;

/// An element type the accumulator sums.
trait Elem: bytemuck::Pod + Default + Send {
    /// Addition that never panics (integers wrap).
    fn plus(self, other: Self) -> Self;
}

macro_rules! elem {
    ($($t:ty: $plus:ident),*) => {
        $(impl Elem for $t {
            fn plus(self, other: Self) -> Self {
                <$t>::$plus(self, other)
            }
        })*
    };
}
elem!(i32: wrapping_add, i64: wrapping_add, f32: add, f64: add);

/// A boolean control (START, END, READY): an element is true when its bytes are `truth`.
struct Flag {
    name: Arc<str>,
    truth: Vec<u8>,
}

enum Mode {
    /// Implicit state: the state's input and output names.
    State { input: Arc<str>, output: Arc<str> },
    /// The instance keeps the sums; `corrid` is the CORRID control (name, datatype).
    Own {
        start: Flag,
        ready: Option<Flag>,
        end: Option<Flag>,
        corrid: Option<(Arc<str>, DataType)>,
    },
}

struct AccumulatorInstance<T> {
    mode: Mode,
    /// The model has a batch dimension (max_batch_size > 0).
    batched: bool,
    delay_us: u64,
    /// Own-state sums by batch slot (no CORRID control).
    by_slot: Vec<Vec<T>>,
    /// Own-state sums by correlation ID bytes.
    by_id: HashMap<Vec<u8>, Vec<T>>,
}

fn flag(model: &str, seq: &SequenceBatching, kind: ControlKind) -> Result<Option<Flag>> {
    let Some(c) = seq.control(kind) else {
        return Ok(None);
    };
    match c.false_true.as_ref().map(|ft| &ft[1]) {
        Some(truth) if !truth.is_empty() => Ok(Some(Flag {
            name: c.name.clone(),
            truth: truth.clone(),
        })),
        _ => Err(Error::invalid(format!(
            "model '{model}': control '{}' ({}) has no true value",
            c.name,
            kind.as_str()
        ))),
    }
}

impl Backend for Accumulator {
    fn create_instance(
        self: Arc<Self>,
        config: &Arc<ModelConfig>,
        _index: u32,
        _gpu: i32,
    ) -> Result<Box<dyn ModelInstance>> {
        let name = &config.name;
        let seq = config.sequence_batching.as_ref().ok_or_else(|| {
            Error::invalid(format!(
                "model '{name}': the accumulator backend needs sequence_batching"
            ))
        })?;
        let (Some(input), Some(output)) = (config.input("INPUT"), config.output("OUTPUT")) else {
            return Err(Error::invalid(format!(
                "model '{name}': the accumulator backend needs input INPUT and output OUTPUT"
            )));
        };
        let dtype = input.data_type;
        if !matches!(
            dtype,
            DataType::Int32 | DataType::Int64 | DataType::Fp32 | DataType::Fp64
        ) {
            return Err(Error::unsupported(format!(
                "model '{name}': the accumulator backend supports INT32, INT64, FP32 and FP64, not {}",
                dtype.as_str()
            )));
        }
        if output.data_type != dtype {
            return Err(Error::invalid(format!(
                "model '{name}': OUTPUT is {} but INPUT is {}; the accumulator needs one datatype",
                output.data_type.as_str(),
                dtype.as_str()
            )));
        }
        let mode = if let Some(st) = seq.states.first() {
            if st.data_type != dtype {
                return Err(Error::invalid(format!(
                    "model '{name}': state '{}' is {} but INPUT is {}",
                    st.input_name,
                    st.data_type.as_str(),
                    dtype.as_str()
                )));
            }
            Mode::State {
                input: st.input_name.clone(),
                output: st.output_name.clone(),
            }
        } else {
            let start = flag(name, seq, ControlKind::Start)?.ok_or_else(|| {
                Error::invalid(format!(
                    "model '{name}': the accumulator backend needs a CONTROL_SEQUENCE_START control or an implicit state"
                ))
            })?;
            let corrid = seq
                .control(ControlKind::CorrId)
                .map(|c| (c.name.clone(), c.data_type));
            // Without a correlation ID the sums are kept per batch slot, and only the
            // direct strategy keeps a sequence in one slot: under oldest, a row is a
            // place in one batch, and the next batch puts other sequences there.
            let oldest = matches!(seq.strategy, SequenceStrategy::Oldest { .. });
            if oldest && corrid.is_none() && config.max_batch_size > 1 {
                return Err(Error::invalid(format!(
                    "model '{name}': the accumulator backend keeps each sequence's sum in its batch slot, which the oldest strategy does not keep from one batch to the next; add a CONTROL_SEQUENCE_CORRID control or an implicit state, or use direct"
                )));
            }
            Mode::Own {
                start,
                ready: flag(name, seq, ControlKind::Ready)?,
                end: flag(name, seq, ControlKind::End)?,
                corrid,
            }
        };
        let batched = config.max_batch_size > 0;
        let delay_us = super::execute_delay_us(config)?;
        Ok(match dtype {
            DataType::Int32 => AccumulatorInstance::<i32>::boxed(mode, batched, delay_us),
            DataType::Int64 => AccumulatorInstance::<i64>::boxed(mode, batched, delay_us),
            DataType::Fp32 => AccumulatorInstance::<f32>::boxed(mode, batched, delay_us),
            _ => AccumulatorInstance::<f64>::boxed(mode, batched, delay_us),
        })
    }
}

/// (rows, elements per row) of a batched tensor, checking that `len` bytes fit the shape.
fn rows_of(
    model: &str,
    name: &str,
    shape: &[i64],
    batched: bool,
    len: usize,
    elem: usize,
) -> Result<(usize, usize)> {
    let split = if batched {
        shape
            .split_first()
            .and_then(|(d0, rest)| Some((usize::try_from(*d0).ok()?, element_count(rest)?)))
    } else {
        element_count(shape).map(|n| (1, n))
    };
    match split {
        Some((rows, per_row))
            if rows.checked_mul(per_row).and_then(|n| n.checked_mul(elem)) == Some(len) =>
        {
            Ok((rows, per_row))
        }
        _ => Err(Error::invalid(format!(
            "model '{model}': '{name}' of shape {} does not match its {len} bytes",
            shape_string(shape)
        ))),
    }
}

/// The bytes of control input `name`, or INTERNAL when the library did not add it.
fn control<'a>(batch: &'a Batch, name: &str) -> Result<&'a [u8]> {
    batch.input(name).map(|(_, data)| data).ok_or_else(|| {
        Error::internal(format!(
            "model '{}': control input '{name}' is missing from the batch",
            batch.config.name
        ))
    })
}

/// One element per row: each row's element as bytes (a BYTES element without its length).
fn elements<'a>(
    batch: &'a Batch,
    name: &str,
    dtype: DataType,
    rows: usize,
) -> Result<Vec<&'a [u8]>> {
    let data = control(batch, name)?;
    let elems: Vec<&[u8]> = if dtype == DataType::Bytes {
        count_bytes_elements(data).map_err(|e| {
            e.context(format_args!(
                "model '{}': control input '{name}'",
                batch.config.name
            ))
        })?;
        bytes_element_offsets(data)
            .windows(2)
            .filter_map(|w| data.get(w[0] + 4..w[1]))
            .collect()
    } else {
        data.chunks_exact(dtype.byte_size().max(1)).collect()
    };
    if elems.len() < rows {
        return Err(Error::invalid(format!(
            "model '{}': control input '{name}' has {} elements for {rows} rows",
            batch.config.name,
            elems.len()
        )));
    }
    Ok(elems)
}

/// Per row: whether `flag` is true.
fn flags(batch: &Batch, flag: &Flag, rows: usize) -> Result<Vec<bool>> {
    let data = control(batch, &flag.name)?;
    let size = flag.truth.len();
    if data.len() < rows.saturating_mul(size) {
        return Err(Error::invalid(format!(
            "model '{}': control input '{}' has {} bytes for {rows} rows",
            batch.config.name,
            flag.name,
            data.len()
        )));
    }
    Ok(data
        .chunks_exact(size)
        .take(rows)
        .map(|e| e == flag.truth)
        .collect())
}

impl<T: Elem> AccumulatorInstance<T> {
    fn boxed(mode: Mode, batched: bool, delay_us: u64) -> Box<dyn ModelInstance> {
        Box::new(AccumulatorInstance::<T> {
            mode,
            batched,
            delay_us,
            by_slot: Vec::new(),
            by_id: HashMap::new(),
        })
    }

    /// OUTPUT for INPUT `x` (rows of `per_row` elements); updates the sums.
    fn sums(&mut self, batch: &Batch, x: &[T], rows: usize, per_row: usize) -> Result<Vec<T>> {
        let model = &batch.config.name;
        let mut out = vec![T::default(); x.len()];
        match &self.mode {
            Mode::State { input, .. } => {
                let (si, data) = batch.input(input).ok_or_else(|| {
                    Error::internal(format!(
                        "model '{model}': state input '{input}' is missing from the batch"
                    ))
                })?;
                let elem = std::mem::size_of::<T>();
                let (srows, sper) =
                    rows_of(model, input, &si.shape, self.batched, data.len(), elem)?;
                if srows != rows || (sper != per_row && sper != 1) {
                    let ishape = batch.input("INPUT").map(|(i, _)| shape_string(&i.shape));
                    return Err(Error::invalid(format!(
                        "model '{model}': state '{input}' of shape {} does not fit INPUT of shape {}",
                        shape_string(&si.shape),
                        ishape.unwrap_or_default()
                    )));
                }
                let state = typed::<T>(data);
                for (i, (o, v)) in out.iter_mut().zip(x).enumerate() {
                    let s = if sper == 1 { i / per_row.max(1) } else { i };
                    *o = v.plus(state[s]);
                }
            }
            Mode::Own {
                start,
                ready,
                end,
                corrid,
            } => {
                let start = flags(batch, start, rows)?;
                let ready = ready.as_ref().map(|f| flags(batch, f, rows)).transpose()?;
                let end = end.as_ref().map(|f| flags(batch, f, rows)).transpose()?;
                let ids = match corrid {
                    Some((name, dtype)) => Some(elements(batch, name, *dtype, rows)?),
                    None => None,
                };
                for r in 0..rows {
                    if ready.as_ref().is_some_and(|v| !v[r]) {
                        continue; // padding: zeros out, state untouched
                    }
                    let sum = match &ids {
                        Some(ids) => self.by_id.entry(ids[r].to_vec()).or_default(),
                        None => {
                            if self.by_slot.len() <= r {
                                self.by_slot.resize_with(r + 1, Vec::new);
                            }
                            &mut self.by_slot[r]
                        }
                    };
                    if start[r] || sum.len() != per_row {
                        sum.clear();
                        sum.resize(per_row, T::default());
                    }
                    let row = r * per_row..(r + 1) * per_row;
                    for (s, v) in sum.iter_mut().zip(&x[row.clone()]) {
                        *s = s.plus(*v);
                    }
                    out[row].copy_from_slice(sum);
                    if let (Some(ids), Some(true)) = (&ids, end.as_ref().map(|e| e[r])) {
                        self.by_id.remove(ids[r]);
                    }
                }
            }
        }
        Ok(out)
    }
}

impl<T: Elem> ModelInstance for AccumulatorInstance<T> {
    fn execute(&mut self, batch: &mut Batch) -> Result<()> {
        simulate_compute(self.delay_us);
        let model = &batch.config.name;
        let (input, data) = batch
            .input("INPUT")
            .ok_or_else(|| Error::invalid(format!("model '{model}': INPUT missing")))?;
        let shape = input.shape.clone();
        let elem = std::mem::size_of::<T>();
        let (rows, per_row) = rows_of(model, "INPUT", &shape, self.batched, data.len(), elem)?;
        let out = self.sums(batch, &typed::<T>(data), rows, per_row)?;
        let bytes: &[u8] = bytemuck::cast_slice(&out);
        if let Mode::State { output, .. } = &self.mode {
            batch
                .alloc_output(output, &shape, None)?
                .copy_from_slice(bytes);
            if &**output == "OUTPUT" {
                return Ok(()); // the state output is the model output
            }
        }
        if batch.config.output("OUTPUT").is_some() {
            batch
                .alloc_output("OUTPUT", &shape, None)?
                .copy_from_slice(bytes);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_config;
    use crate::status::Code;
    use crate::tensor::Shape;

    const CONTROLS: &str = r#"
        { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
        { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }"#;

    fn config(dtype: &str, max_batch: u32, sequence: &str) -> Arc<ModelConfig> {
        let text = format!(
            r#"name: "acc" backend: "accumulator" max_batch_size: {max_batch}
            input [ {{ name: "INPUT" data_type: {dtype} dims: [ 2 ] }} ]
            output [ {{ name: "OUTPUT" data_type: {dtype} dims: [ 2 ] }} ]
            {sequence}"#
        );
        Arc::new(parse_config(&text).unwrap())
    }

    fn create(config: &Arc<ModelConfig>) -> Result<Box<dyn ModelInstance>> {
        Arc::new(Accumulator).create_instance(config, 0, -1)
    }

    type In = (&'static str, DataType, Vec<i64>, Vec<u8>);

    fn batch(config: &Arc<ModelConfig>, size: u32, inputs: Vec<In>) -> Batch {
        let mut b = Batch {
            requests: Vec::new(),
            first_rows: Vec::new(),
            size,
            inputs: Vec::new(),
            outputs: Vec::new(),
            row_errors: Vec::new(),
            config: config.clone(),
            error_message: None,
            gpu: None,
            senders: Vec::new(),
        };
        for (name, dtype, shape, data) in inputs {
            let c_name = Arc::new(std::ffi::CString::new(name).unwrap());
            b.push_input(name.into(), c_name, dtype, Shape::from_vec(shape), data);
        }
        b
    }

    fn bytes<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    fn output<T: bytemuck::Pod>(b: &Batch, name: &str) -> Vec<T> {
        let o = b.outputs.iter().find(|o| &*o.name == name).unwrap();
        bytemuck::pod_collect_to_vec(&o.data)
    }

    /// Runs a batch of INT32 rows (2 elements each) with START and READY controls.
    fn run(
        inst: &mut Box<dyn ModelInstance>,
        cfg: &Arc<ModelConfig>,
        input: &[i32],
        start: &[i32],
        ready: &[i32],
        extra: Vec<In>,
    ) -> Vec<i32> {
        let rows = start.len() as i64;
        let mut inputs = vec![
            ("INPUT", DataType::Int32, vec![rows, 2], bytes(input)),
            ("START", DataType::Int32, vec![rows, 1], bytes(start)),
            ("READY", DataType::Int32, vec![rows, 1], bytes(ready)),
        ];
        inputs.extend(extra);
        let mut b = batch(cfg, rows as u32, inputs);
        inst.execute(&mut b).unwrap();
        output(&b, "OUTPUT")
    }

    #[test]
    fn own_state_by_slot() {
        let cfg = config(
            "TYPE_INT32",
            4,
            &format!("sequence_batching {{ control_input [ {CONTROLS} ] }}"),
        );
        let mut inst = create(&cfg).unwrap();
        let out = run(&mut inst, &cfg, &[1, 2, 10, 20], &[1, 1], &[1, 1], vec![]);
        assert_eq!(out, [1, 2, 10, 20]);
        // Slot 1 is padding (not ready): zeros out, its sum kept; slot 2 starts.
        let input = [1, 1, 5, 5, 7, 7];
        let out = run(&mut inst, &cfg, &input, &[0, 0, 1], &[1, 0, 1], vec![]);
        assert_eq!(out, [2, 3, 0, 0, 7, 7]);
        let out = run(&mut inst, &cfg, &[1, 1, 1, 1], &[0, 0], &[1, 1], vec![]);
        assert_eq!(out, [3, 4, 11, 21]);
        // START resets; integers wrap instead of panicking.
        let input = [i32::MAX, 0, 1, 1];
        let out = run(&mut inst, &cfg, &input, &[1, 0], &[1, 1], vec![]);
        assert_eq!(out, [i32::MAX, 0, 12, 22]);
        let out = run(&mut inst, &cfg, &[1, 0, 0, 0], &[0, 0], &[1, 1], vec![]);
        assert_eq!(out, [i32::MIN, 0, 12, 22]);
        // A control the library did not add fails the batch.
        let mut b = batch(
            &cfg,
            1,
            vec![("INPUT", DataType::Int32, vec![1, 2], bytes(&[1i32, 1]))],
        );
        let e = inst.execute(&mut b).unwrap_err();
        assert_eq!(e.code, Code::Internal);
        assert!(
            e.message.contains("'START'") && e.message.contains("'acc'"),
            "{e}"
        );
    }

    #[test]
    fn own_state_by_corrid() {
        let seq = |corrid: &str| {
            format!(
                r#"sequence_batching {{ control_input [ {CONTROLS},
                {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END bool_false_true: [ false, true ] }} ] }},
                {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: {corrid} }} ] }} ] }}"#
            )
        };
        let cfg = config("TYPE_INT32", 2, &seq("TYPE_UINT64"));
        let mut inst = create(&cfg).unwrap();
        let ids = |ids: &[u64], end: &[bool]| {
            let n = ids.len() as i64;
            let end: Vec<u8> = end.iter().map(|&e| u8::from(e)).collect();
            vec![
                ("CORRID", DataType::Uint64, vec![n, 1], bytes(ids)),
                ("END", DataType::Bool, vec![n, 1], end),
            ]
        };
        let out = run(
            &mut inst,
            &cfg,
            &[1, 2, 3, 4],
            &[1, 1],
            &[1, 1],
            ids(&[7, 9], &[false, false]),
        );
        assert_eq!(out, [1, 2, 3, 4]);
        // The sums follow the correlation IDs, not the rows; END forgets 9.
        let out = run(
            &mut inst,
            &cfg,
            &[1, 1, 1, 1],
            &[0, 0],
            &[1, 1],
            ids(&[9, 7], &[true, false]),
        );
        assert_eq!(out, [4, 5, 2, 3]);
        let out = run(
            &mut inst,
            &cfg,
            &[1, 1, 1, 1],
            &[0, 0],
            &[1, 1],
            ids(&[9, 7], &[false, false]),
        );
        assert_eq!(out, [1, 1, 3, 4]);

        let cfg = config("TYPE_INT32", 2, &seq("TYPE_STRING"));
        let mut inst = create(&cfg).unwrap();
        let ids = |ids: &[&str]| {
            let mut data = Vec::new();
            for id in ids {
                data.extend_from_slice(&(id.len() as u32).to_le_bytes());
                data.extend_from_slice(id.as_bytes());
            }
            let n = ids.len() as i64;
            vec![
                ("CORRID", DataType::Bytes, vec![n, 1], data),
                ("END", DataType::Bool, vec![n, 1], vec![0; ids.len()]),
            ]
        };
        let out = run(
            &mut inst,
            &cfg,
            &[1, 2, 3, 4],
            &[1, 1],
            &[1, 1],
            ids(&["a", "bc"]),
        );
        assert_eq!(out, [1, 2, 3, 4]);
        let out = run(
            &mut inst,
            &cfg,
            &[1, 1, 1, 1],
            &[0, 0],
            &[1, 1],
            ids(&["bc", "a"]),
        );
        assert_eq!(out, [4, 5, 2, 3]);
    }

    #[test]
    fn implicit_state() {
        let seq = r#"sequence_batching { state [ { input_name: "STATE_IN" output_name: "STATE_OUT"
            data_type: TYPE_FP32 dims: [ -1 ] } ] }"#;
        let cfg = config("TYPE_FP32", 4, seq);
        let mut inst = create(&cfg).unwrap();
        let input = bytes(&[1f32, 2., 3., 4.]);
        // A scalar state per row is broadcast.
        let mut b = batch(
            &cfg,
            2,
            vec![
                ("INPUT", DataType::Fp32, vec![2, 2], input.clone()),
                ("STATE_IN", DataType::Fp32, vec![2, 1], bytes(&[10f32, 20.])),
            ],
        );
        inst.execute(&mut b).unwrap();
        assert_eq!(output::<f32>(&b, "OUTPUT"), [11., 12., 23., 24.]);
        assert_eq!(output::<f32>(&b, "STATE_OUT"), [11., 12., 23., 24.]);
        assert_eq!(&b.outputs[0].shape[..], &[2, 2]);
        // A full-size state is added element-wise.
        let state = bytes(&[0.5f32, 1.5, 2.5, 3.5]);
        let mut b = batch(
            &cfg,
            2,
            vec![
                ("INPUT", DataType::Fp32, vec![2, 2], input.clone()),
                ("STATE_IN", DataType::Fp32, vec![2, 2], state),
            ],
        );
        inst.execute(&mut b).unwrap();
        assert_eq!(output::<f32>(&b, "OUTPUT"), [1.5, 3.5, 5.5, 7.5]);
        // Any other size fails the batch, naming both shapes.
        let mut b = batch(
            &cfg,
            2,
            vec![
                ("INPUT", DataType::Fp32, vec![2, 2], input),
                ("STATE_IN", DataType::Fp32, vec![2, 3], bytes(&[0f32; 6])),
            ],
        );
        let e = inst.execute(&mut b).unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(
            e.message.contains("[2,3]") && e.message.contains("[2,2]"),
            "{e}"
        );

        // Without a batch dimension: one row.
        let cfg = config("TYPE_FP32", 0, seq);
        let mut inst = create(&cfg).unwrap();
        let mut b = batch(
            &cfg,
            1,
            vec![
                ("INPUT", DataType::Fp32, vec![2], bytes(&[1f32, 2.])),
                ("STATE_IN", DataType::Fp32, vec![1], bytes(&[5f32])),
            ],
        );
        inst.execute(&mut b).unwrap();
        assert_eq!(output::<f32>(&b, "STATE_OUT"), [6., 7.]);
        assert_eq!(&b.outputs[1].shape[..], &[2]);
    }

    #[test]
    fn create_errors() {
        let err = |cfg: &Arc<ModelConfig>| create(cfg).err().unwrap();
        let e = err(&config("TYPE_INT32", 4, ""));
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(
            e.message.contains("'acc'") && e.message.contains("sequence_batching"),
            "{e}"
        );

        let e = err(&config("TYPE_INT32", 4, "sequence_batching { }"));
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(
            e.message.contains("'acc'") && e.message.contains("START"),
            "{e}"
        );

        let seq = format!("sequence_batching {{ control_input [ {CONTROLS} ] }}");
        let e = err(&config("TYPE_INT8", 4, &seq));
        assert_eq!(e.code, Code::Unsupported);
        assert!(
            e.message.contains("'acc'") && e.message.contains("INT8"),
            "{e}"
        );

        let state = r#"sequence_batching { state [ { input_name: "S_IN" output_name: "S_OUT"
            data_type: TYPE_INT64 dims: [ 1 ] } ] }"#;
        let e = err(&config("TYPE_INT32", 4, state));
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(
            e.message.contains("'acc'") && e.message.contains("INT64"),
            "{e}"
        );
        assert!(create(&config("TYPE_INT64", 4, state)).is_ok());
    }
}
