//! Walks of trees inside a share through directory file descriptors, for `Remove`
//! ([`crate::remove`]) and `DiskUsage` ([`crate::du`]).
//!
//! Invariant: every name a walk touches is looked up relative to a directory file
//! descriptor it opened with `O_DIRECTORY | O_NOFOLLOW`, one component at a time,
//! starting from the share root. A symlink is therefore never followed, neither on the
//! way to the tree (the canonical parent that [`crate::share::Share::resolve`] found is
//! opened again component by component, so a directory swapped for a symlink since
//! the resolution fails the open) nor inside it (entries are examined with
//! `fstatat(AT_SYMLINK_NOFOLLOW)`, removed with `unlinkat`, and a directory is entered
//! only through `openat(O_NOFOLLOW)`). A concurrent rename inside the share can move a
//! directory the walk holds, but never turn the walk towards something outside the
//! share: what it holds is an open directory, not a path.
//!
//! Walks are iterative: a stack of open directories, one per level, at most
//! [`MAX_WALK_DEPTH`] of them; a directory is read as a stream (one `readdir` buffer at
//! a time), so a wide tree costs no memory per entry.

use std::ffi::{CStr, CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;

use ferry_common::msg::MAX_PATH_BYTES;
use ferry_common::path::components;
use nix::dir::{Dir, OwningIter};
use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{fstatat, FileStat, Mode, SFlag};

use crate::share::{Share, ShareError};

/// Names starting with this are the server's own (transfer files, share state):
/// clients can neither remove nor measure them by name.
pub const RESERVED_PREFIX: &str = ".ferry-";

/// Deepest directory level a walk descends to below its top: the deepest tree a client
/// can build (paths are at most [`MAX_PATH_BYTES`], two bytes a level at the least).
/// Each level holds one open descriptor while the walk is below it.
pub const MAX_WALK_DEPTH: usize = MAX_PATH_BYTES / 2;

/// A failed walk of a tree (`Remove`, `DiskUsage`): each variant names the operation
/// and the share-relative path (`share/dir/file`) it failed on.
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    /// The path cannot be used (see [`ShareError`]).
    #[error(transparent)]
    Share(#[from] ShareError),
    /// The path names, or resolves through, one of the server's own names.
    #[error("{path}: names starting with '{RESERVED_PREFIX}' are reserved")]
    Reserved {
        /// The path.
        path: String,
    },
    /// The path resolves outside the share.
    #[error("{path}: path resolves outside the share")]
    Outside {
        /// The path.
        path: String,
    },
    /// The final component is not a valid C string.
    #[error("{path}: not a valid name")]
    NotAName {
        /// The path.
        path: String,
    },
    /// A directory on the way is gone or no longer a directory since it was resolved.
    #[error("{path}: a directory on the path changed while it was used")]
    Changed {
        /// The path.
        path: String,
    },
    /// The tree is deeper than [`MAX_WALK_DEPTH`] levels.
    #[error("{path}: deeper than {MAX_WALK_DEPTH} directory levels")]
    TooDeep {
        /// The top of the walk.
        path: String,
    },
    /// `Remove` of the share root.
    #[error("{path}: the share root cannot be removed")]
    RemoveRoot {
        /// The path.
        path: String,
    },
    /// A non-recursive `Remove` of a directory that is not empty.
    #[error("{path}: directory not empty (remove it recursively)")]
    NotEmpty {
        /// The path.
        path: String,
    },
    /// A directory that kept being filled while it was emptied.
    #[error("{path}: still not empty after {passes} passes (entries are being added)")]
    KeepsFilling {
        /// The directory.
        path: String,
        /// How many times it was emptied.
        passes: u32,
    },
    /// The walk lost the directory above the one it left.
    #[error("{path}: lost its parent")]
    LostParent {
        /// The directory left.
        path: String,
    },
    /// `DiskUsage` met more multiply-linked inodes than it accounts for.
    #[error("{share}: more than {limit} hard-linked files to account for")]
    TooManyLinked {
        /// The share's name.
        share: String,
        /// The most it accounts for.
        limit: usize,
    },
    /// Opening a directory failed.
    #[error("{0}: cannot open")]
    Open(String, #[source] io::Error),
    /// `fstatat` failed.
    #[error("{0}: cannot stat")]
    Stat(String, #[source] io::Error),
    /// Reading a directory failed.
    #[error("{0}: cannot list")]
    List(String, #[source] io::Error),
    /// `unlinkat` failed.
    #[error("{0}: cannot remove")]
    Remove(String, #[source] io::Error),
}

/// Constructs the [`TreeError`] of one failed operation from the path and its cause.
pub type TreeOp = fn(String, io::Error) -> TreeError;

fn dir_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
}

/// Where a walk starts.
pub enum Top {
    /// The share root itself (only ever walked by reads).
    Root(Dir),
    /// An entry inside the share: its parent directory, opened by descriptor, and its
    /// name there.
    Entry {
        /// The parent directory.
        parent: Dir,
        /// The entry's name (one component).
        name: CString,
    },
}

impl Top {
    /// Resolves `rel` in `share` (final component not followed) and opens its parent
    /// directory from the share root one component at a time with `O_NOFOLLOW`. With
    /// `write`, the share must be writable and `rel` must not be the root (as for
    /// [`Share::resolve_for_write`]). Every component of the resolved path is checked
    /// against [`RESERVED_PREFIX`], so a symlink to a reserved directory does not get
    /// around the rule.
    pub fn open(share: &Share, rel: &str, write: bool) -> Result<Top, TreeError> {
        let what = share.display(rel);
        let reserved = || TreeError::Reserved { path: what.clone() };
        // As named (whether it exists or not), then as resolved.
        if components(rel).is_ok_and(|c| c.iter().any(|c| c.starts_with(RESERVED_PREFIX))) {
            return Err(reserved());
        }
        let path = if write {
            share.resolve_for_write(rel)?
        } else {
            share.resolve(rel, false)?
        };
        let Ok(inside) = path.strip_prefix(share.root()) else {
            return Err(TreeError::Outside { path: what });
        };
        let comps: Vec<&OsStr> = inside.iter().collect();
        if comps
            .iter()
            .any(|c| c.as_bytes().starts_with(RESERVED_PREFIX.as_bytes()))
        {
            return Err(reserved());
        }
        let mut dir = Dir::open(share.root(), dir_flags(), Mode::empty())
            .map_err(|e| TreeError::Open(what.clone(), e.into()))?;
        let Some((last, parents)) = comps.split_last() else {
            return Ok(Top::Root(dir));
        };
        for comp in parents {
            dir = Dir::openat(Some(dir.as_raw_fd()), *comp, dir_flags(), Mode::empty())
                .map_err(|e| moved(&what, e))?;
        }
        let name = CString::new(last.as_bytes()).map_err(|_| TreeError::NotAName { path: what })?;
        Ok(Top::Entry { parent: dir, name })
    }
}

/// The error for a directory on the way that could not be opened: gone, or no
/// longer a directory (swapped for a symlink or a file since it was resolved).
fn moved(what: &str, e: Errno) -> TreeError {
    match e {
        Errno::ELOOP | Errno::ENOTDIR => TreeError::Changed { path: what.into() },
        e => TreeError::Open(what.into(), e.into()),
    }
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`.
pub fn lstat_at(dir: RawFd, name: &CStr) -> Result<FileStat, Errno> {
    fstatat(Some(dir), name, AtFlags::AT_SYMLINK_NOFOLLOW)
}

/// True if `st` describes a directory.
pub fn is_dir(st: &FileStat) -> bool {
    SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR
}

/// One open directory of a walk: its entries as a stream, and its name in its parent.
pub struct Frame {
    /// The directory's entries (`.` and `..` included; see [`Frame::next_name`]).
    pub entries: OwningIter,
    /// Its name in the directory below it on the stack (or the top's parent).
    pub name: CString,
}

impl Frame {
    /// Opens the directory `name` in `parent` with `O_NOFOLLOW`: a symlink fails with
    /// `ELOOP` (or `ENOTDIR`), never opens its target.
    pub fn open(parent: RawFd, name: &CStr) -> Result<Frame, Errno> {
        let dir = Dir::openat(Some(parent), name, dir_flags(), Mode::empty())?;
        Ok(Frame {
            entries: dir.into_iter(),
            name: name.to_owned(),
        })
    }

    /// The directory's descriptor.
    pub fn fd(&self) -> RawFd {
        self.entries.as_raw_fd()
    }

    /// The next entry's name and its type as `readdir` reports it (`None` if
    /// unknown), skipping `.` and `..`; `None` at the end.
    pub fn next_name(&mut self) -> Option<Result<(CString, Option<nix::dir::Type>), Errno>> {
        for entry in self.entries.by_ref() {
            match entry {
                Ok(e) => {
                    let name = e.file_name();
                    if name.to_bytes() == b"." || name.to_bytes() == b".." {
                        continue;
                    }
                    return Some(Ok((name.to_owned(), e.file_type())));
                }
                Err(e) => return Some(Err(e)),
            }
        }
        None
    }
}

/// A stack of open directories from the top of a walk down to where it is now.
pub struct Stack {
    /// The directory holding the top (none when the top is the share root).
    base: Option<Dir>,
    /// Share-relative path of the top, for messages.
    rel: String,
    frames: Vec<Frame>,
}

impl Stack {
    /// A stack below `base` (the top's parent, if the top is not the root), for the
    /// top at share-relative `rel`; the caller descends into the top (or pushes the
    /// root with [`Stack::push_root`]).
    pub fn new(base: Option<Dir>, rel: &str) -> Stack {
        Stack {
            base,
            rel: rel.trim_matches('/').to_string(),
            frames: Vec::new(),
        }
    }

    /// Starts the walk in the share root `root`.
    pub fn push_root(&mut self, root: Dir) {
        self.frames.push(Frame {
            entries: root.into_iter(),
            name: c".".to_owned(),
        });
    }

    /// The directory the walk is reading now.
    pub fn current(&mut self) -> Option<&mut Frame> {
        self.frames.last_mut()
    }

    /// The descriptor of the directory the walk is reading now (the top's parent when
    /// the stack is empty). `None` only for an empty stack over the root.
    pub fn fd(&self) -> Option<RawFd> {
        match self.frames.last() {
            Some(f) => Some(f.fd()),
            None => self.base.as_ref().map(AsRawFd::as_raw_fd),
        }
    }

    /// Opens the directory `name` in the current one (or the top itself when the
    /// stack is empty) with `O_NOFOLLOW` and descends into it. Fails with
    /// [`TreeError::TooDeep`] beyond [`MAX_WALK_DEPTH`] levels below the top.
    pub fn descend(&mut self, share: &Share, name: &CStr) -> Result<(), DescendError> {
        if self.frames.len() > MAX_WALK_DEPTH {
            return Err(DescendError::Fatal(TreeError::TooDeep {
                path: share.display(&self.rel),
            }));
        }
        let Some(fd) = self.fd() else {
            return Err(DescendError::Open(Errno::EBADF));
        };
        let frame = Frame::open(fd, name).map_err(DescendError::Open)?;
        self.frames.push(frame);
        Ok(())
    }

    /// Leaves the current directory (closing it) and returns its name.
    pub fn ascend(&mut self) -> Option<CString> {
        self.frames.pop().map(|f| f.name)
    }

    /// Share-relative path of `name` in the current directory, for messages.
    /// With an empty stack, the only entry there is to name is the top itself.
    pub fn display(&self, share: &Share, name: Option<&CStr>) -> String {
        let mut rel = self.rel.clone();
        if self.frames.is_empty() {
            return share.display(&rel);
        }
        // The first frame is the top itself, named by `rel`.
        for part in self
            .frames
            .iter()
            .skip(1)
            .map(|f| f.name.as_c_str())
            .chain(name)
        {
            if !rel.is_empty() {
                rel.push('/');
            }
            rel.push_str(&String::from_utf8_lossy(part.to_bytes()));
        }
        share.display(&rel)
    }

    /// The error of `op` on `name` in the current directory.
    pub fn error(&self, share: &Share, op: TreeOp, name: Option<&CStr>, e: Errno) -> TreeError {
        op(self.display(share, name), e.into())
    }
}

/// Why [`Stack::descend`] did not descend.
pub enum DescendError {
    /// `openat` failed (the entry is gone, or is no longer a directory).
    Open(Errno),
    /// The walk must stop.
    Fatal(TreeError),
}
