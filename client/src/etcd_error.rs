//! Why a cluster's etcd refused or failed: the errors the cluster engine
//! (`ferry-cluster`) reports through [`crate::ClientError::Etcd`]. They live here, beside
//! the client's other errors, so that one error type serves every client-side library
//! (sessions, transfers, and the cluster engine built on them) and the binaries map
//! each kind to one exit code.

use std::path::PathBuf;

/// Why the etcd settings could not be put together.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EtcdConfigError {
    /// The cluster configuration file could not be read.
    #[error("cannot read the cluster configuration {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The cluster configuration file is not valid.
    #[error("cluster configuration {}: {message}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong, with the line.
        message: String,
    },
    /// The settings are incomplete or contradict each other.
    #[error("etcd settings: {0}")]
    Invalid(String),
}

/// Why talking to etcd failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EtcdError {
    /// The settings are not usable.
    #[error(transparent)]
    Config(#[from] EtcdConfigError),
    /// A certificate, key or password file could not be read.
    #[error("cannot read {what} {}: {source}", path.display())]
    ReadFile {
        /// Which file ("etcd's CA file", ...).
        what: &'static str,
        /// The file.
        path: std::path::PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// No answer, or the connection failed for a reason not classified below.
    #[error("cannot connect to etcd at {endpoints}: {cause}")]
    Unreachable {
        /// The endpoints tried.
        endpoints: String,
        /// The cause, every level of it.
        cause: String,
    },
    /// etcd requires a client certificate and none (or one it does not trust) was
    /// given.
    #[error("etcd at {endpoints} refused the connection: TLS handshake failed: client certificate required or not trusted ({cause}); give --etcd-cert and --etcd-key, or [tls] cert and key in the cluster configuration")]
    ClientCertificate {
        /// The endpoints tried.
        endpoints: String,
        /// rustls's alert.
        cause: String,
    },
    /// etcd's certificate did not verify against the CA given.
    #[error("etcd at {endpoints}: TLS handshake failed: its certificate is not trusted ({cause}); check --etcd-ca (or [tls] ca) and that the certificate names this host")]
    ServerCertificate {
        /// The endpoints tried.
        endpoints: String,
        /// rustls's verdict.
        cause: String,
    },
    /// Another TLS failure.
    #[error("etcd at {endpoints} refused the connection: TLS handshake failed: {cause}")]
    Tls {
        /// The endpoints tried.
        endpoints: String,
        /// The cause.
        cause: String,
    },
    /// Plain HTTP was spoken to an etcd that serves TLS only.
    #[error("etcd at {endpoints} refused the connection: it serves TLS only (it closed a plain HTTP connection at once); give --etcd-ca (and --etcd-cert/--etcd-key if it requires client certificates), or [tls] in the cluster configuration")]
    TlsRequired {
        /// The endpoints tried.
        endpoints: String,
    },
    /// TLS was spoken to an etcd that serves plain HTTP.
    #[error(
        "etcd at {endpoints} does not speak TLS ({cause}); drop --etcd-ca, or serve etcd over TLS"
    )]
    NotTls {
        /// The endpoints tried.
        endpoints: String,
        /// The cause.
        cause: String,
    },
    /// etcd refused the user name or password.
    #[error("etcd at {endpoints} refused user {user}: {cause}")]
    AuthFailed {
        /// The endpoints tried.
        endpoints: String,
        /// The user.
        user: String,
        /// etcd's message.
        cause: String,
    },
    /// A user was given and etcd has authentication off.
    #[error("etcd at {endpoints}: user {user} given, but etcd's authentication is not enabled (run `ferry cluster auth-setup`, or drop --etcd-user)")]
    AuthNotEnabled {
        /// The endpoints tried.
        endpoints: String,
        /// The user.
        user: String,
    },
    /// etcd has authentication on and no user was given.
    #[error("etcd at {endpoints} requires a user: give --etcd-user and --etcd-password-file, or [user] in the cluster configuration ({cause})")]
    AuthRequired {
        /// The endpoints tried.
        endpoints: String,
        /// etcd's message.
        cause: String,
    },
    /// The user's roles do not allow the operation.
    #[error(
        "etcd at {endpoints}: {op}: permission denied to {user} (its etcd role does not allow it)"
    )]
    PermissionDenied {
        /// The endpoints tried.
        endpoints: String,
        /// What was refused.
        op: String,
        /// The user, or "an anonymous client".
        user: String,
    },
    /// A request failed otherwise.
    #[error("etcd {endpoints}: {op}: {cause}")]
    Request {
        /// The endpoints.
        endpoints: String,
        /// What was being done.
        op: String,
        /// etcd's error.
        cause: String,
    },
}

impl EtcdError {
    /// The snake_case kind used in `--json` output.
    pub fn kind(&self) -> &'static str {
        match self {
            EtcdError::Config(_) => "usage",
            EtcdError::ReadFile { .. } => "io",
            EtcdError::Unreachable { .. }
            | EtcdError::ClientCertificate { .. }
            | EtcdError::ServerCertificate { .. }
            | EtcdError::Tls { .. }
            | EtcdError::TlsRequired { .. }
            | EtcdError::NotTls { .. } => "connect",
            EtcdError::AuthFailed { .. }
            | EtcdError::AuthNotEnabled { .. }
            | EtcdError::AuthRequired { .. } => "auth_failed",
            EtcdError::PermissionDenied { .. } => "permission_denied",
            EtcdError::Request { .. } => "cluster",
        }
    }

    /// Whether etcd could not be reached or refused the connection (TLS or user).
    pub fn is_connect(&self) -> bool {
        matches!(self.kind(), "connect" | "auth_failed")
    }
}
