//! A share: a directory exported under a name, and the confinement of paths to it.
//!
//! Invariant: every path the server touches for a request is either the canonical
//! share root or a path whose parent directory, with every symlink resolved, lies
//! inside the canonical root. With `follow`, the final component is resolved too and
//! must also stay inside. `..`, absolute paths and NUL bytes never get this far (see
//! [`ferry_common::path`]).
//!
//! Paths are resolved one component at a time from the root ([`Share::resolve`]),
//! following symlinks by reading their targets: a target that climbs above the root or
//! names an absolute path outside it is refused as it is met, before anything outside
//! the share is looked at. So the answer to a request never depends on what exists
//! outside the share (a client that may create symlinks cannot use them to probe the
//! server's file system).
//!
//! Reserved names: the state directory [`STATE_DIR`] at the root is never reached by
//! a resolution, whether named directly or met through a symlink's target (every
//! component is checked as the walk meets it at the root), and
//! [`Share::resolve_for_write`] refuses names starting with [`TEMP_PREFIX`].
//!
//! Known limit: resolution and use are separate system calls, so a local user who can
//! rename directories inside the share while a request runs could race it; clients of
//! ferryd alone cannot, since they cannot create a symlink that points outside and then
//! follow it (every follow is re-checked).

use std::collections::HashMap;
use std::ffi::OsString;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use ferry_common::msg::{HashAlgorithm, DEFAULT_CHUNK_BYTES};
use ferry_common::path::{components, PathError};
use ferry_common::{STATE_DIR, TEMP_PREFIX};

use crate::config::{ConfigError, ShareConfig};
use crate::owners::{OwnerPolicy, Owners};
use crate::store::ManifestStore;

/// The directory, in the state directory, that [`Share::incoming_dir`] names.
pub const INCOMING_DIR: &str = "incoming";

/// Most symlinks followed while resolving one path (the kernel's `MAXSYMLINKS`).
const MAX_SYMLINKS: usize = 40;

/// Most directories a [`ResolvedDirs`] remembers; past that it starts over.
const MAX_RESOLVED_DIRS: usize = 1024;

/// A directory resolved by [`Share::resolve_dir`]: its canonical path and the
/// filesystem it is on (`st_dev`).
#[derive(Debug, Clone)]
pub struct ResolvedDir {
    /// Its canonical path.
    pub path: PathBuf,
    /// Its filesystem, which files created in it are on too.
    pub dev: u64,
    /// Whether it has the set-group-ID bit, which a directory made in it inherits.
    pub setgid: bool,
}

/// Parent directories already resolved during one request (a batch of files in a few
/// directories resolves each directory once), by their components as named, joined by
/// `/`. Only directories that resolved are kept: a path whose parent fails resolves it
/// again and gets its own error. Lives for one request only, like the resolution
/// itself (see the module's known limit).
#[derive(Debug, Default)]
pub struct ResolvedDirs(HashMap<String, ResolvedDir>);

impl ResolvedDirs {
    /// Remembers `dir` as the resolution of the components `key` (joined by `/`).
    fn remember(&mut self, key: String, dir: ResolvedDir) {
        if self.0.len() >= MAX_RESOLVED_DIRS {
            self.0.clear();
        }
        self.0.insert(key, dir);
    }
}

/// Why a path of a request cannot be used: the share layer's errors, each naming the
/// share-relative path (`share/dir/file`) it is about.
#[derive(Debug, thiserror::Error)]
pub enum ShareError {
    /// A write to a read-only share.
    #[error("share '{share}' is read-only")]
    ReadOnly {
        /// The share's name.
        share: String,
    },
    /// A path that is not valid as a share-relative path.
    #[error("{path}: invalid path")]
    InvalidPath {
        /// The path as the client named it.
        path: String,
        /// What is wrong with it.
        #[source]
        source: PathError,
    },
    /// A directory on the way to the path could not be resolved.
    #[error("{path}: cannot resolve its directory")]
    ResolveDir {
        /// The path whose directory failed.
        path: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The path's final component could not be followed.
    #[error("{path}: cannot follow")]
    Follow {
        /// The path.
        path: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The path resolves outside the share.
    #[error("{path}: path resolves outside the share")]
    Outside {
        /// The path.
        path: String,
    },
    /// The path leads to the server's state directory.
    #[error("{path}: '{STATE_DIR}' is reserved for the server's state")]
    Reserved {
        /// The path.
        path: String,
    },
    /// A write to the share root itself.
    #[error("{path}: the share root itself cannot be written")]
    WriteRoot {
        /// The path.
        path: String,
    },
    /// A write to a final component that is not a UTF-8 name.
    #[error("{path}: not a valid name")]
    NotAName {
        /// The path.
        path: String,
    },
    /// A write to a name reserved for temporary files.
    #[error("{path}: names starting with '{TEMP_PREFIX}' are reserved")]
    TempName {
        /// The path.
        path: String,
    },
}

/// An exported directory.
#[derive(Debug)]
pub struct Share {
    name: String,
    root: PathBuf,
    read_only: bool,
    /// The algorithm the share's new data is recorded in, if the configuration fixes
    /// one (else the session's).
    hash: Option<HashAlgorithm>,
    /// Whose files its entries are ([`crate::owners`]).
    owners: OwnerPolicy,
    /// The persistent manifest store, in the server's chunk size (read-only for a
    /// read-only share).
    store: Arc<ManifestStore>,
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
        let owners = cfg.owner_policy();
        if owners.owners == Owners::Client && !nix::unistd::geteuid().is_root() {
            return Err(bad(
                "owners = \"client\" needs ferryd running as root (to act as the clients' users)"
                    .into(),
            ));
        }
        let store = Arc::new(if cfg.read_only {
            ManifestStore::reader(&root, DEFAULT_CHUNK_BYTES)
        } else {
            ManifestStore::new(&root, DEFAULT_CHUNK_BYTES)
        });
        Ok(Share {
            name: cfg.name.clone(),
            root,
            read_only: cfg.read_only,
            hash: cfg.hash,
            owners,
            store,
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

    /// Whose files its entries are.
    pub fn owners(&self) -> &OwnerPolicy {
        &self.owners
    }

    /// True if every write is refused.
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// Where [`Share::incoming_dir`] is (whether or not it exists yet).
    pub fn incoming_path(&self) -> PathBuf {
        self.root.join(STATE_DIR).join(INCOMING_DIR)
    }

    /// The share's private directory for files fetched from elsewhere before they take
    /// a name in the share (a cluster node's `Replicate`): [`INCOMING_DIR`] in the
    /// state directory, which no request can name or list. Made (mode 0700) if missing;
    /// refused unless it and the state directory are real directories, not symlinks.
    /// Blocking.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub fn incoming_dir(&self) -> Result<PathBuf, ShareError> {
        self.check_writable()?;
        let dir = self.incoming_path();
        let state = self.root.join(STATE_DIR);
        let fail = |source: io::Error| ShareError::ResolveDir {
            path: self.display(STATE_DIR),
            source,
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(fail)?;
        for d in [&state, &dir] {
            let meta = std::fs::symlink_metadata(d).map_err(fail)?;
            if !meta.is_dir() {
                return Err(fail(io::Error::from(io::ErrorKind::NotADirectory)));
            }
        }
        Ok(dir)
    }

    /// The share's persistent manifest store: a read-only share's is read (records
    /// saved while it was writable), never written ([`ManifestStore::reader`]).
    pub fn store(&self) -> &Arc<ManifestStore> {
        &self.store
    }

    /// The algorithm the configuration fixes for the share's new data, if any.
    pub fn hash(&self) -> Option<HashAlgorithm> {
        self.hash
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

    /// Fails with [`ShareError::ReadOnly`] on a read-only share.
    pub fn check_writable(&self) -> Result<(), ShareError> {
        if self.read_only {
            Err(ShareError::ReadOnly {
                share: self.name.clone(),
            })
        } else {
            Ok(())
        }
    }

    /// Resolves `rel` inside the share. Without `follow`, a final symlink is not
    /// followed (the returned path names the link itself).
    pub fn resolve(&self, rel: &str, follow: bool) -> Result<PathBuf, ShareError> {
        self.resolve_in(rel, follow, &mut ResolvedDirs::default())
    }

    /// The components of `rel` (see [`ferry_common::path::components`]), or the
    /// refusal of a path that is not valid.
    pub fn components<'r>(&self, rel: &'r str) -> Result<Vec<&'r str>, ShareError> {
        components(rel).map_err(|source| ShareError::InvalidPath {
            path: self.display(rel),
            source,
        })
    }

    /// Resolves the directory `parents` (the components of `rel` before its last),
    /// following every symlink inside the share, and returns its canonical path; fails
    /// as [`Share::resolve`] fails for `rel`'s parent (errors name `rel`), and with
    /// [`ShareError::ResolveDir`] (not a directory) if it is not a directory.
    pub fn resolve_dir(&self, parents: &[&str], rel: &str) -> Result<PathBuf, ShareError> {
        self.resolve_dir_stat(parents, rel).map(|d| d.path)
    }

    /// [`Share::resolve_dir`], with the directory's filesystem.
    fn resolve_dir_stat(&self, parents: &[&str], rel: &str) -> Result<ResolvedDir, ShareError> {
        self.resolve_dir_from(self.root.clone(), parents, rel)
    }

    /// [`Share::resolve_dir_stat`] of `base` (a canonical directory inside the root,
    /// the resolution of some leading components) joined with the remaining `comps`.
    fn resolve_dir_from(
        &self,
        base: PathBuf,
        comps: &[&str],
        rel: &str,
    ) -> Result<ResolvedDir, ShareError> {
        let parent = self.walk(base, comps, rel, |path, source| ShareError::ResolveDir {
            path,
            source,
        })?;
        match std::fs::metadata(&parent) {
            Ok(meta) if meta.is_dir() => Ok(ResolvedDir {
                path: parent,
                dev: meta.dev(),
                setgid: meta.mode() & 0o2000 != 0,
            }),
            _ => Err(ShareError::ResolveDir {
                path: self.display(rel),
                source: io::Error::from(io::ErrorKind::NotADirectory),
            }),
        }
    }

    /// [`Share::resolve_dir`] through `dirs`: a directory resolved before in the same
    /// request is not resolved again, and one below it is resolved from it (the
    /// longest prefix of `parents` that `dirs` holds), not from the root. The answer
    /// is the same: resolution is component by component, and a prefix's canonical
    /// path is where the walk from the root would stand after that prefix.
    fn resolve_dir_in(
        &self,
        parents: &[&str],
        rel: &str,
        dirs: &mut ResolvedDirs,
    ) -> Result<ResolvedDir, ShareError> {
        let key = parents.join("/");
        if let Some(d) = dirs.0.get(&key) {
            return Ok(d.clone());
        }
        let known = (1..parents.len()).rev().find_map(|k| {
            dirs.0
                .get(&parents[..k].join("/"))
                .map(|d| (k, d.path.clone()))
        });
        let d = match known {
            Some((k, base)) => self.resolve_dir_from(base, &parents[k..], rel)?,
            None => self.resolve_dir_stat(parents, rel)?,
        };
        dirs.remember(key, d.clone());
        Ok(d)
    }

    /// Remembers `dir` in `dirs` as the resolution of `rel`, a directory that was just
    /// made or found (not a symlink) at the path [`Share::resolve_for_write_in`] gave
    /// for `rel`: that path is canonical, so `rel`'s children resolve from it.
    pub fn remember_dir(&self, rel: &str, dir: ResolvedDir, dirs: &mut ResolvedDirs) {
        if let Ok(comps) = self.components(rel) {
            dirs.remember(comps.join("/"), dir);
        }
    }

    /// [`Share::resolve`] with its parent directory resolved through `dirs` (see
    /// [`ResolvedDirs`]); the same answers and errors.
    pub fn resolve_in(
        &self,
        rel: &str,
        follow: bool,
        dirs: &mut ResolvedDirs,
    ) -> Result<PathBuf, ShareError> {
        let comps = self.components(rel)?;
        let Some((last, parents)) = comps.split_last() else {
            return Ok(self.root.clone());
        };
        let parent = self.resolve_dir_in(parents, rel, dirs)?.path;
        if !follow {
            if parent == self.root && *last == STATE_DIR {
                return Err(self.reserved(rel));
            }
            return Ok(parent.join(last));
        }
        self.walk(parent, &[last], rel, |path, source| ShareError::Follow {
            path,
            source,
        })
    }

    /// Resolves `comps` from `dir` (a canonical directory inside the root), following
    /// every symlink met, and returns the canonical result. Fails with
    /// [`ShareError::Outside`] as soon as the walk would leave the root (a `..` of a
    /// link's target at the root, or an absolute target outside it), without looking
    /// at anything outside; with `fail(path, cause)` when a component is missing, not a
    /// directory, or the links nest deeper than [`MAX_SYMLINKS`].
    fn walk(
        &self,
        mut dir: PathBuf,
        comps: &[&str],
        rel: &str,
        fail: impl Fn(String, io::Error) -> ShareError,
    ) -> Result<PathBuf, ShareError> {
        let fail = |e: io::Error| fail(self.display(rel), e);
        // Invariant: `dir` is canonical and inside the root. Components still to
        // resolve are in `todo`, the next one last.
        let mut todo: Vec<OsString> = comps.iter().rev().map(OsString::from).collect();
        let mut links = 0;
        while let Some(name) = todo.pop() {
            if name == ".." {
                // Only a link's target has these. `dir` is canonical, so its parent
                // is the lexical one.
                if dir == self.root {
                    return Err(self.outside(rel));
                }
                dir.pop();
                continue;
            }
            if dir == self.root && name == STATE_DIR {
                return Err(self.reserved(rel));
            }
            let next = dir.join(&name);
            let meta = std::fs::symlink_metadata(&next).map_err(fail)?;
            if !meta.file_type().is_symlink() {
                dir = next;
                continue;
            }
            links += 1;
            if links > MAX_SYMLINKS {
                return Err(fail(io::Error::from_raw_os_error(nix::libc::ELOOP)));
            }
            let target = std::fs::read_link(&next).map_err(fail)?;
            let rest = if target.is_absolute() {
                let Ok(rest) = target.strip_prefix(&self.root) else {
                    return Err(self.outside(rel));
                };
                dir = self.root.clone();
                rest
            } else {
                &target
            };
            for c in rest.components().rev() {
                match c {
                    Component::Normal(n) => todo.push(n.to_owned()),
                    Component::ParentDir => todo.push("..".into()),
                    Component::CurDir => {}
                    // A relative path, or what follows the root's prefix, has neither.
                    Component::RootDir | Component::Prefix(_) => return Err(self.outside(rel)),
                }
            }
        }
        Ok(dir)
    }

    /// Resolves `rel` as the target of a write: not the root, not a temporary name, on
    /// a writable share; the final component is not followed.
    pub fn resolve_for_write(&self, rel: &str) -> Result<PathBuf, ShareError> {
        self.resolve_for_write_in(rel, &mut ResolvedDirs::default())
            .map(|(path, _)| path)
    }

    /// [`Share::resolve_for_write`] with the parent directory resolved through `dirs`
    /// (see [`ResolvedDirs`]); the same answers and errors. Returns the path and the
    /// filesystem (`st_dev`) of its directory, which a file created there is on.
    pub fn resolve_for_write_in(
        &self,
        rel: &str,
        dirs: &mut ResolvedDirs,
    ) -> Result<(PathBuf, u64), ShareError> {
        self.resolve_for_write_parent_in(rel, dirs)
            .map(|(path, parent)| (path, parent.dev))
    }

    /// [`Share::resolve_for_write_in`], returning the path and its resolved parent
    /// directory.
    pub fn resolve_for_write_parent_in(
        &self,
        rel: &str,
        dirs: &mut ResolvedDirs,
    ) -> Result<(PathBuf, ResolvedDir), ShareError> {
        self.check_writable()?;
        let comps = self.components(rel)?;
        let Some((last, parents)) = comps.split_last() else {
            // The share root: refused below.
            return self.check_write_target(rel, self.root.clone()).map(|p| {
                let dir = ResolvedDir {
                    path: p.clone(),
                    dev: 0,
                    setgid: false,
                };
                (p, dir)
            });
        };
        let parent = self.resolve_dir_in(parents, rel, dirs)?;
        if parent.path == self.root && *last == STATE_DIR {
            return Err(self.reserved(rel));
        }
        let path = self.check_write_target(rel, parent.path.join(last))?;
        Ok((path, parent))
    }

    /// Refuses `path` (the resolution of `rel`) as the target of a write if it is the
    /// root or a temporary name.
    fn check_write_target(&self, rel: &str, path: PathBuf) -> Result<PathBuf, ShareError> {
        if path == self.root {
            return Err(ShareError::WriteRoot {
                path: self.display(rel),
            });
        }
        match path.file_name().and_then(|n| n.to_str()) {
            None => Err(ShareError::NotAName {
                path: self.display(rel),
            }),
            Some(n) if n.starts_with(TEMP_PREFIX) => Err(ShareError::TempName {
                path: self.display(rel),
            }),
            Some(_) => Ok(path),
        }
    }

    /// The refusal of `rel`, which leads to the server's state directory.
    pub fn reserved(&self, rel: &str) -> ShareError {
        ShareError::Reserved {
            path: self.display(rel),
        }
    }

    /// The refusal of `rel`, which leads outside the share (logged).
    fn outside(&self, rel: &str) -> ShareError {
        tracing::warn!(share = %self.name, path = rel, "refused a path that resolves outside the share");
        ShareError::Outside {
            path: self.display(rel),
        }
    }
}

/// A share named `name` at `path` with no secret of its own, for unit tests.
#[cfg(test)]
pub(crate) fn test_share(name: &str, path: &Path, read_only: bool) -> Share {
    Share::open(&crate::config::ShareConfig {
        name: name.into(),
        path: path.to_owned(),
        read_only,
        secret_file: None,
        secret_env: None,
        hash: None,
        encryption: None,
        owners: crate::owners::Owners::Server,
        root_squash: true,
        allow_devices: false,
        allow_setid: false,
    })
    .unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_common::msg::{ErrorKind, RemoteError};
    use std::os::unix::fs::symlink;

    fn share(read_only: bool) -> (tempfile::TempDir, Share) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("root/sub")).unwrap();
        std::fs::write(dir.path().join("root/sub/f"), b"x").unwrap();
        std::fs::write(dir.path().join("secret"), b"s").unwrap();
        symlink("../secret", dir.path().join("root/escape")).unwrap();
        symlink("sub", dir.path().join("root/inside")).unwrap();
        symlink("/", dir.path().join("root/slash")).unwrap();
        symlink("../nowhere", dir.path().join("root/gone")).unwrap();
        symlink("loop", dir.path().join("root/loop")).unwrap();
        symlink("sub/../inside", dir.path().join("root/chain")).unwrap();
        let s = test_share("s", &dir.path().join("root"), read_only);
        (dir, s)
    }

    #[test]
    fn a_directory_resolved_from_a_remembered_prefix_is_confined_the_same() {
        let (dir, s) = share(false);
        std::fs::create_dir_all(dir.path().join("root/sub/deep")).unwrap();
        symlink("../../..", dir.path().join("root/sub/deep/up")).unwrap();
        symlink("..", dir.path().join("root/sub/deep/back")).unwrap();
        let mut dirs = ResolvedDirs::default();
        // "sub" and "sub/deep" are remembered; what lies below resolves from them.
        s.resolve_for_write_in("sub/deep/x", &mut dirs).unwrap();
        let (p, _) = s
            .resolve_for_write_in("sub/deep/back/y", &mut dirs)
            .unwrap();
        assert_eq!(p, s.root().join("sub/y"));
        let e = s
            .resolve_for_write_in("sub/deep/up/z", &mut dirs)
            .unwrap_err();
        assert!(matches!(e, ShareError::Outside { .. }), "{e:?}");
        let (p, _) = s
            .resolve_for_write_in("sub/deep/back/deep/w", &mut dirs)
            .unwrap();
        assert_eq!(p, s.root().join("sub/deep/w"));
    }

    fn kind(r: Result<PathBuf, ShareError>) -> ErrorKind {
        RemoteError::from(r.unwrap_err()).kind
    }

    #[test]
    fn paths_inside_resolve() {
        let (_d, s) = share(false);
        assert_eq!(s.resolve("", true).unwrap(), s.root());
        assert_eq!(s.resolve("sub/f", true).unwrap(), s.root().join("sub/f"));
        assert_eq!(s.resolve("inside/f", true).unwrap(), s.root().join("sub/f"));
        assert_eq!(s.resolve("inside", false).unwrap(), s.root().join("inside"));
        assert_eq!(s.resolve("new", false).unwrap(), s.root().join("new"));
        assert_eq!(s.resolve("chain/f", true).unwrap(), s.root().join("sub/f"));
        // An absolute target inside the share is followed.
        symlink(s.root().join("sub"), s.root().join("abs")).unwrap();
        assert_eq!(s.resolve("abs/f", true).unwrap(), s.root().join("sub/f"));
    }

    #[test]
    fn what_exists_outside_does_not_change_the_answer() {
        let (d, s) = share(false);
        // `gone` leads to a missing file outside, `escape` to an existing one: both
        // are outside, whatever lies there.
        for path in ["gone/x", "escape/x", "slash/no/such/dir", "slash/etc/x"] {
            assert_eq!(
                kind(s.resolve(path, true)),
                ErrorKind::OutsideShare,
                "{path}"
            );
            assert_eq!(
                kind(s.resolve(path, false)),
                ErrorKind::OutsideShare,
                "{path}"
            );
        }
        assert_eq!(kind(s.resolve("gone", true)), ErrorKind::OutsideShare);
        // Not followed, the link itself is inside.
        assert!(s.resolve("gone", false).is_ok());
        std::fs::write(d.path().join("nowhere"), b"now here").unwrap();
        assert_eq!(kind(s.resolve("gone", true)), ErrorKind::OutsideShare);
        // A loop is an error of its own, not a way out.
        let looped = kind(s.resolve("loop", true));
        assert!(
            !matches!(looped, ErrorKind::OutsideShare | ErrorKind::NotFound),
            "{looped:?}"
        );
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

    #[test]
    fn resolving_through_a_cache_answers_the_same() {
        for read_only in [false, true] {
            let (_d, s) = share(read_only);
            let mut dirs = ResolvedDirs::default();
            let paths = [
                "",
                "new",
                "sub/new",
                "sub/f",
                "inside/f",
                "inside/new",
                "chain/f",
                "escape",
                "escape/x",
                "slash/etc",
                "gone/x",
                "loop/x",
                "sub/f/x",
                ".ferry-state",
                ".ferry-state/x",
                "inside/.ferry-tmp.abc",
                "nothere/x",
            ];
            // Twice: the second round answers from the cache where it can.
            for _ in 0..2 {
                for rel in paths {
                    let plain = s.resolve_for_write(rel);
                    let cached = s.resolve_for_write_in(rel, &mut dirs).map(|(p, _)| p);
                    match (&plain, &cached) {
                        (Ok(a), Ok(b)) => assert_eq!(a, b, "{rel}"),
                        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "{rel}"),
                        _ => panic!("{rel}: {plain:?} against {cached:?}"),
                    }
                    for follow in [false, true] {
                        let plain = s.resolve(rel, follow);
                        let cached = s.resolve_in(rel, follow, &mut dirs);
                        match (&plain, &cached) {
                            (Ok(a), Ok(b)) => assert_eq!(a, b, "{rel}"),
                            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "{rel}"),
                            _ => panic!("{rel}: {plain:?} against {cached:?}"),
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_state_directory_is_never_reached() {
        let (_d, s) = share(false);
        std::fs::create_dir_all(s.root().join(".ferry-state/manifests")).unwrap();
        symlink(".ferry-state", s.root().join("state-link")).unwrap();
        symlink(s.root().join(".ferry-state"), s.root().join("state-abs")).unwrap();
        symlink("..", s.root().join("sub/up")).unwrap();
        for path in [
            ".ferry-state",
            ".ferry-state/manifests",
            "state-link",
            "state-link/manifests",
            "state-abs/manifests",
            "sub/up/.ferry-state",
            "inside/up/.ferry-state/x",
        ] {
            assert_eq!(
                kind(s.resolve(path, true)),
                ErrorKind::InvalidPath,
                "{path}"
            );
            // A final symlink is not followed by a write: it is the link that is named.
            if path != "state-link" {
                assert_eq!(
                    kind(s.resolve_for_write(path)),
                    ErrorKind::InvalidPath,
                    "{path}"
                );
            }
        }
        // Not followed, a link is just a link; the name elsewhere is an ordinary name.
        assert!(s.resolve("state-link", false).is_ok());
        assert!(s.resolve_for_write("sub/.ferry-state").is_ok());
        // A read-only share's store is read, never written.
        assert!(s.store().is_writable());
        assert!(!share(true).1.store().is_writable());
    }
}
