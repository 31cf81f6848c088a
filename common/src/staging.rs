//! Where a received file is written before it gets its final name, and how an
//! interrupted transfer finds its bytes again.
//!
//! Both receivers use it: ferryd for an upload, rcp for a download. A file is written
//! into a hidden file next to its final name, whose name starts with
//! [`TEMP_PREFIX`] (never listed, never a valid target), and is renamed over the final
//! name only once every chunk verified ([`Staged::commit`]).
//!
//! - A file is written *resumably* where it can be: its partial file is
//!   `.ferry-tmp.<stem>.part`, where the stem is the first 32 hex digits of the SHA-256
//!   of the final file name (so the name never exceeds `NAME_MAX`, whatever the final
//!   name), beside a [`journal`](crate::journal) `.ferry-tmp.<stem>.journal`. An
//!   interrupted transfer (killed, disconnected) leaves both; the next transfer to the
//!   same name opens them again and gets the journal's chunks as hints
//!   ([`Staged::hints`]), which it must verify against the partial's bytes before
//!   trusting them ([`chunk_matches`], [`verify_hints`]). Small and empty files too:
//!   their names being deterministic, the next transfer of the same name takes over
//!   (and finally renames or removes) what a killed one left, so a receiver that has no
//!   cleaner of its own (rcp) is not left with stray hidden files.
//! - A file whose partial another live transfer holds (or where something other than
//!   a regular file sits under the partial's name) is written to a *scratch* file
//!   `.ferry-tmp.<16 random hex>`, removed when its [`Staged`] is dropped uncommitted.
//!
//! Invariants:
//! - A transfer owns its partial and journal while it holds an exclusive `flock` on the
//!   partial (scratch files are locked too), so two live transfers never write the same
//!   file, and a cleaner can tell a live file from a stale one by trying the lock.
//! - Whoever takes the lock then checks that the path still names the file it locked (a
//!   commit may have renamed it away in between), and otherwise tries again.
//! - A [`Staged`] file keeps its directory open and names its hidden file and journal
//!   relative to it from then on (lock check, rename, removal): renaming the directory,
//!   or one above it, while the transfer runs neither strands the hidden files nor
//!   makes a later step act on whatever has since appeared at the old path. The commit
//!   gives the file its final name in that same directory, wherever it now is.
//! - Dropping an uncommitted resumable [`Staged`] keeps its partial and journal (that
//!   is what makes a transfer resumable) if they name any chunk, and then gives back
//!   the reserved space of every chunk they do not name, so what is kept costs the
//!   disk only what arrived; one that names no chunk is removed. [`Staged::discard`]
//!   removes them in any case. (A process that is killed drops nothing: its partial
//!   keeps its whole reservation until the next transfer of the name or a cleaner.)

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{CString, OsStr};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{renameat, Flock, FlockArg, OFlag};
use nix::sys::stat::{fstatat, Mode};
use nix::unistd::{unlinkat, UnlinkatFlags};
use rayon::prelude::*;
use sha2::{Digest, Sha256 as Hasher};

use crate::chunk::{chunk_len, hash_chunk};
use crate::journal::{read_from, JournalHeader, JournalWriter};
use crate::msg::{Hash256, HashAlgorithm, Timestamp};
use crate::proto::caps::Algorithms;
use crate::transport::sys::at::open_at_mode;
use crate::{space, TEMP_PREFIX};

/// Suffix of a resumable partial file.
pub const PART_SUFFIX: &str = ".part";
/// Suffix of a resumable partial file's journal.
pub const JOURNAL_SUFFIX: &str = ".journal";
/// Suffix of the hidden name a symlink is created under before it is renamed over its
/// final name (see [`link_path`]).
pub const LINK_SUFFIX: &str = ".link";
/// Suffix of the hidden name a small file received whole in one batch is written
/// under before its rename (see [`small_path`]).
pub const SMALL_SUFFIX: &str = ".small";
/// Hex digits of the stem naming a resumable partial and its journal.
pub const STEM_HEX_DIGITS: usize = 32;
/// How long opening a resumable partial waits for another transfer to let go of it
/// (a connection killed a moment ago may still be winding down) before falling back
/// to a scratch file.
pub const LOCK_WAIT: Duration = Duration::from_millis(500);
const LOCK_POLL: Duration = Duration::from_millis(20);
/// Times opening a resumable partial tries again when the name moved under it.
const OPEN_ATTEMPTS: usize = 3;

/// The stem of the resumable partial and journal for a file named `final_name`.
pub fn stem(final_name: &OsStr) -> String {
    let digest = Hasher::digest(final_name.as_bytes());
    crate::chunk::hex(&digest.into())[..STEM_HEX_DIGITS].to_string()
}

/// The resumable partial and journal paths for the file `final_path`; `None` if it has
/// no file name.
pub fn partial_paths(final_path: &Path) -> Option<(PathBuf, PathBuf)> {
    let dir = parent_dir(final_path);
    let (part, journal) = partial_names(final_path.file_name()?);
    Some((dir.join(part), dir.join(journal)))
}

/// The names (in the same directory) of the resumable partial and journal for a file
/// named `final_name`.
fn partial_names(final_name: &OsStr) -> (String, String) {
    let stem = stem(final_name);
    (
        format!("{TEMP_PREFIX}{stem}{PART_SUFFIX}"),
        format!("{TEMP_PREFIX}{stem}{JOURNAL_SUFFIX}"),
    )
}

/// The hidden name, `.ferry-tmp.<stem>.link`, under which a symlink to be named
/// `final_path` is created before its rename; `None` if it has no file name. Being
/// deterministic, a link a killed copy left there is replaced by the next copy of the
/// same name.
pub fn link_path(final_path: &Path) -> Option<PathBuf> {
    let stem = stem(final_path.file_name()?);
    Some(parent_dir(final_path).join(format!("{TEMP_PREFIX}{stem}{LINK_SUFFIX}")))
}

/// The hidden name, `.ferry-tmp.<stem>.small`, under which a small file received whole
/// in one batch (rcp's batched downloads) is written before its rename; `None` if
/// `final_path` has no file name. Being deterministic, what a killed copy left there is
/// taken over by the next copy of the same name (rcp has no cleaner); ferryd's cleaner
/// treats it as a scratch file.
pub fn small_path(final_path: &Path) -> Option<PathBuf> {
    let stem = stem(final_path.file_name()?);
    Some(parent_dir(final_path).join(format!("{TEMP_PREFIX}{stem}{SMALL_SUFFIX}")))
}

/// A fresh scratch name, `.ferry-tmp.<16 random hex>`, beside `final_path` (to be
/// created with `O_EXCL`: it names nothing yet, almost surely).
pub fn scratch_path(final_path: &Path) -> PathBuf {
    parent_dir(final_path).join(scratch_name())
}

fn scratch_name() -> String {
    format!("{TEMP_PREFIX}{:016x}", rand::random::<u64>())
}

fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    }
}

/// What a hidden temporary name is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TempName {
    /// A resumable partial file, with its stem.
    Part(String),
    /// A resumable partial file's journal, with its stem.
    Journal(String),
    /// Any other temporary name: a scratch file, or a symlink being created
    /// ([`link_path`]).
    Scratch,
}

/// Classifies a directory entry's name: `None` if it is not a temporary name.
pub fn classify(name: &OsStr) -> Option<TempName> {
    let rest = name.as_bytes().strip_prefix(TEMP_PREFIX.as_bytes())?;
    let stem_of = |suffix: &str| {
        let stem = rest.strip_suffix(suffix.as_bytes())?;
        let hex = stem.len() == STEM_HEX_DIGITS
            && stem
                .iter()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b));
        hex.then(|| String::from_utf8_lossy(stem).into_owned())
    };
    Some(if let Some(s) = stem_of(PART_SUFFIX) {
        TempName::Part(s)
    } else if let Some(s) = stem_of(JOURNAL_SUFFIX) {
        TempName::Journal(s)
    } else {
        TempName::Scratch
    })
}

/// A step of staging that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StageOp {
    /// Creating or opening the partial or scratch file.
    Create,
    /// Locking it.
    Lock,
    /// Reading or starting its journal.
    Journal,
    /// Reserving the file's size.
    Reserve,
    /// Renaming it to its final name.
    Rename,
}

impl StageOp {
    /// The operation as a verb, for messages ("cannot {verb}").
    pub fn verb(self) -> &'static str {
        match self {
            StageOp::Create => "create",
            StageOp::Lock => "lock",
            StageOp::Journal => "write the journal",
            StageOp::Reserve => "reserve space",
            StageOp::Rename => "rename into place",
        }
    }
}

/// Why staging failed.
#[derive(Debug, thiserror::Error)]
#[error("cannot {}: {source}", op.verb())]
pub struct StageError {
    /// What was being done.
    pub op: StageOp,
    /// The OS error.
    #[source]
    pub source: io::Error,
}

fn failed(op: StageOp) -> impl FnOnce(io::Error) -> StageError {
    move |source| StageError { op, source }
}

/// The resumable side of a [`Staged`] file.
#[derive(Debug)]
struct Resumable {
    /// The journal's name in [`Staged::dir`].
    journal: CString,
    writer: Arc<JournalWriter>,
}

/// A file being received, not yet under its final name.
#[derive(Debug)]
pub struct Staged {
    /// The directory the file was created in, open; `name` and the journal's name are
    /// relative to it (see the module docs).
    dir: File,
    /// The hidden file's name in `dir`.
    name: CString,
    /// Where the file was created, for messages only (the directory may have moved).
    path: PathBuf,
    file: Arc<File>,
    /// Held until the file is dropped: another transfer or a cleaner trying the lock
    /// sees the file is live.
    _lock: Flock<File>,
    resumable: Option<Resumable>,
    /// The journal's header: appended records are in its algorithm.
    header: JournalHeader,
    hints: BTreeMap<u64, Hash256>,
    /// The algorithm of `hints`: the journal's, or, where the journal was started again
    /// in another algorithm, the old journal's.
    hints_algorithm: HashAlgorithm,
    /// Committed or discarded: nothing is left to remove on drop.
    done: bool,
}

impl Staged {
    /// Opens where the file `final_path`, described by `header`, is received, and
    /// reserves its size. A resumable partial left by an earlier transfer with the same
    /// size, chunk size and source is continued (its journal's chunks become
    /// [`Staged::hints`]); one that does not match is started again. A file that cannot
    /// fit fails with [`StageOp::Reserve`] and leaves nothing behind. Blocking; may wait
    /// up to [`LOCK_WAIT`] for another transfer of the same name.
    ///
    /// The hash algorithm: a journal in an algorithm of `accept` is continued in its own
    /// (so an interrupted transfer resumes in the algorithm it started with; see
    /// [`Staged::header`]); a journal of the same file in another algorithm keeps the
    /// partial's bytes and its chunks as hints ([`Staged::hints_algorithm`]), but is
    /// started again in `header.algorithm`; a fresh journal is in `header.algorithm`.
    pub fn open(
        final_path: &Path,
        header: &JournalHeader,
        accept: Algorithms,
    ) -> Result<Staged, StageError> {
        Staged::open_fit(final_path, header, accept, true)
    }

    /// [`Staged::open`] without reserving the size: the caller reserves it with a
    /// [`space::Deferred`] beside the transfer, before the first write into the file.
    /// A partial longer than the size is cut to it here.
    pub fn open_unreserved(
        final_path: &Path,
        header: &JournalHeader,
        accept: Algorithms,
    ) -> Result<Staged, StageError> {
        Staged::open_fit(final_path, header, accept, false)
    }

    fn open_fit(
        final_path: &Path,
        header: &JournalHeader,
        accept: Algorithms,
        reserve: bool,
    ) -> Result<Staged, StageError> {
        let dir = OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_DIRECTORY)
            .open(parent_dir(final_path))
            .map_err(failed(StageOp::Create))?;
        let staged = match Staged::open_resumable(&dir, final_path, header, accept)? {
            Some(s) => s,
            None => Staged::open_scratch(dir, final_path, header)?,
        };
        staged.fit(header.size, reserve)
    }

    /// Cuts the file to `size` if it is longer and, with `reserve`, reserves `size`.
    fn fit(mut self, size: u64, reserve: bool) -> Result<Staged, StageError> {
        let fit = (|| {
            if self.file.metadata()?.len() > size {
                self.file.set_len(size)?;
            }
            if reserve {
                space::reserve(&self.file, size)?;
            }
            Ok(())
        })();
        match fit {
            Ok(()) => Ok(self),
            Err(e) => {
                self.discard();
                Err(StageError {
                    op: StageOp::Reserve,
                    source: e,
                })
            }
        }
    }

    fn open_scratch(
        dir: File,
        final_path: &Path,
        header: &JournalHeader,
    ) -> Result<Staged, StageError> {
        let scratch = scratch_name();
        let path = parent_dir(final_path).join(&scratch);
        let name = c_name(&scratch);
        let file = open_rw_at(&dir, &name, true).map_err(failed(StageOp::Create))?;
        // The file is new, so the lock is free; failing to take it is an error.
        let lock = match lock(&file, Duration::ZERO) {
            Ok(Some(l)) => l,
            other => {
                let _ = unlinkat(
                    Some(dir.as_raw_fd()),
                    name.as_c_str(),
                    UnlinkatFlags::NoRemoveDir,
                );
                let e = other
                    .err()
                    .unwrap_or_else(|| io::Error::from(Errno::EWOULDBLOCK));
                return Err(failed(StageOp::Lock)(e));
            }
        };
        Ok(Staged {
            dir,
            name,
            path,
            file: Arc::new(file),
            _lock: lock,
            resumable: None,
            header: *header,
            hints: BTreeMap::new(),
            hints_algorithm: header.algorithm,
            done: false,
        })
    }

    /// The resumable partial of `final_path`, or `None` where it cannot be had (held
    /// by another live transfer, or something other than a regular file is there).
    fn open_resumable(
        dir: &File,
        final_path: &Path,
        header: &JournalHeader,
        accept: Algorithms,
    ) -> Result<Option<Staged>, StageError> {
        let Some(final_name) = final_path.file_name() else {
            return Ok(None);
        };
        let (part_name, journal_name) = partial_names(final_name);
        let (part, journal) = (c_name(&part_name), c_name(&journal_name));
        for _ in 0..OPEN_ATTEMPTS {
            let (file, fresh) = match open_rw_at(dir, &part, false) {
                Ok(f) => (f, false),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    match open_rw_at(dir, &part, true) {
                        Ok(f) => (f, true),
                        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                        Err(e) => return Err(failed(StageOp::Create)(e)),
                    }
                }
                // A symlink planted under the partial's name (O_NOFOLLOW): not ours.
                Err(e) if e.raw_os_error() == Some(Errno::ELOOP as i32) => return Ok(None),
                Err(e) => return Err(failed(StageOp::Create)(e)),
            };
            let meta = file.metadata().map_err(failed(StageOp::Create))?;
            if !meta.is_file() {
                return Ok(None);
            }
            let Some(lock) = lock(&file, LOCK_WAIT).map_err(failed(StageOp::Lock))? else {
                return Ok(None);
            };
            if !names_at(dir, &part, &meta) {
                continue;
            }
            let jfile = open_rw_at(dir, &journal, false)
                .or_else(|e| match e.kind() {
                    io::ErrorKind::NotFound => open_rw_at(dir, &journal, true),
                    _ => Err(e),
                })
                .map_err(failed(StageOp::Journal))?;
            let found = if fresh {
                None
            } else {
                read_from(&jfile)
                    .ok()
                    .filter(|c| c.header.same_file(header))
            };
            let (writer, hints, used, hints_algorithm) = match found {
                Some(c) if accept.contains(c.header.algorithm) => (
                    JournalWriter::resume(jfile, &c),
                    c.chunks,
                    c.header,
                    c.header.algorithm,
                ),
                Some(c) => (
                    JournalWriter::create(jfile, header),
                    c.chunks,
                    *header,
                    c.header.algorithm,
                ),
                None => {
                    // Nothing to resume: the partial's old bytes are of no use.
                    file.set_len(0).map_err(failed(StageOp::Create))?;
                    (
                        JournalWriter::create(jfile, header),
                        BTreeMap::new(),
                        *header,
                        header.algorithm,
                    )
                }
            };
            let writer = writer.map_err(failed(StageOp::Journal))?;
            return Ok(Some(Staged {
                dir: dir.try_clone().map_err(failed(StageOp::Create))?,
                name: part,
                path: parent_dir(final_path).join(part_name),
                file: Arc::new(file),
                _lock: lock,
                resumable: Some(Resumable {
                    journal,
                    writer: Arc::new(writer),
                }),
                header: used,
                hints,
                hints_algorithm,
                done: false,
            }));
        }
        Ok(None)
    }

    /// The open file the bytes go to.
    pub fn file(&self) -> &Arc<File> {
        &self.file
    }

    /// Where the bytes were put (a hidden name in the final name's directory): for
    /// messages, as the directory may have been renamed since.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// True if the file is a resumable partial with a journal.
    pub fn is_resumable(&self) -> bool {
        self.resumable.is_some()
    }

    /// The chunks an earlier, interrupted transfer recorded as written: index to hash.
    /// Hints only: verify each against the file's bytes before trusting it.
    pub fn hints(&self) -> &BTreeMap<u64, Hash256> {
        &self.hints
    }

    /// The algorithm of [`Staged::hints`].
    pub fn hints_algorithm(&self) -> HashAlgorithm {
        self.hints_algorithm
    }

    /// The header of the file's journal (for a scratch file, the one it was opened
    /// with): records appended to [`Staged::journal`] must be in its algorithm.
    pub fn header(&self) -> &JournalHeader {
        &self.header
    }

    /// The journal to record written chunks in ([`JournalWriter::append`], after the
    /// chunk's bytes were written); `None` for a scratch file.
    pub fn journal(&self) -> Option<Arc<JournalWriter>> {
        self.resumable.as_ref().map(|r| r.writer.clone())
    }

    /// Renames the file to the file name of `final_path`, in the directory it was
    /// opened in (wherever that directory is now), and removes its journal. The caller
    /// has set its attributes and synced it. A directory under the final name fails
    /// with `EISDIR`. Blocking.
    pub fn commit(&mut self, final_path: &Path) -> Result<(), StageError> {
        let Some(final_name) = final_path.file_name() else {
            return Err(failed(StageOp::Rename)(io::ErrorKind::InvalidInput.into()));
        };
        let dir = Some(self.dir.as_raw_fd());
        renameat(dir, self.name.as_c_str(), dir, final_name)
            .map_err(|e| failed(StageOp::Rename)(e.into()))?;
        self.done = true;
        if let Some(r) = &self.resumable {
            self.remove_quietly(&r.journal);
        }
        Ok(())
    }

    /// Removes the file and its journal: the transfer failed for good. Blocking.
    pub fn discard(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        self.remove_quietly(&self.name);
        if let Some(r) = &self.resumable {
            self.remove_quietly(&r.journal);
        }
    }

    /// Removes `name` from the file's directory; one that is already gone is fine, any
    /// other failure is logged.
    fn remove_quietly(&self, name: &CString) {
        match unlinkat(
            Some(self.dir.as_raw_fd()),
            name.as_c_str(),
            UnlinkatFlags::NoRemoveDir,
        ) {
            Ok(()) | Err(Errno::ENOENT) => {}
            Err(e) => {
                tracing::warn!(dir = %parent_dir(&self.path).display(), name = ?name, "cannot remove temporary file: {e}")
            }
        }
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let Some(r) = &self.resumable else {
            // A scratch file does not outlive its transfer.
            self.remove_quietly(&self.name);
            return;
        };
        // A resumable partial does, if it holds anything to resume.
        let mut held: BTreeSet<u64> = self.hints.keys().copied().collect();
        held.extend(r.writer.appended());
        if held.is_empty() {
            self.discard();
        } else if let Err(e) = release_unheld(&self.file, &self.header, &held) {
            tracing::debug!(path = %self.path.display(), "cannot release a partial file's unused space: {e}");
        }
    }
}

/// Gives back the space of the chunks of `file` not in `held` (not empty): cuts the
/// file after the last held chunk and punches holes where the others were reserved.
/// Blocking.
fn release_unheld(file: &File, header: &JournalHeader, held: &BTreeSet<u64>) -> io::Result<()> {
    let c = u64::from(header.chunk_bytes);
    let Some(&last) = held.last() else {
        return Ok(());
    };
    file.set_len(((last + 1) * c).min(header.size))?;
    let mut i = 0;
    while i < last {
        if held.contains(&i) {
            i += 1;
            continue;
        }
        let start = i;
        while i < last && !held.contains(&i) {
            i += 1;
        }
        space::release(file, start * c, (i - start) * c)?;
    }
    Ok(())
}

/// A step of [`write_whole`] that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WholeStep {
    /// Writing the bytes.
    Write,
    /// Setting the permission bits.
    Chmod,
    /// Setting the modification time.
    SetMtime,
}

impl WholeStep {
    /// The step as a verb, for messages ("cannot {verb}").
    pub fn verb(self) -> &'static str {
        match self {
            WholeStep::Write => "write",
            WholeStep::Chmod => "chmod",
            WholeStep::SetMtime => "set mtime",
        }
    }

    /// "cannot {verb}", as a local error's operation.
    pub fn cannot(self) -> &'static str {
        match self {
            WholeStep::Write => "cannot write",
            WholeStep::Chmod => "cannot chmod",
            WholeStep::SetMtime => "cannot set mtime",
        }
    }
}

/// Writes `bytes` to the empty `file` (a hidden file a small file is received into
/// whole), then sets its permission bits to `mode & 0o7777` and its mtime, all through
/// the descriptor; on failure, returns the step that failed. Blocking.
pub fn write_whole(
    file: &mut File,
    bytes: &[u8],
    mode: u32,
    mtime: Timestamp,
) -> Result<(), (WholeStep, io::Error)> {
    file.write_all(bytes).map_err(|e| (WholeStep::Write, e))?;
    file.set_permissions(fs::Permissions::from_mode(mode & 0o7777))
        .map_err(|e| (WholeStep::Chmod, e))?;
    file.set_modified(mtime.to_system())
        .map_err(|e| (WholeStep::SetMtime, e))
}

/// Removes the temporary file `path`; one that is already gone is fine, any other
/// failure is logged. Blocking.
pub fn remove_quietly(path: &Path) {
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(path = %path.display(), "cannot remove temporary file: {e}"),
    }
}

/// Opens `name` in `dir` for reading and writing without following a final symlink;
/// with `create`, creates it (mode 0600) and fails if it exists.
fn open_rw_at(dir: &File, name: &CString, create: bool) -> io::Result<File> {
    let mut flags = OFlag::O_RDWR | OFlag::O_NOFOLLOW;
    if create {
        flags |= OFlag::O_CREAT | OFlag::O_EXCL;
    }
    open_at_mode(dir, name, flags, Mode::from_bits_truncate(0o600))
}

/// A temporary name (no NUL: made of [`TEMP_PREFIX`], hex digits and a suffix).
fn c_name(name: &str) -> CString {
    CString::new(name).expect("a temporary name holds no NUL byte")
}

/// True if `path` still names the file `meta` was taken from.
pub fn names(path: &Path, meta: &fs::Metadata) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.dev() == meta.dev() && m.ino() == meta.ino())
}

/// True if `name` in `dir` still names the file `meta` was taken from.
fn names_at(dir: &File, name: &CString, meta: &fs::Metadata) -> bool {
    fstatat(
        Some(dir.as_raw_fd()),
        name.as_c_str(),
        nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
    )
    .is_ok_and(|st| st.st_dev == meta.dev() && st.st_ino == meta.ino())
}

/// Takes an exclusive `flock` on `file`'s open file description (through a duplicate
/// descriptor, so the lock lasts while the returned guard lives), waiting up to `wait`
/// for another holder; `Ok(None)` if it is still held after that. Blocking.
pub fn lock(file: &File, wait: Duration) -> io::Result<Option<Flock<File>>> {
    let deadline = Instant::now() + wait;
    loop {
        match Flock::lock(file.try_clone()?, FlockArg::LockExclusiveNonblock) {
            Ok(l) => return Ok(Some(l)),
            Err((_, Errno::EWOULDBLOCK)) if Instant::now() < deadline => {
                std::thread::sleep(LOCK_POLL)
            }
            Err((_, Errno::EWOULDBLOCK)) => return Ok(None),
            Err((_, e)) => return Err(e.into()),
        }
    }
}

/// True if chunk `index` of `file` (a file of `header.size` bytes in chunks of
/// `header.chunk_bytes`) is there and hashes to `expected` in `algorithm`. `buf` must
/// hold a chunk.
/// A read error counts as a mismatch. Blocking.
pub fn chunk_matches(
    file: &File,
    header: &JournalHeader,
    algorithm: HashAlgorithm,
    index: u64,
    expected: &Hash256,
    buf: &mut [u8],
) -> bool {
    let len = chunk_len(header.size, header.chunk_bytes, index) as usize;
    let offset = index * u64::from(header.chunk_bytes);
    len <= buf.len()
        && file.read_exact_at(&mut buf[..len], offset).is_ok()
        && hash_chunk(algorithm, &buf[..len]) == *expected
}

/// The `hints` (hashes in `algorithm`) whose chunk `file` holds with the hinted hash,
/// checked on all cores. Blocking.
pub fn verify_hints(
    file: &File,
    header: &JournalHeader,
    algorithm: HashAlgorithm,
    hints: &BTreeMap<u64, Hash256>,
) -> BTreeMap<u64, Hash256> {
    let hints: Vec<(u64, Hash256)> = hints.iter().map(|(&i, h)| (i, *h)).collect();
    hints
        .into_par_iter()
        .map_init(
            || vec![0u8; header.chunk_bytes as usize],
            |buf, (i, h)| chunk_matches(file, header, algorithm, i, &h, buf).then_some((i, h)),
        )
        .flatten()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::read_journal;

    const C: u32 = 4096;

    fn header(size: u64) -> JournalHeader {
        JournalHeader {
            algorithm: HashAlgorithm::Blake3,
            size,
            chunk_bytes: C,
            source: [0; 32],
        }
    }

    fn temp_entries(dir: &Path) -> Vec<TempName> {
        let mut v: Vec<_> = fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| classify(&e.unwrap().file_name()))
            .collect();
        v.sort_by_key(|t| format!("{t:?}"));
        v
    }

    #[test]
    fn names_are_classified() {
        let (part, journal) = partial_paths(Path::new("/d/some file.bin")).unwrap();
        let s = stem(OsStr::new("some file.bin"));
        assert_eq!(s.len(), STEM_HEX_DIGITS);
        assert_eq!(
            classify(part.file_name().unwrap()),
            Some(TempName::Part(s.clone()))
        );
        assert_eq!(
            classify(journal.file_name().unwrap()),
            Some(TempName::Journal(s))
        );
        assert_eq!(part.parent(), Some(Path::new("/d")));
        assert_eq!(
            classify(OsStr::new(".ferry-tmp.0123456789abcdef")),
            Some(TempName::Scratch)
        );
        assert_eq!(
            classify(OsStr::new(
                ".ferry-tmp.0123456789ABCDEF0123456789abcdef.part"
            )),
            Some(TempName::Scratch)
        );
        assert_eq!(classify(OsStr::new("x.part")), None);
        let small = small_path(Path::new("d/s")).unwrap();
        assert_eq!(small.parent(), Some(Path::new("d")));
        assert_eq!(
            classify(small.file_name().unwrap()),
            Some(TempName::Scratch)
        );
        let link = link_path(Path::new("d/l")).unwrap();
        assert_eq!(link.parent(), Some(Path::new("d")));
        assert_eq!(classify(link.file_name().unwrap()), Some(TempName::Scratch));
        // A long final name still gives a short partial name.
        let long = "n".repeat(255);
        let (part, _) = partial_paths(Path::new(&long)).unwrap();
        assert!(part.file_name().unwrap().len() < 64);
        assert_eq!(part.parent(), Some(Path::new(".")));
    }

    /// The directory a staged file was opened in is renamed, and a new directory with
    /// a same-named hidden file appears at the old path: every later step acts on the
    /// staged file where it now is, never on the impostor.
    #[test]
    fn a_staged_file_follows_its_directory_when_that_is_renamed() {
        let root = tempfile::tempdir().unwrap();
        let (old, new) = (root.path().join("d"), root.path().join("d2"));
        let h = header(2 * u64::from(C));
        let impostor = |dir: &Path| {
            fs::create_dir(dir).unwrap();
            let (part, journal) = partial_paths(&dir.join("f")).unwrap();
            fs::write(&part, b"not ours").unwrap();
            fs::write(&journal, b"not ours").unwrap();
        };

        // Dropped with nothing journaled: removed from where it is now.
        fs::create_dir(&old).unwrap();
        let s = Staged::open(&old.join("f"), &h, Algorithms::ALL).unwrap();
        fs::rename(&old, &new).unwrap();
        impostor(&old);
        drop(s);
        assert_eq!(temp_entries(&new), vec![]);
        assert_eq!(temp_entries(&old).len(), 2, "the impostors are left alone");

        // Discarded: the same.
        fs::remove_dir_all(&old).unwrap();
        fs::rename(&new, &old).unwrap();
        let mut s = Staged::open(&old.join("f"), &h, Algorithms::ALL).unwrap();
        fs::rename(&old, &new).unwrap();
        impostor(&old);
        s.discard();
        assert_eq!(temp_entries(&new), vec![]);
        assert_eq!(temp_entries(&old).len(), 2);

        // Committed: the file takes its final name in the renamed directory.
        fs::remove_dir_all(&old).unwrap();
        fs::rename(&new, &old).unwrap();
        let mut s = Staged::open(&old.join("f"), &h, Algorithms::ALL).unwrap();
        s.file().write_all_at(b"mine", 0).unwrap();
        fs::rename(&old, &new).unwrap();
        impostor(&old);
        s.commit(&old.join("f")).unwrap();
        assert_eq!(&fs::read(new.join("f")).unwrap()[..4], b"mine");
        assert_eq!(temp_entries(&new), vec![]);
        assert!(!old.join("f").exists());
        assert_eq!(temp_entries(&old).len(), 2);

        // A directory under the final name: EISDIR, and the file is still there.
        fs::create_dir(new.join("g")).unwrap();
        let mut s = Staged::open(&new.join("g"), &h, Algorithms::ALL).unwrap();
        let e = s.commit(&new.join("g")).unwrap_err();
        assert_eq!(e.source.raw_os_error(), Some(nix::libc::EISDIR));
        drop(s);
        assert_eq!(temp_entries(&new), vec![]);
    }

    #[test]
    fn an_interrupted_partial_is_resumed_and_a_commit_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let dst = dir.path().join("f.bin");
        let h = header(3 * u64::from(C) + 5);
        let s = Staged::open(&dst, &h, Algorithms::ALL).unwrap();
        assert!(s.is_resumable());
        assert!(s.hints().is_empty());
        assert_eq!(s.file().metadata().unwrap().len(), h.size);
        let chunk = vec![7u8; C as usize];
        s.file().write_all_at(&chunk, u64::from(C)).unwrap();
        s.journal()
            .unwrap()
            .append(1, &hash_chunk(HashAlgorithm::Blake3, &chunk))
            .unwrap();
        // A lying record: chunk 2 was never written.
        s.journal()
            .unwrap()
            .append(2, &hash_chunk(HashAlgorithm::Blake3, &chunk))
            .unwrap();
        drop(s); // interrupted: both files stay, holding chunks 1 and 2 only
        assert_eq!(temp_entries(dir.path()).len(), 2);
        let (part, _) = partial_paths(&dst).unwrap();
        assert_eq!(fs::metadata(&part).unwrap().len(), 3 * u64::from(C));

        let mut s = Staged::open(&dst, &h, Algorithms::ALL).unwrap();
        assert_eq!(s.hints().len(), 2);
        let good = verify_hints(s.file(), &h, HashAlgorithm::Blake3, s.hints());
        assert_eq!(good.keys().copied().collect::<Vec<_>>(), vec![1]);
        let mut buf = vec![0u8; C as usize];
        assert!(chunk_matches(
            s.file(),
            &h,
            HashAlgorithm::Blake3,
            1,
            &hash_chunk(HashAlgorithm::Blake3, &chunk),
            &mut buf
        ));
        assert!(!chunk_matches(
            s.file(),
            &h,
            HashAlgorithm::Blake3,
            0,
            &hash_chunk(HashAlgorithm::Blake3, &chunk),
            &mut buf
        ));
        s.commit(&dst).unwrap();
        assert!(temp_entries(dir.path()).is_empty());
        assert_eq!(
            fs::read(&dst).unwrap()[C as usize..2 * C as usize],
            chunk[..]
        );
    }

    #[test]
    fn a_different_file_starts_over() {
        let dir = tempfile::tempdir().unwrap();
        let dst = dir.path().join("f.bin");
        let s = Staged::open(&dst, &header(4 * u64::from(C)), Algorithms::ALL).unwrap();
        s.file().write_all_at(&[1; 16], 0).unwrap();
        s.journal().unwrap().append(0, &[1; 32]).unwrap();
        drop(s);
        for other in [
            header(5 * u64::from(C)),
            JournalHeader {
                source: [9; 32],
                ..header(4 * u64::from(C))
            },
        ] {
            let s = Staged::open(&dst, &other, Algorithms::ALL).unwrap();
            assert!(s.hints().is_empty(), "{other:?}");
            let mut b = [9u8; 16];
            s.file().read_exact_at(&mut b, 0).unwrap();
            assert_eq!(b, [0; 16], "the old bytes were dropped");
            let (_, journal) = partial_paths(&dst).unwrap();
            assert_eq!(read_journal(&journal).unwrap().header, other);
            // Interrupted again, holding a chunk, for the next round.
            s.file().write_all_at(&[1; 16], 0).unwrap();
            s.journal().unwrap().append(0, &[1; 32]).unwrap();
            drop(s);
        }
    }

    #[test]
    fn a_held_partial_makes_the_second_transfer_use_a_scratch_file() {
        let dir = tempfile::tempdir().unwrap();
        let dst = dir.path().join("f.bin");
        let h = header(2 * u64::from(C));
        let first = Staged::open(&dst, &h, Algorithms::ALL).unwrap();
        let started = Instant::now();
        let second = Staged::open(&dst, &h, Algorithms::ALL).unwrap();
        assert!(started.elapsed() >= LOCK_WAIT);
        assert!(first.is_resumable() && !second.is_resumable());
        assert!(second.journal().is_none());
        assert_eq!(
            classify(second.path().file_name().unwrap()),
            Some(TempName::Scratch)
        );
        drop(second); // a scratch file goes with its transfer
        assert_eq!(temp_entries(dir.path()).len(), 2);
        let mut first = first;
        first.discard();
        assert!(temp_entries(dir.path()).is_empty());
    }

    #[test]
    fn a_partial_that_holds_nothing_goes_and_a_failed_reservation_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let dst = dir.path().join("f.bin");
        for size in [0, 3 * u64::from(C)] {
            let s = Staged::open(&dst, &header(size), Algorithms::ALL).unwrap();
            assert!(s.is_resumable());
            drop(s);
            assert!(temp_entries(dir.path()).is_empty(), "{size}");
        }
        // What a killed transfer of an empty file leaves is taken over and renamed.
        let (part, journal) = partial_paths(&dst).unwrap();
        fs::write(&part, b"").unwrap();
        fs::write(&journal, header(0).encode()).unwrap();
        let mut s = Staged::open(&dst, &header(0), Algorithms::ALL).unwrap();
        assert!(s.is_resumable());
        s.commit(&dst).unwrap();
        assert!(temp_entries(dir.path()).is_empty());
        assert_eq!(fs::metadata(&dst).unwrap().len(), 0);
        for size in [u64::MAX, u64::MAX / 2] {
            let e = Staged::open(&dst, &header(size), Algorithms::ALL).unwrap_err();
            assert_eq!(e.op, StageOp::Reserve);
            assert!(temp_entries(dir.path()).is_empty());
        }
    }

    #[test]
    fn a_symlink_under_the_partial_name_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let dst = dir.path().join("f.bin");
        let target = dir.path().join("victim");
        fs::write(&target, b"keep").unwrap();
        let (part, _) = partial_paths(&dst).unwrap();
        std::os::unix::fs::symlink(&target, &part).unwrap();
        let s = Staged::open(&dst, &header(3 * u64::from(C)), Algorithms::ALL).unwrap();
        assert!(!s.is_resumable());
        drop(s);
        assert_eq!(fs::read(&target).unwrap(), b"keep");
    }
}
