//! Server options, the server handle, models, enqueue and operations.

use super::callbacks::{in_callback, log_sink, response_sink, stats_callback};
use super::custom::{infer_backend, CustomBackend};
use super::*;
use crate::log::Logger;
use crate::request::{Request, Response, ResponseSink};
use crate::server::{GpuMode, Server, ServerOptions};
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

/// The server handle (`infer_server`).
pub struct ServerHandle {
    pub(crate) server: Arc<Server>,
    freed_in_shutdown: std::sync::atomic::AtomicBool,
}

impl ServerHandle {
    /// The server behind the handle, for Rust code embedding the library next to C code
    /// (registering Rust backends, tests).
    pub fn server(&self) -> &Arc<Server> {
        &self.server
    }
}

const DEFAULT_SHUTDOWN: Duration = Duration::from_secs(30);

/// Creates server options with defaults: no repository, load every model at start-up,
/// GPU AUTO, errors and warnings to stderr. The caller owns `*out` and frees it with
/// `infer_server_options_free`.
#[no_mangle]
pub unsafe extern "C" fn infer_server_options_new(out: *mut *mut ServerOptions) -> infer_status {
    status_boundary(|| {
        if out.is_null() {
            return Err(Error::invalid("argument 'out' must not be NULL"));
        }
        // SAFETY: `out`: NULL (refused) or writable for one value.
        unsafe {
            write_out(
                out,
                "out",
                Box::into_raw(Box::new(ServerOptions::default())),
            )
        }
    })
}

/// Frees options (NULL is ignored). Backends registered on options that never made a
/// server are finalized here.
#[no_mangle]
pub unsafe extern "C" fn infer_server_options_free(opts: *mut ServerOptions) {
    value_boundary((), || {
        if !opts.is_null() {
            // SAFETY: `opts` came from Box::into_raw here and is freed once.
            drop(unsafe { Box::from_raw(opts) });
        }
    })
}

/// Sets the model repository: a folder of `<model>/config.pbtxt` (Triton's layout).
#[no_mangle]
pub unsafe extern "C" fn infer_server_options_set_model_repository(
    opts: *mut ServerOptions,
    path: *const c_char,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `opts`: NULL (refused) or a live handle no other thread uses meanwhile.
        let o = unsafe { arg_mut(opts, "opts") }?;
        // SAFETY: `path`: NULL (refused) or a NUL-terminated string alive for the call.
        let p = unsafe { arg_str(path, "path") }?;
        if p.is_empty() {
            return Err(Error::invalid("model repository path must not be empty"));
        }
        o.repository = Some(p.into());
        Ok(())
    })
}

/// false (default): every path a model names (its folder, version folders, config, model
/// file, state data, weights) must stay inside the model repository (or inside the
/// folder given to `infer_server_load_model`), symbolic links included: a link that
/// leads out is refused with INVALID_ARGUMENT naming it. true: the repository is trusted
/// and its symbolic links may lead anywhere (names and configs still cannot use `..` or
/// absolute paths).
#[no_mangle]
pub unsafe extern "C" fn infer_server_options_set_trusted_repository(
    opts: *mut ServerOptions,
    trusted: bool,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `opts`: NULL (refused) or a live handle no other thread uses meanwhile.
        unsafe { arg_mut(opts, "opts") }?.trusted_repository = trusted;
        Ok(())
    })
}

/// false (default): every model in the repository is loaded by `infer_server_new`;
/// true: only models loaded with `infer_server_load_model`.
#[no_mangle]
pub unsafe extern "C" fn infer_server_options_set_model_control_explicit(
    opts: *mut ServerOptions,
    explicit_: bool,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `opts`: NULL (refused) or a live handle no other thread uses meanwhile.
        unsafe { arg_mut(opts, "opts") }?.explicit_model_control = explicit_;
        Ok(())
    })
}

/// Polls the model repository every `period_ms` milliseconds (0: never, the default), as
/// `infer_server_poll_repository` does, on a thread of the server's own until it shuts
/// down. Needs a model repository and no explicit model control (`infer_server_new`
/// refuses the combination with INVALID_ARGUMENT).
#[no_mangle]
pub unsafe extern "C" fn infer_server_options_set_repository_poll_ms(
    opts: *mut ServerOptions,
    period_ms: u64,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `opts`: NULL (refused) or a live handle no other thread uses meanwhile.
        let o = unsafe { arg_mut(opts, "opts") }?;
        o.repository_poll = (period_ms > 0).then(|| Duration::from_millis(period_ms));
        Ok(())
    })
}

/// Gives the server a response cache of `bytes` (0: none, the default), shared by the
/// models whose config says `response_cache { enable: true }`, as Triton's local cache
/// (`--cache-config local,size=...`): a request whose model version, inputs (names,
/// types, shapes, bytes), requested outputs and parameters match an earlier successful
/// one is answered with the stored outputs without running the model, on a library
/// thread; the least recently used responses go when the cache is full. A model that
/// enables the cache on a server without one fails to load (INVALID_ARGUMENT); sequence
/// and streaming models refuse it (UNSUPPORTED).
#[no_mangle]
pub unsafe extern "C" fn infer_server_options_set_response_cache_bytes(
    opts: *mut ServerOptions,
    bytes: u64,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `opts`: NULL (refused) or a live handle no other thread uses meanwhile.
        let o = unsafe { arg_mut(opts, "opts") }?;
        o.response_cache_bytes = usize::try_from(bytes).map_err(|_| {
            Error::invalid(format!(
                "a response cache of {bytes} bytes does not fit this machine's address space"
            ))
        })?;
        Ok(())
    })
}

/// The rate limiter (Triton's `--rate-limit`): INFER_RATE_LIMIT_OFF (the default: an
/// `instance_group`'s `rate_limiter` has no effect, and the load logs so) or
/// INFER_RATE_LIMIT_EXECUTION_COUNT: before each batch an instance takes the resources
/// its `rate_limiter` names (per device, or `global`) and gives them back when the batch
/// is done, across every model of the server; where instances wait for the same
/// resources, one of `priority` 2 gets half the turns of one of priority 1. A resource's
/// size is what `infer_server_options_add_rate_limit_resource` gives, or the largest
/// count any one loaded instance needs. INVALID_ARGUMENT for another mode.
#[no_mangle]
pub unsafe extern "C" fn infer_server_options_set_rate_limit(
    opts: *mut ServerOptions,
    mode: u32,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `opts`: NULL (refused) or a live handle no other thread uses meanwhile.
        let o = unsafe { arg_mut(opts, "opts") }?;
        o.rate_limit = match mode {
            INFER_RATE_LIMIT_OFF => false,
            INFER_RATE_LIMIT_EXECUTION_COUNT => true,
            other => {
                return Err(Error::invalid(format!(
                    "rate limit mode {other}: use INFER_RATE_LIMIT_OFF (0) or INFER_RATE_LIMIT_EXECUTION_COUNT (1)"
                )))
            }
        };
        Ok(())
    })
}

/// Gives rate limiter resource `name` `count` units (Triton's `--rate-limit-resource`):
/// on GPU `device`, or with `device` -1 for the global resource of that name and every
/// device without a size of its own (CPU instances count as device -1). A model whose
/// instance needs more than its device (or the global resource) has fails to load
/// (INVALID_ARGUMENT). Given twice for one name and device, the last count holds.
#[no_mangle]
pub unsafe extern "C" fn infer_server_options_add_rate_limit_resource(
    opts: *mut ServerOptions,
    name: *const c_char,
    count: u32,
    device: i32,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `opts`: NULL (refused) or a live handle no other thread uses meanwhile.
        let o = unsafe { arg_mut(opts, "opts") }?;
        // SAFETY: `name`: NULL (refused) or a NUL-terminated string alive for the call.
        let name = unsafe { arg_str(name, "name") }?;
        if name.is_empty() {
            return Err(Error::invalid("rate limiter resource name is empty"));
        }
        if device < -1 {
            return Err(Error::invalid(format!(
                "rate limiter resource '{name}': device {device} (use a GPU id, or -1 for every device and the global resource)"
            )));
        }
        o.rate_limit_resources
            .retain(|(n, d, _)| !(n == name && *d == device));
        o.rate_limit_resources
            .push((name.to_owned(), device, count));
        Ok(())
    })
}

/// The ONNX Runtime library file (`libonnxruntime.so...`) for ONNX models; searched first,
/// before the `INFER_ONNXRUNTIME_LIBRARY` environment variable, the directory of
/// libinfer and the loader's paths. NULL or "" clears it. ONNX Runtime is loaded once per
/// process: the first server that loads an ONNX model decides which file.
#[no_mangle]
pub unsafe extern "C" fn infer_server_options_set_onnxruntime_library(
    opts: *mut ServerOptions,
    path: *const c_char,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `opts`: NULL (refused) or a live handle no other thread uses meanwhile.
        let o = unsafe { arg_mut(opts, "opts") }?;
        // SAFETY: `path`: NULL or a NUL-terminated string alive for the call.
        let p = unsafe { opt_str(path, "path") }?;
        o.onnxruntime.library = p.filter(|p| !p.is_empty()).map(std::path::PathBuf::from);
        Ok(())
    })
}

/// true: ONNX models must run on ONNX Runtime; where it cannot be loaded, loading an
/// ONNX model fails with UNAVAILABLE saying why, instead of running it on tract.
#[no_mangle]
pub unsafe extern "C" fn infer_server_options_set_onnxruntime_required(
    opts: *mut ServerOptions,
    required: bool,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `opts`: NULL (refused) or a live handle no other thread uses meanwhile.
        unsafe { arg_mut(opts, "opts") }?.onnxruntime.required = required;
        Ok(())
    })
}

/// Caps ONNX Runtime's compute threads: every ONNX Runtime session that does not set its
/// own `intra_op_thread_count` / `inter_op_thread_count` shares one pool of `intra_op`
/// threads (and `inter_op` for parallel execution), so many models do not oversubscribe
/// the host's cores. 0 lets ONNX Runtime choose (one per core). The pools are
/// process-wide: they are made by the first server that loads an ONNX model.
#[no_mangle]
pub unsafe extern "C" fn infer_server_options_set_onnxruntime_threads(
    opts: *mut ServerOptions,
    intra_op: u32,
    inter_op: u32,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `opts`: NULL (refused) or a live handle no other thread uses meanwhile.
        let o = unsafe { arg_mut(opts, "opts") }?;
        if intra_op > 4096 || inter_op > 4096 {
            return Err(Error::invalid(format!(
                "onnxruntime threads: {intra_op} / {inter_op} exceeds the limit of 4096"
            )));
        }
        o.onnxruntime.global_threads = Some((intra_op, inter_op));
        Ok(())
    })
}

/// With explicit model control, names a model of the repository that `infer_server_new`
/// loads (like Triton's `--load-model`); call once per model. `infer_server_new` fails
/// with the first such model's error. Without explicit control every model is loaded
/// anyway and the names are not used.
#[no_mangle]
pub unsafe extern "C" fn infer_server_options_add_startup_model(
    opts: *mut ServerOptions,
    name: *const c_char,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `opts`: NULL (refused) or a live handle no other thread uses meanwhile.
        let o = unsafe { arg_mut(opts, "opts") }?;
        // SAFETY: `name`: NULL (refused) or a NUL-terminated string alive for the call.
        let n = unsafe { arg_str(name, "name") }?;
        if n.is_empty() {
            return Err(Error::invalid("model name must not be empty"));
        }
        o.startup_models.push(n.to_owned());
        Ok(())
    })
}

/// GPU use: INFER_GPU_AUTO (0, use one when present), INFER_GPU_OFF (1, never touch
/// CUDA), INFER_GPU_REQUIRED (2, `infer_server_new` fails with UNAVAILABLE without one).
#[no_mangle]
pub unsafe extern "C" fn infer_server_options_set_gpu(
    opts: *mut ServerOptions,
    mode: u32,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `opts`: NULL (refused) or a live handle no other thread uses meanwhile.
        let o = unsafe { arg_mut(opts, "opts") }?;
        o.gpu = match mode {
            0 => GpuMode::Auto,
            1 => GpuMode::Off,
            2 => GpuMode::Required,
            m => {
                return Err(Error::invalid(format!(
                    "GPU mode {m} is not one of AUTO=0, OFF=1, REQUIRED=2"
                )))
            }
        };
        Ok(())
    })
}

/// Sends log messages of `min_level` and more severe (ERROR=1 WARN=2 INFO=3 DEBUG=4) to
/// `fn`, from any library thread. NULL `fn` restores the default (stderr).
#[no_mangle]
pub unsafe extern "C" fn infer_server_options_set_log_callback(
    opts: *mut ServerOptions,
    min_level: u32,
    func: infer_log_fn,
    user_data: *mut c_void,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `opts`: NULL (refused) or a live handle no other thread uses meanwhile.
        let o = unsafe { arg_mut(opts, "opts") }?;
        if !(1..=4).contains(&min_level) {
            return Err(Error::invalid(format!(
                "log level {min_level} is not one of ERROR=1..DEBUG=4"
            )));
        }
        o.log = match func {
            Some(func) => Logger::new(log_sink(func, user_data), min_level),
            None => Logger::default(),
        };
        Ok(())
    })
}

/// # Safety
/// `name` is NULL or a NUL-terminated string; `backend` is NULL or a filled-in
/// `infer_backend` whose functions stay callable while the backend is registered.
unsafe fn make_backend(
    name: *const c_char,
    backend: *const infer_backend,
    user_data: *mut c_void,
) -> Result<(String, Arc<CustomBackend>)> {
    // SAFETY: `name`: NULL (refused) or a NUL-terminated string alive for the call.
    let name = unsafe { arg_str(name, "name") }?;
    if name.is_empty() {
        return Err(Error::invalid("backend name must not be empty"));
    }
    // SAFETY: `backend`: NULL (refused) or a live handle of this library.
    unsafe { arg_ref(backend, "backend") }?;
    Ok((
        name.to_owned(),
        // SAFETY: `backend` is a filled-in infer_backend the caller keeps alive (the C API's
        // contract).
        Arc::new(unsafe { CustomBackend::from_c(name, backend, user_data) }?),
    ))
}

/// Registers a custom backend on the options, for models loaded at start-up. The struct
/// is copied; `finalize` runs once, when no server needs the backend any more. If the
/// call fails, the caller keeps `backend_user_data` and `finalize` is never called.
#[no_mangle]
pub unsafe extern "C" fn infer_server_options_register_backend(
    opts: *mut ServerOptions,
    name: *const c_char,
    backend: *const infer_backend,
    backend_user_data: *mut c_void,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `opts`: NULL (refused) or a live handle no other thread uses meanwhile.
        let o = unsafe { arg_mut(opts, "opts") }?;
        // SAFETY: `backend` and `name` as the C API states (checked inside).
        let (name, b) = unsafe { make_backend(name, backend, backend_user_data) }?;
        if o.backends.iter().any(|(n, _)| *n == name) {
            b.release_user_data();
            return Err(Error::new(
                Code::AlreadyExists,
                format!("a backend named '{name}' is already registered"),
            ));
        }
        o.backends.push((name, b));
        Ok(())
    })
}

/// Registers a custom backend on a running server; models using it can be loaded after.
/// ALREADY_EXISTS if the name is taken. If the call fails, the caller keeps
/// `backend_user_data` and `finalize` is never called.
#[no_mangle]
pub unsafe extern "C" fn infer_server_register_backend(
    s: *mut ServerHandle,
    name: *const c_char,
    backend: *const infer_backend,
    backend_user_data: *mut c_void,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `s`: NULL (refused) or a live handle of this library.
        let s = unsafe { arg_ref(s, "s") }?;
        // SAFETY: `backend` and `name` as the C API states (checked inside).
        let (name, b) = unsafe { make_backend(name, backend, backend_user_data) }?;
        s.server
            .register_backend(&name, b.clone())
            .inspect_err(|_| {
                // Not registered: the caller keeps its user data and finalize never runs.
                b.release_user_data();
            })
    })
}

/// Creates a server (NULL options = defaults). With a repository and no explicit model
/// control, every model in it is loaded; the first failure fails the call. The caller
/// owns `*out` and frees it with `infer_server_free`.
#[no_mangle]
pub unsafe extern "C" fn infer_server_new(
    opts: *const ServerOptions,
    out: *mut *mut ServerHandle,
) -> infer_status {
    status_boundary(|| {
        if out.is_null() {
            return Err(Error::invalid("argument 'out' must not be NULL"));
        }
        // SAFETY: `opts`: NULL or a live object of this library (the C API's contract).
        let o = unsafe { opts.as_ref() }.cloned().unwrap_or_default();
        let server = Server::new(o)?;
        // SAFETY: `out`: NULL (refused) or writable for one value.
        unsafe {
            write_out(
                out,
                "out",
                Box::into_raw(Box::new(ServerHandle {
                    server,
                    freed_in_shutdown: std::sync::atomic::AtomicBool::new(false),
                })),
            )
        }
    })
}

/// Stops accepting requests (enqueue -> UNAVAILABLE), lets queued and running requests
/// finish, and after `timeout_ms` cancels what remains (each gets a FINAL CANCELLED).
/// Returns when every worker thread has stopped, or, for a worker stuck in a backend,
/// shortly after the timeout: the requests it holds are answered CANCELLED, and the thread
/// is left running, detached, with what it uses kept alive (its late answers are dropped).
/// Idempotent. Must not be called from a response callback (INVALID_ARGUMENT).
#[no_mangle]
pub unsafe extern "C" fn infer_server_shutdown(
    s: *mut ServerHandle,
    timeout_ms: u64,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `s`: NULL (refused) or a live handle of this library.
        let s = unsafe { arg_ref(s, "s") }?;
        if in_callback() {
            return Err(Error::invalid(
                "infer_server_shutdown must not be called from a response callback",
            ));
        }
        s.server.shutdown(Duration::from_millis(timeout_ms));
        s.freed_in_shutdown
            .store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    })
}

/// Shuts down (30 s drain, then as `infer_server_shutdown` after its timeout) and releases
/// the server. NULL is ignored. Calling it from a
/// response callback is refused: the error is logged and set as this thread's last error,
/// and the server stays alive.
#[no_mangle]
pub unsafe extern "C" fn infer_server_free(s: *mut ServerHandle) {
    value_boundary((), || {
        if s.is_null() {
            return;
        }
        if in_callback() {
            let e = Error::invalid("infer_server_free must not be called from a response callback; the server was not freed");
            // SAFETY: not NULL (checked); a live server handle (the C API's contract).
            unsafe { (*s).server.log().error(&e.message) };
            set_last_error(&e);
            return;
        }
        // SAFETY: `s` came from Box::into_raw here and is freed once.
        let h = unsafe { Box::from_raw(s) };
        h.server.shutdown(DEFAULT_SHUTDOWN);
    })
}

/// Loads a model, or replaces it when the name is loaded (new requests go to the new
/// model, in-flight ones finish on the old one). `config_text` is config.pbtxt text or
/// the same schema as JSON; NULL reads `<model_dir>/config.pbtxt`. `model_dir` NULL means
/// `<repository>/<name>` (or no directory).
#[no_mangle]
pub unsafe extern "C" fn infer_server_load_model(
    s: *mut ServerHandle,
    name: *const c_char,
    config_text: *const c_char,
    model_dir: *const c_char,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `s`: NULL (refused) or a live handle of this library.
        let s = unsafe { arg_ref(s, "s") }?;
        // SAFETY: `name`: NULL (refused) or a NUL-terminated string alive for the call.
        let name = unsafe { arg_str(name, "name") }?;
        // SAFETY: `config_text`: NULL (refused) or a NUL-terminated string alive for the call.
        let text = unsafe { opt_str(config_text, "config_text") }?;
        // SAFETY: `model_dir`: NULL (refused) or a NUL-terminated string alive for the call.
        let dir = unsafe { opt_str(model_dir, "model_dir") }?;
        s.server
            .load_model(name, text, dir.map(std::path::Path::new))
    })
}

/// Loads (or replaces) a model whose files the application holds in memory, as Triton's
/// load with `file:` parameters: `config_text` (config.pbtxt text or JSON; required) and
/// `count` files, file `i` named by `paths[i]`, its path in the model folder
/// (`"1/model.onnx"`; a leading `"file:"` is allowed), with `sizes[i]` bytes at
/// `contents[i]` (NULL only when the size is 0). The files are copied to a new private
/// folder under the system's temporary folder (`TMPDIR`), loaded from there, and removed
/// when the model is unloaded or replaced, or the load fails. The repository's folder of
/// the same name is not read. A path that is absolute, holds `..` or is given twice is
/// INVALID_ARGUMENT.
#[no_mangle]
pub unsafe extern "C" fn infer_server_load_model_files(
    s: *mut ServerHandle,
    name: *const c_char,
    config_text: *const c_char,
    paths: *const *const c_char,
    contents: *const *const u8,
    sizes: *const usize,
    count: usize,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `s`: NULL (refused) or a live handle of this library.
        let s = unsafe { arg_ref(s, "s") }?;
        // SAFETY: `name`: NULL (refused) or a NUL-terminated string alive for the call.
        let name = unsafe { arg_str(name, "name") }?;
        // SAFETY: `config_text`: NULL (refused) or a NUL-terminated string alive for the call.
        let config = unsafe { arg_str(config_text, "config_text") }?;
        // SAFETY: each array: NULL with count 0 (else refused) or `count` readable values.
        let paths = unsafe { arg_slice(paths, count, "paths") }?;
        // SAFETY: as above.
        let contents = unsafe { arg_slice(contents, count, "contents") }?;
        // SAFETY: as above.
        let sizes = unsafe { arg_slice(sizes, count, "sizes") }?;
        let mut files: Vec<(&str, &[u8])> = Vec::with_capacity(count);
        for i in 0..count {
            // SAFETY: `paths[i]`: NULL (refused) or a NUL-terminated string alive for the call.
            let path = unsafe { arg_str(paths[i], &format!("paths[{i}]")) }?;
            // SAFETY: `contents[i]`: NULL with size 0 (else refused) or `sizes[i]` readable
            // bytes alive for the call.
            let data = unsafe { arg_slice(contents[i], sizes[i], &format!("contents[{i}]")) }?;
            files.push((path, data));
        }
        s.server.load_model_files(name, config, &files)
    })
}

/// Brings the loaded models in line with the model repository, as Triton's repository
/// polling: folders that appeared are loaded, loaded models whose folder changed (config,
/// version folders, any file) are reloaded (new requests go to the new versions, those in
/// flight finish on the old; none fails), and models whose folder went are unloaded once
/// their requests finish. Left alone: models the application loaded with its own config,
/// folder or files, models it unloaded and models whose last load failed (until their
/// folder changes again). Every change is tried; the first failure is returned, and
/// `infer_server_repository_index_json` gives each model's reason. UNAVAILABLE without a
/// repository or with explicit model control.
#[no_mangle]
pub unsafe extern "C" fn infer_server_poll_repository(s: *mut ServerHandle) -> infer_status {
    status_boundary(|| {
        // SAFETY: `s`: NULL (refused) or a live handle of this library.
        unsafe { arg_ref(s, "s") }?.server.poll_repository()
    })
}

/// Triton's repository index as a JSON array: every model of the repository and every
/// model loaded, one object per version, `{"name", "version", "state", "reason"}`,
/// sorted by name and version (`version`, a string as in Triton, is left out where a model
/// has none: not loaded, or loading). `state`: READY, LOADING, UNLOADING (draining after
/// an unload or a replace) or UNAVAILABLE, whose `reason` is the last load's error,
/// "unloaded" or "not loaded"; a READY model whose last reload failed keeps serving and
/// names that failure in `reason`. `ready_only`: the READY entries alone. The caller frees
/// `*json_out` with `infer_string_free`.
#[no_mangle]
pub unsafe extern "C" fn infer_server_repository_index_json(
    s: *mut ServerHandle,
    ready_only: bool,
    json_out: *mut *mut c_char,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `s`: NULL (refused) or a live handle of this library.
        let s = unsafe { arg_ref(s, "s") }?;
        if json_out.is_null() {
            return Err(Error::invalid("argument 'json_out' must not be NULL"));
        }
        let json = s.server.repository_index_json(ready_only)?;
        // SAFETY: `json_out`: NULL (refused) or writable for one value.
        unsafe { write_out(json_out, "json_out", owned_string(json)) }
    })
}

/// Unloads a model after its queued and running requests finish; a version that answers
/// nothing for 30 s has a stuck backend, and what it holds is answered CANCELLED (its
/// stuck threads are left detached, as at shutdown). Called on a library
/// thread (from a response callback or a backend's execute), it returns once the model
/// takes no new requests, and the model drains on its own threads: waiting there could
/// deadlock (two models whose callbacks unload each other).
#[no_mangle]
pub unsafe extern "C" fn infer_server_unload_model(
    s: *mut ServerHandle,
    name: *const c_char,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `s`: NULL (refused) or a live handle of this library.
        let s = unsafe { arg_ref(s, "s") }?;
        // SAFETY: `name`: NULL (refused) or a NUL-terminated string alive for the call.
        s.server.unload_model(unsafe { arg_str(name, "name") }?)
    })
}

/// Writes whether `version` (-1 = latest) of the model is loaded and serving.
#[no_mangle]
pub unsafe extern "C" fn infer_server_model_ready(
    s: *mut ServerHandle,
    name: *const c_char,
    version: i64,
    ready: *mut bool,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `s`: NULL (refused) or a live handle of this library.
        let s = unsafe { arg_ref(s, "s") }?;
        // SAFETY: `name`: NULL (refused) or a NUL-terminated string alive for the call.
        let name = unsafe { arg_str(name, "name") }?;
        // SAFETY: `ready`: NULL (refused) or writable for one value.
        unsafe { write_out(ready, "ready", s.server.model_ready(name, version)?) }
    })
}

/// The model's configuration as JSON (Triton's field names). The caller frees `*json_out`
/// with `infer_string_free`.
#[no_mangle]
pub unsafe extern "C" fn infer_server_model_config_json(
    s: *mut ServerHandle,
    name: *const c_char,
    version: i64,
    json_out: *mut *mut c_char,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `s`: NULL (refused) or a live handle of this library.
        let s = unsafe { arg_ref(s, "s") }?;
        if json_out.is_null() {
            return Err(Error::invalid("argument 'json_out' must not be NULL"));
        }
        let json = s
            .server
            // SAFETY: `name`: NULL (refused) or a NUL-terminated string alive for the call.
            .model_config_json(unsafe { arg_str(name, "name") }?, version)?;
        // SAFETY: `json_out`: NULL (refused) or writable for one value.
        unsafe { write_out(json_out, "json_out", owned_string(json)) }
    })
}

/// Statistics of one model (or all with NULL) as JSON. The caller frees `*json_out` with
/// `infer_string_free`.
#[no_mangle]
pub unsafe extern "C" fn infer_server_statistics_json(
    s: *mut ServerHandle,
    name: *const c_char,
    json_out: *mut *mut c_char,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `s`: NULL (refused) or a live handle of this library.
        let s = unsafe { arg_ref(s, "s") }?;
        if json_out.is_null() {
            return Err(Error::invalid("argument 'json_out' must not be NULL"));
        }
        // SAFETY: `name`: NULL (refused) or a NUL-terminated string alive for the call.
        let json = s
            .server
            .statistics_json(unsafe { opt_str(name, "name") }?)?;
        // SAFETY: `json_out`: NULL (refused) or writable for one value.
        unsafe { write_out(json_out, "json_out", owned_string(json)) }
    })
}

/// The same counters in Prometheus text format. The caller frees `*text_out` with
/// `infer_string_free`.
#[no_mangle]
pub unsafe extern "C" fn infer_server_metrics_prometheus(
    s: *mut ServerHandle,
    text_out: *mut *mut c_char,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `s`: NULL (refused) or a live handle of this library.
        let s = unsafe { arg_ref(s, "s") }?;
        if text_out.is_null() {
            return Err(Error::invalid("argument 'text_out' must not be NULL"));
        }
        // SAFETY: `text_out`: NULL (refused) or writable for one value.
        unsafe {
            write_out(
                text_out,
                "text_out",
                owned_string(s.server.metrics_prometheus()),
            )
        }
    })
}

/// Holds batch formation for a model: requests are still accepted (queue limits and
/// timeouts apply) but nothing starts until `infer_server_resume_model`.
#[no_mangle]
pub unsafe extern "C" fn infer_server_pause_model(
    s: *mut ServerHandle,
    name: *const c_char,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `s`: NULL (refused) or a live handle of this library.
        unsafe { arg_ref(s, "s") }?
            .server
            // SAFETY: `name`: NULL (refused) or a NUL-terminated string alive for the call.
            .set_paused(unsafe { arg_str(name, "name") }?, true)
    })
}

/// Receives one JSON object per scheduler iteration of a generative model (text valid
/// during the call only).
pub type infer_stats_fn = Option<unsafe extern "C" fn(user_data: *mut c_void, json: *const c_char)>;

/// Sets the per-iteration statistics callback of a generative model (NULL `fn` clears
/// it). It runs on the model's generation threads after each iteration that ran, with at
/// least: `timestamp_us`, `iteration`, `active_requests`, `max_requests`,
/// `context_requests`, `generation_requests`, `context_tokens`, `kv_blocks_max`,
/// `kv_blocks_used`, `kv_blocks_free`, `tokens_per_block`, `paused_requests`. It stays set
/// across reloads of the model. When this call returns, a replaced callback is no longer
/// running and is never called again. NOT_FOUND when the model is not loaded,
/// INVALID_ARGUMENT when it is not generative.
#[no_mangle]
pub unsafe extern "C" fn infer_server_set_iteration_stats_callback(
    s: *mut ServerHandle,
    model: *const c_char,
    func: infer_stats_fn,
    user_data: *mut c_void,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `s`: NULL (refused) or a live handle of this library.
        let server = &unsafe { arg_ref(s, "s") }?.server;
        // SAFETY: `model`: NULL (refused) or a NUL-terminated string alive for the call.
        let name = unsafe { arg_str(model, "model") }?;
        let cb = func.map(|func| stats_callback(func, user_data));
        server.set_iteration_stats_callback(name, cb)
    })
}

/// Resumes a paused model.
#[no_mangle]
pub unsafe extern "C" fn infer_server_resume_model(
    s: *mut ServerHandle,
    name: *const c_char,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `s`: NULL (refused) or a live handle of this library.
        unsafe { arg_ref(s, "s") }?
            .server
            // SAFETY: `name`: NULL (refused) or a NUL-terminated string alive for the call.
            .set_paused(unsafe { arg_str(name, "name") }?, false)
    })
}

/// Receives a response: `response` is owned by the receiver and freed with
/// `infer_response_free` (any thread, any time); `flags` has INFER_RESPONSE_FLAG_FINAL on
/// the last call for the request.
pub type infer_response_fn =
    Option<unsafe extern "C" fn(user_data: *mut c_void, response: *mut Response, flags: u32)>;

/// Receives a log message (ERROR=1 WARN=2 INFO=3 DEBUG=4), from any library thread.
pub type infer_log_fn =
    Option<unsafe extern "C" fn(user_data: *mut c_void, level: u32, message: *const c_char)>;

/// Queues a request. Always takes ownership of `r`, also on failure. On OK, `on_response`
/// is called (on a library thread) one or more times, exactly one call carrying
/// INFER_RESPONSE_FLAG_FINAL, and it is the last; on failure it is never called. Never
/// blocks on execution: a full queue is RESOURCE_EXHAUSTED at once. `request_id_out` may
/// be NULL; it is written before this call returns, which can be after the callback has
/// already run: do not point it into memory the callback frees. May be called from any
/// thread, including from a callback.
#[no_mangle]
pub unsafe extern "C" fn infer_server_enqueue(
    s: *mut ServerHandle,
    r: *mut Request,
    on_response: infer_response_fn,
    user_data: *mut c_void,
    request_id_out: *mut u64,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `r`: NULL (refused) or a request handle the caller gives up.
        let req = unsafe { take_request(r) }?;
        // SAFETY: `s`: NULL (refused) or a live handle of this library.
        let s = unsafe { arg_ref(s, "s") }?;
        let f =
            on_response.ok_or_else(|| Error::invalid("argument 'on_response' must not be NULL"))?;
        // SAFETY: `s` and `request_id_out` as the C API states (checked inside).
        unsafe { enqueue_with(s, req, response_sink(f, user_data), request_id_out) }
    })
}

/// Takes ownership of a request handed to an enqueueing call.
///
/// # Safety
/// `r` is NULL or a request handle of this library that the caller gives up.
unsafe fn take_request(r: *mut Request) -> Result<Box<Request>> {
    if r.is_null() {
        return Err(Error::invalid("argument 'r' must not be NULL"));
    }
    // SAFETY: `r` came from Box::into_raw here and is freed once.
    Ok(unsafe { Box::from_raw(r) })
}

/// # Safety
/// `id_out` is NULL or writable.
unsafe fn enqueue_with(
    s: &ServerHandle,
    mut req: Box<Request>,
    sink: ResponseSink,
    id_out: *mut u64,
) -> Result<()> {
    req.sink = Some(sink);
    let id = s.server.enqueue(req)?;
    if !id_out.is_null() {
        // SAFETY: not NULL (checked); writable (this function's contract).
        unsafe { id_out.write(id) };
    }
    Ok(())
}

#[derive(Default)]
struct Waiter {
    slot: parking_lot::Mutex<Option<*mut Response>>,
    cv: parking_lot::Condvar,
}

// SAFETY: the response pointer is handed from the callback thread to the waiting thread
// exactly once.
unsafe impl Send for Waiter {}
unsafe impl Sync for Waiter {}

/// `user_data` is an `Arc<Waiter>` reference that the FINAL call releases, so the waiter
/// outlives the last touch of it whichever thread finishes first.
unsafe extern "C" fn infer_wake(user_data: *mut c_void, resp: *mut Response, flags: u32) {
    if flags & INFER_RESPONSE_FLAG_FINAL == 0 {
        // SAFETY: `resp` came from Box::into_raw here and is freed once.
        drop(unsafe { Box::from_raw(resp) }); // only the FINAL response is returned
        return;
    }
    // SAFETY: `user_data` is the Arc::into_raw reference infer_server_infer made for this
    // request; the FINAL call, which happens once, takes it back.
    let w = unsafe { Arc::from_raw(user_data as *const Waiter) };
    *w.slot.lock() = Some(resp);
    w.cv.notify_one();
}

/// Runs a request and waits for its FINAL response (convenience for one-response
/// models). Takes ownership of `r`. Returns OK with `*response_out` set (check
/// `infer_response_status` for the model's result), or an error if the request was not
/// accepted. Never call it from a response callback, nor from a backend's execute for
/// the model that backend runs (both INVALID_ARGUMENT: they would wait for themselves).
#[no_mangle]
pub unsafe extern "C" fn infer_server_infer(
    s: *mut ServerHandle,
    r: *mut Request,
    response_out: *mut *mut Response,
) -> infer_status {
    status_boundary(|| {
        // SAFETY: `r`: NULL (refused) or a request handle the caller gives up.
        let req = unsafe { take_request(r) }?;
        // SAFETY: `s`: NULL (refused) or a live handle of this library.
        let s = unsafe { arg_ref(s, "s") }?;
        if response_out.is_null() {
            return Err(Error::invalid("argument 'response_out' must not be NULL"));
        }
        if in_callback() {
            return Err(Error::invalid(
                "infer_server_infer must not be called from a response callback",
            ));
        }
        if s.server.would_wait_for_itself(&req) {
            return Err(Error::invalid(format!(
                "infer_server_infer for model '{}' must not be called from that model's own execute: it would wait for itself (use infer_server_enqueue)",
                req.model
            )));
        }
        let waiter = Arc::new(Waiter::default());
        let ud = Arc::into_raw(waiter.clone()) as *mut c_void;
        // SAFETY: `s` is live (checked above); no id out-pointer.
        if let Err(e) =
            unsafe { enqueue_with(s, req, response_sink(infer_wake, ud), std::ptr::null_mut()) }
        {
            // SAFETY: not accepted, so the callback never runs: the reference made above is
            // taken back here, once.
            drop(unsafe { Arc::from_raw(ud as *const Waiter) });
            return Err(e);
        }
        let mut slot = waiter.slot.lock();
        while slot.is_none() {
            waiter.cv.wait(&mut slot);
        }
        let resp = slot.take().unwrap_or(std::ptr::null_mut());
        drop(slot);
        // SAFETY: not NULL (checked above); writable (the C API's contract).
        unsafe { response_out.write(resp) };
        Ok(())
    })
}

/// Cancels a request: a queued one ends at once with a FINAL CANCELLED response (sent from
/// a library thread); one that is executing finishes normally, except a generative
/// request, which stops after the current iteration with a FINAL CANCELLED response
/// (`finish_reason` "cancelled"; without streaming it carries the tokens generated so
/// far). OK is returned in both cases. Unknown or finished ids are NOT_FOUND. Idempotent,
/// best effort, callable from any thread.
#[no_mangle]
pub unsafe extern "C" fn infer_server_cancel(
    s: *mut ServerHandle,
    request_id: u64,
) -> infer_status {
    // SAFETY: `s`: NULL (refused) or a live handle of this library.
    status_boundary(|| unsafe { arg_ref(s, "s") }?.server.cancel(request_id))
}
