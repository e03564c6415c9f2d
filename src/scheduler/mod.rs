//! Scheduling: the queue in front of a model version and the worker threads (one per
//! model instance) that form batches from it and execute them.
//!
//! Workers pull: an idle worker locks the queue, applies timeouts, asks the pure batch
//! decision ([`dynamic::decide`]) what to send, and executes it after unlocking. The
//! default scheduler is the same machinery with a batch size of one. No lock is held while
//! a backend or a response callback runs. This file holds the scheduler's state and its
//! public face (start, enqueue, cancel, close); the workers' loop is in `worker`.

pub mod dynamic;
pub mod ensemble;
pub mod inflight;
pub mod queue;
pub mod sequence;
mod worker;

pub use ensemble::Router;

use crate::backend::ModelInstance;
use crate::config::ModelConfig;
use crate::request::{ModelIdentity, Request, Response, ResponseSink};
use crate::stats::ModelStats;
use crate::status::{Error, Result};
use dynamic::BatchPolicy;
use parking_lot::{Condvar, Mutex};
use queue::{PriorityQueue, Queued};
use std::collections::BTreeMap;
use std::ffi::CString;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

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
}
