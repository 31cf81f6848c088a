//! The requests of a writable mount (the `write` capability): files open for writing
//! through handles ([`OpenFile`]), `Move` and `SetAttrs`. Filesystem calls block
//! (run them off the async threads); a handle's writes and reads move their bytes with
//! one-sided operations through the connection's pool of chunk buffers.
//!
//! Invariants:
//! - Paths are resolved as every write's are ([`Share::resolve_for_write`]: a
//!   writable share, inside it, not the root) and the final component is never
//!   followed: a file is opened with `O_NOFOLLOW` (a symlink there is refused),
//!   renames and attribute changes act on the entry itself. Names starting with
//!   [`RESERVED_PREFIX`] (the server's own) are refused.
//! - A *staged* handle writes a hidden file (`.ferry-tmp.<16 hex>`, a scratch name
//!   the startup cleanup removes after a crash) in the final name's directory, locked
//!   while the handle lives; it takes the final name only at its commit (first
//!   `FileSync` or `FileClose`): fsync, rename (`RENAME_NOREPLACE` when opened
//!   `exclusive`), fsync of the directory. A handle dropped before its commit removes
//!   its hidden file. After the commit the handle writes the file in place.
//! - `FileWrite` writes an extent only after its bytes, pulled with a one-sided READ,
//!   hashed to the client's hash; extents are pulled in groups of at most one chunk
//!   buffer, and no extent of a group is written unless every extent of the group
//!   verified. A group that fails verification fails the request; other groups of the
//!   same request may have been written (the client treats the whole write as failed).
//! - Every operation of a request on a lent buffer completes before the request
//!   answers (its tasks are all awaited, failed or not), so no buffer is lent again
//!   while the transport may still fill or drain it.
//! - A file changed through a handle (write, size, allocation, commit) has every
//!   manifest of its inode forgotten, cached ([`ManifestCache::forget`]) and recorded
//!   ([`crate::store::ManifestStore::forget`]): its ctime may not have moved within
//!   the timestamp tick, so no key could tell the old version from the new one.

use std::fs::{self, File, OpenOptions, Permissions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_common::attr::attr_of;
use ferry_common::chunk::{chunk_len, hash_chunk};
use ferry_common::direct::DirectFile;
use ferry_common::msg::{
    Attr, Extent, FallocMode, Hash256, HashAlgorithm, RegionDesc, Response, SetAttrs, Timestamp,
};
use ferry_common::staging::{lock, scratch_path};
use ferry_common::transport::{RemoteSlice, SharedTransport, TransportError};
use ferry_common::writeback::Writeback;
use nix::fcntl::{renameat2, FallocateFlags, RenameFlags};
use nix::sys::stat::{futimens, utimensat, UtimensatFlags};
use nix::sys::time::TimeSpec;
use nix::unistd::{fchownat, Gid, Uid};
use rayon::prelude::*;
use tokio::task::{JoinError, JoinSet};

use crate::fdtree::RESERVED_PREFIX;
use crate::filekey::{mtime_settled, ManifestKey};
use crate::fsops::{check_regular, lstat, no_dir_in_the_way, FsError};
use crate::links::Rekey;
use crate::manifests::ManifestCache;
use crate::meta::applies_owners;
use crate::pool::{Pool, PoolError};
use crate::share::{Share, ShareError};
use crate::traffic::Traffic;
use crate::written::WrittenChunks;

/// A filesystem call of this module that failed, as a verb ("cannot {verb}").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileOp {
    /// `lstat` or `fstat`.
    Stat,
    /// Opening the file.
    Open,
    /// Creating the hidden file of a staged handle.
    Create,
    /// `pwrite`.
    Write,
    /// `pread`.
    Read,
    /// `ftruncate`.
    Truncate,
    /// `fchown` / `lchown`.
    Chown,
    /// `fchmod`.
    Chmod,
    /// `futimens` / `utimensat`.
    SetTimes,
    /// `fallocate`.
    Allocate,
    /// `fsync` / `fdatasync` of the file.
    Fsync,
    /// `rename` / `renameat2`.
    Rename,
    /// `fsync` of a directory after a rename.
    FsyncDir,
}

impl FileOp {
    /// The operation as a verb, for messages.
    pub fn verb(self) -> &'static str {
        match self {
            FileOp::Stat => "stat",
            FileOp::Open => "open",
            FileOp::Create => "create",
            FileOp::Write => "write",
            FileOp::Read => "read",
            FileOp::Truncate => "truncate",
            FileOp::Chown => "chown",
            FileOp::Chmod => "chmod",
            FileOp::SetTimes => "set times",
            FileOp::Allocate => "allocate",
            FileOp::Fsync => "fsync",
            FileOp::Rename => "rename",
            FileOp::FsyncDir => "fsync the directory",
        }
    }
}

/// A failed write-capability request, naming the share-relative path
/// (`share/dir/file`) it is about.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The path cannot be used (see [`ShareError`]).
    #[error(transparent)]
    Share(#[from] ShareError),
    /// The caller may not make this on the share ([`crate::owners`]).
    #[error(transparent)]
    Refused(#[from] crate::owners::Refused),
    /// A directory is in the way, or the path names no regular file (see
    /// [`FsError`]).
    #[error(transparent)]
    Fs(#[from] FsError),
    /// No chunk buffer could be lent.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// A filesystem call failed.
    #[error("{path}: cannot {}", op.verb())]
    Io {
        /// The path.
        path: String,
        /// Which call.
        op: FileOp,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The final component names one of the server's own names.
    #[error("{path}: names starting with '{RESERVED_PREFIX}' are reserved")]
    Reserved {
        /// The path.
        path: String,
    },
    /// The final component is a symlink, which these requests never follow.
    #[error("{path}: is a symlink (never followed)")]
    Symlink {
        /// The path.
        path: String,
    },
    /// `FileOpen` with `exclusive` of an existing name.
    #[error("{path}: already exists")]
    Exists {
        /// The path.
        path: String,
    },
    /// `FileOpen` without `create` of a missing name.
    #[error("{path}: no such file or directory")]
    NotFound {
        /// The path.
        path: String,
    },
    /// A mode or size change of a symlink, or a size change of something else than a
    /// regular file.
    #[error("{path}: cannot set the {what} of a {kind}")]
    AttrRefused {
        /// The path.
        path: String,
        /// The attribute.
        what: &'static str,
        /// What the path names.
        kind: &'static str,
    },
    /// An owner change asked of a server that does not run as root.
    #[error("{path}: cannot chown: only a server running as root changes owners")]
    NotRoot {
        /// The path.
        path: String,
    },
    /// A write whose hashes are in another algorithm than the share's (the one its
    /// data is hashed in, which the session accepts: see `Request::ShareInfo`).
    #[error("{path}: hashes in {algorithm}, but the share hashes its data in {wanted}")]
    Algorithm {
        /// The file.
        path: String,
        /// The algorithm named.
        algorithm: HashAlgorithm,
        /// The share's.
        wanted: HashAlgorithm,
    },
    /// An extent whose pulled bytes do not hash to the client's hash.
    #[error("{path}: the extent at offset {offset} ({len} bytes) failed {algorithm} verification; nothing of it was written")]
    Integrity {
        /// The file.
        path: String,
        /// The algorithm of the hash it failed.
        algorithm: HashAlgorithm,
        /// The extent's file offset.
        offset: u64,
        /// Its length.
        len: u32,
    },
    /// A piece that does not lie in the client's region.
    #[error("{path}: bytes outside the client's region")]
    OutsideRegion {
        /// The file.
        path: String,
    },
    /// A one-sided READ or WRITE failed.
    #[error("{path}: transfer failed")]
    Transport {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: TransportError,
    },
    /// A blocking task of a write or read failed.
    #[error("{path}: server task failed")]
    Task {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: JoinError,
    },
    /// The file shrank while it was read.
    #[error("{path}: the file shrank while it was being read")]
    Shrank {
        /// The file.
        path: String,
    },
}

impl FileError {
    fn io(path: &str, op: FileOp) -> impl FnOnce(io::Error) -> FileError + '_ {
        move |source| FileError::Io {
            path: path.into(),
            op,
            source,
        }
    }
}

fn errno(path: &str, op: FileOp) -> impl FnOnce(nix::errno::Errno) -> FileError + '_ {
    move |e| FileError::Io {
        path: path.into(),
        op,
        source: io::Error::from(e),
    }
}

/// What a handle writes.
enum Stage {
    /// The file under its own name.
    InPlace,
    /// A hidden file that takes `final_path` at the commit.
    Staged {
        tmp: PathBuf,
        final_path: PathBuf,
        /// Take the name only if it is still free (`RENAME_NOREPLACE`).
        exclusive: bool,
        /// The hidden file's lock, held while the handle lives (the startup cleanup
        /// leaves locked hidden files alone).
        _lock: Option<nix::fcntl::Flock<File>>,
    },
}

/// What a commit makes durable before the rename.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Durability {
    /// Nothing (`FileCommit`, `FileClose`).
    None,
    /// The data (`fdatasync`): no name on a half-written file after a crash.
    Data,
    /// Data and metadata, and the directory after the rename (`fsync`).
    All,
}

/// What a file request moves data with: the connection's transport, its buffer pool,
/// and the server's traffic counters.
#[derive(Clone)]
pub struct FileIo {
    /// The connection's transport (one-sided READs and WRITEs).
    pub transport: SharedTransport,
    /// The connection's chunk buffers.
    pub pool: Arc<Pool>,
    /// The server's counters.
    pub traffic: Arc<Traffic>,
}

/// A file open for writing through a handle.
pub struct OpenFile {
    what: String,
    share: Arc<Share>,
    file: Arc<File>,
    /// Where a staged file's extents go: the big ones (a stream of writes) direct to
    /// the disk, not through the page cache (see [`ferry_common::direct`]). Only while
    /// the file is staged: nobody else can map a file with no name, and a direct write
    /// cannot invalidate pages another process maps. In-place writes are buffered.
    out: DirectFile,
    /// Flushes a file being written in the background (every
    /// `WRITEBACK_STEP_BYTES` written through the page cache), so an `fsync` after a
    /// big write has little left to do; its errors are returned by the next sync.
    writeback: Writeback,
    stage: Mutex<Stage>,
    chunk_bytes: u32,
    manifests: Arc<ManifestCache>,
    /// Changed through the handle since its last sync (so a close has something to
    /// make durable).
    dirty: std::sync::atomic::AtomicBool,
    /// While staged: the chunk hashes its writes carried, recorded at the commit.
    written: Mutex<WrittenChunks>,
    /// The client set the file's mtime after its last change (`cp -p`, `tar x`): the
    /// commit keeps it as it is ([`OpenFile::stamp_after_the_tick`]).
    mtime_given: std::sync::atomic::AtomicBool,
}

/// `FileOpen` of `rel` in `share` (see [`ferry_common::msg::Request::FileOpen`] and
/// the module docs); `chunk_bytes` is the size of the connection's chunk buffers, and
/// `manifests` the cache whose entries of the file are forgotten when it changes.
/// Blocking.
pub fn open(
    share: Arc<Share>,
    rel: &str,
    create: Option<u32>,
    exclusive: bool,
    truncate: bool,
    chunk_bytes: u32,
    manifests: Arc<ManifestCache>,
) -> Result<OpenFile, FileError> {
    let what = share.display(rel);
    let path = resolve(&share, rel)?;
    let existing = match fs::symlink_metadata(&path) {
        Ok(m) => Some(m),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(FileError::io(&what, FileOp::Stat)(e)),
    };
    let new = |file: File, stage: Stage| {
        let file = Arc::new(file);
        OpenFile {
            what: what.clone(),
            share: share.clone(),
            writeback: Writeback::new(file.clone()),
            out: match &stage {
                Stage::Staged { .. } => DirectFile::on_demand(file.clone()),
                Stage::InPlace => DirectFile::buffered(file.clone()),
            },
            file,
            stage: Mutex::new(stage),
            chunk_bytes,
            manifests: manifests.clone(),
            dirty: std::sync::atomic::AtomicBool::new(false),
            written: Mutex::new(WrittenChunks::new(chunk_bytes)),
            mtime_given: std::sync::atomic::AtomicBool::new(false),
        }
    };
    let (mode, owner) = match &existing {
        Some(_) if exclusive => return Err(FileError::Exists { path: what }),
        Some(m) if m.file_type().is_symlink() => return Err(FileError::Symlink { path: what }),
        Some(m) => {
            check_regular(m, &what)?;
            // A caller's truncation is the file's own, as on a local file system: its
            // inode, links and owner stay (the caller may not own it).
            let in_place = !truncate || crate::owners::acting();
            if in_place {
                return Ok(new(open_in_place(&path, &what, truncate)?, Stage::InPlace));
            }
            let owner = applies_owners().then_some((m.uid(), m.gid()));
            (m.mode() & 0o7777, owner)
        }
        None => match create {
            Some(mode) => {
                crate::owners::check_setid(mode)?;
                (mode & 0o7777, None)
            }
            None => return Err(FileError::NotFound { path: what }),
        },
    };
    let tmp = scratch_path(&path);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&tmp)
        .map_err(FileError::io(&what, FileOp::Create))?;
    if existing.is_some() {
        keep_xattrs(&path, &tmp, &what);
    }
    let lock = lock(&file, Duration::ZERO).ok().flatten();
    // From here on, dropping `opened` removes the hidden file.
    let opened = new(
        file,
        Stage::Staged {
            tmp,
            final_path: path,
            exclusive,
            _lock: lock,
        },
    );
    set_owner_and_mode(&opened.file, owner, mode, &what)?;
    Ok(opened)
}

/// Opens the existing regular file `path` (`what`) to write it in place, never
/// through a symlink; empties it if `truncate`.
fn open_in_place(path: &Path, what: &str, truncate: bool) -> Result<File, FileError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| open_error(what, e))?;
    let meta = file.metadata().map_err(FileError::io(what, FileOp::Stat))?;
    check_regular(&meta, what)?;
    if truncate {
        file.set_len(0)
            .map_err(FileError::io(what, FileOp::Truncate))?;
    }
    Ok(file)
}

/// Gives a new staged file (`what`) the `owner` of the file it replaces, if any, and
/// then exactly `mode`: after the chown (which clears set-id bits), and not under the
/// umask.
fn set_owner_and_mode(
    file: &File,
    owner: Option<(u32, u32)>,
    mode: u32,
    what: &str,
) -> Result<(), FileError> {
    if let Some((uid, gid)) = owner {
        nix::unistd::fchown(
            file.as_raw_fd(),
            Some(Uid::from_raw(uid)),
            Some(Gid::from_raw(gid)),
        )
        .map_err(errno(what, FileOp::Chown))?;
    }
    file.set_permissions(Permissions::from_mode(mode))
        .map_err(FileError::io(what, FileOp::Chmod))
}

/// Gives the staged file `tmp`, which is to replace `path`, the extended attributes
/// of `path`, as a truncation in place would keep them (best effort, like its owner
/// when ferryd is not root).
fn keep_xattrs(path: &Path, tmp: &Path, what: &str) {
    if let Err(e) = ferry_common::xattr::copy_all(path, tmp) {
        tracing::debug!(file = %what, "extended attributes not kept: {e}");
    }
}

/// The error of opening `what` without following it: a symlink met there is named.
fn open_error(what: &str, e: io::Error) -> FileError {
    if e.raw_os_error() == Some(nix::libc::ELOOP) {
        FileError::Symlink { path: what.into() }
    } else {
        FileError::io(what, FileOp::Open)(e)
    }
}

/// Resolves `rel` as the target of a write (see [`Share::resolve_for_write`]) and
/// refuses a final component reserved for the server.
fn resolve(share: &Share, rel: &str) -> Result<PathBuf, FileError> {
    let path = share.resolve_for_write(rel)?;
    let reserved = path
        .file_name()
        .is_some_and(|n| n.as_encoded_bytes().starts_with(RESERVED_PREFIX.as_bytes()));
    if reserved {
        return Err(FileError::Reserved {
            path: share.display(rel),
        });
    }
    Ok(path)
}

impl OpenFile {
    /// The handle writes a staged file that has not taken its name yet.
    pub fn staged(&self) -> bool {
        matches!(*self.stage(), Stage::Staged { .. })
    }

    /// The file's share-relative path as it was opened (`share/dir/file`), for
    /// messages.
    pub fn what(&self) -> &str {
        &self.what
    }

    /// The share the file is in.
    pub fn share(&self) -> &Arc<Share> {
        &self.share
    }

    fn stage(&self) -> std::sync::MutexGuard<'_, Stage> {
        self.stage.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The file's attributes now (`fstat`). Blocking.
    pub fn attr(&self) -> Result<Attr, FileError> {
        let meta = self
            .file
            .metadata()
            .map_err(FileError::io(&self.what, FileOp::Stat))?;
        Ok(attr_of(&meta, None))
    }

    /// Forgets every manifest of the file's inode (see the module docs). Blocking.
    fn forget_manifests(&self) {
        let Ok(meta) = self.file.metadata() else {
            return;
        };
        forget(
            &self.share,
            &self.manifests,
            meta.dev(),
            meta.ino(),
            &self.what,
        );
    }

    /// `FileWrite`: pulls `region` in groups of extents of at most one chunk buffer,
    /// verifies each extent against its hash in `algorithm` and writes the verified
    /// extents (see the module docs); answers with the file's size after.
    pub async fn write(
        self: &Arc<Self>,
        io: &FileIo,
        region: RegionDesc,
        algorithm: HashAlgorithm,
        extents: Vec<Extent>,
        hashes: Vec<Hash256>,
    ) -> Result<Response, FileError> {
        let outcome = self
            .write_extents(io, region, algorithm, extents, hashes)
            .await;
        let this = self.clone();
        let attr = run_blocking(&self.what, move || {
            this.forget_manifests();
            this.attr()
        })
        .await;
        outcome?;
        Ok(Response::FileWritten { size: attr??.size })
    }

    /// `FileFinish`: the extents written as by [`OpenFile::write`] (if any), then
    /// `attrs` set and, with `commit`, the staged file named. Extents that fit one
    /// chunk buffer (a small file's close) are pulled first and then verified,
    /// written, and followed by the rest in one blocking call.
    pub async fn finish(
        self: Arc<Self>,
        io: &FileIo,
        write: (RegionDesc, HashAlgorithm, Vec<Extent>, Vec<Hash256>),
        attrs: SetAttrs,
        commit: bool,
    ) -> Result<Response, FileError> {
        let staged = Staged::of(write, self.chunk_bytes);
        let pulled = staged.pull(&self.what, io).await;
        self.finish_pulled(io, staged, pulled, attrs, commit).await
    }

    /// The rest of [`OpenFile::finish`] once one group is pulled (or none is to be).
    pub async fn finish_pulled(
        self: Arc<Self>,
        io: &FileIo,
        staged: Staged,
        pulled: Result<Option<Pulled>, FileError>,
        attrs: SetAttrs,
        commit: bool,
    ) -> Result<Response, FileError> {
        let Staged {
            region,
            algorithm,
            extents,
            groups,
        } = staged;
        let wrote = !extents.is_empty();
        // More than one group: each pulled and written on its own, concurrently.
        let outcome = if groups.len() > 1 {
            self.write_groups(io, region, algorithm, extents.clone(), groups)
                .await
        } else {
            Ok(())
        };
        let what = self.what.clone();
        let traffic = io.traffic.clone();
        // `self` moves into the blocking call: when the caller holds no other
        // reference (`FilePut`), the file is dropped there, off the async threads.
        let this = self;
        run_blocking(&what, move || {
            let applied = pulled.and_then(|p| match p {
                Some(p) => this.apply_group(&p, algorithm, &extents).map(|bytes| {
                    traffic.file_written(bytes);
                }),
                None => Ok(()),
            });
            if wrote {
                // Even after a failure: some extents may have been written.
                this.forget_manifests();
            }
            applied?;
            outcome?;
            if !attrs.is_empty() {
                this.set_attrs(&attrs)?;
            }
            if commit {
                this.publish()
            } else {
                Ok(Response::Attr(this.attr()?))
            }
        })
        .await?
    }

    /// Pulls, verifies and writes `extents` (with their `hashes`), a group of at most
    /// one chunk buffer at a time, the groups concurrently.
    async fn write_extents(
        self: &Arc<Self>,
        io: &FileIo,
        region: RegionDesc,
        algorithm: HashAlgorithm,
        extents: Vec<Extent>,
        hashes: Vec<Hash256>,
    ) -> Result<(), FileError> {
        let staged = Staged::of((region, algorithm, extents, hashes), self.chunk_bytes);
        self.write_groups(io, region, algorithm, staged.extents, staged.groups)
            .await
    }

    async fn write_groups(
        self: &Arc<Self>,
        io: &FileIo,
        region: RegionDesc,
        algorithm: HashAlgorithm,
        extents: Arc<[(Extent, Hash256)]>,
        groups: Vec<Group>,
    ) -> Result<(), FileError> {
        let mut tasks = JoinSet::new();
        for (i, group) in groups.into_iter().enumerate() {
            let (this, io, extents) = (self.clone(), io.clone(), extents.clone());
            tasks.spawn(async move {
                let r = this
                    .write_group(&io.transport, &io.pool, region, algorithm, extents, group)
                    .await;
                if let Ok(bytes) = &r {
                    io.traffic.file_written(*bytes);
                }
                (i, r)
            });
        }
        join_all(tasks, &self.what).await.map(|_| ())
    }

    /// Pulls one group (`extents[group]`, which lie at `region_offset` of the
    /// region, back to back) into a lent buffer with one READ, verifies every extent
    /// and writes them; returns the bytes written.
    async fn write_group(
        self: &Arc<Self>,
        transport: &SharedTransport,
        pool: &Arc<Pool>,
        region: RegionDesc,
        algorithm: HashAlgorithm,
        extents: Arc<[(Extent, Hash256)]>,
        group: Group,
    ) -> Result<u64, FileError> {
        let pulled = pull_group(&self.what, transport, pool, region, group).await?;
        let this = self.clone();
        run_blocking(&self.what, move || {
            this.apply_group(&pulled, algorithm, &extents)
        })
        .await?
    }

    /// Verifies every extent of a pulled group against its hash and only then writes
    /// them; returns the bytes written. Blocking.
    fn apply_group(
        &self,
        pulled: &Pulled,
        algorithm: HashAlgorithm,
        extents: &[(Extent, Hash256)],
    ) -> Result<u64, FileError> {
        let group = &pulled.group;
        let bytes = pulled.lease.buffer().blocking_read();
        let mut at = 0usize;
        let mut pieces = Vec::new();
        for (extent, hash) in &extents[group.first..group.end] {
            let piece = &bytes[at..at + extent.len as usize];
            if hash_chunk(algorithm, piece) != *hash {
                tracing::warn!(file = %self.what, offset = extent.offset, %algorithm, "file write extent failed hash verification");
                return Err(FileError::Integrity {
                    path: self.what.clone(),
                    algorithm,
                    offset: extent.offset,
                    len: extent.len,
                });
            }
            pieces.push((piece, extent.offset));
            at += extent.len as usize;
        }
        self.touched();
        let staged = self.staged();
        // Held across the writes, so the chunks noted are in the order the bytes landed
        // whatever the order of concurrent groups.
        let mut written = self.written();
        let mut buffered = 0u64;
        let hashes = extents[group.first..group.end]
            .iter()
            .map(|(e, h)| (e.len, h));
        for ((piece, offset), (len, hash)) in pieces.into_iter().zip(hashes) {
            let wrote = if staged {
                self.out.write_counted(piece, offset)
            } else {
                self.file.write_all_at(piece, offset).map(|()| piece.len())
            };
            match wrote {
                Ok(n) => {
                    buffered += n as u64;
                    written.wrote(offset, len, algorithm, *hash);
                }
                Err(e) => {
                    written.poison();
                    return Err(FileError::io(&self.what, FileOp::Write)(e));
                }
            }
        }
        drop(written);
        self.writeback.wrote(buffered);
        Ok(u64::from(group.len))
    }

    /// `FileRead`: reads file bytes `offset..offset + region.len` (fewer at the end)
    /// into lent buffers, one chunk each, pushes them into `region` with one-sided
    /// WRITEs and answers with their length and their hashes in `algorithm`.
    pub async fn read(
        self: &Arc<Self>,
        transport: &SharedTransport,
        pool: &Arc<Pool>,
        offset: u64,
        region: RegionDesc,
        algorithm: HashAlgorithm,
    ) -> Result<Response, FileError> {
        let this = self.clone();
        let size = run_blocking(&self.what, move || this.attr()).await??.size;
        let len = region.len.min(size.saturating_sub(offset));
        let chunk = u64::from(self.chunk_bytes);
        let mut tasks = JoinSet::new();
        for (i, start) in (0..len).step_by(self.chunk_bytes as usize).enumerate() {
            // At most one chunk: fits u32.
            let piece = (len - start).min(chunk) as u32;
            let (this, transport, pool) = (self.clone(), transport.clone(), pool.clone());
            tasks.spawn(async move {
                let r = this
                    .read_piece(
                        &transport,
                        &pool,
                        offset + start,
                        start,
                        piece,
                        region,
                        algorithm,
                    )
                    .await;
                (i, r)
            });
        }
        let hashes = join_all(tasks, &self.what).await?;
        Ok(Response::FileData {
            len,
            algorithm,
            hashes,
        })
    }

    /// Reads `len` bytes at `file_offset` into a lent buffer, hashes them and pushes
    /// them to `region_offset` of the region.
    #[allow(clippy::too_many_arguments)]
    async fn read_piece(
        self: &Arc<Self>,
        transport: &SharedTransport,
        pool: &Arc<Pool>,
        file_offset: u64,
        region_offset: u64,
        len: u32,
        region: RegionDesc,
        algorithm: HashAlgorithm,
    ) -> Result<Hash256, FileError> {
        let lease = pool.lease().await?;
        let slice = RemoteSlice::of(&region, region_offset, len).ok_or_else(|| {
            FileError::OutsideRegion {
                path: self.what.clone(),
            }
        })?;
        let (buf, this) = (lease.buffer().clone(), self.clone());
        let hash = run_blocking(&self.what, move || {
            let mut bytes = buf.blocking_write();
            let piece = &mut bytes[..len as usize];
            match this.file.read_exact_at(piece, file_offset) {
                Ok(()) => Ok(hash_chunk(algorithm, piece)),
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Err(FileError::Shrank {
                    path: this.what.clone(),
                }),
                Err(e) => Err(FileError::io(&this.what, FileOp::Read)(e)),
            }
        })
        .await??;
        transport
            .write(lease.reg(), 0, slice)
            .await
            .map_err(|source| FileError::Transport {
                path: self.what.clone(),
                source,
            })?;
        Ok(hash)
    }

    /// `FileSetAttr`: see [`SetAttrs`] for the order. Blocking.
    pub fn set_attrs(&self, attrs: &SetAttrs) -> Result<Response, FileError> {
        // Nothing to change is an `fstat` (a mount revalidating at open): the file is
        // not touched by it.
        if attrs.is_empty() {
            return Ok(Response::Attr(self.attr()?));
        }
        self.touched();
        let r = apply(Target::Fd(&self.file), attrs, &self.what);
        if r.is_ok() && attrs.mtime.is_some() {
            self.mtime_given.store(true, Ordering::Release);
        }
        if let Some(size) = attrs.size {
            self.forget_manifests();
            let mut written = self.written();
            match &r {
                Ok(()) => written.resized(size),
                Err(_) => written.poison(),
            }
        }
        r?;
        Ok(Response::Attr(self.attr()?))
    }

    /// `FileAllocate`: `fallocate`, mode 0 or `FALLOC_FL_KEEP_SIZE`. Blocking.
    pub fn allocate(&self, offset: u64, len: u64, keep_size: bool) -> Result<Response, FileError> {
        let flags = if keep_size {
            FallocateFlags::FALLOC_FL_KEEP_SIZE
        } else {
            FallocateFlags::empty()
        };
        self.fallocate(offset, len, flags)
    }

    /// `FileFallocate`: a hole punched or a range zeroed. The chunk hashes recorded
    /// from the handle's writes no longer describe the range: they are dropped, so a
    /// staged file's commit hashes what is on disk. Blocking.
    pub fn change_range(
        &self,
        offset: u64,
        len: u64,
        mode: FallocMode,
    ) -> Result<Response, FileError> {
        let flags = match mode {
            FallocMode::PunchHole => {
                FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE
            }
            FallocMode::ZeroRange { keep_size: false } => FallocateFlags::FALLOC_FL_ZERO_RANGE,
            FallocMode::ZeroRange { keep_size: true } => {
                FallocateFlags::FALLOC_FL_ZERO_RANGE | FallocateFlags::FALLOC_FL_KEEP_SIZE
            }
        };
        self.written().poison();
        self.fallocate(offset, len, flags)
    }

    /// `fallocate(flags)` of the handle's file; the manifests of its versions forgotten.
    fn fallocate(
        &self,
        offset: u64,
        len: u64,
        flags: FallocateFlags,
    ) -> Result<Response, FileError> {
        let what = &self.what;
        let invalid = || {
            FileError::io(what, FileOp::Allocate)(io::Error::from_raw_os_error(nix::libc::EINVAL))
        };
        let offset = i64::try_from(offset).map_err(|_| invalid())?;
        let len = i64::try_from(len).map_err(|_| invalid())?;
        self.touched();
        let r = nix::fcntl::fallocate(self.file.as_raw_fd(), flags, offset, len)
            .map_err(errno(what, FileOp::Allocate));
        self.forget_manifests();
        r?;
        Ok(Response::Attr(self.attr()?))
    }

    /// `FileSync`: commits a staged file that has not taken its name (fsync, rename,
    /// fsync of the directory), else `fsync` (`fdatasync` with `data_only`); answers
    /// with the attributes after. `FileClose` is this, then the handle is dropped.
    /// Blocking.
    pub fn sync(&self, data_only: bool) -> Result<Response, FileError> {
        let dirty = self.dirty.swap(false, Ordering::AcqRel);
        let durability = if data_only {
            Durability::Data
        } else {
            Durability::All
        };
        let synced = self.commit(durability).and_then(|committed| {
            if committed {
                return Ok(());
            }
            let r = if data_only {
                self.file.sync_data()
            } else {
                self.file.sync_all()
            };
            r.map_err(FileError::io(&self.what, FileOp::Fsync))
        });
        let synced = synced.and_then(|()| {
            self.writeback
                .take_error()
                .map_err(FileError::io(&self.what, FileOp::Fsync))
        });
        if synced.is_err() && dirty {
            self.touched();
        }
        synced?;
        Ok(Response::Attr(self.attr()?))
    }

    /// `FileClose`: a staged file takes its name (as by `FileCommit`); nothing is
    /// flushed that the client did not ask to be with a `FileSync`. Blocking.
    pub fn close(&self) -> Result<Response, FileError> {
        self.publish()
    }

    /// `FileCommit`: a staged file takes its name now, not made durable (see
    /// [`OpenFile::commit`]). Blocking.
    pub fn publish(&self) -> Result<Response, FileError> {
        self.commit(Durability::None)?;
        Ok(Response::Attr(self.attr()?))
    }

    fn written(&self) -> std::sync::MutexGuard<'_, WrittenChunks> {
        self.written.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The manifest to record of the staged file, still unnamed, whose version is
    /// `before` (see [`OpenFile::record`]): the hashes its writes carried for the chunks
    /// they wrote whole, and for every other chunk (written in pieces, as from a buffer
    /// that is not page-aligned, whose direct write the kernel cuts into requests that
    /// straddle chunks and may deliver out of order; or a hole) the hash of the bytes
    /// read back from the staged file now, which nobody else can write: it has no name.
    /// `None` if nothing can be recorded (a write failed midway, nothing was written,
    /// another chunk size, or the read failed). Blocking.
    fn manifest_at_commit(&self, before: &fs::Metadata) -> Option<(HashAlgorithm, Vec<Hash256>)> {
        let chunk_bytes = self.share.store().chunk_bytes();
        let Some((algorithm, parts)) = self.written().parts(before.size(), chunk_bytes) else {
            tracing::debug!(file = %self.what, "not recorded at commit: nothing written whole, or a write failed");
            return None;
        };
        let missing: Vec<u64> = (0..parts.len() as u64)
            .filter(|&i| parts[i as usize].is_none())
            .collect();
        if missing.is_empty() {
            return Some((algorithm, parts.into_iter().flatten().collect()));
        }
        let size = before.size();
        let read: io::Result<Vec<(u64, Hash256)>> = missing
            .par_iter()
            .map_init(
                || vec![0u8; chunk_bytes as usize],
                |buf, &i| {
                    let len = chunk_len(size, chunk_bytes, i) as usize;
                    self.file
                        .read_exact_at(&mut buf[..len], i * u64::from(chunk_bytes))?;
                    Ok((i, hash_chunk(algorithm, &buf[..len])))
                },
            )
            .collect();
        match read {
            Ok(read) => {
                tracing::debug!(file = %self.what, chunks = read.len(), "chunks not written whole: hashed from the staged file at commit");
                let mut parts = parts;
                for (i, hash) in read {
                    parts[i as usize] = Some(hash);
                }
                Some((algorithm, parts.into_iter().flatten().collect()))
            }
            Err(e) => {
                tracing::debug!(file = %self.what, "not recorded at commit: cannot read the staged file back: {e}");
                None
            }
        }
    }

    /// Records, in the share's store, `manifest` ([`OpenFile::manifest_at_commit`]) as
    /// that of the staged file just named: under its key now, if it is still the
    /// version `before` the rename (same size and mtime) and that mtime differs from
    /// the rename's ctime ([`mtime_settled`]: a later write would change the key).
    /// Otherwise it is not recorded, as a file written underneath ferryd is not.
    /// Blocking.
    fn record(&self, before: &fs::Metadata, manifest: (HashAlgorithm, Vec<Hash256>)) {
        let store = self.share.store();
        let Ok(meta) = self.file.metadata() else {
            return;
        };
        let key = ManifestKey::of(&meta, store.chunk_bytes());
        let unchanged = meta.size() == before.size()
            && (meta.mtime(), meta.mtime_nsec()) == (before.mtime(), before.mtime_nsec());
        if !unchanged || !mtime_settled(&key) {
            tracing::debug!(file = %self.what, unchanged, "not recorded at commit: changed, or its mtime not settled");
            return;
        }
        let (algorithm, hashes) = manifest;
        match store.save(&key, algorithm, &hashes) {
            Ok(()) => {
                tracing::debug!(file = %self.what, %algorithm, "manifest of a mount's write recorded at commit")
            }
            Err(e) => tracing::debug!(file = %self.what, "cannot record the manifest: {e}"),
        }
    }

    /// Marks the file changed since its last sync (its mtime now that of the change).
    fn touched(&self) {
        self.dirty.store(true, Ordering::Release);
        self.mtime_given.store(false, Ordering::Release);
    }

    /// Before a staged file's rename: if its mtime is that of its last write and lies
    /// in the current tick of the kernel's coarse clock, which file timestamps are taken
    /// from (kernels before 6.13, without multigrain timestamps), sets it to the precise
    /// time now, a few milliseconds later at most. Otherwise the rename's ctime could
    /// equal the mtime, and the file could not be recorded ([`mtime_settled`]): a later
    /// write in the same tick would leave its key as it is. An mtime the client set is
    /// kept. Takes the file's metadata now and returns it as the commit goes on with
    /// (stat again only if the mtime was set). Failures are logged: the file is then
    /// just not recorded. Blocking.
    fn stamp_after_the_tick(&self, meta: fs::Metadata) -> fs::Metadata {
        use nix::time::{clock_gettime, ClockId};
        if self.mtime_given.load(Ordering::Acquire) {
            return meta;
        }
        let Ok(coarse) = clock_gettime(ClockId::CLOCK_REALTIME_COARSE) else {
            return meta;
        };
        let tick = i128::from(coarse.tv_sec()) * 1_000_000_000 + i128::from(coarse.tv_nsec());
        if ManifestKey::of(&meta, 0).mtime_ns < tick {
            return meta;
        }
        let now = TimeSpec::from(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default(),
        );
        if let Err(e) = futimens(self.file.as_raw_fd(), &TimeSpec::UTIME_OMIT, &now) {
            tracing::debug!(file = %self.what, "cannot set the mtime past the clock tick: {e}");
            return meta;
        }
        self.file.metadata().unwrap_or(meta)
    }

    /// Gives a staged file its final name (see the module docs); returns whether there
    /// was one to commit. Blocking.
    ///
    /// The data is made durable before the rename (`fdatasync` with `data_only`, else
    /// `fsync`), so no crash leaves a name on a half-written file; with `data_only`
    /// (the client's `close`, or `fdatasync`) the directory is not flushed, so after a
    /// crash the name may be missing (as on a local file system without an fsync of the
    /// directory); a full `fsync` flushes the directory too.
    /// With [`Durability::None`] (`FileCommit`, `FileClose`) nothing is flushed: the
    /// rename is as durable as the file system makes it by itself.
    fn commit(&self, durability: Durability) -> Result<bool, FileError> {
        let mut stage = self.stage();
        let Stage::Staged {
            tmp,
            final_path,
            exclusive,
            ..
        } = &*stage
        else {
            return Ok(false);
        };
        let what = &self.what;
        match durability {
            Durability::None => Ok(()),
            Durability::Data => self.file.sync_data(),
            Durability::All => self.file.sync_all(),
        }
        .map_err(FileError::io(what, FileOp::Fsync))?;
        // The version written, before the rename moves its ctime, and its manifest.
        let before = self
            .file
            .metadata()
            .ok()
            .map(|meta| self.stamp_after_the_tick(meta));
        let manifest = before.as_ref().and_then(|b| self.manifest_at_commit(b));
        if *exclusive {
            renameat2(None, tmp, None, final_path, RenameFlags::RENAME_NOREPLACE)
                .map_err(errno(what, FileOp::Rename))?;
        } else {
            // A rename over an empty directory would succeed, over another fail
            // obscurely.
            no_dir_in_the_way(final_path, what)?;
            fs::rename(tmp, final_path).map_err(FileError::io(what, FileOp::Rename))?;
        }
        let dir = final_path.parent().map(Path::to_owned);
        *stage = Stage::InPlace;
        drop(stage);
        self.forget_manifests();
        if let (Some(before), Some(manifest)) = (before, manifest) {
            self.record(&before, manifest);
        }
        if let (Some(dir), Durability::All) = (dir, durability) {
            sync_dir(&dir, what)?;
        }
        Ok(true)
    }
}

impl Drop for OpenFile {
    fn drop(&mut self) {
        let stage = self.stage.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Stage::Staged { tmp, .. } = stage {
            if let Err(e) = fs::remove_file(&*tmp) {
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::warn!(file = %self.what, "cannot remove the hidden file of an uncommitted handle: {e}");
                }
            }
        }
    }
}

/// The write of a `FileFinish` or `FilePut`, split into groups of at most one chunk
/// buffer.
pub struct Staged {
    region: RegionDesc,
    algorithm: HashAlgorithm,
    extents: Arc<[(Extent, Hash256)]>,
    groups: Vec<Group>,
}

impl Staged {
    /// `write` (region, algorithm, extents, hashes) in groups of `chunk_bytes`.
    pub fn of(
        write: (RegionDesc, HashAlgorithm, Vec<Extent>, Vec<Hash256>),
        chunk_bytes: u32,
    ) -> Staged {
        let (region, algorithm, extents, hashes) = write;
        let extents: Arc<[(Extent, Hash256)]> = extents.into_iter().zip(hashes).collect();
        let groups = groups(&extents, chunk_bytes);
        Staged {
            region,
            algorithm,
            extents,
            groups,
        }
    }

    /// Pulls the one group of a write that fits one chunk buffer (`None` for no
    /// extents, or more than one group: those are pulled as they are written).
    pub async fn pull(&self, what: &str, io: &FileIo) -> Result<Option<Pulled>, FileError> {
        match self.groups.as_slice() {
            [group] => pull_group(what, &io.transport, &io.pool, self.region, *group)
                .await
                .map(Some),
            _ => Ok(None),
        }
    }
}

/// One group's bytes, pulled into a lent chunk buffer.
pub struct Pulled {
    lease: crate::pool::Lease,
    group: Group,
}

/// Pulls `group` of `region` into a lent buffer with one READ.
async fn pull_group(
    what: &str,
    transport: &SharedTransport,
    pool: &Arc<Pool>,
    region: RegionDesc,
    group: Group,
) -> Result<Pulled, FileError> {
    let lease = pool.lease().await?;
    let slice = RemoteSlice::of(&region, group.region_offset, group.len).ok_or_else(|| {
        FileError::OutsideRegion {
            path: what.to_string(),
        }
    })?;
    transport
        .read(slice, lease.reg(), 0)
        .await
        .map_err(|source| FileError::Transport {
            path: what.to_string(),
            source,
        })?;
    Ok(Pulled { lease, group })
}

/// A group of extents pulled with one READ: `extents[first..end]`, at
/// `region_offset` of the region, `len` bytes in all (at most one chunk buffer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Group {
    first: usize,
    end: usize,
    region_offset: u64,
    len: u32,
}

/// Splits `extents` (each at most `chunk_bytes`) into consecutive groups of at most
/// `chunk_bytes` bytes.
fn groups(extents: &[(Extent, Hash256)], chunk_bytes: u32) -> Vec<Group> {
    let mut out: Vec<Group> = Vec::new();
    let mut region_offset = 0u64;
    for (i, (e, _)) in extents.iter().enumerate() {
        match out.last_mut() {
            Some(g) if u64::from(g.len) + u64::from(e.len) <= u64::from(chunk_bytes) => {
                g.end = i + 1;
                g.len += e.len;
            }
            _ => out.push(Group {
                first: i,
                end: i + 1,
                region_offset,
                len: e.len,
            }),
        }
        region_offset += u64::from(e.len);
    }
    out
}

/// Awaits every task (each `(index, result)`), failed or not, and returns their
/// values in index order, or the error of the lowest index that failed.
async fn join_all<T: 'static>(
    mut tasks: JoinSet<(usize, Result<T, FileError>)>,
    what: &str,
) -> Result<Vec<T>, FileError> {
    let mut done = Vec::new();
    let mut failed: Option<(usize, FileError)> = None;
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((i, Ok(v))) => done.push((i, v)),
            Ok((i, Err(e))) => {
                if failed.as_ref().is_none_or(|(j, _)| i < *j) {
                    failed = Some((i, e));
                }
            }
            Err(source) => {
                failed.get_or_insert((
                    usize::MAX,
                    FileError::Task {
                        path: what.into(),
                        source,
                    },
                ));
            }
        }
    }
    if let Some((_, e)) = failed {
        return Err(e);
    }
    done.sort_unstable_by_key(|(i, _)| *i);
    Ok(done.into_iter().map(|(_, v)| v).collect())
}

/// Runs `f` on the blocking pool; a task that panicked fails as [`FileError::Task`].
async fn run_blocking<T: Send + 'static>(
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, FileError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|source| FileError::Task {
            path: what.into(),
            source,
        })
}

/// Forgets every manifest of inode `ino` on `dev`: cached, and recorded in the
/// share's store (a failure is logged against `what`: a record left behind is still
/// told apart from the new version by its key, except within one timestamp tick).
fn forget(share: &Share, manifests: &ManifestCache, dev: u64, ino: u64, what: &str) {
    manifests.forget(dev, ino);
    {
        if let Err(e) = share.store().forget(dev, ino) {
            tracing::warn!(file = %what, "cannot forget the file's manifest record: {e}");
        }
    }
}

fn sync_dir(dir: &Path, what: &str) -> Result<(), FileError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(FileError::io(what, FileOp::FsyncDir))
}

/// `Move`: `rename(2)` of `from` to `to` in `share` (neither followed), replacing `to`
/// unless `no_replace` (`RENAME_NOREPLACE`), then fsyncs the directories of both
/// names. Blocking.
pub fn move_entry(
    share: &Share,
    from: &str,
    to: &str,
    no_replace: bool,
) -> Result<Response, FileError> {
    let src = resolve(share, from)?;
    let dst = resolve(share, to)?;
    let what = share.display(from);
    let flags = if no_replace {
        RenameFlags::RENAME_NOREPLACE
    } else {
        RenameFlags::empty()
    };
    crate::links::rename_keeping_record(share, &src, &dst, &what, || {
        renameat2(None, &src, None, &dst, flags).map_err(errno(&what, FileOp::Rename))
    })?;
    let (src_dir, dst_dir) = (src.parent(), dst.parent());
    if let Some(d) = dst_dir {
        sync_dir(d, &share.display(to))?;
    }
    if let Some(d) = src_dir.filter(|d| Some(*d) != dst_dir) {
        sync_dir(d, &what)?;
    }
    Ok(Response::Ok)
}

/// `SetAttrs` of `rel` in `share`, its final component not followed; a size change
/// forgets the file's manifests in `manifests` and the share's store. Blocking.
pub fn set_attrs(
    share: &Share,
    rel: &str,
    attrs: &SetAttrs,
    manifests: &ManifestCache,
) -> Result<Response, FileError> {
    let what = share.display(rel);
    // The share root's own mode, owner and times may be set (a tree unpacked into a
    // mount sets them), never its size; everything else resolves as a write target.
    // `/` and other absolute or `..` paths are refused as for every request.
    let at_root = share.components(rel)?.is_empty();
    let path = if at_root && attrs.size.is_none() {
        share.check_writable()?;
        share.root().to_path_buf()
    } else {
        resolve(share, rel)?
    };
    let before = fs::symlink_metadata(&path).map_err(FileError::io(&what, FileOp::Stat))?;
    let r = apply(Target::Path(&path), attrs, &what);
    if attrs.size.is_some() {
        forget(share, manifests, before.dev(), before.ino(), &what);
    }
    r?;
    let after = lstat(&path, share, rel)?;
    if attrs.size.is_none() && attrs.mtime.is_none() {
        // Mode, owner or atime: the content is as it was, only the ctime moved, and a
        // write meanwhile would show in the mtime, which this change leaves alone.
        if let Ok(now) = fs::symlink_metadata(&path) {
            if let Some(r) = Rekey::after_ctime_change(share.store(), &before, &now, &what) {
                r.apply(share.store());
            }
        }
    }
    Ok(Response::Attr(after))
}

/// What attributes are set on.
#[derive(Clone, Copy)]
enum Target<'a> {
    /// An open regular file.
    Fd(&'a File),
    /// A path whose final component is not followed.
    Path(&'a Path),
}

/// Applies `attrs` to `target` in the order size, owner, mode, times (see
/// [`SetAttrs`]); `what` names it in errors. A server not running as root refuses a
/// real owner change and takes the owner it already has as no change.
fn apply(target: Target<'_>, attrs: &SetAttrs, what: &str) -> Result<(), FileError> {
    let meta = match target {
        Target::Fd(f) => f.metadata(),
        Target::Path(p) => fs::symlink_metadata(p),
    }
    .map_err(FileError::io(what, FileOp::Stat))?;
    let kind = if meta.file_type().is_symlink() {
        "symlink"
    } else if meta.is_dir() {
        "directory"
    } else if meta.is_file() {
        "file"
    } else {
        "special file"
    };
    let refuse = |attr: &'static str| FileError::AttrRefused {
        path: what.into(),
        what: attr,
        kind,
    };
    if let Some(size) = attrs.size {
        if !meta.is_file() {
            return Err(refuse("size"));
        }
        let truncate = |f: &File| {
            f.set_len(size)
                .map_err(FileError::io(what, FileOp::Truncate))
        };
        match target {
            Target::Fd(f) => truncate(f)?,
            Target::Path(p) => {
                let f = OpenOptions::new()
                    .write(true)
                    .custom_flags(nix::libc::O_NOFOLLOW)
                    .open(p)
                    .map_err(|e| open_error(what, e))?;
                truncate(&f)?;
            }
        }
    }
    let uid = attrs.uid.filter(|u| *u != meta.uid());
    let gid = attrs.gid.filter(|g| *g != meta.gid());
    if uid.is_some() || gid.is_some() {
        if !applies_owners() {
            return Err(FileError::NotRoot { path: what.into() });
        }
        let (u, g) = (uid.map(Uid::from_raw), gid.map(Gid::from_raw));
        match target {
            Target::Fd(f) => nix::unistd::fchown(f.as_raw_fd(), u, g),
            Target::Path(p) => fchownat(None, p, u, g, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW),
        }
        .map_err(errno(what, FileOp::Chown))?;
        // chown clears the set-id bits of a non-directory: put them back unless the
        // request sets a mode of its own.
        // A caller's chown clears them as the kernel's rules say.
        let setid = meta.mode() & 0o6000 != 0 && !crate::owners::acting();
        if attrs.mode.is_none() && setid && !meta.is_dir() && !meta.file_type().is_symlink() {
            set_mode(target, meta.mode() & 0o7777, what)?;
        }
    }
    if let Some(mode) = attrs.mode {
        if meta.file_type().is_symlink() {
            return Err(refuse("mode"));
        }
        if !meta.is_dir() {
            crate::owners::check_setid(mode)?;
        }
        set_mode(target, mode & 0o7777, what)?;
    }
    if attrs.atime.is_some() || attrs.mtime.is_some() {
        let spec = |t: Option<Timestamp>| {
            t.map_or(TimeSpec::UTIME_OMIT, |t| {
                TimeSpec::new(t.secs, i64::from(t.nanos))
            })
        };
        let (atime, mtime) = (spec(attrs.atime), spec(attrs.mtime));
        match target {
            Target::Fd(f) => futimens(f.as_raw_fd(), &atime, &mtime),
            Target::Path(p) => utimensat(None, p, &atime, &mtime, UtimensatFlags::NoFollowSymlink),
        }
        .map_err(errno(what, FileOp::SetTimes))?;
    }
    Ok(())
}

/// Sets the permission bits of `target`, which is not a symlink.
fn set_mode(target: Target<'_>, mode: u32, what: &str) -> Result<(), FileError> {
    let perms = Permissions::from_mode(mode);
    match target {
        Target::Fd(f) => f.set_permissions(perms),
        Target::Path(p) => crate::fsops::chmod_entry(p, mode),
    }
    .map_err(FileError::io(what, FileOp::Chmod))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn extents(lens: &[u32]) -> Vec<(Extent, Hash256)> {
        let mut offset = 0;
        lens.iter()
            .map(|&len| {
                let e = Extent { offset, len };
                offset += 2 * u64::from(len);
                (e, [0; 32])
            })
            .collect()
    }

    #[test]
    fn extents_group_into_reads_of_at_most_one_buffer() {
        let g = groups(&extents(&[4, 4, 8, 3, 16, 1]), 16);
        let got: Vec<_> = g
            .iter()
            .map(|g| (g.first, g.end, g.region_offset, g.len))
            .collect();
        assert_eq!(
            got,
            vec![(0, 3, 0, 16), (3, 4, 16, 3), (4, 5, 19, 16), (5, 6, 35, 1)]
        );
    }

    fn setup() -> (tempfile::TempDir, Arc<Share>, Arc<ManifestCache>) {
        let dir = tempfile::tempdir().unwrap();
        let share = Arc::new(crate::share::test_share("s", dir.path(), false));
        (dir, share, Arc::new(ManifestCache::new(1 << 20)))
    }

    fn hidden(dir: &Path) -> Vec<String> {
        fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with(ferry_common::TEMP_PREFIX))
            .collect()
    }

    #[test]
    fn a_staged_file_takes_its_name_at_sync_and_a_dropped_one_leaves_nothing() {
        let (dir, share, cache) = setup();
        let f = open(
            share.clone(),
            "new",
            Some(0o640),
            false,
            false,
            16,
            cache.clone(),
        )
        .unwrap();
        assert!(f.staged());
        f.file.write_all_at(b"hello", 0).unwrap();
        assert!(!dir.path().join("new").exists());
        assert_eq!(hidden(dir.path()).len(), 1);
        f.sync(false).unwrap();
        assert!(!f.staged());
        assert_eq!(fs::read(dir.path().join("new")).unwrap(), b"hello");
        assert_eq!(
            fs::metadata(dir.path().join("new")).unwrap().mode() & 0o7777,
            0o640
        );
        assert!(hidden(dir.path()).is_empty());
        // Written in place after the commit.
        f.file.write_all_at(b"J", 0).unwrap();
        assert_eq!(fs::read(dir.path().join("new")).unwrap(), b"Jello");
        drop(f);
        assert!(dir.path().join("new").exists());

        let g = open(share, "other", Some(0o600), false, false, 16, cache).unwrap();
        drop(g);
        assert!(!dir.path().join("other").exists());
        assert!(hidden(dir.path()).is_empty());
    }

    #[test]
    fn open_refuses_symlinks_reserved_names_missing_and_existing_exclusive() {
        let (dir, share, cache) = setup();
        fs::write(dir.path().join("f"), b"x").unwrap();
        symlink("f", dir.path().join("l")).unwrap();
        let o = |rel: &str, create, exclusive| {
            open(
                share.clone(),
                rel,
                create,
                exclusive,
                false,
                16,
                cache.clone(),
            )
            .err()
        };
        assert!(matches!(
            o("l", None, false),
            Some(FileError::Symlink { .. })
        ));
        assert!(matches!(
            o(".ferry-x", Some(0o600), false),
            Some(FileError::Reserved { .. })
        ));
        assert!(matches!(
            o("missing", None, false),
            Some(FileError::NotFound { .. })
        ));
        assert!(matches!(
            o("f", Some(0o600), true),
            Some(FileError::Exists { .. })
        ));
        assert!(o("f", None, false).is_none());
        // Truncating: staged, the old content stays until the commit.
        let t = open(share, "f", None, false, true, 16, cache).unwrap();
        assert!(t.staged());
        assert_eq!(fs::read(dir.path().join("f")).unwrap(), b"x");
        t.sync(true).unwrap();
        assert_eq!(fs::read(dir.path().join("f")).unwrap(), b"");
    }

    #[test]
    fn an_exclusive_staged_file_does_not_replace_a_name_taken_meanwhile() {
        let (dir, share, cache) = setup();
        let f = open(share, "n", Some(0o600), true, false, 16, cache).unwrap();
        fs::write(dir.path().join("n"), b"theirs").unwrap();
        let e = f.sync(false).unwrap_err();
        assert!(
            matches!(
                e,
                FileError::Io {
                    op: FileOp::Rename,
                    ..
                }
            ),
            "{e:?}"
        );
        assert_eq!(fs::read(dir.path().join("n")).unwrap(), b"theirs");
        drop(f);
        assert!(hidden(dir.path()).is_empty());
    }

    #[test]
    fn set_attrs_orders_size_mode_times_and_refuses_a_symlinks_mode() {
        let (dir, share, cache) = setup();
        fs::write(dir.path().join("f"), b"0123456789").unwrap();
        symlink("f", dir.path().join("l")).unwrap();
        let t = Timestamp {
            secs: 1_000_000_000,
            nanos: 5,
        };
        let attrs = SetAttrs {
            size: Some(4),
            mode: Some(0o600),
            mtime: Some(t),
            ..SetAttrs::default()
        };
        let Response::Attr(a) = set_attrs(&share, "f", &attrs, &cache).unwrap() else {
            panic!("not an Attr");
        };
        assert_eq!((a.size, a.mode & 0o7777, a.mtime), (4, 0o600, t));
        let e = set_attrs(
            &share,
            "l",
            &SetAttrs {
                mode: Some(0o600),
                ..SetAttrs::default()
            },
            &cache,
        )
        .unwrap_err();
        assert!(matches!(e, FileError::AttrRefused { .. }), "{e:?}");
        // The symlink's own times; its target's untouched.
        set_attrs(
            &share,
            "l",
            &SetAttrs {
                mtime: Some(Timestamp { secs: 7, nanos: 0 }),
                ..SetAttrs::default()
            },
            &cache,
        )
        .unwrap();
        assert_eq!(
            fs::symlink_metadata(dir.path().join("l")).unwrap().mtime(),
            7
        );
        assert_eq!(
            fs::metadata(dir.path().join("f")).unwrap().mtime(),
            1_000_000_000
        );
        // The owner it has is no change, even for a server not running as root.
        let me = fs::metadata(dir.path().join("f")).unwrap();
        set_attrs(
            &share,
            "f",
            &SetAttrs {
                uid: Some(me.uid()),
                gid: Some(me.gid()),
                ..SetAttrs::default()
            },
            &cache,
        )
        .unwrap();
    }

    #[test]
    fn a_change_through_a_handle_forgets_the_files_manifests_even_under_the_same_key() {
        use crate::filekey::ManifestKey;
        let (dir, share, cache) = setup();
        fs::write(dir.path().join("f"), vec![7u8; 100]).unwrap();
        let store = share.store().clone();
        let chunk = store.chunk_bytes();
        // Records of the file's version as it will be after the change: a key that did
        // not move (a change within one timestamp tick) must not keep them alive.
        let record = |f: &OpenFile| {
            let key = ManifestKey::of(&f.file.metadata().unwrap(), chunk);
            let hashes = vec![[1u8; 32]];
            store.save(&key, HashAlgorithm::Blake3, &hashes).unwrap();
            cache.insert((key, HashAlgorithm::Blake3), hashes.into());
            key
        };
        let f = open(share.clone(), "f", None, false, false, chunk, cache.clone()).unwrap();
        let same_size = SetAttrs {
            size: Some(100),
            ..SetAttrs::default()
        };
        let changes: [&dyn Fn(&OpenFile); 2] =
            [&|f| drop(f.set_attrs(&same_size).unwrap()), &|f| {
                drop(f.allocate(0, 100, true).unwrap())
            }];
        for change in changes {
            change(&f);
            let key = record(&f);
            change(&f);
            assert!(store.load(key.dev, key.ino).is_none());
            assert!(cache.is_empty());
        }
        // And a path's size change.
        let key = record(&f);
        set_attrs(&share, "f", &same_size, &cache).unwrap();
        assert!(store.load(key.dev, key.ino).is_none());
        assert!(cache.is_empty());
    }

    #[test]
    fn move_replaces_unless_told_not_to_and_refuses_a_non_empty_directory() {
        let (dir, share, _) = setup();
        fs::write(dir.path().join("a"), b"a").unwrap();
        fs::write(dir.path().join("b"), b"b").unwrap();
        let e = move_entry(&share, "a", "b", true).unwrap_err();
        let FileError::Io { source, .. } = &e else {
            panic!("{e:?}");
        };
        assert_eq!(source.kind(), io::ErrorKind::AlreadyExists);
        move_entry(&share, "a", "b", false).unwrap();
        assert_eq!(fs::read(dir.path().join("b")).unwrap(), b"a");
        fs::create_dir_all(dir.path().join("d/x")).unwrap();
        fs::create_dir(dir.path().join("e")).unwrap();
        let e = move_entry(&share, "e", "d", false).unwrap_err();
        let FileError::Io { source, .. } = &e else {
            panic!("{e:?}");
        };
        assert_eq!(source.raw_os_error(), Some(nix::libc::ENOTEMPTY));
        assert!(matches!(
            move_entry(&share, "b", ".ferry-tmp.x", false),
            Err(FileError::Share(_) | FileError::Reserved { .. })
        ));
    }
}
