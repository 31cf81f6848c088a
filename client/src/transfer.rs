//! Uploading and downloading one file.
//!
//! Upload: the source is mapped window by window (read-only, never the whole file),
//! each window's chunks are hashed on all cores, the window is registered for remote
//! READ and advertised with its hashes; the server pulls and verifies it, then the
//! registration is revoked. Download: a pooled anonymous buffer is registered for
//! remote WRITE per window, the server pushes the chunks and answers with their hashes,
//! the registration is revoked, and the chunks are verified before they are written to
//! a hidden temporary file (its size reserved up front, so a full disk fails the file
//! before any data moves), which is fsynced and renamed into place at the end.
//!
//! Both keep [`WINDOWS_IN_FLIGHT`] windows outstanding, so hashing, transfer and disk
//! I/O overlap. A window whose chunk fails verification is retried once (a flipped bit
//! on the wire); a second failure fails the file.

use std::fs::{self, File, OpenOptions, Permissions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferry_common::chunk::{hash_chunks, manifest_id};
use ferry_common::msg::{ErrorKind, Request, Response, Sha256, Timestamp};
use ferry_common::proto::transfer::{Window, WindowPlan};
use ferry_common::space;
use ferry_common::transport::{Access, FileWindow, Memory};
use ferry_common::writeback::Writeback;
use ferry_common::TEMP_PREFIX;
use tokio::task::JoinSet;

use crate::client::{unexpected, Client};
use crate::error::ClientError;

/// Windows outstanding per file.
pub const WINDOWS_IN_FLIGHT: usize = 2;

/// Chunks per window (capped by what the server accepts).
pub const WINDOW_CHUNKS: usize = 16;

/// Attempts per window before a verification failure fails the file.
const WINDOW_ATTEMPTS: usize = 2;

/// Called with the number of bytes that just completed.
pub type ProgressFn = Arc<dyn Fn(u64) + Send + Sync>;

fn window_chunks(client: &Client) -> usize {
    WINDOW_CHUNKS
        .min(client.welcome().max_window_chunks as usize)
        .max(1)
}

fn is_integrity(e: &ClientError) -> bool {
    matches!(e, ClientError::Integrity { .. }) || e.remote_kind() == Some(ErrorKind::Integrity)
}

/// Runs every window of `plan` through `run` with [`WINDOWS_IN_FLIGHT`] outstanding,
/// and returns the windows' results in file order.
async fn run_windows<F, Fut>(
    plan: &mut WindowPlan,
    progress: &ProgressFn,
    run: F,
) -> Result<Vec<Vec<Sha256>>, ClientError>
where
    F: Fn(Window) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<Sha256>, ClientError>> + Send + 'static,
{
    let mut tasks = JoinSet::new();
    let mut done: Vec<(u64, Vec<Sha256>)> = Vec::new();
    let mut first_err = None;
    loop {
        if first_err.is_none() {
            while let Some(w) = plan.poll_window() {
                let fut = run(w);
                tasks.spawn(async move { (w, fut.await) });
            }
        }
        let Some(joined) = tasks.join_next().await else {
            break;
        };
        match joined {
            Ok((w, Ok(hashes))) => {
                plan.handle_window_done(w)?;
                progress(w.len);
                done.push((w.offset, hashes));
            }
            Ok((_, Err(e))) => {
                first_err.get_or_insert(e);
            }
            Err(e) => {
                first_err.get_or_insert(ClientError::Disconnected(format!(
                    "window task failed: {e}"
                )));
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    done.sort_unstable_by_key(|(offset, _)| *offset);
    Ok(done.into_iter().map(|(_, h)| h).collect())
}

/// Uploads the local regular file `local` to `share`/`path`, preserving mode and
/// mtime. Returns the bytes sent.
pub async fn upload_file(
    client: &Client,
    local: &Path,
    share: &str,
    path: &str,
    progress: ProgressFn,
) -> Result<u64, ClientError> {
    let file = File::open(local).map_err(|e| ClientError::local(local, "cannot open", e))?;
    let meta = file
        .metadata()
        .map_err(|e| ClientError::local(local, "cannot stat", e))?;
    if !meta.is_file() {
        return Err(ClientError::local(
            local,
            "cannot upload",
            std::io::Error::other("not a regular file"),
        ));
    }
    let size = meta.len();
    let open = Request::UploadOpen {
        share: share.into(),
        path: path.into(),
        size,
        mode: meta.mode() & 0o7777,
        mtime: ferry_common::attr::attr_of(&meta, None).mtime,
    };
    let transfer = match client.call(open).await? {
        Response::UploadOpened { transfer } => transfer,
        other => return Err(unexpected(other)),
    };
    let result = upload_windows(client, Arc::new(file), local, transfer, size, progress).await;
    if result.is_err() {
        // Best effort: the server also discards the upload when the connection ends.
        let _ = client.call(Request::Close { transfer }).await;
    }
    result
}

async fn upload_windows(
    client: &Client,
    file: Arc<File>,
    local: &Path,
    transfer: u64,
    size: u64,
    progress: ProgressFn,
) -> Result<u64, ClientError> {
    let chunk = client.welcome().chunk_bytes;
    let mut plan = WindowPlan::new(size, chunk, window_chunks(client), WINDOWS_IN_FLIGHT);
    let hashes = run_windows(&mut plan, &progress, |w| {
        let client = client.clone();
        let file = file.clone();
        let local = local.to_owned();
        async move { upload_window(&client, &file, &local, transfer, chunk, w).await }
    })
    .await?;
    let all: Vec<Sha256> = hashes.into_iter().flatten().collect();
    let commit = Request::UploadCommit {
        transfer,
        manifest: manifest_id(size, chunk, &all),
    };
    match client.call(commit).await? {
        Response::Committed { size } => Ok(size),
        other => Err(unexpected(other)),
    }
}

/// Maps window `w` of the source and hashes its chunks.
async fn map_window(
    file: &Arc<File>,
    local: &Path,
    chunk: u32,
    w: Window,
) -> Result<(Arc<FileWindow>, Vec<Sha256>), ClientError> {
    let (file, local) = (file.clone(), local.to_owned());
    tokio::task::spawn_blocking(move || {
        let window = FileWindow::map(&file, w.offset, w.len as usize)
            .map_err(|e| ClientError::local(&local, "cannot map", e))?;
        let hashes = hash_chunks(window.bytes(), chunk as usize);
        Ok((window, hashes))
    })
    .await
    .map_err(|e| ClientError::Disconnected(format!("hashing task failed: {e}")))?
}

/// Uploads window `w`. When the server finds a chunk that does not match its hash, the
/// window is hashed again: if the source changed meanwhile, that is the error; if not,
/// the bytes were damaged in flight and the window is sent again, once.
async fn upload_window(
    client: &Client,
    file: &Arc<File>,
    local: &Path,
    transfer: u64,
    chunk: u32,
    w: Window,
) -> Result<Vec<Sha256>, ClientError> {
    let (mut window, mut hashes) = map_window(file, local, chunk, w).await?;
    let mut attempt = 1;
    loop {
        match send_window(client, transfer, w, window, hashes.clone()).await {
            Ok(()) => return Ok(hashes),
            Err(e) if is_integrity(&e) => {
                let (again_window, again) = map_window(file, local, chunk, w).await?;
                if again != hashes {
                    return Err(ClientError::SourceChanged {
                        path: local.to_owned(),
                    });
                }
                if attempt >= WINDOW_ATTEMPTS {
                    return Err(e);
                }
                tracing::warn!(file = %local.display(), offset = w.offset, "window damaged in flight; sending it again: {e}");
                attempt += 1;
                (window, hashes) = (again_window, again);
            }
            // The transport serves a window with pread, so a source truncated under it
            // fails the server's READ instead of raising SIGBUS here: report the cause.
            Err(_) if source_shrank(file, w) => {
                return Err(ClientError::SourceChanged {
                    path: local.to_owned(),
                })
            }
            Err(e) => return Err(e),
        }
    }
}

/// True if the source now ends before the end of window `w`.
fn source_shrank(file: &File, w: Window) -> bool {
    file.metadata()
        .is_ok_and(|m| m.len() < w.offset.saturating_add(w.len))
}

/// Registers `window` for remote READ, asks the server to pull it, and revokes it.
async fn send_window(
    client: &Client,
    transfer: u64,
    w: Window,
    window: Arc<FileWindow>,
    hashes: Vec<Sha256>,
) -> Result<(), ClientError> {
    let reg = client
        .transport()
        .register(Memory::File(window), Access::RemoteRead)?;
    let req = Request::UploadWindow {
        transfer,
        offset: w.offset,
        region: reg.desc(),
        hashes,
    };
    let response = client.call(req).await;
    // Revoke as soon as the server is done with the window.
    drop(reg);
    match response? {
        Response::WindowPulled { .. } => Ok(()),
        other => Err(unexpected(other)),
    }
}

/// A hidden temporary file next to the destination, removed on drop unless renamed.
struct TempFile {
    path: PathBuf,
    file: Arc<File>,
    committed: bool,
}

impl TempFile {
    /// Creates the temporary file for `dest` and reserves `size` bytes for it, so a
    /// download that cannot fit fails before any data moves (and leaves nothing).
    fn create(dest: &Path, size: u64) -> Result<TempFile, ClientError> {
        let dir = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
            _ => PathBuf::from("."),
        };
        let path = dir.join(format!("{TEMP_PREFIX}{:016x}", rand::random::<u64>()));
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| ClientError::local(dest, "cannot create", e))?;
        let temp = TempFile {
            path,
            file: Arc::new(file),
            committed: false,
        };
        // On failure, dropping `temp` removes the file.
        space::reserve(&temp.file, size)
            .map_err(|e| ClientError::local(dest, "cannot reserve space", e))?;
        Ok(temp)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Downloads `share`/`path` to the local path `dest`, preserving mode and mtime.
/// Returns the bytes received.
pub async fn download_file(
    client: &Client,
    share: &str,
    path: &str,
    dest: &Path,
    progress: ProgressFn,
) -> Result<u64, ClientError> {
    let open = Request::DownloadOpen {
        share: share.into(),
        path: path.into(),
    };
    let (transfer, attr) = match client.call(open).await? {
        Response::DownloadOpened { transfer, attr } => (transfer, attr),
        other => return Err(unexpected(other)),
    };
    let result = async {
        let mut temp = TempFile::create(dest, attr.size)?;
        let what = format!("{}:{share}/{path}", client.addr());
        let sink = Sink {
            file: temp.file.clone(),
            writeback: Arc::new(Writeback::new(temp.file.clone())),
            dest: dest.to_owned(),
        };
        download_windows(client, &sink, transfer, attr.size, what, progress).await?;
        match client.call(Request::Close { transfer }).await? {
            Response::Ok => {}
            other => return Err(unexpected(other)),
        }
        finish(&mut temp, &sink.writeback, dest, attr.mode, attr.mtime)?;
        Ok(attr.size)
    }
    .await;
    if result.is_err() {
        let _ = client.call(Request::Close { transfer }).await;
    }
    result
}

/// Where a download's verified windows go.
#[derive(Clone)]
struct Sink {
    file: Arc<File>,
    writeback: Arc<Writeback>,
    dest: PathBuf,
}

fn finish(
    temp: &mut TempFile,
    writeback: &Writeback,
    dest: &Path,
    mode: u32,
    mtime: Timestamp,
) -> Result<(), ClientError> {
    let f = &temp.file;
    f.set_permissions(Permissions::from_mode(mode & 0o7777))
        .map_err(|e| ClientError::local(dest, "cannot chmod", e))?;
    f.set_modified(mtime.to_system())
        .map_err(|e| ClientError::local(dest, "cannot set mtime", e))?;
    writeback
        .finish()
        .map_err(|e| ClientError::local(dest, "cannot fsync", e))?;
    if fs::symlink_metadata(dest).is_ok_and(|m| m.is_dir()) {
        return Err(ClientError::local(
            dest,
            "cannot replace",
            std::io::Error::from(std::io::ErrorKind::IsADirectory),
        ));
    }
    fs::rename(&temp.path, dest)
        .map_err(|e| ClientError::local(dest, "cannot rename into place", e))?;
    temp.committed = true;
    Ok(())
}

async fn download_windows(
    client: &Client,
    sink: &Sink,
    transfer: u64,
    size: u64,
    what: String,
    progress: ProgressFn,
) -> Result<(), ClientError> {
    let chunk = client.welcome().chunk_bytes;
    let mut plan = WindowPlan::new(size, chunk, window_chunks(client), WINDOWS_IN_FLIGHT);
    run_windows(&mut plan, &progress, |w| {
        let client = client.clone();
        let sink = sink.clone();
        let what = what.clone();
        async move {
            let mut attempt = 0;
            loop {
                attempt += 1;
                match download_window(&client, &sink, &what, transfer, chunk, w).await {
                    Err(e) if is_integrity(&e) && attempt < WINDOW_ATTEMPTS => {
                        tracing::warn!(file = %what, offset = w.offset, "window failed verification; retrying: {e}");
                    }
                    other => return other,
                }
            }
        }
    })
    .await
    .map(|_| ())
}

async fn download_window(
    client: &Client,
    sink: &Sink,
    what: &str,
    transfer: u64,
    chunk: u32,
    w: Window,
) -> Result<Vec<Sha256>, ClientError> {
    let buf = client
        .take_buffer(plan_buffer_len(client, chunk))
        .map_err(|e| ClientError::local(&sink.dest, "cannot allocate a buffer", e))?;
    let reg = client
        .transport()
        .register(Memory::Buffer(buf.clone()), Access::RemoteWrite)?;
    let mut region = reg.desc();
    region.len = region.len.min(w.len);
    let req = Request::DownloadWindow {
        transfer,
        offset: w.offset,
        region,
    };
    let response = client.call(req).await;
    // Revoke before looking at the data: the server has no business with it now.
    drop(reg);
    let hashes = match response {
        Ok(Response::WindowPushed { hashes }) => hashes,
        Ok(other) => {
            client.give_buffer(buf);
            return Err(unexpected(other));
        }
        Err(e) => {
            client.give_buffer(buf);
            return Err(e);
        }
    };
    let (buf2, file, what2, dest2) = (
        buf.clone(),
        sink.file.clone(),
        what.to_owned(),
        sink.dest.clone(),
    );
    let verdict = tokio::task::spawn_blocking(move || {
        let bytes = buf2.blocking_read();
        let data = &bytes[..w.len as usize];
        let got = hash_chunks(data, chunk as usize);
        if let Some(bad) = (0..got.len()).find(|&i| hashes.get(i) != Some(&got[i])) {
            return Err(ClientError::Integrity {
                what: what2,
                chunk: w.offset / u64::from(chunk) + bad as u64,
            });
        }
        if got.len() != hashes.len() {
            return Err(ClientError::Integrity {
                what: what2,
                chunk: w.offset / u64::from(chunk) + got.len() as u64,
            });
        }
        file.write_all_at(data, w.offset)
            .map_err(|e| ClientError::local(&dest2, "cannot write", e))?;
        Ok(got)
    })
    .await
    .map_err(|e| ClientError::Disconnected(format!("verify task failed: {e}")));
    client.give_buffer(buf);
    let hashes = verdict??;
    sink.writeback.wrote(w.len);
    Ok(hashes)
}

fn plan_buffer_len(client: &Client, chunk: u32) -> usize {
    chunk as usize * window_chunks(client)
}
