//! Turning local failures into the errors a client sees.
//!
//! Messages name the share-relative path (`share/dir/file`), never the server's own
//! filesystem layout.

use std::io;

use ferry_common::msg::{ErrorKind, RemoteError};

/// `EDQUOT`: the disk quota is exhausted (reported as "no space").
const EDQUOT: i32 = 122;

/// `EMLINK`: a file already has as many hard links as its filesystem allows.
const EMLINK: i32 = 31;

/// A [`RemoteError`] with a message cut to the protocol's limit.
pub fn remote(kind: ErrorKind, message: impl Into<String>) -> RemoteError {
    RemoteError::new(kind, message)
}

/// The error kind for an OS error.
pub fn kind_of(e: &io::Error) -> ErrorKind {
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

/// Describes a failed `op` (a verb: "open", "write"...) on `what` (a share-relative
/// path) for the client, as `what: cause`: every path error message starts with the
/// path it is about, so clients can avoid repeating it.
pub fn io_error(op: &str, what: &str, e: &io::Error) -> RemoteError {
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
    remote(kind_of(e), format!("{what}: {cause}"))
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
}
