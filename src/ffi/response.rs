//! Reading responses.

use super::*;
use crate::request::{OutputTensor, ParamValue, Response};

/// The id `infer_server_enqueue` returned for the request (0 for NULL).
#[no_mangle]
pub unsafe extern "C" fn infer_response_request_id(r: *const Response) -> u64 {
    // SAFETY: `r`: NULL or a live object of this library (the C API's contract).
    value_boundary(0, || unsafe { r.as_ref() }.map_or(0, |r| r.request_id))
}

/// OK, or the status the request ended with (INVALID_ARGUMENT for NULL).
#[no_mangle]
pub unsafe extern "C" fn infer_response_status(r: *const Response) -> infer_status {
    value_boundary(INFER_STATUS_INTERNAL, || {
        // SAFETY: `r`: NULL or a live object of this library (the C API's contract).
        unsafe { r.as_ref() }.map_or(INFER_STATUS_INVALID_ARGUMENT, |r| r.status as u32)
    })
}

/// The error message, or NULL when the status is OK. Valid until the response is freed.
#[no_mangle]
pub unsafe extern "C" fn infer_response_error_message(r: *const Response) -> *const c_char {
    value_boundary(std::ptr::null(), || {
        // SAFETY: `r`: NULL or a live object of this library (the C API's contract).
        unsafe { r.as_ref() }
            .and_then(|r| r.error.as_ref())
            .map_or(std::ptr::null(), |e| e.as_ptr())
    })
}

/// The model that answered. Valid until the response is freed ("" for NULL).
#[no_mangle]
pub unsafe extern "C" fn infer_response_model_name(r: *const Response) -> *const c_char {
    value_boundary(c"".as_ptr(), || {
        // SAFETY: `r`: NULL or a live object of this library (the C API's contract).
        unsafe { r.as_ref() }.map_or(c"".as_ptr(), |r| r.model.name.as_ptr())
    })
}

/// The version of the model that answered (0 for NULL).
#[no_mangle]
pub unsafe extern "C" fn infer_response_model_version(r: *const Response) -> i64 {
    // SAFETY: `r`: NULL or a live object of this library (the C API's contract).
    value_boundary(0, || unsafe { r.as_ref() }.map_or(0, |r| r.model.version))
}

/// The request's numeric correlation ID (0 if none or a string ID).
#[no_mangle]
pub unsafe extern "C" fn infer_response_correlation_id(r: *const Response) -> u64 {
    // SAFETY: `r`: NULL or a live object of this library (the C API's contract).
    value_boundary(0, || unsafe { r.as_ref() }.map_or(0, |r| r.correlation_id))
}

/// Number of output tensors (0 for NULL or an error response).
#[no_mangle]
pub unsafe extern "C" fn infer_response_output_count(r: *const Response) -> usize {
    // SAFETY: `r`: NULL or a live object of this library (the C API's contract).
    value_boundary(0, || unsafe { r.as_ref() }.map_or(0, |r| r.outputs.len()))
}

fn write_output(out: &TensorOut, o: &OutputTensor) {
    // SAFETY: the caller passes pointers that are NULL or writable (C API contract).
    unsafe {
        match o.data.device() {
            Some(d) => out.write_raw(&o.name, o.dtype, &o.shape, d.ptr as *const c_void, d.len),
            None => out.write(&o.name, o.dtype, &o.shape, o.data.as_slice()),
        }
    }
}

use std::ffi::c_void;

/// Reads output `index` (0-based). Each out-pointer may be NULL when not wanted. All
/// pointers written stay valid until `infer_response_free`. For a model that batches,
/// dim 0 is this request's own batch size.
#[no_mangle]
pub unsafe extern "C" fn infer_response_output(
    r: *const Response,
    index: usize,
    name: *mut *const c_char,
    dt: *mut infer_datatype,
    shape: *mut *const i64,
    ndim: *mut usize,
    data: *mut *const c_void,
    byte_size: *mut usize,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `r`: NULL (refused) or a live handle of this library.
        let r = unsafe { arg_ref(r, "r") }?;
        let o = r.outputs.get(index).ok_or_else(|| {
            Error::invalid(format!(
                "output index {index} is out of range: the response has {} outputs",
                r.outputs.len()
            ))
        })?;
        let out = TensorOut {
            name,
            dt,
            shape,
            ndim,
            data,
            byte_size,
        };
        write_output(&out, o);
        Ok(())
    })
}

/// Reads the output called `name`; NOT_FOUND when the response has none of that name.
#[no_mangle]
pub unsafe extern "C" fn infer_response_output_by_name(
    r: *const Response,
    name: *const c_char,
    dt: *mut infer_datatype,
    shape: *mut *const i64,
    ndim: *mut usize,
    data: *mut *const c_void,
    byte_size: *mut usize,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `r`: NULL (refused) or a live handle of this library.
        let r = unsafe { arg_ref(r, "r") }?;
        // SAFETY: `name`: NULL (refused) or a NUL-terminated string alive for the call.
        let n = unsafe { arg_str(name, "name") }?;
        let o = r.output(n).ok_or_else(|| {
            Error::not_found(format!(
                "the response of model '{}' has no output '{n}'",
                r.model.name_str()
            ))
        })?;
        let name = std::ptr::null_mut();
        let out = TensorOut {
            name,
            dt,
            shape,
            ndim,
            data,
            byte_size,
        };
        write_output(&out, o);
        Ok(())
    })
}

fn param<'a>(r: &'a Response, key: &str) -> Result<&'a ParamValue> {
    r.parameters
        .iter()
        .find(|(k, _)| k.as_bytes() == key.as_bytes())
        .map(|(_, v)| v)
        .ok_or_else(|| Error::not_found(format!("the response has no parameter '{key}'")))
}

/// Reads an integer response parameter (NOT_FOUND if absent, INVALID_ARGUMENT if it is
/// not an integer).
#[no_mangle]
pub unsafe extern "C" fn infer_response_parameter_int(
    r: *const Response,
    key: *const c_char,
    v: *mut i64,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `r`: NULL (refused) or a live handle of this library.
        let r = unsafe { arg_ref(r, "r") }?;
        // SAFETY: `key`: NULL (refused) or a NUL-terminated string alive for the call.
        let key = unsafe { arg_str(key, "key") }?;
        match param(r, key)? {
            // SAFETY: `v`: NULL (refused) or writable for one value.
            ParamValue::Int(i) => unsafe { write_out(v, "v", *i) },
            _ => Err(Error::invalid(format!(
                "response parameter '{key}' is not an integer"
            ))),
        }
    })
}

/// Reads a string response parameter; the string is valid until the response is freed.
#[no_mangle]
pub unsafe extern "C" fn infer_response_parameter_string(
    r: *const Response,
    key: *const c_char,
    v: *mut *const c_char,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `r`: NULL (refused) or a live handle of this library.
        let r = unsafe { arg_ref(r, "r") }?;
        // SAFETY: `key`: NULL (refused) or a NUL-terminated string alive for the call.
        let key = unsafe { arg_str(key, "key") }?;
        match param(r, key)? {
            // SAFETY: `v`: NULL (refused) or writable for one value.
            ParamValue::Str(s) => unsafe { write_out(v, "v", s.as_ptr()) },
            _ => Err(Error::invalid(format!(
                "response parameter '{key}' is not a string"
            ))),
        }
    })
}

/// Frees a response, on any thread (NULL is ignored). Outputs in GPU memory go back to
/// the library's memory pool, to be reused only once the work queued so far on the
/// legacy default stream, and so on every blocking stream (the runtime's default
/// streams, streams created without `cudaStreamNonBlocking`), has run: reads of them
/// queued there need no wait before this call. Reads queued on a non-blocking stream
/// need [`infer_response_free_after_stream`], or a wait before this call.
#[no_mangle]
pub unsafe extern "C" fn infer_response_free(r: *mut Response) {
    value_boundary((), || {
        if !r.is_null() {
            // SAFETY: `r` came from Box::into_raw here and is freed once.
            let r = unsafe { Box::from_raw(r) };
            // SAFETY: NULL is the legacy default stream.
            unsafe { r.release_device_outputs_after(std::ptr::null_mut()) };
            crate::request::pool::recycle_response(r);
        }
    })
}

/// Frees a response as [`infer_response_free`] does, and holds its outputs in GPU memory
/// back from reuse until the work queued so far on `stream` (a `cudaStream_t` or
/// `CUstream` of the outputs' GPU) has run too: for a caller that queued reads of the
/// outputs on a non-blocking stream and frees the response without waiting for them.
/// Where no event can be recorded on `stream` (a stream of another GPU, say), the call
/// waits for `stream` instead. NULL `r` is ignored.
#[no_mangle]
pub unsafe extern "C" fn infer_response_free_after_stream(r: *mut Response, stream: *mut c_void) {
    value_boundary((), || {
        if !r.is_null() {
            // SAFETY: `r` came from Box::into_raw here and is freed once.
            let r = unsafe { Box::from_raw(r) };
            // SAFETY: `stream` is the caller's stream handle (its contract: a stream of
            // the outputs' GPU; NULL is the legacy default stream).
            unsafe {
                r.release_device_outputs_after(stream as crate::cuda::CUstream);
                r.release_device_outputs_after(std::ptr::null_mut());
            }
            crate::request::pool::recycle_response(r);
        }
    })
}
