//! The server: backends, the model registry (name -> versions -> scheduler), request
//! routing and shutdown with drain. The load/replace/unload lifecycle is in `load`, the
//! start of generative models in `generative`, GPU output placement in `outputs`.
//!
//! Lifecycle changes never fail or lose an accepted request: a replaced or unloaded
//! version stops accepting work, finishes what it has queued and only then goes away.

mod cache;
mod generative;
mod load;
pub mod outputs;
mod repository;
mod warmup;

use crate::backend::{builtin, Backend};
use crate::config::ModelConfig;
pub use crate::cuda::GpuMode;
use crate::cuda::GpuState;
use crate::log::Logger;
use crate::onnx;
use crate::request::checks::prepare;
use crate::request::Request;
use crate::scheduler::{inflight, CancelOutcome, Scheduler};
use crate::stats::PromText;
use crate::status::{Code, Error, Result};
use parking_lot::{Mutex, RwLock};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone)]
pub struct ServerOptions {
    pub repository: Option<PathBuf>,
    /// Symbolic links in the repository (or an application's model folder) may lead out
    /// of it. Off by default: every path a model names stays inside.
    pub trusted_repository: bool,
    pub explicit_model_control: bool,
    pub gpu: GpuMode,
    pub log: Logger,
    pub backends: Vec<(String, Arc<dyn Backend>)>,
    /// With explicit model control: the repository's models loaded at start-up.
    pub startup_models: Vec<String>,
    /// Where ONNX Runtime comes from, whether it is required, its global thread pools.
    pub onnxruntime: onnx::onnxruntime::RuntimeOptions,
    /// Polls the repository this often (`Server::poll_repository`); None: only when the
    /// application asks.
    pub repository_poll: Option<Duration>,
    /// Bytes of the response cache shared by the models that enable it (0: no cache).
    pub response_cache_bytes: usize,
    /// Triton's `--rate-limit=execution_count`: instances take their `rate_limiter`
    /// resources before they execute (off: the field has no effect, as in Triton).
    pub rate_limit: bool,
    /// Resource sizes (Triton's `--rate-limit-resource`): name, device (-1: the global
    /// resource and every device without its own size), count.
    pub rate_limit_resources: Vec<(String, i32, u32)>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            repository: None,
            trusted_repository: false,
            explicit_model_control: false,
            gpu: GpuMode::Auto,
            log: Logger::default(),
            backends: Vec::new(),
            startup_models: Vec::new(),
            onnxruntime: Default::default(),
            repository_poll: None,
            response_cache_bytes: 0,
            rate_limit: false,
            rate_limit_resources: Vec::new(),
        }
    }
}

/// A loaded model: its config and its ready versions.
struct ModelEntry {
    config: Arc<ModelConfig>,
    versions: BTreeMap<i64, Arc<Scheduler>>,
    /// Composing models this ensemble loaded from the repository (explicit model
    /// control), unloaded with it unless the application loaded them itself since.
    loaded_with: Vec<String>,
}

impl ModelEntry {
    fn version(&self, name: &str, version: i64) -> Result<&Arc<Scheduler>> {
        let found = if version < 0 {
            self.versions.values().next_back()
        } else {
            self.versions.get(&version)
        };
        found.ok_or_else(|| {
            let have: Vec<String> = self.versions.keys().map(|v| v.to_string()).collect();
            Error::not_found(format!(
                "model '{name}' has no ready version {version} (ready: {})",
                have.join(", ")
            ))
        })
    }
}

pub struct Server {
    /// This server (ensembles send their steps through it).
    me: std::sync::Weak<Server>,
    /// Unique in the process; the requests this server makes carry it.
    id: u64,
    opts: ServerOptions,
    log: Logger,
    /// What this server may use of the GPUs (fixed at start).
    gpu: GpuState,
    backends: RwLock<HashMap<String, Arc<dyn Backend>>>,
    models: RwLock<HashMap<String, ModelEntry>>,
    /// Replaced or unloaded versions that may still hold queued or running requests.
    retired: Mutex<Vec<Arc<Scheduler>>>,
    /// Serialises load / unload / shutdown.
    lifecycle: Mutex<()>,
    /// Loads in progress, last failures, models from the repository, folders from memory.
    tracking: Mutex<repository::Tracking>,
    /// One repository poll at a time.
    poll_lock: Mutex<()>,
    /// The response cache (`response_cache_bytes` > 0).
    cache: Option<Arc<cache::ResponseCache>>,
    /// The rate limiter (`rate_limit`), shared by every model's instances.
    rate: Option<Arc<crate::scheduler::rate::RateLimiter>>,
    next_request_id: AtomicU64,
    accepting: AtomicBool,
    /// Iteration-statistics callbacks by model name (kept across reloads).
    stats_callbacks: Mutex<HashMap<String, Arc<inflight::StatsCallback>>>,
    /// By device id: what copies host outputs to the GPU a request asked for (made on
    /// the first such request).
    output_placers: Mutex<Vec<Option<Arc<crate::server::outputs::OutputPlacer>>>>,
    /// Answers queue timeouts on time (a thread started on first use).
    timer: Arc<crate::scheduler::timer::Timer>,
    /// This server has said in its log which engine runs its ONNX models (once).
    said_engine: AtomicBool,
    /// Whether the CUDA libraries in use were logged (after the first GPU instance).
    pub(crate) said_cuda_libraries: AtomicBool,
    /// How many of `cuda::kernel_cache::notes` (where GPU kernels came from) were logged.
    pub(crate) said_kernel_notes: std::sync::atomic::AtomicUsize,
}

/// Servers alive in this process; the object pools are emptied when it drops to zero.
static LIVE_SERVERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Drop for Server {
    fn drop(&mut self) {
        onnx::onnxruntime::remove_log(self.id);
        if LIVE_SERVERS.fetch_sub(1, Ordering::AcqRel) == 1 {
            crate::request::pool::drain();
        }
    }
}

/// After a shutdown's timeout: how long the workers get to deliver the cancellations and
/// exit before the requests they hold are answered without them.
const END_GRACE: Duration = Duration::from_millis(200);

/// How long enqueue retries when it meets a version that is being replaced.
const REPLACE_RETRIES: usize = 8;

impl Server {
    pub fn new(opts: ServerOptions) -> Result<Arc<Server>> {
        let log = opts.log.clone();
        let gpu = GpuState::for_mode(opts.gpu);
        match (&gpu, opts.gpu) {
            (GpuState::Unavailable(why), GpuMode::Required) => {
                return Err(Error::unavailable(format!("GPU required but {why}")))
            }
            (GpuState::Unavailable(why), _) => {
                log.info(&format!("no usable GPU ({why}): models run on the CPU"))
            }
            (GpuState::Ready(runtime), _) => {
                log.info(&format!("GPU found: {}", runtime.describe()))
            }
            (GpuState::Off, _) => {}
        }
        let mut backends: HashMap<String, Arc<dyn Backend>> = HashMap::new();
        for (name, b) in &opts.backends {
            backends.insert(name.clone(), b.clone());
        }
        if let Some(period) = opts.repository_poll {
            if opts.repository.is_none() {
                return Err(Error::invalid(
                    "a repository poll period is set, but the server has no model repository (infer_server_options_set_model_repository)",
                ));
            }
            if opts.explicit_model_control {
                return Err(Error::invalid(
                    "a repository poll period is set with explicit model control: polling loads and unloads the repository's models, explicit control leaves that to the application; choose one",
                ));
            }
            if period.is_zero() {
                return Err(Error::invalid(
                    "the repository poll period must not be zero",
                ));
            }
        }
        let cache = match opts.response_cache_bytes {
            0 => None,
            n => Some(cache::ResponseCache::start(n)?),
        };
        LIVE_SERVERS.fetch_add(1, Ordering::AcqRel);
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let server = Arc::new_cyclic(|me| Server {
            me: me.clone(),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            log,
            gpu,
            backends: RwLock::new(backends),
            models: RwLock::new(HashMap::new()),
            retired: Mutex::new(Vec::new()),
            lifecycle: Mutex::new(()),
            tracking: Mutex::new(Default::default()),
            poll_lock: Mutex::new(()),
            cache,
            rate: (opts.rate_limit).then(|| {
                crate::scheduler::rate::RateLimiter::new(opts.rate_limit_resources.clone())
            }),
            next_request_id: AtomicU64::new(1),
            accepting: AtomicBool::new(true),
            stats_callbacks: Mutex::new(HashMap::new()),
            output_placers: Mutex::new(Vec::new()),
            timer: Arc::new(crate::scheduler::timer::Timer::new()),
            said_engine: AtomicBool::new(false),
            said_cuda_libraries: AtomicBool::new(false),
            said_kernel_notes: std::sync::atomic::AtomicUsize::new(0),
            opts,
        });
        if let Some(repo) = &server.opts.repository {
            let mut names = Vec::new();
            if server.opts.explicit_model_control {
                // Only the models named at start-up.
                names.clone_from(&server.opts.startup_models);
            } else {
                let entries = std::fs::read_dir(repo).map_err(|e| {
                    Error::not_found(format!("model repository '{}': {e}", repo.display()))
                })?;
                for e in entries.flatten() {
                    let p = e.path();
                    if load::is_model_dir(&p) {
                        if let Some(n) = p.file_name().and_then(|n| n.to_str()) {
                            names.push(n.to_owned());
                        }
                    }
                }
            }
            names.sort();
            names.dedup();
            // Ensembles need their composing models first: load in rounds until a round
            // makes no progress.
            while !names.is_empty() {
                let mut failed = Vec::new();
                let mut first_error = None;
                for n in &names {
                    // Loaded already, for an ensemble named before it: the application's
                    // now, and not loaded twice.
                    if server.opts.explicit_model_control && server.is_loaded(n) {
                        server.adopt(n);
                        continue;
                    }
                    if let Err(e) = server.load_model(n, None, None) {
                        first_error.get_or_insert(e);
                        failed.push(n.clone());
                    }
                }
                match first_error {
                    None => break,
                    Some(e) if failed.len() == names.len() => {
                        server.shutdown(Duration::from_secs(1));
                        return Err(e);
                    }
                    Some(_) => names = failed,
                }
            }
        }
        if let Some(period) = server.opts.repository_poll {
            if let Err(e) = server.start_polling(period) {
                server.shutdown(Duration::from_secs(1));
                return Err(e);
            }
        }
        Ok(server)
    }

    pub fn log(&self) -> &Logger {
        &self.log
    }

    /// Registers a backend (the C API's custom backends, or one implemented in Rust).
    /// ALREADY_EXISTS if the name is taken.
    pub fn register_backend(&self, name: &str, backend: Arc<dyn Backend>) -> Result<()> {
        let mut b = self.backends.write();
        if b.contains_key(name) {
            return Err(Error::new(
                Code::AlreadyExists,
                format!("a backend named '{name}' is already registered"),
            ));
        }
        b.insert(name.to_owned(), backend);
        Ok(())
    }

    fn backend_for(&self, config: &ModelConfig) -> Result<Arc<dyn Backend>> {
        let key = backend_key(&config.backend, &config.platform);
        if let Some(b) = self.backends.read().get(key) {
            return Ok(b.clone());
        }
        if let Some(b) = builtin::lookup(key) {
            return Ok(b);
        }
        if onnx::is_onnx(key) {
            let engine = self.onnx_engine(config.name.as_str(), key, &config.parameters)?;
            return Ok(Arc::new(onnx::OnnxBackend::new(
                config,
                engine,
                key == onnx::TRACT,
            )?));
        }
        Err(Error::unsupported(format!(
            "model '{}': no backend '{key}' (built in: onnxruntime_onnx / onnxruntime, tract, gpt2, llama, identity, add_sub, accumulator; register custom backends before loading)",
            config.name
        )))
    }

    /// The engine of an ONNX model: ONNX Runtime for Triton's names when it loads, tract
    /// for `backend: "tract"` and when ONNX Runtime cannot be loaded (said once in the
    /// log), UNAVAILABLE when the server option or the model's `onnxruntime_required`
    /// parameter requires ONNX Runtime.
    pub(crate) fn onnx_engine(
        &self,
        model: &str,
        key: &str,
        parameters: &std::collections::BTreeMap<String, String>,
    ) -> Result<onnx::Engine> {
        if key == onnx::TRACT {
            return Ok(onnx::Engine::Tract);
        }
        let param = onnx::onnxruntime::settings::REQUIRED_PARAMETER;
        let by_model = parameters
            .get(param)
            .is_some_and(|v| matches!(v.trim(), "1" | "true" | "TRUE" | "True"));
        match onnx::onnxruntime::runtime(&self.opts.onnxruntime, &self.log) {
            Ok(rt) => {
                onnx::onnxruntime::add_log(self.id, &self.log);
                if !self.said_engine.swap(true, Ordering::AcqRel) {
                    self.log.info(&format!(
                        "ONNX models run on ONNX Runtime {} ('{}'; execution providers: {})",
                        rt.version,
                        rt.path.display(),
                        rt.providers.join(", ")
                    ));
                }
                Ok(onnx::Engine::OnnxRuntime(rt))
            }
            Err(why) if self.opts.onnxruntime.required || by_model => {
                let by = if by_model {
                    format!("parameters.{param}")
                } else {
                    "the server option".to_owned()
                };
                Err(Error::unavailable(format!(
                    "model '{model}': ONNX Runtime is required ({by}): {why}"
                )))
            }
            Err(why) => {
                if !self.said_engine.swap(true, Ordering::AcqRel) {
                    self.log.info(&format!(
                        "ONNX models run on tract: {why} (set {} or infer_server_options_set_onnxruntime_library)",
                        onnx::onnxruntime::LIBRARY_ENV
                    ));
                }
                Ok(onnx::Engine::Tract)
            }
        }
    }

    fn with_model<T>(&self, name: &str, f: impl FnOnce(&ModelEntry) -> Result<T>) -> Result<T> {
        let models = self.models.read();
        let e = models
            .get(name)
            .ok_or_else(|| Error::not_found(format!("model '{name}' is not loaded")))?;
        f(e)
    }

    /// The scheduler serving `version` (-1 = latest) of a model.
    pub fn resolve(&self, name: &str, version: i64) -> Result<Arc<Scheduler>> {
        self.with_model(name, |e| Ok(e.version(name, version)?.clone()))
    }

    /// What this server may use of the GPUs.
    pub fn gpu(&self) -> &GpuState {
        &self.gpu
    }

    pub fn is_accepting(&self) -> bool {
        self.accepting.load(Ordering::Acquire)
    }

    pub fn model_config(&self, name: &str) -> Option<Arc<ModelConfig>> {
        self.models.read().get(name).map(|e| e.config.clone())
    }

    /// Whether `version` (-1: the latest) of the model is loaded and serving; a version
    /// no request could name is INVALID_ARGUMENT, as it is for a request.
    pub fn model_ready(&self, name: &str, version: i64) -> Result<bool> {
        crate::request::checks::check_version(name, version)?;
        Ok(self
            .models
            .read()
            .get(name)
            .is_some_and(|e| e.version(name, version).is_ok()))
    }

    /// This server's id (requests it makes carry it).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Whether a blocking call for `req` made on this thread would wait for this very
    /// thread: it is a worker of the model `req` names.
    pub fn would_wait_for_itself(&self, req: &Request) -> bool {
        self.resolve(&req.model, req.version)
            .is_ok_and(|s| s.runs_on_current_thread())
    }

    pub fn model_config_json(&self, name: &str, version: i64) -> Result<String> {
        self.with_model(name, |e| {
            e.version(name, version)?;
            Ok(e.config.json.clone())
        })
    }

    pub fn set_paused(&self, name: &str, paused: bool) -> Result<()> {
        self.with_model(name, |e| {
            for s in e.versions.values() {
                s.set_paused(paused);
            }
            Ok(())
        })
    }

    /// Routes a request to its model's scheduler. On error the request is dropped
    /// without calling its callback (the caller reports the error).
    pub fn enqueue(&self, mut req: Box<Request>) -> Result<u64> {
        if !self.accepting.load(Ordering::Acquire) {
            return Err(Error::unavailable("the server is shutting down"));
        }
        if req.origin != 0 && req.origin != self.id {
            return Err(Error::invalid(format!(
                "the request for model '{}' was made on another server: make requests with the server that runs them",
                req.model
            )));
        }
        if let Some(device) = req.output_device {
            // Outputs wanted on a GPU: host outputs will be copied there at delivery.
            let placer = self.output_placer(device).map_err(|e| {
                e.context(format!("outputs of model '{}' on GPU {device}", req.model))
            })?;
            if let Some(sink) = req.sink.as_mut() {
                sink.set_delivery_hook(placer);
            }
        }
        let id = self.next_request_id.fetch_add(1, Ordering::Relaxed);
        req.id = id;
        let mut last = None;
        for _ in 0..REPLACE_RETRIES {
            // The version resolved when the request was created saves a registry lookup;
            // if it has been replaced since, its enqueue refuses and the loop looks again.
            let resolved = match req.target.take().and_then(|t| t.downcast().ok()) {
                Some(t) => Ok(t),
                None => self.resolve(&req.model, req.version),
            };
            let result = resolved.and_then(|sched| {
                let key = prepare(&sched.config, &mut req)?;
                if !sched.takes_device_inputs {
                    crate::backend::gpu_instance::inputs_to_host(&mut req)?;
                }
                Ok((key, sched))
            });
            let (key, sched) = match result {
                Ok(v) => v,
                Err(e) => {
                    last = Some(e);
                    break;
                }
            };
            req.checked_against = Some(sched.config.clone());
            if let Some(sink) = req.sink.as_mut() {
                sink.set_fallback(id, sched.model.clone());
            }
            req.enqueued_at = Instant::now();
            if let (Some(cache), true) = (&self.cache, sched.config.response_cache) {
                match cache.serve(&sched, req) {
                    None => return Ok(id),
                    Some(r) => req = r,
                }
            }
            match sched.enqueue(req, key) {
                Ok(()) => return Ok(id),
                Err((r, e)) => {
                    req = r;
                    if e.code != Code::Unavailable {
                        last = Some(e);
                        break;
                    }
                    // The version was replaced between lookup and enqueue: look again.
                    last = Some(e);
                    std::thread::yield_now();
                }
            }
        }
        // Not accepted: the callback must never run.
        if let Some(s) = req.sink.as_mut() {
            s.disarm();
        }
        Err(last.unwrap_or_else(|| {
            Error::unavailable(format!(
                "model '{}' is being replaced; try again",
                req.model
            ))
        }))
    }

    /// This server's [`crate::server::outputs::OutputPlacer`] for GPU `device`, checked
    /// against what the server may use (UNAVAILABLE without a usable GPU,
    /// INVALID_ARGUMENT for a device that does not exist).
    fn output_placer(&self, device: i32) -> Result<Arc<crate::server::outputs::OutputPlacer>> {
        self.gpu.check_device(device as i64)?;
        let i = device as usize;
        let mut all = self.output_placers.lock();
        if all.len() <= i {
            all.resize(i + 1, None);
        }
        if let Some(p) = &all[i] {
            return Ok(p.clone());
        }
        let p = crate::server::outputs::OutputPlacer::new(device)?;
        all[i] = Some(p.clone());
        Ok(p)
    }

    fn all_schedulers(&self) -> Vec<Arc<Scheduler>> {
        let mut v: Vec<Arc<Scheduler>> = self
            .models
            .read()
            .values()
            .flat_map(|e| e.versions.values().cloned())
            .collect();
        v.extend(self.retired.lock().iter().cloned());
        v
    }

    pub fn cancel(&self, request_id: u64) -> Result<()> {
        for s in self.all_schedulers() {
            match s.cancel(request_id) {
                CancelOutcome::NotFound => continue,
                CancelOutcome::Cancelled | CancelOutcome::Running => return Ok(()),
            }
        }
        Err(Error::not_found(format!(
            "request {request_id} is not queued or running (finished, or never enqueued)"
        )))
    }

    pub fn statistics_json(&self, name: Option<&str>) -> Result<String> {
        let models = self.models.read();
        let mut names: Vec<&String> = models
            .keys()
            .filter(|n| name.is_none_or(|m| m == n.as_str()))
            .collect();
        if let (Some(n), true) = (name, names.is_empty()) {
            return Err(Error::not_found(format!("model '{n}' is not loaded")));
        }
        names.sort();
        let mut parts = Vec::new();
        for n in names {
            for (v, s) in &models[n].versions {
                parts.push(s.stats_json(n, *v));
            }
        }
        Ok(format!("{{\"models\":[{}]}}", parts.join(",")))
    }

    pub fn metrics_prometheus(&self) -> String {
        let models = self.models.read();
        let mut names: Vec<&String> = models.keys().collect();
        names.sort();
        let mut p = PromText::default();
        for n in names {
            for (v, s) in &models[n].versions {
                s.stats_prometheus(&mut p, n, *v);
            }
        }
        if let Some(c) = &self.cache {
            let (entries, bytes, budget) = c.usage();
            for (name, help, value) in [
                (
                    "infer_cache_entries",
                    "Responses in the response cache",
                    entries as u64,
                ),
                (
                    "infer_cache_bytes",
                    "Bytes the response cache holds",
                    bytes as u64,
                ),
                (
                    "infer_cache_budget_bytes",
                    "The response cache's size",
                    budget as u64,
                ),
            ] {
                p.sample(name, "gauge", help, "", value);
            }
            p.sample(
                "infer_cache_evictions_total",
                "counter",
                "Responses evicted from the response cache to make room",
                "",
                c.evictions.load(Ordering::Relaxed),
            );
        }
        p.render()
    }

    /// Stops accepting work, lets queued and running requests finish for up to `timeout`,
    /// cancels what is left, and waits for every worker to stop. Idempotent.
    pub fn shutdown(&self, timeout: Duration) {
        self.accepting.store(false, Ordering::Release);
        // Take every version out of the registry under the lock (a racing load sees
        // `accepting` false there), then drain without it.
        let scheds: Vec<Arc<Scheduler>> = {
            let _guard = self.lifecycle.lock();
            let entries: Vec<ModelEntry> = self.models.write().drain().map(|(_, e)| e).collect();
            let mut retired = self.retired.lock();
            retired.extend(entries.into_iter().flat_map(|e| e.versions.into_values()));
            retired.clone()
        };
        for s in &scheds {
            s.set_paused(false);
            s.close();
        }
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline && !scheds.iter().all(|s| s.is_idle()) {
            std::thread::sleep(Duration::from_millis(1));
        }
        for s in &scheds {
            s.cancel_all("the server shut down before the request ran");
        }
        self.end_versions(&scheds, "the server shut down before the request finished");
        // Hits already answered are delivered before shutdown returns.
        if let Some(c) = &self.cache {
            c.drain(END_GRACE);
        }
        self.retired
            .lock()
            .retain(|r| !scheds.iter().any(|v| Arc::ptr_eq(r, v)));
    }

    /// Waits briefly for closed versions' workers to deliver what they hold and exit.
    /// Workers stuck in a backend are given up on: every request still held is answered
    /// CANCELLED (`why`), and the stuck threads are left detached (what they use stays
    /// alive; a late answer of theirs is dropped).
    pub(crate) fn end_versions(&self, versions: &[Arc<Scheduler>], why: &str) {
        let grace = Instant::now() + END_GRACE;
        while Instant::now() < grace && !versions.iter().all(|s| s.is_idle()) {
            std::thread::sleep(Duration::from_millis(1));
        }
        for s in versions {
            if !s.is_idle() {
                let n = s.abandon(why);
                if n > 0 {
                    self.log.warn(&format!(
                        "model '{}' version {}: {n} request(s) answered CANCELLED without waiting for the backend any longer",
                        s.model.name_str(),
                        s.model.version
                    ));
                }
            }
            let left = s.join_until(Instant::now() + END_GRACE);
            if left > 0 {
                self.log.warn(&format!(
                    "model '{}' version {}: {left} worker thread(s) stuck in the backend were left running, detached",
                    s.model.name_str(),
                    s.model.version
                ));
            }
        }
    }
}

/// The name a config selects its backend by: `backend`, else `platform`.
fn backend_key<'a>(backend: &'a str, platform: &'a str) -> &'a str {
    if backend.is_empty() {
        platform
    } else {
        backend
    }
}

/// Ensembles send their steps' requests through the server, as a caller would.
impl crate::scheduler::Router for Server {
    fn enqueue(&self, req: Box<Request>) -> Result<u64> {
        Server::enqueue(self, req)
    }

    fn cancel(&self, request_id: u64) {
        // A step request that already finished has nothing left to cancel.
        let _ = Server::cancel(self, request_id);
    }

    fn scheduler(&self, model: &str, version: i64) -> Option<Arc<Scheduler>> {
        self.resolve(model, version).ok()
    }
}
