//! What the executor needs from CUDA besides memory and streams: the kernels (compiled
//! with NVRTC once per device and loaded once per device's context), kernel launches,
//! and cuBLAS for GEMMs. NVRTC and cuBLAS are loaded at run time like the driver; where
//! they are missing, loading a model on KIND_GPU fails with UNAVAILABLE and the reason.

use super::kargs::{KArgs, Kernel};
use crate::cuda::driver::{Context, DevicePtr};
use crate::status::{Error, Result};
use cudarc::driver::sys as cu;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CString};
use std::sync::{Arc, OnceLock};

/// The kernel source (one file; see its header).
pub const SOURCE: &str = include_str!("kernels.cu");

fn cu_check(r: cu::CUresult, what: &str) -> Result<()> {
    crate::cuda::probe::check(r, what).map_err(Error::internal)
}

/// Compiles the kernels for a device of compute capability `cc` into a CUBIN.
pub fn compile(cc: (i32, i32)) -> Result<Vec<u8>> {
    use cudarc::nvrtc::sys as rtc;
    let guarded = std::panic::catch_unwind(|| {
        // SAFETY: only tries to dlopen the library.
        if !unsafe { rtc::is_culib_present() } {
            return Err(Error::unavailable(
                "NVRTC (libnvrtc.so) was not found by the dynamic loader; the GPU executor compiles its kernels with it",
            ));
        }
        let src = CString::new(SOURCE).map_err(|_| Error::internal("kernel source has a NUL"))?;
        let name = c"kernels.cu";
        let mut prog: rtc::nvrtcProgram = std::ptr::null_mut();
        let ok = |r: rtc::nvrtcResult, what: &str| {
            if r == rtc::nvrtcResult::NVRTC_SUCCESS {
                Ok(())
            } else {
                Err(Error::internal(format!("{what} failed: {r:?}")))
            }
        };
        // SAFETY: valid NUL-terminated strings and out-pointers throughout; the
        // program is destroyed on every path below.
        unsafe {
            ok(
                rtc::nvrtcCreateProgram(
                    &mut prog,
                    src.as_ptr(),
                    name.as_ptr(),
                    0,
                    std::ptr::null(),
                    std::ptr::null(),
                ),
                "nvrtcCreateProgram",
            )?;
            let arch =
                CString::new(format!("--gpu-architecture=sm_{}{}", cc.0, cc.1)).unwrap_or_default();
            let opts: [*const c_char; 3] = [
                arch.as_ptr(),
                c"-default-device".as_ptr(),
                c"--std=c++17".as_ptr(),
            ];
            let compiled = rtc::nvrtcCompileProgram(prog, opts.len() as i32, opts.as_ptr());
            let result = if compiled != rtc::nvrtcResult::NVRTC_SUCCESS {
                let mut size = 0usize;
                rtc::nvrtcGetProgramLogSize(prog, &mut size);
                let mut log = vec![0u8; size.max(1)];
                rtc::nvrtcGetProgramLog(prog, log.as_mut_ptr() as *mut c_char);
                let log = String::from_utf8_lossy(&log)
                    .trim_end_matches('\0')
                    .to_owned();
                Err(Error::internal(format!(
                    "NVRTC could not compile the kernels for sm_{}{} ({compiled:?}): {log}",
                    cc.0, cc.1
                )))
            } else {
                let mut size = 0usize;
                ok(rtc::nvrtcGetCUBINSize(prog, &mut size), "nvrtcGetCUBINSize").and_then(|()| {
                    let mut cubin = vec![0u8; size];
                    ok(
                        rtc::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char),
                        "nvrtcGetCUBIN",
                    )
                    .map(|()| cubin)
                })
            };
            rtc::nvrtcDestroyProgram(&mut prog);
            result
        }
    });
    guarded.unwrap_or_else(|_| {
        Err(Error::unavailable(
            "NVRTC could not be used (a symbol is missing)",
        ))
    })
}

/// The kernels, loaded into one device's context.
pub struct Module {
    raw: cu::CUmodule,
    funcs: HashMap<Kernel, cu::CUfunction>,
    _ctx: Arc<Context>,
}

// SAFETY: module and function handles are usable from any thread with the context bound.
unsafe impl Send for Module {}
unsafe impl Sync for Module {}

impl Drop for Module {
    fn drop(&mut self) {
        let _ = self._ctx.bind();
        // SAFETY: loaded once, unloaded once.
        unsafe { cu::cuModuleUnload(self.raw) };
    }
}

/// Compiled CUBINs by compute capability, and loaded modules by device.
type Cubins = Mutex<HashMap<(i32, i32), Arc<Vec<u8>>>>;
static CUBINS: OnceLock<Cubins> = OnceLock::new();
static MODULES: OnceLock<Mutex<HashMap<i32, Arc<Module>>>> = OnceLock::new();

/// The kernels on GPU `ctx` (compiled and loaded on first use; the context must be bound).
pub fn module(ctx: &Arc<Context>, cc: (i32, i32)) -> Result<Arc<Module>> {
    let modules = MODULES.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(m) = modules.lock().get(&ctx.ordinal()) {
        return Ok(m.clone());
    }
    let cubins = CUBINS.get_or_init(|| Mutex::new(HashMap::new()));
    let cached = cubins.lock().get(&cc).cloned();
    let cubin = match cached {
        Some(c) => c,
        None => {
            let c = Arc::new(compile(cc)?);
            cubins.lock().insert(cc, c.clone());
            c
        }
    };
    let mut raw: cu::CUmodule = std::ptr::null_mut();
    // SAFETY: a CUBIN from NVRTC for this device's architecture; context bound.
    cu_check(
        unsafe { cu::cuModuleLoadData(&mut raw, cubin.as_ptr() as *const c_void) },
        "cuModuleLoadData",
    )?;
    let mut funcs = HashMap::new();
    for k in Kernel::ALL {
        let mut f: cu::CUfunction = std::ptr::null_mut();
        // SAFETY: a loaded module and a NUL-terminated name.
        let r = unsafe { cu::cuModuleGetFunction(&mut f, raw, k.name().as_ptr()) };
        if let Err(e) = cu_check(r, &format!("cuModuleGetFunction({:?})", k.name())) {
            // SAFETY: loaded above.
            unsafe { cu::cuModuleUnload(raw) };
            return Err(e);
        }
        funcs.insert(k, f);
    }
    let m = Arc::new(Module {
        raw,
        funcs,
        _ctx: ctx.clone(),
    });
    modules.lock().insert(ctx.ordinal(), m.clone());
    Ok(m)
}

impl Module {
    /// Launches kernel `k` over `a.n` work items on `stream`, with the geometry of
    /// `Kernel::geometry`.
    ///
    /// # Safety
    /// `stream` must be a live stream of this module's context, and the addresses in `a`
    /// must hold what the kernel reads and writes until the stream has run it.
    pub unsafe fn launch(&self, k: Kernel, a: &KArgs, stream: cu::CUstream) -> Result<()> {
        if a.n <= 0 {
            return Ok(());
        }
        let f = *self
            .funcs
            .get(&k)
            .ok_or_else(|| Error::internal(format!("kernel {:?} is not loaded", k.name())))?;
        let (blocks, threads) = k.geometry(a);
        let mut arg = *a;
        let mut params: [*mut c_void; 1] = [&mut arg as *mut KArgs as *mut c_void];
        // SAFETY: the kernel takes one infer_kargs by value; the driver copies it at launch.
        cu_check(
            unsafe {
                cu::cuLaunchKernel(
                    f,
                    blocks,
                    1,
                    1,
                    threads,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "cuLaunchKernel",
        )
    }
}

/// A cuBLAS handle bound to one stream.
pub struct Blas {
    handle: cudarc::cublas::sys::cublasHandle_t,
}

// SAFETY: used by one instance's worker thread at a time.
unsafe impl Send for Blas {}

/// A column-major GEMM, as cuBLAS takes it (see the plan for the row-major mapping).
#[derive(Clone, Debug)]
pub struct GemmArgs {
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub lda: i32,
    pub ldb: i32,
    pub ldc: i32,
    pub stride_a: i64,
    pub stride_b: i64,
    pub stride_c: i64,
    pub batch: i32,
    pub alpha: f32,
    pub beta: f32,
    /// Element type of A, B and C (`Dt::float_code`: 0 f32, 1 f16, 2 bf16). FP16 and
    /// BF16 accumulate in FP32 on tensor cores.
    pub dt: i64,
}

impl Blas {
    /// A handle on `stream` (the context must be bound). `tf32` allows TF32 tensor-core
    /// math for FP32 GEMMs.
    pub fn new(stream: cu::CUstream, tf32: bool) -> Result<Blas> {
        use cudarc::cublas::sys as b;
        let made = std::panic::catch_unwind(|| {
            // SAFETY: only tries to dlopen the library.
            if !unsafe { b::is_culib_present() } {
                return Err(Error::unavailable(
                    "cuBLAS (libcublas.so) was not found by the dynamic loader; the GPU executor runs GEMMs with it",
                ));
            }
            let mut handle: b::cublasHandle_t = std::ptr::null_mut();
            let st = |r: b::cublasStatus_t, what: &str| {
                if r == b::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                    Ok(())
                } else {
                    Err(Error::internal(format!("{what} failed: {r:?}")))
                }
            };
            // SAFETY: valid out-pointer; stream of the bound context.
            unsafe {
                st(b::cublasCreate_v2(&mut handle), "cublasCreate")?;
                let blas = Blas { handle };
                st(
                    b::cublasSetStream_v2(handle, stream as b::cudaStream_t),
                    "cublasSetStream",
                )?;
                let mode = if tf32 {
                    b::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH
                } else {
                    b::cublasMath_t::CUBLAS_DEFAULT_MATH
                };
                st(b::cublasSetMathMode(handle, mode), "cublasSetMathMode")?;
                Ok(blas)
            }
        });
        made.unwrap_or_else(|_| {
            Err(Error::unavailable(
                "cuBLAS could not be used (a symbol is missing)",
            ))
        })
    }

    /// C = alpha op(A) op(B) + beta C on the handle's stream (column-major): FP32 through
    /// cublasSgemmStridedBatched (TF32 when the handle allows it), FP16 and BF16 through
    /// cublasGemmStridedBatchedEx with FP32 accumulation (tensor cores).
    pub fn gemm(&self, g: &GemmArgs, a: DevicePtr, b: DevicePtr, c: DevicePtr) -> Result<()> {
        use cudarc::cublas::sys as bl;
        if g.m == 0 || g.n == 0 || g.batch == 0 {
            return Ok(()); // an empty result
        }
        let op = |t: bool| {
            if t {
                bl::cublasOperation_t::CUBLAS_OP_T
            } else {
                bl::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let (r, what) = match g.dt {
            0 => (
                // SAFETY: the plan sized every operand; device addresses of this context.
                unsafe {
                    bl::cublasSgemmStridedBatched(
                        self.handle,
                        op(g.trans_a),
                        op(g.trans_b),
                        g.m,
                        g.n,
                        g.k,
                        &g.alpha,
                        a as *const f32,
                        g.lda,
                        g.stride_a,
                        b as *const f32,
                        g.ldb,
                        g.stride_b,
                        &g.beta,
                        c as *mut f32,
                        g.ldc,
                        g.stride_c,
                        g.batch,
                    )
                },
                "cublasSgemmStridedBatched",
            ),
            1 | 2 => {
                let ty = if g.dt == 1 {
                    bl::cudaDataType::CUDA_R_16F
                } else {
                    bl::cudaDataType::CUDA_R_16BF
                };
                (
                    // SAFETY: as above; alpha and beta are f32 for a 32F compute type.
                    unsafe {
                        bl::cublasGemmStridedBatchedEx(
                            self.handle,
                            op(g.trans_a),
                            op(g.trans_b),
                            g.m,
                            g.n,
                            g.k,
                            &g.alpha as *const f32 as *const c_void,
                            a as *const c_void,
                            ty,
                            g.lda,
                            g.stride_a,
                            b as *const c_void,
                            ty,
                            g.ldb,
                            g.stride_b,
                            &g.beta as *const f32 as *const c_void,
                            c as *mut c_void,
                            ty,
                            g.ldc,
                            g.stride_c,
                            g.batch,
                            bl::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                            bl::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                        )
                    },
                    "cublasGemmStridedBatchedEx",
                )
            }
            other => {
                return Err(Error::internal(format!(
                    "a GEMM of element type code {other}"
                )))
            }
        };
        if r == bl::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            Ok(())
        } else {
            Err(Error::internal(format!("{what} failed: {r:?}")))
        }
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        unsafe { cudarc::cublas::sys::cublasDestroy_v2(self.handle) };
    }
}

/// An instantiated CUDA graph: a plan's launches captured from a stream, replayed with one
/// launch.
pub struct CudaGraph {
    exec: cu::CUgraphExec,
    ctx: Arc<Context>,
}

// SAFETY: an executable graph may be launched from any thread with its context bound.
unsafe impl Send for CudaGraph {}

impl CudaGraph {
    /// Captures what `record` queues on `stream` (relaxed mode: other threads' CUDA calls
    /// are not affected) and instantiates it.
    ///
    /// # Safety
    /// `stream` must be a live stream of `ctx` that nothing else uses meanwhile; the
    /// addresses `record` queues work on must stay valid for every later launch.
    pub unsafe fn capture(
        ctx: &Arc<Context>,
        stream: cu::CUstream,
        record: impl FnOnce() -> Result<()>,
    ) -> Result<CudaGraph> {
        cu_check(
            cu::cuStreamBeginCapture_v2(
                stream,
                cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            ),
            "cuStreamBeginCapture",
        )?;
        let recorded = record();
        let mut graph: cu::CUgraph = std::ptr::null_mut();
        let ended = cu_check(
            cu::cuStreamEndCapture(stream, &mut graph),
            "cuStreamEndCapture",
        );
        let result = recorded.and(ended).and_then(|()| {
            let mut exec: cu::CUgraphExec = std::ptr::null_mut();
            cu_check(
                cu::cuGraphInstantiateWithFlags(&mut exec, graph, 0),
                "cuGraphInstantiateWithFlags",
            )
            .map(|()| CudaGraph {
                exec,
                ctx: ctx.clone(),
            })
        });
        if !graph.is_null() {
            cu::cuGraphDestroy(graph);
        }
        result
    }

    /// Queues the whole graph on `stream`.
    ///
    /// # Safety
    /// `stream` must be a live stream of the graph's context.
    pub unsafe fn launch(&self, stream: cu::CUstream) -> Result<()> {
        cu_check(cu::cuGraphLaunch(self.exec, stream), "cuGraphLaunch")
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: instantiated once, destroyed once.
        unsafe { cu::cuGraphExecDestroy(self.exec) };
    }
}
