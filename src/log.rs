//! Log messages go to the application's callback (set on the server options), or to
//! stderr for errors and warnings when there is none.

use std::ffi::{c_char, c_void, CString};
use std::sync::Arc;

pub type LogFn = unsafe extern "C" fn(user_data: *mut c_void, level: u32, message: *const c_char);

pub(crate) const LEVEL_ERROR: u32 = 1;
pub(crate) const LEVEL_WARN: u32 = 2;
pub(crate) const LEVEL_INFO: u32 = 3;

#[derive(Clone, Copy)]
struct Sink {
    func: LogFn,
    user_data: *mut c_void,
}

/// Cheap to clone; shared by the server and its models.
#[derive(Clone)]
pub struct Logger {
    sink: Option<Arc<Sink>>,
    min_level: u32,
}

// SAFETY: the C API documents that the log callback may be called from any thread;
// `user_data` is only handed back to it.
unsafe impl Send for Sink {}
unsafe impl Sync for Sink {}

impl Default for Logger {
    fn default() -> Self {
        Logger {
            sink: None,
            min_level: LEVEL_WARN,
        }
    }
}

impl Logger {
    pub fn new(func: Option<LogFn>, user_data: *mut c_void, min_level: u32) -> Logger {
        Logger {
            sink: func.map(|func| Arc::new(Sink { func, user_data })),
            min_level,
        }
    }

    pub fn log(&self, level: u32, msg: &str) {
        if level > self.min_level {
            return;
        }
        match &self.sink {
            Some(s) => {
                let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
                let _ = std::panic::catch_unwind(|| unsafe {
                    (s.func)(s.user_data, level, c.as_ptr())
                });
            }
            None => {
                let tag = match level {
                    LEVEL_ERROR => "ERROR",
                    LEVEL_WARN => "WARN",
                    LEVEL_INFO => "INFO",
                    _ => "DEBUG",
                };
                eprintln!("libinfer {tag}: {msg}");
            }
        }
    }
    pub fn error(&self, msg: &str) {
        self.log(LEVEL_ERROR, msg)
    }
    pub fn warn(&self, msg: &str) {
        self.log(LEVEL_WARN, msg)
    }
    pub fn info(&self, msg: &str) {
        self.log(LEVEL_INFO, msg)
    }
}
