//! `Verify`: re-reads a stored file from the disk, hashes every chunk, and compares the
//! hashes with the file's record in the share's manifest store ([`crate::store`]).
//!
//! The record is looked up by inode, so the answer tells apart (see
//! [`VerifyRecord`]): no record at all (unverifiable); a record of exactly this file
//! version, where any difference is damage nothing on this machine asked for (bit rot,
//! a failing disk), since ctime, which no user can set back, says the file was not
//! written; and a record the file's status changed after (it was modified, or had its
//! attributes changed, after it was recorded).
//!
//! Caches are bypassed: neither the manifest cache nor the store's hashes are taken as
//! the file's, and the file's clean pages are dropped from the page cache
//! (`POSIX_FADV_DONTNEED`) before it is read, so the bytes come from the disk (pages
//! someone holds dirty stay, and are what the disk is about to hold).
//!
//! A file without a record, or whose record is stale while its bytes match it, gets a
//! record of what was read now when it has settled ([`crate::manifests::CACHE_SETTLE`]):
//! the next `Verify` has something to compare with. A file whose bytes differ from a
//! record keeps that record, so the damage stays visible.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::time::SystemTime;

use ferry_common::msg::{
    ErrorKind, RemoteError, Response, Sha256, VerifyRecord, VerifyReport, MAX_VERIFY_BAD_CHUNKS,
};

use crate::error::{io_error, remote};
use crate::manifests::{hash_chunks_of, settled, ManifestKey, CACHE_SETTLE};
use crate::share::Share;
use crate::store::ManifestStore;

/// `Verify` of the regular file `rel` (its final component not followed). Blocking:
/// reads the whole file, hashing on all cores.
///
/// Errors: path errors as for any request; [`ErrorKind::InvalidPath`] for a symlink
/// or another non-regular file, [`ErrorKind::IsADirectory`] for a directory;
/// [`ErrorKind::Changed`] if the file changed while it was read.
pub fn verify(share: &Share, rel: &str) -> Result<Response, RemoteError> {
    let what = share.display(rel);
    let path = share.resolve(rel, false)?;
    // O_NOFOLLOW: a symlink fails to open (ELOOP) rather than being followed;
    // O_NONBLOCK: a FIFO does not block the open (it is refused below).
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(&path)
        .map_err(|e| match e.raw_os_error() {
            Some(nix::libc::ELOOP) => remote(
                ErrorKind::InvalidPath,
                format!("{what}: is a symlink; only regular files are verified"),
            ),
            _ => io_error("open", &what, &e),
        })?;
    let before = file.metadata().map_err(|e| io_error("stat", &what, &e))?;
    if before.is_dir() {
        return Err(remote(
            ErrorKind::IsADirectory,
            format!("{what}: is a directory"),
        ));
    }
    if !before.is_file() {
        return Err(remote(
            ErrorKind::InvalidPath,
            format!("{what}: not a regular file"),
        ));
    }
    let Some(store) = share.store() else {
        // A read-only share keeps no records: nothing to compare with.
        return Ok(Response::Verified(VerifyReport {
            record: VerifyRecord::Missing,
            size: before.size(),
            chunk_bytes: 0,
            chunks: 0,
            bad_count: 0,
            bad_chunks: Vec::new(),
        }));
    };
    let record = store.load(before.dev(), before.ino());
    let chunk_bytes = record
        .as_ref()
        .map_or(store.chunk_bytes(), |r| r.key.chunk_bytes);
    drop_cached_pages(&file, &what);
    let started = SystemTime::now();
    let read = read_hashes(&file, before.size(), chunk_bytes, &what)?;
    let after = file.metadata().map_err(|e| io_error("stat", &what, &e))?;
    let key = ManifestKey::of(&before, chunk_bytes);
    if ManifestKey::of(&after, chunk_bytes) != key {
        return Err(remote(
            ErrorKind::Changed,
            format!("{what}: changed while it was being verified"),
        ));
    }
    let chunks = read.len() as u64;
    let Some(record) = record else {
        remember(store, &key, &read, started, &what);
        return Ok(Response::Verified(VerifyReport {
            record: VerifyRecord::Missing,
            size: key.size,
            chunk_bytes,
            chunks,
            bad_count: 0,
            bad_chunks: Vec::new(),
        }));
    };
    let state = if record.key == key {
        VerifyRecord::Current
    } else {
        VerifyRecord::Stale {
            size_changed: record.key.size != key.size,
            mtime_changed: record.key.mtime_ns != key.mtime_ns,
        }
    };
    let longest = read.len().max(record.hashes.len());
    let bad = (0..longest).filter(|&i| match (read.get(i), record.hashes.get(i)) {
        (Some(Some(now)), Some(then)) => now != then,
        _ => true,
    });
    let (mut bad_count, mut bad_chunks) = (0u64, Vec::new());
    for i in bad {
        bad_count += 1;
        if bad_chunks.len() < MAX_VERIFY_BAD_CHUNKS {
            bad_chunks.push(i as u64);
        }
    }
    if bad_count > 0 {
        tracing::warn!(file = %what, bad_chunks = bad_count, record = ?state, "verify found chunks that differ from the record");
    } else if state != VerifyRecord::Current {
        // Same bytes, only the status changed (e.g. a chmod): the record follows.
        remember(store, &key, &read, started, &what);
    }
    Ok(Response::Verified(VerifyReport {
        record: state,
        size: key.size,
        chunk_bytes,
        chunks,
        bad_count,
        bad_chunks,
    }))
}

/// Hashes of every chunk of the first `size` bytes of `file`, read with `pread` on all
/// cores; `None` for a chunk that could not be read (an I/O error: damage, as far as
/// the caller is concerned). A short read fails with [`ErrorKind::Changed`].
fn read_hashes(
    file: &File,
    size: u64,
    chunk_bytes: u32,
    what: &str,
) -> Result<Vec<Option<Sha256>>, RemoteError> {
    hash_chunks_of(file, size, chunk_bytes, what, |e| {
        tracing::warn!(file = %what, "verify cannot read a chunk: {e}");
        Ok(None)
    })
}

/// Asks the kernel to drop the clean cached pages of `file`, so the next reads come
/// from the disk. Advisory: a failure is logged and the file read anyway.
fn drop_cached_pages(file: &File, what: &str) {
    if let Err(e) = nix::fcntl::posix_fadvise(
        file.as_raw_fd(),
        0,
        0,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    ) {
        tracing::debug!(file = %what, "cannot drop cached pages before verifying: {e}");
    }
}

/// Records what was read as the manifest of version `key`, if every chunk was read
/// and the file had settled before reading began.
fn remember(
    store: &ManifestStore,
    key: &ManifestKey,
    read: &[Option<Sha256>],
    started: SystemTime,
    what: &str,
) {
    if !settled(key, started, CACHE_SETTLE) {
        return;
    }
    let Some(hashes) = read.iter().copied().collect::<Option<Vec<Sha256>>>() else {
        return;
    };
    match store.save(key, &hashes) {
        Ok(()) => tracing::debug!(file = %what, "manifest recorded by verify"),
        Err(e) => tracing::debug!(file = %what, "cannot record the manifest: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::share::test_share;
    use ferry_common::chunk::hash_chunk;
    use std::io::Write;

    /// The store key of `meta` in the store's chunk size.
    fn key_of(meta: &std::fs::Metadata, store: &ManifestStore) -> ManifestKey {
        ManifestKey::of(meta, store.chunk_bytes())
    }

    fn share(dir: &std::path::Path) -> Share {
        test_share("s", dir, false)
    }

    fn report(r: Response) -> VerifyReport {
        match r {
            Response::Verified(v) => v,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn same_key_with_other_bytes_is_damage_and_a_status_change_is_stale() {
        let dir = tempfile::tempdir().unwrap();
        let s = share(dir.path());
        let data: Vec<u8> = (0..(2 << 20) + 100u32).map(|i| (i % 253) as u8).collect();
        std::fs::File::create(dir.path().join("f"))
            .unwrap()
            .write_all(&data)
            .unwrap();
        let store = s.store().unwrap();
        let meta = std::fs::metadata(dir.path().join("f")).unwrap();
        let key = key_of(&meta, store);
        let mut hashes: Vec<Sha256> = data
            .chunks(store.chunk_bytes() as usize)
            .map(hash_chunk)
            .collect();
        store.save(&key, &hashes).unwrap();
        let clean = report(verify(&s, "f").unwrap());
        assert_eq!(clean.record, VerifyRecord::Current);
        assert_eq!((clean.chunks, clean.bad_count), (3, 0));
        // A record of this very version that the bytes no longer match: what bit rot
        // below the filesystem looks like (the record is forged, the file kept).
        hashes[1][0] ^= 1;
        store.save(&key, &hashes).unwrap();
        let damaged = report(verify(&s, "f").unwrap());
        assert_eq!(damaged.record, VerifyRecord::Current);
        assert_eq!((damaged.bad_count, damaged.bad_chunks), (1, vec![1]));
        // The damaged record is kept: verifying again still says so.
        assert_eq!(report(verify(&s, "f").unwrap()).bad_chunks, vec![1]);
        // A status change (chmod sets ctime) with the same bytes: stale, all chunks
        // compared, the one forged chunk still differs.
        hashes[1][0] ^= 1;
        store.save(&key, &hashes).unwrap();
        let f = std::fs::File::open(dir.path().join("f")).unwrap();
        f.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        let stale = report(verify(&s, "f").unwrap());
        assert_eq!(
            stale.record,
            VerifyRecord::Stale {
                size_changed: false,
                mtime_changed: false
            }
        );
        assert_eq!(stale.bad_count, 0);
    }

    #[test]
    fn no_record_is_missing_and_non_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let s = share(dir.path());
        std::fs::write(dir.path().join("f"), b"hand-made").unwrap();
        std::fs::create_dir(dir.path().join("d")).unwrap();
        std::os::unix::fs::symlink("f", dir.path().join("l")).unwrap();
        let r = report(verify(&s, "f").unwrap());
        assert_eq!(
            (r.record, r.bad_count, r.chunks),
            (VerifyRecord::Missing, 0, 1)
        );
        assert_eq!(verify(&s, "d").unwrap_err().kind, ErrorKind::IsADirectory);
        assert_eq!(verify(&s, "l").unwrap_err().kind, ErrorKind::InvalidPath);
        assert_eq!(
            verify(&s, ".ferry-state").unwrap_err().kind,
            ErrorKind::InvalidPath
        );
        assert_eq!(verify(&s, "nope").unwrap_err().kind, ErrorKind::NotFound);
    }
}
