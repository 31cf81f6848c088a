//! The geometry of a mapped file, as a reader of [`Response::Mapped`] may trust it.
//!
//! A [`MappedFile`] is the server's word on where a file's bytes and chunk hashes lie:
//! its regions, window size, chunk size and manifest region. [`MappedLayout::new`]
//! checks that word once; afterwards the layout answers, with no I/O, every question
//! a one-sided reader asks:
//!
//! - which reads fetch the manifest ([`MappedLayout::manifest_fetch`], a
//!   [`ManifestFetch`] fed with what each read returned and checked against the
//!   version's manifest hash when done);
//! - what part of the file a read wants ([`MappedLayout::span`]: nothing at or past the
//!   end, else the chunks it touches, clipped to the end of the file);
//! - which chunks one READ may fetch together ([`MappedLayout::extends_run`]) and where
//!   that READ goes ([`MappedLayout::run_read`]: region, offset, length).
//!
//! Invariants of a layout built by [`MappedLayout::new`]:
//! - the chunk size is a power of two in `MIN_CHUNK_BYTES..=MAX_CHUNK_BYTES` and at most
//!   the reader's largest READ, and the window size is a non-zero multiple of it, so no
//!   chunk straddles two regions;
//! - region `i` holds exactly file bytes `i * window_bytes .. min(size, (i + 1) *
//!   window_bytes)`, and there is one region per window;
//! - the manifest region holds exactly 32 bytes per chunk (none for an empty file).
//!
//! So every [`RunRead`] the layout hands out lies inside its region.
//!
//! [`Response::Mapped`]: crate::msg::Response::Mapped

use std::ops::{Range, RangeInclusive};

use crate::chunk::manifest_id;
use crate::msg::{FileVersion, Hash256, MappedFile, RegionDesc, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES};

/// Bytes of one chunk hash in the manifest region.
const HASH_BYTES: u64 = 32;

/// Why a server's mapping cannot be used (geometry or manifest), or a read the layout
/// refuses to place.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MappedError {
    /// The chunk size is not a power of two in `MIN_CHUNK_BYTES..=MAX_CHUNK_BYTES`, or
    /// exceeds the reader's largest READ.
    #[error("server sent a bad mapping: chunk size")]
    ChunkSize,
    /// The window size is zero or not a multiple of the chunk size.
    #[error("server sent a bad mapping: window size")]
    WindowSize,
    /// The attributes' size differs from the version's.
    #[error("server sent a bad mapping: size")]
    Size,
    /// The regions are not one per window of the file.
    #[error("server sent a bad mapping: region count")]
    RegionCount,
    /// A region does not hold exactly its window of the file.
    #[error("server sent a bad mapping: region length")]
    RegionLength,
    /// The manifest region is missing, unexpected, or not 32 bytes per chunk.
    #[error("server sent a bad mapping: manifest region")]
    ManifestRegion,
    /// The chunk hashes read do not hash to the version's manifest hash.
    #[error("integrity: the manifest does not match its hash")]
    ManifestMismatch,
    /// Chunks `first..=last` are not one READ of the mapping: past the last chunk, in
    /// two regions, or more than the reader's largest READ.
    #[error("chunks {first}..={last} are not one read of the mapping")]
    RunOutside {
        /// First chunk asked for.
        first: u64,
        /// Last chunk asked for.
        last: u64,
    },
}

/// A checked mapping: file size, chunk and window geometry, and the manifest's place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MappedLayout {
    size: u64,
    chunk_bytes: u64,
    window_bytes: u64,
    max_read_bytes: u64,
    manifest: Option<RegionDesc>,
    version: FileVersion,
}

impl MappedLayout {
    /// Checks the geometry `m` announces, for a reader whose READs fetch at most
    /// `max_read_bytes` (its registered buffer size). Checks run in a fixed order
    /// (chunk size, window size, size, region count, region lengths, manifest region)
    /// and the first that fails is reported.
    pub fn new(m: &MappedFile, max_read_bytes: u64) -> Result<MappedLayout, MappedError> {
        let v = &m.version;
        let cb = u64::from(v.chunk_bytes);
        if !v.chunk_bytes.is_power_of_two()
            || !(MIN_CHUNK_BYTES..=MAX_CHUNK_BYTES).contains(&v.chunk_bytes)
            || cb > max_read_bytes
        {
            return Err(MappedError::ChunkSize);
        }
        if m.window_bytes == 0 || m.window_bytes % cb != 0 {
            return Err(MappedError::WindowSize);
        }
        if m.attr.size != v.size {
            return Err(MappedError::Size);
        }
        if m.regions.len() as u64 != v.size.div_ceil(m.window_bytes) {
            return Err(MappedError::RegionCount);
        }
        for (i, r) in m.regions.iter().enumerate() {
            let start = i as u64 * m.window_bytes;
            if r.len != m.window_bytes.min(v.size - start) {
                return Err(MappedError::RegionLength);
            }
        }
        let chunks = v.size.div_ceil(cb);
        match (&m.manifest, chunks) {
            (None, 0) => {}
            (Some(r), n) if n > 0 && r.len == n * HASH_BYTES => {}
            _ => return Err(MappedError::ManifestRegion),
        }
        Ok(MappedLayout {
            size: v.size,
            chunk_bytes: cb,
            window_bytes: m.window_bytes,
            max_read_bytes,
            manifest: m.manifest,
            version: *v,
        })
    }

    /// File size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Chunk size in bytes.
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_bytes
    }

    /// Number of chunks (the last one may be short).
    pub fn chunks(&self) -> u64 {
        self.size.div_ceil(self.chunk_bytes)
    }

    /// File bytes of chunk `index` (clipped to the end of the file).
    pub fn chunk_range(&self, index: u64) -> Range<u64> {
        let a = index * self.chunk_bytes;
        a..(a + self.chunk_bytes).min(self.size)
    }

    /// The region holding chunk `index` (a chunk never straddles two).
    pub fn region_of(&self, index: u64) -> u64 {
        index * self.chunk_bytes / self.window_bytes
    }

    /// Whether chunk `index` may join the run of consecutive chunks `first..=last` in
    /// the same READ: it follows `last`, lies in the same region, and the run stays
    /// within the reader's largest READ.
    pub fn extends_run(&self, first: u64, last: u64, index: u64) -> bool {
        let per_read = (self.max_read_bytes / self.chunk_bytes).max(1);
        last + 1 == index
            && self.region_of(last) == self.region_of(index)
            && last - first + 1 < per_read
    }

    /// Where the one READ of chunks `first..=last` goes. Refused unless the chunks
    /// exist, lie in one region and fit the reader's largest READ.
    pub fn run_read(&self, first: u64, last: u64) -> Result<RunRead, MappedError> {
        let outside = MappedError::RunOutside { first, last };
        if first > last || last >= self.chunks() || self.region_of(first) != self.region_of(last) {
            return Err(outside);
        }
        let start = self.chunk_range(first).start;
        let end = self.chunk_range(last).end;
        if end - start > self.max_read_bytes {
            return Err(outside);
        }
        let region = self.region_of(first);
        Ok(RunRead {
            region: region as usize,
            offset: start - region * self.window_bytes,
            len: u32::try_from(end - start).map_err(|_| outside)?,
            file: start..end,
            chunk_bytes: self.chunk_bytes,
        })
    }

    /// What a read of `size` bytes at `offset` wants; `None` when it returns nothing
    /// (at or past the end of the file, or of size 0).
    pub fn span(&self, offset: u64, size: u32) -> Option<ReadSpan> {
        if offset >= self.size || size == 0 {
            return None;
        }
        let end = self.size.min(offset.saturating_add(u64::from(size)));
        Some(ReadSpan {
            start: offset,
            end,
            chunk_bytes: self.chunk_bytes,
            first: offset / self.chunk_bytes,
            last: (end - 1) / self.chunk_bytes,
            last_in_file: (self.size - 1) / self.chunk_bytes,
        })
    }

    /// The reads that fetch the manifest, to be fed back in order.
    pub fn manifest_fetch(&self) -> ManifestFetch {
        ManifestFetch {
            region: self.manifest,
            read_bytes: self.max_read_bytes - self.max_read_bytes % HASH_BYTES,
            done: 0,
            hashes: Vec::with_capacity(self.chunks() as usize),
            version: self.version,
        }
    }
}

/// One READ of a run of chunks: `len` bytes at `offset` of region `region`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunRead {
    /// Index of the region in [`MappedFile::regions`].
    pub region: usize,
    /// Offset inside that region.
    pub offset: u64,
    /// Bytes to read (at most the reader's largest READ).
    pub len: u32,
    /// The file bytes this READ fetches.
    pub file: Range<u64>,
    chunk_bytes: u64,
}

impl RunRead {
    /// Where chunk `index` (one of the run's) lies in the bytes the READ returned.
    pub fn chunk_in_buffer(&self, index: u64) -> Range<usize> {
        let a = (index * self.chunk_bytes).max(self.file.start);
        let b = ((index + 1) * self.chunk_bytes).min(self.file.end);
        (a - self.file.start) as usize..(b - self.file.start) as usize
    }
}

/// The chunks a read touches, the read clipped to the end of the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadSpan {
    /// File offset of the read.
    pub start: u64,
    /// End offset of the read, at most the file size.
    pub end: u64,
    chunk_bytes: u64,
    /// First chunk touched.
    pub first: u64,
    /// Last chunk touched.
    pub last: u64,
    /// Last chunk of the file.
    pub last_in_file: u64,
}

impl ReadSpan {
    /// Bytes the read returns.
    pub fn len(&self) -> u64 {
        self.end - self.start
    }

    /// Whether the read returns nothing (never, for a span [`MappedLayout::span`] made).
    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }

    /// The chunks touched, in order.
    pub fn chunks(&self) -> RangeInclusive<u64> {
        self.first..=self.last
    }

    /// The next `count` chunks after the read, clipped to the end of the file.
    pub fn ahead(&self, count: u64) -> RangeInclusive<u64> {
        self.last + 1..=self.last_in_file.min(self.last.saturating_add(count))
    }

    /// How many chunks `bytes` of readahead is.
    pub fn chunks_in(&self, bytes: u64) -> u64 {
        bytes / self.chunk_bytes
    }

    /// The bytes of chunk `index` (one of [`ReadSpan::chunks`]) that the read returns.
    pub fn part_of_chunk(&self, index: u64) -> Range<usize> {
        let base = index * self.chunk_bytes;
        let a = self.start.max(base) - base;
        let b = self.end.min(base + self.chunk_bytes) - base;
        a as usize..b as usize
    }
}

/// Fetching a mapped file's manifest: `poll_read` names the next READ of the manifest
/// region, `handle_read` takes its bytes, `finish` checks the hashes against the
/// version.
#[derive(Debug, Clone)]
pub struct ManifestFetch {
    region: Option<RegionDesc>,
    /// Bytes per READ: the reader's largest READ, rounded down to whole hashes.
    read_bytes: u64,
    /// Bytes of the region read so far.
    done: u64,
    hashes: Vec<Hash256>,
    /// The version the hashes must match.
    version: FileVersion,
}

/// One READ of the manifest region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ManifestRead {
    /// The manifest region.
    pub region: RegionDesc,
    /// Offset inside it.
    pub offset: u64,
    /// Bytes to read: whole hashes, at most the reader's largest READ.
    pub len: u32,
}

impl ManifestFetch {
    /// The next READ to make; `None` once the whole region was read.
    pub fn poll_read(&self) -> Option<ManifestRead> {
        let region = self.region?;
        if self.done >= region.len {
            return None;
        }
        Some(ManifestRead {
            region,
            offset: self.done,
            len: (region.len - self.done).min(self.read_bytes) as u32,
        })
    }

    /// The bytes the READ [`ManifestFetch::poll_read`] named returned (exactly its
    /// `len`; a trailing partial hash is ignored).
    pub fn handle_read(&mut self, bytes: &[u8]) {
        self.done += bytes.len() as u64;
        for h in bytes.chunks_exact(HASH_BYTES as usize) {
            let mut hash = [0u8; HASH_BYTES as usize];
            hash.copy_from_slice(h);
            self.hashes.push(hash);
        }
    }

    /// The chunk hashes, if the whole region was read and they hash to the version's
    /// manifest hash.
    pub fn finish(self) -> Result<Vec<Hash256>, MappedError> {
        let v = &self.version;
        let complete = self.poll_read().is_none();
        if !complete || manifest_id(v.algorithm, v.size, v.chunk_bytes, &self.hashes) != v.manifest
        {
            return Err(MappedError::ManifestMismatch);
        }
        Ok(self.hashes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk::hash_chunk;
    use crate::msg::{Attr, HashAlgorithm, Timestamp};

    const KIB: u64 = 1 << 10;
    const READ: u64 = 1 << 20;

    fn region(len: u64) -> RegionDesc {
        RegionDesc {
            addr: 0x1000,
            len,
            rkey: 7,
        }
    }

    /// A well-formed mapping of `size` bytes in chunks of `chunk` and windows of
    /// `window`, whose chunk hashes are all zero.
    fn mapping(size: u64, chunk: u32, window: u64) -> MappedFile {
        let chunks = size.div_ceil(u64::from(chunk));
        let hashes = vec![[0u8; 32]; chunks as usize];
        let regions = (0..size.div_ceil(window))
            .map(|i| region(window.min(size - i * window)))
            .collect();
        MappedFile {
            handle: 1,
            attr: Attr::test_file(size),
            version: FileVersion {
                algorithm: HashAlgorithm::Blake3,
                size,
                mtime: Timestamp::default(),
                ctime: Timestamp::default(),
                ino: 7,
                chunk_bytes: chunk,
                manifest: manifest_id(HashAlgorithm::Blake3, size, chunk, &hashes),
            },
            window_bytes: window,
            manifest: (chunks > 0).then(|| region(chunks * 32)),
            regions,
        }
    }

    fn layout(m: &MappedFile) -> Result<MappedLayout, MappedError> {
        MappedLayout::new(m, READ)
    }

    #[test]
    fn a_well_formed_mapping_is_accepted() {
        let m = mapping(10 * READ + 5, 64 << 10, 4 * READ);
        let l = layout(&m).unwrap();
        assert_eq!(l.size(), 10 * READ + 5);
        assert_eq!(l.chunk_bytes(), 64 * KIB);
        assert_eq!(l.chunks(), 161);
        assert_eq!(l.chunk_range(160), 10 * READ..10 * READ + 5);
        assert_eq!(layout(&mapping(0, 4096, 4 * READ)).unwrap().chunks(), 0);
    }

    #[test]
    fn bad_chunk_sizes_are_refused() {
        for chunk in [0, 3 << 10, 2 << 10, 32 << 20, 2 << 20] {
            let mut m = mapping(8 * READ, 64 << 10, 4 * READ);
            m.version.chunk_bytes = chunk;
            assert_eq!(layout(&m), Err(MappedError::ChunkSize), "{chunk}");
        }
        // Within the protocol's bounds but past this reader's largest READ.
        let m = mapping(8 * READ, 1 << 20, 4 * READ);
        assert_eq!(
            MappedLayout::new(&m, 512 * KIB),
            Err(MappedError::ChunkSize)
        );
    }

    #[test]
    fn bad_window_sizes_are_refused() {
        let mut m = mapping(8 * READ, 64 << 10, 4 * READ);
        m.window_bytes = 0;
        assert_eq!(layout(&m), Err(MappedError::WindowSize));
        m.window_bytes = 4 * READ + 4096;
        assert_eq!(layout(&m), Err(MappedError::WindowSize));
    }

    #[test]
    fn a_size_unlike_the_versions_is_refused() {
        let mut m = mapping(8 * READ, 64 << 10, 4 * READ);
        m.attr.size += 1;
        assert_eq!(layout(&m), Err(MappedError::Size));
    }

    #[test]
    fn regions_not_one_per_window_are_refused() {
        let mut m = mapping(8 * READ + 1, 64 << 10, 4 * READ);
        m.regions.pop();
        assert_eq!(layout(&m), Err(MappedError::RegionCount));
        let mut m = mapping(8 * READ, 64 << 10, 4 * READ);
        m.regions.push(region(1));
        assert_eq!(layout(&m), Err(MappedError::RegionCount));
        let mut m = mapping(0, 64 << 10, 4 * READ);
        m.regions.push(region(0));
        assert_eq!(layout(&m), Err(MappedError::RegionCount));
    }

    #[test]
    fn regions_of_the_wrong_length_are_refused() {
        let mut m = mapping(8 * READ + 1, 64 << 10, 4 * READ);
        m.regions[0].len -= 1;
        assert_eq!(layout(&m), Err(MappedError::RegionLength));
        let mut m = mapping(8 * READ + 1, 64 << 10, 4 * READ);
        m.regions[2].len = 4 * READ;
        assert_eq!(layout(&m), Err(MappedError::RegionLength));
    }

    #[test]
    fn bad_manifest_regions_are_refused() {
        let mut m = mapping(8 * READ, 64 << 10, 4 * READ);
        m.manifest = None;
        assert_eq!(layout(&m), Err(MappedError::ManifestRegion));
        let mut m = mapping(8 * READ, 64 << 10, 4 * READ);
        m.manifest = Some(region(128 * 32 + 32));
        assert_eq!(layout(&m), Err(MappedError::ManifestRegion));
        let mut m = mapping(0, 64 << 10, 4 * READ);
        m.manifest = Some(region(0));
        assert_eq!(layout(&m), Err(MappedError::ManifestRegion));
    }

    #[test]
    fn the_first_failed_check_is_reported() {
        let mut m = mapping(8 * READ, 64 << 10, 4 * READ);
        m.version.chunk_bytes = 3;
        m.window_bytes = 0;
        m.manifest = None;
        assert_eq!(layout(&m), Err(MappedError::ChunkSize));
        assert_eq!(
            MappedError::ChunkSize.to_string(),
            "server sent a bad mapping: chunk size"
        );
    }

    #[test]
    fn runs_stay_in_one_region_and_one_read() {
        // 64 KiB chunks, 4 MiB windows: 16 chunks a READ, 64 a region.
        let l = layout(&mapping(10 * READ, 64 << 10, 4 * READ)).unwrap();
        assert!(l.extends_run(0, 0, 1));
        assert!(!l.extends_run(0, 0, 2), "not consecutive");
        assert!(l.extends_run(0, 14, 15));
        assert!(!l.extends_run(0, 15, 16), "a 17th chunk passes 1 MiB");
        assert!(!l.extends_run(60, 63, 64), "chunk 64 is in the next region");
        let r = l.run_read(60, 63).unwrap();
        assert_eq!((r.region, r.offset, r.len), (0, 60 * 64 * KIB, 256 << 10));
        assert_eq!(r.chunk_in_buffer(61), 64 << 10..128 << 10);
        let r = l.run_read(64, 64).unwrap();
        assert_eq!((r.region, r.offset, r.len), (1, 0, 64 << 10));
        // The short last chunk.
        let l = layout(&mapping(READ + 100, 64 << 10, 4 * READ)).unwrap();
        let r = l.run_read(15, 16).unwrap();
        assert_eq!(r.file, 15 * 64 * KIB..READ + 100);
        assert_eq!(r.chunk_in_buffer(16), 64 << 10..(64 << 10) + 100);
    }

    #[test]
    fn reads_outside_the_mapping_are_refused() {
        let l = layout(&mapping(10 * READ, 64 << 10, 4 * READ)).unwrap();
        let outside = |first, last| Err(MappedError::RunOutside { first, last });
        assert_eq!(l.run_read(3, 2), outside(3, 2));
        assert_eq!(l.run_read(159, 160), outside(159, 160), "past the end");
        assert_eq!(l.run_read(63, 64), outside(63, 64), "two regions");
        assert_eq!(l.run_read(0, 16), outside(0, 16), "more than one READ");
        assert!(layout(&mapping(0, 4096, READ))
            .unwrap()
            .run_read(0, 0)
            .is_err());
    }

    #[test]
    fn spans_clip_to_the_end_of_the_file() {
        let l = layout(&mapping(100 * KIB, 16 << 10, 4 * READ)).unwrap();
        assert_eq!(l.span(100 * KIB, 10), None, "at the end");
        assert_eq!(l.span(200 * KIB, 10), None, "past the end");
        assert_eq!(l.span(0, 0), None, "empty");
        assert_eq!(layout(&mapping(0, 4096, READ)).unwrap().span(0, 1), None);
        let s = l.span(20 * KIB, 200 << 10).unwrap();
        assert_eq!((s.start, s.end, s.len()), (20 * KIB, 100 * KIB, 80 * KIB));
        assert_eq!(s.chunks(), 1..=6);
        assert_eq!(s.part_of_chunk(1), 4 << 10..16 << 10);
        assert_eq!(s.part_of_chunk(6), 0..4 << 10);
        assert!(s.ahead(4).is_empty(), "nothing after the last chunk");
        let s = l.span(0, 4096).unwrap();
        assert_eq!(s.chunks(), 0..=0);
        assert_eq!(s.part_of_chunk(0), 0..4096);
        assert_eq!(s.ahead(2), 1..=2);
        assert_eq!(s.ahead(100), 1..=6);
        assert_eq!(s.chunks_in(2 << 20), 128);
    }

    /// A mapping whose manifest is the real hashes of `data`.
    fn mapping_of(data: &[u8], chunk: u32) -> (MappedFile, Vec<u8>) {
        let mut m = mapping(data.len() as u64, chunk, 4 * READ);
        let hashes: Vec<Hash256> = data
            .chunks(chunk as usize)
            .map(|c| hash_chunk(HashAlgorithm::Blake3, c))
            .collect();
        m.version.manifest = manifest_id(HashAlgorithm::Blake3, data.len() as u64, chunk, &hashes);
        (m, hashes.concat())
    }

    #[test]
    fn the_manifest_is_read_in_pieces_and_checked() {
        let data: Vec<u8> = (0..(40 * 4096 + 7)).map(|i| (i % 251) as u8).collect();
        let (m, region_bytes) = mapping_of(&data, 4096);
        // 41 hashes: 1,312 bytes, read 320 bytes (10 hashes) at a time.
        let l = MappedLayout::new(&m, 330).unwrap_err();
        assert_eq!(l, MappedError::ChunkSize, "4 KiB chunks need 4 KiB reads");
        let mut l = MappedLayout::new(&m, READ).unwrap();
        l.max_read_bytes = 330;
        let mut fetch = l.manifest_fetch();
        let mut reads = Vec::new();
        while let Some(r) = fetch.poll_read() {
            reads.push((r.offset, r.len));
            let at = r.offset as usize;
            fetch.handle_read(&region_bytes[at..at + r.len as usize]);
        }
        assert_eq!(
            reads,
            [(0, 320), (320, 320), (640, 320), (960, 320), (1280, 32)]
        );
        let hashes = fetch.finish().unwrap();
        assert_eq!(hashes.concat(), region_bytes);
    }

    #[test]
    fn a_manifest_unlike_its_hash_is_refused() {
        let data = vec![5u8; 3 * 4096];
        let (m, mut region_bytes) = mapping_of(&data, 4096);
        region_bytes[40] ^= 1;
        let mut fetch = layout(&m).unwrap().manifest_fetch();
        let r = fetch.poll_read().unwrap();
        assert_eq!((r.offset, r.len), (0, 96));
        fetch.handle_read(&region_bytes);
        assert_eq!(fetch.finish(), Err(MappedError::ManifestMismatch));
        // Stopped before the region was read whole.
        let fetch = layout(&m).unwrap().manifest_fetch();
        assert_eq!(fetch.finish(), Err(MappedError::ManifestMismatch));
        assert_eq!(
            MappedError::ManifestMismatch.to_string(),
            "integrity: the manifest does not match its hash"
        );
    }

    #[test]
    fn an_empty_file_needs_no_manifest_read() {
        let mut m = mapping(0, 4096, READ);
        let fetch = layout(&m).unwrap().manifest_fetch();
        assert_eq!(fetch.poll_read(), None);
        assert_eq!(fetch.finish(), Ok(Vec::new()));
        m.version.manifest = [1u8; 32];
        let fetch = layout(&m).unwrap().manifest_fetch();
        assert_eq!(fetch.finish(), Err(MappedError::ManifestMismatch));
    }
}
