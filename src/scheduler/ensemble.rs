//! Ensembles: a request to an ensemble model runs a graph of steps, each a request to a
//! composing model through the server like any caller's (so each composing model keeps
//! its own scheduler and batches the internal requests of many ensemble requests).
//!
//! A step is sent as soon as every tensor it reads exists; independent steps run in
//! parallel; only the steps the requested outputs depend on run. Intermediate tensors are
//! shared windows into the producing batch's output buffer, passed on without a copy.
//! The first failing step ends the ensemble request (steps not started stay unstarted);
//! every path ends in exactly one FINAL, guarded by taking the caller's sink once. A
//! tensor that will not come (an optional ensemble input not given, an output a step's
//! model did not produce) is "missing": steps that read it go without it, and an ensemble
//! output that is missing is left out of the response, as Triton does.
//!
//! There are no worker threads: steps continue from the composing models' response
//! callbacks, which run on those models' workers. Per-step `max_inflight_requests` bounds
//! how many of a step's requests are out at once; the rest wait in the step's FIFO, which
//! `max_queue_size` bounds in turn (beyond it the ensemble request fails).

use super::Scheduler;
use crate::config::{EnsembleStep, ModelConfig};
use crate::request::{CorrelationId, OutputTensor, Request, Response, ResponseSink, Shape};
use crate::status::{Code, Error, Result};
use crate::tensor::{DataType, DeviceData, DeviceKeep, Tensor, TensorData};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet, VecDeque};
use std::ffi::CString;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

/// A tensor of a running ensemble request.
struct Value {
    dtype: DataType,
    shape: Shape,
    data: TensorData,
}

/// A view of the same bytes: shared windows (in host or device memory) are shared
/// again, other data is moved into a shared buffer once.
fn share(data: &mut TensorData) -> TensorData {
    match data {
        TensorData::Shared { buf, offset, len } => {
            return TensorData::Shared {
                buf: buf.clone(),
                offset: *offset,
                len: *len,
            }
        }
        TensorData::Device(d) => {
            let keep = match &mut d.keep {
                DeviceKeep::Pooled(buf) => DeviceKeep::Pooled(buf.clone()),
                DeviceKeep::Shared(lent) => DeviceKeep::Shared(lent.clone()),
                DeviceKeep::Borrowed(b) => {
                    let lent = Arc::new(b.take());
                    d.keep = DeviceKeep::Shared(lent.clone());
                    DeviceKeep::Shared(lent)
                }
            };
            return TensorData::Device(DeviceData {
                ptr: d.ptr,
                len: d.len,
                device: d.device,
                keep,
            });
        }
        TensorData::Owned(_) | TensorData::Borrowed(_) => {}
    }
    let bytes = data.as_slice().to_vec();
    let len = bytes.len();
    let buf = Arc::new(bytes);
    *data = TensorData::Shared {
        buf: buf.clone(),
        offset: 0,
        len,
    };
    TensorData::Shared {
        buf,
        offset: 0,
        len,
    }
}

struct Run {
    id: u64,
    corr: CorrelationId,
    flags: u32,
    priority: u32,
    timeout_us: u64,
    batch_size: u32,
    started_at: Instant,
    /// Ensemble outputs to return, in config order.
    wanted: Vec<usize>,
    /// Steps the wanted outputs depend on.
    needed: Vec<bool>,
    /// Where each needed step goes and leaves its outputs.
    plan: Vec<StepPlan>,
    st: Mutex<RunState>,
}

struct RunState {
    tensors: HashMap<Arc<str>, Value>,
    /// Tensors that will not come: optional ensemble inputs not given, and outputs a
    /// step's model did not produce. A step that reads one goes without that input; an
    /// ensemble output that is one is left out of the response (as Triton does).
    missing: HashSet<Arc<str>>,
    started: Vec<bool>,
    /// Ids of internal requests sent (for cancel).
    sent: Vec<u64>,
    /// The caller's sink; taken exactly once, by the FINAL.
    sink: Option<ResponseSink>,
}

/// A needed step of a request: the model version it was resolved to when the request
/// started (its enqueue looks again if that version has gone since), and the GPU its
/// outputs stay on.
#[derive(Default)]
struct StepPlan {
    target: Option<Arc<Scheduler>>,
    /// Some(d) when the step's model runs on GPU d and every reader of its outputs
    /// does too: the next steps on d, and the caller where it wants outputs on d. Then
    /// its outputs go from step to step in device memory, as in Triton's ensembles;
    /// otherwise they come to the host (whatever reads them there, or a GPU on another
    /// step, copies them from there).
    leave_on: Option<i32>,
}

#[derive(Default)]
struct StepQueue {
    inflight: u32,
    waiting: VecDeque<Arc<Run>>,
}

/// How an ensemble reaches the models of its steps: the server, seen from below. A step's
/// request goes in as a caller's would, so each composing model keeps its own scheduling.
pub trait Router: Send + Sync {
    /// Enqueues `req` to the model (and version) it names; its request id.
    fn enqueue(&self, req: Box<Request>) -> Result<u64>;
    /// Cancels a request enqueued here (one that has finished is not an error).
    fn cancel(&self, request_id: u64);
    /// The scheduler serving `version` (-1: the latest) of `model`, if loaded.
    fn scheduler(&self, model: &str, version: i64) -> Option<Arc<Scheduler>>;
}

/// The ensemble scheduler: runs each request's steps as their inputs become ready.
pub struct Runner {
    me: Weak<Scheduler>,
    server: Weak<dyn Router>,
    steps: Vec<EnsembleStep>,
    queues: Vec<Mutex<StepQueue>>,
    out_names: Vec<Arc<CString>>,
    runs: Mutex<HashMap<u64, Arc<Run>>>,
    closed: AtomicBool,
}

impl Runner {
    pub(super) fn new(
        me: Weak<Scheduler>,
        server: Weak<dyn Router>,
        config: &ModelConfig,
    ) -> Runner {
        let steps = config
            .ensemble
            .as_ref()
            .map(|e| e.steps.clone())
            .unwrap_or_default();
        Runner {
            me,
            server,
            queues: steps.iter().map(|_| Mutex::default()).collect(),
            steps,
            out_names: config
                .outputs
                .iter()
                .map(|t| super::c_name(&t.name))
                .collect(),
            runs: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
        }
    }

    fn sched(&self) -> Option<Arc<Scheduler>> {
        self.me.upgrade()
    }

    pub(super) fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    pub(super) fn in_flight(&self) -> usize {
        self.runs.lock().len()
    }

    /// Accepts an ensemble request and sends the steps that can start.
    pub(super) fn start(
        &self,
        mut req: Box<Request>,
    ) -> std::result::Result<(), (Box<Request>, Error)> {
        let Some(sched) = self.sched() else {
            return Err((req, Error::unavailable("the ensemble is unloading")));
        };
        if self.closed.load(Ordering::Acquire) {
            let e = Error::unavailable(format!("model '{}' is unloading", sched.model.name_str()));
            return Err((req, e));
        }
        let config = &sched.config;
        let wanted: Vec<usize> = config
            .outputs
            .iter()
            .enumerate()
            .filter(|(_, t)| req.wants_output(&t.name))
            .map(|(i, _)| i)
            .collect();
        // The steps the wanted outputs depend on, found backwards through the tensors.
        let mut need: HashSet<Arc<str>> = wanted
            .iter()
            .map(|&i| config.outputs[i].name.clone())
            .collect();
        let mut needed = vec![false; self.steps.len()];
        loop {
            let mut changed = false;
            for (i, s) in self.steps.iter().enumerate() {
                if !needed[i] && s.output_map.iter().any(|(_, t)| need.contains(t)) {
                    needed[i] = true;
                    need.extend(s.input_map.iter().map(|(_, t)| t.clone()));
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        let plan = self.plan(&config.outputs, &needed, &wanted, req.output_device);
        let mut tensors = HashMap::with_capacity(req.inputs.len() + self.steps.len());
        for t in &mut req.inputs {
            tensors.insert(
                t.name.clone(),
                Value {
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    data: share(&mut t.data),
                },
            );
        }
        let missing: HashSet<Arc<str>> = (config.inputs.iter())
            .filter(|t| !tensors.contains_key(&t.name))
            .map(|t| t.name.clone())
            .collect();
        let run = Arc::new(Run {
            id: req.id,
            corr: req.correlation_id.clone(),
            flags: req.flags,
            priority: req.priority,
            timeout_us: req.timeout_us,
            batch_size: req.batch_size,
            started_at: Instant::now(),
            wanted,
            needed,
            plan,
            st: Mutex::new(RunState {
                tensors,
                missing,
                started: vec![false; self.steps.len()],
                sent: Vec::new(),
                sink: req.sink.take(),
            }),
        });
        self.runs.lock().insert(run.id, run.clone());
        crate::request::pool::recycle_request(req);
        self.advance(&sched, &run);
        Ok(())
    }

    /// Resolves each needed step's model and decides where its outputs stay: on the GPU
    /// it runs on when every reader of them is there too (`out_device`: where the
    /// caller wants the ensemble's outputs), else in host memory. A model with a
    /// response cache reads and writes host memory (its cache keeps host outputs).
    fn plan(
        &self,
        outputs: &[crate::config::TensorConfig],
        needed: &[bool],
        wanted: &[usize],
        out_device: Option<i32>,
    ) -> Vec<StepPlan> {
        let server = self.server.upgrade();
        let targets: Vec<Option<Arc<Scheduler>>> = (self.steps.iter().zip(needed))
            .map(|(s, &n)| {
                let server = server.as_ref().filter(|_| n)?;
                server.scheduler(&s.model_name, s.model_version)
            })
            .collect();
        let device_of = |i: usize| {
            (targets[i].as_ref())
                .filter(|t| !t.config.response_cache)
                .and_then(|t| t.device)
        };
        let readers_on = |i: usize, d: i32| {
            let mut read = false;
            for (_, tensor) in &self.steps[i].output_map {
                if wanted.iter().any(|&o| outputs[o].name == *tensor) {
                    if out_device != Some(d) {
                        return false;
                    }
                    read = true;
                }
                for (j, s) in self.steps.iter().enumerate() {
                    if needed[j] && s.input_map.iter().any(|(_, t)| t == tensor) {
                        if device_of(j) != Some(d) {
                            return false;
                        }
                        read = true;
                    }
                }
            }
            read
        };
        (0..self.steps.len())
            .map(|i| StepPlan {
                leave_on: device_of(i).filter(|&d| readers_on(i, d)),
                target: targets[i].clone(),
            })
            .collect()
    }

    /// Sends every needed step whose inputs exist, or finishes the request.
    fn advance(&self, sched: &Arc<Scheduler>, run: &Arc<Run>) {
        let ready: Vec<usize> = {
            let mut st = run.st.lock();
            if st.sink.is_none() {
                return; // already answered
            }
            let complete = run.wanted.iter().all(|&i| {
                let name = &sched.config.outputs[i].name;
                st.tensors.contains_key(name) || st.missing.contains(name)
            });
            if complete {
                drop(st);
                return self.finish(sched, run);
            }
            let mut ready = Vec::new();
            for (i, s) in self.steps.iter().enumerate() {
                if run.needed[i]
                    && !st.started[i]
                    && (s.input_map.iter())
                        .all(|(_, t)| st.tensors.contains_key(t) || st.missing.contains(t))
                {
                    st.started[i] = true;
                    ready.push(i);
                }
            }
            ready
        };
        for i in ready {
            self.submit(sched, run, i);
        }
    }

    /// Sends step `i` now, or queues it behind the step's in-flight limit.
    fn submit(&self, sched: &Arc<Scheduler>, run: &Arc<Run>, i: usize) {
        let step = &self.steps[i];
        if step.max_inflight_requests > 0 {
            let mut q = self.queues[i].lock();
            if q.inflight >= step.max_inflight_requests {
                let waiting = q.waiting.len();
                if step.max_queue_size == 0 || waiting < step.max_queue_size as usize {
                    q.waiting.push_back(run.clone());
                    return;
                }
                drop(q);
                let e = Error::new(
                    Code::ResourceExhausted,
                    format!(
                        "step '{}': {waiting} requests already wait for it (max_queue_size {})",
                        step.model_name, step.max_queue_size
                    ),
                );
                return self.fail(sched, run, e);
            }
            q.inflight += 1;
        }
        self.send(sched, run, i);
    }

    /// A request of step `i` finished: the next waiting one (of a request still
    /// running) may go.
    fn step_done(&self, sched: &Arc<Scheduler>, i: usize) {
        if self.steps[i].max_inflight_requests == 0 {
            return;
        }
        let next = {
            let mut q = self.queues[i].lock();
            q.inflight -= 1;
            loop {
                match q.waiting.pop_front() {
                    Some(r) if r.st.lock().sink.is_none() => continue,
                    Some(r) => {
                        q.inflight += 1;
                        break Some(r);
                    }
                    None => break None,
                }
            }
        };
        if let Some(r) = next {
            self.send(sched, &r, i);
        }
    }

    fn send(&self, sched: &Arc<Scheduler>, run: &Arc<Run>, i: usize) {
        let step = &self.steps[i];
        let Some(server) = self.server.upgrade() else {
            self.step_done(sched, i);
            return self.fail(sched, run, Error::unavailable("the server is gone"));
        };
        let mut req = Request::boxed(&step.model_name, step.model_version, None);
        {
            let mut st = run.st.lock();
            if st.sink.is_none() {
                drop(st);
                crate::request::pool::recycle_request(req);
                return self.step_done(sched, i);
            }
            for (input, tensor) in &step.input_map {
                if let Some(v) = st.tensors.get_mut(tensor) {
                    req.inputs.push(Tensor {
                        name: input.clone(),
                        dtype: v.dtype,
                        shape: v.shape.clone(),
                        data: share(&mut v.data),
                    });
                }
            }
        }
        req.requested_outputs
            .extend(step.output_map.iter().map(|(o, _)| o.clone()));
        req.outputs_optional = true;
        let plan = &run.plan[i];
        req.leave_on_device = plan.leave_on;
        req.target = (plan.target.clone()).map(|t| t as Arc<dyn std::any::Any + Send + Sync>);
        req.correlation_id = run.corr.clone();
        req.flags = run.flags;
        req.priority = run.priority;
        req.timeout_us = run.timeout_us;
        let (s2, r2) = (sched.clone(), run.clone());
        req.sink = Some(ResponseSink::rust(move |resp, flags| {
            if flags & crate::request::RESPONSE_FLAG_FINAL != 0 {
                if let Some(runner) = s2.kind::<Runner>() {
                    runner.on_response(&s2, &r2, i, resp);
                }
            }
        }));
        match server.enqueue(req) {
            Ok(id) => run.st.lock().sent.push(id),
            Err(e) => {
                self.step_done(sched, i);
                let e = Error::new(e.code, format!("step '{}': {}", step.model_name, e.message));
                self.fail(sched, run, e);
            }
        }
    }

    fn on_response(
        &self,
        sched: &Arc<Scheduler>,
        run: &Arc<Run>,
        i: usize,
        mut resp: Box<Response>,
    ) {
        self.step_done(sched, i);
        let step = &self.steps[i];
        if resp.status != Code::Ok {
            let msg = resp
                .error
                .as_ref()
                .map(|e| e.to_string_lossy().into_owned())
                .unwrap_or_default();
            let e = Error::new(resp.status, format!("step '{}': {msg}", step.model_name));
            crate::request::pool::recycle_response(resp);
            return self.fail(sched, run, e);
        }
        {
            let mut st = run.st.lock();
            for (output, tensor) in &step.output_map {
                let found = resp
                    .outputs
                    .iter_mut()
                    .find(|o| o.name.as_bytes() == output.as_bytes());
                match found {
                    Some(o) => {
                        let v = Value {
                            dtype: o.dtype,
                            shape: o.shape.clone(),
                            data: share(&mut o.data),
                        };
                        st.tensors.insert(tensor.clone(), v);
                    }
                    None => {
                        st.missing.insert(tensor.clone());
                    }
                }
            }
        }
        crate::request::pool::recycle_response(resp);
        self.advance(sched, run);
    }

    fn finish(&self, sched: &Arc<Scheduler>, run: &Arc<Run>) {
        let (sink, resp) = {
            let mut st = run.st.lock();
            let Some(sink) = st.sink.take() else {
                return;
            };
            let mut resp = Response::ok(run.id, &sched.model, &run.corr);
            for &i in &run.wanted {
                let name = &sched.config.outputs[i].name;
                if let Some(v) = st.tensors.get_mut(name) {
                    resp.outputs.push(OutputTensor {
                        name: self.out_names[i].clone(),
                        dtype: v.dtype,
                        shape: v.shape.clone(),
                        data: share(&mut v.data),
                    });
                }
            }
            // The intermediate tensors are not needed any more.
            st.tensors.clear();
            (sink, resp)
        };
        self.runs.lock().remove(&run.id);
        let us = run.started_at.elapsed().as_micros() as u64;
        sched
            .stats
            .record_execution(run.batch_size, u64::from(run.batch_size.max(1)), us);
        sched.stats.success_count.fetch_add(1, Ordering::Relaxed);
        sink.send_final(resp);
    }

    /// Ends the request with `e` (the first failure wins; later ones are dropped).
    fn fail(&self, sched: &Arc<Scheduler>, run: &Arc<Run>, e: Error) {
        let sink = {
            let mut st = run.st.lock();
            st.tensors.clear();
            st.sink.take()
        };
        let Some(sink) = sink else {
            return;
        };
        self.runs.lock().remove(&run.id);
        sched.stats.failure_count.fetch_add(1, Ordering::Relaxed);
        let e = Error::new(
            e.code,
            format!("in ensemble '{}', {}", sched.model.name_str(), e.message),
        );
        sink.send_final(Response::error(run.id, &sched.model, &run.corr, e));
    }

    /// Ends a running ensemble request with CANCELLED and cancels its internal requests.
    pub(super) fn cancel(&self, request_id: u64) -> bool {
        let Some(run) = self.runs.lock().get(&request_id).cloned() else {
            return false;
        };
        let Some(sched) = self.sched() else {
            return false;
        };
        let sent = std::mem::take(&mut run.st.lock().sent);
        self.fail(
            &sched,
            &run,
            Error::cancelled(format!("request {request_id} was cancelled")),
        );
        if let Some(server) = self.server.upgrade() {
            for id in sent {
                server.cancel(id);
            }
        }
        true
    }

    pub(super) fn cancel_all(&self, why: &str) {
        let runs: Vec<Arc<Run>> = self.runs.lock().values().cloned().collect();
        if let Some(sched) = self.sched() {
            for r in runs {
                self.fail(&sched, &r, Error::cancelled(why.to_owned()));
            }
        }
    }
}

/// Whether a producer's shape can feed a consumer's (same rank; -1 matches any size).
pub(crate) fn dims_compatible(a: &[i64], b: &[i64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(&x, &y)| x == -1 || y == -1 || x == y)
}

/// Checks an ensemble against the composing models it names (`lookup` gives a loaded
/// model's config): every composing model loaded, inputs mapped, datatypes and shapes
/// agreeing between producers and consumers, batch sizes within what each allows, no
/// cycle through nested ensembles.
pub(crate) fn check_composition(
    config: &ModelConfig,
    lookup: &dyn Fn(&str, i64) -> Option<Arc<ModelConfig>>,
) -> Result<()> {
    let Some(ens) = &config.ensemble else {
        return Ok(());
    };
    let m = &config.name;
    let err = |path: String, what: String| Error::invalid(format!("model '{m}': {path}: {what}"));
    let full = |mbs: u32, dims: &[i64]| -> Vec<i64> {
        let mut v = Vec::with_capacity(dims.len() + 1);
        if mbs > 0 {
            v.push(-1);
        }
        v.extend_from_slice(dims);
        v
    };
    // Ensemble tensor -> (datatype, full dims, who).
    let mut known: HashMap<Arc<str>, (DataType, Vec<i64>, String)> = HashMap::new();
    for t in &config.inputs {
        known.insert(
            t.name.clone(),
            (
                t.data_type,
                full(config.max_batch_size, &t.dims),
                format!("ensemble input '{}'", t.name),
            ),
        );
    }
    let mut composing = Vec::with_capacity(ens.steps.len());
    for (i, s) in ens.steps.iter().enumerate() {
        let path = format!("ensemble_scheduling.step[{i}]");
        let c = lookup(&s.model_name, s.model_version).ok_or_else(|| {
            err(
                format!("{path}.model_name"),
                format!(
                    "composing model '{}' (version {}) is not loaded; load it before the ensemble",
                    s.model_name, s.model_version
                ),
            )
        })?;
        if c.decoupled {
            return Err(Error::unsupported(format!(
                "model '{m}': {path}.model_name: composing model '{}' is decoupled (it may send several responses per request); ensembles take one response per step",
                s.model_name
            )));
        }
        if config.max_batch_size > c.max_batch_size {
            return Err(err(
                "max_batch_size".into(),
                format!(
                    "{} is larger than composing model '{}' allows ({})",
                    config.max_batch_size, s.model_name, c.max_batch_size
                ),
            ));
        }
        for (out, tensor) in &s.output_map {
            let tc = c.output(out).ok_or_else(|| {
                err(
                    format!("{path}.output_map[{out}]"),
                    format!("composing model '{}' has no output '{out}'", s.model_name),
                )
            })?;
            known.insert(
                tensor.clone(),
                (
                    tc.data_type,
                    full(c.max_batch_size, &tc.dims),
                    format!("output '{out}' of step '{}'", s.model_name),
                ),
            );
        }
        for (input, _) in &s.input_map {
            if c.input(input).is_none() {
                return Err(err(
                    format!("{path}.input_map[{input}]"),
                    format!("composing model '{}' has no input '{input}'", s.model_name),
                ));
            }
        }
        for tc in c.inputs.iter().filter(|t| !t.optional) {
            if !s.input_map.iter().any(|(k, _)| *k == tc.name) {
                return Err(err(
                    format!("{path}.input_map"),
                    format!(
                        "input '{}' of composing model '{}' is not mapped",
                        tc.name, s.model_name
                    ),
                ));
            }
        }
        composing.push(c);
    }
    for (i, (s, c)) in ens.steps.iter().zip(&composing).enumerate() {
        for (input, tensor) in &s.input_map {
            let (Some(tc), Some((dt, dims, who))) = (c.input(input), known.get(tensor)) else {
                continue;
            };
            let want = full(c.max_batch_size, &tc.dims);
            if *dt != tc.data_type || !dims_compatible(dims, &want) {
                return Err(err(
                    format!("ensemble_scheduling.step[{i}].input_map[{input}]"),
                    format!(
                        "tensor '{tensor}' is {} {} ({who}) but input '{input}' of '{}' takes {} {}",
                        dt.as_str(),
                        crate::tensor::shape_string(dims),
                        s.model_name,
                        tc.data_type.as_str(),
                        crate::tensor::shape_string(&want)
                    ),
                ));
            }
        }
    }
    for t in &config.outputs {
        if let Some((dt, dims, who)) = known.get(&t.name) {
            let want = full(config.max_batch_size, &t.dims);
            if *dt != t.data_type || !dims_compatible(dims, &want) {
                return Err(err(
                    "output".into(),
                    format!(
                        "ensemble output '{}' is {} {} but {who} gives {} {}",
                        t.name,
                        t.data_type.as_str(),
                        crate::tensor::shape_string(&want),
                        dt.as_str(),
                        crate::tensor::shape_string(dims)
                    ),
                ));
            }
        }
    }
    // Nested ensembles must not lead back here.
    let mut stack: Vec<Arc<ModelConfig>> = composing;
    let mut seen: HashSet<String> = HashSet::new();
    while let Some(c) = stack.pop() {
        if !seen.insert(c.name.clone()) {
            continue;
        }
        if let Some(e) = &c.ensemble {
            for s in &e.steps {
                if s.model_name == *m {
                    return Err(err(
                        "ensemble_scheduling".into(),
                        format!("cycle: nested ensemble '{}' calls '{m}' again", c.name),
                    ));
                }
                if let Some(n) = lookup(&s.model_name, s.model_version) {
                    stack.push(n);
                }
            }
        }
    }
    Ok(())
}

impl super::Kind for Runner {
    fn enqueue(
        &self,
        _s: &Scheduler,
        req: Box<Request>,
        _shape_key: Option<super::ShapeKey>,
    ) -> std::result::Result<(), (Box<Request>, Error)> {
        self.start(req)
    }

    fn pending(&self) -> usize {
        self.in_flight()
    }

    /// An ensemble has no queue of its own: its steps' models pause.
    fn set_paused(&self, _paused: bool) {}

    fn close(&self) {
        Runner::close(self)
    }

    fn is_idle(&self) -> bool {
        self.in_flight() == 0
    }

    fn cancel_all(&self, why: &str) {
        Runner::cancel_all(self, why)
    }

    fn cancel(&self, _s: &Scheduler, request_id: u64) -> super::CancelOutcome {
        match Runner::cancel(self, request_id) {
            true => super::CancelOutcome::Cancelled,
            false => super::CancelOutcome::NotFound,
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
