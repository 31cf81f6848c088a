//! Batched small files ([`Request::UploadBatch`](ferry_common::msg::Request) and
//! `DownloadBatch`): many files per request, their bytes moved by one one-sided
//! operation into or out of one pooled chunk buffer, the filesystem work of the whole
//! batch done in one blocking task.
//!
//! Upload invariants:
//! - Each file is written whole to a new file without a name in its final directory
//!   ([`Unnamed`]: `O_TMPFILE`; where the filesystem has none, a fresh scratch file
//!   `.ferry-tmp.<16 random hex>` next to its final name, removed again if anything
//!   fails before its rename; what a killed server leaves, its startup cleanup
//!   removes), only after its bytes matched the client's hash, and gets its mode and
//!   mtime through its descriptor.
//! - Durability, a group commit per batch: every file is written, then each
//!   filesystem they are on is flushed once (`syncfs`,
//!   [`ferry_common::writeback::sync_filesystems`]); only once that succeeded is any
//!   file given its final name ([`Unnamed::name`]: linked, or renamed over what is
//!   there), and the filesystems are flushed once more after the names, before the
//!   answer. So after a power cut a final name holds its old
//!   content or the whole new file, never a part of it, and an answered file survives.
//!   A failed flush fails every file of the batch on that filesystem.
//! - A file that fails (bad path, hash mismatch, a directory in the way, an I/O error)
//!   fails alone: its entry in the answer says why, the others go on.
//! - Every committed file is recorded in the share's manifest store, as an upload's
//!   commit records it.
//!
//! Download: each path is opened as `DownloadOpen` opens it (regular files only,
//! symlinks followed inside the share); a file is read whole between two `fstat`s (a
//! size or mtime that moved fails it as changed) and hashed; files go back to back into
//! the buffer, which is written to the client's region with one WRITE after every read
//! finished.

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::Arc;

use ferry_common::attr::attr_of;
use ferry_common::chunk::hash_chunk;
use ferry_common::msg::{Attr, BatchFile, BatchedFile, Hash256, HashAlgorithm, RegionDesc};
use ferry_common::proto::batch::batch_capacity;
use ferry_common::readahead::{will_need, READ_AHEAD_FILES};
use ferry_common::staging::{write_whole, WholeStep};
use ferry_common::transport::{RemoteSlice, SharedTransport, TransportError};
use ferry_common::unnamed::Unnamed;
use ferry_common::writeback::sync_filesystems_on;
use tokio::task::JoinError;

use crate::conn::Hashing;
use crate::filekey::{mtime_settled, ManifestKey};
use crate::fsops::FsError;
use crate::manifests::{self, look_up, ManifestCache, ROT_LOG};
use crate::map::{open_regular_at, MapError};
use crate::pool::{Pool, PoolError};
use crate::share::{ResolvedDirs, Share, ShareError};
use crate::store::ManifestStore;

/// What one batch works with: the connection's transport and buffer pool.
pub struct BatchIo<'a> {
    /// The connection's transport.
    pub transport: &'a SharedTransport,
    /// The connection's buffer pool (buffers of `chunk_bytes`).
    pub pool: &'a Arc<Pool>,
    /// The server's chunk size.
    pub chunk_bytes: u32,
    /// The largest file a batch of this session carries
    /// ([`ferry_common::proto::batch::batch_file_max`]).
    pub file_max: u64,
    /// How the session hashes for the batch's share.
    pub hashing: Hashing,
    /// The server's manifest cache, where a download batch finds recorded hashes.
    pub cache: &'a Arc<ManifestCache>,
}

/// A batch refused as a whole, or one file of it failed: each variant names the
/// operation and the share-relative path (`share/dir/file`) it failed on.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    /// An upload batch hashed in another algorithm than the share records its data in.
    #[error("{share}: the batch's hashes are {sent}, but the share records {wanted} (ask with ShareInfo)")]
    WrongHash {
        /// The share.
        share: String,
        /// The batch's algorithm.
        sent: HashAlgorithm,
        /// The share's.
        wanted: HashAlgorithm,
    },
    /// A path cannot be used (see [`ShareError`]).
    #[error(transparent)]
    Share(#[from] ShareError),
    /// A directory is in the way of a file (see [`FsError`]).
    #[error(transparent)]
    Fs(#[from] FsError),
    /// A file to download is not a regular file or cannot be opened (see [`MapError`]).
    #[error(transparent)]
    Open(#[from] MapError),
    /// No chunk buffer could be lent.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The blocking task that wrote or read the batch's files failed.
    #[error("server task failed")]
    Task(#[source] JoinError),
    /// The batch's blocking task could not act as its caller.
    #[error("cannot act as the caller")]
    Act(#[source] std::io::Error),
    /// A region whose end lies past the address space.
    #[error("a batch region that wraps around")]
    RegionWraps,
    /// The one-sided READ or WRITE of the batch failed.
    #[error("{share}: batch transfer failed")]
    Transport {
        /// The share, as messages name it.
        share: String,
        /// Why.
        #[source]
        source: TransportError,
    },
    /// The same file named twice in one upload batch.
    #[error("{path}: named more than once in one batch")]
    Twice {
        /// The path.
        path: String,
    },
    /// A file whose bytes do not hash to the client's hash.
    #[error("{path}: failed hash verification")]
    Integrity {
        /// The path.
        path: String,
    },
    /// A small file whose bytes on disk no longer match the hash recorded when it was
    /// written, its version unchanged: damage on the server's disk.
    #[error("{path}: chunk 0 (bytes 0..{size}) does not match the hash recorded when the file was written: the server's copy is damaged")]
    Rot {
        /// The path.
        path: String,
        /// Its size (its only chunk's end).
        size: u64,
    },
    /// A file that changed while it was read for a download.
    #[error("{path}: file changed while it was read")]
    Changed {
        /// The path.
        path: String,
    },
    /// Creating the file to write failed.
    #[error("{0}: cannot create")]
    Create(String, #[source] std::io::Error),
    /// Writing the file, or setting its mode or mtime, failed.
    #[error("{path}: cannot {}", step.verb())]
    Write {
        /// The path.
        path: String,
        /// The step that failed.
        step: WholeStep,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Flushing a file's filesystem before its rename failed.
    #[error("{0}: cannot flush")]
    Flush(String, #[source] std::io::Error),
    /// Giving a file its final name failed.
    #[error("{0}: cannot rename into place")]
    Rename(String, #[source] std::io::Error),
    /// Flushing a file's filesystem after its rename failed.
    #[error("{0}: cannot flush the directory of")]
    FlushDir(String, #[source] std::io::Error),
    /// Reading a file failed.
    #[error("{0}: cannot read")]
    Read(String, #[source] std::io::Error),
    /// `fstat` of a file after reading it failed.
    #[error("{0}: cannot stat")]
    Stat(String, #[source] std::io::Error),
}

/// `UploadBatch`: pulls `region` with one READ into a pool buffer, then commits each
/// file of `files` (see the module's invariants). Returns one entry per file: `None`
/// for a file stored, or why it failed.
pub async fn upload(
    io: BatchIo<'_>,
    share: Arc<Share>,
    region: RegionDesc,
    algorithm: HashAlgorithm,
    files: Vec<BatchFile>,
) -> Result<Vec<Option<BatchError>>, BatchError> {
    // The session admitted the batch as a whole (`proto::batch::check_upload_batch`):
    // its region holds exactly its files' bytes and fits one buffer.
    share.check_writable()?;
    // The share's algorithm (`Request::ShareInfo`) is the only one its data is
    // recorded in.
    if algorithm != io.hashing.fresh {
        return Err(BatchError::WrongHash {
            share: share.display(""),
            sent: algorithm,
            wanted: io.hashing.fresh,
        });
    }
    let lease = io.pool.lease().await?;
    if region.len > 0 {
        // Bounded by `capacity` above, so the length fits a u32.
        let slice =
            RemoteSlice::of(&region, 0, region.len as u32).ok_or(BatchError::RegionWraps)?;
        io.transport
            .read(slice, lease.reg(), 0)
            .await
            .map_err(|source| BatchError::Transport {
                share: share.display(""),
                source,
            })?;
    }
    let buf = lease.buffer().clone();
    let (count, bytes) = (files.len(), region.len);
    // Made as the request's caller where the share's owners are the clients'.
    let (staged, results, share) = crate::owners::spawn_blocking(move || {
        let data = buf.blocking_read();
        let (staged, results) = stage_all(&share, algorithm, &files, &data[..]);
        (staged, results, share)
    })
    .await
    .map_err(BatchError::Task)?
    .map_err(BatchError::Act)?;
    // Every byte is in the new files: the buffer goes back to the pool before the
    // flushes, so the next window or batch of the connection need not wait for them.
    drop(lease);
    let results = crate::owners::spawn_blocking(move || commit_staged(&share, staged, results))
        .await
        .map_err(BatchError::Task)?
        .map_err(BatchError::Act)?;
    let failed = results.iter().filter(|r| r.is_some()).count();
    tracing::debug!(files = count, bytes, failed, "upload batch");
    Ok(results)
}

/// A file of an upload batch written, not yet under its final name.
struct Staged {
    index: usize,
    what: String,
    final_path: PathBuf,
    file: Unnamed,
    /// The filesystem the file is on.
    dev: u64,
    size: u64,
    mtime_ns: i128,
    hash: Hash256,
    /// The algorithm of `hash`.
    algorithm: HashAlgorithm,
}

impl Staged {
    fn abandon(self, results: &mut [Option<BatchError>], error: BatchError) {
        self.file.discard();
        results[self.index] = Some(error);
    }
}

/// Writes every file of a batch whose bytes are `data` to a new file; returns the
/// files staged and one result per file (the failures so far). Blocking.
fn stage_all(
    share: &Share,
    algorithm: HashAlgorithm,
    files: &[BatchFile],
    data: &[u8],
) -> (Vec<Staged>, Vec<Option<BatchError>>) {
    let mut results: Vec<Option<BatchError>> =
        std::iter::repeat_with(|| None).take(files.len()).collect();
    let mut staged = Vec::with_capacity(files.len());
    let mut seen = HashSet::with_capacity(files.len());
    let mut dirs = ResolvedDirs::default();
    let mut offset = 0usize;
    for (index, f) in files.iter().enumerate() {
        // check_upload: the sizes add up to data's length.
        let bytes = &data[offset..offset + f.size as usize];
        offset += f.size as usize;
        match stage(share, algorithm, index, f, bytes, &mut seen, &mut dirs) {
            Ok(s) => staged.push(s),
            Err(e) => results[index] = Some(e),
        }
    }
    (staged, results)
}

/// Flushes and renames the `staged` files of a batch, completing `results` (one per
/// file of the batch). Blocking.
fn commit_staged(
    share: &Share,
    staged: Vec<Staged>,
    mut results: Vec<Option<BatchError>>,
) -> Vec<Option<BatchError>> {
    // One flush for the batch (a group commit: one `syncfs` per filesystem, see
    // `sync_filesystems` for why not one fsync per file).
    let flushed = sync_all(&staged);
    let mut synced = Vec::with_capacity(staged.len());
    for (s, flush) in staged.into_iter().zip(flushed) {
        match flush {
            Ok(()) => synced.push(s),
            Err(e) => {
                let error = BatchError::Flush(s.what.clone(), e);
                s.abandon(&mut results, error);
            }
        }
    }
    // Only now, with every file of the batch durable, do final names change.
    let mut renamed = Vec::with_capacity(synced.len());
    for mut s in synced {
        // rename(2) of a file over a directory fails with EISDIR: no separate check.
        if let Err(e) = s.file.name(&s.final_path) {
            let error = match e.raw_os_error() {
                Some(nix::libc::EISDIR) => FsError::DirInTheWay {
                    path: s.what.clone(),
                }
                .into(),
                _ => BatchError::Rename(s.what.clone(), e),
            };
            s.abandon(&mut results, error);
            continue;
        }
        renamed.push(s);
    }
    // The renames made durable the same way (a file and its directory share a
    // filesystem): a file answered as stored survives a power cut.
    let flushed = sync_all(&renamed);
    for (s, flush) in renamed.iter().zip(flushed) {
        if let Err(e) = flush {
            results[s.index] = Some(BatchError::FlushDir(s.what.clone(), e));
        }
    }
    {
        let stored = renamed.iter().filter(|s| results[s.index].is_none());
        record(share.store(), stored);
    }
    results
}

/// One flush of each filesystem that `staged` is on (`sync_filesystems_on`); one result
/// per file. Blocking.
fn sync_all(staged: &[Staged]) -> Vec<std::io::Result<()>> {
    let files: Vec<&File> = staged.iter().map(|s| s.file.file()).collect();
    let devs: Vec<u64> = staged.iter().map(|s| s.dev).collect();
    sync_filesystems_on(&files, &devs)
}

/// Checks one file's bytes and path and writes it to a new file in its final directory
/// ([`Unnamed`]), with its mode and mtime. Blocking.
fn stage(
    share: &Share,
    algorithm: HashAlgorithm,
    index: usize,
    f: &BatchFile,
    bytes: &[u8],
    seen: &mut HashSet<PathBuf>,
    dirs: &mut ResolvedDirs,
) -> Result<Staged, BatchError> {
    let what = share.display(&f.path);
    let (final_path, dev) = share.resolve_for_write_in(&f.path, dirs)?;
    // Compared as resolved, so two spellings of one name are caught too.
    if !seen.insert(final_path.clone()) {
        return Err(BatchError::Twice { path: what });
    }
    if hash_chunk(algorithm, bytes) != f.hash {
        tracing::warn!(file = %what, %algorithm, "batched upload failed hash verification");
        return Err(BatchError::Integrity { path: what });
    }
    // A directory in the way is found by the rename (EISDIR), see `commit_staged`.
    let mut file = Unnamed::create(&final_path).map_err(|e| BatchError::Create(what.clone(), e))?;
    if let Err((step, source)) = write_whole(file.file_mut(), bytes, f.mode, f.mtime) {
        file.discard();
        return Err(BatchError::Write {
            path: what,
            step,
            source,
        });
    }
    Ok(Staged {
        index,
        what,
        final_path,
        file,
        dev,
        size: f.size,
        mtime_ns: i128::from(f.mtime.secs) * 1_000_000_000 + i128::from(f.mtime.nanos),
        hash: f.hash,
        algorithm,
    })
}

/// Saves the manifests of the committed files `stored` (one chunk each, or none for an
/// empty file), each if the file is still what the batch made it and its mtime is
/// settled, as an upload's commit does; each page of the store opened once. Failures
/// are logged only.
fn record<'s>(store: &ManifestStore, stored: impl Iterator<Item = &'s Staged>) {
    let mut what = Vec::new();
    let mut records = Vec::new();
    for s in stored {
        let Ok(meta) = s.file.file().metadata() else {
            continue;
        };
        let key = ManifestKey::of(&meta, store.chunk_bytes());
        if meta.size() != s.size
            || key.mtime_ns != s.mtime_ns
            || s.size > u64::from(store.chunk_bytes())
            || !mtime_settled(&key)
        {
            continue;
        }
        let hashes: &[Hash256] = if s.size == 0 {
            &[]
        } else {
            std::slice::from_ref(&s.hash)
        };
        what.push(&s.what);
        records.push((key, s.algorithm, hashes));
    }
    for (file, saved) in what.into_iter().zip(store.save_many(records)) {
        if let Err(e) = saved {
            tracing::debug!(file = %file, "cannot record the manifest: {e}");
        }
    }
}

/// `DownloadBatch`: reads every file of `paths` that fits into a pool buffer, back to
/// back, and writes them into `region` with one WRITE. Returns one entry per path: a
/// file in the region or not included ([`BatchedFile::Ok`] or
/// [`BatchedFile::NotIncluded`]), or why it failed.
pub async fn download(
    io: BatchIo<'_>,
    share: Arc<Share>,
    paths: Vec<String>,
    region: RegionDesc,
) -> Result<Vec<Result<BatchedFile, BatchError>>, BatchError> {
    let room = region.len.min(batch_capacity(io.chunk_bytes)) as usize;
    let lease = io.pool.lease().await?;
    let buf = lease.buffer().clone();
    let what = share.display("");
    let file_max = io.file_max;
    let (hashing, cache) = (io.hashing, io.cache.clone());
    // Read as the request's caller where the share's owners are the clients'.
    let (files, used) = crate::owners::spawn_blocking(move || {
        let mut data = buf.blocking_write();
        read_all(&share, &paths, &mut data[..room], file_max, hashing, cache)
    })
    .await
    .map_err(BatchError::Task)?
    .map_err(BatchError::Act)?;
    if used > 0 {
        // `used <= room <= capacity`, which fits a u32, and lies inside the region.
        let slice = RemoteSlice::of(&region, 0, used as u32).ok_or(BatchError::RegionWraps)?;
        io.transport
            .write(lease.reg(), 0, slice)
            .await
            .map_err(|source| BatchError::Transport {
                share: what,
                source,
            })?;
    }
    drop(lease);
    tracing::debug!(files = files.len(), bytes = used, "download batch");
    Ok(files)
}

/// Reads each path's file (of at most `file_max` bytes) into `room`, back to back;
/// returns an entry per path and the bytes used. A window of files is opened and their
/// reads started before they are read ([`ferry_common::readahead`]). Blocking.
fn read_all(
    share: &Share,
    paths: &[String],
    room: &mut [u8],
    file_max: u64,
    hashing: Hashing,
    cache: Arc<ManifestCache>,
) -> (Vec<Result<BatchedFile, BatchError>>, usize) {
    let mut used = 0usize;
    let mut files = Vec::with_capacity(paths.len());
    let mut dirs = ResolvedDirs::default();
    for window in paths.chunks(READ_AHEAD_FILES) {
        let opened: Vec<_> = window
            .iter()
            .map(|rel| open_small(share, rel, file_max, &mut dirs))
            .collect();
        for opened in opened {
            files.push(
                opened
                    .and_then(|o| {
                        let known = Known {
                            share,
                            hashing,
                            cache: &cache,
                        };
                        read_one(o, &mut room[used..], file_max, &known)
                    })
                    .map(|read| match read {
                        Some((attr, hash, algorithm)) => {
                            let offset = used as u64;
                            used += attr.size as usize;
                            BatchedFile::Ok {
                                attr,
                                offset,
                                hash,
                                algorithm,
                            }
                        }
                        None => BatchedFile::NotIncluded,
                    }),
            );
        }
    }
    (files, used)
}

/// A file of a download batch, opened.
struct Opened {
    what: String,
    file: File,
    meta: fs::Metadata,
}

/// Opens the file `rel` as `DownloadOpen` does (its parent resolved through `dirs`,
/// once per batch) and, if it has at most `file_max` bytes, starts reading it into the
/// page cache. Blocking.
fn open_small(
    share: &Share,
    rel: &str,
    file_max: u64,
    dirs: &mut ResolvedDirs,
) -> Result<Opened, BatchError> {
    let what = share.display(rel);
    let (file, meta) = match open_plain(share, rel, dirs) {
        Some(opened) => opened,
        None => {
            let path = share.resolve_in(rel, true, dirs)?;
            open_regular_at(&path, &what)?
        }
    };
    if meta.len() <= file_max {
        will_need(&file, meta.len());
    }
    Ok(Opened { what, file, meta })
}

/// The usual case of [`open_small`] in two system calls: `rel` names a regular file,
/// not a symlink, in its resolved parent (opened with `O_NOFOLLOW`, so nothing outside
/// that directory is reached). `None` for anything else (a symlink, a missing file,
/// not a regular file, a reserved name), which the general path then resolves or
/// reports as it always does.
fn open_plain(share: &Share, rel: &str, dirs: &mut ResolvedDirs) -> Option<(File, fs::Metadata)> {
    let path = share.resolve_in(rel, false, dirs).ok()?;
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    let meta = file.metadata().ok()?;
    meta.is_file().then_some((file, meta))
}

/// Where a download batch looks for the hashes recorded when a file was written.
struct Known<'a> {
    share: &'a Share,
    hashing: Hashing,
    cache: &'a ManifestCache,
}

impl Known<'_> {
    /// The hash recorded for the whole of the file version `meta` (one chunk of the
    /// store's size at most), if known: in an algorithm the session accepts, or in
    /// another one (which what is read must then be checked against).
    fn recorded(&self, meta: &fs::Metadata, what: &str) -> Recorded {
        let store = self.share.store();
        if meta.len() == 0 || meta.len() > u64::from(store.chunk_bytes()) {
            return Recorded::Nothing;
        }
        let key = ManifestKey::of(meta, store.chunk_bytes());
        match look_up(&key, what, self.hashing.accept, self.cache, Some(store)) {
            manifests::Known::Accepted(h) => h
                .hashes
                .first()
                .map(|&hash| Recorded::Accepted(hash, h.algorithm)),
            manifests::Known::OtherAlgorithm(h) => h
                .hashes
                .first()
                .map(|&hash| Recorded::Other(hash, h.algorithm)),
            manifests::Known::Nothing => None,
        }
        .unwrap_or(Recorded::Nothing)
    }
}

/// What [`Known::recorded`] found of one small file.
enum Recorded {
    /// Its hash in an algorithm the session accepts: sent as it is.
    Accepted(Hash256, HashAlgorithm),
    /// Its hash in another algorithm: the bytes read are checked against it.
    Other(Hash256, HashAlgorithm),
    /// No record.
    Nothing,
}

/// Reads the file `opened` whole to the start of `room` and returns its attributes (its
/// `size` is the length read), hash and the hash's algorithm; `None` if it is larger
/// than `file_max` or than `room`. The hash is the one recorded when the file was
/// written, if `known` has it (then the bytes are not hashed here), else taken from the
/// bytes read, in the session's algorithm for new data. Blocking.
fn read_one(
    opened: Opened,
    room: &mut [u8],
    file_max: u64,
    known: &Known<'_>,
) -> Result<Option<(Attr, Hash256, HashAlgorithm)>, BatchError> {
    let Opened { what, file, meta } = opened;
    let size = meta.len();
    if size > file_max || size > room.len() as u64 {
        return Ok(None);
    }
    let len = size as usize;
    let changed = || BatchError::Changed { path: what.clone() };
    match file.read_exact_at(&mut room[..len], 0) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(changed()),
        Err(e) => return Err(BatchError::Read(what, e)),
    }
    let after = file
        .metadata()
        .map_err(|e| BatchError::Stat(what.clone(), e))?;
    let attr = attr_of(&meta, None);
    if after.len() != size || attr_of(&after, None).mtime != attr.mtime {
        return Err(changed());
    }
    let data = &room[..len];
    let fresh = known.hashing.fresh;
    let (hash, algorithm) = match known.recorded(&meta, &what) {
        Recorded::Accepted(hash, algorithm) => (hash, algorithm),
        Recorded::Other(hash, other) => {
            if hash_chunk(other, data) != hash {
                tracing::error!(
                    file = %what,
                    chunk = 0,
                    bytes = %format!("0..{size}"),
                    algorithm = %other,
                    "{ROT_LOG}"
                );
                return Err(BatchError::Rot { path: what, size });
            }
            (hash_chunk(fresh, data), fresh)
        }
        Recorded::Nothing => (hash_chunk(fresh, data), fresh),
    };
    Ok(Some((attr, hash, algorithm)))
}
