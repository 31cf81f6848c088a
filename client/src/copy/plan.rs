//! The plan of a copy, made before anything is copied: every directory to create
//! (parents first), every file and symlink, from `S` (source) to `T` (target).

use ferry_common::msg::Timestamp;

use crate::error::ClientError;

/// Options of a copy.
#[derive(Debug, Clone)]
pub struct CopyOptions {
    /// Copy directories.
    pub recursive: bool,
    /// Files in flight at once.
    pub jobs: usize,
}

/// Items of the many-files lane per `--jobs`: a batch of small files or a file of at
/// most one chunk costs at most one chunk buffer, and spends most of its time waiting
/// for the flushes it shares with every other file being committed
/// ([`ferry_common::writeback::GroupSync`], on the server and here); the more of them in
/// flight, the more files each flush covers.
pub const MANY_PER_JOB: usize = 8;

/// The scheduler's lanes for a copy's files: `big` ones (`(item, size)`, over one
/// chunk: windows of many chunks each) `jobs` at once, largest first so the longest
/// start first; the `many` others `jobs * MANY_PER_JOB` at once, in order.
pub(super) fn file_lanes<I>(
    many: Vec<I>,
    mut big: Vec<(I, u64)>,
    jobs: usize,
) -> Vec<(Vec<I>, usize)> {
    big.sort_by_key(|(_, size)| std::cmp::Reverse(*size));
    vec![
        (big.into_iter().map(|(i, _)| i).collect(), jobs),
        (many, jobs.saturating_mul(MANY_PER_JOB)),
    ]
}

/// A directory to create, with the attributes to give it at the end.
pub(super) struct DirItem<T> {
    pub target: T,
    pub mode: u32,
    pub mtime: Timestamp,
}

/// A planned copy from `S` (source) to `T` (target).
pub(super) struct Plan<S, T> {
    pub dirs: Vec<DirItem<T>>,
    /// Source, target, size.
    pub files: Vec<(S, T, u64)>,
    /// Link target, target.
    pub symlinks: Vec<(String, T)>,
}

impl<S, T> Default for Plan<S, T> {
    fn default() -> Self {
        Plan {
            dirs: Vec::new(),
            files: Vec::new(),
            symlinks: Vec::new(),
        }
    }
}

impl<S, T> Plan<S, T> {
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|(_, _, n)| n).sum()
    }
}

pub(super) fn trailing_slash_needs_a_dir(shown: String) -> ClientError {
    ClientError::Usage(format!(
        "{shown}: not a directory (a trailing '/' names an existing directory)"
    ))
}

pub(super) fn several_sources_need_a_dir(shown: String) -> ClientError {
    ClientError::Usage(format!(
        "{shown}: target is not a directory (needed for several sources)"
    ))
}
