//! Window geometry and bookkeeping of transfers.
//!
//! A file moves in windows: runs of whole chunks (the last window may end with a short
//! chunk at end of file). A window is the unit of registration — the client registers
//! one window of memory, advertises it, and revokes it when the window completes — and
//! chunks are the unit of hashing, verification and one-sided transfer.
//!
//! - [`WindowPlan`] (client) yields the windows of a file, a bounded number in flight,
//!   leaving out chunks the client already holds (a resumed download).
//! - [`check_window`] (server) validates a window a client asks for.
//! - [`UploadState`] (server) tracks which chunks of an upload verified and decides
//!   whether it may commit.

use std::collections::{BTreeMap, BTreeSet};

use super::ProtoError;
use crate::chunk::manifest_id;
use crate::msg::{Hash256, HashAlgorithm};

/// A window: file bytes `offset..offset + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// File offset of the first byte (a multiple of the chunk size).
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// One chunk of a window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkRef {
    /// Index of the chunk in the file.
    pub index: u64,
    /// Offset of the chunk from the start of the window.
    pub window_offset: u64,
    /// Length of the chunk in bytes.
    pub len: u32,
}

impl Window {
    /// The chunks of this window, in order.
    pub fn chunks(&self, chunk_bytes: u32) -> impl Iterator<Item = ChunkRef> + '_ {
        let c = u64::from(chunk_bytes);
        let first = self.offset / c;
        (0..self.len.div_ceil(c)).map(move |i| ChunkRef {
            index: first + i,
            window_offset: i * c,
            len: (self.len - i * c).min(c) as u32,
        })
    }

    /// Number of chunks in this window.
    pub fn chunk_count(&self, chunk_bytes: u32) -> usize {
        self.len.div_ceil(u64::from(chunk_bytes)) as usize
    }
}

/// Checks that `offset..offset + len` is a window of a `size`-byte file: chunk-aligned,
/// non-empty, inside the file, at most `max_chunks` chunks, and ending on a chunk
/// boundary unless it ends at end of file.
pub fn check_window(
    size: u64,
    chunk_bytes: u32,
    max_chunks: usize,
    offset: u64,
    len: u64,
) -> Result<Window, ProtoError> {
    let c = u64::from(chunk_bytes);
    let bad = |why: &str| {
        Err(ProtoError::Transfer(format!(
            "bad window {offset}+{len} of a {size}-byte file: {why}"
        )))
    };
    if len == 0 {
        return bad("empty");
    }
    if offset % c != 0 {
        return bad("offset not chunk-aligned");
    }
    let Some(end) = offset.checked_add(len) else {
        return bad("overflows");
    };
    if end > size {
        return bad("past end of file");
    }
    if len > c * max_chunks as u64 {
        return bad("too many chunks");
    }
    if len % c != 0 && end != size {
        return bad("ends inside a chunk");
    }
    Ok(Window { offset, len })
}

/// The client's schedule of windows for one file.
///
/// Invariant: between calls, `next_offset` is the end of the file or the start of a
/// chunk that is not skipped, so every window yielded starts on a chunk to fetch and
/// runs over consecutive chunks to fetch only.
#[derive(Debug, Clone)]
pub struct WindowPlan {
    size: u64,
    chunk_bytes: u64,
    window_bytes: u64,
    next_offset: u64,
    in_flight: BTreeSet<u64>,
    max_in_flight: usize,
    done_bytes: u64,
    skip: BTreeSet<u64>,
}

impl WindowPlan {
    /// Plans a `size`-byte file in windows of `window_chunks` chunks with at most
    /// `max_in_flight` (>= 1) outstanding.
    pub fn new(size: u64, chunk_bytes: u32, window_chunks: usize, max_in_flight: usize) -> Self {
        WindowPlan {
            size,
            chunk_bytes: u64::from(chunk_bytes.max(1)),
            window_bytes: u64::from(chunk_bytes) * window_chunks.max(1) as u64,
            next_offset: 0,
            in_flight: BTreeSet::new(),
            max_in_flight: max_in_flight.max(1),
            done_bytes: 0,
            skip: BTreeSet::new(),
        }
    }

    /// Leaves the chunks with these indices out of every window (the client holds
    /// them already). Call before the first [`WindowPlan::poll_window`].
    pub fn skipping(mut self, chunks: BTreeSet<u64>) -> Self {
        self.skip = chunks;
        self.pass_skipped();
        self
    }

    /// Moves `next_offset` past chunks to skip.
    fn pass_skipped(&mut self) {
        while self.next_offset < self.size
            && self.skip.contains(&(self.next_offset / self.chunk_bytes))
        {
            self.next_offset = (self.next_offset + self.chunk_bytes).min(self.size);
        }
    }

    /// The next window to start, if the in-flight limit allows one.
    pub fn poll_window(&mut self) -> Option<Window> {
        if self.in_flight.len() >= self.max_in_flight || self.next_offset >= self.size {
            return None;
        }
        let start = self.next_offset;
        let limit = (start + self.window_bytes).min(self.size);
        let mut end = start;
        while end < limit && !self.skip.contains(&(end / self.chunk_bytes)) {
            end = (end + self.chunk_bytes).min(self.size);
        }
        let w = Window {
            offset: start,
            len: end - start,
        };
        self.next_offset = end;
        self.pass_skipped();
        self.in_flight.insert(w.offset);
        Some(w)
    }

    /// Records that the window at `offset` of `len` bytes completed.
    pub fn handle_window_done(&mut self, w: Window) -> Result<(), ProtoError> {
        if !self.in_flight.remove(&w.offset) {
            return Err(ProtoError::Transfer(format!(
                "window at {} was not in flight",
                w.offset
            )));
        }
        self.done_bytes += w.len;
        Ok(())
    }

    /// True when every window completed.
    pub fn is_complete(&self) -> bool {
        self.in_flight.is_empty() && self.next_offset >= self.size
    }

    /// Bytes in completed windows.
    pub fn done_bytes(&self) -> u64 {
        self.done_bytes
    }

    /// Largest window this plan yields, in bytes.
    pub fn window_bytes(&self) -> u64 {
        self.window_bytes
    }
}

/// Checks the hashes `got` that a receiver computed of a window's chunks against the
/// hashes the sender `announced` for them. Returns the file index of the first chunk
/// that does not match (a missing or extra hash counts as a mismatch there).
pub fn check_window_hashes(
    w: Window,
    chunk_bytes: u32,
    announced: &[Hash256],
    got: &[Hash256],
) -> Result<(), u64> {
    let first = w.offset / u64::from(chunk_bytes.max(1));
    match (0..announced.len().max(got.len())).find(|&i| announced.get(i) != got.get(i)) {
        Some(bad) => Err(first + bad as u64),
        None => Ok(()),
    }
}

/// Progress of one chunk of an upload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    /// Part of a window being pulled now; the client announced this hash for it.
    Busy(Hash256),
    /// Pulled, verified against this hash, and written.
    Verified(Hash256),
}

/// The server's record of one upload: which chunks verified, with what hash.
///
/// Memory grows with the chunks actually pulled, never with the size a client claims,
/// so a hostile `size` cannot make the server allocate.
#[derive(Debug, Clone)]
pub struct UploadState {
    /// The algorithm of every chunk hash and of the manifest hash.
    algorithm: HashAlgorithm,
    size: u64,
    chunk_bytes: u32,
    max_window_chunks: usize,
    chunks: BTreeMap<u64, ChunkState>,
}

impl UploadState {
    /// A new upload of a `size`-byte file whose hashes are in `algorithm`.
    pub fn new(
        algorithm: HashAlgorithm,
        size: u64,
        chunk_bytes: u32,
        max_window_chunks: usize,
    ) -> Self {
        UploadState {
            algorithm,
            size,
            chunk_bytes,
            max_window_chunks,
            chunks: BTreeMap::new(),
        }
    }

    /// The file size announced at open.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The algorithm of the upload's hashes.
    pub fn algorithm(&self) -> HashAlgorithm {
        self.algorithm
    }

    /// Validates a window request: geometry, one hash per chunk, and no chunk already
    /// verified or being pulled. Marks the window's chunks busy, expecting `hashes`.
    pub fn handle_window(
        &mut self,
        offset: u64,
        len: u64,
        hashes: &[Hash256],
    ) -> Result<Window, ProtoError> {
        let w = check_window(
            self.size,
            self.chunk_bytes,
            self.max_window_chunks,
            offset,
            len,
        )?;
        if hashes.len() != w.chunk_count(self.chunk_bytes) {
            return Err(ProtoError::Transfer(format!(
                "window at {offset} has {} chunks but {} hashes",
                w.chunk_count(self.chunk_bytes),
                hashes.len()
            )));
        }
        if w.chunks(self.chunk_bytes)
            .any(|c| self.chunks.contains_key(&c.index))
        {
            return Err(ProtoError::Transfer(format!(
                "window at {offset} overlaps chunks already pulled or in progress"
            )));
        }
        for (c, h) in w.chunks(self.chunk_bytes).zip(hashes) {
            self.chunks.insert(c.index, ChunkState::Busy(*h));
        }
        Ok(w)
    }

    /// The hash the client announced for chunk `index` of a busy window.
    pub fn expected(&self, index: u64) -> Option<Hash256> {
        match self.chunks.get(&index) {
            Some(ChunkState::Busy(h)) => Some(*h),
            _ => None,
        }
    }

    /// Records that chunk `index` of a busy window was pulled and hashed as `got`. It
    /// is verified only if `got` is the hash the client announced; otherwise the chunk
    /// stays busy and the error says it is damaged ([`ProtoError::ChunkMismatch`]): the
    /// driver then fails the window ([`UploadState::handle_window_failed`]).
    pub fn handle_chunk_pulled(&mut self, index: u64, got: Hash256) -> Result<(), ProtoError> {
        match self.chunks.get_mut(&index) {
            Some(state @ ChunkState::Busy(_)) if *state == ChunkState::Busy(got) => {
                *state = ChunkState::Verified(got);
                Ok(())
            }
            Some(ChunkState::Busy(_)) => Err(ProtoError::ChunkMismatch(index)),
            _ => Err(ProtoError::Transfer(format!(
                "chunk {index} verified but was not being pulled"
            ))),
        }
    }

    /// Forgets the busy or verified chunks of a window that failed, so it can be sent
    /// again.
    pub fn handle_window_failed(&mut self, w: Window) {
        for c in w.chunks(self.chunk_bytes) {
            self.chunks.remove(&c.index);
        }
    }

    /// Bytes verified so far.
    pub fn verified_bytes(&self) -> u64 {
        self.chunks
            .iter()
            .filter(|(_, s)| matches!(s, ChunkState::Verified(_)))
            .map(|(&i, _)| crate::chunk::chunk_len(self.size, self.chunk_bytes, i))
            .sum()
    }

    /// Decides whether the upload may be committed: every chunk verified and the
    /// client's manifest hash equal to the one of the verified chunks. Returns the
    /// verified chunk hashes, in order.
    pub fn commit(&self, manifest: &Hash256) -> Result<Vec<Hash256>, ProtoError> {
        let count = crate::chunk::chunk_count(self.size, self.chunk_bytes);
        let hashes: Vec<Hash256> = self
            .chunks
            .values()
            .filter_map(|s| match s {
                ChunkState::Verified(h) => Some(*h),
                ChunkState::Busy(_) => None,
            })
            .collect();
        if hashes.len() as u64 != count || self.chunks.len() as u64 != count {
            return Err(ProtoError::Transfer(format!(
                "commit with {} of {count} chunks verified",
                hashes.len()
            )));
        }
        if manifest_id(self.algorithm, self.size, self.chunk_bytes, &hashes) != *manifest {
            return Err(ProtoError::Transfer(
                "manifest hash does not match the verified chunks".into(),
            ));
        }
        Ok(hashes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk::{hash_chunk, Manifest};

    const C: u32 = 4096;

    #[test]
    fn windows_tile_the_file() {
        for size in [1u64, 4095, 4096, 4097, 10 * 4096 + 3, 64 * 4096] {
            let mut plan = WindowPlan::new(size, C, 4, 2);
            let mut seen = Vec::new();
            while !plan.is_complete() {
                let mut started = Vec::new();
                while let Some(w) = plan.poll_window() {
                    check_window(size, C, 4, w.offset, w.len).unwrap();
                    started.push(w);
                }
                assert!(started.len() <= 2);
                for w in started {
                    plan.handle_window_done(w).unwrap();
                    seen.push(w);
                }
            }
            assert_eq!(seen.iter().map(|w| w.len).sum::<u64>(), size);
            assert_eq!(plan.done_bytes(), size);
            let chunks: Vec<u64> = seen
                .iter()
                .flat_map(|w| w.chunks(C))
                .map(|c| c.index)
                .collect();
            assert_eq!(
                chunks,
                (0..crate::chunk::chunk_count(size, C)).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn skipped_chunks_are_left_out_of_the_windows() {
        let size = 20 * 4096 + 3; // chunks 0..=20
        let skip = BTreeSet::from([0, 1, 5, 6, 7, 8, 9, 20]);
        let mut plan = WindowPlan::new(size, C, 4, 100).skipping(skip.clone());
        let mut windows = Vec::new();
        while let Some(w) = plan.poll_window() {
            check_window(size, C, 4, w.offset, w.len).unwrap();
            windows.push(w);
        }
        let chunks: Vec<u64> = windows
            .iter()
            .flat_map(|w| w.chunks(C))
            .map(|c| c.index)
            .collect();
        let want: Vec<u64> = (0..=20).filter(|i| !skip.contains(i)).collect();
        assert_eq!(chunks, want);
        // Runs split at skipped chunks and at the window limit.
        let starts: Vec<u64> = windows.iter().map(|w| w.offset / 4096).collect();
        assert_eq!(starts, vec![2, 10, 14, 18]);
        for w in windows {
            plan.handle_window_done(w).unwrap();
        }
        assert!(plan.is_complete());

        // Everything held: nothing to fetch.
        let mut plan = WindowPlan::new(size, C, 4, 2).skipping((0..=20).collect());
        assert!(plan.poll_window().is_none());
        assert!(plan.is_complete());
    }

    #[test]
    fn empty_file_has_no_windows() {
        let mut plan = WindowPlan::new(0, C, 4, 2);
        assert!(plan.poll_window().is_none());
        assert!(plan.is_complete());
        let s = UploadState::new(HashAlgorithm::Blake3, 0, C, 4);
        s.commit(&manifest_id(HashAlgorithm::Blake3, 0, C, &[]))
            .unwrap();
    }

    #[test]
    fn bad_windows_are_refused() {
        let size = 10 * 4096 + 3;
        assert!(check_window(size, C, 4, 1, 4096).is_err()); // unaligned
        assert!(check_window(size, C, 4, 0, 0).is_err()); // empty
        assert!(check_window(size, C, 4, 0, 5 * 4096).is_err()); // too many chunks
        assert!(check_window(size, C, 4, 0, 4000).is_err()); // ends inside a chunk
        assert!(check_window(size, C, 4, 8 * 4096, 3 * 4096).is_err()); // past the end
        assert!(check_window(size, C, 4, u64::MAX - 4095, 4096).is_err()); // overflow
        assert!(check_window(size, C, 4, 8 * 4096, 2 * 4096 + 3).is_ok()); // tail
    }

    #[test]
    fn duplicate_and_mismatched_windows_are_refused() {
        let mut s = UploadState::new(HashAlgorithm::Blake3, 3 * 4096, C, 4);
        assert!(s.handle_window(0, 2 * 4096, &[[0; 32]]).is_err()); // one hash short
        let w = s.handle_window(0, 2 * 4096, &[[0; 32]; 2]).unwrap();
        assert!(s.handle_window(4096, 2 * 4096, &[[0; 32]; 2]).is_err()); // overlap
        s.handle_window_failed(w);
        assert!(s.handle_window(0, 2 * 4096, &[[0; 32]; 2]).is_ok());
        assert!(s.handle_chunk_pulled(2, [0; 32]).is_err()); // not busy
        assert_eq!(s.expected(0), Some([0; 32]));
        assert_eq!(
            s.handle_chunk_pulled(1, [1; 32]),
            Err(ProtoError::ChunkMismatch(1))
        );
        assert_eq!(s.expected(1), Some([0; 32])); // still busy, not verified
    }

    #[test]
    fn commit_needs_every_chunk_and_the_right_manifest() {
        let data: Vec<u8> = (0..3 * 4096 + 10).map(|i| i as u8).collect();
        let hashes: Vec<Hash256> = data
            .chunks(C as usize)
            .map(|c| hash_chunk(HashAlgorithm::Blake3, c))
            .collect();
        let m = Manifest {
            algorithm: HashAlgorithm::Blake3,
            size: data.len() as u64,
            chunk_bytes: C,
            hashes: hashes.clone(),
        };
        let mut s = UploadState::new(HashAlgorithm::Blake3, m.size, C, 2);
        s.handle_window(0, 2 * 4096, &hashes[..2]).unwrap();
        s.handle_chunk_pulled(0, hashes[0]).unwrap();
        s.handle_chunk_pulled(1, hashes[1]).unwrap();
        assert!(s.commit(&m.id()).is_err());
        s.handle_window(2 * 4096, 4096 + 10, &hashes[2..]).unwrap();
        s.handle_chunk_pulled(2, hashes[2]).unwrap();
        assert!(s.commit(&m.id()).is_err()); // chunk 3 still busy
        s.handle_chunk_pulled(3, hashes[3]).unwrap();
        assert!(s.commit(&[0; 32]).is_err());
        assert_eq!(s.commit(&m.id()).unwrap(), m.hashes);
        assert_eq!(s.verified_bytes(), m.size);
    }
}
