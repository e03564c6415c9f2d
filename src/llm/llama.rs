//! Llama-family decoders (Llama 2/3, Mistral, Qwen2, SmolLM, TinyLlama, ...): RMSNorm,
//! rotary positions, SwiGLU MLP, grouped-query attention, optional Q/K/V biases, tied or
//! untied embeddings. This module reads their shape and weights from a Hugging Face
//! folder (`config.json` + `model.safetensors`) or a GGUF file; the forward pass is in
//! `llama_runner`.
//!
//! Weights stay in the file's type and the file's bytes: both formats are
//! memory-mapped, and matrices point into the mapping (resident memory is what the
//! operating system pages in, shared between instances and with the page cache).

use super::gguf::{Gguf, Value};
use super::kv::{KvShape, KvType};
use super::linear::{Bytes, Matrix};
use super::quant::WeightType;
use super::sampling::Rng;
use crate::folder::Folder;
use crate::status::{Error, Result};
use serde_json::{Map, Value as Json};
use std::path::Path;
use std::sync::Arc;

/// How rotary embeddings pair a head's dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Dimension `i` with `i + rot/2` (Hugging Face's `rotate_half`; GGML's NEOX).
    Half,
    /// Dimension `2i` with `2i + 1` (GGML's NORM: llama.cpp's files for the `llama`
    /// architecture, whose Q and K rows were permuted to suit it).
    Adjacent,
}

/// The shape and hyper-parameters of a Llama-family decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// The architecture's name (`llama`, `qwen2`, `mistral`).
    pub arch: String,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    /// Width of the MLP.
    pub n_ff: usize,
    pub vocab_size: usize,
    /// Longest sequence.
    pub n_ctx: usize,
    pub rms_eps: f32,
    pub rope_style: RopeStyle,
    /// Dimensions of each head that rotate (the first `rope_dims`).
    pub rope_dims: usize,
    /// Per rotating pair: its angle per position (`theta^(-2i/rope_dims)` with any
    /// scaling applied).
    pub inv_freq: Vec<f32>,
    /// Q, K and V have biases (Qwen2; Llama's `attention_bias`).
    pub qkv_bias: bool,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl LlamaConfig {
    /// The KV cache shape this model needs, in `dtype`.
    pub fn kv_shape(&self, dtype: KvType) -> KvShape {
        KvShape {
            n_layer: self.n_layer,
            n_kv_head: self.n_kv_head,
            head_dim: self.head_dim,
            dtype,
        }
    }

    fn validate(&self, at: &str) -> Result<()> {
        let bad = |what: String| Err(Error::invalid(format!("{at}: {what}")));
        if self.n_head == 0 || self.n_kv_head == 0 || !self.n_head.is_multiple_of(self.n_kv_head) {
            return bad(format!(
                "{} attention heads cannot share {} key/value heads evenly",
                self.n_head, self.n_kv_head
            ));
        }
        if self.rope_dims == 0
            || self.rope_dims > self.head_dim
            || !self.rope_dims.is_multiple_of(2)
        {
            return bad(format!(
                "{} rotary dimensions do not fit heads of {}",
                self.rope_dims, self.head_dim
            ));
        }
        if self.n_head.checked_mul(self.head_dim).is_none() {
            return bad(format!(
                "{} heads of {} values overflow",
                self.n_head, self.head_dim
            ));
        }
        if let Some(f) = self.inv_freq.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
            return bad(format!(
                "a rotary frequency is {f}: the rotary base or scaling parameters are out of range"
            ));
        }
        if self.inv_freq.len() != self.rope_dims / 2 {
            return bad(format!(
                "{} rotary frequencies for {} rotary dimensions",
                self.inv_freq.len(),
                self.rope_dims
            ));
        }
        for (name, v) in [
            ("layers", self.n_layer),
            ("width", self.n_embd),
            ("head size", self.head_dim),
            ("MLP width", self.n_ff),
            ("vocabulary", self.vocab_size),
            ("context", self.n_ctx),
        ] {
            if v == 0 {
                return bad(format!("{name} is 0"));
            }
        }
        if !(self.rms_eps > 0.0 && self.rms_eps.is_finite()) {
            return bad(format!("RMS norm epsilon {} is not positive", self.rms_eps));
        }
        Ok(())
    }

    /// Reads a Hugging Face `config.json` (`LlamaForCausalLM`, `MistralForCausalLM`,
    /// `Qwen2ForCausalLM`). Fields that change the computation and are not supported are
    /// UNSUPPORTED naming the field.
    pub fn from_hf_json(text: &str) -> Result<LlamaConfig> {
        let at = "config.json";
        let v: Json = serde_json::from_str(text)
            .map_err(|e| Error::invalid(format!("{at}: not valid JSON: {e}")))?;
        let o = v
            .as_object()
            .ok_or_else(|| Error::invalid(format!("{at}: not a JSON object")))?;
        let arch = match o.get("model_type").and_then(Json::as_str) {
            Some(t @ ("llama" | "mistral" | "qwen2")) => t.to_string(),
            Some(t) => {
                return Err(Error::unsupported(format!(
                    "{at}: model_type \"{t}\" (Llama-family decoders read: llama, mistral, qwen2)"
                )))
            }
            None => return Err(Error::invalid(format!("{at}: model_type is missing"))),
        };
        let n_embd = hf_uint(o, "hidden_size")?;
        let n_head = hf_uint(o, "num_attention_heads")?;
        let n_kv_head = match o.get("num_key_value_heads") {
            None | Some(Json::Null) => n_head,
            Some(_) => hf_uint(o, "num_key_value_heads")?,
        };
        let head_dim = match o.get("head_dim") {
            None | Some(Json::Null) => n_embd / n_head.max(1),
            Some(_) => hf_uint(o, "head_dim")?,
        };
        if let Some(act) = o.get("hidden_act").and_then(Json::as_str) {
            if act != "silu" {
                return Err(Error::unsupported(format!(
                    "{at}: hidden_act \"{act}\" (the SwiGLU MLP takes silu)"
                )));
            }
        }
        if hf_flag(o, "mlp_bias", false)? {
            return Err(Error::unsupported(format!(
                "{at}: mlp_bias true (MLP biases are not read)"
            )));
        }
        let partial = hf_float(o, "partial_rotary_factor", 1.0)?;
        if !(partial > 0.0 && partial <= 1.0) {
            return Err(Error::invalid(format!(
                "{at}: partial_rotary_factor {partial:?} is not in (0, 1]"
            )));
        }
        let rope_dims = ((head_dim as f64 * partial) as usize) & !1;
        let theta = hf_float(o, "rope_theta", 10_000.0)?;
        check_rope(at, head_dim, rope_dims, theta, "rope_theta")?;
        let mut n_ctx = hf_uint(o, "max_position_embeddings")?;
        // A sliding window that applies within the context caps the context: attention
        // over the whole context is then the model's own computation.
        let window_on = match arch.as_str() {
            "mistral" => true,
            _ => hf_flag(o, "use_sliding_window", false)?,
        };
        if window_on && !matches!(o.get("sliding_window"), None | Some(Json::Null)) {
            n_ctx = n_ctx.min(hf_uint(o, "sliding_window")?);
        }
        let mut inv_freq = base_freqs(theta, rope_dims);
        match o.get("rope_scaling") {
            None | Some(Json::Null) => {}
            Some(Json::Object(s)) => {
                let kind = s
                    .get("rope_type")
                    .or_else(|| s.get("type"))
                    .and_then(Json::as_str)
                    .unwrap_or("default");
                let num = |k: &str| -> Result<f64> {
                    s.get(k).and_then(Json::as_f64).ok_or_else(|| {
                        Error::invalid(format!("{at}: rope_scaling.{k} is missing or not a number"))
                    })
                };
                match kind {
                    "default" => {}
                    "linear" => {
                        let f = num("factor")?;
                        if !(f.is_finite() && f > 0.0) {
                            return Err(Error::invalid(format!(
                                "{at}: rope_scaling.factor {f} is not a positive number"
                            )));
                        }
                        inv_freq
                            .iter_mut()
                            .for_each(|x| *x = (*x as f64 / f) as f32);
                    }
                    "llama3" => {
                        let (f, low, high, old) = (
                            num("factor")?,
                            num("low_freq_factor")?,
                            num("high_freq_factor")?,
                            num("original_max_position_embeddings")?,
                        );
                        // As transformers checks them (its wavelength bands need them).
                        if !(f.is_finite() && f > 0.0 && low > 0.0 && high > low && old > 0.0)
                            || !(high.is_finite() && old.is_finite())
                        {
                            return Err(Error::invalid(format!(
                                "{at}: rope_scaling factor {f}, low_freq_factor {low}, high_freq_factor {high}, original_max_position_embeddings {old}: each must be positive and finite, and high_freq_factor above low_freq_factor"
                            )));
                        }
                        llama3_scaling(&mut inv_freq, f, low, high, old)
                    }
                    other => {
                        return Err(Error::unsupported(format!(
                        "{at}: rope_scaling type \"{other}\" (default, linear and llama3 are read)"
                    )))
                    }
                }
            }
            Some(other) => {
                return Err(Error::invalid(format!(
                    "{at}: rope_scaling {other} is not an object"
                )))
            }
        }
        let qkv_bias = match arch.as_str() {
            "qwen2" => true,
            _ => hf_flag(o, "attention_bias", false)?,
        };
        let token_id = |what: &str, v: &Json| -> Result<u32> {
            v.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| Error::invalid(format!("{at}: {what} {v} is not a token id")))
        };
        let eos_token_ids = match o.get("eos_token_id") {
            Some(Json::Array(a)) => a
                .iter()
                .map(|x| token_id("eos_token_id", x))
                .collect::<Result<_>>()?,
            None | Some(Json::Null) => Vec::new(),
            Some(x) => vec![token_id("eos_token_id", x)?],
        };
        let c = LlamaConfig {
            arch,
            n_layer: hf_uint(o, "num_hidden_layers")?,
            n_embd,
            n_head,
            n_kv_head,
            head_dim,
            n_ff: hf_uint(o, "intermediate_size")?,
            vocab_size: hf_uint(o, "vocab_size")?,
            n_ctx,
            rms_eps: hf_float(o, "rms_norm_eps", 1e-6)? as f32,
            rope_style: RopeStyle::Half,
            rope_dims,
            inv_freq,
            qkv_bias,
            tie_word_embeddings: hf_flag(o, "tie_word_embeddings", false)?,
            bos_token_id: match o.get("bos_token_id") {
                None | Some(Json::Null) => None,
                Some(x) => Some(token_id("bos_token_id", x)?),
            },
            eos_token_ids,
        };
        c.validate(at)?;
        Ok(c)
    }

    /// Reads a GGUF file's metadata (architectures `llama` and `qwen2`).
    fn from_gguf(g: &Gguf) -> Result<LlamaConfig> {
        let at = &g.path;
        let arch = match g.get("general.architecture").and_then(Value::as_str) {
            Some(a @ ("llama" | "qwen2")) => a.to_string(),
            Some(a) => {
                return Err(Error::unsupported(format!(
                    "{at}: architecture \"{a}\" (llama and qwen2 are read)"
                )))
            }
            None => {
                return Err(Error::invalid(format!(
                    "{at}: metadata general.architecture is missing"
                )))
            }
        };
        let key = |k: &str| format!("{arch}.{k}");
        let us = |k: &str| -> Result<usize> { Ok(g.uint(&key(k))? as usize) };
        let n_embd = us("embedding_length")?;
        let n_head = us("attention.head_count")?;
        let n_kv_head = match g.get(&key("attention.head_count_kv")) {
            None => n_head,
            Some(_) => us("attention.head_count_kv")?,
        };
        let head_dim = match g.get(&key("attention.key_length")) {
            None => n_embd / n_head.max(1),
            Some(_) => us("attention.key_length")?,
        };
        if let Some(vl) = g.get(&key("attention.value_length")) {
            if vl.as_u64() != Some(head_dim as u64) {
                return Err(Error::unsupported(format!(
                    "{at}: {} {vl:?} differs from the key length {head_dim}",
                    key("attention.value_length")
                )));
            }
        }
        let rope_dims = match g.get(&key("rope.dimension_count")) {
            None => head_dim,
            Some(_) => us("rope.dimension_count")?,
        };
        let theta = g.float(&key("rope.freq_base"))?.unwrap_or(10_000.0);
        check_rope(at, head_dim, rope_dims, theta, &key("rope.freq_base"))?;
        let mut inv_freq = base_freqs(theta, rope_dims);
        let scaling = g
            .get(&key("rope.scaling.type"))
            .and_then(Value::as_str)
            .unwrap_or("none");
        match scaling {
            "none" => {}
            "linear" => {
                let f = g.float(&key("rope.scaling.factor"))?.unwrap_or(1.0);
                if !(f.is_finite() && f > 0.0) {
                    return Err(Error::invalid(format!(
                        "{at}: {} {f} is not a positive number",
                        key("rope.scaling.factor")
                    )));
                }
                inv_freq
                    .iter_mut()
                    .for_each(|x| *x = (*x as f64 / f) as f32);
            }
            other => {
                return Err(Error::unsupported(format!(
                    "{at}: {} \"{other}\" (none and linear are read)",
                    key("rope.scaling.type")
                )))
            }
        }
        // Llama 3's scaling is stored as a tensor of per-pair divisors.
        if let Some(info) = g.tensors.get("rope_freqs.weight") {
            let (t, _, bytes) = g.tensor("rope_freqs.weight")?;
            if t != WeightType::F32 || info.dims[0] as usize != rope_dims / 2 {
                return Err(Error::invalid(format!(
                    "{at}: rope_freqs.weight must be {} F32 values",
                    rope_dims / 2
                )));
            }
            for (x, b) in inv_freq.iter_mut().zip(bytes.get().chunks_exact(4)) {
                *x /= f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        let vocab_size = match g.tensors.get("token_embd.weight") {
            Some(t) if t.dims.len() == 2 => t.dims[1] as usize,
            _ => {
                return Err(Error::invalid(format!(
                    "{at}: tensor token_embd.weight is missing or not a matrix"
                )))
            }
        };
        let eos = g
            .get("tokenizer.ggml.eos_token_id")
            .and_then(Value::as_u64)
            .map(|x| vec![x as u32])
            .unwrap_or_default();
        let c = LlamaConfig {
            rope_style: if arch == "llama" {
                RopeStyle::Adjacent
            } else {
                RopeStyle::Half
            },
            qkv_bias: g.tensors.contains_key("blk.0.attn_q.bias"),
            tie_word_embeddings: !g.tensors.contains_key("output.weight"),
            arch: arch.clone(),
            n_layer: us("block_count")?,
            n_embd,
            n_head,
            n_kv_head,
            head_dim,
            n_ff: us("feed_forward_length")?,
            vocab_size,
            n_ctx: us("context_length")?,
            rms_eps: g
                .float(&key("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5) as f32,
            rope_dims,
            inv_freq,
            bos_token_id: g
                .get("tokenizer.ggml.bos_token_id")
                .and_then(Value::as_u64)
                .map(|x| x as u32),
            eos_token_ids: eos,
        };
        c.validate(at)?;
        Ok(c)
    }
}

/// Widest attention head read (the rotary tables are sized by it before any tensor is).
const MAX_HEAD_DIM: usize = 1 << 14;

/// The head size, rotary dimensions and rotary base, before the rotary frequencies are
/// computed from them.
fn check_rope(at: &str, head_dim: usize, rope_dims: usize, theta: f64, field: &str) -> Result<()> {
    if head_dim == 0 || head_dim > MAX_HEAD_DIM {
        return Err(Error::invalid(format!(
            "{at}: a head size of {head_dim} (1 to {MAX_HEAD_DIM} are read)"
        )));
    }
    // Every supported architecture rotates at least one pair of each head.
    if rope_dims == 0 || rope_dims > head_dim || !rope_dims.is_multiple_of(2) {
        return Err(Error::invalid(format!(
            "{at}: {rope_dims} rotary dimensions do not fit heads of {head_dim}"
        )));
    }
    if !(theta.is_finite() && theta > 0.0) {
        return Err(Error::invalid(format!(
            "{at}: {field} {theta:?} is not a positive number"
        )));
    }
    Ok(())
}

fn base_freqs(theta: f64, dims: usize) -> Vec<f32> {
    (0..dims / 2)
        .map(|i| theta.powf(-((2 * i) as f64) / dims as f64) as f32)
        .collect()
}

/// Llama 3's frequency scaling (as transformers' `_compute_llama3_parameters`).
fn llama3_scaling(inv_freq: &mut [f32], factor: f64, low: f64, high: f64, old_ctx: f64) {
    let low_wavelen = old_ctx / low;
    let high_wavelen = old_ctx / high;
    for f in inv_freq.iter_mut() {
        let fr = *f as f64;
        let wavelen = 2.0 * std::f64::consts::PI / fr;
        let v = if wavelen > low_wavelen {
            fr / factor
        } else if wavelen < high_wavelen {
            fr
        } else {
            let smooth = (old_ctx / wavelen - low) / (high - low);
            (1.0 - smooth) * fr / factor + smooth * fr
        };
        *f = v as f32;
    }
}

fn hf_uint(o: &Map<String, Json>, name: &str) -> Result<usize> {
    match o.get(name) {
        None | Some(Json::Null) => Err(Error::invalid(format!("config.json: {name} is missing"))),
        Some(v) => v
            .as_u64()
            .filter(|&n| n > 0 && n <= u32::MAX as u64)
            .map(|n| n as usize)
            .ok_or_else(|| {
                Error::invalid(format!("config.json: {name} {v} is not a positive integer"))
            }),
    }
}

/// An optional number (`default` when absent or null).
fn hf_float(o: &Map<String, Json>, name: &str, default: f64) -> Result<f64> {
    match o.get(name) {
        None | Some(Json::Null) => Ok(default),
        Some(v) => v
            .as_f64()
            .ok_or_else(|| Error::invalid(format!("config.json: {name} {v} is not a number"))),
    }
}

fn hf_flag(o: &Map<String, Json>, name: &str, default: bool) -> Result<bool> {
    match o.get(name) {
        None | Some(Json::Null) => Ok(default),
        Some(Json::Bool(b)) => Ok(*b),
        Some(v) => Err(Error::invalid(format!(
            "config.json: {name} {v} is not a boolean"
        ))),
    }
}

/// One decoder layer.
pub(crate) struct Layer {
    pub attn_norm: Vec<f32>,
    pub wq: Matrix,
    pub wk: Matrix,
    pub wv: Matrix,
    /// `[q | k | v]` biases, when the model has them.
    pub qkv_bias: Option<Vec<f32>>,
    pub wo: Matrix,
    /// The output projection's bias (Llama's `attention_bias`).
    pub wo_bias: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub gate: Matrix,
    pub up: Matrix,
    pub down: Matrix,
}

/// A Llama-family model: its config and weights.
pub struct Llama {
    pub config: LlamaConfig,
    /// `[vocab][n_embd]`.
    pub(crate) embed: Matrix,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: Vec<f32>,
    /// `[vocab][n_embd]`; the embedding itself when tied.
    pub(crate) head: Matrix,
    /// Where the weights came from, for the log.
    pub source: String,
}

/// Finds tensors by name in a file and checks their shapes.
trait Source {
    /// The matrix `name`, which must be `[rows][cols]`.
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix>;
    /// The vector `name` of `n` values, as f32.
    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>>;
    fn has(&self, name: &str) -> bool;
    /// `name` as the file spells it (for messages).
    fn shown(&self, name: &str) -> String {
        name.to_owned()
    }
}

/// The one `.gguf` file of a version folder, if it has one.
pub(crate) fn gguf_in(dir: &Folder) -> Result<Option<std::path::PathBuf>> {
    let ggufs: Vec<String> = dir
        .entries()
        .into_iter()
        .filter(|n| n.ends_with(".gguf"))
        .collect();
    match ggufs.len() {
        0 => Ok(None),
        1 => dir.file(&ggufs[0], "GGUF model").map(Some),
        _ => Err(Error::invalid(format!(
            "{}: holds {} .gguf files ({}); a version folder holds one model",
            dir.path().display(),
            ggufs.len(),
            ggufs.join(", ")
        ))),
    }
}

impl Llama {
    /// Loads a model from a version folder: the one `.gguf` file it holds, else
    /// `config.json` + `model.safetensors`.
    pub fn load(dir: &Folder) -> Result<Llama> {
        match gguf_in(dir)? {
            None => Llama::load_hf(dir),
            Some(path) => Llama::load_gguf(&path),
        }
    }

    /// Loads a GGUF file.
    pub fn load_gguf(path: &Path) -> Result<Llama> {
        let g = Gguf::open(path)?;
        let config = LlamaConfig::from_gguf(&g)?;
        Llama::from_source(config, &GgufSource(&g), g.path.clone())
    }

    /// Loads a Hugging Face folder: `config.json` and `model.safetensors`.
    pub fn load_hf(dir: &Folder) -> Result<Llama> {
        let config_path = dir.path().join("config.json");
        let text = String::from_utf8(dir.read("config.json", "model config")?)
            .map_err(|_| Error::invalid(format!("{}: not UTF-8 text", config_path.display())))?;
        let config =
            LlamaConfig::from_hf_json(&text).map_err(|e| e.context(config_path.display()))?;
        let path = dir.file("model.safetensors", "model weights")?;
        let shown = path.display().to_string();
        let file = std::fs::File::open(&path)
            .map_err(|e| Error::invalid(format!("{shown}: cannot open: {e}")))?;
        // SAFETY: read-only private mapping; the file must not change while it is loaded
        // (see `Gguf::open`).
        let map = Arc::new(
            unsafe { memmap2::Mmap::map(&file) }
                .map_err(|e| Error::invalid(format!("{shown}: cannot map: {e}")))?,
        );
        let st = safetensors::SafeTensors::deserialize(&map)
            .map_err(|e| Error::invalid(format!("{shown}: not a valid safetensors file: {e}")))?;
        let src = HfSource {
            st,
            map: &map,
            path: &shown,
        };
        Llama::from_source(config, &src, shown.clone())
    }

    fn from_source(config: LlamaConfig, src: &dyn Source, source: String) -> Result<Llama> {
        let c = &config;
        let (e, hd) = (c.n_embd, c.head_dim);
        let (qw, kvw) = (c.n_head * hd, c.n_kv_head * hd);
        // The last layer's first tensor, before anything is sized by the layer count.
        let last = format!("blk.{}.attn_norm.weight", c.n_layer.saturating_sub(1));
        if !src.has(&last) {
            return Err(Error::invalid(format!(
                "{source}: {} layers configured, but the weights have no {}",
                c.n_layer,
                src.shown(&last)
            )));
        }
        let mut layers = Vec::with_capacity(c.n_layer);
        for l in 0..c.n_layer {
            let n = |s: &str| format!("blk.{l}.{s}");
            let qkv_bias = if c.qkv_bias {
                let mut b = src.vector(&n("attn_q.bias"), qw)?;
                b.extend(src.vector(&n("attn_k.bias"), kvw)?);
                b.extend(src.vector(&n("attn_v.bias"), kvw)?);
                Some(b)
            } else {
                for t in ["attn_q.bias", "attn_k.bias", "attn_v.bias"] {
                    if src.has(&n(t)) {
                        return Err(Error::unsupported(format!(
                            "{source}: tensor {} exists but the config says the attention has no biases",
                            n(t)
                        )));
                    }
                }
                None
            };
            layers.push(Layer {
                attn_norm: src.vector(&n("attn_norm.weight"), e)?,
                wq: src.matrix(&n("attn_q.weight"), qw, e)?.packed()?,
                wk: src.matrix(&n("attn_k.weight"), kvw, e)?.packed()?,
                wv: src.matrix(&n("attn_v.weight"), kvw, e)?.packed()?,
                qkv_bias,
                wo: src.matrix(&n("attn_output.weight"), e, qw)?.packed()?,
                wo_bias: if src.has(&n("attn_output.bias")) {
                    Some(src.vector(&n("attn_output.bias"), e)?)
                } else {
                    None
                },
                ffn_norm: src.vector(&n("ffn_norm.weight"), e)?,
                gate: src.matrix(&n("ffn_gate.weight"), c.n_ff, e)?.packed()?,
                up: src.matrix(&n("ffn_up.weight"), c.n_ff, e)?.packed()?,
                down: src.matrix(&n("ffn_down.weight"), e, c.n_ff)?.packed()?,
            });
        }
        let embed = src.matrix("token_embd.weight", c.vocab_size, e)?;
        // The embedding is looked up by row; the head multiplies (a tied head is the
        // embedding packed, its rows still read through the file's map).
        let head = if c.tie_word_embeddings {
            embed.clone().packed()?
        } else {
            src.matrix("output.weight", c.vocab_size, e)?.packed()?
        };
        Ok(Llama {
            embed,
            layers,
            norm: src.vector("output_norm.weight", e)?,
            head,
            config,
            source,
        })
    }

    /// Random F32 weights (tests and benchmarks), deterministic in `seed`.
    pub fn random(config: LlamaConfig, seed: u64) -> Result<Llama> {
        let c = &config;
        c.validate("random model")?;
        let mut rng = Rng::new(seed);
        let mut draw = |n: usize, mean: f32, std: f32| -> Vec<f32> {
            let half = std * 3f32.sqrt();
            (0..n)
                .map(|_| mean + (rng.next_f64() as f32 * 2.0 - 1.0) * half)
                .collect()
        };
        let (e, hd) = (c.n_embd, c.head_dim);
        let (qw, kvw) = (c.n_head * hd, c.n_kv_head * hd);
        let mut m = |name: &str, rows: usize, cols: usize, std: f32| {
            Matrix::from_f32(name, rows, cols, &draw(rows * cols, 0.0, std))
        };
        let mut layers = Vec::new();
        for l in 0..c.n_layer {
            layers.push(Layer {
                attn_norm: Vec::new(),
                wq: m(&format!("blk.{l}.attn_q.weight"), qw, e, 0.05)?,
                wk: m(&format!("blk.{l}.attn_k.weight"), kvw, e, 0.05)?,
                wv: m(&format!("blk.{l}.attn_v.weight"), kvw, e, 0.05)?,
                qkv_bias: None,
                wo: m(&format!("blk.{l}.attn_output.weight"), e, qw, 0.05)?,
                wo_bias: None,
                ffn_norm: Vec::new(),
                gate: m(&format!("blk.{l}.ffn_gate.weight"), c.n_ff, e, 0.05)?,
                up: m(&format!("blk.{l}.ffn_up.weight"), c.n_ff, e, 0.05)?,
                down: m(&format!("blk.{l}.ffn_down.weight"), e, c.n_ff, 0.05)?,
            });
        }
        let embed = m("token_embd.weight", c.vocab_size, e, 0.5)?;
        let head = if c.tie_word_embeddings {
            embed.clone()
        } else {
            m("output.weight", c.vocab_size, e, 0.5)?
        };
        for layer in &mut layers {
            layer.attn_norm = draw(e, 1.0, 0.05);
            layer.ffn_norm = draw(e, 1.0, 0.05);
            if c.qkv_bias {
                layer.qkv_bias = Some(draw(qw + 2 * kvw, 0.0, 0.05));
            }
        }
        Ok(Llama {
            embed,
            layers,
            norm: draw(e, 1.0, 0.05),
            head,
            config,
            source: format!("random weights (seed {seed})"),
        })
    }

    /// The same model with every matrix expanded to F32 (owned): what the quantized
    /// weights stand for, computed without 8-bit activations. For checking a quantized
    /// file's decoding against a reference; it takes the memory of F32 weights.
    pub fn dequantized(&self) -> Result<Llama> {
        let f = |m: &Matrix| -> Result<Matrix> {
            let mut v = vec![0.0f32; m.rows * m.cols];
            for (r, row) in v.chunks_exact_mut(m.cols).enumerate() {
                m.row_f32(r, row);
            }
            Matrix::from_f32(&m.name, m.rows, m.cols, &v)
        };
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            layers.push(Layer {
                attn_norm: l.attn_norm.clone(),
                wq: f(&l.wq)?,
                wk: f(&l.wk)?,
                wv: f(&l.wv)?,
                qkv_bias: l.qkv_bias.clone(),
                wo: f(&l.wo)?,
                wo_bias: l.wo_bias.clone(),
                ffn_norm: l.ffn_norm.clone(),
                gate: f(&l.gate)?,
                up: f(&l.up)?,
                down: f(&l.down)?,
            });
        }
        let embed = f(&self.embed)?;
        let head = if self.config.tie_word_embeddings {
            embed.clone()
        } else {
            f(&self.head)?
        };
        Ok(Llama {
            config: self.config.clone(),
            embed,
            layers,
            norm: self.norm.clone(),
            head,
            source: format!("{} (dequantized)", self.source),
        })
    }

    /// Bytes of weights, and how many of them are mapped from the file.
    pub fn weight_bytes(&self) -> (usize, usize) {
        let mut all = vec![&self.embed];
        // A tied head is the embedding's bytes, unless packed into its own.
        if !self.config.tie_word_embeddings || self.head.is_packed() {
            all.push(&self.head);
        }
        for l in &self.layers {
            all.extend([&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down]);
        }
        let total = all.iter().map(|m| m.bytes()).sum();
        let mapped = all
            .iter()
            .filter(|m| m.is_mapped())
            .map(|m| m.bytes())
            .sum();
        (total, mapped)
    }

    /// The weight types of the model's matrices, most bytes first (for the log).
    pub fn weight_types(&self) -> Vec<(WeightType, usize)> {
        let mut by: Vec<(WeightType, usize)> = Vec::new();
        let mut add = |m: &Matrix| match by.iter_mut().find(|(t, _)| *t == m.wtype) {
            Some((_, n)) => *n += m.bytes(),
            None => by.push((m.wtype, m.bytes())),
        };
        add(&self.embed);
        if !self.config.tie_word_embeddings || self.head.is_packed() {
            add(&self.head);
        }
        for l in &self.layers {
            for m in [&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down] {
                add(m);
            }
        }
        by.sort_by_key(|b| std::cmp::Reverse(b.1));
        by
    }
}

struct GgufSource<'a>(&'a Gguf);

impl Source for GgufSource<'_> {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let (t, info, bytes) = self.0.tensor(name)?;
        if info.dims != [cols as u64, rows as u64] {
            return Err(Error::invalid(format!(
                "{}: tensor {name} has GGML dims {:?}, the metadata implies [{cols}, {rows}]",
                self.0.path, info.dims
            )));
        }
        Matrix::new(name, t, rows, cols, bytes).map_err(|e| e.context(&self.0.path))
    }

    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>> {
        let (t, info, bytes) = self.0.tensor(name)?;
        if info.dims.iter().product::<u64>() != n as u64 {
            return Err(Error::invalid(format!(
                "{}: tensor {name} has dims {:?}, {n} values expected",
                self.0.path, info.dims
            )));
        }
        let mut out = vec![0.0; n];
        super::quant::dequantize_row(t, bytes.get(), &mut out);
        Ok(out)
    }

    fn has(&self, name: &str) -> bool {
        self.0.tensors.contains_key(name)
    }
}

struct HfSource<'a> {
    st: safetensors::SafeTensors<'a>,
    map: &'a Arc<memmap2::Mmap>,
    path: &'a str,
}

impl HfSource<'_> {
    /// Hugging Face's name of a GGUF-style tensor name.
    fn hf_name(name: &str) -> String {
        if let Some(rest) = name.strip_prefix("blk.") {
            let (l, t) = rest.split_once('.').unwrap_or((rest, ""));
            let t = match t {
                "attn_norm.weight" => "input_layernorm.weight",
                "ffn_norm.weight" => "post_attention_layernorm.weight",
                "attn_q.weight" => "self_attn.q_proj.weight",
                "attn_k.weight" => "self_attn.k_proj.weight",
                "attn_v.weight" => "self_attn.v_proj.weight",
                "attn_q.bias" => "self_attn.q_proj.bias",
                "attn_k.bias" => "self_attn.k_proj.bias",
                "attn_v.bias" => "self_attn.v_proj.bias",
                "attn_output.weight" => "self_attn.o_proj.weight",
                "attn_output.bias" => "self_attn.o_proj.bias",
                "ffn_gate.weight" => "mlp.gate_proj.weight",
                "ffn_up.weight" => "mlp.up_proj.weight",
                "ffn_down.weight" => "mlp.down_proj.weight",
                other => other,
            };
            return format!("model.layers.{l}.{t}");
        }
        match name {
            "token_embd.weight" => "model.embed_tokens.weight".into(),
            "output_norm.weight" => "model.norm.weight".into(),
            "output.weight" => "lm_head.weight".into(),
            other => other.into(),
        }
    }

    fn view(&self, name: &str) -> Result<(String, safetensors::tensor::TensorView<'_>)> {
        let hf = HfSource::hf_name(name);
        let v = self
            .st
            .tensor(&hf)
            .map_err(|_| Error::invalid(format!("{}: tensor {hf} is missing", self.path)))?;
        Ok((hf, v))
    }

    fn wtype(&self, hf: &str, v: &safetensors::tensor::TensorView<'_>) -> Result<WeightType> {
        use safetensors::Dtype;
        match v.dtype() {
            Dtype::F32 => Ok(WeightType::F32),
            Dtype::F16 => Ok(WeightType::F16),
            Dtype::BF16 => Ok(WeightType::BF16),
            other => Err(Error::unsupported(format!(
                "{}: tensor {hf} has dtype {other:?}; F32, F16 and BF16 are read",
                self.path
            ))),
        }
    }
}

impl Source for HfSource<'_> {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let (hf, v) = self.view(name)?;
        if v.shape() != [rows, cols] {
            return Err(Error::invalid(format!(
                "{}: tensor {hf} has shape {:?}, the config implies [{rows}, {cols}]",
                self.path,
                v.shape()
            )));
        }
        let t = self.wtype(&hf, &v)?;
        let start = v.data().as_ptr() as usize - self.map.as_ptr() as usize;
        let bytes = Bytes::Mapped {
            map: Arc::clone(self.map),
            start,
            len: v.data().len(),
        };
        Matrix::new(&hf, t, rows, cols, bytes).map_err(|e| e.context(self.path))
    }

    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>> {
        let (hf, v) = self.view(name)?;
        if v.shape().iter().product::<usize>() != n || v.shape().len() != 1 {
            return Err(Error::invalid(format!(
                "{}: tensor {hf} has shape {:?}, [{n}] expected",
                self.path,
                v.shape()
            )));
        }
        let t = self.wtype(&hf, &v)?;
        let mut out = vec![0.0; n];
        super::quant::dequantize_row(t, v.data(), &mut out);
        Ok(out)
    }

    fn has(&self, name: &str) -> bool {
        self.st.tensor(&HfSource::hf_name(name)).is_ok()
    }

    fn shown(&self, name: &str) -> String {
        HfSource::hf_name(name)
    }
}
