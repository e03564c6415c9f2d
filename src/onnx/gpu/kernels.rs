//! The executor's kernels (kernels.cu): compiled with NVRTC once per compute capability,
//! loaded once per device's context, launched with their argument block. NVRTC is loaded
//! at run time like the driver; where it is missing, loading a model on KIND_GPU fails
//! with UNAVAILABLE and the reason.

use super::kargs::{KArgs, Kernel};
use crate::cuda::driver::Context;
use crate::cuda::module::Module;
use crate::cuda::CUstream;
use crate::status::Result;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

/// The kernel source (one file; see its header).
pub const SOURCE: &str = include_str!("kernels.cu");

/// Compiles the kernels for a device of compute capability `cc` into a CUBIN.
pub fn compile(cc: (i32, i32)) -> Result<Vec<u8>> {
    crate::cuda::nvrtc::compile(
        SOURCE,
        c"kernels.cu",
        cc,
        "the GPU executor compiles its kernels with it",
    )
}

/// The kernels, loaded into one device's context.
pub struct Kernels {
    module: Module,
}

/// Compiled CUBINs by compute capability, and loaded modules by device.
type Cubins = Mutex<HashMap<(i32, i32), Arc<Vec<u8>>>>;
static CUBINS: OnceLock<Cubins> = OnceLock::new();
static LOADED: OnceLock<Mutex<HashMap<i32, Arc<Kernels>>>> = OnceLock::new();

/// The kernels on GPU `ctx` (compiled and loaded on first use; the context must be bound).
pub fn kernels(ctx: &Arc<Context>, cc: (i32, i32)) -> Result<Arc<Kernels>> {
    let loaded = LOADED.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(m) = loaded.lock().get(&ctx.ordinal()) {
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
    let names: Vec<&std::ffi::CStr> = Kernel::ALL.iter().map(|k| k.name()).collect();
    let m = Arc::new(Kernels {
        module: Module::load(ctx, &cubin, &names)?,
    });
    loaded.lock().insert(ctx.ordinal(), m.clone());
    Ok(m)
}

impl Kernels {
    /// Launches kernel `k` over `a.n` work items on `stream`, with the geometry of
    /// `Kernel::geometry`.
    ///
    /// # Safety
    /// `stream` must be a live stream of this module's context, and the addresses in `a`
    /// must hold what the kernel reads and writes until the stream has run it.
    pub unsafe fn launch(&self, k: Kernel, a: &KArgs, stream: CUstream) -> Result<()> {
        if a.n <= 0 {
            return Ok(());
        }
        let (blocks, threads) = k.geometry(a);
        let mut arg = *a;
        let mut params: [*mut c_void; 1] = [&mut arg as *mut KArgs as *mut c_void];
        // SAFETY: every kernel takes one infer_kargs by value; function `k.index()` of the
        // module is `k` (loaded in `Kernel::ALL` order); the caller's contract above.
        unsafe {
            self.module
                .launch(k.index(), blocks, threads, &mut params, stream)
        }
    }
}
