//! Conversions between the local filesystem's metadata and wire attributes.

use std::fs::Metadata;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::msg::{Attr, FileKind, Timestamp};

impl Timestamp {
    /// The timestamp of `t`.
    pub fn from_system(t: SystemTime) -> Timestamp {
        match t.duration_since(UNIX_EPOCH) {
            Ok(d) => Timestamp {
                secs: d.as_secs() as i64,
                nanos: d.subsec_nanos(),
            },
            Err(e) => {
                // Before the epoch: floor to whole seconds, keep nanos positive.
                let d = e.duration();
                let (secs, nanos) = if d.subsec_nanos() == 0 {
                    (-(d.as_secs() as i64), 0)
                } else {
                    (-(d.as_secs() as i64) - 1, 1_000_000_000 - d.subsec_nanos())
                };
                Timestamp { secs, nanos }
            }
        }
    }

    /// This timestamp as a `SystemTime` (nanos clamped to the valid range).
    pub fn to_system(self) -> SystemTime {
        let nanos = Duration::from_nanos(u64::from(self.nanos.min(999_999_999)));
        if self.secs >= 0 {
            UNIX_EPOCH + Duration::from_secs(self.secs as u64) + nanos
        } else {
            UNIX_EPOCH - Duration::from_secs(self.secs.unsigned_abs()) + nanos
        }
    }
}

/// The kind of the object `meta` describes (symlinks not followed if `meta` came from
/// `symlink_metadata`).
pub fn kind_of(meta: &Metadata) -> FileKind {
    let t = meta.file_type();
    if t.is_file() {
        FileKind::File
    } else if t.is_dir() {
        FileKind::Dir
    } else if t.is_symlink() {
        FileKind::Symlink
    } else {
        FileKind::Other
    }
}

/// Wire attributes of `meta`, with the symlink target for symlinks.
pub fn attr_of(meta: &Metadata, symlink_target: Option<String>) -> Attr {
    Attr {
        kind: kind_of(meta),
        size: meta.len(),
        mode: meta.mode() & 0o7777,
        mtime: Timestamp {
            secs: meta.mtime(),
            nanos: meta.mtime_nsec().clamp(0, 999_999_999) as u32,
        },
        symlink_target,
        ino: meta.ino(),
        nlink: u32::try_from(meta.nlink()).unwrap_or(u32::MAX),
        atime: Timestamp {
            secs: meta.atime(),
            nanos: meta.atime_nsec().clamp(0, 999_999_999) as u32,
        },
        ctime: Timestamp {
            secs: meta.ctime(),
            nanos: meta.ctime_nsec().clamp(0, 999_999_999) as u32,
        },
        blocks: meta.blocks(),
        dev: meta.dev(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_round_trip() {
        for (secs, nanos) in [(0, 0), (1_700_000_000, 123), (-1, 999_999_999), (-5, 0)] {
            let t = Timestamp { secs, nanos };
            assert_eq!(Timestamp::from_system(t.to_system()), t);
        }
    }
}
