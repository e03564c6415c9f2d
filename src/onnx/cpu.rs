//! ONNX models on the CPU through tract: `backend: "tract"`, and the engine for Triton's
//! ONNX names when ONNX Runtime cannot be loaded.
//!
//! Each instance owns one optimized plan of `<model_dir>/<version>/model.onnx` (or the
//! config's `default_model_filename`). When the model batches, dim 0 of every input is
//! one symbol in the plan, so the same plan serves every batch size up to
//! max_batch_size. Instance creation checks that what the config states agrees with the
//! model.

use super::model::*;
use crate::backend::{Batch, ModelInstance};
use crate::config::ModelConfig;
use crate::status::{Code, Error, Result};
use crate::tensor::{shape_string, DataType};
use std::path::Path;
use std::sync::Arc;
use tract_onnx::prelude::*;
use tract_onnx::tract_core::plan::SessionId;
use tract_onnx::tract_hir::infer::Factoid;

/// An instance of `file` on tract. The config's ONNX Runtime settings are read (and
/// refused by name where wrong) as on ONNX Runtime; of them tract uses
/// `intra_op_thread_count`: its matrix products then run on a pool of that many threads
/// (0: one per core) owned by the instance; without it, on the instance's worker thread.
pub(super) fn instance(
    config: &ModelConfig,
    file: &Path,
    what: &str,
) -> Result<Box<dyn ModelInstance>> {
    let settings = super::onnxruntime::Settings::of(config)?;
    let executor = match settings.intra_op_threads {
        None | Some(1) => None,
        Some(n) => Some(thread_pool(n, &config.name, what)?),
    };
    let plan = Plan::build(config, file, what)?;
    let state =
        RunState::new(&plan.runnable).map_err(|e| Error::internal(format!("{what}: {e:#}")))?;
    Ok(Box::new(OnnxInstance {
        plan,
        state,
        executor,
        what: what.to_owned(),
    }))
}

/// A pool of `n` threads (0: one per core) for tract's matrix products.
fn thread_pool(n: usize, model: &str, what: &str) -> Result<multithread::Executor> {
    let n = if n == 0 {
        std::thread::available_parallelism().map_or(1, |p| p.get())
    } else {
        n
    };
    let name = format!("infer-tract-{model}");
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(move |i| format!("{name}-{i}"))
        .build()
        .map_err(|e| {
            Error::exhausted(format!(
                "{what}: cannot start {n} threads (parameters.intra_op_thread_count): {e}"
            ))
        })?;
    Ok(multithread::Executor::MultiThread(Arc::new(pool)))
}

/// The tract datum type of a library datatype; None for those tract cannot run.
fn datum_type(dt: DataType) -> Option<DatumType> {
    Some(match dt {
        DataType::Bool => DatumType::Bool,
        DataType::Uint8 => DatumType::U8,
        DataType::Uint16 => DatumType::U16,
        DataType::Uint32 => DatumType::U32,
        DataType::Uint64 => DatumType::U64,
        DataType::Int8 => DatumType::I8,
        DataType::Int16 => DatumType::I16,
        DataType::Int32 => DatumType::I32,
        DataType::Int64 => DatumType::I64,
        DataType::Fp16 => DatumType::F16,
        DataType::Fp32 => DatumType::F32,
        DataType::Fp64 => DatumType::F64,
        DataType::Bytes | DataType::Bf16 | DataType::Invalid => return None,
    })
}

/// The library datatype of a tract datum type (TDim is how tract carries INT64 shapes).
fn data_type(dt: DatumType) -> Option<DataType> {
    Some(match dt {
        DatumType::Bool => DataType::Bool,
        DatumType::U8 => DataType::Uint8,
        DatumType::U16 => DataType::Uint16,
        DatumType::U32 => DataType::Uint32,
        DatumType::U64 => DataType::Uint64,
        DatumType::I8 => DataType::Int8,
        DatumType::I16 => DataType::Int16,
        DatumType::I32 => DataType::Int32,
        DatumType::I64 | DatumType::TDim => DataType::Int64,
        DatumType::F16 => DataType::Fp16,
        DatumType::F32 => DataType::Fp32,
        DatumType::F64 => DataType::Fp64,
        _ => return None,
    })
}

/// A tract dimension as the model declares it.
fn dim_of(d: &TDim) -> Dim {
    match d.to_i64() {
        Ok(v) => Dim::Fixed(v),
        Err(_) => Dim::Any(Some(d.to_string())),
    }
}

fn declared_inference(name: &str, fact: &InferenceFact) -> Declared {
    let dims = (!fact.shape.is_open()).then(|| {
        fact.shape
            .dims()
            .map(|d| d.concretize().map_or(Dim::Any(None), |d| dim_of(&d)))
            .collect()
    });
    Declared {
        name: name.to_owned(),
        dtype: fact.datum_type.concretize().map(carried),
        dims,
    }
}

fn declared_typed(name: &str, fact: &TypedFact) -> Declared {
    Declared {
        name: name.to_owned(),
        dtype: Some(carried(fact.datum_type)),
        dims: Some(fact.shape.iter().map(dim_of).collect()),
    }
}

fn carried(dt: DatumType) -> std::result::Result<DataType, String> {
    data_type(dt).ok_or_else(|| format!("{dt:?}"))
}

/// Reads the model file; operators tract does not implement are refused here, by name
/// and node.
fn load(file: &Path, what: &str, output_shapes: bool) -> Result<InferenceModel> {
    if !file.is_file() {
        return Err(Error::not_found(format!(
            "{what}: model file '{}' not found",
            file.display()
        )));
    }
    // The file's `value_info` (intermediate shapes) is not read: exporters write symbolic
    // shapes there that fail to unify with the sizes the graph computes; tract's own
    // analysis finds them.
    let onnx = tract_onnx::onnx()
        .with_ignore_output_shapes(!output_shapes)
        .with_ignore_value_info(true);
    let proto = onnx.proto_model_for_path(file).map_err(|e| {
        Error::invalid(format!(
            "{what}: '{}' is not an ONNX model: {e:#}",
            file.display()
        ))
    })?;
    // A file that decodes but that tract cannot turn into a graph uses something tract
    // does not implement (an attribute, a datatype, a mode).
    let dir = file.parent().and_then(Path::to_str);
    let parsed = onnx.parse(&proto, dir).map_err(|e| {
        Error::unsupported(format!(
            "{what}: the ONNX backend (tract) cannot read '{}': {e:#}",
            file.display()
        ))
    })?;
    if !parsed.unresolved_inputs.is_empty() {
        return Err(Error::invalid(format!(
            "{what}: '{}' uses tensors no node or initializer produces: {}",
            file.display(),
            parsed.unresolved_inputs.join(", ")
        )));
    }
    let model = parsed.model;
    let missing: Vec<String> = model
        .nodes()
        .iter()
        .filter_map(|n| {
            let op = n.op.name();
            let ty = op.strip_prefix("Unimplemented(")?.strip_suffix(')')?;
            Some(format!("operator '{ty}' (node '{}')", n.name))
        })
        .collect();
    if !missing.is_empty() {
        return Err(Error::unsupported(format!(
            "{what}: the ONNX backend (tract) does not support {}",
            missing.join(", ")
        )));
    }
    Ok(model)
}

fn model_inputs(model: &InferenceModel) -> Result<Vec<Declared>> {
    let outlets = model.input_outlets().map_err(tract_internal)?;
    outlets
        .iter()
        .map(|o| {
            let fact = model.outlet_fact(*o).map_err(tract_internal)?;
            Ok(declared_inference(&model.node(o.node).name, fact))
        })
        .collect()
}

/// An output's name: its ONNX name (the outlet label), else its node's name.
fn output_name(label: Option<&str>, node_name: &str) -> String {
    label.unwrap_or(node_name).to_owned()
}

fn tract_internal(e: TractError) -> Error {
    Error::internal(format!("tract: {e:#}"))
}

/// The inputs and outputs of the model as tract reads it, for auto-complete: outputs
/// from tract's analysis when the file's declarations are partial; for a file tract
/// cannot read, the graph's own declarations (it may still run on the GPU executor).
pub(super) fn declared(file: &Path, what: &str) -> Result<(Vec<Declared>, Vec<Declared>)> {
    let model = match load(file, what, true) {
        Ok(m) => m,
        Err(e) if e.code == crate::status::Code::Unsupported => {
            // What tract cannot read may still run on the GPU executor: complete the
            // config from the graph's declarations.
            return declared_from_graph(file, what).map_err(|_| e);
        }
        Err(e) => return Err(e),
    };
    let inputs = model_inputs(&model)?;
    // Output facts come from analysis of the graph, the file's output declarations
    // ignored, when it succeeds (a file may declare an output shape or type its graph
    // does not compute); else from analysis with the declarations, else from them.
    if let Some(outputs) = analysed_outputs(file, what) {
        return Ok((inputs, outputs));
    }
    let outputs: Vec<Declared> = {
        let outlets = model.output_outlets().map_err(tract_internal)?.to_vec();
        let declared: Vec<Declared> = outlets
            .iter()
            .map(|&o| {
                let fact = model.outlet_fact(o).map_err(tract_internal)?;
                Ok(declared_inference(
                    &output_name(model.outlet_label(o), &model.node(o.node).name),
                    fact,
                ))
            })
            .collect::<Result<_>>()?;
        let complete = declared.iter().all(|d| {
            d.dtype.is_some()
                && d.dims
                    .as_ref()
                    .is_some_and(|v| v.iter().all(|x| *x != Dim::Any(None)))
        });
        if complete {
            declared
        } else {
            match model.clone().into_typed() {
                // With every input known, a failed analysis is tract's limit: say so
                // rather than that the model does not declare an output.
                Err(e)
                    if inputs.iter().all(|d| d.dtype.is_some() && d.dims.is_some())
                        && declared
                            .iter()
                            .any(|d| d.dtype.is_none() || d.dims.is_none()) =>
                {
                    return Err(Error::unsupported(format!(
                        "{what}: the ONNX backend (tract) cannot analyse the model to complete its config: {e:#}"
                    )));
                }
                Ok(typed) => {
                    let outlets = typed.output_outlets().map_err(tract_internal)?.to_vec();
                    outlets
                        .iter()
                        .map(|&o| {
                            let fact = typed.outlet_fact(o).map_err(tract_internal)?;
                            Ok(declared_typed(
                                &output_name(typed.outlet_label(o), &typed.node(o.node).name),
                                fact,
                            ))
                        })
                        .collect::<Result<_>>()?
                }
                Err(_) => declared,
            }
        }
    };

    Ok((inputs, outputs))
}

/// The outputs tract's analysis of the graph finds (the file's own output declarations
/// ignored); None where tract cannot read or analyse the model.
pub(super) fn analysed_outputs(file: &Path, what: &str) -> Option<Vec<Declared>> {
    let model = load(file, what, false).ok()?;
    let typed = tract_stage(what, "analyse", || model.into_typed()).ok()?;
    let outlets = typed.output_outlets().ok()?.to_vec();
    outlets
        .iter()
        .map(|&o| {
            let fact = typed.outlet_fact(o).ok()?;
            Some(declared_typed(
                &output_name(typed.outlet_label(o), &typed.node(o.node).name),
                fact,
            ))
        })
        .collect()
}

/// One model input: where its data comes from in a batch, and its tract type.
struct PlanInput {
    name: String,
    dtype: DatumType,
}

struct PlanOutput {
    name: String,
    dtype: DatumType,
}

struct Plan {
    runnable: Arc<TypedRunnableModel>,
    inputs: Vec<PlanInput>,
    outputs: Vec<PlanOutput>,
}

impl Plan {
    fn build(config: &ModelConfig, file: &Path, what: &str) -> Result<Plan> {
        let mut model = load(file, what, false)?;
        let declared = model_inputs(&model)?;
        let batching = config.max_batch_size > 0;
        let batch = model.symbols.sym("batch_size");

        check_config_inputs(config, &declared, what)?;
        let mut inputs = Vec::with_capacity(declared.len());
        for (ix, d) in declared.iter().enumerate() {
            let exp = expected_input(config, d, what)?;
            let dt = check_tensor(what, exp.role, d, &exp, config.max_batch_size)?;
            // The plan's input fact: the batch symbol, fixed sizes, and for -1 the
            // model's own dim (or a symbol of its own).
            let model_dims = d.dims.clone().unwrap_or_default();
            let mut shape: TVec<TDim> = TVec::new();
            for (k, &want) in exp.dims.iter().enumerate() {
                let dim = if batching && k == 0 {
                    batch.to_dim()
                } else if want >= 0 {
                    TDim::from(want)
                } else {
                    match model_dims.get(k) {
                        Some(Dim::Fixed(v)) => TDim::from(*v),
                        Some(Dim::Any(Some(s))) => model.symbols.parse_tdim(s).map_err(|e| {
                            Error::internal(format!("{what}: input '{}': dim {s}: {e:#}", d.name))
                        })?,
                        _ => model.symbols.sym(&format!("{}_{k}", d.name)).to_dim(),
                    }
                };
                shape.push(dim);
            }
            model
                .set_input_fact(ix, InferenceFact::dt_shape(dt, shape))
                .map_err(|e| Error::invalid(format!("{what}: input '{}': {e:#}", d.name)))?;
            inputs.push(PlanInput {
                name: d.name.clone(),
                dtype: dt,
            });
        }

        let mut typed = tract_stage(what, "analyse", || model.into_typed())?;

        // The outputs the config asks for (and state outputs), in that order.
        let model_outputs: Vec<(String, OutletId)> = typed
            .output_outlets()
            .map_err(tract_internal)?
            .iter()
            .map(|&o| {
                (
                    output_name(typed.outlet_label(o), &typed.node(o.node).name),
                    o,
                )
            })
            .collect();
        let wanted = expected_outputs(config);
        let mut outlets = Vec::with_capacity(wanted.len());
        let mut outputs = Vec::with_capacity(wanted.len());
        for (name, exp) in &wanted {
            let Some((_, o)) = model_outputs.iter().find(|(n, _)| n == name) else {
                let have: Vec<&str> = model_outputs.iter().map(|(n, _)| n.as_str()).collect();
                return Err(Error::invalid(format!(
                    "{what}: {} '{name}' is not an output of the ONNX model (its outputs: {})",
                    exp.role,
                    have.join(", ")
                )));
            };
            let fact = typed.outlet_fact(*o).map_err(tract_internal)?;
            let d = declared_typed(name, fact);
            let dt = check_tensor(what, exp.role, &d, exp, config.max_batch_size)?;
            outlets.push(*o);
            outputs.push(PlanOutput {
                name: name.clone(),
                dtype: dt,
            });
        }
        // Outputs nobody reads are not computed.
        typed
            .select_output_outlets(&outlets)
            .map_err(tract_internal)?;
        let optimized = tract_stage(what, "optimize", || typed.into_optimized())?;
        let runnable = tract_stage(what, "plan", || optimized.into_runnable())?;
        Ok(Plan {
            runnable,
            inputs,
            outputs,
        })
    }
}

/// One of tract's stages on a model, its failure UNSUPPORTED naming the stage. tract
/// panics on some models it does not expect (an LSTM without an initial state over a
/// symbolic batch, for one): that too refuses the model rather than failing the load as
/// an internal error.
fn tract_stage<T>(what: &str, stage: &str, f: impl FnOnce() -> TractResult<T>) -> Result<T> {
    let why = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(v)) => return Ok(v),
        Ok(Err(e)) => format!("{e:#}"),
        Err(p) => format!("tract failed: {}", crate::status::panic_message(&*p)),
    };
    Err(Error::unsupported(format!(
        "{what}: the ONNX backend (tract) cannot {stage} the model: {why}"
    )))
}

/// Checks a tensor the model declares against what the config says; returns the tract
/// datum type to use.
fn check_tensor(
    what: &str,
    role: &str,
    d: &Declared,
    exp: &Expected,
    max_batch_size: u32,
) -> Result<DatumType> {
    let dt = datum_type(exp.dtype).ok_or_else(|| {
        Error::unsupported(format!(
            "{what}: {role} '{}' is {}, a datatype the ONNX backend cannot run",
            d.name,
            exp.dtype.as_str()
        ))
    })?;
    check_declared(what, role, d, exp, max_batch_size)?;
    Ok(dt)
}

/// An instance's tract run state, as good as new at the start of every run.
///
/// tract keeps what some operators carry from one run to the next in the run state: a
/// recurrent layer's hidden state (ONNX LSTM/GRU/RNN become a `Scan` that starts the
/// next run from the last one's final state, for streaming), a random generator's
/// position. One run state serves every batch of the instance, so that would carry one
/// request's values into the next request's answer. Each run therefore starts with
/// those operators' states made anew (the rest of the run state, its buffers and its
/// per-session scratch space, is reused). A run that failed or panicked part-way leaves
/// values and resolved symbols behind: the whole run state is rebuilt before the next
/// run. Sequences that carry state between requests do so through the sequence
/// batcher's implicit state, which is a model input and output, never through tract's.
struct RunState {
    plan: Arc<TypedRunnableModel>,
    state: TypedSimpleState,
    /// The nodes whose operator has a run state of its own.
    stateful: Vec<usize>,
    /// A run began and did not finish.
    broken: bool,
}

impl RunState {
    fn new(plan: &Arc<TypedRunnableModel>) -> TractResult<RunState> {
        let state = plan.spawn()?;
        let stateful = (state.op_states.iter().enumerate())
            .filter_map(|(ix, s)| s.is_some().then_some(ix))
            .collect();
        Ok(RunState {
            plan: plan.clone(),
            state,
            stateful,
            broken: false,
        })
    }

    /// Runs the plan on `inputs` from a fresh state.
    fn run(&mut self, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        if std::mem::replace(&mut self.broken, true) {
            self.state = self.plan.spawn()?;
        } else {
            self.reset_op_states()?;
        }
        let outputs = self.state.run(inputs)?;
        self.broken = false;
        Ok(outputs)
    }

    /// Makes the stateful operators' states anew, as spawning a run state does.
    fn reset_op_states(&mut self) -> TractResult<()> {
        let model = self.plan.model();
        for &ix in &self.stateful {
            // Creating an operator's state reads no session (the ones that key on it do
            // so when they run, under the run state's own session).
            let ctx = self.state.turn_state.context(SessionId::NONE, ix);
            let fresh = model.node(ix).op().state(&ctx)?;
            self.state.op_states[ix] = fresh;
        }
        Ok(())
    }
}

struct OnnxInstance {
    plan: Plan,
    state: RunState,
    /// The instance's thread pool for tract's matrix products, if it has one.
    executor: Option<multithread::Executor>,
    what: String,
}

impl ModelInstance for OnnxInstance {
    fn execute(&mut self, batch: &mut Batch) -> Result<()> {
        let mut inputs: TVec<TValue> = TVec::with_capacity(self.plan.inputs.len());
        for pi in &self.plan.inputs {
            let (bi, data) = batch.input(&pi.name).ok_or_else(|| {
                Error::invalid(format!(
                    "{}: input '{}' is missing from the batch",
                    self.what, pi.name
                ))
            })?;
            let shape: TVec<usize> = bi.shape.iter().map(|&d| d.max(0) as usize).collect();
            let tensor = if pi.dtype == DatumType::Bool {
                // Any non-zero byte is true; tract's bool must be 0 or 1.
                let v: Vec<bool> = data.iter().map(|&b| b != 0).collect();
                Tensor::from_shape(&shape, &v)
            } else {
                // SAFETY: every bit pattern is a valid value of the numeric types used
                // here; the length is checked against the shape.
                unsafe { Tensor::from_raw_dt(pi.dtype, &shape, data) }
            }
            .map_err(|e| Error::invalid(format!("{}: input '{}': {e:#}", self.what, pi.name)))?;
            inputs.push(tensor.into_tvalue());
        }
        let state = &mut self.state;
        let outs = match &self.executor {
            Some(pool) => multithread::multithread_tract_scope(pool.clone(), || state.run(inputs)),
            None => state.run(inputs),
        }
        .map_err(|e| {
            Error::new(
                Code::Internal,
                format!("{}: execution failed: {e:#}", self.what),
            )
        })?;
        for (po, t) in self.plan.outputs.iter().zip(outs) {
            let t = if t.datum_type() == po.dtype {
                t
            } else {
                t.cast_to_dt(po.dtype)
                    .map_err(|e| {
                        Error::internal(format!("{}: output '{}': {e:#}", self.what, po.name))
                    })?
                    .into_owned()
                    .into_tvalue()
            };
            let shape: Vec<i64> = t.shape().iter().map(|&d| d as i64).collect();
            let out = batch.alloc_output(&po.name, &shape, None)?;
            // tract's bool is one byte of 0 or 1, as BOOL is.
            let bytes = t.as_bytes();
            if out.len() != bytes.len() {
                return Err(Error::internal(format!(
                    "{}: output '{}' has {} bytes for shape {}, expected {}",
                    self.what,
                    po.name,
                    bytes.len(),
                    shape_string(&shape),
                    out.len()
                )));
            }
            out.copy_from_slice(bytes);
        }
        Ok(())
    }
}
