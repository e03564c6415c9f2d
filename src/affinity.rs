//! Pinning worker threads to CPU cores (`instance_group { cpus: [ ... ] }`, a libinfer
//! extension). Linux only; elsewhere pinning is UNSUPPORTED.

use crate::status::{Error, Result};

/// CPU indices must be below this: the number of CPUs a `cpu_set_t` can name.
#[cfg(target_os = "linux")]
pub(crate) const MAX_CPUS: u32 = libc::CPU_SETSIZE as u32;
/// CPU indices must be below this (Linux's `CPU_SETSIZE`, for the same configs to validate
/// everywhere).
#[cfg(not(target_os = "linux"))]
pub(crate) const MAX_CPUS: u32 = 1024;

#[cfg(target_os = "linux")]
mod imp {
    use super::MAX_CPUS;
    use crate::status::{Error, Result};
    use std::mem::size_of;

    fn cpu_set(cpus: &[u32]) -> Result<libc::cpu_set_t> {
        // SAFETY: cpu_set_t is a plain bit array; all zeroes is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a valid cpu_set_t.
        unsafe { libc::CPU_ZERO(&mut set) };
        for &cpu in cpus {
            if cpu >= MAX_CPUS {
                return Err(Error::invalid(format!(
                    "CPU {cpu} is out of range (CPU indices must be < {MAX_CPUS})"
                )));
            }
            // SAFETY: `cpu` < CPU_SETSIZE, so the bit is inside `set`.
            unsafe { libc::CPU_SET(cpu as usize, &mut set) };
        }
        Ok(set)
    }

    /// The CPUs the calling thread may run on.
    pub(crate) fn current_cpus() -> Result<Vec<u32>> {
        // SAFETY: see cpu_set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a writable cpu_set_t of the size passed.
        let rc = unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            return Err(Error::internal(format!("sched_getaffinity failed: {e}")));
        }
        Ok((0..MAX_CPUS)
            // SAFETY: the index is < CPU_SETSIZE.
            .filter(|&c| unsafe { libc::CPU_ISSET(c as usize, &set) })
            .collect())
    }

    pub(crate) fn pin_current_thread(cpus: &[u32]) -> Result<()> {
        if cpus.is_empty() {
            return Ok(());
        }
        let set = cpu_set(cpus)?;
        // SAFETY: `set` is a valid cpu_set_t of the size passed; pid 0 = this thread.
        let rc = unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            return Err(Error::invalid(format!("sched_setaffinity failed: {e}")));
        }
        // The kernel silently drops CPUs that are offline or outside the cgroup's cpuset
        // as long as one listed CPU remains: check that the thread got every one.
        let got = current_cpus()?;
        if let Some(missing) = cpus.iter().find(|c| !got.contains(c)) {
            return Err(Error::invalid(format!(
                "CPU {missing} is not available (the thread's affinity became {got:?})"
            )));
        }
        Ok(())
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use crate::status::{Error, Result};

    fn unsupported() -> Error {
        Error::unsupported("CPU affinity (instance_group.cpus) is only supported on Linux")
    }

    pub(crate) fn current_cpus() -> Result<Vec<u32>> {
        Err(unsupported())
    }

    pub(crate) fn pin_current_thread(cpus: &[u32]) -> Result<()> {
        if cpus.is_empty() {
            return Ok(());
        }
        Err(unsupported())
    }
}

/// The CPUs the calling thread may run on (its affinity mask, inherited from the thread
/// that created it: for a process started under `taskset`, the cores given there).
pub(crate) fn current_cpus() -> Result<Vec<u32>> {
    imp::current_cpus()
}

/// Pins the calling thread to `cpus` (any of them; empty: nothing to do). Fails with
/// INVALID_ARGUMENT when a CPU is out of range, does not exist or is not allowed, and
/// with UNSUPPORTED on platforms other than Linux.
pub(crate) fn pin_current_thread(cpus: &[u32]) -> Result<()> {
    imp::pin_current_thread(cpus)
}

/// Checks, before any thread is started, that the calling thread (and so the threads it
/// starts) may run on every one of `cpus`.
pub(crate) fn check_allowed(cpus: &[u32]) -> Result<()> {
    if cpus.is_empty() {
        return Ok(());
    }
    if let Some(cpu) = cpus.iter().find(|&&c| c >= MAX_CPUS) {
        return Err(Error::invalid(format!(
            "CPU {cpu} is out of range (CPU indices must be < {MAX_CPUS})"
        )));
    }
    let allowed = current_cpus()?;
    match cpus.iter().find(|c| !allowed.contains(c)) {
        Some(cpu) => Err(Error::invalid(format!(
            "CPU {cpu} is not in this process's affinity mask {allowed:?}"
        ))),
        None => Ok(()),
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use crate::status::Code;

    #[test]
    fn affinity_pin_to_an_allowed_core() {
        let allowed = current_cpus().unwrap();
        assert!(!allowed.is_empty());
        let cpu = *allowed.last().unwrap();
        check_allowed(&[cpu]).unwrap();
        pin_current_thread(&[cpu]).unwrap();
        assert_eq!(current_cpus().unwrap(), vec![cpu]);
        // SAFETY: no preconditions.
        assert_eq!(unsafe { libc::sched_getcpu() }, cpu as i32);
        // Back to every allowed core (the test thread is the harness's).
        pin_current_thread(&allowed).unwrap();
        assert_eq!(current_cpus().unwrap(), allowed);
    }

    #[test]
    fn affinity_empty_list_is_a_no_op() {
        let before = current_cpus().unwrap();
        pin_current_thread(&[]).unwrap();
        check_allowed(&[]).unwrap();
        assert_eq!(current_cpus().unwrap(), before);
    }

    #[test]
    fn affinity_out_of_range_core_fails() {
        let before = current_cpus().unwrap();
        let e = pin_current_thread(&[MAX_CPUS]).unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(e.message.contains(&MAX_CPUS.to_string()), "{e}");
        let e = check_allowed(&[MAX_CPUS + 5]).unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(e.message.contains(&(MAX_CPUS + 5).to_string()), "{e}");
        assert_eq!(current_cpus().unwrap(), before);
    }

    #[test]
    fn affinity_core_outside_the_allowed_set_fails() {
        let allowed = current_cpus().unwrap();
        // The highest index a cpu_set_t can name: no test machine has it.
        let absent = MAX_CPUS - 1;
        assert!(!allowed.contains(&absent));
        let e = check_allowed(&[allowed[0], absent]).unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(e.message.contains(&absent.to_string()), "{e}");
        // Alone: the kernel refuses it.
        let e = pin_current_thread(&[absent]).unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
        assert_eq!(current_cpus().unwrap(), allowed);
        // With an allowed core: the kernel drops it silently, the check after catches it.
        let e = pin_current_thread(&[allowed[0], absent]).unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(e.message.contains(&absent.to_string()), "{e}");
        pin_current_thread(&allowed).unwrap();
    }
}
