//! Client errors, each able to say its `--json` kind (`rcp` maps them to exit codes).

use std::io;
use std::path::PathBuf;

use ferry_common::msg::{ErrorKind, RemoteError};
use ferry_common::proto::ProtoError;
use ferry_common::transport::TransportError;

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
        /// The kind of the server's refusal, when it refused the session (`Busy`: at
        /// its connection limit).
        refused: Option<ErrorKind>,
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
    /// Data did not match its chunk hash, even after a retry.
    #[error("{what}: chunk {chunk} failed hash verification")]
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
    /// The server stopped answering: requests waited and it sent nothing, not even an
    /// answer to a liveness probe, for `after` ([`ferry_common::proto::client::Liveness`]).
    /// The session is closed.
    #[error("server {addr} is not responding: nothing received for {after:?} while requests waited (it is hung, stopped or unreachable)")]
    Hung {
        /// `host:port` of the server.
        addr: String,
        /// How long it was silent.
        after: std::time::Duration,
    },
    /// A storage node moved no bytes and sent nothing for `after` during a stripe
    /// transfer (the cluster's progress deadline): the operation was abandoned there,
    /// and the node is suspect for a while.
    #[error("storage node {node} made no progress for {after:?}")]
    Stalled {
        /// The node's id.
        node: String,
        /// The progress deadline it missed.
        after: std::time::Duration,
    },
    /// The peer broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtoError),
    /// A request was not sent: a field exceeds a protocol limit (a path longer than
    /// the protocol carries, say). The session goes on.
    #[error("request not sent: {0}")]
    Limit(ferry_common::codec::CodecError),
    /// A local secret could not be loaded.
    #[error(transparent)]
    Secret(#[from] ferry_common::auth::SecretError),
    /// A cluster share's namespace or placement refused the operation (a conflict
    /// that did not resolve, no live node, a stripe with no readable replica).
    #[error("{0}")]
    Cluster(String),
    /// The cluster's etcd refused or failed (TLS, user authentication, a role that
    /// does not allow the operation, no answer).
    #[error(transparent)]
    Etcd(#[from] crate::etcd_error::EtcdError),
    /// The server accepted our proof but could not prove it knows the share's secret
    /// itself: it is not the server that holds the secret.
    #[error(
        "{addr}: the server could not prove it knows the secret of share '{share}'; not using it"
    )]
    ServerNotAuthentic {
        /// `host:port` as given.
        addr: String,
        /// The share.
        share: String,
    },
}

impl From<crate::etcd_error::EtcdConfigError> for ClientError {
    fn from(e: crate::etcd_error::EtcdConfigError) -> Self {
        ClientError::Etcd(e.into())
    }
}

/// True for a full filesystem: `ENOSPC`, or `EDQUOT` (the quota is exhausted).
fn is_no_space(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::StorageFull || e.raw_os_error() == Some(nix::libc::EDQUOT)
}

fn describe_io(e: &io::Error) -> String {
    if is_no_space(e) {
        return "no space left on device".into();
    }
    match e.kind() {
        io::ErrorKind::NotFound => "no such file or directory".into(),
        io::ErrorKind::PermissionDenied => "permission denied".into(),
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

    /// Whether the server is at a resource limit (a request or the session itself
    /// refused `Busy`): trying again later may succeed.
    pub fn is_busy(&self) -> bool {
        matches!(
            self,
            ClientError::Remote(RemoteError {
                kind: ErrorKind::Busy,
                ..
            }) | ClientError::Handshake {
                refused: Some(ErrorKind::Busy),
                ..
            }
        )
    }

    /// The snake_case kind used in `--json` output.
    pub fn kind(&self) -> &'static str {
        match self {
            ClientError::Connect { .. } | ClientError::Handshake { .. } => "connect",
            ClientError::Remote(e) => e.kind.as_str(),
            ClientError::Local { source, .. } if is_no_space(source) => "no_space",
            ClientError::Local { source, .. } => match source.kind() {
                io::ErrorKind::NotFound => "not_found",
                io::ErrorKind::PermissionDenied => "permission_denied",
                io::ErrorKind::NotADirectory => "not_a_directory",
                io::ErrorKind::IsADirectory => "is_a_directory",
                io::ErrorKind::AlreadyExists => "exists",
                _ => "io",
            },
            ClientError::Integrity { .. } => "integrity",
            ClientError::SourceChanged { .. } => "changed",
            ClientError::Usage(_) => "usage",
            ClientError::Transport(_) | ClientError::Disconnected(_) => "io",
            ClientError::Hung { .. } | ClientError::Stalled { .. } => "hung",
            ClientError::Protocol(_) => "protocol",
            ClientError::Limit(_) => "invalid_path",
            ClientError::Secret(_) => "secret",
            ClientError::ServerNotAuthentic { .. } => "auth_failed",
            ClientError::Cluster(_) => "cluster",
            ClientError::Etcd(e) => e.kind(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_disk_is_no_space_and_names_the_path() {
        for errno in [nix::libc::ENOSPC, nix::libc::EDQUOT] {
            let e = ClientError::local(
                "/mnt/small/big.bin",
                "cannot write",
                io::Error::from_raw_os_error(errno),
            );
            assert_eq!(e.kind(), "no_space");
            assert_eq!(
                e.to_string(),
                "/mnt/small/big.bin: cannot write: no space left on device"
            );
        }
    }

    #[test]
    fn an_unreadable_file_is_permission_denied() {
        let e = ClientError::local(
            "/src/secret",
            "cannot open",
            io::Error::from_raw_os_error(nix::libc::EACCES),
        );
        assert_eq!(e.kind(), "permission_denied");
        assert_eq!(e.to_string(), "/src/secret: cannot open: permission denied");
    }
}
