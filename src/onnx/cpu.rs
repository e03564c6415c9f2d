//! ONNX models on the CPU through tract, selected with Triton's names
//! `platform: "onnxruntime_onnx"` or `backend: "onnxruntime"`.
//!
//! Each instance owns one optimized plan of `<model_dir>/<version>/model.onnx` (or the
//! config's `default_model_filename`). When the model batches, dim 0 of every input is
//! one symbol in the plan, so the same plan serves every batch size up to
//! max_batch_size. Before the config is checked, [`autocomplete`] fills in what the
//! config leaves out (inputs, outputs, datatypes, dims, max_batch_size) from the model,
//! as Triton does; instance creation then checks that what the config states agrees
//! with the model.

use crate::backend::{Backend, Batch, InstancePlace, ModelInstance};
use crate::config::{pb, ModelConfig, RawConfig};
use crate::folder::{check_relative, Folder};
use crate::status::{Code, Error, Result};
use crate::tensor::{shape_string, DataType};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tract_onnx::prelude::*;
use tract_onnx::tract_core::plan::SessionId;
use tract_onnx::tract_hir::infer::Factoid;

/// The batch size Triton's auto-complete gives a model that can batch.
const DEFAULT_MAX_BATCH_SIZE: i32 = 4;

/// Whether a config's backend (or platform) name selects an ONNX engine: Triton's names
/// for ONNX Runtime, or `tract`.
pub fn is_onnx(key: &str) -> bool {
    key == "onnxruntime_onnx" || key == "onnxruntime" || key == TRACT
}

/// The backend name that asks for tract.
pub const TRACT: &str = "tract";

/// Which engine computes a model's CPU instances.
#[derive(Clone, Copy)]
pub enum Engine {
    OnnxRuntime(&'static crate::onnx::onnxruntime::Runtime),
    Tract,
}

/// ONNX models: on ONNX Runtime when it is loaded (CPU instances, and GPU instances when
/// it has the CUDA provider), else on tract; GPU instances without ONNX Runtime's CUDA
/// provider run on the library's own GPU executor (`onnx::gpu`).
pub struct OnnxBackend {
    pub engine: Engine,
}

impl OnnxBackend {
    fn ort_gpu(&self) -> Option<&'static crate::onnx::onnxruntime::Runtime> {
        match self.engine {
            Engine::OnnxRuntime(rt) if rt.cuda => Some(rt),
            _ => None,
        }
    }
}

impl Backend for OnnxBackend {
    /// On KIND_GPU instances ONNX Runtime's CUDA provider, or the GPU executor.
    fn runs_on_gpu(&self) -> bool {
        true
    }

    fn auto_prefers_gpu(&self) -> bool {
        true
    }

    fn manages_device(&self) -> bool {
        self.ort_gpu().is_some()
    }

    fn create_instance(
        self: Arc<Self>,
        config: &Arc<ModelConfig>,
        _index: u32,
        _gpu: i32,
    ) -> Result<Box<dyn ModelInstance>> {
        Err(Error::invalid(format!(
            "model '{}': an ONNX model needs its version folder",
            config.name
        )))
    }

    fn create_version_instance(
        self: Arc<Self>,
        config: &Arc<ModelConfig>,
        at: &InstancePlace<'_>,
    ) -> Result<Box<dyn ModelInstance>> {
        use crate::onnx::onnxruntime::{OrtInstance, Place};
        let dir = at.model_dir.ok_or_else(|| {
            Error::invalid(format!(
                "model '{}': an ONNX model needs a model folder (give model_dir or a model repository)",
                config.name
            ))
        })?;
        let what = format!("model '{}' version {}", config.name, at.version);
        let file = model_file(dir, at.version, &config.default_model_filename, &what)?;
        if at.gpu >= 0 {
            if let Some(rt) = self.ort_gpu() {
                return Ok(Box::new(OrtInstance::new(
                    rt,
                    config,
                    &file,
                    Place::Gpu(at.gpu),
                    &what,
                )?));
            }
            // On a GPU instance: the GPU executor (the context is bound by the caller).
            return Ok(Box::new(crate::onnx::gpu::OnnxGpuInstance::new(
                config, &file, at.gpu, &what,
            )?));
        }
        if let Engine::OnnxRuntime(rt) = self.engine {
            return Ok(Box::new(OrtInstance::new(
                rt,
                config,
                &file,
                Place::Cpu,
                &what,
            )?));
        }
        refuse_cpu_accelerators(config, &what)?;
        let plan = Plan::build(config, &file, &what)?;
        let state =
            RunState::new(&plan.runnable).map_err(|e| Error::internal(format!("{what}: {e:#}")))?;
        Ok(Box::new(OnnxInstance { plan, state, what }))
    }
}

/// A CPU accelerator (OpenVINO) is ONNX Runtime's: refused, naming the field, where tract
/// runs the model.
fn refuse_cpu_accelerators(config: &ModelConfig, what: &str) -> Result<()> {
    let asked = config
        .optimization
        .as_ref()
        .and_then(|o| o.execution_accelerators.as_ref())
        .is_some_and(|a| !a.cpu_execution_accelerator.is_empty());
    if asked {
        return Err(Error::unsupported(format!(
            "{what}: optimization.execution_accelerators.cpu_execution_accelerator: runs on ONNX Runtime only, and this model runs on tract (ONNX Runtime is not loaded, or backend is \"tract\")"
        )));
    }
    Ok(())
}

/// The model file of a version: `<version>/<default_model_filename or model.onnx>`,
/// a regular file inside the model folder's root.
pub(super) fn model_file(
    dir: &Folder,
    version: i64,
    default_filename: &str,
    what: &str,
) -> Result<PathBuf> {
    let file = if default_filename.is_empty() {
        "model.onnx"
    } else {
        default_filename
    };
    check_relative(file, &format!("{what}: default_model_filename"))?;
    dir.file(&format!("{version}/{file}"), &format!("{what}: model file"))
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

/// The `TYPE_*` value of the config schema for a datatype.
fn pb_data_type(dt: DataType) -> i32 {
    pb::DataType::from_str_name(&format!("TYPE_{}", dt.as_str())).map_or(0, |t| t as i32)
}

/// A dimension as the model declares it.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Dim {
    Fixed(i64),
    /// A named symbol (ONNX `dim_param`) or an unknown size.
    Any(Option<TDim>),
}

impl Dim {
    fn of(d: &TDim) -> Dim {
        match d.to_i64() {
            Ok(v) => Dim::Fixed(v),
            Err(_) => Dim::Any(Some(d.clone())),
        }
    }
    /// The config's dim: a size, or -1 for any size (also for a fixed 0, which configs
    /// cannot state).
    fn config(&self) -> i64 {
        match self {
            Dim::Fixed(v) if *v > 0 => *v,
            _ => -1,
        }
    }
}

fn dims_string(dims: &[Dim]) -> String {
    let parts: Vec<String> = dims
        .iter()
        .map(|d| match d {
            Dim::Fixed(v) => v.to_string(),
            Dim::Any(Some(s)) => s.to_string(),
            Dim::Any(None) => "?".to_owned(),
        })
        .collect();
    format!("[{}]", parts.join(","))
}

/// A tensor as the model declares it: datatype and dims when known.
#[derive(Clone, Debug)]
pub(super) struct Declared {
    pub(super) name: String,
    /// Err: a type the library cannot carry (its name).
    pub(super) dtype: Option<std::result::Result<DataType, String>>,
    /// None: the rank is unknown.
    pub(super) dims: Option<Vec<Dim>>,
}

fn declared_inference(name: &str, fact: &InferenceFact) -> Declared {
    let dims = (!fact.shape.is_open()).then(|| {
        fact.shape
            .dims()
            .map(|d| d.concretize().map_or(Dim::Any(None), |d| Dim::of(&d)))
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
        dims: Some(fact.shape.iter().map(Dim::of).collect()),
    }
}

fn carried(dt: DatumType) -> std::result::Result<DataType, String> {
    data_type(dt).ok_or_else(|| format!("{dt:?}"))
}

/// The inputs and outputs a model declares, read without tract (for files tract cannot
/// read, such as BFLOAT16 models that only the GPU executor runs).
pub(super) fn declared_from_graph(
    file: &Path,
    what: &str,
) -> Result<(Vec<Declared>, Vec<Declared>)> {
    let g = crate::onnx::gpu::load_graph(file, what)?;
    let of = |io: &crate::onnx::graph::Io| Declared {
        name: io.name.clone(),
        dtype: io
            .dt
            .map(|d| d.to_library().ok_or_else(|| d.name().to_owned())),
        dims: io.dims.as_ref().map(|v| {
            v.iter()
                .map(|&d| {
                    if d >= 0 {
                        Dim::Fixed(d)
                    } else {
                        Dim::Any(None)
                    }
                })
                .collect()
        }),
    };
    Ok((
        g.inputs.iter().map(of).collect(),
        g.outputs.iter().map(of).collect(),
    ))
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
    let onnx = tract_onnx::onnx().with_ignore_output_shapes(!output_shapes);
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

/// Fills in, from the model file of the latest version, what the config leaves out:
/// inputs and outputs (all of them when the config lists none), a listed tensor's
/// datatype and dims when they are not given, and max_batch_size (with
/// `dynamic_batching { }`) when the config gives 0 and every input and output has a
/// symbolic first dimension. Sequence state and control tensors are not inputs or
/// outputs. A config that is already complete is left alone, and the model is read only
/// when something is missing.
pub fn autocomplete(raw: &mut RawConfig, dir: Option<&Folder>, engine: Engine) -> Result<()> {
    let c = &raw.pb;
    let tensor_incomplete = |dt: i32, dims: &[i64]| dt == 0 || dims.is_empty();
    let needed = c.input.is_empty()
        || c.output.is_empty()
        || c.max_batch_size == 0
        || c.input
            .iter()
            .any(|t| tensor_incomplete(t.data_type, &t.dims))
        || c.output
            .iter()
            .any(|t| tensor_incomplete(t.data_type, &t.dims));
    if !needed {
        return Ok(());
    }
    let name = raw.name().to_owned();
    let Some(dir) = dir else {
        if c.input.is_empty() || c.output.is_empty() {
            return Err(Error::invalid(format!(
                "model '{name}': the config lists no {} and there is no model folder to complete it from",
                if c.input.is_empty() { "inputs" } else { "outputs" }
            )));
        }
        return Ok(());
    };
    if !c.default_model_filename.is_empty() {
        check_relative(
            &c.default_model_filename,
            &format!("model '{name}': default_model_filename"),
        )?;
    }
    let Some(version) = served_version(dir, c) else {
        if c.input.is_empty() || c.output.is_empty() {
            return Err(Error::not_found(format!(
                "model '{name}': no version folder of '{}' holds {}",
                dir.path().display(),
                if c.default_model_filename.is_empty() {
                    "model.onnx"
                } else {
                    &c.default_model_filename
                }
            )));
        }
        return Ok(());
    };
    let what = format!("model '{name}' version {version}");
    let file = model_file(dir, version, &c.default_model_filename, &what)?;
    if let Engine::OnnxRuntime(rt) = engine {
        let settings = crate::onnx::onnxruntime::Settings::for_metadata();
        let session = crate::onnx::onnxruntime::open(
            rt,
            &file,
            &settings,
            crate::onnx::onnxruntime::Place::Cpu,
            &what,
        )?;
        let (inputs, mut outputs) = crate::onnx::onnxruntime::metadata(&session, &file, &what);
        drop(session);
        let outputs_missing = raw.pb.output.is_empty()
            || (raw.pb.output.iter()).any(|t| tensor_incomplete(t.data_type, &t.dims));
        if outputs_missing {
            // A file may declare an output shape its graph does not compute (ONNX
            // Runtime serves the declaration); tract's analysis of the graph, where it
            // succeeds, says what is computed.
            if let Some(analysed) = analysed_outputs(&file, &what) {
                for d in &mut outputs {
                    if let Some(a) = analysed.iter().find(|a| a.name == d.name) {
                        let same_rank =
                            (a.dims.as_ref().map(Vec::len)) == (d.dims.as_ref().map(Vec::len));
                        if !same_rank || a.dtype != d.dtype {
                            *d = a.clone();
                        }
                    }
                }
            }
        }
        return complete_config(raw, &what, &inputs, &outputs);
    }
    let model = match load(&file, &what, true) {
        Ok(m) => m,
        Err(e) if e.code == crate::status::Code::Unsupported => {
            // What tract cannot read may still run on the GPU executor: complete the
            // config from the graph's declarations.
            let (inputs, outputs) = declared_from_graph(&file, &what).map_err(|_| e)?;
            return complete_config(raw, &what, &inputs, &outputs);
        }
        Err(e) => return Err(e),
    };
    let inputs = model_inputs(&model)?;
    // Output facts come from analysis when it succeeds (the model's own declarations
    // may be partial), else from what the file declares.
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

    complete_config(raw, &what, &inputs, &outputs)
}

/// The outputs tract's analysis of the graph finds (the file's own output declarations
/// ignored); None where tract cannot read or analyse the model.
fn analysed_outputs(file: &Path, what: &str) -> Option<Vec<Declared>> {
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

/// Fills in what the config leaves out from the model's declared inputs and outputs.
pub(super) fn complete_config(
    raw: &mut RawConfig,
    what: &str,
    inputs: &[Declared],
    outputs: &[Declared],
) -> Result<()> {
    let c = &mut raw.pb;
    // Tensors the sequence batcher provides or consumes are not the model's inputs and
    // outputs in the config.
    let (state_in, state_out, controls): (Vec<String>, Vec<String>, Vec<String>) =
        match &c.scheduling_choice {
            Some(pb::model_config::SchedulingChoice::SequenceBatching(q)) => (
                q.state.iter().map(|s| s.input_name.clone()).collect(),
                q.state.iter().map(|s| s.output_name.clone()).collect(),
                q.control_input.iter().map(|ci| ci.name.clone()).collect(),
            ),
            _ => Default::default(),
        };
    let is_input = |n: &str| !state_in.iter().any(|s| s == n) && !controls.iter().any(|s| s == n);
    let is_output = |n: &str| !state_out.iter().any(|s| s == n);
    let io_inputs: Vec<&Declared> = inputs.iter().filter(|d| is_input(&d.name)).collect();
    let io_outputs: Vec<&Declared> = outputs.iter().filter(|d| is_output(&d.name)).collect();

    // A config whose listed dims already cover a tensor's full rank does not batch.
    let rank = |n: &str| {
        inputs
            .iter()
            .chain(outputs.iter())
            .find(|d| d.name == n)
            .and_then(|d| d.dims.as_ref().map(Vec::len))
    };
    let full_rank_listed = c
        .input
        .iter()
        .map(|t| (&t.name, &t.dims))
        .chain(c.output.iter().map(|t| (&t.name, &t.dims)))
        .any(|(n, dims)| !dims.is_empty() && rank(n) == Some(dims.len()));
    if c.max_batch_size == 0 && !full_rank_listed {
        let symbolic_first = |d: &&Declared| {
            d.dims
                .as_ref()
                .is_some_and(|v| matches!(v.first(), Some(Dim::Any(_))))
        };
        let all = inputs.iter().chain(outputs.iter()).collect::<Vec<_>>();
        if !all.is_empty() && all.iter().all(symbolic_first) {
            c.max_batch_size = DEFAULT_MAX_BATCH_SIZE;
            if c.scheduling_choice.is_none() {
                c.scheduling_choice = Some(pb::model_config::SchedulingChoice::DynamicBatching(
                    pb::ModelDynamicBatching::default(),
                ));
            }
        }
    }
    let skip = usize::from(c.max_batch_size > 0);
    let dims_of = |d: &Declared| -> Result<Vec<i64>> {
        let dims = d.dims.as_ref().ok_or_else(|| {
            Error::invalid(format!(
                "{what}: the model does not say the rank of '{}': give its dims in the config",
                d.name
            ))
        })?;
        Ok(dims.iter().skip(skip).map(Dim::config).collect())
    };
    // A scalar (per batch item) is served as dims [1] reshaped to [], as Triton does.
    let scalar_reshape = |dims: &[i64]| {
        dims.is_empty()
            .then(|| pb::ModelTensorReshape { shape: Vec::new() })
    };
    let shape_of = |d: &Declared| -> Result<(Vec<i64>, Option<pb::ModelTensorReshape>)> {
        let dims = dims_of(d)?;
        let reshape = scalar_reshape(&dims);
        Ok(if reshape.is_some() {
            (vec![1], reshape)
        } else {
            (dims, None)
        })
    };
    let dtype_of = |d: &Declared| -> Result<i32> {
        let dt = d.dtype.as_ref().ok_or_else(|| {
            Error::invalid(format!(
                "{what}: the model does not say the datatype of '{}': give data_type in the config",
                d.name
            ))
        })?;
        dt.clone().map(pb_data_type).map_err(|dt| {
            Error::unsupported(format!(
                "{what}: tensor '{}' has datatype {dt}, which the ONNX backend cannot carry",
                d.name
            ))
        })
    };
    if c.input.is_empty() {
        for d in &io_inputs {
            let (dims, reshape) = shape_of(d)?;
            c.input.push(pb::ModelInput {
                name: d.name.clone(),
                data_type: dtype_of(d)?,
                dims,
                reshape,
                ..Default::default()
            });
        }
    } else {
        for t in &mut c.input {
            if let Some(d) = io_inputs.iter().find(|d| d.name == t.name) {
                if t.data_type == 0 {
                    t.data_type = dtype_of(d)?;
                }
                if t.dims.is_empty() && t.reshape.is_none() {
                    (t.dims, t.reshape) = shape_of(d)?;
                }
            }
        }
    }
    if c.output.is_empty() {
        for d in &io_outputs {
            let (dims, reshape) = shape_of(d)?;
            c.output.push(pb::ModelOutput {
                name: d.name.clone(),
                data_type: dtype_of(d)?,
                dims,
                reshape,
                ..Default::default()
            });
        }
    } else {
        for t in &mut c.output {
            if let Some(d) = io_outputs.iter().find(|d| d.name == t.name) {
                if t.data_type == 0 {
                    t.data_type = dtype_of(d)?;
                }
                if t.dims.is_empty() && t.reshape.is_none() {
                    (t.dims, t.reshape) = shape_of(d)?;
                }
            }
        }
    }
    Ok(())
}

/// The version auto-complete reads: the highest-numbered version folder holding the
/// model file among those the version policy serves.
pub(super) fn served_version(dir: &Folder, c: &pb::ModelConfig) -> Option<i64> {
    use pb::model_version_policy::PolicyChoice;
    let specific = match c
        .version_policy
        .as_ref()
        .and_then(|p| p.policy_choice.as_ref())
    {
        Some(PolicyChoice::Specific(s)) => Some(&s.versions),
        _ => None,
    };
    dir.entries()
        .into_iter()
        .filter_map(|n| n.parse::<i64>().ok())
        .filter(|&v| v > 0 && specific.is_none_or(|vs| vs.contains(&v)))
        .filter(|&v| model_file(dir, v, &c.default_model_filename, "").is_ok())
        .max()
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

/// What the config (or the sequence batcher) says a tensor is: datatype and full dims
/// as the model sees them (batch dim first when batching; -1 = any size).
pub(super) struct Expected {
    pub(super) dtype: DataType,
    pub(super) dims: Vec<i64>,
    /// Which part of the config it comes from, for messages.
    pub(super) role: &'static str,
}

impl Plan {
    fn build(config: &ModelConfig, file: &Path, what: &str) -> Result<Plan> {
        let mut model = load(file, what, false)?;
        let declared = model_inputs(&model)?;
        let batching = config.max_batch_size > 0;
        let batch = model.symbols.sym("batch_size");

        // Every config input must be a model input.
        for tc in &config.inputs {
            if !declared.iter().any(|d| *d.name == *tc.name) {
                let have: Vec<&str> = declared.iter().map(|d| d.name.as_str()).collect();
                return Err(Error::invalid(format!(
                    "{what}: config input '{}' is not an input of the ONNX model (its inputs: {})",
                    tc.name,
                    have.join(", ")
                )));
            }
        }
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
                        Some(Dim::Any(Some(s))) => s.clone(),
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

/// What the config (or the sequence batcher) says the model input `d` is: a config
/// input, a state input or a control input; INVALID_ARGUMENT when the config does not
/// account for it.
pub(super) fn expected_input(config: &ModelConfig, d: &Declared, what: &str) -> Result<Expected> {
    let batching = config.max_batch_size > 0;
    let seq = config.sequence_batching.as_ref();
    let lead: &[i64] = if batching { &[-1] } else { &[] };
    let exp = if let Some(tc) = config.input(&d.name) {
        let dims = tc.reshape.as_deref().unwrap_or(&tc.dims);
        Expected {
            dtype: tc.data_type,
            dims: [lead, dims].concat(),
            role: "input",
        }
    } else if let Some(st) = seq.and_then(|q| q.states.iter().find(|s| *s.input_name == *d.name)) {
        Expected {
            dtype: st.data_type,
            dims: [lead, &st.dims[..]].concat(),
            role: "state input",
        }
    } else if let Some(ci) = seq.and_then(|q| q.controls.iter().find(|c| *c.name == *d.name)) {
        Expected {
            dtype: ci.data_type,
            dims: [lead, &[1][..]].concat(),
            role: "control input",
        }
    } else {
        let have: Vec<&str> = config.inputs.iter().map(|t| &*t.name).collect();
        return Err(Error::invalid(format!(
                    "{what}: the ONNX model has input '{}', which the config does not list (config inputs: {})",
                    d.name,
                    have.join(", ")
                )));
    };
    Ok(exp)
}

/// The outputs the config asks for, then the state outputs, with what each should be.
pub(super) fn expected_outputs(config: &ModelConfig) -> Vec<(String, Expected)> {
    let lead: &[i64] = if config.max_batch_size > 0 {
        &[-1]
    } else {
        &[]
    };
    let mut wanted: Vec<(String, Expected)> = config
        .outputs
        .iter()
        .map(|tc| {
            (
                tc.name.to_string(),
                Expected {
                    dtype: tc.data_type,
                    dims: [lead, tc.reshape.as_deref().unwrap_or(&tc.dims)].concat(),
                    role: "output",
                },
            )
        })
        .collect();
    if let Some(q) = &config.sequence_batching {
        for st in &q.states {
            wanted.push((
                st.output_name.to_string(),
                Expected {
                    dtype: st.data_type,
                    dims: [lead, &st.dims[..]].concat(),
                    role: "state output",
                },
            ));
        }
    }
    wanted
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

/// Checks a tensor the model declares against what the config says: datatype, rank,
/// fixed sizes, and a batch dimension the model can vary.
pub(super) fn check_declared(
    what: &str,
    role: &str,
    d: &Declared,
    exp: &Expected,
    max_batch_size: u32,
) -> Result<()> {
    let name = &d.name;
    let batching = max_batch_size > 0;
    if let Some(model_dt) = &d.dtype {
        // (tract's TDim, its INT64 shapes, is carried as INT64.)
        if model_dt.as_ref().ok() != Some(&exp.dtype) {
            let model_says = match model_dt {
                Ok(t) => t.as_str().to_owned(),
                Err(name) => name.clone(),
            };
            return Err(Error::invalid(format!(
                "{what}: {role} '{name}': the config says {}, the model says {model_says}",
                exp.dtype.as_str()
            )));
        }
    }
    if let Some(dims) = &d.dims {
        // The dims as the config writes them (without the batch dimension).
        let skip = usize::from(batching);
        let config_dims = shape_string(&exp.dims[skip.min(exp.dims.len())..]);
        let batch_note = if batching {
            " (after the batch dimension)"
        } else {
            ""
        };
        let mismatch = || {
            Error::invalid(format!(
                "{what}: {role} '{name}': the config's dims {config_dims}{batch_note} do not match the model's shape {}",
                dims_string(dims)
            ))
        };
        if dims.len() != exp.dims.len() {
            return Err(mismatch());
        }
        let is_input = role.ends_with("input");
        for (k, (m, &want)) in dims.iter().zip(&exp.dims).enumerate() {
            match m {
                Dim::Fixed(v) if batching && k == 0 => {
                    return Err(Error::invalid(format!(
                        "{what}: {role} '{name}': the model fixes dim 0 to {v}, so it cannot batch (max_batch_size is {max_batch_size}); make the model's first dimension symbolic or set max_batch_size: 0"
                    )));
                }
                Dim::Fixed(v) if want >= 0 && *v != want => return Err(mismatch()),
                // A request of another size would reach the model and fail there.
                Dim::Fixed(v) if want < 0 && *v > 0 && is_input => {
                    return Err(Error::invalid(format!(
                        "{what}: {role} '{name}': the config's dims {config_dims}{batch_note} allow any size where the model's shape {} fixes {v}; write {v}",
                        dims_string(dims)
                    )));
                }
                _ => {}
            }
        }
    }
    Ok(())
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
        let outs = self.state.run(inputs).map_err(|e| {
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
