//! Uploading and downloading one file.
//!
//! Upload: the source is mapped window by window (read-only, never the whole file),
//! each window's chunks are hashed on all cores, the window is registered for remote
//! READ and advertised with its hashes; the server pulls and verifies it (or finds the
//! chunks already in the partial file an interrupted upload left, and verifies them
//! there), then the registration is revoked. Download: a pooled anonymous buffer is
//! registered for remote WRITE per window, the server pushes the chunks and answers
//! with their hashes, the registration is revoked, and the chunks are verified before
//! they are written to a hidden file ([`ferry_common::staging`]; its size reserved
//! before the first write, so a full disk fails the file before any of it is written:
//! up front for a file of one window, beside the first windows for a bigger one, see
//! [`Reserving`]), which is fsynced and renamed into place at the end.
//!
//! Resumed downloads: a file of several chunks is received into a resumable partial
//! whose journal records each chunk written. A download that ends early on a lost
//! connection (or a killed or interrupted rcp) leaves both; the next download of the
//! same server file version (size, mtime, ctime, inode, device, chunk size) to the
//! same place reads the journaled chunks back, hashes them again, and asks the server
//! only for the others. Any other failure removes the partial and its journal.
//!
//! Both keep [`WINDOWS_IN_FLIGHT`] windows outstanding ([`RDMA_WINDOWS_IN_FLIGHT`] over
//! RDMA), so hashing, transfer and disk I/O overlap. A window whose chunk fails verification is retried once (a flipped bit
//! on the wire); a second failure fails the file.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, Permissions};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferry_common::chunk::{chunk_len, hash_chunks, manifest_id};
use ferry_common::direct::{DirectFile, DIRECT_MIN_FILE_BYTES};
use ferry_common::journal::{source_tag, JournalHeader, JournalWriter};
use ferry_common::msg::{ErrorKind, Hash256, HashAlgorithm, Request, Response, Timestamp};
use ferry_common::proto::caps::Algorithms;
use ferry_common::proto::retry::{Verdict, WindowFailure, WindowRetry};
use ferry_common::proto::transfer::{check_window_hashes, Window, WindowPlan};
use ferry_common::space::{self, Deferred};
use ferry_common::staging::{verify_hints, StageError, StageOp, Staged};
use ferry_common::transport::{Access, FileWindow, Memory, TransportKind};
use ferry_common::writeback::Writeback;
use tokio::task::JoinSet;

use crate::client::{unexpected, Client};
use crate::error::ClientError;

/// What copying one file moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Copied {
    /// Size of the file.
    pub bytes: u64,
    /// File bytes that crossed the connection (pulled or pushed) in windows that
    /// completed.
    pub bytes_sent: u64,
    /// File bytes not sent because the destination's partial file of an interrupted
    /// copy, or the base file of an upload with a base, already held them (verified
    /// there against their SHA-256).
    pub bytes_reused: u64,
}

/// Windows outstanding per file over TCP.
pub const WINDOWS_IN_FLIGHT: usize = 2;

/// Windows outstanding per file over RDMA: the verbs path is a queue pair whose
/// requests the NIC (or rxe's one packet thread) works through in order while the
/// hashing runs beside it, so it wants more ahead of it. Measured in the Soft-RoCE VM
/// (256 MiB, 2 vCPUs, TCG): downloads 33-41 MiB/s with 2 windows, 44-48 with 4 or 6;
/// uploads 37-38 against 40-42.
pub const RDMA_WINDOWS_IN_FLIGHT: usize = 4;

/// Windows outstanding per file on `client`'s transport.
fn windows_in_flight(client: &Client) -> usize {
    match client.transport().kind() {
        TransportKind::Rdma => RDMA_WINDOWS_IN_FLIGHT,
        TransportKind::Tcp => WINDOWS_IN_FLIGHT,
    }
}

/// Chunks per window (capped by what the server accepts).
pub const WINDOW_CHUNKS: usize = 16;

/// Called with the number of bytes that just completed.
pub type ProgressFn = Arc<dyn Fn(u64) + Send + Sync>;

fn window_chunks(client: &Client) -> usize {
    WINDOW_CHUNKS
        .min(client.welcome().max_window_chunks as usize)
        .max(1)
}

/// How a window attempt failed, for the retry policy.
fn failure(e: &ClientError) -> WindowFailure {
    match e {
        ClientError::Integrity { .. } => WindowFailure::Integrity,
        ClientError::SourceChanged { .. } => WindowFailure::SourceChanged,
        _ if e.remote_kind() == Some(ErrorKind::Integrity) => WindowFailure::Integrity,
        _ => WindowFailure::Other,
    }
}

/// Runs every window of `plan` through `run` with the plan's windows outstanding,
/// and returns the windows' results in file order.
async fn run_windows<T, F, Fut>(
    plan: &mut WindowPlan,
    progress: &ProgressFn,
    run: F,
) -> Result<Vec<T>, ClientError>
where
    T: Send + 'static,
    F: Fn(Window) -> Fut,
    Fut: std::future::Future<Output = Result<T, ClientError>> + Send + 'static,
{
    let mut tasks = JoinSet::new();
    let mut done: Vec<(u64, T)> = Vec::new();
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
            Ok((w, Ok(out))) => {
                plan.handle_window_done(w)?;
                progress(w.len);
                done.push((w.offset, out));
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
    Ok(done.into_iter().map(|(_, out)| out).collect())
}

/// Uploads the local regular file `local` to `share`/`path`, preserving mode and
/// mtime. If an interrupted upload to the same path left chunks on the server that
/// match the source's, they are not sent again.
pub async fn upload_file(
    client: &Client,
    local: &Path,
    share: &str,
    path: &str,
    progress: ProgressFn,
) -> Result<Copied, ClientError> {
    upload(client, local, share, path, None, progress).await
}

/// [`upload_file`] against a `base`: the server's file `share`/`base` (typically the
/// same file in the previous snapshot). Chunks of the source that the base holds are
/// copied by the server from the base (after hashing them again) instead of being
/// pulled; they are counted in [`Copied::bytes_reused`]. The source is still read and
/// hashed in full here: the server matches by the hashes of each window.
pub async fn upload_file_with_base(
    client: &Client,
    local: &Path,
    share: &str,
    path: &str,
    base: &str,
    progress: ProgressFn,
) -> Result<Copied, ClientError> {
    upload(client, local, share, path, Some(base), progress).await
}

async fn upload(
    client: &Client,
    local: &Path,
    share: &str,
    path: &str,
    base: Option<&str>,
    progress: ProgressFn,
) -> Result<Copied, ClientError> {
    upload_part(client, local, None, share, path, base, progress)
        .await
        .map(|u| u.copied)
}

/// What uploading a part of a file produced.
#[derive(Debug, Clone, Copy)]
pub struct Uploaded {
    /// What moved.
    pub copied: Copied,
    /// The manifest id of the uploaded bytes' chunks.
    pub manifest: Hash256,
    /// The algorithm of the manifest (the destination share's).
    pub algorithm: HashAlgorithm,
}

/// Uploads bytes `range` of the local regular file `local` as the whole file
/// `share`/`path` (mode 0600, the source's mtime): a stripe of a cluster file. `range`
/// must start on a multiple of the chunk size. Returns the manifest id the server
/// committed, for the caller to record.
pub async fn upload_range(
    client: &Client,
    local: &Path,
    range: std::ops::Range<u64>,
    share: &str,
    path: &str,
    progress: ProgressFn,
) -> Result<Uploaded, ClientError> {
    upload_part(client, local, Some(range), share, path, None, progress).await
}

async fn upload_part(
    client: &Client,
    local: &Path,
    range: Option<std::ops::Range<u64>>,
    share: &str,
    path: &str,
    base: Option<&str>,
    progress: ProgressFn,
) -> Result<Uploaded, ClientError> {
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
    let file_size = meta.len();
    let (mut mode, mtime) = (
        meta.mode() & 0o7777,
        ferry_common::attr::attr_of(&meta, None).mtime,
    );
    let (offset, size) = match &range {
        None => (0, file_size),
        Some(r) if r.start <= r.end && r.end <= file_size => {
            mode = 0o600;
            (r.start, r.end - r.start)
        }
        Some(_) => {
            return Err(ClientError::SourceChanged {
                path: local.to_owned(),
            })
        }
    };
    let open = match base {
        None => Request::UploadOpen {
            share: share.into(),
            path: path.into(),
            size,
            mode,
            mtime,
        },
        Some(base) => Request::UploadOpenBase {
            share: share.into(),
            path: path.into(),
            size,
            mode,
            mtime,
            base: base.into(),
        },
    };
    let (transfer, algorithm) = match client.call(open).await? {
        Response::UploadOpened {
            transfer,
            algorithm,
        } => (transfer, algorithm),
        other => return Err(unexpected(other)),
    };
    client.check_algorithm(algorithm)?;
    client.used_hash(algorithm);
    let source = Source::new(file, file_size);
    let up = Up {
        transfer,
        algorithm,
        chunk: client.welcome().chunk_bytes,
        offset,
    };
    if offset % u64::from(up.chunk) != 0 {
        let _ = client.call(Request::Close { transfer }).await;
        return Err(ClientError::Usage(format!(
            "{}: a part must start on a chunk boundary",
            local.display()
        )));
    }
    let result = upload_windows(client, source, local, up, size, progress).await;
    if result.is_err() {
        // Best effort: abandons the upload, removing what the server holds of it. (A
        // connection that ends instead leaves a resumable partial on the server.)
        let _ = client.call(Request::Close { transfer }).await;
    }
    result
}

/// An open upload: its transfer id, the algorithm the server asked its hashes in, the
/// chunk size, and where in the source file the uploaded bytes start.
#[derive(Debug, Clone, Copy)]
struct Up {
    transfer: u64,
    algorithm: HashAlgorithm,
    chunk: u32,
    offset: u64,
}

async fn upload_windows(
    client: &Client,
    source: Source,
    local: &Path,
    up: Up,
    size: u64,
    progress: ProgressFn,
) -> Result<Uploaded, ClientError> {
    let Up {
        transfer,
        algorithm,
        chunk,
        ..
    } = up;
    let mut plan = WindowPlan::new(
        size,
        chunk,
        window_chunks(client),
        windows_in_flight(client),
    );
    let windows = run_windows(&mut plan, &progress, |w| {
        let client = client.clone();
        let source = source.clone();
        let local = local.to_owned();
        async move { upload_window(&client, &source, &local, up, w).await }
    })
    .await?;
    let mut copied = Copied::default();
    let mut all: Vec<Hash256> = Vec::new();
    for w in windows {
        all.extend(w.hashes);
        copied.bytes_sent += w.pulled;
        copied.bytes_reused += w.reused;
    }
    let manifest = manifest_id(algorithm, size, chunk, &all);
    let commit = Request::UploadCommit { transfer, manifest };
    match client.call(commit).await? {
        Response::Committed { size } => Ok(Uploaded {
            copied: Copied {
                bytes: size,
                ..copied
            },
            manifest,
            algorithm,
        }),
        other => Err(unexpected(other)),
    }
}

/// One window of an upload, received by the server.
struct SentWindow {
    hashes: Vec<Hash256>,
    /// Bytes the server pulled.
    pulled: u64,
    /// Bytes the server found in its partial file instead.
    reused: u64,
}

/// Where an upload's windows come from.
#[derive(Clone)]
enum Source {
    /// Each window mapped and registered as it is (files under
    /// [`DIRECT_MIN_FILE_BYTES`]: no copy at all).
    Mapped(Arc<File>),
    /// Each window read into a pooled buffer, which is registered: what the page cache
    /// holds copied from it, the rest read direct (big files; see
    /// [`ferry_common::direct`] for why).
    Read(Arc<DirectFile>),
}

impl Source {
    fn new(file: File, size: u64) -> Source {
        if size >= DIRECT_MIN_FILE_BYTES {
            Source::Read(Arc::new(DirectFile::for_reading(Arc::new(file), size)))
        } else {
            Source::Mapped(Arc::new(file))
        }
    }

    fn file(&self) -> &File {
        match self {
            Source::Mapped(f) => f,
            Source::Read(d) => d.file(),
        }
    }
}

/// Returns a window's buffer (if it had one) to the client's pool. Only once the
/// window's registration is gone.
fn release(client: &Client, memory: Memory) {
    if let Memory::Buffer(b) = memory {
        client.give_buffer(b);
    }
}

/// Maps or reads window `w` of the source and hashes its chunks in `up.algorithm`, on
/// the shared hashing pool.
async fn prepare_window(
    client: &Client,
    source: &Source,
    local: &Path,
    up: Up,
    w: Window,
) -> Result<(Memory, Vec<Hash256>), ClientError> {
    let Up {
        algorithm,
        chunk,
        offset: base,
        ..
    } = up;
    let local = local.to_owned();
    match source.clone() {
        Source::Mapped(file) => tokio::task::spawn_blocking(move || {
            let window = FileWindow::map(&file, base + w.offset, w.len as usize)
                .map_err(|e| ClientError::local(&local, "cannot map", e))?;
            let hashes = hash_chunks(algorithm, window.bytes(), chunk as usize);
            Ok((Memory::File(window), hashes))
        })
        .await
        .map_err(|e| ClientError::Disconnected(format!("hashing task failed: {e}")))?,
        Source::Read(file) => {
            let buf = client
                .take_buffer(plan_buffer_len(client, chunk, w.len))
                .map_err(|e| ClientError::local(&local, "cannot allocate a buffer", e))?;
            let buf2 = buf.clone();
            let read = tokio::task::spawn_blocking(move || {
                let mut bytes = buf2.blocking_write();
                let data = &mut bytes[..w.len as usize];
                match file.read_exact_at(data, base + w.offset) {
                    Ok(()) => Ok(hash_chunks(algorithm, data, chunk as usize)),
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                        Err(ClientError::SourceChanged { path: local })
                    }
                    Err(e) => Err(ClientError::local(&local, "cannot read", e)),
                }
            })
            .await
            .map_err(|e| ClientError::Disconnected(format!("hashing task failed: {e}")));
            match read {
                Ok(Ok(hashes)) => Ok((Memory::Buffer(buf), hashes)),
                Ok(Err(e)) | Err(e) => {
                    client.give_buffer(buf);
                    Err(e)
                }
            }
        }
    }
}

/// Uploads window `w`. When the server finds a chunk that does not match its hash, the
/// window is read and hashed again: if the source changed meanwhile, that is the error;
/// if not, the bytes were damaged in flight and the window is sent again, once.
async fn upload_window(
    client: &Client,
    source: &Source,
    local: &Path,
    up: Up,
    w: Window,
) -> Result<SentWindow, ClientError> {
    let transfer = up.transfer;
    let (mut memory, mut hashes) = prepare_window(client, source, local, up, w).await?;
    let mut retry = WindowRetry::default();
    loop {
        let sent = send_window(client, transfer, w, memory.clone(), hashes.clone()).await;
        match sent {
            Ok((pulled, reused)) => {
                release(client, memory);
                return Ok(SentWindow {
                    hashes,
                    pulled,
                    reused,
                });
            }
            Err(e) if failure(&e) == WindowFailure::Integrity => {
                release(client, memory);
                let (again_memory, again) = prepare_window(client, source, local, up, w).await?;
                let changed = again != hashes;
                let verdict = retry.handle_failure(if changed {
                    WindowFailure::SourceChanged
                } else {
                    WindowFailure::Integrity
                });
                if verdict == Verdict::Fail {
                    release(client, again_memory);
                    return Err(if changed {
                        ClientError::SourceChanged {
                            path: local.to_owned(),
                        }
                    } else {
                        e
                    });
                }
                tracing::warn!(file = %local.display(), offset = w.offset, "window damaged in flight; sending it again: {e}");
                (memory, hashes) = (again_memory, again);
            }
            Err(e) => {
                release(client, memory);
                // The transport serves a mapped window with pread, so a source
                // truncated under it fails the server's READ instead of raising SIGBUS
                // here: report the cause.
                if source_shrank(source.file(), up.offset, w) {
                    return Err(ClientError::SourceChanged {
                        path: local.to_owned(),
                    });
                }
                return Err(e);
            }
        }
    }
}

/// True if the source now ends before the end of window `w` (of a part starting at
/// `base`).
fn source_shrank(file: &File, base: u64, w: Window) -> bool {
    file.metadata()
        .is_ok_and(|m| m.len() < base.saturating_add(w.offset).saturating_add(w.len))
}

/// Registers `memory` (window `w`) for remote READ, asks the server to pull it, and
/// revokes it. Returns the bytes pulled and the bytes the server reused.
async fn send_window(
    client: &Client,
    transfer: u64,
    w: Window,
    memory: Memory,
    hashes: Vec<Hash256>,
) -> Result<(u64, u64), ClientError> {
    let reg = client.transport().register(memory, Access::RemoteRead)?;
    let mut region = reg.desc();
    region.len = region.len.min(w.len);
    let req = Request::UploadWindow {
        transfer,
        offset: w.offset,
        region,
        hashes,
    };
    let response = client.call(req).await;
    // Revoke as soon as the server is done with the window.
    drop(reg);
    match response? {
        Response::WindowPulled { bytes, reused } if bytes.checked_add(reused) == Some(w.len) => {
            Ok((bytes, reused))
        }
        other => Err(unexpected(other)),
    }
}

/// The local operation, as `ClientError::Local` words it, that failed in staging.
fn stage_op(op: StageOp) -> &'static str {
    match op {
        StageOp::Create => "cannot create",
        StageOp::Lock => "cannot lock",
        StageOp::Journal => "cannot write the journal",
        StageOp::Reserve => "cannot reserve space",
        StageOp::Rename => "cannot rename into place",
        _ => "cannot stage",
    }
}

fn stage_error(dest: &Path, e: StageError) -> ClientError {
    ClientError::local(dest, stage_op(e.op), e.source)
}

/// True for the failures after which a download's partial file is kept for a later
/// run to resume: the connection was lost (the server was killed or restarted, the
/// network failed, the server hung). The others remove it.
fn keeps_partial(e: &ClientError) -> bool {
    matches!(
        e,
        ClientError::Disconnected(_)
            | ClientError::Transport(_)
            | ClientError::Hung { .. }
            | ClientError::Stalled { .. }
    )
}

/// Opens the hidden file a download of `dest` goes to (resuming an interrupted one of
/// the same version) and returns it with the chunks it already holds, verified. With
/// `reserve`, its size is reserved first; else the caller reserves it ([`Reserving`]).
async fn stage_download(
    dest: &Path,
    header: JournalHeader,
    reserve: bool,
) -> Result<(Staged, BTreeSet<u64>), ClientError> {
    let (staged, held) = stage_download_hashes(dest, header, reserve).await?;
    Ok((staged, held.into_keys().collect()))
}

/// [`stage_download`], with the held chunks' hashes.
async fn stage_download_hashes(
    dest: &Path,
    header: JournalHeader,
    reserve: bool,
) -> Result<(Staged, BTreeMap<u64, Hash256>), ClientError> {
    let dest = dest.to_owned();
    tokio::task::spawn_blocking(move || {
        // Only the download's algorithm is resumed in; a journal in another one (an
        // older Ferry's) still lends its verified chunks to this run.
        let accept = Algorithms::of(&[header.algorithm]);
        let staged = if reserve {
            Staged::open(&dest, &header, accept)
        } else {
            Staged::open_unreserved(&dest, &header, accept)
        }
        .map_err(|e| stage_error(&dest, e))?;
        let held = verify_hints(
            staged.file(),
            &header,
            staged.hints_algorithm(),
            staged.hints(),
        );
        if !staged.hints().is_empty() {
            tracing::info!(
                file = %dest.display(),
                journaled = staged.hints().len(),
                verified = held.len(),
                "resuming an interrupted download"
            );
        }
        Ok((staged, held))
    })
    .await
    .map_err(|e| ClientError::Disconnected(format!("staging task failed: {e}")))?
}

/// Downloads `share`/`path` to the local path `dest`, preserving mode and mtime.
/// Chunks that an interrupted download of the same file version left in `dest`'s
/// partial file are verified there and not fetched again.
pub async fn download_file(
    client: &Client,
    share: &str,
    path: &str,
    dest: &Path,
    progress: ProgressFn,
) -> Result<Copied, ClientError> {
    let open = Request::DownloadOpen {
        share: share.into(),
        path: path.into(),
    };
    let (transfer, attr, algorithm) = match client.call(open).await? {
        Response::DownloadOpened {
            transfer,
            attr,
            algorithm,
        } => (transfer, attr, algorithm),
        other => return Err(unexpected(other)),
    };
    client.check_algorithm(algorithm)?;
    client.used_hash(algorithm);
    let result = async {
        let chunk = client.welcome().chunk_bytes;
        let header = JournalHeader {
            size: attr.size,
            chunk_bytes: chunk,
            algorithm,
            source: source_tag(&attr),
        };
        // A file of more than one window is reserved beside its first windows.
        let defer = space::reserve_beside(attr.size, chunk);
        let (mut staged, held) = stage_download(dest, header, !defer).await?;
        let reserving = defer.then(|| Reserving::start(&staged, attr.size));
        let reused: u64 = held.iter().map(|&i| chunk_len(attr.size, chunk, i)).sum();
        progress(reused);
        let mut sink = Sink::of(&staged, attr.size, dest);
        sink.reserved = reserving.as_ref().map(|r| r.0.clone());
        let what = format!("{}:{share}/{path}", client.addr());
        let received = async {
            let down = Down {
                transfer,
                algorithm,
                chunk,
            };
            let (sent, _) =
                download_windows(client, &sink, down, attr.size, held, what, progress).await?;
            if let Some(r) = &reserving {
                r.wait().await.map_err(|e| reserve_error(dest, e))?;
            }
            match client.call(Request::Close { transfer }).await? {
                Response::Ok => {}
                other => return Err(unexpected(other)),
            }
            finish(&mut staged, &sink.writeback, dest, attr.mode, attr.mtime).await?;
            Ok(sent)
        }
        .await;
        match received {
            Ok(sent) => Ok(Copied {
                bytes: attr.size,
                bytes_sent: sent,
                bytes_reused: reused,
            }),
            Err(e) => {
                // The reservation is over before the file is removed or kept: its
                // space is then either freed or given back with the partial's
                // unwritten chunks, and not taken from the next file's.
                if let Some(r) = &reserving {
                    let _ = r.wait().await;
                }
                if !keeps_partial(&e) {
                    staged.discard();
                }
                Err(e)
            }
        }
    }
    .await;
    if result.is_err() {
        let _ = client.call(Request::Close { transfer }).await;
    }
    result
}

/// A download's reservation made beside its first windows ([`Deferred`]): every
/// window waits for it before writing into the file.
struct Reserving(Arc<Deferred>);

impl Reserving {
    /// Starts reserving `size` bytes of `staged`'s file.
    fn start(staged: &Staged, size: u64) -> Reserving {
        Reserving(Deferred::start(staged.file().clone(), size))
    }

    /// Waits until the reservation is made; its error.
    async fn wait(&self) -> std::io::Result<()> {
        let d = self.0.clone();
        tokio::task::spawn_blocking(move || d.wait())
            .await
            .map_err(std::io::Error::other)?
    }
}

fn reserve_error(dest: &Path, source: std::io::Error) -> ClientError {
    stage_error(
        dest,
        StageError {
            op: StageOp::Reserve,
            source,
        },
    )
}

/// Where a download's verified windows go.
#[derive(Clone)]
struct Sink {
    /// The hidden file, its aligned blocks written direct where allowed.
    out: Arc<DirectFile>,
    /// The partial's journal; `None` for a scratch file.
    journal: Option<Arc<JournalWriter>>,
    writeback: Arc<Writeback>,
    /// Whether written windows are flushed early ([`Writeback::wrote`]): not for a
    /// scratch file in place, which is never made durable.
    flush_early: bool,
    dest: PathBuf,
    /// Where in `out` the downloaded file's byte 0 goes (a stripe's offset).
    base: u64,
    /// The file's reservation, where it is made beside the transfer: waited for
    /// before every write.
    reserved: Option<Arc<Deferred>>,
}

impl Sink {
    fn of(staged: &Staged, size: u64, dest: &Path) -> Sink {
        Sink {
            out: Arc::new(DirectFile::for_writing(staged.file().clone(), size)),
            journal: staged.journal(),
            writeback: Arc::new(Writeback::new(staged.file().clone())),
            flush_early: true,
            dest: dest.to_owned(),
            base: 0,
            reserved: None,
        }
    }
}

/// A local file being received in parts (the stripes of a cluster file, each
/// downloaded from its own node with [`download_range`]), under a hidden name until
/// [`Assembly::finish`]. A download of the same file `tag` cut short leaves it to be
/// resumed: its journaled chunks are verified again and not fetched.
pub struct Assembly {
    staged: Staged,
    sink: Sink,
    held: BTreeMap<u64, Hash256>,
    chunk: u32,
}

impl Assembly {
    /// Stages `dest` for a file of `size` bytes in chunks of `chunk` bytes, hashed in
    /// `algorithm`, whose version is named by `tag`.
    pub async fn open(
        dest: &Path,
        size: u64,
        chunk: u32,
        algorithm: HashAlgorithm,
        tag: [u8; 32],
    ) -> Result<Assembly, ClientError> {
        let header = JournalHeader {
            size,
            chunk_bytes: chunk,
            algorithm,
            source: tag,
        };
        let (staged, held) = stage_download_hashes(dest, header, true).await?;
        let sink = Sink::of(&staged, size, dest);
        Ok(Assembly {
            staged,
            sink,
            held,
            chunk,
        })
    }

    /// Bytes the staged file already holds, verified.
    pub fn held_bytes(&self) -> u64 {
        let size = self.staged.header().size;
        self.held
            .keys()
            .map(|&i| chunk_len(size, self.chunk, i))
            .sum()
    }

    /// Gives the file its mode and mtime, makes it durable and renames it into place.
    pub async fn finish(mut self, mode: u32, mtime: Timestamp) -> Result<(), ClientError> {
        let dest = self.sink.dest.clone();
        finish(&mut self.staged, &self.sink.writeback, &dest, mode, mtime).await
    }

    /// Removes the staged file (a failure that a later run cannot resume).
    pub fn discard(mut self) {
        self.staged.discard();
    }
}

/// What [`download_range`] fetched.
#[derive(Debug, Clone, Copy)]
pub struct Ranged {
    /// Bytes that crossed the connection.
    pub bytes_sent: u64,
    /// The manifest id of the part's chunks (fetched and already held), in the
    /// algorithm the server hashed in.
    pub manifest: Hash256,
    /// That algorithm.
    pub algorithm: HashAlgorithm,
}

/// A local file that parts are downloaded into where they belong, with no hidden name,
/// no journal and no fsync (a cluster mount's staging file, filled stripe by stripe
/// as its writes need them): [`Part::InPlace`].
pub struct InPlace {
    sink: Sink,
}

impl InPlace {
    /// Parts go into `file` (open for writing; `path` names it in errors).
    pub fn new(file: Arc<File>, path: &Path) -> InPlace {
        InPlace {
            sink: Sink {
                out: Arc::new(DirectFile::buffered(file.clone())),
                journal: None,
                writeback: Arc::new(Writeback::new(file)),
                flush_early: false,
                dest: path.to_owned(),
                base: 0,
                reserved: None,
            },
        }
    }
}

/// Where [`download_part`] writes: an assembly's hidden file (its chunk size fixed, its
/// verified chunks not fetched again) or a file in place.
struct Target<'a> {
    sink: &'a Sink,
    /// The chunk size the part must come in (`None`: the server's).
    chunk: Option<u32>,
    /// Chunks already held, verified, and the algorithm of their hashes.
    held: Option<(HashAlgorithm, &'a BTreeMap<u64, Hash256>)>,
}

/// Where [`download_range`] puts a part.
#[derive(Clone, Copy)]
pub enum Part<'a> {
    /// An assembly's hidden file: the part must come in the assembly's chunk size, and
    /// the chunks it already holds (verified) are not fetched again.
    Assembly(&'a Assembly),
    /// A local file in place ([`InPlace`]), in the server's chunk size: the caller
    /// compares [`Ranged::manifest`] with the one it expects before it trusts the bytes.
    InPlace(&'a InPlace),
}

impl Part<'_> {
    fn target(&self) -> Target<'_> {
        match self {
            Part::Assembly(a) => Target {
                sink: &a.sink,
                chunk: Some(a.chunk),
                held: Some((a.staged.hints_algorithm(), &a.held)),
            },
            Part::InPlace(f) => Target {
                sink: &f.sink,
                chunk: None,
                held: None,
            },
        }
    }
}

/// Downloads the whole file `share`/`path` into `into` at byte `offset` (a multiple of
/// the chunk size): a stripe of a cluster file. Every chunk is verified as it arrives,
/// before it is written. The file must have `len` bytes.
pub async fn download_range(
    client: &Client,
    share: &str,
    path: &str,
    into: Part<'_>,
    offset: u64,
    len: u64,
    progress: ProgressFn,
) -> Result<Ranged, ClientError> {
    download_part(
        client,
        (share, path),
        into.target(),
        (offset, len),
        progress,
    )
    .await
}

async fn download_part(
    client: &Client,
    (share, path): (&str, &str),
    into: Target<'_>,
    (offset, len): (u64, u64),
    progress: ProgressFn,
) -> Result<Ranged, ClientError> {
    let open = Request::DownloadOpen {
        share: share.into(),
        path: path.into(),
    };
    let (transfer, attr, algorithm) = match client.call(open).await? {
        Response::DownloadOpened {
            transfer,
            attr,
            algorithm,
        } => (transfer, attr, algorithm),
        other => return Err(unexpected(other)),
    };
    let result = async {
        client.check_algorithm(algorithm)?;
        client.used_hash(algorithm);
        let chunk = client.welcome().chunk_bytes;
        let what = format!("{}:{share}/{path}", client.addr());
        let want_chunk = into.chunk.unwrap_or(chunk);
        if attr.size != len || chunk != want_chunk || offset % u64::from(chunk) != 0 {
            return Err(ClientError::Cluster(format!(
                "{what}: holds {} bytes in chunks of {chunk}, not the {len} in chunks of {want_chunk} the layout says",
                attr.size
            )));
        }
        let first = offset / u64::from(chunk);
        let count = len.div_ceil(u64::from(chunk));
        // Held chunks count only if the assembly's hashes are in this algorithm.
        let held: BTreeMap<u64, Hash256> = match into.held {
            Some((a, held)) if a == algorithm => held
                .range(first..first + count)
                .map(|(&i, &h)| (i - first, h))
                .collect(),
            _ => BTreeMap::new(),
        };
        let reused: u64 = held.keys().map(|&i| chunk_len(len, chunk, i)).sum();
        progress(reused);
        let sink = Sink {
            base: offset,
            ..into.sink.clone()
        };
        let down = Down {
            transfer,
            algorithm,
            chunk,
        };
        let skip = held.keys().copied().collect();
        let (sent, windows) =
            download_windows(client, &sink, down, len, skip, what, progress).await?;
        let mut all = held;
        for (w_offset, hashes) in windows {
            let first = w_offset / u64::from(chunk);
            for (i, h) in hashes.into_iter().enumerate() {
                all.insert(first + i as u64, h);
            }
        }
        let hashes: Vec<Hash256> = all.into_values().collect();
        match client.call(Request::Close { transfer }).await? {
            Response::Ok => {}
            other => return Err(unexpected(other)),
        }
        Ok(Ranged {
            bytes_sent: sent,
            manifest: manifest_id(algorithm, len, chunk, &hashes),
            algorithm,
        })
    }
    .await;
    if result.is_err() {
        let _ = client.call(Request::Close { transfer }).await;
    }
    result
}

/// Gives the downloaded file its mode and mtime, makes it durable (a `syncfs` shared
/// with the other files this process commits at the same time, see
/// [`Writeback::finish_grouped`]) and renames it into place.
async fn finish(
    staged: &mut Staged,
    writeback: &Arc<Writeback>,
    dest: &Path,
    mode: u32,
    mtime: Timestamp,
) -> Result<(), ClientError> {
    let f = staged.file();
    f.set_permissions(Permissions::from_mode(mode & 0o7777))
        .map_err(|e| ClientError::local(dest, "cannot chmod", e))?;
    f.set_modified(mtime.to_system())
        .map_err(|e| ClientError::local(dest, "cannot set mtime", e))?;
    let flush = writeback.clone();
    tokio::task::spawn_blocking(move || flush.finish_grouped())
        .await
        .map_err(|e| ClientError::Disconnected(format!("flush task failed: {e}")))?
        .map_err(|e| ClientError::local(dest, "cannot fsync", e))?;
    if fs::symlink_metadata(dest).is_ok_and(|m| m.is_dir()) {
        return Err(ClientError::local(
            dest,
            "cannot replace",
            std::io::Error::from(std::io::ErrorKind::IsADirectory),
        ));
    }
    staged.commit(dest).map_err(|e| stage_error(dest, e))
}

/// Fetches every window of the file except the chunks in `held`; returns the bytes
/// pushed.
/// An open download: its transfer id, the algorithm of the hashes the server sends,
/// and the chunk size.
#[derive(Debug, Clone, Copy)]
struct Down {
    transfer: u64,
    algorithm: HashAlgorithm,
    chunk: u32,
}

async fn download_windows(
    client: &Client,
    sink: &Sink,
    down: Down,
    size: u64,
    held: BTreeSet<u64>,
    what: String,
    progress: ProgressFn,
) -> Result<(u64, Vec<(u64, Vec<Hash256>)>), ClientError> {
    let chunk = down.chunk;
    let mut plan = WindowPlan::new(
        size,
        chunk,
        window_chunks(client),
        windows_in_flight(client),
    )
    .skipping(held);
    let windows = run_windows(&mut plan, &progress, |w| {
        let client = client.clone();
        let sink = sink.clone();
        let what = what.clone();
        async move {
            let mut retry = WindowRetry::default();
            // A window that failed verification is asked for again with `verify`: the
            // server then checks what it reads against the hashes recorded when the
            // file was written, and names rot on its disk as such.
            let mut verify = false;
            loop {
                match download_window(&client, &sink, &what, down, verify, w).await {
                    Err(e) if retry.handle_failure(failure(&e)) == Verdict::Retry => {
                        tracing::warn!(file = %what, offset = w.offset, "window failed verification; retrying: {e}");
                        verify = true;
                    }
                    other => return other.map(|hashes| (w.offset, hashes)),
                }
            }
        }
    })
    .await?;
    Ok((plan.done_bytes(), windows))
}

async fn download_window(
    client: &Client,
    sink: &Sink,
    what: &str,
    down: Down,
    verify: bool,
    w: Window,
) -> Result<Vec<Hash256>, ClientError> {
    let Down {
        transfer,
        algorithm,
        chunk,
    } = down;
    let buf = client
        .take_buffer(plan_buffer_len(client, chunk, w.len))
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
        verify,
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
    let (buf2, out, journal, what2, dest2, base, reserved) = (
        buf.clone(),
        sink.out.clone(),
        sink.journal.clone(),
        what.to_owned(),
        sink.dest.clone(),
        sink.base,
        sink.reserved.clone(),
    );
    let verdict = tokio::task::spawn_blocking(move || {
        let bytes = buf2.blocking_read();
        let data = &bytes[..w.len as usize];
        let got = hash_chunks(algorithm, data, chunk as usize);
        if let Err(bad) = check_window_hashes(w, chunk, &hashes, &got) {
            return Err(ClientError::Integrity {
                what: what2,
                chunk: bad,
            });
        }
        if let Some(r) = &reserved {
            r.wait().map_err(|e| reserve_error(&dest2, e))?;
        }
        out.write_all_at(data, base + w.offset)
            .map_err(|e| ClientError::local(&dest2, "cannot write", e))?;
        // Journaled only once the bytes are in the file. The journal is a hint, so
        // failing to extend it costs a later resume, not this download.
        if let Some(j) = &journal {
            let first = (base + w.offset) / u64::from(chunk);
            for (i, h) in got.iter().enumerate() {
                if let Err(e) = j.append(first + i as u64, h) {
                    tracing::warn!(file = %dest2.display(), "cannot extend the download's journal: {e}");
                    break;
                }
            }
        }
        Ok(got)
    })
    .await
    .map_err(|e| ClientError::Disconnected(format!("verify task failed: {e}")));
    client.give_buffer(buf);
    let got = verdict??;
    // Direct writes leave no dirty pages to push early; the final fsync flushes the
    // device's cache once.
    if sink.flush_early && !sink.out.is_direct() {
        sink.writeback.wrote(w.len);
    }
    Ok(got)
}

/// The buffer a download window of `len` bytes lands in: whole chunks, at most a full
/// window (buffers are pooled and reused for any window that fits).
fn plan_buffer_len(client: &Client, chunk: u32, len: u64) -> usize {
    let full = chunk as usize * window_chunks(client);
    usize::try_from(len.next_multiple_of(u64::from(chunk)))
        .map_or(full, |l| l.clamp(chunk as usize, full))
}
