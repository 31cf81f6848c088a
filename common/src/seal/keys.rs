//! The key exchange and the key schedule.

use ring::agreement::{self, EphemeralPrivateKey, UnparsedPublicKey, X25519};
use ring::hkdf;
use ring::rand::SystemRandom;
use sha2::{Digest, Sha256};

use zeroize::Zeroizing;

use super::piece::{DataOpener, DataSealer};
use super::record::{ControlOpener, ControlSealer, TrafficKey};
use super::{RekeyPolicy, SealError, Suite};

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
    /// keys for `suite`, bound to `transcript`; `client` says which side this is;
    /// `rekey` is this side's policy when both sides update keys (capability
    /// `rekey`), `None` for one key per direction and use (an older peer).
    pub fn agree(
        self,
        peer: &[u8; PUBLIC_KEY_BYTES],
        transcript: &[u8; 32],
        suite: Suite,
        client: bool,
        rekey: Option<RekeyPolicy>,
    ) -> Result<SessionKeys, SealError> {
        let peer = UnparsedPublicKey::new(&X25519, peer);
        agreement::agree_ephemeral(self.private, &peer, |shared| {
            SessionKeys::derive(shared, transcript, suite, client, rekey)
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
    /// The schedule: `prk = HKDF-Extract(transcript, shared)`, then one traffic secret
    /// per direction and use, `HKDF-Expand(prk, "ferry-encrypt-v1 <c2s|s2c>
    /// <control|data> <suite>")`. Without `rekey` that secret is the key (and the
    /// nonce is the bare counter); with it, keys, IVs and later generations derive from
    /// it as in TLS 1.3 ([`TrafficSecret`]). An all-zero shared secret (a peer's
    /// low-order public key) is refused.
    pub fn derive(
        shared: &[u8],
        transcript: &[u8; 32],
        suite: Suite,
        client: bool,
        rekey: Option<RekeyPolicy>,
    ) -> Result<SessionKeys, SealError> {
        if shared.iter().all(|&b| b == 0) {
            return Err(SealError::BadKeyShare);
        }
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, transcript).extract(shared);
        let key = |direction: &str, usage: &str| -> Result<TrafficSecret, SealError> {
            let info = format!("{KEY_LABEL} {direction} {usage} {}", suite.name());
            let info = [info.as_bytes()];
            let mut out = Zeroizing::new([0u8; 32]);
            prk.expand(&info, hkdf::HKDF_SHA256)
                .and_then(|okm| okm.fill(out.as_mut()))
                .map_err(|_| SealError::Crypto("HKDF expansion failed"))?;
            Ok(TrafficSecret {
                bytes: out,
                generation: 0,
            })
        };
        let (send, recv) = if client {
            ("c2s", "s2c")
        } else {
            ("s2c", "c2s")
        };
        Ok(SessionKeys {
            suite,
            control_send: ControlSealer::new(suite, key(send, "control")?, rekey)?,
            control_recv: ControlOpener::new(suite, key(recv, "control")?, rekey.is_some())?,
            data_send: DataSealer::new(suite, key(send, "data")?, client, rekey)?,
            data_recv: DataOpener::new(suite, key(recv, "data")?, !client, rekey.is_some())?,
        })
    }
}

/// HKDF-Expand-Label (RFC 8446 §7.1) over SHA-256 with an empty context: fills `out`
/// from `secret` under `"tls13 " + label`.
pub(crate) fn expand_label(secret: &[u8], label: &str, out: &mut [u8]) -> Result<(), SealError> {
    struct Len(usize);
    impl hkdf::KeyType for Len {
        fn len(&self) -> usize {
            self.0
        }
    }
    let full = format!("tls13 {label}");
    let length = u16::try_from(out.len()).map_err(|_| SealError::Crypto("HKDF label too long"))?;
    let label_len =
        u8::try_from(full.len()).map_err(|_| SealError::Crypto("HKDF label too long"))?;
    let length = length.to_be_bytes();
    let info: [&[u8]; 4] = [&length, &[label_len], full.as_bytes(), &[0]];
    hkdf::Prk::new_less_safe(hkdf::HKDF_SHA256, secret)
        .expand(&info, Len(out.len()))
        .and_then(|okm| okm.fill(out))
        .map_err(|_| SealError::Crypto("HKDF expansion failed"))
}

/// One direction-and-use's traffic secret at one generation. Generation 0 comes from
/// [`SessionKeys::derive`]; each next one is `HKDF-Expand-Label(current, "traffic upd",
/// "", 32)` (RFC 8446 §7.2), and a generation's key and IV are
/// `HKDF-Expand-Label(secret, "key" | "iv", "", 32 | 12)`. A secret is zeroized when it
/// is dropped, which [`TrafficSecret::next`] does to the current one: a later key
/// never yields an earlier one.
pub(crate) struct TrafficSecret {
    bytes: Zeroizing<[u8; 32]>,
    generation: u32,
}

impl TrafficSecret {
    /// Its generation: 0 for the handshake's, one more for each update.
    pub(crate) fn generation(&self) -> u32 {
        self.generation
    }

    /// The next generation's secret; fails rather than wrap the generation.
    pub(crate) fn next(self) -> Result<TrafficSecret, SealError> {
        let generation = self
            .generation
            .checked_add(1)
            .ok_or(SealError::Exhausted("key generation"))?;
        let mut bytes = Zeroizing::new([0u8; 32]);
        expand_label(self.bytes.as_ref(), "traffic upd", bytes.as_mut())?;
        Ok(TrafficSecret { bytes, generation })
    }

    /// This generation's AEAD key and IV.
    pub(crate) fn key(&self, suite: Suite) -> Result<TrafficKey, SealError> {
        let mut key = Zeroizing::new([0u8; 32]);
        let mut iv = [0u8; ring::aead::NONCE_LEN];
        expand_label(self.bytes.as_ref(), "key", key.as_mut())?;
        expand_label(self.bytes.as_ref(), "iv", &mut iv)?;
        TrafficKey::new(suite, &key, iv)
    }

    /// The key of a session without key updates: the secret itself, with an all-zero
    /// IV (the nonce is the bare counter).
    pub(crate) fn fixed_key(&self, suite: Suite) -> Result<TrafficKey, SealError> {
        TrafficKey::new(suite, &self.bytes, [0u8; ring::aead::NONCE_LEN])
    }

    /// A secret of the given bytes, for tests of the schedule.
    #[cfg(test)]
    pub(crate) fn of(bytes: [u8; 32]) -> TrafficSecret {
        TrafficSecret {
            bytes: Zeroizing::new(bytes),
            generation: 0,
        }
    }
}

impl std::fmt::Debug for TrafficSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrafficSecret")
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::seal::Binding;
    use hmac::{Hmac, Mac};
    use std::time::Instant;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// HKDF-Expand-Label written out with the `hmac` crate (RFC 5869 §2.3, RFC 8446
    /// §7.1): a second computation, independent of `ring`'s HKDF.
    fn reference_label(secret: &[u8], label: &str, len: usize) -> Vec<u8> {
        let full = format!("tls13 {label}");
        let mut info = (len as u16).to_be_bytes().to_vec();
        info.push(full.len() as u8);
        info.extend_from_slice(full.as_bytes());
        info.push(0);
        let (mut out, mut t) = (Vec::new(), Vec::new());
        for i in 1u8.. {
            if out.len() >= len {
                break;
            }
            let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).unwrap();
            mac.update(&t);
            mac.update(&info);
            mac.update(&[i]);
            t = mac.finalize().into_bytes().to_vec();
            out.extend_from_slice(&t);
        }
        out.truncate(len);
        out
    }

    #[test]
    fn expand_label_matches_rfc_8448_and_a_second_computation() {
        // RFC 8448 §3, "Simple 1-RTT Handshake": the server handshake traffic secret
        // and the AES-128 key and IV derived from it.
        let secret = hex("b67b7d690cc16c4e75e54213cb2d37b4e9c912bcded9105d42befd59d391ad38");
        let mut key = [0u8; 16];
        let mut iv = [0u8; 12];
        expand_label(&secret, "key", &mut key).unwrap();
        expand_label(&secret, "iv", &mut iv).unwrap();
        assert_eq!(key.to_vec(), hex("3fce516009c21727d0f2e4e86ee403bc"));
        assert_eq!(iv.to_vec(), hex("5d313eb2671276ee13000b30"));
        // Ferry's lengths (32-byte keys and secrets), against the reference and
        // against values computed apart (Python's hmac over the same construction).
        let secret: [u8; 32] = std::array::from_fn(|i| i as u8);
        for (label, len, expected) in [
            (
                "traffic upd",
                32,
                "2cecd0a17506ef5fa73edc062d6e7b5397cf074ec1b4d8f99a120772932f0b45",
            ),
            (
                "key",
                32,
                "2ffbc449e87844051c7768f61ffd8ad070830f01ec2c520ef65f08e8296dffa0",
            ),
            ("iv", 12, "2f41c846a431a163814bcd71"),
        ] {
            let mut out = vec![0u8; len];
            expand_label(&secret, label, &mut out).unwrap();
            assert_eq!(out, hex(expected), "{label}");
            assert_eq!(out, reference_label(&secret, label, len), "{label}");
        }
    }

    #[test]
    fn each_generation_is_the_update_of_the_last_and_its_key_differs() {
        let secret: [u8; 32] = std::array::from_fn(|i| i as u8);
        let mut expected = secret.to_vec();
        let mut s = TrafficSecret::of(secret);
        for generation in 1..=3u32 {
            s = s.next().unwrap();
            expected = reference_label(&expected, "traffic upd", 32);
            assert_eq!(s.generation(), generation);
            assert_eq!(s.bytes.as_ref(), &expected[..]);
        }
        // A key of generation 3 seals what only generation 3 opens.
        let now = Instant::now();
        let policy = Some(RekeyPolicy {
            after_bytes: 1,
            ..RekeyPolicy::default()
        });
        let mut sealer =
            ControlSealer::new(Suite::Aes256Gcm, TrafficSecret::of(secret), policy).unwrap();
        for _ in 0..3 {
            sealer.update().unwrap();
        }
        let record = sealer.seal(now, b"g3".to_vec()).unwrap();
        let mut g3 = ControlOpener::new(Suite::Aes256Gcm, s, true).unwrap();
        let mut g0 = ControlOpener::new(Suite::Aes256Gcm, TrafficSecret::of(secret), true).unwrap();
        assert!(g0.open(record.clone()).is_err());
        assert_eq!(g3.open(record).unwrap(), b"g3");
        // The generation never wraps.
        let last = TrafficSecret {
            generation: u32::MAX,
            ..TrafficSecret::of(secret)
        };
        assert_eq!(
            last.next().unwrap_err(),
            SealError::Exhausted("key generation")
        );
    }

    fn pair(suite: Suite) -> (SessionKeys, SessionKeys) {
        let c = KeyShare::generate().unwrap();
        let s = KeyShare::generate().unwrap();
        let (cp, sp) = (c.public(), s.public());
        let t = transcript(b"hello", b"welcome");
        (
            c.agree(&sp, &t, suite, true, Some(RekeyPolicy::default()))
                .unwrap(),
            s.agree(&cp, &t, suite, false, Some(RekeyPolicy::default()))
                .unwrap(),
        )
    }

    #[test]
    fn both_sides_derive_matching_keys_in_every_suite() {
        for suite in Suite::ALL {
            let (mut c, mut s) = pair(suite);
            let now = Instant::now();
            let sealed = c.control_send.seal(now, b"ping".to_vec()).unwrap();
            assert_ne!(&sealed[..4], b"ping");
            assert_eq!(s.control_recv.open(sealed).unwrap(), b"ping");
            let sealed = s.control_send.seal(now, b"pong".to_vec()).unwrap();
            assert_eq!(c.control_recv.open(sealed).unwrap(), b"pong");
            let mut data = vec![7u8; 1000];
            let at = Binding {
                rkey: 1,
                addr: 0,
                len: 1000,
            };
            let p = s.data_send.seal(now, &at, &mut data).unwrap();
            assert_ne!(data, vec![7u8; 1000]);
            let key = c.data_recv.key(p.generation()).unwrap();
            key.open(p.counter, &at, &mut data, &p.tag).unwrap();
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
                None,
            )
            .unwrap();
        // The server saw a hello a middlebox changed.
        let mut sk = s
            .agree(
                &cp,
                &transcript(b"hellO", b"welcome"),
                Suite::Aes256Gcm,
                false,
                None,
            )
            .unwrap();
        let now = Instant::now();
        let sealed = ck.control_send.seal(now, b"auth".to_vec()).unwrap();
        assert!(matches!(
            sk.control_recv.open(sealed),
            Err(SealError::Forged(_))
        ));
        // A client's own direction never opens its own records.
        let (mut c2, _) = pair(Suite::ChaCha20Poly1305);
        let sealed = c2.control_send.seal(now, b"x".to_vec()).unwrap();
        assert!(c2.control_recv.open(sealed).is_err());
    }

    #[test]
    fn low_order_keys_are_refused() {
        let s = KeyShare::generate().unwrap();
        let t = transcript(b"a", b"b");
        assert!(matches!(
            s.agree(&[0u8; 32], &t, Suite::Aes256Gcm, false, None),
            Err(SealError::BadKeyShare)
        ));
    }
}
