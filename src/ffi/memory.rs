//! GPU memory in the C API (section 10): where a request's outputs go, where a
//! response's outputs are, and what a custom backend sees of device memory.
//!
//! Instances on GPUs (KIND_GPU) have their batches and, when asked, their outputs in
//! device memory. Every other model computes in host memory; a request that asks for GPU
//! outputs gets those host outputs copied to its GPU before each callback (BYTES outputs
//! stay on the host): `infer_response_output_memory` says where each output is.

use super::*;
use crate::backend::Batch;
use crate::request::{Request, Response};
use std::ffi::c_void;

/// Chooses where this request's outputs should live (default INFER_MEMORY_CPU, device 0).
/// INFER_MEMORY_CPU_PINNED is accepted and served as ordinary host memory (reported as
/// INFER_MEMORY_CPU). INFER_MEMORY_GPU is UNAVAILABLE without a usable GPU (the message
/// says why) and INVALID_ARGUMENT for a device id that does not exist. With
/// INFER_MEMORY_GPU, outputs a backend on a GPU instance produced in device memory stay
/// there (on the instance's device, which `infer_response_output_memory` reports), and
/// every other output but BYTES (whatever computed it: CPU instances, ensembles, each
/// response of a generative model) is copied to GPU `device_id` before the callback runs;
/// BYTES outputs stay in host memory. Device outputs are complete before the callback
/// runs and valid until `infer_response_free`. A response whose outputs cannot be copied
/// (no device memory: RESOURCE_EXHAUSTED; a driver error: INTERNAL) comes as an error
/// response naming the model, the outputs and the device.
#[no_mangle]
pub unsafe extern "C" fn infer_request_set_output_memory(
    r: *mut Request,
    mem: infer_memory_type,
    device_id: i64,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `r`: NULL (refused) or a live handle no other thread uses meanwhile.
        let r = unsafe { arg_mut(r, "r") }?;
        match mem {
            INFER_MEMORY_CPU | INFER_MEMORY_CPU_PINNED => {
                r.output_device = None;
                Ok(())
            }
            INFER_MEMORY_GPU => {
                let at = format!("outputs of model '{}' on GPU {device_id}", r.model);
                r.gpu.check_device(device_id).map_err(|e| e.context(&at))?;
                r.output_device = Some(device_id as i32);
                Ok(())
            }
            m => Err(unknown_memory_type(m)),
        }
    })
}

/// Where output `index` (0-based) of a response lives: INFER_MEMORY_CPU and device 0;
/// INFER_MEMORY_CPU_PINNED and device 0 for page-locked host memory (an output a GPU
/// instance copied down, read where it landed, which that GPU copies from directly: lent
/// as an input with INFER_MEMORY_CPU_PINNED, say); or INFER_MEMORY_GPU and the device id
/// (then `infer_response_output`'s data pointer is a device address).
/// INVALID_ARGUMENT for an index out of range or a NULL out-pointer.
#[no_mangle]
pub unsafe extern "C" fn infer_response_output_memory(
    r: *const Response,
    index: usize,
    mem: *mut infer_memory_type,
    device_id: *mut i64,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `r`: NULL (refused) or a live handle of this library.
        let r = unsafe { arg_ref(r, "r") }?;
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
        match r.outputs[index].data.device() {
            Some(d) => {
                // SAFETY: `mem`: NULL (refused) or writable for one value.
                unsafe { write_out(mem, "mem", INFER_MEMORY_GPU) }?;
                // SAFETY: `device_id`: NULL (refused) or writable for one value.
                unsafe { write_out(device_id, "device_id", d.device as i64) }
            }
            None => {
                let host = match r.outputs[index].data.in_page_locked_memory() {
                    true => INFER_MEMORY_CPU_PINNED,
                    false => INFER_MEMORY_CPU,
                };
                // SAFETY: `mem`: NULL (refused) or writable for one value.
                unsafe { write_out(mem, "mem", host) }?;
                // SAFETY: `device_id`: NULL (refused) or writable for one value.
                unsafe { write_out(device_id, "device_id", 0) }
            }
        }
    })
}

/// For a custom backend inside `execute`: where batched input `name` is. On a GPU
/// instance INFER_MEMORY_GPU and the instance's device (every input is in device memory
/// there); on a CPU instance INFER_MEMORY_CPU and device 0. NOT_FOUND if no request of
/// the batch has the input.
#[no_mangle]
pub unsafe extern "C" fn infer_batch_input_memory(
    b: *const Batch,
    name: *const c_char,
    mem: *mut infer_memory_type,
    device_id: *mut i64,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `b`: NULL (refused) or a live handle of this library.
        let b = unsafe { arg_ref(b, "b") }?;
        // SAFETY: `name`: NULL (refused) or a NUL-terminated string alive for the call.
        let n = unsafe { arg_str(name, "name") }?;
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
        match &b.gpu {
            Some(g) => {
                // SAFETY: `mem`: NULL (refused) or writable for one value.
                unsafe { write_out(mem, "mem", INFER_MEMORY_GPU) }?;
                // SAFETY: `device_id`: NULL (refused) or writable for one value.
                unsafe { write_out(device_id, "device_id", g.device as i64) }
            }
            None => {
                // SAFETY: `mem`: NULL (refused) or writable for one value.
                unsafe { write_out(mem, "mem", INFER_MEMORY_CPU) }?;
                // SAFETY: `device_id`: NULL (refused) or writable for one value.
                unsafe { write_out(device_id, "device_id", 0) }
            }
        }
    })
}

/// For a custom backend on a GPU instance: allocates batched output `name` in device
/// memory (uninitialised, from the instance's pool) and writes its device address to
/// `*device_ptr`; the backend fills it with work on the instance's stream
/// (`infer_batch_cuda_stream`), and the library waits for that stream before it reads
/// the output or hands it to the caller. Same checks as `infer_batch_output`; BYTES
/// outputs are host memory only. On a CPU instance INVALID_ARGUMENT: allocate outputs
/// with `infer_batch_output`.
#[no_mangle]
pub unsafe extern "C" fn infer_batch_output_device(
    b: *mut Batch,
    name: *const c_char,
    shape: *const i64,
    ndim: usize,
    device_ptr: *mut *mut c_void,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `b`: NULL (refused) or a live handle no other thread uses meanwhile.
        let b = unsafe { arg_mut(b, "b") }?;
        // SAFETY: `name`: NULL (refused) or a NUL-terminated string alive for the call.
        let n = unsafe { arg_str(name, "name") }?;
        // SAFETY: `shape`: NULL with a count of 0, or that many readable elements.
        let shape = unsafe { arg_shape(shape, ndim, "shape") }?;
        if device_ptr.is_null() {
            return Err(Error::invalid("argument 'device_ptr' must not be NULL"));
        }
        let ptr = b.alloc_output_device(n, shape)?;
        // SAFETY: `device_ptr`: NULL (refused) or writable for one value.
        unsafe { write_out(device_ptr, "device_ptr", ptr as *mut c_void) }
    })
}

/// For a custom backend on a GPU instance: the instance's CUDA stream (a CUstream) to
/// enqueue work on; the instance's device context is current on the calling thread. The
/// batch's inputs are ready in stream order (copies queued on this stream), so work
/// enqueued on it needs no further synchronization. NULL on a CPU instance and for NULL.
#[no_mangle]
pub unsafe extern "C" fn infer_batch_cuda_stream(b: *const Batch) -> *mut c_void {
    value_boundary(std::ptr::null_mut(), || {
        // SAFETY: `b`: NULL or a live object of this library (the C API's contract).
        unsafe { b.as_ref() }
            .and_then(|b| b.gpu.as_ref())
            .map_or(std::ptr::null_mut(), |g| g.stream)
    })
}
