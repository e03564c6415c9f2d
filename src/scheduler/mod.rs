//! Scheduling: what happens to a request between `enqueue` and its FINAL response.
//!
//! A [`Scheduler`] serves one model version. Its work is done by one of four kinds, each
//! its own type behind the [`Kind`] interface (as Triton has one class per scheduler):
//! - [`batcher::DynamicBatcher`]: a queue and one worker thread per model instance that
//!   forms batches from it (the default scheduler is the same with batches of one);
//! - [`sequence::SequenceBatcher`]: sequences of correlated requests placed in slots;
//! - [`ensemble::Runner`]: the steps of an ensemble, sent to other models through a
//!   [`Router`];
//! - [`inflight::Engine`]: in-flight batching of generative models.
//!
//! Workers pull: an idle worker takes work under its kind's lock and executes it after
//! unlocking. No lock is held while a backend or a response callback runs. The worker
//! loops are in `worker`, the execution of a batch and its split into responses in
//! `execute`.

pub mod batcher;
pub mod dynamic;
pub mod ensemble;
mod execute;
pub mod inflight;
pub mod queue;
pub mod rate;
pub mod sequence;
pub mod timer;
mod worker;

pub use ensemble::Router;

use crate::backend::ModelInstance;
use crate::config::ModelConfig;
use crate::request::{ModelIdentity, Request};
use crate::stats::ModelStats;
use crate::status::{Error, Result};
use batcher::DynamicBatcher;
use execute::Batches;
use parking_lot::Mutex;
use sequence::SequenceBatcher;
use std::any::Any;
use std::ffi::CString;
use std::sync::Arc;
use std::sync::Weak;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use timer::Timer;

/// How long an idle worker spins before it sleeps: a request that arrives meanwhile
/// starts without a thread wake-up, which dominates latency for small models.
const IDLE_SPIN: Duration = Duration::from_micros(50);

/// The shape of a request's inputs, for batchers that batch only equal shapes.
pub type ShapeKey = smallvec::SmallVec<[i64; 8]>;

/// The outcome of a cancel request for one scheduler.
#[derive(Debug, PartialEq, Eq)]
pub enum CancelOutcome {
    Cancelled,
    /// Executing: it finishes normally.
    Running,
    NotFound,
}

/// A request a shutdown answers itself ([`Kind::abandon`]).
pub enum Abandoned {
    /// Taken from a queue, with its error.
    Queued(Box<Request>, Error),
    /// Executing in a batch that did not finish: its id and sink.
    Executing(u64, crate::request::ResponseSink),
}

/// What every scheduling kind does. `s` is the scheduler the kind serves (its model,
/// configuration, statistics and log).
pub trait Kind: Send + Sync + 'static {
    /// Takes a request. On failure the request comes back with the error; its callback
    /// is not called.
    fn enqueue(
        &self,
        s: &Scheduler,
        req: Box<Request>,
        shape_key: Option<ShapeKey>,
    ) -> std::result::Result<(), (Box<Request>, Error)>;
    /// Requests waiting (not yet executing).
    fn pending(&self) -> usize;
    fn set_paused(&self, paused: bool);
    /// Stops taking requests; what is queued is still served.
    fn close(&self);
    /// True when nothing is queued, executing or waiting to be answered.
    fn is_idle(&self) -> bool;
    /// Ends every queued request with CANCELLED (delivered by the kind's threads).
    fn cancel_all(&self, why: &str);
    fn cancel(&self, s: &Scheduler, request_id: u64) -> CancelOutcome;
    /// Appends the kind's own members to the statistics JSON object, each with its
    /// leading comma.
    fn stats_json(&self, _out: &mut String) {}
    /// Appends the kind's own Prometheus samples.
    fn stats_prometheus(&self, _out: &mut crate::stats::PromText, _labels: &str) {}
    /// Answers the queued requests whose deadline is `now` or earlier (the timer calls it
    /// at a deadline the kind armed with [`Scheduler::arm`]).
    fn expire(&self, _s: &Scheduler, _now: Instant) {}
    /// A shutdown stopped waiting (a backend is stuck): hands over every request the kind
    /// still holds, queued or executing, to be answered now. What a stuck backend returns
    /// later is dropped.
    fn abandon(&self, _why: &str) -> Vec<Abandoned> {
        Vec::new()
    }
    /// Responses delivered apart from their batch (decoupled backends), for
    /// [`Scheduler::progress`].
    fn delivered_apart(&self) -> u64 {
        0
    }
    fn as_any(&self) -> &dyn Any;
}

/// Where each instance's worker runs, by instance index.
#[derive(Default)]
pub struct Placement {
    /// The CPU cores the worker thread is pinned to (`instance_group.cpus`); an empty or
    /// missing entry leaves it unpinned.
    pub cpus: Vec<Vec<u32>>,
    /// What the instance takes from the server's rate limiter before each batch (empty
    /// when the limiter is off).
    pub rate_slots: Vec<Arc<rate::Slot>>,
}

pub struct Scheduler {
    pub model: ModelIdentity,
    pub config: Arc<ModelConfig>,
    pub stats: ModelStats,
    /// Every instance runs on a GPU and batches go straight to them (no sequence
    /// batcher), or an ensemble (its steps' models take them): inputs in device memory
    /// stay there. Otherwise the server copies them to the host before they are queued.
    pub takes_device_inputs: bool,
    /// The GPU every instance runs on, where they take inputs in device memory and can
    /// leave outputs there (`takes_device_inputs`, all on one device); None otherwise.
    pub device: Option<i32>,
    kind: Arc<dyn Kind>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    log: crate::log::Logger,
    /// The server's timer (queue deadlines), and this scheduler for it.
    timer: Option<Arc<Timer>>,
    me: Weak<Scheduler>,
}

thread_local! {
    /// What the current thread serves: a scheduler's address for its workers and loops,
    /// [`TIMER_THREAD`] for a timer, 0 for threads that are not the library's.
    static SERVING: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

const TIMER_THREAD: usize = 1;

/// True on the library's own threads (workers, generation loops, timers): where response
/// callbacks and backends run. A call that waits for a model to drain must not wait
/// there (that model's callbacks may be waiting for this thread's model in turn).
pub fn on_library_thread() -> bool {
    SERVING.with(|c| c.get() != 0)
}

fn mark_thread(s: &Scheduler) {
    SERVING.with(|c| c.set(s as *const Scheduler as usize));
}

pub(crate) fn c_name(s: &str) -> Arc<CString> {
    Arc::new(CString::new(s.replace('\0', "")).unwrap_or_default())
}

impl Scheduler {
    fn new(
        model: ModelIdentity,
        config: Arc<ModelConfig>,
        stats: ModelStats,
        log: crate::log::Logger,
        kind: Arc<dyn Kind>,
    ) -> Scheduler {
        Scheduler {
            model,
            config,
            stats,
            takes_device_inputs: false,
            device: None,
            kind,
            workers: Mutex::new(Vec::new()),
            log,
            timer: None,
            me: Weak::new(),
        }
    }

    /// True on this scheduler's own threads (its workers, its generation loops).
    pub fn runs_on_current_thread(&self) -> bool {
        SERVING.with(|c| c.get() == self as *const Scheduler as usize)
    }

    /// Asks the timer to call [`Kind::expire`] at `at`.
    pub(crate) fn arm(&self, at: Instant) {
        if let Some(t) = &self.timer {
            t.arm(at, self.me.clone());
        }
    }

    /// Answers what is due at `now` (called by the timer).
    pub(crate) fn expire(&self, now: Instant) {
        self.kind.expire(self, now)
    }

    /// Starts one worker thread per instance: a sequence batcher for models with
    /// `sequence_batching`, a dynamic batcher otherwise. `initial_states` are the values
    /// of the configured implicit states (see [`sequence::initial_states`]). `placement`
    /// says where each instance's worker runs and what it takes before a batch. A pin
    /// that fails fails the start (INVALID_ARGUMENT) after the started workers have
    /// exited. `timer` answers queue timeouts on time while every instance is busy.
    pub fn start(
        model: ModelIdentity,
        config: Arc<ModelConfig>,
        instances: Vec<Box<dyn ModelInstance>>,
        log: crate::log::Logger,
        initial_states: Vec<sequence::StateValue>,
        placement: Placement,
        timer: Arc<Timer>,
    ) -> Result<Arc<Scheduler>> {
        let Placement { cpus, rate_slots } = placement;
        let model_name = model.name_str().to_owned();
        let pin_error = |i: usize, list: &[u32], e: Error| {
            e.context(format!(
                "model '{model_name}': instance {i}: cannot pin its worker thread to cpus {list:?}"
            ))
        };
        for (i, list) in cpus.iter().enumerate().take(instances.len()) {
            crate::affinity::check_allowed(list).map_err(|e| pin_error(i, list, e))?;
        }
        let batches = Batches::new(&config, &instances, rate_slots);
        let stats = ModelStats::new(config.max_batch_size);
        // The kind and, for each instance, the loop its worker runs.
        type Loop = Box<dyn FnOnce(&Arc<Scheduler>) + Send>;
        let first_device = instances.first().and_then(|i| i.device());
        let one_device = first_device.filter(|&d| instances.iter().all(|i| i.device() == Some(d)));
        let (kind, loops, takes_device_inputs): (Arc<dyn Kind>, Vec<Loop>, bool) =
            match config.sequence_batching.as_ref() {
                Some(q) => {
                    let seq = sequence::Sequencer::new(&config, q, instances.len(), initial_states);
                    let kind = Arc::new(SequenceBatcher::new(seq, batches));
                    let loops = instances
                        .into_iter()
                        .enumerate()
                        .map(|(i, inst)| {
                            let k = kind.clone();
                            Box::new(move |s: &Arc<Scheduler>| k.worker(s, i, inst)) as Loop
                        })
                        .collect();
                    (kind, loops, false)
                }
                None => {
                    let on_gpu =
                        !instances.is_empty() && instances.iter().all(|i| i.device().is_some());
                    let kind = Arc::new(DynamicBatcher::new(&config, batches));
                    let loops = instances
                        .into_iter()
                        .enumerate()
                        .map(|(i, inst)| {
                            let k = kind.clone();
                            Box::new(move |s: &Arc<Scheduler>| {
                                if inst.device().is_some() {
                                    k.pipelined_worker(s, i, inst)
                                } else {
                                    k.worker(s, i, inst)
                                }
                            }) as Loop
                        })
                        .collect();
                    (kind, loops, on_gpu)
                }
            };
        let sched = Scheduler::new(model, config, stats, log, kind);
        let sched = Arc::new_cyclic(|me| Scheduler {
            takes_device_inputs,
            device: one_device.filter(|_| takes_device_inputs),
            timer: Some(timer),
            me: me.clone(),
            ..sched
        });
        // Pinned workers report their pin result here before they start working.
        let (pinned_tx, pinned_rx) = std::sync::mpsc::channel::<(usize, Result<()>)>();
        let mut pinned = 0usize;
        for (i, work) in loops.into_iter().enumerate() {
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
                    mark_thread(&s);
                    work(&s)
                });
            let handle = match handle {
                Ok(h) => h,
                Err(e) => {
                    // The workers already started drain nothing and exit.
                    sched.close();
                    sched.join();
                    return Err(Error::exhausted(format!(
                        "model '{}': cannot start worker thread {i}: {e}",
                        sched.model.name_str()
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

    /// An ensemble model: requests run its steps through `server`. It takes inputs in
    /// device memory: each step's model takes them there or copies them to the host.
    pub fn start_ensemble(
        model: ModelIdentity,
        config: Arc<ModelConfig>,
        server: std::sync::Weak<dyn Router>,
        log: crate::log::Logger,
    ) -> Arc<Scheduler> {
        Arc::new_cyclic(|me| {
            let runner = Arc::new(ensemble::Runner::new(me.clone(), server, &config));
            let stats = ModelStats::new(config.max_batch_size);
            Scheduler {
                takes_device_inputs: true,
                ..Scheduler::new(model, config, stats, log, runner)
            }
        })
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
        let engine = Arc::new(engine);
        let sched = Arc::new(Scheduler::new(model, config, stats, log, engine.clone()));
        for (i, exec) in executors.into_iter().enumerate() {
            let (s, e) = (sched.clone(), engine.clone());
            let handle = std::thread::Builder::new()
                .name(format!("infer-{}-{i}", s.model.name_str()))
                .spawn(move || {
                    mark_thread(&s);
                    inflight::run(&s, &e, i, exec)
                });
            match handle {
                Ok(h) => sched.workers.lock().push(h),
                Err(e) => {
                    sched.close();
                    sched.join();
                    return Err(Error::exhausted(format!(
                        "model '{}': cannot start generation loop thread {i}: {e}",
                        sched.model.name_str()
                    )));
                }
            }
        }
        Ok(sched)
    }

    /// The scheduling kind, when it is a `K`.
    pub fn kind<K: Kind>(&self) -> Option<&K> {
        self.kind.as_any().downcast_ref::<K>()
    }

    /// The in-flight batching engine of a generative model.
    pub fn generative(&self) -> Option<&inflight::Engine> {
        self.kind::<inflight::Engine>()
    }

    /// This version's statistics as JSON, with the kind's own members (generation
    /// counters for generative models; the GPU data path's, per instance, for models
    /// with instances on a GPU).
    pub fn stats_json(&self, name: &str, version: i64) -> String {
        let mut j = self.stats.json(name, version, self.pending());
        let mut extra = String::new();
        self.kind.stats_json(&mut extra);
        if !extra.is_empty() && j.ends_with('}') {
            j.pop();
            j.push_str(&extra);
            j.push('}');
        }
        j
    }

    /// Appends this version's Prometheus samples.
    pub fn stats_prometheus(&self, out: &mut crate::stats::PromText, name: &str, version: i64) {
        let labels = crate::stats::labels_tagged(name, version, &self.config.metric_tags);
        self.stats.prometheus(out, &labels, self.pending());
        self.kind.stats_prometheus(out, &labels);
    }

    /// Queues a request. On failure the request comes back with the error so the caller
    /// can retry elsewhere (a replaced model) or fail it; the callback is not called.
    pub fn enqueue(
        &self,
        req: Box<Request>,
        shape_key: Option<ShapeKey>,
    ) -> std::result::Result<(), (Box<Request>, Error)> {
        self.kind.enqueue(self, req, shape_key)
    }

    pub fn pending(&self) -> usize {
        self.kind.pending()
    }

    /// Grows with every request answered and every response a decoupled backend sends:
    /// an unload sees whether the backend still makes progress.
    pub fn progress(&self) -> u64 {
        use std::sync::atomic::Ordering::Relaxed;
        self.stats.success_count.load(Relaxed)
            + self.stats.failure_count.load(Relaxed)
            + self.kind.delivered_apart()
    }

    pub fn set_paused(&self, paused: bool) {
        self.kind.set_paused(paused)
    }

    /// Stops accepting requests; the workers drain the queue and exit.
    pub fn close(&self) {
        self.kind.close()
    }

    /// True when nothing is queued or executing.
    pub fn is_idle(&self) -> bool {
        self.kind.is_idle()
    }

    /// Ends every queued request with CANCELLED (delivered by the workers).
    pub fn cancel_all(&self, why: &str) {
        self.kind.cancel_all(why)
    }

    pub fn cancel(&self, request_id: u64) -> CancelOutcome {
        self.kind.cancel(self, request_id)
    }

    /// Takes every request the kind still holds (after `close` and a wait that timed
    /// out) and answers it with CANCELLED on a library thread; returns how many.
    pub fn abandon(&self, why: &str) -> usize {
        let list = self.kind.abandon(why);
        let n = list.len();
        if n == 0 {
            return 0;
        }
        // Callbacks run on library threads, never on the caller's: a short-lived one
        // answers, and this call waits for it.
        let shared = Arc::new(Mutex::new(Some(list)));
        if let Some(me) = self.me.upgrade() {
            let (list, why) = (shared.clone(), why.to_owned());
            let spawned = std::thread::Builder::new()
                .name(format!("infer-{}-end", self.model.name_str()))
                .spawn(move || {
                    if let Some(list) = list.lock().take() {
                        me.answer_abandoned(list, &why);
                    }
                });
            if let Ok(h) = spawned {
                let _ = h.join();
            }
        }
        // No thread to be had: answer here rather than not at all.
        let left = shared.lock().take();
        if let Some(list) = left {
            self.answer_abandoned(list, why);
        }
        n
    }

    fn answer_abandoned(&self, list: Vec<Abandoned>, why: &str) {
        for a in list {
            match a {
                Abandoned::Queued(req, e) => self.fail(req, e),
                Abandoned::Executing(id, sink) => {
                    self.stats
                        .failure_count
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    sink.send_final(crate::request::Response::error(
                        id,
                        &self.model,
                        &crate::request::CorrelationId::None,
                        Error::cancelled(why.to_owned()),
                    ))
                }
            }
        }
    }

    /// Ends a request that did not run with `err`, counting the failure.
    pub(crate) fn fail(&self, req: Box<Request>, err: Error) {
        self.stats
            .failure_count
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        req.fail(&self.model, err);
    }

    /// Waits for the worker threads to exit until `deadline`; threads still running then
    /// (stuck in a backend) are left detached, keeping what they use alive. Returns how
    /// many were left.
    pub fn join_until(&self, deadline: Instant) -> usize {
        let me = std::thread::current().id();
        let handles: Vec<_> = {
            let mut w = self.workers.lock();
            let (mine, others): (Vec<_>, Vec<_>) = w.drain(..).partition(|h| h.thread().id() == me);
            *w = mine;
            others
        };
        let mut left = 0;
        for h in handles {
            while !h.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            if h.is_finished() {
                let _ = h.join();
            } else {
                left += 1;
            }
        }
        left
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
