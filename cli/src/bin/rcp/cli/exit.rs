//! `rcp`'s exit codes (documented in the README and `rcp --help`), and the code of
//! each [`ClientError`].

use ferry_client::error::ClientError;
use ferry_common::msg::ErrorKind;

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
/// A chunk failed verification against its hash.
pub const INTEGRITY: u8 = 6;
/// Authentication failed: no secret, a wrong one, an unusable secret file, or a
/// server that could not prove it knows the secret.
pub const AUTH: u8 = 7;
/// `rcp backup` with several targets: at least one succeeded and at least one
/// failed.
pub const SOME_TARGETS_FAILED: u8 = 8;
/// `rcp backup --verify`: the server found stored files whose bytes differ from
/// their recorded manifests (damaged, or modified after the backup).
pub const DAMAGE_FOUND: u8 = 9;

/// The exit code for the error `e`.
pub fn of(e: &ClientError) -> u8 {
    match e {
        ClientError::Connect { .. } | ClientError::Handshake { .. } => CONNECT,
        ClientError::Remote(e) => match e.kind {
            ErrorKind::Integrity => INTEGRITY,
            ErrorKind::Protocol => OTHER,
            ErrorKind::AuthRequired | ErrorKind::AuthFailed => AUTH,
            _ => REMOTE,
        },
        ClientError::Secret(_) | ClientError::ServerNotAuthentic { .. } => AUTH,
        ClientError::Local { .. } | ClientError::SourceChanged { .. } => LOCAL,
        ClientError::Integrity { .. } => INTEGRITY,
        ClientError::Usage(_) => USAGE,
        ClientError::Etcd(e) => match e.kind() {
            "connect" => CONNECT,
            "auth_failed" => AUTH,
            "permission_denied" => REMOTE,
            "usage" => USAGE,
            "io" => LOCAL,
            _ => OTHER,
        },
        _ => OTHER,
    }
}

/// The exit code of several failures' `codes`: [`OK`] for none, their code if they
/// share one, else [`OTHER`].
pub fn shared(mut codes: impl Iterator<Item = u8>) -> u8 {
    match codes.next() {
        None => OK,
        Some(first) if codes.all(|c| c == first) => first,
        Some(_) => OTHER,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_common::msg::RemoteError;

    #[test]
    fn each_failure_has_its_code() {
        let handshake = ClientError::Handshake {
            addr: "h:1".into(),
            cause: "at the limit".into(),
            refused: Some(ErrorKind::Busy),
        };
        assert_eq!(of(&handshake), CONNECT);
        let full = ClientError::local("/f", "cannot write", std::io::Error::from_raw_os_error(28));
        assert_eq!(of(&full), LOCAL);
        let denied = ClientError::Remote(RemoteError {
            kind: ErrorKind::AuthFailed,
            message: "m".into(),
        });
        assert_eq!(of(&denied), AUTH);
        let damaged = ClientError::Remote(RemoteError {
            kind: ErrorKind::Integrity,
            message: "m".into(),
        });
        assert_eq!(of(&damaged), INTEGRITY);
        assert_eq!(of(&ClientError::Disconnected("gone".into())), OTHER);
    }

    #[test]
    fn failures_that_differ_are_other() {
        assert_eq!(shared([].into_iter()), OK);
        assert_eq!(shared([REMOTE, REMOTE].into_iter()), REMOTE);
        assert_eq!(shared([REMOTE, LOCAL].into_iter()), OTHER);
    }
}
