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

/// The name and shape of an output to allocate, with `data_out` checked not NULL.
///
/// # Safety
/// `name`, `shape` (of `ndim`) and `data_out` are NULL or valid as the C API states.
unsafe fn output_args<'a>(
    name: *const c_char,
    shape: *const i64,
    ndim: usize,
    data_out: *mut *mut c_void,
) -> Result<(&'a str, &'a [i64])> {
    // SAFETY: `name`: NULL (refused) or a NUL-terminated string alive for the call.
    let n = unsafe { arg_str(name, "name") }?;
    // SAFETY: `shape`: NULL with a count of 0, or that many readable elements.
    let shape = unsafe { arg_shape(shape, ndim, "shape") }?;
    if data_out.is_null() {
        return Err(Error::invalid("argument 'data_out' must not be NULL"));
    }
    Ok((n, shape))
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
    // SAFETY: as this function's contract.
    let (n, shape) = unsafe { output_args(name, shape, ndim, data_out) }?;
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

/// Where request `request_index` (0-based, < `infer_batch_request_count`) is in the
/// batch: its first row and its number of rows (its batch size; 1 for models that do
/// not batch). Out-pointers may be NULL when not wanted.
#[no_mangle]
pub unsafe extern "C" fn infer_batch_request_rows(
    b: *const Batch,
    request_index: u32,
    first_row: *mut u32,
    rows: *mut u32,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `b`: NULL (refused) or a live handle of this library.
        let b = unsafe { arg_ref(b, "b") }?;
        let (first, n) = b.request_rows(request_index)?;
        if !first_row.is_null() {
            // SAFETY: not NULL (checked); writable (the C API's contract).
            unsafe { first_row.write(first) };
        }
        if !rows.is_null() {
            // SAFETY: not NULL (checked); writable (the C API's contract).
            unsafe { rows.write(n) };
        }
        Ok(())
    })
}

/// Reads input `name` of request `request_index` alone, in the shape that request gave
/// (the rows of a ragged batch before they were concatenated, or a request's own shape
/// of an input with allow_ragged_batch). On a GPU instance the data may be a device
/// address (`infer_batch_input_memory` says where batched inputs are; a request's own
/// input is where the caller put it). Out-pointers may be NULL; what is written is valid
/// until `execute` returns. NOT_FOUND if that request has no such input.
#[no_mangle]
pub unsafe extern "C" fn infer_batch_request_input(
    b: *const Batch,
    request_index: u32,
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
        let t = b.request_input(request_index, n)?;
        let out = TensorOut {
            name: std::ptr::null_mut(),
            dt,
            shape,
            ndim,
            data,
            byte_size,
        };
        let (ptr, len) = match &t.data {
            crate::tensor::TensorData::Device(d) => (d.ptr as *const c_void, d.len),
            other => {
                let s = other.as_slice();
                (s.as_ptr() as *const c_void, s.len())
            }
        };
        // SAFETY: out-pointers NULL or writable (the C API's contract); the request's
        // tensor lives until execute returns.
        unsafe { out.write_raw(c"", t.dtype, &t.shape, ptr, len) };
        Ok(())
    })
}

/// A decoupled backend's handle on one request (`infer_response_sender`): what it sends
/// that request, from any thread, until its FINAL.
pub struct ResponseSender(std::sync::Arc<crate::backend::decoupled::Sender>);

/// For a decoupled model (`model_transaction_policy { decoupled: true }`), inside
/// `execute`: takes the response sender of request `request_index` (0-based,
/// < `infer_batch_request_count`). The library then does not answer that request from
/// the batch's outputs; the backend sends it 0..n responses and then the FINAL through
/// the sender, from any thread, during `execute` or after it returns. The request's
/// inputs are valid only until `execute` returns: copy what is needed later. If
/// `execute` fails (or fails the request's rows), the request gets that error and the
/// sender's later sends fail with UNAVAILABLE; the sender must still be ended with a
/// FINAL send to free it. INVALID_ARGUMENT for a model that is not decoupled, an index
/// out of range, or a sender already taken.
#[no_mangle]
pub unsafe extern "C" fn infer_batch_response_sender(
    b: *mut Batch,
    request_index: u32,
    out: *mut *mut ResponseSender,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `b`: NULL (refused) or a live handle no other thread uses meanwhile.
        let b = unsafe { arg_mut(b, "b") }?;
        if out.is_null() {
            return Err(Error::invalid("argument 'out' must not be NULL"));
        }
        let s = b.take_sender(request_index)?;
        let handle = Box::into_raw(Box::new(ResponseSender(s)));
        // SAFETY: `out`: not NULL (checked), writable for one value.
        unsafe { write_out(out, "out", handle) }
    })
}

/// Allocates output `name` of the sender's next response (datatype from the config;
/// the shape must fit the config's dims, after a batch dim of any size when the model
/// batches) and writes its zeroed buffer to `*data_out`, valid until the response is
/// sent. Outputs the request did not ask for are allocated and then left out of the
/// response. For BYTES outputs use `infer_response_sender_output_bytes`.
#[no_mangle]
pub unsafe extern "C" fn infer_response_sender_output(
    s: *mut ResponseSender,
    name: *const c_char,
    shape: *const i64,
    ndim: usize,
    data_out: *mut *mut c_void,
) -> infer_status {
    // SAFETY: the arguments as the C API states (checked inside).
    status_boundary(|| unsafe { sender_output(s, name, shape, ndim, None, data_out) })
}

/// Like `infer_response_sender_output` with an explicit byte size, required for BYTES
/// outputs (length-prefixed elements).
#[no_mangle]
pub unsafe extern "C" fn infer_response_sender_output_bytes(
    s: *mut ResponseSender,
    name: *const c_char,
    shape: *const i64,
    ndim: usize,
    byte_size: usize,
    data_out: *mut *mut c_void,
) -> infer_status {
    // SAFETY: the arguments as the C API states (checked inside).
    status_boundary(|| unsafe { sender_output(s, name, shape, ndim, Some(byte_size), data_out) })
}

/// # Safety
/// `s` is NULL or a live sender; the other pointers are NULL or valid as the C API states.
unsafe fn sender_output(
    s: *mut ResponseSender,
    name: *const c_char,
    shape: *const i64,
    ndim: usize,
    byte_size: Option<usize>,
    data_out: *mut *mut c_void,
) -> Result<()> {
    // SAFETY: `s`: NULL (refused) or a live sender.
    let s = unsafe { arg_ref(s, "s") }?;
    // SAFETY: as this function's contract.
    let (n, shape) = unsafe { output_args(name, shape, ndim, data_out) }?;
    let ptr = s.0.alloc_output(n, shape, byte_size)?;
    // SAFETY: `data_out`: not NULL (checked), writable for one value.
    unsafe { write_out(data_out, "data_out", ptr as *mut c_void) }
}

/// Sends the outputs allocated since the last send as one response. `flags` is 0 or
/// INFER_RESPONSE_FLAG_FINAL; the FINAL (with or without outputs) ends the request, and
/// frees the sender whatever the status: it must not be used again. A FINAL whose
/// outputs are invalid (a BYTES output that does not parse) ends the request with an
/// INTERNAL error response and returns the error. May be called from any thread, one at
/// a time per sender; the response callback runs on the calling thread (or, for what is
/// sent before `execute` returns, on the library's worker when it does).
#[no_mangle]
pub unsafe extern "C" fn infer_response_sender_send(
    s: *mut ResponseSender,
    flags: u32,
) -> infer_status {
    status_boundary(|| {
        if s.is_null() {
            return Err(Error::invalid("argument 's' must not be NULL"));
        }
        if flags & !INFER_RESPONSE_FLAG_FINAL != 0 {
            return Err(Error::invalid(format!(
                "flags {flags:#x}: only INFER_RESPONSE_FLAG_FINAL may be set"
            )));
        }
        let last = flags & INFER_RESPONSE_FLAG_FINAL != 0;
        let result = {
            // SAFETY: not NULL (checked); a live sender (the C API's contract).
            let sender = unsafe { &(*s).0 };
            let r = sender.send(last);
            if let (true, Err(e)) = (last, &r) {
                // The request still gets its FINAL.
                let _ = sender.send_error(Error::internal(e.message.clone()));
            }
            r
        };
        if last {
            // SAFETY: made by Box::into_raw in infer_batch_response_sender; the FINAL is
            // the handle's last use (the C API's contract).
            drop(unsafe { Box::from_raw(s) });
        }
        result
    })
}

/// Ends the request with an error response (FINAL) of `code` (an error status) and `msg`
/// (copied; NULL = a generic message), and frees the sender whatever the status.
#[no_mangle]
pub unsafe extern "C" fn infer_response_sender_send_error(
    s: *mut ResponseSender,
    code: infer_status,
    msg: *const c_char,
) -> infer_status {
    status_boundary(|| {
        if s.is_null() {
            return Err(Error::invalid("argument 's' must not be NULL"));
        }
        let result = (|| {
            // SAFETY: not NULL (checked); a live sender (the C API's contract).
            let sender = unsafe { &(*s).0 };
            let code = match Code::from_u32(code) {
                Some(Code::Ok) | None => Code::Internal,
                Some(c) => c,
            };
            // SAFETY: `msg`: NULL or a NUL-terminated string alive for the call.
            let msg = unsafe { opt_str(msg, "msg") }?
                .map(str::to_owned)
                .unwrap_or_else(|| format!("the backend failed request {}", sender.request_id()));
            sender.send_error(Error::new(code, msg))
        })();
        // SAFETY: made by Box::into_raw in infer_batch_response_sender; this is the
        // handle's last use (the C API's contract).
        drop(unsafe { Box::from_raw(s) });
        result
    })
}

/// True when the caller cancelled the sender's request (`infer_server_cancel`): the
/// backend may stop early and end it (e.g. with a CANCELLED error). False for NULL.
#[no_mangle]
pub unsafe extern "C" fn infer_response_sender_is_cancelled(s: *const ResponseSender) -> bool {
    // SAFETY: `s`: NULL or a live sender (the C API's contract).
    value_boundary(false, || {
        unsafe { s.as_ref() }.is_some_and(|s| s.0.is_cancelled())
    })
}
