//! Compiled kernels kept on disk, so that a process compiles a device's kernels with NVRTC
//! once per machine instead of once per start (seconds for the executor's kernels).
//!
//! Where: `INFER_KERNEL_CACHE` names the folder (`0` or `off`: no disk cache); else
//! `$XDG_CACHE_HOME/libinfer/kernels`, else `$HOME/.cache/libinfer/kernels`. A file is
//! `<name>-sm_<cc>-<key>.cubin`, the key a hash of everything the CUBIN depends on: the
//! source, the NVRTC options, the compute capability, the NVRTC library (path, size, time
//! and version) and this library's version. Each file starts with a header that repeats
//! that description, checked on read, so a file of another build is never used.
//!
//! Two processes (or threads) that need the same kernels at once compile them once: the
//! first holds an exclusive `flock` on `<file>.lock` while it compiles and writes the file
//! (to a temporary name, then renamed), the others wait for the lock and read the file.
//! A file the driver refuses is deleted by [`KernelCache::discard`] and compiled again.
//! The cache never fails a load: where the folder cannot be used, kernels are compiled
//! in memory as without it, and [`notes`] says why.

use crate::status::Result;
use parking_lot::Mutex;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The first line of every cache file.
const MAGIC: &str = "libinfer kernel cache 1\n";

/// What the CUBIN of one compile depends on.
pub struct KernelKey<'a> {
    /// Names the file (e.g. "kernels").
    pub name: &'a str,
    pub source: &'a str,
    pub options: &'a [&'a str],
    pub cc: (i32, i32),
    /// The NVRTC in use, as `nvrtc::identity` describes it.
    pub nvrtc: String,
}

impl KernelKey<'_> {
    /// The header every file of this key starts with (after `MAGIC`), one line.
    fn description(&self) -> String {
        format!(
            "{} sm_{}{} source {:016x}/{} options [{}] {} libinfer {}",
            self.name,
            self.cc.0,
            self.cc.1,
            fnv1a(self.source.as_bytes(), 0xcbf2_9ce4_8422_2325),
            self.source.len(),
            self.options.join(" "),
            self.nvrtc,
            env!("CARGO_PKG_VERSION"),
        )
    }

    fn file_name(&self) -> String {
        let d = self.description();
        let h1 = fnv1a(d.as_bytes(), 0xcbf2_9ce4_8422_2325);
        let h2 = fnv1a(d.as_bytes(), 0x6c62_272e_07bb_0142);
        format!(
            "{}-sm_{}{}-{h1:016x}{h2:016x}.cubin",
            self.name, self.cc.0, self.cc.1
        )
    }
}

/// FNV-1a, 64 bits, from `basis` (two bases give two independent halves of the key).
fn fnv1a(bytes: &[u8], basis: u64) -> u64 {
    bytes.iter().fold(basis, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Where the kernels of one compile came from.
#[derive(Debug, Clone, PartialEq)]
pub enum Origin {
    /// Read from this file.
    Cache(PathBuf),
    /// Compiled in this process, in `seconds`; saved to the file, or not (and why).
    Compiled {
        seconds: f64,
        saved: std::result::Result<PathBuf, String>,
    },
}

/// The disk cache: a folder.
pub struct KernelCache {
    dir: PathBuf,
}

/// What the processes' compiles and cache reads were, for the server's log.
static NOTES: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Lines saying where each device's kernels came from (compiled, read from the cache,
/// why the cache was not used), in the order they happened.
pub fn notes() -> Vec<String> {
    NOTES.lock().clone()
}

fn note(line: String) {
    let mut n = NOTES.lock();
    if !n.contains(&line) {
        n.push(line);
    }
}

impl KernelCache {
    /// The cache the environment asks for (see the module's notes); None when it is off
    /// or no folder can be named.
    pub fn from_env() -> Option<KernelCache> {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
        let dir = match var("INFER_KERNEL_CACHE") {
            Some(v) if v == "0" || v.eq_ignore_ascii_case("off") => return None,
            Some(v) => PathBuf::from(v),
            None => match (var("XDG_CACHE_HOME"), var("HOME")) {
                (Some(x), _) => PathBuf::from(x).join("libinfer").join("kernels"),
                (None, Some(h)) => PathBuf::from(h)
                    .join(".cache")
                    .join("libinfer")
                    .join("kernels"),
                (None, None) => return None,
            },
        };
        Some(KernelCache { dir })
    }

    pub fn at(dir: &Path) -> KernelCache {
        KernelCache {
            dir: dir.to_owned(),
        }
    }

    /// The path of `key`'s file.
    pub fn path(&self, key: &KernelKey<'_>) -> PathBuf {
        self.dir.join(key.file_name())
    }

    /// `key`'s CUBIN: from its file where a valid one is there, else from `compile`, then
    /// saved. Only `compile`'s error fails this; a cache that cannot be used is noted and
    /// passed over.
    pub fn get_or_compile(
        &self,
        key: &KernelKey<'_>,
        compile: impl FnOnce() -> Result<Vec<u8>>,
    ) -> Result<(Vec<u8>, Origin)> {
        let path = self.path(key);
        let description = key.description();
        if let Some(cubin) = read_valid(&path, &description) {
            return Ok((cubin, Origin::Cache(path)));
        }
        // The lock: whoever holds it compiles; the others find the file after it.
        let lock = match self.lock(&path) {
            Ok(l) => Some(l),
            Err(why) => {
                let t = Instant::now();
                let cubin = compile()?;
                let origin = Origin::Compiled {
                    seconds: t.elapsed().as_secs_f64(),
                    saved: Err(why),
                };
                return Ok((cubin, origin));
            }
        };
        if let Some(cubin) = read_valid(&path, &description) {
            return Ok((cubin, Origin::Cache(path)));
        }
        let t = Instant::now();
        let cubin = compile()?;
        let seconds = t.elapsed().as_secs_f64();
        let saved = write_atomic(&path, &description, &cubin).map(|()| path);
        if saved.is_ok() {
            self.prune(key);
        }
        drop(lock);
        Ok((cubin, Origin::Compiled { seconds, saved }))
    }

    /// Keeps the `KEEP` newest files of `key`'s name and architecture (other sources,
    /// NVRTCs or versions of this library), deleting older ones and their lock files, so
    /// that upgrades do not pile files up. A file in use is safe: it was read whole.
    fn prune(&self, key: &KernelKey<'_>) {
        const KEEP: usize = 8;
        let prefix = format!("{}-sm_{}{}-", key.name, key.cc.0, key.cc.1);
        let Ok(dir) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let mut files: Vec<(std::time::SystemTime, PathBuf)> = dir
            .flatten()
            .filter(|e| {
                let n = e.file_name();
                let n = n.to_string_lossy();
                n.starts_with(&prefix) && n.ends_with(".cubin")
            })
            .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
            .collect();
        files.sort_by_key(|f| std::cmp::Reverse(f.0));
        for (_, old) in files.into_iter().skip(KEEP) {
            let _ = std::fs::remove_file(&old);
            let _ = std::fs::remove_file(old.with_extension("cubin.lock"));
        }
    }

    /// Deletes `key`'s file (the driver refused what it held).
    pub fn discard(&self, key: &KernelKey<'_>) {
        let _ = std::fs::remove_file(self.path(key));
    }

    /// An exclusive lock on `<path>.lock` (the folder made first), held until dropped.
    fn lock(&self, path: &Path) -> std::result::Result<std::fs::File, String> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| format!("cannot create {}: {e}", self.dir.display()))?;
        let lock_path = path.with_extension("cubin.lock");
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| format!("cannot open {}: {e}", lock_path.display()))?;
        loop {
            // SAFETY: a file descriptor this File owns, open for the whole call.
            let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
            if r == 0 {
                return Ok(f);
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(format!("cannot lock {}: {e}", lock_path.display()));
            }
        }
    }
}

/// The CUBIN of the file at `path` if it exists and its header is `description`'s.
fn read_valid(path: &Path, description: &str) -> Option<Vec<u8>> {
    let bytes = std::fs::read(path).ok()?;
    let header = format!("{MAGIC}{description}\n");
    let body = bytes.strip_prefix(header.as_bytes())?;
    (!body.is_empty()).then(|| body.to_vec())
}

/// Writes header and CUBIN to a temporary file beside `path`, then renames it there, so
/// a reader sees the whole file or none.
fn write_atomic(path: &Path, description: &str, cubin: &[u8]) -> std::result::Result<(), String> {
    let tmp = path.with_extension(format!("cubin.tmp{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(MAGIC.as_bytes())?;
        f.write_all(description.as_bytes())?;
        f.write_all(b"\n")?;
        f.write_all(cubin)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("cannot write {}: {e}", path.display())
    })
}

/// Records where `what`'s kernels came from, for [`notes`].
pub fn record(what: &str, origin: &Origin) {
    note(match origin {
        Origin::Cache(p) => format!("{what}: read from the kernel cache {}", p.display()),
        Origin::Compiled {
            seconds,
            saved: Ok(p),
        } => format!(
            "{what}: compiled with NVRTC in {seconds:.2} s, saved to {}",
            p.display()
        ),
        Origin::Compiled {
            seconds,
            saved: Err(why),
        } => format!("{what}: compiled with NVRTC in {seconds:.2} s, not cached ({why})"),
    });
}

/// Notes that the cache is off for `what` (INFER_KERNEL_CACHE=off or no folder).
pub fn record_off(what: &str, seconds: f64) {
    note(format!(
        "{what}: compiled with NVRTC in {seconds:.2} s (no kernel cache: INFER_KERNEL_CACHE is off or no folder is known)"
    ));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn key(source: &str) -> KernelKey<'_> {
        KernelKey {
            name: "k",
            source,
            options: &["--gpu-architecture=sm_90"],
            cc: (9, 0),
            nvrtc: "NVRTC 13.0 /x/libnvrtc.so.13".into(),
        }
    }

    fn tmp(tag: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("infer-kernel-cache-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn compiles_once_then_reads_the_file() {
        let dir = tmp("once");
        let cache = KernelCache::at(&dir);
        let calls = AtomicUsize::new(0);
        let compile = || {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok(b"CUBIN".to_vec())
        };
        let (a, o) = cache.get_or_compile(&key("src"), compile).unwrap();
        assert!(matches!(o, Origin::Compiled { saved: Ok(_), .. }), "{o:?}");
        let (b, o) = cache.get_or_compile(&key("src"), compile).unwrap();
        assert_eq!((a, b.clone()), (b"CUBIN".to_vec(), b"CUBIN".to_vec()));
        assert_eq!(o, Origin::Cache(cache.path(&key("src"))));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // Another source is another file.
        assert_ne!(cache.path(&key("src")), cache.path(&key("src2")));
        cache.get_or_compile(&key("src2"), compile).unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_file_of_another_build_or_a_damaged_one_is_compiled_again() {
        let dir = tmp("bad");
        let cache = KernelCache::at(&dir);
        let k = key("src");
        std::fs::create_dir_all(&dir).unwrap();
        for junk in [
            &b""[..],
            b"garbage",
            MAGIC.as_bytes(),
            b"libinfer kernel cache 1\nk sm_90 other\nCUBIN",
        ] {
            std::fs::write(cache.path(&k), junk).unwrap();
            let (c, o) = cache.get_or_compile(&k, || Ok(b"NEW".to_vec())).unwrap();
            assert_eq!(c, b"NEW");
            assert!(matches!(o, Origin::Compiled { saved: Ok(_), .. }), "{o:?}");
            assert_eq!(
                read_valid(&cache.path(&k), &k.description()),
                Some(b"NEW".to_vec())
            );
        }
        cache.discard(&k);
        assert!(!cache.path(&k).exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_compile_error_is_returned_and_nothing_is_saved() {
        let dir = tmp("err");
        let cache = KernelCache::at(&dir);
        let e = cache
            .get_or_compile(&key("src"), || {
                Err(crate::status::Error::internal("no compile"))
            })
            .err()
            .map(|e| e.message);
        assert_eq!(e.as_deref(), Some("no compile"));
        assert!(!cache.path(&key("src")).exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_folder_that_cannot_be_made_still_compiles() {
        let file = tmp("notdir");
        std::fs::write(&file, b"a file").unwrap();
        let cache = KernelCache::at(&file.join("sub"));
        let (c, o) = cache
            .get_or_compile(&key("src"), || Ok(b"C".to_vec()))
            .unwrap();
        assert_eq!(c, b"C");
        match o {
            Origin::Compiled {
                saved: Err(why), ..
            } => assert!(why.contains("cannot create"), "{why}"),
            o => panic!("{o:?}"),
        }
        let _ = std::fs::remove_file(&file);
    }

    #[test]
    fn only_the_newest_files_of_an_architecture_are_kept() {
        let dir = tmp("prune");
        let cache = KernelCache::at(&dir);
        let sources: Vec<String> = (0..11).map(|i| format!("source {i}")).collect();
        for (i, src) in sources.iter().enumerate() {
            cache.get_or_compile(&key(src), || Ok(vec![1])).unwrap();
            // Distinct modification times, oldest first.
            let f = std::fs::File::options()
                .append(true)
                .open(cache.path(&key(src)))
                .unwrap();
            let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000 + i as u64);
            f.set_modified(t).unwrap();
        }
        // One more save prunes down to 8: the newest 7 of the 11 and this one.
        let newest = KernelKey {
            cc: (9, 0),
            ..key("newest")
        };
        cache.get_or_compile(&newest, || Ok(vec![1])).unwrap();
        let kept: Vec<bool> = sources
            .iter()
            .map(|s| cache.path(&key(s)).exists())
            .collect();
        assert_eq!(kept, [vec![false; 4], vec![true; 7]].concat());
        assert!(cache.path(&newest).exists());
        // Another architecture's files are not counted.
        let other = KernelKey {
            cc: (8, 0),
            ..key("x")
        };
        cache.get_or_compile(&other, || Ok(vec![1])).unwrap();
        assert!(cache.path(&key(&sources[4])).exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn threads_that_need_the_same_kernels_compile_them_once() {
        let dir = tmp("threads");
        let calls = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    let cache = KernelCache::at(&dir);
                    let (c, _) = cache
                        .get_or_compile(&key("src"), || {
                            calls.fetch_add(1, Ordering::SeqCst);
                            std::thread::sleep(std::time::Duration::from_millis(200));
                            Ok(b"CUBIN".to_vec())
                        })
                        .unwrap();
                    assert_eq!(c, b"CUBIN");
                });
            }
        });
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
