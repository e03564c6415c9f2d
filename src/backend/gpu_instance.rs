//! A model instance on a GPU: the data path around a backend that computes on a device.
//!
//! Per batch, on the instance's worker thread:
//! 1. the inputs are laid out in one device buffer (256-byte aligned). Host rows are
//!    gathered straight from the requests into a pinned staging buffer with the same
//!    layout, a chunk at a time, each chunk's copy up queued as soon as it is staged (the
//!    device copies while the host stages the next); rows the caller lent as page-locked
//!    memory (INFER_MEMORY_CPU_PINNED) are copied up from where they are, rows already in
//!    device memory device to device, and a batch of one request whose input is on this
//!    device uses the caller's memory as it is;
//! 2. the backend runs with device pointers and the instance's stream, and allocates its
//!    outputs in device memory from the instance's pool;
//! 3. outputs that someone needs on the host are copied down into pinned memory, the
//!    stream is synchronized once, and the pinned buffers are lent to the responses,
//!    which read their windows in place (up to `LEND_PINNED` bytes per instance; past it
//!    they are copied out); outputs wanted on the device stay there, shared by the
//!    responses that asked (`infer_request_set_output_memory`).
//!
//! Every copy is asynchronous on the instance's stream and every host buffer involved is
//! pinned; buffers come from the instance's pool, so the steady state allocates nothing.
//!
//! Statistics ([`GpuInstanceStats`], in the model's statistics JSON under "gpu"): the
//! copies and their bytes are counted as they are queued, and four timing events are
//! recorded on the stream around each batch's work: before the input copies, after them,
//! after the backend's work, after the output copies. Their elapsed times are read once
//! the batch's end event has completed (so reading them never waits), and a batch whose
//! events cannot be read, or would have been recorded into a stream capture (a backend's
//! CUDA graph capture left open), counts as untimed. The sets of four come from a pool, so
//! the steady state creates no events either.

use super::{Batch, BatchOutput, Completion, ModelInstance, OutputBytes};
use crate::cuda::driver::{Context, DevicePtr, Event, MemoryPool, Stream};
use crate::cuda::{DeviceBuf, PinnedBuf};
use crate::stats::{BatchTimes, GpuInstanceStats};
use crate::status::{Error, Result};
use crate::tensor::{DataType, Shape};
use parking_lot::Mutex;
use std::ffi::c_void;
use std::sync::Arc;

/// Alignment of each input in the batch's device buffer.
const ALIGN: usize = 256;

/// What a backend sees of the GPU while it runs a batch.
pub struct BatchGpu {
    pub device: i32,
    /// The instance's stream (a `CUstream`).
    pub stream: *mut c_void,
    /// The device address of each batch input (parallel to `Batch::inputs`).
    pub inputs: Vec<DevicePtr>,
    /// Outputs the backend allocated in device memory: (index in `Batch::outputs`, buffer).
    pub outputs: Vec<(usize, DeviceBuf)>,
    pool: Arc<MemoryPool>,
}

// SAFETY: the stream handle is only passed to the backend on the worker thread.
unsafe impl Send for BatchGpu {}

impl BatchGpu {
    /// The instance's memory pool.
    pub fn pool(&self) -> &Arc<MemoryPool> {
        &self.pool
    }
}

impl Batch {
    /// For a backend on a GPU instance: allocates batched output `name` in device memory
    /// and returns its address.
    pub fn alloc_output_device(&mut self, name: &str, shape: &[i64]) -> Result<DevicePtr> {
        if self.gpu.is_none() {
            return Err(Error::invalid(format!(
                "model '{}': output '{name}': this instance runs on the CPU, where outputs are in host memory (allocate outputs with infer_batch_output)",
                self.config.name
            )));
        }
        if self.config.output(name).map(|t| t.data_type) == Some(DataType::Bytes) {
            return Err(Error::invalid(format!(
                "model '{}': output '{name}' is BYTES, which lives in host memory (allocate it with infer_batch_output)",
                self.config.name
            )));
        }
        let (tname, dtype, bytes) = self.output_spec(name, shape, None)?;
        let g = self
            .gpu
            .as_mut()
            .ok_or_else(|| Error::internal("no GPU state"))?;
        let buf = g
            .pool
            .device(bytes)
            .map_err(|e| e.context(format!("model '{}': output '{name}'", self.config.name)))?;
        let ptr = buf.ptr();
        self.outputs.push(BatchOutput {
            name: tname,
            dtype,
            shape: Shape::from_slice(shape),
            data: OutputBytes::Owned(Vec::new()),
            device: None,
        });
        g.outputs.push((self.outputs.len() - 1, buf));
        Ok(ptr)
    }
}

/// A backend's instance on one GPU, with its stream and memory pool.
pub struct GpuInstance {
    // Dropped first: the backend's own teardown may still use the context and stream.
    inner: Box<dyn ModelInstance>,
    stream: Stream,
    pool: Arc<MemoryPool>,
    /// Events of finished batches, for the next ones.
    events: Arc<Mutex<Vec<Event>>>,
    /// Timing event sets of finished batches, for the next ones.
    timing_sets: TimingPool,
    stats: Arc<GpuInstanceStats>,
    ctx: Arc<Context>,
}

/// Timing event sets (see [`Timing`]) that no batch uses now.
type TimingPool = Arc<Mutex<Vec<[Event; 4]>>>;

/// The timing events of one batch, recorded in order on the instance's stream: before
/// the input copies (0), after them (1), after the backend's work (2), after the output
/// copies (3). Goes back to the pool when dropped.
struct Timing {
    /// None: no set could be made (the batch runs untimed).
    set: Option<[Event; 4]>,
    /// Marks recorded so far; a mark that is skipped leaves the batch untimed.
    marked: usize,
    untimed: bool,
    pool: TimingPool,
    ctx: Arc<Context>,
}

impl Timing {
    /// A set from the pool, or a new one. The context must be bound.
    fn new(pool: &TimingPool, ctx: &Arc<Context>) -> Timing {
        let set = pool.lock().pop().or_else(|| {
            let make = || Event::timing(ctx).ok();
            Some([make()?, make()?, make()?, make()?])
        });
        Timing {
            untimed: set.is_none(),
            set,
            marked: 0,
            pool: pool.clone(),
            ctx: ctx.clone(),
        }
    }

    /// Records mark `i` at the current end of `stream`'s work. With `check_capture`, first
    /// asks whether the stream is capturing (a backend's CUDA graph capture not ended): an
    /// event recorded there would be a node of the graph, not a time of this batch, so the
    /// batch is left untimed instead. Never fails the batch.
    fn mark(&mut self, i: usize, stream: &Stream, check_capture: bool) {
        let Some(set) = self
            .set
            .as_ref()
            .filter(|_| !self.untimed && self.marked == i)
        else {
            self.untimed = true;
            return;
        };
        if check_capture && stream.is_capturing().unwrap_or(true) {
            self.untimed = true;
            return;
        }
        if set[i].record(stream).is_err() {
            self.untimed = true;
            return;
        }
        self.marked += 1;
    }

    /// The batch's times, once its work has completed (so no call here waits); None when
    /// it is untimed or the driver cannot say (cuEventElapsedTime failed).
    fn read(&self) -> Option<BatchTimes> {
        let set = self
            .set
            .as_ref()
            .filter(|_| !self.untimed && self.marked == 4)?;
        self.ctx.bind().ok()?;
        let ns = |from: usize, to: usize| {
            let ms = set[to].elapsed_ms_since(&set[from]).ok()?;
            Some((f64::from(ms) * 1e6).round().max(0.0) as u64)
        };
        Some(BatchTimes {
            h2d_ns: ns(0, 1)?,
            compute_ns: ns(1, 2)?,
            d2h_ns: ns(2, 3)?,
            busy_ns: ns(0, 3)?,
        })
    }
}

impl Drop for Timing {
    fn drop(&mut self) {
        if let Some(set) = self.set.take() {
            // A set still pending on the stream is fine: its next record supersedes.
            self.pool.lock().push(set);
        }
    }
}

/// Host bytes staged in pinned memory are copied up in chunks of about this size, each
/// queued once staged, so that the device copies while the host stages the next chunk
/// (a single copy of 4 MiB waited for all of it to be staged first).
const STAGE_CHUNK: usize = 512 << 10;

/// Host pieces in page-locked memory of at least this size are copied up from where
/// they are; smaller ones are staged with the rest (fewer, larger copies).
const DIRECT_MIN: usize = 64 << 10;

/// The bytes of a host piece that is copied up from where it lies: in page-locked
/// memory (lent as such by the caller, or an output another GPU instance lent to an
/// ensemble's step) and at least `DIRECT_MIN` long.
fn direct(piece: &crate::tensor::TensorData) -> Option<&[u8]> {
    piece.page_locked_bytes().filter(|b| b.len() >= DIRECT_MIN)
}

/// Queues a batch's input copies to its device buffer as the host stages them.
struct Uploader<'a> {
    instance: &'a GpuInstance,
    dev: &'a DeviceBuf,
    /// Bytes at [start, end) of the pinned buffer, staged and not yet queued.
    run: Option<(usize, usize)>,
}

impl Uploader<'_> {
    /// Copies `bytes` to offset `at` of the pinned buffer, queueing the copy up of each
    /// chunk that fills.
    fn stage(&mut self, pinned: &mut PinnedBuf, mut at: usize, mut bytes: &[u8]) -> Result<()> {
        while !bytes.is_empty() {
            if self.run.is_some_and(|(s, _)| at >= s + STAGE_CHUNK) {
                self.flush(pinned)?;
            }
            let start = self.run.map_or(at, |(s, _)| s);
            let n = (start + STAGE_CHUNK - at).min(bytes.len());
            pinned.as_mut_slice()[at..at + n].copy_from_slice(&bytes[..n]);
            self.run = Some((start, at + n));
            at += n;
            bytes = &bytes[n..];
            if at - start >= STAGE_CHUNK {
                self.flush(pinned)?;
            }
        }
        Ok(())
    }

    /// Queues the copy up of the staged bytes not yet queued.
    fn flush(&mut self, pinned: &PinnedBuf) -> Result<()> {
        let Some((at, end)) = self.run.take() else {
            return Ok(());
        };
        if end == at {
            return Ok(());
        }
        // SAFETY: both ranges lie inside buffers that live until the stream is
        // synchronized (the caller keeps them); the staged bytes are not written again.
        unsafe {
            self.instance.stream.copy_to_device(
                self.dev.ptr() + at as u64,
                pinned.as_ptr().add(at),
                end - at,
            )?
        };
        self.instance.stats.h2d(end - at);
        Ok(())
    }

    /// Queues the copy up of host bytes in page-locked memory, from where they are.
    fn direct(&mut self, at: usize, bytes: &[u8]) -> Result<()> {
        // SAFETY: the bytes (the caller's memory, or a buffer shared by the request's
        // input) stay valid and unchanged until the request is released, after the
        // batch's work has run; the destination is inside `dev`.
        unsafe {
            self.instance.stream.copy_to_device(
                self.dev.ptr() + at as u64,
                bytes.as_ptr(),
                bytes.len(),
            )?
        };
        self.instance.stats.h2d(bytes.len());
        Ok(())
    }

    /// Queues a copy of `len` bytes of device memory at `src` to offset `at`.
    fn device(&mut self, at: usize, src: DevicePtr, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        // SAFETY: the caller's memory stays valid until the request is released, after
        // the stream is synchronized; the destination is inside `dev`.
        unsafe {
            self.instance
                .stream
                .copy_device(self.dev.ptr() + at as u64, src, len)?
        };
        self.instance.stats.d2d(len);
        Ok(())
    }
}

/// Where one batch input lives on the device.
enum Place {
    /// The caller's device memory, used in place.
    InPlace(DevicePtr),
    /// At this offset of the batch's input buffer.
    Packed(usize),
}

impl GpuInstance {
    pub fn new(inner: Box<dyn ModelInstance>, ctx: Arc<Context>) -> Result<GpuInstance> {
        let stream = Stream::new(&ctx)?;
        let pool = MemoryPool::new(&ctx);
        Ok(GpuInstance {
            inner,
            stream,
            pool,
            events: Arc::new(Mutex::new(Vec::new())),
            timing_sets: Arc::new(Mutex::new(Vec::new())),
            stats: Arc::new(GpuInstanceStats::new(ctx.ordinal())),
            ctx,
        })
    }

    /// Lays out and copies the batch's inputs to the device, between timing marks 0 and 1
    /// (host rows are staged after mark 0, a chunk at a time while the device copies the
    /// chunks before, so that time is the inputs' way to the device as the stream sees
    /// it). The returned buffers must live until the stream has been synchronized.
    fn stage_inputs(
        &self,
        batch: &Batch,
        timing: &mut Timing,
    ) -> Result<(Vec<DevicePtr>, Option<DeviceBuf>, Option<PinnedBuf>)> {
        let device = self.ctx.ordinal();
        let mut places = Vec::with_capacity(batch.inputs.len());
        let mut total = 0usize;
        let mut host_bytes = 0usize;
        for input in &batch.inputs {
            let pieces = batch.input_pieces(input);
            if let [one] = pieces.as_slice() {
                // In place only when aligned as the device buffer's own inputs are (a
                // kernel may read it in wide words); else it is copied like the rest.
                let aligned = |d: &&crate::tensor::DeviceData| d.ptr.is_multiple_of(ALIGN as u64);
                if let Some(d) = one.device().filter(|d| d.device == device).filter(aligned) {
                    places.push(Place::InPlace(d.ptr));
                    continue;
                }
            }
            let len = match Batch::assembled(input) {
                Some(v) => {
                    host_bytes += v.len();
                    v.len()
                }
                None => pieces
                    .iter()
                    .map(|p| {
                        if p.device().is_none() && direct(p).is_none() {
                            host_bytes += p.len();
                        }
                        p.len()
                    })
                    .sum(),
            };
            let at = total.next_multiple_of(ALIGN);
            places.push(Place::Packed(at));
            total = at + len;
        }
        if total == 0 {
            timing.mark(0, &self.stream, true);
            timing.mark(1, &self.stream, false);
            let ptrs = places
                .iter()
                .map(|p| match p {
                    Place::InPlace(ptr) => *ptr,
                    Place::Packed(_) => 0,
                })
                .collect();
            return Ok((ptrs, None, None));
        }
        let dev = self.pool.device(total)?;
        let mut pinned = if host_bytes > 0 {
            Some(self.pool.pinned(total)?)
        } else {
            None
        };
        // Host rows go to the pinned buffer at their device offsets, a chunk at a time,
        // and each chunk's copy up is queued as soon as it is there: the device copies
        // one chunk while the host stages the next. A run of staged host bytes goes up
        // in one copy (up to a chunk), broken only by pieces already on a device.
        timing.mark(0, &self.stream, true);
        let mut up = Uploader {
            instance: self,
            dev: &dev,
            run: None,
        };
        for (input, place) in batch.inputs.iter().zip(&places) {
            let Place::Packed(mut at) = *place else {
                continue;
            };
            if let Some(v) = Batch::assembled(input) {
                if let Some(p) = pinned.as_mut() {
                    up.stage(p, at, v)?;
                }
                continue;
            }
            for piece in batch.input_pieces(input) {
                let len = piece.len();
                match piece.device() {
                    Some(d) => {
                        if let Some(p) = pinned.as_ref() {
                            up.flush(p)?;
                        }
                        up.device(at, d.ptr, len)?;
                    }
                    None => match (direct(piece), pinned.as_mut()) {
                        (Some(bytes), p) => {
                            if let Some(p) = p {
                                up.flush(p)?;
                            }
                            up.direct(at, bytes)?;
                        }
                        (None, Some(p)) => up.stage(p, at, piece.as_slice())?,
                        (None, None) => {}
                    },
                }
                at += len;
            }
        }
        if let Some(p) = pinned.as_ref() {
            up.flush(p)?;
        }
        timing.mark(1, &self.stream, false);
        let ptrs = places
            .iter()
            .map(|p| match p {
                Place::InPlace(ptr) => *ptr,
                Place::Packed(at) => dev.ptr() + *at as u64,
            })
            .collect();
        Ok((ptrs, Some(dev), pinned))
    }

    /// Starts a batch: stages its inputs, runs the backend, queues the copies down of
    /// what the host needs and marks the end of the batch's work with an event.
    fn start(&mut self, batch: &mut Batch) -> Result<InFlight> {
        let device = self.ctx.ordinal();
        let config = batch.config.clone();
        let at = |e: Error| e.context(format!("model '{}' on GPU {device}", config.name));
        self.ctx.bind().map_err(at)?;
        self.stats.batch_started();
        let mut timing = Timing::new(&self.timing_sets, &self.ctx);
        let (inputs, dev_in, pinned_in) = match self.stage_inputs(batch, &mut timing) {
            Ok(s) => s,
            Err(e) => {
                // Copies already queued read buffers that are about to go back.
                let _ = self.stream.synchronize();
                return Err(at(e));
            }
        };
        batch.gpu = Some(BatchGpu {
            device,
            stream: self.stream.raw() as *mut c_void,
            inputs,
            outputs: Vec::new(),
            pool: self.pool.clone(),
        });
        // A panicking backend must not unwind past buffers its queued work still reads:
        // catch it, wait for the stream, then fail the batch.
        let ran = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.inner.execute(batch)
        })) {
            Ok(r) => r,
            Err(panic) => {
                let _ = self.stream.synchronize();
                Err(Error::internal(format!(
                    "model '{}': the backend panicked: {}",
                    config.name,
                    crate::status::panic_message(&*panic)
                )))
            }
        };
        // A capture left open on the stream (a backend's, or one a panic cut short)
        // would take in this batch's copies and every later batch's work: end it, drop
        // what it recorded (the batch's outputs were never computed) and fail the batch.
        let ran = match self.stream.is_capturing() {
            Ok(true) => {
                let ended = self.stream.end_capture();
                let _ = self.stream.synchronize();
                Err(Error::internal(format!(
                    "model '{}': the backend left a CUDA graph capture open on the instance's stream; the capture was ended ({}) and its work dropped",
                    config.name,
                    ended.map_or_else(|e| e.message, |()| "ok".to_owned())
)))
            }
            _ => ran,
        };
        timing.mark(2, &self.stream, true);
        let outputs = batch.gpu.take().map_or_else(Vec::new, |g| g.outputs);
        let all_on_device = !batch.requests.is_empty()
            && batch
                .requests
                .iter()
                .all(|r| r.outputs_on_device().is_some());
        let mut flight = InFlight {
            ran,
            event: None,
            events: self.events.clone(),
            timing,
            stats: self.stats.clone(),
            outputs,
            landing: Vec::new(),
            inputs: (dev_in, pinned_in),
            any_on_device: (batch.requests.iter()).any(|r| r.outputs_on_device().is_some()),
            device,
        };
        let queued = self.queue_copies_down(batch, &mut flight, all_on_device);
        if let Err(e) = queued {
            // Nothing to wait for from another thread: wait here, then fail the batch.
            let _ = self.stream.synchronize();
            flight.event = None;
            if flight.ran.is_ok() {
                flight.ran = Err(at(e));
            }
        }
        Ok(flight)
    }

    fn queue_copies_down(
        &self,
        batch: &Batch,
        flight: &mut InFlight,
        all_on_device: bool,
    ) -> Result<()> {
        if flight.ran.is_ok() {
            for (idx, buf) in &flight.outputs {
                // Implicit-state outputs always come back to the host (the sequence
                // batcher keeps them there), also when the config lists them as outputs.
                let name = &batch.outputs[*idx].name;
                let model_output = batch.config.output(name).is_some();
                let state = (batch.config.sequence_batching.as_ref())
                    .is_some_and(|q| q.state_by_output(name).is_some());
                if all_on_device && model_output && !state {
                    continue;
                }
                let mut p = self.pool.pinned(buf.len())?;
                // SAFETY: `p` and `buf` live in `flight` until its event has completed.
                unsafe {
                    self.stream
                        .copy_to_host(p.as_mut_ptr(), buf.ptr(), buf.len())?
                };
                if !buf.is_empty() {
                    self.stats.d2h(buf.len());
                }
                flight.landing.push((*idx, p));
            }
        }
        flight.timing.mark(3, &self.stream, false);
        let event = match self.events.lock().pop() {
            Some(e) => e,
            None => Event::new(&self.ctx)?,
        };
        event.record(&self.stream)?;
        flight.event = Some(event);
        Ok(())
    }
}

/// How long a worker polls for its batch's end before it sleeps until the device is
/// done. Measured on an H200 (docs/PERFORMANCE.md "GPU"): sleeping at once added 40-47 us
/// to a 140 us batch (a blocking wait's wake-up); spinning throughout burned a core for
/// as long as the device computed. Batches shorter than this are answered as by spinning;
/// a longer one costs at most this much CPU time.
const WAIT_SPIN: std::time::Duration = std::time::Duration::from_micros(500);

/// How much page-locked memory an instance lends to responses at most: a response reads
/// its outputs where the device copied them (no copy out of the staging buffer; 4 MiB
/// took about 0.3 ms to copy, a fifth of the MLP's batch of 256 on an H200) until it is
/// freed; past this, outputs are copied out as a response an application keeps would
/// otherwise keep memory locked.
const LEND_PINNED: u64 = 64 << 20;

/// A started batch: the buffers its queued work uses and the event that marks its end.
struct InFlight {
    /// What the backend's `execute` returned.
    ran: Result<()>,
    event: Option<Event>,
    events: Arc<Mutex<Vec<Event>>>,
    timing: Timing,
    stats: Arc<GpuInstanceStats>,
    outputs: Vec<(usize, DeviceBuf)>,
    landing: Vec<(usize, PinnedBuf)>,
    /// Kept until the work that reads them has run.
    #[allow(dead_code)]
    inputs: (Option<DeviceBuf>, Option<PinnedBuf>),
    any_on_device: bool,
    device: i32,
}

impl Completion for InFlight {
    fn complete(mut self: Box<Self>, batch: &mut Batch) -> Result<()> {
        // Without an event the stream was synchronized when the batch failed.
        let waited = self.event.take().map(|event| {
            let waited = event.wait(WAIT_SPIN);
            self.events.lock().push(event);
            waited
        });
        // The batch's work has run: its timing events have completed (read without
        // waiting), unless waiting failed.
        let times = match &waited {
            Some(Err(_)) => None,
            _ => self.timing.read(),
        };
        self.stats.batch_done(times);
        if let Some(waited) = waited {
            waited.map_err(|e| {
                e.context(format!(
                    "model '{}' on GPU {}: the batch's work on the stream failed",
                    batch.config.name, self.device
                ))
            })?;
        }
        let InFlight {
            ran,
            outputs,
            landing,
            any_on_device,
            ..
        } = *self;
        ran?;
        for (idx, p) in landing {
            batch.outputs[idx].data = match p.lend(LEND_PINNED) {
                Ok(p) => OutputBytes::Pinned(p),
                Err(p) => OutputBytes::Owned(p.as_slice().to_vec()),
            };
        }
        for (idx, buf) in outputs {
            if any_on_device && batch.config.output(&batch.outputs[idx].name).is_some() {
                batch.outputs[idx].device = Some(Arc::new(buf));
            }
        }
        Ok(())
    }
}

impl ModelInstance for GpuInstance {
    fn execute(&mut self, batch: &mut Batch) -> Result<()> {
        let flight = self.start(batch)?;
        Box::new(flight).complete(batch)
    }

    fn begin(&mut self, batch: &mut Batch) -> Option<Result<Box<dyn Completion>>> {
        Some(
            self.start(batch)
                .map(|f| Box::new(f) as Box<dyn Completion>),
        )
    }

    fn device(&self) -> Option<i32> {
        Some(self.ctx.ordinal())
    }

    fn gpu_stats(&self) -> Option<Arc<GpuInstanceStats>> {
        Some(self.stats.clone())
    }
}

/// Copies a request's inputs that are in device memory to the host, for a model whose
/// instances read them there (CPU instances, sequence batching, generative models).
/// The caller's device memory is released once copied.
pub fn inputs_to_host(req: &mut crate::request::Request) -> Result<()> {
    for t in &mut req.inputs {
        let Some(d) = t.data.device() else {
            continue;
        };
        let at = |e: Error| {
            e.context(format!(
                "input '{}' of model '{}' on GPU {}: copying it to the host",
                t.name, req.model, d.device
            ))
        };
        let ctx = crate::cuda::context(d.device).map_err(at)?;
        let _bound = crate::cuda::ScopedBind::new(&ctx).map_err(at)?;
        let mut host = vec![0u8; d.len];
        // SAFETY: `len` bytes of device memory at `ptr`, valid while the tensor holds
        // them: memory the caller lent (checked against the driver's allocation when the
        // input was added) or a batch output passed on by an ensemble (its buffer held).
        unsafe { crate::cuda::driver::copy_to_host_now(&mut host, d.ptr) }.map_err(at)?;
        t.data = crate::tensor::TensorData::Owned(host);
    }
    Ok(())
}
