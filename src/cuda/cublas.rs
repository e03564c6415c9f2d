//! cuBLAS (opened by `libs` for the driver in use): a handle bound to one stream and the
//! strided-batched GEMMs (FP32, FP16, BF16) run on it.

use super::driver::{DeviceMem, DevicePtr};
use super::libs::{self, BlasHandle, Cublas};
use crate::status::{Error, Result};
use cudarc::driver::sys;
use std::ffi::{c_int, c_void};

/// A cuBLAS handle bound to one stream.
pub struct Blas {
    lib: &'static Cublas,
    handle: BlasHandle,
    /// The handle's own workspace (`use_workspace`), dropped after the handle.
    workspace: Option<DeviceMem>,
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
        let lib = libs::cublas().map_err(|why| {
            Error::unavailable(format!(
                "cuBLAS cannot be used: {why}; the GPU executor runs GEMMs with it"
            ))
        })?;
        let mut handle: BlasHandle = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        let r = unsafe { (lib.create)(&mut handle) };
        if r != 0 {
            return Err(Error::unavailable(format!(
                "cublasCreate failed: {} ({} {}.{})",
                lib.status_name(r),
                lib.file,
                lib.version.0,
                lib.version.1
            )));
        }
        let mut blas = Blas {
            lib,
            handle,
            workspace: None,
        };
        blas.set_stream(stream)?;
        let mode = if tf32 {
            libs::CUBLAS_TF32_TENSOR_OP_MATH
        } else {
            libs::CUBLAS_DEFAULT_MATH
        };
        // SAFETY: a live handle.
        blas.check(
            unsafe { (lib.set_math_mode)(handle, mode) },
            "cublasSetMathMode",
        )?;
        Ok(blas)
    }

    fn check(&self, r: c_int, what: &str) -> Result<()> {
        if r == 0 {
            Ok(())
        } else {
            Err(Error::internal(format!(
                "{what} failed: {}",
                self.lib.status_name(r)
            )))
        }
    }

    /// Moves the handle to `stream` (of the handle's context). cublasSetStream puts the
    /// handle back on cuBLAS's own workspace, so the handle's workspace, if it has one, is
    /// given again.
    pub fn set_stream(&mut self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: a live handle; a stream of its context.
        let r = unsafe { (self.lib.set_stream)(self.handle, stream as *mut c_void) };
        self.check(r, "cublasSetStream")?;
        self.apply_workspace()
    }

    /// Gives the handle `mem` as the scratch memory of its GEMMs, kept with the handle.
    /// GEMMs captured into a CUDA graph need one: with cuBLAS's own workspace, the graph
    /// would use memory the handle may give back or hand to other work (cuBLAS's notes
    /// on CUDA graphs).
    pub fn use_workspace(&mut self, mem: DeviceMem) -> Result<()> {
        self.workspace = Some(mem);
        self.apply_workspace()
    }

    fn apply_workspace(&self) -> Result<()> {
        let Some(w) = &self.workspace else {
            return Ok(());
        };
        // SAFETY: a live handle; device memory of its context that lives as long.
        let r = unsafe { (self.lib.set_workspace)(self.handle, w.ptr() as *mut c_void, w.len()) };
        self.check(r, "cublasSetWorkspace")
    }

    /// C = alpha op(A) op(B) + beta C on the handle's stream (column-major): FP32 through
    /// cublasSgemmStridedBatched (TF32 when the handle allows it), FP16 and BF16 through
    /// cublasGemmStridedBatchedEx with FP32 accumulation (tensor cores).
    pub fn gemm(&self, g: &GemmArgs, a: DevicePtr, b: DevicePtr, c: DevicePtr) -> Result<()> {
        if g.m == 0 || g.n == 0 || g.batch == 0 {
            return Ok(()); // an empty result
        }
        let op = |t: bool| {
            if t {
                libs::CUBLAS_OP_T
            } else {
                libs::CUBLAS_OP_N
            }
        };
        let (r, what) = match g.dt {
            0 => (
                // SAFETY: the plan sized every operand; device addresses of this context.
                unsafe {
                    (self.lib.sgemm_strided_batched)(
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
                    libs::CUDA_R_16F
                } else {
                    libs::CUDA_R_16BF
                };
                (
                    // SAFETY: as above; alpha and beta are f32 for a 32F compute type.
                    unsafe {
                        (self.lib.gemm_strided_batched_ex)(
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
                            libs::CUBLAS_COMPUTE_32F,
                            libs::CUBLAS_GEMM_DEFAULT,
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
        self.check(r, what)
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        unsafe { (self.lib.destroy)(self.handle) };
    }
}
