//! Open files: one-sided reads of server memory, verified chunk by chunk.
//!
//! On open the server maps the file and returns its read-only regions, its version and
//! the region holding its manifest. The client reads the manifest by RDMA READ and
//! checks it against the version's manifest hash. After that, `read()` needs no
//! request to the server at all: missing chunks are fetched by RDMA READ straight from
//! the server's registered file pages into this client's registered buffers, hashed,
//! and only then copied out. The geometry of a mapping (which region, offset and
//! length a READ takes; which part of the file a read wants) is the sans-IO
//! [`MappedLayout`]'s; this module does the I/O, the caching and the waiting.
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

use ferry_common::chunk::hash_chunk;
use ferry_common::msg::{FileVersion, Hash256, MappedFile};
use ferry_common::proto::mapped::{MappedError, MappedLayout, ReadSpan};
use ferry_common::transport::TransportError;
use fuser::Errno;
use tokio::sync::watch;

use crate::bufs::BufPool;
use crate::cache::{ChunkCache, ChunkKey};
use crate::remote::{lock, Conn, Lease, OpError, Remote, FETCH_BYTES};

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
    /// `map`'s geometry, checked.
    layout: MappedLayout,
    hashes: Arc<[Hash256]>,
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
        // A server at its mapped-bytes or mapped-files limit answers Busy until other
        // opens release theirs: wait for it within the timeout.
        let (conn, map) = self
            .remote
            .call_patient(&what, |c| {
                let (share, path) = (share.to_string(), path.to_string());
                async move {
                    let m = c.client.map_open(&share, &path, chunk_bytes).await?;
                    Ok((c, m))
                }
            })
            .await?;
        match self.fetch_manifest(&conn, &map).await {
            Ok((layout, hashes)) => Ok(Mapped {
                conn,
                map: Arc::new(map),
                layout,
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

    /// Checks the server's geometry, then reads the manifest region and checks it
    /// against the version's manifest hash.
    async fn fetch_manifest(
        &self,
        conn: &Conn,
        m: &MappedFile,
    ) -> Result<(MappedLayout, Vec<Hash256>), OpError> {
        let refused = |e: MappedError| OpError::new(Errno::EIO, e.to_string());
        let layout = MappedLayout::new(m, FETCH_BYTES as u64).map_err(refused)?;
        let mut fetch = layout.manifest_fetch();
        while let Some(r) = fetch.poll_read() {
            let lease = conn.lease().await;
            let read = conn.read(&r.region, r.offset, r.len, &lease);
            tokio::time::timeout(self.remote.timeout(), read)
                .await
                .map_err(|_| OpError::new(Errno::EIO, "manifest read timed out"))?
                .map_err(|e| OpError::new(Errno::EIO, format!("manifest read failed: {e}")))?;
            let buf = lease.buffer().read().await;
            fetch.handle_read(&buf[..r.len as usize]);
        }
        let hashes = fetch.finish().map_err(refused)?;
        Ok((layout, hashes))
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
        span: &ReadSpan,
        mine: &mut Vec<(u64, watch::Sender<Option<Fetched>>)>,
    ) {
        let ahead = self
            .readahead
            .unwrap_or_else(|| span.chunks_in(READAHEAD_BYTES));
        for i in span.ahead(ahead) {
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
        let mut runs = Vec::new();
        let mut run: Vec<(u64, watch::Sender<Option<Fetched>>)> = Vec::new();
        for (index, tx) in mine {
            let joins = match (run.first(), run.last()) {
                (Some((first, _)), Some((last, _))) => m.layout.extends_run(*first, *last, index),
                _ => false,
            };
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
                    let bytes = m.layout.chunk_range(index);
                    let (a, b) = (bytes.start, bytes.end);
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
        lease: &Lease<'_>,
    ) -> Result<Vec<Fetched>, Fetched> {
        let run = m.layout.run_read(first, last).map_err(|e| {
            tracing::error!("{e}");
            Fetched::Failed {
                errno: Errno::EIO,
                conn_lost: false,
            }
        })?;
        let (start, end) = (run.file.start, run.file.end);
        let read = m
            .conn
            .read(&m.map.regions[run.region], run.offset, run.len, lease);
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
                let bytes = &buf[run.chunk_in_buffer(i)];
                if hash_chunk(m.map.version.algorithm, bytes) == m.hashes[i as usize] {
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
        let Some(span) = m.layout.span(offset, size) else {
            return Some(Vec::new());
        };
        let manifest = m.map.version.manifest;
        let mut mine = Vec::new();
        let chunks = {
            let mut store = lock(&reader.store);
            let mut chunks = Vec::with_capacity((span.last - span.first + 1) as usize);
            for i in span.chunks() {
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
        let mut out = reader.replies.take(span.len() as usize);
        for (i, data) in span.chunks().zip(chunks) {
            out.extend_from_slice(&data[span.part_of_chunk(i)]);
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
        let Some(span) = m.layout.span(offset, size) else {
            return Ok(Vec::new());
        };
        let (c0, c1) = (span.first, span.last);
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
        let mut out = reader.replies.take(span.len() as usize);
        for (i, claim) in span.chunks().zip(claims) {
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
            out.extend_from_slice(&data[span.part_of_chunk(i)]);
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
