//! Sealing and opening of pieces of file data, with key updates that never pause a
//! transfer.
//!
//! Pieces are sealed concurrently and announced (counter, tag, generation) in the
//! ordered control stream, not necessarily in the order they were sealed. So a data
//! key cannot simply be replaced: a piece sealed under generation `g` may be announced
//! after one sealed under `g + 1`. Instead:
//!
//! - the sealer ([`DataSealer`]) moves to the next generation when its budget is
//!   spent, and keeps every older generation that a sealed piece still holds (a
//!   [`SealedPiece`] holds its key until the caller drops it, after its announcement
//!   was sent); [`DataSealer::retired`] hands out, oldest first, the generations no
//!   piece holds any more, and the caller announces each retirement in the control
//!   stream, after every announcement of a piece of that generation;
//! - the opener ([`DataOpener`]) keeps the keys of every generation from the oldest
//!   not retired to the newest announced. It resolves a piece's key when its
//!   announcement is read ([`DataOpener::key`], in stream order, so before that
//!   generation's retirement), and the piece holds that key until it is opened. A
//!   retired generation's key is dropped from the opener at once and freed when the
//!   last piece holding it is opened; its generation is never accepted again.
//!
//! At most [`MAX_LIVE_KEYS`] generations are live on either side: a sealer with that
//! many keeps sealing under its current key (up to the hard counter limit), and an
//! opener refuses a peer that announces more.
//!
//! Each piece's associated data binds it to where it belongs ([`Binding`]), so a
//! piece moved to another registration, offset or length, or another direction or
//! generation, does not open.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ring::aead::{Aad, Tag};

use super::keys::TrafficSecret;
use super::record::{advance, TrafficKey};
use super::rekey::Budget;
use super::{RekeyPolicy, SealError, Suite, TAG_BYTES};

/// Most data-key generations live at once per direction.
pub const MAX_LIVE_KEYS: usize = 64;

/// Bytes of a piece's associated data.
const AD_BYTES: usize = 21;

/// Where a piece of file data belongs: the owner's registration (`rkey`, never reused
/// within a session, so it names one transfer's window or one mapped file), the
/// address in it (so the file offset), and the length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binding {
    /// The registration's key.
    pub rkey: u32,
    /// The piece's first byte, in the registration's address space.
    pub addr: u64,
    /// The piece's length.
    pub len: u32,
}

/// One generation's key for pieces of one direction.
#[derive(Debug)]
pub struct PieceKey {
    generation: u32,
    key: TrafficKey,
    /// Whether the client sealed under it (the direction, in the associated data).
    client_sealed: bool,
    /// Whether pieces carry associated data (sessions with key updates).
    bound: bool,
}

impl PieceKey {
    /// Its generation.
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// The associated data of a piece at `at`: direction (1 byte, 1 when the client
    /// sealed), generation (u32), rkey (u32), addr (u64), len (u32), little-endian.
    /// Empty in a session without key updates.
    fn ad(&self, at: &Binding) -> ([u8; AD_BYTES], usize) {
        let mut ad = [0u8; AD_BYTES];
        ad[0] = u8::from(self.client_sealed);
        ad[1..5].copy_from_slice(&self.generation.to_le_bytes());
        ad[5..9].copy_from_slice(&at.rkey.to_le_bytes());
        ad[9..17].copy_from_slice(&at.addr.to_le_bytes());
        ad[17..21].copy_from_slice(&at.len.to_le_bytes());
        (ad, if self.bound { AD_BYTES } else { 0 })
    }

    /// Decrypts `piece` in place if it is the piece sealed for `at` under `counter`
    /// with `tag`; otherwise fails and `piece` holds no plaintext the caller may use.
    pub fn open(
        &self,
        counter: u64,
        at: &Binding,
        piece: &mut [u8],
        tag: &[u8; TAG_BYTES],
    ) -> Result<(), SealError> {
        let (ad, len) = self.ad(at);
        self.key
            .aead()
            .open_in_place_separate_tag(
                self.key.nonce(counter),
                Aad::from(&ad[..len]),
                Tag::from(*tag),
                piece,
                0..,
            )
            .map(|_| ())
            .map_err(|_| SealError::Forged("piece of file data"))
    }
}

/// A piece just sealed: what its announcement carries. It holds its generation's key
/// live on the sealing side until it is dropped, which the caller does once the
/// announcement has been sent.
#[derive(Debug)]
pub struct SealedPiece {
    /// The counter it was sealed under.
    pub counter: u64,
    /// Its tag.
    pub tag: [u8; TAG_BYTES],
    key: Arc<PieceKey>,
}

impl SealedPiece {
    /// The generation of the key it was sealed under.
    pub fn generation(&self) -> u32 {
        self.key.generation
    }
}

fn piece_key(
    suite: Suite,
    secret: &TrafficSecret,
    client_sealed: bool,
    bound: bool,
) -> Result<Arc<PieceKey>, SealError> {
    let key = if bound {
        secret.key(suite)?
    } else {
        secret.fixed_key(suite)?
    };
    Ok(Arc::new(PieceKey {
        generation: secret.generation(),
        key,
        client_sealed,
        bound,
    }))
}

#[derive(Debug)]
struct SendState {
    current: Arc<PieceKey>,
    next: u64,
    /// The secret of `current` and the policy (none without key updates).
    updating: Option<(TrafficSecret, RekeyPolicy)>,
    budget: Budget,
    /// Older generations, oldest first, not yet retired.
    retiring: VecDeque<Arc<PieceKey>>,
}

/// Seals pieces of file data; shared by concurrent sealers.
#[derive(Debug)]
pub struct DataSealer {
    suite: Suite,
    client: bool,
    state: Mutex<SendState>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl DataSealer {
    pub(super) fn new(
        suite: Suite,
        secret: TrafficSecret,
        client: bool,
        rekey: Option<RekeyPolicy>,
    ) -> Result<DataSealer, SealError> {
        let current = piece_key(suite, &secret, client, rekey.is_some())?;
        let state = SendState {
            current,
            next: 0,
            updating: rekey.map(|p| (secret, p)),
            budget: Budget::default(),
            retiring: VecDeque::new(),
        };
        Ok(DataSealer {
            suite,
            client,
            state: Mutex::new(state),
        })
    }

    /// Encrypts `piece` (bound to `at`) in place under a fresh counter, at `now`,
    /// moving to the next generation first if the current key's budget is spent.
    /// Fails rather than reuse a counter.
    pub fn seal(
        &self,
        now: Instant,
        at: &Binding,
        piece: &mut [u8],
    ) -> Result<SealedPiece, SealError> {
        let (key, counter) = {
            let mut s = lock(&self.state);
            self.maybe_update(&mut s, now)?;
            let counter = s.next;
            s.next = advance(counter, "data")?;
            s.budget.charge(now, piece.len());
            (s.current.clone(), counter)
        };
        let (ad, len) = key.ad(at);
        let tag = key
            .key
            .aead()
            .seal_in_place_separate_tag(key.key.nonce(counter), Aad::from(&ad[..len]), piece)
            .map_err(|_| SealError::Crypto("AEAD seal failed"))?;
        let mut out = [0u8; TAG_BYTES];
        out.copy_from_slice(tag.as_ref());
        Ok(SealedPiece {
            counter,
            tag: out,
            key,
        })
    }

    fn maybe_update(&self, s: &mut SendState, now: Instant) -> Result<(), SealError> {
        let Some((_, policy)) = &s.updating else {
            return Ok(());
        };
        if !s.budget.spent(policy, now) || s.retiring.len() + 1 >= MAX_LIVE_KEYS {
            return Ok(());
        }
        let Some((secret, policy)) = s.updating.take() else {
            return Ok(());
        };
        let secret = secret.next()?;
        let key = piece_key(self.suite, &secret, self.client, true)?;
        let old = std::mem::replace(&mut s.current, key);
        s.retiring.push_back(old);
        s.updating = Some((secret, policy));
        s.next = 0;
        s.budget = Budget::default();
        Ok(())
    }

    /// The oldest generation that no sealed piece holds any more, now retired: the
    /// caller announces it after every announcement of its pieces. `None` while the
    /// oldest is still held (retirements go in order).
    pub fn retired(&self) -> Option<u32> {
        let mut s = lock(&self.state);
        let oldest = s.retiring.front()?;
        if Arc::strong_count(oldest) > 1 {
            return None;
        }
        s.retiring.pop_front().map(|k| k.generation)
    }

    /// The generation sealing now (0 without key updates).
    pub fn generation(&self) -> u32 {
        lock(&self.state).current.generation
    }

    /// A sealer whose next counter is `next`, for tests of the limit.
    #[cfg(test)]
    pub(crate) fn at_counter(self, next: u64) -> DataSealer {
        lock(&self.state).next = next;
        self
    }
}

#[derive(Debug)]
struct RecvState {
    /// Generations `lo ..= secret's`, in order (empty when `lo` is one past it).
    keys: VecDeque<Arc<PieceKey>>,
    /// The oldest generation not retired.
    lo: u32,
    /// The newest generation's secret (none without key updates).
    secret: Option<TrafficSecret>,
}

/// Opens pieces of file data the peer sealed.
#[derive(Debug)]
pub struct DataOpener {
    suite: Suite,
    client_sealed: bool,
    state: Mutex<RecvState>,
}

impl DataOpener {
    pub(super) fn new(
        suite: Suite,
        secret: TrafficSecret,
        client_sealed: bool,
        updates: bool,
    ) -> Result<DataOpener, SealError> {
        let first = piece_key(suite, &secret, client_sealed, updates)?;
        let state = RecvState {
            keys: VecDeque::from([first]),
            lo: 0,
            secret: updates.then_some(secret),
        };
        Ok(DataOpener {
            suite,
            client_sealed,
            state: Mutex::new(state),
        })
    }

    /// The key of `generation`, for a piece whose announcement was just read (in
    /// stream order). A newer generation than any seen derives the keys up to it; a
    /// retired one, or one that would make more than [`MAX_LIVE_KEYS`] live, fails.
    pub fn key(&self, generation: u32) -> Result<Arc<PieceKey>, SealError> {
        let mut s = lock(&self.state);
        if generation < s.lo {
            return Err(SealError::KeyUpdate("a piece sealed under a retired key"));
        }
        loop {
            let index = (generation - s.lo) as usize;
            if let Some(key) = s.keys.get(index) {
                return Ok(key.clone());
            }
            if s.keys.len() >= MAX_LIVE_KEYS {
                return Err(SealError::KeyUpdate(
                    "the peer keeps too many data keys live",
                ));
            }
            self.step(&mut s)?;
        }
    }

    /// Derives the next generation's key.
    fn step(&self, s: &mut RecvState) -> Result<(), SealError> {
        let secret = s
            .secret
            .take()
            .ok_or(SealError::KeyUpdate(
                "a piece of a key generation this session does not have",
            ))?
            .next()?;
        s.keys
            .push_back(piece_key(self.suite, &secret, self.client_sealed, true)?);
        s.secret = Some(secret);
        Ok(())
    }

    /// The peer retired `generation`, which must be the oldest live one: no later
    /// piece is sealed under it, and its key goes once the pieces holding it are
    /// opened.
    pub fn retire(&self, generation: u32) -> Result<(), SealError> {
        let mut s = lock(&self.state);
        if s.secret.is_none() {
            return Err(SealError::KeyUpdate("this session does not update keys"));
        }
        if generation != s.lo {
            return Err(SealError::KeyUpdate("data keys retired out of order"));
        }
        if s.keys.is_empty() {
            // Never announced a piece under it: step past it.
            self.step(&mut s)?;
        }
        s.keys.pop_front();
        s.lo =
            s.lo.checked_add(1)
                .ok_or(SealError::Exhausted("key generation"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AT: Binding = Binding {
        rkey: 3,
        addr: 0x10_0000,
        len: 4096,
    };

    fn pair(rekey: Option<RekeyPolicy>) -> (DataSealer, DataOpener) {
        let suite = Suite::Aes256Gcm;
        let s = DataSealer::new(suite, TrafficSecret::of([5; 32]), true, rekey).unwrap();
        let o = DataOpener::new(suite, TrafficSecret::of([5; 32]), true, rekey.is_some()).unwrap();
        (s, o)
    }

    fn policy(after_bytes: u64) -> Option<RekeyPolicy> {
        Some(RekeyPolicy {
            after_bytes,
            ..RekeyPolicy::default()
        })
    }

    /// Opens `bytes` sealed as `p` for `at`; returns whether it opened.
    fn opens(o: &DataOpener, p: &SealedPiece, at: Binding, bytes: &[u8]) -> bool {
        let mut b = bytes.to_vec();
        let key = o.key(p.generation()).unwrap();
        key.open(p.counter, &at, &mut b, &p.tag).is_ok()
    }

    #[test]
    fn a_piece_moved_to_another_offset_registration_or_direction_does_not_open() {
        let now = Instant::now();
        let (s, o) = pair(Some(RekeyPolicy::default()));
        let mut piece = vec![7u8; 4096];
        let p = s.seal(now, &AT, &mut piece).unwrap();
        for moved in [
            Binding {
                addr: AT.addr + 4096,
                ..AT
            },
            Binding { rkey: 4, ..AT },
            Binding { len: 4095, ..AT },
        ] {
            assert!(!opens(&o, &p, moved, &piece), "{moved:?}");
        }
        // The server's opener of the client's pieces, given the client's own piece
        // back as if the server had sealed it (a reflected piece).
        let reflected =
            DataOpener::new(Suite::Aes256Gcm, TrafficSecret::of([5; 32]), false, true).unwrap();
        assert!(!opens(&reflected, &p, AT, &piece));
        assert!(opens(&o, &p, AT, &piece));
        // Swapped pieces (an attacker moving ciphertext) and flipped bits do not open.
        let mut other = vec![8u8; 4096];
        let q = s.seal(now, &AT, &mut other).unwrap();
        assert!(!opens(&o, &p, AT, &other));
        let mut flipped = piece.clone();
        flipped[100] ^= 0x80;
        assert!(!opens(&o, &p, AT, &flipped));
        let mut b = other.clone();
        o.key(0)
            .unwrap()
            .open(q.counter, &AT, &mut b, &q.tag)
            .unwrap();
        assert_eq!(b, vec![8u8; 4096]);
        // Without key updates (an older peer) pieces carry no associated data, as
        // before.
        let (s, o) = pair(None);
        let p = s.seal(now, &AT, &mut piece).unwrap();
        assert!(opens(&o, &p, Binding { rkey: 9, ..AT }, &piece));
    }

    #[test]
    fn generations_live_until_retired_in_order_and_pieces_open_across_updates() {
        let now = Instant::now();
        let (s, o) = pair(policy(8192));
        let mut bytes: Vec<Vec<u8>> = (0..6u8).map(|i| vec![i; 4096]).collect();
        // Two pieces per generation: 0, 0, 1, 1, 2, 2.
        let sealed: Vec<SealedPiece> = bytes
            .iter_mut()
            .map(|b| s.seal(now, &AT, b).unwrap())
            .collect();
        let gens: Vec<u32> = sealed.iter().map(|p| p.generation()).collect();
        assert_eq!(gens, [0, 0, 1, 1, 2, 2]);
        assert_eq!(
            (sealed[2].counter, sealed[4].counter),
            (0, 0),
            "counters restart"
        );
        // Nothing retires while a piece of generation 0 is held.
        assert_eq!(s.retired(), None);
        // Announced out of order: generation 2 first, then 0 (the opener keeps both).
        let mut sealed: Vec<Option<SealedPiece>> = sealed.into_iter().map(Some).collect();
        for i in [4, 5, 0, 2, 1, 3] {
            let p = sealed[i].take().unwrap();
            assert!(opens(&o, &p, AT, &bytes[i]), "piece {i}");
            // Announced: the sealer lets go of it.
            drop(p);
            if i == 1 {
                assert_eq!(s.retired(), Some(0));
                o.retire(0).unwrap();
            }
        }
        assert_eq!((s.retired(), s.retired()), (Some(1), None), "2 is current");
        o.retire(1).unwrap();
        // A retired generation is never accepted again; retirements go in order.
        assert!(matches!(o.key(0), Err(SealError::KeyUpdate(_))));
        assert!(matches!(o.retire(3), Err(SealError::KeyUpdate(_))));
        assert_eq!(s.generation(), 2);
    }

    #[test]
    fn an_opener_refuses_too_many_live_generations_and_a_sealer_never_makes_them() {
        let (_, o) = pair(policy(1));
        o.key(MAX_LIVE_KEYS as u32 - 1).unwrap();
        assert!(matches!(
            o.key(MAX_LIVE_KEYS as u32),
            Err(SealError::KeyUpdate(_))
        ));
        // A sealer whose pieces are all still held stops updating at the bound.
        let now = Instant::now();
        let (s, _) = pair(policy(1));
        let held: Vec<SealedPiece> = (0..2 * MAX_LIVE_KEYS)
            .map(|_| s.seal(now, &AT, &mut [0u8; 16]).unwrap())
            .collect();
        assert_eq!(s.generation(), MAX_LIVE_KEYS as u32 - 1);
        drop(held);
        assert_eq!(s.retired(), Some(0));
        // Without key updates there are no other generations.
        let (_, o) = pair(None);
        assert!(o.key(1).is_err() && o.retire(0).is_err());
    }

    #[test]
    fn a_data_counter_at_its_limit_fails_or_updates_and_never_wraps() {
        let now = Instant::now();
        let (s, o) = pair(None);
        let s = s.at_counter(u64::MAX - 1);
        let mut last = vec![1u8; 64];
        let p = s.seal(now, &AT, &mut last).unwrap();
        assert_eq!(p.counter, u64::MAX - 1);
        for _ in 0..3 {
            let e = s.seal(now, &AT, &mut [0u8; 64]).unwrap_err();
            assert_eq!(e, SealError::Exhausted("data"));
        }
        assert!(opens(&o, &p, AT, &last));
        // With key updates, a key whose budget is spent gives way: counter 0 again.
        let (s, _) = pair(policy(64));
        let s = s.at_counter(1000);
        assert_eq!(s.seal(now, &AT, &mut [0u8; 64]).unwrap().counter, 1000);
        let p = s.seal(now, &AT, &mut [0u8; 64]).unwrap();
        assert_eq!((p.generation(), p.counter), (1, 0));
    }
}
