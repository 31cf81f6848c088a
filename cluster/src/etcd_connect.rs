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

use super::etcd_config::{EtcdConfig, EtcdTls};
use ferry_client::etcd_error::EtcdError;

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
