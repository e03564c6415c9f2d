//! The CUDA room, every raw CUDA call of the library: whether this process can use NVIDIA
//! GPUs, and which ones (`probe`); the driver's contexts, streams, events and memory
//! (`driver`); loaded kernel modules (`module`); NVRTC (`nvrtc`), cuBLAS (`cublas`), the
//! choice of their files for the driver in use (`libs`) and CUDA graphs (`graph`). It imports nothing above `status` and `log`.
//!
//! The CUDA driver is loaded at run time (cudarc's dynamic loading), so the library builds
//! and runs where no CUDA is installed. The driver and its devices are probed once per
//! process, on the first server that asks (cuInit is process state); a server whose GPU
//! mode is OFF never asks, so it never loads the driver. The probe must never panic and
//! never abort: a missing driver, an old driver or a driver without devices is a reason,
//! not an error of the caller.
//!
//! Instances of any backend run on a GPU through `backend::gpu_instance`, which moves their
//! batches through pinned host memory and device memory on the instance's stream.
//! Responses whose request asked for GPU outputs get their host outputs copied to that
//! GPU before their callback (`server::outputs`).

pub mod cublas;
pub mod driver;
pub mod graph;
pub mod kernel_cache;
pub mod libs;
pub mod module;
pub mod nvrtc;
pub(crate) mod probe;

/// The driver's stream handle, as raw launches take it.
pub use cudarc::driver::sys::CUstream;
pub use driver::{Context, DeviceBuf, DevicePtr, MemoryPool, PinnedBuf, ScopedBind, Stream};
pub use probe::{DeviceInfo, GpuRuntime};

use std::sync::OnceLock;

/// GPU use, as `infer_server_options_set_gpu` sets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuMode {
    /// Use a GPU when present; run on the CPU otherwise (with a log line).
    Auto = 0,
    /// Never touch CUDA.
    Off = 1,
    /// `infer_server_new` fails with UNAVAILABLE when no GPU can be used.
    Required = 2,
}

/// What one server sees of the GPUs; fixed when the server is made. A copy is a word or
/// two (it points into the process-wide probe result), so requests carry it for free.
#[derive(Clone, Copy, Debug)]
pub enum GpuState {
    /// GPU use is OFF for this server: CUDA was never touched.
    Off,
    /// Probed and not usable, for this reason.
    Unavailable(&'static str),
    /// A driver and at least one device.
    Ready(&'static GpuRuntime),
}

/// The primary context of each device in use: one retain per device, shared by whatever
/// works there (instances, their streams, pools and modules, output placers, responses'
/// device buffers), and released with the last of them, so that a process whose servers
/// are all gone holds no GPU context (the driver keeps it while the application itself
/// retains it). The next user retains it again.
static CONTEXTS: parking_lot::Mutex<Vec<std::sync::Weak<Context>>> =
    parking_lot::Mutex::new(Vec::new());

/// The primary context of GPU `ordinal` (which the probe found); UNAVAILABLE once the
/// device has had a sticky fault.
pub fn context(ordinal: i32) -> crate::status::Result<std::sync::Arc<Context>> {
    if let Some(why) = driver::device_fault(ordinal) {
        return Err(crate::status::Error::unavailable(why));
    }
    let mut all = CONTEXTS.lock();
    let i = usize::try_from(ordinal)
        .map_err(|_| crate::status::Error::invalid(format!("GPU {ordinal} does not exist")))?;
    if all.len() <= i {
        all.resize(i + 1, std::sync::Weak::new());
    }
    if let Some(c) = all[i].upgrade() {
        return Ok(c);
    }
    let c = Context::retain(ordinal)?;
    all[i] = std::sync::Arc::downgrade(&c);
    Ok(c)
}

/// The CUDA libraries this process has loaded (the driver, NVRTC, cuBLAS), as the files
/// the loader mapped: their paths carry the versions ("libcublas.so.13.1.0.3"). Empty
/// where /proc/self/maps cannot be read.
pub fn loaded_libraries() -> Vec<String> {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return Vec::new();
    };
    let mut found: Vec<String> = Vec::new();
    for path in maps.lines().filter_map(|l| l.split_whitespace().nth(5)) {
        let file = path.rsplit('/').next().unwrap_or(path);
        let ours = [
            "libcuda.so",
            "libnvrtc.so",
            "libnvrtc-builtins",
            "libcublas.so",
            "libcublasLt.so",
        ]
        .iter()
        .any(|p| file.starts_with(p));
        if ours && !found.iter().any(|f| f == path) {
            found.push(path.to_owned());
        }
    }
    found
}

/// The process-wide probe result, computed on first use.
static PROBE: OnceLock<Result<GpuRuntime, Box<str>>> = OnceLock::new();

/// The CUDA major version of the driver the probe found (None before a probe, or when
/// it found none): the newest NVRTC and cuBLAS `libs` may open.
fn probed_driver_major() -> Option<i32> {
    match PROBE.get() {
        Some(Ok(runtime)) => Some(runtime.driver_version / 1000),
        _ => None,
    }
}

impl GpuState {
    /// The state for a server in `mode`; probes the driver (once per process) unless the
    /// mode is OFF.
    pub fn for_mode(mode: GpuMode) -> GpuState {
        if mode == GpuMode::Off {
            return GpuState::Off;
        }
        match PROBE.get_or_init(|| probe::probe().map_err(Box::from)) {
            Ok(runtime) => GpuState::Ready(runtime),
            Err(why) => GpuState::Unavailable(why),
        }
    }

    pub fn runtime(&self) -> Option<&'static GpuRuntime> {
        match *self {
            GpuState::Ready(runtime) => Some(runtime),
            _ => None,
        }
    }

    /// Why no GPU can be used ("" when one can), for error messages.
    pub fn why_not(&self) -> String {
        match self {
            GpuState::Off => {
                "GPU use is OFF for this server (infer_server_options_set_gpu)".to_owned()
            }
            GpuState::Unavailable(why) => format!("no usable GPU: {why}"),
            GpuState::Ready(_) => String::new(),
        }
    }

    /// Checks that GPU `device` exists; the error says why not (no GPU at all is
    /// UNAVAILABLE, a device id out of range INVALID_ARGUMENT).
    pub fn check_device(&self, device: i64) -> crate::status::Result<&'static GpuRuntime> {
        use crate::status::Error;
        let runtime = self
            .runtime()
            .ok_or_else(|| Error::unavailable(self.why_not()))?;
        let count = runtime.devices.len();
        if device < 0 || device as u64 >= count as u64 {
            return Err(Error::invalid(format!(
                "GPU {device} does not exist (this machine has {count}: ids 0 to {})",
                count - 1
            )));
        }
        Ok(runtime)
    }
}
