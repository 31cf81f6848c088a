//! Share secrets and the challenge-response that proves a session knows one.
//!
//! Each share of a ferryd has a secret. A session proves it knows a share's secret
//! before the server resolves any path in that share or exposes any memory region of
//! it:
//!
//! 1. the client's `Hello` carries a fresh random nonce `Nc`, the server's `Welcome` a
//!    fresh random nonce `Ns` (both [`NONCE_BYTES`] from the OS's generator);
//! 2. the client sends `Auth { share, proof }` with
//!    `proof = HMAC-SHA256(secret, "ferry-auth-v1 client" 0 share 0 Nc Ns)`;
//! 3. the server recomputes it, compares in constant time, and answers with
//!    `HMAC-SHA256(secret, "ferry-auth-v1 server" 0 share 0 Nc Ns)`, which the client
//!    checks in turn (so a server that does not know the secret is caught too).
//!
//! Neither side's proof can be replayed on another session: the other side's nonce
//! is fresh. The labels keep a client proof from ever being valid as a server proof.
//! Secrets never travel. What this does not give (confidentiality and integrity of
//! the bytes after the handshake) is said in `docs/security.md`.
//!
//! Secrets come from files (which must not be accessible by group or others, as ssh
//! insists for private keys) or from the environment, never from a command line.

use std::fmt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of each side's nonce.
pub const NONCE_BYTES: usize = 32;

/// A nonce: fresh random bytes from one side of a handshake.
pub type Nonce = [u8; NONCE_BYTES];

/// A proof: an HMAC-SHA256 tag.
pub type Proof = [u8; 32];

/// Fewest bytes a secret may have. `head -c 32 /dev/urandom | base64` makes a good
/// one (44 characters).
pub const MIN_SECRET_BYTES: usize = 16;

/// Most bytes a secret may have.
pub const MAX_SECRET_BYTES: usize = 4096;

const CLIENT_LABEL: &[u8] = b"ferry-auth-v1 client";
const SERVER_LABEL: &[u8] = b"ferry-auth-v1 server";

/// Why a secret could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SecretError {
    /// The file could not be read.
    #[error("cannot read secret file {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Group or others may access the file.
    #[error(
        "secret file {} is accessible by group or others (mode {mode:04o}): run `chmod 600 {}`",
        path.display(),
        path.display()
    )]
    Permissions {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The file is owned by someone other than this process's user or root.
    #[error("secret file {} is owned by uid {owner}, not by this user ({me}) or root", path.display())]
    Owner {
        /// The file.
        path: PathBuf,
        /// Its owner.
        owner: u32,
        /// This process's effective uid.
        me: u32,
    },
    /// The secret (after trailing whitespace is dropped) is too short or too long.
    #[error(
        "the secret from {origin} has {len} bytes; it needs {MIN_SECRET_BYTES} to \
         {MAX_SECRET_BYTES} (make one with `head -c 32 /dev/urandom | base64`)"
    )]
    Length {
        /// Where the secret came from.
        origin: String,
        /// Its length.
        len: usize,
    },
    /// A named environment variable is not set, or is not valid text.
    #[error("environment variable {0} is not set")]
    MissingEnv(String),
}

/// A share's secret. Its `Debug` form never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret(<{} bytes>)", self.0.len())
    }
}

impl Secret {
    /// A secret from raw bytes; trailing whitespace (a file's final newline) is dropped.
    /// `origin` names where it came from, for the error.
    pub fn from_bytes(bytes: &[u8], origin: &str) -> Result<Secret, SecretError> {
        let end = bytes
            .iter()
            .rposition(|b| !b.is_ascii_whitespace())
            .map_or(0, |i| i + 1);
        let trimmed = &bytes[..end];
        if !(MIN_SECRET_BYTES..=MAX_SECRET_BYTES).contains(&trimmed.len()) {
            return Err(SecretError::Length {
                origin: origin.to_string(),
                len: trimmed.len(),
            });
        }
        Ok(Secret(trimmed.to_vec()))
    }

    /// Reads a secret file. Refuses a file that group or others may read, write or
    /// execute, or one owned by another user than this process's (root excepted).
    pub fn from_file(path: &Path) -> Result<Secret, SecretError> {
        let read_err = |source| SecretError::Read {
            path: path.to_owned(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(read_err)?;
        let mode = meta.mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(SecretError::Permissions {
                path: path.to_owned(),
                mode,
            });
        }
        let me = nix::unistd::geteuid().as_raw();
        if meta.uid() != me && meta.uid() != 0 {
            return Err(SecretError::Owner {
                path: path.to_owned(),
                owner: meta.uid(),
                me,
            });
        }
        let bytes = std::fs::read(path).map_err(read_err)?;
        Secret::from_bytes(&bytes, &path.display().to_string())
    }

    /// The secret held by environment variable `var`.
    pub fn from_env(var: &str) -> Result<Secret, SecretError> {
        let value = std::env::var(var).map_err(|_| SecretError::MissingEnv(var.to_string()))?;
        Secret::from_bytes(value.as_bytes(), &format!("${var}"))
    }

    fn tag(&self, label: &[u8], share: &str, client: &Nonce, server: &Nonce) -> Hmac<Sha256> {
        // HMAC accepts keys of any length; `new_from_slice` cannot fail for it.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        mac.update(label);
        mac.update(&[0]);
        mac.update(share.as_bytes());
        mac.update(&[0]);
        mac.update(client);
        mac.update(server);
        mac
    }

    /// The proof a client sends for `share` on the session with these nonces.
    pub fn client_proof(&self, share: &str, client: &Nonce, server: &Nonce) -> Proof {
        self.tag(CLIENT_LABEL, share, client, server)
            .finalize()
            .into_bytes()
            .into()
    }

    /// The proof a server answers with.
    pub fn server_proof(&self, share: &str, client: &Nonce, server: &Nonce) -> Proof {
        self.tag(SERVER_LABEL, share, client, server)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Whether `proof` is the client proof for these values, compared in constant time.
    pub fn check_client_proof(
        &self,
        share: &str,
        client: &Nonce,
        server: &Nonce,
        proof: &Proof,
    ) -> bool {
        self.check(CLIENT_LABEL, share, (client, server), proof)
    }

    /// Whether `proof` is the server proof for these values, compared in constant time.
    pub fn check_server_proof(
        &self,
        share: &str,
        client: &Nonce,
        server: &Nonce,
        proof: &Proof,
    ) -> bool {
        self.check(SERVER_LABEL, share, (client, server), proof)
    }

    fn check(&self, label: &[u8], share: &str, nonces: (&Nonce, &Nonce), proof: &Proof) -> bool {
        // `verify_slice` compares in constant time.
        self.tag(label, share, nonces.0, nonces.1)
            .verify_slice(proof)
            .is_ok()
    }
}

/// The value an encrypted session's proofs use in place of the server's nonce:
/// SHA-256 over a label, the server's nonce and the session's handshake transcript
/// ([`crate::seal::transcript`]). Proofs over it are valid only for the session whose
/// key exchange produced that transcript (channel binding), so a man in the middle
/// who ran a separate exchange with each side cannot pass either side's proof on.
pub fn bind_to_transcript(server: &Nonce, transcript: &[u8; 32]) -> Nonce {
    use sha2::Digest;
    let mut h = Sha256::new();
    h.update(b"ferry-auth-v2 channel binding");
    h.update(server);
    h.update(transcript);
    h.finalize().into()
}

/// A fresh nonce from the operating system's random generator.
pub fn fresh_nonce() -> Nonce {
    use rand::RngCore;
    let mut n = [0u8; NONCE_BYTES];
    rand::rngs::OsRng.fill_bytes(&mut n);
    n
}

/// How a server guards one share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShareAccess {
    /// A session must prove this secret before using the share.
    Secret(Secret),
    /// Anyone who can connect may use the share (ferryd's `--insecure-no-auth`).
    Open,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn secret() -> Secret {
        Secret::from_bytes(b"0123456789abcdef0123\n", "test").unwrap()
    }

    #[test]
    fn proofs_bind_share_nonces_and_side() {
        let s = secret();
        let (c, n) = ([1u8; 32], [2u8; 32]);
        let p = s.client_proof("data", &c, &n);
        assert!(s.check_client_proof("data", &c, &n, &p));
        assert!(!s.check_client_proof("dat", &c, &n, &p));
        assert!(!s.check_client_proof("data", &n, &c, &p));
        assert!(!s.check_client_proof("data", &c, &[3u8; 32], &p));
        assert!(!s.check_server_proof("data", &c, &n, &p));
        let other = Secret::from_bytes(b"0123456789abcdef0124", "t").unwrap();
        assert!(!other.check_client_proof("data", &c, &n, &p));
        let sp = s.server_proof("data", &c, &n);
        assert_ne!(sp, p);
        assert!(s.check_server_proof("data", &c, &n, &sp));
        // The share name and the label are separated: "da" + "ta..." cannot collide.
        assert_ne!(s.client_proof("da", &c, &n), s.client_proof("data", &c, &n));
    }

    #[test]
    fn lengths_and_trailing_whitespace() {
        assert_eq!(
            secret(),
            Secret::from_bytes(b"0123456789abcdef0123", "t").unwrap()
        );
        assert!(matches!(
            Secret::from_bytes(b"short\n", "t"),
            Err(SecretError::Length { len: 5, .. })
        ));
        assert!(Secret::from_bytes(&[b'x'; MAX_SECRET_BYTES + 1], "t").is_err());
        assert!(!format!("{:?}", secret()).contains("0123"));
    }

    #[test]
    fn files_readable_by_others_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("s");
        std::fs::write(&f, "0123456789abcdef0123\n").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = Secret::from_file(&f).unwrap_err();
        assert!(matches!(e, SecretError::Permissions { mode: 0o644, .. }));
        assert!(e.to_string().contains("chmod 600"), "{e}");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o640)).unwrap();
        assert!(Secret::from_file(&f).is_err());
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(Secret::from_file(&f).unwrap(), secret());
        assert!(matches!(
            Secret::from_file(&dir.path().join("missing")),
            Err(SecretError::Read { .. })
        ));
    }

    #[test]
    fn nonces_are_fresh() {
        assert_ne!(fresh_nonce(), fresh_nonce());
    }
}
