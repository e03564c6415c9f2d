//! Executing a formed batch on a model instance and answering its requests: the part the
//! two batch-forming kinds (the dynamic and the sequence batcher) share. The batch's
//! outputs are split into one FINAL response per request and delivered, in batch order
//! when `preserve_ordering` is set. No lock is held while a backend or a response
//! callback runs.

use super::{c_name, Scheduler};
use crate::backend::decoupled::Outstanding;
use crate::backend::{Batch, ModelInstance};
use crate::config::ModelConfig;
use crate::request::{Request, Response, ResponseSink};
use crate::status::{Error, Result};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::ffi::CString;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// Responses of finished batches waiting for earlier batches (preserve_ordering).
#[derive(Default)]
struct Reorder {
    next: u64,
    ready: BTreeMap<u64, Vec<(ResponseSink, Box<Response>)>>,
    delivering: bool,
}

/// A request a worker executes.
pub(super) struct Running {
    pub(super) id: u64,
    /// Taken back by the worker to answer, or by an abandoning shutdown.
    pub(super) sink: Option<ResponseSink>,
}

/// The execution bookkeeping of a batch-forming kind.
pub(super) struct Batches {
    pub(super) in_names: Vec<Arc<CString>>,
    out_names: Vec<Arc<CString>>,
    preserve_ordering: bool,
    reorder: Mutex<Reorder>,
    /// What each worker is executing now: the request ids (for cancel) and, while the
    /// backend runs, their response sinks, so that a shutdown that gives up on a stuck
    /// backend can answer them (the worker then finds the sink gone).
    pub(super) running: Vec<Mutex<Vec<Running>>>,
    /// The data-path statistics of the instances on a GPU: (instance index, counters).
    gpu_stats: Vec<(usize, Arc<crate::stats::GpuInstanceStats>)>,
    /// The devices (bit = ordinal) whose sticky fault this model has logged.
    faults_logged: std::sync::atomic::AtomicU64,
    /// Requests a decoupled backend still answers after their batch was split.
    pub(super) outstanding: Arc<Outstanding>,
    /// By instance: its place in the server's rate limiter (empty when that is off).
    rate_slots: Vec<Arc<super::rate::Slot>>,
}

impl Batches {
    pub(super) fn new(
        config: &ModelConfig,
        instances: &[Box<dyn ModelInstance>],
        rate_slots: Vec<Arc<super::rate::Slot>>,
    ) -> Batches {
        let oldest_ordering = config.sequence_batching.as_ref().is_some_and(|q| {
            matches!(
                q.strategy,
                crate::config::SequenceStrategy::Oldest {
                    preserve_ordering: true,
                    ..
                }
            )
        });
        let dynamic_ordering = config
            .dynamic_batching
            .as_ref()
            .is_some_and(|d| d.preserve_ordering);
        Batches {
            in_names: config.inputs.iter().map(|t| c_name(&t.name)).collect(),
            out_names: config.outputs.iter().map(|t| c_name(&t.name)).collect(),
            preserve_ordering: dynamic_ordering || oldest_ordering,
            reorder: Mutex::new(Reorder::default()),
            running: instances.iter().map(|_| Mutex::new(Vec::new())).collect(),
            gpu_stats: instances
                .iter()
                .enumerate()
                .filter_map(|(i, inst)| inst.gpu_stats().map(|g| (i, g)))
                .collect(),
            faults_logged: std::sync::atomic::AtomicU64::new(0),
            outstanding: Arc::new(Outstanding::default()),
            rate_slots,
        }
    }

    /// The sticky faults of the devices this model's instances run on: (GPU, why).
    fn device_faults(&self) -> Vec<(i32, String)> {
        let mut faults = crate::cuda::driver::device_faults();
        faults.retain(|(d, _)| self.gpu_stats.iter().any(|(_, g)| g.device() == *d));
        faults
    }

    /// True when a worker is executing request `id`.
    pub(super) fn is_running(&self, id: u64) -> bool {
        self.running
            .iter()
            .any(|r| r.lock().iter().any(|x| x.id == id))
    }

    /// Takes the sinks of every executing request, and of every request a decoupled
    /// backend still answers (a shutdown that stopped waiting for a stuck backend
    /// answers them).
    pub(super) fn abandon_running(&self, why: &str, out: &mut Vec<super::Abandoned>) {
        for r in &self.running {
            for x in r.lock().iter_mut() {
                if let Some(sink) = x.sink.take() {
                    out.push(super::Abandoned::Executing(x.id, sink));
                }
            }
        }
        let err = Error::cancelled(why.to_owned());
        for (id, sink) in self.outstanding.abandon(&err) {
            out.push(super::Abandoned::Executing(id, sink));
        }
    }

    /// True when nothing is executing and no decoupled backend still answers a request.
    pub(super) fn none_outstanding(&self) -> bool {
        self.outstanding.is_empty()
    }

    /// A request a worker executes, or that a decoupled backend still answers (then it
    /// is marked cancelled, for the backend to see).
    pub(super) fn is_running_or_cancel(&self, id: u64) -> bool {
        self.is_running(id) || self.outstanding.cancel(id)
    }

    /// The "gpu" member of the statistics JSON (with its leading comma), if any instance
    /// runs on a GPU.
    pub(super) fn stats_json(&self, out: &mut String) {
        if self.gpu_stats.is_empty() {
            return;
        }
        let instances: Vec<String> = self.gpu_stats.iter().map(|(i, g)| g.json(*i)).collect();
        out.push_str(",\"gpu\":{\"instances\":[");
        out.push_str(&instances.join(","));
        out.push(']');
        // Devices lost to a sticky fault: their instances fail every batch.
        let faults: Vec<String> = self
            .device_faults()
            .iter()
            .map(|(d, why)| {
                format!(
                    "{{\"device\":{d},\"error\":{}}}",
                    serde_json::Value::String(why.clone())
                )
            })
            .collect();
        if !faults.is_empty() {
            out.push_str(",\"faults\":[");
            out.push_str(&faults.join(","));
            out.push(']');
        }
        out.push('}');
    }

    pub(super) fn stats_prometheus(&self, out: &mut crate::stats::PromText, labels: &str) {
        for (i, g) in &self.gpu_stats {
            g.prometheus(out, labels, *i);
        }
    }
}

/// One worker's view: the scheduler it serves, its kind's bookkeeping, its instance index.
pub(super) struct Worker<'a> {
    pub(super) s: &'a Scheduler,
    pub(super) b: &'a Batches,
    pub(super) index: usize,
}

impl Worker<'_> {
    pub(super) fn fail(&self, req: Box<Request>, err: Error) {
        self.s.fail(req, err);
    }

    /// Sets what this worker executes now: the requests' ids (for cancel) and their
    /// sinks (moved out of the requests until the batch is answered).
    pub(super) fn set_running(&self, reqs: &mut [Box<Request>]) {
        let mut running = self.b.running[self.index].lock();
        running.clear();
        running.extend(reqs.iter_mut().map(|r| Running {
            id: r.id,
            sink: r.sink.take(),
        }));
    }

    /// Gives the requests of a finished batch their sinks back and forgets them (those an
    /// abandoning shutdown took stay without: they were answered). One lock per batch.
    fn reclaim_sinks(&self, reqs: &mut [Box<Request>]) {
        let mut running = self.b.running[self.index].lock();
        let n = reqs.len();
        let in_order = running.len() >= n
            && running[..n]
                .iter()
                .zip(reqs.iter())
                .all(|(x, r)| x.id == r.id);
        if in_order {
            // The batch's requests come first, in the order they were taken.
            for (x, r) in running.drain(..n).zip(reqs.iter_mut()) {
                if let Some(sink) = x.sink {
                    r.sink = Some(sink);
                }
            }
            return;
        }
        for r in reqs.iter_mut() {
            if let Some(i) = running.iter().position(|x| x.id == r.id) {
                if let Some(sink) = running.remove(i).sink {
                    r.sink = Some(sink);
                }
            }
        }
    }

    pub(super) fn panic_error(&self, panic: Box<dyn std::any::Any + Send>) -> Error {
        Error::internal(format!(
            "model '{}': the backend panicked: {}",
            self.s.model.name_str(),
            crate::status::panic_message(&*panic)
        ))
    }

    pub(super) fn record_queue_times(&self, requests: &[Box<Request>], start: Instant) {
        for r in requests {
            self.s
                .stats
                .queue_us
                .record(start.saturating_duration_since(r.enqueued_at).as_micros() as u64);
        }
    }

    /// Every request ends with `e` (nothing ran).
    pub(super) fn fail_all(
        &self,
        mut requests: Vec<Box<Request>>,
        e: Error,
    ) -> Vec<(ResponseSink, Box<Response>)> {
        self.reclaim_sinks(&mut requests);
        let e = e.context(format!("model '{}'", self.s.model.name_str()));
        requests
            .into_iter()
            .filter_map(|mut r| {
                let sink = r.sink.take()?;
                self.s.stats.failure_count.fetch_add(1, Ordering::Relaxed);
                Some((
                    sink,
                    Response::error(r.id, &self.s.model, &r.correlation_id, e.clone()),
                ))
            })
            .collect()
    }

    /// Waits for this instance's turn and resources in the server's rate limiter, when it
    /// is on; they are held until the grant is dropped.
    pub(super) fn rate_grant(&self) -> Option<super::rate::Grant> {
        self.b.rate_slots.get(self.index).map(|s| s.acquire())
    }

    /// Whether this instance takes turns in the server's rate limiter.
    pub(super) fn rate_limited(&self) -> bool {
        self.b.rate_slots.get(self.index).is_some()
    }

    /// Runs one batch and turns the result into one FINAL response per request.
    pub(super) fn execute(
        &self,
        instance: &mut dyn ModelInstance,
        requests: Vec<Box<Request>>,
    ) -> Vec<(ResponseSink, Box<Response>)> {
        let start = Instant::now();
        self.record_queue_times(&requests, start);
        let nreq = inferences(&requests);
        let assembled = if instance.device().is_some() {
            Batch::assemble_gathered(self.s.config.clone(), &self.b.in_names, requests)
        } else {
            Batch::assemble(self.s.config.clone(), &self.b.in_names, requests)
        };
        let mut batch = match assembled {
            Ok(b) => b,
            Err((e, requests)) => return self.fail_all(requests, e),
        };
        let assembled_at = Instant::now();
        let (result, began) = self.run(instance, &mut batch, nreq, start);
        let ran_at = Instant::now();
        let answers = self.split(batch, result);
        self.s
            .stats
            .record_phases(assembled_at - start, ran_at - began, ran_at.elapsed());
        answers
    }

    /// Executes an assembled batch (a panicking backend fails the batch) and records it.
    /// Also returns when the backend began: after the wait for the rate limiter, which
    /// is in none of the execution's phases (see `ModelStats::record_phases`).
    pub(super) fn run(
        &self,
        instance: &mut dyn ModelInstance,
        batch: &mut Batch,
        nreq: u64,
        start: Instant,
    ) -> (Result<()>, Instant) {
        let grant = self.rate_grant();
        let began = Instant::now();
        let result =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| instance.execute(batch)));
        drop(grant);
        let compute = start.elapsed().as_micros() as u64;
        self.s.stats.record_execution(batch.size, nreq, compute);
        let result = match result {
            Ok(r) => r,
            Err(panic) => Err(self.panic_error(panic)),
        };
        (result, began)
    }

    /// A failed batch's error, as the requests get it: where this worker's instance is on
    /// a GPU that has had a sticky fault, that is the reason (UNAVAILABLE, naming the
    /// device and the fault), whatever call of the batch saw it first; the fault is
    /// logged once per device for this model.
    fn device_fault_error(&self, e: Error) -> Error {
        self.log_device_faults();
        let device = self
            .b
            .gpu_stats
            .iter()
            .find(|(i, _)| *i == self.index)
            .map(|(_, g)| g.device());
        let Some(why) = device.and_then(crate::cuda::driver::device_fault) else {
            return e;
        };
        if e.message.contains(&why) {
            return Error::unavailable(e.message);
        }
        Error::unavailable(format!(
            "model '{}': {why} (the batch failed with: {})",
            self.s.model.name_str(),
            e.message
        ))
    }

    /// Logs, once per device for this model, a sticky fault of a GPU its instances run
    /// on (a failed batch is where it shows).
    fn log_device_faults(&self) {
        use std::sync::atomic::Ordering;
        for (dev, why) in self.b.device_faults() {
            let bit = 1u64 << (dev.clamp(0, 63) as u32);
            if self.b.faults_logged.fetch_or(bit, Ordering::AcqRel) & bit == 0 {
                self.s.log.error(&format!(
                    "model '{}': {why}; its instances on GPU {dev} answer every request with UNAVAILABLE (models on the CPU and on other GPUs keep serving)",
                    self.s.model.name_str()
                ));
            }
        }
    }

    pub(super) fn split(
        &self,
        batch: Batch,
        result: Result<()>,
    ) -> Vec<(ResponseSink, Box<Response>)> {
        let Batch {
            mut requests,
            first_rows,
            size,
            outputs,
            row_errors,
            config,
            senders,
            ..
        } = batch;
        self.reclaim_sinks(&mut requests);
        let result = match result {
            Err(e) => Err(self.device_fault_error(e)),
            ok => ok,
        };
        let mut answers = Vec::with_capacity(requests.len());
        let outputs_checked: Result<Vec<SplitOutput>> = match &result {
            Ok(()) => outputs
                .into_iter()
                // Implicit-state outputs that are not model outputs stay inside.
                .filter(|o| config.output(&o.name).is_some())
                .map(|o| {
                    let (name, tc) = self
                        .b
                        .out_names
                        .iter()
                        .zip(&config.outputs)
                        .find(|(_, t)| t.name == o.name)
                        .map(|(c, t)| (c.clone(), Some(t)))
                        .unwrap_or_else(|| (c_name(&o.name), None));
                    let bytes_offsets = if o.dtype == crate::tensor::DataType::Bytes {
                        let n = Batch::check_bytes_output(&o)?;
                        if crate::tensor::element_count(&o.shape) != Some(n) {
                            return Err(Error::internal(format!(
                                "model '{}': output '{}' has shape {} but holds {n} BYTES elements",
                                self.s.model.name_str(),
                                o.name,
                                crate::tensor::shape_string(&o.shape)
                            )));
                        }
                        Some(crate::tensor::bytes_element_offsets(&o.data))
                    } else {
                        None
                    };
                    let scatter = match config.batch_output_source(&o.name) {
                        Some(src) => Some(self.scatter_windows(&requests, &o, src)?),
                        None => None,
                    };
                    // The model computes in `reshape`; callers see `dims` (fixed dims only).
                    let reshape_back = tc
                        .filter(|t| t.reshape.is_some() && t.dims.iter().all(|d| *d >= 0))
                        .map(|t| t.dims.clone());
                    Ok(SplitOutput {
                        name,
                        dtype: o.dtype,
                        shape: o.shape,
                        buf: o.data.into_shared(),
                        device: o.device,
                        bytes_offsets,
                        reshape_back,
                        scatter,
                    })
                })
                .collect(),
            Err(e) => Err(e.clone()),
        };
        for (i, (mut req, first_row)) in requests.into_iter().zip(first_rows).enumerate() {
            let rows = req.batch_size;
            if let Some(Some(sender)) = senders.get(i) {
                // A decoupled backend answers this request itself.
                let last_row = first_row + rows;
                let failed = match &outputs_checked {
                    Err(e) => Some(e.clone()),
                    Ok(_) => (row_errors.iter())
                        .find(|(r, _)| *r >= first_row && *r < last_row)
                        .map(|(_, e)| e.clone()),
                };
                match (req.sink.take(), failed) {
                    (Some(sink), None) => {
                        self.s.stats.success_count.fetch_add(1, Ordering::Relaxed);
                        sender.attach(sink, &self.s.model, &self.b.outstanding);
                    }
                    (Some(sink), Some(e)) => {
                        sender.end(&e);
                        self.s.stats.failure_count.fetch_add(1, Ordering::Relaxed);
                        let resp = Response::error(req.id, &self.s.model, &req.correlation_id, e);
                        answers.push((sink, resp));
                    }
                    (None, _) => sender.end(&Error::cancelled(
                        "a shutdown answered the request while its batch ran",
                    )),
                }
                crate::request::pool::recycle_request(req);
                continue;
            }
            if let Some(sink) = req.sink.take() {
                let window = RowWindow {
                    batch_rows: size,
                    first_row,
                    rows,
                };
                let resp = self.answer(&req, i, window, &outputs_checked, &row_errors, &config);
                answers.push((sink, resp));
            }
            crate::request::pool::recycle_request(req);
        }
        answers
    }

    /// The FINAL response of one request of a finished batch.
    fn answer(
        &self,
        req: &Request,
        index: usize,
        w: RowWindow,
        outputs: &Result<Vec<SplitOutput>>,
        row_errors: &[(u32, Error)],
        config: &ModelConfig,
    ) -> Box<Response> {
        let fail = |e: Error| {
            self.s.stats.failure_count.fetch_add(1, Ordering::Relaxed);
            Response::error(req.id, &self.s.model, &req.correlation_id, e)
        };
        let outs = match outputs {
            Ok(o) => o,
            Err(e) => return fail(e.clone()),
        };
        let last_row = w.first_row + w.rows;
        if let Some((_, e)) = row_errors
            .iter()
            .find(|(r, _)| *r >= w.first_row && *r < last_row)
        {
            return fail(e.clone());
        }
        if let Some(m) = (req.requested_outputs.iter())
            .filter(|_| !req.outputs_optional)
            .find(|want| !outs.iter().any(|o| o.name.as_bytes() == want.as_bytes()))
        {
            return fail(Error::internal(format!(
                "model '{}': the backend did not produce output '{m}'",
                self.s.model.name_str()
            )));
        }
        let mut resp = Response::ok(req.id, &self.s.model, &req.correlation_id);
        resp.outputs.reserve(outs.len());
        for o in outs {
            if !req.wants_output(o.name.to_str().unwrap_or("")) {
                continue;
            }
            let total = o.device.as_ref().map_or(o.buf.bytes().len(), |d| d.len());
            let (offset, len, mut shape) = match o.scatter.as_ref().and_then(|s| s.get(index)) {
                Some((offset, len, shape)) => (*offset, *len, shape.clone()),
                None => row_window(config, w, &o.shape, total, o.bytes_offsets.as_deref()),
            };
            if let (Some(dims), None) = (&o.reshape_back, &o.scatter) {
                let batch_dims = usize::from(config.max_batch_size > 0);
                shape.truncate(batch_dims);
                shape.extend(dims.iter().copied());
            }
            resp.outputs.push(crate::request::OutputTensor {
                name: o.name.clone(),
                dtype: o.dtype,
                shape,
                data: match (&o.device, req.outputs_on_device()) {
                    (Some(d), Some(_)) => {
                        crate::tensor::TensorData::Device(crate::tensor::DeviceData {
                            ptr: d.ptr() + offset as u64,
                            len,
                            device: d.device(),
                            keep: crate::tensor::DeviceKeep::Pooled(d.clone()),
                        })
                    }
                    _ => crate::tensor::TensorData::Shared {
                        buf: o.buf.clone(),
                        offset,
                        len,
                    },
                },
            });
        }
        self.s.stats.success_count.fetch_add(1, Ordering::Relaxed);
        resp
    }

    /// Hands responses to their callbacks, in batch order when preserve_ordering is set.
    pub(super) fn deliver(&self, seq: u64, answers: Vec<(ResponseSink, Box<Response>)>) {
        if !self.b.preserve_ordering {
            for (sink, resp) in answers {
                sink.send_final(resp);
            }
            return;
        }
        let mut ro = self.b.reorder.lock();
        ro.ready.insert(seq, answers);
        if ro.delivering {
            return; // the worker delivering now will reach this batch
        }
        ro.delivering = true;
        loop {
            let next = ro.next;
            let Some(batch) = ro.ready.remove(&next) else {
                break;
            };
            ro.next += 1;
            drop(ro);
            for (sink, resp) in batch {
                sink.send_final(resp);
            }
            ro = self.b.reorder.lock();
        }
        ro.delivering = false;
    }
}

impl Worker<'_> {
    /// Where each request's part of a `batch_output` is (BATCH_SCATTER_WITH_INPUT_SHAPE):
    /// the next elements, as many as its `source` input has, in that input's shape. The
    /// output must hold exactly the requests' elements.
    fn scatter_windows(
        &self,
        requests: &[Box<Request>],
        o: &crate::backend::BatchOutput,
        source: &str,
    ) -> Result<Vec<(usize, usize, crate::request::Shape)>> {
        let elem = o.dtype.byte_size();
        let total = o.device.as_ref().map_or(o.data.len(), |d| d.len());
        let mut offset = 0usize;
        let mut out = Vec::with_capacity(requests.len());
        for r in requests {
            let shape = r.input(source).map(|t| t.shape.clone()).unwrap_or_default();
            let len = crate::tensor::element_count(&shape).unwrap_or(0) * elem;
            out.push((offset.min(total), len, shape));
            offset += len;
        }
        if offset != total {
            return Err(Error::internal(format!(
                "model '{}': batch output '{}' holds {} elements, but the requests' input '{source}' has {} (each request gets as many as its '{source}' has)",
                self.s.model.name_str(),
                o.name,
                total / elem.max(1),
                offset / elem.max(1)
            )));
        }
        Ok(out)
    }
}

struct SplitOutput {
    name: Arc<CString>,
    dtype: crate::tensor::DataType,
    shape: crate::request::Shape,
    buf: crate::tensor::SharedBytes,
    /// The output in device memory, for requests that want it there.
    device: Option<Arc<crate::cuda::DeviceBuf>>,
    /// Element offsets of a BYTES output.
    bytes_offsets: Option<Vec<usize>>,
    /// The config's dims, when the model computes this output in a `reshape` shape.
    reshape_back: Option<Vec<i64>>,
    /// Each request's (byte offset, byte length, shape) of a `batch_output`.
    scatter: Option<Vec<(usize, usize, crate::request::Shape)>>,
}

/// Which rows of a batch belong to one request.
#[derive(Clone, Copy)]
struct RowWindow {
    batch_rows: u32,
    first_row: u32,
    rows: u32,
}

/// The byte window and shape of a request's rows of a batch output.
fn row_window(
    config: &ModelConfig,
    w: RowWindow,
    shape: &crate::request::Shape,
    total: usize,
    bytes_offsets: Option<&[usize]>,
) -> (usize, usize, crate::request::Shape) {
    if config.max_batch_size == 0 || w.batch_rows == 0 {
        return (0, total, shape.clone());
    }
    let mut s = shape.clone();
    if let Some(d0) = s.first_mut() {
        *d0 = w.rows as i64;
    }
    let (first, rows) = (w.first_row as usize, w.rows as usize);
    match bytes_offsets {
        None => {
            let per_row = total / w.batch_rows as usize;
            (per_row * first, per_row * rows, s)
        }
        Some(offs) => {
            let elems = offs.len().saturating_sub(1);
            let per_row = elems / w.batch_rows as usize;
            let a = offs[(per_row * first).min(elems)];
            let b = offs[(per_row * (first + rows)).min(elems)];
            (a, b - a, s)
        }
    }
}

/// The inferences a batch of `requests` counts for in the statistics: each request's
/// batch size (Triton's `inference_count`: a request of batch size 6 is 6 inferences;
/// padding rows are none).
pub(super) fn inferences(requests: &[Box<Request>]) -> u64 {
    requests
        .iter()
        .map(|r| u64::from(r.batch_size.max(1)))
        .sum()
}
