//! Progress callbacks of copies and backups: the total once planned, then the bytes
//! done as they are done.

use std::sync::Arc;

use crate::transfer::ProgressFn;

/// Progress callbacks of a copy or a backup.
pub trait Progress: Send + Sync {
    /// The total number of file bytes, once planned.
    fn set_total(&self, bytes: u64);
    /// `bytes` more were copied.
    fn advance(&self, bytes: u64);
}

/// A transfer's progress function that advances `progress`.
pub fn advance_fn(progress: &Arc<dyn Progress>) -> ProgressFn {
    let progress = progress.clone();
    Arc::new(move |n| progress.advance(n))
}

/// A [`Progress`] that only counts bytes done, with `ProgressFn`.
pub(crate) struct FnProgress(pub ProgressFn);

impl Progress for FnProgress {
    fn set_total(&self, _bytes: u64) {}
    fn advance(&self, bytes: u64) {
        (self.0)(bytes)
    }
}

/// Shares a progress function that ignores its input (for callers without a bar).
pub fn no_progress() -> ProgressFn {
    Arc::new(|_| {})
}
