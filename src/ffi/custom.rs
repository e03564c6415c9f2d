//! Custom backends: models computed by the embedding application through the C callbacks
//! of `infer_backend`. The library does all queueing and batching; the backend computes.
//! To the core a custom backend is one more [`Backend`].

use crate::backend::{Backend, Batch, ModelInstance};
use crate::config::ModelConfig;
use crate::status::{Code, Error, Result};
use std::ffi::{c_char, c_void, CString};
use std::sync::Arc;

/// The callbacks of a custom backend. `struct_size` must be `sizeof(infer_backend)`;
/// the struct only grows at the end, and fields past `struct_size` read as NULL.
/// `execute` is required; the others may be NULL.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy)]
pub struct infer_backend {
    pub struct_size: u32,
    /// Called once per instance before it serves; may set `*instance_state`.
    pub instance_init: Option<
        unsafe extern "C" fn(
            backend_user_data: *mut c_void,
            model_name: *const c_char,
            model_config_json: *const c_char,
            instance_index: u32,
            gpu_device: i32,
            instance_state: *mut *mut c_void,
        ) -> u32,
    >,
    /// Runs one batch (required). A non-OK status fails every request of the batch.
    pub execute:
        Option<unsafe extern "C" fn(instance_state: *mut c_void, batch: *mut Batch) -> u32>,
    /// Releases one instance's state.
    pub instance_fini: Option<unsafe extern "C" fn(instance_state: *mut c_void)>,
    /// Called once when the server no longer needs the backend.
    pub finalize: Option<unsafe extern "C" fn(backend_user_data: *mut c_void)>,
}

std::thread_local! {
    /// The message an `instance_init` running on this thread gave for its failure.
    static INIT_ERROR: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Records the message of the failing `instance_init` on this thread.
pub(crate) fn set_init_error(msg: String) {
    INIT_ERROR.with(|e| *e.borrow_mut() = Some(msg));
}

pub struct CustomBackend {
    name: String,
    callbacks: infer_backend,
    user_data: *mut c_void,
    /// Cleared when registration fails: the caller still owns `user_data` then, so
    /// `finalize` must not run.
    owns_user_data: std::sync::atomic::AtomicBool,
}

// SAFETY: the C API requires backend callbacks to be callable from any library thread;
// `user_data` is only passed back to them.
unsafe impl Send for CustomBackend {}
unsafe impl Sync for CustomBackend {}

impl CustomBackend {
    /// Copies the callbacks the caller's struct declares (by `struct_size`).
    ///
    /// # Safety
    /// `b` must point to at least `b.struct_size` readable bytes.
    pub unsafe fn from_c(
        name: &str,
        b: *const infer_backend,
        user_data: *mut c_void,
    ) -> Result<Self> {
        // SAFETY: the struct starts with its u32 struct_size (this function's contract).
        let declared = unsafe { std::ptr::read_unaligned(b as *const u32) } as usize;
        let need = std::mem::offset_of!(infer_backend, execute) + std::mem::size_of::<usize>();
        if declared < need {
            return Err(Error::invalid(format!(
                "backend '{name}': struct_size {declared} is too small (at least {need}); set it to sizeof(infer_backend)"
            )));
        }
        // Only fields that lie wholly within the caller's struct are read.
        let src = b as *const u8;
        let field = |offset: usize| -> Option<usize> {
            (offset + std::mem::size_of::<usize>() <= declared)
                // SAFETY: the field lies within the `declared` bytes the caller's struct has.
                .then(|| unsafe { std::ptr::read_unaligned(src.add(offset) as *const usize) })
        };
        use std::mem::{offset_of, transmute};
        // SAFETY: each value is a function pointer (or 0 for NULL) the caller stored in a
        // field of this type; Option<fn> has the same layout as a nullable pointer.
        let callbacks = infer_backend {
            struct_size: declared as u32,
            instance_init: field(offset_of!(infer_backend, instance_init))
                .and_then(|p| unsafe { transmute(p) }),
            execute: field(offset_of!(infer_backend, execute))
                .and_then(|p| unsafe { transmute(p) }),
            instance_fini: field(offset_of!(infer_backend, instance_fini))
                .and_then(|p| unsafe { transmute(p) }),
            finalize: field(offset_of!(infer_backend, finalize))
                .and_then(|p| unsafe { transmute(p) }),
        };
        if callbacks.execute.is_none() {
            return Err(Error::invalid(format!(
                "backend '{name}': execute must not be NULL"
            )));
        }
        Ok(CustomBackend {
            name: name.to_owned(),
            callbacks,
            user_data,
            owns_user_data: std::sync::atomic::AtomicBool::new(true),
        })
    }

    /// Gives `user_data` back to the caller: `finalize` will not be called.
    pub fn release_user_data(&self) {
        self.owns_user_data
            .store(false, std::sync::atomic::Ordering::Release);
    }
}

impl Drop for CustomBackend {
    fn drop(&mut self) {
        if let Some(f) = self.callbacks.finalize {
            if self
                .owns_user_data
                .load(std::sync::atomic::Ordering::Acquire)
            {
                unsafe { f(self.user_data) };
            }
        }
    }
}

struct CustomInstance {
    backend: Arc<CustomBackend>,
    state: *mut c_void,
    model: String,
}

// SAFETY: an instance is driven by one worker thread at a time; the C API tells backend
// authors that instance callbacks may run on any library thread.
unsafe impl Send for CustomInstance {}

impl Backend for CustomBackend {
    /// The application's code decides where it computes; on a GPU instance it gets device
    /// memory and the instance's stream (C API section 10).
    fn runs_on_gpu(&self) -> bool {
        true
    }

    fn create_instance(
        self: Arc<Self>,
        config: &Arc<ModelConfig>,
        index: u32,
        gpu: i32,
    ) -> Result<Box<dyn ModelInstance>> {
        let mut state: *mut c_void = std::ptr::null_mut();
        if let Some(init) = self.callbacks.instance_init {
            let name = CString::new(config.name.as_str()).unwrap_or_default();
            let json = CString::new(config.json.as_str()).unwrap_or_default();
            INIT_ERROR.with(|e| e.borrow_mut().take());
            let rc = unsafe {
                init(
                    self.user_data,
                    name.as_ptr(),
                    json.as_ptr(),
                    index,
                    gpu,
                    &mut state,
                )
            };
            let message = INIT_ERROR.with(|e| e.borrow_mut().take());
            if rc != 0 {
                let code = match Code::from_u32(rc) {
                    Some(Code::Ok) | None => Code::Internal,
                    Some(c) => c,
                };
                let why = message.map_or_else(String::new, |m| format!(": {m}"));
                return Err(Error::new(
                    code,
                    format!(
                        "backend '{}': instance_init of instance {index} of model '{}' failed with {}{why}",
                        self.name,
                        config.name,
                        code.as_str()
                    ),
                ));
            }
        }
        Ok(Box::new(CustomInstance {
            backend: self,
            state,
            model: config.name.clone(),
        }))
    }
}

impl ModelInstance for CustomInstance {
    fn execute(&mut self, batch: &mut Batch) -> Result<()> {
        let Some(exec) = self.backend.callbacks.execute else {
            return Err(Error::internal("execute callback missing"));
        };
        let rc = unsafe { exec(self.state, batch as *mut Batch) };
        if rc == 0 {
            return Ok(());
        }
        let code = match Code::from_u32(rc) {
            Some(Code::Ok) | None => Code::Internal,
            Some(c) => c,
        };
        let msg = batch.error_message.take().unwrap_or_else(|| {
            format!(
                "backend '{}': execute for model '{}' failed with {}",
                self.backend.name,
                self.model,
                Code::from_u32(rc).map_or("an unknown status", |c| c.as_str())
            )
        });
        Err(Error::new(code, msg))
    }
}

impl Drop for CustomInstance {
    fn drop(&mut self) {
        if let Some(f) = self.backend.callbacks.instance_fini {
            unsafe { f(self.state) };
        }
    }
}
