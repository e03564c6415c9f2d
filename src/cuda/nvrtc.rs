//! NVRTC, loaded at run time like the driver: CUDA C++ source compiled into a CUBIN for
//! one compute capability.

use crate::status::{Error, Result};
use std::ffi::{c_char, CStr, CString};

/// Compiles the CUDA C++ `source` (named `name` in NVRTC's messages) for a device of
/// compute capability `cc` into a CUBIN. `purpose` says in the unavailable message what
/// the caller compiles with NVRTC.
pub fn compile(source: &str, name: &CStr, cc: (i32, i32), purpose: &str) -> Result<Vec<u8>> {
    use cudarc::nvrtc::sys as rtc;
    let guarded = std::panic::catch_unwind(|| {
        // SAFETY: only tries to dlopen the library.
        if !unsafe { rtc::is_culib_present() } {
            return Err(Error::unavailable(format!(
                "NVRTC (libnvrtc.so) was not found by the dynamic loader; {purpose}"
            )));
        }
        let src = CString::new(source).map_err(|_| Error::internal("kernel source has a NUL"))?;
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
                    "NVRTC could not compile {} for sm_{}{} ({compiled:?}): {log}",
                    name.to_string_lossy(),
                    cc.0,
                    cc.1
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
