//! `ferry-mount`: a real ferryd, a real FUSE mount, byte-for-byte comparisons with the
//! files on the server's disk.
//!
//! Every test has its own ferryd, mount and temp dirs ([`Mount`] unmounts on drop).
//! Under the Soft-RoCE suite (`FERRY_TEST_TRANSPORT=rdma`) the mount speaks RDMA and the
//! files are smaller (TCG is 10-15x slower); the tests that need the TCP wire proxy are
//! skipped there.
//!
//! Contract points and the tests that check them:
//!
//! | point | tests |
//! |---|---|
//! | reads byte-identical | `whole_files_*`, `random_reads_*`, `reads_across_chunk_boundaries`, `concurrent_readers_*`, `reads_through_a_transparent_proxy_*` |
//! | directories of any size list completely | `a_directory_of_many_entries_lists_completely` |
//! | ino, size, mode bits, mtime (ns), nlink, kind, uid/gid, readlink | `stat_fields_match_the_server`, `symlinks_are_returned_verbatim` |
//! | changes seen at the next open; old handles never mix versions | `a_file_changed_on_the_server_*`, `a_handle_opened_before_*`, `a_file_truncated_*` |
//! | chunk verification: EIO, log line, no unverified byte | `a_corrupted_chunk_*`, `a_single_flipped_read_*` |
//! | server killed: bounded failure, unmount works | `server_killed_*`, `restarted_server_*` |
//! | `-o ro`: EROFS | `writes_fail_with_erofs` (writes: `mount_write.rs`) |
//! | one-sided reads of an open file | `reads_of_an_open_file_are_one_sided` |
//! | `SHARE/SUBDIR` mounts | `subdir_mount_*` |
//! | `fuse.ferry` in mountinfo; exit codes 2 and 3; SIGTERM / SIGINT / umount / fusermount3 -u; detaching | `the_mount_shows_as_fuse_ferry_in_mountinfo`, `bad_arguments_*`, `a_missing_mount_point_*`, `unreachable_server_exits_3`, `sigint_*`, `external_unmount_*`, `detached_*`; SIGTERM in every test (`assert_clean_unmount`) |

use std::collections::BTreeSet;
use std::fs::{self, File, FileTimes, OpenOptions};
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{symlink, FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ferry_tests::{
    assert_same_bytes, bin, ferry_mount, ferrytest, is_fuse_type, mount_type, on_rdma, rcp_args,
    send_signal, set_mode, test_choice, test_host, unused_local_port, within, write_random_file,
    Corruption, Env, Mount, ReadTarget, Server, Share, WireProxy, FSTYPE, MIB, STARTUP_TIMEOUT,
    UNMOUNT_TIMEOUT,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// `EIO`, `EROFS`, `ENOTCONN` on Linux.
const EIO: i32 = 5;
const EROFS: i32 = 30;
const ENOTCONN: i32 = 107;

/// ferry-mount's default chunk size for files of up to 2 GiB.
const CHUNK: u64 = 16 << 10;

/// `tcp` when on TCP, else `rdma`: sizes and counts scaled for the Soft-RoCE VM.
fn scaled(tcp: u64, rdma: u64) -> u64 {
    if on_rdma() {
        rdma
    } else {
        tcp
    }
}

/// Prints why a test that needs the TCP wire proxy does nothing here; true if so.
fn skip_without_tcp(test: &str) -> bool {
    if on_rdma() {
        eprintln!("{test}: skipped: the wire proxy speaks the tcp transport, this run is rdma");
        return true;
    }
    false
}

/// Reads up to `len` bytes at `offset`, stopping early only at end of file.
fn pread(file: &File, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    let mut filled = 0;
    while filled < len {
        match file.read_at(&mut buf[filled..], offset + filled as u64) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    buf.truncate(filled);
    Ok(buf)
}

/// `expected[offset .. offset + len]`, clamped to its end.
fn slice(expected: &[u8], offset: u64, len: usize) -> &[u8] {
    let start = (offset as usize).min(expected.len());
    let end = (start + len).min(expected.len());
    &expected[start..end]
}

/// Drops the page cache of `file`, so the next read reaches ferry-mount.
fn drop_page_cache(file: &File) {
    nix::fcntl::posix_fadvise(
        file.as_raw_fd(),
        0,
        0,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    )
    .expect("posix_fadvise(DONTNEED)");
}

/// Panics unless `err` is one of the errnos `allowed`.
#[track_caller]
fn assert_errno(err: &io::Error, allowed: &[i32], what: &str) {
    assert!(
        err.raw_os_error().is_some_and(|e| allowed.contains(&e)),
        "{what}: expected an error with errno in {allowed:?}, got {err} ({:?})",
        err.raw_os_error()
    );
}

/// Panics unless `result` failed with one of the errnos `allowed`.
#[track_caller]
fn assert_fails<T: std::fmt::Debug>(result: io::Result<T>, allowed: &[i32], what: &str) {
    match result {
        Ok(v) => panic!("{what}: expected errno in {allowed:?}, but it succeeded ({v:?})"),
        Err(e) => assert_errno(&e, allowed, what),
    }
}

/// Stops the mount and checks that SIGTERM unmounted it and ended it with exit 0.
#[track_caller]
fn assert_clean_unmount(mount: Mount) {
    let path = mount.path().to_owned();
    let stopped = mount.unmount();
    assert!(
        stopped.graceful && stopped.code == Some(0),
        "SIGTERM should unmount {} and exit 0; got {stopped:?}",
        path.display()
    );
    assert_eq!(
        mount_type(&path),
        None,
        "{} is still mounted",
        path.display()
    );
}

/// The mount of the whole default share of `env`.
fn mount_share(env: &Env) -> Mount {
    Mount::start(env.remote(""))
}

/// A time with nanoseconds, `secs` after the epoch.
fn time(secs: u64, nanos: u32) -> SystemTime {
    UNIX_EPOCH + Duration::new(secs, nanos)
}

fn set_mtime_ns(path: &Path, secs: u64, nanos: u32) {
    let file = File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    file.set_times(FileTimes::new().set_modified(time(secs, nanos)))
        .unwrap_or_else(|e| panic!("set mtime of {}: {e}", path.display()));
}

// ---------------------------------------------------------------- reading

/// File sizes around the chunk size, plus a few MiB and an odd tail.
fn interesting_sizes() -> Vec<u64> {
    vec![
        0,
        1,
        4095,
        4096,
        4097,
        CHUNK - 1,
        CHUNK,
        CHUNK + 1,
        2 * CHUNK + 1,
        scaled(3 * MIB + 12_345, MIB + 777),
    ]
}

/// Writes one file per size under `dir/` in the default share; returns the names.
fn write_sized_files(env: &Env, dir: &str, sizes: &[u64]) -> Vec<String> {
    fs::create_dir_all(env.share(dir)).unwrap();
    sizes
        .iter()
        .enumerate()
        .map(|(i, &size)| {
            let rel = format!("{dir}/f{i}-{size}.bin");
            write_random_file(&env.share(&rel), size, 100 + i as u64);
            rel
        })
        .collect()
}

fn assert_whole_files_identical(env: &Env, mount: &Mount, files: &[String]) {
    for rel in files {
        let expected = fs::read(env.share(rel)).unwrap();
        let actual =
            fs::read(mount.join(rel)).unwrap_or_else(|e| panic!("read {rel} via the mount: {e}"));
        assert_same_bytes(&expected, &actual, rel);
        let len = fs::metadata(mount.join(rel)).unwrap().len();
        assert_eq!(len, expected.len() as u64, "st_size of {rel}");
    }
}

ferrytest!(whole_files_read_back_byte_identical, |env| {
    let files = write_sized_files(&env, "a/b", &interesting_sizes());
    let mount = mount_share(&env);
    assert_whole_files_identical(&env, &mount, &files);
    // A second pass is served (at least partly) from caches: still identical.
    assert_whole_files_identical(&env, &mount, &files);
    assert_clean_unmount(mount);
});

ferrytest!(whole_files_with_small_chunks_and_a_tiny_cache, |env| {
    let mut sizes = interesting_sizes();
    sizes.push(scaled(2 * MIB + 3, 300_001));
    let files = write_sized_files(&env, "small", &sizes);
    let mount = Mount::builder(env.remote(""))
        .opt("chunk_size=4K,cache_size=2")
        .opt("readahead=2")
        .start();
    assert_whole_files_identical(&env, &mount, &files);
    assert_clean_unmount(mount);
});

ferrytest!(random_reads_match_the_file, |env| {
    let size = scaled(3 * MIB + 4321, MIB + 4321);
    write_random_file(&env.share("r.bin"), size, 7);
    let expected = fs::read(env.share("r.bin")).unwrap();
    let mount = mount_share(&env);
    let file = File::open(mount.join("r.bin")).unwrap();
    let mut rng = StdRng::seed_from_u64(0x5eed);
    for i in 0..scaled(400, 80) {
        let offset = rng.gen_range(0..size + 100);
        let len = if i % 4 == 0 {
            rng.gen_range(1..=16)
        } else {
            rng.gen_range(1..=200_000)
        };
        if i % 16 == 0 {
            drop_page_cache(&file);
        }
        let got =
            pread(&file, offset, len).unwrap_or_else(|e| panic!("pread({offset}, {len}): {e}"));
        assert_same_bytes(
            slice(&expected, offset, len),
            &got,
            &format!("read #{i} of {len} bytes at {offset}"),
        );
    }
    drop(file);
    assert_clean_unmount(mount);
});

ferrytest!(reads_across_chunk_boundaries, |env| {
    let size = 5 * CHUNK + 100;
    write_random_file(&env.share("b.bin"), size, 8);
    let expected = fs::read(env.share("b.bin")).unwrap();
    for chunk_opt in ["chunk_size=64K", "chunk_size=16K"] {
        let chunk = if chunk_opt.ends_with("16K") {
            16 << 10
        } else {
            64 << 10
        };
        let mount = Mount::builder(env.remote("")).opt(chunk_opt).start();
        let file = File::open(mount.join("b.bin")).unwrap();
        let mut boundary = chunk;
        while boundary <= size {
            for (back, len) in [
                (1, 2),
                (4096, 8192),
                (1, chunk as usize + 2),
                (0, 1),
                (3, 7),
            ] {
                let offset = boundary - back;
                drop_page_cache(&file);
                let got = pread(&file, offset, len).unwrap();
                assert_same_bytes(
                    slice(&expected, offset, len),
                    &got,
                    &format!("{chunk_opt}: {len} bytes at {offset}"),
                );
            }
            boundary += chunk;
        }
        // The last partial chunk and a read past the end.
        let got = pread(&file, size - 150, 1000).unwrap();
        assert_same_bytes(slice(&expected, size - 150, 1000), &got, "the tail");
        assert!(
            pread(&file, size + 10, 10).unwrap().is_empty(),
            "read past the end"
        );
        drop(file);
        assert_clean_unmount(mount);
    }
});

ferrytest!(concurrent_readers_on_the_same_and_different_files, |env| {
    let names = ["c0.bin", "c1.bin", "c2.bin"];
    for (i, name) in names.iter().enumerate() {
        write_random_file(
            &env.share(name),
            scaled(2 * MIB, 512 << 10) + 17 * i as u64,
            30 + i as u64,
        );
    }
    let expected: Arc<Vec<Vec<u8>>> = Arc::new(
        names
            .iter()
            .map(|n| fs::read(env.share(n)).unwrap())
            .collect(),
    );
    let mount = mount_share(&env);
    let paths: Arc<Vec<PathBuf>> = Arc::new(names.iter().map(|n| mount.join(n)).collect());
    let threads = 8;
    let rounds = scaled(3, 1);
    within(
        Duration::from_secs(120),
        "the concurrent readers",
        move || {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let (expected, paths) = (expected.clone(), paths.clone());
                    thread::spawn(move || {
                        let mut rng = StdRng::seed_from_u64(1000 + t as u64);
                        for round in 0..rounds {
                            let whole = (t + round as usize) % 3;
                            let got = fs::read(&paths[whole]).unwrap();
                            assert_same_bytes(
                                &expected[whole],
                                &got,
                                &format!("thread {t}: whole file {whole}"),
                            );
                            let other = (t + 1) % 3;
                            let file = File::open(&paths[other]).unwrap();
                            let size = expected[other].len() as u64;
                            for _ in 0..30 {
                                let offset = rng.gen_range(0..size);
                                let len = rng.gen_range(1..=100_000);
                                let got = pread(&file, offset, len).unwrap();
                                assert_same_bytes(
                                    slice(&expected[other], offset, len),
                                    &got,
                                    &format!("thread {t}: {len} bytes at {offset} of file {other}"),
                                );
                            }
                        }
                    })
                })
                .collect();
            for h in handles {
                h.join().expect("a reader thread panicked");
            }
        },
    );
    assert_clean_unmount(mount);
});

// ---------------------------------------------------------------- metadata

ferrytest!(a_directory_of_many_entries_lists_completely, |env| {
    let count = scaled(10_000, 1_500) as usize;
    let dir = env.share("many");
    fs::create_dir(&dir).unwrap();
    let mut names: BTreeSet<String> = (0..count - 4).map(|i| format!("entry-{i:05}")).collect();
    names.extend(["with space", "ünïcödé", ".hidden", &"x".repeat(255)].map(String::from));
    for (i, name) in names.iter().enumerate() {
        fs::write(dir.join(name), vec![b'x'; i % 5]).unwrap();
    }
    fs::create_dir(dir.join("entry-00007.d")).unwrap();
    names.insert("entry-00007.d".into());
    let mount = mount_share(&env);
    let listed: Vec<String> = fs::read_dir(mount.join("many"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(listed.len(), names.len(), "number of entries listed");
    let listed_set: BTreeSet<String> = listed.iter().cloned().collect();
    assert_eq!(listed_set.len(), listed.len(), "no name is listed twice");
    assert_eq!(listed_set, names, "the names listed");
    for name in [
        "entry-00000",
        "entry-00003",
        "with space",
        "ünïcödé",
        ".hidden",
        "entry-00007.d",
    ] {
        assert_stat_matches(&env, &mount, &format!("many/{name}"));
    }
    assert_clean_unmount(mount);
});

/// Panics unless the mounted `rel` shows the server's ino, size, mode bits, mtime (with
/// nanoseconds), nlink and kind, and the mounting user as owner; lists every mismatch.
#[track_caller]
fn assert_stat_matches(env: &Env, mount: &Mount, rel: &str) {
    assert_stat_matches_at(env, mount, rel, rel);
}

/// [`assert_stat_matches`] for share path `share_rel` seen as `mount_rel` in the mount
/// (they differ for a subdir mount).
#[track_caller]
fn assert_stat_matches_at(env: &Env, mount: &Mount, share_rel: &str, mount_rel: &str) {
    let server = fs::symlink_metadata(env.share(share_rel)).unwrap();
    let mounted = fs::symlink_metadata(mount.join(mount_rel))
        .unwrap_or_else(|e| panic!("lstat {mount_rel} via the mount: {e}"));
    let me = fs::metadata(env.root()).unwrap();
    let mut wrong = Vec::new();
    let mut check = |field: &str, got: String, want: String| {
        if got != want {
            wrong.push(format!(
                "{field}: {got} via the mount, {want} on the server"
            ));
        }
    };
    check(
        "kind",
        format!("{:?}", mounted.file_type()),
        format!("{:?}", server.file_type()),
    );
    check(
        "st_ino",
        mounted.ino().to_string(),
        server.ino().to_string(),
    );
    check(
        "st_size",
        mounted.size().to_string(),
        server.size().to_string(),
    );
    check(
        "mode & 0o7777",
        format!("{:o}", mounted.mode() & 0o7777),
        format!("{:o}", server.mode() & 0o7777),
    );
    check(
        "mtime",
        format!("{}.{:09}", mounted.mtime(), mounted.mtime_nsec()),
        format!("{}.{:09}", server.mtime(), server.mtime_nsec()),
    );
    check(
        "st_nlink",
        mounted.nlink().to_string(),
        server.nlink().to_string(),
    );
    check(
        "uid:gid (the mounting user's)",
        format!("{}:{}", mounted.uid(), mounted.gid()),
        format!("{}:{}", me.uid(), me.gid()),
    );
    assert!(
        wrong.is_empty(),
        "stat of {mount_rel}:\n  {}",
        wrong.join("\n  ")
    );
}

ferrytest!(stat_fields_match_the_server, |env| {
    write_random_file(&env.share("f"), 12_345, 1);
    set_mode(&env.share("f"), 0o640);
    set_mtime_ns(&env.share("f"), 1_600_000_000, 123_456_789);
    write_random_file(&env.share("suid"), 10, 2);
    set_mode(&env.share("suid"), 0o4755);
    write_random_file(&env.share("hard"), 3 * CHUNK + 1, 3);
    fs::hard_link(env.share("hard"), env.share("hard2")).unwrap();
    set_mtime_ns(&env.share("hard"), 1_234_567_890, 1);
    fs::create_dir_all(env.share("d/sub1")).unwrap();
    fs::create_dir(env.share("d/sub2")).unwrap();
    fs::write(env.share("d/empty"), b"").unwrap();
    set_mode(&env.share("d"), 0o750);
    set_mtime_ns(&env.share("d"), 1_500_000_000, 999_999_999);
    symlink("f", env.share("link")).unwrap();

    let mount = mount_share(&env);
    for rel in [
        "f", "suid", "hard", "hard2", "d", "d/sub1", "d/empty", "link",
    ] {
        assert_stat_matches(&env, &mount, rel);
    }
    assert_eq!(fs::metadata(mount.join("hard")).unwrap().nlink(), 2);
    assert_eq!(
        fs::metadata(mount.join("hard")).unwrap().ino(),
        fs::metadata(mount.join("hard2")).unwrap().ino(),
        "hard links share an inode number"
    );
    // Following a symlink inside the share gives its target's attributes.
    let followed = fs::metadata(mount.join("link")).unwrap();
    assert!(followed.is_file());
    assert_eq!(followed.ino(), fs::metadata(env.share("f")).unwrap().ino());
    assert_eq!(followed.len(), 12_345);
    let root = fs::metadata(mount.path()).unwrap();
    assert!(root.is_dir(), "the mount's root is a directory");
    assert_eq!(
        root.mode() & 0o7777,
        fs::metadata(env.share("")).unwrap().mode() & 0o7777
    );
    assert_clean_unmount(mount);
});

ferrytest!(symlinks_are_returned_verbatim, |env| {
    fs::create_dir(env.share("d")).unwrap();
    fs::write(env.share("d/target"), b"hello").unwrap();
    let links = [
        ("rel", "d/target"),
        ("d/up", "../d/./target"),
        ("dangling", "no/such/file"),
        ("absolute", "/etc/hostname"),
        ("outside", "../../outside/the/share"),
        ("spaces", "a name with spaces"),
    ];
    for (link, target) in links {
        symlink(target, env.share(link)).unwrap();
    }
    let mount = mount_share(&env);
    for (link, target) in links {
        let path = mount.join(link);
        assert_eq!(
            fs::read_link(&path).unwrap(),
            PathBuf::from(target),
            "readlink {link}"
        );
        let meta = fs::symlink_metadata(&path).unwrap();
        assert!(meta.file_type().is_symlink(), "lstat {link} is a symlink");
        assert_stat_matches(&env, &mount, link);
    }
    assert_eq!(fs::read(mount.join("rel")).unwrap(), b"hello");
    assert_eq!(fs::read(mount.join("d/up")).unwrap(), b"hello");
    assert_clean_unmount(mount);
});

// ---------------------------------------------------------------- changes

ferrytest!(
    a_file_changed_on_the_server_is_seen_at_the_next_open,
    |env| {
        let path = env.share("v.bin");
        write_random_file(&path, 300_001, 1);
        // negative_timeout=0 too: the file is removed and created again below.
        let mount = Mount::builder(env.remote(""))
            .opt("attr_timeout=0,entry_timeout=0,negative_timeout=0")
            .start();
        let check = |what: &str| {
            let expected = fs::read(&path).unwrap();
            let got = fs::read(mount.join("v.bin")).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_same_bytes(&expected, &got, what);
            assert_eq!(
                fs::metadata(mount.join("v.bin")).unwrap().len(),
                expected.len() as u64,
                "{what}: size"
            );
        };
        check("the first version");

        // Replaced: a new file renamed over the old name (a new inode).
        write_random_file(&env.share("v.new"), 200_007, 2);
        set_mtime_ns(&env.share("v.new"), 1_700_000_000, 1);
        fs::rename(env.share("v.new"), &path).unwrap();
        check("after a replacement by rename");

        // Rewritten in place with the same size (same inode, new bytes).
        let mut bytes = fs::read(&path).unwrap();
        bytes.iter_mut().for_each(|b| *b = b.wrapping_add(1));
        fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .write_all_at(&bytes, 0)
            .unwrap();
        set_mtime_ns(&path, 1_700_000_100, 2);
        check("after an in-place rewrite of the same size");

        // Truncated and rewritten in place with another size.
        write_random_file(&path, 500_000, 3);
        set_mtime_ns(&path, 1_700_000_200, 3);
        check("after an in-place rewrite with a new size");

        // Removed, then created again.
        fs::remove_file(&path).unwrap();
        assert_fails(
            fs::read(mount.join("v.bin")),
            &[2],
            "reading a removed file (ENOENT)",
        );
        write_random_file(&path, 1000, 4);
        check("after being created again");
        assert_clean_unmount(mount);
    }
);

/// Reads `old.len()` bytes through `file` in 64 KiB pieces: every piece that succeeds
/// must equal `old` there (or, if `may_end_early`, a prefix of it: the file may have
/// shrunk), every failure must be EIO. Returns how many pieces failed.
#[track_caller]
fn assert_old_bytes_or_eio(file: &File, old: &[u8], may_end_early: bool, what: &str) -> usize {
    let mut failed = 0;
    let mut offset = 0u64;
    while offset < old.len() as u64 {
        let what = format!("{what}: the old handle at {offset}");
        match pread(file, offset, CHUNK as usize) {
            Ok(got) => {
                let want = slice(old, offset, CHUNK as usize);
                let want = if may_end_early && got.len() < want.len() {
                    &want[..got.len()]
                } else {
                    want
                };
                assert_same_bytes(want, &got, &what);
            }
            Err(e) => {
                assert_errno(&e, &[EIO], &what);
                failed += 1;
            }
        }
        offset += CHUNK;
    }
    failed
}

ferrytest!(
    a_handle_opened_before_a_change_never_mixes_versions,
    |env| {
        // Larger than the readahead (16 chunks of 64 KiB), so most chunks are fetched
        // only after the change.
        let size = scaled(4 * MIB + 5, 2 * MIB + 5);
        let (a, b) = (env.share("a.bin"), env.share("b.bin"));
        write_random_file(&a, size, 1);
        write_random_file(&b, size, 2);
        let (old_a, old_b) = (fs::read(&a).unwrap(), fs::read(&b).unwrap());
        let mount = Mount::builder(env.remote(""))
            .opt("attr_timeout=0,entry_timeout=0")
            .start();
        let (fa, fb) = (
            File::open(mount.join("a.bin")).unwrap(),
            File::open(mount.join("b.bin")).unwrap(),
        );
        // Part of each is read (and cached) before the change, the rest after.
        assert_same_bytes(&old_a[..4096], &pread(&fa, 0, 4096).unwrap(), "a before");
        assert_same_bytes(&old_b[..4096], &pread(&fb, 0, 4096).unwrap(), "b before");

        // a: rewritten in place (the server's mapping sees the new bytes).
        let new_a: Vec<u8> = old_a.iter().map(|b| !b).collect();
        OpenOptions::new()
            .write(true)
            .open(&a)
            .unwrap()
            .write_all_at(&new_a, 0)
            .unwrap();
        set_mtime_ns(&a, 1_700_000_000, 5);
        // b: replaced by rename (the old inode stays intact while open).
        write_random_file(&env.share("b.new"), size, 3);
        fs::rename(env.share("b.new"), &b).unwrap();

        let failed_a = assert_old_bytes_or_eio(&fa, &old_a, false, "rewritten in place");
        let failed_b = assert_old_bytes_or_eio(&fb, &old_b, false, "replaced by rename");
        eprintln!("old handles: {failed_a} pieces of a failed with EIO, {failed_b} of b");
        // A new open sees the new versions.
        assert_same_bytes(
            &new_a,
            &fs::read(mount.join("a.bin")).unwrap(),
            "a reopened",
        );
        assert_same_bytes(
            &fs::read(&b).unwrap(),
            &fs::read(mount.join("b.bin")).unwrap(),
            "b reopened",
        );
        drop((fa, fb));
        env.server().assert_running();
        assert_clean_unmount(mount);
    }
);

ferrytest!(a_file_truncated_on_the_server_while_open, |env| {
    let size = scaled(2 * MIB + 5, 400_005);
    let path = env.share("t.bin");
    write_random_file(&path, size, 1);
    let old = fs::read(&path).unwrap();
    let mount = Mount::builder(env.remote(""))
        .opt("attr_timeout=0,entry_timeout=0,timeout=5")
        .start();
    let file = File::open(mount.join("t.bin")).unwrap();
    assert_same_bytes(
        &old[..10],
        &pread(&file, 0, 10).unwrap(),
        "before the truncation",
    );
    OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(0)
        .unwrap();
    // The mapped pages beyond the new end are gone on the server: reads through the
    // old handle return old bytes (up to the new end of file, which the kernel may
    // learn) or EIO, never other bytes; they never hang, and ferryd survives.
    let old = Arc::new(old);
    let (file, old2) = (Arc::new(file), old.clone());
    let fa = file.clone();
    let failed = within(
        Duration::from_secs(60),
        "reads after the truncation",
        move || assert_old_bytes_or_eio(&fa, &old2, true, "truncated in place"),
    );
    eprintln!("after truncation: {failed} pieces failed with EIO");
    env.server().assert_running();
    assert_eq!(
        fs::metadata(mount.join("t.bin")).unwrap().len(),
        0,
        "the new size"
    );
    assert!(fs::read(mount.join("t.bin")).unwrap().is_empty());
    drop(file);
    assert_clean_unmount(mount);
});

// ---------------------------------------------------------------- integrity

ferrytest!(a_corrupted_chunk_fails_with_eio_and_is_logged, |env| {
    a_corrupted_chunk_fails(&env, "blake3");
});

ferrytest!(
    a_corrupted_chunk_fails_with_eio_and_is_logged_sha256,
    |env| {
        a_corrupted_chunk_fails(&env, "sha256");
    }
);

/// A byte flipped in every READ of one chunk of a file, through a mount offering only
/// the chunk-hash algorithm `hash`.
fn a_corrupted_chunk_fails(env: &Env, hash: &str) {
    if skip_without_tcp("a_corrupted_chunk_fails_with_eio_and_is_logged") {
        return;
    }
    // 65 chunks of 16 KiB (the manifest region, 65 * 32 bytes, is left alone).
    let size = MIB + 12_345;
    let bad_chunk = 5u64;
    let bad_offset = bad_chunk * CHUNK + 777;
    fs::create_dir(env.share("dir")).unwrap();
    write_random_file(&env.share("dir/bad.bin"), size, 1);
    write_random_file(&env.share("dir/good.bin"), size + 1, 2);
    let expected = fs::read(env.share("dir/bad.bin")).unwrap();
    let proxy = WireProxy::start(
        env.server().addr(),
        Some(Corruption::file_byte(size, bad_offset)),
    );
    let mount = Mount::builder(proxy.remote("data", ""))
        .transport("tcp")
        // The proxy reads and flips plaintext data: a session in the clear.
        .opt("encryption=off")
        .arg("--hash")
        .arg(hash)
        .start();

    // Read the file front to back until the error.
    let mut file = File::open(mount.join("dir/bad.bin")).unwrap();
    let mut got = Vec::new();
    let mut buf = vec![0u8; 128 << 10];
    let err = loop {
        match file.read(&mut buf) {
            Ok(0) => panic!(
                "the whole corrupted file was read without an error ({} bytes)",
                got.len()
            ),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => break e,
        }
    };
    assert_errno(&err, &[EIO], "reading the corrupted chunk");
    assert!(
        got.len() as u64 <= bad_chunk * CHUNK,
        "{} bytes were returned, past the start of corrupted chunk {bad_chunk} ({})",
        got.len(),
        bad_chunk * CHUNK
    );
    assert_same_bytes(
        &expected[..got.len()],
        &got,
        "the bytes before the corrupted chunk",
    );

    // Every flip hit the chosen byte, and only data reads were touched.
    let flips = proxy.flips();
    assert!(
        !flips.is_empty(),
        "the proxy flipped nothing ({} READs seen)",
        proxy.read_responses()
    );
    for flip in &flips {
        assert_eq!(flip.file_offset(), Some(bad_offset), "{flip:?}");
        assert!(matches!(flip.read.target, ReadTarget::FileData { .. }));
    }
    let line = mount.wait_for_log_line(
        &["integrity", "dir/bad.bin", "chunk 5"],
        Duration::from_secs(5),
    );
    match line {
        Some(line) => eprintln!("the integrity line: {line}"),
        None => panic!(
            "no stderr line naming `integrity`, `dir/bad.bin` and `chunk 5`:\n{}",
            mount.log()
        ),
    }

    // The corruption persists: the chunk fails again; the others read fine.
    drop_page_cache(&file);
    assert_fails(
        pread(&file, bad_offset - 7, 100),
        &[EIO],
        "reading chunk 5 again",
    );
    for offset in [0, 4 * CHUNK, 6 * CHUNK, size - 100] {
        drop_page_cache(&file);
        let got = pread(&file, offset, 4096).unwrap_or_else(|e| panic!("read at {offset}: {e}"));
        assert_same_bytes(
            slice(&expected, offset, 4096),
            &got,
            &format!("4 KiB at {offset}"),
        );
    }
    // Another file of another size is not touched.
    assert_same_bytes(
        &fs::read(env.share("dir/good.bin")).unwrap(),
        &fs::read(mount.join("dir/good.bin")).unwrap(),
        "dir/good.bin",
    );
    assert_eq!(proxy.parse_errors(), 0);
    drop(file);
    assert_clean_unmount(mount);
}

ferrytest!(a_single_flipped_read_never_returns_wrong_bytes, |env| {
    if skip_without_tcp("a_single_flipped_read_never_returns_wrong_bytes") {
        return;
    }
    // One flip in flight, anywhere in the file's data: the mount may re-read and
    // succeed or fail the read with EIO, but never returns the damaged bytes.
    let size = 2 * MIB + 99;
    write_random_file(&env.share("once.bin"), size, 3);
    let expected = fs::read(env.share("once.bin")).unwrap();
    let corruption = Corruption::new(ferry_tests::Direction::ServerToClient, |read| {
        matches!(read.target, ReadTarget::FileData { .. }).then_some(read.len as usize / 3)
    })
    .limit(1);
    let proxy = WireProxy::start(env.server().addr(), Some(corruption));
    let mount = Mount::builder(proxy.remote("data", ""))
        .transport("tcp")
        // The proxy reads and flips plaintext data: a session in the clear.
        .opt("encryption=off")
        .start();
    match fs::read(mount.join("once.bin")) {
        Ok(got) => assert_same_bytes(&expected, &got, "a read that recovered from one flip"),
        Err(e) => {
            assert_errno(&e, &[EIO], "a read with one flip");
            // Once the flip is spent, the file reads whole.
            assert_same_bytes(
                &expected,
                &fs::read(mount.join("once.bin")).unwrap(),
                "the retry",
            );
        }
    }
    assert_eq!(proxy.flip_count(), 1, "exactly one flip was made");
    assert_clean_unmount(mount);
});

ferrytest!(reads_through_a_transparent_proxy_are_unchanged, |env| {
    if skip_without_tcp("reads_through_a_transparent_proxy_are_unchanged") {
        return;
    }
    let files = write_sized_files(&env, "p", &interesting_sizes());
    let proxy = WireProxy::start(env.server().addr(), None);
    let mount = Mount::builder(proxy.remote("data", ""))
        .transport("tcp")
        // The proxy reads and flips plaintext data: a session in the clear.
        .opt("encryption=off")
        .start();
    assert_whole_files_identical(&env, &mount, &files);
    // File data crossed the wire as one-sided READ responses, which the proxy parsed.
    assert!(
        proxy.read_responses() > 0,
        "no READ responses went through the proxy"
    );
    assert_eq!(proxy.parse_errors(), 0);
    assert_eq!(proxy.flip_count(), 0);
    assert_clean_unmount(mount);
});

// ---------------------------------------------------------------- one-sided reads

ferrytest!(reads_of_an_open_file_are_one_sided, |env| {
    let size = scaled(8 * MIB + 3, 2 * MIB + 3);
    write_random_file(&env.share("big.bin"), size, 9);
    let expected = fs::read(env.share("big.bin")).unwrap();
    let mount = mount_share(&env);
    let (host, port) = env.server().addr().rsplit_once(':').unwrap();
    let port: u16 = port.parse().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let client = rt
        .block_on(ferry_tests::connect_to(host, port, test_choice()))
        .expect("connect a stats client");

    let mut file = File::open(mount.join("big.bin")).unwrap();
    let before = rt.block_on(client.server_stats()).unwrap();
    assert!(
        before.mapped_files >= 1,
        "the open file is mapped on the server: {before:?}"
    );
    let mut got = vec![0u8; size as usize];
    file.read_exact(&mut got).unwrap();
    let after = rt.block_on(client.server_stats()).unwrap();
    assert_same_bytes(&expected, &got, "big.bin");
    assert_eq!(
        after.requests,
        before.requests + 1,
        "requests the server handled while {size} bytes of an open file were read \
         (+1 is the second stats call): before {before:?}, after {after:?}"
    );
    drop(file);
    assert_clean_unmount(mount);
});

// ---------------------------------------------------------------- read-only

ferrytest!(writes_fail_with_erofs, |env| {
    fs::create_dir(env.share("d")).unwrap();
    fs::create_dir(env.share("empty")).unwrap();
    fs::write(env.share("f"), b"original").unwrap();
    let mount = Mount::builder(env.remote("")).opt("ro").start();
    let m = |rel: &str| mount.join(rel);
    assert_fails(
        OpenOptions::new().write(true).open(m("f")),
        &[EROFS],
        "open f for writing",
    );
    assert_fails(
        OpenOptions::new().append(true).open(m("f")),
        &[EROFS],
        "open f for appending",
    );
    assert_fails(
        OpenOptions::new().write(true).truncate(true).open(m("f")),
        &[EROFS],
        "open f with O_TRUNC",
    );
    assert_fails(File::create(m("new")), &[EROFS], "create new");
    assert_fails(File::create(m("d/new")), &[EROFS], "create d/new");
    assert_fails(fs::create_dir(m("newdir")), &[EROFS], "mkdir newdir");
    assert_fails(fs::remove_file(m("f")), &[EROFS], "unlink f");
    assert_fails(fs::remove_dir(m("empty")), &[EROFS], "rmdir empty");
    assert_fails(fs::rename(m("f"), m("g")), &[EROFS], "rename f g");
    assert_fails(
        fs::set_permissions(m("f"), fs::Permissions::from_mode(0o777)),
        &[EROFS],
        "chmod f",
    );
    assert_fails(symlink("f", m("sl")), &[EROFS], "symlink sl");
    assert_fails(fs::hard_link(m("f"), m("hl")), &[EROFS], "link hl");
    let file = File::open(m("f")).unwrap();
    assert_fails(
        file.set_times(FileTimes::new().set_modified(time(1, 0))),
        &[EROFS],
        "utimens f",
    );
    drop(file);
    // Nothing changed on the server.
    assert_eq!(fs::read(env.share("f")).unwrap(), b"original");
    ferry_tests::assert_entries(&env.share(""), &["d", "empty", "f"]);
    ferry_tests::assert_entries(&env.share("d"), &[]);
    assert_clean_unmount(mount);
});

// ---------------------------------------------------------------- subdir mounts

ferrytest!(subdir_mount_shows_only_the_subdir, |env| {
    fs::create_dir_all(env.share("a/b/sub")).unwrap();
    write_random_file(&env.share("a/b/file.bin"), 3 * CHUNK + 7, 1);
    fs::write(env.share("a/b/sub/x"), b"x").unwrap();
    fs::write(env.share("top.bin"), b"top").unwrap();
    let mount = Mount::start(env.remote("a/b"));
    ferry_tests::assert_entries(mount.path(), &["file.bin", "sub"]);
    ferry_tests::assert_entries(&mount.join("sub"), &["x"]);
    assert_same_bytes(
        &fs::read(env.share("a/b/file.bin")).unwrap(),
        &fs::read(mount.join("file.bin")).unwrap(),
        "file.bin",
    );
    assert_eq!(fs::read(mount.join("sub/x")).unwrap(), b"x");
    assert_stat_matches_at(&env, &mount, "a/b/file.bin", "file.bin");
    assert_stat_matches_at(&env, &mount, "a/b/sub", "sub");
    assert_fails(
        fs::metadata(mount.join("top.bin")),
        &[2],
        "top.bin is outside the subdir (ENOENT)",
    );
    assert_clean_unmount(mount);
});

ferrytest!(
    subdir_mount_of_a_missing_or_non_directory_path_fails,
    |env| {
        fs::write(env.share("plain"), b"p").unwrap();
        for (remote, what) in [
            (env.remote("no/such/dir"), "no/such/dir"),
            (env.remote("plain"), "plain"),
            (env.remote_in("nosuchshare", ""), "nosuchshare"),
        ] {
            let failed = match Mount::builder(remote).try_start() {
                Ok(mount) => panic!("mounting {what} succeeded; it must fail\n{}", mount.log()),
                Err(failed) => failed,
            };
            assert!(
                matches!(failed.code, Some(1) | Some(4)),
                "mounting {what}: expected exit 4 (mount failed) or 1\n{failed}"
            );
            assert!(
                failed.stderr.contains(what),
                "mounting {what}: stderr should name it\n{failed}"
            );
        }
    }
);

// ---------------------------------------------------------------- process life

ferrytest!(bad_arguments_exit_2_with_a_clear_message, |env| {
    let mnt = tempfile::tempdir().unwrap();
    let mnt = mnt.path().to_str().unwrap().to_owned();
    let remote = env.remote("");
    let cases: Vec<(Vec<String>, &[&str])> = vec![
        (vec![], &["usage"]),
        (vec![remote.clone()], &["usage", "mountpoint", "MOUNTPOINT"]),
        (
            vec![
                "-o".into(),
                "writeback=0".into(),
                remote.clone(),
                mnt.clone(),
            ],
            &["writeback"],
        ),
        (
            vec!["-o".into(), "nosuchopt".into(), remote.clone(), mnt.clone()],
            &["nosuchopt"],
        ),
        (
            vec![
                "-o".into(),
                "attr_timeout=abc".into(),
                remote.clone(),
                mnt.clone(),
            ],
            &["attr_timeout"],
        ),
        (
            vec![
                "-o".into(),
                "chunk_size=12Q".into(),
                remote.clone(),
                mnt.clone(),
            ],
            &["chunk_size"],
        ),
        (
            vec![
                "--transport".into(),
                "pigeon".into(),
                remote.clone(),
                mnt.clone(),
            ],
            &["pigeon", "transport"],
        ),
        (
            vec!["--no-such-flag".into(), remote.clone(), mnt.clone()],
            &["no-such-flag"],
        ),
        (
            vec!["no-colon-here".into(), mnt.clone()],
            &["no-colon-here", "HOST"],
        ),
        (
            vec![remote.clone(), mnt.clone(), "extra".into()],
            &["extra", "usage"],
        ),
    ];
    for (args, needles) in cases {
        let mut full = vec!["-f".to_owned()];
        full.extend(args);
        let out = ferry_mount(&full);
        out.assert_code(2).assert_stderr_has_any(needles);
        assert_eq!(
            mount_type(Path::new(&mnt)),
            None,
            "nothing may be mounted after {full:?}"
        );
    }
});

ferrytest!(a_missing_mount_point_fails_clearly, |env| {
    let missing = "/nonexistent-ferry-mount-point/mnt";
    let out = ferry_mount(rcp_args!["-f", env.remote(""), missing]);
    assert!(
        matches!(out.code, Some(2) | Some(4)),
        "expected exit 2 or 4\n{out}"
    );
    out.assert_stderr_has_any(&[missing]);
});

#[test]
fn unreachable_server_exits_3() {
    let mnt = tempfile::tempdir().unwrap();
    let remote = format!("{}:{}:data", test_host(), unused_local_port());
    let out = ferry_mount(rcp_args!["-f", "-o", "timeout=5", remote, mnt.path()]);
    out.assert_code(3);
    assert!(
        !out.stderr.trim().is_empty(),
        "stderr should say why\n{out}"
    );
    assert!(
        out.elapsed < Duration::from_secs(15),
        "took {:?}\n{out}",
        out.elapsed
    );
    assert_eq!(mount_type(&mnt.path().canonicalize().unwrap()), None);
}

ferrytest!(the_mount_shows_as_fuse_ferry_in_mountinfo, |env| {
    let mount = mount_share(&env);
    assert_eq!(
        mount.fstype().as_deref(),
        Some(FSTYPE),
        "the file system type of {} in /proc/self/mountinfo",
        mount.path().display()
    );
    assert_clean_unmount(mount);
});

ferrytest!(sigint_unmounts_and_exits_0, |env| {
    fs::write(env.share("f"), b"f").unwrap();
    let mount = mount_share(&env);
    assert_eq!(fs::read(mount.join("f")).unwrap(), b"f");
    assert!(send_signal(mount.pid(), "INT"));
    let status = mount.wait_for_exit(UNMOUNT_TIMEOUT);
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(0),
        "exit after SIGINT: {status:?}\n{}",
        mount.log()
    );
    assert!(
        mount.wait_for_unmount(Duration::from_secs(2)),
        "still mounted after SIGINT"
    );
});

ferrytest!(external_unmount_ends_the_process_with_exit_0, |env| {
    fs::write(env.share("f"), b"f").unwrap();
    for tool in [&["umount"][..], &["fusermount3", "-u"][..]] {
        let mount = mount_share(&env);
        assert_eq!(fs::read(mount.join("f")).unwrap(), b"f");
        let status = Command::new(tool[0])
            .args(&tool[1..])
            .arg(mount.path())
            .status()
            .unwrap();
        assert!(status.success(), "{tool:?} failed: {status}");
        let exit = mount.wait_for_exit(UNMOUNT_TIMEOUT);
        assert_eq!(
            exit.and_then(|s| s.code()),
            Some(0),
            "ferry-mount after `{}`: {exit:?}\n{}",
            tool.join(" "),
            mount.log()
        );
        assert!(!mount.is_mounted());
    }
});

/// Processes whose command line contains `needle` (other than this one).
fn processes_with_arg(needle: &str) -> Vec<u32> {
    let me = std::process::id();
    fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| c.split(|&b| b == 0).any(|arg| arg == needle.as_bytes()))
                .unwrap_or(false)
        })
        .collect()
}

/// Unmounts and kills what a detached-mode test left behind.
struct DetachedGuard {
    mountpoint: PathBuf,
}

impl Drop for DetachedGuard {
    fn drop(&mut self) {
        let path = self.mountpoint.to_str().unwrap().to_owned();
        if mount_type(&self.mountpoint).is_some() {
            let _ = Command::new("umount").arg("-l").arg(&path).status();
        }
        for pid in processes_with_arg(&path) {
            send_signal(pid, "KILL");
        }
    }
}

ferrytest!(detached_mount_is_ready_when_the_command_returns, |env| {
    fs::write(env.share("f"), b"detached").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().canonicalize().unwrap().join("mnt");
    fs::create_dir(&mnt).unwrap();
    let _guard = DetachedGuard {
        mountpoint: mnt.clone(),
    };
    let out = ferry_mount(rcp_args![env.remote(""), mnt]);
    out.assert_code(0);
    assert!(
        mount_type(&mnt).is_some_and(|t| is_fuse_type(&t)),
        "the mount is ready when the command returns\n{out}"
    );
    assert_eq!(fs::read(mnt.join("f")).unwrap(), b"detached");
    let daemons = processes_with_arg(mnt.to_str().unwrap());
    assert_eq!(
        daemons.len(),
        1,
        "one ferry-mount process serves the mount: {daemons:?}"
    );
    let status = Command::new("umount").arg(&mnt).status().unwrap();
    assert!(status.success());
    let deadline = Instant::now() + UNMOUNT_TIMEOUT;
    while Instant::now() < deadline && !processes_with_arg(mnt.to_str().unwrap()).is_empty() {
        thread::sleep(Duration::from_millis(20));
    }
    assert!(
        processes_with_arg(mnt.to_str().unwrap()).is_empty(),
        "the detached ferry-mount did not exit after umount"
    );
});

// ---------------------------------------------------------------- server failures

/// A ferryd serving `dir` as share `data` on exactly `addr`, for restarts on the same
/// port; killed on drop.
struct FixedFerryd {
    child: std::process::Child,
}

impl FixedFerryd {
    fn start(addr: &str, dir: &Path) -> FixedFerryd {
        let state = tempfile::tempdir().unwrap();
        let port_file = state.path().join("port");
        let transport = if on_rdma() { "auto" } else { "tcp" };
        let mut child = Command::new(bin("ferryd"))
            .arg("--listen")
            .arg(addr)
            .arg("--port-file")
            .arg(&port_file)
            .arg("--share")
            .arg(format!("data={}", dir.display()))
            .env("FERRY_TRANSPORT", transport)
            .env("FERRYD_SECRET", ferry_tests::TEST_SECRET)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let start = Instant::now();
        while !fs::read_to_string(&port_file).is_ok_and(|t| t.ends_with('\n')) {
            if let Some(status) = child.try_wait().unwrap() {
                panic!("the restarted ferryd on {addr} exited with {status}");
            }
            assert!(
                start.elapsed() < STARTUP_TIMEOUT,
                "the restarted ferryd did not start"
            );
            thread::sleep(Duration::from_millis(20));
        }
        FixedFerryd { child }
    }
}

impl Drop for FixedFerryd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The mount's per-operation timeout in the server-failure tests, and the slack
/// allowed on top of it.
const OP_TIMEOUT_SECS: u64 = 3;
const OP_SLACK: Duration = Duration::from_secs(7);

/// Runs one file-system operation after the server died: it must end within the
/// timeout plus slack, and fail with EIO or ENOTCONN unless `may_succeed` (an
/// operation that cached data can answer). Returns what a successful one returned.
fn after_death<T: Send + 'static>(
    what: &str,
    may_succeed: bool,
    op: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> Option<T> {
    let limit = Duration::from_secs(OP_TIMEOUT_SECS) + OP_SLACK;
    let start = Instant::now();
    let result = within(limit, what, op);
    eprintln!(
        "{what}: {} after {:?}",
        if result.is_ok() { "ok" } else { "failed" },
        start.elapsed()
    );
    match result {
        Ok(value) if may_succeed => Some(value),
        Ok(_) => panic!("{what} succeeded although the server is gone"),
        Err(e) => {
            assert_errno(&e, &[EIO, ENOTCONN], what);
            None
        }
    }
}

#[test]
fn server_killed_fails_operations_within_the_timeout_then_unmounts() {
    let dir = tempfile::tempdir().unwrap();
    let share = dir.path().to_owned();
    fs::create_dir(share.join("sub")).unwrap();
    let size = scaled(2 * MIB + 1, 512 << 10);
    write_random_file(&share.join("a.bin"), size, 1);
    write_random_file(&share.join("b.bin"), size, 2);
    fs::write(share.join("sub/c"), b"c").unwrap();
    let (a, b) = (
        fs::read(share.join("a.bin")).unwrap(),
        fs::read(share.join("b.bin")).unwrap(),
    );
    let server = Server::start(&[Share::rw("data", &share)]);
    let mount = Mount::builder(server.remote("data", ""))
        .opt(&format!("timeout={OP_TIMEOUT_SECS}"))
        .start();
    assert_same_bytes(
        &a,
        &fs::read(mount.join("a.bin")).unwrap(),
        "a.bin before the kill",
    );
    let held = File::open(mount.join("b.bin")).unwrap();

    drop(server); // SIGKILL

    let p = |rel: &str| mount.join(rel);
    after_death("stat of a path never looked up", false, {
        let p = p("sub/c");
        move || fs::metadata(p)
    });
    after_death("listing a directory never listed", false, {
        let p = p("sub");
        move || fs::read_dir(p).and_then(|d| d.collect::<io::Result<Vec<_>>>())
    });
    if let Some(got) = after_death("reading a file already read", true, {
        let p = p("a.bin");
        move || fs::read(p)
    }) {
        assert_same_bytes(&a, &got, "a.bin from the caches after the kill");
    }
    let held = Arc::new(held);
    let h = held.clone();
    if let Some(got) = after_death(
        "reading through a handle opened before the kill",
        true,
        move || pread(&h, size / 2, 100_000),
    ) {
        assert_same_bytes(slice(&b, size / 2, 100_000), &got, "b.bin after the kill");
    }
    drop(held);
    assert_clean_unmount(mount);
}

#[test]
fn restarted_server_on_the_same_port_may_be_reconnected() {
    let dir = tempfile::tempdir().unwrap();
    let share = dir.path().to_owned();
    write_random_file(&share.join("a.bin"), 100_000, 1);
    let server = Server::start(&[Share::rw("data", &share)]);
    let addr = server.addr().to_owned();
    let mount = Mount::builder(server.remote("data", ""))
        .opt(&format!(
            "timeout={OP_TIMEOUT_SECS},attr_timeout=0,entry_timeout=0"
        ))
        .start();
    assert_eq!(
        fs::read(mount.join("a.bin")).unwrap(),
        fs::read(share.join("a.bin")).unwrap()
    );
    drop(server);
    // Let the mount notice the loss.
    after_death("stat after the kill", true, {
        let p = mount.join("a.bin");
        move || fs::metadata(p)
    });

    write_random_file(&share.join("later.bin"), 200_003, 2);
    let _restarted = FixedFerryd::start(&addr, &share);
    let expected = fs::read(share.join("later.bin")).unwrap();
    let start = Instant::now();
    let mut reconnected = false;
    while start.elapsed() < Duration::from_secs(15) {
        let p = mount.join("later.bin");
        let limit = Duration::from_secs(OP_TIMEOUT_SECS) + OP_SLACK;
        match within(
            limit,
            "reading through the mount after the restart",
            move || fs::read(p),
        ) {
            Ok(got) => {
                assert_same_bytes(&expected, &got, "later.bin after the restart");
                reconnected = true;
                break;
            }
            Err(e) => assert_errno(&e, &[EIO, ENOTCONN], "reading after the restart"),
        }
        thread::sleep(Duration::from_millis(250));
    }
    eprintln!(
        "restarted_server_on_the_same_port_may_be_reconnected: {}",
        if reconnected {
            format!("reconnected after {:?}", start.elapsed())
        } else {
            "no reconnection within 15 s (the contract does not require one)".to_owned()
        }
    );
    assert_clean_unmount(mount);
}
