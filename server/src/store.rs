//! The persistent manifest store of a writable share: chunk manifests of the share's
//! files, kept across restarts so that an unchanged file is not hashed again, and so
//! that `Verify` has something to compare a file's bytes with.
//!
//! **Layout**: a record of more than one chunk is a file of its own,
//! `<share>/.ferry-state/manifests/<ii>/<dev>-<ino>` (hex; `ii` is the inode number's
//! low byte, fanning records out over 256 directories). A record of at most one chunk
//! (every file up to the chunk size, the empty one included) is a slot of
//! [`SLOT_BYTES`] in a *page*, `<share>/.ferry-state/pages/<pp>/<dev>-<page>` with
//! `page = ino >> 8` (so 256 inode numbers share a page; `pp` is the page's low byte),
//! at offset `(ino & 0xff) * SLOT_BYTES`. Pages exist because a record file per small
//! file doubled the inodes an upload of small files creates: on ext4 an inode
//! allocation was the largest cost of a batch (profiled: 25-35 % more files/s for
//! 10,000 files of 4 KiB without the second inode), and consecutive inode numbers,
//! which one directory's new files mostly get, share one page. One record per inode,
//! in the server's chunk size ([`ManifestStore::chunk_bytes`]): hard links share one
//! record, as they share one content. A file that crosses the chunk size may have both
//! a slot and a record file; the one of the later ctime is the inode's record
//! ([`ManifestStore::load`]), and a lookup of an exact key ([`ManifestStore::get`])
//! matches only the version it names. Record files of one-chunk files, which ferryd
//! wrote before pages existed, are still read.
//!
//! **`<dev>` of the share's own file system is 0** ([`HOME_DEV`]), in names and in
//! records: the store lives on that file system (under the share's root), so "the
//! file system holding this store" names it for as long as the records exist, while
//! its device number does not: a loop image or LVM volume mounted again, or a disk
//! found in another order at boot, comes back under another number with every inode,
//! ctime and byte as it was. A record keyed by that number would then miss, and the
//! first read after rot underneath would hash and record the damaged bytes as the
//! truth. Files on another file system mounted inside the share keep their device
//! number. Records written before this rule (ferryd up to this change), under the
//! device number the share's file system had then, are still read and forgotten while
//! that number holds ([`ManifestStore::stored_devs`]). The state directory is reserved
//! ([`ferry_common::STATE_DIR`]): no request can name or list it, and the startup
//! cleaner does not enter it.
//!
//! **Record** (little-endian): magic `FRYMAN0` and one digit naming the algorithm of
//! its chunk hashes (`1`: SHA-256, which every record written before BLAKE3 is; `2`:
//! BLAKE3; [`HashAlgorithm::code`]), then the [`ManifestKey`] it was taken
//! of (`dev u64, ino u64, size u64, mtime_ns i128, ctime_ns i128, chunk_bytes u32`),
//! the chunk count (`u64`, which must be the key's `chunk_count(size, chunk_bytes)`),
//! the hashes (32 bytes each), and the SHA-256 of everything before it (whatever the
//! algorithm of the hashes: it guards against tearing); in a slot,
//! zeros pad it to [`SLOT_BYTES`] (a slot never written reads as zeros: no magic, a
//! miss). A record is used only when its whole key equals the file's key now
//! ([`ManifestStore::get`]); one that is short, long, corrupt, of another inode or of
//! another version is just a miss.
//!
//! **Why a changed file is never taken for unchanged**: see [`crate::filekey`] for
//! the key. Writes of records follow the same "settled" rule as the cache, with one
//! addition for ferryd's own changes (an upload's commit, a hard link): there the
//! key's ctime is ferryd's own change, just now, and the record is saved only if the
//! file's mtime differs from that ctime ([`crate::filekey::mtime_settled`]), so any
//! later write, which sets mtime and ctime to the time of writing, changes the key
//! even within the same clock tick. A mount's write to a staged file is recorded the same way at
//! its commit, from the hashes its writes carried ([`crate::written`]).
//!
//! **Writes** rewrite the record file in place: truncated, then the new bytes written
//! (never fsynced); a slot is one `pwrite` of its whole [`SLOT_BYTES`], so saves of
//! different inodes of one page never touch each other's bytes. Nothing trusts a record that fails its
//! checksum, so a reader meeting one half-written, one torn by a crash, or two saves
//! interleaved, misses, costing one hashing. (Records were written to a temporary
//! name and renamed over before: on ext4 that doubled the directory work of every
//! small file an upload batch stores, a profiled 17 % of ferryd's CPU for 10,000
//! files of 4 KiB.) A re-key after ferryd's own link ([`ManifestStore::rekey`])
//! rewrites only the changed bytes: same length, only the key's ctime and the checksum
//! change.
//!
//! **Garbage**: records of inodes that no longer exist are removed by
//! [`ManifestStore::prune`], which ferryd runs once at start (after the cleaner, in the
//! background): one walk of the share reading directory entries only (no `stat` per
//! file), then every record file whose inode number was not met is removed, and every
//! page none of whose 256 inode numbers was met. A record of a reused inode number
//! survives until it is overwritten; its key never matches.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::{DirBuilderExt, DirEntryExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

use ferry_common::chunk::{chunk_count, hash_chunk};
use ferry_common::msg::{Hash256, HashAlgorithm};
use ferry_common::STATE_DIR;

use crate::filekey::ManifestKey;

/// Most pages one [`ManifestStore::save_many`] keeps open (past that it starts over),
/// bounding the descriptors a batch holds.
const MAX_OPEN_PAGES: usize = 32;

/// Directory of the record files inside the state directory.
const MANIFESTS_DIR: &str = "manifests";

/// Directory of the pages of one-chunk records inside the state directory.
const PAGES_DIR: &str = "pages";

/// Bits of an inode number that select its slot in a page.
const PAGE_BITS: u32 = 8;

/// Bytes of one slot: a record of at most one hash (`HEADER_BYTES + 32 + 32` = 140),
/// zero-padded.
pub const SLOT_BYTES: usize = 160;

/// First bytes of a record, before the digit naming its algorithm.
const MAGIC_PREFIX: [u8; 7] = *b"FRYMAN0";

/// The magic of a record whose hashes are in `algorithm`.
fn magic(algorithm: HashAlgorithm) -> [u8; 8] {
    let mut m = [0u8; 8];
    m[..7].copy_from_slice(&MAGIC_PREFIX);
    m[7] = b'0' + algorithm.code();
    m
}

/// The algorithm a record's magic names, if it is one.
fn algorithm_of(magic: &[u8]) -> Option<HashAlgorithm> {
    if magic.len() != 8 || magic[..7] != MAGIC_PREFIX {
        return None;
    }
    HashAlgorithm::from_code(magic[7].checked_sub(b'0')?)
}

/// Bytes of a record before its hashes: magic, key, count.
const HEADER_BYTES: usize = 8 + 8 + 8 + 8 + 16 + 16 + 4 + 8;

/// The device number a record stores for a file on the store's own file system (see
/// the module docs). No file system has device 0: Linux numbers the anonymous devices
/// (major 0) from minor 1.
pub const HOME_DEV: u64 = 0;

/// Prefix of the temporary records that earlier versions of ferryd wrote;
/// [`ManifestStore::prune`] removes stale ones.
const TEMP_RECORD_PREFIX: &str = ".tmp.";

/// A manifest record as stored: the key it was taken of and its hashes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The file version the hashes describe.
    pub key: ManifestKey,
    /// The algorithm of `hashes`.
    pub algorithm: HashAlgorithm,
    /// The hash of each chunk of `key.chunk_bytes`, in order.
    pub hashes: Vec<Hash256>,
}

/// What a [`ManifestStore::prune`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PruneReport {
    /// Records kept (their inode was met in the walk).
    pub kept: u64,
    /// Records (and stale temporary records) removed.
    pub removed: u64,
    /// Directories or records that could not be examined or removed.
    pub failed: u64,
}

/// The manifest records of one share (see the module docs).
#[derive(Debug)]
pub struct ManifestStore {
    /// The share's canonical root.
    root: PathBuf,
    /// `<root>/.ferry-state/manifests`.
    dir: PathBuf,
    /// `<root>/.ferry-state/pages`.
    pages: PathBuf,
    chunk_bytes: u32,
    /// The device number of the root's file system when the store was made (`None` if
    /// it could not be read): its files' records use [`HOME_DEV`].
    home: Option<u64>,
    /// False for a read-only share's store: its records are read, never written
    /// ([`ManifestStore::reader`]).
    writable: bool,
    /// Set once the state and manifests directories are known to be real directories
    /// (created if missing); until then every save checks them.
    ready: AtomicBool,
}

impl ManifestStore {
    /// The store of the share rooted at `root` (canonical), for manifests in chunks of
    /// `chunk_bytes`. Nothing is created until the first record is saved.
    pub fn new(root: &Path, chunk_bytes: u32) -> ManifestStore {
        ManifestStore {
            root: root.to_owned(),
            dir: root.join(STATE_DIR).join(MANIFESTS_DIR),
            pages: root.join(STATE_DIR).join(PAGES_DIR),
            chunk_bytes,
            home: fs::metadata(root).ok().map(|m| m.dev()),
            writable: true,
            ready: AtomicBool::new(false),
        }
    }

    /// The store of a read-only share rooted at `root`: the records ferryd saved while
    /// the share was writable are read (so a reader still gets the hashes recorded
    /// when a file was written, and rot since is caught), and nothing is ever written:
    /// every save, re-key or forget fails with [`io::ErrorKind::ReadOnlyFilesystem`],
    /// and [`ManifestStore::prune`] does nothing.
    pub fn reader(root: &Path, chunk_bytes: u32) -> ManifestStore {
        ManifestStore {
            writable: false,
            ..ManifestStore::new(root, chunk_bytes)
        }
    }

    /// False for a read-only share's store ([`ManifestStore::reader`]).
    #[cfg(test)]
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    /// Fails unless records may be written (see [`ManifestStore::reader`]).
    fn check_writable(&self) -> io::Result<()> {
        if self.writable {
            Ok(())
        } else {
            Err(io::Error::new(
                io::ErrorKind::ReadOnlyFilesystem,
                "the share is read-only: its manifest records are not written",
            ))
        }
    }

    /// [`ManifestStore::new`] as if the root's file system had device number `home`.
    #[cfg(test)]
    fn with_home(root: &Path, chunk_bytes: u32, home: Option<u64>) -> ManifestStore {
        ManifestStore {
            home,
            ..ManifestStore::new(root, chunk_bytes)
        }
    }

    /// The device number records of files on `dev` are saved under.
    fn stored_dev(&self, dev: u64) -> u64 {
        if self.home == Some(dev) {
            HOME_DEV
        } else {
            dev
        }
    }

    /// The device numbers records of files on `dev` may be found under, the one saved
    /// under first: for the store's own file system also its device number now, under
    /// which ferryd recorded before [`HOME_DEV`] (module docs).
    fn stored_devs(&self, dev: u64) -> impl Iterator<Item = u64> {
        let home = self.home == Some(dev);
        std::iter::once(self.stored_dev(dev)).chain(home.then_some(dev))
    }

    /// The chunk size of every record.
    pub fn chunk_bytes(&self) -> u32 {
        self.chunk_bytes
    }

    fn record_path(&self, dev: u64, ino: u64) -> PathBuf {
        self.dir
            .join(format!("{:02x}", ino & 0xff))
            .join(format!("{dev:x}-{ino:x}"))
    }

    /// The page holding inode `ino`'s slot, and the slot's offset in it.
    fn slot_of(&self, dev: u64, ino: u64) -> (PathBuf, u64) {
        let page = ino >> PAGE_BITS;
        let path = self
            .pages
            .join(format!("{:02x}", page & 0xff))
            .join(format!("{dev:x}-{page:x}"));
        let index = ino & ((1 << PAGE_BITS) - 1);
        (path, index * SLOT_BYTES as u64)
    }

    /// The record of inode `ino` on `dev`, whatever version it was taken of; `None` if
    /// there is none or it is unreadable or corrupt. Of a slot and a record file, the
    /// one of the later ctime (module docs). Blocking.
    pub fn load(&self, dev: u64, ino: u64) -> Option<Record> {
        let mut latest: Option<Record> = None;
        for stored in self.stored_devs(dev) {
            let found = [self.load_slot(stored, ino), self.load_file(stored, ino)];
            for record in found.into_iter().flatten() {
                if latest
                    .as_ref()
                    .is_none_or(|l| record.key.ctime_ns > l.key.ctime_ns)
                {
                    latest = Some(record);
                }
            }
        }
        latest.map(|record| Record {
            key: ManifestKey { dev, ..record.key },
            ..record
        })
    }

    /// The record file of inode `ino` saved under device number `stored`, if it holds a
    /// valid record of it (its key's `dev` is `stored`).
    fn load_file(&self, stored: u64, ino: u64) -> Option<Record> {
        let path = self.record_path(stored, ino);
        let mut file = open_record(&path, false)?;
        read_record(&mut file, &path, stored, ino)
    }

    /// The slot of inode `ino` saved under device number `stored`, if it holds a valid
    /// record of it (its key's `dev` is `stored`).
    fn load_slot(&self, stored: u64, ino: u64) -> Option<Record> {
        let (path, at) = self.slot_of(stored, ino);
        let file = open_record(&path, false)?;
        read_slot(&file, at, stored, ino)
    }

    /// Saves the record of version `old` again under `new`, if the inode's record is
    /// of exactly `old`: for a change of the file that leaves its content as it was
    /// and moves only its ctime (ferryd's own `link`; the caller vouches for that, as
    /// for [`ManifestStore::save`]). Returns whether the record was re-keyed.
    ///
    /// The record is rewritten in place (same length: same size, same hashes), like
    /// every write of a record (module docs): a reader meeting a half-written record
    /// (or one torn by a crash, or a `save` racing the rewrite) misses. Blocking.
    pub fn rekey(&self, old: &ManifestKey, new: &ManifestKey) -> io::Result<bool> {
        let same_content = old.dev == new.dev
            && old.ino == new.ino
            && old.size == new.size
            && old.mtime_ns == new.mtime_ns
            && old.chunk_bytes == new.chunk_bytes;
        if !same_content {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a re-key keeps the inode, size, mtime and chunk size",
            ));
        }
        if old.chunk_bytes != self.chunk_bytes {
            return Ok(false);
        }
        self.check_writable()?;
        for stored in self.stored_devs(old.dev) {
            // Rewritten where it was found, under the device number it was saved under.
            let old = ManifestKey {
                dev: stored,
                ..*old
            };
            let new = ManifestKey {
                dev: stored,
                ..*new
            };
            let bytes = |record: &Record| encode(&new, record.algorithm, &record.hashes);
            if fits_slot(&old) {
                let (path, at) = self.slot_of(stored, old.ino);
                if let Some(file) = open_record(&path, true) {
                    if let Some(record) = read_slot(&file, at, stored, old.ino) {
                        if record.key == old {
                            file.write_all_at(&slot_bytes(&bytes(&record)), at)?;
                            return Ok(true);
                        }
                    }
                }
            }
            // A record file: of a larger file, or of a one-chunk file recorded before
            // pages existed.
            let path = self.record_path(stored, old.ino);
            let Some(mut file) = open_record(&path, true) else {
                continue;
            };
            if let Some(record) = read_record(&mut file, &path, stored, old.ino) {
                if record.key == old {
                    file.write_all_at(&bytes(&record), 0)?;
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// The hashes recorded for exactly the version `key` names; `None` otherwise.
    /// Blocking.
    pub fn get(&self, key: &ManifestKey) -> Option<(HashAlgorithm, Vec<Hash256>)> {
        if key.chunk_bytes != self.chunk_bytes {
            return None;
        }
        for stored in self.stored_devs(key.dev) {
            let want = ManifestKey {
                dev: stored,
                ..*key
            };
            let exact =
                |record: Record| (record.key == want).then_some((record.algorithm, record.hashes));
            if fits_slot(key) {
                if let Some(hashes) = self.load_slot(stored, key.ino).and_then(exact) {
                    return Some(hashes);
                }
            }
            if let Some(hashes) = self.load_file(stored, key.ino).and_then(exact) {
                return Some(hashes);
            }
        }
        None
    }

    /// Forgets every record of inode `ino` on `dev`, whatever version it was taken of:
    /// its slot is zeroed (if it holds a record of this inode) and its record file
    /// removed. For a file changed in place by a client (`FileWrite` and the other
    /// handle requests): its ctime may not have moved (a change within the same
    /// timestamp tick), so its old record could otherwise still match its key.
    /// Blocking.
    pub fn forget(&self, dev: u64, ino: u64) -> io::Result<()> {
        self.check_writable()?;
        for stored in self.stored_devs(dev) {
            let (path, at) = self.slot_of(stored, ino);
            if let Some(file) = open_record(&path, true) {
                if read_slot(&file, at, stored, ino).is_some() {
                    file.write_all_at(&[0u8; SLOT_BYTES], at)?;
                }
            }
            match fs::remove_file(self.record_path(stored, ino)) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }

    #[cfg(test)]
    fn get_hashes(&self, key: &ManifestKey) -> Option<Vec<Hash256>> {
        self.get(key).map(|(_, h)| h)
    }

    /// Records `hashes` as the manifest of version `key`, replacing the inode's
    /// previous record. The caller vouches that `hashes` are the content of that
    /// version and that a later change of the file changes its key (a settled file, or
    /// [`crate::filekey::mtime_settled`]). A key in another chunk size is not stored. Blocking.
    pub fn save(
        &self,
        key: &ManifestKey,
        algorithm: HashAlgorithm,
        hashes: &[Hash256],
    ) -> io::Result<()> {
        self.save_each(&mut HashMap::new(), key, algorithm, hashes)
    }

    /// [`ManifestStore::save`] of several records (key, algorithm, hashes), each page
    /// opened once for all of them (the records of one directory's new files mostly
    /// share a page): one result per record. Blocking.
    pub fn save_many<'h>(
        &self,
        records: impl IntoIterator<Item = (ManifestKey, HashAlgorithm, &'h [Hash256])>,
    ) -> Vec<io::Result<()>> {
        let mut pages = HashMap::new();
        records
            .into_iter()
            .map(|(key, algorithm, hashes)| self.save_each(&mut pages, &key, algorithm, hashes))
            .collect()
    }

    /// [`ManifestStore::save`], a page found in `pages` (by path) written through the
    /// file open there, and one opened kept there.
    fn save_each(
        &self,
        pages: &mut HashMap<PathBuf, fs::File>,
        key: &ManifestKey,
        algorithm: HashAlgorithm,
        hashes: &[Hash256],
    ) -> io::Result<()> {
        if key.chunk_bytes != self.chunk_bytes {
            return Ok(());
        }
        self.check_writable()?;
        if hashes.len() as u64 != chunk_count(key.size, key.chunk_bytes) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "manifest length does not match the file size",
            ));
        }
        self.prepare()?;
        let stored = self.stored_dev(key.dev);
        let bytes = encode(
            &ManifestKey {
                dev: stored,
                ..*key
            },
            algorithm,
            hashes,
        );
        if fits_slot(key) {
            let (path, at) = self.slot_of(stored, key.ino);
            if pages.len() >= MAX_OPEN_PAGES && !pages.contains_key(&path) {
                pages.clear();
            }
            let page = match pages.entry(path) {
                Entry::Occupied(e) => e.into_mut(),
                Entry::Vacant(e) => {
                    let page = self.open_for_write(e.key(), false)?;
                    e.insert(page)
                }
            };
            return page.write_all_at(&slot_bytes(&bytes), at);
        }
        // In place, not through a temporary name and a rename: see the module docs.
        let path = self.record_path(stored, key.ino);
        self.open_for_write(&path, true)?.write_all_at(&bytes, 0)
    }

    /// Opens (creating it, mode 0600, and its fan-out directory if missing; truncated
    /// if `truncate`) the record file or page at `path`, never through a symlink.
    fn open_for_write(&self, path: &Path, truncate: bool) -> io::Result<fs::File> {
        let open = || {
            fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(truncate)
                .mode(0o600)
                .custom_flags(nix::libc::O_NOFOLLOW)
                .open(path)
        };
        match open() {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // The fan-out directory does not exist yet.
                let dir = path.parent().unwrap_or(&self.dir);
                match fs::DirBuilder::new().mode(0o700).create(dir) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                    Err(e) => return Err(e),
                }
                open()
            }
            opened => opened,
        }
    }

    /// Creates the state, manifests and pages directories if missing (mode 0700) and
    /// checks that all are real directories, not symlinks; once.
    fn prepare(&self) -> io::Result<()> {
        if self.ready.load(Ordering::Acquire) {
            return Ok(());
        }
        for dir in [
            self.root.join(STATE_DIR),
            self.dir.clone(),
            self.pages.clone(),
        ] {
            match fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            }
            if !fs::symlink_metadata(&dir)?.is_dir() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{} is not a directory", dir.display()),
                ));
            }
        }
        self.ready.store(true, Ordering::Release);
        Ok(())
    }

    /// Removes the record files whose inode no longer exists in the share, the pages
    /// none of whose inodes exists, and temporary records older than `started` (see the
    /// module docs). Records and pages written after `started` are kept whatever the
    /// walk saw: their file may have been created behind it. Blocking; walks the whole
    /// share once.
    pub fn prune(&self, started: SystemTime) -> PruneReport {
        let mut report = PruneReport::default();
        if !self.writable || (!self.dir.is_dir() && !self.pages.is_dir()) {
            return report;
        }
        let live = self.live_inodes(&mut report);
        let live_pages: HashSet<u64> = live.iter().map(|ino| ino >> PAGE_BITS).collect();
        prune_fans(&self.dir, started, &mut report, |name| {
            parse_name(name).is_some_and(|(_, ino)| live.contains(&ino))
        });
        prune_fans(&self.pages, started, &mut report, |name| {
            parse_name(name).is_some_and(|(_, page)| live_pages.contains(&page))
        });
        report
    }

    /// Inode numbers of the regular files under the root (from directory entries, no
    /// `stat`; symlinks not followed; the state directory skipped).
    fn live_inodes(&self, report: &mut PruneReport) -> HashSet<u64> {
        let mut live = HashSet::new();
        let mut dirs = vec![self.root.clone()];
        while let Some(dir) = dirs.pop() {
            let Ok(entries) = fs::read_dir(&dir) else {
                report.failed += 1;
                continue;
            };
            for entry in entries.flatten() {
                let Ok(kind) = entry.file_type() else {
                    continue;
                };
                if kind.is_dir() {
                    if !(dir == self.root && entry.file_name() == STATE_DIR) {
                        dirs.push(entry.path());
                    }
                } else if kind.is_file() {
                    live.insert(entry.ino());
                }
            }
        }
        live
    }
}

/// Removes what the fan-out directories under `dir` hold that is neither `live` (by
/// name) nor written after `started`, and temporary records older than `started`.
fn prune_fans(
    dir: &Path,
    started: SystemTime,
    report: &mut PruneReport,
    live: impl Fn(&str) -> bool,
) {
    let Ok(fans) = fs::read_dir(dir) else {
        return;
    };
    for fan in fans.flatten() {
        if !fan.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let Ok(records) = fs::read_dir(fan.path()) else {
            report.failed += 1;
            continue;
        };
        for record in records.flatten() {
            let name = record.file_name();
            let name = name.to_string_lossy();
            let temporary = name.starts_with(TEMP_RECORD_PREFIX);
            let recent = record
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t >= started);
            if recent || (!temporary && live(&name)) {
                report.kept += u64::from(!temporary);
                continue;
            }
            match fs::remove_file(record.path()) {
                Ok(()) => report.removed += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(record = %record.path().display(), "cannot remove a manifest record: {e}");
                    report.failed += 1;
                }
            }
        }
    }
}

/// True if the record of `key` goes in a slot: at most one chunk.
fn fits_slot(key: &ManifestKey) -> bool {
    chunk_count(key.size, key.chunk_bytes) <= 1
}

/// A slot's bytes: `record` (at most [`SLOT_BYTES`], [`fits_slot`]) zero-padded.
fn slot_bytes(record: &[u8]) -> [u8; SLOT_BYTES] {
    let mut slot = [0u8; SLOT_BYTES];
    slot[..record.len()].copy_from_slice(record);
    slot
}

/// The record in the slot at `at` of the page `file`, if it is a valid one of inode
/// `ino` on `dev` (of at most one chunk).
fn read_slot(file: &fs::File, at: u64, dev: u64, ino: u64) -> Option<Record> {
    let mut slot = [0u8; SLOT_BYTES];
    file.read_exact_at(&mut slot, at).ok()?;
    let header: &[u8; HEADER_BYTES] = slot[..HEADER_BYTES].try_into().ok()?;
    let (key, algorithm, count) = decode_header(header)?;
    if key.dev != dev || key.ino != ino || count > 1 {
        return None;
    }
    checked(
        &slot[..HEADER_BYTES + 32 * count as usize + 32],
        key,
        algorithm,
    )
}

/// Opens the record at `path` for reading (and writing, if `write`), never through a
/// symlink; `None` if it is missing or cannot be opened.
fn open_record(path: &Path, write: bool) -> Option<fs::File> {
    match fs::OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
    {
        Ok(f) => Some(f),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => {
            tracing::debug!(record = %path.display(), "cannot open a manifest record: {e}");
            None
        }
    }
}

/// The record in `file` (at `path`) if it is a valid one of inode `ino` on `dev`.
fn read_record(file: &mut fs::File, path: &Path, dev: u64, ino: u64) -> Option<Record> {
    let len = file.metadata().ok()?.len();
    // Bounded before reading: the header says how long the record must be.
    let mut header = [0u8; HEADER_BYTES];
    file.read_exact(&mut header).ok()?;
    let (key, algorithm, count) = decode_header(&header)?;
    if key.dev != dev || key.ino != ino {
        return None;
    }
    let want = (HEADER_BYTES as u64)
        .checked_add(count.checked_mul(32)?)?
        .checked_add(32)?;
    if len != want {
        tracing::debug!(record = %path.display(), "manifest record of the wrong length");
        return None;
    }
    let mut all = vec![0u8; usize::try_from(want).ok()?];
    all[..HEADER_BYTES].copy_from_slice(&header);
    file.read_exact(&mut all[HEADER_BYTES..]).ok()?;
    let record = checked(&all, key, algorithm);
    if record.is_none() {
        tracing::debug!(record = %path.display(), "manifest record fails its checksum");
    }
    record
}

/// The record of `key` whose bytes, header to checksum, are `all`, if its checksum
/// holds.
fn checked(all: &[u8], key: ManifestKey, algorithm: HashAlgorithm) -> Option<Record> {
    let (signed, check) = all.split_at(all.len().checked_sub(32)?);
    if hash_chunk(HashAlgorithm::Sha256, signed)[..] != *check {
        return None;
    }
    let hashes = signed[HEADER_BYTES..]
        .chunks_exact(32)
        .map(|c| {
            let mut h = [0u8; 32];
            h.copy_from_slice(c);
            h
        })
        .collect();
    Some(Record {
        key,
        algorithm,
        hashes,
    })
}

/// `(dev, ino)` of a record's file name.
fn parse_name(name: &str) -> Option<(u64, u64)> {
    let (dev, ino) = name.split_once('-')?;
    Some((
        u64::from_str_radix(dev, 16).ok()?,
        u64::from_str_radix(ino, 16).ok()?,
    ))
}

fn encode(key: &ManifestKey, algorithm: HashAlgorithm, hashes: &[Hash256]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + 32 * hashes.len() + 32);
    out.extend_from_slice(&magic(algorithm));
    out.extend_from_slice(&key.dev.to_le_bytes());
    out.extend_from_slice(&key.ino.to_le_bytes());
    out.extend_from_slice(&key.size.to_le_bytes());
    out.extend_from_slice(&key.mtime_ns.to_le_bytes());
    out.extend_from_slice(&key.ctime_ns.to_le_bytes());
    out.extend_from_slice(&key.chunk_bytes.to_le_bytes());
    out.extend_from_slice(&(hashes.len() as u64).to_le_bytes());
    for h in hashes {
        out.extend_from_slice(h);
    }
    let check = hash_chunk(HashAlgorithm::Sha256, &out);
    out.extend_from_slice(&check);
    out
}

/// The key, hash algorithm and chunk count of a record's header, if it is one of a
/// valid record.
fn decode_header(h: &[u8; HEADER_BYTES]) -> Option<(ManifestKey, HashAlgorithm, u64)> {
    let algorithm = algorithm_of(&h[..8])?;
    let mut at = 8;
    let mut take = |n: usize| {
        let s = &h[at..at + n];
        at += n;
        s
    };
    let u64_of = |s: &[u8]| u64::from_le_bytes(s.try_into().unwrap_or([0; 8]));
    let i128_of = |s: &[u8]| i128::from_le_bytes(s.try_into().unwrap_or([0; 16]));
    let dev = u64_of(take(8));
    let ino = u64_of(take(8));
    let size = u64_of(take(8));
    let mtime_ns = i128_of(take(16));
    let ctime_ns = i128_of(take(16));
    let chunk_bytes = u32::from_le_bytes(take(4).try_into().unwrap_or([0; 4]));
    let count = u64_of(take(8));
    if chunk_bytes == 0 || count != chunk_count(size, chunk_bytes) {
        return None;
    }
    let key = ManifestKey {
        dev,
        ino,
        size,
        mtime_ns,
        ctime_ns,
        chunk_bytes,
    };
    Some((key, algorithm, count))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    const C: u32 = 4096;

    fn key(ino: u64, size: u64) -> ManifestKey {
        ManifestKey {
            dev: 7,
            ino,
            size,
            mtime_ns: 1_000,
            ctime_ns: 5_000_000_000,
            chunk_bytes: C,
        }
    }

    fn hashes(n: usize, fill: u8) -> Vec<Hash256> {
        (0..n).map(|i| [fill.wrapping_add(i as u8); 32]).collect()
    }

    /// Saves a BLAKE3 record of `k`.
    fn save(store: &ManifestStore, k: &ManifestKey, h: &[Hash256]) {
        store.save(k, HashAlgorithm::Blake3, h).unwrap();
    }

    #[test]
    fn forget_drops_slot_and_file_records_of_one_inode_only() {
        let dir = tempfile::tempdir().unwrap();
        let store = ManifestStore::new(dir.path(), C);
        let small = key(0x300, 100);
        let neighbour = key(0x301, 100);
        let big = key(0x302, 3 * u64::from(C));
        save(&store, &small, &hashes(1, 1));
        save(&store, &neighbour, &hashes(1, 2));
        save(&store, &big, &hashes(3, 3));
        store.forget(7, 0x300).unwrap();
        store.forget(7, 0x302).unwrap();
        assert!(store.get_hashes(&small).is_none());
        assert!(store.get_hashes(&big).is_none());
        assert!(store.load(7, 0x302).is_none());
        assert_eq!(store.get_hashes(&neighbour), Some(hashes(1, 2)));
        // Nothing recorded: nothing to do.
        store.forget(7, 0x999).unwrap();
    }

    #[test]
    fn a_save_over_a_longer_record_leaves_only_the_new_one() {
        let dir = tempfile::tempdir().unwrap();
        let store = ManifestStore::new(dir.path(), C);
        let long = key(0x42, 5 * u64::from(C));
        save(&store, &long, &hashes(5, 1));
        let shorter = ManifestKey {
            size: 2 * u64::from(C),
            ..key(0x42, 0)
        };
        save(&store, &shorter, &hashes(2, 9));
        assert_eq!(store.get_hashes(&shorter), Some(hashes(2, 9)));
        assert!(store.get_hashes(&long).is_none());
        let len = fs::metadata(store.record_path(7, 0x42)).unwrap().len();
        assert_eq!(len as usize, HEADER_BYTES + 2 * 32 + 32);
    }

    #[test]
    fn save_many_saves_each_record_as_save_does() {
        let dir = tempfile::tempdir().unwrap();
        let store = ManifestStore::new(dir.path(), C);
        // Two pages, a record file of two chunks, and one of a wrong length.
        let cases: Vec<(ManifestKey, Vec<Hash256>)> = vec![
            (key(0x300, 10), hashes(1, 1)),
            (key(0x301, 0), hashes(0, 2)),
            (key(0x500, 20), hashes(1, 3)),
            (key(0x302, u64::from(C) + 1), hashes(2, 4)),
            (key(0x303, 10), hashes(2, 5)),
        ];
        let results = store.save_many(
            cases
                .iter()
                .map(|(k, h)| (*k, HashAlgorithm::Blake3, h.as_slice())),
        );
        assert_eq!(results.len(), 5);
        assert!(results[..4].iter().all(Result::is_ok), "{results:?}");
        assert!(results[4].is_err());
        for (k, h) in &cases[..4] {
            assert_eq!(store.get_hashes(k).as_ref(), Some(h), "{:x}", k.ino);
        }
        assert!(store.get_hashes(&cases[4].0).is_none());
        assert!(store.record_path(7, 0x302).exists());
    }

    #[test]
    fn one_chunk_records_share_a_page_and_keep_out_of_each_others_slots() {
        let dir = tempfile::tempdir().unwrap();
        let store = ManifestStore::new(dir.path(), C);
        // 0x300..0x3ff share a page; 0x400 starts the next one. (inode, size, hashes)
        let cases: Vec<(u64, u64, Vec<Hash256>)> =
            [(0x300, 0), (0x301, 1), (0x3ff, C), (0x400, 100)]
                .into_iter()
                .enumerate()
                .map(|(i, (ino, size))| {
                    (ino, u64::from(size), hashes(usize::from(size > 0), i as u8))
                })
                .collect();
        for (ino, size, h) in &cases {
            store
                .save(&key(*ino, *size), HashAlgorithm::Blake3, h)
                .unwrap();
        }
        for (ino, size, h) in &cases {
            assert_eq!(
                store.get_hashes(&key(*ino, *size)).as_ref(),
                Some(h),
                "{ino:x}"
            );
            assert!(store.get_hashes(&key(*ino, size + 1)).is_none());
        }
        // No record file, two pages; an empty slot between them is a miss.
        assert!(!store.record_path(7, 0x300).exists());
        let (page, at) = store.slot_of(7, 0x3ff);
        assert_eq!(at, 0xff * SLOT_BYTES as u64);
        assert_eq!(fs::metadata(&page).unwrap().len(), 256 * SLOT_BYTES as u64);
        assert_eq!(page, store.slot_of(7, 0x300).0);
        assert_ne!(page, store.slot_of(7, 0x400).0);
        assert!(store.load(7, 0x302).is_none());
        // Another device's inode of the same number has a page of its own.
        assert!(store.load(8, 0x300).is_none());
        // A save replaces only its own slot.
        let newer = ManifestKey {
            ctime_ns: 6_000_000_000,
            ..key(0x301, 7)
        };
        save(&store, &newer, &hashes(1, 42));
        assert_eq!(store.get_hashes(&newer), Some(hashes(1, 42)));
        assert!(store.get_hashes(&key(0x301, 1)).is_none());
        assert_eq!(store.get_hashes(&key(0x300, 0)), Some(hashes(0, 0)));
        assert_eq!(
            store.get_hashes(&key(0x3ff, u64::from(C))),
            Some(hashes(1, 2))
        );
    }

    #[test]
    fn a_file_crossing_the_chunk_size_is_recorded_by_its_later_version() {
        let dir = tempfile::tempdir().unwrap();
        let store = ManifestStore::new(dir.path(), C);
        let at = |ctime_ns, size| ManifestKey {
            ctime_ns,
            ..key(0x55, size)
        };
        let long = at(5_000_000_000, 3 * u64::from(C));
        save(&store, &long, &hashes(3, 1));
        let short = at(6_000_000_000, 10);
        save(&store, &short, &hashes(1, 2));
        assert_eq!(store.load(7, 0x55).unwrap().key, short);
        assert_eq!(store.get_hashes(&short), Some(hashes(1, 2)));
        let long_again = at(7_000_000_000, 2 * u64::from(C));
        save(&store, &long_again, &hashes(2, 3));
        assert_eq!(store.load(7, 0x55).unwrap().key, long_again);
        assert_eq!(store.get_hashes(&long_again), Some(hashes(2, 3)));
        assert!(store.get_hashes(&long).is_none());
    }

    #[test]
    fn a_one_chunk_record_file_of_an_older_ferryd_is_still_read_and_rekeyed() {
        let dir = tempfile::tempdir().unwrap();
        let store = ManifestStore::new(dir.path(), C);
        let k = key(0x66, 100);
        let path = store.record_path(7, 0x66);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, encode(&k, HashAlgorithm::Blake3, &hashes(1, 5))).unwrap();
        assert_eq!(store.get_hashes(&k), Some(hashes(1, 5)));
        assert_eq!(store.load(7, 0x66).unwrap().key, k);
        let new = ManifestKey {
            ctime_ns: k.ctime_ns + 1,
            ..k
        };
        assert!(store.rekey(&k, &new).unwrap());
        assert_eq!(store.get_hashes(&new), Some(hashes(1, 5)));
        assert!(store.get_hashes(&k).is_none());
    }

    #[test]
    fn records_round_trip_and_any_other_key_misses() {
        let dir = tempfile::tempdir().unwrap();
        let store = ManifestStore::new(dir.path(), C);
        assert!(store.get_hashes(&key(0x1234, 9000)).is_none());
        save(&store, &key(0x1234, 9000), &hashes(3, 1));
        assert_eq!(store.get_hashes(&key(0x1234, 9000)).unwrap(), hashes(3, 1));
        let path = dir.path().join(".ferry-state/manifests/34/7-1234");
        assert!(path.is_file(), "{path:?}");
        for other in [
            ManifestKey {
                ctime_ns: 5_000_000_001,
                ..key(0x1234, 9000)
            },
            ManifestKey {
                mtime_ns: 1_001,
                ..key(0x1234, 9000)
            },
            ManifestKey {
                size: 8999,
                ..key(0x1234, 9000)
            },
            ManifestKey {
                dev: 8,
                ..key(0x1234, 9000)
            },
            ManifestKey {
                chunk_bytes: 2 * C,
                ..key(0x1234, 9000)
            },
            key(0x1235, 9000),
        ] {
            assert!(store.get_hashes(&other).is_none(), "{other:?}");
        }
        // A newer version replaces the record of the inode.
        let newer = ManifestKey {
            ctime_ns: 6_000_000_000,
            ..key(0x1234, 5000)
        };
        save(&store, &newer, &hashes(2, 9));
        assert!(store.get_hashes(&key(0x1234, 9000)).is_none());
        assert_eq!(store.load(7, 0x1234).unwrap().key, newer);
        // Other chunk sizes are not stored; a wrong count is refused.
        save(
            &store,
            &ManifestKey {
                chunk_bytes: 2 * C,
                ..key(9, 9000)
            },
            &hashes(2, 0),
        );
        assert!(store.load(7, 9).is_none());
        assert!(store
            .save(&key(9, 9000), HashAlgorithm::Blake3, &hashes(2, 0))
            .is_err());
        assert!(temp_records(&store).is_empty());
    }

    fn temp_records(store: &ManifestStore) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for fan in fs::read_dir(&store.dir).unwrap().flatten() {
            for r in fs::read_dir(fan.path()).unwrap().flatten() {
                if r.file_name()
                    .to_string_lossy()
                    .starts_with(TEMP_RECORD_PREFIX)
                {
                    out.push(r.path());
                }
            }
        }
        out
    }

    #[test]
    fn a_damaged_record_is_a_miss() {
        let dir = tempfile::tempdir().unwrap();
        let store = ManifestStore::new(dir.path(), C);
        let k = key(0x42, 3 * 4096);
        save(&store, &k, &hashes(3, 1));
        let path = store.record_path(7, 0x42);
        let good = fs::read(&path).unwrap();
        // Every single flipped byte, a truncation and an extension are misses.
        for at in (0..good.len()).step_by(7) {
            let mut bad = good.clone();
            bad[at] ^= 0x40;
            fs::write(&path, &bad).unwrap();
            assert!(store.get_hashes(&k).is_none(), "flip at {at}");
        }
        fs::write(&path, &good[..good.len() - 1]).unwrap();
        assert!(store.get_hashes(&k).is_none());
        let mut long = good.clone();
        long.push(0);
        fs::write(&path, &long).unwrap();
        assert!(store.get_hashes(&k).is_none());
        // A record stored under another inode's name is not that inode's.
        fs::write(&path, &good).unwrap();
        fs::create_dir_all(store.record_path(7, 0x142).parent().unwrap()).unwrap();
        fs::write(store.record_path(7, 0x142), &good).unwrap();
        assert!(store.load(7, 0x142).is_none());
        assert_eq!(store.get_hashes(&k).unwrap(), hashes(3, 1));
    }

    #[test]
    fn a_damaged_slot_is_a_miss() {
        let dir = tempfile::tempdir().unwrap();
        let store = ManifestStore::new(dir.path(), C);
        let k = key(0x42, 100);
        save(&store, &k, &hashes(1, 1));
        let (page, at) = store.slot_of(7, 0x42);
        let good = fs::read(&page).unwrap();
        let at = at as usize;
        // Every flipped byte of the record (not the padding after it) is a miss.
        for i in (0..HEADER_BYTES + 64).step_by(5) {
            let mut bad = good.clone();
            bad[at + i] ^= 0x40;
            fs::write(&page, &bad).unwrap();
            assert!(store.get_hashes(&k).is_none(), "flip at {i}");
        }
        // A page cut short inside the slot.
        fs::write(&page, &good[..at + 100]).unwrap();
        assert!(store.get_hashes(&k).is_none());
        // The slot's record copied into another inode's slot is not that inode's.
        let mut moved = good.clone();
        moved.resize(good.len().max(at + 2 * SLOT_BYTES), 0);
        moved.copy_within(at..at + SLOT_BYTES, at + SLOT_BYTES);
        fs::write(&page, &moved).unwrap();
        assert!(store.load(7, 0x43).is_none());
        assert_eq!(store.get_hashes(&k).unwrap(), hashes(1, 1));
    }

    #[test]
    fn rekey_moves_exactly_the_record_of_the_old_version() {
        let dir = tempfile::tempdir().unwrap();
        let store = ManifestStore::new(dir.path(), C);
        let old = key(0x77, 3 * 4096);
        let new = ManifestKey {
            ctime_ns: old.ctime_ns + 1,
            ..old
        };
        // No record: nothing to move.
        assert!(!store.rekey(&old, &new).unwrap());
        save(&store, &old, &hashes(3, 4));
        let path = store.record_path(7, 0x77);
        let ino_before = fs::metadata(&path).unwrap().ino();
        assert!(store.rekey(&old, &new).unwrap());
        assert!(store.get_hashes(&old).is_none());
        assert_eq!(store.get_hashes(&new).unwrap(), hashes(3, 4));
        // Rewritten in place: the same record file, no temporary left.
        assert_eq!(fs::metadata(&path).unwrap().ino(), ino_before);
        assert!(temp_records(&store).is_empty());
        // A record of another version is left alone.
        let other = ManifestKey {
            ctime_ns: new.ctime_ns + 5,
            ..new
        };
        assert!(!store.rekey(&old, &other).unwrap());
        assert_eq!(store.get_hashes(&new).unwrap(), hashes(3, 4));
        // A re-key never changes what the hashes describe.
        let grown = ManifestKey {
            size: new.size + 1,
            ..new
        };
        assert!(store.rekey(&new, &grown).is_err());
        assert_eq!(store.get_hashes(&new).unwrap(), hashes(3, 4));
        // The same for a slot.
        let small = key(0x78, 10);
        let moved = ManifestKey {
            ctime_ns: small.ctime_ns + 1,
            ..small
        };
        assert!(!store.rekey(&small, &moved).unwrap());
        save(&store, &small, &hashes(1, 6));
        assert!(store.rekey(&small, &moved).unwrap());
        assert!(store.get_hashes(&small).is_none());
        assert_eq!(store.get_hashes(&moved).unwrap(), hashes(1, 6));
        assert!(!store.rekey(&small, &moved).unwrap());
    }

    #[test]
    fn prune_removes_records_of_gone_inodes_only() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("sub")).unwrap();
        fs::write(dir.path().join("sub/kept"), b"x").unwrap();
        let ino = fs::metadata(dir.path().join("sub/kept")).unwrap().ino();
        let store = ManifestStore::new(dir.path(), C);
        let big = 2 * u64::from(C);
        // A record file and a slot of the live inode.
        save(&store, &key(ino, big), &hashes(2, 1));
        save(&store, &key(ino, 1), &hashes(1, 1));
        // An inode number no file has, nor any in its page (the kept file's page is
        // thousands of pages away).
        let gone = (ino + 1_000_003) | 1;
        save(&store, &key(gone, big), &hashes(2, 2));
        save(&store, &key(gone, 1), &hashes(1, 2));
        // A stale temporary record.
        let fan = store.record_path(7, gone);
        let tmp = fan.parent().unwrap().join(".tmp.0000000000000001");
        fs::write(&tmp, b"half").unwrap();
        // Written before "start": all removable.
        let started = SystemTime::now() + std::time::Duration::from_secs(3600);
        let r = store.prune(started);
        assert_eq!((r.kept, r.removed, r.failed), (2, 3, 0), "{r:?}");
        assert!(store.load_file(7, ino).is_some());
        assert!(store.load_slot(7, ino).is_some());
        assert!(store.load(7, gone).is_none());
        assert!(!store.slot_of(7, gone).0.exists());
        assert!(!tmp.exists());
        // Records written after the start are kept, whatever the walk saw.
        save(&store, &key(gone, big), &hashes(2, 2));
        save(&store, &key(gone, 1), &hashes(1, 2));
        let r = store.prune(SystemTime::UNIX_EPOCH);
        assert_eq!((r.kept, r.removed), (4, 0));
    }

    #[test]
    fn records_of_the_stores_own_file_system_survive_a_new_device_number() {
        let dir = tempfile::tempdir().unwrap();
        let big = key(0x1234, 3 * u64::from(C));
        let small = key(0x1235, 10);
        let before = ManifestStore::with_home(dir.path(), C, Some(7));
        save(&before, &big, &hashes(3, 1));
        save(&before, &small, &hashes(1, 2));
        // Saved under HOME_DEV, not the device number.
        assert!(before.record_path(HOME_DEV, 0x1234).is_file());
        assert!(!before.record_path(7, 0x1234).exists());
        // The file system mounted again under device number 9: same inodes, ctimes.
        let after = ManifestStore::with_home(dir.path(), C, Some(9));
        let moved = |k: &ManifestKey| ManifestKey { dev: 9, ..*k };
        assert_eq!(after.get_hashes(&moved(&big)), Some(hashes(3, 1)));
        assert_eq!(after.get_hashes(&moved(&small)), Some(hashes(1, 2)));
        assert_eq!(after.load(9, 0x1234).unwrap().key, moved(&big));
        // Device 7 is no longer the store's: its files are another file system's.
        assert!(after.get_hashes(&big).is_none());
        // Re-keyed and forgotten where they are.
        let relinked = ManifestKey {
            ctime_ns: 6_000_000_000,
            ..moved(&big)
        };
        assert!(after.rekey(&moved(&big), &relinked).unwrap());
        assert_eq!(after.get_hashes(&relinked), Some(hashes(3, 1)));
        after.forget(9, 0x1234).unwrap();
        after.forget(9, 0x1235).unwrap();
        assert!(after.load(9, 0x1234).is_none());
        assert!(after.load(9, 0x1235).is_none());
    }

    #[test]
    fn records_saved_under_the_device_number_before_home_dev_are_still_read() {
        let dir = tempfile::tempdir().unwrap();
        // As ferryd saved them before HOME_DEV: under the real device number, 7.
        let old = ManifestStore::with_home(dir.path(), C, None);
        let big = key(0x1234, 3 * u64::from(C));
        let small = key(0x1235, 10);
        save(&old, &big, &hashes(3, 1));
        save(&old, &small, &hashes(1, 2));
        assert!(old.record_path(7, 0x1234).is_file());
        let store = ManifestStore::with_home(dir.path(), C, Some(7));
        assert_eq!(store.get_hashes(&big), Some(hashes(3, 1)));
        assert_eq!(store.get_hashes(&small), Some(hashes(1, 2)));
        assert_eq!(store.load(7, 0x1235).unwrap().key, small);
        let relinked = ManifestKey {
            ctime_ns: 6_000_000_000,
            ..small
        };
        assert!(store.rekey(&small, &relinked).unwrap());
        assert_eq!(store.get_hashes(&relinked), Some(hashes(1, 2)));
        // A newer version saved now, under HOME_DEV, is the inode's record.
        let newer = ManifestKey {
            ctime_ns: 7_000_000_000,
            ..key(0x1234, 2 * u64::from(C))
        };
        save(&store, &newer, &hashes(2, 5));
        assert_eq!(store.load(7, 0x1234).unwrap().key, newer);
        assert_eq!(store.get_hashes(&newer), Some(hashes(2, 5)));
        // Forgetting removes both.
        store.forget(7, 0x1234).unwrap();
        assert!(store.load(7, 0x1234).is_none());
        assert!(!store.record_path(7, 0x1234).exists());
    }

    #[test]
    fn a_read_only_shares_store_reads_records_and_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let big = key(0x1234, 3 * u64::from(C));
        save(&ManifestStore::new(dir.path(), C), &big, &hashes(3, 1));
        let reader = ManifestStore::reader(dir.path(), C);
        assert_eq!(reader.get_hashes(&big), Some(hashes(3, 1)));
        let read_only =
            |r: io::Result<()>| r.unwrap_err().kind() == io::ErrorKind::ReadOnlyFilesystem;
        let other = key(0x99, 10);
        assert!(read_only(reader.save(
            &other,
            HashAlgorithm::Blake3,
            &hashes(1, 2)
        )));
        assert!(read_only(reader.forget(7, 0x1234)));
        let relinked = ManifestKey {
            ctime_ns: 6_000_000_000,
            ..big
        };
        assert!(reader.rekey(&big, &relinked).is_err());
        let r = reader.prune(SystemTime::now() + std::time::Duration::from_secs(3600));
        assert_eq!(r, PruneReport::default());
        // Nothing changed on disk.
        assert_eq!(reader.get_hashes(&big), Some(hashes(3, 1)));
        assert!(reader.get_hashes(&other).is_none());
        assert!(!reader.slot_of(7, 0x99).0.exists());
    }
}
