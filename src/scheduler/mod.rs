//! Scheduling: the queue in front of a model version and the worker threads (one per
//! model instance) that form batches from it and execute them.
//!
//! Workers pull: an idle worker locks the queue, applies timeouts, asks the pure batch
//! decision ([`dynamic::decide`]) what to send, and executes it after unlocking. The
//! default scheduler is the same machinery with a batch size of one. No lock is held while
//! a backend or a response callback runs.

pub mod dynamic;
pub mod ensemble;
pub mod inflight;
pub mod queue;
pub mod sequence;

pub use ensemble::Router;

use crate::backend::{Batch, ModelInstance};
use crate::config::ModelConfig;
use crate::request::{ModelIdentity, Request, Response, ResponseSink};
use crate::stats::ModelStats;
use crate::status::{Code, Error, Result};
use dynamic::{decide, BatchPolicy, Decision};
use parking_lot::{Condvar, Mutex};
use queue::{PriorityQueue, Queued};
use std::collections::BTreeMap;
use std::ffi::CString;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it sleeps: a request that arrives meanwhile
/// starts without a thread wake-up, which dominates latency for small models.
const IDLE_SPIN: Duration = Duration::from_micros(50);

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
}

/// Responses of finished batches waiting for earlier batches (preserve_ordering).
#[derive(Default)]
struct Reorder {
    next: u64,
    ready: BTreeMap<u64, Vec<(ResponseSink, Box<Response>)>>,
    delivering: bool,
}

/// The outcome of a cancel request for one scheduler.
#[derive(Debug, PartialEq, Eq)]
pub enum CancelOutcome {
    Cancelled,
    /// Executing: it finishes normally.
    Running,
    NotFound,
}

pub struct Scheduler {
    pub model: ModelIdentity,
    pub config: Arc<ModelConfig>,
    pub stats: ModelStats,
    policy: BatchPolicy,
    preserve_ordering: bool,
    in_names: Vec<Arc<CString>>,
    out_names: Vec<Arc<CString>>,
    state: Mutex<State>,
    cv: Condvar,
    /// Mirror of the queue length for spinning workers.
    pending: AtomicUsize,
    reorder: Mutex<Reorder>,
    /// Request ids each worker is executing now (for cancel).
    running: Vec<Mutex<Vec<u64>>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    /// The sequence batcher, for models with `sequence_batching` (then `state` and `cv`
    /// are unused).
    seq: Option<sequence::Sequencer>,
    /// The ensemble runner, for `platform: "ensemble"` (no workers then).
    ens: Option<ensemble::Runner>,
    /// In-flight batching, for generative models (its loops are the workers).
    pub(crate) gen: Option<inflight::Engine>,
    /// Every instance runs on a GPU and batches go straight to them (no sequence
    /// batcher): inputs in device memory stay there. Otherwise the server copies them to
    /// the host before they are queued.
    pub takes_device_inputs: bool,
    /// The data-path statistics of the instances on a GPU: (instance index, counters).
    gpu_stats: Vec<(usize, Arc<crate::stats::GpuInstanceStats>)>,
    log: crate::log::Logger,
}

pub(crate) fn c_name(s: &str) -> Arc<CString> {
    Arc::new(CString::new(s.replace('\0', "")).unwrap_or_default())
}

impl Scheduler {
    /// Starts one worker thread per instance. `initial_states` are the values of the
    /// configured implicit states (see [`sequence::initial_states`]). `cpus[i]` are the
    /// CPU cores instance `i`'s worker thread is pinned to (`instance_group.cpus`); an
    /// empty or missing entry leaves the thread unpinned. A pin that fails fails the
    /// start (INVALID_ARGUMENT) after the started workers have exited.
    pub fn start(
        model: ModelIdentity,
        config: Arc<ModelConfig>,
        instances: Vec<Box<dyn ModelInstance>>,
        log: crate::log::Logger,
        initial_states: Vec<sequence::StateValue>,
        cpus: Vec<Vec<u32>>,
    ) -> Result<Arc<Scheduler>> {
        let model_name = model.name_str().to_owned();
        let pin_error = |i: usize, list: &[u32], e: Error| {
            e.context(format!(
                "model '{model_name}': instance {i}: cannot pin its worker thread to cpus {list:?}"
            ))
        };
        for (i, list) in cpus.iter().enumerate().take(instances.len()) {
            crate::affinity::check_allowed(list).map_err(|e| pin_error(i, list, e))?;
        }
        let seq = config
            .sequence_batching
            .as_ref()
            .map(|q| sequence::Sequencer::new(&config, q, instances.len(), initial_states));
        let oldest_ordering = config.sequence_batching.as_ref().is_some_and(|q| {
            matches!(
                q.strategy,
                crate::config::SequenceStrategy::Oldest {
                    preserve_ordering: true,
                    ..
                }
            )
        });
        let db = config.dynamic_batching.as_ref();
        let policy = match db {
            Some(db) => BatchPolicy {
                max_batch_size: config.max_batch_size.max(1),
                preferred: db.preferred_batch_size.clone(),
                max_queue_delay: Duration::from_micros(db.max_queue_delay_us),
            },
            None => BatchPolicy::single(),
        };
        let takes_device_inputs = seq.is_none()
            && !instances.is_empty()
            && instances.iter().all(|i| i.device().is_some());
        let gpu_stats = instances
            .iter()
            .enumerate()
            .filter_map(|(i, inst)| inst.gpu_stats().map(|g| (i, g)))
            .collect();
        let sched = Arc::new(Scheduler {
            takes_device_inputs,
            gpu_stats,
            model,
            stats: ModelStats::new(config.max_batch_size),
            policy,
            preserve_ordering: db.is_some_and(|d| d.preserve_ordering) || oldest_ordering,
            in_names: config.inputs.iter().map(|t| c_name(&t.name)).collect(),
            out_names: config.outputs.iter().map(|t| c_name(&t.name)).collect(),
            state: Mutex::new(State {
                queue: PriorityQueue::new(db),
                ending: Vec::new(),
                paused: false,
                closed: false,
                executing: 0,
                next_batch_seq: 0,
            }),
            cv: Condvar::new(),
            pending: AtomicUsize::new(0),
            reorder: Mutex::new(Reorder::default()),
            running: instances.iter().map(|_| Mutex::new(Vec::new())).collect(),
            workers: Mutex::new(Vec::new()),
            seq,
            ens: None,
            gen: None,
            log,
            config,
        });
        // Pinned workers report their pin result here before they start working.
        let (pinned_tx, pinned_rx) = std::sync::mpsc::channel::<(usize, Result<()>)>();
        let mut pinned = 0usize;
        for (i, instance) in instances.into_iter().enumerate() {
            let s = sched.clone();
            let pin = cpus.get(i).filter(|c| !c.is_empty()).cloned();
            let report = pin.as_ref().map(|_| pinned_tx.clone());
            let handle = std::thread::Builder::new()
                .name(format!("infer-{}-{i}", s.model.name_str()))
                .spawn(move || {
                    if let (Some(list), Some(report)) = (pin, report) {
                        let result = crate::affinity::pin_current_thread(&list);
                        let failed = result.is_err();
                        let _ = report.send((i, result));
                        if failed {
                            return;
                        }
                    }
                    if s.seq.is_some() {
                        s.sequence_worker(i, instance)
                    } else if instance.device().is_some() {
                        s.pipelined_worker(i, instance)
                    } else {
                        s.worker(i, instance)
                    }
                });
            let handle = match handle {
                Ok(h) => h,
                Err(e) => {
                    // The workers already started drain nothing and exit.
                    sched.close();
                    sched.join();
                    return Err(Error::internal(format!(
                        "cannot start a worker thread: {e}"
                    )));
                }
            };
            sched.workers.lock().push(handle);
            if cpus.get(i).is_some_and(|c| !c.is_empty()) {
                pinned += 1;
            }
        }
        drop(pinned_tx);
        let mut failed: Option<(usize, Error)> = None;
        for _ in 0..pinned {
            // A worker that exits without reporting drops its sender: after all have,
            // recv fails instead of waiting forever.
            let Ok((i, result)) = pinned_rx.recv() else {
                break;
            };
            if let Err(e) = result {
                if failed.as_ref().is_none_or(|(f, _)| i < *f) {
                    failed = Some((i, e));
                }
            }
        }
        if let Some((i, e)) = failed {
            // The workers that did start drain nothing and exit.
            sched.close();
            sched.join();
            let list = cpus.get(i).map(Vec::as_slice).unwrap_or_default();
            return Err(pin_error(i, list, e));
        }
        Ok(sched)
    }

    /// An ensemble model: requests run its steps through `server`.
    pub fn start_ensemble(
        model: ModelIdentity,
        config: Arc<ModelConfig>,
        server: std::sync::Weak<dyn Router>,
        log: crate::log::Logger,
    ) -> Arc<Scheduler> {
        Arc::new_cyclic(|me| {
            let runner = ensemble::Runner::new(me.clone(), server, &config);
            let stats = ModelStats::new(config.max_batch_size);
            Scheduler::without_queue(model, config, stats, log, Some(runner), None)
        })
    }

    /// A scheduler whose requests go to an ensemble runner or an in-flight engine: the
    /// batch queue, its state and the per-worker bookkeeping stay empty.
    fn without_queue(
        model: ModelIdentity,
        config: Arc<ModelConfig>,
        stats: ModelStats,
        log: crate::log::Logger,
        ens: Option<ensemble::Runner>,
        gen: Option<inflight::Engine>,
    ) -> Scheduler {
        Scheduler {
            model,
            stats,
            policy: BatchPolicy::single(),
            preserve_ordering: false,
            in_names: Vec::new(),
            out_names: Vec::new(),
            state: Mutex::new(State {
                queue: PriorityQueue::new(None),
                ending: Vec::new(),
                paused: false,
                closed: false,
                executing: 0,
                next_batch_seq: 0,
            }),
            cv: Condvar::new(),
            pending: AtomicUsize::new(0),
            reorder: Mutex::new(Reorder::default()),
            running: Vec::new(),
            workers: Mutex::new(Vec::new()),
            seq: None,
            ens,
            gen,
            takes_device_inputs: false,
            gpu_stats: Vec::new(),
            log,
            config,
        }
    }

    /// A generative model: one in-flight batching loop per executor (model instance).
    pub fn start_generative(
        model: ModelIdentity,
        config: Arc<ModelConfig>,
        engine: inflight::Engine,
        executors: Vec<Box<dyn inflight::Executor>>,
        log: crate::log::Logger,
    ) -> Result<Arc<Scheduler>> {
        let stats = ModelStats::new(engine.settings.max_num_sequences as u32);
        let sched = Arc::new(Scheduler::without_queue(
            model,
            config,
            stats,
            log,
            None,
            Some(engine),
        ));
        for (i, exec) in executors.into_iter().enumerate() {
            let s = sched.clone();
            let handle = std::thread::Builder::new()
                .name(format!("infer-{}-{i}", s.model.name_str()))
                .spawn(move || inflight::run(s, i, exec));
            match handle {
                Ok(h) => sched.workers.lock().push(h),
                Err(e) => {
                    sched.close();
                    sched.join();
                    return Err(Error::internal(format!(
                        "cannot start a generation loop thread: {e}"
                    )));
                }
            }
        }
        Ok(sched)
    }

    /// This version's statistics as JSON (generation counters included for generative
    /// models; the GPU data path's, per instance, for models with instances on a GPU).
    pub fn stats_json(&self, name: &str, version: i64) -> String {
        let mut j = self.stats.json(name, version, self.pending());
        if let Some(g) = &self.gen {
            j.pop();
            j.push_str(",\"generation\":");
            j.push_str(&g.gen_stats.json());
            j.push('}');
        }
        if !self.gpu_stats.is_empty() {
            let instances: Vec<String> = self.gpu_stats.iter().map(|(i, g)| g.json(*i)).collect();
            j.pop();
            j.push_str(",\"gpu\":{\"instances\":[");
            j.push_str(&instances.join(","));
            j.push_str("]}}");
        }
        j
    }

    /// Appends this version's Prometheus samples.
    pub fn stats_prometheus(&self, out: &mut crate::stats::PromText, name: &str, version: i64) {
        self.stats.prometheus(out, name, version, self.pending());
        if !self.gpu_stats.is_empty() {
            let labels = crate::stats::labels(name, version);
            for (i, g) in &self.gpu_stats {
                g.prometheus(out, &labels, *i);
            }
        }
        if let Some(g) = &self.gen {
            let labels = crate::stats::labels(name, version);
            g.gen_stats.prometheus(out, &labels);
        }
    }

    /// Queues a request. On failure the request comes back with the error so the caller
    /// can retry elsewhere (a replaced model) or fail it; the callback is not called.
    pub fn enqueue(
        &self,
        req: Box<Request>,
        shape_key: Option<smallvec::SmallVec<[i64; 8]>>,
    ) -> std::result::Result<(), (Box<Request>, Error)> {
        if let Some(ens) = &self.ens {
            return ens.start(req);
        }
        if let Some(g) = &self.gen {
            return g.enqueue(&self.model, req);
        }
        if let Some(sq) = &self.seq {
            if let Some(warning) = sq.enqueue(req, shape_key)? {
                self.log.warn(&warning);
            }
            return Ok(());
        }
        let mut st = self.state.lock();
        if st.closed {
            drop(st);
            let e = Error::unavailable(format!("model '{}' is unloading", self.model.name_str()));
            return Err((req, e));
        }
        let level = match st.queue.level_of(req.priority) {
            Ok(l) => l,
            Err(e) => {
                drop(st);
                return Err((req, e.context(format!("model '{}'", self.model.name_str()))));
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
            return Err((
                q.req,
                e.context(format!("model '{}'", self.model.name_str())),
            ));
        }
        self.pending.fetch_add(1, Ordering::Release);
        drop(st);
        self.cv.notify_one();
        Ok(())
    }

    pub fn pending(&self) -> usize {
        if let Some(ens) = &self.ens {
            return ens.in_flight();
        }
        if let Some(g) = &self.gen {
            return g.pending();
        }
        match &self.seq {
            Some(sq) => sq.queued(),
            None => self.pending.load(Ordering::Acquire),
        }
    }

    pub fn set_paused(&self, paused: bool) {
        if let Some(g) = &self.gen {
            return g.set_paused(paused);
        }
        if let Some(sq) = &self.seq {
            return sq.set_paused(paused);
        }
        self.state.lock().paused = paused;
        self.cv.notify_all();
    }

    /// Stops accepting requests; the workers drain the queue and exit.
    pub fn close(&self) {
        if let Some(ens) = &self.ens {
            ens.close();
        }
        if let Some(g) = &self.gen {
            return g.close();
        }
        if let Some(sq) = &self.seq {
            return sq.close();
        }
        self.state.lock().closed = true;
        self.cv.notify_all();
    }

    /// True when nothing is queued or executing.
    pub fn is_idle(&self) -> bool {
        if let Some(ens) = &self.ens {
            return ens.in_flight() == 0;
        }
        if let Some(g) = &self.gen {
            return g.is_idle();
        }
        if let Some(sq) = &self.seq {
            return sq.is_idle();
        }
        let st = self.state.lock();
        st.queue.is_empty() && st.ending.is_empty() && st.executing == 0
    }

    /// Ends every queued request with CANCELLED (delivered by the workers).
    pub fn cancel_all(&self, why: &str) {
        if let Some(ens) = &self.ens {
            return ens.cancel_all(why);
        }
        if let Some(g) = &self.gen {
            return g.cancel_all(why);
        }
        if let Some(sq) = &self.seq {
            return sq.cancel_all(why);
        }
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

    pub fn cancel(&self, request_id: u64) -> CancelOutcome {
        if let Some(ens) = &self.ens {
            return match ens.cancel(request_id) {
                true => CancelOutcome::Cancelled,
                false => CancelOutcome::NotFound,
            };
        }
        if let Some(g) = &self.gen {
            return g.cancel(&self.model, request_id);
        }
        if let Some(sq) = &self.seq {
            let running = || self.running.iter().any(|r| r.lock().contains(&request_id));
            return match sq.cancel(request_id, running) {
                Some(true) => CancelOutcome::Cancelled,
                Some(false) => CancelOutcome::Running,
                None => CancelOutcome::NotFound,
            };
        }
        let mut st = self.state.lock();
        if let Some(q) = st.queue.remove(request_id) {
            self.pending.fetch_sub(1, Ordering::Release);
            let msg = format!(
                "request {request_id} for model '{}' was cancelled",
                self.model.name_str()
            );
            st.ending.push((q.req, Error::cancelled(msg)));
            drop(st);
            self.cv.notify_all();
            return CancelOutcome::Cancelled;
        }
        // Still under the state lock: a request leaves the queue and becomes running in
        // one step (see next_batch), so it is always found in one place or the other.
        if self.running.iter().any(|r| r.lock().contains(&request_id)) {
            return CancelOutcome::Running;
        }
        CancelOutcome::NotFound
    }

    /// Waits for the worker threads to exit (after `close`). A worker of this model that
    /// calls it (from a callback) waits for the others, not for itself.
    pub fn join(&self) {
        let me = std::thread::current().id();
        let handles: Vec<_> = {
            let mut w = self.workers.lock();
            let (mine, others): (Vec<_>, Vec<_>) = w.drain(..).partition(|h| h.thread().id() == me);
            *w = mine;
            others
        };
        for h in handles {
            let _ = h.join();
        }
    }

    fn fail(&self, req: Box<Request>, err: Error) {
        self.stats
            .failure_count
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        req.fail(&self.model, err);
    }

    fn worker(self: Arc<Self>, index: usize, mut instance: Box<dyn ModelInstance>) {
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
    fn pipelined_worker(self: Arc<Self>, index: usize, mut instance: Box<dyn ModelInstance>) {
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

    fn sequence_worker(self: Arc<Self>, index: usize, mut instance: Box<dyn ModelInstance>) {
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

/// A batch output ready to be split into responses.
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
