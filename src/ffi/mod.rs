//! The C boundary. Only handle casts, argument checks, panic catching, status codes and
//! the thread-local last error live here; every function body calls into the library.
//!
//! Every export runs inside [`status_boundary`] or [`value_boundary`], so no panic crosses
//! into C, and every pointer argument goes through the `arg_*` helpers, so NULL is an
//! INVALID_ARGUMENT, never a crash.

#![allow(non_camel_case_types)]
#![allow(clippy::missing_safety_doc)]
// C signatures are fixed by the API: out-parameters make long argument lists.
#![allow(clippy::too_many_arguments)]

pub mod backend;
mod callbacks;
pub mod custom;
pub mod memory;
pub mod request;
pub mod response;
pub mod server;

use crate::status::{panic_message, Code, Error, Result};
use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// A status code: `INFER_STATUS_OK` (0) or the error.
pub type infer_status = u32;
/// A tensor element type (`INFER_DATATYPE_*`).
pub type infer_datatype = u32;
/// Where memory lives (`INFER_MEMORY_*`).
pub type infer_memory_type = u32;

pub const INFER_STATUS_OK: infer_status = 0;
pub const INFER_STATUS_INVALID_ARGUMENT: infer_status = 1;
pub const INFER_STATUS_NOT_FOUND: infer_status = 2;
pub const INFER_STATUS_ALREADY_EXISTS: infer_status = 3;
/// Shutting down, model not ready, no GPU.
pub const INFER_STATUS_UNAVAILABLE: infer_status = 4;
pub const INFER_STATUS_UNSUPPORTED: infer_status = 5;
pub const INFER_STATUS_INTERNAL: infer_status = 6;
pub const INFER_STATUS_CANCELLED: infer_status = 7;
/// Request timeout, sequence timeout.
pub const INFER_STATUS_DEADLINE_EXCEEDED: infer_status = 8;
/// Queue full, out of memory.
pub const INFER_STATUS_RESOURCE_EXHAUSTED: infer_status = 9;

pub const INFER_DATATYPE_INVALID: infer_datatype = 0;
pub const INFER_DATATYPE_BOOL: infer_datatype = 1;
pub const INFER_DATATYPE_UINT8: infer_datatype = 2;
pub const INFER_DATATYPE_UINT16: infer_datatype = 3;
pub const INFER_DATATYPE_UINT32: infer_datatype = 4;
pub const INFER_DATATYPE_UINT64: infer_datatype = 5;
pub const INFER_DATATYPE_INT8: infer_datatype = 6;
pub const INFER_DATATYPE_INT16: infer_datatype = 7;
pub const INFER_DATATYPE_INT32: infer_datatype = 8;
pub const INFER_DATATYPE_INT64: infer_datatype = 9;
pub const INFER_DATATYPE_FP16: infer_datatype = 10;
pub const INFER_DATATYPE_FP32: infer_datatype = 11;
pub const INFER_DATATYPE_FP64: infer_datatype = 12;
/// Each element: a little-endian uint32 length, then that many bytes.
pub const INFER_DATATYPE_BYTES: infer_datatype = 13;
pub const INFER_DATATYPE_BF16: infer_datatype = 14;

pub const INFER_MEMORY_CPU: infer_memory_type = 0;
pub const INFER_MEMORY_CPU_PINNED: infer_memory_type = 1;
pub const INFER_MEMORY_GPU: infer_memory_type = 2;

/// Rate limiter modes (`infer_server_options_set_rate_limit`), as Triton's
/// `--rate-limit`: off (instance groups' `rate_limiter` has no effect), or instances take
/// their resources before each execution.
pub const INFER_RATE_LIMIT_OFF: u32 = 0;
pub const INFER_RATE_LIMIT_EXECUTION_COUNT: u32 = 1;

/// INVALID_ARGUMENT for a memory type that is not one of INFER_MEMORY_*.
pub(crate) fn unknown_memory_type(m: infer_memory_type) -> Error {
    Error::invalid(format!(
        "memory type {m} is not one of CPU=0, CPU_PINNED=1, GPU=2"
    ))
}

pub const INFER_GPU_AUTO: u32 = 0;
pub const INFER_GPU_OFF: u32 = 1;
pub const INFER_GPU_REQUIRED: u32 = 2;

pub const INFER_LOG_ERROR: u32 = 1;
pub const INFER_LOG_WARN: u32 = 2;
pub const INFER_LOG_INFO: u32 = 3;
pub const INFER_LOG_DEBUG: u32 = 4;

pub const INFER_REQUEST_FLAG_SEQUENCE_START: u32 = 1;
pub const INFER_REQUEST_FLAG_SEQUENCE_END: u32 = 2;
pub const INFER_RESPONSE_FLAG_FINAL: u32 = 1;

/// The C API version this library implements. A client built against MAJOR.MINOR works
/// with a library of the same MAJOR and a MINOR at least as high.
pub const INFER_API_VERSION_MAJOR: u32 = 0;
pub const INFER_API_VERSION_MINOR: u32 = 5;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

pub(crate) fn set_last_error(e: &Error) {
    let msg = CString::new(e.message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = msg);
}

/// Runs an export that returns a status; errors set the thread's last error message.
pub(crate) fn status_boundary(f: impl FnOnce() -> Result<()>) -> infer_status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => INFER_STATUS_OK,
        Ok(Err(e)) => {
            set_last_error(&e);
            e.code as u32
        }
        Err(p) => {
            set_last_error(&Error::internal(format!(
                "internal error (panic): {}",
                panic_message(p.as_ref())
            )));
            Code::Internal as u32
        }
    }
}

/// Runs an export that returns a plain value; a panic gives `fallback`.
pub(crate) fn value_boundary<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(fallback)
}

/// A handle argument; NULL is refused.
///
/// # Safety
/// `p` is NULL or points to a live `T` for `'a`.
pub(crate) unsafe fn arg_ref<'a, T>(p: *const T, what: &str) -> Result<&'a T> {
    // SAFETY: NULL or a live `T` (this function's contract).
    unsafe { p.as_ref() }
        .ok_or_else(|| Error::invalid(format!("argument '{what}' must not be NULL")))
}

/// A handle argument the call changes; NULL is refused.
///
/// # Safety
/// `p` is NULL or points to a live `T` that nothing else uses for `'a`.
pub(crate) unsafe fn arg_mut<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T> {
    // SAFETY: NULL or a live, unshared `T` (this function's contract).
    unsafe { p.as_mut() }
        .ok_or_else(|| Error::invalid(format!("argument '{what}' must not be NULL")))
}

/// A string argument (UTF-8); NULL is refused.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string that lives for `'a`.
pub(crate) unsafe fn arg_str<'a>(p: *const c_char, what: &str) -> Result<&'a str> {
    if p.is_null() {
        return Err(Error::invalid(format!(
            "argument '{what}' must not be NULL"
        )));
    }
    // SAFETY: not NULL (checked); NUL-terminated and alive (this function's contract).
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| Error::invalid(format!("argument '{what}' is not valid UTF-8")))
}

/// An optional string argument: NULL is None.
///
/// # Safety
/// As [`arg_str`].
pub(crate) unsafe fn opt_str<'a>(p: *const c_char, what: &str) -> Result<Option<&'a str>> {
    if p.is_null() {
        Ok(None)
    } else {
        // SAFETY: `p`: NULL (refused) or a NUL-terminated string alive for the call.
        unsafe { arg_str(p, what) }.map(Some)
    }
}

/// Writes an out-parameter; fails (writing nothing) when the pointer is NULL.
///
/// # Safety
/// `p` is NULL or valid for writing one `T`.
pub(crate) unsafe fn write_out<T>(p: *mut T, what: &str, v: T) -> Result<()> {
    if p.is_null() {
        return Err(Error::invalid(format!(
            "argument '{what}' must not be NULL"
        )));
    }
    // SAFETY: not NULL (checked) and writable (this function's contract).
    unsafe { p.write(v) };
    Ok(())
}

/// Reads a (pointer, count) array argument; NULL is allowed only with count 0.
///
/// # Safety
/// `p` is NULL or points to `n` initialised `T`s that live for `'a`.
pub(crate) unsafe fn arg_slice<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T]> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Error::invalid(format!(
            "argument '{what}' must not be NULL when its length is {n}"
        )));
    }
    // SAFETY: not NULL (checked); `n` live elements (this function's contract).
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// A shape argument: at most [`crate::tensor::MAX_DIMS`] dims (checked before any is
/// read).
///
/// # Safety
/// As [`arg_slice`]: `p` is NULL with `ndim` 0, or points to `ndim` readable values.
pub(crate) unsafe fn arg_shape<'a>(p: *const i64, ndim: usize, what: &str) -> Result<&'a [i64]> {
    if ndim > crate::tensor::MAX_DIMS {
        return Err(Error::invalid(format!(
            "argument '{what}' has {ndim} dims; the most a tensor may have is {}",
            crate::tensor::MAX_DIMS
        )));
    }
    // SAFETY: this function's contract.
    unsafe { arg_slice(p, ndim, what) }
}

/// Out-pointers describing a tensor (`infer_response_output`, `infer_batch_input`); each
/// may be NULL when the caller does not want it.
pub(crate) struct TensorOut {
    pub name: *mut *const c_char,
    pub dt: *mut infer_datatype,
    pub shape: *mut *const i64,
    pub ndim: *mut usize,
    pub data: *mut *const std::ffi::c_void,
    pub byte_size: *mut usize,
}

impl TensorOut {
    /// Writes the tensor's description to every out-pointer that is not NULL.
    ///
    /// # Safety
    /// Every out-pointer is NULL or writable; `name`, `shape` and `bytes` outlive the
    /// caller's use of what is written.
    pub(crate) unsafe fn write(
        &self,
        name: &CStr,
        dt: crate::tensor::DataType,
        shape: &[i64],
        bytes: &[u8],
    ) {
        // SAFETY: this function's contract.
        unsafe {
            self.write_raw(
                name,
                dt,
                shape,
                bytes.as_ptr() as *const std::ffi::c_void,
                bytes.len(),
            )
        }
    }

    /// Like `write`, for data given by address (device memory).
    ///
    /// # Safety
    /// As [`TensorOut::write`].
    pub(crate) unsafe fn write_raw(
        &self,
        name: &CStr,
        dt: crate::tensor::DataType,
        shape: &[i64],
        data: *const std::ffi::c_void,
        len: usize,
    ) {
        if !self.name.is_null() {
            // SAFETY: not NULL (checked), writable (this function's contract).
            unsafe { self.name.write(name.as_ptr()) };
        }
        if !self.dt.is_null() {
            // SAFETY: not NULL (checked), writable (this function's contract).
            unsafe { self.dt.write(dt as u32) };
        }
        if !self.shape.is_null() {
            // SAFETY: not NULL (checked), writable (this function's contract).
            unsafe { self.shape.write(shape.as_ptr()) };
        }
        if !self.ndim.is_null() {
            // SAFETY: not NULL (checked), writable (this function's contract).
            unsafe { self.ndim.write(shape.len()) };
        }
        if !self.data.is_null() {
            // SAFETY: not NULL (checked), writable (this function's contract).
            unsafe { self.data.write(data) };
        }
        if !self.byte_size.is_null() {
            // SAFETY: not NULL (checked), writable (this function's contract).
            unsafe { self.byte_size.write(len) };
        }
    }
}

/// A string the library hands over; the caller frees it with `infer_string_free`.
pub(crate) fn owned_string(s: String) -> *mut c_char {
    CString::new(s.replace('\0', " "))
        .unwrap_or_default()
        .into_raw()
}

/// The name of a status code, e.g. "INVALID_ARGUMENT"; "UNKNOWN" for other values.
/// The string is static. May be called from any thread.
#[no_mangle]
pub extern "C" fn infer_status_string(status: infer_status) -> *const c_char {
    value_boundary(c"UNKNOWN".as_ptr(), || {
        Code::from_u32(status).map_or(c"UNKNOWN".as_ptr(), |c| c.as_cstr().as_ptr())
    })
}

/// The message of the last failing call on this thread; never NULL ("" if none). Valid
/// until the next failing call on the same thread.
#[no_mangle]
pub extern "C" fn infer_last_error_message() -> *const c_char {
    value_boundary(c"".as_ptr(), || LAST_ERROR.with(|l| l.borrow().as_ptr()))
}

/// Writes the C API version this library implements (INFER_API_VERSION_MAJOR/MINOR of
/// the header it was built with).
#[no_mangle]
pub unsafe extern "C" fn infer_api_version(major: *mut u32, minor: *mut u32) -> infer_status {
    status_boundary(|| {
        if major.is_null() || minor.is_null() {
            return Err(Error::invalid(
                "arguments 'major' and 'minor' must not be NULL",
            ));
        }
        // SAFETY: `major`: NULL (refused) or writable for one value.
        unsafe { write_out(major, "major", INFER_API_VERSION_MAJOR) }?;
        // SAFETY: `minor`: NULL (refused) or writable for one value.
        unsafe { write_out(minor, "minor", INFER_API_VERSION_MINOR) }
    })
}

static VERSION: &CStr =
    match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
        Ok(s) => s,
        Err(_) => c"0.0.0",
    };

/// The library version, e.g. "0.1.0". Static string.
#[no_mangle]
pub extern "C" fn infer_version() -> *const c_char {
    VERSION.as_ptr()
}

/// The name of a datatype, e.g. "FP32"; "INVALID" for unknown values. Static string.
#[no_mangle]
pub extern "C" fn infer_datatype_string(dt: infer_datatype) -> *const c_char {
    value_boundary(c"INVALID".as_ptr(), || {
        crate::tensor::DataType::from_u32(dt)
            .unwrap_or(crate::tensor::DataType::Invalid)
            .as_cstr()
            .as_ptr()
    })
}

/// Parses "FP32" or "TYPE_FP32" ("STRING"/"TYPE_STRING" give BYTES); 0 (INVALID) for
/// unknown names or NULL.
#[no_mangle]
pub unsafe extern "C" fn infer_datatype_from_string(s: *const c_char) -> infer_datatype {
    value_boundary(0, || {
        // SAFETY: `s`: NULL (refused) or a NUL-terminated string alive for the call.
        unsafe { arg_str(s, "s") }
            .ok()
            .and_then(crate::tensor::DataType::parse)
            .map_or(0, |d| d as u32)
    })
}

/// Size of one element in bytes; 0 for BYTES and unknown types.
#[no_mangle]
pub extern "C" fn infer_datatype_byte_size(dt: infer_datatype) -> u32 {
    crate::tensor::DataType::from_u32(dt).map_or(0, |d| d.byte_size() as u32)
}

/// Frees a string the library returned as owned (`char **` out-parameters). NULL is
/// ignored.
#[no_mangle]
pub unsafe extern "C" fn infer_string_free(s: *mut c_char) {
    value_boundary((), || {
        if !s.is_null() {
            // SAFETY: a string this library handed over (CString::into_raw), freed once
            // (the C API's contract).
            drop(unsafe { CString::from_raw(s) });
        }
    })
}
