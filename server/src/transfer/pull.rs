//! One chunk of an upload's window: kept from the partial file, copied from the base,
//! or pulled from the client with a one-sided READ, and in every case checked against
//! the client's hash before it counts (see the invariants of [`super`]).

use std::fs::File;
use std::sync::Arc;

use ferry_common::chunk::hash_chunk;
use ferry_common::direct::DirectFile;
use ferry_common::journal::{JournalHeader, JournalWriter};
use ferry_common::msg::{Hash256, RegionDesc};
use ferry_common::proto::transfer::{ChunkRef, Window};
use ferry_common::space::Deferred;
use ferry_common::staging::chunk_matches;
use ferry_common::transport::{RemoteSlice, SharedTransport};

use super::{reserve_failed, BaseFile, TransferError};
use crate::pool::{Lease, Pool};

/// A chunk of a window to get into the upload's file.
pub(super) struct PullChunk {
    pub(super) transport: SharedTransport,
    pub(super) pool: Arc<Pool>,
    /// The upload's file, as the partial's journal reads it back.
    pub(super) file: Arc<File>,
    /// Where verified bytes go.
    pub(super) sink: Sink,
    pub(super) header: JournalHeader,
    pub(super) what: String,
    pub(super) region: RegionDesc,
    pub(super) window: Window,
    pub(super) chunk: ChunkRef,
    pub(super) expected: Hash256,
    /// The journal names this chunk with the expected hash.
    pub(super) hinted: bool,
    /// The upload's base file, if its manifest lists the expected hash.
    pub(super) base: Option<Arc<BaseFile>>,
}

/// A chunk of a window, verified and in the file.
pub(super) struct ChunkDone {
    pub(super) index: u64,
    pub(super) hash: Hash256,
    pub(super) len: u32,
    /// Found in the partial file or the base rather than pulled.
    pub(super) reused: bool,
    /// Written to the file by this upload (pulled, or copied from the base).
    pub(super) written: bool,
}

/// Where an upload's verified chunks go: its file, then its journal.
#[derive(Clone)]
pub(super) struct Sink {
    /// The file, its aligned blocks written direct where allowed.
    pub(super) out: Arc<DirectFile>,
    /// The file's reservation, where it is made beside the first windows: waited for
    /// before every write.
    pub(super) reserved: Option<Arc<Deferred>>,
    /// The partial's journal; `None` for a scratch file.
    pub(super) journal: Option<Arc<JournalWriter>>,
}

impl Sink {
    /// Writes the verified chunk `index` (`bytes`, hashing to `hash`) at `offset`, then
    /// journals it. Journaled only once the bytes are in the file; the journal is a
    /// hint, so failing to extend it costs a later resume, not this upload (logged
    /// against `what`). Waits for the file's reservation first, and fails with its
    /// error. Blocking.
    fn write(
        &self,
        bytes: &[u8],
        offset: u64,
        index: u64,
        hash: &Hash256,
        what: &str,
    ) -> Result<(), TransferError> {
        if let Some(r) = &self.reserved {
            r.wait().map_err(|e| reserve_failed(what, e))?;
        }
        self.out
            .write_all_at(bytes, offset)
            .map_err(|e| TransferError::Write(what.to_owned(), e))?;
        if let Some(j) = &self.journal {
            if let Err(e) = j.append(index, hash) {
                tracing::warn!(file = %what, "cannot extend the upload's journal: {e}");
            }
        }
        Ok(())
    }
}

impl PullChunk {
    /// Gets the chunk into the file the cheapest way that yields verified bytes: kept
    /// if the journal names it and the partial still holds it, else copied if the base
    /// holds it, else pulled from the client's region.
    pub(super) async fn run(self) -> Result<ChunkDone, TransferError> {
        let lease = self.pool.lease().await?;
        if self.hinted && self.held(&lease).await? {
            return Ok(self.done(true, false));
        }
        if self.copied_from_base(&lease).await? {
            return Ok(self.done(true, true));
        }
        self.pull(&lease).await?;
        Ok(self.done(false, true))
    }

    fn done(&self, reused: bool, written: bool) -> ChunkDone {
        ChunkDone {
            index: self.chunk.index,
            hash: self.expected,
            len: self.chunk.len,
            reused,
            written,
        }
    }

    /// The chunk's offset in the file.
    fn file_offset(&self) -> u64 {
        self.window.offset + self.chunk.window_offset
    }

    /// True if the partial file holds the chunk with the expected hash (read back
    /// into the lent buffer and hashed again).
    async fn held(&self, lease: &Lease) -> Result<bool, TransferError> {
        let (buf, file, header) = (lease.buffer().clone(), self.file.clone(), self.header);
        let (index, expected) = (self.chunk.index, self.expected);
        self.blocking(move || {
            let mut bytes = buf.blocking_write();
            chunk_matches(
                &file,
                &header,
                header.algorithm,
                index,
                &expected,
                &mut bytes[..],
            )
        })
        .await
    }

    /// True if the base holds the chunk with the expected hash (read into the lent
    /// buffer and hashed again), which is then written to the file.
    async fn copied_from_base(&self, lease: &Lease) -> Result<bool, TransferError> {
        let Some(base) = self.base.clone() else {
            return Ok(false);
        };
        let (buf, sink, what) = (lease.buffer().clone(), self.sink.clone(), self.what.clone());
        let (index, expected, len) = (self.chunk.index, self.expected, self.chunk.len as usize);
        let offset = self.file_offset();
        self.blocking(move || {
            let mut bytes = buf.blocking_write();
            if !base.find(&expected, len, &mut bytes[..]) {
                return Ok(false);
            }
            sink.write(&bytes[..len], offset, index, &expected, &what)?;
            Ok(true)
        })
        .await?
    }

    /// Pulls the chunk from the client's region into the lent buffer with one READ,
    /// checks it against the expected hash and writes it to the file.
    async fn pull(&self, lease: &Lease) -> Result<(), TransferError> {
        let what = &self.what;
        let slice = RemoteSlice::of(&self.region, self.chunk.window_offset, self.chunk.len)
            .ok_or_else(|| TransferError::OutsideRegion { path: what.clone() })?;
        self.transport
            .read(slice, lease.reg(), 0)
            .await
            .map_err(|source| TransferError::Transport {
                path: what.clone(),
                source,
            })?;
        let (buf, sink, what2) = (lease.buffer().clone(), self.sink.clone(), what.clone());
        let (index, expected, len) = (self.chunk.index, self.expected, self.chunk.len as usize);
        let offset = self.file_offset();
        let algorithm = self.header.algorithm;
        let verified = self
            .blocking(move || {
                let bytes = buf.blocking_read();
                if hash_chunk(algorithm, &bytes[..len]) != expected {
                    return Ok(false);
                }
                sink.write(&bytes[..len], offset, index, &expected, &what2)?;
                Ok::<_, TransferError>(true)
            })
            .await??;
        if verified {
            return Ok(());
        }
        tracing::warn!(file = %what, chunk = index, %algorithm, "upload chunk failed hash verification");
        Err(TransferError::Integrity {
            path: what.clone(),
            algorithm,
            index,
            start: offset,
            end: offset + u64::from(self.chunk.len),
        })
    }

    /// Runs `f` (hashing, reading or writing the chunk) on the blocking pool.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, TransferError> {
        tokio::task::spawn_blocking(f)
            .await
            .map_err(|source| TransferError::HashTask {
                path: self.what.clone(),
                source,
            })
    }
}
