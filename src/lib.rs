//! libinfer: an inference server that lives inside the caller's process.
//!
//! The C API (`include/infer.h`, generated from [`ffi`]) is the product; the Rust modules
//! behind it are public so tests and benchmarks can reach them, but they are not a stable
//! Rust API.

// Requests travel boxed (they are created boxed at the C boundary and move between
// queues and batches without being copied), so `Vec<Box<Request>>` is deliberate, and a
// rejected request is handed back by value inside the error.
// Every raw operation inside an `unsafe fn` sits in its own `unsafe` block with its SAFETY
// line.
#![deny(unsafe_op_in_unsafe_fn)]
#![allow(clippy::vec_box, clippy::result_large_err)]

pub(crate) mod affinity;
pub mod backend;
pub mod callback;
pub mod config;
pub mod cuda;
pub mod ffi;
pub mod folder;
pub mod llm;
pub mod log;
pub mod onnx;
pub mod request;
pub mod scheduler;
pub mod server;
pub mod stats;
pub mod status;
pub mod tensor;

/// The library version (Cargo package version).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
