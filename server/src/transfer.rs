//! Uploads (pulled with one-sided READs) and downloads (pushed with one-sided WRITEs).
//!
//! Invariants:
//! - An upload writes only to a hidden file in the target directory
//!   ([`ferry_common::staging`]), whose declared size is reserved when it is opened (a
//!   file that cannot fit is refused with "no space" before any data moves). It is
//!   renamed to the final name only by [`Upload::commit`], after every chunk verified
//!   against its SHA-256 and the manifest hash matched.
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
use ferry_common::journal::{JournalHeader, JournalWriter};
use ferry_common::msg::{
    Attr, ErrorKind, RegionDesc, RemoteError, Response, Sha256, Timestamp, MAX_WINDOW_CHUNKS,
};
use ferry_common::proto::transfer::{check_window, ChunkRef, UploadState, Window};
use ferry_common::staging::{chunk_matches, StageError, Staged};
use ferry_common::transport::{RemoteSlice, SharedTransport, TransportError};
use ferry_common::writeback::Writeback;
use tokio::task::JoinSet;

use crate::error::{io_error, remote};
use crate::fsops::{dir_in_the_way, no_dir_in_the_way};
use crate::manifests::{manifest_of, ManifestCache, ManifestKey, CACHE_SETTLE};
use crate::pool::Pool;
use crate::share::Share;
use crate::store::{mtime_settled, ManifestStore};

/// An open upload.
pub struct Upload {
    what: String,
    final_path: PathBuf,
    staged: Mutex<Staged>,
    file: Arc<File>,
    /// `file` for chunk data: its aligned blocks written direct where allowed.
    out: Arc<DirectFile>,
    /// The partial's journal; `None` for a scratch file.
    journal: Option<Arc<JournalWriter>>,
    header: JournalHeader,
    /// Chunks an interrupted upload of this file journaled: index to hash.
    hints: BTreeMap<u64, Sha256>,
    /// The base file of an [`Request::UploadOpenBase`](ferry_common::msg::Request), if
    /// any.
    base: Option<Arc<BaseFile>>,
    writeback: Writeback,
    state: Mutex<UploadState>,
    mode: u32,
    mtime: Timestamp,
    chunk_bytes: u32,
    /// The share's manifest store, where the committed file's manifest is recorded.
    store: Option<Arc<ManifestStore>>,
}

fn transport_error(what: &str, e: TransportError) -> RemoteError {
    remote(ErrorKind::Io, format!("{what}: transfer failed: {e}"))
}

fn stage_error(what: &str, e: &StageError) -> RemoteError {
    io_error(e.op.verb(), what, &e.source)
}

/// A file whose chunks an upload may copy instead of pulling.
///
/// Invariant: `offsets` maps a chunk hash of the base's manifest (in the upload's
/// chunk size) to the offset of one chunk that had it when the manifest was taken. The
/// base may have changed since, so a chunk copied from it is hashed again before use.
pub struct BaseFile {
    file: File,
    size: u64,
    chunk_bytes: u32,
    offsets: HashMap<Sha256, u64>,
}

impl BaseFile {
    /// Opens the regular file `rel` (final component not followed) and takes its
    /// manifest in chunks of `chunk_bytes` (from `cache` if it is there). Blocking.
    pub fn open(
        share: &Share,
        rel: &str,
        chunk_bytes: u32,
        cache: &ManifestCache,
    ) -> Result<BaseFile, RemoteError> {
        let what = share.display(rel);
        let path = share.resolve(rel, false)?;
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NONBLOCK | nix::libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|e| io_error("open the base", &what, &e))?;
        let meta = file.metadata().map_err(|e| io_error("stat", &what, &e))?;
        if !meta.is_file() {
            return Err(remote(
                ErrorKind::InvalidPath,
                format!("{what}: the base is not a regular file"),
            ));
        }
        let (hashes, meta) = manifest_of(
            &file,
            chunk_bytes,
            &what,
            cache,
            share.store().map(|s| &**s),
            CACHE_SETTLE,
        )?;
        let mut offsets = HashMap::with_capacity(hashes.len());
        for (i, h) in hashes.iter().enumerate() {
            offsets
                .entry(*h)
                .or_insert(i as u64 * u64::from(chunk_bytes));
        }
        Ok(BaseFile {
            file,
            size: meta.size(),
            chunk_bytes,
            offsets,
        })
    }

    /// Copies `len` bytes of a base chunk hashing to `expected` into `buf`, if the base
    /// has one and it still hashes so. Blocking.
    fn find(&self, expected: &Sha256, len: usize, buf: &mut [u8]) -> bool {
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
            && hash_chunk(&buf[..len]) == *expected
    }
}

impl Upload {
    /// Opens an upload of `size` bytes to `rel`: opens (or resumes) its hidden file next
    /// to the final name and reserves `size` bytes. With a `base`, chunks the base holds
    /// with the client's hash are copied from it instead of pulled. Blocking.
    pub fn open(
        share: &Share,
        rel: &str,
        size: u64,
        mode: u32,
        mtime: Timestamp,
        chunk_bytes: u32,
        base: Option<BaseFile>,
    ) -> Result<Upload, RemoteError> {
        let what = share.display(rel);
        let final_path = share.resolve_for_write(rel)?;
        no_dir_in_the_way(&final_path, &what)?;
        // The upload's own chunk hashes decide what may be reused, so the journal does
        // not name a source.
        let header = JournalHeader {
            size,
            chunk_bytes,
            source: [0; 32],
        };
        let staged = Staged::open(&final_path, &header).map_err(|e| stage_error(&what, &e))?;
        let hints = staged.hints().clone();
        if !hints.is_empty() {
            tracing::info!(file = %what, chunks = hints.len(), "resuming an interrupted upload");
        }
        let file = staged.file().clone();
        Ok(Upload {
            what,
            final_path,
            journal: staged.journal(),
            staged: Mutex::new(staged),
            header,
            hints,
            base: base.map(Arc::new),
            writeback: Writeback::new(file.clone()),
            out: Arc::new(DirectFile::for_writing(file.clone(), size)),
            file,
            state: Mutex::new(UploadState::new(size, chunk_bytes, MAX_WINDOW_CHUNKS)),
            mode,
            mtime,
            chunk_bytes,
            store: share.store().cloned(),
        })
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
        hashes: Vec<Sha256>,
    ) -> Result<Response, RemoteError> {
        let window = self
            .state()
            .handle_window(offset, region.len, &hashes)
            .map_err(|e| remote(ErrorKind::Protocol, format!("{}: {e}", self.what)))?;
        let mut tasks = JoinSet::new();
        for (chunk, expected) in window.chunks(self.chunk_bytes).zip(hashes) {
            let job = PullChunk {
                transport: transport.clone(),
                pool: pool.clone(),
                file: self.file.clone(),
                out: self.out.clone(),
                journal: self.journal.clone(),
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
                        .map_err(|e| remote(ErrorKind::Protocol, e.to_string()))?;
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
                if !self.out.is_direct() {
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

    /// Commits: checks every chunk verified and the manifest, fsyncs, sets mode and
    /// mtime, renames into place (removing the journal) and fsyncs the directory.
    /// Then records the verified manifest in the share's store (see [`Upload::record`]).
    /// Blocking.
    pub fn commit(&self, manifest: &Sha256) -> Result<Response, RemoteError> {
        let (size, hashes) = {
            let state = self.state();
            let hashes = state.commit(manifest).map_err(|e| {
                remote(
                    ErrorKind::Integrity,
                    format!("{}: not committed: {e}", self.what),
                )
            })?;
            (state.size(), hashes)
        };
        let what = &self.what;
        let mut staged = self.staged();
        let file = &self.file;
        if file
            .metadata()
            .map_err(|e| io_error("stat", what, &e))?
            .len()
            != size
        {
            file.set_len(size)
                .map_err(|e| io_error("truncate", what, &e))?;
        }
        file.set_permissions(Permissions::from_mode(self.mode & 0o7777))
            .map_err(|e| io_error("chmod", what, &e))?;
        file.set_modified(self.mtime.to_system())
            .map_err(|e| io_error("set mtime", what, &e))?;
        self.writeback
            .finish()
            .map_err(|e| io_error("fsync", what, &e))?;
        // The rename is relative to the directory the upload was opened in (see
        // `Staged`), which the client may have renamed since; a file renamed over a
        // directory fails with EISDIR, so no separate (path-based) check.
        staged.commit(&self.final_path).map_err(|e| {
            if e.source.raw_os_error() == Some(nix::libc::EISDIR) {
                dir_in_the_way(what)
            } else {
                stage_error(what, &e)
            }
        })?;
        staged
            .sync_dir()
            .map_err(|e| io_error("fsync the directory", what, &e))?;
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
    fn record(&self, store: &ManifestStore, size: u64, hashes: &[Sha256]) {
        let Ok(meta) = self.file.metadata() else {
            return;
        };
        let key = ManifestKey::of(&meta, self.chunk_bytes);
        let mtime = i128::from(self.mtime.secs) * 1_000_000_000 + i128::from(self.mtime.nanos);
        if meta.size() != size || key.mtime_ns != mtime || !mtime_settled(&key) {
            return;
        }
        match store.save(&key, hashes) {
            Ok(()) => tracing::debug!(file = %self.what, "manifest recorded at commit"),
            Err(e) => tracing::debug!(file = %self.what, "cannot record the manifest: {e}"),
        }
    }

    /// Abandons the upload for good: removes its hidden file and journal. Blocking.
    pub fn discard(&self) {
        self.staged().discard();
    }
}

/// Waits for every task of a window, returning all results or the first error.
async fn join_all<T: 'static>(
    mut tasks: JoinSet<Result<T, RemoteError>>,
) -> Result<Vec<T>, RemoteError> {
    let mut out = Vec::new();
    let mut first_err = None;
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok(v)) => out.push(v),
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(e) => {
                first_err.get_or_insert(remote(ErrorKind::Io, format!("chunk task failed: {e}")));
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

struct PullChunk {
    transport: SharedTransport,
    pool: Arc<Pool>,
    file: Arc<File>,
    out: Arc<DirectFile>,
    journal: Option<Arc<JournalWriter>>,
    header: JournalHeader,
    what: String,
    region: RegionDesc,
    window: Window,
    chunk: ChunkRef,
    expected: Sha256,
    /// The journal names this chunk with the expected hash.
    hinted: bool,
    /// The upload's base file, if its manifest lists the expected hash.
    base: Option<Arc<BaseFile>>,
}

/// A chunk of a window, verified and in the file.
struct ChunkDone {
    index: u64,
    hash: Sha256,
    len: u32,
    /// Found in the partial file or the base rather than pulled.
    reused: bool,
    /// Written to the file by this upload (pulled, or copied from the base).
    written: bool,
}

impl PullChunk {
    async fn run(self) -> Result<ChunkDone, RemoteError> {
        let PullChunk {
            transport,
            pool,
            file,
            out,
            journal,
            header,
            what,
            region,
            window,
            chunk,
            expected,
            hinted,
            base,
        } = self;
        let done = |reused, written| ChunkDone {
            index: chunk.index,
            hash: expected,
            len: chunk.len,
            reused,
            written,
        };
        let lease = pool.lease().await?;
        if hinted {
            let (buf, file) = (lease.buffer().clone(), file.clone());
            let held = tokio::task::spawn_blocking(move || {
                let mut bytes = buf.blocking_write();
                chunk_matches(&file, &header, chunk.index, &expected, &mut bytes[..])
            })
            .await
            .map_err(|e| remote(ErrorKind::Io, format!("{what}: hashing task failed: {e}")))?;
            if held {
                return Ok(done(true, false));
            }
        }
        if let Some(base) = base {
            let (buf, out, journal) = (lease.buffer().clone(), out.clone(), journal.clone());
            let file_offset = window.offset + chunk.window_offset;
            let what2 = what.clone();
            let copied = tokio::task::spawn_blocking(move || {
                let mut bytes = buf.blocking_write();
                let len = chunk.len as usize;
                if !base.find(&expected, len, &mut bytes[..]) {
                    return Ok(false);
                }
                out.write_all_at(&bytes[..len], file_offset)?;
                if let Some(j) = journal {
                    if let Err(e) = j.append(chunk.index, &expected) {
                        tracing::warn!(file = %what2, "cannot extend the upload's journal: {e}");
                    }
                }
                Ok(true)
            })
            .await
            .map_err(|e| remote(ErrorKind::Io, format!("{what}: hashing task failed: {e}")))?
            .map_err(|e| io_error("write", &what, &e))?;
            if copied {
                return Ok(done(true, true));
            }
        }
        let slice = RemoteSlice::of(&region, chunk.window_offset, chunk.len).ok_or_else(|| {
            remote(
                ErrorKind::Protocol,
                format!("{what}: chunk outside the region"),
            )
        })?;
        transport
            .read(slice, lease.reg(), 0)
            .await
            .map_err(|e| transport_error(&what, e))?;
        let buf = lease.buffer().clone();
        let file_offset = window.offset + chunk.window_offset;
        let len = chunk.len as usize;
        let what2 = what.clone();
        let verdict = tokio::task::spawn_blocking(move || {
            let bytes = buf.blocking_read();
            let got = hash_chunk(&bytes[..len]);
            if got != expected {
                return Ok(false);
            }
            out.write_all_at(&bytes[..len], file_offset)?;
            // Journaled only once the bytes are in the file. The journal is a hint, so
            // failing to extend it costs a later resume, not this upload.
            if let Some(j) = journal {
                if let Err(e) = j.append(chunk.index, &got) {
                    tracing::warn!(file = %what2, "cannot extend the upload's journal: {e}");
                }
            }
            Ok(true)
        })
        .await
        .map_err(|e| remote(ErrorKind::Io, format!("{what}: hashing task failed: {e}")))?
        .map_err(|e| io_error("write", &what, &e))?;
        drop(lease);
        if verdict {
            return Ok(done(false, true));
        }
        tracing::warn!(file = %what, chunk = chunk.index, "upload chunk failed SHA-256 verification");
        Err(remote(
            ErrorKind::Integrity,
            format!(
                "{what}: chunk {} (bytes {}..{}) failed SHA-256 verification",
                chunk.index,
                file_offset,
                file_offset + chunk.len as u64
            ),
        ))
    }
}

/// An open download.
pub struct Download {
    what: String,
    /// The file; read direct where the page cache does not hold a chunk.
    file: Arc<DirectFile>,
    attr: Attr,
    ino: u64,
    chunk_bytes: u32,
}

impl Download {
    /// Opens `rel` for download (symlinks followed inside the share). Blocking.
    pub fn open(share: &Share, rel: &str, chunk_bytes: u32) -> Result<Download, RemoteError> {
        let what = share.display(rel);
        let path = share.resolve(rel, true)?;
        let file = File::open(&path).map_err(|e| io_error("open", &what, &e))?;
        let meta = file.metadata().map_err(|e| io_error("stat", &what, &e))?;
        if meta.is_dir() {
            return Err(remote(
                ErrorKind::IsADirectory,
                format!("{what}: is a directory"),
            ));
        }
        if !meta.is_file() {
            return Err(remote(
                ErrorKind::InvalidPath,
                format!("{what}: not a regular file"),
            ));
        }
        Ok(Download {
            what,
            attr: ferry_common::attr::attr_of(&meta, None),
            ino: meta.ino(),
            file: Arc::new(DirectFile::for_reading(Arc::new(file), meta.len())),
            chunk_bytes,
        })
    }

    /// Attributes at open time.
    pub fn attr(&self) -> &Attr {
        &self.attr
    }

    /// Pushes one window: reads each chunk into a pool buffer (from the page cache if it
    /// holds the chunk, else direct), hashes it and RDMA-WRITEs
    /// it into the client's `region`; answers with the hashes.
    pub async fn push_window(
        &self,
        transport: &SharedTransport,
        pool: &Arc<Pool>,
        offset: u64,
        region: RegionDesc,
    ) -> Result<Response, RemoteError> {
        let size = self.attr.size;
        let len = region.len.min(size.saturating_sub(offset));
        let window = check_window(size, self.chunk_bytes, MAX_WINDOW_CHUNKS, offset, len)
            .map_err(|e| remote(ErrorKind::Protocol, format!("{}: {e}", self.what)))?;
        let mut tasks = JoinSet::new();
        for chunk in window.chunks(self.chunk_bytes) {
            let transport = transport.clone();
            let pool = pool.clone();
            let file = self.file.clone();
            let what = self.what.clone();
            tasks.spawn(async move {
                let lease = pool.lease().await?;
                let buf = lease.buffer().clone();
                let file_offset = window.offset + chunk.window_offset;
                let len = chunk.len as usize;
                let what2 = what.clone();
                let hash = tokio::task::spawn_blocking(move || {
                    let mut bytes = buf.blocking_write();
                    match file.read_exact_at(&mut bytes[..len], file_offset) {
                        Ok(()) => Ok(hash_chunk(&bytes[..len])),
                        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(remote(
                            ErrorKind::Changed,
                            format!("{what2}: file shrank during the download"),
                        )),
                        Err(e) => Err(io_error("read", &what2, &e)),
                    }
                })
                .await
                .map_err(|e| remote(ErrorKind::Io, format!("{what}: read task failed: {e}")))??;
                let slice =
                    RemoteSlice::of(&region, chunk.window_offset, chunk.len).ok_or_else(|| {
                        remote(
                            ErrorKind::Protocol,
                            format!("{what}: chunk outside the region"),
                        )
                    })?;
                transport
                    .write(lease.reg(), 0, slice)
                    .await
                    .map_err(|e| transport_error(&what, e))?;
                Ok((chunk.index, hash))
            });
        }
        let mut done = join_all(tasks).await?;
        done.sort_unstable_by_key(|(i, _)| *i);
        Ok(Response::WindowPushed {
            hashes: done.into_iter().map(|(_, h)| h).collect(),
        })
    }

    /// Ends the download: fails with [`ErrorKind::Changed`] if the file was modified
    /// since it was opened. Blocking.
    pub fn close(&self) -> Result<Response, RemoteError> {
        let meta = self
            .file
            .file()
            .metadata()
            .map_err(|e| io_error("stat", &self.what, &e))?;
        let now = ferry_common::attr::attr_of(&meta, None);
        if meta.ino() != self.ino || now.size != self.attr.size || now.mtime != self.attr.mtime {
            return Err(remote(
                ErrorKind::Changed,
                format!("{}: file changed during the download", self.what),
            ));
        }
        Ok(Response::Ok)
    }
}

/// An open transfer of a connection.
pub enum Transfer {
    /// An upload (boxed: it is the larger by far).
    Upload(Box<Upload>),
    /// A download.
    Download(Download),
}
