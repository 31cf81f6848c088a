//! The key exchange and the key schedule.

use ring::agreement::{self, EphemeralPrivateKey, UnparsedPublicKey, X25519};
use ring::hkdf;
use ring::rand::SystemRandom;
use sha2::{Digest, Sha256};

use super::record::{ControlOpener, ControlSealer, DataOpener, DataSealer};
use super::{SealError, Suite};

/// Bytes of an X25519 public key.
pub const PUBLIC_KEY_BYTES: usize = 32;

const TRANSCRIPT_LABEL: &[u8] = b"ferry-encrypt-v1 transcript";
const KEY_LABEL: &str = "ferry-encrypt-v1";

/// The hash that binds a session's keys and proofs to its handshake: SHA-256 over a
/// label and the length-prefixed encodings of the `Hello` and the `Welcome`.
pub fn transcript(hello: &[u8], welcome: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(TRANSCRIPT_LABEL);
    for part in [hello, welcome] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part);
    }
    h.finalize().into()
}

/// One side's ephemeral X25519 key pair for one handshake. The private key cannot be
/// copied out and is consumed by [`KeyShare::agree`]: it never outlives the handshake.
pub struct KeyShare {
    private: EphemeralPrivateKey,
    public: [u8; PUBLIC_KEY_BYTES],
}

impl std::fmt::Debug for KeyShare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyShare")
            .field("public", &super::to_hex(&self.public))
            .finish_non_exhaustive()
    }
}

impl KeyShare {
    /// A fresh key pair from the operating system's random generator.
    pub fn generate() -> Result<KeyShare, SealError> {
        let private = EphemeralPrivateKey::generate(&X25519, &SystemRandom::new())
            .map_err(|_| SealError::Crypto("cannot generate an X25519 key"))?;
        let public = private
            .compute_public_key()
            .map_err(|_| SealError::Crypto("cannot compute an X25519 public key"))?;
        let public = public
            .as_ref()
            .try_into()
            .map_err(|_| SealError::Crypto("X25519 public key of unexpected length"))?;
        Ok(KeyShare { private, public })
    }

    /// The public key, for the `Hello` or `Welcome`.
    pub fn public(&self) -> [u8; PUBLIC_KEY_BYTES] {
        self.public
    }

    /// Completes the exchange with the peer's public key and derives the session's
    /// keys for `suite`, bound to `transcript`; `client` says which side this is.
    pub fn agree(
        self,
        peer: &[u8; PUBLIC_KEY_BYTES],
        transcript: &[u8; 32],
        suite: Suite,
        client: bool,
    ) -> Result<SessionKeys, SealError> {
        let peer = UnparsedPublicKey::new(&X25519, peer);
        agreement::agree_ephemeral(self.private, &peer, |shared| {
            SessionKeys::derive(shared, transcript, suite, client)
        })
        .map_err(|_| SealError::BadKeyShare)?
    }
}

/// The four keys of a session, from one side's point of view.
#[derive(Debug)]
pub struct SessionKeys {
    /// The suite they are for.
    pub suite: Suite,
    /// Seals this side's control messages.
    pub control_send: ControlSealer,
    /// Opens the peer's control messages.
    pub control_recv: ControlOpener,
    /// Seals the file data this side exposes or pushes.
    pub data_send: DataSealer,
    /// Opens the file data the peer exposes or pushes.
    pub data_recv: DataOpener,
}

impl SessionKeys {
    /// The schedule: `prk = HKDF-Extract(transcript, shared)`, then one key per
    /// direction and use, `HKDF-Expand(prk, "ferry-encrypt-v1 <c2s|s2c> <control|data>
    /// <suite>")`. An all-zero shared secret (a peer's low-order public key) is
    /// refused.
    pub fn derive(
        shared: &[u8],
        transcript: &[u8; 32],
        suite: Suite,
        client: bool,
    ) -> Result<SessionKeys, SealError> {
        if shared.iter().all(|&b| b == 0) {
            return Err(SealError::BadKeyShare);
        }
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, transcript).extract(shared);
        let key = |direction: &str, usage: &str| -> Result<[u8; 32], SealError> {
            let info = format!("{KEY_LABEL} {direction} {usage} {}", suite.name());
            let info = [info.as_bytes()];
            let mut out = [0u8; 32];
            prk.expand(&info, hkdf::HKDF_SHA256)
                .and_then(|okm| okm.fill(&mut out))
                .map_err(|_| SealError::Crypto("HKDF expansion failed"))?;
            Ok(out)
        };
        let (send, recv) = if client {
            ("c2s", "s2c")
        } else {
            ("s2c", "c2s")
        };
        Ok(SessionKeys {
            suite,
            control_send: ControlSealer::new(suite, &key(send, "control")?)?,
            control_recv: ControlOpener::new(suite, &key(recv, "control")?)?,
            data_send: DataSealer::new(suite, &key(send, "data")?)?,
            data_recv: DataOpener::new(suite, &key(recv, "data")?)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(suite: Suite) -> (SessionKeys, SessionKeys) {
        let c = KeyShare::generate().unwrap();
        let s = KeyShare::generate().unwrap();
        let (cp, sp) = (c.public(), s.public());
        let t = transcript(b"hello", b"welcome");
        (
            c.agree(&sp, &t, suite, true).unwrap(),
            s.agree(&cp, &t, suite, false).unwrap(),
        )
    }

    #[test]
    fn both_sides_derive_matching_keys_in_every_suite() {
        for suite in Suite::ALL {
            let (mut c, mut s) = pair(suite);
            let sealed = c.control_send.seal(b"ping".to_vec()).unwrap();
            assert_ne!(&sealed[..4], b"ping");
            assert_eq!(s.control_recv.open(sealed).unwrap(), b"ping");
            let sealed = s.control_send.seal(b"pong".to_vec()).unwrap();
            assert_eq!(c.control_recv.open(sealed).unwrap(), b"pong");
            let mut data = vec![7u8; 1000];
            let (n, tag) = s.data_send.seal(&mut data).unwrap();
            assert_ne!(data, vec![7u8; 1000]);
            c.data_recv.open(n, &mut data, &tag).unwrap();
            assert_eq!(data, vec![7u8; 1000]);
        }
    }

    #[test]
    fn a_different_transcript_or_peer_gives_keys_that_do_not_open() {
        let c = KeyShare::generate().unwrap();
        let s = KeyShare::generate().unwrap();
        let (cp, sp) = (c.public(), s.public());
        let mut ck = c
            .agree(
                &sp,
                &transcript(b"hello", b"welcome"),
                Suite::Aes256Gcm,
                true,
            )
            .unwrap();
        // The server saw a hello a middlebox changed.
        let mut sk = s
            .agree(
                &cp,
                &transcript(b"hellO", b"welcome"),
                Suite::Aes256Gcm,
                false,
            )
            .unwrap();
        let sealed = ck.control_send.seal(b"auth".to_vec()).unwrap();
        assert!(matches!(
            sk.control_recv.open(sealed),
            Err(SealError::Forged(_))
        ));
        // A client's own direction never opens its own records.
        let (mut c2, _) = pair(Suite::ChaCha20Poly1305);
        let sealed = c2.control_send.seal(b"x".to_vec()).unwrap();
        assert!(c2.control_recv.open(sealed).is_err());
    }

    #[test]
    fn low_order_keys_are_refused() {
        let s = KeyShare::generate().unwrap();
        let t = transcript(b"a", b"b");
        assert!(matches!(
            s.agree(&[0u8; 32], &t, Suite::Aes256Gcm, false),
            Err(SealError::BadKeyShare)
        ));
    }
}
