//! The chunk hashes a mount's writes to a staged file carried, kept so that the file
//! is recorded at its commit ([`crate::files`]) without reading or hashing it again:
//! a file written through `ferry-mount` is then checked at rest like an upload.
//!
//! A write's extents are each verified against the client's hash before they are
//! written. An extent that starts on a chunk boundary and stays within that chunk
//! carries the hash of the chunk's bytes, provided the file ends where the extent does
//! when the chunk is the last one; the mount cuts its extents at chunk boundaries, so
//! a file written front to back arrives as exactly such extents.
//!
//! A chunk written in pieces (from a buffer that is not page-aligned, whose direct
//! write the kernel cuts into requests that straddle chunks and may deliver out of
//! order) is answered as such ([`WrittenChunks::parts`]); the commit then hashes it
//! from the staged file, which nobody else can write ([`crate::files`]), once.
//!
//! Invariants:
//! - `chunks[i]` is the length and hash of the last extent written at chunk `i`'s start
//!   that lay within chunk `i`, and no byte of chunk `i` was written or cut since;
//!   any other write touching chunk `i` removes it, a size change removes every chunk
//!   from the one the new end falls in.
//! - `touched` holds every chunk some extent wrote a byte of (whole or not) that the
//!   file's size still reaches; a chunk in neither holds only what the handle found
//!   there or a hole.
//! - Only extents in one algorithm are kept: an extent in another poisons the whole.
//! - [`WrittenChunks::manifest`] answers only when every chunk of the file's size has
//!   an entry of exactly that chunk's length, so what it answers is the manifest of the
//!   bytes the handle wrote, provided nothing else wrote the file (a staged file has no
//!   name yet: nobody else can).

use std::collections::{BTreeMap, BTreeSet};

use ferry_common::chunk::{chunk_count, chunk_len};
use ferry_common::msg::{Hash256, HashAlgorithm};

/// See the module docs.
#[derive(Debug)]
pub struct WrittenChunks {
    chunk_bytes: u32,
    algorithm: Option<HashAlgorithm>,
    chunks: BTreeMap<u64, (u32, Hash256)>,
    touched: BTreeSet<u64>,
    poisoned: bool,
}

impl WrittenChunks {
    /// Nothing written yet, into a file of chunks of `chunk_bytes`.
    pub fn new(chunk_bytes: u32) -> WrittenChunks {
        WrittenChunks {
            chunk_bytes: chunk_bytes.max(1),
            algorithm: None,
            chunks: BTreeMap::new(),
            touched: BTreeSet::new(),
            poisoned: false,
        }
    }

    /// `len` bytes whose `algorithm` hash is `hash` were written at `offset`.
    pub fn wrote(&mut self, offset: u64, len: u32, algorithm: HashAlgorithm, hash: Hash256) {
        if len == 0 || self.poisoned {
            return;
        }
        if *self.algorithm.get_or_insert(algorithm) != algorithm {
            self.poison();
            return;
        }
        let chunk = u64::from(self.chunk_bytes);
        let first = offset / chunk;
        let last = (offset + u64::from(len) - 1) / chunk;
        self.touched.extend(first..=last);
        if offset % chunk == 0 && first == last {
            self.chunks.insert(first, (len, hash));
        } else {
            let touched: Vec<u64> = self.chunks.range(first..=last).map(|(&i, _)| i).collect();
            for i in touched {
                self.chunks.remove(&i);
            }
        }
    }

    /// The file's size was set to `size` (truncated, or extended with zeros).
    pub fn resized(&mut self, size: u64) {
        let from = size / u64::from(self.chunk_bytes);
        self.chunks.retain(|&i, _| i < from);
        // The chunk the new end falls in keeps what was written of it.
        self.touched.retain(|&i| i <= from);
    }

    /// Something happened whose effect on the bytes is unknown (a write that failed
    /// midway): nothing is answered any more.
    pub fn poison(&mut self) {
        self.poisoned = true;
        self.chunks.clear();
        self.touched.clear();
    }

    /// The manifest of a file of `size` bytes in chunks of `chunk_bytes`, if every one
    /// of its chunks was written whole (see the module docs).
    #[cfg(test)]
    pub fn manifest(&self, size: u64, chunk_bytes: u32) -> Option<(HashAlgorithm, Vec<Hash256>)> {
        let (algorithm, parts) = self.parts(size, chunk_bytes)?;
        Some((algorithm, parts.into_iter().collect::<Option<Vec<_>>>()?))
    }

    /// Of a file of `size` bytes in chunks of `chunk_bytes`, every chunk of which the
    /// handle wrote: the algorithm of its writes and, for each chunk, its hash if it
    /// was written whole (else `None`: written in pieces, or cut since). `None` overall
    /// when nothing is answered: poisoned, a chunk no write touched (a hole, or bytes
    /// the handle found there), an empty file, or another chunk size.
    pub fn parts(
        &self,
        size: u64,
        chunk_bytes: u32,
    ) -> Option<(HashAlgorithm, Vec<Option<Hash256>>)> {
        if self.poisoned || size == 0 || chunk_bytes != self.chunk_bytes {
            return None;
        }
        let algorithm = self.algorithm?;
        let hashes = (0..chunk_count(size, chunk_bytes))
            .map(|i| {
                let want = chunk_len(size, chunk_bytes, i);
                match self.chunks.get(&i) {
                    Some(&(len, hash)) if u64::from(len) == want => Some(Some(hash)),
                    _ => self.touched.contains(&i).then_some(None),
                }
            })
            .collect::<Option<Vec<_>>>()?;
        Some((algorithm, hashes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B3: HashAlgorithm = HashAlgorithm::Blake3;
    const C: u32 = 100;

    fn h(n: u8) -> Hash256 {
        [n; 32]
    }

    #[test]
    fn a_file_written_front_to_back_in_chunk_sized_extents_has_its_manifest() {
        let mut w = WrittenChunks::new(C);
        w.wrote(0, 100, B3, h(1));
        w.wrote(100, 100, B3, h(2));
        w.wrote(200, 42, B3, h(3));
        assert_eq!(w.manifest(242, C), Some((B3, vec![h(1), h(2), h(3)])));
        // Another size, or another chunk size, is not what was written.
        assert_eq!(w.manifest(250, C), None);
        assert_eq!(w.manifest(242, 50), None);
        assert_eq!(w.manifest(0, C), None);
    }

    #[test]
    fn a_partial_write_into_a_chunk_forgets_it_until_it_is_written_whole_again() {
        let mut w = WrittenChunks::new(C);
        w.wrote(0, 100, B3, h(1));
        w.wrote(100, 100, B3, h(2));
        // Straddling both chunks: neither is known any more.
        w.wrote(50, 100, B3, h(9));
        assert_eq!(w.manifest(200, C), None);
        w.wrote(0, 100, B3, h(4));
        assert_eq!(w.manifest(200, C), None);
        w.wrote(100, 100, B3, h(5));
        assert_eq!(w.manifest(200, C), Some((B3, vec![h(4), h(5)])));
        // A piece inside a chunk, not at its start.
        w.wrote(130, 10, B3, h(6));
        assert_eq!(w.manifest(200, C), None);
    }

    #[test]
    fn a_short_piece_at_a_chunk_start_is_whole_only_as_the_last_chunk() {
        let mut w = WrittenChunks::new(C);
        w.wrote(0, 100, B3, h(1));
        w.wrote(100, 30, B3, h(2));
        assert_eq!(w.manifest(130, C), Some((B3, vec![h(1), h(2)])));
        // Continued by a separate extent: chunk 1 is no longer those 30 bytes.
        w.wrote(130, 30, B3, h(3));
        assert_eq!(w.manifest(160, C), None);
        assert_eq!(w.manifest(130, C), None);
    }

    #[test]
    fn resizing_forgets_the_chunks_from_the_new_end_on() {
        let mut w = WrittenChunks::new(C);
        w.wrote(0, 100, B3, h(1));
        w.wrote(100, 100, B3, h(2));
        w.resized(150);
        assert_eq!(w.manifest(150, C), None);
        assert_eq!(w.manifest(100, C), Some((B3, vec![h(1)])));
        // Extended with zeros past a whole chunk: the zeros were not written.
        w.resized(300);
        assert_eq!(w.manifest(300, C), None);
        w.resized(100);
        assert_eq!(w.manifest(100, C), Some((B3, vec![h(1)])));
    }

    #[test]
    fn another_algorithm_or_a_failed_write_poisons_it() {
        let mut w = WrittenChunks::new(C);
        w.wrote(0, 100, B3, h(1));
        w.wrote(100, 100, HashAlgorithm::Sha256, h(2));
        assert_eq!(w.manifest(100, C), None);
        let mut w = WrittenChunks::new(C);
        w.wrote(0, 100, B3, h(1));
        w.poison();
        w.wrote(0, 100, B3, h(1));
        assert_eq!(w.manifest(100, C), None);
    }

    #[test]
    fn parts_name_the_chunks_written_whole_and_leave_the_rest_to_the_caller() {
        let mut w = WrittenChunks::new(C);
        assert_eq!(w.parts(250, C), None, "nothing written yet");
        // Chunk 1 in two pieces (the second first), chunks 0 and 2 whole.
        w.wrote(150, 50, B3, h(7));
        w.wrote(100, 50, B3, h(8));
        w.wrote(0, 100, B3, h(1));
        w.wrote(200, 50, B3, h(3));
        assert_eq!(
            w.parts(250, C),
            Some((B3, vec![Some(h(1)), None, Some(h(3))]))
        );
        assert_eq!(w.manifest(250, C), None);
        // Extended: chunk 3 is a hole no write touched.
        w.resized(350);
        assert_eq!(w.parts(350, C), None);
        // Cut back into chunk 2: its remaining bytes were written, in a piece now.
        w.resized(230);
        assert_eq!(w.parts(230, C), Some((B3, vec![Some(h(1)), None, None])));
        w.poison();
        assert_eq!(w.parts(250, C), None);
    }
}
