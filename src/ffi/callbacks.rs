//! The application's C callbacks as the core takes them. A response or release callback
//! with its user data becomes an [`InlineFn`] (no allocation: one per request), whose
//! function here turns the Rust value into the C call, stops a foreign unwind at the
//! boundary, and counts the response callbacks running on this thread. The log and
//! iteration-statistics callbacks, set once, become closures.

use crate::callback::{InlineFn, Words};
use crate::request::{Response, ResponseSink};
use std::cell::Cell;
use std::ffi::{c_char, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// An application's response callback (`infer_response_fn` without its NULL).
pub(crate) type ResponseFn = unsafe extern "C" fn(*mut c_void, *mut Response, u32);
/// An application's release callback (`infer_release_fn` without its NULL).
pub(crate) type ReleaseFn = unsafe extern "C" fn(*mut c_void);

thread_local! {
    static IN_CALLBACK: Cell<u32> = const { Cell::new(0) };
}

/// True while the current thread runs an application's response callback (blocking
/// calls that would deadlock are refused there).
pub(crate) fn in_callback() -> bool {
    IN_CALLBACK.with(|c| c.get() > 0)
}

/// A response sink that calls `func(user_data, response, flags)`; the application owns
/// each response it is given.
pub(crate) fn response_sink(func: ResponseFn, user_data: *mut c_void) -> ResponseSink {
    let words: Words = [func as *mut (), user_data.cast()];
    // SAFETY: `call_response` reads the words back as exactly this function and its user
    // data; the C API lets response callbacks run on any library thread, once per
    // response until the FINAL, which is what a sink does.
    ResponseSink::inline(unsafe { InlineFn::new(call_response, words) })
}

/// # Safety
/// `w` is `[func, user_data]` as [`response_sink`] made it.
unsafe fn call_response(w: Words, (resp, flags): (Box<Response>, u32)) {
    // SAFETY: `w[0]` was made from a `ResponseFn` (same size as a pointer).
    let func = unsafe { std::mem::transmute::<*mut (), ResponseFn>(w[0]) };
    let ptr = Box::into_raw(resp);
    IN_CALLBACK.with(|c| c.set(c.get() + 1));
    // A C callback must not unwind; if a foreign exception tries, stop it here.
    // SAFETY: the application's callback with its own user data; the response is its own
    // from here on (freed with infer_response_free).
    let _ = catch_unwind(AssertUnwindSafe(|| unsafe {
        func(w[1].cast(), ptr, flags)
    }));
    IN_CALLBACK.with(|c| c.set(c.get() - 1));
}

/// A release callback: `func(user_data)`, called once when the library is done with the
/// memory it was lent.
pub(crate) fn release(func: ReleaseFn, user_data: *mut c_void) -> crate::tensor::Release {
    let words: Words = [func as *mut (), user_data.cast()];
    // SAFETY: `call_release` reads the words back as exactly this function and its user
    // data; the C API lets a release callback run on any thread, and a lent buffer calls
    // it once.
    unsafe { InlineFn::new(call_release, words) }
}

/// # Safety
/// `w` is `[func, user_data]` as [`release`] made it.
unsafe fn call_release(w: Words, (): ()) {
    // SAFETY: `w[0]` was made from a `ReleaseFn` (same size as a pointer).
    let func = unsafe { std::mem::transmute::<*mut (), ReleaseFn>(w[0]) };
    // A panic-free C function by contract; guard anyway so that a foreign unwind cannot
    // escape from a destructor.
    // SAFETY: the application's callback with its own user data.
    let _ = catch_unwind(|| unsafe { func(w[1].cast()) });
}

/// An application's C function and the user data it is called with.
struct CCallback<F> {
    func: F,
    user_data: *mut c_void,
}

// SAFETY: the C API states that callbacks run on library threads with `user_data` handed
// back untouched; their thread safety is the application's.
unsafe impl<F> Send for CCallback<F> {}
// SAFETY: as above.
unsafe impl<F> Sync for CCallback<F> {}

/// The log sink of an application's log function (`infer_log_fn` without its NULL).
pub(crate) fn log_sink(
    func: unsafe extern "C" fn(*mut c_void, u32, *const c_char),
    user_data: *mut c_void,
) -> Arc<crate::log::LogSink> {
    let c = CCallback { func, user_data };
    Arc::new(move |level, msg: &str| {
        let c = &c; // the whole struct (Send, Sync), not its fields
        let text = CString::new(msg.replace('\0', " ")).unwrap_or_default();
        // SAFETY: the application's log function with its own user data; the C API lets it
        // run on any library thread.
        unsafe { (c.func)(c.user_data, level, text.as_ptr()) }
    })
}

/// The iteration-statistics callback of an application's function (`infer_stats_fn`
/// without its NULL).
pub(crate) fn stats_callback(
    func: unsafe extern "C" fn(*mut c_void, *const c_char),
    user_data: *mut c_void,
) -> Arc<crate::scheduler::inflight::StatsCallback> {
    let c = CCallback { func, user_data };
    Arc::new(move |json: &str| {
        let c = &c; // the whole struct (Send, Sync), not its fields
        let text = CString::new(json).unwrap_or_default();
        // SAFETY: the application's statistics function with its own user data; the C API
        // lets it run on any library thread.
        unsafe { (c.func)(c.user_data, text.as_ptr()) }
    })
}
