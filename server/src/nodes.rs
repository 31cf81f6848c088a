//! The requests of the `posix` capability that name paths: `MakeNode` (FIFOs, sockets
//! and device nodes, made with `mknod` and never opened) and `SetTimes` (`utimensat`
//! with `UTIME_NOW` and `UTIME_OMIT`, so the server's kernel applies its rule that a
//! user with write access may set the times to now but only the owner may set a given
//! time). Each is one blocking call, made as the request's caller where the share's
//! owners are the clients' ([`crate::owners`]).

use std::io;

use ferry_common::msg::{NodeKind, RemoteError, Response, TimeSet};
use nix::sys::stat::{mknod, utimensat, Mode, SFlag, UtimensatFlags};
use nix::sys::time::TimeSpec;

use crate::fsops;
use crate::owners::{check_node, check_setid};
use crate::share::Share;

/// Why a `posix` request failed on the file system.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NodeError {
    /// `mknod` failed.
    #[error("{path}: cannot make the node")]
    Make {
        /// The share-relative path, for display.
        path: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `utimensat` failed.
    #[error("{path}: cannot set times")]
    Times {
        /// The share-relative path, for display.
        path: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

impl NodeError {
    /// The verb, path and OS error, for the wire.
    pub(crate) fn parts(&self) -> (&'static str, &str, &io::Error) {
        match self {
            NodeError::Make { path, source } => ("make the node", path, source),
            NodeError::Times { path, source } => ("set times", path, source),
        }
    }
}

/// `MakeNode`: `mknod` of `rel` with exactly the bits `mode` (the umask not applied),
/// answered with its attributes and owner.
pub(crate) fn make_node(
    share: &Share,
    rel: &str,
    kind: NodeKind,
    mode: u32,
    rdev: u64,
) -> Result<Response, RemoteError> {
    check_node(kind)?;
    check_setid(mode)?;
    let path = share.resolve_for_write(rel)?;
    let what = share.display(rel);
    let flag = match kind {
        NodeKind::Fifo => SFlag::S_IFIFO,
        NodeKind::Socket => SFlag::S_IFSOCK,
        NodeKind::Char => SFlag::S_IFCHR,
        NodeKind::Block => SFlag::S_IFBLK,
    };
    let bits = Mode::from_bits_truncate(mode & 0o7777);
    let failed = |source: io::Error| NodeError::Make {
        path: what.clone(),
        source,
    };
    mknod(&path, flag, bits, rdev).map_err(|e| failed(e.into()))?;
    // chmod of a node changes its inode; it never opens it, nor follows a symlink
    // put in its place since.
    fsops::chmod_entry(&path, mode).map_err(failed)?;
    Ok(fsops::stat_meta(share, rel, false)?)
}

/// `SetTimes`: `utimensat` of `rel`, its final component not followed.
pub(crate) fn set_times(
    share: &Share,
    rel: &str,
    atime: TimeSet,
    mtime: TimeSet,
) -> Result<Response, RemoteError> {
    let at_root = share.components(rel)?.is_empty();
    let path = if at_root {
        share.check_writable()?;
        share.root().to_path_buf()
    } else {
        share.resolve_for_write(rel)?
    };
    let spec = |t: TimeSet| match t {
        TimeSet::Omit => TimeSpec::UTIME_OMIT,
        TimeSet::Now => TimeSpec::UTIME_NOW,
        TimeSet::At(t) => TimeSpec::new(t.secs, i64::from(t.nanos.min(999_999_999))),
    };
    utimensat(
        None,
        &path,
        &spec(atime),
        &spec(mtime),
        UtimensatFlags::NoFollowSymlink,
    )
    .map_err(|e| NodeError::Times {
        path: share.display(rel),
        source: e.into(),
    })?;
    Ok(fsops::stat(share, rel, false)?)
}
