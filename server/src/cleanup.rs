//! Removing the hidden files a killed ferryd left in a share.
//!
//! A ferryd that is killed (SIGKILL, a crash, a power loss) cannot remove the hidden
//! files of the uploads it was receiving. At start, ferryd walks each writable share
//! once, in the background, and removes:
//!
//! - scratch files and symlinks being created (`.ferry-tmp.<16 hex>`): never resumable;
//! - a resumable partial without a readable journal, and a journal without its partial;
//! - resumable partials (with their journals) not written to for the partial TTL
//!   (`--partial-ttl`, default 24 h; zero removes all of them).
//!
//! The server's state directory at the root ([`STATE_DIR`], the manifest store) is not
//! entered: its files are not transfer files, and the store prunes its own.
//!
//! Invariant: nothing a live transfer uses is removed. A file whose status changed
//! after this ferryd started (ctime) is left alone (a transfer of this process wrote
//! it), and so is a regular file another holder has `flock`ed (every transfer locks its
//! hidden file while it runs); a file is removed only while the cleaner holds its lock
//! and only if its name still names the file it locked.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ferry_common::journal::read_journal;
use ferry_common::staging::{classify, lock, names, TempName, JOURNAL_SUFFIX, PART_SUFFIX};
use ferry_common::{STATE_DIR, TEMP_PREFIX};

/// What a cleanup of one share did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CleanupReport {
    /// Files removed (scratch files, partials, journals).
    pub removed: u64,
    /// Resumable partials kept (younger than the TTL, with a valid journal).
    pub kept: u64,
    /// Hidden files left alone because a live transfer uses them.
    pub live: u64,
    /// Hidden files or directories that could not be examined or removed.
    pub failed: u64,
}

/// Cleans the tree under `root` (symlinks are not followed): see the module docs.
/// `started` is when this ferryd started; `ttl` the partial TTL. Blocking.
pub fn clean_tree(root: &Path, ttl: Duration, started: SystemTime) -> CleanupReport {
    let mut c = Cleaner {
        ttl,
        started,
        now: SystemTime::now(),
        report: CleanupReport::default(),
    };
    let mut dirs = vec![root.to_owned()];
    while let Some(dir) = dirs.pop() {
        let entries = match fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(dir = %dir.display(), "cleanup cannot list a directory: {e}");
                c.report.failed += 1;
                continue;
            }
        };
        // stem -> (partial present, journal present)
        let mut partials: BTreeMap<String, (bool, bool)> = BTreeMap::new();
        for entry in entries.flatten() {
            match classify(&entry.file_name()) {
                None if dir == root && entry.file_name() == STATE_DIR => {}
                None => {
                    if entry.file_type().is_ok_and(|t| t.is_dir()) {
                        dirs.push(entry.path());
                    }
                }
                Some(TempName::Scratch) => c.scratch(&entry.path()),
                Some(TempName::Part(stem)) => partials.entry(stem).or_default().0 = true,
                Some(TempName::Journal(stem)) => partials.entry(stem).or_default().1 = true,
            }
        }
        for (stem, (part, journal)) in partials {
            c.partial(&dir, &stem, part, journal);
        }
    }
    c.report
}

struct Cleaner {
    ttl: Duration,
    started: SystemTime,
    now: SystemTime,
    report: CleanupReport,
}

impl Cleaner {
    /// True if `meta`'s status changed since this ferryd started: ours, and live.
    fn is_ours(&self, meta: &fs::Metadata) -> bool {
        let ctime = u64::try_from(meta.ctime())
            .map(|s| UNIX_EPOCH + Duration::new(s, meta.ctime_nsec().clamp(0, 999_999_999) as u32));
        ctime.is_ok_and(|t| t >= self.started)
    }

    fn remove(&mut self, path: &Path) {
        match fs::remove_file(path) {
            Ok(()) => self.report.removed += 1,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %path.display(), "cleanup cannot remove a stale file: {e}");
                self.report.failed += 1;
            }
        }
    }

    fn scratch(&mut self, path: &Path) {
        let Ok(meta) = fs::symlink_metadata(path) else {
            return;
        };
        if self.is_ours(&meta) {
            self.report.live += 1;
        } else if meta.is_symlink() {
            self.remove(path);
        } else if meta.is_file() {
            self.locked_then(path, |c| c.remove(path));
        }
    }

    /// Runs `f` while holding the lock of the regular file at `path`, if no one else
    /// holds it and `path` still names the file locked; else counts the file as live.
    fn locked_then(&mut self, path: &Path, f: impl FnOnce(&mut Self)) {
        let file = match open_no_follow(path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return,
            Err(e) => {
                tracing::warn!(path = %path.display(), "cleanup cannot open a stale file: {e}");
                self.report.failed += 1;
                return;
            }
        };
        let Ok(meta) = file.metadata() else {
            self.report.failed += 1;
            return;
        };
        match lock(&file, Duration::ZERO) {
            Ok(Some(_held)) if names(path, &meta) && !self.is_ours(&meta) => f(self),
            Ok(_) => self.report.live += 1,
            Err(e) => {
                tracing::warn!(path = %path.display(), "cleanup cannot lock a stale file: {e}");
                self.report.failed += 1;
            }
        }
    }

    fn partial(&mut self, dir: &Path, stem: &str, has_part: bool, has_journal: bool) {
        let part = dir.join(format!("{TEMP_PREFIX}{stem}{PART_SUFFIX}"));
        let journal = dir.join(format!("{TEMP_PREFIX}{stem}{JOURNAL_SUFFIX}"));
        let part_meta = has_part.then(|| fs::symlink_metadata(&part).ok()).flatten();
        let part_meta = match part_meta {
            Some(m) if m.is_file() => m,
            other => {
                // Something other than a regular file under a partial's name: a
                // symlink is removed (never followed), anything else left alone.
                if other.is_some_and(|m| m.is_symlink()) {
                    self.remove(&part);
                }
                // A journal whose partial is gone: useless.
                if has_journal {
                    match fs::symlink_metadata(&journal) {
                        Ok(m) if self.is_ours(&m) => self.report.live += 1,
                        Ok(_) => self.remove(&journal),
                        Err(_) => {}
                    }
                }
                return;
            }
        };
        if self.is_ours(&part_meta) {
            self.report.live += 1;
            return;
        }
        self.locked_then(&part, |c| {
            let journal_meta = fs::symlink_metadata(&journal).ok();
            let valid = has_journal
                && journal_meta.as_ref().is_some_and(|m| m.is_file())
                && read_journal(&journal).is_ok();
            let written = [Some(&part_meta), journal_meta.as_ref()]
                .into_iter()
                .flatten()
                .filter_map(|m| m.modified().ok())
                .max()
                .unwrap_or(UNIX_EPOCH);
            let age = c.now.duration_since(written).unwrap_or(Duration::ZERO);
            if valid && age < c.ttl {
                c.report.kept += 1;
                return;
            }
            c.remove(&part);
            if journal_meta.is_some() {
                c.remove(&journal);
            }
        });
    }
}

fn open_no_follow(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use ferry_common::journal::JournalHeader;
    use ferry_common::staging::{partial_paths, Staged};

    use super::*;
    use ferry_common::proto::caps::Algorithms;

    use ferry_common::msg::HashAlgorithm;

    fn header() -> JournalHeader {
        JournalHeader {
            algorithm: HashAlgorithm::Blake3,
            size: 3 * 4096,
            chunk_bytes: 4096,
            source: [0; 32],
        }
    }

    /// A resumable partial of `dir/name` left by an interrupted transfer that had
    /// received chunk 0.
    fn leave_partial(dir: &Path, name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
        let staged = Staged::open(&dir.join(name), &header(), Algorithms::ALL).unwrap();
        staged.journal().unwrap().append(0, &[0; 32]).unwrap();
        drop(staged);
        partial_paths(&dir.join(name)).unwrap()
    }

    fn names_in(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn stale_files_go_and_resumable_partials_stay() {
        let root = tempfile::tempdir().unwrap();
        let sub = root.path().join("a/b");
        fs::create_dir_all(&sub).unwrap();
        fs::write(root.path().join("keep.txt"), b"x").unwrap();
        fs::write(sub.join(".ferry-tmp.0123456789abcdef"), b"scratch").unwrap();
        symlink("t", sub.join(".ferry-tmp.fedcba9876543210")).unwrap();
        let (kept_part, kept_journal) = leave_partial(&sub, "resumable.bin");
        let (orphan_part, orphan_journal) = leave_partial(&sub, "no-journal.bin");
        fs::remove_file(&orphan_journal).unwrap();
        let (lone_part, lone_journal) = leave_partial(root.path(), "no-part.bin");
        fs::remove_file(&lone_part).unwrap();
        let (bad_part, bad_journal) = leave_partial(root.path(), "bad-journal.bin");
        fs::write(&bad_journal, b"garbage").unwrap();
        // A live transfer's files: locked.
        let live = Staged::open(&root.path().join("live.bin"), &header(), Algorithms::ALL).unwrap();
        std::thread::sleep(Duration::from_millis(20));

        let r = clean_tree(root.path(), Duration::from_secs(3600), SystemTime::now());
        assert_eq!(
            r,
            CleanupReport {
                removed: 6,
                kept: 1,
                live: 1,
                failed: 0
            }
        );
        assert!(kept_part.exists() && kept_journal.exists());
        for gone in [&orphan_part, &lone_journal, &bad_part, &bad_journal] {
            assert!(!gone.exists(), "{}", gone.display());
        }
        assert_eq!(
            names_in(&sub),
            vec![
                kept_journal
                    .file_name()
                    .unwrap()
                    .to_string_lossy()
                    .into_owned(),
                kept_part
                    .file_name()
                    .unwrap()
                    .to_string_lossy()
                    .into_owned(),
            ]
        );
        assert!(live.path().exists());

        // A TTL of zero removes every resumable partial that is not in use.
        let r = clean_tree(root.path(), Duration::ZERO, SystemTime::now());
        assert_eq!((r.removed, r.kept, r.live), (2, 0, 1));
        assert!(!kept_part.exists() && !kept_journal.exists());
        assert!(live.path().exists());
        assert_eq!(
            names_in(root.path()).len(),
            4,
            "{:?}",
            names_in(root.path())
        );
    }

    #[test]
    fn the_state_directory_is_left_alone() {
        let root = tempfile::tempdir().unwrap();
        let state = root.path().join(".ferry-state/manifests/00");
        fs::create_dir_all(&state).unwrap();
        // Even files with a temporary name, there, are not the cleaner's.
        fs::write(state.join(".ferry-tmp.0123456789abcdef"), b"x").unwrap();
        fs::write(state.join("1-100"), b"record").unwrap();
        // Elsewhere the name is an ordinary directory, cleaned as any other.
        let deeper = root.path().join("sub/.ferry-state");
        fs::create_dir_all(&deeper).unwrap();
        fs::write(deeper.join(".ferry-tmp.0123456789abcdef"), b"x").unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let r = clean_tree(root.path(), Duration::ZERO, SystemTime::now());
        assert_eq!((r.removed, r.failed), (1, 0), "{r:?}");
        assert_eq!(names_in(&state), [".ferry-tmp.0123456789abcdef", "1-100"]);
        assert!(names_in(&deeper).is_empty());
    }

    #[test]
    fn files_changed_after_the_start_are_left_alone() {
        let root = tempfile::tempdir().unwrap();
        let started = SystemTime::now() - Duration::from_secs(60);
        fs::write(root.path().join(".ferry-tmp.0123456789abcdef"), b"x").unwrap();
        let (part, journal) = leave_partial(root.path(), "f.bin");
        let r = clean_tree(root.path(), Duration::ZERO, started);
        assert_eq!((r.removed, r.live), (0, 2));
        assert!(part.exists() && journal.exists());
    }
}
