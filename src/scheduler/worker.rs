//! The worker threads of a model's scheduler, one per model instance: each takes a batch
//! from the queue (or from the sequence batcher), executes it on its instance (pipelined
//! on a GPU instance), splits the outputs into one FINAL response per request and
//! delivers them, in batch order when `preserve_ordering` is set. No lock is held while a
//! backend or a response callback runs.

use super::dynamic::{decide, Decision};
use super::queue::Queued;
use super::{c_name, sequence, Scheduler, IDLE_SPIN};
use crate::backend::{Batch, ModelInstance};
use crate::config::ModelConfig;
use crate::request::{Request, Response, ResponseSink};
use crate::status::{Code, Error, Result};
use std::ffi::CString;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

impl Scheduler {
    fn fail(&self, req: Box<Request>, err: Error) {
        self.stats
            .failure_count
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        req.fail(&self.model, err);
    }

    pub(super) fn worker(self: Arc<Self>, index: usize, mut instance: Box<dyn ModelInstance>) {
        let mut taken: Vec<Queued> = Vec::new();
        let mut ending: Vec<(Box<Request>, Error)> = Vec::new();
        while let Some(seq) = self.next_batch(index, &mut taken, &mut ending, false) {
            for (req, err) in ending.drain(..) {
                self.fail(req, err);
            }
            if taken.is_empty() {
                continue;
            }
            let requests: Vec<Box<Request>> = taken.drain(..).map(|q| q.req).collect();
            let answers = self.execute(instance.as_mut(), requests);
            self.running[index].lock().clear();
            self.deliver(seq, answers);
            let mut st = self.state.lock();
            st.executing -= 1;
        }
        drop(instance);
    }

    /// The worker of an instance that completes batches asynchronously (a GPU
    /// instance): it starts batch N+1 (inputs staged, work queued) before it waits for
    /// batch N and answers its requests, so at most two batches are in flight and the
    /// device works on one while the host prepares or delivers the other. With a batch
    /// in flight the worker does not sleep for new requests: when none are ready it
    /// finishes the batch first.
    pub(super) fn pipelined_worker(
        self: Arc<Self>,
        index: usize,
        mut instance: Box<dyn ModelInstance>,
    ) {
        let mut taken: Vec<Queued> = Vec::new();
        let mut ending: Vec<(Box<Request>, Error)> = Vec::new();
        let mut in_flight: Option<Started> = None;
        loop {
            let next = self.next_batch(index, &mut taken, &mut ending, in_flight.is_some());
            for (req, err) in ending.drain(..) {
                self.fail(req, err);
            }
            let Some(seq) = next.filter(|_| !taken.is_empty()) else {
                if let Some(previous) = in_flight.take() {
                    self.finish_started(index, previous);
                }
                if next.is_none() {
                    break;
                }
                continue;
            };
            let requests: Vec<Box<Request>> = taken.drain(..).map(|q| q.req).collect();
            let ids: Vec<u64> = requests.iter().map(|r| r.id).collect();
            let start = Instant::now();
            self.record_queue_times(&requests, start);
            let nreq = requests.len() as u64;
            let started =
                match Batch::assemble_gathered(self.config.clone(), &self.in_names, requests) {
                    Ok(mut batch) => {
                        let begun = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            instance.begin(&mut batch)
                        }));
                        let done = match begun {
                            Ok(Some(r)) => r,
                            Ok(None) => Err(Error::internal(format!(
                                "model '{}': instance {index} cannot start batches",
                                self.model.name_str()
                            ))),
                            Err(panic) => Err(self.panic_error(panic)),
                        };
                        Some(Started {
                            seq,
                            batch,
                            done,
                            start,
                            nreq,
                            ids,
                        })
                    }
                    Err((e, requests)) => {
                        let answers = self.fail_all(requests, e);
                        self.end_batch(index, seq, &ids, answers);
                        None
                    }
                };
            if let Some(previous) = in_flight.take() {
                self.finish_started(index, previous);
            }
            in_flight = started;
        }
        drop(instance);
    }

    /// Waits for a started batch, then answers its requests.
    fn finish_started(&self, index: usize, s: Started) {
        let Started {
            seq,
            mut batch,
            done,
            start,
            nreq,
            ids,
        } = s;
        let result = done.and_then(|c| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.complete(&mut batch)))
                .unwrap_or_else(|panic| Err(self.panic_error(panic)))
        });
        let compute = start.elapsed().as_micros() as u64;
        self.stats.record_execution(batch.size, nreq, compute);
        let answers = self.split(batch, result);
        self.end_batch(index, seq, &ids, answers);
    }

    /// Delivers a finished batch and forgets its requests.
    fn end_batch(
        &self,
        index: usize,
        seq: u64,
        ids: &[u64],
        answers: Vec<(ResponseSink, Box<Response>)>,
    ) {
        self.running[index].lock().retain(|id| !ids.contains(id));
        self.deliver(seq, answers);
        let mut st = self.state.lock();
        st.executing -= 1;
    }

    fn panic_error(&self, panic: Box<dyn std::any::Any + Send>) -> Error {
        Error::internal(format!(
            "model '{}': the backend panicked: {}",
            self.model.name_str(),
            crate::status::panic_message(&*panic)
        ))
    }

    pub(super) fn sequence_worker(
        self: Arc<Self>,
        index: usize,
        mut instance: Box<dyn ModelInstance>,
    ) {
        let Some(sq) = self.seq.as_ref() else {
            return;
        };
        let record = |reqs: &[Box<Request>]| {
            let mut running = self.running[index].lock();
            running.clear();
            running.extend(reqs.iter().map(|r| r.id));
        };
        loop {
            let (work, notes) = sq.next_work(index, &record);
            for (level, msg) in notes {
                self.log.log(level, &msg);
            }
            let formed = match work {
                sequence::Work::Exit => break,
                sequence::Work::End(list) => {
                    for (req, err) in list {
                        self.fail(req, err);
                    }
                    continue;
                }
                sequence::Work::Batch(f) => f,
            };
            let sequence::Formed {
                seq_no,
                size,
                requests,
                rows,
            } = formed;
            let start = Instant::now();
            self.record_queue_times(&requests, start);
            let nreq = requests.len() as u64;
            let first_rows = rows.iter().map(|r| r.row).collect();
            let ids: Vec<u64> = requests.iter().map(|r| r.id).collect();
            let (answers, mut states) = match Batch::assemble_rows(
                self.config.clone(),
                &self.in_names,
                requests,
                first_rows,
                size,
            ) {
                Err((e, requests)) => (self.fail_all(requests, e), None),
                Ok(mut batch) => {
                    let result = match sq.add_inputs(&mut batch, &rows) {
                        Ok(()) => self.run(instance.as_mut(), &mut batch, nreq, start),
                        Err(e) => Err(e),
                    };
                    let (result, states) = match result {
                        Ok(()) => match sq.take_states(&batch, &rows) {
                            Ok(s) => (Ok(()), Some(s)),
                            Err(e) => (Err(e), None),
                        },
                        Err(e) => (Err(e), None),
                    };
                    (self.split(batch, result), states)
                }
            };
            // A request answered with an error leaves its sequence's state as it was
            // (as a failed batch does), even where the backend wrote a new one: the
            // answer can still fail after execution (an output it did not produce, a
            // malformed BYTES output), and a retry must not apply the step twice.
            if let Some(states) = states.as_mut() {
                for (id, state) in ids.iter().zip(states.iter_mut()) {
                    let failed = answers
                        .iter()
                        .any(|(_, r)| r.request_id == *id && r.status != Code::Ok);
                    if failed {
                        *state = None;
                    }
                }
            }
            self.running[index].lock().clear();
            sq.complete(rows, states);
            self.deliver(seq_no, answers);
            sq.done();
        }
        drop(instance);
    }

    /// Blocks until there is a batch (returns its sequence number, requests in `taken`)
    /// or requests to end with an error (`ending`, `taken` empty), or the scheduler is
    /// closed and drained (None).
    fn next_batch(
        &self,
        worker: usize,
        taken: &mut Vec<Queued>,
        ending: &mut Vec<(Box<Request>, Error)>,
        no_wait: bool,
    ) -> Option<u64> {
        let mut st = self.state.lock();
        let mut expired = Vec::new();
        loop {
            if !st.ending.is_empty() {
                ending.append(&mut st.ending);
                return Some(0);
            }
            if st.queue.is_empty() {
                if st.closed {
                    return None;
                }
                if no_wait {
                    return Some(0);
                }
                // Spin briefly before sleeping: see IDLE_SPIN.
                drop(st);
                let start = Instant::now();
                let mut spins = 0u32;
                while self.pending.load(Ordering::Acquire) == 0 {
                    std::hint::spin_loop();
                    spins = spins.wrapping_add(1);
                    // Reading the clock costs more than a spin: look at it now and then.
                    if spins.is_multiple_of(64) && start.elapsed() >= IDLE_SPIN {
                        break;
                    }
                }
                st = self.state.lock();
                if st.queue.is_empty() && st.ending.is_empty() && !st.closed {
                    self.cv.wait(&mut st);
                }
                continue;
            }
            // Timeouts apply while paused too.
            let now = Instant::now();
            st.queue.expire(now, &mut expired);
            if !expired.is_empty() {
                self.pending.fetch_sub(expired.len(), Ordering::Release);
                ending.extend(expired.drain(..).map(|q| {
                    let msg = format!(
                        "request {} for model '{}' timed out in the queue",
                        q.req.id,
                        self.model.name_str()
                    );
                    (q.req, Error::deadline(msg))
                }));
                return Some(0);
            }
            if st.paused {
                if no_wait {
                    return Some(0);
                }
                match st.queue.next_deadline() {
                    Some(d) => {
                        self.cv.wait_until(&mut st, d);
                    }
                    None => self.cv.wait(&mut st),
                }
                continue;
            }
            match decide(&self.policy, st.queue.iter().map(|q| q.candidate()), now) {
                Decision::Execute(n) => {
                    st.queue.pop_front(n, taken);
                    self.pending.fetch_sub(taken.len(), Ordering::Release);
                    // (A pipelined worker may still be completing its previous batch,
                    // whose ids stay until it is delivered.)
                    self.running[worker]
                        .lock()
                        .extend(taken.iter().map(|q| q.req.id));
                    st.executing += 1;
                    let seq = st.next_batch_seq;
                    st.next_batch_seq += 1;
                    let more = !st.queue.is_empty();
                    drop(st);
                    if more {
                        self.cv.notify_one();
                    }
                    return Some(seq);
                }
                Decision::WaitUntil(_) | Decision::Idle if no_wait => return Some(0),
                Decision::WaitUntil(t) => {
                    let t = st.queue.next_deadline().map_or(t, |d| d.min(t));
                    self.cv.wait_until(&mut st, t);
                }
                Decision::Idle => {
                    self.cv.wait(&mut st);
                }
            }
        }
    }

    fn record_queue_times(&self, requests: &[Box<Request>], start: Instant) {
        for r in requests {
            self.stats
                .queue_us
                .record(start.saturating_duration_since(r.enqueued_at).as_micros() as u64);
        }
    }

    /// Every request ends with `e` (nothing ran).
    fn fail_all(
        &self,
        requests: Vec<Box<Request>>,
        e: Error,
    ) -> Vec<(ResponseSink, Box<Response>)> {
        let e = e.context(format!("model '{}'", self.model.name_str()));
        requests
            .into_iter()
            .filter_map(|mut r| {
                let sink = r.sink.take()?;
                self.stats.failure_count.fetch_add(1, Ordering::Relaxed);
                Some((
                    sink,
                    Response::error(r.id, &self.model, &r.correlation_id, e.clone()),
                ))
            })
            .collect()
    }

    /// Runs one batch and turns the result into one FINAL response per request.
    fn execute(
        &self,
        instance: &mut dyn ModelInstance,
        requests: Vec<Box<Request>>,
    ) -> Vec<(ResponseSink, Box<Response>)> {
        let start = Instant::now();
        self.record_queue_times(&requests, start);
        let nreq = requests.len() as u64;
        let assembled = if instance.device().is_some() {
            Batch::assemble_gathered(self.config.clone(), &self.in_names, requests)
        } else {
            Batch::assemble(self.config.clone(), &self.in_names, requests)
        };
        let mut batch = match assembled {
            Ok(b) => b,
            Err((e, requests)) => return self.fail_all(requests, e),
        };
        let result = self.run(instance, &mut batch, nreq, start);
        self.split(batch, result)
    }

    /// Executes an assembled batch (a panicking backend fails the batch) and records it.
    fn run(
        &self,
        instance: &mut dyn ModelInstance,
        batch: &mut Batch,
        nreq: u64,
        start: Instant,
    ) -> Result<()> {
        let result =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| instance.execute(batch)));
        let compute = start.elapsed().as_micros() as u64;
        self.stats.record_execution(batch.size, nreq, compute);
        match result {
            Ok(r) => r,
            Err(panic) => Err(self.panic_error(panic)),
        }
    }

    fn split(&self, batch: Batch, result: Result<()>) -> Vec<(ResponseSink, Box<Response>)> {
        let Batch {
            requests,
            first_rows,
            size,
            outputs,
            row_errors,
            config,
            ..
        } = batch;
        let mut answers = Vec::with_capacity(requests.len());
        let outputs_checked: Result<Vec<SplitOutput>> = match &result {
            Ok(()) => outputs
                .into_iter()
                // Implicit-state outputs that are not model outputs stay inside.
                .filter(|o| config.output(&o.name).is_some())
                .map(|o| {
                    let (name, tc) = self
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
                                self.model.name_str(),
                                o.name,
                                crate::tensor::shape_string(&o.shape)
                            )));
                        }
                        Some(crate::tensor::bytes_element_offsets(&o.data))
                    } else {
                        None
                    };
                    // The model computes in `reshape`; callers see `dims` (fixed dims only).
                    let reshape_back = tc
                        .filter(|t| t.reshape.is_some() && t.dims.iter().all(|d| *d >= 0))
                        .map(|t| t.dims.clone());
                    Ok(SplitOutput {
                        name,
                        dtype: o.dtype,
                        shape: o.shape,
                        buf: Arc::new(o.data),
                        device: o.device,
                        bytes_offsets,
                        reshape_back,
                    })
                })
                .collect(),
            Err(e) => Err(e.clone()),
        };
        for (mut req, first_row) in requests.into_iter().zip(first_rows) {
            let rows = req.batch_size;
            if let Some(sink) = req.sink.take() {
                let window = RowWindow {
                    batch_rows: size,
                    first_row,
                    rows,
                };
                let resp = self.answer(&req, window, &outputs_checked, &row_errors, &config);
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
        w: RowWindow,
        outputs: &Result<Vec<SplitOutput>>,
        row_errors: &[(u32, Error)],
        config: &ModelConfig,
    ) -> Box<Response> {
        let fail = |e: Error| {
            self.stats.failure_count.fetch_add(1, Ordering::Relaxed);
            Response::error(req.id, &self.model, &req.correlation_id, e)
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
        if let Some(m) = req
            .requested_outputs
            .iter()
            .find(|want| !outs.iter().any(|o| o.name.as_bytes() == want.as_bytes()))
        {
            return fail(Error::internal(format!(
                "model '{}': the backend did not produce output '{m}'",
                self.model.name_str()
            )));
        }
        let mut resp = Response::ok(req.id, &self.model, &req.correlation_id);
        resp.outputs.reserve(outs.len());
        for o in outs {
            if !req.wants_output(o.name.to_str().unwrap_or("")) {
                continue;
            }
            let total = o.device.as_ref().map_or(o.buf.len(), |d| d.len());
            let (offset, len, mut shape) =
                row_window(config, w, &o.shape, total, o.bytes_offsets.as_deref());
            if let Some(dims) = &o.reshape_back {
                let batch_dims = usize::from(config.max_batch_size > 0);
                shape.truncate(batch_dims);
                shape.extend(dims.iter().copied());
            }
            resp.outputs.push(crate::request::OutputTensor {
                name: o.name.clone(),
                dtype: o.dtype,
                shape,
                data: match (&o.device, req.output_device) {
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
        self.stats.success_count.fetch_add(1, Ordering::Relaxed);
        resp
    }

    /// Hands responses to their callbacks, in batch order when preserve_ordering is set.
    fn deliver(&self, seq: u64, answers: Vec<(ResponseSink, Box<Response>)>) {
        if !self.preserve_ordering {
            for (sink, resp) in answers {
                sink.send_final(resp);
            }
            return;
        }
        let mut ro = self.reorder.lock();
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
            ro = self.reorder.lock();
        }
        ro.delivering = false;
    }
}

/// A batch a pipelined worker started, on its way to completion.
struct Started {
    seq: u64,
    batch: Batch,
    done: Result<Box<dyn crate::backend::Completion>>,
    start: Instant,
    nreq: u64,
    ids: Vec<u64>,
}

struct SplitOutput {
    name: Arc<CString>,
    dtype: crate::tensor::DataType,
    shape: crate::request::Shape,
    buf: Arc<Vec<u8>>,
    /// The output in device memory, for requests that want it there.
    device: Option<Arc<crate::cuda::DeviceBuf>>,
    /// Element offsets of a BYTES output.
    bytes_offsets: Option<Vec<usize>>,
    /// The config's dims, when the model computes this output in a `reshape` shape.
    reshape_back: Option<Vec<i64>>,
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
