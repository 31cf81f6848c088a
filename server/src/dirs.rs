//! Directory batches (the `dirs` capability): `MakeDirs`, many directories made per
//! request, and `SetAttrBatch`, owners, modes and mtimes of many entries set per
//! request. Each entry fails alone. Blocking.
//!
//! Both resolve paths as every write does ([`Share::resolve_for_write_parent_in`]),
//! each parent directory once per request; `MakeDirs` also remembers each directory
//! it made or found, so a tree sent parents first resolves every directory from its
//! parent, one component, not from the share root.

use std::fs::{self, DirBuilder};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::sync::OnceLock;

use ferry_common::attr::{set_attrs, SetMetaError};
use ferry_common::msg::{AttrEntry, NewDir};

use crate::fsops::FsError;
use crate::share::{ResolvedDir, ResolvedDirs, Share};

/// `MakeDirs`: each of `dirs` in order (see [`ferry_common::msg::Request::MakeDirs`]).
pub fn make_dirs(share: &Share, dirs: &[NewDir]) -> Vec<Result<(), FsError>> {
    let mut resolved = ResolvedDirs::default();
    dirs.iter()
        .map(|d| make_dir(share, d, &mut resolved))
        .collect()
}

/// One directory of a `MakeDirs`, given exactly `d.mode`: `mkdir(2)` applies the
/// umask, drops set-ID bits and inherits a set-group-ID parent's bit, so the mode is
/// set again unless none of those can have changed it.
fn make_dir(share: &Share, d: &NewDir, resolved: &mut ResolvedDirs) -> Result<(), FsError> {
    let what = || share.display(&d.path);
    let (path, parent) = share.resolve_for_write_parent_in(&d.path, resolved)?;
    let mode = d.mode & 0o7777;
    match DirBuilder::new().mode(mode).create(&path) {
        Ok(()) => {
            let exact =
                umask().is_some_and(|u| mode & u == 0) && mode & 0o7000 == 0 && !parent.setgid;
            if !exact {
                crate::fsops::chmod_entry(&path, mode).map_err(|source| FsError::Chmod {
                    path: what(),
                    source,
                })?;
            }
            let made = ResolvedDir {
                path,
                dev: parent.dev,
                setgid: mode & 0o2000 != 0,
            };
            share.remember_dir(&d.path, made, resolved);
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => match fs::symlink_metadata(&path) {
            Ok(m) if m.is_dir() => {
                let found = ResolvedDir {
                    path,
                    dev: m.dev(),
                    setgid: m.mode() & 0o2000 != 0,
                };
                share.remember_dir(&d.path, found, resolved);
                Ok(())
            }
            _ => Err(FsError::NotADirectory { path: what() }),
        },
        Err(source) => Err(FsError::Mkdir {
            path: what(),
            source,
        }),
    }
}

/// This process's umask, read once from `/proc/self/status` (`None` where that cannot
/// be read: then every new directory's mode is set again).
fn umask() -> Option<u32> {
    static UMASK: OnceLock<Option<u32>> = OnceLock::new();
    *UMASK.get_or_init(|| {
        let status = fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find(|l| l.starts_with("Umask:"))?;
        u32::from_str_radix(line["Umask:".len()..].trim(), 8).ok()
    })
}

/// `SetAttrBatch`: each of `entries` in order; owners only if `owners` (see
/// [`crate::meta::applies_owners`]).
pub fn set_attr_batch(
    share: &Share,
    entries: &[AttrEntry],
    owners: bool,
) -> Vec<Result<(), FsError>> {
    let mut resolved = ResolvedDirs::default();
    entries
        .iter()
        .map(|e| {
            let (path, _) = share.resolve_for_write_in(&e.path, &mut resolved)?;
            let (uid, gid) = if owners { (e.uid, e.gid) } else { (None, None) };
            set_attrs(&path, e.mode, uid, gid, e.mtime)
                .map_err(|err| meta_error(share.display(&e.path), err))
        })
        .collect()
}

/// The [`FsError`] of a failed [`set_attrs`] of `path`.
fn meta_error(path: String, err: SetMetaError) -> FsError {
    match err {
        SetMetaError::Stat(source) => FsError::Stat { path, source },
        SetMetaError::Chown(source) => FsError::Chown { path, source },
        SetMetaError::Chmod(source) => FsError::Chmod { path, source },
        SetMetaError::SetMtime(source) => FsError::SetMtime { path, source },
        other => {
            let (_, source) = other.into_parts();
            FsError::SetMtime { path, source }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    use ferry_common::msg::Timestamp;

    fn share(dir: &std::path::Path) -> Share {
        crate::share::test_share("s", dir, false)
    }

    fn new_dir(path: &str, mode: u32) -> NewDir {
        NewDir {
            path: path.into(),
            mode,
        }
    }

    #[test]
    fn a_tree_is_made_parents_first_with_exact_modes() {
        let dir = tempfile::tempdir().unwrap();
        let dirs = [
            new_dir("a", 0o755),
            new_dir("a/b", 0o700),
            new_dir("a/b/c", 0o777),
            new_dir("a/d", 0o2750),
        ];
        let results = make_dirs(&share(dir.path()), &dirs);
        assert!(results.iter().all(Result::is_ok), "{results:?}");
        for d in &dirs {
            let m = fs::symlink_metadata(dir.path().join(&d.path)).unwrap();
            assert!(m.is_dir());
            assert_eq!(m.mode() & 0o7777, d.mode, "{}", d.path);
        }
    }

    #[test]
    fn each_directory_fails_alone() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("file"), b"x").unwrap();
        fs::create_dir(dir.path().join("there")).unwrap();
        symlink("there", dir.path().join("link")).unwrap();
        let dirs = [
            new_dir("file", 0o755),
            new_dir("there", 0o755),
            new_dir("link", 0o755),
            new_dir("missing/x", 0o755),
            new_dir("../out", 0o755),
            new_dir(".ferry-tmp.x", 0o755),
            new_dir("there/new", 0o755),
        ];
        let r = make_dirs(&share(dir.path()), &dirs);
        assert!(
            matches!(r[0], Err(FsError::NotADirectory { .. })),
            "{:?}",
            r[0]
        );
        assert!(r[1].is_ok());
        // A symlink to a directory is not a directory there.
        assert!(
            matches!(r[2], Err(FsError::NotADirectory { .. })),
            "{:?}",
            r[2]
        );
        assert!(matches!(r[3], Err(FsError::Share(_))), "{:?}", r[3]);
        assert!(matches!(r[4], Err(FsError::Share(_))), "{:?}", r[4]);
        assert!(matches!(r[5], Err(FsError::Share(_))), "{:?}", r[5]);
        assert!(r[6].is_ok());
        assert!(dir.path().join("there/new").is_dir());
        assert!(!dir.path().parent().unwrap().join("out").exists());
    }

    #[test]
    fn a_read_only_share_makes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let ro = crate::share::test_share("s", dir.path(), true);
        let r = make_dirs(&ro, &[new_dir("a", 0o755)]);
        assert!(matches!(r[0], Err(FsError::Share(_))), "{:?}", r[0]);
        assert!(!dir.path().join("a").exists());
    }

    #[test]
    fn attributes_are_set_and_a_symlink_keeps_its_target_untouched() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("d")).unwrap();
        fs::write(dir.path().join("f"), b"x").unwrap();
        symlink("f", dir.path().join("l")).unwrap();
        let t = Timestamp {
            secs: 1_000_000_000,
            nanos: 5,
        };
        let entry = |path: &str, mode| AttrEntry {
            path: path.into(),
            mode,
            uid: None,
            gid: None,
            mtime: Some(t),
        };
        let entries = [
            entry("d", Some(0o711)),
            entry("l", Some(0o600)),
            entry("missing", Some(0o600)),
        ];
        let r = set_attr_batch(&share(dir.path()), &entries, false);
        assert!(r[0].is_ok() && r[1].is_ok(), "{r:?}");
        assert!(matches!(r[2], Err(FsError::Stat { .. })), "{:?}", r[2]);
        let d = fs::symlink_metadata(dir.path().join("d")).unwrap();
        assert_eq!(
            (d.mode() & 0o7777, d.mtime(), d.mtime_nsec()),
            (0o711, 1_000_000_000, 5)
        );
        let l = fs::symlink_metadata(dir.path().join("l")).unwrap();
        assert_eq!(l.mtime(), 1_000_000_000);
        let f = fs::metadata(dir.path().join("f")).unwrap();
        assert_ne!(f.mode() & 0o7777, 0o600);
        assert_ne!(f.mtime(), 1_000_000_000);
    }
}
