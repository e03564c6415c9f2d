//! The model repository beyond load and unload, as Triton's users know it: the index of
//! every model and version with its state and the reason of its last failure; polling
//! the repository (new folders load, changed ones reload, removed ones unload); models
//! whose files the application supplies in memory.
//!
//! The server tracks, next to its registry of ready versions, what the registry cannot
//! say: loads in progress, the last failure of each model, which models came from the
//! repository as they are on disk (with a fingerprint of their folder, which a poll
//! compares), and the temporary folders of models loaded from memory.

use super::{load, Server};
use crate::folder::check_relative;
use crate::status::{Code, Error, Result};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How deep a fingerprint looks into a model folder, and how many entries it reads at
/// most (a model folder is a config and version folders of a few files each).
const FINGERPRINT_DEPTH: usize = 8;
const FINGERPRINT_ENTRIES: usize = 100_000;
/// Configs are hashed by content too (a rewrite within the file system's time
/// resolution that keeps the size is still seen), up to this size.
const FINGERPRINT_CONTENT: u64 = 1 << 20;

/// What the server knows of its models besides the registry.
#[derive(Default)]
pub(super) struct Tracking {
    /// Loads in progress, by model name.
    loading: HashMap<String, usize>,
    /// The last failed load of each model (cleared by a load that succeeds).
    failed: HashMap<String, Failure>,
    /// Models loaded from the repository as it is on disk (no config or folder of the
    /// application's own), with their folder's fingerprint at that load.
    from_repository: HashMap<String, u64>,
    /// Models the application unloaded, with their folder's fingerprint then (None:
    /// no folder): a poll leaves them unloaded until their folder changes.
    unloaded: HashMap<String, Option<u64>>,
    /// The temporary folders of models loaded from files in memory, removed when the
    /// model is unloaded or replaced.
    owned: HashMap<String, OwnedDir>,
}

struct Failure {
    reason: String,
    /// The folder's fingerprint when a repository load failed: a poll tries again only
    /// after the folder changed.
    fingerprint: Option<u64>,
}

/// A folder this server made, removed with everything in it on drop.
pub(super) struct OwnedDir(PathBuf);

impl Drop for OwnedDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A model's place in the index.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum State {
    Ready,
    Loading,
    Unloading,
    Unavailable,
}

impl State {
    fn text(self) -> &'static str {
        match self {
            State::Ready => "READY",
            State::Loading => "LOADING",
            State::Unloading => "UNLOADING",
            State::Unavailable => "UNAVAILABLE",
        }
    }
}

impl Server {
    /// A load, tracked: the index shows it LOADING meanwhile, and its failure after.
    /// `owned` is the temporary folder a load from memory made (kept while the model is
    /// loaded); a load without one removes the folder of the model it replaces.
    pub(super) fn load_tracked(
        &self,
        name: &str,
        config_text: Option<&str>,
        model_dir: Option<&Path>,
        owned: Option<OwnedDir>,
    ) -> Result<()> {
        let from_repo = config_text.is_none() && model_dir.is_none();
        let fingerprint = if from_repo {
            self.repository_folder(name).map(|p| fingerprint(&p))
        } else {
            None
        };
        *self
            .tracking
            .lock()
            .loading
            .entry(name.to_owned())
            .or_default() += 1;
        let result = self.load_model_inner(name, config_text, model_dir);
        let replaced_dir = {
            let mut t = self.tracking.lock();
            if let Some(n) = t.loading.get_mut(name) {
                *n -= 1;
                if *n == 0 {
                    t.loading.remove(name);
                }
            }
            match &result {
                Ok(()) => {
                    t.failed.remove(name);
                    t.unloaded.remove(name);
                    match fingerprint {
                        Some(f) => t.from_repository.insert(name.to_owned(), f),
                        None => t.from_repository.remove(name),
                    };
                    match owned {
                        Some(dir) => t.owned.insert(name.to_owned(), dir),
                        None => t.owned.remove(name),
                    }
                }
                Err(e) => {
                    t.failed.insert(
                        name.to_owned(),
                        Failure {
                            reason: e.message.clone(),
                            fingerprint,
                        },
                    );
                    // The loaded model keeps its folder; a new one (`owned`) goes when this
                    // function returns.
                    None
                }
            }
        };
        // Removing a folder is file work: not under the lock.
        drop(replaced_dir);
        result
    }

    /// After an unload by the application: the index says "unloaded", a poll leaves the
    /// model alone until its folder changes, and a folder from memory goes.
    pub(super) fn note_unloaded(&self, name: &str, by_poll: bool) {
        let fingerprint = self.repository_folder(name).map(|p| fingerprint(&p));
        let owned = {
            let mut t = self.tracking.lock();
            t.from_repository.remove(name);
            t.failed.remove(name);
            if by_poll {
                t.unloaded.remove(name);
            } else {
                t.unloaded.insert(name.to_owned(), fingerprint);
            }
            t.owned.remove(name)
        };
        drop(owned);
    }

    /// `<repository>/<name>` when it is a model folder.
    fn repository_folder(&self, name: &str) -> Option<PathBuf> {
        let repo = self.opts.repository.as_ref()?;
        crate::folder::check_folder_name(name, "").ok()?;
        let p = repo.join(name);
        load::is_model_dir(&p).then_some(p)
    }

    /// The names of the repository's model folders, sorted.
    fn repository_models(&self) -> Result<Vec<String>> {
        let Some(repo) = &self.opts.repository else {
            return Ok(Vec::new());
        };
        let entries = std::fs::read_dir(repo)
            .map_err(|e| Error::not_found(format!("model repository '{}': {e}", repo.display())))?;
        let mut names: Vec<String> = entries
            .flatten()
            .filter(|e| load::is_model_dir(&e.path()))
            .filter_map(|e| e.file_name().to_str().map(str::to_owned))
            .collect();
        names.sort();
        Ok(names)
    }

    /// Triton's repository index as JSON: an array of `{"name", "version", "state",
    /// "reason"}`, one per version (`version` left out where a model has none: not
    /// loaded, or loading), sorted by name and version. States: READY (serving),
    /// LOADING, UNLOADING (draining after an unload or a replace), UNAVAILABLE (in the
    /// repository but not loaded; `reason` says why: the last load's error, "unloaded",
    /// or "not loaded"). A READY model whose last reload failed keeps serving, and its
    /// `reason` names that failure. `ready_only`: the READY entries alone.
    pub fn repository_index_json(&self, ready_only: bool) -> Result<String> {
        let on_disk = self.repository_models()?;
        type Key = (String, Option<i64>, State);
        let mut entries: BTreeMap<Key, String> = BTreeMap::new();
        let mut names: HashSet<String> = on_disk.into_iter().collect();
        let ready: Vec<(String, Vec<i64>)> = (self.models.read().iter())
            .map(|(n, e)| (n.clone(), e.versions.keys().copied().collect()))
            .collect();
        let draining: Vec<(String, i64)> = (self.retired.lock().iter())
            .filter(|s| !s.is_idle())
            .map(|s| (s.model.name_str().to_owned(), s.model.version))
            .collect();
        let t = self.tracking.lock();
        names.extend(ready.iter().map(|(n, _)| n.clone()));
        names.extend(draining.iter().map(|(n, _)| n.clone()));
        names.extend(t.loading.keys().cloned());
        names.extend(t.failed.keys().cloned());
        for (n, versions) in &ready {
            let reason = t.failed.get(n).map_or(String::new(), |f| {
                format!("serving; its last load failed: {}", f.reason)
            });
            for v in versions {
                entries.insert((n.clone(), Some(*v), State::Ready), reason.clone());
            }
        }
        for (n, v) in &draining {
            entries
                .entry((n.clone(), Some(*v), State::Unloading))
                .or_default();
        }
        for n in t.loading.keys() {
            entries.insert((n.clone(), None, State::Loading), String::new());
        }
        let listed: HashSet<String> = entries.keys().map(|(m, _, _)| m.clone()).collect();
        for n in names.iter().filter(|n| !listed.contains(*n)) {
            let reason = match (t.failed.get(n), t.unloaded.contains_key(n)) {
                (Some(f), _) => f.reason.clone(),
                (None, true) => "unloaded".to_owned(),
                (None, false) => "not loaded".to_owned(),
            };
            entries.insert((n.clone(), None, State::Unavailable), reason);
        }
        drop(t);
        // Written by hand to keep Triton's key order (name, version, state, reason).
        let text = |v: &str| serde_json::Value::from(v).to_string();
        let list: Vec<String> = entries
            .into_iter()
            .filter(|((_, _, s), _)| !ready_only || *s == State::Ready)
            .map(|((name, version, state), reason)| {
                let version = version.map_or(String::new(), |v| format!(",\"version\":\"{v}\""));
                format!(
                    "{{\"name\":{}{version},\"state\":\"{}\",\"reason\":{}}}",
                    text(&name),
                    state.text(),
                    text(&reason)
                )
            })
            .collect();
        Ok(format!("[{}]", list.join(",")))
    }

    /// Brings the loaded models in line with the repository, as Triton's polling does:
    /// model folders that appeared are loaded, loaded models whose folder changed (config,
    /// version folders, any file) are reloaded (new requests go to the new versions; those
    /// in flight finish on the old), and models whose folder went are unloaded after their
    /// requests finish. Models the application loaded with its own config or folder, and
    /// models it unloaded (until their folder changes), are left alone, as is a model whose
    /// last load failed until its folder changes. Every change is tried; the first that
    /// failed is returned (the index shows each one's reason).
    pub fn poll_repository(&self) -> Result<()> {
        if self.opts.repository.is_none() {
            return Err(Error::unavailable(
                "the server has no model repository to poll (infer_server_options_set_model_repository)",
            ));
        }
        if self.opts.explicit_model_control {
            return Err(Error::unavailable(
                "polling the model repository is disabled with explicit model control: the application loads and unloads each model (infer_server_load_model)",
            ));
        }
        if !self.is_accepting() {
            return Err(Error::unavailable("the server is shutting down"));
        }
        let _one_at_a_time = self.poll_lock.lock();
        let on_disk = self.repository_models()?;
        let mut first_error: Option<Error> = None;
        // Gone from the repository: unloaded.
        let gone: Vec<String> = {
            let t = self.tracking.lock();
            let mut g: Vec<String> = (t.from_repository.keys())
                .filter(|n| on_disk.binary_search(n).is_err())
                .cloned()
                .collect();
            g.sort();
            g
        };
        for n in gone {
            match self.unload_model_by(&n, true) {
                Ok(()) => self.log.info(&format!(
                    "model '{n}' unloaded: its folder left the model repository"
                )),
                Err(e) if e.code == Code::NotFound => {}
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        // New or changed: loaded, in rounds (an ensemble after its composing models).
        let mut todo: Vec<String> = Vec::new();
        for n in &on_disk {
            let Some(dir) = self.repository_folder(n) else {
                continue;
            };
            let now = fingerprint(&dir);
            let loaded = self.is_loaded(n);
            let t = self.tracking.lock();
            let wanted = match (loaded, t.from_repository.get(n)) {
                (true, Some(&at_load)) => {
                    at_load != now && (t.failed.get(n)).is_none_or(|f| f.fingerprint != Some(now))
                }
                // The application's own config or folder: not the poll's.
                (true, None) => false,
                (false, _) => {
                    let unloaded_as_is = t.unloaded.get(n).is_some_and(|f| *f == Some(now));
                    let failed_as_is = t.failed.get(n).is_some_and(|f| f.fingerprint == Some(now));
                    !unloaded_as_is && !failed_as_is
                }
            };
            if wanted {
                todo.push(n.clone());
            }
        }
        while !todo.is_empty() {
            let mut failed = Vec::new();
            let mut errors = Vec::new();
            for n in &todo {
                let reload = self.is_loaded(n);
                match self.load_tracked(n, None, None, None) {
                    Ok(()) => self.log.info(&format!(
                        "model '{n}' {}: found by a repository poll",
                        if reload { "reloaded" } else { "loaded" }
                    )),
                    Err(e) => {
                        failed.push(n.clone());
                        errors.push(e);
                    }
                }
            }
            if failed.len() == todo.len() {
                for e in errors {
                    self.log.warn(&format!("repository poll: {}", e.message));
                    first_error.get_or_insert(e);
                }
                break;
            }
            todo = failed;
        }
        match first_error {
            None => Ok(()),
            Some(e) => Err(e.context("repository poll")),
        }
    }

    /// Loads a model whose files the application holds in memory (Triton's load with
    /// `file:<version>/<name>` parameters): `config_text` (config.pbtxt text or JSON) and
    /// the files, each named by its path in the model folder (`1/model.onnx`; a leading
    /// `file:` is allowed). They are written to a new private folder under the system's
    /// temporary folder, loaded from there as a model folder, and the folder is removed
    /// when the model is unloaded or replaced (or the load fails). The repository's
    /// folder of the same name, if any, is not read.
    pub fn load_model_files(
        &self,
        name: &str,
        config_text: &str,
        files: &[(&str, &[u8])],
    ) -> Result<()> {
        crate::folder::check_model_name(name)?;
        let what = format!("model '{name}'");
        let mut seen: HashSet<&str> = HashSet::new();
        let mut plan: Vec<(&str, &[u8])> = Vec::with_capacity(files.len());
        for (i, (path, data)) in files.iter().enumerate() {
            let rel = path.strip_prefix("file:").unwrap_or(path);
            check_relative(rel, &format!("{what}: file {i}"))?;
            if !seen.insert(rel) {
                return Err(Error::invalid(format!(
                    "{what}: file {i}: '{rel}' is given twice"
                )));
            }
            plan.push((rel, data));
        }
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "libinfer-model-{}-{}-{}",
            std::process::id(),
            self.id,
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let mut builder = std::fs::DirBuilder::new();
        {
            use std::os::unix::fs::DirBuilderExt;
            builder.mode(0o700);
        }
        builder.create(&dir).map_err(|e| {
            Error::unavailable(format!(
                "{what}: cannot make a folder for its files at '{}': {e}",
                dir.display()
            ))
        })?;
        let owned = OwnedDir(dir.clone());
        for (rel, data) in plan {
            let path = dir.join(rel);
            let wrote = path
                .parent()
                .map_or(Ok(()), std::fs::create_dir_all)
                .and_then(|()| std::fs::write(&path, data));
            wrote.map_err(|e| {
                Error::unavailable(format!(
                    "{what}: cannot write its file '{rel}' to '{}': {e}",
                    path.display()
                ))
            })?;
        }
        self.load_tracked(name, Some(config_text), Some(&dir), Some(owned))?;
        self.adopt(name);
        Ok(())
    }

    /// Polls the repository every `period` on a thread of its own until the server shuts
    /// down or goes (the thread holds no reference to it between polls).
    pub(super) fn start_polling(self: &Arc<Self>, period: Duration) -> Result<()> {
        let me = Arc::downgrade(self);
        let step = period.min(Duration::from_millis(50));
        std::thread::Builder::new()
            .name("infer-repo-poll".into())
            .spawn(move || loop {
                let mut waited = Duration::ZERO;
                while waited < period {
                    std::thread::sleep(step);
                    waited += step;
                    match me.upgrade() {
                        Some(s) if s.is_accepting() => {}
                        _ => return,
                    }
                }
                let Some(s) = me.upgrade() else { return };
                if !s.is_accepting() {
                    return;
                }
                // Failures are in the log and the index.
                let _ = s.poll_repository();
            })
            .map(|_| ())
            .map_err(|e| {
                Error::unavailable(format!("cannot start the repository poll thread: {e}"))
            })
    }
}

/// A hash of everything in a model folder that a reload would read: each entry's path,
/// kind, size and modification time, and the configs' contents.
pub(super) fn fingerprint(dir: &Path) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let mut budget = FINGERPRINT_ENTRIES;
    walk(dir, Path::new(""), 0, &mut h, &mut budget);
    h.finish()
}

fn walk(dir: &Path, rel: &Path, depth: usize, h: &mut impl Hasher, budget: &mut usize) {
    let Ok(read) = std::fs::read_dir(dir.join(rel)) else {
        return;
    };
    let mut names: Vec<std::ffi::OsString> = read.flatten().map(|e| e.file_name()).collect();
    names.sort();
    for n in names {
        if *budget == 0 {
            return;
        }
        *budget -= 1;
        let r = rel.join(&n);
        let p = dir.join(&r);
        r.hash(h);
        // Links are followed: a changed target is a changed model.
        let Ok(meta) = std::fs::metadata(&p) else {
            0u8.hash(h);
            continue;
        };
        meta.is_dir().hash(h);
        meta.len().hash(h);
        if let Ok(t) = meta.modified() {
            t.hash(h);
        }
        if meta.is_dir() {
            if depth < FINGERPRINT_DEPTH {
                walk(dir, &r, depth + 1, h, budget);
            }
        } else if depth == 0
            && (n == "config.pbtxt" || n == "config.json")
            && meta.len() <= FINGERPRINT_CONTENT
        {
            if let Ok(bytes) = std::fs::read(&p) {
                bytes.hash(h);
            }
        }
    }
}
