//! The server: backends, the model registry (name -> versions -> scheduler), model
//! lifecycle (load, replace, unload, shutdown with drain) and request routing.
//!
//! Lifecycle changes never fail or lose an accepted request: a replaced or unloaded
//! version stops accepting work, finishes what it has queued and only then goes away.

pub mod outputs;

use crate::backend::{builtin, Backend, InstancePlace};
use crate::config::{parse_raw, InstanceKind, ModelConfig, VersionPolicy};
pub use crate::cuda::GpuMode;
use crate::cuda::GpuState;
use crate::log::Logger;
use crate::onnx;
use crate::request::checks::prepare;
use crate::request::{ModelIdentity, Request};
use crate::scheduler::sequence::{initial_states, StateValue};
use crate::scheduler::{inflight, CancelOutcome, Scheduler};
use crate::stats::PromText;
use crate::status::{Code, Error, Result};
use parking_lot::{Mutex, RwLock};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone)]
pub struct ServerOptions {
    pub repository: Option<PathBuf>,
    pub explicit_model_control: bool,
    pub gpu: GpuMode,
    pub log: Logger,
    pub backends: Vec<(String, Arc<dyn Backend>)>,
    /// With explicit model control: the repository's models loaded at start-up.
    pub startup_models: Vec<String>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            repository: None,
            explicit_model_control: false,
            gpu: GpuMode::Auto,
            log: Logger::default(),
            backends: Vec::new(),
            startup_models: Vec::new(),
        }
    }
}

/// A loaded model: its config and its ready versions.
struct ModelEntry {
    config: Arc<ModelConfig>,
    versions: BTreeMap<i64, Arc<Scheduler>>,
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
    next_request_id: AtomicU64,
    accepting: AtomicBool,
    /// Iteration-statistics callbacks by model name (kept across reloads).
    stats_callbacks: Mutex<HashMap<String, Arc<inflight::StatsCallback>>>,
    /// By device id: what copies host outputs to the GPU a request asked for (made on
    /// the first such request).
    output_placers: Mutex<Vec<Option<Arc<crate::server::outputs::OutputPlacer>>>>,
}

/// Servers alive in this process; the object pools are emptied when it drops to zero.
static LIVE_SERVERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Drop for Server {
    fn drop(&mut self) {
        if LIVE_SERVERS.fetch_sub(1, Ordering::AcqRel) == 1 {
            crate::request::pool::drain();
        }
    }
}

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
        LIVE_SERVERS.fetch_add(1, Ordering::AcqRel);
        let server = Arc::new_cyclic(|me| Server {
            me: me.clone(),
            log,
            gpu,
            backends: RwLock::new(backends),
            models: RwLock::new(HashMap::new()),
            retired: Mutex::new(Vec::new()),
            lifecycle: Mutex::new(()),
            next_request_id: AtomicU64::new(1),
            accepting: AtomicBool::new(true),
            stats_callbacks: Mutex::new(HashMap::new()),
            output_placers: Mutex::new(Vec::new()),
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
                    if is_model_dir(&p) {
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
            return Ok(Arc::new(onnx::OnnxBackend));
        }
        Err(Error::unsupported(format!(
            "model '{}': no backend '{key}' (built in: onnxruntime_onnx / onnxruntime, gpt2, identity, add_sub, accumulator; register custom backends before loading)",
            config.name
        )))
    }

    fn model_dir(&self, name: &str, model_dir: Option<&Path>) -> Option<PathBuf> {
        match model_dir {
            Some(d) => Some(d.to_path_buf()),
            None => self.opts.repository.as_ref().map(|r| r.join(name)),
        }
    }

    /// Loads (or replaces) a model. `config_text` None reads the model's directory.
    pub fn load_model(
        &self,
        name: &str,
        config_text: Option<&str>,
        model_dir: Option<&Path>,
    ) -> Result<()> {
        if name.is_empty() {
            return Err(Error::invalid("model name must not be empty"));
        }
        if !self.accepting.load(Ordering::Acquire) {
            return Err(Error::unavailable("the server is shutting down"));
        }
        let dir = self.model_dir(name, model_dir);
        let text = match config_text {
            Some(t) => t.to_owned(),
            None => {
                let dir = dir.as_ref().ok_or_else(|| {
                    Error::invalid(format!(
                        "model '{name}': no config given and the server has no model repository"
                    ))
                })?;
                read_config(dir).map_err(|e| e.context(format!("model '{name}'")))?
            }
        };
        let mut raw = parse_raw(&text, Some(name))?;
        let key = backend_key(&raw.pb.backend, &raw.pb.platform).to_owned();
        // Built-in ONNX models complete their config from the model file, as Triton does;
        // a custom backend registered under the same name keeps the config as written.
        if onnx::is_onnx(&key) && !self.backends.read().contains_key(&key) {
            onnx::autocomplete(&mut raw, dir.as_deref())?;
        }
        let generative = inflight::is_generative(&key) && !self.backends.read().contains_key(&key);
        if generative {
            inflight::autocomplete(&mut raw);
        }
        let config = Arc::new(raw.finish()?);
        if config.ensemble.is_some() {
            return self.load_ensemble(name, config, dir.as_deref());
        }
        if generative {
            return self.load_generative(name, config, dir.as_deref());
        }
        let backend = self.backend_for(&config)?;
        let versions = select_versions(&config, dir.as_deref().filter(|d| d.is_dir()))?;
        let initial_states = initial_states(&config, dir.as_deref())?;
        // Instances are created (backend code runs) without any library lock held.
        let mut started: BTreeMap<i64, Arc<Scheduler>> = BTreeMap::new();
        for v in versions {
            match self.start_version(&config, &backend, v, dir.as_deref(), &initial_states) {
                Ok(s) => {
                    started.insert(v, s);
                }
                Err(e) => {
                    stop_versions(started.values());
                    return Err(e);
                }
            }
        }
        self.register(name, config, started)
    }

    /// The config of a loaded model version (-1: the latest).
    fn loaded_config(&self, name: &str, version: i64) -> Option<Arc<ModelConfig>> {
        let models = self.models.read();
        let e = models.get(name)?;
        let ok = version == -1 || e.versions.contains_key(&version);
        ok.then(|| e.config.clone())
    }

    fn load_ensemble(
        &self,
        name: &str,
        config: Arc<ModelConfig>,
        dir: Option<&Path>,
    ) -> Result<()> {
        crate::scheduler::ensemble::check_composition(&config, &|n, v| self.loaded_config(n, v))?;
        let versions = select_versions(&config, dir.filter(|d| d.is_dir()))?;
        let started: BTreeMap<i64, Arc<Scheduler>> = versions
            .into_iter()
            .map(|v| {
                let s = Scheduler::start_ensemble(
                    ModelIdentity::new(&config.name, v),
                    config.clone(),
                    self.me.clone() as std::sync::Weak<dyn crate::scheduler::Router>,
                    self.log.clone(),
                );
                (v, s)
            })
            .collect();
        self.register(name, config, started)
    }

    fn load_generative(
        &self,
        name: &str,
        config: Arc<ModelConfig>,
        dir: Option<&Path>,
    ) -> Result<()> {
        inflight::settings::check_config(&config)?;
        let dir = dir.filter(|d| d.is_dir()).ok_or_else(|| {
            Error::invalid(format!(
                "model '{name}': a generative model reads its weights from <model folder>/<version>/ (config.json and model.safetensors), and it has no model folder"
            ))
        })?;
        let versions = select_versions(&config, Some(dir))?;
        let callback = self.stats_callbacks.lock().get(name).cloned();
        let mut started: BTreeMap<i64, Arc<Scheduler>> = BTreeMap::new();
        for v in versions {
            match inflight::gpt2::start_version(&config, v, dir, &self.log) {
                Ok(s) => {
                    if let Some(g) = s.generative() {
                        g.set_stats_callback(callback.clone());
                    }
                    started.insert(v, s);
                }
                Err(e) => {
                    stop_versions(started.values());
                    return Err(e);
                }
            }
        }
        self.register(name, config, started)
    }

    /// Sets (None: clears) the per-iteration statistics callback of a generative model,
    /// for the versions loaded now and those a reload brings.
    pub fn set_iteration_stats_callback(
        &self,
        name: &str,
        cb: Option<Arc<inflight::StatsCallback>>,
    ) -> Result<()> {
        let versions: Vec<Arc<Scheduler>> =
            self.with_model(name, |e| Ok(e.versions.values().cloned().collect()))?;
        if versions.iter().any(|s| s.generative().is_none()) {
            return Err(Error::invalid(format!(
                "model '{name}' is not a generative model: it has no iterations to report"
            )));
        }
        {
            let mut map = self.stats_callbacks.lock();
            match &cb {
                Some(cb) => map.insert(name.to_owned(), cb.clone()),
                None => map.remove(name),
            };
        }
        for s in versions {
            if let Some(g) = s.generative() {
                g.set_stats_callback(cb.clone());
            }
        }
        Ok(())
    }

    /// Puts started versions into the registry, retiring what they replace.
    fn register(
        &self,
        name: &str,
        config: Arc<ModelConfig>,
        started: BTreeMap<i64, Arc<Scheduler>>,
    ) -> Result<()> {
        let old = {
            let _guard = self.lifecycle.lock();
            if !self.accepting.load(Ordering::Acquire) {
                drop(_guard);
                stop_versions(started.values());
                return Err(Error::unavailable("the server is shutting down"));
            }
            let entry = ModelEntry {
                config,
                versions: started,
            };
            let old = self.models.write().insert(name.to_owned(), entry);
            if let Some(old) = &old {
                self.retired.lock().extend(old.versions.values().cloned());
            }
            old
        };
        self.log.info(&format!("model '{name}' loaded"));
        if let Some(old) = old {
            self.retire(old.versions.into_values().collect());
        }
        Ok(())
    }

    /// Whether a KIND_GPU group can start: a GPU this server may use, device ids that
    /// exist, and a backend that runs on a GPU.
    fn check_gpu_group(
        &self,
        config: &ModelConfig,
        backend: &Arc<dyn Backend>,
        g: &crate::config::InstanceGroup,
    ) -> Result<()> {
        let at = format!(
            "model '{}': instance_group '{}' asks for KIND_GPU",
            config.name, g.name
        );
        let Some(runtime) = self.gpu.runtime() else {
            return Err(Error::unavailable(format!(
                "{at}, but {}",
                self.gpu.why_not()
            )));
        };
        let count = runtime.devices.len();
        if let Some(&bad) = g.gpus.iter().find(|&&id| id < 0 || id as usize >= count) {
            return Err(Error::invalid(format!(
                "{at} on GPU {bad}, which does not exist (this machine has {count}: ids 0 to {})",
                count - 1
            )));
        }
        if !backend.runs_on_gpu() {
            return Err(Error::unsupported(format!(
                "{at}, but backend '{}' cannot run on a GPU (use KIND_CPU or KIND_AUTO)",
                config.backend
            )));
        }
        Ok(())
    }

    /// Creates one instance on GPU `device`: the backend's `instance_init` runs with the
    /// device's primary context current (the caller's own context is given back after),
    /// and the instance gets its stream and memory pool.
    fn gpu_instance(
        &self,
        config: &Arc<ModelConfig>,
        backend: &Arc<dyn Backend>,
        at: &InstancePlace<'_>,
    ) -> Result<Box<dyn crate::backend::ModelInstance>> {
        let ctx = crate::cuda::context(at.gpu).map_err(|e| {
            e.context(format!(
                "model '{}': instance {} on GPU {}",
                config.name, at.index, at.gpu
            ))
        })?;
        let _bound = crate::cuda::ScopedBind::new(&ctx)?;
        let inner = backend.clone().create_version_instance(config, at)?;
        let instance = crate::backend::gpu_instance::GpuInstance::new(inner, ctx).map_err(|e| {
            e.context(format!(
                "model '{}': instance {} on GPU {}",
                config.name, at.index, at.gpu
            ))
        })?;
        Ok(Box::new(instance))
    }

    fn start_version(
        &self,
        config: &Arc<ModelConfig>,
        backend: &Arc<dyn Backend>,
        version: i64,
        model_dir: Option<&Path>,
        initial_states: &[StateValue],
    ) -> Result<Arc<Scheduler>> {
        let mut instances = Vec::new();
        // The CPU cores each instance's worker thread is pinned to (empty: not pinned).
        let mut cpus: Vec<Vec<u32>> = Vec::new();
        let mut index = 0u32;
        for g in &config.instance_groups {
            if g.kind == InstanceKind::Gpu {
                self.check_gpu_group(config, backend, g)?;
                // `count` instances on each listed GPU (every GPU when none is listed).
                let gpus: Vec<i32> = if g.gpus.is_empty() {
                    let n = self.gpu.runtime().map_or(0, |r| r.devices.len());
                    (0..n as i32).collect()
                } else {
                    g.gpus.clone()
                };
                for gpu in gpus {
                    for _ in 0..g.count.max(1) {
                        let at = InstancePlace {
                            index,
                            gpu,
                            version,
                            model_dir,
                        };
                        instances.push(self.gpu_instance(config, backend, &at)?);
                        cpus.push(g.cpus.clone());
                        index += 1;
                    }
                }
                continue;
            }
            if g.kind == InstanceKind::Auto && backend.auto_prefers_gpu() {
                if let Some(n) = self.gpu.runtime().map(|r| r.devices.len()) {
                    let gpus: Vec<i32> = if g.gpus.is_empty() {
                        (0..n as i32).collect()
                    } else {
                        g.gpus.clone()
                    };
                    let mut first = true;
                    let mut placed = Vec::new();
                    'devices: for gpu in gpus {
                        for _ in 0..g.count.max(1) {
                            let at = InstancePlace {
                                index: index + placed.len() as u32,
                                gpu,
                                version,
                                model_dir,
                            };
                            match self.gpu_instance(config, backend, &at) {
                                Ok(i) => placed.push(i),
                                Err(e)
                                    if first
                                        && matches!(
                                            e.code,
                                            Code::Unsupported | Code::Unavailable
                                        ) =>
                                {
                                    self.log.info(&format!(
                                        "model '{}': instance_group '{}' (KIND_AUTO) runs on the CPU: {}",
                                        config.name, g.name, e.message
                                    ));
                                    break 'devices;
                                }
                                Err(e) => return Err(e),
                            }
                            first = false;
                        }
                    }
                    if !placed.is_empty() {
                        for i in placed {
                            instances.push(i);
                            cpus.push(g.cpus.clone());
                            index += 1;
                        }
                        continue;
                    }
                }
            }
            for _ in 0..g.count.max(1) {
                let at = InstancePlace {
                    index,
                    gpu: -1,
                    version,
                    model_dir,
                };
                instances.push(backend.clone().create_version_instance(config, &at)?);
                cpus.push(g.cpus.clone());
                index += 1;
            }
        }
        if instances.is_empty() {
            let at = InstancePlace {
                index: 0,
                gpu: -1,
                version,
                model_dir,
            };
            instances.push(backend.clone().create_version_instance(config, &at)?);
        }
        Scheduler::start(
            ModelIdentity::new(&config.name, version),
            config.clone(),
            instances,
            self.log.clone(),
            initial_states.to_vec(),
            cpus,
        )
    }

    /// Closes versions that no longer take requests (already moved from the registry to
    /// `retired`) and waits for them to drain. Runs without the lifecycle lock, so
    /// callbacks of the draining versions may load and unload models.
    fn retire(&self, versions: Vec<Arc<Scheduler>>) {
        for s in &versions {
            s.set_paused(false);
            s.close();
        }
        for s in &versions {
            s.join();
        }
        self.retired
            .lock()
            .retain(|r| !versions.iter().any(|v| Arc::ptr_eq(r, v)) || !r.is_idle());
    }

    pub fn unload_model(&self, name: &str) -> Result<()> {
        let entry = {
            let _guard = self.lifecycle.lock();
            let entry = self
                .models
                .write()
                .remove(name)
                .ok_or_else(|| Error::not_found(format!("model '{name}' is not loaded")))?;
            self.retired.lock().extend(entry.versions.values().cloned());
            entry
        };
        self.retire(entry.versions.into_values().collect());
        self.log.info(&format!("model '{name}' unloaded"));
        Ok(())
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

    pub fn model_ready(&self, name: &str, version: i64) -> bool {
        self.models
            .read()
            .get(name)
            .is_some_and(|e| e.version(name, version).is_ok())
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
        for s in &scheds {
            s.join();
        }
        self.retired
            .lock()
            .retain(|r| !scheds.iter().any(|v| Arc::ptr_eq(r, v)));
    }
}

/// Stops versions that never served (a failed or refused load).
fn stop_versions<'a>(versions: impl Iterator<Item = &'a Arc<Scheduler>>) {
    for s in versions {
        s.close();
        s.join();
    }
}

fn read_config(dir: &Path) -> Result<String> {
    for f in ["config.pbtxt", "config.json"] {
        let p = dir.join(f);
        if p.is_file() {
            return std::fs::read_to_string(&p)
                .map_err(|e| Error::invalid(format!("cannot read '{}': {e}", p.display())));
        }
    }
    // An ONNX model needs no config: everything is read from the model file.
    if has_onnx_version(dir) {
        return Ok("platform: \"onnxruntime_onnx\"\n".to_owned());
    }
    Err(Error::not_found(format!(
        "no config.pbtxt in '{}' (nor a version folder with model.onnx)",
        dir.display()
    )))
}

/// Whether a model folder has a numbered version folder holding `model.onnx`.
fn has_onnx_version(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|rd| {
        rd.flatten().any(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.parse::<i64>().is_ok_and(|v| v > 0))
                && e.path().join("model.onnx").is_file()
        })
    })
}

/// Whether a repository entry is a model folder.
fn is_model_dir(p: &Path) -> bool {
    p.join("config.pbtxt").is_file() || p.join("config.json").is_file() || has_onnx_version(p)
}

/// The name a config selects its backend by: `backend`, else `platform`.
fn backend_key<'a>(backend: &'a str, platform: &'a str) -> &'a str {
    if backend.is_empty() {
        platform
    } else {
        backend
    }
}

/// The versions to serve: numbered folders chosen by the version policy, or version 1
/// when the model has no numbered folders (built-in and custom backends need none).
fn select_versions(config: &ModelConfig, dir: Option<&Path>) -> Result<Vec<i64>> {
    let mut found: Vec<i64> = Vec::new();
    if let Some(dir) = dir {
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                if e.path().is_dir() {
                    if let Some(v) = e.file_name().to_str().and_then(|s| s.parse::<i64>().ok()) {
                        if v > 0 {
                            found.push(v);
                        }
                    }
                }
            }
        }
    }
    found.sort_unstable();
    if found.is_empty() {
        return Ok(vec![1]);
    }
    let chosen: Vec<i64> = match &config.version_policy {
        VersionPolicy::All => found.clone(),
        VersionPolicy::Latest(n) => found
            .iter()
            .rev()
            .take((*n).max(1) as usize)
            .rev()
            .copied()
            .collect(),
        VersionPolicy::Specific(vs) => {
            for v in vs {
                if !found.contains(v) {
                    return Err(Error::not_found(format!(
                        "model '{}': version_policy names version {v}, but there is no folder {v}",
                        config.name
                    )));
                }
            }
            vs.clone()
        }
    };
    Ok(chosen)
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
}
