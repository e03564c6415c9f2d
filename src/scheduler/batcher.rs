//! The dynamic batcher: one priority queue in front of a model version, and one worker
//! per model instance that takes batches from it as the batch decision
//! ([`super::dynamic::decide`]) says. Without `dynamic_batching` it is Triton's default
//! scheduler: batches of one request. The workers' loops are in `worker`.

use super::dynamic::{decide, BatchPolicy, Decision};
use super::execute::Batches;
use super::queue::{PriorityQueue, Queued};
use super::{CancelOutcome, Kind, Scheduler, ShapeKey, IDLE_SPIN};
use crate::config::ModelConfig;
use crate::request::Request;
use crate::status::Error;
use parking_lot::{Condvar, Mutex};
use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

struct State {
    queue: PriorityQueue,
    /// Requests taken out of the queue (cancelled, timed out) whose error FINAL a worker
    /// delivers: callbacks run on library threads, never on the caller's.
    ending: Vec<(Box<Request>, Error)>,
    paused: bool,
    /// No new requests; workers finish what is queued and exit.
    closed: bool,
    /// Batches taken from the queue and not yet answered.
    executing: usize,
    next_batch_seq: u64,
    /// The deadline the timer is armed for (None: not armed).
    armed: Option<Instant>,
}

/// A value alone on its cache line (128 bytes: two 64-byte lines, as adjacent-line
/// prefetchers pair them).
#[repr(align(128))]
struct CacheLine<T>(T);

impl<T> std::ops::Deref for CacheLine<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

pub struct DynamicBatcher {
    policy: BatchPolicy,
    state: Mutex<State>,
    cv: Condvar,
    /// Mirror of the queue length for spinning workers, on its own cache line: idle
    /// workers spin reading it while enqueuers take the state lock.
    pending: CacheLine<AtomicUsize>,
    pub(super) batches: Batches,
}

impl DynamicBatcher {
    pub(super) fn new(config: &ModelConfig, batches: Batches) -> DynamicBatcher {
        let db = config.dynamic_batching.as_ref();
        let policy = match db {
            Some(db) => BatchPolicy {
                max_batch_size: config.max_batch_size.max(1),
                preferred: db.preferred_batch_size.clone(),
                max_queue_delay: Duration::from_micros(db.max_queue_delay_us),
            },
            None => BatchPolicy::single(),
        };
        DynamicBatcher {
            policy,
            state: Mutex::new(State {
                queue: PriorityQueue::new(db),
                ending: Vec::new(),
                paused: false,
                closed: false,
                executing: 0,
                next_batch_seq: 0,
                armed: None,
            }),
            cv: Condvar::new(),
            pending: CacheLine(AtomicUsize::new(0)),
            batches,
        }
    }

    /// A batch was answered.
    pub(super) fn batch_done(&self) {
        self.state.lock().executing -= 1;
    }

    /// Blocks until there is a batch (returns its sequence number, requests in `taken`)
    /// or requests to end with an error (`ending`, `taken` empty), or the batcher is
    /// closed and drained (None). With `no_wait` it returns at once when there is
    /// nothing to take.
    pub(super) fn next_batch(
        &self,
        s: &Scheduler,
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
                ending.extend(expired.drain(..).map(|q| timed_out(s, q)));
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
                    self.batches.running[worker]
                        .lock()
                        .extend(taken.iter_mut().map(|q| super::execute::Running {
                            id: q.req.id,
                            sink: q.req.sink.take(),
                        }));
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
}

/// A request whose queue timeout passed, with its DEADLINE_EXCEEDED error.
fn timed_out(s: &Scheduler, q: Queued) -> (Box<Request>, Error) {
    let msg = format!(
        "request {} for model '{}' timed out in the queue",
        q.req.id,
        s.model.name_str()
    );
    (q.req, Error::deadline(msg))
}

impl Kind for DynamicBatcher {
    fn enqueue(
        &self,
        s: &Scheduler,
        req: Box<Request>,
        shape_key: Option<ShapeKey>,
    ) -> std::result::Result<(), (Box<Request>, Error)> {
        let mut st = self.state.lock();
        if st.closed {
            drop(st);
            let e = Error::unavailable(format!("model '{}' is unloading", s.model.name_str()));
            return Err((req, e));
        }
        let level = match st.queue.level_of(req.priority) {
            Ok(l) => l,
            Err(e) => {
                drop(st);
                return Err((req, e.context(format!("model '{}'", s.model.name_str()))));
            }
        };
        let deadline = st
            .queue
            .timeout_for(level, req.timeout_us)
            .map(|t| req.enqueued_at + t);
        let q = Queued {
            req,
            deadline,
            shape_key,
        };
        if let Err((q, e)) = st.queue.push(level, q) {
            drop(st);
            return Err((q.req, e.context(format!("model '{}'", s.model.name_str()))));
        }
        self.pending.fetch_add(1, Ordering::Release);
        // The timer answers it on time even when no worker is free.
        let arm = deadline.filter(|d| st.armed.is_none_or(|a| *d < a));
        if arm.is_some() {
            st.armed = arm;
        }
        drop(st);
        self.cv.notify_one();
        if let Some(d) = arm {
            s.arm(d);
        }
        Ok(())
    }

    fn pending(&self) -> usize {
        self.pending.load(Ordering::Acquire)
    }

    fn set_paused(&self, paused: bool) {
        self.state.lock().paused = paused;
        self.cv.notify_all();
    }

    fn close(&self) {
        self.state.lock().closed = true;
        self.cv.notify_all();
    }

    fn is_idle(&self) -> bool {
        let st = self.state.lock();
        st.queue.is_empty()
            && st.ending.is_empty()
            && st.executing == 0
            && self.batches.none_outstanding()
    }

    fn cancel_all(&self, why: &str) {
        let mut st = self.state.lock();
        let drained = st.queue.drain();
        self.pending.store(0, Ordering::Release);
        st.ending.extend(
            drained
                .into_iter()
                .map(|q| (q.req, Error::cancelled(why.to_owned()))),
        );
        drop(st);
        self.cv.notify_all();
    }

    fn cancel(&self, s: &Scheduler, request_id: u64) -> CancelOutcome {
        let mut st = self.state.lock();
        if let Some(q) = st.queue.remove(request_id) {
            self.pending.fetch_sub(1, Ordering::Release);
            let msg = format!(
                "request {request_id} for model '{}' was cancelled",
                s.model.name_str()
            );
            st.ending.push((q.req, Error::cancelled(msg)));
            drop(st);
            self.cv.notify_all();
            return CancelOutcome::Cancelled;
        }
        // Still under the state lock: a request leaves the queue and becomes running in
        // one step (see next_batch), so it is always found in one place or the other.
        if self.batches.is_running_or_cancel(request_id) {
            return CancelOutcome::Running;
        }
        CancelOutcome::NotFound
    }

    fn abandon(&self, why: &str) -> Vec<super::Abandoned> {
        let mut st = self.state.lock();
        let queued = st.queue.drain();
        self.pending.store(0, Ordering::Release);
        let mut out: Vec<super::Abandoned> = std::mem::take(&mut st.ending)
            .into_iter()
            .map(|(req, e)| super::Abandoned::Queued(req, e))
            .collect();
        out.extend(
            queued
                .into_iter()
                .map(|q| super::Abandoned::Queued(q.req, Error::cancelled(why.to_owned()))),
        );
        drop(st);
        self.batches.abandon_running(why, &mut out);
        out
    }

    fn expire(&self, s: &Scheduler, now: Instant) {
        let mut expired = Vec::new();
        let mut st = self.state.lock();
        st.queue.expire(now, &mut expired);
        self.pending.fetch_sub(expired.len(), Ordering::Release);
        st.armed = st.queue.next_deadline();
        let next = st.armed;
        drop(st);
        if let Some(d) = next {
            s.arm(d);
        }
        for q in expired {
            let (req, e) = timed_out(s, q);
            s.fail(req, e);
        }
    }

    fn stats_json(&self, out: &mut String) {
        self.batches.stats_json(out);
    }

    fn stats_prometheus(&self, out: &mut crate::stats::PromText, labels: &str) {
        self.batches.stats_prometheus(out, labels);
    }

    fn delivered_apart(&self) -> u64 {
        (self.batches.outstanding.delivered).load(std::sync::atomic::Ordering::Relaxed)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
