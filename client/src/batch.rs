//! Small files in batches: many files per request, their bytes in one registered
//! buffer that the server moves with one one-sided operation.
//!
//! Upload ([`upload_batch`]): the files are read back to back into a pooled buffer
//! (each between two `fstat`s: a source that moves while it is read fails as changed;
//! a window of files is opened and their reads started first, see
//! [`ferry_common::readahead`]),
//! hashed, and the buffer is registered for remote READ and advertised in one
//! `UploadBatch`; the server answers per file. Download ([`download_batch`]): a pooled
//! buffer is registered for remote WRITE and the server fills it from many files; each
//! file is verified against its hash, written whole with its mode and mtime to a new
//! file without a name in its final directory ([`Unnamed`]; where the filesystem has
//! none, to a hidden file next to its final name, [`small_path`]), and once every file
//! of the batch is durable (one `syncfs` per filesystem: a group commit) each is
//! given its final name (linked, or renamed over what is there). Either way a registration is revoked as soon as the server
//! answered, and buffers are reused across batches.
//!
//! A file that fails fails alone. One the server found damaged in flight (an upload's
//! hash mismatch) or that fails verification here (a download) is sent once more in a
//! later batch: an upload's source is read and hashed again first, and fails as changed
//! if its hash moved. A file the batch cannot carry (its size is not the one listed, or
//! the server did not include it) is reported as [`Outcome::PerFile`]: the caller copies
//! it on the per-file path. Nothing is resumable here: an interrupted batch is simply
//! sent again.

use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferry_common::attr::attr_of;
use ferry_common::chunk::hash_chunk;
use ferry_common::msg::{
    BatchFile, ErrorKind, Hash256, HashAlgorithm, RemoteError, Request, Response, Timestamp,
    BATCH_MAX_BYTES, BATCH_MAX_FILES, BATCH_MAX_PATH_BYTES,
};
use ferry_common::proto::batch::{batch_file_max, place_downloaded, Placement};
use ferry_common::proto::retry::WINDOW_ATTEMPTS;
use ferry_common::proto::ProtoError;
use ferry_common::readahead::{will_need, READ_AHEAD_FILES};
use ferry_common::staging::{remove_quietly, scratch_path, small_path, write_whole, WholeStep};
use ferry_common::transport::{Access, Buffer, Memory};
use ferry_common::unnamed::Unnamed;
use ferry_common::writeback::sync_filesystems;
use nix::fcntl::{Flock, FlockArg};

use crate::client::{unexpected, Client};
use crate::error::ClientError;
use crate::transfer::{Copied, ProgressFn};

/// Times a file is sent before a hash mismatch fails it: the retry policy of windows.
const ATTEMPTS: usize = WINDOW_ATTEMPTS;

/// Directory batches (`MakeDirs`, `SetAttrBatch`) an upload or a backup keeps in
/// flight (within a level): a few, as the server has cores.
pub const DIR_BATCHES_AT_ONCE: usize = 4;

/// Most bytes of one batch with `client`'s server: the server moves a batch through one
/// of its chunk buffers.
pub fn capacity(client: &Client) -> u64 {
    BATCH_MAX_BYTES.min(u64::from(client.welcome().chunk_bytes))
}

/// The largest file a batch carries with `client`'s server: up to its capacity where
/// the session negotiated medium batches, else
/// [`SMALL_FILE_MAX_BYTES`](ferry_common::msg::SMALL_FILE_MAX_BYTES)
/// ([`batch_file_max`]).
pub fn file_max(client: &Client) -> u64 {
    let medium = client.negotiated().is_some_and(|n| n.medium_batches);
    batch_file_max(medium, client.welcome().chunk_bytes)
}

/// True if a regular file of `size` bytes goes in a batch with `client`'s server.
pub fn is_small(client: &Client, size: u64) -> bool {
    size <= file_max(client)
}

/// Splits `items` into batches, in order: each of at most [`BATCH_MAX_FILES`] items,
/// `capacity` bytes (by `size`) and [`BATCH_MAX_PATH_BYTES`] path bytes (by
/// `path_len`). An item larger than `capacity` on its own gets a batch of its own.
pub fn pack<T>(
    items: Vec<T>,
    capacity: u64,
    size: impl Fn(&T) -> u64,
    path_len: impl Fn(&T) -> usize,
) -> Vec<Vec<T>> {
    let mut batches: Vec<Vec<T>> = Vec::new();
    let (mut bytes, mut paths) = (0u64, 0usize);
    for item in items {
        let (n, p) = (size(&item), path_len(&item));
        let fits = batches.last().is_some_and(|b| {
            b.len() < BATCH_MAX_FILES
                && bytes.saturating_add(n) <= capacity
                && paths + p <= BATCH_MAX_PATH_BYTES
        });
        if !fits {
            batches.push(Vec::new());
            (bytes, paths) = (0, 0);
        }
        bytes = bytes.saturating_add(n);
        paths += p;
        batches.last_mut().expect("pushed above").push(item);
    }
    batches
}

/// A local file to upload in a batch.
#[derive(Debug, Clone)]
pub struct SmallUpload {
    /// The local source.
    pub src: PathBuf,
    /// The share-relative target.
    pub target: String,
    /// Its size when it was listed.
    pub size: u64,
}

/// A server file to download in a batch.
#[derive(Debug, Clone)]
pub struct SmallDownload {
    /// The share-relative source.
    pub src: String,
    /// The local target.
    pub target: PathBuf,
    /// Its size when it was listed.
    pub size: u64,
}

/// What became of one file of a batch.
#[derive(Debug)]
pub enum Outcome {
    /// Copied.
    Copied(Copied),
    /// Failed: server errors are about the target of an upload or the source of a
    /// download, local ones about the local file.
    Failed(ClientError),
    /// Not carried by a batch: copy it on the per-file path.
    PerFile,
}

/// The same error again, for each file of a batch that failed as a whole.
pub(crate) fn again(e: &ClientError) -> ClientError {
    match e {
        ClientError::Remote(r) => ClientError::Remote(r.clone()),
        ClientError::Protocol(p) => ClientError::Protocol(p.clone()),
        other => ClientError::Disconnected(other.to_string()),
    }
}

fn bad_answer(why: &str) -> ClientError {
    ClientError::Protocol(ProtoError::Transfer(format!(
        "bad batch answer from the server: {why}"
    )))
}

fn is_integrity(e: &RemoteError) -> bool {
    e.kind == ErrorKind::Integrity
}

/// A pooled buffer for one batch, returned to the client's pool on drop.
struct Pooled {
    client: Client,
    buf: Option<Arc<Buffer>>,
}

impl Pooled {
    fn take(client: &Client, len: usize) -> Result<Pooled, std::io::Error> {
        Ok(Pooled {
            client: client.clone(),
            buf: Some(client.take_buffer(len)?),
        })
    }

    fn buffer(&self) -> &Arc<Buffer> {
        self.buf.as_ref().expect("held until drop")
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.client.give_buffer(b);
        }
    }
}

async fn run_blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ClientError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ClientError::Disconnected(format!("batch task failed: {e}")))
}

// ---------------------------------------------------------------- upload

/// A source read into the batch buffer.
struct Read {
    size: u64,
    mode: u32,
    mtime: Timestamp,
    hash: Hash256,
}

/// Why a source is not in the batch.
enum Unread {
    Failed(ClientError),
    PerFile,
}

/// Opens `item` and, if it is still a small regular file of its listed size, starts
/// reading it into the page cache ([`will_need`]); returns it with its metadata.
/// Blocking.
fn open_source(item: &SmallUpload) -> Result<(File, fs::Metadata), Unread> {
    let local = |op, e| Unread::Failed(ClientError::local(&item.src, op, e));
    let file = File::open(&item.src).map_err(|e| local("cannot open", e))?;
    let before = file.metadata().map_err(|e| local("cannot stat", e))?;
    if !before.is_file() {
        return Err(local(
            "cannot upload",
            std::io::Error::other("not a regular file"),
        ));
    }
    // The item was sized for a batch ([`is_small`]): read it ahead whole.
    if before.len() == item.size {
        will_need(&file, before.len());
    }
    Ok((file, before))
}

/// Reads `item`, opened by [`open_source`] (`before` is its metadata then), whole into
/// the start of `room`. Blocking.
fn read_source(
    item: &SmallUpload,
    (file, before): (File, fs::Metadata),
    room: &mut [u8],
    algorithm: HashAlgorithm,
) -> Result<Read, Unread> {
    let local = |op, e| Unread::Failed(ClientError::local(&item.src, op, e));
    if before.len() != item.size || before.len() > room.len() as u64 {
        // Changed since it was listed: the per-file path copies it as it is now.
        return Err(Unread::PerFile);
    }
    let len = before.len() as usize;
    let changed = || {
        Unread::Failed(ClientError::SourceChanged {
            path: item.src.clone(),
        })
    };
    match file.read_exact_at(&mut room[..len], 0) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(changed()),
        Err(e) => return Err(local("cannot read", e)),
    }
    let after = file.metadata().map_err(|e| local("cannot stat", e))?;
    let attr = attr_of(&before, None);
    if after.len() != before.len() || attr_of(&after, None).mtime != attr.mtime {
        return Err(changed());
    }
    Ok(Read {
        size: before.len(),
        mode: before.mode() & 0o7777,
        mtime: attr.mtime,
        hash: hash_chunk(algorithm, &room[..len]),
    })
}

/// Uploads `items` (a batch from [`pack`]) to `share`; returns each with its outcome.
/// `progress` is told each file's size as it is committed.
pub async fn upload_batch(
    client: &Client,
    share: &str,
    items: Vec<SmallUpload>,
    progress: &ProgressFn,
) -> Vec<(SmallUpload, Outcome)> {
    let mut done = Vec::with_capacity(items.len());
    // The share's algorithm, which the server records the files in and checks.
    let algorithm = match client.share_hash(share).await {
        Ok(a) => a,
        Err(e) => {
            for item in items {
                done.push((item, Outcome::Failed(again(&e))));
            }
            return done;
        }
    };
    client.used_hash(algorithm);
    let mut todo: Vec<Todo> = items.into_iter().map(|i| (i, None)).collect();
    for attempt in 1..=ATTEMPTS {
        if todo.is_empty() {
            break;
        }
        let last = attempt == ATTEMPTS;
        let to = (share, algorithm);
        todo = send_uploads(client, to, todo, last, progress, &mut done).await;
    }
    done
}

/// A file to upload, with the hash it was sent with before (if it was).
type Todo = (SmallUpload, Option<Hash256>);

/// Sends one batch of `todo`; puts finished files in `done` and returns those to send
/// again (damaged in flight, unless this is the `last` attempt).
async fn send_uploads(
    client: &Client,
    (share, algorithm): (&str, HashAlgorithm),
    todo: Vec<Todo>,
    last: bool,
    progress: &ProgressFn,
    done: &mut Vec<(SmallUpload, Outcome)>,
) -> Vec<Todo> {
    let cap = capacity(client) as usize;
    let pooled = match Pooled::take(client, cap) {
        Ok(p) => p,
        Err(e) => {
            for (item, _) in todo {
                let error = ClientError::local(&item.src, "cannot allocate a buffer", again_io(&e));
                done.push((item, Outcome::Failed(error)));
            }
            return Vec::new();
        }
    };
    let buf = pooled.buffer().clone();
    let read = run_blocking(move || read_batch(&buf, todo, cap, algorithm)).await;
    let ReadBatch { sent, unsent, used } = match read {
        Ok(r) => r,
        // The task holding the items is gone with them: nothing to report them by.
        Err(e) => {
            tracing::error!("{e}");
            return Vec::new();
        }
    };
    done.extend(unsent);
    if sent.is_empty() {
        return Vec::new();
    }
    let answer = request_upload(client, (share, algorithm), &pooled, &sent, used).await;
    drop(pooled);
    match answer {
        Ok(results) => settle_uploads(sent, results, last, progress, done),
        Err(e) => {
            for (item, _) in sent {
                done.push((item, Outcome::Failed(again(&e))));
            }
            Vec::new()
        }
    }
}

/// The files of an upload batch read into its buffer, and those that are not in it.
struct ReadBatch {
    /// Read back to back from the buffer's start, in order.
    sent: Vec<(SmallUpload, Read)>,
    /// Failed, or left to the per-file path.
    unsent: Vec<(SmallUpload, Outcome)>,
    /// Bytes of the buffer used.
    used: u64,
}

/// Reads each of `todo` whole into `buf`, back to back, within its first `cap` bytes,
/// hashing each in `algorithm`; a file whose hash moved since it was sent before fails
/// as changed. Blocking.
fn read_batch(buf: &Buffer, todo: Vec<Todo>, cap: usize, algorithm: HashAlgorithm) -> ReadBatch {
    let mut data = buf.blocking_write();
    let mut batch = ReadBatch {
        sent: Vec::new(),
        unsent: Vec::new(),
        used: 0,
    };
    let mut used = 0usize;
    let mut todo = todo.into_iter();
    // A window of files opened and their reads started, then read in order.
    let windows = std::iter::from_fn(|| {
        let window: Vec<_> = todo
            .by_ref()
            .take(READ_AHEAD_FILES)
            .map(|(item, before)| {
                let opened = open_source(&item);
                (item, before, opened)
            })
            .collect();
        (!window.is_empty()).then_some(window)
    });
    for (item, before, opened) in windows.flatten() {
        match opened.and_then(|o| read_source(&item, o, &mut data[used..cap], algorithm)) {
            Ok(r) if before.is_some_and(|h| h != r.hash) => {
                let error = ClientError::SourceChanged {
                    path: item.src.clone(),
                };
                batch.unsent.push((item, Outcome::Failed(error)));
            }
            Ok(r) => {
                used += r.size as usize;
                batch.sent.push((item, r));
            }
            Err(Unread::Failed(e)) => batch.unsent.push((item, Outcome::Failed(e))),
            Err(Unread::PerFile) => batch.unsent.push((item, Outcome::PerFile)),
        }
    }
    batch.used = used as u64;
    batch
}

/// Registers the first `used` bytes of `pooled` for the server to READ, sends the
/// `UploadBatch` of `sent`, and returns the server's result per file. The
/// registration is revoked as soon as the server answered.
async fn request_upload(
    client: &Client,
    (share, algorithm): (&str, HashAlgorithm),
    pooled: &Pooled,
    sent: &[(SmallUpload, Read)],
    used: u64,
) -> Result<Vec<Option<RemoteError>>, ClientError> {
    let files: Vec<BatchFile> = sent
        .iter()
        .map(|(item, r)| BatchFile {
            path: item.target.clone(),
            size: r.size,
            mode: r.mode,
            mtime: r.mtime,
            hash: r.hash,
        })
        .collect();
    let reg = client
        .transport()
        .register(Memory::Buffer(pooled.buffer().clone()), Access::RemoteRead)?;
    let mut region = reg.desc();
    region.len = used;
    let req = Request::UploadBatch {
        share: share.into(),
        region,
        algorithm,
        files,
    };
    let response = client.call(req).await;
    drop(reg);
    match response? {
        Response::UploadedBatch { results } if results.len() == sent.len() => Ok(results),
        Response::UploadedBatch { .. } => Err(bad_answer("not one result per file")),
        other => Err(unexpected(other)),
    }
}

/// Settles each of `sent` by the server's `results`: committed (into `done`, and told
/// to `progress`), damaged in flight (returned, to be sent again, unless this is the
/// `last` attempt), or refused (into `done`).
fn settle_uploads(
    sent: Vec<(SmallUpload, Read)>,
    results: Vec<Option<RemoteError>>,
    last: bool,
    progress: &ProgressFn,
    done: &mut Vec<(SmallUpload, Outcome)>,
) -> Vec<Todo> {
    let mut retry = Vec::new();
    for ((item, r), result) in sent.into_iter().zip(results) {
        match result {
            None => {
                progress(r.size);
                done.push((item, Outcome::Copied(whole(r.size))));
            }
            Some(e) if is_integrity(&e) && !last => {
                tracing::warn!(file = %item.src.display(), "damaged in flight; sending it again: {}", e.message);
                retry.push((item, Some(r.hash)));
            }
            Some(e) => done.push((item, Outcome::Failed(ClientError::Remote(e)))),
        }
    }
    retry
}

/// A file of `size` bytes copied whole, every byte sent.
fn whole(size: u64) -> Copied {
    Copied {
        bytes: size,
        bytes_sent: size,
        bytes_reused: 0,
    }
}

/// An I/O error like `e` (which is not `Clone`).
fn again_io(e: &std::io::Error) -> std::io::Error {
    match e.raw_os_error() {
        Some(errno) => std::io::Error::from_raw_os_error(errno),
        None => std::io::Error::new(e.kind(), e.to_string()),
    }
}

// ---------------------------------------------------------------- download

/// A verified file of a download batch, to be written.
struct Fetched {
    index: usize,
    /// The algorithm of its hash.
    algorithm: HashAlgorithm,
    offset: usize,
    size: usize,
    mode: u32,
    mtime: Timestamp,
}

/// Downloads `items` (a batch from [`pack`]) from `share`; returns each with its
/// outcome. `progress` is told each file's size as it lands under its final name.
pub async fn download_batch(
    client: &Client,
    share: &str,
    items: Vec<SmallDownload>,
    progress: &ProgressFn,
) -> Vec<(SmallDownload, Outcome)> {
    let mut done = Vec::with_capacity(items.len());
    let mut todo = items;
    for attempt in 1..=ATTEMPTS {
        if todo.is_empty() {
            break;
        }
        let last = attempt == ATTEMPTS;
        todo = fetch(client, share, todo, last, progress, &mut done).await;
    }
    done
}

/// Fetches one batch of `todo`; puts finished files in `done` and returns those that
/// failed verification (unless this is the `last` attempt).
async fn fetch(
    client: &Client,
    share: &str,
    todo: Vec<SmallDownload>,
    last: bool,
    progress: &ProgressFn,
    done: &mut Vec<(SmallDownload, Outcome)>,
) -> Vec<SmallDownload> {
    let cap = capacity(client) as usize;
    let pooled = match Pooled::take(client, cap) {
        Ok(p) => p,
        Err(e) => {
            for item in todo {
                let error =
                    ClientError::local(&item.target, "cannot allocate a buffer", again_io(&e));
                done.push((item, Outcome::Failed(error)));
            }
            return Vec::new();
        }
    };
    let files = match request_download(client, share, &pooled, &todo, cap).await {
        Ok(f) => f,
        Err(e) => {
            for item in todo {
                done.push((item, Outcome::Failed(again(&e))));
            }
            return Vec::new();
        }
    };
    let (mut outcomes, fetched) = place(files);
    for (f, _) in &fetched {
        client.used_hash(f.algorithm);
    }
    let buf = pooled.buffer().clone();
    let targets: Vec<PathBuf> = todo.iter().map(|i| i.target.clone()).collect();
    let written = run_blocking(move || verify_and_land(&buf, &targets, fetched)).await;
    drop(pooled);
    let (results, bad) = match written {
        Ok(w) => w,
        Err(e) => {
            for (item, outcome) in todo.into_iter().zip(outcomes) {
                done.push((item, outcome.unwrap_or_else(|| Outcome::Failed(again(&e)))));
            }
            return Vec::new();
        }
    };
    for (index, result) in results {
        outcomes[index] = Some(match result {
            Ok(size) => {
                progress(size);
                Outcome::Copied(whole(size))
            }
            Err(e) => Outcome::Failed(e),
        });
    }
    let ctx = (client, share, last);
    settle_downloads(ctx, todo, outcomes, bad.into_iter().collect(), done)
}

/// Registers the first `cap` bytes of `pooled` for the server to WRITE, sends the
/// `DownloadBatch` of `todo`, and returns the server's entry per path. The
/// registration is revoked before the data is looked at: the server has no business
/// with it once it answered.
async fn request_download(
    client: &Client,
    share: &str,
    pooled: &Pooled,
    todo: &[SmallDownload],
    cap: usize,
) -> Result<Vec<Placement>, ClientError> {
    let reg = client
        .transport()
        .register(Memory::Buffer(pooled.buffer().clone()), Access::RemoteWrite)?;
    let mut region = reg.desc();
    region.len = region.len.min(cap as u64);
    let req = Request::DownloadBatch {
        share: share.into(),
        paths: todo.iter().map(|i| i.src.clone()).collect(),
        region,
    };
    let response = client.call(req).await;
    drop(reg);
    match response? {
        Response::DownloadedBatch { files } => Ok(place_downloaded(files, todo.len(), cap)?),
        other => Err(unexpected(other)),
    }
}

/// What the server's answer says of each path, as the core placed it: settled
/// already (refused, not included, or placed outside the region), or `None` and, with
/// its expected hash, among the fetched files to verify and write.
fn place(files: Vec<Placement>) -> (Vec<Option<Outcome>>, Vec<(Fetched, Hash256)>) {
    let mut outcomes = Vec::with_capacity(files.len());
    let mut fetched = Vec::new();
    for file in files {
        outcomes.push(match file {
            Placement::Placed(p) => {
                let f = Fetched {
                    index: p.index,
                    algorithm: p.algorithm,
                    offset: p.offset,
                    size: p.attr.size as usize,
                    mode: p.attr.mode,
                    mtime: p.attr.mtime,
                };
                fetched.push((f, p.hash));
                None
            }
            Placement::Outside => Some(Outcome::Failed(bad_answer("a file outside the region"))),
            Placement::Failed(e) => Some(Outcome::Failed(ClientError::Remote(e))),
            Placement::PerFile => Some(Outcome::PerFile),
        });
    }
    (outcomes, fetched)
}

/// Verifies each of `fetched` in `buf` against its hash and lands those that match
/// ([`land_all`]); returns the landing results and the indices of those that did not
/// match. Blocking.
fn verify_and_land(
    buf: &Buffer,
    targets: &[PathBuf],
    fetched: Vec<(Fetched, Hash256)>,
) -> (Vec<Landed>, Vec<usize>) {
    let data = buf.blocking_read();
    let (good, bad): (Vec<_>, Vec<_>) = fetched.into_iter().partition(|(f, hash)| {
        hash_chunk(f.algorithm, &data[f.offset..f.offset + f.size]) == *hash
    });
    let good: Vec<Fetched> = good.into_iter().map(|(f, _)| f).collect();
    let bad: Vec<usize> = bad.into_iter().map(|(f, _)| f.index).collect();
    (land_all(targets, &good, &data[..]), bad)
}

/// Puts each of `todo` with its outcome in `done`, but those that failed verification
/// (indices in `bad`): returned to be fetched again, unless this is the `last`
/// attempt, when they fail as integrity errors.
fn settle_downloads(
    (client, share, last): (&Client, &str, bool),
    todo: Vec<SmallDownload>,
    outcomes: Vec<Option<Outcome>>,
    bad: BTreeSet<usize>,
    done: &mut Vec<(SmallDownload, Outcome)>,
) -> Vec<SmallDownload> {
    let mut retry = Vec::new();
    for (index, (item, outcome)) in todo.into_iter().zip(outcomes).enumerate() {
        match outcome {
            Some(o) => done.push((item, o)),
            None if bad.contains(&index) && !last => {
                tracing::warn!(file = %item.src, "batched file failed verification; fetching it again");
                retry.push(item);
            }
            // Failed every attempt: the per-file path fetches it once more, asking the
            // server to check its bytes against the hash recorded when it was written,
            // so damage on the server's disk is named (and logged there) as such.
            None => {
                tracing::warn!(
                    file = %format!("{}:{share}/{}", client.addr(), item.src),
                    "batched file failed verification on every attempt; fetching it on its own"
                );
                done.push((item, Outcome::PerFile));
            }
        }
    }
    retry
}

/// What became of landing one file of a download batch: its index in the batch, and
/// its size or why it failed.
type Landed = (usize, Result<u64, ClientError>);

/// A file of a download batch written, not yet under its final name.
struct Landing {
    index: usize,
    size: u64,
    file: Pending,
}

/// Where a downloaded small file is written before it has its final name.
enum Pending {
    /// A file without a name in its final directory ([`Unnamed`]), the usual case.
    Unnamed(Unnamed),
    /// Where the filesystem has no unnamed files: a hidden name, locked
    /// ([`open_hidden`]).
    Hidden(PathBuf, Flock<File>),
}

impl Pending {
    fn file(&self) -> &File {
        match self {
            Pending::Unnamed(u) => u.file(),
            Pending::Hidden(_, f) => f,
        }
    }

    fn file_mut(&mut self) -> &mut File {
        match self {
            Pending::Unnamed(u) => u.file_mut(),
            Pending::Hidden(_, f) => f,
        }
    }

    /// Gives the file the name `dest`, replacing a file there as `rename(2)` does.
    fn name(&mut self, dest: &Path) -> std::io::Result<()> {
        match self {
            Pending::Unnamed(u) => u.name(dest),
            Pending::Hidden(hidden, _) => fs::rename(hidden, dest),
        }
    }

    fn discard(self) {
        match self {
            Pending::Unnamed(u) => u.discard(),
            Pending::Hidden(hidden, _) => remove_quietly(&hidden),
        }
    }
}

/// Writes each of `files` (bytes in `data`) to its hidden name, makes them all durable
/// with one flush, and renames each into place; returns `(index, size or error)` per
/// file. Blocking.
fn land_all(targets: &[PathBuf], files: &[Fetched], data: &[u8]) -> Vec<Landed> {
    let mut results = Vec::with_capacity(files.len());
    let mut landed = Vec::with_capacity(files.len());
    for f in files {
        let dest = &targets[f.index];
        match land(dest, f, &data[f.offset..f.offset + f.size]) {
            Ok(l) => landed.push(l),
            Err(e) => results.push((f.index, Err(e))),
        }
    }
    // One flush for the batch: a group commit, one `syncfs` per filesystem (see
    // `sync_filesystems`), before any final name changes.
    let flushed = sync_filesystems(&landed.iter().map(|l| l.file.file()).collect::<Vec<_>>());
    for (mut l, flush) in landed.into_iter().zip(flushed) {
        let dest = &targets[l.index];
        // Naming refuses to put a file over a directory (EISDIR): no look first.
        let failed = match flush {
            Err(e) => Some(("cannot flush", e)),
            Ok(()) => match l.file.name(dest) {
                Ok(()) => None,
                Err(e) if e.kind() == std::io::ErrorKind::IsADirectory => {
                    Some(("cannot replace", e))
                }
                Err(e) => Some(("cannot rename into place", e)),
            },
        };
        let result = match failed {
            None => Ok(l.size),
            Some((op, e)) => {
                l.file.discard();
                Err(ClientError::local(dest, op, e))
            }
        };
        results.push((l.index, result));
    }
    results
}

/// Writes `bytes` to a new file for `dest` with mode and mtime: one without a name
/// ([`Unnamed`]) where the filesystem has them, else `dest`'s hidden name. Blocking.
fn land(dest: &Path, f: &Fetched, bytes: &[u8]) -> Result<Landing, ClientError> {
    let unnamed =
        Unnamed::create_unnamed(dest).map_err(|e| ClientError::local(dest, "cannot create", e))?;
    let (mut file, held) = match unnamed {
        Some(u) => (Pending::Unnamed(u), 0),
        None => {
            let (hidden, file, held) = open_hidden(dest)?;
            (Pending::Hidden(hidden, file), held)
        }
    };
    // What a killed copy left there goes first (a fresh file has nothing to cut: no
    // truncate, which costs ext4 a journal update per file).
    let emptied = if held > 0 {
        file.file_mut().set_len(0)
    } else {
        Ok(())
    };
    let written = emptied
        .map_err(|e| (WholeStep::Write, e))
        .and_then(|()| write_whole(file.file_mut(), bytes, f.mode, f.mtime));
    if let Err((step, e)) = written {
        file.discard();
        return Err(ClientError::local(dest, step.cannot(), e));
    }
    Ok(Landing {
        index: f.index,
        size: bytes.len() as u64,
        file,
    })
}

/// Opens and locks the hidden file `dest` is written to: [`small_path`], taken over if
/// a killed copy left it (regular files only, never through a symlink); or, when
/// another live copy holds it or something else is there, a fresh scratch name.
/// Returns its path, the locked file and the bytes it held. Blocking.
fn open_hidden(dest: &Path) -> Result<(PathBuf, Flock<File>, u64), ClientError> {
    let create = |op: &'static str| move |e: std::io::Error| ClientError::local(dest, op, e);
    let hidden = small_path(dest).ok_or_else(|| {
        ClientError::local(dest, "cannot create", std::io::Error::other("no file name"))
    })?;
    let options = |fresh: bool| {
        let mut o = OpenOptions::new();
        o.write(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK);
        if fresh {
            o.create_new(true);
        } else {
            o.create(true);
        }
        o
    };
    // The usual case first: nothing there, so a new file, empty and its lock free (but
    // a copy taking it over at once holds the lock: then a scratch name, below).
    // Any other failure is met again, and reported, on the way below.
    if let Ok(file) = options(true).open(&hidden) {
        if let Ok(locked) = Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            return Ok((hidden, locked, 0));
        }
    }
    let opened = options(false).open(&hidden);
    if let Ok(file) = opened {
        if let Ok(meta) = file.metadata() {
            if meta.is_file() {
                if let Ok(locked) = Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                    return Ok((hidden, locked, meta.len()));
                }
            }
        }
    }
    let scratch = scratch_path(dest);
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&scratch)
        .map_err(create("cannot create"))?;
    // A new file: its lock is free, and it is empty.
    let locked = Flock::lock(file, FlockArg::LockExclusiveNonblock)
        .map_err(|(_, errno)| ClientError::local(dest, "cannot lock", errno.into()))?;
    Ok((scratch, locked, 0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_common::TEMP_PREFIX;

    #[test]
    fn batches_respect_count_bytes_and_path_budget() {
        let sizes: Vec<u64> = vec![4096; 600];
        let batches = pack(sizes, BATCH_MAX_BYTES, |s| *s, |_| 10);
        assert_eq!(
            batches.iter().map(Vec::len).collect::<Vec<_>>(),
            [BATCH_MAX_FILES, BATCH_MAX_FILES, 600 - 2 * BATCH_MAX_FILES]
        );
        // Bytes: 64 KiB files, 16 to a MiB; an empty file still counts one.
        let sizes: Vec<u64> = [vec![64 << 10; 17], vec![0]].concat();
        let batches = pack(sizes, BATCH_MAX_BYTES, |s| *s, |_| 1);
        assert_eq!(batches.iter().map(Vec::len).collect::<Vec<_>>(), [16, 2]);
        // Paths: long names fill the path budget before the count.
        let batches = pack(vec![1u64; 40], BATCH_MAX_BYTES, |s| *s, |_| 4096);
        assert!(batches
            .iter()
            .all(|b| b.len() * 4096 <= BATCH_MAX_PATH_BYTES));
        assert_eq!(batches.iter().map(Vec::len).sum::<usize>(), 40);
        assert_eq!(batches.len(), 5);
        // An item larger than the capacity rides alone; nothing is lost or reordered.
        let batches = pack(vec![5u64, 20, 5], 10, |s| *s, |_| 1);
        assert_eq!(batches, [vec![5], vec![20], vec![5]]);
        assert!(pack(Vec::<u64>::new(), 10, |s| *s, |_| 1).is_empty());
    }

    #[test]
    fn a_download_takes_over_what_a_killed_copy_left_and_skips_a_held_name() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("f");
        let left = small_path(&dest).unwrap();
        fs::write(&left, b"old bytes of a killed copy").unwrap();
        let (hidden, held, bytes) = open_hidden(&dest).unwrap();
        assert_eq!(hidden, left);
        assert_eq!(bytes, b"old bytes of a killed copy".len() as u64);
        // While held (another copy of the same name), a scratch name is used.
        let (other, _scratch, bytes) = open_hidden(&dest).unwrap();
        assert_ne!(other, left);
        assert_eq!(bytes, 0);
        assert!(other
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with(TEMP_PREFIX));
        drop(held);
        // A symlink there is not followed: a scratch name again.
        fs::remove_file(&left).unwrap();
        let victim = dir.path().join("victim");
        fs::write(&victim, b"keep").unwrap();
        std::os::unix::fs::symlink(&victim, &left).unwrap();
        let (third, _f, _) = open_hidden(&dest).unwrap();
        assert_ne!(third, left);
        assert_eq!(fs::read(&victim).unwrap(), b"keep");
    }
}
