//! Session encryption: the key exchange, the key schedule and the sealing of records.
//!
//! Sans-IO: nothing here touches a socket or a clock. The transport wrapper
//! `transport::sealed::Sealed` uses it to protect every control message and every
//! byte of file data of a session once its handshake agreed to encrypt.
//!
//! # Construction
//!
//! An ephemeral-ephemeral X25519 exchange (as Noise `NN` or TLS 1.3's `psk_dhe_ke`),
//! authenticated by channel binding to the share's secret:
//!
//! 1. the client's `Hello` offers the suites it accepts and a fresh X25519 public key
//!    ([`KeyShare`]); the server's `Welcome` names one suite and carries its own fresh
//!    public key (capabilities `encrypt`, `encrypt-key`, `encrypt-policy`,
//!    `proto::caps`);
//! 2. both sides hash the handshake into a transcript `T` ([`transcript`]): the
//!    encodings of the `Hello` and the `Welcome`, so every offered and chosen
//!    capability, both nonces and both public keys;
//! 3. `prk = HKDF-Extract(salt = T, ikm = X25519(e_c, e_s))`; each direction gets its
//!    own control key and data key, `HKDF-Expand(prk, "ferry-encrypt-v1 <dir> <use>
//!    <suite>")` ([`SessionKeys::derive`]);
//! 4. every `Auth` proof of the session is an HMAC of the share's secret over both
//!    nonces *and* `T` (`auth::Secret::client_proof_bound`). A man in the middle who
//!    ran one exchange with each side has two different transcripts, so no proof it
//!    forwards verifies: the secret authenticates the key exchange, in both
//!    directions, and is never used as a key.
//!
//! Forward secrecy: the private keys live only in memory for one handshake and are
//! dropped as soon as the keys are derived; the session keys are never stored. A
//! leaked share secret lets an attacker impersonate a side in *future* sessions, not
//! decrypt recorded ones.
//!
//! # Records
//!
//! Control messages are sealed by a [`ControlSealer`] with a 64-bit counter nonce per
//! direction, never sent: the receiver's [`ControlOpener`] expects the next counter,
//! so a frame that is altered, replayed, reordered or dropped fails to open and ends
//! the connection. File data is sealed in pieces by a [`DataSealer`] under the
//! direction's data key, each piece with its own counter (carried, authenticated, in
//! the control message that announces the piece) and tag.
//!
//! # Key updates
//!
//! In a session with the `rekey` capability each key is a generation of a traffic
//! secret (TLS 1.3's schedule, `keys.rs`), updated per direction by its sender's
//! [`RekeyPolicy`]: control keys at a key-update record ([`ControlSealer::update`]),
//! data keys per piece, each piece naming its generation and the opener keeping
//! every generation until the sender retires it (`piece`'s docs argue why nothing in
//! flight is lost). Pieces are bound to where they belong ([`Binding`]). No counter
//! wraps: sealing fails first.

mod keys;
mod piece;
mod record;
mod rekey;

pub use keys::{transcript, KeyShare, SessionKeys, PUBLIC_KEY_BYTES};
pub use piece::{Binding, DataOpener, DataSealer, PieceKey, SealedPiece, MAX_LIVE_KEYS};
pub use record::{ControlOpener, ControlSealer, TAG_BYTES};
pub use rekey::{RekeyPolicy, RECORD_LIMIT};

/// Why sealing, opening or the key exchange failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SealError {
    /// A record did not authenticate: altered, replayed, reordered, truncated or
    /// sealed under another key.
    #[error(
        "a {0} failed authentication (tampered with, replayed, reordered or dropped on the way)"
    )]
    Forged(&'static str),
    /// The peer's public key is not a usable X25519 key (or gave an all-zero secret).
    #[error("the peer's key share is not a valid X25519 public key")]
    BadKeyShare,
    /// A key's counter ran out; the session must end (after 2^64 records).
    #[error("the session's {0} counter is exhausted")]
    Exhausted(&'static str),
    /// A key update broke the rules (out of order, too many keys live, or in a
    /// session that does not update keys).
    #[error("key update refused: {0}")]
    KeyUpdate(&'static str),
    /// The system's random generator or the crypto library failed.
    #[error("crypto failure: {0}")]
    Crypto(&'static str),
}

/// An AEAD cipher suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Suite {
    /// AES-256 in GCM mode: fastest where the CPU has AES and carry-less multiply
    /// instructions.
    Aes256Gcm,
    /// ChaCha20-Poly1305: fastest without them.
    ChaCha20Poly1305,
}

impl Suite {
    /// Every suite this build supports.
    pub const ALL: [Suite; 2] = [Suite::Aes256Gcm, Suite::ChaCha20Poly1305];

    /// Its name on the wire and in output.
    pub fn name(self) -> &'static str {
        match self {
            Suite::Aes256Gcm => "aes256gcm",
            Suite::ChaCha20Poly1305 => "chacha20poly1305",
        }
    }

    /// The suite called `name`, if this build knows it.
    pub fn from_name(name: &str) -> Option<Suite> {
        Suite::ALL.into_iter().find(|s| s.name() == name)
    }

    /// Every suite, the fastest on this CPU first: AES-256-GCM where it has AES
    /// instructions ([`aes_hardware`]), ChaCha20-Poly1305 otherwise.
    pub fn preferred() -> [Suite; 2] {
        if aes_hardware() {
            [Suite::Aes256Gcm, Suite::ChaCha20Poly1305]
        } else {
            [Suite::ChaCha20Poly1305, Suite::Aes256Gcm]
        }
    }

    pub(crate) fn aead(self) -> &'static ring::aead::Algorithm {
        match self {
            Suite::Aes256Gcm => &ring::aead::AES_256_GCM,
            Suite::ChaCha20Poly1305 => &ring::aead::CHACHA20_POLY1305,
        }
    }
}

impl std::fmt::Display for Suite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether this CPU has AES and carry-less multiplication instructions (AES-NI and
/// PCLMULQDQ on x86-64, the crypto extension on aarch64).
pub fn aes_hardware() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("aes")
            && std::arch::is_x86_feature_detected!("pclmulqdq")
    }
    #[cfg(target_arch = "aarch64")]
    {
        std::arch::is_aarch64_feature_detected!("aes")
            && std::arch::is_aarch64_feature_detected!("pmull")
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

/// Whether a side wants its sessions encrypted: ferryd per share (`encryption = ...`,
/// `--encryption`), a client per run (`--encryption`, `-o encryption=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Encryption {
    /// Encrypted or not at all: a peer (or a middlebox) that does not agree gets a
    /// clear refusal.
    Required,
    /// Encrypted whenever the peer supports it, in the clear with an older peer.
    #[default]
    Preferred,
    /// Never asked for: a client offers nothing; ferryd does not ask for it on this
    /// share's behalf (a client that requires it still gets it).
    Off,
}

impl Encryption {
    /// Lowercase name, as in configuration and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Encryption::Required => "required",
            Encryption::Preferred => "preferred",
            Encryption::Off => "off",
        }
    }
}

impl std::str::FromStr for Encryption {
    type Err = String;
    fn from_str(s: &str) -> Result<Encryption, String> {
        match s {
            "required" => Ok(Encryption::Required),
            "preferred" => Ok(Encryption::Preferred),
            "off" => Ok(Encryption::Off),
            other => Err(format!(
                "unknown encryption policy '{other}' (expected required, preferred or off)"
            )),
        }
    }
}

impl std::fmt::Display for Encryption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Lowercase hex of `bytes`.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of the lowercase or uppercase hex string `s`, which must encode exactly
/// `N` bytes.
pub fn from_hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; N];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_policies_round_trip() {
        for s in Suite::ALL {
            assert_eq!(Suite::from_name(s.name()), Some(s));
        }
        assert_eq!(Suite::from_name("rot13"), None);
        for p in [Encryption::Required, Encryption::Preferred, Encryption::Off] {
            assert_eq!(p.as_str().parse::<Encryption>(), Ok(p));
        }
        assert!("maybe".parse::<Encryption>().is_err());
        let key = [0xa5u8; 32];
        assert_eq!(from_hex::<32>(&to_hex(&key)), Some(key));
        assert_eq!(from_hex::<32>("zz"), None);
        assert_eq!(from_hex::<2>("é1"), None);
    }

    #[test]
    fn preference_follows_the_cpu() {
        let p = Suite::preferred();
        assert_eq!(p[0] == Suite::Aes256Gcm, aes_hardware());
    }
}
