//! Single-file helpers: seeded random content, metadata, byte-for-byte comparison.

use std::fs::{self, File};
use std::io::{self, BufWriter, Read, Write};
use std::net::TcpListener;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, UNIX_EPOCH};

use ferry_common::journal::read_journal;
use ferry_common::staging::{classify, TempName, JOURNAL_SUFFIX, PART_SUFFIX};
use ferry_common::STATE_DIR;
use ferry_common::TEMP_PREFIX as TEMP_PREFIX_FULL;
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};

/// One mebibyte, Ferry's default chunk size.
pub const MIB: u64 = 1 << 20;

/// The prefix of ferryd's hidden temporary upload names; none may survive an upload.
pub const TEMP_PREFIX: &str = ".ferry-tmp";

/// Block size for writing and comparing files.
const BLOCK_BYTES: usize = 1 << 20;

/// Writes `len` bytes from a ChaCha RNG seeded with `seed` to `path` (replacing it).
/// The same `(len, seed)` always gives the same bytes.
pub fn write_random_file(path: &Path, len: u64, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let file = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    let mut out = BufWriter::with_capacity(BLOCK_BYTES, file);
    let mut block = vec![0u8; BLOCK_BYTES];
    let mut left = len;
    while left > 0 {
        let n = left.min(BLOCK_BYTES as u64) as usize;
        rng.fill_bytes(&mut block[..n]);
        out.write_all(&block[..n])
            .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        left -= n as u64;
    }
    out.flush()
        .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

/// Sets the permission bits of `path` (follows symlinks).
pub fn set_mode(path: &Path, mode: u32) {
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("chmod {:o} {}: {e}", mode, path.display()));
}

/// Sets the modification time of a file or directory to `secs` after the epoch.
pub fn set_mtime(path: &Path, secs: u64) {
    let file = File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    file.set_modified(UNIX_EPOCH + Duration::from_secs(secs))
        .unwrap_or_else(|e| panic!("set mtime of {}: {e}", path.display()));
}

/// `mode & 0o7777` of `path` (not following a final symlink).
pub fn mode_of(path: &Path) -> u32 {
    metadata(path).mode() & 0o7777
}

/// The modification time of `path` in whole seconds (not following a final symlink).
pub fn mtime_of(path: &Path) -> i64 {
    metadata(path).mtime()
}

fn metadata(path: &Path) -> fs::Metadata {
    fs::symlink_metadata(path).unwrap_or_else(|e| panic!("stat {}: {e}", path.display()))
}

/// Panics unless `actual` has the same permission bits and mtime (seconds) as `expected`.
#[track_caller]
pub fn assert_same_mode_and_mtime(expected: &Path, actual: &Path) {
    let (em, am) = (mode_of(expected), mode_of(actual));
    assert_eq!(
        em,
        am,
        "mode of {} is {am:o}, expected {em:o} (as {})",
        actual.display(),
        expected.display()
    );
    let (et, at) = (mtime_of(expected), mtime_of(actual));
    assert_eq!(
        et,
        at,
        "mtime of {} is {at}, expected {et} (as {})",
        actual.display(),
        expected.display()
    );
}

/// Where `actual` first differs from `expected`: the offset and both bytes, or the
/// lengths where one is a prefix of the other ("equal" if they are the same).
pub fn byte_difference(expected: &[u8], actual: &[u8]) -> String {
    let n = expected.len().min(actual.len());
    match (0..n).find(|&i| expected[i] != actual[i]) {
        Some(i) => format!(
            "first difference at byte {i} (0x{:02x} expected, 0x{:02x} found); {} bytes expected, {} found",
            expected[i],
            actual[i],
            expected.len(),
            actual.len()
        ),
        None if expected.len() == actual.len() => "equal".to_owned(),
        None => format!(
            "{} bytes expected, {} found (equal up to the shorter)",
            expected.len(),
            actual.len()
        ),
    }
}

/// Panics unless `actual == expected`, naming the first differing offset.
#[track_caller]
pub fn assert_same_bytes(expected: &[u8], actual: &[u8], what: &str) {
    if expected != actual {
        panic!("{what}: {}", byte_difference(expected, actual));
    }
}

/// Panics unless the two files hold the same bytes; the message gives the first
/// differing offset.
#[track_caller]
pub fn assert_files_equal(expected: &Path, actual: &Path) {
    match first_difference(expected, actual) {
        Ok(None) => {}
        Ok(Some(diff)) => panic!(
            "{} differs from {}: {diff}",
            actual.display(),
            expected.display()
        ),
        Err(e) => panic!(
            "cannot compare {} with {}: {e}",
            actual.display(),
            expected.display()
        ),
    }
}

/// Compares two files byte for byte. `Ok(None)` if equal, else a description of the
/// first difference (offset and bytes, or which file is shorter).
pub fn first_difference(a: &Path, b: &Path) -> io::Result<Option<String>> {
    let (mut fa, mut fb) = (File::open(a)?, File::open(b)?);
    let (la, lb) = (fa.metadata()?.len(), fb.metadata()?.len());
    let mut ba = vec![0u8; BLOCK_BYTES];
    let mut bb = vec![0u8; BLOCK_BYTES];
    let mut offset = 0u64;
    loop {
        let na = read_block(&mut fa, &mut ba)?;
        let nb = read_block(&mut fb, &mut bb)?;
        let n = na.min(nb);
        if ba[..n] != bb[..n] {
            let i = (0..n).find(|&i| ba[i] != bb[i]).unwrap_or(0);
            return Ok(Some(format!(
                "first difference at byte {} (0x{:02x} expected, 0x{:02x} found); sizes {la} and {lb}",
                offset + i as u64,
                ba[i],
                bb[i]
            )));
        }
        if na != nb {
            return Ok(Some(format!(
                "equal for the first {} bytes, then one file ends; sizes {la} expected, {lb} found",
                offset + n as u64
            )));
        }
        if na == 0 {
            return Ok(None);
        }
        offset += n as u64;
    }
}

/// Fills `buf` as far as the file allows; returns the bytes read (short only at EOF).
fn read_block(file: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// Panics unless directory `dir` holds exactly the entries `expected` (names, not
/// recursive, in any order). ferryd's state directory ([`STATE_DIR`], present at the
/// root of a writable share once it recorded a manifest) is not counted.
#[track_caller]
pub fn assert_entries(dir: &Path, expected: &[&str]) {
    let mut found: Vec<String> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read_dir {}: {e}", dir.display()))
        .map(|e| {
            e.expect("read_dir entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|name| name != STATE_DIR)
        .collect();
    found.sort();
    let mut want: Vec<String> = expected.iter().map(|s| (*s).to_owned()).collect();
    want.sort();
    assert_eq!(found, want, "entries of {}", dir.display());
}

/// Panics if any entry under `dir` (recursively, not following symlinks) has a name
/// starting with [`TEMP_PREFIX`].
#[track_caller]
pub fn assert_no_temp_files(dir: &Path) {
    let stray = temp_files(dir);
    assert!(
        stray.is_empty(),
        "stray temporary files under {}: {stray:#?}",
        dir.display()
    );
}

/// Every entry under `dir` (recursively, not following symlinks) whose name starts with
/// [`TEMP_PREFIX`].
pub fn temp_files(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    find_temp_files(dir, &mut found);
    found.sort();
    found
}

fn find_temp_files(dir: &Path, found: &mut Vec<PathBuf>) {
    let entries = fs::read_dir(dir).unwrap_or_else(|e| panic!("read_dir {}: {e}", dir.display()));
    for entry in entries {
        let entry = entry.expect("read_dir entry");
        let path = entry.path();
        // ferryd's state (the manifest store) writes its own short-lived files.
        if entry.file_name() == ferry_common::STATE_DIR {
            continue;
        }
        if entry.file_name().to_string_lossy().starts_with(TEMP_PREFIX) {
            found.push(path.clone());
        }
        if entry.file_type().expect("file type").is_dir() {
            find_temp_files(&path, found);
        }
    }
}

/// The journal beside the resumable partial `path`, or the partial beside the journal
/// `path`; `None` if `path` is neither.
fn sibling(path: &Path) -> Option<PathBuf> {
    let name = path.file_name()?;
    let stem = match classify(name)? {
        TempName::Part(s) => format!("{TEMP_PREFIX_FULL}{s}{JOURNAL_SUFFIX}"),
        TempName::Journal(s) => format!("{TEMP_PREFIX_FULL}{s}{PART_SUFFIX}"),
        TempName::Scratch => return None,
    };
    Some(path.with_file_name(stem))
}

/// Panics unless every hidden temporary file under `dir` (recursively) is a resumable
/// partial with a readable journal beside it, or that journal: what an interrupted
/// transfer may leave, and nothing else (no scratch file, no orphan).
#[track_caller]
pub fn assert_only_resumable_temp_files(dir: &Path) {
    let bad: Vec<String> = temp_files(dir)
        .into_iter()
        .filter(|p| {
            let Some(other) = sibling(p) else {
                return true;
            };
            let journal = match classify(p.file_name().unwrap_or_default()) {
                Some(TempName::Journal(_)) => p.clone(),
                _ => other.clone(),
            };
            !other.is_file() || read_journal(&journal).is_err()
        })
        .map(|p| p.display().to_string())
        .collect();
    assert!(
        bad.is_empty(),
        "temporary files under {} that are not resumable partials with their journals: {bad:#?}",
        dir.display()
    );
}

/// File bytes that the journals of resumable partials under `dir` (recursively) record
/// as written: what a resumed copy may reuse, after verifying it.
pub fn journaled_bytes(dir: &Path) -> u64 {
    temp_files(dir)
        .into_iter()
        .filter(|p| {
            matches!(
                classify(p.file_name().unwrap_or_default()),
                Some(TempName::Journal(_))
            )
        })
        .filter(|p| sibling(p).is_some_and(|part| part.is_file()))
        .filter_map(|p| read_journal(&p).ok())
        .map(|c| c.chunk_bytes_total())
        .sum()
}

/// A loopback port that nothing listens on (bound, then released).
pub fn unused_local_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local_addr").port()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_files_are_seeded() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b, c) = (
            dir.path().join("a"),
            dir.path().join("b"),
            dir.path().join("c"),
        );
        write_random_file(&a, 3 * MIB + 5, 1);
        write_random_file(&b, 3 * MIB + 5, 1);
        write_random_file(&c, 3 * MIB + 5, 2);
        assert_eq!(fs::metadata(&a).unwrap().len(), 3 * MIB + 5);
        assert_files_equal(&a, &b);
        assert!(first_difference(&a, &c).unwrap().is_some());
    }

    #[test]
    fn first_difference_gives_the_offset() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        write_random_file(&a, 2 * MIB + 10, 7);
        let mut bytes = fs::read(&a).unwrap();
        let at = MIB as usize + 3;
        bytes[at] ^= 0x40;
        fs::write(&b, &bytes).unwrap();
        let diff = first_difference(&a, &b).unwrap().unwrap();
        assert!(diff.contains(&format!("byte {at} ")), "{diff}");

        bytes[at] ^= 0x40;
        bytes.truncate(MIB as usize * 2);
        fs::write(&b, &bytes).unwrap();
        let diff = first_difference(&a, &b).unwrap().unwrap();
        assert!(diff.contains(&format!("first {} bytes", 2 * MIB)), "{diff}");
    }

    #[test]
    fn temp_files_are_found_at_any_depth() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir_all(dir.path().join("x/y")).unwrap();
        assert_no_temp_files(dir.path());
        fs::write(dir.path().join("x/y/.ferry-tmp.123"), b"").unwrap();
        let result = std::panic::catch_unwind(|| assert_no_temp_files(dir.path()));
        assert!(result.is_err());
    }

    #[test]
    fn mode_and_mtime_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("f");
        fs::write(&f, b"x").unwrap();
        set_mtime(&f, 1_000_000_000);
        set_mode(&f, 0o751);
        assert_eq!(mode_of(&f), 0o751);
        assert_eq!(mtime_of(&f), 1_000_000_000);
    }
}
