//! ONNX models on ONNX Runtime, as Triton serves them: one ONNX Runtime session per
//! instance, on the CPU provider, or on the CUDA provider (with TensorRT first when the
//! config names it) for KIND_GPU instances when the loaded ONNX Runtime has it.
//!
//! The library is loaded at run time ([`library`]); the config's ONNX Runtime settings
//! are read by [`settings`]. A batch's inputs go to ONNX Runtime without a copy where
//! their memory allows (aligned host memory), and its outputs are copied once into the
//! batch's outputs.

pub mod library;
pub mod settings;

pub use library::{add_log, remove_log, runtime, Runtime, RuntimeOptions, LIBRARY_ENV};
pub use settings::{Accelerator, GraphLevel, Settings};

use super::model::{check_model_io, Declared, Dim};
use crate::backend::{Batch, ModelInstance};
use crate::config::ModelConfig;
use crate::status::{Error, Result};
use crate::tensor::{shape_string, DataType};
use ort::ep::ArbitrarilyConfigurableExecutionProvider;
use ort::session::builder::{GraphOptimizationLevel, SessionBuilder};
use ort::session::{Session, SessionInputValue};
use ort::value::{Tensor, TensorElementType, TensorRef, ValueType};
use std::borrow::Cow;
use std::path::Path;

/// The library datatype of an ONNX Runtime element type; Err: its name.
fn data_type(t: TensorElementType) -> std::result::Result<DataType, String> {
    Ok(match t {
        TensorElementType::Float32 => DataType::Fp32,
        TensorElementType::Float64 => DataType::Fp64,
        TensorElementType::Float16 => DataType::Fp16,
        TensorElementType::Bfloat16 => DataType::Bf16,
        TensorElementType::Int8 => DataType::Int8,
        TensorElementType::Int16 => DataType::Int16,
        TensorElementType::Int32 => DataType::Int32,
        TensorElementType::Int64 => DataType::Int64,
        TensorElementType::Uint8 => DataType::Uint8,
        TensorElementType::Uint16 => DataType::Uint16,
        TensorElementType::Uint32 => DataType::Uint32,
        TensorElementType::Uint64 => DataType::Uint64,
        TensorElementType::Bool => DataType::Bool,
        TensorElementType::String => DataType::Bytes,
        other => return Err(format!("{other:?}")),
    })
}

/// A tensor as ONNX Runtime says the model declares it.
fn declared(name: &str, t: &ValueType) -> Declared {
    match t {
        ValueType::Tensor { ty, shape, .. } => Declared {
            name: name.to_owned(),
            dtype: Some(data_type(*ty)),
            dims: Some(
                shape
                    .iter()
                    .map(|&d| {
                        if d >= 0 {
                            Dim::Fixed(d)
                        } else {
                            Dim::Any(None)
                        }
                    })
                    .collect(),
            ),
        },
        other => Declared {
            name: name.to_owned(),
            dtype: Some(Err(format!("{other:?}"))),
            dims: None,
        },
    }
}

/// The model's inputs and outputs, from ONNX Runtime's own metadata (symbolic and
/// unknown sizes are any size).
///
/// ONNX Runtime gives a tensor of unknown rank no dims, as it does a scalar (and so it
/// does an output whose declaration contradicts its inference); where it gives none, the
/// file's own declaration says which it is.
pub(super) fn metadata(
    session: &Session,
    file: &Path,
    what: &str,
) -> (Vec<Declared>, Vec<Declared>) {
    let mut inputs: Vec<Declared> = session
        .inputs()
        .iter()
        .map(|o| declared(o.name(), o.dtype()))
        .collect();
    let mut outputs: Vec<Declared> = session
        .outputs()
        .iter()
        .map(|o| declared(o.name(), o.dtype()))
        .collect();
    let rankless = |d: &Declared| d.dims.as_ref().is_some_and(Vec::is_empty);
    if inputs.iter().chain(outputs.iter()).any(rankless) {
        if let Ok((fi, fo)) = super::model::declared_from_graph(file, what) {
            for (list, from_file) in [(&mut inputs, &fi), (&mut outputs, &fo)] {
                for d in list.iter_mut().filter(|d| rankless(d)) {
                    if let Some(f) = from_file.iter().find(|f| f.name == d.name) {
                        // Unknown rank, or a declaration ONNX Runtime gave up merging with
                        // what it inferred: the file's own words.
                        d.dims = f.dims.clone();
                    }
                }
            }
        }
    }
    (inputs, outputs)
}

fn ort_error<'a>(what: &'a str, doing: &'a str) -> impl Fn(ort::Error) -> Error + 'a {
    move |e| Error::internal(format!("{what}: ONNX Runtime: {doing}: {e}"))
}

/// Where a session runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    Cpu,
    /// The CUDA provider on this device (TensorRT first when the config asks).
    Gpu(i32),
}

/// Opens a session of `file` with the model's settings. Load errors carry ONNX Runtime's
/// message: a file that is not ONNX is INVALID_ARGUMENT, a missing one NOT_FOUND, an
/// operator or type ONNX Runtime lacks UNSUPPORTED, a provider that is not there or fails
/// UNAVAILABLE naming it, anything else INVALID_ARGUMENT.
pub fn open(rt: &Runtime, file: &Path, s: &Settings, place: Place, what: &str) -> Result<Session> {
    let b = builder(rt, s, place, what)?;
    commit(b, file, what)
}

fn commit(mut b: SessionBuilder, file: &Path, what: &str) -> Result<Session> {
    use ort::ErrorCode as C;
    b.commit_from_file(file).map_err(|e| {
        let file = file.display();
        let msg = e.to_string();
        match e.code() {
            C::InvalidProtobuf => Error::invalid(format!(
                "{what}: '{file}' is not an ONNX model (ONNX Runtime: {msg})"
            )),
            C::NoSuchFile => Error::not_found(format!("{what}: model file '{file}': {msg}")),
            // An operator, a type or an opset this ONNX Runtime does not implement.
            C::NotImplemented => Error::unsupported(format!(
                "{what}: ONNX Runtime does not support '{file}': {msg}"
            )),
            _ if msg.contains("No Op registered")
                || msg.contains("is not a registered function/op") =>
            {
                Error::unsupported(format!(
                    "{what}: ONNX Runtime does not support '{file}': {msg}"
                ))
            }
            C::ExecutionProviderFailure => Error::unavailable(format!(
                "{what}: ONNX Runtime's execution provider failed to load '{file}': {msg}"
            )),
            _ => Error::invalid(format!("{what}: ONNX Runtime cannot load '{file}': {msg}")),
        }
    })
}

fn builder(rt: &Runtime, s: &Settings, place: Place, what: &str) -> Result<SessionBuilder> {
    let err = ort_error(what, "session options");
    let recover = |e: ort::Error<SessionBuilder>| {
        Error::internal(format!("{what}: ONNX Runtime: session options: {e}"))
    };
    let mut b = Session::builder(&rt.env).map_err(&err)?;
    // The environment's logger takes every level; a session formats only warnings and
    // errors.
    b = b
        .with_log_level(ort::logging::LogLevel::Warning)
        .map_err(recover)?;
    b = b
        .with_optimization_level(match s.graph_level {
            GraphLevel::All => GraphOptimizationLevel::All,
            GraphLevel::Extended => GraphOptimizationLevel::Level2,
            GraphLevel::Basic => GraphOptimizationLevel::Level1,
            GraphLevel::Disabled => GraphOptimizationLevel::Disable,
        })
        .map_err(recover)?;
    // A model that sets its own thread counts gets its own pools; the others share the
    // process's global pools when the server set them.
    let own_threads = s.intra_op_threads.is_some() || s.inter_op_threads.is_some();
    if own_threads || rt.global_threads.is_none() {
        if rt.global_threads.is_some() {
            b = b.with_independent_thread_pool().map_err(recover)?;
        }
        if let Some(n) = s.intra_op_threads {
            b = b.with_intra_threads(n).map_err(recover)?;
        }
        if let Some(n) = s.inter_op_threads {
            b = b.with_inter_threads(n).map_err(recover)?;
        }
    }
    if s.parallel_execution {
        b = b.with_parallel_execution(true).map_err(recover)?;
    }
    if let Some(p) = s.mem_pattern {
        b = b.with_memory_pattern(p).map_err(recover)?;
    }
    for (k, v) in &s.session_entries {
        b = b.with_config_entry(k, v).map_err(|e| {
            Error::invalid(format!(
                "{what}: parameters.{k}: ONNX Runtime refuses '{v}': {e}"
            ))
        })?;
    }
    let mut eps = Vec::new();
    match place {
        Place::Cpu => {
            for a in &s.cpu_accelerators {
                let Accelerator::OpenVino(opts) = a else {
                    continue;
                };
                require_provider(rt, "OpenVINOExecutionProvider", "openvino", what)?;
                let mut ep = ort::ep::OpenVINO::default();
                for (k, v) in opts {
                    ep = ep.with_arbitrary_config(k, v);
                }
                eps.push(ep.build().error_on_failure());
            }
        }
        Place::Gpu(device) => {
            let mut cuda_opts = s.cuda_options.clone();
            for a in &s.gpu_accelerators {
                match a {
                    Accelerator::TensorRt(opts) => {
                        require_provider(rt, "TensorrtExecutionProvider", "tensorrt", what)?;
                        let mut ep = ort::ep::TensorRT::default().with_device_id(device);
                        for (k, v) in opts {
                            ep = ep.with_arbitrary_config(k, v);
                        }
                        eps.push(ep.build().error_on_failure());
                    }
                    Accelerator::Cuda(opts) => cuda_opts.extend(opts.iter().cloned()),
                    Accelerator::OpenVino(_) => {}
                }
            }
            require_provider(rt, "CUDAExecutionProvider", "cuda", what)?;
            let mut ep = ort::ep::CUDA::default().with_device_id(device);
            for (k, v) in &cuda_opts {
                ep = ep.with_arbitrary_config(k, v);
            }
            eps.push(ep.build().error_on_failure());
        }
    }
    // The CPU provider last: its arena setting, and the nodes no other provider takes.
    let mut cpu = ort::ep::CPU::default();
    if let Some(a) = s.mem_arena {
        cpu = cpu.with_arena_allocator(a);
    } else {
        cpu = cpu.with_arena_allocator(true);
    }
    eps.push(cpu.build().error_on_failure());
    b = b.with_execution_providers(eps).map_err(|e| match place {
        Place::Cpu => Error::unavailable(format!(
            "{what}: ONNX Runtime cannot use the execution providers: {e}"
        )),
        Place::Gpu(device) => Error::unavailable(format!(
            "{what}: ONNX Runtime's GPU execution providers cannot start on GPU {device}: {e} (parameters.gpu_executor: \"libinfer\" runs the GPU instances on libinfer's own CUDA executor)"
        )),
    })?;
    Ok(b)
}

fn require_provider(rt: &Runtime, provider: &str, name: &str, what: &str) -> Result<()> {
    if rt.providers.iter().any(|p| p == provider) {
        return Ok(());
    }
    Err(Error::unavailable(format!(
        "{what}: the '{name}' execution provider is not in the loaded ONNX Runtime ('{}', version {}; it has {})",
        rt.path.display(),
        rt.version,
        rt.providers.join(", ")
    )))
}

/// One model input as the session takes it.
struct SessionInput {
    name: String,
    dtype: DataType,
    /// The model's dims for this input when the config reshapes it (without the batch
    /// dimension).
    reshape: Option<Vec<i64>>,
}

/// One output the instance gives (in the model's shape: the library reshapes to the
/// config's dims).
struct SessionOutput {
    name: String,
    dtype: DataType,
}

/// An instance: one ONNX Runtime session.
pub struct OrtInstance {
    session: Session,
    inputs: Vec<SessionInput>,
    outputs: Vec<SessionOutput>,
    run_options: Option<ort::session::RunOptions>,
    batching: bool,
    what: String,
}

impl OrtInstance {
    pub fn new(
        rt: &Runtime,
        config: &ModelConfig,
        file: &Path,
        place: Place,
        what: &str,
    ) -> Result<OrtInstance> {
        let settings = Settings::of(config)?;
        let session = open(rt, file, &settings, place, what)?;
        let (model_inputs, model_outputs) = metadata(&session, file, what);
        let (expected, wanted) = check_model_io(config, &model_inputs, &model_outputs, what)?;
        let mut inputs = Vec::with_capacity(model_inputs.len());
        for (d, exp) in model_inputs.iter().zip(expected) {
            check_carried(what, exp.role, &d.name, exp.dtype)?;
            let reshape = config.input(&d.name).and_then(|tc| tc.reshape.clone());
            inputs.push(SessionInput {
                name: d.name.clone(),
                dtype: exp.dtype,
                reshape,
            });
        }
        let mut outputs = Vec::with_capacity(wanted.len());
        for (name, exp) in wanted {
            check_carried(what, exp.role, &name, exp.dtype)?;
            outputs.push(SessionOutput {
                name,
                dtype: exp.dtype,
            });
        }
        let run_options = match &settings.arena_shrinkage {
            Some(v) => {
                let mut o =
                    ort::session::RunOptions::new().map_err(ort_error(what, "run options"))?;
                o.set("memory.enable_memory_arena_shrinkage", v).map_err(|e| {
                    Error::invalid(format!(
                        "{what}: parameters.memory.enable_memory_arena_shrinkage: ONNX Runtime refuses '{v}': {e}"
                    ))
                })?;
                Some(o)
            }
            None => None,
        };
        Ok(OrtInstance {
            session,
            inputs,
            outputs,
            run_options,
            batching: config.max_batch_size > 0,
            what: what.to_owned(),
        })
    }
}

/// Every datatype of the config is carried (BYTES as ONNX Runtime's strings).
fn check_carried(what: &str, role: &str, name: &str, dt: DataType) -> Result<()> {
    if matches!(dt, DataType::Invalid) {
        return Err(Error::unsupported(format!(
            "{what}: {role} '{name}' is {}, a datatype the ONNX Runtime engine does not carry",
            dt.as_str()
        )));
    }
    Ok(())
}

/// `match $dt` with an arm `$m!(T)` for each numeric datatype (T its Rust type), then
/// the arms given for the others.
macro_rules! numeric {
    ($dt:expr, $m:ident, $($rest:tt)*) => {
        match $dt {
            DataType::Fp32 => $m!(f32),
            DataType::Fp64 => $m!(f64),
            DataType::Fp16 => $m!(half::f16),
            DataType::Bf16 => $m!(half::bf16),
            DataType::Int8 => $m!(i8),
            DataType::Int16 => $m!(i16),
            DataType::Int32 => $m!(i32),
            DataType::Int64 => $m!(i64),
            DataType::Uint8 => $m!(u8),
            DataType::Uint16 => $m!(u16),
            DataType::Uint32 => $m!(u32),
            DataType::Uint64 => $m!(u64),
            $($rest)*
        }
    };
}

/// A session input over `data`: borrowed when the bytes are aligned for the element
/// type, else copied.
fn input_value<'a>(
    dt: DataType,
    shape: Vec<i64>,
    data: &'a [u8],
) -> ort::Result<SessionInputValue<'a>> {
    macro_rules! typed {
        ($t:ty) => {
            match bytemuck::try_cast_slice::<u8, $t>(data) {
                Ok(v) => TensorRef::<$t>::from_array_view((shape, v))?.into(),
                Err(_) => {
                    Tensor::<$t>::from_array((shape, bytemuck::pod_collect_to_vec::<u8, $t>(data)))?
                        .into()
                }
            }
        };
    }
    Ok(numeric!(dt, typed,
        DataType::Bool => {
            // Any non-zero byte is true.
            let v: Vec<bool> = data.iter().map(|&b| b != 0).collect();
            Tensor::<bool>::from_array((shape, v))?.into()
        }
        DataType::Bytes => {
            // Triton's elements (a 4-byte little-endian length, then the bytes) as
            // ONNX Runtime's strings, which are UTF-8 without NUL.
            let texts: Vec<String> = bytes_elements(data)?
                .into_iter()
                .map(str::to_owned)
                .collect();
            Tensor::from_string_array((shape, &texts[..]))?.into()
        }
        DataType::Invalid => return Err(ort::Error::new("INVALID tensors are not carried")),
    ))
}

/// The elements of a BYTES buffer as text.
fn bytes_elements(data: &[u8]) -> ort::Result<Vec<&str>> {
    crate::tensor::count_bytes_elements(data).map_err(|e| ort::Error::new(e.message))?;
    let offsets = crate::tensor::bytes_element_offsets(data);
    (offsets.windows(2).enumerate())
        .map(|(i, w)| {
            let text = std::str::from_utf8(&data[w[0] + 4..w[1]]).map_err(|_| {
                ort::Error::new(format!(
                    "BYTES element {i} is not UTF-8 (ONNX Runtime's strings are)"
                ))
            })?;
            if text.contains('\0') {
                return Err(ort::Error::new(format!(
                    "BYTES element {i} holds a NUL byte (ONNX Runtime's strings cannot)"
                )));
            }
            Ok(text)
        })
        .collect()
}

/// Strings as Triton's BYTES elements.
fn bytes_of(texts: &[String]) -> Vec<u8> {
    let mut out = Vec::with_capacity(texts.iter().map(|t| t.len() + 4).sum());
    for t in texts {
        out.extend_from_slice(&(t.len() as u32).to_le_bytes());
        out.extend_from_slice(t.as_bytes());
    }
    out
}

/// An output's shape and bytes.
fn output_bytes(v: &ort::value::DynValue, dt: DataType) -> ort::Result<(Vec<i64>, Cow<'_, [u8]>)> {
    macro_rules! typed {
        ($t:ty) => {{
            let (shape, data) = v.try_extract_tensor::<$t>()?;
            (
                shape.to_vec(),
                Cow::Borrowed(bytemuck::cast_slice::<$t, u8>(data)),
            )
        }};
    }
    Ok(numeric!(dt, typed,
        DataType::Bool => {
            let (shape, data) = v.try_extract_tensor::<bool>()?;
            (
                shape.to_vec(),
                Cow::Owned(data.iter().map(|&b| u8::from(b)).collect()),
            )
        }
        DataType::Bytes => {
            let (shape, texts) = v.try_extract_strings()?;
            (shape.to_vec(), Cow::Owned(bytes_of(&texts)))
        }
        DataType::Invalid => return Err(ort::Error::new("INVALID tensors are not carried")),
    ))
}

impl ModelInstance for OrtInstance {
    fn execute(&mut self, batch: &mut Batch) -> Result<()> {
        let what = &self.what;
        let mut feeds: Vec<(Cow<'_, str>, SessionInputValue<'_>)> =
            Vec::with_capacity(self.inputs.len());
        for si in &self.inputs {
            let (bi, data) = batch.input(&si.name).ok_or_else(|| {
                Error::invalid(format!(
                    "{what}: input '{}' is missing from the batch",
                    si.name
                ))
            })?;
            let shape: Vec<i64> = match &si.reshape {
                Some(r) => {
                    let lead = if self.batching {
                        bi.shape.first().copied()
                    } else {
                        None
                    };
                    let mut s: Vec<i64> = lead.into_iter().collect();
                    s.extend_from_slice(r);
                    s
                }
                None => bi.shape.to_vec(),
            };
            let value = input_value(si.dtype, shape, data)
                .map_err(|e| Error::invalid(format!("{what}: input '{}': {e}", si.name)))?;
            feeds.push((Cow::Borrowed(si.name.as_str()), value));
        }
        let outputs = match &self.run_options {
            Some(o) => self.session.run_with_options(feeds, o),
            None => self.session.run(feeds),
        }
        .map_err(|e| {
            // ONNX Runtime refuses inputs the model cannot take (a size the graph does not
            // accept, a value out of range) as invalid arguments: the request's fault.
            let msg = format!("{what}: execution failed: {e}");
            if e.code() == ort::ErrorCode::InvalidArgument {
                Error::invalid(msg)
            } else {
                Error::internal(msg)
            }
        })?;
        for so in &self.outputs {
            let v = outputs.get(&so.name).ok_or_else(|| {
                Error::internal(format!(
                    "{what}: ONNX Runtime did not return output '{}'",
                    so.name
                ))
            })?;
            if let ValueType::Tensor { ty, .. } = v.dtype() {
                let got = data_type(*ty);
                if got.as_ref().ok() != Some(&so.dtype) {
                    return Err(Error::internal(format!(
                        "{what}: output '{}' is {} where the config says {}",
                        so.name,
                        got.map_or_else(|n| n, |d| d.as_str().to_owned()),
                        so.dtype.as_str()
                    )));
                }
            }
            let (shape, bytes) = output_bytes(v, so.dtype)
                .map_err(|e| Error::internal(format!("{what}: output '{}': {e}", so.name)))?;
            let byte_size = (so.dtype == DataType::Bytes).then_some(bytes.len());
            let out = batch.alloc_output(&so.name, &shape, byte_size)?;
            if out.len() != bytes.len() {
                return Err(Error::internal(format!(
                    "{what}: output '{}' has {} bytes for shape {}, expected {}",
                    so.name,
                    bytes.len(),
                    shape_string(&shape),
                    out.len()
                )));
            }
            out.copy_from_slice(&bytes);
        }
        Ok(())
    }
}
