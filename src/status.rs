//! Status codes and the library's error type.
//!
//! The numeric codes are part of the C ABI and are fixed forever; a retired value stays
//! reserved and is never reused.

use std::fmt;

/// A status code as it crosses the C boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Code {
    Ok = 0,
    InvalidArgument = 1,
    NotFound = 2,
    AlreadyExists = 3,
    Unavailable = 4,
    Unsupported = 5,
    Internal = 6,
    Cancelled = 7,
    DeadlineExceeded = 8,
    ResourceExhausted = 9,
}

impl Code {
    pub const ALL: [Code; 10] = [
        Code::Ok,
        Code::InvalidArgument,
        Code::NotFound,
        Code::AlreadyExists,
        Code::Unavailable,
        Code::Unsupported,
        Code::Internal,
        Code::Cancelled,
        Code::DeadlineExceeded,
        Code::ResourceExhausted,
    ];

    pub fn from_u32(v: u32) -> Option<Code> {
        Code::ALL.get(v as usize).copied()
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Code::Ok => "OK",
            Code::InvalidArgument => "INVALID_ARGUMENT",
            Code::NotFound => "NOT_FOUND",
            Code::AlreadyExists => "ALREADY_EXISTS",
            Code::Unavailable => "UNAVAILABLE",
            Code::Unsupported => "UNSUPPORTED",
            Code::Internal => "INTERNAL",
            Code::Cancelled => "CANCELLED",
            Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
            Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        }
    }

    /// The same name with a NUL terminator, for returning to C.
    pub fn as_cstr(self) -> &'static std::ffi::CStr {
        match self {
            Code::Ok => c"OK",
            Code::InvalidArgument => c"INVALID_ARGUMENT",
            Code::NotFound => c"NOT_FOUND",
            Code::AlreadyExists => c"ALREADY_EXISTS",
            Code::Unavailable => c"UNAVAILABLE",
            Code::Unsupported => c"UNSUPPORTED",
            Code::Internal => c"INTERNAL",
            Code::Cancelled => c"CANCELLED",
            Code::DeadlineExceeded => c"DEADLINE_EXCEEDED",
            Code::ResourceExhausted => c"RESOURCE_EXHAUSTED",
        }
    }
}

/// An error: a status code and a message that names what is at fault.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub code: Code,
    pub message: String,
}

impl Error {
    pub fn new(code: Code, message: impl Into<String>) -> Error {
        Error {
            code,
            message: message.into(),
        }
    }
    pub fn invalid(message: impl Into<String>) -> Error {
        Error::new(Code::InvalidArgument, message)
    }
    pub fn not_found(message: impl Into<String>) -> Error {
        Error::new(Code::NotFound, message)
    }
    pub fn unavailable(message: impl Into<String>) -> Error {
        Error::new(Code::Unavailable, message)
    }
    pub fn unsupported(message: impl Into<String>) -> Error {
        Error::new(Code::Unsupported, message)
    }
    pub fn internal(message: impl Into<String>) -> Error {
        Error::new(Code::Internal, message)
    }
    pub fn cancelled(message: impl Into<String>) -> Error {
        Error::new(Code::Cancelled, message)
    }
    pub fn deadline(message: impl Into<String>) -> Error {
        Error::new(Code::DeadlineExceeded, message)
    }
    pub fn exhausted(message: impl Into<String>) -> Error {
        Error::new(Code::ResourceExhausted, message)
    }

    /// The same error with `prefix` in front of the message.
    pub fn context(mut self, prefix: impl fmt::Display) -> Error {
        self.message = format!("{prefix}: {}", self.message);
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code.as_str(), self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a caught panic said (its `&str` or `String` payload).
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_stable() {
        for (i, c) in Code::ALL.iter().enumerate() {
            assert_eq!(*c as u32, i as u32);
            assert_eq!(Code::from_u32(i as u32), Some(*c));
            assert_eq!(c.as_cstr().to_str().unwrap(), c.as_str());
        }
        assert_eq!(Code::from_u32(10), None);
    }
}
