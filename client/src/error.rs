//! Client errors, each able to say its exit code and `--json` kind.

use std::io;
use std::path::PathBuf;

use ferry_common::msg::{ErrorKind, RemoteError};
use ferry_common::proto::ProtoError;
use ferry_common::transport::TransportError;

/// Exit codes of `rcp`, documented in the README.
pub mod exit {
    /// Everything copied.
    pub const OK: u8 = 0;
    /// Several different failures, or another error.
    pub const OTHER: u8 = 1;
    /// Bad arguments.
    pub const USAGE: u8 = 2;
    /// Cannot connect (no such host, connection refused, handshake failed).
    pub const CONNECT: u8 = 3;
    /// The server refused or failed the operation.
    pub const REMOTE: u8 = 4;
    /// A local I/O error.
    pub const LOCAL: u8 = 5;
    /// A chunk failed SHA-256 verification.
    pub const INTEGRITY: u8 = 6;
}

/// Why a client operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The server could not be reached.
    #[error("cannot connect to {addr}: {cause}")]
    Connect {
        /// `host:port` as given.
        addr: String,
        /// Human-readable cause ("connection refused", "no such host"...).
        cause: String,
    },
    /// The server was reached but the session could not start.
    #[error("{addr}: handshake failed: {cause}")]
    Handshake {
        /// `host:port` as given.
        addr: String,
        /// Why.
        cause: String,
    },
    /// The server refused or failed a request.
    #[error("{}", .0.message)]
    Remote(RemoteError),
    /// A local filesystem operation failed.
    #[error("{}: {op}: {}", path.display(), describe_io(source))]
    Local {
        /// The local path.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Data did not match its SHA-256, even after a retry.
    #[error("{what}: chunk {chunk} failed SHA-256 verification")]
    Integrity {
        /// What was being copied.
        what: String,
        /// Index of the chunk.
        chunk: u64,
    },
    /// A local source changed while it was being uploaded.
    #[error("{}: changed while it was being copied; nothing was written, try again", path.display())]
    SourceChanged {
        /// The local file.
        path: PathBuf,
    },
    /// The arguments do not make sense.
    #[error("{0}")]
    Usage(String),
    /// A transport operation failed.
    #[error("transfer failed: {0}")]
    Transport(#[from] TransportError),
    /// The connection to the server ended.
    #[error("connection to the server lost: {0}")]
    Disconnected(String),
    /// The peer broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtoError),
}

fn describe_io(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::NotFound => "no such file or directory".into(),
        io::ErrorKind::PermissionDenied => "permission denied".into(),
        io::ErrorKind::StorageFull => "no space left on device".into(),
        _ => e.to_string(),
    }
}

impl ClientError {
    /// A local error.
    pub fn local(path: impl Into<PathBuf>, op: &'static str, source: io::Error) -> Self {
        ClientError::Local {
            path: path.into(),
            op,
            source,
        }
    }

    /// The remote error kind, if the server reported this error.
    pub fn remote_kind(&self) -> Option<ErrorKind> {
        match self {
            ClientError::Remote(e) => Some(e.kind),
            _ => None,
        }
    }

    /// The `rcp` exit code for this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            ClientError::Connect { .. } | ClientError::Handshake { .. } => exit::CONNECT,
            ClientError::Remote(e) => match e.kind {
                ErrorKind::Integrity => exit::INTEGRITY,
                ErrorKind::Protocol => exit::OTHER,
                _ => exit::REMOTE,
            },
            ClientError::Local { .. } | ClientError::SourceChanged { .. } => exit::LOCAL,
            ClientError::Integrity { .. } => exit::INTEGRITY,
            ClientError::Usage(_) => exit::USAGE,
            ClientError::Transport(_) | ClientError::Protocol(_) | ClientError::Disconnected(_) => {
                exit::OTHER
            }
        }
    }

    /// The snake_case kind used in `--json` output.
    pub fn kind(&self) -> &'static str {
        match self {
            ClientError::Connect { .. } | ClientError::Handshake { .. } => "connect",
            ClientError::Remote(e) => e.kind.as_str(),
            ClientError::Local { source, .. } => match source.kind() {
                io::ErrorKind::NotFound => "not_found",
                io::ErrorKind::PermissionDenied => "permission_denied",
                io::ErrorKind::StorageFull => "no_space",
                io::ErrorKind::NotADirectory => "not_a_directory",
                io::ErrorKind::IsADirectory => "is_a_directory",
                io::ErrorKind::AlreadyExists => "exists",
                _ => "io",
            },
            ClientError::Integrity { .. } => "integrity",
            ClientError::SourceChanged { .. } => "changed",
            ClientError::Usage(_) => "usage",
            ClientError::Transport(_) | ClientError::Disconnected(_) => "io",
            ClientError::Protocol(_) => "protocol",
        }
    }
}
