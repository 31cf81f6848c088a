//! A share: a directory exported under a name, and the confinement of paths to it.
//!
//! Invariant: every path the server touches for a request is either the canonical
//! share root or a path whose parent directory, with every symlink resolved, lies
//! inside the canonical root. With `follow`, the final component is resolved too and
//! must also stay inside. `..`, absolute paths and NUL bytes never get this far (see
//! [`ferry_common::path`]).
//!
//! Known limit: resolution and use are separate system calls, so a local user who can
//! rename directories inside the share while a request runs could race it; clients of
//! ferryd alone cannot, since they cannot create a symlink that points outside and then
//! follow it (every follow is re-checked).

use std::io;
use std::path::{Path, PathBuf};

use ferry_common::msg::{ErrorKind, RemoteError};
use ferry_common::path::{components, PathError};
use ferry_common::TEMP_PREFIX;

use crate::config::{ConfigError, ShareConfig};
use crate::error::{io_error, remote};

/// An exported directory.
#[derive(Debug)]
pub struct Share {
    name: String,
    root: PathBuf,
    read_only: bool,
}

impl Share {
    /// Opens a configured share: its root must exist and be a directory.
    pub fn open(cfg: &ShareConfig) -> Result<Share, ConfigError> {
        let bad = |reason: String| ConfigError::ShareRoot {
            name: cfg.name.clone(),
            path: cfg.path.clone(),
            reason,
        };
        let root = std::fs::canonicalize(&cfg.path).map_err(|e| bad(e.to_string()))?;
        if !root.is_dir() {
            return Err(bad("not a directory".into()));
        }
        Ok(Share {
            name: cfg.name.clone(),
            root,
            read_only: cfg.read_only,
        })
    }

    /// The share's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The canonical root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// True if every write is refused.
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// `share/path`, for messages.
    pub fn display(&self, rel: &str) -> String {
        let rel = rel.trim_matches('/');
        if rel.is_empty() {
            self.name.clone()
        } else {
            format!("{}/{rel}", self.name)
        }
    }

    /// Fails with [`ErrorKind::ReadOnly`] on a read-only share.
    pub fn check_writable(&self) -> Result<(), RemoteError> {
        if self.read_only {
            Err(remote(
                ErrorKind::ReadOnly,
                format!("share '{}' is read-only", self.name),
            ))
        } else {
            Ok(())
        }
    }

    /// Resolves `rel` inside the share. Without `follow`, a final symlink is not
    /// followed (the returned path names the link itself).
    pub fn resolve(&self, rel: &str, follow: bool) -> Result<PathBuf, RemoteError> {
        let comps = components(rel).map_err(|e| path_error(&self.display(rel), e))?;
        let Some((last, parents)) = comps.split_last() else {
            return Ok(self.root.clone());
        };
        let mut parent = self.root.clone();
        parent.extend(parents);
        let parent = std::fs::canonicalize(&parent)
            .map_err(|e| io_error("resolve", &self.display(rel), &e))?;
        self.check_inside(&parent, rel)?;
        if !parent.is_dir() {
            return Err(io_error(
                "resolve",
                &self.display(rel),
                &io::Error::from(io::ErrorKind::NotADirectory),
            ));
        }
        let full = parent.join(last);
        if !follow {
            return Ok(full);
        }
        let real =
            std::fs::canonicalize(&full).map_err(|e| io_error("open", &self.display(rel), &e))?;
        self.check_inside(&real, rel)?;
        Ok(real)
    }

    /// Resolves `rel` as the target of a write: not the root, not a temporary name, on
    /// a writable share; the final component is not followed.
    pub fn resolve_for_write(&self, rel: &str) -> Result<PathBuf, RemoteError> {
        self.check_writable()?;
        let path = self.resolve(rel, false)?;
        if path == self.root {
            return Err(remote(
                ErrorKind::InvalidPath,
                format!(
                    "{}: the share root itself cannot be written",
                    self.display(rel)
                ),
            ));
        }
        match path.file_name().and_then(|n| n.to_str()) {
            None => Err(remote(
                ErrorKind::InvalidPath,
                format!("{}: not a valid name", self.display(rel)),
            )),
            Some(n) if n.starts_with(TEMP_PREFIX) => Err(remote(
                ErrorKind::InvalidPath,
                format!(
                    "{}: names starting with '{TEMP_PREFIX}' are reserved",
                    self.display(rel)
                ),
            )),
            Some(_) => Ok(path),
        }
    }

    fn check_inside(&self, real: &Path, rel: &str) -> Result<(), RemoteError> {
        if real.starts_with(&self.root) {
            Ok(())
        } else {
            tracing::warn!(share = %self.name, path = rel, "refused a path that resolves outside the share");
            Err(remote(
                ErrorKind::OutsideShare,
                format!("{}: path resolves outside the share", self.display(rel)),
            ))
        }
    }
}

fn path_error(what: &str, e: PathError) -> RemoteError {
    let kind = match e {
        PathError::DotDot | PathError::Absolute => ErrorKind::OutsideShare,
        _ => ErrorKind::InvalidPath,
    };
    remote(kind, format!("{what}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn share(read_only: bool) -> (tempfile::TempDir, Share) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("root/sub")).unwrap();
        std::fs::write(dir.path().join("root/sub/f"), b"x").unwrap();
        std::fs::write(dir.path().join("secret"), b"s").unwrap();
        symlink("../secret", dir.path().join("root/escape")).unwrap();
        symlink("sub", dir.path().join("root/inside")).unwrap();
        symlink("/", dir.path().join("root/slash")).unwrap();
        let s = Share::open(&ShareConfig {
            name: "s".into(),
            path: dir.path().join("root"),
            read_only,
            secret_file: None,
            secret_env: None,
        })
        .unwrap();
        (dir, s)
    }

    fn kind(r: Result<PathBuf, RemoteError>) -> ErrorKind {
        r.unwrap_err().kind
    }

    #[test]
    fn paths_inside_resolve() {
        let (_d, s) = share(false);
        assert_eq!(s.resolve("", true).unwrap(), s.root());
        assert_eq!(s.resolve("sub/f", true).unwrap(), s.root().join("sub/f"));
        assert_eq!(s.resolve("inside/f", true).unwrap(), s.root().join("sub/f"));
        assert_eq!(s.resolve("inside", false).unwrap(), s.root().join("inside"));
        assert_eq!(s.resolve("new", false).unwrap(), s.root().join("new"));
    }

    #[test]
    fn escapes_are_refused() {
        let (_d, s) = share(false);
        assert_eq!(kind(s.resolve("../secret", true)), ErrorKind::OutsideShare);
        assert_eq!(
            kind(s.resolve("/etc/passwd", true)),
            ErrorKind::OutsideShare
        );
        assert_eq!(kind(s.resolve("escape", true)), ErrorKind::OutsideShare);
        assert_eq!(kind(s.resolve("slash/etc", false)), ErrorKind::OutsideShare);
        assert_eq!(
            kind(s.resolve("slash/etc/passwd", true)),
            ErrorKind::OutsideShare
        );
        assert_eq!(kind(s.resolve("a\0b", true)), ErrorKind::InvalidPath);
        // Without follow, the link itself is inside and may be replaced or stat'ed.
        assert!(s.resolve("escape", false).is_ok());
    }

    #[test]
    fn missing_parents_and_files_are_not_found() {
        let (_d, s) = share(false);
        assert_eq!(kind(s.resolve("nope/x", false)), ErrorKind::NotFound);
        assert_eq!(kind(s.resolve("nope", true)), ErrorKind::NotFound);
        assert_eq!(kind(s.resolve("sub/f/x", false)), ErrorKind::NotADirectory);
    }

    #[test]
    fn writes_are_checked() {
        let (_d, s) = share(true);
        assert_eq!(kind(s.resolve_for_write("x")), ErrorKind::ReadOnly);
        let (_d, s) = share(false);
        assert_eq!(kind(s.resolve_for_write("")), ErrorKind::InvalidPath);
        assert_eq!(
            kind(s.resolve_for_write(".ferry-tmp.abc")),
            ErrorKind::InvalidPath
        );
        assert!(s.resolve_for_write("sub/new").is_ok());
    }
}
