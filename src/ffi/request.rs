//! Building requests.

use super::server::ServerHandle;
use super::*;
use crate::request::checks::{check_input, InputBytes};
use crate::request::{CorrelationId, ParamValue, Request};
use crate::tensor::{
    element_count, shape_string, Borrowed, DataType, DeviceData, DeviceKeep, Shape, Tensor,
    TensorData,
};
use std::ffi::c_void;
use std::sync::Arc;

/// Longest string correlation ID, in bytes.
pub const INFER_MAX_CORRELATION_ID_BYTES: usize = 128;
// The header's copy of the limit the core applies.
const _: () = assert!(INFER_MAX_CORRELATION_ID_BYTES == crate::request::MAX_CORRELATION_ID_BYTES);
/// Most dimensions a tensor shape may have.
pub const INFER_MAX_DIMS: usize = 64;
const _: () = assert!(INFER_MAX_DIMS == crate::tensor::MAX_DIMS);
/// Longest model name, in bytes.
pub const INFER_MAX_MODEL_NAME_BYTES: usize = 255;
const _: () = assert!(INFER_MAX_MODEL_NAME_BYTES == crate::folder::MAX_MODEL_NAME_BYTES);

/// Creates a request for `version` (-1 = latest) of a loaded model. The caller owns
/// `*out`: it passes it to `infer_server_enqueue` / `infer_server_infer` (which take
/// ownership) or frees it with `infer_request_free`.
#[no_mangle]
pub unsafe extern "C" fn infer_request_new(
    s: *mut ServerHandle,
    model: *const c_char,
    version: i64,
    out: *mut *mut Request,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `s`: NULL (refused) or a live handle of this library.
        let s = unsafe { arg_ref(s, "s") }?;
        // SAFETY: `model`: NULL (refused) or a NUL-terminated string alive for the call.
        let model = unsafe { arg_str(model, "model") }?;
        if out.is_null() {
            return Err(Error::invalid("argument 'out' must not be NULL"));
        }
        crate::request::checks::check_version(model, version)?;
        if !s.server.is_accepting() {
            return Err(Error::unavailable("the server is shutting down"));
        }
        let mut req = match s.server.resolve(model, version) {
            Ok(target) => {
                let mut r = Request::boxed(model, version, Some(target.config.clone()));
                r.target = Some(target);
                r
            }
            // A version that is not ready now may be by enqueue time: check then.
            Err(e) if e.code == Code::NotFound => {
                let config = s.server.model_config(model).ok_or(e)?;
                Request::boxed(model, version, Some(config))
            }
            Err(e) => return Err(e),
        };
        req.gpu = *s.server.gpu();
        req.origin = s.server.id();
        // SAFETY: `out`: NULL (refused) or writable for one value.
        unsafe { write_out(out, "out", Box::into_raw(req)) }
    })
}

/// Frees a request that was never enqueued (NULL is ignored). Borrowed inputs are
/// released.
#[no_mangle]
pub unsafe extern "C" fn infer_request_free(r: *mut Request) {
    value_boundary((), || {
        if !r.is_null() {
            // SAFETY: `r` came from Box::into_raw here and is freed once.
            drop(unsafe { Box::from_raw(r) });
        }
    })
}

/// Sets a numeric correlation ID (sequence models; 0 = none).
#[no_mangle]
pub unsafe extern "C" fn infer_request_set_correlation_id(
    r: *mut Request,
    id: u64,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `r`: NULL (refused) or a live handle no other thread uses meanwhile.
        unsafe { arg_mut(r, "r") }?.correlation_id = if id == 0 {
            CorrelationId::None
        } else {
            CorrelationId::U64(id)
        };
        Ok(())
    })
}

/// Sets a string correlation ID of at most 128 bytes (copied).
#[no_mangle]
pub unsafe extern "C" fn infer_request_set_correlation_id_str(
    r: *mut Request,
    id: *const c_char,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `r`: NULL (refused) or a live handle no other thread uses meanwhile.
        let r = unsafe { arg_mut(r, "r") }?;
        // SAFETY: `id`: NULL (refused) or a NUL-terminated string alive for the call.
        let id = unsafe { arg_str(id, "id") }?;
        if id.len() > INFER_MAX_CORRELATION_ID_BYTES {
            return Err(Error::invalid(format!(
                "correlation ID of {} bytes is longer than the limit of {INFER_MAX_CORRELATION_ID_BYTES}",
                id.len()
            )));
        }
        r.correlation_id = CorrelationId::Str(id.to_owned());
        Ok(())
    })
}

/// Sets INFER_REQUEST_FLAG_SEQUENCE_START / _END.
#[no_mangle]
pub unsafe extern "C" fn infer_request_set_flags(r: *mut Request, flags: u32) -> infer_status {
    status_boundary(|| {
        // SAFETY: `r`: NULL (refused) or a live handle no other thread uses meanwhile.
        let r = unsafe { arg_mut(r, "r") }?;
        let known = INFER_REQUEST_FLAG_SEQUENCE_START | INFER_REQUEST_FLAG_SEQUENCE_END;
        if flags & !known != 0 {
            return Err(Error::invalid(format!(
                "request flags {flags:#x} contain unknown bits {:#x}",
                flags & !known
            )));
        }
        r.flags = flags;
        Ok(())
    })
}

/// Sets the priority level: 0 = the model's default, 1 = highest. Checked against the
/// model's priority_levels at enqueue.
#[no_mangle]
pub unsafe extern "C" fn infer_request_set_priority(r: *mut Request, level: u32) -> infer_status {
    status_boundary(|| {
        // SAFETY: `r`: NULL (refused) or a live handle no other thread uses meanwhile.
        unsafe { arg_mut(r, "r") }?.priority = level;
        Ok(())
    })
}

/// Sets the queue timeout in microseconds (0 = none). Where the model's queue policy has
/// a default timeout, a request may only shorten it, and only with
/// allow_timeout_override.
#[no_mangle]
pub unsafe extern "C" fn infer_request_set_timeout_us(r: *mut Request, us: u64) -> infer_status {
    status_boundary(|| {
        // SAFETY: `r`: NULL (refused) or a live handle no other thread uses meanwhile.
        unsafe { arg_mut(r, "r") }?.timeout_us = us;
        Ok(())
    })
}

/// Checks an input and adds it; `make` builds its storage only after every check passed,
/// so a failed call neither copies nor takes ownership of the caller's buffer.
///
/// # Safety
/// `r` is NULL or a live request; `name`, `shape` (of `ndim`) and `data` (of
/// `byte_size`) are NULL or valid as the C API states.
unsafe fn add_input(
    r: *mut Request,
    name: *const c_char,
    dt: infer_datatype,
    shape: *const i64,
    ndim: usize,
    data: *const c_void,
    byte_size: usize,
    on_device: bool,
    make: impl FnOnce(&mut Request, &[u8]) -> Result<TensorData>,
) -> Result<()> {
    // SAFETY: `r`: NULL (refused) or a live handle no other thread uses meanwhile.
    let r = unsafe { arg_mut(r, "r") }?;
    // SAFETY: `name`: NULL (refused) or a NUL-terminated string alive for the call.
    let name = unsafe { arg_str(name, "name") }?;
    let dtype = DataType::from_u32(dt)
        .filter(|d| *d != DataType::Invalid)
        .ok_or_else(|| {
            Error::invalid(format!(
                "input '{name}' of model '{}': datatype {dt} is not valid",
                r.model
            ))
        })?;
    if ndim > INFER_MAX_DIMS {
        return Err(Error::invalid(format!(
            "input '{name}': {ndim} dimensions is more than {INFER_MAX_DIMS}"
        )));
    }
    // SAFETY: `shape`: NULL with a count of 0, or that many readable elements.
    let shape: Shape = unsafe { arg_shape(shape, ndim, "shape") }?
        .iter()
        .copied()
        .collect();
    // Device memory is never read on the host: only its length is checked here.
    let bytes: &[u8] = if on_device {
        if data.is_null() && byte_size > 0 {
            return Err(Error::invalid("argument 'data' must not be NULL"));
        }
        &[]
    } else {
        // SAFETY: `data`: NULL with a count of 0, or that many readable elements.
        unsafe { arg_slice(data as *const u8, byte_size, "data") }?
    };
    let checked = if on_device {
        InputBytes::Device(byte_size)
    } else {
        InputBytes::Host(bytes)
    };
    if r.input(name).is_some() {
        return Err(Error::new(
            Code::AlreadyExists,
            format!("input '{name}' of model '{}' was already added", r.model),
        ));
    }
    let shared_name: Arc<str> = match &r.checked_against {
        Some(cfg) => check_input(cfg, name, dtype, &shape, checked)?,
        None => {
            let elems = element_count(&shape).ok_or_else(|| {
                Error::invalid(format!(
                    "input '{name}': invalid shape {}",
                    shape_string(&shape)
                ))
            })?;
            if on_device && dtype == DataType::Bytes {
                return Err(Error::invalid(format!(
                    "input '{name}' of model '{}': BYTES inputs must be in host memory",
                    r.model
                )));
            }
            if dtype != DataType::Bytes && elems.checked_mul(dtype.byte_size()) != Some(byte_size) {
                return Err(Error::invalid(format!(
                    "input '{name}': byte size {} does not match shape {} of {}",
                    byte_size,
                    shape_string(&shape),
                    dtype.as_str()
                )));
            }
            Arc::from(name)
        }
    };
    let data = make(r, bytes)?;
    r.inputs.push(Tensor {
        name: shared_name,
        dtype,
        shape,
        data,
    });
    Ok(())
}

/// Adds an input, copying `byte_size` bytes from `data`. Checked against the model's
/// config: the name, datatype, shape (with the batch dimension when the model batches)
/// and byte size (elements x type size; BYTES elements are length-prefixed).
#[no_mangle]
pub unsafe extern "C" fn infer_request_add_input(
    r: *mut Request,
    name: *const c_char,
    dt: infer_datatype,
    shape: *const i64,
    ndim: usize,
    data: *const c_void,
    byte_size: usize,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: the arguments as the C API states (checked inside); the caller keeps
        // `data` readable until `release` runs (infer_request_add_input_borrowed).
        unsafe {
            add_input(r, name, dt, shape, ndim, data, byte_size, false, |r, b| {
                r.try_buffer_from(b).map(TensorData::Owned).ok_or_else(|| {
                    Error::exhausted(format!("cannot allocate {} bytes for an input", b.len()))
                })
            })
        }
    })
}

/// Release callback of a borrowed input.
pub type infer_release_fn = Option<unsafe extern "C" fn(user_data: *mut c_void)>;

/// Adds an input without copying: the library reads `data` until it calls `release`
/// (at most once, from any thread; NULL `release` = never told). If this call fails the
/// buffer was not taken and `release` is not called.
///
/// `mem` says where `data` is: host memory (INFER_MEMORY_CPU, or INFER_MEMORY_CPU_PINNED
/// for page-locked memory such as cuMemHostAlloc's, which a GPU instance copies to the
/// device straight from the caller's buffer instead of staging it first; memory so named
/// that is not page-locked is still copied right, but that copy waits for the instance's
/// stream), or device memory of GPU `device_id` (INFER_MEMORY_GPU). Device memory must be one
/// allocation of that device holding all `byte_size` bytes (INVALID_ARGUMENT otherwise;
/// UNAVAILABLE without a usable GPU) and BYTES inputs must be in host memory. A model
/// whose instances all run on GPUs reads it there (in place when the batch has only this
/// request and it is on the instance's device), as do an ensemble's steps on such
/// models; any other model (or step) gets a copy in host memory, made when the request
/// (step) is enqueued; `release` is called when no model needs the memory any more. The
/// caller must not change the memory until released, and work that produced it must be
/// complete before enqueue (the library's stream does not wait for the caller's).
#[no_mangle]
pub unsafe extern "C" fn infer_request_add_input_borrowed(
    r: *mut Request,
    name: *const c_char,
    dt: infer_datatype,
    shape: *const i64,
    ndim: usize,
    data: *const c_void,
    byte_size: usize,
    mem: infer_memory_type,
    device_id: i64,
    release: infer_release_fn,
    release_user_data: *mut c_void,
) -> infer_status {
    status_boundary(|| {
        match mem {
            INFER_MEMORY_CPU | INFER_MEMORY_CPU_PINNED => {}
            INFER_MEMORY_GPU => {
                // SAFETY: `r`: NULL (refused) or a live handle of this library.
                let rr = unsafe { arg_ref(r, "r") }?;
                // SAFETY: `name`: NULL (refused) or a NUL-terminated string alive for the call.
                let input = unsafe { arg_str(name, "name") }?;
                let at = format!("input '{input}' of model '{}' on GPU {device_id}", rr.model);
                rr.gpu.check_device(device_id).map_err(|e| e.context(&at))?;
                if byte_size > 0 {
                    check_device_range(data as u64, byte_size, device_id as i32)
                        .map_err(|why| Error::invalid(format!("{at}: {why}")))?;
                }
                let ptr = data as u64;
                // SAFETY: the arguments as the C API states (checked inside); the caller keeps
                // `data` readable until `release` runs (infer_request_add_input_borrowed).
                return unsafe {
                    add_input(r, name, dt, shape, ndim, data, byte_size, true, |_, _| {
                        let release =
                            release.map(|func| super::callbacks::release(func, release_user_data));
                        Ok(TensorData::Device(DeviceData {
                            ptr,
                            len: byte_size,
                            device: device_id as i32,
                            // SAFETY: no host bytes are read (NULL, 0); only `release`
                            // runs, once, when the input is done with.
                            keep: DeviceKeep::Borrowed(Some(Borrowed::new(
                                std::ptr::null(),
                                0,
                                release,
                            ))),
                        }))
                    })
                };
            }
            m => return Err(unknown_memory_type(m)),
        }
        // SAFETY: the arguments as the C API states (checked inside); the caller keeps
        // `data` readable until `release` runs (infer_request_add_input_borrowed).
        unsafe {
            add_input(r, name, dt, shape, ndim, data, byte_size, false, |_, b| {
                let release =
                    release.map(|func| super::callbacks::release(func, release_user_data));
                // SAFETY: the caller keeps `data` readable until `release` runs (the C
                // API's contract for infer_request_add_input_borrowed).
                let lent = Borrowed::new(b.as_ptr(), b.len(), release);
                Ok(TensorData::Borrowed(if mem == INFER_MEMORY_CPU_PINNED {
                    lent.page_locked()
                } else {
                    lent
                }))
            })
        }
    })
}

/// Asks for one output (call again for more); with none requested, every output is
/// returned.
#[no_mangle]
pub unsafe extern "C" fn infer_request_add_requested_output(
    r: *mut Request,
    name: *const c_char,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `r`: NULL (refused) or a live handle no other thread uses meanwhile.
        let r = unsafe { arg_mut(r, "r") }?;
        // SAFETY: `name`: NULL (refused) or a NUL-terminated string alive for the call.
        let name = unsafe { arg_str(name, "name") }?;
        let shared: Arc<str> = match &r.checked_against {
            Some(cfg) => cfg.output(name).map(|o| o.name.clone()).ok_or_else(|| {
                Error::invalid(format!(
                    "unexpected inference output '{name}' for model '{m}': it has no output '{name}'",
                    m = cfg.name
                ))
            })?,
            None => Arc::from(name),
        };
        if !r.requested_outputs.contains(&shared) {
            r.requested_outputs.push(shared);
        }
        Ok(())
    })
}

/// # Safety
/// `r` is NULL or a live request; `key` is NULL or a NUL-terminated string.
unsafe fn set_param(r: *mut Request, key: *const c_char, v: ParamValue) -> Result<()> {
    // SAFETY: `r`: NULL (refused) or a live handle no other thread uses meanwhile.
    let r = unsafe { arg_mut(r, "r") }?;
    // SAFETY: `key`: NULL (refused) or a NUL-terminated string alive for the call.
    let key = unsafe { arg_str(key, "key") }?;
    if key.is_empty() {
        return Err(Error::invalid("parameter key must not be empty"));
    }
    match r.parameters.iter_mut().find(|(k, _)| k == key) {
        Some(p) => p.1 = v,
        None => r.parameters.push((key.to_owned(), v)),
    }
    Ok(())
}

/// Sets an integer request parameter (replacing one of the same key).
#[no_mangle]
pub unsafe extern "C" fn infer_request_set_parameter_int(
    r: *mut Request,
    key: *const c_char,
    v: i64,
) -> infer_status {
    // SAFETY: `r` and `key` as the C API states (checked inside).
    status_boundary(|| unsafe { set_param(r, key, ParamValue::Int(v)) })
}

/// Sets a floating-point request parameter.
#[no_mangle]
pub unsafe extern "C" fn infer_request_set_parameter_double(
    r: *mut Request,
    key: *const c_char,
    v: f64,
) -> infer_status {
    // SAFETY: `r` and `key` as the C API states (checked inside).
    status_boundary(|| unsafe { set_param(r, key, ParamValue::Double(v)) })
}

/// Sets a boolean request parameter.
#[no_mangle]
pub unsafe extern "C" fn infer_request_set_parameter_bool(
    r: *mut Request,
    key: *const c_char,
    v: bool,
) -> infer_status {
    // SAFETY: `r` and `key` as the C API states (checked inside).
    status_boundary(|| unsafe { set_param(r, key, ParamValue::Bool(v)) })
}

/// Sets a string request parameter (copied).
#[no_mangle]
pub unsafe extern "C" fn infer_request_set_parameter_string(
    r: *mut Request,
    key: *const c_char,
    v: *const c_char,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `v`: NULL (refused) or a NUL-terminated string alive for the call.
        let v = unsafe { arg_str(v, "v") }?;
        // SAFETY: `r` and `key` as the C API states (checked inside).
        unsafe {
            set_param(
                r,
                key,
                ParamValue::Str(std::ffi::CString::new(v).unwrap_or_default()),
            )
        }
    })
}

/// Checks that `[ptr, ptr + len)` lies in one allocation of device memory on `device`.
fn check_device_range(ptr: u64, len: usize, device: i32) -> std::result::Result<(), String> {
    let info = crate::cuda::driver::pointer_info(ptr)
        .map_err(|why| format!("{ptr:#x} is not device memory ({why})"))?;
    if info.device != device {
        return Err(format!(
            "{ptr:#x} is memory of GPU {}, not of GPU {device}",
            info.device
        ));
    }
    let end = info.range_start.saturating_add(info.range_size as u64);
    if ptr.saturating_add(len as u64) > end {
        return Err(format!(
            "{len} bytes at {ptr:#x} run past the end of its allocation ({} bytes at {:#x})",
            info.range_size, info.range_start
        ));
    }
    Ok(())
}
