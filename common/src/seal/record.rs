//! Sealing and opening of records under one key.
//!
//! Nonce invariant: a key seals each counter value at most once. Control keys count
//! records in order (the receiver expects the next value, so the counter is never
//! sent); a data key hands out counters atomically to concurrent sealers and each
//! piece's counter travels in the sealed control message that announces it.

use std::sync::atomic::{AtomicU64, Ordering};

use ring::aead::{Aad, LessSafeKey, Nonce, Tag, UnboundKey, NONCE_LEN};

use super::{SealError, Suite};

/// Bytes of an authentication tag (both suites).
pub const TAG_BYTES: usize = 16;

fn nonce(counter: u64) -> Nonce {
    let mut n = [0u8; NONCE_LEN];
    n[NONCE_LEN - 8..].copy_from_slice(&counter.to_be_bytes());
    Nonce::assume_unique_for_key(n)
}

fn key(suite: Suite, bytes: &[u8; 32]) -> Result<LessSafeKey, SealError> {
    UnboundKey::new(suite.aead(), bytes)
        .map(LessSafeKey::new)
        .map_err(|_| SealError::Crypto("cannot make an AEAD key"))
}

/// Seals one direction's control messages, in order.
#[derive(Debug)]
pub struct ControlSealer {
    key: LessSafeKey,
    next: u64,
}

impl ControlSealer {
    pub(super) fn new(suite: Suite, bytes: &[u8; 32]) -> Result<ControlSealer, SealError> {
        Ok(ControlSealer {
            key: key(suite, bytes)?,
            next: 0,
        })
    }

    /// Seals `plaintext` as the next record: the ciphertext followed by its tag.
    pub fn seal(&mut self, mut plaintext: Vec<u8>) -> Result<Vec<u8>, SealError> {
        let counter = self.next;
        self.next = counter
            .checked_add(1)
            .ok_or(SealError::Exhausted("control"))?;
        self.key
            .seal_in_place_append_tag(nonce(counter), Aad::empty(), &mut plaintext)
            .map_err(|_| SealError::Crypto("AEAD seal failed"))?;
        Ok(plaintext)
    }
}

/// Opens the peer's control messages, expecting them in the order they were sealed.
#[derive(Debug)]
pub struct ControlOpener {
    key: LessSafeKey,
    next: u64,
}

impl ControlOpener {
    pub(super) fn new(suite: Suite, bytes: &[u8; 32]) -> Result<ControlOpener, SealError> {
        Ok(ControlOpener {
            key: key(suite, bytes)?,
            next: 0,
        })
    }

    /// Opens `record`, which must be the next one the peer sealed. A failure is fatal
    /// to the session: the counter does not advance, and no later record opens.
    pub fn open(&mut self, mut record: Vec<u8>) -> Result<Vec<u8>, SealError> {
        let counter = self.next;
        let len = self
            .key
            .open_in_place(nonce(counter), Aad::empty(), &mut record)
            .map_err(|_| SealError::Forged("control message"))?
            .len();
        self.next = counter
            .checked_add(1)
            .ok_or(SealError::Exhausted("control"))?;
        record.truncate(len);
        Ok(record)
    }
}

/// Seals pieces of file data; shared by concurrent sealers.
#[derive(Debug)]
pub struct DataSealer {
    key: LessSafeKey,
    next: AtomicU64,
}

impl DataSealer {
    pub(super) fn new(suite: Suite, bytes: &[u8; 32]) -> Result<DataSealer, SealError> {
        Ok(DataSealer {
            key: key(suite, bytes)?,
            next: AtomicU64::new(0),
        })
    }

    /// Encrypts `piece` in place under a fresh counter; returns the counter and tag
    /// the opener needs.
    pub fn seal(&self, piece: &mut [u8]) -> Result<(u64, [u8; TAG_BYTES]), SealError> {
        let counter = self.next.fetch_add(1, Ordering::Relaxed);
        if counter == u64::MAX {
            return Err(SealError::Exhausted("data"));
        }
        let tag: Tag = self
            .key
            .seal_in_place_separate_tag(nonce(counter), Aad::empty(), piece)
            .map_err(|_| SealError::Crypto("AEAD seal failed"))?;
        let mut out = [0u8; TAG_BYTES];
        out.copy_from_slice(tag.as_ref());
        Ok((counter, out))
    }
}

/// Opens pieces of file data the peer sealed.
#[derive(Debug)]
pub struct DataOpener {
    key: LessSafeKey,
}

impl DataOpener {
    pub(super) fn new(suite: Suite, bytes: &[u8; 32]) -> Result<DataOpener, SealError> {
        Ok(DataOpener {
            key: key(suite, bytes)?,
        })
    }

    /// Decrypts `piece` in place if it is the piece sealed under `counter` with `tag`;
    /// otherwise fails and `piece` holds no plaintext the caller may use.
    pub fn open(
        &self,
        counter: u64,
        piece: &mut [u8],
        tag: &[u8; TAG_BYTES],
    ) -> Result<(), SealError> {
        let tag = Tag::from(*tag);
        self.key
            .open_in_place_separate_tag(nonce(counter), Aad::empty(), tag, piece, 0..)
            .map(|_| ())
            .map_err(|_| SealError::Forged("piece of file data"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(suite: Suite) -> (ControlSealer, ControlOpener, DataSealer, DataOpener) {
        let k = [9u8; 32];
        (
            ControlSealer::new(suite, &k).unwrap(),
            ControlOpener::new(suite, &k).unwrap(),
            DataSealer::new(suite, &k).unwrap(),
            DataOpener::new(suite, &k).unwrap(),
        )
    }

    #[test]
    fn altered_replayed_reordered_and_dropped_records_do_not_open() {
        for suite in Suite::ALL {
            let (mut s, mut o, _, _) = keys(suite);
            let a = s.seal(b"first".to_vec()).unwrap();
            let b = s.seal(b"second".to_vec()).unwrap();
            let c = s.seal(b"third".to_vec()).unwrap();
            // Reordered: b before a.
            assert!(o.open(b.clone()).is_err());
            assert_eq!(o.open(a.clone()).unwrap(), b"first");
            // Replayed: a again.
            assert!(o.open(a).is_err());
            // Altered.
            let mut bad = b.clone();
            bad[0] ^= 1;
            assert!(o.open(bad).is_err());
            // Truncated (tag cut).
            assert!(o.open(b[..b.len() - 1].to_vec()).is_err());
            assert_eq!(o.open(b).unwrap(), b"second");
            assert_eq!(o.open(c).unwrap(), b"third");
            // Dropped: the fourth is lost, the fifth does not open in its place.
            let _lost = s.seal(b"fourth".to_vec()).unwrap();
            let e = s.seal(b"fifth".to_vec()).unwrap();
            assert!(o.open(e).is_err());
        }
    }

    #[test]
    fn data_pieces_need_their_own_counter_and_tag() {
        let (_, _, s, o) = keys(Suite::Aes256Gcm);
        let mut p1 = vec![1u8; 4096];
        let mut p2 = vec![2u8; 4096];
        let (n1, t1) = s.seal(&mut p1).unwrap();
        let (n2, t2) = s.seal(&mut p2).unwrap();
        assert_ne!(n1, n2);
        // Swapped pieces (an attacker moving ciphertext) do not open.
        let mut swapped = p2.clone();
        assert!(o.open(n1, &mut swapped, &t1).is_err());
        let mut flipped = p1.clone();
        flipped[100] ^= 0x80;
        assert!(o.open(n1, &mut flipped, &t1).is_err());
        o.open(n1, &mut p1, &t1).unwrap();
        o.open(n2, &mut p2, &t2).unwrap();
        assert_eq!((p1, p2), (vec![1u8; 4096], vec![2u8; 4096]));
    }
}
