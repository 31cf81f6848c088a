//! Downloads: each window's chunks read from the file into pool buffers and pushed
//! into the client's region with one-sided WRITEs, answered with their hashes.
//!
//! The hashes sent are the ones recorded when the file was written, whenever the
//! server knows them for the file's version at open ([`look_up`]) in an
//! algorithm the client accepts: then the bytes read are not hashed here at all, and
//! the client's check compares what is on the disk now with what was written, so rot
//! underneath the file system is caught. A file recorded in another algorithm than
//! the reader accepts is hashed as it is read, both ways: in the reader's algorithm for
//! the hashes sent, and in the record's to check the bytes against it (rot fails the
//! read here, as below). Only a file with no known manifest is hashed once, for the
//! reader, and checked against nothing. When the client finds a chunk that does not match and asks again
//! with `verify`, the chunks read are hashed and compared with the record here too:
//! a mismatch on a file whose version did not change is rot on this server's disk,
//! logged and answered with an integrity error naming the file and chunk.
//!
//! A file with no record at all (written underneath ferryd, not through it) is
//! recorded by the download that hashed every chunk of it, as the mount records the
//! files it hashes ([`crate::manifests::manifest_of`]): at the close, if the file is
//! still the version opened and had settled before the download began
//! ([`crate::filekey::settled`]), its hashes go to the cache and the share's store, so
//! the next reader is sent them without hashing, and rot after this read is caught.
//! A file recorded in another algorithm than the download's keeps that record, and
//! the hashes taken for this reader are not cached (as `manifest_of`).

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use ferry_common::chunk::{chunk_count, hash_chunk};
use ferry_common::direct::DirectFile;
use ferry_common::msg::{Attr, Hash256, HashAlgorithm, RegionDesc, Response, MAX_WINDOW_CHUNKS};
use ferry_common::proto::transfer::check_window;
use ferry_common::transport::{RemoteSlice, SharedTransport};
use tokio::task::JoinSet;

use super::{join_all, TransferError};
use crate::conn::Hashing;
use crate::filekey::{settled, ManifestKey, CACHE_SETTLE};
use crate::fsops::check_regular;
use crate::manifests::{look_up, Hashes, Known, ManifestCache, ROT_LOG};
use crate::pool::Pool;
use crate::share::Share;
use crate::store::ManifestStore;

/// An open download.
pub struct Download {
    what: String,
    /// The file; read direct where the page cache does not hold a chunk.
    file: Arc<DirectFile>,
    attr: Attr,
    /// The version opened, as the manifest store keys it.
    key: ManifestKey,
    chunk_bytes: u32,
    /// The algorithm of the hashes sent.
    algorithm: HashAlgorithm,
    /// The hashes recorded for the version opened, if known (in `algorithm`).
    recorded: Option<Hashes>,
    /// The hashes recorded for the version opened in another algorithm than the
    /// reader's, one per chunk: every chunk read is checked against them.
    check: Option<Hashes>,
    /// For a file with no record in any algorithm: the hashes taken here so far, to
    /// record at the close (see the module docs).
    fresh: Option<Fresh>,
}

/// The hashes a download of a file with no record takes, and where to record them.
struct Fresh {
    /// By chunk index; `None` until that chunk is read.
    hashes: Mutex<Vec<Option<Hash256>>>,
    /// When the download was opened, before any chunk was read.
    started: SystemTime,
    cache: Arc<ManifestCache>,
    /// The share's store (which holds no record of the file in any algorithm).
    store: Option<Arc<ManifestStore>>,
}

impl Fresh {
    fn new(
        meta: &std::fs::Metadata,
        chunk_bytes: u32,
        started: SystemTime,
        cache: &Arc<ManifestCache>,
        store: Option<Arc<ManifestStore>>,
    ) -> Fresh {
        let chunks = chunk_count(meta.len(), chunk_bytes) as usize;
        Fresh {
            hashes: Mutex::new(vec![None; chunks]),
            started,
            cache: cache.clone(),
            store,
        }
    }
}

impl Download {
    /// Opens `rel` for download (symlinks followed inside the share) and looks up the
    /// hashes recorded for its version (`cache`, then the share's store). Blocking.
    pub fn open(
        share: &Share,
        rel: &str,
        chunk_bytes: u32,
        hashing: Hashing,
        cache: &Arc<ManifestCache>,
    ) -> Result<Download, TransferError> {
        let started = SystemTime::now();
        let what = share.display(rel);
        let path = share.resolve(rel, true)?;
        let file = File::open(&path).map_err(|e| TransferError::Open(what.clone(), e))?;
        let meta = file
            .metadata()
            .map_err(|e| TransferError::Stat(what.clone(), e))?;
        check_regular(&meta, &what)?;
        let key = ManifestKey::of(&meta, chunk_bytes);
        let store = Some(share.store().clone());
        let (recorded, check, fresh) =
            match look_up(&key, &what, hashing.accept, cache, store.as_deref()) {
                Known::Accepted(found) => (Some(found), None, None),
                // A record in another algorithm is kept as it is, and hashes taken for
                // this reader are not cached: readers get the record written with the
                // file, not hashes of what is on the disk now. What is read is checked
                // against it, so rot is caught whichever algorithm the reader wants.
                Known::OtherAlgorithm(record) => (None, Some(record), None),
                Known::Nothing => (
                    None,
                    None,
                    Some(Fresh::new(&meta, chunk_bytes, started, cache, store)),
                ),
            };
        let check = check.filter(|r| r.hashes.len() as u64 == chunk_count(meta.len(), chunk_bytes));
        Ok(Download {
            what,
            attr: ferry_common::attr::attr_of(&meta, None),
            key,
            file: Arc::new(DirectFile::for_reading(Arc::new(file), meta.len())),
            chunk_bytes,
            algorithm: recorded.as_ref().map_or(hashing.fresh, |r| r.algorithm),
            recorded,
            check,
            fresh,
        })
    }

    /// Attributes at open time.
    pub fn attr(&self) -> &Attr {
        &self.attr
    }

    /// The algorithm of the hashes this download sends.
    pub fn algorithm(&self) -> HashAlgorithm {
        self.algorithm
    }

    /// Pushes one window: reads each chunk into a pool buffer (from the page cache if it
    /// holds the chunk, else direct) and RDMA-WRITEs it into the client's `region`;
    /// answers with the chunks' recorded hashes, or, for a file with none, their hashes
    /// taken here. With `verify`, recorded hashes are checked against the bytes read
    /// first (see the module docs).
    pub async fn push_window(
        &self,
        transport: &SharedTransport,
        pool: &Arc<Pool>,
        offset: u64,
        region: RegionDesc,
        verify: bool,
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
            let algorithm = self.algorithm;
            // A chunk beyond the record cannot be: the record is of this size.
            let recorded = self
                .recorded
                .as_ref()
                .and_then(|r| r.hashes.get(chunk.index as usize).copied());
            let check = self.check.as_ref().and_then(|r| {
                r.hashes
                    .get(chunk.index as usize)
                    .map(|&h| (r.algorithm, h))
            });
            tasks.spawn(async move {
                let lease = pool.lease().await?;
                let buf = lease.buffer().clone();
                let file_offset = window.offset + chunk.window_offset;
                let len = chunk.len as usize;
                let what2 = what.clone();
                let hash = tokio::task::spawn_blocking(move || {
                    let mut bytes = buf.blocking_write();
                    match file.read_exact_at(&mut bytes[..len], file_offset) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                            return Err(TransferError::Shrank { path: what2 })
                        }
                        Err(e) => return Err(TransferError::Read(what2, e)),
                    }
                    let data = &bytes[..len];
                    // (the hash sent, whether the bytes match the record)
                    Ok(match (recorded, check) {
                        (Some(h), _) if !verify => (h, true),
                        (Some(h), _) => (h, hash_chunk(algorithm, data) == h),
                        (None, Some((other, h))) => {
                            (hash_chunk(algorithm, data), hash_chunk(other, data) == h)
                        }
                        (None, None) => (hash_chunk(algorithm, data), true),
                    })
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
        if let Some((index, _)) = done.iter().find(|(_, (_, matches))| !matches) {
            return Err(self.mismatch(*index));
        }
        if let Some(fresh) = &self.fresh {
            let mut taken = fresh.hashes.lock().unwrap_or_else(|p| p.into_inner());
            for (index, (hash, _)) in &done {
                if let Some(slot) = taken.get_mut(*index as usize) {
                    *slot = Some(*hash);
                }
            }
        }
        Ok(Response::WindowPushed {
            hashes: done.into_iter().map(|(_, (h, _))| h).collect(),
        })
    }

    /// The error for chunk `index`, whose bytes read do not match the hash recorded for
    /// the version opened: rot (logged) if the file is still that version, else a
    /// change during the download.
    fn mismatch(&self, index: u64) -> TransferError {
        let same = self
            .file
            .file()
            .metadata()
            .is_ok_and(|m| ManifestKey::of(&m, self.chunk_bytes) == self.key);
        if !same {
            return TransferError::ChangedDuring {
                path: self.what.clone(),
            };
        }
        let start = index * u64::from(self.chunk_bytes);
        let end = (start + u64::from(self.chunk_bytes)).min(self.attr.size);
        tracing::error!(
            file = %self.what,
            chunk = index,
            bytes = %format!("{start}..{end}"),
            algorithm = %self.check.as_ref().map_or(self.algorithm, |r| r.algorithm),
            "{ROT_LOG}"
        );
        TransferError::Rot {
            path: self.what.clone(),
            index,
            start,
            end,
        }
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
        if meta.ino() != self.attr.ino || now.size != self.attr.size || now.mtime != self.attr.mtime
        {
            return Err(TransferError::ChangedDuring {
                path: self.what.clone(),
            });
        }
        if ManifestKey::of(&meta, self.chunk_bytes) == self.key {
            self.record();
        }
        Ok(Response::Ok)
    }

    /// Records the hashes taken of a file with no record, once every chunk was read,
    /// if it had settled before the download began (the caller checked that it is
    /// still the version opened). Blocking.
    fn record(&self) {
        let Some(fresh) = &self.fresh else {
            return;
        };
        if !settled(&self.key, fresh.started, CACHE_SETTLE) {
            return;
        }
        let taken = fresh.hashes.lock().unwrap_or_else(|p| p.into_inner());
        let Some(hashes) = taken.iter().copied().collect::<Option<Vec<Hash256>>>() else {
            return;
        };
        let hashes: Arc<[Hash256]> = hashes.into();
        fresh
            .cache
            .insert((self.key, self.algorithm), hashes.clone());
        if let Some(store) = &fresh.store {
            if let Err(e) = store.save(&self.key, self.algorithm, &hashes) {
                tracing::debug!(file = %self.what, "cannot store the manifest: {e}");
            }
        }
        tracing::debug!(file = %self.what, algorithm = %self.algorithm, "manifest recorded by a download");
    }
}
