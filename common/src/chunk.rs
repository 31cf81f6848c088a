//! Chunking and chunk manifests.
//!
//! A file of `size` bytes is cut into chunks of `chunk_bytes` (the last one may be
//! shorter; a 0-byte file has no chunks). Each chunk is hashed with the manifest's
//! [`HashAlgorithm`] (BLAKE3 or SHA-256); the list of chunk hashes is the file's
//! manifest, and [`Manifest::id`] — a hash, in the same algorithm, over the size, the
//! chunk size and every chunk hash — names that version of the file.
//!
//! The algorithm is a property of each manifest, never implied: every manifest, chunk
//! hash list, journal and manifest record names its own (`docs/protocol.md`, "Chunk
//! hashes"). A SHA-256 manifest's id is what it was before BLAKE3 existed, so records
//! written by older Ferry versions keep their meaning.

use rayon::prelude::*;
use sha2::{Digest, Sha256 as Sha256Hasher};

use crate::msg::Hash256;
pub use crate::msg::HashAlgorithm;

/// The hash of one chunk, in `algorithm`.
pub fn hash_chunk(algorithm: HashAlgorithm, data: &[u8]) -> Hash256 {
    match algorithm {
        HashAlgorithm::Sha256 => Sha256Hasher::digest(data).into(),
        HashAlgorithm::Blake3 => blake3::hash(data).into(),
    }
}

/// Hashes consecutive `chunk_bytes`-sized chunks of `data` in `algorithm`, on the
/// shared hashing pool (rayon's, one thread per core).
///
/// `chunk_bytes` must be non-zero. The last chunk may be shorter.
pub fn hash_chunks(algorithm: HashAlgorithm, data: &[u8], chunk_bytes: usize) -> Vec<Hash256> {
    assert!(chunk_bytes > 0, "chunk size must be positive");
    data.par_chunks(chunk_bytes)
        .map(|c| hash_chunk(algorithm, c))
        .collect()
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
    /// The algorithm of every hash here.
    pub algorithm: HashAlgorithm,
    /// File size in bytes.
    pub size: u64,
    /// Chunk size the hashes were taken with.
    pub chunk_bytes: u32,
    /// The hash of each chunk, in file order.
    pub hashes: Vec<Hash256>,
}

impl Manifest {
    /// The manifest hash: in the manifest's algorithm, the hash of `size` (u64 LE),
    /// `chunk_bytes` (u32 LE) and every chunk hash in order. Two files with the same
    /// id (in the same algorithm) have the same bytes.
    pub fn id(&self) -> Hash256 {
        manifest_id(self.algorithm, self.size, self.chunk_bytes, &self.hashes)
    }
}

/// [`Manifest::id`] without building a [`Manifest`].
pub fn manifest_id(
    algorithm: HashAlgorithm,
    size: u64,
    chunk_bytes: u32,
    hashes: &[Hash256],
) -> Hash256 {
    match algorithm {
        HashAlgorithm::Sha256 => {
            let mut h = Sha256Hasher::new();
            h.update(size.to_le_bytes());
            h.update(chunk_bytes.to_le_bytes());
            for c in hashes {
                h.update(c);
            }
            h.finalize().into()
        }
        HashAlgorithm::Blake3 => {
            let mut h = blake3::Hasher::new();
            h.update(&size.to_le_bytes());
            h.update(&chunk_bytes.to_le_bytes());
            for c in hashes {
                h.update(c);
            }
            h.finalize().into()
        }
    }
}

/// Lowercase hex of a digest, for logs and messages.
pub fn hex(d: &Hash256) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOTH: [HashAlgorithm; 2] = [HashAlgorithm::Sha256, HashAlgorithm::Blake3];

    #[test]
    fn known_vectors() {
        assert_eq!(
            hex(&hash_chunk(HashAlgorithm::Sha256, b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        // The BLAKE3 reference vector of "abc".
        assert_eq!(
            hex(&hash_chunk(HashAlgorithm::Blake3, b"abc")),
            "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"
        );
    }

    #[test]
    fn sha256_manifest_ids_are_what_older_versions_computed() {
        // Computed by the SHA-256-only code this replaced (commit 59c4d76): records
        // and journals written then must keep their meaning.
        let id = manifest_id(
            HashAlgorithm::Sha256,
            5,
            4096,
            &[hash_chunk(HashAlgorithm::Sha256, b"hello")],
        );
        let mut h = Sha256Hasher::new();
        h.update(5u64.to_le_bytes());
        h.update(4096u32.to_le_bytes());
        h.update(hash_chunk(HashAlgorithm::Sha256, b"hello"));
        assert_eq!(id, <[u8; 32]>::from(h.finalize()));
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
        for a in BOTH {
            let par = hash_chunks(a, &data, 4096);
            let ser: Vec<_> = data.chunks(4096).map(|c| hash_chunk(a, c)).collect();
            assert_eq!(par, ser);
            assert_eq!(par.len(), 4);
        }
    }

    #[test]
    fn the_algorithms_differ() {
        assert_ne!(
            hash_chunk(HashAlgorithm::Sha256, b"x"),
            hash_chunk(HashAlgorithm::Blake3, b"x")
        );
        let h = [hash_chunk(HashAlgorithm::Sha256, b"x")];
        assert_ne!(
            manifest_id(HashAlgorithm::Sha256, 1, 4096, &h),
            manifest_id(HashAlgorithm::Blake3, 1, 4096, &h)
        );
    }

    #[test]
    fn manifest_id_depends_on_everything() {
        for a in BOTH {
            let m = Manifest {
                algorithm: a,
                size: 5,
                chunk_bytes: 4096,
                hashes: vec![hash_chunk(a, b"hello")],
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
}
