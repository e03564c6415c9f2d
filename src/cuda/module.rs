//! Compiled kernels loaded into a context: a CUBIN's functions, looked up by name once,
//! launched by index.

use super::driver::Context;
use crate::status::{Error, Result};
use cudarc::driver::sys as cu;
use std::ffi::{c_void, CStr};
use std::sync::Arc;

fn cu_check(r: cu::CUresult, what: &str) -> Result<()> {
    super::driver::check(r, what)
}

/// A CUBIN loaded into one context, with the functions asked for at load.
pub struct Module {
    raw: cu::CUmodule,
    funcs: Vec<cu::CUfunction>,
    ctx: Arc<Context>,
}

// SAFETY: module and function handles are usable from any thread with the context bound.
unsafe impl Send for Module {}
// SAFETY: as above; the module is never changed after load.
unsafe impl Sync for Module {}

impl Drop for Module {
    fn drop(&mut self) {
        let _bound = super::driver::ScopedBind::for_cleanup(&self.ctx);
        // SAFETY: loaded once, unloaded once.
        unsafe { cu::cuModuleUnload(self.raw) };
    }
}

impl Module {
    /// Loads `cubin` into `ctx` (which must be bound) and looks up `names`; function `i`
    /// of [`Module::launch`] is `names[i]`.
    pub fn load(ctx: &Arc<Context>, cubin: &[u8], names: &[&CStr]) -> Result<Module> {
        let mut raw: cu::CUmodule = std::ptr::null_mut();
        // SAFETY: a CUBIN for this device's architecture; context bound.
        cu_check(
            unsafe { cu::cuModuleLoadData(&mut raw, cubin.as_ptr() as *const c_void) },
            "cuModuleLoadData",
        )?;
        let mut funcs = Vec::with_capacity(names.len());
        for name in names {
            let mut f: cu::CUfunction = std::ptr::null_mut();
            // SAFETY: a loaded module and a NUL-terminated name.
            let r = unsafe { cu::cuModuleGetFunction(&mut f, raw, name.as_ptr()) };
            if let Err(e) = cu_check(r, &format!("cuModuleGetFunction({name:?})")) {
                // SAFETY: loaded above, unloaded once.
                unsafe { cu::cuModuleUnload(raw) };
                return Err(e);
            }
            funcs.push(f);
        }
        Ok(Module {
            raw,
            funcs,
            ctx: ctx.clone(),
        })
    }

    /// Launches function `index` with a one-dimensional grid of `blocks` blocks of
    /// `threads` threads on `stream`, passing `params` (one pointer per kernel parameter;
    /// the driver copies the values at launch).
    ///
    /// # Safety
    /// `stream` must be a live stream of this module's context; `params` must match the
    /// kernel's parameters, and the addresses they carry must hold what the kernel reads
    /// and writes until the stream has run it.
    pub unsafe fn launch(
        &self,
        index: usize,
        blocks: u32,
        threads: u32,
        params: &mut [*mut c_void],
        stream: cu::CUstream,
    ) -> Result<()> {
        let f = *self
            .funcs
            .get(index)
            .ok_or_else(|| Error::internal(format!("kernel {index} is not loaded")))?;
        // SAFETY: the caller's contract above.
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
