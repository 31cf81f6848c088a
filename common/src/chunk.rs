//! Chunking and SHA-256 manifests.
//!
//! A file of `size` bytes is cut into chunks of `chunk_bytes` (the last one may be
//! shorter; a 0-byte file has no chunks). Each chunk is hashed with SHA-256; the list of
//! chunk hashes is the file's manifest, and [`Manifest::id`] — SHA-256 over the size,
//! the chunk size and every chunk hash — names that version of the file.

use rayon::prelude::*;
use sha2::{Digest, Sha256 as Hasher};

use crate::msg::Sha256;

/// SHA-256 of one chunk.
pub fn hash_chunk(data: &[u8]) -> Sha256 {
    Hasher::digest(data).into()
}

/// Hashes consecutive `chunk_bytes`-sized chunks of `data` on all cores.
///
/// `chunk_bytes` must be non-zero. The last chunk may be shorter.
pub fn hash_chunks(data: &[u8], chunk_bytes: usize) -> Vec<Sha256> {
    assert!(chunk_bytes > 0, "chunk size must be positive");
    data.par_chunks(chunk_bytes).map(hash_chunk).collect()
}

/// Number of chunks of a file of `size` bytes.
pub fn chunk_count(size: u64, chunk_bytes: u32) -> u64 {
    size.div_ceil(u64::from(chunk_bytes))
}

/// Length of chunk `index` of a file of `size` bytes.
pub fn chunk_len(size: u64, chunk_bytes: u32, index: u64) -> u64 {
    let start = index * u64::from(chunk_bytes);
    size.saturating_sub(start).min(u64::from(chunk_bytes))
}

/// The chunk hashes of one version of a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    /// File size in bytes.
    pub size: u64,
    /// Chunk size the hashes were taken with.
    pub chunk_bytes: u32,
    /// SHA-256 of each chunk, in file order.
    pub hashes: Vec<Sha256>,
}

impl Manifest {
    /// The manifest hash: SHA-256 of `size` (u64 LE), `chunk_bytes` (u32 LE) and every
    /// chunk hash in order. Two files with the same id have the same bytes.
    pub fn id(&self) -> Sha256 {
        manifest_id(self.size, self.chunk_bytes, &self.hashes)
    }
}

/// [`Manifest::id`] without building a [`Manifest`].
pub fn manifest_id(size: u64, chunk_bytes: u32, hashes: &[Sha256]) -> Sha256 {
    let mut h = Hasher::new();
    h.update(size.to_le_bytes());
    h.update(chunk_bytes.to_le_bytes());
    for c in hashes {
        h.update(c);
    }
    h.finalize().into()
}

/// Lowercase hex of a digest, for logs and messages.
pub fn hex(d: &Sha256) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vector() {
        assert_eq!(
            hex(&hash_chunk(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn chunk_geometry() {
        let c = 1 << 20;
        assert_eq!(chunk_count(0, c), 0);
        assert_eq!(chunk_count(1, c), 1);
        assert_eq!(chunk_count(u64::from(c), c), 1);
        assert_eq!(chunk_count(u64::from(c) + 1, c), 2);
        assert_eq!(chunk_len(u64::from(c) + 1, c, 1), 1);
        assert_eq!(chunk_len(u64::from(c) + 1, c, 2), 0);
    }

    #[test]
    fn parallel_hashes_match_serial() {
        let data: Vec<u8> = (0..(3 * 4096 + 5)).map(|i| (i * 7) as u8).collect();
        let par = hash_chunks(&data, 4096);
        let ser: Vec<_> = data.chunks(4096).map(hash_chunk).collect();
        assert_eq!(par, ser);
        assert_eq!(par.len(), 4);
    }

    #[test]
    fn manifest_id_depends_on_everything() {
        let m = Manifest {
            size: 5,
            chunk_bytes: 4096,
            hashes: vec![hash_chunk(b"hello")],
        };
        let mut other = m.clone();
        other.size = 6;
        assert_ne!(m.id(), other.id());
        let mut other = m.clone();
        other.chunk_bytes = 8192;
        assert_ne!(m.id(), other.id());
        let mut other = m.clone();
        other.hashes[0][0] ^= 1;
        assert_ne!(m.id(), other.id());
    }
}
