//! The ONNX backend: which engine runs a model (ONNX Runtime, tract, or the GPU
//! executor for GPU instances) and the config auto-complete, read by that engine.

use super::model::*;
use super::{cpu, gpu, onnxruntime};
use crate::backend::{Backend, InstancePlace, ModelInstance};
use crate::config::{ModelConfig, RawConfig};
use crate::folder::{check_relative, Folder};
use crate::status::{Error, Result};
use std::path::Path;
use std::sync::Arc;

/// Which engine computes a model's CPU instances.
#[derive(Clone, Copy)]
pub enum Engine {
    OnnxRuntime(&'static onnxruntime::Runtime),
    Tract,
}

/// Which engine runs an ONNX model's GPU instances (`parameters { key: "gpu_executor" }`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuExecutor {
    /// No parameter: ONNX Runtime's CUDA provider where the loaded ONNX Runtime has it,
    /// else libinfer's own executor.
    Default,
    /// `"onnxruntime"`: ONNX Runtime's CUDA provider; UNAVAILABLE where it is missing.
    OnnxRuntime,
    /// `"libinfer"`: libinfer's own CUDA executor, whatever ONNX Runtime offers.
    Libinfer,
}

impl GpuExecutor {
    /// The choice of `parameters`; a value that names no engine is INVALID_ARGUMENT.
    pub fn of(
        model: &str,
        parameters: &std::collections::BTreeMap<String, String>,
    ) -> Result<GpuExecutor> {
        let Some(v) = parameters.get(GPU_EXECUTOR_PARAMETER) else {
            return Ok(GpuExecutor::Default);
        };
        match v.trim() {
            "onnxruntime" => Ok(GpuExecutor::OnnxRuntime),
            "libinfer" => Ok(GpuExecutor::Libinfer),
            other => Err(Error::invalid(format!(
                "model '{model}': parameters.{GPU_EXECUTOR_PARAMETER}: '{other}' (GPU instances run on \"onnxruntime\", ONNX Runtime's CUDA provider, or \"libinfer\", libinfer's own CUDA executor)"
            ))),
        }
    }

    /// Whether GPU instances run on ONNX Runtime's CUDA provider, where the loaded ONNX
    /// Runtime has it (`has_cuda`) or not.
    fn takes_ort_cuda(self, has_cuda: bool) -> bool {
        has_cuda && self != GpuExecutor::Libinfer
    }
}

/// ONNX models: on ONNX Runtime when it is loaded (CPU instances, and GPU instances when
/// it has the CUDA provider and the config does not pick libinfer's executor), else on
/// tract; other GPU instances run on the library's own GPU executor (`onnx::gpu`).
pub struct OnnxBackend {
    engine: Engine,
    /// Whether instances may run on a GPU: not for `backend: "tract"`, which names a CPU
    /// engine (KIND_AUTO places it on the CPU, KIND_GPU is refused).
    gpu: bool,
    gpu_executor: GpuExecutor,
}

impl OnnxBackend {
    /// The backend of `config` on `engine`; `tract` when the config names tract
    /// (`backend: "tract"`), whose instances stay on the CPU. Refused here, at load:
    /// `gpu_executor` with tract, and the GPU executor's settings where ONNX Runtime's
    /// CUDA provider runs the GPU instances (they would never apply).
    pub fn new(config: &ModelConfig, engine: Engine, tract: bool) -> Result<OnnxBackend> {
        let gpu_executor = GpuExecutor::of(&config.name, &config.parameters)?;
        if tract && gpu_executor != GpuExecutor::Default {
            return Err(Error::unsupported(format!(
                "model '{}': parameters.{GPU_EXECUTOR_PARAMETER}: backend \"tract\" runs on the CPU only (for GPU instances use platform \"onnxruntime_onnx\")",
                config.name
            )));
        }
        let b = OnnxBackend {
            engine,
            gpu: !tract,
            gpu_executor,
        };
        if let Some(rt) = b.ort_gpu() {
            refuse_executor_settings(config, &rt.path)?;
        }
        Ok(b)
    }

    /// ONNX Runtime, where its CUDA provider runs the GPU instances.
    fn ort_gpu(&self) -> Option<&'static onnxruntime::Runtime> {
        match self.engine {
            Engine::OnnxRuntime(rt) if self.gpu_executor.takes_ort_cuda(rt.cuda) => Some(rt),
            _ => None,
        }
    }

    /// Why ONNX Runtime's CUDA provider cannot run the GPU instances the config gives it.
    fn no_ort_gpu(&self, what: &str) -> Error {
        let why = match self.engine {
            Engine::OnnxRuntime(rt) => format!(
                "the loaded ONNX Runtime ('{}', version {}) has no CUDA execution provider (it has {}; onnxruntime-gpu's library has it)",
                rt.path.display(),
                rt.version,
                rt.providers.join(", ")
            ),
            Engine::Tract => "ONNX Runtime is not loaded (see the log's line on which engine runs ONNX models)".to_owned(),
        };
        Error::unavailable(format!(
            "{what}: parameters.{GPU_EXECUTOR_PARAMETER} is \"onnxruntime\", but {why}"
        ))
    }
}

/// The settings only libinfer's GPU executor reads, refused where ONNX Runtime's CUDA
/// provider runs a model's GPU instances: they would be read and never applied.
fn refuse_executor_settings(config: &ModelConfig, library: &Path) -> Result<()> {
    let field = EXECUTOR_PARAMETERS
        .iter()
        .find(|k| config.parameters.contains_key(**k))
        .map(|k| format!("parameters.{k}"))
        .or_else(|| {
            let graphs = config
                .optimization
                .as_ref()
                .and_then(|o| o.cuda.as_ref())
                .is_some_and(|c| c.graphs);
            graphs.then(|| "optimization.cuda.graphs".to_owned())
        });
    match field {
        None => Ok(()),
        Some(f) => Err(Error::unsupported(format!(
            "model '{}': {f} is a setting of libinfer's GPU executor, and this model's GPU instances run on ONNX Runtime's CUDA provider ('{}'); set parameters.{GPU_EXECUTOR_PARAMETER}: \"libinfer\" to run them on the executor (ONNX Runtime takes its own settings through gpu_execution_accelerator: \"cuda\" options, or \"tensorrt\" with precision_mode)",
            config.name,
            library.display()
        ))),
    }
}

impl Backend for OnnxBackend {
    /// On KIND_GPU instances ONNX Runtime's CUDA provider, or the GPU executor.
    fn runs_on_gpu(&self) -> bool {
        self.gpu
    }

    fn auto_prefers_gpu(&self) -> bool {
        self.gpu
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
        use onnxruntime::{OrtInstance, Place};
        let dir = at.model_dir.ok_or_else(|| {
            Error::invalid(format!(
                "model '{}': an ONNX model needs a model folder (give model_dir or a model repository)",
                config.name
            ))
        })?;
        let what = format!("model '{}' version {}", config.name, at.version);
        let file = model_file(dir, at.version, &config.default_model_filename, &what)?;
        if at.gpu >= 0 {
            if self.gpu_executor == GpuExecutor::OnnxRuntime && self.ort_gpu().is_none() {
                return Err(self.no_ort_gpu(&what));
            }
            if let Some(rt) = self.ort_gpu() {
                return Ok(Box::new(OrtInstance::new(
                    rt,
                    config,
                    &file,
                    Place::Gpu(at.gpu),
                    &what,
                )?));
            }
            // On a GPU instance: the GPU executor (the context is bound by the caller),
            // with the config's ONNX Runtime settings read (and refused by name where
            // wrong) and the config checked against the file as on the CPU engines, so
            // that a config means the same wherever its instances run.
            onnxruntime::Settings::of(config)?;
            let graph = gpu::shared_graph(&file, &what)?;
            let (inputs, outputs) = declared_of(&graph);
            check_model_io(config, &inputs, &outputs, &what)?;
            return Ok(Box::new(gpu::OnnxGpuInstance::new(
                config, graph, at.gpu, &what,
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
        cpu::instance(config, &file, &what)
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
    let (inputs, outputs) = match engine {
        Engine::Tract => cpu::declared(&file, &what)?,
        Engine::OnnxRuntime(rt) => ort_declared(raw, rt, &file, &what)?,
    };
    complete_config(raw, &what, &inputs, &outputs)
}

/// The inputs and outputs ONNX Runtime reads from the model; where the config lacks
/// outputs, tract's analysis of the graph corrects a declared output of the wrong rank
/// or datatype.
fn ort_declared(
    raw: &RawConfig,
    rt: &onnxruntime::Runtime,
    file: &Path,
    what: &str,
) -> Result<(Vec<Declared>, Vec<Declared>)> {
    {
        let settings = onnxruntime::Settings::for_metadata();
        let session = onnxruntime::open(rt, file, &settings, onnxruntime::Place::Cpu, what)?;
        let (inputs, mut outputs) = onnxruntime::metadata(&session, file, what);
        drop(session);
        let outputs_missing = raw.pb.output.is_empty()
            || (raw.pb.output.iter()).any(|t| t.data_type == 0 || t.dims.is_empty());
        if outputs_missing {
            // A file may declare an output shape its graph does not compute (ONNX
            // Runtime serves the declaration); tract's analysis of the graph, where it
            // succeeds, says what is computed.
            if let Some(analysed) = cpu::analysed_outputs(file, what) {
                for d in &mut outputs {
                    if let Some(a) = analysed.iter().find(|a| a.name == d.name) {
                        let same_rank =
                            (a.dims.as_ref().map(Vec::len)) == (d.dims.as_ref().map(Vec::len));
                        // (Only where tract can name the datatype: tract has no strings.)
                        let carried = matches!(a.dtype, Some(Ok(_)));
                        if carried && (!same_rank || a.dtype != d.dtype) {
                            *d = a.clone();
                        }
                    }
                }
            }
        }
        Ok((inputs, outputs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> ModelConfig {
        let text = format!(
            "name: \"m\" platform: \"onnxruntime_onnx\" max_batch_size: 4\n\
             input [ {{ name: \"X\" data_type: TYPE_FP32 dims: [ 4 ] }} ]\n\
             output [ {{ name: \"Y\" data_type: TYPE_FP32 dims: [ 4 ] }} ]\n{extra}"
        );
        match crate::config::parse_config(&text) {
            Ok(c) => c,
            Err(e) => panic!("{e:?}"),
        }
    }

    fn param(k: &str, v: &str) -> String {
        format!("parameters {{ key: \"{k}\" value: {{ string_value: \"{v}\" }} }}\n")
    }

    #[test]
    fn gpu_executor_parameter() {
        let of = |extra: &str| GpuExecutor::of("m", &config(extra).parameters);
        assert_eq!(of("").unwrap(), GpuExecutor::Default);
        let ort = of(&param("gpu_executor", "onnxruntime")).unwrap();
        let own = of(&param("gpu_executor", " libinfer ")).unwrap();
        assert_eq!(
            (ort, own),
            (GpuExecutor::OnnxRuntime, GpuExecutor::Libinfer)
        );
        let e = of(&param("gpu_executor", "tensorrt")).unwrap_err();
        assert_eq!(e.code, crate::status::Code::InvalidArgument);
        assert!(
            e.message.contains("'m'")
                && e.message.contains("parameters.gpu_executor: 'tensorrt'")
                && e.message.contains("\"libinfer\""),
            "{}",
            e.message
        );
        // ONNX Runtime's CUDA provider runs the GPU instances where it is present, unless
        // the config picks libinfer's executor; never where it is absent.
        assert!(GpuExecutor::Default.takes_ort_cuda(true));
        assert!(GpuExecutor::OnnxRuntime.takes_ort_cuda(true));
        assert!(!GpuExecutor::Libinfer.takes_ort_cuda(true));
        for g in [
            GpuExecutor::Default,
            GpuExecutor::OnnxRuntime,
            GpuExecutor::Libinfer,
        ] {
            assert!(!g.takes_ort_cuda(false), "{g:?}");
        }
    }

    #[test]
    fn executor_settings_are_refused_where_onnxruntime_runs_the_gpu_instances() {
        let lib = Path::new("/x/libonnxruntime.so.1.32.0");
        assert!(refuse_executor_settings(&config(""), lib).is_ok());
        assert!(
            refuse_executor_settings(&config(&param("intra_op_thread_count", "2")), lib).is_ok()
        );
        for (extra, field) in [
            (param("precision", "FP16"), "parameters.precision"),
            (param("allow_tf32", "true"), "parameters.allow_tf32"),
            (
                param("cuda_graph_max_batch", "8"),
                "parameters.cuda_graph_max_batch",
            ),
            (
                "optimization { cuda { graphs: true } }".to_owned(),
                "optimization.cuda.graphs",
            ),
        ] {
            let e = refuse_executor_settings(&config(&extra), lib).unwrap_err();
            assert_eq!(e.code, crate::status::Code::Unsupported);
            assert!(
                e.message.contains(field)
                    && e.message.contains("'m'")
                    && e.message.contains("libonnxruntime.so.1.32.0")
                    && e.message.contains("gpu_executor: \"libinfer\""),
                "{}",
                e.message
            );
        }
        let off = "optimization { cuda { graphs: false } }";
        assert!(refuse_executor_settings(&config(off), lib).is_ok());
    }
}
