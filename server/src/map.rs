//! Mapped files: `MapOpen` registers a whole file read-only so the client can fetch any
//! part of it with one-sided READs, with no request per read; `MapRelease` revokes it.
//!
//! A mapped file is registered as windows of [`MAP_WINDOW_BYTES`] (the last one
//! shorter), each a read-only [`FileWindow`], plus one anonymous buffer holding the
//! chunk manifest (32-byte SHA-256 per chunk, in order), all `Access::RemoteRead`.
//!
//! Invariants:
//! - The file is opened read-only and never touched through its mapping by the server:
//!   hashing uses `pread` ([`crate::manifests`]) and the TCP transport serves READs of
//!   a file window with `pread` too, so a file truncated under a mapping fails reads
//!   instead of killing the server with SIGBUS.
//! - Every registration of a mapped file lives in its [`MappedEntry`]; dropping the
//!   entry (on `MapRelease`, or when the connection ends and its [`MapTable`] goes)
//!   revokes them all before the server's counters (mapped files and bytes, and
//!   registrations) fall.
//! - A connection holds at most `MAX_OPEN_MAPS` entries (its session's tables,
//!   `ferry_common::proto::conn`, admit each `MapOpen` and grant its handle), and the
//!   file bytes registered by all connections together stay within the server's
//!   [`MapBudget`]; beyond either, `MapOpen` fails with [`ferry_common::msg::ErrorKind::Busy`] before
//!   any hashing or mapping.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ferry_common::attr::attr_of;
use ferry_common::chunk::{chunk_count, manifest_id};
use ferry_common::msg::{
    FileVersion, Hash256, MappedFile, Response, MAP_WINDOW_BYTES, MAX_CHUNK_BYTES,
    MAX_MANIFEST_PAGE_CHUNKS, MAX_MAP_REGIONS, MIN_CHUNK_BYTES,
};
use ferry_common::transport::{
    Access, Buffer, FileWindow, Memory, Registration, SharedTransport, TransportError,
};

use crate::conn::Hashing;
use crate::filekey::CACHE_SETTLE;
use crate::fsops::{check_regular, FsError};
use crate::gauge::{Gauge, Held};
use crate::manifests::{manifest_of, Hashes, ManifestCache, ManifestError};
use crate::share::{Share, ShareError};

/// Most chunks a mapped file's manifest holds (32 MiB of hashes): for a file that
/// would need more at the requested chunk size, the chunk size is doubled until it
/// fits (or reaches `MAX_CHUNK_BYTES`), so a tiny chunk size asked for a huge file
/// cannot make the server hold gigabytes of hashes.
pub const MAX_MANIFEST_CHUNKS: u64 = 1 << 20;

/// A failed `MapOpen`, `MapRelease` or `Manifest`, naming the share-relative path
/// (`share/dir/file`) of its file.
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    /// The path cannot be used (see [`ShareError`]).
    #[error(transparent)]
    Share(#[from] ShareError),
    /// The path names something else than a regular file (see [`FsError`]).
    #[error(transparent)]
    Fs(#[from] FsError),
    /// The file's manifest could not be taken.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// A handle the connection does not hold.
    #[error("no mapped file {handle}")]
    NoSuchMap {
        /// The handle.
        handle: u64,
    },
    /// The file needs more than [`MAX_MAP_REGIONS`] windows.
    #[error("{path}: too large to map ({size} bytes; at most {max} bytes)")]
    TooLarge {
        /// The file.
        path: String,
        /// Its size.
        size: u64,
        /// The largest size that can be mapped.
        max: u64,
    },
    /// Mapping the file would exceed the server's budget of mapped bytes.
    #[error(
        "{path}: the server has {in_use} of its {max} mapped bytes in use; mapping {size} \
         more would exceed its --max-mapped-bytes"
    )]
    OverBudget {
        /// The file.
        path: String,
        /// Its size.
        size: u64,
        /// Bytes mapped now, over every connection.
        in_use: u64,
        /// The budget.
        max: u64,
    },
    /// Registering a window or the manifest failed.
    #[error("{path}: cannot register the mapped file")]
    Register {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: TransportError,
    },
    /// Allocating the buffer of the manifest's hashes failed.
    #[error("{path}: cannot allocate the manifest region")]
    AllocateManifest {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `stat` or `fstat` of the file failed.
    #[error("{0}: cannot stat")]
    Stat(String, #[source] std::io::Error),
    /// Opening the file failed.
    #[error("{0}: cannot open")]
    Open(String, #[source] std::io::Error),
    /// Mapping a window of the file failed.
    #[error("{0}: cannot map")]
    Map(String, #[source] std::io::Error),
}

/// The chunk size a mapped file's manifest is taken with for a request of `requested`
/// bytes: clamped into `MIN_CHUNK_BYTES..=MAX_CHUNK_BYTES`, then rounded up to a power
/// of two (both bounds are powers of two, so the result stays within them).
pub fn clamp_chunk_bytes(requested: u32) -> u32 {
    requested
        .clamp(MIN_CHUNK_BYTES, MAX_CHUNK_BYTES)
        .next_power_of_two()
}

/// The chunk size a mapped file of `size` bytes is hashed with, for a request of
/// `requested`: [`clamp_chunk_bytes`], then doubled while the manifest would exceed
/// [`MAX_MANIFEST_CHUNKS`] (never beyond `MAX_CHUNK_BYTES`).
pub fn chunk_bytes_for(requested: u32, size: u64) -> u32 {
    let mut chunk = clamp_chunk_bytes(requested);
    while chunk < MAX_CHUNK_BYTES && chunk_count(size, chunk) > MAX_MANIFEST_CHUNKS {
        chunk *= 2;
    }
    chunk
}

/// The server-wide budget of registered mapped-file bytes, and the counters of open
/// mapped files and their bytes.
///
/// Invariant: `bytes` is the sum of the sizes of the live [`BudgetLease`]s, never more
/// than `max_bytes`; `files` is their number.
#[derive(Debug)]
pub struct MapBudget {
    max_bytes: u64,
    bytes: AtomicU64,
    files: AtomicU64,
}

/// A reservation of mapped bytes and one mapped-file slot; returned on drop.
#[derive(Debug)]
pub struct BudgetLease {
    budget: Arc<MapBudget>,
    bytes: u64,
}

impl MapBudget {
    /// A budget of `max_bytes` registered file bytes.
    pub fn new(max_bytes: u64) -> Arc<MapBudget> {
        Arc::new(MapBudget {
            max_bytes,
            bytes: AtomicU64::new(0),
            files: AtomicU64::new(0),
        })
    }

    /// Reserves `bytes` for one mapped file, or `None` if that would exceed the budget.
    pub fn reserve(self: &Arc<Self>, bytes: u64) -> Option<BudgetLease> {
        self.bytes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |used| {
                used.checked_add(bytes).filter(|&n| n <= self.max_bytes)
            })
            .ok()?;
        self.files.fetch_add(1, Ordering::SeqCst);
        Some(BudgetLease {
            budget: self.clone(),
            bytes,
        })
    }

    /// File bytes reserved now.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::SeqCst)
    }

    /// Mapped files open now.
    pub fn files(&self) -> u64 {
        self.files.load(Ordering::SeqCst)
    }

    /// The budget.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }
}

impl Drop for BudgetLease {
    fn drop(&mut self) {
        self.budget.files.fetch_sub(1, Ordering::SeqCst);
        self.budget.bytes.fetch_sub(self.bytes, Ordering::SeqCst);
    }
}

/// The handle a mapped file being opened will have, as the session granted it.
#[derive(Debug)]
pub struct MapSlot {
    handle: u64,
}

/// One open mapped file of a connection.
///
/// Field order is drop order: the registrations are revoked first, then the budget
/// and the connection's slot are given back.
pub struct MappedEntry {
    _regions: Vec<Registration>,
    _manifest: Option<Registration>,
    /// The regions and the manifest, in the server's registration gauge.
    _registered: Held,
    _lease: BudgetLease,
    slot: MapSlot,
}

impl MappedEntry {
    /// The handle the client names this file by.
    pub fn handle(&self) -> u64 {
        self.slot.handle
    }
}

/// A connection's open mapped files, by the handles its session granted.
#[derive(Default)]
pub struct MapTable {
    entries: Mutex<HashMap<u64, MappedEntry>>,
}

impl MapTable {
    /// An empty table.
    pub fn new() -> MapTable {
        MapTable::default()
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<u64, MappedEntry>> {
        // Every critical section is one map operation: poisoning carries nothing.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The slot of a file to open under `handle`, granted by the session's tables.
    pub fn slot(&self, handle: u64) -> MapSlot {
        MapSlot { handle }
    }

    /// Adds an opened file under its slot's handle.
    pub fn insert(&self, entry: MappedEntry) {
        self.entries().insert(entry.handle(), entry);
    }

    /// Removes the file `handle` and returns it (dropping it revokes its
    /// registrations); an unknown handle is [`MapError::NoSuchMap`].
    pub fn remove(&self, handle: u64) -> Result<MappedEntry, MapError> {
        self.entries()
            .remove(&handle)
            .ok_or(MapError::NoSuchMap { handle })
    }

    /// Removes every entry (dropping them revokes their registrations).
    pub fn take_all(&self) -> Vec<MappedEntry> {
        self.entries().drain().map(|(_, e)| e).collect()
    }
}

/// What a `MapOpen` needs from the server.
pub struct MapContext<'a> {
    /// The connection's transport, which registers the memory.
    pub transport: &'a SharedTransport,
    /// The server-wide manifest cache.
    pub cache: &'a ManifestCache,
    /// The server-wide budget of mapped bytes.
    pub budget: &'a Arc<MapBudget>,
    /// The server-wide count of registrations.
    pub registrations: &'a Gauge,
}

fn register_error(what: &str) -> impl FnOnce(TransportError) -> MapError + '_ {
    move |source| MapError::Register {
        path: what.into(),
        source,
    }
}

/// Opens `rel` read-only, takes its manifest, maps and registers it. Blocking (hashing
/// and registration take time). Returns the entry to keep and the response to send.
///
/// Errors: path errors as for any request (symlinks followed inside the share only);
/// [`FsError::IsADirectory`] for a directory, [`FsError::NotRegular`] for another
/// non-regular file; [`MapError::OverBudget`] over the byte budget;
/// [`ManifestError::KeepsChanging`] if the file changed while it was hashed.
pub fn open(
    share: &Share,
    rel: &str,
    requested_chunk_bytes: u32,
    ctx: &MapContext<'_>,
    slot: MapSlot,
    hashing: Hashing,
) -> Result<(MappedEntry, MappedFile), MapError> {
    let what = share.display(rel);
    let (file, first) = open_regular(share, rel, &what)?;
    check_region_count(first.size(), &what)?;
    let mut lease = reserve(ctx.budget, first.size(), &what)?;
    let chunk_bytes = chunk_bytes_for(requested_chunk_bytes, first.size());
    let (manifest, meta) = manifest_of(
        &file,
        chunk_bytes,
        hashing.accept,
        hashing.fresh,
        &what,
        ctx.cache,
        Some(&**share.store()),
        CACHE_SETTLE,
    )?;
    let size = meta.size();
    if size != first.size() {
        check_region_count(size, &what)?;
        drop(lease);
        lease = reserve(ctx.budget, size, &what)?;
    }
    let regions = register_windows(&file, size, ctx.transport, &what)?;
    let Hashes { algorithm, hashes } = manifest;
    let manifest = if hashes.is_empty() {
        None
    } else {
        Some(register_manifest(&hashes, ctx.transport, &what)?)
    };
    let registered = ctx
        .registrations
        .hold(regions.len() as u64 + u64::from(manifest.is_some()));
    let attr = attr_of(&meta, None);
    let version = FileVersion {
        size,
        mtime: attr.mtime,
        ctime: attr.ctime,
        ino: meta.ino(),
        chunk_bytes,
        manifest: manifest_id(algorithm, size, chunk_bytes, &hashes),
        algorithm,
    };
    let response = MappedFile {
        handle: slot.handle,
        attr,
        version,
        window_bytes: MAP_WINDOW_BYTES,
        regions: regions.iter().map(Registration::desc).collect(),
        manifest: manifest.as_ref().map(Registration::desc),
    };
    tracing::debug!(file = %what, size, chunk_bytes, handle = slot.handle, "mapped");
    let entry = MappedEntry {
        _regions: regions,
        _manifest: manifest,
        _registered: registered,
        _lease: lease,
        slot,
    };
    Ok((entry, response))
}

/// `Manifest`: one page of the chunk manifest of the regular file `rel` (symlinks
/// followed within the share), hashes of chunks `first_chunk..` (at most
/// [`MAX_MANIFEST_PAGE_CHUNKS`]), with the version they belong to. Blocking.
///
/// The hashes come from `cache` when the file's [`crate::filekey::ManifestKey`] is
/// there, so paging through a settled file hashes it once; a file that changes between
/// pages yields pages of different versions, which the client detects.
pub fn manifest_page(
    share: &Share,
    rel: &str,
    requested_chunk_bytes: u32,
    first_chunk: u64,
    cache: &ManifestCache,
    hashing: Hashing,
) -> Result<Response, MapError> {
    let what = share.display(rel);
    let (file, first) = open_regular(share, rel, &what)?;
    let chunk_bytes = chunk_bytes_for(requested_chunk_bytes, first.size());
    let (manifest, meta) = manifest_of(
        &file,
        chunk_bytes,
        hashing.accept,
        hashing.fresh,
        &what,
        cache,
        Some(&**share.store()),
        CACHE_SETTLE,
    )?;
    let Hashes { algorithm, hashes } = manifest;
    let attr = attr_of(&meta, None);
    let version = FileVersion {
        size: meta.size(),
        mtime: attr.mtime,
        ctime: attr.ctime,
        ino: meta.ino(),
        chunk_bytes,
        manifest: manifest_id(algorithm, meta.size(), chunk_bytes, &hashes),
        algorithm,
    };
    let start = usize::try_from(first_chunk)
        .unwrap_or(usize::MAX)
        .min(hashes.len());
    let end = start
        .saturating_add(MAX_MANIFEST_PAGE_CHUNKS)
        .min(hashes.len());
    Ok(Response::Manifest {
        version,
        first_chunk,
        hashes: hashes[start..end].to_vec(),
    })
}

/// Opens the share file `rel` (`what` names it in errors) read-only, symlinks followed
/// inside the share; refuses anything but a regular file. Returns the file and its
/// metadata as opened.
pub(crate) fn open_regular(
    share: &Share,
    rel: &str,
    what: &str,
) -> Result<(std::fs::File, std::fs::Metadata), MapError> {
    let path = share.resolve(rel, true)?;
    open_regular_at(&path, what)
}

/// [`open_regular`] of `path`, which [`Share::resolve`] with follow gave. Blocking.
pub(crate) fn open_regular_at(
    path: &std::path::Path,
    what: &str,
) -> Result<(std::fs::File, std::fs::Metadata), MapError> {
    // Checked before opening too: opening a socket fails with an obscure error.
    check_regular(
        &std::fs::metadata(path).map_err(|e| MapError::Stat(what.into(), e))?,
        what,
    )?;
    // O_NONBLOCK: a FIFO put there since the check must not block the open; the
    // check on the open file refuses it.
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| MapError::Open(what.into(), e))?;
    let meta = file
        .metadata()
        .map_err(|e| MapError::Stat(what.into(), e))?;
    check_regular(&meta, what)?;
    Ok((file, meta))
}

fn check_region_count(size: u64, what: &str) -> Result<(), MapError> {
    if size.div_ceil(MAP_WINDOW_BYTES) > MAX_MAP_REGIONS as u64 {
        return Err(MapError::TooLarge {
            path: what.into(),
            size,
            max: MAX_MAP_REGIONS as u64 * MAP_WINDOW_BYTES,
        });
    }
    Ok(())
}

fn reserve(budget: &Arc<MapBudget>, size: u64, what: &str) -> Result<BudgetLease, MapError> {
    budget.reserve(size).ok_or_else(|| MapError::OverBudget {
        path: what.into(),
        size,
        in_use: budget.bytes(),
        max: budget.max_bytes(),
    })
}

/// Maps and registers `size` bytes of `file` as windows of [`MAP_WINDOW_BYTES`].
fn register_windows(
    file: &File,
    size: u64,
    transport: &SharedTransport,
    what: &str,
) -> Result<Vec<Registration>, MapError> {
    let mut regions = Vec::new();
    let mut offset = 0;
    while offset < size {
        // At most MAP_WINDOW_BYTES (256 MiB): fits a usize.
        let len = (size - offset).min(MAP_WINDOW_BYTES) as usize;
        let window =
            FileWindow::map_lazy(file, offset, len).map_err(|e| MapError::Map(what.into(), e))?;
        let reg = transport
            .register(Memory::File(window), Access::RemoteRead)
            .map_err(register_error(what))?;
        regions.push(reg);
        offset += len as u64;
    }
    Ok(regions)
}

/// Copies the hashes into an anonymous buffer and registers it read-only.
fn register_manifest(
    hashes: &[Hash256],
    transport: &SharedTransport,
    what: &str,
) -> Result<Registration, MapError> {
    let buf = Buffer::new(hashes.len() * 32).map_err(|source| MapError::AllocateManifest {
        path: what.into(),
        source,
    })?;
    {
        let mut bytes = buf.blocking_write();
        for (dst, h) in bytes.chunks_exact_mut(32).zip(hashes) {
            dst.copy_from_slice(h);
        }
    }
    transport
        .register(Memory::Buffer(buf), Access::RemoteRead)
        .map_err(register_error(what))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_sizes_are_clamped_and_rounded() {
        assert_eq!(clamp_chunk_bytes(0), MIN_CHUNK_BYTES);
        assert_eq!(clamp_chunk_bytes(1), MIN_CHUNK_BYTES);
        assert_eq!(clamp_chunk_bytes(MIN_CHUNK_BYTES), MIN_CHUNK_BYTES);
        assert_eq!(clamp_chunk_bytes(MIN_CHUNK_BYTES + 1), 2 * MIN_CHUNK_BYTES);
        assert_eq!(clamp_chunk_bytes(1 << 20), 1 << 20);
        assert_eq!(clamp_chunk_bytes((1 << 20) - 1), 1 << 20);
        assert_eq!(clamp_chunk_bytes(3 << 20), 4 << 20);
        assert_eq!(clamp_chunk_bytes(MAX_CHUNK_BYTES), MAX_CHUNK_BYTES);
        assert_eq!(clamp_chunk_bytes(MAX_CHUNK_BYTES + 1), MAX_CHUNK_BYTES);
        assert_eq!(clamp_chunk_bytes(u32::MAX), MAX_CHUNK_BYTES);
    }

    #[test]
    fn huge_files_get_bigger_chunks() {
        let max_at = |chunk: u32| MAX_MANIFEST_CHUNKS * u64::from(chunk);
        assert_eq!(chunk_bytes_for(4096, 0), 4096);
        assert_eq!(chunk_bytes_for(4096, max_at(4096)), 4096);
        assert_eq!(chunk_bytes_for(4096, max_at(4096) + 1), 8192);
        assert_eq!(chunk_bytes_for(5000, 64 << 30), 64 << 10);
        assert_eq!(chunk_bytes_for(1 << 20, 64 << 30), 1 << 20);
        // Bounded by the largest chunk size even where the manifest stays large.
        assert_eq!(chunk_bytes_for(4096, u64::MAX), MAX_CHUNK_BYTES);
        for size in [1u64, 1 << 30, 1 << 40, 3 << 41] {
            let chunk = chunk_bytes_for(4096, size);
            assert!(chunk.is_power_of_two());
            assert!(chunk_count(size, chunk) <= MAX_MANIFEST_CHUNKS);
        }
    }

    #[test]
    fn the_budget_bounds_bytes_and_counts_files() {
        let b = MapBudget::new(100);
        let one = b.reserve(60).unwrap();
        assert!(b.reserve(41).is_none());
        let empty = b.reserve(0).unwrap();
        let two = b.reserve(40).unwrap();
        assert_eq!((b.bytes(), b.files()), (100, 3));
        assert!(b.reserve(1).is_none());
        drop(one);
        assert_eq!((b.bytes(), b.files()), (40, 2));
        assert!(b.reserve(u64::MAX).is_none());
        drop((empty, two));
        assert_eq!((b.bytes(), b.files()), (0, 0));
    }

    #[test]
    fn an_unknown_handle_is_refused() {
        let t = MapTable::new();
        assert!(matches!(
            t.remove(12345),
            Err(MapError::NoSuchMap { handle: 12345 })
        ));
    }
}
