//! The journal of a resumable partial file: which chunks of it were written, with what
//! chunk hash (in the algorithm its header names).
//!
//! A receiver (ferryd for an upload, rcp for a download) writes a file of `size` bytes
//! into a hidden partial file ([`crate::staging`]) and, after each chunk's bytes were
//! written there, appends a record to the partial's journal. After a crash or a kill,
//! the next transfer of the same file reads the journal to learn which chunks it may
//! already have. The journal is only a hint: every chunk it names is read back from the
//! partial and hashed again before it counts as received, so a stale, torn or lying
//! journal costs bytes on the wire, never correctness.
//!
//! Layout (all integers little-endian):
//!
//! ```text
//! header, 64 bytes:
//!   0..8    magic "FRYJRNL\0"
//!   8..10   format version (u16) = 2
//!   10..12  chunk-hash algorithm of the records (u16, [`HashAlgorithm::code`])
//!   12..16  chunk_bytes (u32)
//!   16..24  size of the complete file (u64)
//!   24..56  source: 32 bytes naming the version of the file being received
//!           (a download: [`source_tag`] of the server's attributes; an upload: zero)
//!   56..64  the first 8 bytes of SHA-256(bytes 0..56)
//! then records, 48 bytes each:
//!   0..8    chunk index (u64)
//!   8..40   the chunk's hash, in the header's algorithm
//!   40..48  the first 8 bytes of SHA-256(bytes 0..40 || header bytes 56..64)
//! ```
//!
//! A record whose check does not match (torn by a crash, or left from another header)
//! or whose index is beyond the file's last chunk is ignored; an incomplete record at
//! the end is ignored and cut off before the next append. When an index appears twice,
//! the later record wins.
//!
//! Format version 1, which Ferry wrote before BLAKE3, is the same with bytes 8..12 the
//! u32 1 (so bytes 10..12 are zero) and SHA-256 records. A SHA-256 journal is still
//! written in it, byte for byte as before (so a partial an older Ferry left resumes,
//! and one this build leaves is one an older Ferry can resume); version 2 is for the
//! other algorithms.
//! The checks are SHA-256 in both: they guard against tearing, not against an
//! adversary.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{self, BufReader, Read};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Mutex;

use sha2::{Digest, Sha256 as Hasher};

use crate::chunk::chunk_count;
use crate::msg::{Attr, Hash256, HashAlgorithm};

/// Magic bytes opening a journal.
pub const JOURNAL_MAGIC: [u8; 8] = *b"FRYJRNL\0";
/// Format version of the journals this build writes in another algorithm than SHA-256.
pub const JOURNAL_VERSION: u16 = 2;
/// Format version of the journals Ferry wrote before BLAKE3 (SHA-256 records), still
/// read.
pub const JOURNAL_VERSION_SHA256: u16 = 1;
/// Bytes of the header.
pub const HEADER_BYTES: u64 = 64;
/// Bytes of one record.
pub const RECORD_BYTES: u64 = 48;

/// Why a journal cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JournalError {
    /// Reading or writing the journal failed.
    #[error("journal I/O: {0}")]
    Io(#[from] io::Error),
    /// The file is shorter than a header, or does not start with [`JOURNAL_MAGIC`].
    #[error("not a Ferry journal")]
    NotAJournal,
    /// The header is of another format version.
    #[error("journal format version {0} is not supported")]
    Version(u32),
    /// The header names a hash algorithm this build does not know.
    #[error("journal hash algorithm {0} is not supported")]
    Algorithm(u16),
    /// The header's check does not match its bytes.
    #[error("journal header is damaged")]
    DamagedHeader,
}

/// What a journal is about: the complete file and its chunking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalHeader {
    /// Size of the complete file in bytes.
    pub size: u64,
    /// Chunk size the records are in.
    pub chunk_bytes: u32,
    /// The algorithm of the records' hashes.
    pub algorithm: HashAlgorithm,
    /// Names the version of the file being received; a journal is reused only for the
    /// same source. Zero where the receiver cannot know it (an upload: the chunk hashes
    /// the client sends decide).
    pub source: [u8; 32],
}

impl JournalHeader {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER_BYTES as usize] {
        let mut b = [0u8; HEADER_BYTES as usize];
        b[0..8].copy_from_slice(&JOURNAL_MAGIC);
        // A SHA-256 journal is written in format 1, byte for byte what Ferry wrote
        // before BLAKE3 (so its records' checks, which cover the header, are the same
        // whichever version wrote it); a BLAKE3 one in format 2.
        let (version, code) = match self.algorithm {
            HashAlgorithm::Sha256 => (JOURNAL_VERSION_SHA256, 0),
            other => (JOURNAL_VERSION, u16::from(other.code())),
        };
        b[8..10].copy_from_slice(&version.to_le_bytes());
        b[10..12].copy_from_slice(&code.to_le_bytes());
        b[12..16].copy_from_slice(&self.chunk_bytes.to_le_bytes());
        b[16..24].copy_from_slice(&self.size.to_le_bytes());
        b[24..56].copy_from_slice(&self.source);
        let check = check8(&[&b[..56]]);
        b[56..64].copy_from_slice(&check);
        b
    }

    /// Parses a header.
    pub fn decode(b: &[u8; HEADER_BYTES as usize]) -> Result<JournalHeader, JournalError> {
        if b[0..8] != JOURNAL_MAGIC {
            return Err(JournalError::NotAJournal);
        }
        let version = u16::from_le_bytes(array(&b[8..10]));
        let code = u16::from_le_bytes(array(&b[10..12]));
        let algorithm = match (version, code) {
            (JOURNAL_VERSION_SHA256, 0) => HashAlgorithm::Sha256,
            (JOURNAL_VERSION, code) => u8::try_from(code)
                .ok()
                .and_then(HashAlgorithm::from_code)
                .ok_or(JournalError::Algorithm(code))?,
            _ => return Err(JournalError::Version(u32::from_le_bytes(array(&b[8..12])))),
        };
        if check8(&[&b[..56]]) != b[56..64] {
            return Err(JournalError::DamagedHeader);
        }
        Ok(JournalHeader {
            chunk_bytes: u32::from_le_bytes(array(&b[12..16])),
            algorithm,
            size: u64::from_le_bytes(array(&b[16..24])),
            source: array(&b[24..56]),
        })
    }

    /// Whether `other` describes the same file (size, chunk size and source), whatever
    /// the algorithm of its records.
    pub fn same_file(&self, other: &JournalHeader) -> bool {
        (self.size, self.chunk_bytes, self.source) == (other.size, other.chunk_bytes, other.source)
    }

    /// Number of chunks of the complete file.
    pub fn chunks(&self) -> u64 {
        if self.chunk_bytes == 0 {
            return 0;
        }
        chunk_count(self.size, self.chunk_bytes)
    }

    /// The check every record of this header carries a hash of.
    fn check(&self) -> [u8; 8] {
        array(&self.encode()[56..64])
    }
}

/// Names one version of a file on a server, for [`JournalHeader::source`]: its size,
/// mtime, ctime, inode and device, hashed. A file changed in place gets a new ctime
/// (which no user can set back), a replaced one another inode.
pub fn source_tag(attr: &Attr) -> [u8; 32] {
    let mut h = Hasher::new();
    h.update(b"ferry source v1");
    h.update(attr.size.to_le_bytes());
    h.update(attr.mtime.secs.to_le_bytes());
    h.update(attr.mtime.nanos.to_le_bytes());
    h.update(attr.ctime.secs.to_le_bytes());
    h.update(attr.ctime.nanos.to_le_bytes());
    h.update(attr.ino.to_le_bytes());
    h.update(attr.dev.to_le_bytes());
    h.finalize().into()
}

/// A journal as read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalContents {
    /// The header.
    pub header: JournalHeader,
    /// The chunks the journal names, index to hash (the latest record of each index).
    pub chunks: BTreeMap<u64, Hash256>,
    /// Complete records read, valid or not.
    pub records: u64,
    /// Records ignored: a failed check, or an index beyond the file.
    pub ignored: u64,
    /// Bytes of the header and every complete record: where the next record goes.
    pub complete_len: u64,
}

impl JournalContents {
    /// File bytes covered by [`JournalContents::chunks`].
    pub fn chunk_bytes_total(&self) -> u64 {
        self.chunks
            .keys()
            .map(|&i| crate::chunk::chunk_len(self.header.size, self.header.chunk_bytes, i))
            .sum()
    }
}

/// Reads the journal at `path`. Blocking.
pub fn read_journal(path: &Path) -> Result<JournalContents, JournalError> {
    read_from(File::open(path)?)
}

/// Reads a journal from an open file, from its start. Blocking.
pub fn read_from(file: impl Read) -> Result<JournalContents, JournalError> {
    let mut r = BufReader::new(file);
    let mut head = [0u8; HEADER_BYTES as usize];
    match r.read_exact(&mut head) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            return Err(JournalError::NotAJournal)
        }
        Err(e) => return Err(e.into()),
    }
    let header = JournalHeader::decode(&head)?;
    let check = header.check();
    let count = header.chunks();
    let mut contents = JournalContents {
        header,
        chunks: BTreeMap::new(),
        records: 0,
        ignored: 0,
        complete_len: HEADER_BYTES,
    };
    let mut rec = [0u8; RECORD_BYTES as usize];
    loop {
        match r.read_exact(&mut rec) {
            Ok(()) => {}
            // The end, or an incomplete last record, not counted in `complete_len`.
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(e.into()),
        }
        contents.records += 1;
        contents.complete_len += RECORD_BYTES;
        match decode_record(&rec, &check) {
            Some((index, hash)) if index < count => {
                contents.chunks.insert(index, hash);
            }
            _ => contents.ignored += 1,
        }
    }
    Ok(contents)
}

fn encode_record(index: u64, hash: &Hash256, check: &[u8; 8]) -> [u8; RECORD_BYTES as usize] {
    let mut b = [0u8; RECORD_BYTES as usize];
    b[0..8].copy_from_slice(&index.to_le_bytes());
    b[8..40].copy_from_slice(hash);
    let c = check8(&[&b[..40], check]);
    b[40..48].copy_from_slice(&c);
    b
}

fn decode_record(b: &[u8; RECORD_BYTES as usize], check: &[u8; 8]) -> Option<(u64, Hash256)> {
    if check8(&[&b[..40], check]) != b[40..48] {
        return None;
    }
    Some((u64::from_le_bytes(array(&b[0..8])), array(&b[8..40])))
}

/// The first 8 bytes of the SHA-256 of `parts`, concatenated.
fn check8(parts: &[&[u8]]) -> [u8; 8] {
    let mut h = Hasher::new();
    for p in parts {
        h.update(p);
    }
    array(&h.finalize()[..8])
}

fn array<const N: usize>(b: &[u8]) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&b[..N]);
    out
}

/// Appends records to an open journal.
///
/// Invariant: `next` is the length of the header plus every complete record, and the
/// file holds nothing beyond it, so a record torn by a crash is overwritten by the
/// next append rather than shifting every later record.
#[derive(Debug)]
pub struct JournalWriter {
    state: Mutex<Appending>,
    check: [u8; 8],
}

#[derive(Debug)]
struct Appending {
    file: File,
    next: u64,
    /// Indices appended through this writer.
    appended: BTreeSet<u64>,
}

impl JournalWriter {
    fn new(file: File, next: u64, check: [u8; 8]) -> JournalWriter {
        JournalWriter {
            state: Mutex::new(Appending {
                file,
                next,
                appended: BTreeSet::new(),
            }),
            check,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, Appending> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a new journal in `file` (emptied first) with `header`. Blocking.
    pub fn create(file: File, header: &JournalHeader) -> io::Result<JournalWriter> {
        file.set_len(0)?;
        file.write_all_at(&header.encode(), 0)?;
        Ok(JournalWriter::new(file, HEADER_BYTES, header.check()))
    }

    /// Continues the journal `contents` was read from `file`: cuts off an incomplete
    /// last record, and rewrites the records compactly when ignored or superseded ones
    /// outnumber the live ones (so a journal's size stays proportional to the file's
    /// chunks however often it is resumed). Blocking.
    pub fn resume(file: File, contents: &JournalContents) -> io::Result<JournalWriter> {
        let check = contents.header.check();
        let live = contents.chunks.len() as u64;
        let next = if contents.records > 2 * live + 16 {
            let mut bytes = Vec::with_capacity((live * RECORD_BYTES) as usize);
            for (&i, h) in &contents.chunks {
                bytes.extend_from_slice(&encode_record(i, h, &check));
            }
            file.set_len(HEADER_BYTES)?;
            file.write_all_at(&bytes, HEADER_BYTES)?;
            HEADER_BYTES + bytes.len() as u64
        } else {
            contents.complete_len
        };
        file.set_len(next)?;
        Ok(JournalWriter::new(file, next, check))
    }

    /// Appends the record "chunk `index` was written and hashes to `hash`". Call it
    /// only after the chunk's bytes were written to the partial file. Blocking.
    pub fn append(&self, index: u64, hash: &Hash256) -> io::Result<()> {
        let rec = encode_record(index, hash, &self.check);
        let mut state = self.state();
        let next = state.next;
        state.file.write_all_at(&rec, next)?;
        state.next += RECORD_BYTES;
        state.appended.insert(index);
        Ok(())
    }

    /// The chunk indices appended through this writer so far.
    pub fn appended(&self) -> BTreeSet<u64> {
        self.state().appended.clone()
    }
}

#[cfg(test)]
mod tests {
    use std::fs::OpenOptions;

    use super::*;

    fn header() -> JournalHeader {
        JournalHeader {
            algorithm: HashAlgorithm::Blake3,
            size: 10 * 4096 + 7,
            chunk_bytes: 4096,
            source: [7; 32],
        }
    }

    fn open(path: &Path) -> File {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .unwrap()
    }

    #[test]
    fn records_round_trip_and_the_latest_wins() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let w = JournalWriter::create(open(&path), &header()).unwrap();
        w.append(3, &[3; 32]).unwrap();
        w.append(10, &[10; 32]).unwrap();
        w.append(3, &[33; 32]).unwrap();
        let c = read_journal(&path).unwrap();
        assert_eq!(c.header, header());
        assert_eq!(c.records, 3);
        assert_eq!(c.ignored, 0);
        assert_eq!(c.chunks, BTreeMap::from([(3, [33; 32]), (10, [10; 32])]));
        assert_eq!(c.chunk_bytes_total(), 4096 + 7);
        assert_eq!(c.complete_len, HEADER_BYTES + 3 * RECORD_BYTES);
    }

    #[test]
    fn a_torn_record_is_ignored_and_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let w = JournalWriter::create(open(&path), &header()).unwrap();
        w.append(1, &[1; 32]).unwrap();
        w.append(2, &[2; 32]).unwrap();
        drop(w);
        // A crash in the middle of the third append leaves half a record...
        let f = open(&path);
        let half = encode_record(4, &[4; 32], &header().check());
        f.write_all_at(&half[..20], HEADER_BYTES + 2 * RECORD_BYTES)
            .unwrap();
        // ...and damage inside a complete one fails its check.
        let mut rec2 = [0u8; 1];
        f.read_exact_at(&mut rec2, HEADER_BYTES + RECORD_BYTES + 9)
            .unwrap();
        f.write_all_at(&[rec2[0] ^ 1], HEADER_BYTES + RECORD_BYTES + 9)
            .unwrap();
        let c = read_journal(&path).unwrap();
        assert_eq!(c.chunks, BTreeMap::from([(1, [1; 32])]));
        assert_eq!((c.records, c.ignored), (2, 1));
        assert_eq!(c.complete_len, HEADER_BYTES + 2 * RECORD_BYTES);

        // Resuming cuts the torn tail off: the next record lands where it belongs.
        let w = JournalWriter::resume(open(&path), &c).unwrap();
        w.append(5, &[5; 32]).unwrap();
        let c = read_journal(&path).unwrap();
        assert_eq!(c.chunks, BTreeMap::from([(1, [1; 32]), (5, [5; 32])]));
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            HEADER_BYTES + 3 * RECORD_BYTES
        );
    }

    #[test]
    fn records_beyond_the_file_or_of_another_header_are_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let w = JournalWriter::create(open(&path), &header()).unwrap();
        w.append(11, &[1; 32]).unwrap(); // the file has chunks 0..=10
        drop(w);
        let other = JournalHeader {
            source: [8; 32],
            ..header()
        };
        let stray = encode_record(2, &[2; 32], &other.check());
        open(&path)
            .write_all_at(&stray, HEADER_BYTES + RECORD_BYTES)
            .unwrap();
        let c = read_journal(&path).unwrap();
        assert!(c.chunks.is_empty());
        assert_eq!((c.records, c.ignored), (2, 2));
    }

    #[test]
    fn sha256_journals_are_format_1_as_before_and_blake3_ones_format_2() {
        let sha = JournalHeader {
            algorithm: HashAlgorithm::Sha256,
            ..header()
        };
        let b = sha.encode();
        assert_eq!(
            b[8..12],
            1u32.to_le_bytes(),
            "format 1, as Ferry wrote it before"
        );
        assert_eq!(JournalHeader::decode(&b).unwrap(), sha);
        let b = header().encode();
        assert_eq!(b[8..10], 2u16.to_le_bytes());
        assert_eq!(u16::from_le_bytes([b[10], b[11]]), 2, "BLAKE3's code");
        assert_eq!(JournalHeader::decode(&b).unwrap(), header());
        // A record's check covers the header's check bytes, so a format-1 journal's
        // records are read back only if its header is re-encoded in format 1.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let w = JournalWriter::create(std::fs::File::create(&path).unwrap(), &sha).unwrap();
        w.append(3, &[5; 32]).unwrap();
        let c = read_journal(&path).unwrap();
        assert_eq!(c.header.algorithm, HashAlgorithm::Sha256);
        assert_eq!(c.chunks.get(&3), Some(&[5; 32]));
    }

    #[test]
    fn damaged_or_foreign_headers_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        std::fs::write(&path, b"short").unwrap();
        assert!(matches!(
            read_journal(&path),
            Err(JournalError::NotAJournal)
        ));
        let mut b = header().encode();
        b[20] ^= 1;
        std::fs::write(&path, b).unwrap();
        assert!(matches!(
            read_journal(&path),
            Err(JournalError::DamagedHeader)
        ));
        let mut b = header().encode();
        b[8] = 9;
        b[10] = 0;
        std::fs::write(&path, b).unwrap();
        assert!(matches!(read_journal(&path), Err(JournalError::Version(9))));
        // Version 2 naming an algorithm this build does not know.
        let mut b = header().encode();
        b[10] = 77;
        std::fs::write(&path, b).unwrap();
        assert!(matches!(
            read_journal(&path),
            Err(JournalError::Algorithm(77))
        ));
        assert!(matches!(
            read_journal(&dir.path().join("none")),
            Err(JournalError::Io(_))
        ));
    }

    #[test]
    fn a_journal_resumed_many_times_stays_compact() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let w = JournalWriter::create(open(&path), &header()).unwrap();
        for _ in 0..40 {
            w.append(0, &[9; 32]).unwrap();
        }
        drop(w);
        let c = read_journal(&path).unwrap();
        assert_eq!(c.records, 40);
        JournalWriter::resume(open(&path), &c).unwrap();
        let c = read_journal(&path).unwrap();
        assert_eq!((c.records, c.chunks.len()), (1, 1));
    }

    #[test]
    fn source_tags_differ_with_any_attribute() {
        let attr = Attr {
            kind: crate::msg::FileKind::File,
            size: 5,
            mode: 0o644,
            mtime: crate::msg::Timestamp { secs: 1, nanos: 2 },
            symlink_target: None,
            ino: 3,
            nlink: 1,
            atime: Default::default(),
            ctime: crate::msg::Timestamp { secs: 4, nanos: 5 },
            blocks: 0,
            dev: 6,
        };
        let base = source_tag(&attr);
        let mut other = attr.clone();
        other.ctime.nanos += 1;
        assert_ne!(source_tag(&other), base);
        let mut other = attr.clone();
        other.dev += 1;
        assert_ne!(source_tag(&other), base);
        // Access time and link count are not part of the version.
        let mut other = attr;
        other.atime.secs = 99;
        other.nlink = 2;
        assert_eq!(source_tag(&other), base);
    }
}
