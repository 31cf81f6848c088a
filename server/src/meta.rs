//! `SetMeta`: numeric owners and modification times of existing entries, set without
//! following any entry's final component (`lchown`, `utimensat` with
//! `AT_SYMLINK_NOFOLLOW`), one result per entry. Blocking.
//!
//! Owners are applied only when the server runs as root (effective uid 0), as rsync
//! applies them only as root; otherwise they are ignored and the entry still counts as
//! set. `chown` clears the set-user-ID and set-group-ID bits of a non-directory, so
//! they are put back afterwards.

use ferry_common::msg::{AttrEntry, MetaEntry};

use crate::dirs::set_attr_batch;
use crate::fsops::FsError;
use crate::share::Share;

/// Whether this process may give files away: owners are applied only then.
pub fn applies_owners() -> bool {
    nix::unistd::geteuid().is_root()
}

/// `SetMeta`: each of `entries` in order, each failing alone; owners only if
/// `owners` (see [`applies_owners`]). Paths are resolved as every write's are (inside
/// a writable share, not the root, no reserved name, the final component not
/// followed), each parent directory once.
pub fn set_meta(share: &Share, entries: Vec<MetaEntry>, owners: bool) -> Vec<Result<(), FsError>> {
    // `SetAttrBatch` without modes: the same resolution, steps and errors.
    let entries: Vec<AttrEntry> = entries
        .into_iter()
        .map(|e| AttrEntry {
            path: e.path,
            mode: None,
            uid: e.uid,
            gid: e.gid,
            mtime: e.mtime,
        })
        .collect();
    set_attr_batch(share, &entries, owners)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::{symlink, MetadataExt};

    use ferry_common::msg::Timestamp;

    fn share(dir: &std::path::Path) -> Share {
        crate::share::test_share("s", dir, false)
    }

    fn entry(path: &str, mtime: Option<Timestamp>) -> MetaEntry {
        MetaEntry {
            path: path.into(),
            uid: None,
            gid: None,
            mtime,
        }
    }

    #[test]
    fn a_symlink_gets_its_own_mtime_and_its_target_is_untouched() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("f"), b"x").unwrap();
        symlink("f", dir.path().join("l")).unwrap();
        let before = fs::metadata(dir.path().join("f")).unwrap().mtime();
        let t = Timestamp {
            secs: 1_000_000_000,
            nanos: 123_456_789,
        };
        let results = set_meta(&share(dir.path()), vec![entry("l", Some(t))], false);
        assert!(results.iter().all(Result::is_ok), "{results:?}");
        let link = fs::symlink_metadata(dir.path().join("l")).unwrap();
        assert_eq!(
            (link.mtime(), link.mtime_nsec()),
            (1_000_000_000, 123_456_789)
        );
        assert_eq!(fs::metadata(dir.path().join("f")).unwrap().mtime(), before);
    }

    #[test]
    fn each_entry_fails_alone_and_reserved_or_outside_paths_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("f"), b"x").unwrap();
        let t = Some(Timestamp { secs: 5, nanos: 0 });
        let entries = vec![
            entry("missing", t),
            entry("../f", t),
            entry(".ferry-tmp.x", t),
            entry("", t),
            entry("f", t),
        ];
        let results = set_meta(&share(dir.path()), entries, false);
        assert!(matches!(results[0], Err(FsError::Stat { .. })));
        for r in &results[1..4] {
            assert!(matches!(r, Err(FsError::Share(_))), "{r:?}");
        }
        assert!(results[4].is_ok());
        assert_eq!(fs::metadata(dir.path().join("f")).unwrap().mtime(), 5);
    }
}
