//! Turning local failures into the errors a client sees: one `From` impl per layer's
//! error enum (and the driver's [`ConnError`]) into the wire's [`RemoteError`].
//!
//! Invariant: no layer builds a [`RemoteError`]; the request functions return their
//! layer's error, and only the connection driver's request-family modules convert it
//! (with `?`, or through `conn::blocking`) when they answer a request.
//!
//! Messages name the share-relative path (`share/dir/file`), never the server's own
//! filesystem layout.

use std::io;

use ferry_common::msg::{ErrorKind, RemoteError};
use ferry_common::path::PathError;
use ferry_common::xattr::NameError;

use crate::batch::BatchError;
use crate::conn::ConnError;
use crate::fdtree::TreeError;
use crate::files::FileError;
use crate::fsops::FsError;
use crate::links::LinkError;
use crate::manifests::ManifestError;
use crate::map::MapError;
use crate::pool::PoolError;
use crate::share::ShareError;
use crate::transfer::TransferError;
use crate::verify::VerifyError;
use crate::xattrs::XattrError;

/// `EDQUOT`: the disk quota is exhausted (reported as "no space").
const EDQUOT: i32 = 122;

/// `EMLINK`: a file already has as many hard links as its filesystem allows.
const EMLINK: i32 = 31;

/// The error kind for an OS error.
fn kind_of(e: &io::Error) -> ErrorKind {
    match e.raw_os_error() {
        Some(EDQUOT) => return ErrorKind::NoSpace,
        Some(EMLINK) => return ErrorKind::TooManyLinks,
        _ => {}
    }
    match e.kind() {
        io::ErrorKind::NotFound => ErrorKind::NotFound,
        io::ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
        io::ErrorKind::AlreadyExists | io::ErrorKind::DirectoryNotEmpty => ErrorKind::Exists,
        io::ErrorKind::StorageFull => ErrorKind::NoSpace,
        io::ErrorKind::NotADirectory => ErrorKind::NotADirectory,
        io::ErrorKind::IsADirectory => ErrorKind::IsADirectory,
        io::ErrorKind::ReadOnlyFilesystem => ErrorKind::ReadOnly,
        io::ErrorKind::InvalidFilename => ErrorKind::InvalidPath,
        _ => ErrorKind::Io,
    }
}

/// The error kind for an OS error in answer to a request of the `write` capability,
/// whose clients know the kinds older ones cannot decode: `ENOTEMPTY`, `EDQUOT`,
/// `EOPNOTSUPP`, `EFBIG` and `EINVAL` get kinds of their own, and `ELOOP` (a symlink
/// where these requests never follow one, or too many on the way) is `InvalidPath`.
/// Everything else as [`kind_of`].
fn write_kind_of(e: &io::Error) -> ErrorKind {
    use nix::libc;
    match e.raw_os_error() {
        Some(libc::ENOTEMPTY) => ErrorKind::NotEmpty,
        Some(libc::EDQUOT) => ErrorKind::QuotaExceeded,
        Some(libc::EOPNOTSUPP) => ErrorKind::Unsupported,
        Some(libc::EFBIG) => ErrorKind::FileTooBig,
        Some(libc::EINVAL) => ErrorKind::Invalid,
        Some(libc::ENOSPC) => ErrorKind::NoSpace,
        Some(libc::ELOOP) => ErrorKind::InvalidPath,
        _ => kind_of(e),
    }
}

/// [`io_error`] for the requests of the `write` capability ([`write_kind_of`]).
fn write_io_error(op: &str, what: &str, e: &io::Error) -> RemoteError {
    let kind = write_kind_of(e);
    let cause = match kind {
        ErrorKind::NotEmpty => format!("cannot {op}: directory not empty"),
        ErrorKind::QuotaExceeded => format!("cannot {op}: disk quota exceeded on the server"),
        ErrorKind::Unsupported => {
            format!("cannot {op}: not supported by the server's file system")
        }
        ErrorKind::FileTooBig => {
            format!("cannot {op}: file too large for the server's file system")
        }
        ErrorKind::Invalid => format!("cannot {op}: invalid argument"),
        ErrorKind::InvalidPath => format!("cannot {op}: a symlink is in the way (never followed)"),
        _ => return io_error(op, what, e),
    };
    RemoteError::new(kind, format!("{what}: {cause}"))
}

/// `e` as the client sees it: its message followed by its cause's, as `e: cause`.
fn with_cause(kind: ErrorKind, e: &dyn std::error::Error) -> RemoteError {
    match e.source() {
        Some(cause) => RemoteError::new(kind, format!("{e}: {cause}")),
        None => RemoteError::new(kind, e.to_string()),
    }
}

/// Describes a failed `op` (a verb: "open", "write"...) on `what` (a share-relative
/// path) for the client, as `what: cause`: every path error message starts with the
/// path it is about, so clients can avoid repeating it.
fn io_error(op: &str, what: &str, e: &io::Error) -> RemoteError {
    let cause = match kind_of(e) {
        ErrorKind::NotFound => "no such file or directory".to_string(),
        ErrorKind::PermissionDenied => format!("cannot {op}: permission denied"),
        ErrorKind::NoSpace => format!("cannot {op}: no space left on the server's device"),
        ErrorKind::Exists => "already exists".to_string(),
        ErrorKind::NotADirectory => "not a directory".to_string(),
        ErrorKind::IsADirectory => "is a directory".to_string(),
        ErrorKind::TooManyLinks => format!("cannot {op}: too many links to the file"),
        _ => format!("cannot {op}: {e}"),
    };
    RemoteError::new(kind_of(e), format!("{what}: {cause}"))
}

impl From<crate::owners::Refused> for RemoteError {
    fn from(e: crate::owners::Refused) -> RemoteError {
        RemoteError::new(ErrorKind::PermissionDenied, e.to_string())
    }
}

impl From<crate::nodes::NodeError> for RemoteError {
    fn from(e: crate::nodes::NodeError) -> RemoteError {
        let (op, what, source) = e.parts();
        write_io_error(op, what, source)
    }
}

impl From<ShareError> for RemoteError {
    fn from(e: ShareError) -> RemoteError {
        match e {
            ShareError::InvalidPath { path, source } => {
                let kind = match &source {
                    PathError::DotDot | PathError::Absolute => ErrorKind::OutsideShare,
                    _ => ErrorKind::InvalidPath,
                };
                RemoteError::new(kind, format!("{path}: {source}"))
            }
            ShareError::ResolveDir { path, source } => io_error("resolve", &path, &source),
            ShareError::Follow { path, source } => io_error("open", &path, &source),
            e @ ShareError::ReadOnly { .. } => RemoteError::new(ErrorKind::ReadOnly, e.to_string()),
            e @ ShareError::Outside { .. } => {
                RemoteError::new(ErrorKind::OutsideShare, e.to_string())
            }
            e @ (ShareError::Reserved { .. }
            | ShareError::WriteRoot { .. }
            | ShareError::NotAName { .. }
            | ShareError::TempName { .. }) => {
                RemoteError::new(ErrorKind::InvalidPath, e.to_string())
            }
        }
    }
}

impl From<ConnError> for RemoteError {
    fn from(e: ConnError) -> RemoteError {
        match e {
            e @ ConnError::NoSuchShare { .. } => {
                RemoteError::new(ErrorKind::NoSuchShare, e.to_string())
            }
            // The share's policy refuses this client, as a share that requires
            // encryption refuses one in the clear.
            e @ ConnError::HashRefused { .. } => {
                RemoteError::new(ErrorKind::PermissionDenied, e.to_string())
            }
            e @ (ConnError::Misrouted(_)
            | ConnError::NoState { .. }
            | ConnError::NoFile { .. }
            | ConnError::WrongKind { .. }) => RemoteError::new(ErrorKind::Protocol, e.to_string()),
            e @ ConnError::Task(_) => with_cause(ErrorKind::Io, &e),
            e @ ConnError::Act(_) => with_cause(ErrorKind::PermissionDenied, &e),
        }
    }
}

impl From<FsError> for RemoteError {
    fn from(e: FsError) -> RemoteError {
        match e {
            FsError::Share(e) => e.into(),
            e @ FsError::NotADirectory { .. } => RemoteError::new(ErrorKind::Exists, e.to_string()),
            e @ (FsError::SymlinkTarget { .. }
            | FsError::AttrOfSymlink { .. }
            | FsError::NotRegular { .. }) => {
                RemoteError::new(ErrorKind::InvalidPath, e.to_string())
            }
            e @ (FsError::DirInTheWay { .. } | FsError::IsADirectory { .. }) => {
                RemoteError::new(ErrorKind::IsADirectory, e.to_string())
            }
            FsError::Stat { path, source } => io_error("stat", &path, &source),
            FsError::ReadLink { path, source } => io_error("readlink", &path, &source),
            FsError::List { path, source } => io_error("list", &path, &source),
            FsError::Chmod { path, source } => io_error("chmod", &path, &source),
            FsError::Mkdir { path, source } => io_error("mkdir", &path, &source),
            FsError::Symlink { path, source } => io_error("symlink", &path, &source),
            FsError::SetMtime { path, source } => io_error("set mtime", &path, &source),
            FsError::Chown { path, source } => io_error("chown", &path, &source),
            FsError::Rename { path, source } => io_error("rename", &path, &source),
            FsError::Fsync { path, source } => io_error("fsync", &path, &source),
            FsError::StatFs { path, source } => io_error("statfs", &path, &source),
        }
    }
}

impl From<XattrError> for RemoteError {
    fn from(e: XattrError) -> RemoteError {
        use nix::libc;
        match e {
            XattrError::Share(e) => e.into(),
            e @ XattrError::Name {
                source: NameError::Namespace,
                ..
            } => RemoteError::new(ErrorKind::Unsupported, e.to_string()),
            e @ XattrError::Name {
                source: NameError::TooLong(_),
                ..
            } => RemoteError::new(ErrorKind::AttributeTooBig, e.to_string()),
            e @ XattrError::Name { .. } => RemoteError::new(ErrorKind::Invalid, e.to_string()),
            XattrError::Io {
                path,
                op,
                name,
                source,
            } => {
                let kind = match source.raw_os_error() {
                    Some(libc::ENODATA) => ErrorKind::NoAttribute,
                    Some(libc::E2BIG | libc::ERANGE) => ErrorKind::AttributeTooBig,
                    Some(libc::EPERM) => ErrorKind::PermissionDenied,
                    _ => write_kind_of(&source),
                };
                let what = format!("{path}: cannot {op} extended attribute {name:?}");
                RemoteError::new(kind, format!("{what}: {source}"))
            }
        }
    }
}

impl From<FileError> for RemoteError {
    fn from(e: FileError) -> RemoteError {
        match e {
            FileError::Share(e) => e.into(),
            FileError::Fs(e) => e.into(),
            FileError::Pool(e) => e.into(),
            FileError::Refused(e) => e.into(),
            FileError::Io { path, op, source } => write_io_error(op.verb(), &path, &source),
            e @ (FileError::Reserved { .. }
            | FileError::Symlink { .. }
            | FileError::AttrRefused { .. }) => {
                RemoteError::new(ErrorKind::InvalidPath, e.to_string())
            }
            e @ FileError::Exists { .. } => RemoteError::new(ErrorKind::Exists, e.to_string()),
            e @ FileError::NotFound { .. } => RemoteError::new(ErrorKind::NotFound, e.to_string()),
            e @ FileError::NotRoot { .. } => {
                RemoteError::new(ErrorKind::PermissionDenied, e.to_string())
            }
            e @ (FileError::Algorithm { .. } | FileError::OutsideRegion { .. }) => {
                RemoteError::new(ErrorKind::Protocol, e.to_string())
            }
            e @ FileError::Integrity { .. } => {
                RemoteError::new(ErrorKind::Integrity, e.to_string())
            }
            e @ FileError::Shrank { .. } => RemoteError::new(ErrorKind::Changed, e.to_string()),
            e @ (FileError::Transport { .. } | FileError::Task { .. }) => {
                with_cause(ErrorKind::Io, &e)
            }
        }
    }
}

impl From<TreeError> for RemoteError {
    fn from(e: TreeError) -> RemoteError {
        match e {
            TreeError::Share(e) => e.into(),
            e @ (TreeError::Reserved { .. }
            | TreeError::NotAName { .. }
            | TreeError::TooDeep { .. }
            | TreeError::RemoveRoot { .. }) => {
                RemoteError::new(ErrorKind::InvalidPath, e.to_string())
            }
            e @ TreeError::Outside { .. } => {
                RemoteError::new(ErrorKind::OutsideShare, e.to_string())
            }
            e @ TreeError::Changed { .. } => RemoteError::new(ErrorKind::Changed, e.to_string()),
            e @ (TreeError::NotEmpty { .. } | TreeError::KeepsFilling { .. }) => {
                RemoteError::new(ErrorKind::Exists, e.to_string())
            }
            e @ TreeError::LostParent { .. } => RemoteError::new(ErrorKind::Io, e.to_string()),
            e @ TreeError::TooManyLinked { .. } => RemoteError::new(ErrorKind::Busy, e.to_string()),
            TreeError::Open(path, source) => io_error("open", &path, &source),
            TreeError::Stat(path, source) => io_error("stat", &path, &source),
            TreeError::List(path, source) => io_error("list", &path, &source),
            TreeError::Remove(path, source) => io_error("remove", &path, &source),
        }
    }
}

impl From<PoolError> for RemoteError {
    fn from(e: PoolError) -> RemoteError {
        with_cause(ErrorKind::Io, &e)
    }
}

impl From<ManifestError> for RemoteError {
    fn from(e: ManifestError) -> RemoteError {
        match e {
            ManifestError::Stat(path, source) => io_error("stat", &path, &source),
            ManifestError::Read(path, source) => io_error("read", &path, &source),
            e @ (ManifestError::Shrank { .. } | ManifestError::KeepsChanging { .. }) => {
                RemoteError::new(ErrorKind::Changed, e.to_string())
            }
            e @ ManifestError::Rot { .. } => RemoteError::new(ErrorKind::Integrity, e.to_string()),
        }
    }
}

impl From<TransferError> for RemoteError {
    fn from(e: TransferError) -> RemoteError {
        match e {
            TransferError::Share(e) => e.into(),
            TransferError::Fs(e) => e.into(),
            TransferError::Pool(e) => e.into(),
            TransferError::Manifest(e) => e.into(),
            TransferError::Stage { path, source } => {
                io_error(source.op.verb(), &path, &source.source)
            }
            TransferError::Window { path, source } => {
                RemoteError::new(ErrorKind::Protocol, format!("{path}: {source}"))
            }
            TransferError::NotCommitted { .. } => with_cause(ErrorKind::Integrity, &e),
            e @ TransferError::Chunk(_) | e @ TransferError::OutsideRegion { .. } => {
                RemoteError::new(ErrorKind::Protocol, e.to_string())
            }
            e @ (TransferError::Integrity { .. } | TransferError::Rot { .. }) => {
                RemoteError::new(ErrorKind::Integrity, e.to_string())
            }
            e @ (TransferError::Transport { .. }
            | TransferError::HashTask { .. }
            | TransferError::ReadTask { .. }
            | TransferError::ChunkTask(_)) => with_cause(ErrorKind::Io, &e),
            e @ (TransferError::Shrank { .. } | TransferError::ChangedDuring { .. }) => {
                RemoteError::new(ErrorKind::Changed, e.to_string())
            }
            e @ TransferError::BaseNotRegular { .. } => {
                RemoteError::new(ErrorKind::InvalidPath, e.to_string())
            }
            TransferError::OpenBase(path, source) => io_error("open the base", &path, &source),
            TransferError::Open(path, source) => io_error("open", &path, &source),
            TransferError::Stat(path, source) => io_error("stat", &path, &source),
            TransferError::Truncate(path, source) => io_error("truncate", &path, &source),
            TransferError::Chmod(path, source) => io_error("chmod", &path, &source),
            TransferError::SetMtime(path, source) => io_error("set mtime", &path, &source),
            TransferError::Fsync(path, source) => io_error("fsync", &path, &source),
            TransferError::FsyncDir(path, source) => {
                io_error("fsync the directory", &path, &source)
            }
            TransferError::Write(path, source) => io_error("write", &path, &source),
            TransferError::Read(path, source) => io_error("read", &path, &source),
        }
    }
}

impl From<MapError> for RemoteError {
    fn from(e: MapError) -> RemoteError {
        match e {
            MapError::Share(e) => e.into(),
            MapError::Fs(e) => e.into(),
            MapError::Manifest(e) => e.into(),
            e @ MapError::OverBudget { .. } => RemoteError::new(ErrorKind::Busy, e.to_string()),
            e @ MapError::NoSuchMap { .. } => RemoteError::new(ErrorKind::Protocol, e.to_string()),
            e @ MapError::TooLarge { .. } => RemoteError::new(ErrorKind::Io, e.to_string()),
            e @ (MapError::Register { .. } | MapError::AllocateManifest { .. }) => {
                with_cause(ErrorKind::Io, &e)
            }
            MapError::Stat(path, source) => io_error("stat", &path, &source),
            MapError::Open(path, source) => io_error("open", &path, &source),
            MapError::Map(path, source) => io_error("map", &path, &source),
        }
    }
}

impl From<BatchError> for RemoteError {
    fn from(e: BatchError) -> RemoteError {
        match e {
            BatchError::Share(e) => e.into(),
            BatchError::Fs(e) => e.into(),
            BatchError::Open(e) => e.into(),
            BatchError::Pool(e) => e.into(),
            e @ BatchError::Task(_) => with_cause(ErrorKind::Io, &e),
            e @ BatchError::Act(_) => with_cause(ErrorKind::PermissionDenied, &e),
            e @ (BatchError::RegionWraps | BatchError::WrongHash { .. }) => {
                RemoteError::new(ErrorKind::Protocol, e.to_string())
            }
            e @ BatchError::Transport { .. } => with_cause(ErrorKind::Io, &e),
            e @ BatchError::Twice { .. } => RemoteError::new(ErrorKind::InvalidPath, e.to_string()),
            e @ (BatchError::Integrity { .. } | BatchError::Rot { .. }) => {
                RemoteError::new(ErrorKind::Integrity, e.to_string())
            }
            e @ BatchError::Changed { .. } => RemoteError::new(ErrorKind::Changed, e.to_string()),
            BatchError::Create(path, source) => io_error("create", &path, &source),
            BatchError::Write { path, step, source } => io_error(step.verb(), &path, &source),
            BatchError::Flush(path, source) => io_error("flush", &path, &source),
            BatchError::Rename(path, source) => io_error("rename into place", &path, &source),
            BatchError::FlushDir(path, source) => {
                io_error("flush the directory of", &path, &source)
            }
            BatchError::Read(path, source) => io_error("read", &path, &source),
            BatchError::Stat(path, source) => io_error("stat", &path, &source),
        }
    }
}

impl From<LinkError> for RemoteError {
    fn from(e: LinkError) -> RemoteError {
        match e {
            LinkError::Share(e) => e.into(),
            e @ (LinkError::Moved { .. } | LinkError::SourceChanged { .. }) => {
                RemoteError::new(ErrorKind::Changed, e.to_string())
            }
            e @ LinkError::NotAFile { .. } => {
                RemoteError::new(ErrorKind::InvalidPath, e.to_string())
            }
            LinkError::Open(path, source) => io_error("open", &path, &source),
            LinkError::Stat(path, source) => io_error("stat", &path, &source),
            LinkError::Link(path, source) => io_error("link", &path, &source),
        }
    }
}

impl From<VerifyError> for RemoteError {
    fn from(e: VerifyError) -> RemoteError {
        match e {
            VerifyError::Share(e) => e.into(),
            VerifyError::Fs(e) => e.into(),
            VerifyError::Hash(e) => e.into(),
            e @ VerifyError::Symlink { .. } => {
                RemoteError::new(ErrorKind::InvalidPath, e.to_string())
            }
            e @ VerifyError::Changed { .. } => RemoteError::new(ErrorKind::Changed, e.to_string()),
            VerifyError::Open(path, source) => io_error("open", &path, &source),
            VerifyError::Stat(path, source) => io_error("stat", &path, &source),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_classes() {
        let e = io::Error::from_raw_os_error(28); // ENOSPC
        assert_eq!(kind_of(&e), ErrorKind::NoSpace);
        assert_eq!(
            kind_of(&io::Error::from_raw_os_error(EDQUOT)),
            ErrorKind::NoSpace
        );
        assert_eq!(
            kind_of(&io::Error::from_raw_os_error(2)),
            ErrorKind::NotFound
        );
        let r = io_error("link", "data/y", &io::Error::from_raw_os_error(EMLINK));
        assert_eq!(r.kind, ErrorKind::TooManyLinks);
        assert_eq!(r.message, "data/y: cannot link: too many links to the file");
        let r = io_error("write", "data/x", &e);
        assert_eq!(
            r.message,
            "data/x: cannot write: no space left on the server's device"
        );
    }

    #[test]
    fn write_requests_get_the_new_kinds_and_older_ones_keep_theirs() {
        use nix::libc;
        let cases = [
            (libc::ENOTEMPTY, ErrorKind::NotEmpty, ErrorKind::Exists),
            (libc::EDQUOT, ErrorKind::QuotaExceeded, ErrorKind::NoSpace),
            (libc::EOPNOTSUPP, ErrorKind::Unsupported, ErrorKind::Io),
            (libc::EFBIG, ErrorKind::FileTooBig, ErrorKind::Io),
            (libc::EINVAL, ErrorKind::Invalid, ErrorKind::Io),
            (libc::ENOSPC, ErrorKind::NoSpace, ErrorKind::NoSpace),
            (libc::ELOOP, ErrorKind::InvalidPath, ErrorKind::Io),
            (libc::ENOENT, ErrorKind::NotFound, ErrorKind::NotFound),
        ];
        for (errno, new, old) in cases {
            let e = io::Error::from_raw_os_error(errno);
            assert_eq!(write_kind_of(&e), new, "{e}");
            assert_eq!(kind_of(&e), old, "{e}");
        }
        let r: RemoteError = FileError::Io {
            path: "s/d".into(),
            op: crate::files::FileOp::Rename,
            source: io::Error::from_raw_os_error(libc::ENOTEMPTY),
        }
        .into();
        assert_eq!(r.kind, ErrorKind::NotEmpty);
        assert_eq!(r.message, "s/d: cannot rename: directory not empty");
        let r: RemoteError = FileError::Integrity {
            path: "s/f".into(),
            algorithm: ferry_common::msg::HashAlgorithm::Blake3,
            offset: 4096,
            len: 10,
        }
        .into();
        assert_eq!(r.kind, ErrorKind::Integrity);
        assert!(
            r.message.starts_with("s/f: the extent at offset 4096"),
            "{}",
            r.message
        );
    }

    #[test]
    fn layer_errors_reach_the_wire_with_their_kind_and_message() {
        let cases: Vec<(RemoteError, ErrorKind, &str)> = vec![
            (
                ShareError::InvalidPath {
                    path: "s/../x".into(),
                    source: PathError::DotDot,
                }
                .into(),
                ErrorKind::OutsideShare,
                "s/../x: '..' is not allowed in share paths (it could escape the share)",
            ),
            (
                FsError::Share(ShareError::ReadOnly { share: "s".into() }).into(),
                ErrorKind::ReadOnly,
                "share 's' is read-only",
            ),
            (
                FsError::Mkdir {
                    path: "s/d".into(),
                    source: io::Error::from_raw_os_error(13), // EACCES
                }
                .into(),
                ErrorKind::PermissionDenied,
                "s/d: cannot mkdir: permission denied",
            ),
            (
                TreeError::Stat("s/t".into(), io::Error::from_raw_os_error(2)).into(),
                ErrorKind::NotFound,
                "s/t: no such file or directory",
            ),
            (
                PoolError::Allocate(io::Error::other("boom")).into(),
                ErrorKind::Io,
                "cannot allocate a chunk buffer: boom",
            ),
            (
                PoolError::Closed.into(),
                ErrorKind::Io,
                "buffer pool closed",
            ),
            (
                BatchError::RegionWraps.into(),
                ErrorKind::Protocol,
                "a batch region that wraps around",
            ),
            (
                ConnError::NoSuchShare {
                    share: "n\"o".into(),
                }
                .into(),
                ErrorKind::NoSuchShare,
                "no such share 'n\\\"o'",
            ),
            (
                ConnError::NoState { transfer: 7 }.into(),
                ErrorKind::Protocol,
                "no open transfer 7",
            ),
            (
                TransferError::Fs(FsError::DirInTheWay { path: "s/f".into() }).into(),
                ErrorKind::IsADirectory,
                "s/f: a directory is in the way",
            ),
        ];
        for (got, kind, message) in cases {
            assert_eq!((got.kind, got.message.as_str()), (kind, message));
        }
    }
}
