//! A model's ONNX Runtime settings, read from its config with the names Triton's ONNX
//! Runtime backend gives them: `parameters` (thread counts, execution mode, memory arena
//! and pattern, arena shrinkage, session config entries, the older CUDA provider keys),
//! `optimization { graph { level } }` and `optimization { execution_accelerators }`.
//! A value that cannot be used is INVALID_ARGUMENT naming the field; an accelerator this
//! engine cannot use is UNSUPPORTED naming it.

use crate::config::ModelConfig;
use crate::onnx::model::{EXECUTOR_PARAMETERS, GPU_EXECUTOR_PARAMETER};
use crate::status::{Error, Result};

/// The model parameter that makes ONNX Runtime required for this model.
pub const REQUIRED_PARAMETER: &str = "onnxruntime_required";

/// Graph optimization, as `optimization { graph { level } }` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraphLevel {
    /// -1: basic optimizations.
    Basic,
    /// 1: basic and extended.
    Extended,
    /// 2: none.
    Disabled,
    /// 0 or absent: all.
    All,
}

/// An execution accelerator from `optimization { execution_accelerators }`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Accelerator {
    /// `gpu_execution_accelerator { name: "tensorrt" }`: ONNX Runtime's TensorRT provider,
    /// options by their provider names.
    TensorRt(Vec<(String, String)>),
    /// `gpu_execution_accelerator { name: "cuda" }`: options for the CUDA provider.
    Cuda(Vec<(String, String)>),
    /// `cpu_execution_accelerator { name: "openvino" }`.
    OpenVino(Vec<(String, String)>),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    pub intra_op_threads: Option<usize>,
    pub inter_op_threads: Option<usize>,
    pub parallel_execution: bool,
    pub mem_arena: Option<bool>,
    pub mem_pattern: Option<bool>,
    /// `memory.enable_memory_arena_shrinkage`: a run option ("cpu:0;gpu:0").
    pub arena_shrinkage: Option<String>,
    /// `session.*` parameters, passed as session config entries.
    pub session_entries: Vec<(String, String)>,
    pub graph_level: GraphLevel,
    pub gpu_accelerators: Vec<Accelerator>,
    pub cpu_accelerators: Vec<Accelerator>,
    /// The older CUDA provider keys given as model parameters.
    pub cuda_options: Vec<(String, String)>,
    /// The model must run on ONNX Runtime (no tract fallback).
    pub required: bool,
}

/// The older CUDA provider keys Triton still takes as model parameters.
const CUDA_PARAMETERS: &[&str] = &[
    "cudnn_conv_algo_search",
    "gpu_mem_limit",
    "arena_extend_strategy",
    "do_copy_in_default_stream",
];

fn flag(what: &str, key: &str, v: &str) -> Result<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Ok(true),
        "0" | "false" | "off" | "no" => Ok(false),
        _ => Err(Error::invalid(format!(
            "{what}: parameters.{key}: '{v}' is not a flag (use 0/1 or true/false)"
        ))),
    }
}

/// The flag's value as the provider options want it ("1"/"0").
fn flag_text(what: &str, key: &str, v: &str) -> Result<String> {
    Ok(if flag(what, key, v)? { "1" } else { "0" }.to_owned())
}

fn count(what: &str, key: &str, v: &str) -> Result<usize> {
    let n: usize = v.trim().parse().map_err(|_| {
        Error::invalid(format!(
            "{what}: parameters.{key}: '{v}' is not a thread count"
        ))
    })?;
    if n > 4096 {
        return Err(Error::invalid(format!(
            "{what}: parameters.{key}: {n} threads exceeds the limit of 4096"
        )));
    }
    Ok(n)
}

impl Settings {
    /// What a session opened only to read the model's inputs and outputs needs: no
    /// graph optimization, one thread.
    pub fn for_metadata() -> Settings {
        Settings {
            intra_op_threads: Some(1),
            inter_op_threads: Some(1),
            parallel_execution: false,
            mem_arena: None,
            mem_pattern: None,
            arena_shrinkage: None,
            session_entries: Vec::new(),
            graph_level: GraphLevel::Disabled,
            gpu_accelerators: Vec::new(),
            cpu_accelerators: Vec::new(),
            cuda_options: Vec::new(),
            required: false,
        }
    }

    /// Reads the settings of `config`. Unknown parameters are refused (UNSUPPORTED naming
    /// the key), as they would otherwise be ignored.
    pub fn of(config: &ModelConfig) -> Result<Settings> {
        let what = format!("model '{}'", config.name);
        let what = what.as_str();
        let mut s = Settings {
            intra_op_threads: None,
            inter_op_threads: None,
            parallel_execution: false,
            mem_arena: None,
            mem_pattern: None,
            arena_shrinkage: None,
            session_entries: Vec::new(),
            graph_level: GraphLevel::All,
            gpu_accelerators: Vec::new(),
            cpu_accelerators: Vec::new(),
            cuda_options: Vec::new(),
            required: false,
        };
        for (key, v) in &config.parameters {
            match key.as_str() {
                "intra_op_thread_count" => s.intra_op_threads = Some(count(what, key, v)?),
                "inter_op_thread_count" => s.inter_op_threads = Some(count(what, key, v)?),
                "execution_mode" => {
                    s.parallel_execution = match v.trim() {
                        "0" => false,
                        "1" => true,
                        _ => {
                            return Err(Error::invalid(format!(
                                "{what}: parameters.execution_mode: '{v}' (0: sequential, 1: parallel)"
                            )))
                        }
                    }
                }
                "enable_mem_arena" => s.mem_arena = Some(flag(what, key, v)?),
                "enable_mem_pattern" => s.mem_pattern = Some(flag(what, key, v)?),
                "memory.enable_memory_arena_shrinkage" => {
                    s.arena_shrinkage = Some(v.clone());
                }
                REQUIRED_PARAMETER => s.required = flag(what, key, v)?,
                k if k.starts_with("session.") => s.session_entries.push((k.to_owned(), v.clone())),
                k if CUDA_PARAMETERS.contains(&k) => s.cuda_options.push((k.to_owned(), v.clone())),
                // The GPU instances' engine, and libinfer's executor's settings.
                k if k == GPU_EXECUTOR_PARAMETER || EXECUTOR_PARAMETERS.contains(&k) => {}
                k => {
                    return Err(Error::unsupported(format!(
                        "{what}: parameters.{k}: not a setting of the ONNX Runtime engine (it takes intra_op_thread_count, inter_op_thread_count, execution_mode, enable_mem_arena, enable_mem_pattern, memory.enable_memory_arena_shrinkage, session.* entries, {}, {REQUIRED_PARAMETER}; {GPU_EXECUTOR_PARAMETER}, and libinfer's GPU executor's {})",
                        CUDA_PARAMETERS.join(", "),
                        EXECUTOR_PARAMETERS.join(", ")
                    )))
                }
            }
        }
        if let Some(o) = &config.optimization {
            if let Some(g) = &o.graph {
                s.graph_level = match g.level {
                    0 => GraphLevel::All,
                    -1 => GraphLevel::Basic,
                    1 => GraphLevel::Extended,
                    2 => GraphLevel::Disabled,
                    l => {
                        return Err(Error::invalid(format!(
                            "{what}: optimization.graph.level: {l} (use -1: basic, 1: basic and extended, 2: none; 0 or absent: all)"
                        )))
                    }
                };
            }
            if let Some(acc) = &o.execution_accelerators {
                for (i, a) in acc.gpu_execution_accelerator.iter().enumerate() {
                    let at = format!(
                        "optimization.execution_accelerators.gpu_execution_accelerator[{i}]"
                    );
                    s.gpu_accelerators.push(match a.name.as_str() {
                        "tensorrt" => Accelerator::TensorRt(tensorrt_options(what, &at, &a.parameters)?),
                        "cuda" => Accelerator::Cuda(sorted(&a.parameters)),
                        n => {
                            return Err(Error::unsupported(format!(
                                "{what}: {at}.name: '{n}' (the ONNX Runtime engine has \"tensorrt\" and \"cuda\")"
                            )))
                        }
                    });
                }
                for (i, a) in acc.cpu_execution_accelerator.iter().enumerate() {
                    let at = format!(
                        "optimization.execution_accelerators.cpu_execution_accelerator[{i}]"
                    );
                    s.cpu_accelerators.push(match a.name.as_str() {
                        "openvino" => Accelerator::OpenVino(sorted(&a.parameters)),
                        n => {
                            return Err(Error::unsupported(format!(
                            "{what}: {at}.name: '{n}' (the ONNX Runtime engine has \"openvino\")"
                        )))
                        }
                    });
                }
            }
        }
        Ok(s)
    }

    /// Whether the config asks for anything only ONNX Runtime does (for the message when
    /// another engine serves the model).
    pub fn ort_only(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if !self.gpu_accelerators.is_empty() {
            v.push("optimization.execution_accelerators.gpu_execution_accelerator");
        }
        if !self.cpu_accelerators.is_empty() {
            v.push("optimization.execution_accelerators.cpu_execution_accelerator");
        }
        v
    }
}

fn sorted(p: &std::collections::BTreeMap<String, String>) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = p.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    v.sort();
    v
}

/// Triton's TensorRT accelerator parameters as the TensorRT provider's options.
fn tensorrt_options(
    what: &str,
    at: &str,
    p: &std::collections::BTreeMap<String, String>,
) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for (k, v) in sorted(p) {
        let key = format!("{at}.parameters.{k}");
        match k.as_str() {
            "precision_mode" => match v.as_str() {
                "FP32" => {}
                "FP16" => out.push(("trt_fp16_enable".to_owned(), "1".to_owned())),
                "INT8" => out.push(("trt_int8_enable".to_owned(), "1".to_owned())),
                _ => {
                    return Err(Error::invalid(format!(
                        "{what}: {key}: '{v}' (FP32, FP16 or INT8)"
                    )))
                }
            },
            "max_workspace_size_bytes" => {
                let n: u64 = v.parse().map_err(|_| {
                    Error::invalid(format!("{what}: {key}: '{v}' is not a byte count"))
                })?;
                out.push(("trt_max_workspace_size".to_owned(), n.to_string()));
            }
            "int8_calibration_table_name" | "int8_use_native_calibration_table" => {
                let v = if k.ends_with("table") && k.contains("native") {
                    flag_text(what, &key, &v)?
                } else {
                    v
                };
                out.push((format!("trt_{k}"), v));
            }
            k if k.starts_with("trt_") => {
                let bool_key = k.ends_with("_enable")
                    || matches!(
                        k,
                        "trt_dump_subgraphs"
                            | "trt_force_sequential_engine_build"
                            | "trt_layer_norm_fp32_fallback"
                            | "trt_force_timing_cache"
                            | "trt_detailed_build_log"
                            | "trt_dump_ep_context_model"
                    );
                let v = if bool_key { flag_text(what, &key, &v)? } else { v };
                out.push((k.to_owned(), v));
            }
            _ => {
                return Err(Error::unsupported(format!(
                    "{what}: {key}: not a TensorRT accelerator parameter (precision_mode, max_workspace_size_bytes, int8_calibration_table_name, int8_use_native_calibration_table, trt_*)"
                )))
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(text: &str) -> Result<Settings> {
        let c = crate::config::parse_config(&format!(
            "name: \"m\"\nplatform: \"onnxruntime_onnx\"\nmax_batch_size: 0\ninput [ {{ name: \"x\" data_type: TYPE_FP32 dims: [ 1 ] }} ]\noutput [ {{ name: \"y\" data_type: TYPE_FP32 dims: [ 1 ] }} ]\n{text}"
        ))?;
        Settings::of(&c)
    }

    #[test]
    fn triton_names_are_read() {
        let s = settings(
            r#"parameters { key: "intra_op_thread_count" value: { string_value: "2" } }
parameters { key: "inter_op_thread_count" value: { string_value: "1" } }
parameters { key: "execution_mode" value: { string_value: "1" } }
parameters { key: "enable_mem_arena" value: { string_value: "0" } }
parameters { key: "session.use_device_allocator_for_initializers" value: { string_value: "1" } }
optimization { graph { level: -1 } execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt" parameters { key: "precision_mode" value: "FP16" } parameters { key: "max_workspace_size_bytes" value: "1073741824" } parameters { key: "trt_engine_cache_enable" value: "true" } } ] } }"#,
        )
        .unwrap();
        assert_eq!(s.intra_op_threads, Some(2));
        assert_eq!(s.inter_op_threads, Some(1));
        assert!(s.parallel_execution);
        assert_eq!(s.mem_arena, Some(false));
        assert_eq!(s.graph_level, GraphLevel::Basic);
        assert_eq!(
            s.session_entries,
            vec![(
                "session.use_device_allocator_for_initializers".to_owned(),
                "1".to_owned()
            )]
        );
        let Accelerator::TensorRt(o) = &s.gpu_accelerators[0] else {
            panic!("{:?}", s.gpu_accelerators)
        };
        assert!(o.contains(&("trt_fp16_enable".into(), "1".into())), "{o:?}");
        assert!(o.contains(&("trt_max_workspace_size".into(), "1073741824".into())));
        assert!(o.contains(&("trt_engine_cache_enable".into(), "1".into())));
    }

    #[test]
    fn bad_values_name_the_field() {
        let e = settings(
            r#"parameters { key: "intra_op_thread_count" value: { string_value: "many" } }"#,
        )
        .unwrap_err();
        assert!(
            e.message.contains("parameters.intra_op_thread_count"),
            "{e}"
        );
        let e =
            settings(r#"parameters { key: "threads" value: { string_value: "4" } }"#).unwrap_err();
        assert_eq!(e.code, crate::status::Code::Unsupported);
        assert!(e.message.contains("parameters.threads"), "{e}");
        let e = settings("optimization { graph { level: 3 } }").unwrap_err();
        assert!(e.message.contains("optimization.graph.level: 3"), "{e}");
        let e = settings(
            r#"optimization { execution_accelerators { cpu_execution_accelerator [ { name: "dnnl" } ] } }"#,
        )
        .unwrap_err();
        assert!(
            e.message
                .contains("cpu_execution_accelerator[0].name: 'dnnl'"),
            "{e}"
        );
        let e = settings(
            r#"optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt" parameters { key: "precision_mode" value: "FP8" } } ] } }"#,
        )
        .unwrap_err();
        assert!(e.message.contains("precision_mode: 'FP8'"), "{e}");
    }
}
