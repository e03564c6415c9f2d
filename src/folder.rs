//! The one place where a name from a config or a caller becomes a file path. Every path
//! a model can name (its folder in the repository, version folders, the config, the
//! model file, state data, weights) is resolved by a [`Folder`]:
//! - the name must be relative and plain: no root, no drive, no `..`;
//! - symbolic links are resolved, and the result must stay inside the root (the model
//!   repository, or the folder the application passed), unless the application trusts
//!   the repository (then links may lead anywhere);
//! - files must be regular files: FIFOs, devices and sockets are refused (reading one
//!   could block the load forever or never end).
//!
//! Paths are checked when resolved; a file swapped for a link between the check and the
//! read is not caught (the repository is the application's, not an attacker's, folder;
//! the rules stop names and configs from reaching out of it).

use crate::status::{Code, Error, Result};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

/// Longest model name, in bytes (a file name's limit on common file systems).
pub const MAX_MODEL_NAME_BYTES: usize = 255;

/// A folder inside a confining root.
#[derive(Clone, Debug)]
pub struct Folder {
    /// Canonical.
    root: Arc<Path>,
    /// Canonical; inside `root` unless `links_out`.
    path: PathBuf,
    /// Symbolic links may lead out of the root (a trusted repository).
    links_out: bool,
}

/// Checks that `rel` is a plain relative path: not empty, no root, no `..`.
pub fn check_relative(rel: &str, what: &str) -> Result<()> {
    let p = Path::new(rel);
    if rel.is_empty() || rel.contains('\0') {
        return Err(Error::invalid(format!(
            "{what}: the path '{rel}' is empty or holds NUL"
        )));
    }
    if p.components()
        .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
    {
        return Err(Error::invalid(format!(
            "{what}: the path '{rel}' must be relative and stay inside its folder (no leading '/', no '..')"
        )));
    }
    Ok(())
}

/// Checks a model name: not empty, at most [`MAX_MODEL_NAME_BYTES`], no NUL.
pub fn check_model_name(name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::invalid("model name must not be empty"));
    }
    if name.len() > MAX_MODEL_NAME_BYTES {
        return Err(Error::invalid(format!(
            "a model name of {} bytes is longer than the limit of {MAX_MODEL_NAME_BYTES}",
            name.len()
        )));
    }
    Ok(())
}

/// Checks that a model name can name a folder of a repository: one plain component.
pub fn check_folder_name(name: &str, what: &str) -> Result<()> {
    check_model_name(name)?;
    let mut parts = Path::new(name).components();
    match (parts.next(), parts.next()) {
        (Some(Component::Normal(_)), None) if !name.contains(['/', '\\']) => Ok(()),
        _ => Err(Error::invalid(format!(
            "{what}: '{name}' is not a folder name of the model repository (no '/', '\\', '.' or '..')"
        ))),
    }
}

impl Folder {
    /// A root: the model repository, or a model folder the application names. It must
    /// exist and be a directory; with `links_out` symbolic links below it may lead out.
    pub fn root(path: &Path, links_out: bool, what: &str) -> Result<Folder> {
        let canon = path.canonicalize().map_err(|e| {
            Error::new(
                Code::NotFound,
                format!("{what}: cannot open folder '{}': {e}", path.display()),
            )
        })?;
        if !canon.is_dir() {
            return Err(Error::invalid(format!(
                "{what}: '{}' is not a folder",
                path.display()
            )));
        }
        Ok(Folder {
            root: Arc::from(canon.as_path()),
            path: canon,
            links_out,
        })
    }

    /// The folder's canonical path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Resolves `rel` below this folder: a plain relative path whose canonical form stays
    /// inside the root. NOT_FOUND when nothing is there.
    fn resolve(&self, rel: &str, what: &str) -> Result<PathBuf> {
        check_relative(rel, what)?;
        let joined = self.path.join(rel);
        let canon = joined.canonicalize().map_err(|e| {
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                Code::NotFound
            } else {
                Code::InvalidArgument
            };
            Error::new(
                code,
                format!("{what}: cannot open '{}': {e}", joined.display()),
            )
        })?;
        if !self.links_out && !canon.starts_with(&*self.root) {
            return Err(Error::invalid(format!(
                "{what}: '{}' leads to '{}', outside '{}' (through a symbolic link); only a trusted repository may link out (infer_server_options_set_trusted_repository)",
                joined.display(),
                canon.display(),
                self.root.display()
            )));
        }
        Ok(canon)
    }

    /// A sub-folder (`rel` may have several parts).
    pub fn folder(&self, rel: &str, what: &str) -> Result<Folder> {
        let path = self.resolve(rel, what)?;
        if !path.is_dir() {
            return Err(Error::invalid(format!(
                "{what}: '{}' is not a folder",
                self.path.join(rel).display()
            )));
        }
        Ok(Folder {
            root: self.root.clone(),
            path,
            links_out: self.links_out,
        })
    }

    /// A sub-folder, or None when there is nothing at `rel` (other errors stay errors).
    pub fn folder_if_any(&self, rel: &str, what: &str) -> Result<Option<Folder>> {
        match self.folder(rel, what) {
            Ok(f) => Ok(Some(f)),
            Err(e) if e.code == Code::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// A regular file below this folder (not a FIFO, device or socket).
    pub fn file(&self, rel: &str, what: &str) -> Result<PathBuf> {
        let path = self.resolve(rel, what)?;
        let meta = std::fs::metadata(&path).map_err(|e| {
            Error::invalid(format!("{what}: cannot open '{}': {e}", path.display()))
        })?;
        if !meta.is_file() {
            return Err(Error::invalid(format!(
                "{what}: '{}' is not a regular file ({})",
                self.path.join(rel).display(),
                kind_of(&meta)
            )));
        }
        Ok(path)
    }

    /// Whether `rel` is a regular file this folder may read.
    pub fn has_file(&self, rel: &str) -> bool {
        self.file(rel, "").is_ok()
    }

    /// Reads a regular file below this folder.
    pub fn read(&self, rel: &str, what: &str) -> Result<Vec<u8>> {
        let path = self.file(rel, what)?;
        std::fs::read(&path)
            .map_err(|e| Error::invalid(format!("{what}: cannot read '{}': {e}", path.display())))
    }

    /// The names of this folder's entries (unreadable ones skipped).
    pub fn entries(&self) -> Vec<String> {
        std::fs::read_dir(&self.path)
            .map(|rd| {
                rd.flatten()
                    .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    }
}

fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a folder"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a plain file"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    struct Tmp(PathBuf);
    impl Drop for Tmp {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    fn tmp(tag: &str) -> Tmp {
        let p = std::env::temp_dir().join(format!("infer-folder-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(p.join("repo/m/1")).unwrap();
        std::fs::write(p.join("repo/m/1/model.onnx"), b"x").unwrap();
        std::fs::write(p.join("secret"), b"s").unwrap();
        Tmp(p)
    }

    #[test]
    fn names_and_relative_paths() {
        assert!(check_folder_name("resnet", "t").is_ok());
        for bad in ["", "..", ".", "a/b", "/etc", "a\\b", "../x"] {
            assert!(check_folder_name(bad, "t").is_err(), "{bad}");
        }
        assert!(check_model_name(&"x".repeat(MAX_MODEL_NAME_BYTES)).is_ok());
        assert!(check_model_name(&"x".repeat(MAX_MODEL_NAME_BYTES + 1)).is_err());
        assert!(check_relative("1/model.onnx", "t").is_ok());
        for bad in ["", "/etc/passwd", "../x", "1/../../x", "a\0b"] {
            assert!(check_relative(bad, "t").is_err(), "{bad}");
        }
    }

    #[test]
    fn links_out_of_the_root_are_refused_unless_trusted() {
        let t = tmp("links");
        symlink(t.0.join("secret"), t.0.join("repo/m/1/out.onnx")).unwrap();
        symlink(
            t.0.join("repo/m/1/model.onnx"),
            t.0.join("repo/m/1/in.onnx"),
        )
        .unwrap();
        let repo = Folder::root(&t.0.join("repo"), false, "t").unwrap();
        let m = repo.folder("m", "t").unwrap();
        assert!(m.file("1/model.onnx", "t").is_ok());
        assert!(m.file("1/in.onnx", "t").is_ok());
        let e = m.file("1/out.onnx", "t").unwrap_err();
        assert!(e.message.contains("outside"), "{}", e.message);
        assert!(m.file("../../secret", "t").is_err());
        let trusted = Folder::root(&t.0.join("repo"), true, "t").unwrap();
        assert!(trusted
            .folder("m", "t")
            .unwrap()
            .file("1/out.onnx", "t")
            .is_ok());
        assert_eq!(
            repo.folder_if_any("absent", "t")
                .unwrap()
                .map(|f| f.path().to_owned()),
            None
        );
    }

    #[test]
    fn special_files_are_refused() {
        let t = tmp("fifo");
        let fifo = t.0.join("repo/m/1/state.bin");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let m = Folder::root(&t.0.join("repo/m"), false, "t").unwrap();
        let e = m.file("1/state.bin", "t").unwrap_err();
        assert!(e.message.contains("FIFO"), "{}", e.message);
        assert!(m.file("1", "t").is_err());
    }
}
