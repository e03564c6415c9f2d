//! Finding and loading ONNX Runtime's shared library, once per process.
//!
//! Nothing of ONNX Runtime is needed to build the library: `libonnxruntime.so` is opened
//! at run time, from the first of these that loads:
//! 1. the server option (`infer_server_options_set_onnxruntime_library`);
//! 2. the environment variable [`LIBRARY_ENV`];
//! 3. next to the library itself (the directory of `libinfer.so`, or of the program when
//!    it links libinfer statically): `libonnxruntime.so`, else the highest
//!    `libonnxruntime.so.1.*` there;
//! 4. the dynamic loader's own search (`LD_LIBRARY_PATH`, the system's directories):
//!    `libonnxruntime.so`, then `libonnxruntime.so.1`.
//!
//! ONNX Runtime allows one library and one environment (its thread pools, its logger) per
//! process, so the first server that serves an ONNX model fixes both; a later server that
//! names another file or other thread settings is told so in its log.

use crate::log::Logger;
use parking_lot::Mutex;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The environment variable naming the ONNX Runtime library file.
pub const LIBRARY_ENV: &str = "INFER_ONNXRUNTIME_LIBRARY";

/// The oldest ONNX Runtime whose C API the engine uses (API version 20).
pub const MIN_MINOR_VERSION: u32 = 20;

/// What a server asks of ONNX Runtime.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RuntimeOptions {
    /// The library file to load (first in the search).
    pub library: Option<PathBuf>,
    /// ONNX models must run on ONNX Runtime: no fallback to tract (UNAVAILABLE instead).
    pub required: bool,
    /// The process-wide thread pools shared by every session that does not set its own
    /// thread counts (`intra_op_thread_count` / `inter_op_thread_count`): (intra, inter);
    /// None: each session has its own pools, as ONNX Runtime does by default.
    pub global_threads: Option<(u32, u32)>,
}

/// A log ONNX Runtime's messages go to: one per server that uses it.
struct Listener {
    server: u64,
    log: Logger,
    /// The messages already said to it, digits left out (a warning ONNX Runtime repeats
    /// at every run, with other sizes, is said once).
    said: HashSet<String>,
}

static LOGS: Mutex<Vec<Listener>> = Mutex::new(Vec::new());
/// How many distinct messages a server's log hears at most.
const MAX_SAID: usize = 256;

/// Server `id`'s log hears ONNX Runtime's warnings and errors from now on.
pub fn add_log(id: u64, log: &Logger) {
    let mut logs = LOGS.lock();
    if !logs.iter().any(|l| l.server == id) {
        logs.push(Listener {
            server: id,
            log: log.clone(),
            said: HashSet::new(),
        });
    }
}

/// Server `id` is going away.
pub fn remove_log(id: u64) {
    LOGS.lock().retain(|l| l.server != id);
}

/// An ONNX Runtime message: warnings and errors, each distinct one once per server, to
/// every registered log (a process-wide message cannot be told apart by server). No lock
/// is held while the logs' callbacks run.
fn forward(level: ort::logging::LogLevel, msg: &str) {
    use ort::logging::LogLevel as L;
    let error = match level {
        L::Verbose | L::Info => return,
        L::Warning => false,
        L::Error | L::Fatal => true,
    };
    let key: String = msg.chars().filter(|c| !c.is_ascii_digit()).collect();
    let logs: Vec<Logger> = LOGS
        .lock()
        .iter_mut()
        .filter_map(|l| {
            let new = l.said.len() < MAX_SAID && l.said.insert(key.clone());
            new.then(|| l.log.clone())
        })
        .collect();
    let line = format!("ONNX Runtime: {msg}");
    for l in logs {
        if error {
            l.error(&line);
        } else {
            l.warn(&line);
        }
    }
}

/// ONNX Runtime, loaded.
pub struct Runtime {
    pub path: PathBuf,
    pub version: String,
    pub env: ort::environment::Environment,
    /// The global thread pools the environment was made with.
    pub global_threads: Option<(u32, u32)>,
    /// Whether ONNX Runtime lists the CUDA execution provider (onnxruntime-gpu).
    pub cuda: bool,
    /// The execution providers this build of ONNX Runtime has.
    pub providers: Vec<String>,
}

/// ONNX Runtime once it has loaded (a failed attempt is not kept: a later server may name
/// a library that loads).
static RUNTIME: OnceLock<Runtime> = OnceLock::new();
/// Serialises the attempt (the ort crate's own loader is not meant to race).
static LOADING: Mutex<()> = Mutex::new(());

/// ONNX Runtime for a server with `opts`, loading it on first use (tried again at each
/// call until it loads); Err says why it is not available (every place searched, and what
/// failed). `log` hears when this server's
/// options differ from what the process already has.
pub fn runtime(
    opts: &RuntimeOptions,
    log: &Logger,
) -> std::result::Result<&'static Runtime, String> {
    let _g = LOADING.lock();
    let first = RUNTIME.get().is_none();
    if first {
        let rt = load(opts)?;
        let _ = RUNTIME.set(rt);
    }
    match RUNTIME.get() {
        Some(rt) => {
            if !first {
                if let Some(want) = &opts.library {
                    if !same_file(want, &rt.path) {
                        log.warn(&format!(
                            "ONNX Runtime: this process already uses '{}' (version {}); '{}' is not loaded (one ONNX Runtime per process)",
                            rt.path.display(),
                            rt.version,
                            want.display()
                        ));
                    }
                }
                if opts.global_threads.is_some() && opts.global_threads != rt.global_threads {
                    log.warn(&format!(
                        "ONNX Runtime: the process's thread pools are already set ({}); this server's setting does not apply (one ONNX Runtime environment per process)",
                        match rt.global_threads {
                            Some((a, b)) => format!("global pools of {a} intra-op and {b} inter-op threads"),
                            None => "a pool per session".to_owned(),
                        }
                    ));
                }
            }
            Ok(rt)
        }
        None => Err("ONNX Runtime could not be loaded".to_owned()),
    }
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

/// The places searched, in order, with what each is.
fn candidates(opts: &RuntimeOptions) -> Vec<(PathBuf, &'static str)> {
    let mut c = Vec::new();
    if let Some(p) = &opts.library {
        c.push((p.clone(), "the server option"));
    }
    if let Some(p) = std::env::var_os(LIBRARY_ENV).filter(|p| !p.is_empty()) {
        c.push((PathBuf::from(p), LIBRARY_ENV));
    }
    if let Some(dir) = own_directory() {
        let plain = dir.join("libonnxruntime.so");
        if plain.exists() {
            c.push((plain, "next to libinfer"));
        } else if let Some(v) = highest_versioned(&dir) {
            c.push((v, "next to libinfer"));
        }
    }
    c.push((
        PathBuf::from("libonnxruntime.so"),
        "the loader's search path",
    ));
    c.push((
        PathBuf::from("libonnxruntime.so.1"),
        "the loader's search path",
    ));
    c
}

/// The highest `libonnxruntime.so.1.*` in `dir`.
fn highest_versioned(dir: &Path) -> Option<PathBuf> {
    let entries = std::fs::read_dir(dir).ok()?;
    let version = |name: &str| -> Option<Vec<u32>> {
        let rest = name.strip_prefix("libonnxruntime.so.")?;
        rest.split('.').map(|p| p.parse().ok()).collect()
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            Some((version(&name)?, e.path()))
        })
        .max_by(|a, b| a.0.cmp(&b.0))
        .map(|(_, p)| p)
}

/// The directory of the object this code is in (libinfer.so, or the program).
fn own_directory() -> Option<PathBuf> {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    let here = own_directory as *const () as *const libc::c_void;
    // SAFETY: dladdr only reads the address and fills `info`; `here` is an address in
    // this object.
    let found = unsafe { libc::dladdr(here, info.as_mut_ptr()) };
    if found == 0 {
        return None;
    }
    // SAFETY: dladdr returned non-zero, so it filled `info`.
    let info = unsafe { info.assume_init() };
    if info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated path owned by the loader, valid while the
    // object stays loaded (it is this library).
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    let path = PathBuf::from(
        <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(name.to_bytes()),
    );
    let path = path.canonicalize().unwrap_or(path);
    path.parent().map(Path::to_path_buf)
}

fn load(opts: &RuntimeOptions) -> std::result::Result<Runtime, String> {
    let mut tried = Vec::new();
    for (path, from) in candidates(opts) {
        // A file named by an option or the environment must exist; the loader's own
        // search is tried by name.
        if (path.is_absolute() || path.components().count() > 1) && !path.is_file() {
            tried.push(format!("'{}' ({from}): no such file", path.display()));
            continue;
        }
        let version = match probe(&path) {
            Ok(v) => v,
            Err(e) => {
                tried.push(format!("'{}' ({from}): {e}", path.display()));
                continue;
            }
        };
        match start(&path, &version, opts) {
            Ok(rt) => return Ok(rt),
            Err(e) => tried.push(format!("'{}' ({from}): {e}", path.display())),
        }
    }
    Err(format!(
        "ONNX Runtime could not be loaded: {}",
        tried.join("; ")
    ))
}

/// Opens the file with the loader and reads its version, without handing it to the ort
/// crate (which keeps the first library it is given for the life of the process).
fn probe(path: &Path) -> std::result::Result<String, String> {
    // SAFETY: loading a shared library runs its initialisers; ONNX Runtime's are
    // self-contained. The handle is dropped (dlclose) when this returns; the ort crate
    // opens it again.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| e.to_string())?;
    // SAFETY: `OrtGetApiBase` has this signature in every ONNX Runtime release.
    let get: libloading::Symbol<unsafe extern "C" fn() -> *const ort::sys::OrtApiBase> =
        unsafe { lib.get(b"OrtGetApiBase\0") }
            .map_err(|_| "not ONNX Runtime (no OrtGetApiBase)".to_owned())?;
    // SAFETY: OrtGetApiBase takes nothing and returns a static table or null.
    let base = unsafe { get() };
    if base.is_null() {
        return Err("OrtGetApiBase returned nothing".to_owned());
    }
    // SAFETY: `base` is ONNX Runtime's static API base; GetVersionString returns a static
    // NUL-terminated string.
    let version = unsafe { std::ffi::CStr::from_ptr(((*base).GetVersionString)()) }
        .to_string_lossy()
        .into_owned();
    let minor = version
        .split('.')
        .nth(1)
        .and_then(|m| m.parse::<u32>().ok())
        .unwrap_or(0);
    if !version.starts_with("1.") || minor < MIN_MINOR_VERSION {
        return Err(format!(
            "version {version}, older than the 1.{MIN_MINOR_VERSION} this library needs"
        ));
    }
    Ok(version)
}

fn start(
    path: &Path,
    version: &str,
    opts: &RuntimeOptions,
) -> std::result::Result<Runtime, String> {
    let absolute = if path.is_absolute() {
        path.to_path_buf()
    } else if path.components().count() > 1 {
        std::env::current_dir()
            .map(|d| d.join(path))
            .unwrap_or_else(|_| path.to_path_buf())
    } else {
        path.to_path_buf()
    };
    let builder = ort::init_from(&absolute).map_err(|e| e.to_string())?;
    let mut builder = builder.with_name("libinfer").with_telemetry(false);
    if let Some((intra, inter)) = opts.global_threads {
        let pools = ort::environment::GlobalThreadPoolOptions::default()
            .with_intra_threads(intra as usize)
            .and_then(|p| p.with_inter_threads(inter as usize))
            .map_err(|e| format!("global thread pools: {e}"))?;
        builder = builder.with_global_thread_pool(pools);
    }
    // ONNX Runtime's own warnings and errors go to the logs of the servers using it
    // (`forward`); the rest is dropped.
    builder = builder.with_logger(std::sync::Arc::new(
        |level: ort::logging::LogLevel, _category: &str, _id: &str, _at: &str, msg: &str| {
            forward(level, msg)
        },
    ));
    let env = builder.build().map_err(|e| e.to_string())?;
    let providers = available_providers();
    let cuda = providers.iter().any(|p| p == "CUDAExecutionProvider");
    let shown = if absolute.is_absolute() {
        absolute.canonicalize().unwrap_or(absolute)
    } else {
        absolute
    };
    Ok(Runtime {
        path: shown,
        version: version.to_owned(),
        env,
        global_threads: opts.global_threads,
        cuda,
        providers,
    })
}

/// The execution providers the loaded ONNX Runtime was built with.
fn available_providers() -> Vec<String> {
    let mut list: *mut *mut std::ffi::c_char = std::ptr::null_mut();
    let mut n: std::ffi::c_int = 0;
    // SAFETY: the API table is ONNX Runtime's (loaded above); GetAvailableProviders fills
    // an array it owns, released below with ReleaseAvailableProviders.
    let status = unsafe { (ort::api().GetAvailableProviders)(&mut list, &mut n) };
    if !status.0.is_null() {
        // SAFETY: a non-null status is owned by the caller and released once.
        unsafe { (ort::api().ReleaseStatus)(status.0) };
        return Vec::new();
    }
    let mut out = Vec::with_capacity(n.max(0) as usize);
    for i in 0..n.max(0) as usize {
        // SAFETY: `list` has `n` NUL-terminated strings.
        let s = unsafe { std::ffi::CStr::from_ptr(*list.add(i)) };
        out.push(s.to_string_lossy().into_owned());
    }
    // SAFETY: the array from GetAvailableProviders, released once (with the status the
    // release returns).
    let status = unsafe { (ort::api().ReleaseAvailableProviders)(list, n) };
    if !status.0.is_null() {
        // SAFETY: as above.
        unsafe { (ort::api().ReleaseStatus)(status.0) };
    }
    out
}
