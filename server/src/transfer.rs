//! Uploads (pulled with one-sided READs) and downloads (pushed with one-sided WRITEs).
//!
//! Here: an upload ([`Upload`]) and the base file it may copy chunks from
//! ([`BaseFile`]); each chunk of an upload's window in `pull`; a download ([`Download`])
//! in `download`. Both fail with [`TransferError`].
//!
//! Invariants:
//! - An upload writes only to a hidden file in the target directory
//!   ([`ferry_common::staging`]), whose declared size is reserved when it is opened (a
//!   file that cannot fit is refused with "no space" before any data moves). It is
//!   renamed to the final name only by [`Upload::commit`], after every chunk verified
//!   against its hash and the manifest hash matched.
//! - An upload's hashes are in one algorithm, told to the client at open
//!   ([`Upload::algorithm`]): the one an interrupted upload it resumes started with,
//!   else the base's manifest's, else the share's for new data.
//! - A file of several chunks is written to a resumable partial with a journal: each
//!   chunk is journaled after its bytes were written. A later upload of the same name,
//!   size and chunk size takes the journal as hints: a chunk whose hint equals the
//!   client's hash is read back from the partial and hashed again, and only if that
//!   matches is it not pulled. So every chunk of a committed file was verified against
//!   the client's hash by this server, pulled or not.
//! - [`Upload::discard`] (an explicit close) removes the partial and its journal.
//!   Dropping an uncommitted upload otherwise (connection lost, client killed, server
//!   shutting down) keeps a resumable partial for the next attempt and removes a
//!   scratch file.
//! - A window's response is sent only after every one-sided operation of that window
//!   completed (successfully or not), so no chunk buffer is reused while the transport
//!   may still fill or drain it.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions, Permissions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use ferry_common::chunk::{chunk_len, hash_chunk};
use ferry_common::direct::DirectFile;
use ferry_common::journal::JournalHeader;
use ferry_common::msg::{
    Hash256, HashAlgorithm, RegionDesc, Response, Timestamp, MAX_WINDOW_CHUNKS,
};
use ferry_common::proto::caps::Algorithms;
use ferry_common::proto::transfer::UploadState;
use ferry_common::proto::ProtoError;
use ferry_common::space::{self, Deferred};
use ferry_common::staging::{StageError, StageOp, Staged};
use ferry_common::transport::{SharedTransport, TransportError};
use ferry_common::writeback::{sync_filesystem, Writeback};
use tokio::task::{JoinError, JoinSet};

use crate::conn::Hashing;
use crate::filekey::{mtime_settled, ManifestKey, CACHE_SETTLE};
use crate::fsops::{no_dir_in_the_way, FsError};
use crate::manifests::{manifest_of, ManifestCache, ManifestError};
use crate::pool::{Pool, PoolError};
use crate::share::{Share, ShareError};
use crate::store::ManifestStore;

mod download;
mod pull;

pub use download::Download;
use pull::{PullChunk, Sink};

/// An open upload.
pub struct Upload {
    what: String,
    final_path: PathBuf,
    staged: Mutex<Staged>,
    file: Arc<File>,
    /// Where chunk data goes: `file`, its aligned blocks written direct where allowed,
    /// and the partial's journal.
    sink: Sink,
    header: JournalHeader,
    /// Chunks an interrupted upload of this file journaled: index to hash.
    hints: BTreeMap<u64, Hash256>,
    /// The base file of an [`Request::UploadOpenBase`](ferry_common::msg::Request), if
    /// any.
    base: Option<Arc<BaseFile>>,
    writeback: Writeback,
    /// The file's reservation, for a file of more than one window: made beside the
    /// first windows ([`Deferred`]), waited for before every write, the commit, and
    /// the file's removal or release (so the space is given back, not taken again
    /// after).
    reserved: Option<Arc<Deferred>>,
    state: Mutex<UploadState>,
    mode: u32,
    mtime: Timestamp,
    chunk_bytes: u32,
    /// The share's manifest store, where the committed file's manifest is recorded.
    store: Option<Arc<ManifestStore>>,
}

/// A failed upload or download, naming the share-relative path (`share/dir/file`) of
/// its file.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The path cannot be used (see [`ShareError`]).
    #[error(transparent)]
    Share(#[from] ShareError),
    /// A directory is in the way of the upload, or a download names something else
    /// than a regular file (see [`FsError`]).
    #[error(transparent)]
    Fs(#[from] FsError),
    /// No chunk buffer could be lent.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The base file's manifest could not be taken.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// Opening, resuming or committing the hidden file of an upload failed.
    #[error("{path}: cannot stage")]
    Stage {
        /// The file.
        path: String,
        /// Which step failed, and why.
        #[source]
        source: StageError,
    },
    /// A one-sided READ or WRITE of a chunk failed.
    #[error("{path}: transfer failed")]
    Transport {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: TransportError,
    },
    /// A window the transfer's state refuses.
    #[error("{path}: bad window")]
    Window {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: ProtoError,
    },
    /// A verified chunk the upload's state refuses.
    #[error(transparent)]
    Chunk(ProtoError),
    /// A commit before every chunk was verified, or with the wrong manifest.
    #[error("{path}: not committed")]
    NotCommitted {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: ProtoError,
    },
    /// A chunk that does not lie in the client's region.
    #[error("{path}: chunk outside the region")]
    OutsideRegion {
        /// The file.
        path: String,
    },
    /// A pulled chunk whose bytes do not hash to the client's hash.
    #[error("{path}: chunk {index} (bytes {start}..{end}) failed {algorithm} verification")]
    Integrity {
        /// The file.
        path: String,
        /// The algorithm of the hash it failed.
        algorithm: HashAlgorithm,
        /// The chunk's index.
        index: u64,
        /// Its first byte's offset.
        start: u64,
        /// The offset past its last byte.
        end: u64,
    },
    /// A chunk of a file being read whose bytes no longer match the hash recorded
    /// when it was written, the file's version unchanged: damage on the server's disk.
    #[error("{path}: chunk {index} (bytes {start}..{end}) does not match the hash recorded when the file was written: the server's copy is damaged")]
    Rot {
        /// The file.
        path: String,
        /// The chunk's index.
        index: u64,
        /// Its first byte's offset.
        start: u64,
        /// The offset past its last byte.
        end: u64,
    },
    /// The blocking task hashing or writing an upload's chunk failed.
    #[error("{path}: hashing task failed")]
    HashTask {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: JoinError,
    },
    /// The blocking task reading a download's chunk failed.
    #[error("{path}: read task failed")]
    ReadTask {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: JoinError,
    },
    /// A chunk's task of a window failed.
    #[error("chunk task failed")]
    ChunkTask(#[source] JoinError),
    /// A download's file shrank below its size at open.
    #[error("{path}: file shrank during the download")]
    Shrank {
        /// The file.
        path: String,
    },
    /// A download's file was modified while it was read.
    #[error("{path}: file changed during the download")]
    ChangedDuring {
        /// The file.
        path: String,
    },
    /// An upload's base that is not a regular file.
    #[error("{path}: the base is not a regular file")]
    BaseNotRegular {
        /// The base's path.
        path: String,
    },
    /// Opening an upload's base failed.
    #[error("{0}: cannot open the base")]
    OpenBase(String, #[source] std::io::Error),
    /// Opening a download's file failed.
    #[error("{0}: cannot open")]
    Open(String, #[source] std::io::Error),
    /// `fstat` failed.
    #[error("{0}: cannot stat")]
    Stat(String, #[source] std::io::Error),
    /// Cutting an upload's file to its size failed.
    #[error("{0}: cannot truncate")]
    Truncate(String, #[source] std::io::Error),
    /// Setting an upload's mode failed.
    #[error("{0}: cannot chmod")]
    Chmod(String, #[source] std::io::Error),
    /// Setting an upload's mtime failed.
    #[error("{0}: cannot set mtime")]
    SetMtime(String, #[source] std::io::Error),
    /// Syncing an upload's file failed.
    #[error("{0}: cannot fsync")]
    Fsync(String, #[source] std::io::Error),
    /// Syncing the directory of a committed upload failed.
    #[error("{0}: cannot fsync the directory")]
    FsyncDir(String, #[source] std::io::Error),
    /// Writing a chunk failed.
    #[error("{0}: cannot write")]
    Write(String, #[source] std::io::Error),
    /// Reading a chunk failed.
    #[error("{0}: cannot read")]
    Read(String, #[source] std::io::Error),
}

/// A file whose chunks an upload may copy instead of pulling.
///
/// Invariant: `offsets` maps a chunk hash of the base's manifest (in the upload's
/// chunk size) to the offset of one chunk that had it when the manifest was taken. The
/// base may have changed since, so a chunk copied from it is hashed again before use.
pub struct BaseFile {
    file: File,
    /// The algorithm of the base's manifest, and so of `offsets`' keys.
    algorithm: HashAlgorithm,
    size: u64,
    chunk_bytes: u32,
    offsets: HashMap<Hash256, u64>,
}

impl BaseFile {
    /// Opens the regular file `rel` (final component not followed) and takes its
    /// manifest in chunks of `chunk_bytes` ([`manifest_of`]: its recorded one in an
    /// algorithm of `hashing.accept`, else hashed in `hashing.fresh`). Blocking.
    pub fn open(
        share: &Share,
        rel: &str,
        chunk_bytes: u32,
        cache: &ManifestCache,
        hashing: Hashing,
    ) -> Result<BaseFile, TransferError> {
        let what = share.display(rel);
        let path = share.resolve(rel, false)?;
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NONBLOCK | nix::libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|e| TransferError::OpenBase(what.clone(), e))?;
        let meta = file
            .metadata()
            .map_err(|e| TransferError::Stat(what.clone(), e))?;
        if !meta.is_file() {
            return Err(TransferError::BaseNotRegular { path: what });
        }
        let (manifest, meta) = manifest_of(
            &file,
            chunk_bytes,
            hashing.accept,
            hashing.fresh,
            &what,
            cache,
            Some(&**share.store()),
            CACHE_SETTLE,
        )?;
        let mut offsets = HashMap::with_capacity(manifest.hashes.len());
        for (i, h) in manifest.hashes.iter().enumerate() {
            offsets
                .entry(*h)
                .or_insert(i as u64 * u64::from(chunk_bytes));
        }
        Ok(BaseFile {
            file,
            algorithm: manifest.algorithm,
            size: meta.size(),
            chunk_bytes,
            offsets,
        })
    }

    /// Copies `len` bytes of a base chunk hashing to `expected` into `buf`, if the base
    /// has one and it still hashes so. Blocking.
    fn find(&self, expected: &Hash256, len: usize, buf: &mut [u8]) -> bool {
        let Some(&offset) = self.offsets.get(expected) else {
            return false;
        };
        let available = chunk_len(
            self.size,
            self.chunk_bytes,
            offset / u64::from(self.chunk_bytes),
        );
        len <= buf.len()
            && len as u64 == available
            && self.file.read_exact_at(&mut buf[..len], offset).is_ok()
            && hash_chunk(self.algorithm, &buf[..len]) == *expected
    }
}

impl Upload {
    /// Opens an upload of `size` bytes to `rel`: opens (or resumes) its hidden file next
    /// to the final name and reserves `size` bytes. With a `base`, chunks the base holds
    /// with the client's hash are copied from it instead of pulled. Blocking.
    ///
    /// The upload's algorithm ([`Upload::algorithm`]): with a base, the base manifest's
    /// (its hashes are what chunks are matched by); else that of the journal of an
    /// interrupted upload of the same file in an algorithm of `hashing.accept` (so a
    /// resumed upload keeps the algorithm it started with; a share whose configuration
    /// fixes an algorithm accepts only that one); else `hashing.fresh`.
    #[allow(clippy::too_many_arguments)]
    pub fn open(
        share: &Share,
        rel: &str,
        size: u64,
        mode: u32,
        mtime: Timestamp,
        chunk_bytes: u32,
        base: Option<BaseFile>,
        hashing: Hashing,
    ) -> Result<Upload, TransferError> {
        let what = share.display(rel);
        let final_path = share.resolve_for_write(rel)?;
        no_dir_in_the_way(&final_path, &what)?;
        let (wanted, accept) = match (&base, share.hash()) {
            (Some(b), _) => (b.algorithm, Algorithms::of(&[b.algorithm])),
            (None, Some(fixed)) => (fixed, Algorithms::of(&[fixed])),
            (None, None) => (hashing.fresh, hashing.accept),
        };
        // The upload's own chunk hashes decide what may be reused, so the journal does
        // not name a source.
        let header = JournalHeader {
            size,
            chunk_bytes,
            algorithm: wanted,
            source: [0; 32],
        };
        // A file of more than one window is reserved beside its first windows: on a
        // file system that allocates every page at once (tmpfs) that takes a tenth of
        // a copy, with nothing on the wire. One that does not fit then fails its first
        // window with the reservation's error, before any of its bytes is written.
        let defer = space::reserve_beside(size, chunk_bytes);
        let staged = if defer {
            Staged::open_unreserved(&final_path, &header, accept)
        } else {
            Staged::open(&final_path, &header, accept)
        }
        .map_err(|source| TransferError::Stage {
            path: what.clone(),
            source,
        })?;
        let header = *staged.header();
        // Hints in another algorithm than the upload's can match no hash the client
        // sends: the partial's bytes are pulled again.
        let hints = if staged.hints_algorithm() == header.algorithm {
            staged.hints().clone()
        } else {
            BTreeMap::new()
        };
        if !hints.is_empty() {
            tracing::info!(file = %what, chunks = hints.len(), "resuming an interrupted upload");
        }
        let file = staged.file().clone();
        let reserved = defer.then(|| Deferred::start(file.clone(), size));
        let sink = Sink {
            out: Arc::new(DirectFile::for_writing(file.clone(), size)),
            journal: staged.journal(),
            reserved: reserved.clone(),
        };
        Ok(Upload {
            what,
            final_path,
            staged: Mutex::new(staged),
            header,
            hints,
            base: base.map(Arc::new),
            writeback: Writeback::new(file.clone()),
            reserved,
            sink,
            file,
            state: Mutex::new(UploadState::new(
                header.algorithm,
                size,
                chunk_bytes,
                MAX_WINDOW_CHUNKS,
            )),
            mode,
            mtime,
            chunk_bytes,
            store: Some(share.store().clone()),
        })
    }

    /// The algorithm of the upload's hashes, which the client must hash in.
    pub fn algorithm(&self) -> HashAlgorithm {
        self.header.algorithm
    }

    fn state(&self) -> std::sync::MutexGuard<'_, UploadState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn staged(&self) -> std::sync::MutexGuard<'_, Staged> {
        self.staged.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Receives one window: each chunk that the partial file already holds with the
    /// hash in `hashes` (journaled by an interrupted upload, then read back and hashed
    /// again) is kept; each other chunk that the base holds with that hash (read from
    /// the base and hashed again) is copied; every other chunk is pulled by RDMA READ from the client's
    /// `region` into a pool buffer, checked against `hashes` and written.
    pub async fn pull_window(
        &self,
        transport: &SharedTransport,
        pool: &Arc<Pool>,
        offset: u64,
        region: RegionDesc,
        hashes: Vec<Hash256>,
    ) -> Result<Response, TransferError> {
        let window = self
            .state()
            .handle_window(offset, region.len, &hashes)
            .map_err(|source| TransferError::Window {
                path: self.what.clone(),
                source,
            })?;
        let mut tasks = JoinSet::new();
        for (chunk, expected) in window.chunks(self.chunk_bytes).zip(hashes) {
            let job = PullChunk {
                transport: transport.clone(),
                pool: pool.clone(),
                file: self.file.clone(),
                sink: self.sink.clone(),
                header: self.header,
                what: self.what.clone(),
                region,
                window,
                chunk,
                expected,
                hinted: self.hints.get(&chunk.index) == Some(&expected),
                base: self
                    .base
                    .clone()
                    .filter(|b| b.offsets.contains_key(&expected)),
            };
            tasks.spawn(job.run());
        }
        match join_all(tasks).await {
            Ok(done) => {
                let (mut pulled, mut reused, mut written) = (0, 0, 0);
                let mut state = self.state();
                for c in done {
                    state
                        .handle_chunk_pulled(c.index, c.hash)
                        .map_err(TransferError::Chunk)?;
                    match c.reused {
                        true => reused += u64::from(c.len),
                        false => pulled += u64::from(c.len),
                    }
                    if c.written {
                        written += u64::from(c.len);
                    }
                }
                // Direct writes leave no dirty pages to push early; the commit's fsync
                // flushes the device's cache once.
                if !self.sink.out.is_direct() {
                    self.writeback.wrote(written);
                }
                Ok(Response::WindowPulled {
                    bytes: pulled,
                    reused,
                })
            }
            Err(e) => {
                self.state().handle_window_failed(window);
                Err(e)
            }
        }
    }

    /// Commits: checks every chunk verified and the manifest, sets mode and mtime,
    /// makes the file durable, renames it into place (removing the journal) and makes
    /// the rename durable. Both flushes are `syncfs` calls shared with every other
    /// commit of the filesystem in flight ([`ferry_common::writeback::GroupSync`]): a
    /// group commit, so files committed together pay two flushes between them.
    /// Then records the verified manifest in the share's store (see [`Upload::record`]).
    /// Blocking.
    pub fn commit(&self, manifest: &Hash256) -> Result<Response, TransferError> {
        let (size, hashes) = {
            let state = self.state();
            let hashes = state
                .commit(manifest)
                .map_err(|source| TransferError::NotCommitted {
                    path: self.what.clone(),
                    source,
                })?;
            (state.size(), hashes)
        };
        let what = &self.what;
        if let Some(r) = &self.reserved {
            r.wait().map_err(|e| reserve_failed(what, e))?;
        }
        let mut staged = self.staged();
        let file = &self.file;
        let failed = |op: fn(String, std::io::Error) -> TransferError| {
            move |e: std::io::Error| op(what.clone(), e)
        };
        if file.metadata().map_err(failed(TransferError::Stat))?.len() != size {
            file.set_len(size)
                .map_err(failed(TransferError::Truncate))?;
        }
        file.set_permissions(Permissions::from_mode(self.mode & 0o7777))
            .map_err(failed(TransferError::Chmod))?;
        file.set_modified(self.mtime.to_system())
            .map_err(failed(TransferError::SetMtime))?;
        self.writeback
            .finish_grouped()
            .map_err(failed(TransferError::Fsync))?;
        // The rename is relative to the directory the upload was opened in (see
        // `Staged`), which the client may have renamed since; a file renamed over a
        // directory fails with EISDIR, so no separate (path-based) check.
        staged.commit(&self.final_path).map_err(|source| {
            if source.source.raw_os_error() == Some(nix::libc::EISDIR) {
                TransferError::Fs(FsError::DirInTheWay { path: what.clone() })
            } else {
                TransferError::Stage {
                    path: what.clone(),
                    source,
                }
            }
        })?;
        // The directory is on the file's filesystem: its flush covers the rename.
        sync_filesystem(file).map_err(failed(TransferError::FsyncDir))?;
        if let Some(store) = &self.store {
            self.record(store, size, &hashes);
        }
        Ok(Response::Committed { size })
    }

    /// Saves `hashes`, every one verified by this server as it wrote the chunk, as the
    /// manifest of the committed file under its key now, if the file is still what this
    /// upload made it (`size` bytes, the upload's mtime) and that mtime lies far enough
    /// before the commit that a later write would change the key ([`mtime_settled`]).
    /// Failures are logged, never returned: the file is committed either way.
    fn record(&self, store: &ManifestStore, size: u64, hashes: &[Hash256]) {
        let Ok(meta) = self.file.metadata() else {
            return;
        };
        let key = ManifestKey::of(&meta, self.chunk_bytes);
        let mtime = i128::from(self.mtime.secs) * 1_000_000_000 + i128::from(self.mtime.nanos);
        if meta.size() != size || key.mtime_ns != mtime || !mtime_settled(&key) {
            return;
        }
        match store.save(&key, self.header.algorithm, hashes) {
            Ok(()) => tracing::debug!(file = %self.what, "manifest recorded at commit"),
            Err(e) => tracing::debug!(file = %self.what, "cannot record the manifest: {e}"),
        }
    }

    /// Abandons the upload for good: removes its hidden file and journal. Blocking.
    pub fn discard(&self) {
        if let Some(r) = &self.reserved {
            let _ = r.wait();
        }
        self.staged().discard();
    }
}

impl Drop for Upload {
    /// Waits for a reservation still being made (an upload dropped within its first
    /// windows), so that the staged file's removal or release comes after it. Blocking
    /// that long at most.
    fn drop(&mut self) {
        if let Some(r) = &self.reserved {
            let _ = r.wait();
        }
    }
}

/// The error of a reservation made beside the first windows, as [`Staged::open`]'s.
fn reserve_failed(what: &str, source: std::io::Error) -> TransferError {
    TransferError::Stage {
        path: what.to_owned(),
        source: StageError {
            op: StageOp::Reserve,
            source,
        },
    }
}

/// Waits for every task of a window, returning all results or the first error.
async fn join_all<T: 'static>(
    mut tasks: JoinSet<Result<T, TransferError>>,
) -> Result<Vec<T>, TransferError> {
    let mut out = Vec::new();
    let mut first_err = None;
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok(v)) => out.push(v),
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(e) => {
                first_err.get_or_insert(TransferError::ChunkTask(e));
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// An open transfer of a connection.
pub enum Transfer {
    /// An upload (boxed, as is a download: they differ much in size).
    Upload(Box<Upload>),
    /// A download.
    Download(Box<Download>),
}
