//! The model lifecycle: load (reading the model folder and its config, choosing the
//! versions, starting one scheduler per version), replace and unload. A replaced or
//! unloaded version stops accepting work, finishes what it has queued and only then goes
//! away.

use super::{backend_key, ModelEntry, Server};
use crate::backend::{Backend, InstancePlace};
use crate::config::{parse_raw, InstanceKind, ModelConfig, VersionPolicy};
use crate::folder::{check_folder_name, check_model_name, Folder};
use crate::onnx;
use crate::request::ModelIdentity;
use crate::scheduler::sequence::{initial_states, StateValue};
use crate::scheduler::{inflight, Scheduler};
use crate::status::{Code, Error, Result};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// How long an unload waits for a version that answers nothing before it gives up on
/// its backend.
const UNLOAD_STALL: std::time::Duration = std::time::Duration::from_secs(30);

impl Server {
    /// The model's folder: the one the application names (the root its files are
    /// confined to), else `<repository>/<name>` (confined to the repository). None when
    /// there is none.
    fn model_folder(&self, name: &str, model_dir: Option<&Path>) -> Result<Option<Folder>> {
        let what = format!("model '{name}'");
        let trusted = self.opts.trusted_repository;
        match (model_dir, &self.opts.repository) {
            (Some(d), _) => match Folder::root(d, trusted, &what) {
                Ok(f) => Ok(Some(f)),
                Err(e) if e.code == Code::NotFound => Ok(None),
                Err(e) => Err(e),
            },
            (None, Some(repo)) => {
                check_folder_name(name, &what)?;
                Folder::root(repo, trusted, "model repository")?.folder_if_any(name, &what)
            }
            (None, None) => Ok(None),
        }
    }

    /// Loads (or replaces) a model. `config_text` None reads the model's directory. The
    /// application's own load: a model an ensemble had loaded becomes the application's
    /// (it stays when the ensemble goes).
    pub fn load_model(
        &self,
        name: &str,
        config_text: Option<&str>,
        model_dir: Option<&Path>,
    ) -> Result<()> {
        self.load_tracked(name, config_text, model_dir, None)?;
        self.adopt(name);
        Ok(())
    }

    /// Whether a model of this name is loaded.
    pub(super) fn is_loaded(&self, name: &str) -> bool {
        self.models.read().contains_key(name)
    }

    /// The application owns `name` now: no ensemble unloads it.
    pub(super) fn adopt(&self, name: &str) {
        for e in self.models.write().values_mut() {
            e.loaded_with.retain(|m| m != name);
        }
    }

    /// The load itself (`load_tracked` records what it did).
    pub(super) fn load_model_inner(
        &self,
        name: &str,
        config_text: Option<&str>,
        model_dir: Option<&Path>,
    ) -> Result<()> {
        check_model_name(name)?;
        if !self.accepting.load(Ordering::Acquire) {
            return Err(Error::unavailable("the server is shutting down"));
        }
        let dir = self.model_folder(name, model_dir)?;
        let text = match config_text {
            Some(t) => t.to_owned(),
            None => {
                let dir = dir
                    .as_ref()
                    .ok_or_else(|| match (model_dir, &self.opts.repository) {
                        (None, None) => Error::invalid(format!(
                        "model '{name}': no config given and the server has no model repository"
                    )),
                        _ => Error::not_found(format!("model '{name}': no model folder")),
                    })?;
                read_config(dir).map_err(|e| e.context(format!("model '{name}'")))?
            }
        };
        let mut raw = parse_raw(&text, Some(name))?;
        let key = backend_key(&raw.pb.backend, &raw.pb.platform).to_owned();
        // Built-in ONNX models complete their config from the model file, as Triton does;
        // a custom backend registered under the same name keeps the config as written.
        if onnx::is_onnx(&key) && !self.backends.read().contains_key(&key) {
            let params: std::collections::BTreeMap<String, String> = (raw.pb.parameters.iter())
                .map(|(k, v)| (k.clone(), v.string_value.clone()))
                .collect();
            let engine = self.onnx_engine(name, &key, &params)?;
            onnx::autocomplete(&mut raw, dir.as_ref(), engine)?;
        }
        let generative = inflight::is_generative(&key) && !self.backends.read().contains_key(&key);
        if generative {
            // Text tensors when every version folder has a tokenizer.
            let text = dir.as_ref().is_some_and(|d| {
                let versions: Vec<Folder> = (d.entries().into_iter())
                    .filter(|n| n.parse::<i64>().is_ok_and(|v| v > 0))
                    .filter_map(|n| d.folder_if_any(&n, "version").ok().flatten())
                    .collect();
                !versions.is_empty() && versions.iter().all(crate::llm::TextCodec::available)
            });
            inflight::autocomplete(&mut raw, text);
        }
        let config = Arc::new(raw.finish()?);
        if config.decoupled && !generative {
            check_decoupled(&config, &key, self.backends.read().contains_key(&key))?;
        }
        for g in config
            .instance_groups
            .iter()
            .filter(|g| g.rate_limiter.is_some())
        {
            if self.rate.is_none() {
                self.log.info(&format!(
                    "model '{name}': instance_group '{}': rate_limiter has no effect: the server's rate limiter is off (infer_server_options_set_rate_limit), as in Triton without --rate-limit",
                    g.name
                ));
            } else if generative {
                return Err(Error::unsupported(format!(
                    "model '{name}': instance_group '{}': rate_limiter: a generative model's generation loop is not rate limited; remove it from the config",
                    g.name
                )));
            }
        }
        if config.response_cache {
            let at = format!("model '{name}': response_cache.enable");
            if self.cache.is_none() {
                return Err(Error::invalid(format!(
                    "{at}: the server has no response cache (give it a size with infer_server_options_set_response_cache_bytes)"
                )));
            }
            if config.sequence_batching.is_some() {
                return Err(Error::unsupported(format!(
                    "{at}: a sequence model's responses depend on its state, not only its inputs"
                )));
            }
            if generative || config.decoupled {
                return Err(Error::unsupported(format!(
                    "{at}: a streaming model's responses are not cached"
                )));
            }
        }
        if !config.warmup.is_empty() && (config.ensemble.is_some() || generative) {
            return Err(Error::unsupported(format!(
                "model '{name}': model_warmup is not supported for {}; remove it from the config",
                if generative {
                    "a generative model"
                } else {
                    "an ensemble"
                }
            )));
        }
        if config.ensemble.is_some() {
            return self.load_ensemble(name, config, dir.as_ref());
        }
        if generative {
            return self.load_generative(name, config, dir.as_ref());
        }
        let backend = self.backend_for(&config)?;
        let versions = select_versions(&config, dir.as_ref())?;
        let initial_states = initial_states(&config, dir.as_ref())?;
        // Instances are created (backend code runs) without any library lock held.
        let mut started: BTreeMap<i64, Arc<Scheduler>> = BTreeMap::new();
        for v in versions {
            match self.start_version(&config, &backend, v, dir.as_ref(), &initial_states) {
                Ok(s) => {
                    started.insert(v, s);
                }
                Err(e) => {
                    stop_versions(started.values());
                    return Err(e);
                }
            }
        }
        self.register(name, config, started, Vec::new())
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
        dir: Option<&Folder>,
    ) -> Result<()> {
        let loaded_here = self.load_composing(name, &config)?;
        let checked = crate::scheduler::ensemble::check_composition(&config, &|n, v| {
            self.loaded_config(n, v)
        })
        .and_then(|()| select_versions(&config, dir));
        let versions = match checked {
            Ok(v) => v,
            Err(e) => {
                self.unload_loaded(name, &loaded_here);
                return Err(e);
            }
        };
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
        self.register(name, config, started, loaded_here)
    }

    /// With explicit model control, an ensemble's composing models that are not loaded
    /// are loaded from the repository first (nested ensembles in turn), as Triton's
    /// explicit mode does; returns their names. One that fails fails the ensemble's load
    /// (the ones loaded for it are unloaded again).
    fn load_composing(&self, name: &str, config: &ModelConfig) -> Result<Vec<String>> {
        thread_local! {
            /// The ensembles this thread is loading composing models for (a cycle through
            /// nested ensembles would load forever).
            static LOADING: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        let Some(ens) = &config.ensemble else {
            return Ok(Vec::new());
        };
        if !self.opts.explicit_model_control || self.opts.repository.is_none() {
            return Ok(Vec::new());
        }
        if LOADING.with(|l| l.borrow().iter().any(|n| n == name)) {
            return Err(Error::invalid(format!(
                "model '{name}': ensemble_scheduling: cycle: loading its composing models leads back to it"
            )));
        }
        LOADING.with(|l| l.borrow_mut().push(name.to_owned()));
        let mut loaded: Vec<String> = Vec::new();
        let mut result = Ok(());
        for s in &ens.steps {
            let m = &s.model_name;
            if loaded.contains(m) || self.is_loaded(m) {
                continue;
            }
            match self.model_folder(m, None) {
                Ok(Some(_)) => {}
                // Not in the repository: the composition check says it is not loaded.
                _ => continue,
            }
            match self.load_tracked(m, None, None, None) {
                Ok(()) => {
                    self.log.info(&format!(
                        "model '{m}' loaded from the repository for ensemble '{name}'"
                    ));
                    loaded.push(m.clone());
                }
                Err(e) => {
                    result = Err(e.context(format!(
                        "model '{name}': its composing model '{m}' could not be loaded from the repository"
                    )));
                    break;
                }
            }
        }
        LOADING.with(|l| l.borrow_mut().pop());
        match result {
            Ok(()) => Ok(loaded),
            Err(e) => {
                self.unload_loaded(name, &loaded);
                Err(e)
            }
        }
    }

    /// Unloads the composing models `ensemble` loaded (newest first), except those
    /// another loaded ensemble uses or the application has loaded itself since.
    fn unload_loaded(&self, ensemble: &str, loaded: &[String]) {
        for m in loaded.iter().rev() {
            let used = self.models.read().iter().any(|(n, e)| {
                n != ensemble
                    && (e.config.ensemble.as_ref())
                        .is_some_and(|x| x.steps.iter().any(|s| s.model_name == *m))
            });
            if used || !self.is_loaded(m) {
                continue;
            }
            match self.unload_model_by(m, false) {
                Ok(()) => self
                    .log
                    .info(&format!("model '{m}' unloaded with ensemble '{ensemble}'")),
                Err(e) => self.log.warn(&format!(
                    "model '{m}' (loaded for ensemble '{ensemble}'): {}",
                    e.message
                )),
            }
        }
    }

    fn load_generative(
        &self,
        name: &str,
        config: Arc<ModelConfig>,
        dir: Option<&Folder>,
    ) -> Result<()> {
        inflight::settings::check_config(&config)?;
        let dir = dir.ok_or_else(|| {
            Error::invalid(format!(
                "model '{name}': a generative model reads its weights from <model folder>/<version>/ (config.json and model.safetensors), and it has no model folder"
            ))
        })?;
        let versions = select_versions(&config, Some(dir))?;
        let callback = self.stats_callbacks.lock().get(name).cloned();
        let mut started: BTreeMap<i64, Arc<Scheduler>> = BTreeMap::new();
        for v in versions {
            match super::generative::start_version(&config, v, dir, &self.log) {
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
        self.register(name, config, started, Vec::new())
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
        mut loaded_with: Vec<String>,
    ) -> Result<()> {
        let old = {
            let _guard = self.lifecycle.lock();
            if !self.accepting.load(Ordering::Acquire) {
                drop(_guard);
                stop_versions(started.values());
                return Err(Error::unavailable("the server is shutting down"));
            }
            let mut models = self.models.write();
            // A replaced ensemble's composing models stay loaded, and are the new one's.
            if let Some(old) = models.get(name) {
                for m in &old.loaded_with {
                    if !loaded_with.contains(m) {
                        loaded_with.push(m.clone());
                    }
                }
            }
            if config.response_cache {
                for v in started.values() {
                    v.stats.cache_enabled.store(true, Ordering::Relaxed);
                }
            }
            let entry = ModelEntry {
                config,
                versions: started,
                loaded_with,
            };
            let old = models.insert(name.to_owned(), entry);
            drop(models);
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
        let made = self.gpu_instance_unlogged(config, backend, at)?;
        // Once per server, after the first GPU instance: which CUDA files serve it.
        if !self.said_cuda_libraries.swap(true, Ordering::AcqRel) {
            let libs = crate::cuda::loaded_libraries();
            if !libs.is_empty() {
                let chosen = crate::cuda::libs::describe();
                let chosen = if chosen.is_empty() {
                    String::new()
                } else {
                    format!(" ({chosen})")
                };
                self.log.info(&format!(
                    "CUDA libraries in use: {}{chosen}",
                    libs.join(", ")
                ));
            }
        }
        // Where the kernels of each new GPU architecture came from (compiled, how long,
        // the disk cache), once each.
        let notes = crate::cuda::kernel_cache::notes();
        let said = self.said_kernel_notes.swap(notes.len(), Ordering::AcqRel);
        for line in notes.iter().skip(said) {
            self.log.info(line);
        }
        Ok(made)
    }

    fn gpu_instance_unlogged(
        &self,
        config: &Arc<ModelConfig>,
        backend: &Arc<dyn Backend>,
        at: &InstancePlace<'_>,
    ) -> Result<Box<dyn crate::backend::ModelInstance>> {
        if backend.manages_device() {
            return backend.clone().create_version_instance(config, at);
        }
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
        model_dir: Option<&Folder>,
        initial_states: &[StateValue],
    ) -> Result<Arc<Scheduler>> {
        let mut instances = Vec::new();
        // The CPU cores each instance's worker thread is pinned to (empty: not pinned).
        let mut cpus: Vec<Vec<u32>> = Vec::new();
        // The group of each instance.
        let mut groups: Vec<usize> = Vec::new();
        let mut index = 0u32;
        for (gi, g) in config.instance_groups.iter().enumerate() {
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
                        groups.push(gi);
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
                            groups.push(gi);
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
                groups.push(gi);
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
        // Triton's model_warmup: every instance runs the samples before the version serves.
        super::warmup::run(config, &mut instances, model_dir)?;
        let slots = self.rate_slots(config, &instances, &groups)?;
        Scheduler::start(
            ModelIdentity::new(&config.name, version),
            config.clone(),
            instances,
            self.log.clone(),
            initial_states.to_vec(),
            crate::scheduler::Placement {
                cpus,
                rate_slots: slots,
            },
            self.timer.clone(),
        )
    }

    /// Each instance's place in the server's rate limiter (none when it is off).
    fn rate_slots(
        &self,
        config: &ModelConfig,
        instances: &[Box<dyn crate::backend::ModelInstance>],
        groups: &[usize],
    ) -> Result<Vec<Arc<crate::scheduler::rate::Slot>>> {
        let Some(limiter) = &self.rate else {
            return Ok(Vec::new());
        };
        let mut slots = Vec::with_capacity(instances.len());
        for (i, inst) in instances.iter().enumerate() {
            let g = groups.get(i).and_then(|&g| config.instance_groups.get(g));
            let rl = g.and_then(|g| g.rate_limiter.as_ref());
            let needs: Vec<crate::scheduler::rate::Need> = (rl.map(|r| r.resources.as_slice()))
                .unwrap_or_default()
                .iter()
                .map(|r| crate::scheduler::rate::Need {
                    name: Arc::from(r.name.as_str()),
                    global: r.global,
                    count: r.count,
                })
                .collect();
            let what = format!(
                "model '{}': instance_group '{}'",
                config.name,
                g.map_or("", |g| g.name.as_str())
            );
            let priority = rl.map_or(1, |r| r.priority);
            slots.push(limiter.register(&what, &needs, inst.device().unwrap_or(-1), priority)?);
        }
        Ok(slots)
    }

    /// Closes versions that no longer take requests (already moved from the registry to
    /// `retired`) and waits for them to drain. Runs without the lifecycle lock, so
    /// callbacks of the draining versions may load and unload models.
    fn retire(&self, versions: Vec<Arc<Scheduler>>) {
        for s in &versions {
            s.set_paused(false);
            s.close();
        }
        // On a library thread (a response callback, a backend) waiting could close a
        // cycle: two models whose callbacks unload each other. The versions drain on
        // their own threads then, and shutdown waits for them.
        if crate::scheduler::on_library_thread() {
            return;
        }
        // Wait while they make progress; a version that answers nothing for
        // UNLOAD_STALL has a stuck backend: what it holds is answered CANCELLED.
        let answered = || -> u64 { versions.iter().map(|s| s.progress()).sum() };
        let (mut last, mut since) = (answered(), std::time::Instant::now());
        while !versions.iter().all(|s| s.is_idle()) {
            std::thread::sleep(std::time::Duration::from_millis(1));
            let now = answered();
            if now != last {
                (last, since) = (now, std::time::Instant::now());
            } else if since.elapsed() > UNLOAD_STALL {
                for s in &versions {
                    s.cancel_all("the model was unloaded while its backend was stuck");
                }
                self.end_versions(
                    &versions,
                    "the model was unloaded while its backend was stuck",
                );
                break;
            }
        }
        for s in &versions {
            s.join();
        }
        self.retired
            .lock()
            .retain(|r| !versions.iter().any(|v| Arc::ptr_eq(r, v)) || !r.is_idle());
    }

    pub fn unload_model(&self, name: &str) -> Result<()> {
        self.unload_model_by(name, false)
    }

    /// An unload by the application or by a repository poll (`by_poll`: the model's
    /// folder left the repository).
    pub(super) fn unload_model_by(&self, name: &str, by_poll: bool) -> Result<()> {
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
        self.note_unloaded(name, by_poll);
        self.log.info(&format!("model '{name}' unloaded"));
        self.unload_loaded(name, &entry.loaded_with);
        Ok(())
    }
}

/// Stops versions that never served (a failed or refused load).
fn stop_versions<'a>(versions: impl Iterator<Item = &'a Arc<Scheduler>>) {
    for s in versions {
        s.close();
        s.join();
    }
}

fn read_config(dir: &Folder) -> Result<String> {
    for f in ["config.pbtxt", "config.json"] {
        if dir.entries().iter().any(|e| e == f) {
            let bytes = dir.read(f, "its config")?;
            return String::from_utf8(bytes)
                .map_err(|_| Error::invalid(format!("its config '{f}' is not UTF-8 text")));
        }
    }
    // An ONNX model needs no config: everything is read from the model file.
    if has_onnx_version(dir) {
        return Ok("platform: \"onnxruntime_onnx\"\n".to_owned());
    }
    Err(Error::not_found(format!(
        "no config.pbtxt in '{}' (nor a version folder with model.onnx)",
        dir.path().display()
    )))
}

/// The numbered version folders' names of a model folder.
fn version_names(dir: &Folder) -> impl Iterator<Item = (i64, String)> {
    dir.entries()
        .into_iter()
        .filter_map(|n| n.parse::<i64>().ok().filter(|&v| v > 0).map(|v| (v, n)))
}

/// Whether a model folder has a numbered version folder holding `model.onnx`.
fn has_onnx_version(dir: &Folder) -> bool {
    version_names(dir).any(|(_, n)| dir.has_file(&format!("{n}/model.onnx")))
}

/// Whether a repository entry looks like a model folder (one whose links lead out of the
/// repository counts: its load says why it is refused).
pub(super) fn is_model_dir(p: &Path) -> bool {
    match Folder::root(p, true, "") {
        Ok(f) => f.has_file("config.pbtxt") || f.has_file("config.json") || has_onnx_version(&f),
        Err(_) => false,
    }
}

/// The versions to serve: numbered folders chosen by the version policy, or version 1
/// when the model has no numbered folders (built-in and custom backends need none).
fn select_versions(config: &ModelConfig, dir: Option<&Folder>) -> Result<Vec<i64>> {
    let mut found: Vec<i64> = Vec::new();
    if let Some(dir) = dir {
        for (v, n) in version_names(dir) {
            if dir.path().join(&n).is_dir() {
                found.push(v);
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

/// A decoupled model (not generative): its custom backend sends each request's
/// responses when it chooses, so nothing may promise an order across requests.
fn check_decoupled(config: &ModelConfig, key: &str, custom: bool) -> Result<()> {
    let name = &config.name;
    if !custom {
        return Err(Error::unsupported(format!(
            "model '{name}': model_transaction_policy.decoupled is not supported for backend '{key}' (custom backends and the generative backends send responses apart from requests); remove it from the config"
        )));
    }
    let dynamic = (config.dynamic_batching.as_ref()).is_some_and(|d| d.preserve_ordering);
    let oldest = config.sequence_batching.as_ref().is_some_and(|q| {
        matches!(
            q.strategy,
            crate::config::SequenceStrategy::Oldest {
                preserve_ordering: true,
                ..
            }
        )
    });
    if dynamic || oldest {
        let field = if dynamic {
            "dynamic_batching.preserve_ordering"
        } else {
            "sequence_batching.oldest.preserve_ordering"
        };
        return Err(Error::unsupported(format!(
            "model '{name}': {field} with model_transaction_policy.decoupled: a decoupled backend sends each request's responses when it chooses; remove one of them"
        )));
    }
    Ok(())
}
