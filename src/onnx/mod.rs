//! ONNX models, selected with Triton's names `platform: "onnxruntime_onnx"` or
//! `backend: "onnxruntime"` (or `backend: "tract"`): read from their file and computed by
//! one of the engines:
//! - `onnxruntime`: ONNX Runtime, loaded at run time, on the CPU and (with its CUDA
//!   provider) on GPU instances; the engine for Triton's names whenever it loads;
//! - `cpu`: tract, the pure-Rust engine: `backend: "tract"`, and the fallback when ONNX
//!   Runtime cannot be loaded;
//! - `gpu`: libinfer's own CUDA executor, for GPU instances when ONNX Runtime has no CUDA
//!   provider, or when the config picks it (`parameters.gpu_executor: "libinfer"`).
//!
//! `backend` picks the engine; `model` is what the engines share about a model and its
//! config (auto-complete, checks); `graph` is the file reader the GPU executor uses.

pub mod backend;
pub mod cpu;
pub mod gpu;
pub mod graph;
pub mod model;
pub mod onnxruntime;

pub use backend::{autocomplete, Engine, OnnxBackend};
pub use model::{is_onnx, TRACT};
