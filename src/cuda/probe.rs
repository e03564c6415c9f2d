//! The driver and device probe. Every CUDA call here goes through cudarc's `sys` layer,
//! whose first use loads libcuda; a missing library or symbol panics inside cudarc, so
//! the probe first asks whether the library loads at all and then runs under
//! `catch_unwind` as a second guard.

use cudarc::driver::result::device;
use cudarc::driver::sys;
use std::ffi::{c_char, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// The oldest driver this build works with: CUDA 12.0 (R525). The bindings are CUDA
/// 13.0's (cudarc's `cuda-13000` feature), and every driver function the library calls
/// has the same symbol in 12.0 drivers, except `cuEventElapsedTime_v2` (12.8), which
/// `driver::Event::elapsed_ms_since` resolves by the driver's version.
const DRIVER_API_NEEDED: i32 = 12000;

/// One device, as the driver describes it.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    pub total_memory: usize,
    pub multiprocessors: i32,
}

/// The driver and the devices it reports. Immutable after the probe; thread-safe.
#[derive(Debug)]
pub struct GpuRuntime {
    /// As `cuDriverGetVersion` reports it (e.g. 13000 for CUDA 13.0).
    pub driver_version: i32,
    /// At least one.
    pub devices: Vec<DeviceInfo>,
}

impl GpuRuntime {
    /// "CUDA driver 13.0, GPU 0: NVIDIA H100 (compute 9.0, 79.2 GiB, 132 SMs)".
    pub fn describe(&self) -> String {
        let mut s = format!("CUDA driver {}", api_version(self.driver_version));
        for d in &self.devices {
            s.push_str(&format!(
                ", GPU {}: {} (compute {}.{}, {:.1} GiB, {} SMs)",
                d.ordinal,
                d.name,
                d.compute_capability.0,
                d.compute_capability.1,
                d.total_memory as f64 / (1u64 << 30) as f64,
                d.multiprocessors
            ));
        }
        s
    }
}

fn api_version(v: i32) -> String {
    format!("{}.{}", v / 1000, v % 1000 / 10)
}

/// Probes the driver and its devices; the error is the reason no GPU can be used.
pub(super) fn probe() -> Result<GpuRuntime, String> {
    match catch_unwind(AssertUnwindSafe(probe_unguarded)) {
        Ok(result) => result,
        Err(payload) => {
            let why = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied())
                .unwrap_or("unknown failure");
            Err(format!("the CUDA driver could not be used: {why}"))
        }
    }
}

fn probe_unguarded() -> Result<GpuRuntime, String> {
    // SAFETY: only tries to dlopen the library; never panics.
    if !unsafe { sys::is_culib_present() } {
        return Err("no CUDA driver (libcuda.so.1 was not found by the dynamic loader)".into());
    }
    let mut version = 0;
    // SAFETY: the out-pointer is valid; the library is present (checked above).
    check(
        unsafe { sys::cuDriverGetVersion(&mut version) },
        "cuDriverGetVersion",
    )?;
    if version < DRIVER_API_NEEDED {
        return Err(format!(
            "the CUDA driver supports CUDA {}; this build needs {} or newer (driver R525 or later)",
            api_version(version),
            api_version(DRIVER_API_NEEDED)
        ));
    }
    // SAFETY: plain driver calls with valid out-pointers.
    check(unsafe { sys::cuInit(0) }, "cuInit")?;
    let mut count = 0;
    check(
        unsafe { sys::cuDeviceGetCount(&mut count) },
        "cuDeviceGetCount",
    )?;
    if count <= 0 {
        return Err("the CUDA driver reports no devices".into());
    }
    let mut devices = Vec::new();
    for ordinal in 0..count {
        let dev = device::get(ordinal).map_err(|e| format!("cuDeviceGet({ordinal}): {e}"))?;
        // SAFETY: `dev` came from cuDeviceGet; a failed query reads as -1 / 0.
        let attr = |a| unsafe { device::get_attribute(dev, a) }.unwrap_or(-1);
        use sys::CUdevice_attribute::*;
        devices.push(DeviceInfo {
            ordinal: ordinal as usize,
            name: device::get_name(dev).unwrap_or_else(|_| "unknown device".to_owned()),
            compute_capability: (
                attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
            ),
            total_memory: unsafe { device::total_mem(dev) }.unwrap_or(0),
            multiprocessors: attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        });
    }
    Ok(GpuRuntime {
        driver_version: version,
        devices,
    })
}

/// `what: CUDA_ERROR_NAME`, or Ok.
pub(crate) fn check(r: sys::CUresult, what: &str) -> Result<(), String> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string or fails.
    let known = unsafe { sys::cuGetErrorName(r, &mut name) } == sys::CUresult::CUDA_SUCCESS;
    if known && !name.is_null() {
        // SAFETY: non-NULL and NUL-terminated (a static string of the driver).
        let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
        Err(format!("{what} failed: {name}"))
    } else {
        Err(format!("{what} failed: {r:?}"))
    }
}
