//! Conversions between the local filesystem's metadata and wire attributes.

use std::fs::{self, Metadata, Permissions};
use std::io;
use std::os::unix::fs::{lchown, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::sys::stat::{utimensat, UtimensatFlags};
use nix::sys::time::TimeSpec;

use crate::msg::{Attr, FileKind, NodeKind, Owner, Timestamp};

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
        let kind = if t.is_fifo() {
            NodeKind::Fifo
        } else if t.is_socket() {
            NodeKind::Socket
        } else if t.is_char_device() {
            NodeKind::Char
        } else if t.is_block_device() {
            NodeKind::Block
        } else {
            return FileKind::Other;
        };
        let rdev = match kind {
            NodeKind::Char | NodeKind::Block => meta.rdev(),
            NodeKind::Fifo | NodeKind::Socket => 0,
        };
        FileKind::Node { kind, rdev }
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

/// The numeric owner and group of `meta`.
pub fn owner_of(meta: &Metadata) -> Owner {
    Owner {
        uid: meta.uid(),
        gid: meta.gid(),
    }
}

/// Why [`set_owner_and_mtime`] failed: the step that failed, with the OS error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SetMetaError {
    /// `lstat` of the entry failed.
    #[error("cannot stat")]
    Stat(#[source] io::Error),
    /// `lchown` failed.
    #[error("cannot chown")]
    Chown(#[source] io::Error),
    /// `chmod` (asked for, or putting back the set-user-ID or set-group-ID bit that
    /// `lchown` cleared) failed.
    #[error("cannot chmod")]
    Chmod(#[source] io::Error),
    /// `utimensat` failed.
    #[error("cannot set mtime")]
    SetMtime(#[source] io::Error),
}

impl SetMetaError {
    /// The step that failed, as a phrase ("cannot chown"), and its OS error.
    pub fn into_parts(self) -> (&'static str, io::Error) {
        match self {
            SetMetaError::Stat(e) => ("cannot stat", e),
            SetMetaError::Chown(e) => ("cannot chown", e),
            SetMetaError::Chmod(e) => ("cannot chmod", e),
            SetMetaError::SetMtime(e) => ("cannot set mtime", e),
        }
    }
}

/// Gives the existing entry `path` the numeric owner `uid`/`gid` (each `None` leaves it)
/// and the modification time `mtime`, never following `path`'s final component
/// (`lchown`, `utimensat` with `AT_SYMLINK_NOFOLLOW`; a symlink gets its own). `chown`
/// clears the set-user-ID and set-group-ID bits of a non-directory: they are put back.
/// The access time is left as it is, and so is an owner or mtime the entry already has
/// (no change, so no new ctime). Blocking.
pub fn set_owner_and_mtime(
    path: &Path,
    uid: Option<u32>,
    gid: Option<u32>,
    mtime: Option<Timestamp>,
) -> Result<(), SetMetaError> {
    set_attrs(path, None, uid, gid, mtime)
}

/// [`set_owner_and_mtime`] with permission bits too: the owner first, then `mode`
/// (`& 0o7777`; ignored for a symlink, which has none of its own), then the mtime, so
/// neither a `chown` that clears set-ID bits nor a `chmod` moves the mtime set last.
/// Bits the entry already has are left alone. Blocking.
pub fn set_attrs(
    path: &Path,
    mode: Option<u32>,
    uid: Option<u32>,
    gid: Option<u32>,
    mtime: Option<Timestamp>,
) -> Result<(), SetMetaError> {
    let meta = fs::symlink_metadata(path).map_err(SetMetaError::Stat)?;
    // What already holds is left alone: a change would move the ctime, which keys the
    // manifest records a server keeps of committed files.
    let uid = uid.filter(|&u| u != meta.uid());
    let gid = gid.filter(|&g| g != meta.gid());
    let mtime = mtime.filter(|t| (t.secs, i64::from(t.nanos)) != (meta.mtime(), meta.mtime_nsec()));
    let symlink = meta.file_type().is_symlink();
    let had = meta.mode() & 0o7777;
    let mut chmod = mode.map(|m| m & 0o7777).filter(|&m| !symlink && m != had);
    if uid.is_some() || gid.is_some() {
        lchown(path, uid, gid).map_err(SetMetaError::Chown)?;
        // The set-ID bits the chown may have cleared: put back what is wanted.
        let wanted = mode.map_or(had, |m| m & 0o7777);
        if !symlink && wanted & 0o6000 != 0 {
            chmod = Some(wanted);
        }
    }
    if let Some(mode) = chmod {
        fs::set_permissions(path, Permissions::from_mode(mode)).map_err(SetMetaError::Chmod)?;
    }
    if let Some(t) = mtime {
        let nanos = i64::from(t.nanos.min(999_999_999));
        utimensat(
            None,
            path,
            &TimeSpec::UTIME_OMIT,
            &TimeSpec::new(t.secs, nanos),
            UtimensatFlags::NoFollowSymlink,
        )
        .map_err(|errno| SetMetaError::SetMtime(io::Error::from(errno)))?;
    }
    Ok(())
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
