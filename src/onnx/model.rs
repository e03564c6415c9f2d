//! What the ONNX engines share about a model and its config: the model file of a
//! version, the tensors a model declares, the config auto-complete fills in from them,
//! and the checks of a config against them.

use crate::config::{pb, ModelConfig, RawConfig};
use crate::folder::{check_relative, Folder};
use crate::status::{Error, Result};
use crate::tensor::{shape_string, DataType};
use std::path::{Path, PathBuf};

/// The batch size Triton's auto-complete gives a model that can batch.
const DEFAULT_MAX_BATCH_SIZE: i32 = 4;

/// Whether a config's backend (or platform) name selects an ONNX engine: Triton's names
/// for ONNX Runtime, or `tract`.
pub fn is_onnx(key: &str) -> bool {
    key == "onnxruntime_onnx" || key == "onnxruntime" || key == TRACT
}

/// The backend name that asks for tract.
pub const TRACT: &str = "tract";

/// The model parameter that picks the engine of an ONNX model's GPU instances
/// (`backend::GpuExecutor`).
pub const GPU_EXECUTOR_PARAMETER: &str = "gpu_executor";

/// The parameters only libinfer's GPU executor reads (`gpu::Options`); the other engines
/// accept them where the executor runs the model's GPU instances.
pub const EXECUTOR_PARAMETERS: &[&str] = &["allow_tf32", "precision", "cuda_graph_max_batch"];

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

/// The `TYPE_*` value of the config schema for a datatype.
fn pb_data_type(dt: DataType) -> i32 {
    // BYTES is TYPE_STRING in the config schema.
    let name = match dt {
        DataType::Bytes => "STRING",
        other => other.as_str(),
    };
    pb::DataType::from_str_name(&format!("TYPE_{name}")).map_or(0, |t| t as i32)
}

/// A dimension as the model declares it.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Dim {
    Fixed(i64),
    /// A named symbol (ONNX `dim_param`, or an expression of symbols) or an unknown size.
    Any(Option<String>),
}

impl Dim {
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
            Dim::Any(Some(s)) => s.clone(),
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

/// The inputs and outputs a model declares, read without tract (for files tract cannot
/// read, such as BFLOAT16 models that only the GPU executor runs).
pub(super) fn declared_from_graph(
    file: &Path,
    what: &str,
) -> Result<(Vec<Declared>, Vec<Declared>)> {
    Ok(declared_of(&crate::onnx::gpu::load_graph(file, what)?))
}

/// The inputs and outputs a parsed graph declares.
pub(super) fn declared_of(g: &crate::onnx::graph::Graph) -> (Vec<Declared>, Vec<Declared>) {
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
    (
        g.inputs.iter().map(of).collect(),
        g.outputs.iter().map(of).collect(),
    )
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
    // Batch inputs are computed by the library for each batch.
    let batch_inputs: Vec<String> = (c.batch_input.iter())
        .flat_map(|b| b.target_name.iter().cloned())
        .collect();
    let is_input = |n: &str| {
        !state_in.iter().any(|s| s == n)
            && !controls.iter().any(|s| s == n)
            && !batch_inputs.iter().any(|s| s == n)
    };
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
    // Inputs and outputs alike: all of the model's when the config lists none, else what
    // a listed tensor leaves out.
    macro_rules! complete {
        ($list:expr, $declared:expr, $ty:ident) => {
            if $list.is_empty() {
                for d in $declared {
                    let (dims, reshape) = shape_of(d)?;
                    $list.push(pb::$ty {
                        name: d.name.clone(),
                        data_type: dtype_of(d)?,
                        dims,
                        reshape,
                        ..Default::default()
                    });
                }
            } else {
                for t in &mut $list {
                    if let Some(d) = $declared.iter().find(|d| d.name == t.name) {
                        if t.data_type == 0 {
                            t.data_type = dtype_of(d)?;
                        }
                        if t.dims.is_empty() && t.reshape.is_none() {
                            (t.dims, t.reshape) = shape_of(d)?;
                        }
                    }
                }
            }
        };
    }
    complete!(c.input, &io_inputs, ModelInput);
    complete!(c.output, &io_outputs, ModelOutput);
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

/// What the config (or the sequence batcher) says a tensor is: datatype and full dims
/// as the model sees them (batch dim first when batching; -1 = any size).
pub(super) struct Expected {
    pub(super) dtype: DataType,
    pub(super) dims: Vec<i64>,
    /// Which part of the config it comes from, for messages.
    pub(super) role: &'static str,
}

/// Every config input must be an input of the model (INVALID_ARGUMENT naming it and the
/// model's inputs).
pub(super) fn check_config_inputs(
    config: &ModelConfig,
    model: &[Declared],
    what: &str,
) -> Result<()> {
    for tc in &config.inputs {
        if !model.iter().any(|d| *d.name == *tc.name) {
            let have: Vec<&str> = model.iter().map(|d| d.name.as_str()).collect();
            return Err(Error::invalid(format!(
                "{what}: config input '{}' is not an input of the ONNX model (its inputs: {})",
                tc.name,
                have.join(", ")
            )));
        }
    }
    Ok(())
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
    } else if let Some(b) = config.batch_input(&d.name) {
        use crate::config::BatchInputKind as K;
        // Its length changes with the batch: any size, of the kind's rank.
        let rank = if b.kind == K::ItemShape { 2 } else { 1 };
        Expected {
            dtype: b.data_type,
            dims: vec![-1; rank],
            role: "batch input",
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

/// An output's name and what it should be.
pub(super) type NamedExpected = (String, Expected);

/// The config against the tensors the model declares: every config input is a model
/// input; every model input is a config, state or control input of the declared datatype
/// and dims; every output the config asks for (and every state output) is a model output
/// of the declared datatype, and of the declared shape where the file fixes all of it
/// (files declare symbolic output shapes their graph does not compute; each batch's
/// outputs are checked as they are computed). Returns what each model input (in the
/// model's order) and each wanted output should be.
pub(super) fn check_model_io(
    config: &ModelConfig,
    inputs: &[Declared],
    outputs: &[Declared],
    what: &str,
) -> Result<(Vec<Expected>, Vec<NamedExpected>)> {
    check_config_inputs(config, inputs, what)?;
    let mut expected = Vec::with_capacity(inputs.len());
    for d in inputs {
        let exp = expected_input(config, d, what)?;
        check_declared(what, exp.role, d, &exp, config.max_batch_size)?;
        expected.push(exp);
    }
    let wanted = expected_outputs(config);
    for (name, exp) in &wanted {
        let Some(d) = outputs.iter().find(|d| d.name == *name) else {
            let have: Vec<&str> = outputs.iter().map(|d| d.name.as_str()).collect();
            return Err(Error::invalid(format!(
                "{what}: {} '{name}' is not an output of the ONNX model (its outputs: {})",
                exp.role,
                have.join(", ")
            )));
        };
        let all_fixed = (d.dims.iter().flatten()).all(|x| matches!(x, Dim::Fixed(_)));
        let d = Declared {
            dims: if all_fixed { d.dims.clone() } else { None },
            ..d.clone()
        };
        check_declared(what, exp.role, &d, exp, config.max_batch_size)?;
    }
    Ok((expected, wanted))
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
