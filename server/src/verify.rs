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
//! record of what was read now when it has settled ([`crate::filekey::CACHE_SETTLE`]):
//! the next `Verify` has something to compare with. A file whose bytes differ from a
//! record keeps that record, so the damage stays visible.

use std::fs::{File, Metadata, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::time::SystemTime;

use ferry_common::msg::{
    Hash256, HashAlgorithm, Response, VerifyRecord, VerifyReport, MAX_VERIFY_BAD_CHUNKS,
};

use crate::filekey::{settled, ManifestKey, CACHE_SETTLE};
use crate::fsops::{check_regular, FsError};
use crate::manifests::{hash_chunks_of, ManifestError};
use crate::share::{Share, ShareError};
use crate::store::ManifestStore;

/// A file that could not be verified, naming the share-relative path
/// (`share/dir/file`) it is about.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// The path cannot be used (see [`ShareError`]).
    #[error(transparent)]
    Share(#[from] ShareError),
    /// The path names something else than a regular file (see [`FsError`]).
    #[error(transparent)]
    Fs(#[from] FsError),
    /// The file could not be hashed.
    #[error(transparent)]
    Hash(#[from] ManifestError),
    /// The path names a symlink.
    #[error("{path}: is a symlink; only regular files are verified")]
    Symlink {
        /// The path.
        path: String,
    },
    /// The file's key moved while it was read.
    #[error("{path}: changed while it was being verified")]
    Changed {
        /// The path.
        path: String,
    },
    /// Opening the file failed.
    #[error("{0}: cannot open")]
    Open(String, #[source] std::io::Error),
    /// `fstat` of the file failed.
    #[error("{0}: cannot stat")]
    Stat(String, #[source] std::io::Error),
}

/// `Verify` of the regular file `rel` (its final component not followed). Blocking:
/// reads the whole file, hashing on all cores.
///
/// Errors: path errors as for any request; [`VerifyError::Symlink`] for a symlink,
/// [`FsError::NotRegular`] for another non-regular file,
/// [`FsError::IsADirectory`] for a directory; [`VerifyError::Changed`] (or
/// [`ManifestError::Shrank`]) if the file changed while it was read.
pub fn verify(share: &Share, rel: &str) -> Result<Response, VerifyError> {
    let what = share.display(rel);
    let (file, before) = open_regular(share, rel, &what)?;
    // A read-only share's store is read (records saved while it was writable) and
    // never written: there `remember` below fails, logged at debug level.
    let store = share.store();
    let record = store.load(before.dev(), before.ino());
    let chunk_bytes = record
        .as_ref()
        .map_or(store.chunk_bytes(), |r| r.key.chunk_bytes);
    // The record's own algorithm; a file with none is recorded in the share's.
    let algorithm = record
        .as_ref()
        .map_or(share.hash().unwrap_or(HashAlgorithm::SUPPORTED[0]), |r| {
            r.algorithm
        });
    let started = SystemTime::now();
    let (key, read) = read_unchanged(&file, &before, algorithm, chunk_bytes, &what)?;
    let chunks = read.len() as u64;
    let Some(record) = record else {
        remember(store, &key, algorithm, &read, started, &what);
        return Ok(report(
            VerifyRecord::Missing,
            algorithm,
            key.size,
            chunk_bytes,
            chunks,
            (0, Vec::new()),
        ));
    };
    let state = if record.key == key {
        VerifyRecord::Current
    } else {
        VerifyRecord::Stale {
            size_changed: record.key.size != key.size,
            mtime_changed: record.key.mtime_ns != key.mtime_ns,
        }
    };
    let bad = bad_chunks(&read, &record.hashes);
    if bad.0 > 0 {
        tracing::warn!(file = %what, bad_chunks = bad.0, record = ?state, "verify found chunks that differ from the record");
    } else if state != VerifyRecord::Current {
        // Same bytes, only the status changed (e.g. a chmod): the record follows.
        remember(store, &key, algorithm, &read, started, &what);
    }
    Ok(report(state, algorithm, key.size, chunk_bytes, chunks, bad))
}

/// The answer to a `Verify`; `bad` is the count of chunks that differ and the first
/// [`MAX_VERIFY_BAD_CHUNKS`] of them.
fn report(
    record: VerifyRecord,
    algorithm: HashAlgorithm,
    size: u64,
    chunk_bytes: u32,
    chunks: u64,
    (bad_count, bad_chunks): (u64, Vec<u64>),
) -> Response {
    Response::Verified(VerifyReport {
        record,
        algorithm,
        size,
        chunk_bytes,
        chunks,
        bad_count,
        bad_chunks,
    })
}

/// Opens `rel` (`what` in messages) without following a final symlink and without
/// blocking on a FIFO; refuses anything but a regular file. Returns the file and its
/// metadata as opened.
fn open_regular(share: &Share, rel: &str, what: &str) -> Result<(File, Metadata), VerifyError> {
    let path = share.resolve(rel, false)?;
    // O_NOFOLLOW: a symlink fails to open (ELOOP) rather than being followed;
    // O_NONBLOCK: a FIFO does not block the open (it is refused below).
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(&path)
        .map_err(|e| match e.raw_os_error() {
            Some(nix::libc::ELOOP) => VerifyError::Symlink { path: what.into() },
            _ => VerifyError::Open(what.into(), e),
        })?;
    let meta = file
        .metadata()
        .map_err(|e| VerifyError::Stat(what.into(), e))?;
    check_regular(&meta, what)?;
    Ok((file, meta))
}

/// Reads `file` from the disk (its cached pages dropped first) and hashes it in chunks
/// of `chunk_bytes`; fails if its key moved from `before`'s while it was read. Returns
/// the key and the hashes (see [`read_hashes`]).
fn read_unchanged(
    file: &File,
    before: &Metadata,
    algorithm: HashAlgorithm,
    chunk_bytes: u32,
    what: &str,
) -> Result<(ManifestKey, Vec<Option<Hash256>>), VerifyError> {
    drop_cached_pages(file, what);
    let read = read_hashes(file, algorithm, before.size(), chunk_bytes, what)?;
    let after = file
        .metadata()
        .map_err(|e| VerifyError::Stat(what.into(), e))?;
    let key = ManifestKey::of(before, chunk_bytes);
    if ManifestKey::of(&after, chunk_bytes) != key {
        return Err(VerifyError::Changed { path: what.into() });
    }
    Ok((key, read))
}

/// The chunks where `read` differs from `recorded` (one missing on either side, or
/// unreadable, differs): how many, and the first [`MAX_VERIFY_BAD_CHUNKS`] of them.
fn bad_chunks(read: &[Option<Hash256>], recorded: &[Hash256]) -> (u64, Vec<u64>) {
    let longest = read.len().max(recorded.len());
    let bad = (0..longest).filter(|&i| match (read.get(i), recorded.get(i)) {
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
    (bad_count, bad_chunks)
}

/// Hashes of every chunk of the first `size` bytes of `file`, read with `pread` on all
/// cores; `None` for a chunk that could not be read (an I/O error: damage, as far as
/// the caller is concerned). A short read fails with [`ManifestError::Shrank`].
fn read_hashes(
    file: &File,
    algorithm: HashAlgorithm,
    size: u64,
    chunk_bytes: u32,
    what: &str,
) -> Result<Vec<Option<Hash256>>, ManifestError> {
    hash_chunks_of(file, algorithm, size, chunk_bytes, what, |e| {
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
    algorithm: HashAlgorithm,
    read: &[Option<Hash256>],
    started: SystemTime,
    what: &str,
) {
    if !settled(key, started, CACHE_SETTLE) {
        return;
    }
    let Some(hashes) = read.iter().copied().collect::<Option<Vec<Hash256>>>() else {
        return;
    };
    match store.save(key, algorithm, &hashes) {
        Ok(()) => tracing::debug!(file = %what, "manifest recorded by verify"),
        Err(e) => tracing::debug!(file = %what, "cannot record the manifest: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::share::test_share;
    use ferry_common::chunk::hash_chunk;
    use ferry_common::msg::{ErrorKind, RemoteError};
    use std::io::Write;

    /// The store key of `meta` in the store's chunk size.
    fn key_of(meta: &std::fs::Metadata, store: &ManifestStore) -> ManifestKey {
        ManifestKey::of(meta, store.chunk_bytes())
    }

    fn share(dir: &std::path::Path) -> Share {
        test_share("s", dir, false)
    }

    /// The kind of error the client is sent for `r`, a failed verification.
    fn kind(r: Result<Response, VerifyError>) -> ErrorKind {
        RemoteError::from(r.unwrap_err()).kind
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
        let store = s.store();
        let meta = std::fs::metadata(dir.path().join("f")).unwrap();
        let key = key_of(&meta, store);
        let mut hashes: Vec<Hash256> = data
            .chunks(store.chunk_bytes() as usize)
            .map(|c| hash_chunk(HashAlgorithm::Sha256, c))
            .collect();
        store.save(&key, HashAlgorithm::Sha256, &hashes).unwrap();
        let clean = report(verify(&s, "f").unwrap());
        assert_eq!(clean.record, VerifyRecord::Current);
        assert_eq!((clean.chunks, clean.bad_count), (3, 0));
        // A record of this very version that the bytes no longer match: what bit rot
        // below the filesystem looks like (the record is forged, the file kept).
        hashes[1][0] ^= 1;
        store.save(&key, HashAlgorithm::Sha256, &hashes).unwrap();
        let damaged = report(verify(&s, "f").unwrap());
        assert_eq!(damaged.record, VerifyRecord::Current);
        assert_eq!((damaged.bad_count, damaged.bad_chunks), (1, vec![1]));
        // The damaged record is kept: verifying again still says so.
        assert_eq!(report(verify(&s, "f").unwrap()).bad_chunks, vec![1]);
        // A status change (chmod sets ctime) with the same bytes: stale, all chunks
        // compared, the one forged chunk still differs.
        hashes[1][0] ^= 1;
        store.save(&key, HashAlgorithm::Sha256, &hashes).unwrap();
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
        assert_eq!(kind(verify(&s, "d")), ErrorKind::IsADirectory);
        assert_eq!(kind(verify(&s, "l")), ErrorKind::InvalidPath);
        assert_eq!(kind(verify(&s, ".ferry-state")), ErrorKind::InvalidPath);
        assert_eq!(kind(verify(&s, "nope")), ErrorKind::NotFound);
    }
}
