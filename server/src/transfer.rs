//! Uploads (pulled with one-sided READs) and downloads (pushed with one-sided WRITEs).
//!
//! Invariants:
//! - An upload writes only to a hidden temporary file in the target directory, whose
//!   declared size is reserved when it is opened (a file that cannot fit is refused
//!   with "no space" before any data moves). It is renamed to the final name only by
//!   [`Upload::commit`], after every chunk verified against its SHA-256 and the
//!   manifest hash matched. Dropping an uncommitted [`Upload`] (abort, error,
//!   connection loss) removes the temporary file.
//! - A window's response is sent only after every one-sided operation of that window
//!   completed (successfully or not), so no chunk buffer is reused while the transport
//!   may still fill or drain it.

use std::fs::{self, File, OpenOptions, Permissions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use ferry_common::chunk::hash_chunk;
use ferry_common::msg::{
    Attr, ErrorKind, RegionDesc, RemoteError, Response, Sha256, Timestamp, MAX_WINDOW_CHUNKS,
};
use ferry_common::proto::transfer::{check_window, ChunkRef, UploadState, Window};
use ferry_common::space;
use ferry_common::transport::{RemoteSlice, SharedTransport, TransportError};
use ferry_common::writeback::Writeback;
use ferry_common::TEMP_PREFIX;
use tokio::task::JoinSet;

use crate::error::{io_error, remote};
use crate::pool::Pool;
use crate::share::Share;

/// A temporary file that is removed on drop unless it was renamed into place.
struct TempFile {
    path: PathBuf,
    file: Arc<File>,
    committed: bool,
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.committed {
            if let Err(e) = fs::remove_file(&self.path) {
                tracing::warn!(path = %self.path.display(), "cannot remove temporary file: {e}");
            }
        }
    }
}

/// An open upload.
pub struct Upload {
    what: String,
    final_path: PathBuf,
    temp: Mutex<TempFile>,
    file: Arc<File>,
    writeback: Writeback,
    state: Mutex<UploadState>,
    mode: u32,
    mtime: Timestamp,
    chunk_bytes: u32,
}

fn transport_error(what: &str, e: TransportError) -> RemoteError {
    remote(ErrorKind::Io, format!("{what}: transfer failed: {e}"))
}

impl Upload {
    /// Opens an upload of `size` bytes to `rel`: creates the temporary file next to the
    /// final name. Blocking.
    pub fn open(
        share: &Share,
        rel: &str,
        size: u64,
        mode: u32,
        mtime: Timestamp,
        chunk_bytes: u32,
    ) -> Result<Upload, RemoteError> {
        let what = share.display(rel);
        let final_path = share.resolve_for_write(rel)?;
        if fs::symlink_metadata(&final_path).is_ok_and(|m| m.is_dir()) {
            return Err(remote(
                ErrorKind::IsADirectory,
                format!("{what}: a directory is in the way"),
            ));
        }
        let dir = final_path.parent().unwrap_or(share.root());
        let temp_path = dir.join(format!("{TEMP_PREFIX}{:016x}", rand::random::<u64>()));
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&temp_path)
            .map_err(|e| io_error("create", &what, &e))?;
        let file = Arc::new(file);
        let temp = TempFile {
            path: temp_path,
            file: file.clone(),
            committed: false,
        };
        // A file that cannot fit fails here, before any data moves; dropping `temp`
        // removes the temporary file.
        space::reserve(&file, size).map_err(|e| io_error("reserve space", &what, &e))?;
        Ok(Upload {
            what,
            final_path,
            temp: Mutex::new(temp),
            writeback: Writeback::new(file.clone()),
            file,
            state: Mutex::new(UploadState::new(size, chunk_bytes, MAX_WINDOW_CHUNKS)),
            mode,
            mtime,
            chunk_bytes,
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, UploadState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Pulls one window: RDMA READ of each chunk from the client's `region` into a pool
    /// buffer, SHA-256 check against `hashes`, write into the temporary file.
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
                what: self.what.clone(),
                region,
                window,
                chunk,
                expected,
            };
            tasks.spawn(job.run());
        }
        match join_all(tasks).await {
            Ok(done) => {
                let mut state = self.state();
                for (index, hash) in done {
                    state
                        .handle_chunk_verified(index, hash)
                        .map_err(|e| remote(ErrorKind::Protocol, e.to_string()))?;
                }
                self.writeback.wrote(window.len);
                Ok(Response::WindowPulled { bytes: window.len })
            }
            Err(e) => {
                self.state().handle_window_failed(window);
                Err(e)
            }
        }
    }

    /// Commits: checks every chunk verified and the manifest, fsyncs, sets mode and
    /// mtime, renames into place and fsyncs the directory. Blocking.
    pub fn commit(&self, manifest: &Sha256) -> Result<Response, RemoteError> {
        let size = {
            let state = self.state();
            state.commit(manifest).map_err(|e| {
                remote(
                    ErrorKind::Integrity,
                    format!("{}: not committed: {e}", self.what),
                )
            })?;
            state.size()
        };
        let what = &self.what;
        let mut temp = self.temp.lock().unwrap_or_else(|p| p.into_inner());
        let file = &temp.file;
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
        if fs::symlink_metadata(&self.final_path).is_ok_and(|m| m.is_dir()) {
            return Err(remote(
                ErrorKind::IsADirectory,
                format!("{what}: a directory is in the way"),
            ));
        }
        fs::rename(&temp.path, &self.final_path).map_err(|e| io_error("rename", what, &e))?;
        temp.committed = true;
        if let Some(dir) = self.final_path.parent() {
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| io_error("fsync the directory", what, &e))?;
        }
        Ok(Response::Committed { size })
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
    what: String,
    region: RegionDesc,
    window: Window,
    chunk: ChunkRef,
    expected: Sha256,
}

impl PullChunk {
    async fn run(self) -> Result<(u64, Sha256), RemoteError> {
        let PullChunk {
            transport,
            pool,
            file,
            what,
            region,
            window,
            chunk,
            expected,
        } = self;
        let slice = RemoteSlice::of(&region, chunk.window_offset, chunk.len).ok_or_else(|| {
            remote(
                ErrorKind::Protocol,
                format!("{what}: chunk outside the region"),
            )
        })?;
        let lease = pool.lease().await?;
        transport
            .read(slice, lease.reg(), 0)
            .await
            .map_err(|e| transport_error(&what, e))?;
        let buf = lease.buffer().clone();
        let file_offset = window.offset + chunk.window_offset;
        let len = chunk.len as usize;
        let verdict = tokio::task::spawn_blocking(move || {
            let bytes = buf.blocking_read();
            let got = hash_chunk(&bytes[..len]);
            if got != expected {
                return Ok(Err(got));
            }
            file.write_all_at(&bytes[..len], file_offset)
                .map(|()| Ok(got))
        })
        .await
        .map_err(|e| remote(ErrorKind::Io, format!("{what}: hashing task failed: {e}")))?
        .map_err(|e| io_error("write", &what, &e))?;
        drop(lease);
        match verdict {
            Ok(hash) => Ok((chunk.index, hash)),
            Err(_) => {
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
    }
}

/// An open download.
pub struct Download {
    what: String,
    file: Arc<File>,
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
            file: Arc::new(file),
            chunk_bytes,
        })
    }

    /// Attributes at open time.
    pub fn attr(&self) -> &Attr {
        &self.attr
    }

    /// Pushes one window: reads each chunk into a pool buffer, hashes it and RDMA-WRITEs
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
    /// An upload.
    Upload(Upload),
    /// A download.
    Download(Download),
}
