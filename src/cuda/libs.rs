//! NVRTC and cuBLAS, opened at run time. A CUDA library of major version N needs a
//! driver of CUDA N or newer (its CUBINs and its statically linked runtime do), so the
//! files are chosen by version, not by whichever name the loader finds first: for a
//! driver of CUDA D, `lib<name>.so.D`, then each older major down to 12, on the loader's
//! paths (`LD_LIBRARY_PATH`, the loader's cache: where the CUDA toolkit's packages and
//! Triton's images put them); then the unversioned `lib<name>.so` (a toolkit's
//! development link), taken only when the version it reports is one the driver runs.
//! Each library is opened once per process; the error says what was looked for and why
//! each file found was not taken.

use libloading::Library;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

static NVRTC: OnceLock<Result<Nvrtc, String>> = OnceLock::new();
static CUBLAS: OnceLock<Result<Cublas, String>> = OnceLock::new();

/// The oldest major version of NVRTC and cuBLAS taken.
const OLDEST_MAJOR: i32 = 12;

/// A library found and opened, with the version it reports.
struct Opened {
    lib: Library,
    /// The name or path it was opened by.
    file: String,
    version: (i32, i32),
}

/// Opens the newest `lib<stem>.so.N` that a driver of CUDA `driver_major` runs (any
/// major from 13 down when no driver was probed: compiling needs none). `version` reads
/// the version an opened file reports (None: not the library it claims to be).
fn open(
    stem: &str,
    driver_major: Option<i32>,
    version: impl Fn(&Library) -> Option<(i32, i32)>,
) -> Result<Opened, String> {
    let newest = driver_major.unwrap_or(13).max(OLDEST_MAJOR);
    let mut tried: Vec<String> = Vec::new();
    let mut names: Vec<String> = (OLDEST_MAJOR..=newest)
        .rev()
        .map(|major| format!("lib{stem}.so.{major}"))
        .collect();
    names.push(format!("lib{stem}.so"));
    for file in names {
        // SAFETY: opening a CUDA library runs its initializers, which have no
        // preconditions; the handle is kept for the life of the process.
        let lib = match unsafe { Library::new(&file) } {
            Ok(lib) => lib,
            Err(_) => continue, // not there: the common case, not worth listing
        };
        let Some(v) = version(&lib) else {
            tried.push(format!("{file} reports no version"));
            continue;
        };
        if v.0 < OLDEST_MAJOR {
            tried.push(format!("{file} is version {}.{}, older than 12", v.0, v.1));
            continue;
        }
        if let Some(d) = driver_major.filter(|&d| v.0 > d) {
            tried.push(format!(
                "{file} is version {}.{}, which needs a CUDA {} driver (this one is CUDA {d})",
                v.0, v.1, v.0
            ));
            continue;
        }
        return Ok(Opened {
            lib,
            file,
            version: v,
        });
    }
    let wanted = (OLDEST_MAJOR..=newest)
        .rev()
        .map(|m| format!("lib{stem}.so.{m}"))
        .collect::<Vec<_>>()
        .join(", ");
    let why = if tried.is_empty() {
        format!("none of {wanted} or lib{stem}.so is on the loader's paths")
    } else {
        format!(
            "none of {wanted} or lib{stem}.so that this driver runs is on the loader's paths ({})",
            tried.join("; ")
        )
    };
    Err(why)
}

/// Reads symbol `name` of `lib` as a function of type `F`.
///
/// # Safety
/// `F` must be the C signature of `name`.
unsafe fn sym<F: Copy>(lib: &Library, name: &str) -> Result<F, String> {
    // SAFETY: the caller names the symbol's true type.
    unsafe { lib.get::<F>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|_| format!("it has no {name}"))
}

/// The library's name for result code `r` (`name` is its nvrtcGetErrorString or
/// cublasGetStatusName: a static string, or NULL, for any value), or "`what` r".
fn code_name(name: unsafe extern "C" fn(c_int) -> *const c_char, r: c_int, what: &str) -> String {
    // SAFETY: returns a static string (or NULL) for any value.
    let p = unsafe { name(r) };
    if p.is_null() {
        return format!("{what} {r}");
    }
    // SAFETY: non-NULL and NUL-terminated.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The library in `cell`, loaded on first use by `load` for the driver the probe found
/// (any, before a probe).
fn loaded<T>(
    cell: &'static OnceLock<Result<T, String>>,
    load: fn(Option<i32>) -> Result<T, String>,
) -> Result<&'static T, &'static str> {
    cell.get_or_init(|| load(super::probed_driver_major()))
        .as_ref()
        .map_err(String::as_str)
}

// ---- NVRTC ----

pub(crate) type NvrtcProgram = *mut c_void;

/// NVRTC's functions (results are `nvrtcResult`, 0 for success).
pub(crate) struct Nvrtc {
    _lib: Library,
    pub file: String,
    pub version: (i32, i32),
    pub create_program: unsafe extern "C" fn(
        *mut NvrtcProgram,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> c_int,
    pub compile_program: unsafe extern "C" fn(NvrtcProgram, c_int, *const *const c_char) -> c_int,
    pub program_log_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> c_int,
    pub program_log: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> c_int,
    pub cubin_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> c_int,
    pub cubin: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> c_int,
    pub destroy_program: unsafe extern "C" fn(*mut NvrtcProgram) -> c_int,
    error_string: unsafe extern "C" fn(c_int) -> *const c_char,
}

impl Nvrtc {
    /// "NVRTC_ERROR_COMPILATION", or the number.
    pub fn error_name(&self, r: c_int) -> String {
        code_name(self.error_string, r, "NVRTC error")
    }
}

fn nvrtc_version(lib: &Library) -> Option<(i32, i32)> {
    type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;
    // SAFETY: nvrtcVersion(int *major, int *minor).
    let f = unsafe { sym::<VersionFn>(lib, "nvrtcVersion") }.ok()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: valid out-pointers.
    (unsafe { f(&mut major, &mut minor) } == 0).then_some((major, minor))
}

fn load_nvrtc(driver_major: Option<i32>) -> Result<Nvrtc, String> {
    let o = open("nvrtc", driver_major, nvrtc_version)?;
    let lib = &o.lib;
    let bad = |why: String| format!("{} cannot be used: {why}", o.file);
    // SAFETY: each type below is the symbol's C signature (nvrtc.h).
    unsafe {
        Ok(Nvrtc {
            create_program: sym(lib, "nvrtcCreateProgram").map_err(bad)?,
            compile_program: sym(lib, "nvrtcCompileProgram").map_err(bad)?,
            program_log_size: sym(lib, "nvrtcGetProgramLogSize").map_err(bad)?,
            program_log: sym(lib, "nvrtcGetProgramLog").map_err(bad)?,
            cubin_size: sym(lib, "nvrtcGetCUBINSize").map_err(bad)?,
            cubin: sym(lib, "nvrtcGetCUBIN").map_err(bad)?,
            destroy_program: sym(lib, "nvrtcDestroyProgram").map_err(bad)?,
            error_string: sym(lib, "nvrtcGetErrorString").map_err(bad)?,
            file: o.file,
            version: o.version,
            _lib: o.lib,
        })
    }
}

/// NVRTC, opened on first use for the driver the probe found (any, before a probe).
pub(crate) fn nvrtc() -> Result<&'static Nvrtc, &'static str> {
    loaded(&NVRTC, load_nvrtc)
}

// ---- cuBLAS ----

pub(crate) type BlasHandle = *mut c_void;

/// cublasOperation_t
pub(crate) const CUBLAS_OP_N: c_int = 0;
pub(crate) const CUBLAS_OP_T: c_int = 1;
/// cublasMath_t
pub(crate) const CUBLAS_DEFAULT_MATH: c_int = 0;
pub(crate) const CUBLAS_TF32_TENSOR_OP_MATH: c_int = 3;
/// cudaDataType
pub(crate) const CUDA_R_16F: c_int = 2;
pub(crate) const CUDA_R_16BF: c_int = 14;
/// cublasComputeType_t
pub(crate) const CUBLAS_COMPUTE_32F: c_int = 68;
/// cublasGemmAlgo_t
pub(crate) const CUBLAS_GEMM_DEFAULT: c_int = -1;

type SgemmStridedBatched = unsafe extern "C" fn(
    BlasHandle,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const f32,
    *const f32,
    c_int,
    i64,
    *const f32,
    c_int,
    i64,
    *const f32,
    *mut f32,
    c_int,
    i64,
    c_int,
) -> c_int;

type GemmStridedBatchedEx = unsafe extern "C" fn(
    BlasHandle,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const c_void,
    *const c_void,
    c_int,
    c_int,
    i64,
    *const c_void,
    c_int,
    c_int,
    i64,
    *const c_void,
    *mut c_void,
    c_int,
    c_int,
    i64,
    c_int,
    c_int,
    c_int,
) -> c_int;

/// cuBLAS's functions (results are `cublasStatus_t`, 0 for success).
pub(crate) struct Cublas {
    _lib: Library,
    pub file: String,
    pub version: (i32, i32),
    pub create: unsafe extern "C" fn(*mut BlasHandle) -> c_int,
    pub destroy: unsafe extern "C" fn(BlasHandle) -> c_int,
    pub set_stream: unsafe extern "C" fn(BlasHandle, *mut c_void) -> c_int,
    pub set_math_mode: unsafe extern "C" fn(BlasHandle, c_int) -> c_int,
    pub set_workspace: unsafe extern "C" fn(BlasHandle, *mut c_void, usize) -> c_int,
    pub sgemm_strided_batched: SgemmStridedBatched,
    pub gemm_strided_batched_ex: GemmStridedBatchedEx,
    status_name: unsafe extern "C" fn(c_int) -> *const c_char,
}

impl Cublas {
    /// "CUBLAS_STATUS_NOT_INITIALIZED", or the number.
    pub fn status_name(&self, r: c_int) -> String {
        code_name(self.status_name, r, "cuBLAS status")
    }
}

fn cublas_version(lib: &Library) -> Option<(i32, i32)> {
    type PropertyFn = unsafe extern "C" fn(c_int, *mut c_int) -> c_int;
    // SAFETY: cublasGetProperty(libraryPropertyType, int *value).
    let f = unsafe { sym::<PropertyFn>(lib, "cublasGetProperty") }.ok()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: valid out-pointers; 0 is MAJOR_VERSION, 1 MINOR_VERSION.
    let ok = unsafe { f(0, &mut major) == 0 && f(1, &mut minor) == 0 };
    ok.then_some((major, minor))
}

fn load_cublas(driver_major: Option<i32>) -> Result<Cublas, String> {
    let o = open("cublas", driver_major, cublas_version)?;
    let lib = &o.lib;
    let bad = |why: String| format!("{} cannot be used: {why}", o.file);
    // SAFETY: each type below is the symbol's C signature (cublas_api.h).
    unsafe {
        Ok(Cublas {
            create: sym(lib, "cublasCreate_v2").map_err(bad)?,
            destroy: sym(lib, "cublasDestroy_v2").map_err(bad)?,
            set_stream: sym(lib, "cublasSetStream_v2").map_err(bad)?,
            set_math_mode: sym(lib, "cublasSetMathMode").map_err(bad)?,
            set_workspace: sym(lib, "cublasSetWorkspace_v2").map_err(bad)?,
            sgemm_strided_batched: sym(lib, "cublasSgemmStridedBatched").map_err(bad)?,
            gemm_strided_batched_ex: sym(lib, "cublasGemmStridedBatchedEx").map_err(bad)?,
            status_name: sym(lib, "cublasGetStatusName").map_err(bad)?,
            file: o.file,
            version: o.version,
            _lib: o.lib,
        })
    }
}

/// cuBLAS, opened on first use for the driver the probe found.
pub(crate) fn cublas() -> Result<&'static Cublas, &'static str> {
    loaded(&CUBLAS, load_cublas)
}

/// "NVRTC 13.0 (libnvrtc.so.13), cuBLAS 13.1 (libcublas.so.13)": the libraries opened
/// so far ("" for none); opens nothing.
pub fn describe() -> String {
    let mut parts = Vec::new();
    if let Some(Ok(n)) = NVRTC.get() {
        parts.push(format!(
            "NVRTC {}.{} ({})",
            n.version.0, n.version.1, n.file
        ));
    }
    if let Some(Ok(b)) = CUBLAS.get() {
        parts.push(format!(
            "cuBLAS {}.{} ({})",
            b.version.0, b.version.1, b.file
        ));
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_lists_what_was_looked_for() {
        let e = open("infer-no-such-library", Some(13), |_| Some((13, 0)))
            .err()
            .unwrap_or_default();
        assert!(
            e.contains("libinfer-no-such-library.so.13")
                && e.contains("libinfer-no-such-library.so.12")
                && e.contains("loader's paths"),
            "{e}"
        );
    }
}
