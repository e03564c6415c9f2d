//! Log messages go to the application's callback (set on the server options), or to
//! stderr for errors and warnings when there is none.

use std::sync::Arc;

pub(crate) const LEVEL_ERROR: u32 = 1;
pub(crate) const LEVEL_WARN: u32 = 2;
pub(crate) const LEVEL_INFO: u32 = 3;

/// Where log messages go: the application's callback (the C API wraps its function and
/// user data in one), called with the level and the message from any library thread.
pub type LogSink = dyn Fn(u32, &str) + Send + Sync;

/// Cheap to clone; shared by the server and its models.
#[derive(Clone)]
pub struct Logger {
    sink: Option<Arc<LogSink>>,
    min_level: u32,
}

impl Default for Logger {
    fn default() -> Self {
        Logger {
            sink: None,
            min_level: LEVEL_WARN,
        }
    }
}

impl Logger {
    /// Messages up to `min_level` go to `sink`.
    pub fn new(sink: Arc<LogSink>, min_level: u32) -> Logger {
        Logger {
            sink: Some(sink),
            min_level,
        }
    }

    pub fn log(&self, level: u32, msg: &str) {
        if level > self.min_level {
            return;
        }
        match &self.sink {
            Some(sink) => {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sink(level, msg)));
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
