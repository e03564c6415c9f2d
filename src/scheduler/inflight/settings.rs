//! What a generative model's config says about scheduling: the capacity policy, the
//! limits and the KV cache. Parameter names follow TensorRT-LLM's Triton backend where it
//! has one.

use crate::config::{InstanceKind, ModelConfig};
use crate::status::{Error, Result};

/// How requests are admitted against the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Admit a request only when the blocks for its longest possible output are free:
    /// once running, it runs to the end.
    GuaranteedNoEvict,
    /// Admit when the prompt fits; when blocks run out, pause the newest requests and
    /// resume them later by recomputing their keys and values.
    MaxUtilization,
    /// No request joins a running batch: the next batch starts when the last one ends.
    StaticBatch,
}

impl Policy {
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::GuaranteedNoEvict => "guaranteed_no_evict",
            Policy::MaxUtilization => "max_utilization",
            Policy::StaticBatch => "static_batch",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    pub policy: Policy,
    /// Requests in flight per instance.
    pub max_num_sequences: usize,
    /// Tokens processed per iteration (prompt tokens plus one per generating request).
    pub max_num_tokens: usize,
    /// Requests waiting for admission; 0 = no limit.
    pub max_queue_size: usize,
    pub tokens_per_block: usize,
    /// The KV cache of each instance, in blocks.
    pub kv_blocks: usize,
    /// Prompts may be split across iterations.
    pub chunked_context: bool,
    /// Full blocks of a finished prompt prefix are kept for requests that share it.
    pub prefix_reuse: bool,
    /// Compute threads per instance (0 = one per core).
    pub threads: usize,
    /// `max_tokens` of a request that does not say.
    pub default_max_tokens: usize,
}

/// Parameters this backend reads; other keys are reported once at load.
pub const KNOWN_PARAMETERS: &[&str] = &[
    "batch_scheduler_policy",
    "gpt_model_type",
    "max_num_sequences",
    "max_num_tokens",
    "max_queue_size",
    "tokens_per_block",
    "kv_cache_blocks",
    "max_tokens_in_paged_kv_cache",
    "kv_cache_memory_mb",
    "enable_chunked_context",
    "enable_kv_cache_reuse",
    "intra_op_thread_count",
    "default_max_tokens",
    "kv_cache_type",
];

const DEFAULT_MAX_SEQUENCES: usize = 64;
/// Limits of the parameters that size threads and per-iteration buffers.
pub const MAX_SEQUENCES: usize = 1 << 16;
pub const MAX_TOKENS: usize = 1 << 20;
pub const MAX_TOKENS_PER_BLOCK: usize = 1 << 16;
pub const MAX_THREADS: usize = 256;
const DEFAULT_MAX_TOKENS_PER_ITERATION: usize = 8192;
/// TensorRT-LLM's default. Longer blocks are fewer, longer runs of each head's keys and
/// values for attention to read (32 streams of a 0.4 B Q8_0 model decoded about 4 %
/// faster than with 16, attention taking 10 % less of a step); prefix reuse keeps whole
/// blocks only, so a shared prefix shorter than a block is not reused.
const DEFAULT_TOKENS_PER_BLOCK: usize = 64;
const DEFAULT_REQUEST_MAX_TOKENS: usize = 16;
/// Without a size in the config the cache holds every sequence at full context, up to
/// this much memory.
const DEFAULT_KV_MEMORY: u64 = 1 << 30;

impl Settings {
    /// Reads the parameters. `bytes_per_block(tokens_per_block)` and `n_positions` come
    /// from the model; unknown keys are returned for a warning.
    pub fn from_config(
        c: &ModelConfig,
        n_positions: usize,
        bytes_per_block: impl Fn(usize) -> usize,
    ) -> Result<(Settings, Vec<String>)> {
        let m = &c.name;
        let bad = |key: &str, v: &str, what: &str| {
            Error::invalid(format!(
                "model '{m}': parameter '{key}' must be {what}, got '{v}'"
            ))
        };
        let uint = |key: &str| -> Result<Option<usize>> {
            match c.parameters.get(key) {
                None => Ok(None),
                Some(v) => v
                    .trim()
                    .parse::<usize>()
                    .map(Some)
                    .map_err(|_| bad(key, v, "a non-negative integer")),
            }
        };
        let positive = |key: &str| -> Result<Option<usize>> {
            match uint(key)? {
                Some(0) => Err(bad(key, "0", "at least 1")),
                v => Ok(v),
            }
        };
        // Numbers that size threads or per-iteration buffers have limits (README,
        // "Security and limits").
        let at_most = |key: &str, v: Option<usize>, max: usize| -> Result<Option<usize>> {
            match v {
                Some(n) if n > max => Err(bad(key, &n.to_string(), &format!("at most {max}"))),
                v => Ok(v),
            }
        };
        let flag = |key: &str| -> Result<Option<bool>> {
            match c.parameters.get(key).map(|v| v.trim().to_ascii_lowercase()) {
                None => Ok(None),
                Some(v) if v == "true" || v == "1" => Ok(Some(true)),
                Some(v) if v == "false" || v == "0" => Ok(Some(false)),
                Some(v) => Err(bad(key, &v, "true or false")),
            }
        };
        let mut policy = match c.parameters.get("batch_scheduler_policy") {
            None => Policy::GuaranteedNoEvict,
            Some(v) => match v.trim().to_ascii_lowercase().as_str() {
                "guaranteed_no_evict" => Policy::GuaranteedNoEvict,
                "max_utilization" => Policy::MaxUtilization,
                "static_batch" => Policy::StaticBatch,
                _ => {
                    return Err(bad(
                        "batch_scheduler_policy",
                        v,
                        "guaranteed_no_evict, max_utilization or static_batch",
                    ))
                }
            },
        };
        if let Some(v) = c.parameters.get("gpt_model_type") {
            match v.trim().to_ascii_lowercase().as_str() {
                "inflight_fused_batching" | "inflight_batching" => {}
                "v1" => {
                    if c.parameters.contains_key("batch_scheduler_policy")
                        && policy != Policy::StaticBatch
                    {
                        return Err(Error::invalid(format!(
                            "model '{m}': gpt_model_type 'V1' (static batching) contradicts batch_scheduler_policy '{}'",
                            policy.as_str()
                        )));
                    }
                    policy = Policy::StaticBatch;
                }
                _ => {
                    return Err(bad(
                        "gpt_model_type",
                        v,
                        "inflight_fused_batching, inflight_batching or V1",
                    ))
                }
            }
        }
        let max_num_sequences = at_most(
            "max_num_sequences",
            positive("max_num_sequences")?,
            MAX_SEQUENCES,
        )?
        .unwrap_or(DEFAULT_MAX_SEQUENCES);
        let max_num_tokens = at_most("max_num_tokens", positive("max_num_tokens")?, MAX_TOKENS)?
            .unwrap_or(DEFAULT_MAX_TOKENS_PER_ITERATION.max(max_num_sequences));
        if max_num_tokens < max_num_sequences {
            return Err(Error::invalid(format!(
                "model '{m}': max_num_tokens ({max_num_tokens}) must be at least max_num_sequences ({max_num_sequences}): every running request needs a token per iteration"
            )));
        }
        let tokens_per_block = at_most(
            "tokens_per_block",
            positive("tokens_per_block")?,
            MAX_TOKENS_PER_BLOCK,
        )?
        .unwrap_or(DEFAULT_TOKENS_PER_BLOCK);
        let per_block = bytes_per_block(tokens_per_block).max(1);
        let blocks_for = |tokens: usize| tokens.div_ceil(tokens_per_block);
        let mut sizes: Vec<(usize, &str)> = Vec::new();
        if let Some(b) = positive("kv_cache_blocks")? {
            sizes.push((b, "kv_cache_blocks"));
        }
        if let Some(t) = positive("max_tokens_in_paged_kv_cache")? {
            sizes.push((blocks_for(t), "max_tokens_in_paged_kv_cache"));
        }
        if let Some(mb) = positive("kv_cache_memory_mb")? {
            let bytes = (mb as u64).saturating_mul(1 << 20);
            sizes.push(((bytes / per_block as u64) as usize, "kv_cache_memory_mb"));
        }
        let kv_blocks = match sizes.iter().min_by_key(|s| s.0) {
            Some(&(0, key)) => {
                return Err(Error::invalid(format!(
                    "model '{m}': parameter '{key}' leaves no room for one KV block of {tokens_per_block} tokens ({per_block} bytes)"
                )))
            }
            Some(&(b, _)) => b,
            None => {
                let full = max_num_sequences.saturating_mul(blocks_for(n_positions));
                let cap = (DEFAULT_KV_MEMORY / per_block as u64).max(1) as usize;
                full.min(cap)
            }
        };
        let settings = Settings {
            policy,
            max_num_sequences,
            max_num_tokens,
            max_queue_size: uint("max_queue_size")?.unwrap_or(0),
            tokens_per_block,
            kv_blocks,
            chunked_context: flag("enable_chunked_context")?.unwrap_or(false),
            prefix_reuse: flag("enable_kv_cache_reuse")?.unwrap_or(false),
            threads: at_most(
                "intra_op_thread_count",
                uint("intra_op_thread_count")?,
                MAX_THREADS,
            )?
            .unwrap_or(0),
            default_max_tokens: positive("default_max_tokens")?
                .unwrap_or(DEFAULT_REQUEST_MAX_TOKENS),
        };
        let unknown = c
            .parameters
            .keys()
            .filter(|k| !KNOWN_PARAMETERS.contains(&k.as_str()))
            .cloned()
            .collect();
        Ok((settings, unknown))
    }
}

/// The checks a generative model's config must pass beyond the general ones.
pub fn check_config(c: &ModelConfig) -> Result<()> {
    let m = &c.name;
    if c.max_batch_size != 0 {
        return Err(Error::invalid(format!(
            "model '{m}': a generative model takes one sequence per request and batches by iteration: set max_batch_size: 0 (got {}) and size the batch with parameter max_num_sequences",
            c.max_batch_size
        )));
    }
    if c.dynamic_batching.is_some() || c.sequence_batching.is_some() {
        return Err(Error::invalid(format!(
            "model '{m}': a generative model is scheduled by iteration (in-flight batching); remove dynamic_batching / sequence_batching"
        )));
    }
    if let Some(g) = c
        .instance_groups
        .iter()
        .find(|g| g.kind == InstanceKind::Gpu)
    {
        return Err(Error::unsupported(format!(
            "model '{m}': instance_group '{}' asks for KIND_GPU, but generative models run on the CPU only (use KIND_CPU or KIND_AUTO)",
            g.name
        )));
    }
    use crate::tensor::DataType;
    let ids = |t: &crate::config::TensorConfig, what: &str| -> Result<()> {
        if !matches!(t.data_type, DataType::Int32 | DataType::Int64) {
            return Err(Error::invalid(format!(
                "model '{m}': {what} '{}' must be TYPE_INT32 or TYPE_INT64, not {}",
                t.name,
                t.data_type.as_str()
            )));
        }
        if t.dims != [-1] {
            return Err(Error::invalid(format!(
                "model '{m}': {what} '{}' must have dims [ -1 ] (a sequence of tokens), not {:?}",
                t.name, t.dims
            )));
        }
        Ok(())
    };
    let text = |t: &crate::config::TensorConfig, what: &str| -> Result<()> {
        if t.data_type != DataType::Bytes || !(t.dims == [1] || t.dims == [-1]) {
            return Err(Error::invalid(format!(
                "model '{m}': {what} '{}' must be TYPE_STRING with dims [ 1 ] or [ -1 ] (one text)",
                t.name
            )));
        }
        Ok(())
    };
    for t in &c.inputs {
        match &*t.name {
            INPUT_IDS => ids(t, "input")?,
            TEXT_INPUT => text(t, "input")?,
            other => {
                return Err(Error::invalid(format!(
                    "model '{m}': unknown input '{other}' for a generative model (it takes '{INPUT_IDS}' or '{TEXT_INPUT}'); sampling settings are request parameters"
                )))
            }
        }
    }
    match (c.input(INPUT_IDS), c.input(TEXT_INPUT)) {
        (None, None) => {
            return Err(Error::invalid(format!(
                "model '{m}': a generative model needs the input '{INPUT_IDS}' or '{TEXT_INPUT}'"
            )))
        }
        (Some(a), Some(b)) if !(a.optional && b.optional) => {
            return Err(Error::invalid(format!(
                "model '{m}': with both '{INPUT_IDS}' and '{TEXT_INPUT}', a request sends one of them: mark both optional: true"
            )))
        }
        _ => {}
    }
    if c.output(OUTPUT_IDS).is_none() && c.output(TEXT_OUTPUT).is_none() {
        return Err(Error::invalid(format!(
            "model '{m}': a generative model needs the output '{OUTPUT_IDS}' or '{TEXT_OUTPUT}'"
        )));
    }
    for t in &c.outputs {
        match &*t.name {
            OUTPUT_IDS => ids(t, "output")?,
            TEXT_OUTPUT => text(t, "output")?,
            OUTPUT_LOG_PROBS => {
                if t.data_type != DataType::Fp32 || t.dims != [-1] {
                    return Err(Error::invalid(format!(
                        "model '{m}': output '{OUTPUT_LOG_PROBS}' must be TYPE_FP32 with dims [ -1 ]"
                    )));
                }
            }
            other => {
                return Err(Error::invalid(format!(
                    "model '{m}': unknown output '{other}' for a generative model (it has '{OUTPUT_IDS}', '{TEXT_OUTPUT}' and '{OUTPUT_LOG_PROBS}')"
                )))
            }
        }
    }
    Ok(())
}

pub const INPUT_IDS: &str = "input_ids";
pub const OUTPUT_IDS: &str = "output_ids";
pub const OUTPUT_LOG_PROBS: &str = "output_log_probs";
pub const TEXT_INPUT: &str = "text_input";
pub const TEXT_OUTPUT: &str = "text_output";

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(params: &[(&str, &str)]) -> Settings {
        let mut text = String::from(
            "backend: \"llama\"\nmax_batch_size: 0\n\
             input [ { name: \"input_ids\" data_type: TYPE_INT32 dims: [ -1 ] } ]\n\
             output [ { name: \"output_ids\" data_type: TYPE_INT32 dims: [ -1 ] } ]\n",
        );
        for (k, v) in params {
            text += &format!("parameters {{ key: \"{k}\" value {{ string_value: \"{v}\" }} }}\n");
        }
        let c = crate::config::parse_config_named(&text, Some("m")).unwrap();
        // 1 KiB a position: a block of 64 is 64 KiB.
        Settings::from_config(&c, 2048, |tpb| tpb << 10).unwrap().0
    }

    #[test]
    fn blocks_hold_64_positions_unless_configured() {
        let s = settings(&[]);
        assert_eq!(s.tokens_per_block, 64);
        // Every sequence at full context: 64 sequences of 2048 positions, 32 blocks each.
        assert_eq!(s.kv_blocks, 64 * 32);
        let s = settings(&[("tokens_per_block", "16")]);
        assert_eq!((s.tokens_per_block, s.kv_blocks), (16, 64 * 128));
        // A size in positions becomes whole blocks of the configured length.
        let s = settings(&[("max_tokens_in_paged_kv_cache", "1000")]);
        assert_eq!((s.tokens_per_block, s.kv_blocks), (64, 16));
        // Without a size, at most 1 GiB: 16384 blocks of 64 KiB.
        let s = settings(&[("max_num_sequences", "1024")]);
        assert_eq!(s.kv_blocks, 16384);
    }
}
