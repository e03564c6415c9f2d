//! Outputs computed in host memory, delivered in the device memory a request asked for.
//!
//! A request that asks for its outputs on GPU `d` (`infer_request_set_output_memory`)
//! gets them there whatever served it: outputs a GPU instance produced in device memory
//! stay where they are (see `backend::gpu_instance`), and every other output of its responses that is
//! in host memory (a model on the CPU, an ensemble's final outputs, each response of a
//! generative model, host outputs of a backend on a GPU instance) is copied to `d` just
//! before its callback runs, on the thread that delivers it ([`crate::request::ResponseSink`]).
//! BYTES outputs stay in host memory.
//!
//! Per response: one device buffer from the server's pool for device `d` holds every
//! output copied (each at a 256-byte aligned offset) and is shared by them until
//! `infer_response_free`; the bytes go through a pinned staging buffer of the same pool
//! and up with asynchronous copies on a stream of `d`, which is synchronized before the
//! callback. Buffers and streams go back to the pool, so the steady state allocates
//! nothing. A failure (no device memory, a driver error) turns the response into an
//! error response naming the model, the outputs and the device.

use crate::cuda::driver::{Context, Event, MemoryPool, Stream};

/// How long a delivering thread polls for its copies before it sleeps until they are
/// done (as GPU instances wait for their batches).
const WAIT_SPIN: std::time::Duration = std::time::Duration::from_micros(200);
use crate::cuda::ScopedBind;
use crate::request::{DeliveryHook, Response};
use crate::status::{Code, Error, Result};
use crate::tensor::{DataType, DeviceData, DeviceKeep, TensorData};
use parking_lot::Mutex;
use std::sync::Arc;

/// Alignment of each output in a response's device buffer.
const ALIGN: usize = 256;

/// Copies host outputs of responses to one GPU (one per server and device, made on the
/// first request that asks for that device).
pub struct OutputPlacer {
    ctx: Arc<Context>,
    pool: Arc<MemoryPool>,
    /// Streams no delivering thread uses now, each with the event its copies are
    /// waited for by.
    streams: Mutex<Vec<(Stream, Event)>>,
}

impl OutputPlacer {
    /// A placer for GPU `device` (which the probe found).
    pub fn new(device: i32) -> Result<Arc<OutputPlacer>> {
        let ctx = crate::cuda::context(device)?;
        Ok(Arc::new(OutputPlacer {
            pool: MemoryPool::new(&ctx),
            ctx,
            streams: Mutex::new(Vec::new()),
        }))
    }

    pub fn device(&self) -> i32 {
        self.ctx.ordinal()
    }

    /// The pool the device buffers come from (for statistics and tests).
    pub fn pool(&self) -> &Arc<MemoryPool> {
        &self.pool
    }

    /// Moves `resp`'s host outputs (all but BYTES) to this placer's device. On failure
    /// the response becomes an error response (its outputs dropped) saying what failed.
    pub fn place(&self, resp: &mut Response) {
        if let Err(e) = self.try_place(resp) {
            let e = if resp.status == Code::Ok {
                e
            } else {
                // Keep what the response already said (e.g. a cancelled generation).
                let was = resp
                    .error
                    .as_ref()
                    .map_or(String::new(), |m| m.to_string_lossy().into_owned());
                Error::new(e.code, format!("{}; the response was: {was}", e.message))
            };
            resp.outputs.clear();
            resp.status = e.code;
            resp.error =
                Some(std::ffi::CString::new(e.message.replace('\0', " ")).unwrap_or_default());
        }
    }

    fn try_place(&self, resp: &mut Response) -> Result<()> {
        // The layout: offset of each output to copy in the response's device buffer.
        let mut at: smallvec::SmallVec<[Option<usize>; 4]> = smallvec::SmallVec::new();
        let mut total = 0usize;
        for o in &resp.outputs {
            let host = o.dtype != DataType::Bytes && o.data.device().is_none();
            if host {
                let a = total.next_multiple_of(ALIGN);
                at.push(Some(a));
                total = a + o.data.len();
            } else {
                at.push(None);
            }
        }
        if at.iter().all(Option::is_none) {
            return Ok(());
        }
        let device = self.device();
        let what = || {
            let names: Vec<String> = resp
                .outputs
                .iter()
                .zip(&at)
                .filter(|(_, a)| a.is_some())
                .map(|(o, _)| format!("'{}'", o.name.to_string_lossy()))
                .collect();
            let s = if names.len() == 1 { "" } else { "s" };
            format!(
                "model '{}': output{s} {} ({total} bytes) to GPU {device}",
                resp.model.name_str(),
                names.join(", ")
            )
        };
        let bound = ScopedBind::new(&self.ctx).map_err(|e| e.context(what()))?;
        let dev = self.pool.device(total).map_err(|e| {
            Error::new(
                e.code,
                format!("{}: no device memory: {}", what(), e.message),
            )
        })?;
        let mut pinned = self
            .pool
            .pinned(total)
            .map_err(|e| Error::new(e.code, format!("{}: {}", what(), e.message)))?;
        for (o, a) in resp.outputs.iter().zip(&at) {
            if let Some(a) = *a {
                let src = o.data.as_slice();
                pinned.as_mut_slice()[a..a + src.len()].copy_from_slice(src);
            }
        }
        let popped = self.streams.lock().pop();
        let (stream, event) = match popped {
            Some(s) => s,
            None => (
                Stream::new(&self.ctx).map_err(|e| e.context(what()))?,
                Event::new(&self.ctx).map_err(|e| e.context(what()))?,
            ),
        };
        let mut queued = Ok(());
        for (o, a) in resp.outputs.iter().zip(&at) {
            let Some(a) = *a else { continue };
            // SAFETY: both ranges lie inside `dev` and `pinned`, which live until the
            // stream has been synchronized below (also when a copy fails).
            queued = unsafe {
                stream.copy_to_device(dev.ptr() + a as u64, pinned.as_ptr().add(a), o.data.len())
            };
            if queued.is_err() {
                break;
            }
        }
        // Waited for as a GPU instance waits for its batch: polled briefly, then asleep
        // (a stream synchronize would spin this thread's core, the application's, for
        // as long as the copy runs).
        let synced = match &queued {
            Ok(()) => event.record(&stream).and_then(|()| event.wait(WAIT_SPIN)),
            Err(_) => stream.synchronize(),
        };
        let done = queued.and(synced);
        if done.is_ok() {
            self.streams.lock().push((stream, event));
        }
        // (A stream that failed is dropped: it is destroyed, not reused.)
        done.map_err(|e| {
            Error::new(
                Code::Internal,
                format!("{}: copying to the device: {}", what(), e.message),
            )
        })?;
        drop(pinned);
        drop(bound);
        let dev = Arc::new(dev);
        for (o, a) in resp.outputs.iter_mut().zip(&at) {
            if let Some(a) = *a {
                o.data = TensorData::Device(DeviceData {
                    ptr: dev.ptr() + a as u64,
                    len: o.data.len(),
                    device,
                    keep: DeviceKeep::Pooled(dev.clone()),
                });
            }
        }
        Ok(())
    }
}

impl Drop for OutputPlacer {
    fn drop(&mut self) {
        // Destroying the streams binds the context: give the thread its own back after.
        let _bound = ScopedBind::new(&self.ctx);
        self.streams.lock().clear();
    }
}

impl DeliveryHook for OutputPlacer {
    fn before_delivery(&self, resp: &mut Response) {
        self.place(resp);
    }
}
