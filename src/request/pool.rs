//! Recycling of request and response objects (with their vectors' capacity).
//!
//! Requests are built on caller threads and finished on worker threads; responses the
//! other way round. Freeing them where they finish and allocating anew where they start
//! makes every request pay for cross-thread `free`s, which contend on the allocator's
//! locks. Instead a finished object goes back to a bounded lock-free pool, reset, and the
//! next request or response takes it from there.

use super::{Request, Response};
use crossbeam_queue::ArrayQueue;
use std::sync::OnceLock;

/// Objects kept per pool: enough for the requests in flight of a busy server; beyond it
/// they are freed as usual.
const POOL_CAPACITY: usize = 1024;
/// Input buffers larger than this are freed, not kept for reuse.
pub(crate) const MAX_SPARE_BUFFER: usize = 16 * 1024;
/// Input buffers a pooled request keeps for reuse. With the limits above the pools keep
/// at most 64 MiB of input buffers, and nothing once the last server is freed.
pub(crate) const MAX_SPARE_BUFFERS: usize = 4;

fn requests() -> &'static ArrayQueue<Box<Request>> {
    static POOL: OnceLock<ArrayQueue<Box<Request>>> = OnceLock::new();
    POOL.get_or_init(|| ArrayQueue::new(POOL_CAPACITY))
}

fn responses() -> &'static ArrayQueue<Box<Response>> {
    static POOL: OnceLock<ArrayQueue<Box<Response>>> = OnceLock::new();
    POOL.get_or_init(|| ArrayQueue::new(POOL_CAPACITY))
}

/// A reset request from the pool, or a new one.
pub fn take_request() -> Option<Box<Request>> {
    requests().pop()
}

/// Resets a finished request and keeps it for reuse. Its callback must already have
/// been taken (a sink still armed would send its safety-net FINAL here).
pub fn recycle_request(mut r: Box<Request>) {
    r.reset();
    let _ = requests().push(r);
}

pub fn take_response() -> Option<Box<Response>> {
    responses().pop()
}

/// Drops what a response refers to (output buffers, error text) and keeps the object.
pub fn recycle_response(mut r: Box<Response>) {
    r.reset();
    let _ = responses().push(r);
}

/// Frees everything the pools keep (called when the last server goes away).
pub fn drain() {
    while requests().pop().is_some() {}
    while responses().pop().is_some() {}
}
