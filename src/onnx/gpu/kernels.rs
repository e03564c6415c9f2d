//! The executor's kernels (kernels.cu): compiled with NVRTC once per compute capability
//! (and kept on disk across processes: `crate::cuda::kernel_cache`), loaded once per
//! device's context, launched with their argument block. NVRTC is loaded
//! at run time like the driver; where it is missing, loading a model on KIND_GPU fails
//! with UNAVAILABLE and the reason.

use super::kargs::{KArgs, Kernel};
use crate::cuda::driver::Context;
use crate::cuda::kernel_cache::{self, KernelCache, KernelKey};
use crate::cuda::module::Module;
use crate::cuda::nvrtc;
use crate::cuda::CUstream;
use crate::status::Result;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, OnceLock, Weak};

/// The kernel source (one file; see its header).
pub const SOURCE: &str = include_str!("kernels.cu");

/// Compiles the kernels for a device of compute capability `cc` into a CUBIN.
pub fn compile(cc: (i32, i32)) -> Result<Vec<u8>> {
    nvrtc::compile(SOURCE, c"kernels.cu", cc, PURPOSE)
}

/// The kernels, loaded into one device's context.
pub struct Kernels {
    module: Module,
}

/// Compiled CUBINs by compute capability (each slot's lock is held while it compiles, so
/// loads that need the same kernels at once compile them once), and loaded modules by
/// device, for as long as an instance holds them: the module holds the device's context,
/// which goes back to the driver with the last instance there (and comes back, with the
/// module loaded again from the CUBIN kept here, with the next).
type Slot = Arc<Mutex<Option<Arc<Vec<u8>>>>>;
static CUBINS: OnceLock<Mutex<HashMap<(i32, i32), Slot>>> = OnceLock::new();
static LOADED: OnceLock<Mutex<HashMap<i32, Weak<Kernels>>>> = OnceLock::new();

const PURPOSE: &str = "the GPU executor compiles its kernels with it";

/// The CUBIN for `cc`: this process's, else the disk cache's
/// (`crate::cuda::kernel_cache`), else compiled now (and saved there). `refused`: the
/// driver refused the CUBIN given before, which is dropped and compiled again.
fn cubin(cc: (i32, i32), refused: bool) -> Result<Arc<Vec<u8>>> {
    let slot = CUBINS
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .entry(cc)
        .or_default()
        .clone();
    let mut slot = slot.lock();
    if refused {
        *slot = None;
    }
    if let Some(c) = slot.as_ref() {
        return Ok(c.clone());
    }
    let what = format!("GPU kernels for sm_{}{}", cc.0, cc.1);
    let c = match KernelCache::from_env() {
        Some(cache) => {
            let arch = format!("--gpu-architecture=sm_{}{}", cc.0, cc.1);
            let options: Vec<&str> = std::iter::once(arch.as_str())
                .chain(nvrtc::OPTIONS)
                .collect();
            let key = KernelKey {
                name: "kernels",
                source: SOURCE,
                options: &options,
                cc,
                nvrtc: nvrtc::identity(PURPOSE)?,
            };
            if refused {
                cache.discard(&key);
            }
            let (c, origin) = cache.get_or_compile(&key, || compile(cc))?;
            kernel_cache::record(&what, &origin);
            c
        }
        None => {
            let t = std::time::Instant::now();
            let c = compile(cc)?;
            kernel_cache::record_off(&what, t.elapsed().as_secs_f64());
            c
        }
    };
    let c = Arc::new(c);
    *slot = Some(c.clone());
    Ok(c)
}

/// The kernels on GPU `ctx` (compiled and loaded on first use; the context must be bound).
pub fn kernels(ctx: &Arc<Context>, cc: (i32, i32)) -> Result<Arc<Kernels>> {
    let loaded = LOADED.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(m) = loaded.lock().get(&ctx.ordinal()).and_then(Weak::upgrade) {
        return Ok(m);
    }
    let names: Vec<&std::ffi::CStr> = Kernel::ALL.iter().map(|k| k.name()).collect();
    let module = match Module::load(ctx, &cubin(cc, false)?, &names) {
        Ok(m) => m,
        // A CUBIN from the disk cache that this driver refuses (damaged, or made by an
        // NVRTC this driver does not take): compiled again, once.
        Err(_) => Module::load(ctx, &cubin(cc, true)?, &names)?,
    };
    let m = Arc::new(Kernels { module });
    loaded.lock().insert(ctx.ordinal(), Arc::downgrade(&m));
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
