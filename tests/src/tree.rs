//! Generating directory trees and comparing two trees.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};

use crate::files::{
    first_difference, mode_of, mtime_of, set_mode, set_mtime, write_random_file, MIB,
};

/// What a generated tree holds, not counting its root directory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TreeStats {
    /// Regular files.
    pub files: u64,
    /// Directories below the root.
    pub dirs: u64,
    /// Symbolic links.
    pub symlinks: u64,
    /// Total bytes of the regular files.
    pub bytes: u64,
}

/// File modes the generators cycle through.
const FILE_MODES: [u32; 3] = [0o644, 0o600, 0o755];

/// Directory modes the generators cycle through; all owner-writable so copies can fill
/// them in any order.
const DIR_MODES: [u32; 4] = [0o755, 0o750, 0o700, 0o775];

/// mtimes the generators hand out start here (2017-07-14) and step forward.
const BASE_MTIME: u64 = 1_500_000_000;

/// Writes files, dirs and symlinks under a root, remembering directories so their
/// modes and mtimes can be set last (creating children changes a dir's mtime).
struct Builder {
    root: PathBuf,
    rng: StdRng,
    stats: TreeStats,
    dirs: Vec<PathBuf>,
}

impl Builder {
    fn new(root: &Path, seed: u64) -> Builder {
        fs::create_dir_all(root).unwrap_or_else(|e| panic!("mkdir {}: {e}", root.display()));
        Builder {
            root: root.to_path_buf(),
            rng: StdRng::seed_from_u64(seed),
            stats: TreeStats::default(),
            dirs: vec![root.to_path_buf()],
        }
    }

    fn dir(&mut self, rel: &str) {
        let path = self.root.join(rel);
        fs::create_dir(&path).unwrap_or_else(|e| panic!("mkdir {}: {e}", path.display()));
        self.dirs.push(path);
        self.stats.dirs += 1;
    }

    fn file(&mut self, rel: &str, len: u64) {
        let path = self.root.join(rel);
        let n = self.stats.files;
        if len > 64 * 1024 {
            write_random_file(&path, len, self.rng.next_u64());
        } else {
            let mut bytes = vec![0u8; len as usize];
            self.rng.fill_bytes(&mut bytes);
            fs::write(&path, &bytes).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        }
        set_mtime(&path, BASE_MTIME + n * 61);
        set_mode(&path, FILE_MODES[(n % 3) as usize]);
        self.stats.files += 1;
        self.stats.bytes += len;
    }

    fn symlink(&mut self, rel: &str, target: &str) {
        let path = self.root.join(rel);
        symlink(target, &path).unwrap_or_else(|e| panic!("symlink {}: {e}", path.display()));
        self.stats.symlinks += 1;
    }

    /// Sets every directory's mode and mtime, deepest first, and returns the stats.
    fn finish(mut self) -> TreeStats {
        self.dirs
            .sort_by_key(|d| std::cmp::Reverse(d.components().count()));
        for (i, dir) in self.dirs.iter().enumerate() {
            set_mtime(dir, BASE_MTIME + 10_000_000 + i as u64 * 3_600);
            set_mode(dir, DIR_MODES[i % DIR_MODES.len()]);
        }
        self.stats
    }
}

/// Generates a tree of more than 1,000 files under `root` (created if missing):
///
/// - directories `dK/sK/tK/uK` four levels deep (4 x 4 x 3 x 2), files at every level;
/// - sizes of 0 B, 1 B to 4 KiB, and four files over 1 MiB (about 8 MiB in all);
/// - file modes cycling 0o644, 0o600, 0o755 and distinct mtimes;
/// - directory modes cycling 0o755, 0o750, 0o700, 0o775 and distinct mtimes, set after
///   their children are in place;
/// - empty directories (top level, middle, and an empty one inside an otherwise empty one);
/// - names with a space and non-ASCII letters;
/// - symlinks: relative ones to files (same dir, across dirs with `..`) and to a dir,
///   one dangling, one absolute to `/etc/hostname`.
///
/// The same `seed` always gives the same tree.
pub fn make_tree(root: &Path, seed: u64) -> TreeStats {
    let mut b = Builder::new(root, seed);
    let mut n = 0u64;
    let mut size = |rng: &mut StdRng| -> u64 {
        n += 1;
        match n {
            n if n % 97 == 0 => 0,
            n if n % 300 == 150 => MIB + 1 + n * 31,
            _ => rng.gen_range(1..=4096),
        }
    };
    for d in 0..4 {
        b.dir(&format!("d{d}"));
        for s in 0..4 {
            b.dir(&format!("d{d}/s{s}"));
            let len = size(&mut b.rng);
            b.file(&format!("d{d}/s{s}/file.txt"), len);
            for t in 0..3 {
                b.dir(&format!("d{d}/s{s}/t{t}"));
                let len = size(&mut b.rng);
                b.file(&format!("d{d}/s{s}/t{t}/mid.dat"), len);
                for u in 0..2 {
                    b.dir(&format!("d{d}/s{s}/t{t}/u{u}"));
                    for f in 0..10 {
                        let len = size(&mut b.rng);
                        b.file(&format!("d{d}/s{s}/t{t}/u{u}/f{f}.bin"), len);
                    }
                }
            }
        }
    }
    b.file("top.txt", 12);
    b.file("empty.txt", 0);
    b.file("with space.txt", 100);
    b.file("d1/été.txt", 7);
    b.file("d2/big-3mib.bin", 3 * MIB + 3);

    b.dir("empty_top");
    b.dir("d0/s1/empty_mid");
    b.dir("d3/s2/t1/u0/nest");
    b.dir("d3/s2/t1/u0/nest/empty_deep");

    b.symlink("link_rel", "d0/s0/t0/u0/f0.bin");
    b.symlink("d0/s0/t0/u0/link_sibling", "f1.bin");
    b.symlink("d2/s1/link_up", "../../d3/s3/t2/u1/f9.bin");
    b.symlink("d3/link_dir", "s0");
    b.symlink("dangling", "no/such/target");
    b.symlink("abs_hostname", "/etc/hostname");
    b.finish()
}

/// Generates a small tree under `root` (created if missing):
/// `a.txt` (10 B), `sub/b.bin` (1 MiB + 5), `sub/deeper/c.empty` (0 B), `empty/`,
/// and `link -> a.txt`; modes and mtimes set as in [`make_tree`].
pub fn make_small_tree(root: &Path, seed: u64) -> TreeStats {
    let mut b = Builder::new(root, seed);
    b.file("a.txt", 10);
    b.dir("sub");
    b.file("sub/b.bin", MIB + 5);
    b.dir("sub/deeper");
    b.file("sub/deeper/c.empty", 0);
    b.dir("empty");
    b.symlink("link", "a.txt");
    b.finish()
}

/// Generates a tree of about fifty files (about 7 MiB) under `root` (created if
/// missing), for copying with real tools into a mount:
///
/// - directories `a`, `a/b`, `a/b/c`, `d` and an empty `e`;
/// - 46 files of 0 B to 64 KiB (the edges 0, 1, 4095, 4096, 4097 and 65536 among them),
///   three of about 1-2 MiB and one of exactly 3 MiB, a name with a space;
/// - modes and mtimes as in [`make_tree`] (directories' set last);
/// - symlinks: a relative one to a file across directories, one to a directory, and a
///   dangling one.
///
/// The same `seed` always gives the same tree.
pub fn make_medium_tree(root: &Path, seed: u64) -> TreeStats {
    let mut b = Builder::new(root, seed);
    for dir in ["a", "a/b", "a/b/c", "d", "e"] {
        b.dir(dir);
    }
    let edges = [0, 1, 4095, 4096, 4097, 65536];
    let places = ["", "a/", "a/b/", "a/b/c/", "d/"];
    for i in 0..46usize {
        let len = match edges.get(i) {
            Some(&len) => len,
            None => b.rng.gen_range(2..=64 << 10),
        };
        b.file(&format!("{}f{i:02}.dat", places[i % places.len()]), len);
    }
    b.file("a/one and a bit.bin", MIB + 17);
    b.file("a/b/half.bin", (MIB >> 1) + 3);
    b.file("d/two.bin", 2 * MIB - 1);
    b.file("d/three.bin", 3 * MIB);
    b.symlink("a/b/link_to_file", "../../d/f04.dat");
    b.symlink("link_to_dir", "a/b");
    b.symlink("d/dangling", "no/such/file");
    b.finish()
}

/// Generates a tree of many small files under `root` (created if missing): `dirs`
/// directories `dNN` of `per_dir` files each, of 0 B to 8 KiB (seeded), plus, at the
/// top, files of exactly 64 KiB and 64 KiB + 1 (either side of the batching
/// threshold) and three of a few MiB; modes and mtimes set as in [`make_tree`].
pub fn make_many_small_files(root: &Path, seed: u64, dirs: usize, per_dir: usize) -> TreeStats {
    let mut b = Builder::new(root, seed);
    for d in 0..dirs {
        b.dir(&format!("d{d:02}"));
        for f in 0..per_dir {
            let len = match f % 50 {
                0 => 0,
                _ => b.rng.gen_range(1..=8192),
            };
            b.file(&format!("d{d:02}/f{f:03}.txt"), len);
        }
    }
    b.file("edge-64k.bin", 64 << 10);
    b.file("edge-64k-plus-1.bin", (64 << 10) + 1);
    for (i, len) in [2 * MIB + 3, MIB, 3 * MIB + 1].into_iter().enumerate() {
        b.file(&format!("big{i}.bin"), len);
    }
    b.finish()
}

/// One entry of a walked tree.
#[derive(Debug, PartialEq, Eq)]
enum Node {
    File,
    Dir,
    Symlink(PathBuf),
    Other,
}

/// All entries under `root`, keyed by path relative to it; symlinks are not followed.
fn walk(root: &Path) -> BTreeMap<PathBuf, Node> {
    let mut nodes = BTreeMap::new();
    walk_into(root, Path::new(""), &mut nodes);
    nodes
}

fn walk_into(root: &Path, rel: &Path, nodes: &mut BTreeMap<PathBuf, Node>) {
    let dir = root.join(rel);
    let entries = fs::read_dir(&dir).unwrap_or_else(|e| panic!("read_dir {}: {e}", dir.display()));
    for entry in entries {
        let entry = entry.expect("read_dir entry");
        // ferryd's state directory at a share's root is not part of the copied tree.
        if rel.as_os_str().is_empty() && entry.file_name() == ferry_common::STATE_DIR {
            continue;
        }
        let rel = rel.join(entry.file_name());
        let kind = entry.file_type().expect("file type");
        let node = if kind.is_symlink() {
            let target = fs::read_link(entry.path())
                .unwrap_or_else(|e| panic!("readlink {}: {e}", entry.path().display()));
            Node::Symlink(target)
        } else if kind.is_dir() {
            walk_into(root, &rel, nodes);
            Node::Dir
        } else if kind.is_file() {
            Node::File
        } else {
            Node::Other
        };
        nodes.insert(rel, node);
    }
}

/// Panics unless `actual` is a faithful copy of `expected`: the same relative names,
/// each of the same type; files with the same bytes; symlinks with the same target
/// string; files and directories (the roots too) with the same `mode & 0o7777` and
/// mtime in seconds. The message lists every difference found (the first 30).
#[track_caller]
pub fn assert_trees_equal(expected: &Path, actual: &Path) {
    check_trees(expected, actual, None);
}

/// [`assert_trees_equal`], stricter, for what `rcp -r` keeps of every entry like
/// `rsync -a`: mtimes to the nanosecond (as far as the filesystem keeps them) of files,
/// directories and symlinks (a symlink's own), sizes, and with `owners` the numeric
/// owner and group of every entry, the roots too.
#[track_caller]
pub fn assert_trees_identical(expected: &Path, actual: &Path, owners: bool) {
    check_trees(expected, actual, Some(owners));
}

/// What [`check_trees`] compares beyond [`assert_trees_equal`]'s checks: with
/// `Some(owners)`, nanosecond mtimes and sizes of every entry, and owners if `owners`.
#[track_caller]
fn check_trees(expected: &Path, actual: &Path, strict: Option<bool>) {
    let want = walk(expected);
    let got = walk(actual);
    let mut problems = Vec::new();

    for rel in want.keys().filter(|k| !got.contains_key(*k)) {
        problems.push(format!("missing: {}", rel.display()));
    }
    for rel in got.keys().filter(|k| !want.contains_key(*k)) {
        problems.push(format!("unexpected: {}", rel.display()));
    }
    compare_meta(expected, actual, Path::new("."), &mut problems);
    if let Some(owners) = strict {
        compare_strict(expected, actual, Path::new("."), owners, &mut problems);
    }
    for (rel, node) in &want {
        let Some(other) = got.get(rel) else { continue };
        let (e, a) = (expected.join(rel), actual.join(rel));
        if let Some(owners) = strict {
            compare_strict(&e, &a, rel, owners, &mut problems);
        }
        match (node, other) {
            (Node::File, Node::File) => {
                match first_difference(&e, &a) {
                    Ok(None) => {}
                    Ok(Some(diff)) => problems.push(format!("{}: {diff}", rel.display())),
                    Err(err) => problems.push(format!("{}: cannot compare: {err}", rel.display())),
                }
                compare_meta(&e, &a, rel, &mut problems);
            }
            (Node::Dir, Node::Dir) => compare_meta(&e, &a, rel, &mut problems),
            (Node::Symlink(te), Node::Symlink(ta)) => {
                if te != ta {
                    problems.push(format!(
                        "{}: symlink target {:?}, expected {:?}",
                        rel.display(),
                        ta,
                        te
                    ));
                }
            }
            (want, got) => {
                problems.push(format!("{}: is {got:?}, expected {want:?}", rel.display()))
            }
        }
    }

    if !problems.is_empty() {
        let total = problems.len();
        problems.truncate(30);
        panic!(
            "{} is not a copy of {} ({total} differences):\n  {}",
            actual.display(),
            expected.display(),
            problems.join("\n  ")
        );
    }
}

fn compare_meta(expected: &Path, actual: &Path, rel: &Path, problems: &mut Vec<String>) {
    let (em, am) = (mode_of(expected), mode_of(actual));
    if em != am {
        problems.push(format!("{}: mode {am:o}, expected {em:o}", rel.display()));
    }
    let (et, at) = (mtime_of(expected), mtime_of(actual));
    if et != at {
        problems.push(format!("{}: mtime {at}, expected {et}", rel.display()));
    }
}

/// The stricter checks of [`assert_trees_identical`] of one entry (not following a
/// final symlink).
fn compare_strict(
    expected: &Path,
    actual: &Path,
    rel: &Path,
    owners: bool,
    problems: &mut Vec<String>,
) {
    use std::os::unix::fs::MetadataExt;
    let (Ok(em), Ok(am)) = (fs::symlink_metadata(expected), fs::symlink_metadata(actual)) else {
        return;
    };
    let (et, at) = ((em.mtime(), em.mtime_nsec()), (am.mtime(), am.mtime_nsec()));
    if et != at {
        problems.push(format!(
            "{}: mtime {at:?}, expected {et:?} (s, ns)",
            rel.display()
        ));
    }
    if !em.is_dir() && em.len() != am.len() {
        problems.push(format!(
            "{}: size {}, expected {}",
            rel.display(),
            am.len(),
            em.len()
        ));
    }
    if owners && (em.uid(), em.gid()) != (am.uid(), am.gid()) {
        problems.push(format!(
            "{}: owner {}:{}, expected {}:{}",
            rel.display(),
            am.uid(),
            am.gid(),
            em.uid(),
            em.gid()
        ));
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    /// `cp -a` of a generated tree; `cp -a` keeps modes, mtimes and symlinks as-is.
    fn generated_and_copied(seed: u64) -> (tempfile::TempDir, PathBuf, PathBuf, TreeStats) {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        let b = dir.path().join("b");
        let stats = make_tree(&a, seed);
        let status = Command::new("cp")
            .arg("-a")
            .arg(&a)
            .arg(&b)
            .status()
            .unwrap();
        assert!(status.success());
        (dir, a, b, stats)
    }

    #[test]
    fn make_tree_has_what_the_tests_need() {
        let dir = tempfile::tempdir().unwrap();
        let stats = make_tree(&dir.path().join("t"), 1);
        assert!(stats.files >= 1_000, "{stats:?}");
        assert!(stats.symlinks >= 4, "{stats:?}");
        let nodes = walk(&dir.path().join("t"));
        let deepest = nodes.keys().map(|p| p.components().count()).max().unwrap();
        assert!(deepest >= 5, "deepest entry has {deepest} components");
        let files = nodes.values().filter(|n| **n == Node::File).count() as u64;
        assert_eq!(files, stats.files);
        let big = nodes
            .iter()
            .filter(|(_, n)| **n == Node::File)
            .filter(|(p, _)| fs::metadata(dir.path().join("t").join(p)).unwrap().len() > MIB)
            .count();
        assert!(big >= 3, "only {big} files over 1 MiB");
        assert_eq!(
            fs::read_link(dir.path().join("t/abs_hostname")).unwrap(),
            Path::new("/etc/hostname")
        );
        // Directory mtimes were set after their children were created.
        assert!(mtime_of(&dir.path().join("t/d0")) < 1_600_000_000);
    }

    #[test]
    fn make_tree_is_deterministic() {
        let dir = tempfile::tempdir().unwrap();
        make_small_tree(&dir.path().join("x"), 5);
        make_small_tree(&dir.path().join("y"), 5);
        assert_trees_equal(&dir.path().join("x"), &dir.path().join("y"));
    }

    #[test]
    fn a_faithful_copy_compares_equal() {
        let (_dir, a, b, _) = generated_and_copied(2);
        assert_trees_equal(&a, &b);
    }

    #[test]
    #[should_panic(expected = "d1/s0/t0/u0/f3.bin: mtime")]
    fn a_changed_mtime_is_reported() {
        let (_dir, a, b, _) = generated_and_copied(3);
        set_mtime(&b.join("d1/s0/t0/u0/f3.bin"), 1);
        assert_trees_equal(&a, &b);
    }

    #[test]
    #[should_panic(expected = "link_rel: mtime (1, 5)")]
    fn a_changed_symlink_mtime_is_reported_by_the_strict_check() {
        let (_dir, a, b, _) = generated_and_copied(7);
        // `cp -a` keeps symlink mtimes: the copy is identical until one moves.
        assert_trees_identical(&a, &b, false);
        let t = nix::sys::time::TimeSpec::new(1, 5);
        nix::sys::stat::utimensat(
            None,
            &b.join("link_rel"),
            &t,
            &t,
            nix::sys::stat::UtimensatFlags::NoFollowSymlink,
        )
        .unwrap();
        assert_trees_equal(&a, &b);
        assert_trees_identical(&a, &b, false);
    }

    #[test]
    #[should_panic(expected = "link: symlink target \"elsewhere\"")]
    fn a_changed_symlink_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        make_small_tree(&a, 4);
        make_small_tree(&b, 4);
        fs::remove_file(b.join("link")).unwrap();
        symlink("elsewhere", b.join("link")).unwrap();
        assert_trees_equal(&a, &b);
    }

    #[test]
    #[should_panic(expected = "unexpected: sub/.ferry-tmp-1")]
    fn an_extra_file_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        make_small_tree(&a, 6);
        make_small_tree(&b, 6);
        fs::write(b.join("sub/.ferry-tmp-1"), b"x").unwrap();
        assert_trees_equal(&a, &b);
    }
}
