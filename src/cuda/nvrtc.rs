//! NVRTC (opened by `libs` for the driver in use): CUDA C++ source compiled into a CUBIN for
//! one compute capability.

use super::libs::NvrtcProgram;
use crate::status::{Error, Result};
use std::ffi::{c_char, c_int, CStr, CString};

/// The options every compile passes besides the architecture.
pub const OPTIONS: [&str; 2] = ["-default-device", "--std=c++17"];

/// The NVRTC `compile` uses, as one line for a cache key: version, and the file the loader
/// mapped with its size and modification time (so that a library replaced in place is
/// another NVRTC). `purpose` as for `compile`.
pub fn identity(purpose: &str) -> Result<String> {
    let rtc = super::libs::nvrtc()
        .map_err(|why| Error::unavailable(format!("NVRTC cannot be used: {why}; {purpose}")))?;
    let path = super::loaded_libraries()
        .into_iter()
        .find(|p| {
            p.rsplit('/')
                .next()
                .is_some_and(|f| f.starts_with("libnvrtc.so"))
        })
        .unwrap_or_else(|| rtc.file.to_string());
    let stamp = std::fs::metadata(&path)
        .map(|m| {
            let secs = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_secs());
            format!("{} bytes, modified {secs}", m.len())
        })
        .unwrap_or_default();
    Ok(format!(
        "NVRTC {}.{} {path} ({stamp})",
        rtc.version.0, rtc.version.1
    ))
}

/// Compiles the CUDA C++ `source` (named `name` in NVRTC's messages) for a device of
/// compute capability `cc` into a CUBIN. `purpose` says in the unavailable message what
/// the caller compiles with NVRTC.
pub fn compile(source: &str, name: &CStr, cc: (i32, i32), purpose: &str) -> Result<Vec<u8>> {
    let rtc = super::libs::nvrtc()
        .map_err(|why| Error::unavailable(format!("NVRTC cannot be used: {why}; {purpose}")))?;
    let src = CString::new(source).map_err(|_| Error::internal("kernel source has a NUL"))?;
    let failed = |r: c_int, what: &str| {
        Error::internal(format!(
            "{what} failed: {} ({})",
            rtc.error_name(r),
            rtc.file
        ))
    };
    let mut prog: NvrtcProgram = std::ptr::null_mut();
    // SAFETY: valid NUL-terminated strings and out-pointers.
    let r = unsafe {
        (rtc.create_program)(
            &mut prog,
            src.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if r != 0 {
        return Err(failed(r, "nvrtcCreateProgram"));
    }
    let arch = CString::new(format!("--gpu-architecture=sm_{}{}", cc.0, cc.1)).unwrap_or_default();
    let rest: Vec<CString> = OPTIONS
        .iter()
        .map(|o| CString::new(*o).unwrap_or_default())
        .collect();
    let opts: Vec<*const c_char> = std::iter::once(arch.as_ptr())
        .chain(rest.iter().map(|o| o.as_ptr()))
        .collect();
    // SAFETY: a live program; the options are NUL-terminated strings that outlive the
    // call; every out-pointer is valid; the program is destroyed below on every path.
    let result = unsafe {
        let compiled = (rtc.compile_program)(prog, opts.len() as c_int, opts.as_ptr());
        if compiled != 0 {
            let mut size = 0usize;
            (rtc.program_log_size)(prog, &mut size);
            let mut log = vec![0u8; size.max(1)];
            (rtc.program_log)(prog, log.as_mut_ptr() as *mut c_char);
            let log = String::from_utf8_lossy(&log)
                .trim_end_matches('\0')
                .to_owned();
            Err(Error::internal(format!(
                "NVRTC {}.{} ({}) could not compile {} for sm_{}{} ({}): {log}",
                rtc.version.0,
                rtc.version.1,
                rtc.file,
                name.to_string_lossy(),
                cc.0,
                cc.1,
                rtc.error_name(compiled)
            )))
        } else {
            let mut size = 0usize;
            let r = (rtc.cubin_size)(prog, &mut size);
            if r != 0 {
                Err(failed(r, "nvrtcGetCUBINSize"))
            } else {
                let mut cubin = vec![0u8; size];
                let r = (rtc.cubin)(prog, cubin.as_mut_ptr() as *mut c_char);
                if r != 0 {
                    Err(failed(r, "nvrtcGetCUBIN"))
                } else {
                    Ok(cubin)
                }
            }
        }
    };
    // SAFETY: the program made above, destroyed once.
    unsafe { (rtc.destroy_program)(&mut prog) };
    result
}
