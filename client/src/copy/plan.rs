//! The plan of a copy, made before anything is copied: every directory to create
//! (parents first), every file and symlink, from `S` (source) to `T` (target).

use std::collections::HashMap;

use ferry_common::msg::{Owner, Timestamp};

use crate::error::ClientError;

/// Options of a copy.
#[derive(Debug, Clone)]
pub struct CopyOptions {
    /// Copy directories.
    pub recursive: bool,
    /// Files in flight at once.
    pub jobs: usize,
    /// Keep hard links inside the copied trees (`-H`): a file's further names are made
    /// links to its first, not copies.
    pub hard_links: bool,
    /// Carry extended attributes (`-X`, see `copy::xattrs`).
    pub xattrs: bool,
}

/// Items of the many-files lane per `--jobs`: a batch of small files or a file of at
/// most one chunk costs at most one chunk buffer, and spends most of its time waiting
/// for the flushes it shares with every other file being committed
/// ([`ferry_common::writeback::GroupSync`], on the server and here); the more of them in
/// flight, the more files each flush covers.
pub const MANY_PER_JOB: usize = 8;

/// Most items of the many-files lane at once, whatever `--jobs` says: each may hold a
/// chunk buffer, so this bounds their memory (256 MiB with 1 MiB chunks).
pub const MANY_MAX: usize = 256;

/// The scheduler's lanes for a copy's files: `big` ones (`(item, size)`, over one
/// chunk: windows of many chunks each) `jobs` at once, largest first so the longest
/// start first; the `many` others `jobs * MANY_PER_JOB` (at most [`MANY_MAX`]) at
/// once, in order.
pub(super) fn file_lanes<I>(
    many: Vec<I>,
    mut big: Vec<(I, u64)>,
    jobs: usize,
) -> Vec<(Vec<I>, usize)> {
    big.sort_by_key(|(_, size)| std::cmp::Reverse(*size));
    vec![
        (big.into_iter().map(|(i, _)| i).collect(), jobs),
        (many, jobs.saturating_mul(MANY_PER_JOB).min(MANY_MAX)),
    ]
}

/// A directory to create, with the attributes to give it at the end: its owner (if
/// known and to be kept) once every entry's content is in place, then its mode and
/// mtime, deepest first.
pub(super) struct DirItem<T> {
    pub target: T,
    pub mode: u32,
    pub mtime: Timestamp,
    pub owner: Option<Owner>,
}

/// What a copied file or symlink gets once every entry's content is in place: its
/// owner (applied only by a receiver running as root) and, for a symlink, its own
/// mtime (a file's is set with its content).
pub(super) struct EntryMeta<T> {
    pub target: T,
    pub owner: Option<Owner>,
    pub mtime: Option<Timestamp>,
}

/// What is left to set once every entry's content is in place: the `meta` of the
/// files and symlinks that were `copied`, then the owners of the `dirs` that are
/// `kept`; only entries with something to set.
pub(super) fn finishing<T: Clone>(
    meta: &[EntryMeta<T>],
    dirs: &[DirItem<T>],
    copied: impl Fn(&T) -> bool,
    kept: impl Fn(&T) -> bool,
) -> Vec<EntryMeta<T>> {
    let entries = meta
        .iter()
        .filter(|m| copied(&m.target))
        .map(|m| EntryMeta {
            target: m.target.clone(),
            owner: m.owner,
            mtime: m.mtime,
        });
    let dirs = dirs.iter().filter(|d| kept(&d.target)).map(|d| EntryMeta {
        target: d.target.clone(),
        owner: d.owner,
        mtime: None,
    });
    entries
        .chain(dirs)
        .filter(|m| m.owner.is_some() || m.mtime.is_some())
        .collect()
}

/// A planned copy from `S` (source) to `T` (target).
pub(super) struct Plan<S, T> {
    pub dirs: Vec<DirItem<T>>,
    /// Source, target, size.
    pub files: Vec<(S, T, u64)>,
    /// Link target, target.
    pub symlinks: Vec<(String, T)>,
    /// Owners and symlink mtimes of the files and symlinks, to set once they are copied.
    pub meta: Vec<EntryMeta<T>>,
    /// With `-H`: (first name, further name) of each further name of a file with
    /// several names in the sources; made a hard link once the first is copied.
    pub links: Vec<(T, T)>,
    /// Each source planned and its target: where `-X` walks.
    pub roots: Vec<(S, T)>,
    /// With `-H`: the first name planned of each inode (device, inode number) with
    /// several names.
    pub first_names: HashMap<(u64, u64), T>,
}

impl<S, T> Default for Plan<S, T> {
    fn default() -> Self {
        Plan {
            dirs: Vec::new(),
            files: Vec::new(),
            symlinks: Vec::new(),
            meta: Vec::new(),
            links: Vec::new(),
            roots: Vec::new(),
            first_names: HashMap::new(),
        }
    }
}

impl<S, T: Clone> Plan<S, T> {
    /// Plans the file `src` (of `size` bytes, inode `inode` with `nlink` names) to
    /// `target`: copied, or with `hard_links` a link to the first name of its inode
    /// planned before it. Returns whether it is copied.
    pub fn add_file(
        &mut self,
        src: S,
        target: T,
        size: u64,
        (inode, nlink): ((u64, u64), u64),
        hard_links: bool,
    ) -> bool {
        if hard_links && nlink > 1 {
            if let Some(first) = self.first_names.get(&inode) {
                self.links.push((first.clone(), target));
                return false;
            }
            self.first_names.insert(inode, target.clone());
        }
        self.files.push((src, target, size));
        true
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
