//! Decoder-only language models on the CPU (GPT-2, and the Llama family from Hugging
//! Face folders or GGUF files, with quantized weights), with a paged KV cache.
//!
//! What this module owns: loading a Hugging Face GPT-2 folder ([`Gpt2::load`]), the
//! forward pass over a packed batch of sequences ([`Runner::step`]), the KV cache's memory
//! ([`KvCache`]) and token sampling ([`sample`]). What it never does: decide which
//! sequences run, own block tables or hand out blocks — that is the scheduler's job; a
//! step only reads and writes the blocks it is given.
//!
//! Batching invariance: a token's hidden states, K/V and logits are bitwise the same
//! whether it runs alone, with other sequences, or inside a prefill chunk of any size, on
//! any number of threads. The scheduler may therefore batch freely without changing any
//! request's output.

mod attention;
mod config;
mod gguf;
mod gpt2;
mod kernels;
mod kv;
mod linear;
mod llama;
mod llama_runner;
mod pool;
mod quant;
mod sampling;
mod step;
mod text;
mod weights;

pub use config::{Activation, Gpt2Config};
pub use gpt2::Runner;
pub use kv::{KvCache, KvShape, KvType};
pub use llama::{Llama, LlamaConfig, RopeStyle};
pub use llama_runner::LlamaRunner;
pub use quant::WeightType;

/// Which kernels quantized products run on this CPU, in words, and a warning when
/// `INFER_CPU_MAX_ISA` names no instruction set.
pub fn cpu_kernels() -> (&'static str, Option<String>) {
    (
        quant::panel::Isa::describe(),
        quant::panel::Isa::setting_problem(),
    )
}
pub use sampling::{argmax, penalize, sample, Penalties, Rng, SamplingParams};
pub use step::{Logits, StepSeq};
pub use text::{hf_eos_ids, Detokenizer, StopStrings, TextCodec, TextSource};
pub use weights::Gpt2;
