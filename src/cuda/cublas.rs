//! cuBLAS, loaded at run time like the driver: a handle bound to one stream and the
//! strided-batched GEMMs (FP32, FP16, BF16) run on it.

use super::driver::DevicePtr;
use crate::status::{Error, Result};
use cudarc::driver::sys;
use std::ffi::c_void;

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
    /// Element type of A, B and C: 0 f32, 1 f16, 2 bf16. FP16 and
    /// BF16 accumulate in FP32 on tensor cores.
    pub dt: i64,
}

impl Blas {
    /// A handle on `stream` (the context must be bound). `tf32` allows TF32 tensor-core
    /// math for FP32 GEMMs.
    pub fn new(stream: sys::CUstream, tf32: bool) -> Result<Blas> {
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

    /// Moves the handle to `stream` (of the handle's context).
    pub fn set_stream(&mut self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: a live handle; a stream of its context.
        let r = unsafe {
            cudarc::cublas::sys::cublasSetStream_v2(
                self.handle,
                stream as cudarc::cublas::sys::cudaStream_t,
            )
        };
        if r == cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            Ok(())
        } else {
            Err(Error::internal(format!("cublasSetStream failed: {r:?}")))
        }
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
