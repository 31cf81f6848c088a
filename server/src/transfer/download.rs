//! Downloads: each window's chunks read from the file into pool buffers, hashed and
//! pushed into the client's region with one-sided WRITEs.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;

use ferry_common::chunk::hash_chunk;
use ferry_common::direct::DirectFile;
use ferry_common::msg::{Attr, RegionDesc, Response, MAX_WINDOW_CHUNKS};
use ferry_common::proto::transfer::check_window;
use ferry_common::transport::{RemoteSlice, SharedTransport};
use tokio::task::JoinSet;

use super::{join_all, TransferError};
use crate::fsops::check_regular;
use crate::pool::Pool;
use crate::share::Share;

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
    pub fn open(share: &Share, rel: &str, chunk_bytes: u32) -> Result<Download, TransferError> {
        let what = share.display(rel);
        let path = share.resolve(rel, true)?;
        let file = File::open(&path).map_err(|e| TransferError::Open(what.clone(), e))?;
        let meta = file
            .metadata()
            .map_err(|e| TransferError::Stat(what.clone(), e))?;
        check_regular(&meta, &what)?;
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
    ) -> Result<Response, TransferError> {
        let size = self.attr.size;
        let len = region.len.min(size.saturating_sub(offset));
        let window = check_window(size, self.chunk_bytes, MAX_WINDOW_CHUNKS, offset, len).map_err(
            |source| TransferError::Window {
                path: self.what.clone(),
                source,
            },
        )?;
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
                        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                            Err(TransferError::Shrank { path: what2 })
                        }
                        Err(e) => Err(TransferError::Read(what2, e)),
                    }
                })
                .await
                .map_err(|source| TransferError::ReadTask {
                    path: what.clone(),
                    source,
                })??;
                let slice = RemoteSlice::of(&region, chunk.window_offset, chunk.len)
                    .ok_or_else(|| TransferError::OutsideRegion { path: what.clone() })?;
                transport
                    .write(lease.reg(), 0, slice)
                    .await
                    .map_err(|source| TransferError::Transport { path: what, source })?;
                Ok((chunk.index, hash))
            });
        }
        let mut done = join_all(tasks).await?;
        done.sort_unstable_by_key(|(i, _)| *i);
        Ok(Response::WindowPushed {
            hashes: done.into_iter().map(|(_, h)| h).collect(),
        })
    }

    /// Ends the download: fails with [`TransferError::ChangedDuring`] if the file was modified
    /// since it was opened. Blocking.
    pub fn close(&self) -> Result<Response, TransferError> {
        let meta = self
            .file
            .file()
            .metadata()
            .map_err(|e| TransferError::Stat(self.what.clone(), e))?;
        let now = ferry_common::attr::attr_of(&meta, None);
        if meta.ino() != self.ino || now.size != self.attr.size || now.mtime != self.attr.mtime {
            return Err(TransferError::ChangedDuring {
                path: self.what.clone(),
            });
        }
        Ok(Response::Ok)
    }
}
