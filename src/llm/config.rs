//! The shape and hyper-parameters of a GPT-2 model, read from (and written as) a Hugging
//! Face `config.json`.
//!
//! This module decides which configurations the forward pass supports; it never touches
//! weights.

use crate::status::{Error, Result};
use serde_json::{Map, Value};

/// The MLP's non-linearity (Hugging Face's `activation_function`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `gelu_new` / `gelu_pytorch_tanh`: the tanh approximation of GELU (GPT-2's own).
    GeluTanh,
    /// `gelu`: the exact GELU, `0.5 x (1 + erf(x / sqrt 2))`.
    GeluErf,
    /// `relu`.
    Relu,
}

impl Activation {
    /// Hugging Face's name for it.
    pub fn hf_name(self) -> &'static str {
        match self {
            Activation::GeluTanh => "gelu_new",
            Activation::GeluErf => "gelu",
            Activation::Relu => "relu",
        }
    }

    fn from_hf_name(name: &str) -> Option<Activation> {
        match name {
            "gelu_new" | "gelu_pytorch_tanh" => Some(Activation::GeluTanh),
            "gelu" => Some(Activation::GeluErf),
            "relu" => Some(Activation::Relu),
            _ => None,
        }
    }
}

/// A GPT-2 configuration. `Default` is GPT-2 small (124M); when changing `n_embd` from
/// it, set `n_inner` (4 × `n_embd` in GPT-2) too.
#[derive(Clone, Debug, PartialEq)]
pub struct Gpt2Config {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    /// Width of the MLP's hidden layer.
    pub n_inner: usize,
    pub vocab_size: usize,
    /// Longest sequence (the size of the position embedding).
    pub n_positions: usize,
    pub layer_norm_epsilon: f32,
    pub activation: Activation,
    /// Divide attention scores by sqrt(head_dim) (`scale_attn_weights`).
    pub scale_attn_weights: bool,
    /// Also divide layer `i`'s attention scores by `i + 1`.
    pub scale_attn_by_inverse_layer_idx: bool,
    /// The LM head is the token embedding (`tie_word_embeddings`); otherwise the model
    /// has its own `lm_head.weight`.
    pub tie_word_embeddings: bool,
}

impl Default for Gpt2Config {
    fn default() -> Gpt2Config {
        Gpt2Config {
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            n_inner: 3072,
            vocab_size: 50257,
            n_positions: 1024,
            layer_norm_epsilon: 1e-5,
            activation: Activation::GeluTanh,
            scale_attn_weights: true,
            scale_attn_by_inverse_layer_idx: false,
            tie_word_embeddings: true,
        }
    }
}

impl Gpt2Config {
    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head.max(1)
    }

    /// Checks what the forward pass relies on: INVALID_ARGUMENT naming the field.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_embd", self.n_embd),
            ("n_inner", self.n_inner),
            ("vocab_size", self.vocab_size),
            ("n_positions", self.n_positions),
        ] {
            if v == 0 {
                return Err(Error::invalid(format!("GPT-2 config: {name} is 0")));
            }
            // Token ids, positions and block ids travel as u32.
            if v > u32::MAX as usize / 4 {
                return Err(Error::invalid(format!(
                    "GPT-2 config: {name} {v} is too large"
                )));
            }
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return Err(Error::invalid(format!(
                "GPT-2 config: n_embd {} is not a multiple of n_head {}",
                self.n_embd, self.n_head
            )));
        }
        if !(self.layer_norm_epsilon >= 0.0 && self.layer_norm_epsilon.is_finite()) {
            return Err(Error::invalid(format!(
                "GPT-2 config: layer_norm_epsilon {} is not a finite non-negative number",
                self.layer_norm_epsilon
            )));
        }
        Ok(())
    }

    /// Parses a Hugging Face GPT-2 `config.json`. Unknown fields are ignored.
    pub fn from_json(text: &str) -> Result<Gpt2Config> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| Error::invalid(format!("GPT-2 config: not valid JSON: {e}")))?;
        let Some(o) = v.as_object() else {
            return Err(Error::invalid("GPT-2 config: not a JSON object"));
        };
        if let Some(t) = o.get("model_type") {
            if t.as_str() != Some("gpt2") {
                return Err(Error::unsupported(format!(
                    "GPT-2 config: model_type {t} is not \"gpt2\""
                )));
            }
        }
        let n_embd = positive(o, "n_embd")?;
        let n_positions = match o.get("n_positions") {
            Some(_) => positive(o, "n_positions")?,
            // Older configs call it n_ctx.
            None if o.contains_key("n_ctx") => positive(o, "n_ctx")?,
            None => positive(o, "n_positions")?,
        };
        let n_inner = match o.get("n_inner") {
            None | Some(Value::Null) => n_embd.saturating_mul(4),
            Some(_) => positive(o, "n_inner")?,
        };
        let activation = match o.get("activation_function") {
            None | Some(Value::Null) => Activation::GeluTanh,
            Some(Value::String(s)) => Activation::from_hf_name(s).ok_or_else(|| {
                Error::unsupported(format!(
                    "GPT-2 config: activation_function \"{s}\" is not supported \
                     (gelu_new, gelu_pytorch_tanh, gelu, relu are)"
                ))
            })?,
            Some(other) => {
                return Err(Error::invalid(format!(
                    "GPT-2 config: activation_function {other} is not a string"
                )))
            }
        };
        let layer_norm_epsilon = match o.get("layer_norm_epsilon") {
            None | Some(Value::Null) => 1e-5,
            Some(x) => x.as_f64().ok_or_else(|| {
                Error::invalid(format!(
                    "GPT-2 config: layer_norm_epsilon {x} is not a number"
                ))
            })? as f32,
        };
        // reorder_and_upcast_attn only changes how fp16 training computes attention; in
        // f32 it is the same function, so it is accepted and ignored.
        let c = Gpt2Config {
            n_layer: positive(o, "n_layer")?,
            n_head: positive(o, "n_head")?,
            n_embd,
            n_inner,
            vocab_size: positive(o, "vocab_size")?,
            n_positions,
            layer_norm_epsilon,
            activation,
            scale_attn_weights: flag(o, "scale_attn_weights", true)?,
            scale_attn_by_inverse_layer_idx: flag(o, "scale_attn_by_inverse_layer_idx", false)?,
            tie_word_embeddings: flag(o, "tie_word_embeddings", true)?,
        };
        c.validate()?;
        Ok(c)
    }

    /// The Hugging Face `config.json` for this configuration.
    pub fn to_json(&self) -> String {
        let v = serde_json::json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_embd": self.n_embd,
            "n_inner": self.n_inner,
            "vocab_size": self.vocab_size,
            "n_positions": self.n_positions,
            "n_ctx": self.n_positions,
            "layer_norm_epsilon": self.layer_norm_epsilon as f64,
            "activation_function": self.activation.hf_name(),
            "scale_attn_weights": self.scale_attn_weights,
            "scale_attn_by_inverse_layer_idx": self.scale_attn_by_inverse_layer_idx,
            "reorder_and_upcast_attn": false,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "float32",
        });
        let mut s = serde_json::to_string_pretty(&v).unwrap_or_default();
        s.push('\n');
        s
    }
}

fn positive(o: &Map<String, Value>, name: &str) -> Result<usize> {
    match o.get(name) {
        None | Some(Value::Null) => Err(Error::invalid(format!("GPT-2 config: {name} is missing"))),
        Some(v) => match v.as_u64() {
            Some(0) => Err(Error::invalid(format!("GPT-2 config: {name} is 0"))),
            Some(n) => usize::try_from(n)
                .map_err(|_| Error::invalid(format!("GPT-2 config: {name} {n} is too large"))),
            None => Err(Error::invalid(format!(
                "GPT-2 config: {name} {v} is not a positive integer"
            ))),
        },
    }
}

fn flag(o: &Map<String, Value>, name: &str, default: bool) -> Result<bool> {
    match o.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(Error::invalid(format!(
            "GPT-2 config: {name} {v} is not a boolean"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Code;

    const MINIMAL: &str =
        r#"{"n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 256, "n_positions": 128}"#;

    #[test]
    fn defaults_follow_hugging_face() {
        let c = Gpt2Config::from_json(MINIMAL).unwrap();
        assert_eq!(c.n_inner, 256);
        assert_eq!(c.layer_norm_epsilon, 1e-5);
        assert_eq!(c.activation, Activation::GeluTanh);
        assert!(c.scale_attn_weights && !c.scale_attn_by_inverse_layer_idx);
        assert!(c.tie_word_embeddings);
        assert_eq!(c.head_dim(), 16);
    }

    #[test]
    fn json_round_trip() {
        let c = Gpt2Config {
            activation: Activation::GeluErf,
            scale_attn_by_inverse_layer_idx: true,
            tie_word_embeddings: false,
            ..Gpt2Config::default()
        };
        assert_eq!(Gpt2Config::from_json(&c.to_json()).unwrap(), c);
    }

    #[test]
    fn bad_configs_are_refused() {
        let cases: &[(&str, Code, &str)] = &[
            ("not json", Code::InvalidArgument, "JSON"),
            ("[1]", Code::InvalidArgument, "object"),
            (
                r#"{"n_head": 4, "n_embd": 64, "vocab_size": 256, "n_positions": 128}"#,
                Code::InvalidArgument,
                "n_layer is missing",
            ),
            (
                r#"{"n_layer": 0, "n_head": 4, "n_embd": 64, "vocab_size": 256, "n_positions": 128}"#,
                Code::InvalidArgument,
                "n_layer is 0",
            ),
            (
                r#"{"n_layer": 2, "n_head": 5, "n_embd": 64, "vocab_size": 256, "n_positions": 128}"#,
                Code::InvalidArgument,
                "multiple of n_head",
            ),
            (
                r#"{"n_layer": 2.5, "n_head": 4, "n_embd": 64, "vocab_size": 256, "n_positions": 128}"#,
                Code::InvalidArgument,
                "positive integer",
            ),
            (
                r#"{"model_type": "llama", "n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 256, "n_positions": 128}"#,
                Code::Unsupported,
                "model_type",
            ),
            (
                r#"{"activation_function": "swish", "n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 256, "n_positions": 128}"#,
                Code::Unsupported,
                "swish",
            ),
            (
                r#"{"layer_norm_epsilon": -1, "n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 256, "n_positions": 128}"#,
                Code::InvalidArgument,
                "layer_norm_epsilon",
            ),
        ];
        for (text, code, needle) in cases {
            let e = Gpt2Config::from_json(text).unwrap_err();
            assert_eq!(e.code, *code, "{text}: {e}");
            assert!(e.message.contains(needle), "{text}: {e}");
        }
    }
}
