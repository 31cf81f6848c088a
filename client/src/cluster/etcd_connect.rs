//! Opening an etcd connection from an [`EtcdConfig`], and saying why etcd refused one.
//!
//! etcd's client reports refusals as a gRPC status or a transport error whose causes
//! (rustls's alert, hyper's protocol error, etcd's own message) are nested sources;
//! [`classify`] reads the whole chain and turns the ones an operator can act on into
//! an [`EtcdError`] that names the endpoint, what was refused and which setting fixes
//! it.

use std::path::Path;
use std::time::Duration;

use etcd_client::{Certificate, ConnectOptions, Identity, TlsOptions};

use super::etcd_config::{EtcdConfig, EtcdConfigError, EtcdTls};

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

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, EtcdError> {
    std::fs::read(path).map_err(|source| EtcdError::ReadFile {
        what,
        path: path.to_owned(),
        source,
    })
}

fn tls_options(tls: &EtcdTls) -> Result<TlsOptions, EtcdError> {
    let mut options =
        TlsOptions::new().ca_certificate(Certificate::from_pem(read("etcd's CA file", &tls.ca)?));
    if let Some(id) = &tls.identity {
        let cert = read("the etcd client certificate", &id.cert)?;
        let key = read("the etcd client key", &id.key)?;
        options = options.identity(Identity::from_pem(cert, key));
    }
    Ok(options)
}

/// The connect options of `config` (files read now), with the timeouts given.
pub(crate) fn connect_options(
    config: &EtcdConfig,
    connect_timeout: Duration,
    request_timeout: Duration,
) -> Result<ConnectOptions, EtcdError> {
    let mut options = ConnectOptions::new()
        .with_connect_timeout(connect_timeout)
        .with_timeout(request_timeout);
    if let Some(tls) = &config.tls {
        options = options.with_tls(tls_options(tls)?);
    }
    if let Some(user) = &config.user {
        let text = read("the etcd password file", &user.password_file)?;
        let text = String::from_utf8_lossy(&text);
        let password = text.lines().next().unwrap_or_default().to_owned();
        // A long-lived client (ferryd, a mount) outlives etcd's token TTL.
        options = options
            .with_user(user.name.clone(), password)
            .with_auto_token_refresh(true);
    }
    Ok(options)
}

/// Every level of `e`'s cause, joined by ": ".
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![e.to_string()];
    let mut next = e.source();
    while let Some(s) = next {
        let text = s.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        next = s.source();
    }
    parts.join(": ")
}

/// `e` said briefly: a gRPC status's message and its deepest cause ("tcp connect
/// error: Connection refused (os error 111)"), or every level of another error.
pub fn brief(e: &etcd_client::Error) -> String {
    match e {
        etcd_client::Error::GRpcStatus(status) => {
            let mut deepest: Option<&(dyn std::error::Error + 'static)> =
                std::error::Error::source(status);
            while let Some(next) = deepest.and_then(|d| d.source()) {
                deepest = Some(next);
            }
            match deepest.map(|d| d.to_string()) {
                Some(d) if !status.message().contains(&d) => format!("{}: {d}", status.message()),
                _ => status.message().to_owned(),
            }
        }
        e => chain(e),
    }
}

/// What `e`, met while connecting to etcd at `endpoints` with `config`, means.
pub(crate) fn classify(config: &EtcdConfig, endpoints: &str, e: &etcd_client::Error) -> EtcdError {
    // Matched against every level (the debug text of nested errors included), shown
    // briefly.
    let cause = format!("{} {e:?}", chain(e));
    let has = |needle: &str| cause.contains(needle);
    let endpoints = endpoints.to_owned();
    let user = config.user.as_ref().map(|u| u.name.clone());
    if has("CertificateRequired") || has("BadCertificate") || has("UnknownCA") {
        EtcdError::ClientCertificate {
            endpoints,
            cause: excerpt(&cause, "received fatal alert"),
        }
    } else if has("invalid peer certificate") {
        EtcdError::ServerCertificate {
            endpoints,
            cause: excerpt(&cause, "invalid peer certificate"),
        }
    } else if config.tls.is_some() && (has("InvalidContentType") || has("corrupt message")) {
        EtcdError::NotTls {
            endpoints,
            cause: brief(e),
        }
    } else if config.tls.is_some() && is_closed(&cause) {
        // etcd with --client-cert-auth ends the connection once the handshake shows
        // no certificate it trusts: the client sees the alert, or only the close,
        // depending on which it reads first.
        EtcdError::ClientCertificate {
            endpoints,
            cause: "etcd closed the connection after the TLS handshake".into(),
        }
    } else if config.tls.is_none() && is_closed(&cause) {
        EtcdError::TlsRequired { endpoints }
    } else if has("authentication is not enabled") {
        EtcdError::AuthNotEnabled {
            endpoints,
            user: user.unwrap_or_default(),
        }
    } else if has("user name is empty")
        || has("invalid auth token")
        || (user.is_none() && has("permission denied"))
    {
        // Without a user, etcd takes a client certificate's common name as the user;
        // one that names no user with the rights is refused as "permission denied".
        EtcdError::AuthRequired {
            endpoints,
            cause: brief(e),
        }
    } else if let (Some(user), true) = (user, has("authentication failed")) {
        EtcdError::AuthFailed {
            endpoints,
            user,
            cause: brief(e),
        }
    } else if has("permission denied") {
        EtcdError::PermissionDenied {
            endpoints,
            op: "connecting".into(),
            user: describe_user(config),
        }
    } else if config.tls.is_some() && (has("tls") || has("TLS") || has("alert")) {
        EtcdError::Tls {
            endpoints,
            cause: brief(e),
        }
    } else {
        EtcdError::Unreachable {
            endpoints,
            cause: brief(e),
        }
    }
}

/// Whether the error is the server ending the connection as soon as it was made: a
/// TLS server given an HTTP/2 preface in the clear (Go's closes it), or one that
/// refused the client's certificate after the handshake.
fn is_closed(cause: &str) -> bool {
    [
        "ConnectionReset",
        "connection reset",
        "connection closed",
        "BrokenPipe",
        "broken pipe",
        "Canceled",
    ]
    .iter()
    .any(|n| cause.contains(n))
}

/// The part of `cause` from `marker` to the end of that message (the nested
/// errors' debug output closes it with a quote or a parenthesis).
fn excerpt(cause: &str, marker: &str) -> String {
    match cause.find(marker) {
        Some(at) => {
            let rest = &cause[at..];
            let end = rest.find(['"', ')']).unwrap_or(rest.len());
            rest[..end].trim().to_owned()
        }
        None => cause.to_owned(),
    }
}

/// Who the connection is, for a refusal message.
pub(crate) fn describe_user(config: &EtcdConfig) -> String {
    match &config.user {
        Some(u) => format!("user {}", u.name),
        None => "an anonymous client".into(),
    }
}

/// What `e`, failing request `op` on an established connection, means.
pub(crate) fn request_error(
    config: &EtcdConfig,
    endpoints: &str,
    op: &str,
    e: &etcd_client::Error,
) -> EtcdError {
    let cause = brief(e);
    // etcd says "etcdserver: permission denied" when a role lacks the key range.
    if cause.contains("permission denied") {
        return EtcdError::PermissionDenied {
            endpoints: endpoints.to_owned(),
            op: op.to_owned(),
            user: describe_user(config),
        };
    }
    EtcdError::Request {
        endpoints: endpoints.to_owned(),
        op: op.to_owned(),
        cause,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn excerpts_end_with_the_nested_message() {
        let cause = r#"transport error, source: Custom { kind: InvalidData, error: "received fatal alert: BadCertificate" })"#;
        assert_eq!(
            excerpt(cause, "received fatal alert"),
            "received fatal alert: BadCertificate"
        );
        assert_eq!(excerpt("other", "received fatal alert"), "other");
    }
}
