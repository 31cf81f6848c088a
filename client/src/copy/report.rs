//! What a copy did, recorded item by item while its tasks run.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::error::ClientError;
use crate::location::Remote;
use crate::progress::Progress;
use crate::transfer::{Copied, ProgressFn};

/// One failed item.
#[derive(Debug)]
pub struct ItemError {
    /// The item, as the user would name it.
    pub path: String,
    /// What went wrong.
    pub error: ClientError,
}

/// What a copy did.
#[derive(Debug, Default)]
pub struct Report {
    /// Regular files copied.
    pub files: u64,
    /// Directories created or reused.
    pub dirs: u64,
    /// Symlinks copied.
    pub symlinks: u64,
    /// Further names of files made hard links to their first (`-H`).
    pub hard_links: u64,
    /// File bytes copied (the sizes of the files copied).
    pub bytes: u64,
    /// File bytes of the files copied that crossed the connection: pulled by the server
    /// (uploads) or pushed by it (downloads).
    pub bytes_sent: u64,
    /// File bytes of the files copied that were not sent because an interrupted copy
    /// had left them, verified, in the destination's partial file (`bytes_sent +
    /// bytes_reused == bytes`).
    pub bytes_reused: u64,
    /// Stripes uploaded to a cluster (copies to a cluster only).
    pub stripes_sent: u64,
    /// Stripes of the files copied to a cluster that were not sent: the version
    /// replaced held the same bytes there, and the new one names its objects.
    pub stripes_reused: u64,
    /// Items that failed.
    pub errors: Vec<ItemError>,
    /// Special files (devices, fifos, sockets) inside trees, not copied (as rsync does
    /// without `-D`).
    pub skipped: Vec<String>,
}

/// The report being filled and the progress being told, shared by a copy's tasks.
pub(super) struct Shared {
    pub report: Mutex<Report>,
    pub progress: Arc<dyn Progress>,
    /// Targets of the files and symlinks copied: only these get their owners and
    /// symlink mtimes at the end (a target that failed may hold an older file).
    pub done: Mutex<HashSet<PathBuf>>,
}

impl Shared {
    pub fn new(progress: Arc<dyn Progress>) -> Arc<Shared> {
        Arc::new(Shared {
            report: Mutex::new(Report::default()),
            progress,
            done: Mutex::new(HashSet::new()),
        })
    }

    pub fn fail(&self, path: String, error: ClientError) {
        lock(&self.report).errors.push(ItemError { path, error });
    }

    /// Records the file copied to `target`.
    pub fn copied(&self, target: &Path, c: Copied) {
        lock(&self.done).insert(target.to_path_buf());
        let mut r = lock(&self.report);
        r.files += 1;
        r.bytes += c.bytes;
        r.bytes_sent += c.bytes_sent;
        r.bytes_reused += c.bytes_reused;
    }

    /// Records the symlink made at `target`.
    pub fn linked(&self, target: &Path) {
        lock(&self.done).insert(target.to_path_buf());
        lock(&self.report).symlinks += 1;
    }

    /// Whether the file or symlink `target` was copied.
    pub fn is_done(&self, target: &Path) -> bool {
        lock(&self.done).contains(target)
    }

    /// Records a failed upload: server errors are about the target, local ones about
    /// the source.
    pub fn upload_failed(&self, dest: &Remote, src: &Path, target: &str, e: ClientError) {
        if e.remote_kind().is_some() {
            self.fail(dest.with_path(target.to_string()).display(), e);
        } else {
            self.fail(src.display().to_string(), e);
        }
    }

    /// Records a failed download: local errors are about the target (a full disk, a
    /// directory we may not write), the others about the source.
    pub fn download_failed(&self, src: &Remote, target: &Path, e: ClientError) {
        match e {
            ClientError::Local { .. } => self.fail(target.display().to_string(), e),
            e => self.fail(src.display(), e),
        }
    }

    pub fn progress_fn(self: &Arc<Self>) -> ProgressFn {
        let shared = self.clone();
        Arc::new(move |n| shared.progress.advance(n))
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(super) fn finish_report(shared: Arc<Shared>) -> Report {
    std::mem::take(&mut *lock(&shared.report))
}

/// A scheduler failure (a task that panicked) is the copy's, recorded without a path.
pub(super) fn settle_scheduled(shared: &Shared, done: Result<Vec<()>, ClientError>) {
    if let Err(e) = done {
        shared.fail(String::new(), e);
    }
}
