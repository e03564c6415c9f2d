//! The worker loops of the batch-forming kinds, one thread per model instance: each
//! takes a batch from its kind (the dynamic batcher's queue or the sequence batcher's
//! slots), executes it on its instance (pipelined on a GPU instance) and delivers the
//! answers (see `execute`). No lock is held while a backend or a response callback runs.

use super::batcher::DynamicBatcher;
use super::execute::{inferences, Worker};
use super::queue::Queued;
use super::sequence::{self, SequenceBatcher};
use super::Scheduler;
use crate::backend::{Batch, ModelInstance};
use crate::request::{Request, Response, ResponseSink};
use crate::status::{Code, Error, Result};
use std::time::{Duration, Instant};

impl DynamicBatcher {
    pub(super) fn worker(&self, s: &Scheduler, index: usize, mut instance: Box<dyn ModelInstance>) {
        let w = Worker {
            s,
            b: &self.batches,
            index,
        };
        let mut taken: Vec<Queued> = Vec::new();
        let mut ending: Vec<(Box<Request>, Error)> = Vec::new();
        while let Some(seq) = self.next_batch(s, index, &mut taken, &mut ending, false) {
            for (req, err) in ending.drain(..) {
                w.fail(req, err);
            }
            if taken.is_empty() {
                continue;
            }
            let requests: Vec<Box<Request>> = taken.drain(..).map(|q| q.req).collect();
            let answers = w.execute(instance.as_mut(), requests);
            w.deliver(seq, answers);
            self.batch_done();
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
        &self,
        s: &Scheduler,
        index: usize,
        mut instance: Box<dyn ModelInstance>,
    ) {
        let w = Worker {
            s,
            b: &self.batches,
            index,
        };
        let mut taken: Vec<Queued> = Vec::new();
        let mut ending: Vec<(Box<Request>, Error)> = Vec::new();
        let mut in_flight: Option<Started> = None;
        loop {
            let next = self.next_batch(s, index, &mut taken, &mut ending, in_flight.is_some());
            for (req, err) in ending.drain(..) {
                w.fail(req, err);
            }
            let Some(seq) = next.filter(|_| !taken.is_empty()) else {
                if let Some(previous) = in_flight.take() {
                    self.finish_started(&w, previous);
                }
                if next.is_none() {
                    break;
                }
                continue;
            };
            let requests: Vec<Box<Request>> = taken.drain(..).map(|q| q.req).collect();
            let start = Instant::now();
            w.record_queue_times(&requests, start);
            let nreq = inferences(&requests);
            let started = match Batch::assemble_gathered(
                s.config.clone(),
                &self.batches.in_names,
                requests,
            ) {
                Ok(mut batch) => {
                    let assembled = start.elapsed();
                    // Held until the batch completes; an instance in a rate limiter
                    // finishes its batch in flight first (it holds that one's grant).
                    if w.rate_limited() {
                        if let Some(previous) = in_flight.take() {
                            self.finish_started(&w, previous);
                        }
                    }
                    let grant = w.rate_grant();
                    let began = Instant::now();
                    let begun = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        instance.begin(&mut batch)
                    }));
                    let done = match begun {
                        Ok(Some(r)) => r,
                        Ok(None) => Err(Error::internal(format!(
                            "model '{}': instance {index} cannot start batches",
                            s.model.name_str()
                        ))),
                        Err(panic) => Err(w.panic_error(panic)),
                    };
                    Some(Started {
                        seq,
                        batch,
                        done,
                        start,
                        assembled,
                        began,
                        nreq,
                        grant,
                    })
                }
                Err((e, requests)) => {
                    let answers = w.fail_all(requests, e);
                    self.end_batch(&w, seq, answers);
                    None
                }
            };
            if let Some(previous) = in_flight.take() {
                self.finish_started(&w, previous);
            }
            in_flight = started;
        }
        drop(instance);
    }

    /// Waits for a started batch, then answers its requests.
    fn finish_started(&self, w: &Worker, s: Started) {
        let Started {
            seq,
            mut batch,
            done,
            start,
            assembled,
            began,
            nreq,
            grant,
        } = s;
        let result = done.and_then(|c| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.complete(&mut batch)))
                .unwrap_or_else(|panic| Err(w.panic_error(panic)))
        });
        drop(grant);
        let ran = start.elapsed();
        w.s.stats
            .record_execution(batch.size, nreq, ran.as_micros() as u64);
        let split_at = Instant::now();
        let answers = w.split(batch, result);
        w.s.stats
            .record_phases(assembled, split_at - began, split_at.elapsed());
        self.end_batch(w, seq, answers);
    }

    /// Delivers a finished batch.
    fn end_batch(&self, w: &Worker, seq: u64, answers: Vec<(ResponseSink, Box<Response>)>) {
        w.deliver(seq, answers);
        self.batch_done();
    }
}

impl SequenceBatcher {
    pub(super) fn worker(&self, s: &Scheduler, index: usize, mut instance: Box<dyn ModelInstance>) {
        let w = Worker {
            s,
            b: &self.batches,
            index,
        };
        let sq = &self.seq;
        let record = |reqs: &mut [Box<Request>]| w.set_running(reqs);
        loop {
            let (work, notes) = sq.next_work(index, &record);
            for (level, msg) in notes {
                s.log.log(level, &msg);
            }
            let formed = match work {
                sequence::Work::Exit => break,
                sequence::Work::End(list) => {
                    for (req, err) in list {
                        w.fail(req, err);
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
            w.record_queue_times(&requests, start);
            let nreq = inferences(&requests);
            let first_rows = rows.iter().map(|r| r.row).collect();
            let ids: Vec<u64> = requests.iter().map(|r| r.id).collect();
            let (answers, mut states) = match Batch::assemble_rows(
                s.config.clone(),
                &self.batches.in_names,
                requests,
                first_rows,
                size,
            ) {
                Err((e, requests)) => (w.fail_all(requests, e), None),
                Ok(mut batch) => {
                    let added = sq.add_inputs(&mut batch, &rows);
                    let assembled_at = Instant::now();
                    let (result, began) = match added {
                        Ok(()) => w.run(instance.as_mut(), &mut batch, nreq, start),
                        Err(e) => (Err(e), assembled_at),
                    };
                    let ran_at = Instant::now();
                    let (result, states) = match result {
                        Ok(()) => match sq.take_states(&batch, &rows) {
                            Ok(s) => (Ok(()), Some(s)),
                            Err(e) => (Err(e), None),
                        },
                        Err(e) => (Err(e), None),
                    };
                    let answers = w.split(batch, result);
                    s.stats
                        .record_phases(assembled_at - start, ran_at - began, ran_at.elapsed());
                    (answers, states)
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
            sq.complete(rows, states);
            w.deliver(seq_no, answers);
            sq.done();
        }
        drop(instance);
    }
}

/// A batch a pipelined worker started, on its way to completion.
struct Started {
    seq: u64,
    batch: Batch,
    done: Result<Box<dyn crate::backend::Completion>>,
    start: Instant,
    /// The time the batch's inputs took to assemble.
    assembled: Duration,
    /// When the backend began it (after the wait for the rate limiter).
    began: Instant,
    nreq: u64,
    /// The rate limiter's resources, while the batch runs.
    grant: Option<super::rate::Grant>,
}
