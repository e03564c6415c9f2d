//! ONNX models, selected with Triton's names `platform: "onnxruntime_onnx"` or
//! `backend: "onnxruntime"`: read from their file and computed by one of the executors,
//! `cpu` (tract) on CPU instances and `gpu` (libinfer's own CUDA executor) on GPU ones.
//! `graph` is the file reader they share.

pub mod cpu;
pub mod gpu;
pub mod graph;

pub use cpu::{autocomplete, is_onnx, OnnxBackend};
