//! The version of a file's content as `fstat` tells it, and when that version has
//! settled: the key under which the manifest cache ([`crate::manifests`]) and a
//! share's persistent store ([`crate::store`]) keep chunk manifests.
//!
//! **Cache key** ([`ManifestKey`]): `(dev, ino, size, mtime ns, ctime ns, chunk_bytes)`.
//! A changed file is never mistaken for an unchanged one:
//! - every write, truncate or metadata change sets ctime, which no user can set back
//!   (unlike mtime, which `utimes` can);
//! - a file replaced by rename or re-created is another inode: `ino` differs, or, when
//!   the inode number is reused, its ctime is the re-creation time;
//! - `dev` keeps inode numbers of different filesystems apart.
//!
//! Timestamps have a granularity (the kernel's coarse clock tick), so a write in the
//! same tick as the stat that preceded hashing can leave size, mtime and ctime as they
//! were. A manifest is therefore cached only when the file's ctime lies at least
//! [`CACHE_SETTLE`] before hashing began (git's "racily clean" rule): a recently
//! changed file is hashed again on every open, so what the cache returns was taken
//! from content that no write within the same timestamp could have followed. (A clock
//! stepped backwards by more than that defeats the rule; so be it.)

use std::fs::Metadata;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, SystemTime};

/// How long before hashing began a file's ctime must lie for its manifest to be
/// cached (see the module docs).
pub const CACHE_SETTLE: Duration = Duration::from_secs(1);

/// Identifies one version of a file's content, as far as `fstat` can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ManifestKey {
    /// Device of the filesystem.
    pub dev: u64,
    /// Inode number.
    pub ino: u64,
    /// Size in bytes.
    pub size: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i128,
    /// Status change time, nanoseconds since the epoch.
    pub ctime_ns: i128,
    /// Chunk size of the manifest.
    pub chunk_bytes: u32,
}

impl ManifestKey {
    /// The key of the file `meta` describes, hashed in chunks of `chunk_bytes`.
    pub fn of(meta: &Metadata, chunk_bytes: u32) -> ManifestKey {
        ManifestKey {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime_ns: nanos(meta.mtime(), meta.mtime_nsec()),
            ctime_ns: nanos(meta.ctime(), meta.ctime_nsec()),
            chunk_bytes,
        }
    }
}

fn nanos(secs: i64, nsec: i64) -> i128 {
    i128::from(secs) * 1_000_000_000 + i128::from(nsec)
}

/// True if `a` and `b` describe the same content version (see [`ManifestKey`]).
pub fn same_version(a: &Metadata, b: &Metadata) -> bool {
    ManifestKey::of(a, 0) == ManifestKey::of(b, 0)
}

/// True if the file's ctime lies at least `settle` before `started`.
pub fn settled(key: &ManifestKey, started: SystemTime, settle: Duration) -> bool {
    let started_ns = match started.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i128,
        Err(_) => return false,
    };
    key.ctime_ns + settle.as_nanos() as i128 <= started_ns
}

/// How far from its ctime an mtime with no digits below the millisecond must lie for
/// [`mtime_settled`]: such an mtime may be stored coarsely (whole seconds, or FAT's
/// two), so a later write in the same stored second could set it to the same value.
pub const COARSE_MTIME_SETTLE: Duration = Duration::from_secs(2);

/// True if no write after the status change that `key`'s ctime records can leave the
/// key as it is. Such a write, at a time the file system stores as `t`, sets both
/// mtime and ctime to `t`: in another clock tick than that ctime, the ctime moves; in
/// the same one, the mtime becomes that ctime. So an mtime other than the ctime can no
/// longer match, whether it lies before it (an upload of a file written moments ago)
/// or after it (a client whose clock runs ahead of the server's, or a clock stepped
/// back). That holds where the mtime is stored as finely as the ctime; an mtime with
/// digits below the millisecond was, and one without may have been rounded to seconds,
/// so it must lie [`COARSE_MTIME_SETTLE`] from the ctime.
///
/// A file committed by this server with the mtime of a source written just before
/// (an upload moments after the file was made) is thus recorded: its mtime is the
/// source's, its ctime the commit's.
pub fn mtime_settled(key: &ManifestKey) -> bool {
    if key.mtime_ns % 1_000_000 != 0 {
        key.mtime_ns != key.ctime_ns
    } else {
        (key.mtime_ns - key.ctime_ns).abs() >= COARSE_MTIME_SETTLE.as_nanos() as i128
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> ManifestKey {
        ManifestKey {
            dev: 7,
            ino: 1,
            size: 1,
            mtime_ns: 1_000,
            ctime_ns: 5_000_000_000,
            chunk_bytes: 4096,
        }
    }

    #[test]
    fn settled_mtimes() {
        assert!(mtime_settled(&key()));
        let at = |mtime_ns, ctime_ns| ManifestKey {
            mtime_ns,
            ctime_ns,
            ..key()
        };
        // A fine mtime just before the ctime: a later write's mtime differs.
        assert!(mtime_settled(&at(4_999_999_123, 5_000_000_000)));
        assert!(mtime_settled(&at(4_996_000_001, 4_996_000_002)));
        // The same tick: a later write in it leaves the key as it is.
        assert!(!mtime_settled(&at(4_999_999_123, 4_999_999_123)));
        // An mtime after the ctime (a client's clock ahead): a later write's mtime,
        // the ctime's or a later tick's with the ctime moved, differs.
        assert!(mtime_settled(&at(5_000_000_123, 5_000_000_000)));
        // Whole milliseconds may be a coarse file system's: two seconds' margin,
        // either way.
        assert!(!mtime_settled(&at(4_000_000_000, 5_000_000_000)));
        assert!(!mtime_settled(&at(4_500_000_000, 6_000_000_000)));
        assert!(!mtime_settled(&at(7_000_000_000, 6_000_000_000)));
        assert!(mtime_settled(&at(4_000_000_000, 6_000_000_000)));
        assert!(mtime_settled(&at(8_000_000_000, 6_000_000_000)));
    }
}
