//! Chunk manifests of mapped files: hashing a file with `pread`, and the server-wide
//! cache that spares a second open of an unchanged file the hashing.
//!
//! **Hashing reads with `pread(2)`, never through a mapping**: a file truncated by
//! someone else while the server touched its mapping would raise SIGBUS and kill the
//! whole server. A short read means the file shrank while it was hashed.
//!
//! **Cache key**: a file's [`crate::filekey::ManifestKey`] and the algorithm of the
//! hashes, cached only once the file has settled (see [`crate::filekey`]).
//!
//! **Which hashes a reader gets** ([`manifest_of`]): those recorded when the file was
//! written, whenever the share's store holds a valid record of its version in an
//! algorithm the reader accepts — never hashes taken again from the bytes on disk, which
//! would bless whatever rotted there since. Only a file with no such record is hashed,
//! and those hashes are cached (and stored) only when the store holds no record of that
//! version at all, so the cache never shadows a record.
//!
//! Below the cache, a writable share's persistent store ([`crate::store`]) keeps the
//! manifests of settled files across restarts, under the same key.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, Metadata};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use ferry_common::chunk::{chunk_count, chunk_len, hash_chunk};
use ferry_common::msg::{Hash256, HashAlgorithm};
use ferry_common::proto::caps::Algorithms;
use rayon::prelude::*;

use crate::filekey::{same_version, settled, ManifestKey};
use crate::store::ManifestStore;

/// Bytes of chunk hashes (plus [`ENTRY_OVERHEAD_BYTES`] per entry) the server-wide
/// cache holds at most; the least recently used entries are evicted beyond it.
pub const MANIFEST_CACHE_BYTES: usize = 64 << 20;

/// Bookkeeping charged per cached entry on top of its hashes (key, map slots, `Arc`
/// header), so that many tiny files cannot grow the cache without bound.
pub const ENTRY_OVERHEAD_BYTES: usize = 128;

/// A manifest that could not be taken, naming the share-relative path of its file.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// `fstat` of the file failed.
    #[error("{0}: cannot stat")]
    Stat(String, #[source] std::io::Error),
    /// Reading a chunk failed.
    #[error("{0}: cannot read")]
    Read(String, #[source] std::io::Error),
    /// A chunk read came back short: the file shrank.
    #[error("{path}: the file shrank while it was being read")]
    Shrank {
        /// The file.
        path: String,
    },
    /// A chunk of the file no longer matches the hash recorded when it was written,
    /// the file's version unchanged: damage on the server's disk.
    #[error("{path}: bytes {start}..{end} do not match the hash recorded when the file was written: the server's copy is damaged")]
    Rot {
        /// The file.
        path: String,
        /// The damaged record chunk's first byte.
        start: u64,
        /// The offset past its last byte.
        end: u64,
    },
    /// The file changed during each of the hashings tried.
    #[error("{path}: the file keeps changing while it is being hashed")]
    KeepsChanging {
        /// The file.
        path: String,
    },
}

/// What ferryd logs, at error level with the file, chunk, bytes and algorithm, when
/// bytes it read no longer match the hash recorded when the file was written.
pub(crate) const ROT_LOG: &str = "integrity error: the file's bytes on disk no longer match the hash recorded when it was written (unchanged size, mtime and ctime: damage underneath the file system)";

/// Bytes an entry of `chunks` hashes is charged in the cache.
pub fn entry_cost(chunks: usize) -> usize {
    chunks * 32 + ENTRY_OVERHEAD_BYTES
}

/// What the cache is keyed by: a file version and the algorithm of its hashes.
pub type CacheKey = (ManifestKey, HashAlgorithm);

/// A file's chunk hashes and their algorithm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hashes {
    /// The algorithm of `hashes`.
    pub algorithm: HashAlgorithm,
    /// One hash per chunk, in file order.
    pub hashes: Arc<[Hash256]>,
}

struct Slot {
    hashes: Arc<[Hash256]>,
    /// Position in `Lru::order`.
    stamp: u64,
}

/// Invariants: `order` holds exactly one stamp per key of `map` (its slot's stamp);
/// `inodes` lists, under each `(dev, ino)`, exactly the keys of `map` of that inode;
/// `bytes` is the sum of [`entry_cost`] over `map`, and at most the capacity.
struct Lru {
    map: HashMap<CacheKey, Slot>,
    order: BTreeMap<u64, CacheKey>,
    inodes: HashMap<(u64, u64), Vec<CacheKey>>,
    next_stamp: u64,
    bytes: usize,
}

impl Lru {
    /// Drops `key` (just removed from `map`) from its inode's list.
    fn unindex(&mut self, key: &CacheKey) {
        let inode = (key.0.dev, key.0.ino);
        if let Some(keys) = self.inodes.get_mut(&inode) {
            keys.retain(|k| k != key);
            if keys.is_empty() {
                self.inodes.remove(&inode);
            }
        }
    }
}

/// A least-recently-used cache of chunk manifests, bounded by bytes, shared by every
/// connection of a server.
pub struct ManifestCache {
    capacity_bytes: usize,
    inner: Mutex<Lru>,
}

impl ManifestCache {
    /// An empty cache holding at most `capacity_bytes` (see [`entry_cost`]).
    pub fn new(capacity_bytes: usize) -> ManifestCache {
        ManifestCache {
            capacity_bytes,
            inner: Mutex::new(Lru {
                map: HashMap::new(),
                order: BTreeMap::new(),
                inodes: HashMap::new(),
                next_stamp: 0,
                bytes: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lru> {
        // Each critical section restores the invariants before it can panic (only
        // allocation could), so a poisoned lock still guards consistent state.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The hashes cached under `key`, marking them most recently used.
    pub fn get(&self, key: &CacheKey) -> Option<Arc<[Hash256]>> {
        let mut lru = self.lock();
        let stamp = lru.next_stamp;
        let slot = lru.map.get_mut(key)?;
        let old = std::mem::replace(&mut slot.stamp, stamp);
        let hashes = slot.hashes.clone();
        lru.order.remove(&old);
        lru.order.insert(stamp, *key);
        lru.next_stamp += 1;
        Some(hashes)
    }

    /// Caches `hashes` under `key` as most recently used, evicting the least recently
    /// used entries until the cache fits. A manifest larger than the whole cache is not
    /// cached.
    pub fn insert(&self, key: CacheKey, hashes: Arc<[Hash256]>) {
        let cost = entry_cost(hashes.len());
        if cost > self.capacity_bytes {
            return;
        }
        let mut lru = self.lock();
        if let Some(old) = lru.map.remove(&key) {
            lru.order.remove(&old.stamp);
            lru.bytes -= entry_cost(old.hashes.len());
            lru.unindex(&key);
        }
        while lru.bytes + cost > self.capacity_bytes {
            let Some((_, victim)) = lru.order.pop_first() else {
                break;
            };
            if let Some(gone) = lru.map.remove(&victim) {
                lru.bytes -= entry_cost(gone.hashes.len());
                lru.unindex(&victim);
            }
        }
        let stamp = lru.next_stamp;
        lru.next_stamp += 1;
        lru.order.insert(stamp, key);
        lru.map.insert(key, Slot { hashes, stamp });
        lru.inodes
            .entry((key.0.dev, key.0.ino))
            .or_default()
            .push(key);
        lru.bytes += cost;
    }

    /// Forgets every manifest cached of inode `ino` on `dev`, whatever its version: for
    /// a file changed in place by a client, whose key may not have moved (a change
    /// within the same timestamp tick).
    pub fn forget(&self, dev: u64, ino: u64) {
        let mut lru = self.lock();
        for key in lru.inodes.remove(&(dev, ino)).unwrap_or_default() {
            if let Some(gone) = lru.map.remove(&key) {
                lru.order.remove(&gone.stamp);
                lru.bytes -= entry_cost(gone.hashes.len());
            }
        }
    }

    /// Number of cached manifests.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// True if nothing is cached.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes charged for the cached manifests (at most the capacity).
    #[cfg(test)]
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }
}

/// The hash in `algorithm` of every `chunk_bytes` chunk of the first `size` bytes of
/// `file`, read with `pread` on all cores (rayon). Blocking. `what` names the file in
/// errors.
///
/// A short read fails with [`ManifestError::Shrank`]: the file shrank below `size`.
pub fn hash_file(
    file: &File,
    algorithm: HashAlgorithm,
    size: u64,
    chunk_bytes: u32,
    what: &str,
) -> Result<Vec<Hash256>, ManifestError> {
    hash_chunks_of(file, algorithm, size, chunk_bytes, what, |e| {
        Err(ManifestError::Read(what.into(), e))
    })
}

/// [`hash_file`] with the chunks that fail to read (other than by a short read) handed
/// to `unreadable`, whose answer stands for that chunk: `Ok` carries on, `Err` fails
/// the whole call.
pub fn hash_chunks_of<T, F>(
    file: &File,
    algorithm: HashAlgorithm,
    size: u64,
    chunk_bytes: u32,
    what: &str,
    unreadable: F,
) -> Result<Vec<T>, ManifestError>
where
    T: From<Hash256> + Send,
    F: Fn(std::io::Error) -> Result<T, ManifestError> + Sync,
{
    let buf_len = u64::from(chunk_bytes).min(size) as usize;
    (0..chunk_count(size, chunk_bytes))
        .into_par_iter()
        .map_init(
            || vec![0u8; buf_len],
            |buf, index| {
                let len = chunk_len(size, chunk_bytes, index) as usize;
                let offset = index * u64::from(chunk_bytes);
                match file.read_exact_at(&mut buf[..len], offset) {
                    Ok(()) => Ok(T::from(hash_chunk(algorithm, &buf[..len]))),
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                        Err(ManifestError::Shrank { path: what.into() })
                    }
                    Err(e) => unreadable(e),
                }
            },
        )
        .collect()
}

/// A manifest record to check a file's bytes against while hashing them in another
/// chunk size ([`hash_file_checked`]).
pub struct Recorded<'a> {
    /// The record's algorithm.
    pub algorithm: HashAlgorithm,
    /// Its chunk size.
    pub chunk_bytes: u32,
    /// Its hashes.
    pub hashes: &'a [Hash256],
}

/// [`hash_file`] in chunks of `chunk_bytes` (in `algorithm`), checking every byte read
/// against `record`, the hashes recorded when the file was written in another chunk
/// size (and maybe another algorithm), on all cores. Each unit of the larger of the
/// two chunk sizes (both powers of two, so one is a multiple of the other) is read
/// once and hashed both ways: a reader who wants small chunks (the mount's) still gets
/// only bytes that match the record. A mismatch fails with [`ManifestError::Rot`] and
/// is logged. Blocking.
pub fn hash_file_checked(
    file: &File,
    algorithm: HashAlgorithm,
    size: u64,
    chunk_bytes: u32,
    record: &Recorded<'_>,
    what: &str,
) -> Result<Vec<Hash256>, ManifestError> {
    let unit = chunk_bytes.max(record.chunk_bytes);
    if record.hashes.len() as u64 != chunk_count(size, record.chunk_bytes) {
        // Not a record of this size: nothing to check against.
        return hash_file(file, algorithm, size, chunk_bytes, what);
    }
    // Every unit's result is kept, in order, so the failure reported is the first in
    // the file whatever thread finished first (a short-circuiting collect would report
    // any of them).
    let units: Vec<Result<Vec<Hash256>, ManifestError>> = (0..chunk_count(size, unit))
        .into_par_iter()
        .map_init(
            || vec![0u8; u64::from(unit).min(size) as usize],
            |buf, u| {
                let len = chunk_len(size, unit, u) as usize;
                let offset = u * u64::from(unit);
                match file.read_exact_at(&mut buf[..len], offset) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                        return Err(ManifestError::Shrank { path: what.into() })
                    }
                    Err(e) => return Err(ManifestError::Read(what.into(), e)),
                }
                let data = &buf[..len];
                let first = offset / u64::from(record.chunk_bytes);
                for (i, c) in data.chunks(record.chunk_bytes as usize).enumerate() {
                    let index = first + i as u64;
                    if hash_chunk(record.algorithm, c) != record.hashes[index as usize] {
                        let start = index * u64::from(record.chunk_bytes);
                        let end = start + c.len() as u64;
                        tracing::error!(
                            file = %what,
                            chunk = index,
                            bytes = %format!("{start}..{end}"),
                            algorithm = %record.algorithm,
                            "{ROT_LOG}"
                        );
                        return Err(ManifestError::Rot {
                            path: what.into(),
                            start,
                            end,
                        });
                    }
                }
                Ok(data
                    .chunks(chunk_bytes as usize)
                    .map(|c| hash_chunk(algorithm, c))
                    .collect())
            },
        )
        .collect();
    let units = units.into_iter().collect::<Result<Vec<_>, _>>()?;
    Ok(units.concat())
}

/// What the cache and the store know of one file version.
pub(crate) enum Known {
    /// Hashes in an accepted algorithm.
    Accepted(Hashes),
    /// A record in an algorithm the reader does not accept (kept as it is): what the
    /// reader is sent must still be checked against it, hashed both ways.
    OtherAlgorithm(Hashes),
    /// No record of this version.
    Nothing,
}

/// The hashes already known of the file version `key`, without reading the file: from
/// `cache` in an algorithm of `accept`, else the record the share's `store` holds of
/// exactly that version (cached then, if of an accepted algorithm). Blocking.
pub(crate) fn look_up(
    key: &ManifestKey,
    what: &str,
    accept: Algorithms,
    cache: &ManifestCache,
    store: Option<&ManifestStore>,
) -> Known {
    let cached = HashAlgorithm::SUPPORTED
        .iter()
        .filter(|a| accept.contains(**a))
        .find_map(|&algorithm| {
            cache
                .get(&(*key, algorithm))
                .map(|hashes| Hashes { algorithm, hashes })
        });
    if let Some(found) = cached {
        return Known::Accepted(found);
    }
    let Some((algorithm, hashes)) = store.and_then(|s| s.get(key)) else {
        return Known::Nothing;
    };
    let hashes: Arc<[Hash256]> = hashes.into();
    if !accept.contains(algorithm) {
        return Known::OtherAlgorithm(Hashes { algorithm, hashes });
    }
    tracing::debug!(file = %what, bytes = key.size, %algorithm, "manifest from the store");
    cache.insert((*key, algorithm), hashes.clone());
    Known::Accepted(Hashes { algorithm, hashes })
}

/// The manifest of `file` in chunks of `chunk_bytes`, in an algorithm of `accept`, and
/// the metadata it belongs to. Blocking.
///
/// The hashes recorded when the file was written, when the share's `store` holds a
/// valid record of the file's current [`ManifestKey`] in an algorithm of `accept`
/// (from `cache` if they are there); otherwise hashed in `fresh` with [`hash_file`]
/// between two `fstat`s. If the two differ, the file changed while it was hashed: it
/// is hashed once more, and a second change fails with
/// [`ManifestError::KeepsChanging`]. Hashes taken here are cached and stored only if
/// the file had settled (see [`crate::filekey::CACHE_SETTLE`]: its ctime lies at least
/// `settle` before hashing began) and the store holds no record of that version in any
/// algorithm (a record is never replaced by hashes of what is on disk now). Logs at
/// debug whether the manifest came from the store or was hashed.
#[allow(clippy::too_many_arguments)]
pub fn manifest_of(
    file: &File,
    chunk_bytes: u32,
    accept: Algorithms,
    fresh: HashAlgorithm,
    what: &str,
    cache: &ManifestCache,
    store: Option<&ManifestStore>,
    settle: Duration,
) -> Result<(Hashes, Metadata), ManifestError> {
    let stat = || {
        file.metadata()
            .map_err(|e| ManifestError::Stat(what.into(), e))
    };
    let mut before = stat()?;
    for _attempt in 0..2 {
        let key = ManifestKey::of(&before, chunk_bytes);
        // A record of this version in an algorithm the reader does not accept is kept
        // as it is, and the bytes are checked against it as they are hashed; so is a
        // record in the store's own chunk size when another chunk size is asked for.
        let (recorded, check) = match look_up(&key, what, accept, cache, store) {
            Known::Accepted(found) => return Ok((found, before)),
            Known::OtherAlgorithm(record) => (
                true,
                Some((chunk_bytes, (record.algorithm, record.hashes.to_vec()))),
            ),
            Known::Nothing => (
                false,
                store.and_then(|s| {
                    let base = ManifestKey::of(&before, s.chunk_bytes());
                    (s.chunk_bytes() != chunk_bytes)
                        .then(|| s.get(&base).map(|r| (s.chunk_bytes(), r)))
                        .flatten()
                }),
            ),
        };
        let started = SystemTime::now();
        let hashes = match &check {
            None => hash_file(file, fresh, before.size(), chunk_bytes, what)?,
            Some((record_chunk, (algorithm, record))) => {
                let record = Recorded {
                    algorithm: *algorithm,
                    chunk_bytes: *record_chunk,
                    hashes: record,
                };
                hash_file_checked(file, fresh, before.size(), chunk_bytes, &record, what)?
            }
        };
        tracing::debug!(file = %what, bytes = key.size, algorithm = %fresh, "manifest hashed");
        let after = stat()?;
        if same_version(&before, &after) {
            let hashes: Arc<[Hash256]> = hashes.into();
            if !recorded && settled(&key, started, settle) {
                cache.insert((key, fresh), hashes.clone());
                if let Some(store) = store {
                    if let Err(e) = store.save(&key, fresh, &hashes) {
                        tracing::debug!(file = %what, "cannot store the manifest: {e}");
                    }
                }
            }
            return Ok((
                Hashes {
                    algorithm: fresh,
                    hashes,
                },
                after,
            ));
        }
        before = after;
    }
    Err(ManifestError::KeepsChanging { path: what.into() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn key(n: u64) -> ManifestKey {
        ManifestKey {
            dev: 1,
            ino: n,
            size: n * 100,
            mtime_ns: 5,
            ctime_ns: 6,
            chunk_bytes: 4096,
        }
    }

    const B3: HashAlgorithm = HashAlgorithm::Blake3;
    const SHA: HashAlgorithm = HashAlgorithm::Sha256;
    const ALL: Algorithms = Algorithms::ALL;

    fn k(n: u64) -> CacheKey {
        (key(n), B3)
    }

    fn hashes(n: usize, fill: u8) -> Arc<[Hash256]> {
        vec![[fill; 32]; n].into()
    }

    #[test]
    fn hit_and_miss() {
        let c = ManifestCache::new(1 << 20);
        assert!(c.get(&k(1)).is_none());
        c.insert(k(1), hashes(3, 1));
        assert_eq!(c.get(&k(1)).unwrap()[..], hashes(3, 1)[..]);
        assert_eq!(c.bytes(), entry_cost(3));
        // Any field of the key changed is another version.
        for other in [
            ManifestKey {
                mtime_ns: 7,
                ..key(1)
            },
            ManifestKey {
                ctime_ns: 7,
                ..key(1)
            },
            ManifestKey { size: 1, ..key(1) },
            ManifestKey { ino: 9, ..key(1) },
            ManifestKey { dev: 2, ..key(1) },
            ManifestKey {
                chunk_bytes: 8192,
                ..key(1)
            },
        ] {
            assert!(c.get(&(other, B3)).is_none(), "{other:?}");
            assert!(c.get(&(key(1), HashAlgorithm::Sha256)).is_none());
        }
        // Re-inserting replaces and keeps the accounting exact.
        c.insert(k(1), hashes(5, 2));
        assert_eq!(c.len(), 1);
        assert_eq!(c.bytes(), entry_cost(5));
        assert_eq!(c.get(&k(1)).unwrap()[0], [2; 32]);
    }

    #[test]
    fn forget_drops_every_version_of_one_inode_and_keeps_the_accounting() {
        let c = ManifestCache::new(1 << 20);
        let newer = ManifestKey {
            ctime_ns: 99,
            ..key(1)
        };
        c.insert(k(1), hashes(3, 1));
        c.insert((newer, SHA), hashes(3, 2));
        c.insert(k(1), hashes(3, 3));
        c.insert(k(2), hashes(4, 4));
        c.forget(1, 1);
        assert!(c.get(&k(1)).is_none());
        assert!(c.get(&(newer, SHA)).is_none());
        assert_eq!(c.len(), 1);
        assert_eq!(c.bytes(), entry_cost(4));
        assert!(c.get(&k(2)).is_some());
        c.forget(1, 1);
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn least_recently_used_entries_are_evicted_by_bytes() {
        // Room for exactly three entries of 10 hashes.
        let c = ManifestCache::new(3 * entry_cost(10));
        for n in 1..=3 {
            c.insert(k(n), hashes(10, n as u8));
        }
        assert_eq!(c.len(), 3);
        // Touch 1: 2 is now the least recently used.
        assert!(c.get(&k(1)).is_some());
        c.insert(k(4), hashes(10, 4));
        assert!(c.get(&k(2)).is_none());
        assert!(c.get(&k(1)).is_some() && c.get(&k(3)).is_some());
        assert!(c.get(&k(4)).is_some());
        // A big entry evicts as many as it needs.
        c.insert(k(5), hashes(25, 5));
        assert!(c.bytes() <= 3 * entry_cost(10));
        assert!(c.get(&k(5)).is_some());
        assert_eq!(c.len(), 1);
        // One larger than the whole cache is not cached and evicts nothing.
        c.insert(k(6), hashes(100, 6));
        assert!(c.get(&k(6)).is_none());
        assert!(c.get(&k(5)).is_some());
    }

    fn file_with(data: &[u8]) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::File::create(&path)
            .unwrap()
            .write_all(data)
            .unwrap();
        (dir, path)
    }

    #[test]
    fn hash_file_matches_the_chunks() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let (_d, path) = file_with(&data);
        let f = File::open(&path).unwrap();
        let got = hash_file(&f, B3, data.len() as u64, 4096, "t").unwrap();
        let want: Vec<_> = data.chunks(4096).map(|c| hash_chunk(B3, c)).collect();
        assert_eq!(got, want);
        assert!(hash_file(&f, B3, 0, 4096, "t").unwrap().is_empty());
        // Claiming more than the file holds is a short read: the file changed.
        let e = hash_file(&f, B3, 20_000, 4096, "t").unwrap_err();
        assert!(matches!(e, ManifestError::Shrank { .. }), "{e}");
    }

    #[test]
    fn second_open_hits_and_a_change_misses() {
        let (_d, path) = file_with(&[7u8; 9000]);
        let cache = ManifestCache::new(1 << 20);
        let f = File::open(&path).unwrap();
        let (first, meta) =
            manifest_of(&f, 4096, ALL, B3, "t", &cache, None, Duration::ZERO).unwrap();
        assert_eq!((first.hashes.len(), first.algorithm), (3, B3));
        assert_eq!(cache.len(), 1);
        let (second, _) =
            manifest_of(&f, 4096, ALL, B3, "t", &cache, None, Duration::ZERO).unwrap();
        assert!(
            Arc::ptr_eq(&first.hashes, &second.hashes),
            "not served from the cache"
        );

        // An in-place change of the same size: new mtime/ctime, a new manifest.
        let w = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        w.write_all_at(&[8u8; 10], 0).unwrap();
        // Within one timestamp tick of the first write the times could be equal; a
        // distinct mtime makes the change visible whatever the clock's granularity.
        w.set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(1000))
            .unwrap();
        let (third, meta3) =
            manifest_of(&f, 4096, ALL, B3, "t", &cache, None, Duration::ZERO).unwrap();
        assert_eq!(meta3.size(), meta.size());
        assert_ne!(third.hashes[0], first.hashes[0]);
        assert_eq!(third.hashes[1], first.hashes[1]);
        assert_eq!(cache.len(), 2);
    }

    #[test]
    fn the_store_serves_a_fresh_cache_and_is_filled_by_hashing() {
        let (d, path) = file_with(&[3u8; 9000]);
        let store = ManifestStore::new(d.path(), 4096);
        let f = File::open(&path).unwrap();
        let (hashed, meta) = manifest_of(
            &f,
            4096,
            ALL,
            B3,
            "t",
            &ManifestCache::new(1 << 20),
            Some(&store),
            Duration::ZERO,
        )
        .unwrap();
        let key = ManifestKey::of(&meta, 4096);
        assert_eq!(store.get(&key).unwrap(), (B3, hashed.hashes.to_vec()));
        // A record of exactly this key is believed (forged here, to show where the
        // answer came from): a restarted server, with an empty cache, does not hash,
        // and serves a SHA-256 record as SHA-256 to a reader who accepts it.
        let forged = vec![[9u8; 32]; 3];
        store.save(&key, SHA, &forged).unwrap();
        let cache = ManifestCache::new(1 << 20);
        let (got, _) =
            manifest_of(&f, 4096, ALL, B3, "t", &cache, Some(&store), Duration::ZERO).unwrap();
        assert_eq!((got.algorithm, &got.hashes[..]), (SHA, &forged[..]));
        assert_eq!(cache.len(), 1);
        // A reader who accepts only BLAKE3 gets the bytes hashed, each checked against
        // the record (what was written), which is neither replaced nor shadowed in the
        // cache: the forged record fails that check, as rot would...
        let b3_only = Algorithms::of(&[B3]);
        let e = manifest_of(
            &f,
            4096,
            b3_only,
            B3,
            "t",
            &cache,
            Some(&store),
            Duration::ZERO,
        )
        .unwrap_err();
        assert!(matches!(e, ManifestError::Rot { start: 0, .. }), "{e}");
        assert_eq!(store.get(&key).unwrap(), (SHA, forged.clone()));
        assert_eq!(cache.len(), 1);
        // ... and a true SHA-256 record passes it.
        let true_sha: Vec<Hash256> = [&[3u8; 4096][..], &[3u8; 4096][..], &[3u8; 808][..]]
            .iter()
            .map(|c| hash_chunk(SHA, c))
            .collect();
        store.save(&key, SHA, &true_sha).unwrap();
        let (fresh, _) = manifest_of(
            &f,
            4096,
            b3_only,
            B3,
            "t",
            &ManifestCache::new(1 << 20),
            Some(&store),
            Duration::ZERO,
        )
        .unwrap();
        assert_eq!(fresh.algorithm, B3);
        assert_eq!(&fresh.hashes[..], &hashed.hashes[..]);
        assert_eq!(store.get(&key).unwrap(), (SHA, true_sha));
        store.save(&key, SHA, &forged).unwrap();
        // Another chunk size is not in the store: hashed, each byte checked against the
        // record of the store's chunk size as it is read. The forged record fails that
        // check (what damage underneath the file system looks like)...
        let e =
            manifest_of(&f, 8192, ALL, B3, "t", &cache, Some(&store), Duration::ZERO).unwrap_err();
        assert!(
            matches!(
                e,
                ManifestError::Rot {
                    start: 0,
                    end: 4096,
                    ..
                }
            ),
            "{e}"
        );
        // ... and the true one passes it.
        store.save(&key, B3, &hashed.hashes).unwrap();
        let (other, _) =
            manifest_of(&f, 8192, ALL, B3, "t", &cache, Some(&store), Duration::ZERO).unwrap();
        assert_eq!(other.hashes.len(), 2);
        assert_eq!(other.hashes[0], hash_chunk(B3, &[3u8; 8192]));
        // Unsettled files are not stored.
        let (d2, path2) = file_with(&[4u8; 100]);
        let store2 = ManifestStore::new(d2.path(), 4096);
        let f2 = File::open(&path2).unwrap();
        let (_, meta2) = manifest_of(
            &f2,
            4096,
            ALL,
            B3,
            "t",
            &cache,
            Some(&store2),
            Duration::from_secs(3600),
        )
        .unwrap();
        assert!(store2.load(meta2.dev(), meta2.ino()).is_none());
    }

    #[test]
    fn unsettled_files_are_not_cached() {
        let (_d, path) = file_with(&[1u8; 100]);
        let cache = ManifestCache::new(1 << 20);
        let f = File::open(&path).unwrap();
        // Just written: its ctime is within the settle time of now.
        manifest_of(
            &f,
            4096,
            ALL,
            B3,
            "t",
            &cache,
            None,
            Duration::from_secs(3600),
        )
        .unwrap();
        assert!(cache.is_empty());
    }
}
