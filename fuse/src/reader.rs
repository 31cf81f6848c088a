//! Open files: one-sided reads of server memory, verified chunk by chunk.
//!
//! On open the server maps the file and returns its read-only regions, its version and
//! the region holding its manifest. The client reads the manifest by RDMA READ and
//! checks it against the version's manifest hash. After that, `read()` needs no
//! request to the server at all: missing chunks are fetched by RDMA READ straight from
//! the server's registered file pages into this client's registered buffers, hashed,
//! and only then copied out.
//!
//! Invariants:
//! - No byte reaches a reader before its whole chunk matched the manifest SHA-256; a
//!   mismatch (after one re-read) fails the read with EIO and is logged with the path
//!   and the chunk.
//! - All chunks of one read are checked against the same version's manifest, so a read
//!   returns that version's bytes or an error, never a mix of versions.
//! - A chunk is fetched at most once at a time: concurrent readers of the same chunk
//!   wait for the one fetch in flight.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ferry_common::chunk::{hash_chunk, manifest_id};
use ferry_common::msg::{FileVersion, MappedFile, Sha256, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES};
use ferry_common::transport::TransportError;
use fuser::Errno;
use tokio::sync::watch;

use crate::bufs::BufPool;
use crate::cache::{ChunkCache, ChunkKey};
use crate::remote::{lock, Conn, OpError, Remote};

/// Most bytes one RDMA READ fetches: a run of consecutive chunks, or one chunk. Also
/// the size of each registered fetch buffer, and so the largest chunk size a mount uses.
pub const FETCH_BYTES: usize = 1 << 20;

/// Smallest chunk a mount picks by itself (no `chunk_size` option). A random 4 KiB read
/// that misses fetches and hashes one whole chunk, so small chunks keep its latency
/// down (16 KiB: 8 µs of hashing, against 32 µs at 64 KiB); runs of consecutive
/// chunks are still fetched with one READ, so sequential reads do not suffer.
pub const AUTO_MIN_CHUNK: u32 = 16 << 10;

/// Most chunks of a file whose chunk size the mount picks: its manifest, fetched whole
/// at open, stays at most 4 MiB (32 bytes a chunk).
pub const AUTO_MAX_CHUNKS: u64 = 1 << 17;

/// Bytes fetched ahead of a sequential reader unless `readahead` sets a chunk count.
pub const READAHEAD_BYTES: u64 = 2 << 20;

/// The chunk size for a file of `size` bytes: [`AUTO_MIN_CHUNK`], doubled until the file
/// has at most [`AUTO_MAX_CHUNKS`] chunks, and at most [`FETCH_BYTES`].
pub fn auto_chunk(size: u64) -> u32 {
    let mut chunk = u64::from(AUTO_MIN_CHUNK);
    while chunk < FETCH_BYTES as u64 && size.div_ceil(chunk) > AUTO_MAX_CHUNKS {
        chunk *= 2;
    }
    chunk as u32
}

/// Idle reply buffers kept for reuse: about as many as reads run at once.
const REPLY_BUFFERS_KEPT: usize = 16;

/// The outcome of one chunk fetch, as waiters see it.
#[derive(Debug, Clone)]
enum Fetched {
    Ok(Arc<[u8]>),
    Failed { errno: Errno, conn_lost: bool },
}

type Slot = watch::Receiver<Option<Fetched>>;

struct Store {
    cache: ChunkCache,
    inflight: HashMap<ChunkKey, Slot>,
}

/// What every open file shares: the connection, the verified-chunk cache and the
/// chunks being fetched.
pub struct Reader {
    remote: Arc<Remote>,
    store: Mutex<Store>,
    /// Chunks read ahead of a sequential reader; `None`: [`READAHEAD_BYTES`] worth.
    readahead: Option<u64>,
    /// Buffers of the bytes returned to readers; the caller hands each back with
    /// [`Reader::recycle`] once it has replied.
    replies: BufPool,
}

/// The state of an open file on one connection.
#[derive(Clone)]
struct Mapped {
    conn: Arc<Conn>,
    map: Arc<MappedFile>,
    hashes: Arc<[Sha256]>,
}

/// One open file.
pub struct OpenFile {
    /// Share-relative path, for logs.
    path: String,
    /// Share-relative path, as the server knows it.
    share_path: String,
    share: String,
    state: Mutex<Mapped>,
    /// End offset of the previous read, for sequential detection.
    seq_end: AtomicU64,
}

enum Claim {
    Ready(Arc<[u8]>),
    Wait(Slot),
}

/// Consecutive chunks this reader claimed and fetches with one READ, each with the
/// sender its waiters watch.
///
/// Invariant: every chunk of a run has an `inflight` entry until the run completes;
/// a run dropped before it completes (its future cancelled) removes the entries of the
/// chunks it still holds, so a later read fetches them afresh instead of waiting on a
/// fetch nobody makes.
struct Run {
    reader: Arc<Reader>,
    mapped: Mapped,
    chunks: Vec<(u64, watch::Sender<Option<Fetched>>)>,
}

impl Run {
    /// Whether the run holds any of chunks `c0..=c1` (its chunks are consecutive).
    fn overlaps(&self, c0: u64, c1: u64) -> bool {
        match (self.chunks.first(), self.chunks.last()) {
            (Some((first, _)), Some((last, _))) => *first <= c1 && *last >= c0,
            _ => false,
        }
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        if self.chunks.is_empty() {
            return;
        }
        let manifest = self.mapped.map.version.manifest;
        let mut store = lock(&self.reader.store);
        for (index, _) in &self.chunks {
            store.inflight.remove(&(manifest, *index));
        }
        // The senders drop here: their waiters see the fetch abandoned.
    }
}

impl Reader {
    /// A reader with a cache of `cache_bytes` and `readahead` chunks of readahead
    /// (`None`: [`READAHEAD_BYTES`] worth, in each file's chunk size).
    pub fn new(remote: Arc<Remote>, cache_bytes: u64, readahead: Option<u32>) -> Arc<Reader> {
        Arc::new(Reader {
            remote,
            store: Mutex::new(Store {
                cache: ChunkCache::new(cache_bytes),
                inflight: HashMap::new(),
            }),
            readahead: readahead.map(u64::from),
            replies: BufPool::new(REPLY_BUFFERS_KEPT),
        })
    }

    /// Takes back a buffer [`OpenFile::read`] returned, for the next read.
    pub fn recycle(&self, buf: Vec<u8>) {
        self.replies.give(buf);
    }

    /// Opens `share_path` for reading: maps it on the server, fetches and checks its
    /// manifest.
    pub async fn open(
        self: &Arc<Self>,
        share: &str,
        share_path: &str,
        chunk_bytes: u32,
    ) -> Result<OpenFile, OpError> {
        let mapped = self.map(share, share_path, chunk_bytes).await?;
        Ok(OpenFile {
            path: format!("{share}/{share_path}"),
            share_path: share_path.to_string(),
            share: share.to_string(),
            state: Mutex::new(mapped),
            seq_end: AtomicU64::new(0),
        })
    }

    async fn map(
        self: &Arc<Self>,
        share: &str,
        path: &str,
        chunk_bytes: u32,
    ) -> Result<Mapped, OpError> {
        let what = format!("open {share}/{path}");
        let (conn, map) = self
            .remote
            .call(&what, |c| {
                let (share, path) = (share.to_string(), path.to_string());
                async move {
                    let m = c.client.map_open(&share, &path, chunk_bytes).await?;
                    Ok((c, m))
                }
            })
            .await?;
        match self.fetch_manifest(&conn, &map).await {
            Ok(hashes) => Ok(Mapped {
                conn,
                map: Arc::new(map),
                hashes: hashes.into(),
            }),
            Err(e) => {
                let handle = map.handle;
                let c = conn.clone();
                tokio::spawn(async move { c.client.map_release(handle).await });
                Err(OpError::new(e.errno, format!("{what}: {}", e.message)))
            }
        }
    }

    /// Checks the server's geometry and reads the manifest region.
    async fn fetch_manifest(&self, conn: &Conn, m: &MappedFile) -> Result<Vec<Sha256>, OpError> {
        let bad = |why: &str| OpError::new(Errno::EIO, format!("server sent a bad mapping: {why}"));
        let v = &m.version;
        let cb = u64::from(v.chunk_bytes);
        if !v.chunk_bytes.is_power_of_two()
            || !(MIN_CHUNK_BYTES..=MAX_CHUNK_BYTES).contains(&v.chunk_bytes)
            || cb > FETCH_BYTES as u64
        {
            return Err(bad("chunk size"));
        }
        if m.window_bytes == 0 || m.window_bytes % cb != 0 {
            return Err(bad("window size"));
        }
        if m.attr.size != v.size {
            return Err(bad("size"));
        }
        let windows = v.size.div_ceil(m.window_bytes);
        if m.regions.len() as u64 != windows {
            return Err(bad("region count"));
        }
        for (i, r) in m.regions.iter().enumerate() {
            let start = i as u64 * m.window_bytes;
            if r.len != m.window_bytes.min(v.size - start) {
                return Err(bad("region length"));
            }
        }
        let chunks = v.size.div_ceil(cb);
        let mut hashes = Vec::with_capacity(chunks as usize);
        match (&m.manifest, chunks) {
            (None, 0) => {}
            (Some(r), n) if n > 0 && r.len == n * 32 => {
                let mut off = 0u64;
                while off < r.len {
                    let len = (r.len - off).min(FETCH_BYTES as u64) as u32;
                    let lease = conn.lease().await;
                    tokio::time::timeout(self.remote.timeout(), conn.read(r, off, len, &lease))
                        .await
                        .map_err(|_| OpError::new(Errno::EIO, "manifest read timed out"))?
                        .map_err(|e| {
                            OpError::new(Errno::EIO, format!("manifest read failed: {e}"))
                        })?;
                    let buf = lease.buffer().read().await;
                    for h in buf[..len as usize].chunks_exact(32) {
                        hashes.push(h.try_into().expect("32-byte chunks"));
                    }
                    off += u64::from(len);
                }
            }
            _ => return Err(bad("manifest region")),
        }
        if manifest_id(v.size, v.chunk_bytes, &hashes) != v.manifest {
            return Err(OpError::new(
                Errno::EIO,
                "integrity: the manifest does not match its hash",
            ));
        }
        Ok(hashes)
    }

    /// Claims chunk `index` of `m`: cached, being fetched, or now ours to fetch (then
    /// `mine` gets the sender).
    fn claim(
        store: &mut Store,
        m: &Mapped,
        index: u64,
        mine: &mut Vec<(u64, watch::Sender<Option<Fetched>>)>,
    ) -> Claim {
        let key = (m.map.version.manifest, index);
        if let Some(data) = store.cache.get(&key) {
            return Claim::Ready(data);
        }
        if let Some(slot) = store.inflight.get(&key) {
            return Claim::Wait(slot.clone());
        }
        let (tx, rx) = watch::channel(None);
        store.inflight.insert(key, rx.clone());
        mine.push((index, tx));
        Claim::Wait(rx)
    }

    /// Claims the chunks a sequential reader of `span` will want next.
    fn claim_ahead(
        &self,
        store: &mut Store,
        m: &Mapped,
        span: &Span,
        mine: &mut Vec<(u64, watch::Sender<Option<Fetched>>)>,
    ) {
        let ahead = self.readahead.unwrap_or(READAHEAD_BYTES / span.chunk_bytes);
        for i in span.c1 + 1..=span.last_chunk.min(span.c1 + ahead) {
            let _ = Reader::claim(store, m, i, mine);
        }
    }

    /// Groups `mine` (sorted by index) into runs of consecutive chunks in one region
    /// of at most [`FETCH_BYTES`], each fetched with one READ.
    fn runs(
        self: &Arc<Self>,
        m: &Mapped,
        mine: Vec<(u64, watch::Sender<Option<Fetched>>)>,
    ) -> Vec<Run> {
        let cb = u64::from(m.map.version.chunk_bytes);
        let per_run = (FETCH_BYTES as u64 / cb).max(1);
        let region_of = |i: u64| i * cb / m.map.window_bytes;
        let mut runs = Vec::new();
        let mut run: Vec<(u64, watch::Sender<Option<Fetched>>)> = Vec::new();
        for (index, tx) in mine {
            let joins = run.last().is_some_and(|(last, _)| {
                *last + 1 == index && region_of(*last) == region_of(index)
            }) && (run.len() as u64) < per_run;
            if !joins && !run.is_empty() {
                runs.push(self.run(m, std::mem::take(&mut run)));
            }
            run.push((index, tx));
        }
        if !run.is_empty() {
            runs.push(self.run(m, run));
        }
        runs
    }

    fn run(
        self: &Arc<Self>,
        m: &Mapped,
        chunks: Vec<(u64, watch::Sender<Option<Fetched>>)>,
    ) -> Run {
        Run {
            reader: self.clone(),
            mapped: m.clone(),
            chunks,
        }
    }

    /// Fetches `run` in a task of its own (readahead: nobody waits for it yet).
    fn spawn_run(self: &Arc<Self>, path: &str, run: Run) {
        let me = self.clone();
        let path = path.to_string();
        tokio::spawn(async move { me.complete_run(&path, run).await });
    }

    /// Fetches `run`, caches what verified, and hands every waiter its chunk's outcome.
    async fn complete_run(&self, path: &str, mut run: Run) {
        let results = self
            .fetch_run(path, &run.mapped, run.chunks.iter().map(|(i, _)| *i))
            .await;
        let manifest = run.mapped.map.version.manifest;
        let mut store = lock(&self.store);
        for ((index, tx), result) in run.chunks.drain(..).zip(results) {
            let key = (manifest, index);
            if let Fetched::Ok(data) = &result {
                store.cache.insert(key, data.clone());
            }
            store.inflight.remove(&key);
            let _ = tx.send(Some(result));
        }
    }

    /// Fetches and verifies the consecutive chunks `indices` with one READ; a chunk
    /// that fails its hash is read once more on its own before it is declared bad.
    async fn fetch_run(
        &self,
        path: &str,
        m: &Mapped,
        indices: impl Iterator<Item = u64>,
    ) -> Vec<Fetched> {
        let indices: Vec<u64> = indices.collect();
        let (first, last) = (indices[0], indices[indices.len() - 1]);
        let lease = m.conn.lease().await;
        let mut out = match self.read_chunks(m, first, last, &lease).await {
            Ok(chunks) => chunks,
            Err(f) => return vec![f; indices.len()],
        };
        for (slot, &index) in out.iter_mut().zip(&indices) {
            if !matches!(slot, Fetched::Failed { errno, .. } if *errno == Errno::EIO) {
                continue;
            }
            tracing::warn!("{path}: chunk {index} does not match its SHA-256; reading it again");
            *slot = match self.read_chunks(m, index, index, &lease).await {
                Ok(mut v) => v.pop().expect("one chunk"),
                Err(f) => f,
            };
            if let Fetched::Failed { errno, .. } = slot {
                if *errno == Errno::EIO {
                    let (a, b) = chunk_range(&m.map.version, index);
                    tracing::error!(
                        "integrity error: {path} chunk {index} (bytes {a}..{b}) does not match \
                         its SHA-256 after a re-read; returning EIO"
                    );
                }
            }
        }
        out
    }

    /// One READ of chunks `first..=last` (one region), each hashed: `Ok` per chunk, or
    /// `Failed{EIO}` for a hash mismatch. `Err` if the READ itself failed.
    async fn read_chunks(
        &self,
        m: &Mapped,
        first: u64,
        last: u64,
        lease: &crate::remote::Lease<'_>,
    ) -> Result<Vec<Fetched>, Fetched> {
        let v = &m.map.version;
        let (start, _) = chunk_range(v, first);
        let (_, end) = chunk_range(v, last);
        let region = (start / m.map.window_bytes) as usize;
        let offset = start - region as u64 * m.map.window_bytes;
        let len = (end - start) as u32;
        let read = m.conn.read(&m.map.regions[region], offset, len, lease);
        match tokio::time::timeout(self.remote.timeout(), read).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let conn_lost = !matches!(e, TransportError::RemoteAccess { .. })
                    || m.conn.client.transport().kind()
                        == ferry_common::transport::TransportKind::Rdma;
                if conn_lost {
                    self.remote.drop_conn(&m.conn, &e.to_string());
                }
                tracing::error!("read of {start}..{end} failed: {e}");
                return Err(Fetched::Failed {
                    errno: Errno::EIO,
                    conn_lost,
                });
            }
            Err(_) => {
                self.remote.drop_conn(
                    &m.conn,
                    "a one-sided read got no completion within the timeout",
                );
                return Err(Fetched::Failed {
                    errno: Errno::EIO,
                    conn_lost: true,
                });
            }
        }
        let buf = lease.buffer().read().await;
        Ok((first..=last)
            .map(|i| {
                let (a, b) = chunk_range(v, i);
                let bytes = &buf[(a - start) as usize..(b - start) as usize];
                if hash_chunk(bytes) == m.hashes[i as usize] {
                    Fetched::Ok(bytes.into())
                } else {
                    Fetched::Failed {
                        errno: Errno::EIO,
                        conn_lost: false,
                    }
                }
            })
            .collect())
    }
}

/// File bytes `a..b` of chunk `index`.
fn chunk_range(v: &FileVersion, index: u64) -> (u64, u64) {
    let cb = u64::from(v.chunk_bytes);
    let a = index * cb;
    (a, (a + cb).min(v.size))
}

/// The chunks a read touches, the read clipped to the end of the file.
struct Span {
    /// End offset of the read, at most the file size.
    end: u64,
    chunk_bytes: u64,
    /// First and last chunk touched.
    c0: u64,
    c1: u64,
    last_chunk: u64,
}

impl Span {
    /// `None` for a read that returns nothing (at or past the end, or of size 0).
    fn of(v: &FileVersion, offset: u64, size: u32) -> Option<Span> {
        if offset >= v.size || size == 0 {
            return None;
        }
        let end = v.size.min(offset + u64::from(size));
        let cb = u64::from(v.chunk_bytes);
        Some(Span {
            end,
            chunk_bytes: cb,
            c0: offset / cb,
            c1: (end - 1) / cb,
            last_chunk: (v.size - 1) / cb,
        })
    }

    /// Appends the bytes of the read starting at `offset` that chunk `index` holds.
    fn copy_out(&self, out: &mut Vec<u8>, offset: u64, index: u64, data: &[u8]) {
        let base = index * self.chunk_bytes;
        let a = offset.max(base) - base;
        let b = self.end.min(base + self.chunk_bytes) - base;
        out.extend_from_slice(&data[a as usize..b as usize]);
    }
}

impl OpenFile {
    /// The version this handle reads.
    pub fn version(&self) -> FileVersion {
        lock(&self.state).map.version
    }

    /// The attributes the server reported at open.
    pub fn attr(&self) -> ferry_common::msg::Attr {
        lock(&self.state).map.attr.clone()
    }

    /// Reads `size` bytes at `offset` (fewer at the end of the file). The buffer may be
    /// handed back with [`Reader::recycle`] after use.
    pub async fn read(
        &self,
        reader: &Arc<Reader>,
        offset: u64,
        size: u32,
    ) -> Result<Vec<u8>, OpError> {
        match self.read_once(reader, offset, size).await {
            Err((e, true)) => {
                // The connection went away: map the same version again on a new one
                // and retry once. A changed file fails instead of mixing versions.
                self.remap(reader).await.map_err(|e2| {
                    OpError::new(
                        e2.errno,
                        format!("{}; reconnecting: {}", e.message, e2.message),
                    )
                })?;
                self.read_once(reader, offset, size)
                    .await
                    .map_err(|(e, _)| e)
            }
            other => other.map_err(|(e, _)| e),
        }
    }

    async fn remap(&self, reader: &Arc<Reader>) -> Result<(), OpError> {
        let old = lock(&self.state).clone();
        let fresh = reader
            .map(&self.share, &self.share_path, old.map.version.chunk_bytes)
            .await?;
        if fresh.map.version != old.map.version {
            let handle = fresh.map.handle;
            let c = fresh.conn.clone();
            tokio::spawn(async move { c.client.map_release(handle).await });
            return Err(OpError::new(
                Errno::EIO,
                format!(
                    "{}: the file changed on the server while it was open",
                    self.path
                ),
            ));
        }
        *lock(&self.state) = fresh;
        Ok(())
    }

    /// Answers the read at once, with no I/O, when every chunk it touches is cached
    /// (starting readahead as [`OpenFile::read`] would); `None` when some chunk is not,
    /// having changed nothing. Needs a tokio runtime context (readahead is spawned).
    pub fn read_cached(&self, reader: &Arc<Reader>, offset: u64, size: u32) -> Option<Vec<u8>> {
        let m = lock(&self.state).clone();
        let Some(span) = Span::of(&m.map.version, offset, size) else {
            return Some(Vec::new());
        };
        let manifest = m.map.version.manifest;
        let mut mine = Vec::new();
        let chunks = {
            let mut store = lock(&reader.store);
            let mut chunks = Vec::with_capacity((span.c1 - span.c0 + 1) as usize);
            for i in span.c0..=span.c1 {
                chunks.push(store.cache.get(&(manifest, i))?);
            }
            if self.seq_end.swap(span.end, Ordering::Relaxed) == offset {
                reader.claim_ahead(&mut store, &m, &span, &mut mine);
            }
            chunks
        };
        for run in reader.runs(&m, mine) {
            reader.spawn_run(&self.path, run);
        }
        let mut out = reader.replies.take((span.end - offset) as usize);
        for (i, data) in (span.c0..=span.c1).zip(chunks) {
            span.copy_out(&mut out, offset, i, &data);
        }
        Some(out)
    }

    async fn read_once(
        &self,
        reader: &Arc<Reader>,
        offset: u64,
        size: u32,
    ) -> Result<Vec<u8>, (OpError, bool)> {
        let m = lock(&self.state).clone();
        let Some(span) = Span::of(&m.map.version, offset, size) else {
            return Ok(Vec::new());
        };
        let (c0, c1) = (span.c0, span.c1);
        let sequential = self.seq_end.swap(span.end, Ordering::Relaxed) == offset;
        let mut mine = Vec::new();
        let claims: Vec<Claim> = {
            let mut store = lock(&reader.store);
            let claims = (c0..=c1)
                .map(|i| Reader::claim(&mut store, &m, i, &mut mine))
                .collect();
            if sequential {
                reader.claim_ahead(&mut store, &m, &span, &mut mine);
            }
            claims
        };
        // Runs holding chunks of this read are fetched here, on this task: the reply
        // waits for them anyway, and a hand-off to another task would cost a wake-up.
        // The rest (readahead) go on in tasks of their own.
        let (now, later): (Vec<Run>, Vec<Run>) = reader
            .runs(&m, mine)
            .into_iter()
            .partition(|run| run.overlaps(c0, c1));
        for run in later {
            reader.spawn_run(&self.path, run);
        }
        for run in now {
            reader.complete_run(&self.path, run).await;
        }
        let mut out = reader.replies.take((span.end - offset) as usize);
        for (i, claim) in (c0..=c1).zip(claims) {
            let data = match claim {
                Claim::Ready(d) => d,
                Claim::Wait(mut rx) => {
                    let got = rx.wait_for(Option::is_some).await.map(|v| v.clone());
                    match got {
                        Ok(Some(Fetched::Ok(d))) => d,
                        Ok(Some(Fetched::Failed { errno, conn_lost })) => {
                            return Err((
                                OpError::new(
                                    errno,
                                    format!("{}: chunk {i} unavailable", self.path),
                                ),
                                conn_lost,
                            ))
                        }
                        _ => {
                            return Err((
                                OpError::new(Errno::EIO, format!("{}: fetch abandoned", self.path)),
                                false,
                            ))
                        }
                    }
                }
            };
            span.copy_out(&mut out, offset, i, &data);
        }
        Ok(out)
    }

    /// Revokes the server's registrations of this file (best effort, in the background).
    pub fn release(&self) {
        let m = lock(&self.state).clone();
        let handle = m.map.handle;
        tokio::spawn(async move {
            let _ = m.conn.client.map_release(handle).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_chunks_until_the_manifest_would_pass_4_mib() {
        assert_eq!(auto_chunk(0), AUTO_MIN_CHUNK);
        assert_eq!(auto_chunk(4096), AUTO_MIN_CHUNK);
        assert_eq!(auto_chunk(2 << 30), 16 << 10);
        assert_eq!(auto_chunk((2 << 30) + 1), 32 << 10);
        assert_eq!(auto_chunk(8 << 30), 64 << 10);
        assert_eq!(auto_chunk(1 << 40), FETCH_BYTES as u32);
        assert_eq!(auto_chunk(u64::MAX), FETCH_BYTES as u32);
        for size in [1u64, 1 << 20, 3 << 30, 100 << 30] {
            let c = u64::from(auto_chunk(size));
            assert!(c.is_power_of_two());
            assert!(size.div_ceil(c) <= AUTO_MAX_CHUNKS || c == FETCH_BYTES as u64);
        }
    }
}
