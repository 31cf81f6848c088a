//! Keys, and the sealing and opening of control records.
//!
//! Nonce invariant: a key seals each counter value at most once, and a counter never
//! wraps (the last value, `u64::MAX`, is never used: the sealer fails first). Control
//! keys count records in order (the receiver expects the next value, so the counter is
//! never sent). In a session with key updates, a sealer gives way to the next
//! generation's key when its [`RekeyPolicy`] budget is spent (the caller sends the
//! peer a key-update record, the last one under the old key, then calls
//! [`ControlSealer::update`]); the opener updates when it opens that record, so both
//! sides switch at the same record and the counter starts again at 0 under a new key.

use std::time::Instant;

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, NONCE_LEN};

use super::keys::TrafficSecret;
use super::rekey::Budget;
use super::{RekeyPolicy, SealError, Suite};

/// Bytes of an authentication tag (both suites).
pub const TAG_BYTES: usize = 16;

/// An AEAD key and the IV its nonces are made from (RFC 8446 §5.3: the IV XOR the
/// 64-bit counter, big-endian, in its last 8 bytes).
pub(crate) struct TrafficKey {
    key: LessSafeKey,
    iv: [u8; NONCE_LEN],
}

impl std::fmt::Debug for TrafficKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrafficKey").finish_non_exhaustive()
    }
}

impl TrafficKey {
    pub(crate) fn new(
        suite: Suite,
        bytes: &[u8; 32],
        iv: [u8; NONCE_LEN],
    ) -> Result<TrafficKey, SealError> {
        let key = UnboundKey::new(suite.aead(), bytes)
            .map(LessSafeKey::new)
            .map_err(|_| SealError::Crypto("cannot make an AEAD key"))?;
        Ok(TrafficKey { key, iv })
    }

    pub(crate) fn nonce(&self, counter: u64) -> Nonce {
        let mut n = self.iv;
        for (b, c) in n[NONCE_LEN - 8..].iter_mut().zip(counter.to_be_bytes()) {
            *b ^= c;
        }
        Nonce::assume_unique_for_key(n)
    }

    pub(crate) fn aead(&self) -> &LessSafeKey {
        &self.key
    }
}

/// The counter after `counter`; `Exhausted` when `counter` is `u64::MAX`, which is
/// therefore never used.
pub(crate) fn advance(counter: u64, what: &'static str) -> Result<u64, SealError> {
    counter.checked_add(1).ok_or(SealError::Exhausted(what))
}

/// The updating half of a sealer: its secret, policy and what the key sealed.
#[derive(Debug)]
struct Updating {
    secret: TrafficSecret,
    policy: RekeyPolicy,
    budget: Budget,
}

/// Seals one direction's control messages, in order.
#[derive(Debug)]
pub struct ControlSealer {
    suite: Suite,
    key: TrafficKey,
    next: u64,
    /// `None`: one key for the whole session (a peer without key updates).
    updating: Option<Updating>,
}

impl ControlSealer {
    pub(super) fn new(
        suite: Suite,
        secret: TrafficSecret,
        rekey: Option<RekeyPolicy>,
    ) -> Result<ControlSealer, SealError> {
        let (key, updating) = match rekey {
            None => (secret.fixed_key(suite)?, None),
            Some(policy) => {
                let key = secret.key(suite)?;
                let budget = Budget::default();
                (
                    key,
                    Some(Updating {
                        secret,
                        policy,
                        budget,
                    }),
                )
            }
        };
        Ok(ControlSealer {
            suite,
            key,
            next: 0,
            updating,
        })
    }

    /// Seals `plaintext`, sealed at `now`, as the next record: the ciphertext followed by
    /// its tag. Fails rather than reuse a counter.
    pub fn seal(&mut self, now: Instant, mut plaintext: Vec<u8>) -> Result<Vec<u8>, SealError> {
        let counter = self.next;
        self.next = advance(counter, "control")?;
        if let Some(u) = &mut self.updating {
            u.budget.charge(now, plaintext.len());
        }
        self.key
            .aead()
            .seal_in_place_append_tag(self.key.nonce(counter), Aad::empty(), &mut plaintext)
            .map_err(|_| SealError::Crypto("AEAD seal failed"))?;
        Ok(plaintext)
    }

    /// Whether this key's budget is spent at `now`: the caller should seal a key-update
    /// record and then [`ControlSealer::update`]. Never, without key updates.
    pub fn update_due(&self, now: Instant) -> bool {
        self.updating
            .as_ref()
            .is_some_and(|u| u.budget.spent(&u.policy, now))
    }

    /// Moves to the next generation's key (the old key and secret are dropped), counter
    /// 0. Fails in a session without key updates.
    pub fn update(&mut self) -> Result<(), SealError> {
        let u = self
            .updating
            .take()
            .ok_or(SealError::KeyUpdate("this session does not update keys"))?;
        let secret = u.secret.next()?;
        self.key = secret.key(self.suite)?;
        self.next = 0;
        self.updating = Some(Updating {
            secret,
            policy: u.policy,
            budget: Budget::default(),
        });
        Ok(())
    }

    /// The generation of the key sealing now (0 without key updates).
    pub fn generation(&self) -> u32 {
        self.updating.as_ref().map_or(0, |u| u.secret.generation())
    }

    /// Whether the session updates keys (both sides have the `rekey` capability).
    pub fn updates(&self) -> bool {
        self.updating.is_some()
    }

    /// A sealer whose next counter is `next`, for tests of the limit.
    #[cfg(test)]
    pub(crate) fn at_counter(mut self, next: u64) -> ControlSealer {
        self.next = next;
        self
    }
}

/// Opens the peer's control messages, expecting them in the order they were sealed.
#[derive(Debug)]
pub struct ControlOpener {
    suite: Suite,
    key: TrafficKey,
    next: u64,
    /// `None`: one key for the whole session.
    secret: Option<TrafficSecret>,
}

impl ControlOpener {
    pub(super) fn new(
        suite: Suite,
        secret: TrafficSecret,
        updates: bool,
    ) -> Result<ControlOpener, SealError> {
        let (key, secret) = if updates {
            (secret.key(suite)?, Some(secret))
        } else {
            (secret.fixed_key(suite)?, None)
        };
        Ok(ControlOpener {
            suite,
            key,
            next: 0,
            secret,
        })
    }

    /// Opens `record`, which must be the next one the peer sealed. A failure is fatal
    /// to the session: the counter does not advance, and no later record opens.
    pub fn open(&mut self, mut record: Vec<u8>) -> Result<Vec<u8>, SealError> {
        let counter = self.next;
        let len = self
            .key
            .aead()
            .open_in_place(self.key.nonce(counter), Aad::empty(), &mut record)
            .map_err(|_| SealError::Forged("control message"))?
            .len();
        self.next = advance(counter, "control")?;
        record.truncate(len);
        Ok(record)
    }

    /// The peer's key-update record was just opened: the next record is sealed under
    /// the next generation's key, counter 0. Fails in a session without key updates.
    pub fn update(&mut self) -> Result<(), SealError> {
        let secret = self
            .secret
            .take()
            .ok_or(SealError::KeyUpdate(
                "the peer updated a key this session cannot update",
            ))?
            .next()?;
        self.key = secret.key(self.suite)?;
        self.next = 0;
        self.secret = Some(secret);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(suite: Suite, rekey: Option<RekeyPolicy>) -> (ControlSealer, ControlOpener) {
        let s = ControlSealer::new(suite, TrafficSecret::of([9; 32]), rekey).unwrap();
        let o = ControlOpener::new(suite, TrafficSecret::of([9; 32]), rekey.is_some()).unwrap();
        (s, o)
    }

    #[test]
    fn altered_replayed_reordered_and_dropped_records_do_not_open() {
        let now = Instant::now();
        for suite in Suite::ALL {
            for rekey in [None, Some(RekeyPolicy::default())] {
                let (mut s, mut o) = pair(suite, rekey);
                let a = s.seal(now, b"first".to_vec()).unwrap();
                let b = s.seal(now, b"second".to_vec()).unwrap();
                let c = s.seal(now, b"third".to_vec()).unwrap();
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
                let _lost = s.seal(now, b"fourth".to_vec()).unwrap();
                let e = s.seal(now, b"fifth".to_vec()).unwrap();
                assert!(o.open(e).is_err());
            }
        }
    }

    #[test]
    fn a_key_update_switches_both_sides_at_the_same_record_and_old_records_fail() {
        let now = Instant::now();
        let policy = RekeyPolicy {
            after_bytes: 10,
            ..RekeyPolicy::default()
        };
        let (mut s, mut o) = pair(Suite::Aes256Gcm, Some(policy));
        let first = s.seal(now, b"0123456789".to_vec()).unwrap();
        assert!(s.update_due(now), "10 bytes spend a 10-byte budget");
        let announce = s.seal(now, b"update".to_vec()).unwrap();
        s.update().unwrap();
        assert_eq!((s.generation(), s.update_due(now)), (1, false));
        let after = s.seal(now, b"new key".to_vec()).unwrap();
        o.open(first).unwrap();
        o.open(announce.clone()).unwrap();
        // Not updated yet: the next record does not open under the old key (a failed
        // open changes nothing)...
        assert!(o.open(after.clone()).is_err());
        o.update().unwrap();
        assert_eq!(o.open(after).unwrap(), b"new key");
        // ...and a record of the old key replayed after the update does not open.
        assert!(o.open(announce).is_err());
        // A session without updates refuses one.
        let (mut s, mut o) = pair(Suite::Aes256Gcm, None);
        assert!(!s.update_due(now + std::time::Duration::from_secs(1 << 20)));
        assert!(matches!(s.update(), Err(SealError::KeyUpdate(_))));
        assert!(matches!(o.update(), Err(SealError::KeyUpdate(_))));
    }

    #[test]
    fn a_counter_at_its_limit_fails_and_never_wraps() {
        let now = Instant::now();
        let (s, mut o) = pair(Suite::ChaCha20Poly1305, None);
        let mut s = s.at_counter(u64::MAX - 1);
        let last = s.seal(now, b"last".to_vec()).unwrap();
        for _ in 0..3 {
            assert_eq!(
                s.seal(now, b"x".to_vec()),
                Err(SealError::Exhausted("control"))
            );
        }
        // The failed seals did not advance (or wrap) the counter.
        assert_eq!(s.next, u64::MAX);
        o.next = u64::MAX - 1;
        assert_eq!(o.open(last).unwrap(), b"last");
        assert_eq!(o.next, u64::MAX);
        // With updates, the record limit makes the key give way long before.
        let (mut s, _) = pair(Suite::Aes256Gcm, Some(RekeyPolicy::default()));
        for _ in 0..super::super::rekey::RECORD_LIMIT {
            s.updating.as_mut().unwrap().budget.charge(now, 0);
        }
        assert!(s.update_due(now));
    }
}
