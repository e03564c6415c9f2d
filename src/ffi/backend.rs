//! What a custom backend may call from inside `execute`.

use super::*;
use crate::backend::{Batch, BatchInput};
use crate::status::Code;
use std::ffi::c_void;

pub use super::custom::infer_backend;

/// Rows in this execution: the sum of the requests' batch sizes (the number of requests
/// for models that do not batch). 0 for NULL.
#[no_mangle]
pub unsafe extern "C" fn infer_batch_size(b: *const Batch) -> u32 {
    // SAFETY: `b`: NULL or a live object of this library (the C API's contract).
    value_boundary(0, || unsafe { b.as_ref() }.map_or(0, |b| b.size))
}

/// Number of requests in this execution (0 for NULL).
#[no_mangle]
pub unsafe extern "C" fn infer_batch_request_count(b: *const Batch) -> u32 {
    // SAFETY: `b`: NULL or a live object of this library (the C API's contract).
    value_boundary(0, || {
        unsafe { b.as_ref() }.map_or(0, |b| b.requests.len() as u32)
    })
}

/// Number of batched inputs present (optional inputs no request gave are absent).
#[no_mangle]
pub unsafe extern "C" fn infer_batch_input_count(b: *const Batch) -> u32 {
    // SAFETY: `b`: NULL or a live object of this library (the C API's contract).
    value_boundary(0, || {
        unsafe { b.as_ref() }.map_or(0, |b| b.inputs.len() as u32)
    })
}

fn write_input(out: &TensorOut, b: &Batch, i: &BatchInput) {
    if let Some(g) = &b.gpu {
        // On a GPU instance every input is in device memory.
        let index = b
            .inputs
            .iter()
            .position(|x| std::ptr::eq(x, i))
            .unwrap_or(0);
        let ptr = g.inputs.get(index).copied().unwrap_or(0);
        let len = b.input_len(i);
        // SAFETY: as below.
        unsafe { out.write_raw(&i.c_name, i.dtype, &i.shape, ptr as *const c_void, len) };
        return;
    }
    // SAFETY: the caller passes pointers that are NULL or writable (C API contract).
    unsafe { out.write(&i.c_name, i.dtype, &i.shape, b.input_data(i)) }
}

/// Reads a batched input: the rows of all requests concatenated along dim 0 (dim 0 = the
/// batch size when the model batches; inputs with allow_ragged_batch are flattened to one
/// dimension). Out-pointers may be NULL when not wanted; the pointers written are valid
/// until `execute` returns. NOT_FOUND if no request of the batch has the input.
#[no_mangle]
pub unsafe extern "C" fn infer_batch_input(
    b: *const Batch,
    name: *const c_char,
    dt: *mut infer_datatype,
    shape: *mut *const i64,
    ndim: *mut usize,
    data: *mut *const c_void,
    byte_size: *mut usize,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `b`: NULL (refused) or a live handle of this library.
        let b = unsafe { arg_ref(b, "b") }?;
        // SAFETY: `name`: NULL (refused) or a NUL-terminated string alive for the call.
        let n = unsafe { arg_str(name, "name") }?;
        let i = b.inputs.iter().find(|i| &*i.name == n).ok_or_else(|| {
            Error::not_found(format!(
                "model '{}': the batch has no input '{n}'",
                b.config.name
            ))
        })?;
        let name = std::ptr::null_mut();
        write_input(
            &TensorOut {
                name,
                dt,
                shape,
                ndim,
                data,
                byte_size,
            },
            b,
            i,
        );
        Ok(())
    })
}

/// Reads batched input `index` (0-based, < `infer_batch_input_count`), with its name.
#[no_mangle]
pub unsafe extern "C" fn infer_batch_input_by_index(
    b: *const Batch,
    index: u32,
    name: *mut *const c_char,
    dt: *mut infer_datatype,
    shape: *mut *const i64,
    ndim: *mut usize,
    data: *mut *const c_void,
    byte_size: *mut usize,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `b`: NULL (refused) or a live handle of this library.
        let b = unsafe { arg_ref(b, "b") }?;
        let i = b.inputs.get(index as usize).ok_or_else(|| {
            Error::invalid(format!(
                "input index {index} is out of range: the batch has {} inputs",
                b.inputs.len()
            ))
        })?;
        write_input(
            &TensorOut {
                name,
                dt,
                shape,
                ndim,
                data,
                byte_size,
            },
            b,
            i,
        );
        Ok(())
    })
}

/// # Safety
/// `b` is NULL or a live batch of the running execute call; `name`, `shape` (of `ndim`)
/// and `data_out` are NULL or valid as the C API states.
unsafe fn batch_output(
    b: *mut Batch,
    name: *const c_char,
    shape: *const i64,
    ndim: usize,
    byte_size: Option<usize>,
    data_out: *mut *mut c_void,
) -> Result<()> {
    // SAFETY: `b`: NULL (refused) or a live handle no other thread uses meanwhile.
    let b = unsafe { arg_mut(b, "b") }?;
    // SAFETY: `name`: NULL (refused) or a NUL-terminated string alive for the call.
    let n = unsafe { arg_str(name, "name") }?;
    // SAFETY: `shape`: NULL with a count of 0, or that many readable elements.
    let shape = unsafe { arg_shape(shape, ndim, "shape") }?;
    if data_out.is_null() {
        return Err(Error::invalid("argument 'data_out' must not be NULL"));
    }
    let buf = b.alloc_output(n, shape, byte_size)?;
    // SAFETY: `data_out`: NULL (refused) or writable for one value.
    unsafe { write_out(data_out, "data_out", buf.as_mut_ptr() as *mut c_void) }
}

/// Allocates batched output `name` (datatype from the config; dim 0 must be the batch
/// size when the model batches) and writes its zeroed buffer to `*data_out` for the
/// backend to fill. The library splits it into per-request responses. For BYTES outputs
/// use `infer_batch_output_bytes`.
#[no_mangle]
pub unsafe extern "C" fn infer_batch_output(
    b: *mut Batch,
    name: *const c_char,
    shape: *const i64,
    ndim: usize,
    data_out: *mut *mut c_void,
) -> infer_status {
    // SAFETY: `b`, `name`, `shape` and `data_out` as the C API states (checked inside).
    status_boundary(|| unsafe { batch_output(b, name, shape, ndim, None, data_out) })
}

/// Like `infer_batch_output` with an explicit byte size, required for BYTES outputs
/// (length-prefixed elements, rows in batch order).
#[no_mangle]
pub unsafe extern "C" fn infer_batch_output_bytes(
    b: *mut Batch,
    name: *const c_char,
    shape: *const i64,
    ndim: usize,
    byte_size: usize,
    data_out: *mut *mut c_void,
) -> infer_status {
    // SAFETY: `b`, `name`, `shape` and `data_out` as the C API states (checked inside).
    status_boundary(|| unsafe { batch_output(b, name, shape, ndim, Some(byte_size), data_out) })
}

/// Fails the request that contains batch row `row` (0-based, < `infer_batch_size`) with
/// `code` and `msg` (copied; NULL = a generic message); the other requests of the batch
/// are answered normally.
#[no_mangle]
pub unsafe extern "C" fn infer_batch_set_request_error(
    b: *mut Batch,
    row: u32,
    code: infer_status,
    msg: *const c_char,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `b`: NULL (refused) or a live handle no other thread uses meanwhile.
        let b = unsafe { arg_mut(b, "b") }?;
        let code = match Code::from_u32(code) {
            Some(Code::Ok) | None => {
                return Err(Error::invalid(format!(
                    "status {code} is not an error status"
                )))
            }
            Some(c) => c,
        };
        // SAFETY: `msg`: NULL (refused) or a NUL-terminated string alive for the call.
        let msg = unsafe { opt_str(msg, "msg") }?
            .map(str::to_owned)
            .unwrap_or_else(|| format!("model '{}': the backend failed row {row}", b.config.name));
        b.set_row_error(row, Error::new(code, msg))
    })
}

/// Sets the message every request of the batch gets when `execute` returns an error
/// status (copied). Without it, a generic message naming the backend and status is used.
#[no_mangle]
pub unsafe extern "C" fn infer_batch_set_error_message(
    b: *mut Batch,
    msg: *const c_char,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `b`: NULL (refused) or a live handle no other thread uses meanwhile.
        let b = unsafe { arg_mut(b, "b") }?;
        // SAFETY: `msg`: NULL (refused) or a NUL-terminated string alive for the call.
        b.error_message = Some(unsafe { arg_str(msg, "msg") }?.to_owned());
        Ok(())
    })
}

/// Explains why `instance_init` is about to fail: call it from inside `instance_init`
/// (on the thread that runs it), then return the error status. The message (copied) goes
/// into the error the model load fails with.
#[no_mangle]
pub unsafe extern "C" fn infer_backend_set_init_error(msg: *const c_char) -> infer_status {
    status_boundary(|| {
        // SAFETY: `msg`: NULL (refused) or a NUL-terminated string alive for the call.
        super::custom::set_init_error(unsafe { arg_str(msg, "msg") }?.to_owned());
        Ok(())
    })
}
