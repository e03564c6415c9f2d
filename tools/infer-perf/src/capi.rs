//! The few C API calls the tool makes, wrapped so that every failure is a message that
//! names what failed. These are the library's exported `infer_*` functions: the tool
//! drives the server exactly as an embedding application does.

use infer::ffi::request::*;
use infer::ffi::response::*;
use infer::ffi::server::*;
use infer::ffi::*;
use infer::request::{Request, Response};
use infer::server::ServerOptions;
use std::ffi::{c_void, CStr, CString};
use std::path::Path;

pub use infer::ffi::server::infer_response_fn;

fn last_error() -> String {
    // SAFETY: the library returns a valid NUL-terminated string owned by this thread.
    unsafe { CStr::from_ptr(infer_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

fn status_name(st: infer_status) -> String {
    // SAFETY: infer_status_string returns a static NUL-terminated string for any value.
    unsafe { CStr::from_ptr(infer_status_string(st)) }
        .to_string_lossy()
        .into_owned()
}

/// `Err("<what>: <STATUS>: <message>")` unless `st` is OK.
fn check(st: infer_status, what: &str) -> Result<(), String> {
    if st == INFER_STATUS_OK {
        Ok(())
    } else {
        Err(format!("{what}: {}: {}", status_name(st), last_error()))
    }
}

fn cstring(s: &str, what: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{what} '{s}' holds a NUL byte"))
}

/// Takes a string the library allocated.
///
/// SAFETY: `p` is NULL or a string from the library not yet freed.
unsafe fn take_string(p: *mut std::ffi::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    let s = CStr::from_ptr(p).to_string_lossy().into_owned();
    infer_string_free(p);
    s
}

/// How the server is made.
pub struct Options {
    pub repository: std::path::PathBuf,
    /// INFER_GPU_AUTO, _OFF or _REQUIRED.
    pub gpu: u32,
    /// The most verbose log level shown (1 = errors ... 4 = debug).
    pub log_level: u32,
    pub onnxruntime_library: Option<std::path::PathBuf>,
}

pub const GPU_AUTO: u32 = INFER_GPU_AUTO;
pub const GPU_OFF: u32 = INFER_GPU_OFF;
pub const GPU_REQUIRED: u32 = INFER_GPU_REQUIRED;

/// The library's log lines, on stderr.
///
/// SAFETY: called by the library with a NUL-terminated message.
unsafe extern "C" fn log_line(_: *mut c_void, level: u32, message: *const std::ffi::c_char) {
    let what = match level {
        1 => "error",
        2 => "warning",
        3 => "info",
        _ => "debug",
    };
    let m = if message.is_null() {
        std::borrow::Cow::Borrowed("")
    } else {
        CStr::from_ptr(message).to_string_lossy()
    };
    eprintln!("libinfer {what}: {m}");
}

/// A server over one model repository, with explicit model control: only the models the
/// tool loads are loaded.
pub struct Server(*mut ServerHandle);

// SAFETY: the C API's server handle may be used from any thread.
unsafe impl Send for Server {}
// SAFETY: as above; every call on it is thread-safe.
unsafe impl Sync for Server {}

impl Server {
    pub fn open(o: &Options) -> Result<Server, String> {
        let repo = cstring(&o.repository.to_string_lossy(), "model repository")?;
        let ort = o
            .onnxruntime_library
            .as_ref()
            .map(|p| cstring(&p.to_string_lossy(), "ONNX Runtime library"))
            .transpose()?;
        let mut opts: *mut ServerOptions = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the options are freed below on every path.
        check(
            unsafe { infer_server_options_new(&mut opts) },
            "creating server options",
        )?;
        // SAFETY (every call below): `opts` is live until freed at the end; the strings
        // outlive the calls (they are copied); `log_line` is a valid log function that
        // needs no user data.
        let set = (|| unsafe {
            check(
                infer_server_options_set_model_repository(opts, repo.as_ptr()),
                "model repository",
            )?;
            check(
                infer_server_options_set_model_control_explicit(opts, true),
                "model control",
            )?;
            check(infer_server_options_set_gpu(opts, o.gpu), "GPU mode")?;
            check(
                infer_server_options_set_log_callback(
                    opts,
                    o.log_level,
                    Some(log_line),
                    std::ptr::null_mut(),
                ),
                "log level",
            )?;
            if let Some(p) = &ort {
                check(
                    infer_server_options_set_onnxruntime_library(opts, p.as_ptr()),
                    "ONNX Runtime library",
                )?;
            }
            Ok::<(), String>(())
        })();
        let mut server = std::ptr::null_mut();
        let made = set.and_then(|()| {
            // SAFETY: `opts` is live; `server` is a valid out-pointer.
            check(
                unsafe { infer_server_new(opts, &mut server) },
                "starting the server",
            )
        });
        // SAFETY: created above, freed once.
        unsafe { infer_server_options_free(opts) };
        made.map(|()| Server(server))
    }

    /// Loads `name` from the repository, or with `config` (JSON or config.pbtxt text)
    /// read against the repository's folder of the model.
    pub fn load(&self, name: &str, config: Option<&str>, dir: Option<&Path>) -> Result<(), String> {
        let n = cstring(name, "model name")?;
        let c = config.map(|c| cstring(c, "config")).transpose()?;
        let d = dir
            .map(|d| cstring(&d.to_string_lossy(), "model folder"))
            .transpose()?;
        // SAFETY: the strings outlive the call; NULL means "from the repository".
        check(
            unsafe {
                infer_server_load_model(
                    self.0,
                    n.as_ptr(),
                    c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
                    d.as_ref().map_or(std::ptr::null(), |d| d.as_ptr()),
                )
            },
            &format!("loading model '{name}'"),
        )
    }

    /// The model's configuration, as the library completed it.
    pub fn config(&self, name: &str) -> Result<serde_json::Value, String> {
        let n = cstring(name, "model name")?;
        let mut out = std::ptr::null_mut();
        // SAFETY: live server, valid string and out-pointer.
        check(
            unsafe { infer_server_model_config_json(self.0, n.as_ptr(), -1, &mut out) },
            &format!("reading the config of model '{name}'"),
        )?;
        // SAFETY: `out` was just returned by the library.
        let text = unsafe { take_string(out) };
        serde_json::from_str(&text).map_err(|e| format!("config JSON of '{name}': {e}"))
    }

    /// The model's statistics object (`models[0]` of the statistics JSON).
    pub fn stats(&self, name: &str) -> Result<serde_json::Value, String> {
        let n = cstring(name, "model name")?;
        let mut out = std::ptr::null_mut();
        // SAFETY: live server, valid string and out-pointer.
        check(
            unsafe { infer_server_statistics_json(self.0, n.as_ptr(), &mut out) },
            &format!("reading the statistics of model '{name}'"),
        )?;
        // SAFETY: `out` was just returned by the library.
        let text = unsafe { take_string(out) };
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("statistics of '{name}': {e}"))?;
        // The latest version's entry.
        v["models"]
            .as_array()
            .and_then(|m| m.iter().max_by_key(|x| x["version"].as_i64()))
            .cloned()
            .ok_or_else(|| format!("the statistics of '{name}' name no version"))
    }

    /// A new request for the latest version of `model`.
    pub fn request(&self, model: &str) -> Result<Req, String> {
        let n = cstring(model, "model name")?;
        let mut r = std::ptr::null_mut();
        // SAFETY: live server, valid string and out-pointer.
        check(
            unsafe { infer_request_new(self.0, n.as_ptr(), -1, &mut r) },
            &format!("creating a request for '{model}'"),
        )?;
        Ok(Req(r))
    }

    /// Enqueues `r`; `on_response` gets `user_data` with every response.
    ///
    /// SAFETY: `user_data` must stay valid until the FINAL response, and `on_response`
    /// must accept it.
    pub unsafe fn enqueue(
        &self,
        r: Req,
        on_response: infer_response_fn,
        user_data: *mut c_void,
    ) -> Result<(), (infer_status, String)> {
        let raw = r.0;
        std::mem::forget(r);
        let st = infer_server_enqueue(self.0, raw, on_response, user_data, std::ptr::null_mut());
        if st == INFER_STATUS_OK {
            Ok(())
        } else {
            Err((st, format!("{}: {}", status_name(st), last_error())))
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: created by infer_server_new, freed once.
        unsafe { infer_server_free(self.0) };
    }
}

/// A request being built; freed unless enqueued.
pub struct Req(*mut Request);

impl Req {
    pub fn input(
        &mut self,
        name: &CStr,
        dt: infer_datatype,
        shape: &[i64],
        data: &[u8],
    ) -> Result<(), String> {
        // SAFETY: live request; the slices are valid for the call (the data is copied).
        check(
            unsafe {
                infer_request_add_input(
                    self.0,
                    name.as_ptr(),
                    dt,
                    shape.as_ptr(),
                    shape.len(),
                    data.as_ptr().cast(),
                    data.len(),
                )
            },
            &format!("input '{}'", name.to_string_lossy()),
        )
    }

    pub fn sequence(&mut self, correlation_id: u64, flags: u32) -> Result<(), String> {
        // SAFETY: live request.
        check(
            unsafe { infer_request_set_correlation_id(self.0, correlation_id) },
            "correlation id",
        )?;
        // SAFETY: live request.
        check(
            unsafe { infer_request_set_flags(self.0, flags) },
            "sequence flags",
        )
    }

    pub fn param_int(&mut self, key: &CStr, v: i64) -> Result<(), String> {
        // SAFETY: live request, valid key.
        check(
            unsafe { infer_request_set_parameter_int(self.0, key.as_ptr(), v) },
            &format!("parameter '{}'", key.to_string_lossy()),
        )
    }

    pub fn param_bool(&mut self, key: &CStr, v: bool) -> Result<(), String> {
        // SAFETY: live request, valid key.
        check(
            unsafe { infer_request_set_parameter_bool(self.0, key.as_ptr(), v) },
            &format!("parameter '{}'", key.to_string_lossy()),
        )
    }
}

impl Drop for Req {
    fn drop(&mut self) {
        // SAFETY: a request that was never enqueued (enqueue forgets it).
        unsafe { infer_request_free(self.0) };
    }
}

/// What the tool reads of a response.
pub struct Answer {
    pub error: Option<String>,
    /// Elements of the output named `count_output` (tokens of a generative model).
    pub counted: usize,
}

/// Reads and frees a response.
///
/// SAFETY: `r` is a response the library handed to a callback, not yet freed.
pub unsafe fn read_response(r: *mut Response, count_output: Option<&CStr>) -> Answer {
    let st = infer_response_status(r);
    let error = if st == INFER_STATUS_OK {
        None
    } else {
        let m = infer_response_error_message(r);
        Some(if m.is_null() {
            status_name(st)
        } else {
            format!(
                "{}: {}",
                status_name(st),
                CStr::from_ptr(m).to_string_lossy()
            )
        })
    };
    let mut counted = 0;
    if let (None, Some(name)) = (&error, count_output) {
        let mut shape: *const i64 = std::ptr::null();
        let mut ndim = 0usize;
        if infer_response_output_by_name(
            r,
            name.as_ptr(),
            std::ptr::null_mut(),
            &mut shape,
            &mut ndim,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        ) == INFER_STATUS_OK
            && !shape.is_null()
        {
            counted = std::slice::from_raw_parts(shape, ndim)
                .iter()
                .map(|&d| d.max(0) as usize)
                .product();
        }
    }
    infer_response_free(r);
    Answer { error, counted }
}

pub const FINAL: u32 = INFER_RESPONSE_FLAG_FINAL;
pub const SEQUENCE_START: u32 = INFER_REQUEST_FLAG_SEQUENCE_START;
pub const SEQUENCE_END: u32 = INFER_REQUEST_FLAG_SEQUENCE_END;

/// The C API's datatype of a config's `data_type` (`TYPE_FP32`) or a plain name (`FP32`),
/// with its element size (0 for BYTES) and its name (`FP32`; `BYTES` for `TYPE_STRING`),
/// as the library parses and names it.
pub fn datatype(name: &str) -> Option<(infer_datatype, usize, String)> {
    let n = CString::new(name).ok()?;
    // SAFETY: a NUL-terminated string alive for the call.
    let dt = unsafe { infer_datatype_from_string(n.as_ptr()) };
    if dt == INFER_DATATYPE_INVALID {
        return None;
    }
    // SAFETY: the library returns a static NUL-terminated string for any value.
    let canonical = unsafe { CStr::from_ptr(infer_datatype_string(dt)) }
        .to_string_lossy()
        .into_owned();
    Some((dt, infer_datatype_byte_size(dt) as usize, canonical))
}
