//! The few driver objects the data path needs, as owned handles: a device's primary
//! context, streams, events, and pooled device and pinned host memory.
//!
//! Every call goes through cudarc's `sys` layer (the driver is loaded at run time). They
//! are only made after the probe found a driver new enough to have every symbol used
//! here, so cudarc's lazy symbol lookup does not fail. Errors name the call and the
//! driver's error name.

use crate::status::{Code, Error, Result};
use cudarc::driver::sys;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A device address (`CUdeviceptr`).
pub type DevicePtr = u64;

/// Errors after which a context is lost for good (cuda.h: "the context cannot be used
/// anymore, and must be destroyed"): the device's primary context, which every model and
/// the host application share, answers every later call with the same error until the
/// process ends. They come from the device (a kernel's bad address, an assert, a trap, an
/// uncorrectable memory error), usually at the next synchronization after the launch.
fn is_sticky(r: sys::CUresult) -> bool {
    use sys::CUresult::*;
    matches!(
        r,
        CUDA_ERROR_ECC_UNCORRECTABLE
            | CUDA_ERROR_ILLEGAL_ADDRESS
            | CUDA_ERROR_LAUNCH_TIMEOUT
            | CUDA_ERROR_ASSERT
            | CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUDA_ERROR_MISALIGNED_ADDRESS
            | CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUDA_ERROR_INVALID_PC
            | CUDA_ERROR_LAUNCH_FAILED
    )
}

/// The sticky fault of each device that had one ("GPU 0 is unusable: ..."), in the order
/// they were seen. A device stays here for the life of the process.
static FAULTS: Mutex<Vec<(i32, String)>> = Mutex::new(Vec::new());

/// Whether any device has faulted: the common case reads one atomic.
static ANY_FAULT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

thread_local! {
    /// The ordinal of the context the library bound last on this thread (-1: none, or
    /// the caller's own).
    static BOUND: std::cell::Cell<i32> = const { std::cell::Cell::new(-1) };
}

/// Why GPU `ordinal` is unusable, if a sticky fault was seen there.
pub fn device_fault(ordinal: i32) -> Option<String> {
    if !ANY_FAULT.load(Ordering::Acquire) {
        return None;
    }
    FAULTS
        .lock()
        .iter()
        .find(|(d, _)| *d == ordinal)
        .map(|(_, why)| why.clone())
}

/// Every device that faulted, with why.
pub fn device_faults() -> Vec<(i32, String)> {
    if !ANY_FAULT.load(Ordering::Acquire) {
        return Vec::new();
    }
    FAULTS.lock().clone()
}

/// Records a sticky fault of GPU `ordinal` seen as `why` (the first one seen stays) and
/// returns the error for the call that saw it.
fn record_fault(ordinal: i32, why: &str) -> Error {
    let mut faults = FAULTS.lock();
    let msg = match faults.iter().find(|(d, _)| *d == ordinal) {
        Some((_, first)) => first.clone(),
        None => {
            let msg = format!(
                "GPU {ordinal} is unusable: {why}, a device fault after which the driver refuses all work on the GPU until the process restarts"
            );
            faults.push((ordinal, msg.clone()));
            ANY_FAULT.store(true, Ordering::Release);
            msg
        }
    };
    Error::unavailable(msg)
}

/// The device of the calling thread's current context (-1 if it cannot be told).
fn current_ordinal() -> i32 {
    let bound = BOUND.with(|b| b.get());
    if bound >= 0 {
        return bound;
    }
    let mut dev = 0;
    // SAFETY: a valid out-pointer.
    if unsafe { sys::cuCtxGetDevice(&mut dev) } == sys::CUresult::CUDA_SUCCESS {
        dev
    } else {
        -1
    }
}

/// A driver call's result as the library's: out of memory is RESOURCE_EXHAUSTED, a
/// sticky device fault marks the device unusable (UNAVAILABLE from then on), anything
/// else is INTERNAL. Modules, graphs and launches use it too.
pub(super) fn check(r: sys::CUresult, what: &str) -> Result<()> {
    super::probe::check(r, what).map_err(|why| {
        if is_sticky(r) {
            return record_fault(current_ordinal(), &why);
        }
        let code = if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            Code::ResourceExhausted
        } else {
            Code::Internal
        };
        Error::new(code, why)
    })
}

/// A device's primary context, retained for as long as this lives. Binding it makes the
/// device current on the calling thread (what `cudaSetDevice` does in the runtime API,
/// so an application's own CUDA code on that thread sees the same context).
pub struct Context {
    ordinal: i32,
    raw: sys::CUcontext,
}

// SAFETY: a CUcontext is a handle the driver lets any thread bind.
unsafe impl Send for Context {}
unsafe impl Sync for Context {}

impl Context {
    pub fn retain(ordinal: i32) -> Result<Arc<Context>> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the probe checked the driver and the ordinal exists.
        check(
            unsafe { sys::cuDevicePrimaryCtxRetain(&mut raw, ordinal) },
            &format!("cuDevicePrimaryCtxRetain(GPU {ordinal})"),
        )?;
        Ok(Arc::new(Context { ordinal, raw }))
    }

    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Makes this context current on the calling thread. On a device that faulted, it is
    /// still made current (so that clean-up calls go to the right context) and the fault
    /// is the error.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: `raw` is a retained primary context.
        check(unsafe { sys::cuCtxSetCurrent(self.raw) }, "cuCtxSetCurrent")?;
        BOUND.with(|b| b.set(self.ordinal));
        match device_fault(self.ordinal) {
            Some(why) => Err(Error::unavailable(why)),
            None => Ok(()),
        }
    }
}

/// Binds a context on the calling thread and gives the thread its previous context back
/// when dropped (for work on a caller's thread, whose own CUDA state must not change).
pub struct ScopedBind {
    previous: sys::CUcontext,
    previous_ordinal: i32,
}

impl ScopedBind {
    pub fn new(ctx: &Context) -> Result<ScopedBind> {
        let mut previous = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check(
            unsafe { sys::cuCtxGetCurrent(&mut previous) },
            "cuCtxGetCurrent",
        )?;
        let scoped = ScopedBind {
            previous,
            previous_ordinal: BOUND.with(|b| b.get()),
        };
        ctx.bind()?;
        Ok(scoped)
    }
}

impl ScopedBind {
    /// As [`ScopedBind::new`], for clean-up (drops run on whatever thread let go of the
    /// last reference, an application's thread too, whose current context must not
    /// change): a device fault does not stop the bind (the clean-up calls then fail,
    /// harmlessly). None when the context cannot be made current at all.
    pub(super) fn for_cleanup(ctx: &Context) -> Option<ScopedBind> {
        let mut previous = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        if unsafe { sys::cuCtxGetCurrent(&mut previous) } != sys::CUresult::CUDA_SUCCESS {
            return None;
        }
        let scoped = ScopedBind {
            previous,
            previous_ordinal: BOUND.with(|b| b.get()),
        };
        // SAFETY: `raw` is a retained primary context.
        if unsafe { sys::cuCtxSetCurrent(ctx.raw) } != sys::CUresult::CUDA_SUCCESS {
            return None; // `scoped` puts the previous one back
        }
        BOUND.with(|b| b.set(ctx.ordinal));
        Some(scoped)
    }
}

impl Drop for ScopedBind {
    fn drop(&mut self) {
        // SAFETY: the context that was current before (or NULL: none).
        unsafe { sys::cuCtxSetCurrent(self.previous) };
        BOUND.with(|b| b.set(self.previous_ordinal));
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: releases the retain of `retain`.
        unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.ordinal) };
    }
}

/// A non-blocking stream of one context.
pub struct Stream {
    raw: sys::CUstream,
    ctx: Arc<Context>,
}

// SAFETY: streams may be used from any thread that binds their context.
unsafe impl Send for Stream {}
unsafe impl Sync for Stream {}

impl Stream {
    pub fn new(ctx: &Arc<Context>) -> Result<Stream> {
        ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer, context bound. 1 = CU_STREAM_NON_BLOCKING.
        check(
            unsafe { sys::cuStreamCreate(&mut raw, 1) },
            "cuStreamCreate",
        )?;
        Ok(Stream {
            raw,
            ctx: ctx.clone(),
        })
    }

    pub fn raw(&self) -> sys::CUstream {
        self.raw
    }

    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: a live stream.
        check(
            unsafe { sys::cuStreamSynchronize(self.raw) },
            "cuStreamSynchronize",
        )
    }

    /// Whether the stream is capturing work into a CUDA graph (a capture still active or
    /// one invalidated and not yet ended): what is queued now would be part of the graph.
    pub fn is_capturing(&self) -> Result<bool> {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a live stream, a valid out-pointer.
        check(
            unsafe { sys::cuStreamIsCapturing(self.raw, &mut status) },
            "cuStreamIsCapturing",
        )?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Ends a capture left open on the stream (by a backend, or cut short by a panic)
    /// and drops what it recorded, so that work queued on the stream runs again. The
    /// driver's answer is returned (an invalidated capture ends with an error).
    pub fn end_capture(&self) -> Result<()> {
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: a live stream, a valid out-pointer.
        let ended = check(
            unsafe { sys::cuStreamEndCapture(self.raw, &mut graph) },
            "cuStreamEndCapture",
        );
        if !graph.is_null() {
            // SAFETY: the graph the capture made, destroyed once; never instantiated.
            unsafe { sys::cuGraphDestroy(graph) };
        }
        ended
    }

    /// Copies `len` bytes from pinned host memory to the device, in stream order.
    ///
    /// # Safety
    /// Both ranges must be valid until the stream has run the copy.
    pub unsafe fn copy_to_device(&self, dst: DevicePtr, src: *const u8, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        // SAFETY: a live stream; both ranges valid until it runs the copy (this
        // function's contract).
        check(
            unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, len, self.raw) },
            "cuMemcpyHtoDAsync",
        )
    }

    /// Copies `len` bytes from the device to pinned host memory, in stream order.
    ///
    /// # Safety
    /// Both ranges must be valid until the stream has run the copy.
    pub unsafe fn copy_to_host(&self, dst: *mut u8, src: DevicePtr, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        // SAFETY: a live stream; both ranges valid until it runs the copy (this
        // function's contract).
        check(
            unsafe { sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, len, self.raw) },
            "cuMemcpyDtoHAsync",
        )
    }

    /// Copies between device addresses (any devices: unified addressing), in stream order.
    ///
    /// # Safety
    /// Both ranges must be valid until the stream has run the copy.
    pub unsafe fn copy_device(&self, dst: DevicePtr, src: DevicePtr, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        // SAFETY: a live stream; both ranges valid until it runs the copy (this
        // function's contract).
        check(
            unsafe { sys::cuMemcpyAsync(dst, src, len, self.raw) },
            "cuMemcpyAsync",
        )
    }

    /// Sets `len` bytes at `dst` to zero, in stream order.
    ///
    /// # Safety
    /// The range must be valid until the stream has run the memset.
    pub unsafe fn zero(&self, dst: DevicePtr, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        // SAFETY: a live stream; the range valid until it runs the memset (this
        // function's contract).
        check(
            unsafe { sys::cuMemsetD8Async(dst, 0, len, self.raw) },
            "cuMemsetD8Async",
        )
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // Work still queued may use memory about to be freed: drain first.
        let _bound = ScopedBind::for_cleanup(&self.ctx);
        // SAFETY: a live stream, destroyed once.
        unsafe {
            sys::cuStreamSynchronize(self.raw);
            sys::cuStreamDestroy_v2(self.raw);
        }
    }
}

/// An event of one context, to wait for a point of a stream from another thread
/// ([`Event::new`]), or to time the work between two points of a stream
/// ([`Event::timing`]).
pub struct Event {
    raw: sys::CUevent,
    ctx: Arc<Context>,
}

// SAFETY: events may be recorded and waited on from any thread that binds their context.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    /// An event for synchronization only (CU_EVENT_DISABLE_TIMING: the cheapest to record
    /// and wait for), waited for asleep (CU_EVENT_BLOCKING_SYNC): a thread waiting for the
    /// device does not spin a core, which in an embedding process is the host
    /// application's.
    pub fn new(ctx: &Arc<Context>) -> Result<Event> {
        // 2 = CU_EVENT_DISABLE_TIMING, 1 = CU_EVENT_BLOCKING_SYNC.
        Event::with_flags(ctx, 2 | 1)
    }

    /// An event that also takes the time at which the stream reaches it, for
    /// [`Event::elapsed_ms_since`].
    pub fn timing(ctx: &Arc<Context>) -> Result<Event> {
        // 0 = CU_EVENT_DEFAULT.
        Event::with_flags(ctx, 0)
    }

    fn with_flags(ctx: &Arc<Context>, flags: u32) -> Result<Event> {
        ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer, context bound.
        check(
            unsafe { sys::cuEventCreate(&mut raw, flags) },
            "cuEventCreate",
        )?;
        Ok(Event {
            raw,
            ctx: ctx.clone(),
        })
    }

    /// Marks the current end of `stream`'s work.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        // SAFETY: live event and stream of the same context.
        check(
            unsafe { sys::cuEventRecord(self.raw, stream.raw) },
            "cuEventRecord",
        )
    }

    /// Milliseconds of stream time from `start`'s last record to this event's (both made
    /// by [`Event::timing`]). Never waits: NOT_READY while either has not completed; an
    /// error too for an event never recorded, or last recorded into a stream capture. The
    /// context must be bound.
    pub fn elapsed_ms_since(&self, start: &Event) -> Result<f32> {
        let Some(elapsed) = elapsed_time_fn() else {
            return Err(Error::internal("the CUDA driver has no cuEventElapsedTime"));
        };
        let mut ms = 0f32;
        // SAFETY: live events, a valid out-pointer.
        check(
            unsafe { elapsed(&mut ms, start.raw, self.raw) },
            "cuEventElapsedTime",
        )?;
        Ok(ms)
    }

    /// Waits until the work before the last `record` has run: polls the event for up to
    /// `spin` (work that short is answered with no wake-up latency), then sleeps in
    /// [`Event::synchronize`] (an event of [`Event::new`] blocks rather than spins), so a
    /// long batch costs a waiting thread at most `spin` of CPU time. Binds the context.
    pub fn wait(&self, spin: std::time::Duration) -> Result<()> {
        self.ctx.bind()?;
        let start = std::time::Instant::now();
        loop {
            // SAFETY: a live event.
            match unsafe { sys::cuEventQuery(self.raw) } {
                sys::CUresult::CUDA_SUCCESS => return Ok(()),
                sys::CUresult::CUDA_ERROR_NOT_READY => {}
                e => return check(e, "cuEventQuery"),
            }
            if start.elapsed() >= spin {
                return self.synchronize();
            }
            std::hint::spin_loop();
        }
    }

    /// Waits until the work before the last `record` has run. Binds the context.
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: a live event.
        check(
            unsafe { sys::cuEventSynchronize(self.raw) },
            "cuEventSynchronize",
        )
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _bound = ScopedBind::for_cleanup(&self.ctx);
        // SAFETY: a live event, destroyed once.
        unsafe { sys::cuEventDestroy_v2(self.raw) };
    }
}

/// Copies `len` bytes between device addresses in the order of `stream` (a raw handle).
///
/// # Safety
/// Both ranges must be valid until the stream has run the copy.
pub unsafe fn copy_async(
    dst: DevicePtr,
    src: DevicePtr,
    len: usize,
    stream: sys::CUstream,
) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    // SAFETY: this function's contract (a live stream, both ranges valid until it runs).
    check(
        unsafe { sys::cuMemcpyAsync(dst, src, len, stream) },
        "cuMemcpyAsync",
    )
}

/// Copies `len` bytes from device memory to host memory now (a synchronous, pageable
/// copy: for inputs in device memory that a model on the CPU needs).
///
/// # Safety
/// `src` must hold `len` readable device bytes; the context of some device must be bound.
pub unsafe fn copy_to_host_now(dst: &mut [u8], src: DevicePtr) -> Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    // SAFETY: `dst` is a writable slice; `src` holds as many device bytes and a context
    // is bound (this function's contract).
    check(
        unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr() as *mut c_void, src, dst.len()) },
        "cuMemcpyDtoH",
    )
}

/// Device memory of exactly one allocation, freed when dropped (model constants: sized
/// once, kept for the life of an instance).
pub struct DeviceMem {
    ptr: DevicePtr,
    len: usize,
    ctx: Arc<Context>,
}

impl DeviceMem {
    /// Allocates `len` bytes (at least 1), uninitialised. The context must be bound.
    pub fn alloc(ctx: &Arc<Context>, len: usize) -> Result<DeviceMem> {
        let mut ptr: DevicePtr = 0;
        // SAFETY: valid out-pointer; the caller bound the context.
        check(
            unsafe { sys::cuMemAlloc_v2(&mut ptr, len.max(1)) },
            "cuMemAlloc",
        )
        .map_err(|e| e.context(format!("{len} bytes on GPU {}", ctx.ordinal)))?;
        Ok(DeviceMem {
            ptr,
            len,
            ctx: ctx.clone(),
        })
    }

    /// Allocates `bytes.len()` bytes (at least 1) and copies `bytes` in, complete on the
    /// device when this returns. The context must be bound.
    pub fn upload(ctx: &Arc<Context>, bytes: &[u8]) -> Result<DeviceMem> {
        let mem = DeviceMem::alloc(ctx, bytes.len())
            .map_err(|e| e.context(format!("{} bytes of constants", bytes.len())))?;
        let ptr = mem.ptr;
        if !bytes.is_empty() {
            // SAFETY: `ptr` holds `len` bytes; a synchronous copy from host memory.
            check(
                unsafe { sys::cuMemcpyHtoD_v2(ptr, bytes.as_ptr() as *const c_void, bytes.len()) },
                "cuMemcpyHtoD",
            )?;
            // From pageable memory the copy returns once the bytes are staged, before the
            // DMA to the device is done; the instances' streams are non-blocking, so
            // nothing orders their kernels after it. Wait for the legacy stream.
            // SAFETY: the legacy stream (null) of the bound context.
            check(
                unsafe { sys::cuStreamSynchronize(std::ptr::null_mut()) },
                "cuStreamSynchronize (after a constant upload)",
            )?;
        }
        Ok(mem)
    }
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        let _bound = ScopedBind::for_cleanup(&self.ctx);
        // SAFETY: allocated by cuMemAlloc, freed once (the driver waits for pending work).
        unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

/// What the driver says about a device address.
#[derive(Clone, Copy, Debug)]
pub struct PointerInfo {
    pub device: i32,
    /// The allocation holding the address: its start and size.
    pub range_start: DevicePtr,
    pub range_size: usize,
}

/// Looks up device memory at `ptr`; Err (with the reason) for anything else: host
/// memory, freed memory, an address the driver does not know.
pub fn pointer_info(ptr: DevicePtr) -> std::result::Result<PointerInfo, String> {
    use sys::CUpointer_attribute::*;
    let mut mem_type: u32 = 0;
    let mut device: i32 = -1;
    let mut start: DevicePtr = 0;
    let mut size: usize = 0;
    let attr = |out: *mut c_void, a| {
        // SAFETY: each out-pointer has the size the attribute writes.
        super::probe::check(
            unsafe { sys::cuPointerGetAttribute(out, a, ptr) },
            "cuPointerGetAttribute",
        )
    };
    attr(
        &mut mem_type as *mut u32 as *mut c_void,
        CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
    )
    .map_err(|_| "the CUDA driver does not know this address".to_owned())?;
    // 2 = CU_MEMORY_TYPE_DEVICE.
    if mem_type != 2 {
        return Err("it is host memory, not device memory".to_owned());
    }
    attr(
        &mut device as *mut i32 as *mut c_void,
        CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    )?;
    attr(
        &mut start as *mut u64 as *mut c_void,
        CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
    )?;
    attr(
        &mut size as *mut usize as *mut c_void,
        CU_POINTER_ATTRIBUTE_RANGE_SIZE,
    )?;
    Ok(PointerInfo {
        device,
        range_start: start,
        range_size: size,
    })
}

/// Allocation counters of a pool (for statistics and for tests that check that the
/// steady state allocates nothing).
#[derive(Default, Debug)]
pub struct PoolCounters {
    pub device_allocs: AtomicU64,
    pub device_bytes: AtomicU64,
    pub pinned_allocs: AtomicU64,
    pub pinned_bytes: AtomicU64,
    /// Pinned bytes lent to responses ([`PinnedBuf::lend`]) and not yet back.
    pub pinned_lent_bytes: AtomicU64,
}

/// Device and pinned host memory of one context, in size classes (`size_class`: at most
/// 12.5% over what is asked). A buffer goes back to its free list when dropped (from any
/// thread, no driver call), and a request takes a free buffer of its class or of a class
/// up to a quarter larger. Free buffers unused for `idle_release` (30 s unless set) are
/// given back to the driver by the next allocation, so that a batch far larger than the
/// usual does not hold its memory for the life of the instance; the rest when the pool
/// goes. A failed allocation empties the free lists and tries once more before it
/// reports RESOURCE_EXHAUSTED.
pub struct MemoryPool {
    ctx: Arc<Context>,
    device_free: Mutex<BTreeMap<usize, Vec<FreeDevice>>>,
    pinned_free: Mutex<BTreeMap<usize, Vec<(usize, Instant)>>>,
    /// How long a free buffer may stay unused before it is given back (milliseconds).
    idle_release_ms: AtomicU64,
    /// When the free lists were last looked over for idle buffers.
    last_trim: Mutex<Instant>,
    pub counters: PoolCounters,
}

/// A device buffer on a pool's free list, with the events that must complete before it
/// is handed out again (reads of it that a caller queued on its own streams), and when it
/// came back.
struct FreeDevice {
    ptr: DevicePtr,
    fences: Vec<Event>,
    since: Instant,
}

impl FreeDevice {
    /// Whether every fence has completed (a fence that cannot be queried, on a device
    /// that faulted say, no longer holds anything back).
    fn ready(&self) -> bool {
        self.fences.iter().all(|e| {
            // SAFETY: a live event.
            let r = unsafe { sys::cuEventQuery(e.raw) };
            r != sys::CUresult::CUDA_ERROR_NOT_READY
        })
    }
}

/// The size of the buffer a request of `bytes` gets: a power of two up to 4 KiB (256 at
/// least), then a multiple of an eighth of the power of two below it (5,000 bytes: 5,120;
/// 33 MiB: 36 MiB), so a buffer is at most 12.5% larger than asked.
fn size_class(bytes: usize) -> usize {
    let b = bytes.max(256);
    if b <= 4096 {
        return b.next_power_of_two();
    }
    let step = 1usize << (usize::BITS - 1 - b.leading_zeros() - 3);
    b.div_ceil(step) * step
}

/// The largest class a request of class `class` may take from a free list.
fn reuse_limit(class: usize) -> usize {
    class + class / 4
}

/// Free buffers unused this long are given back to the driver (unless set otherwise).
const IDLE_RELEASE: Duration = Duration::from_secs(30);

impl MemoryPool {
    pub fn new(ctx: &Arc<Context>) -> Arc<MemoryPool> {
        Arc::new(MemoryPool {
            ctx: ctx.clone(),
            device_free: Mutex::new(BTreeMap::new()),
            pinned_free: Mutex::new(BTreeMap::new()),
            idle_release_ms: AtomicU64::new(IDLE_RELEASE.as_millis() as u64),
            last_trim: Mutex::new(Instant::now()),
            counters: PoolCounters::default(),
        })
    }

    /// Sets how long a free buffer may stay unused before an allocation gives it back.
    pub fn set_idle_release(&self, idle: Duration) {
        self.idle_release_ms
            .store(idle.as_millis() as u64, Ordering::Relaxed);
    }

    /// Gives back to the driver the free buffers unused for `idle_release` whose fences
    /// have completed; looks at most once per half of that (and once a second). The
    /// context must be bound.
    fn trim_idle(&self) {
        let idle = Duration::from_millis(self.idle_release_ms.load(Ordering::Relaxed));
        let now = Instant::now();
        {
            let mut last = self.last_trim.lock();
            if now.duration_since(*last) < (idle / 2).min(Duration::from_secs(1)) {
                return;
            }
            *last = now;
        }
        let old = |since: Instant| now.duration_since(since) >= idle;
        let mut device = Vec::new();
        for (class, list) in self.device_free.lock().iter_mut() {
            let mut i = 0;
            while i < list.len() {
                if old(list[i].since) && list[i].ready() {
                    device.push((*class, list.swap_remove(i)));
                } else {
                    i += 1;
                }
            }
        }
        let mut pinned = Vec::new();
        for (class, list) in self.pinned_free.lock().iter_mut() {
            list.retain(|&(p, since)| {
                let go = old(since);
                if go {
                    pinned.push((*class, p));
                }
                !go
            });
        }
        for (class, f) in device {
            self.free_device(class, f);
        }
        for (class, p) in pinned {
            self.free_pinned(class, p);
        }
    }

    /// Gives a free device buffer of class `class` back to the driver (the context bound;
    /// cuMemFree waits for the device's work, so a fenced buffer may go too).
    fn free_device(&self, class: usize, f: FreeDevice) {
        drop(f.fences);
        // SAFETY: allocated by cuMemAlloc in this context, no longer referenced.
        unsafe { sys::cuMemFree_v2(f.ptr) };
        self.counters
            .device_bytes
            .fetch_sub(class as u64, Ordering::Relaxed);
    }

    /// Gives a free pinned buffer of class `class` back to the driver.
    fn free_pinned(&self, class: usize, p: usize) {
        // SAFETY: allocated by cuMemHostAlloc, no longer referenced.
        unsafe { sys::cuMemFreeHost(p as *mut c_void) };
        self.counters
            .pinned_bytes
            .fetch_sub(class as u64, Ordering::Relaxed);
    }

    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// `len` bytes of device memory (uninitialised). The context must be bound.
    pub fn device(self: &Arc<Self>, len: usize) -> Result<DeviceBuf> {
        self.trim_idle();
        let mut class = size_class(len);
        // The most recently freed buffer of the smallest class that fits whose fences
        // have completed; a fenced one that is still being read stays on the list.
        let reused = {
            let mut free = self.device_free.lock();
            free.range_mut(class..=reuse_limit(class))
                .find_map(|(c, v)| {
                    let i = v.iter().rposition(FreeDevice::ready)?;
                    Some((*c, v.remove(i)))
                })
        };
        let ptr = match reused {
            Some((c, f)) => {
                class = c;
                drop(f.fences); // completed: destroyed outside the lock
                f.ptr
            }
            None => {
                let alloc = || {
                    let mut p: DevicePtr = 0;
                    // SAFETY: valid out-pointer; the caller bound the context.
                    check(unsafe { sys::cuMemAlloc_v2(&mut p, class) }, "cuMemAlloc").map(|()| p)
                };
                let p = alloc().or_else(|_| {
                    self.release_free();
                    alloc()
                });
                let p = p.map_err(|e| {
                    Error::new(
                        Code::ResourceExhausted,
                        format!(
                            "{class} bytes of memory on GPU {}: {}",
                            self.ctx.ordinal, e.message
                        ),
                    )
                })?;
                self.counters.device_allocs.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .device_bytes
                    .fetch_add(class as u64, Ordering::Relaxed);
                p
            }
        };
        Ok(DeviceBuf {
            ptr,
            len,
            class,
            pool: self.clone(),
            fences: Mutex::new(Vec::new()),
        })
    }

    /// `len` bytes of page-locked host memory (uninitialised). The context must be bound.
    pub fn pinned(self: &Arc<Self>, len: usize) -> Result<PinnedBuf> {
        self.trim_idle();
        let mut class = size_class(len);
        let reused = self
            .pinned_free
            .lock()
            .range_mut(class..=reuse_limit(class))
            .find_map(|(c, v)| Some((*c, v.pop()?.0)));
        let addr = match reused {
            Some((c, p)) => {
                class = c;
                p
            }
            None => {
                let alloc = || {
                    let mut p: *mut c_void = std::ptr::null_mut();
                    // SAFETY: valid out-pointer; the caller bound the context. PORTABLE:
                    // page-locked for every context, so that an output lent from here
                    // goes up to another GPU from where it lies (without it, the driver
                    // treats it as pageable there and stages the copy); not mapped.
                    check(
                        unsafe {
                            sys::cuMemHostAlloc(&mut p, class, sys::CU_MEMHOSTALLOC_PORTABLE)
                        },
                        "cuMemHostAlloc",
                    )
                    .map(|()| p as usize)
                };
                let p = alloc().or_else(|_| {
                    self.release_free();
                    alloc()
                });
                let p = p.map_err(|e| {
                    Error::new(
                        Code::ResourceExhausted,
                        format!("{class} bytes of pinned host memory: {}", e.message),
                    )
                })?;
                self.counters.pinned_allocs.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .pinned_bytes
                    .fetch_add(class as u64, Ordering::Relaxed);
                p
            }
        };
        Ok(PinnedBuf {
            ptr: addr as *mut u8,
            len,
            class,
            pool: self.clone(),
            lent: false,
        })
    }

    /// Frees every buffer on the free lists.
    fn release_free(&self) {
        // cuMemFree waits for the device's work first, so fenced buffers go too.
        let device = std::mem::take(&mut *self.device_free.lock());
        let pinned = std::mem::take(&mut *self.pinned_free.lock());
        if device.is_empty() && pinned.is_empty() {
            return;
        }
        let _bound = ScopedBind::for_cleanup(&self.ctx);
        for (class, frees) in device {
            for f in frees {
                self.free_device(class, f);
            }
        }
        for (class, ptrs) in pinned {
            for (p, _) in ptrs {
                self.free_pinned(class, p);
            }
        }
    }
}

impl Drop for MemoryPool {
    fn drop(&mut self) {
        self.release_free();
    }
}

/// Device memory from a [`MemoryPool`]; back to the pool when dropped.
pub struct DeviceBuf {
    ptr: DevicePtr,
    len: usize,
    class: usize,
    pool: Arc<MemoryPool>,
    /// Events on streams of the caller's that read this buffer (`release_after`).
    fences: Mutex<Vec<Event>>,
}

impl DeviceBuf {
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn device(&self) -> i32 {
        self.pool.ctx.ordinal
    }

    /// Keeps this buffer from being handed out again, once dropped, until the work
    /// queued on `stream` (a stream of the buffer's device, NULL for the legacy default
    /// stream) up to now has run: a caller's asynchronous reads of it. Where no event can
    /// be recorded there (a stream of another device, a device that faulted), waits for
    /// the stream instead. The calling thread's current context is left as it was.
    ///
    /// # Safety
    /// `stream` is NULL or a live stream handle.
    pub unsafe fn release_after(&self, stream: sys::CUstream) {
        let fenced = (|| -> Result<()> {
            let _bound = ScopedBind::new(&self.pool.ctx)?;
            let event = Event::new(&self.pool.ctx)?;
            // SAFETY: a live event; `stream` is NULL or live (this function's contract).
            check(
                unsafe { sys::cuEventRecord(event.raw, stream) },
                "cuEventRecord",
            )?;
            self.fences.lock().push(event);
            Ok(())
        })();
        if fenced.is_err() {
            if let Ok(_bound) = ScopedBind::new(&self.pool.ctx) {
                // SAFETY: NULL or a live stream (this function's contract).
                unsafe { sys::cuStreamSynchronize(stream) };
            }
        }
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        let fences = std::mem::take(&mut *self.fences.lock());
        self.pool
            .device_free
            .lock()
            .entry(self.class)
            .or_default()
            .push(FreeDevice {
                ptr: self.ptr,
                fences,
                since: Instant::now(),
            });
    }
}

/// Page-locked host memory from a [`MemoryPool`]; back to the pool when dropped.
pub struct PinnedBuf {
    ptr: *mut u8,
    len: usize,
    class: usize,
    pool: Arc<MemoryPool>,
    /// Counted in the pool's `pinned_lent_bytes` until dropped.
    lent: bool,
}

// SAFETY: plain host memory owned by this handle.
unsafe impl Send for PinnedBuf {}
unsafe impl Sync for PinnedBuf {}

impl PinnedBuf {
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The bytes; only meaningful once the stream that wrote them has been synchronized.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes owned by this handle (class >= len).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Lends this buffer out of the pool for as long as its holders keep it (responses
    /// that read their outputs in place), if the pool's lent pinned memory stays within
    /// `limit` bytes with it; else gives it back unchanged. Page-locked memory is scarce:
    /// the limit bounds what responses an application holds on to can keep locked.
    pub fn lend(mut self, limit: u64) -> std::result::Result<PinnedBuf, PinnedBuf> {
        let class = self.class as u64;
        let lent = &self.pool.counters.pinned_lent_bytes;
        let fits = lent.fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
            now.checked_add(class).filter(|&after| after <= limit)
        });
        if fits.is_err() {
            return Err(self);
        }
        self.lent = true;
        Ok(self)
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if self.lent {
            self.pool
                .counters
                .pinned_lent_bytes
                .fetch_sub(self.class as u64, Ordering::AcqRel);
        }
        self.pool
            .pinned_free
            .lock()
            .entry(self.class)
            .or_default()
            .push((self.ptr as usize, Instant::now()));
    }
}

type ElapsedTimeFn = unsafe extern "C" fn(*mut f32, sys::CUevent, sys::CUevent) -> sys::CUresult;

/// `cuEventElapsedTime_v2` where the driver has it (CUDA 12.8 and newer), else the
/// original `cuEventElapsedTime` (same signature): the bindings name only the first,
/// which a CUDA 12.0-12.7 driver lacks.
fn elapsed_time_fn() -> Option<ElapsedTimeFn> {
    static F: std::sync::OnceLock<Option<ElapsedTimeFn>> = std::sync::OnceLock::new();
    *F.get_or_init(|| {
        // SAFETY: the driver is loaded (an event exists), and both symbols have the
        // signature of `ElapsedTimeFn` (cuda.h).
        unsafe {
            let lib = sys::culib();
            ["cuEventElapsedTime_v2", "cuEventElapsedTime"]
                .iter()
                .find_map(|name| lib.get::<ElapsedTimeFn>(name.as_bytes()).ok().map(|f| *f))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::{reuse_limit, size_class};

    #[test]
    fn size_classes_waste_at_most_an_eighth() {
        assert_eq!(size_class(0), 256);
        assert_eq!(size_class(1), 256);
        assert_eq!(size_class(256), 256);
        assert_eq!(size_class(257), 512);
        assert_eq!(size_class(4096), 4096);
        assert_eq!(size_class(4097), 4608);
        assert_eq!(size_class(5000), 5120);
        assert_eq!(size_class(1 << 20), 1 << 20);
        assert_eq!(size_class((1 << 20) + 1), (1 << 20) + (1 << 17));
        assert_eq!(size_class(33 << 20), 36 << 20);
        for n in (4097..1 << 22).step_by(997).chain([usize::MAX / 4]) {
            let c = size_class(n);
            assert!(c >= n && c - n <= n / 8, "{n} -> {c}");
            assert_eq!(size_class(c), c, "a class is its own class");
        }
        assert_eq!(reuse_limit(1 << 20), (1 << 20) + (1 << 18));
    }
}
