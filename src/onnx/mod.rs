//! ONNX models, selected with Triton's names `platform: "onnxruntime_onnx"` or
//! `backend: "onnxruntime"` (or `backend: "tract"`): read from their file and computed by
//! one of the engines:
//! - `onnxruntime`: ONNX Runtime, loaded at run time, on the CPU and (with its CUDA
//!   provider) on GPU instances; the engine for Triton's names whenever it loads;
//! - `cpu`: tract, the pure-Rust engine: `backend: "tract"`, and the fallback when ONNX
//!   Runtime cannot be loaded;
//! - `gpu`: libinfer's own CUDA executor, for GPU instances when ONNX Runtime has no CUDA
//!   provider.
//!
//! `graph` is the file reader the GPU executor uses.

pub mod cpu;
pub mod gpu;
pub mod graph;
pub mod onnxruntime;

pub use cpu::{autocomplete, is_onnx, Engine, OnnxBackend, TRACT};
