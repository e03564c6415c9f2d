//! GPU memory in the C API (section 10): where a request's outputs go, where a
//! response's outputs are, and what a custom backend sees of device memory.
//!
//! No model runs on a GPU yet, so every tensor the library hands out is in host memory;
//! asking for device memory fails with the reason (no usable GPU, or not implemented yet)
//! rather than silently giving host memory.

use super::*;
use crate::backend::Batch;
use crate::request::{Request, Response};
use std::ffi::c_void;

/// Chooses where this request's outputs should live (default INFER_MEMORY_CPU, device 0).
/// INFER_MEMORY_CPU_PINNED is accepted and served as ordinary host memory (reported as
/// INFER_MEMORY_CPU). INFER_MEMORY_GPU is UNAVAILABLE without a usable GPU (the message
/// says why), INVALID_ARGUMENT for a device id that does not exist, and UNSUPPORTED
/// otherwise: outputs in GPU memory are not implemented yet. May be called from any
/// thread that owns the request.
#[no_mangle]
pub unsafe extern "C" fn infer_request_set_output_memory(
    r: *mut Request,
    mem: infer_memory_type,
    device_id: i64,
) -> infer_status {
    status_boundary(|| {
        let r = arg_mut(r, "r")?;
        match mem {
            INFER_MEMORY_CPU | INFER_MEMORY_CPU_PINNED => Ok(()),
            INFER_MEMORY_GPU => {
                let at = format!("outputs of model '{}' on GPU {device_id}", r.model);
                r.gpu.check_device(device_id).map_err(|e| e.context(&at))?;
                Err(Error::unsupported(format!(
                    "{at}: outputs in GPU memory are not implemented yet"
                )))
            }
            m => Err(unknown_memory_type(m)),
        }
    })
}

/// Where output `index` (0-based) of a response lives: its memory type and device id.
/// Always INFER_MEMORY_CPU and device 0 today (no model runs on a GPU yet).
/// INVALID_ARGUMENT for an index out of range or a NULL out-pointer.
#[no_mangle]
pub unsafe extern "C" fn infer_response_output_memory(
    r: *const Response,
    index: usize,
    mem: *mut infer_memory_type,
    device_id: *mut i64,
) -> infer_status {
    status_boundary(|| {
        let r = arg_ref(r, "r")?;
        if index >= r.outputs.len() {
            return Err(Error::invalid(format!(
                "output index {index} is out of range: the response has {} outputs",
                r.outputs.len()
            )));
        }
        if mem.is_null() || device_id.is_null() {
            return Err(Error::invalid(
                "arguments 'mem' and 'device_id' must not be NULL",
            ));
        }
        write_out(mem, "mem", INFER_MEMORY_CPU)?;
        write_out(device_id, "device_id", 0)
    })
}

/// For a custom backend inside `execute`: where batched input `name` is. On a CPU
/// instance (every instance today) INFER_MEMORY_CPU and device 0. NOT_FOUND if no request
/// of the batch has the input.
#[no_mangle]
pub unsafe extern "C" fn infer_batch_input_memory(
    b: *const Batch,
    name: *const c_char,
    mem: *mut infer_memory_type,
    device_id: *mut i64,
) -> infer_status {
    status_boundary(|| {
        let b = arg_ref(b, "b")?;
        let n = arg_str(name, "name")?;
        if !b.inputs.iter().any(|i| &*i.name == n) {
            return Err(Error::not_found(format!(
                "model '{}': the batch has no input '{n}'",
                b.config.name
            )));
        }
        if mem.is_null() || device_id.is_null() {
            return Err(Error::invalid(
                "arguments 'mem' and 'device_id' must not be NULL",
            ));
        }
        write_out(mem, "mem", INFER_MEMORY_CPU)?;
        write_out(device_id, "device_id", 0)
    })
}

/// For a custom backend on a GPU instance: allocates batched output `name` in device
/// memory and writes its device pointer to `*device_ptr`. On a CPU instance (every
/// instance today) INVALID_ARGUMENT: allocate outputs with `infer_batch_output`.
#[no_mangle]
pub unsafe extern "C" fn infer_batch_output_device(
    b: *mut Batch,
    name: *const c_char,
    shape: *const i64,
    ndim: usize,
    device_ptr: *mut *mut c_void,
) -> infer_status {
    status_boundary(|| {
        let b = arg_mut(b, "b")?;
        let n = arg_str(name, "name")?;
        arg_slice(shape, ndim, "shape")?;
        if device_ptr.is_null() {
            return Err(Error::invalid("argument 'device_ptr' must not be NULL"));
        }
        Err(Error::invalid(format!(
            "model '{}': output '{n}': this instance runs on the CPU, where outputs are in host memory (allocate outputs with infer_batch_output)",
            b.config.name
        )))
    })
}

/// For a custom backend on a GPU instance: the instance's CUDA stream (a CUstream) to
/// enqueue work on. NULL on a CPU instance (every instance today) and for NULL.
#[no_mangle]
pub unsafe extern "C" fn infer_batch_cuda_stream(b: *const Batch) -> *mut c_void {
    // No instance runs on a GPU yet, so no batch has a stream.
    let _ = b;
    std::ptr::null_mut()
}
