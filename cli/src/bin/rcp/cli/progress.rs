//! The progress bar on stderr that copies and backups share.

use ferry_client::progress::Progress;
use indicatif::{ProgressBar, ProgressStyle};

/// A [`Progress`] drawn as a bar.
pub struct Bar(pub ProgressBar);

impl Progress for Bar {
    /// Adds `bytes` to the bar's total: a copy plans once, each target of a backup
    /// adds its own to the one bar they share.
    fn set_total(&self, bytes: u64) {
        self.0.inc_length(bytes);
    }
    fn advance(&self, bytes: u64) {
        self.0.inc(bytes);
    }
}

/// A bar, drawn only if `show`.
pub fn progress_bar(show: bool) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(0);
    let style = ProgressStyle::with_template(
        "{bytes:>10}/{total_bytes:<10} {binary_bytes_per_sec:>12} eta {eta:>4} [{wide_bar}]",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    bar.set_style(style);
    bar
}
