//! `ferry-mount` read-write (issue 21): real tools and real processes writing through
//! the mount, compared byte for byte with the files on the server's disk.
//!
//! Every test has its own ferryd, mounts and temp dirs ([`Mount`] unmounts on drop,
//! also when a test fails). A test skips (prints why and returns) when FUSE is
//! unavailable or a tool it drives (rsync, git, sqlite3, python3, fallocate) is not
//! installed. Under the Soft-RoCE suite (`FERRY_TEST_TRANSPORT=rdma`) the mounts speak
//! RDMA and some files are smaller (TCG is 10-15x slower).
//!
//! The specified behaviour and the tests that check it:
//!
//! | point | tests |
//! |---|---|
//! | read-write by default; `-o ro` and `:ro` shares give EROFS; `writeback=MIB` | `the_default_mount_is_writable`, `ro_option_*`, `a_read_only_share_*`, `writeback_*` |
//! | (a) close-to-open: a second mount, `rcp`, the server's disk | `close_to_open_*`, every tool test (compares the server's disk) |
//! | (b) new and O_TRUNC files appear whole at close or fsync | `a_new_file_appears_*`, `a_truncated_file_*`, `a_reader_on_another_mount_sees_old_or_new_*`, `editor_style_save_*` |
//! | (c) in-place writes reach the file; on disk after fsync | `in_place_writes_*`, `dd_notrunc_*`, `mmap_shared_*`, `rsync_*` (`--inplace`), `sqlite_*` |
//! | (d) write-back errors reach write/fsync/close; nothing half-written | `ferryd_killed_*`, `ferry_mount_killed_*`, `a_full_share_*` |
//! | (e) never stale after its own writes | `own_writes_are_read_back_at_once_*` |
//! | file-system operations | `ops_*`, `statvfs_*` |
//! | data moves one-sided | `written_bytes_are_pulled_one_sided` |

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::IntoRawFd;
use std::os::unix::fs::{symlink, FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use ferry_tests::{
    assert_files_equal, assert_no_temp_files, assert_same_bytes, assert_trees_equal,
    byte_difference, ferry_mount, make_medium_tree, mode_of, mtime_of, on_rdma, python, rcp_args,
    run_tool, send_signal, sh, skip_without_fuse, skip_without_tool, temp_files, test_choice,
    within, write_random_file, Env, Mount, Server, ServerOptions, Share, Tmpfs, ToolOutput,
    DEFAULT_SHARE, MIB,
};
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};

/// Linux errnos.
const ENOENT: i32 = 2;
const EEXIST: i32 = 17;
const ENOSPC: i32 = 28;
const EROFS: i32 = 30;
const ENOTEMPTY: i32 = 39;

/// The options of a mount that must see another mount's changes at the next open: no
/// attribute, entry or negative caching in the kernel.
const NO_KERNEL_CACHE: &str = "attr_timeout=0,entry_timeout=0,negative_timeout=0";

// ---------------------------------------------------------------- harness

/// `tcp` when on TCP, else `rdma`: sizes, counts and limits scaled for the VM.
fn scaled(tcp: u64, rdma: u64) -> u64 {
    if on_rdma() {
        rdma
    } else {
        tcp
    }
}

/// How long one tool run may take (a cp of a tree, a git clone, ...).
fn tool_limit() -> Duration {
    Duration::from_secs(scaled(15, 120))
}

/// Declares a `#[test]` that skips without FUSE and runs `$body` with a fresh [`Env`]
/// serving one read-write share, [`DEFAULT_SHARE`].
macro_rules! mount_test {
    ($name:ident, |$env:ident| $body:block) => {
        #[test]
        fn $name() {
            if skip_without_fuse(stringify!($name)) {
                return;
            }
            let $env = Env::new();
            $body
        }
    };
}

/// A mount of the whole default share with the default options (read-write).
fn mount_rw(env: &Env) -> Mount {
    Mount::start(env.remote(""))
}

/// A second mount of the default share that caches no attributes or entries in the
/// kernel (so it sees other mounts' changes at the next open).
fn mount_reader(env: &Env) -> Mount {
    Mount::builder(env.remote("")).opt(NO_KERNEL_CACHE).start()
}

/// Runs a tool with [`tool_limit`] and panics (with its output) unless it exits 0.
#[track_caller]
fn run_ok(cmd: &mut Command, what: &str) -> ToolOutput {
    let out = run_tool(cmd, tool_limit());
    out.assert_success(what);
    out
}

/// `len` bytes from a ChaCha RNG seeded with `seed`.
fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    StdRng::seed_from_u64(seed).fill_bytes(&mut bytes);
    bytes
}

/// Panics unless `path` (on the server's disk or in a mount) holds exactly `expected`.
#[track_caller]
fn assert_file_is(path: &Path, expected: &[u8], what: &str) {
    let got = fs::read(path).unwrap_or_else(|e| panic!("{what}: read {}: {e}", path.display()));
    assert_same_bytes(expected, &got, &format!("{what} ({})", path.display()));
}

/// Panics unless `err` has one of the errnos `allowed`.
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

/// Closes `file` and returns what close(2) said (dropping a `File` ignores it, and a
/// write-back error may be reported only there).
fn close(file: File) -> io::Result<()> {
    nix::unistd::close(file.into_raw_fd()).map_err(io::Error::from)
}

/// Writes all of `bytes` at `offset`.
fn pwrite(file: &File, bytes: &[u8], offset: u64) -> io::Result<()> {
    file.write_all_at(bytes, offset)
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

/// Polls `ok` every 50 ms for at most `limit`; whether it became true.
fn eventually(limit: Duration, mut ok: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if ok() {
            return true;
        }
        if start.elapsed() > limit {
            return false;
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// Stops the mount and checks that SIGTERM unmounted it and ended it with exit 0 (no
/// write left hanging keeps it busy).
#[track_caller]
fn assert_clean_unmount(mount: Mount) {
    let path = mount.path().to_owned();
    let stopped = mount.unmount();
    assert!(
        stopped.graceful && stopped.code == Some(0),
        "SIGTERM should unmount {} and exit 0; got {stopped:?}",
        path.display()
    );
}

/// Reads `path` over and over on a thread until `stop` is set, checking every read
/// against `old` and `new`: each must equal one of them exactly. Returns the number
/// of reads that saw (old, new), or the first bad read's description.
fn spawn_whole_file_checker(
    path: PathBuf,
    old: Arc<Vec<u8>>,
    new: Arc<Vec<u8>>,
    stop: Arc<AtomicBool>,
) -> thread::JoinHandle<Result<(u64, u64), String>> {
    thread::spawn(move || {
        let (mut saw_old, mut saw_new) = (0, 0);
        loop {
            // Read once more after `stop`: the last read must see the final state.
            let last = stop.load(Ordering::SeqCst);
            let got = fs::read(&path).map_err(|e| {
                format!(
                    "read {} failed after {saw_old} old and {saw_new} new reads: {e}",
                    path.display()
                )
            })?;
            if got == *old {
                saw_old += 1;
            } else if got == *new {
                saw_new += 1;
            } else {
                return Err(format!(
                    "a read of {} after {saw_old} old and {saw_new} new reads is neither the \
                     old content ({}) nor the new ({})",
                    path.display(),
                    byte_difference(&old, &got),
                    byte_difference(&new, &got)
                ));
            }
            if last {
                return Ok((saw_old, saw_new));
            }
        }
    })
}

/// Joins a checker from [`spawn_whole_file_checker`] and panics on a bad read.
#[track_caller]
fn join_checker(checker: thread::JoinHandle<Result<(u64, u64), String>>, what: &str) -> (u64, u64) {
    match checker.join() {
        Ok(Ok(counts)) => counts,
        Ok(Err(bad)) => panic!("{what}: {bad}"),
        Err(_) => panic!("{what}: the reader thread panicked"),
    }
}

/// `stat -c %u:%g PATH`, not following a final symlink.
fn stat_owner(path: &Path) -> String {
    let out = run_ok(
        Command::new("stat").args(["-c", "%u:%g"]).arg(path),
        "stat -c %u:%g",
    );
    out.stdout.trim().to_owned()
}

// ---------------------------------------------------------------- read-write or not

mount_test!(the_default_mount_is_writable, |env| {
    fs::write(env.share("old.txt"), b"old").unwrap();
    let mount = mount_rw(&env);
    fs::write(mount.join("new.txt"), b"written through the mount")
        .unwrap_or_else(|e| panic!("a default mount of a writable share must be writable: {e}"));
    assert_file_is(
        &env.share("new.txt"),
        b"written through the mount",
        "new.txt on the server after close",
    );
    assert_file_is(&env.share("old.txt"), b"old", "old.txt is untouched");
    assert_no_temp_files(&env.share(""));
    assert_clean_unmount(mount);
});

/// Checks that the mount refuses writes with EROFS and that nothing changed.
#[track_caller]
fn assert_read_only(mount: &Mount, share_dir: &Path, what: &str) {
    let m = |rel: &str| mount.join(rel);
    assert_fails(
        File::create(m("new")),
        &[EROFS],
        &format!("{what}: create new"),
    );
    assert_fails(
        OpenOptions::new().write(true).open(m("f")),
        &[EROFS],
        &format!("{what}: open f for writing"),
    );
    assert_fails(
        fs::create_dir(m("newdir")),
        &[EROFS],
        &format!("{what}: mkdir"),
    );
    assert_fails(
        fs::remove_file(m("f")),
        &[EROFS],
        &format!("{what}: unlink f"),
    );
    let touch = run_tool(
        Command::new("touch").env("LC_ALL", "C").arg(m("touched")),
        tool_limit(),
    );
    touch.assert_failure(&format!("{what}: touch"));
    assert!(
        touch.stderr.contains("Read-only file system"),
        "{what}: touch should fail with EROFS\n{touch}"
    );
    assert_file_is(&share_dir.join("f"), b"original", what);
    assert!(!share_dir.join("new").exists(), "{what}: new was created");
    assert!(
        !share_dir.join("touched").exists(),
        "{what}: touched was created"
    );
    assert!(!share_dir.join("newdir").exists(), "{what}: newdir exists");
}

mount_test!(ro_option_mounts_read_only, |env| {
    fs::write(env.share("f"), b"original").unwrap();
    let mount = Mount::builder(env.remote("")).opt("ro").start();
    assert_read_only(&mount, &env.share(""), "-o ro");
    assert_clean_unmount(mount);
});

#[test]
fn a_read_only_share_mounts_read_only() {
    if skip_without_fuse("a_read_only_share_mounts_read_only") {
        return;
    }
    let env = Env::with_shares(&[("ro", true)]);
    fs::write(env.share_dir("ro").join("f"), b"original").unwrap();
    let mount = Mount::start(env.remote_in("ro", ""));
    assert_read_only(&mount, &env.share_dir("ro"), "a share exported :ro");
    assert_clean_unmount(mount);
}

mount_test!(writeback_option_is_parsed_and_checked, |env| {
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().canonicalize().unwrap();
    for bad in ["writeback=abc", "writeback=", "writeback=-1"] {
        let out = ferry_mount(rcp_args!["-o", bad, env.remote(""), mnt]);
        if ferry_tests::mount_type(&mnt).is_some() {
            // It mounted (and detached): take it down before failing.
            let _ = Command::new("umount").arg("-l").arg(&mnt).status();
        }
        out.assert_code(2);
        assert!(
            out.stderr.contains("writeback"),
            "-o {bad}: the message should name the option\n{out}"
        );
    }
});

mount_test!(writeback_cache_of_one_mib_still_writes_big_files, |env| {
    let size = scaled(24 * MIB, 6 * MIB) as usize + 4097;
    let data = random_bytes(size, 41);
    let mount = Mount::builder(env.remote("")).opt("writeback=1").start();
    let mut file = File::create(mount.join("big.bin")).unwrap();
    for piece in data.chunks(64 << 10) {
        file.write_all(piece)
            .unwrap_or_else(|e| panic!("write through a 1 MiB write-back cache: {e}"));
    }
    close(file).unwrap_or_else(|e| panic!("close: {e}"));
    assert_file_is(&env.share("big.bin"), &data, "big.bin on the server");
    assert_file_is(&mount.join("big.bin"), &data, "big.bin through the mount");
    assert_no_temp_files(&env.share(""));
    assert_clean_unmount(mount);
});

// ---------------------------------------------------------------- real tools

mount_test!(cp_a_of_a_tree_into_and_out_of_the_mount, |env| {
    let src = env.local("src");
    make_medium_tree(&src, 1);
    let mount = mount_rw(&env);
    run_ok(
        Command::new("cp")
            .arg("-a")
            .arg(&src)
            .arg(mount.join("dst")),
        "cp -a into the mount",
    );
    assert_trees_equal(&src, &env.share("dst"));
    assert_no_temp_files(&env.share(""));
    // And back out: what the mount reads is what was written.
    run_ok(
        Command::new("cp")
            .arg("-a")
            .arg(mount.join("dst"))
            .arg(env.local("back")),
        "cp -a out of the mount",
    );
    assert_trees_equal(&src, &env.local("back"));
    assert_clean_unmount(mount);
});

mount_test!(tar_x_into_the_mount, |env| {
    let src = env.local("src");
    make_medium_tree(&src, 2);
    // A hard link in the archive: tar extracts it with link(2).
    fs::hard_link(src.join("a/b/f02.dat"), src.join("a/b/hard.dat")).unwrap();
    let archive = env.local("t.tar");
    run_ok(
        Command::new("tar")
            .arg("cf")
            .arg(&archive)
            .arg("-C")
            .arg(env.local(""))
            .arg("src"),
        "tar c",
    );
    let mount = mount_rw(&env);
    run_ok(
        Command::new("tar")
            .arg("xf")
            .arg(&archive)
            .arg("-C")
            .arg(mount.path()),
        "tar x in the mount",
    );
    assert_trees_equal(&src, &env.share("src"));
    let ino = |p: PathBuf| fs::metadata(p).unwrap().ino();
    assert_eq!(
        ino(env.share("src/a/b/f02.dat")),
        ino(env.share("src/a/b/hard.dat")),
        "the archive's hard link is a hard link on the server"
    );
    assert_no_temp_files(&env.share(""));
    assert_clean_unmount(mount);
});

mount_test!(rsync_a_into_the_mount_then_updates, |env| {
    if skip_without_tool("rsync_a_into_the_mount_then_updates", "rsync") {
        return;
    }
    let src = env.local("src");
    make_medium_tree(&src, 3);
    let mount = mount_rw(&env);
    let rsync = |extra: &[&str], what: &str| {
        let mut cmd = Command::new("rsync");
        cmd.arg("-a").args(extra);
        cmd.arg(format!("{}/", src.display()))
            .arg(format!("{}/", mount.join("r").display()));
        run_ok(&mut cmd, what);
    };
    rsync(&[], "rsync -a (first copy)");
    assert_trees_equal(&src, &env.share("r"));

    // One file changed: rsync writes a temp file and renames it over the old one.
    write_random_file(&src.join("a/b/f02.dat"), 30_000, 99);
    ferry_tests::set_mtime(&src.join("a/b/f02.dat"), 1_600_000_000);
    ferry_tests::set_mtime(&src.join("a/b"), 1_600_000_001);
    rsync(&[], "rsync -a (one file changed)");
    assert_trees_equal(&src, &env.share("r"));

    // In place: a few bytes in the middle of the 3 MiB file (same size), and a file
    // shortened; rsync --inplace writes into the existing files and truncates.
    let big = src.join("d/three.bin");
    let mut bytes = fs::read(&big).unwrap();
    for b in &mut bytes[1_500_000..1_500_100] {
        *b = !*b;
    }
    fs::write(&big, &bytes).unwrap();
    ferry_tests::set_mtime(&big, 1_600_000_100);
    let shorter = src.join("a/one and a bit.bin");
    let mut bytes = fs::read(&shorter).unwrap();
    bytes.truncate(bytes.len() - 1000);
    fs::write(&shorter, &bytes).unwrap();
    ferry_tests::set_mtime(&shorter, 1_600_000_200);
    ferry_tests::set_mtime(&src.join("d"), 1_600_000_300);
    ferry_tests::set_mtime(&src.join("a"), 1_600_000_400);
    rsync(
        &["--inplace", "--no-whole-file"],
        "rsync -a --inplace --no-whole-file",
    );
    assert_trees_equal(&src, &env.share("r"));
    assert_no_temp_files(&env.share(""));
    assert_clean_unmount(mount);
});

/// `git` with no system or user configuration and a fixed identity and clock.
fn git(home: &Path) -> Command {
    let mut cmd = Command::new("git");
    cmd.env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("HOME", home)
        .env("GIT_AUTHOR_NAME", "Ferry Test")
        .env("GIT_AUTHOR_EMAIL", "test@ferry.invalid")
        .env("GIT_COMMITTER_NAME", "Ferry Test")
        .env("GIT_COMMITTER_EMAIL", "test@ferry.invalid")
        .env("GIT_AUTHOR_DATE", "2024-01-02T03:04:05Z")
        .env("GIT_COMMITTER_DATE", "2024-01-02T03:04:05Z");
    cmd
}

mount_test!(git_clone_into_the_mount_then_commit, |env| {
    if skip_without_tool("git_clone_into_the_mount_then_commit", "git") {
        return;
    }
    let home = env.local("home");
    fs::create_dir(&home).unwrap();
    let repo = env.local("repo");
    fs::create_dir(&repo).unwrap();
    let g = |dir: &Path, args: &[&str]| {
        let mut cmd = git(&home);
        cmd.arg("-C").arg(dir).args(args);
        run_ok(&mut cmd, &format!("git {}", args.join(" ")))
    };
    g(&repo, &["-c", "init.defaultBranch=main", "init", "-q"]);
    fs::write(repo.join("README"), b"ferry\n").unwrap();
    fs::create_dir(repo.join("src")).unwrap();
    fs::write(repo.join("src/a.txt"), b"one\n").unwrap();
    write_random_file(&repo.join("blob.bin"), 200_000, 5);
    g(&repo, &["add", "-A"]);
    g(&repo, &["commit", "-q", "-m", "one"]);
    fs::write(repo.join("src/a.txt"), b"one\ntwo\n").unwrap();
    fs::write(repo.join("run.sh"), b"#!/bin/sh\necho hi\n").unwrap();
    ferry_tests::set_mode(&repo.join("run.sh"), 0o755);
    symlink("src/a.txt", repo.join("link")).unwrap();
    g(&repo, &["add", "-A"]);
    g(&repo, &["commit", "-q", "-m", "two"]);
    fs::create_dir(repo.join("docs")).unwrap();
    fs::write(repo.join("docs/x.md"), b"# x\n").unwrap();
    fs::remove_file(repo.join("README")).unwrap();
    g(&repo, &["add", "-A"]);
    g(&repo, &["commit", "-q", "-m", "three"]);
    let head = g(&repo, &["rev-parse", "HEAD"]).stdout;

    let mount = mount_rw(&env);
    let clone = mount.join("clone");
    let mut cmd = git(&home);
    cmd.args(["clone", "-q"])
        .arg(format!("file://{}", repo.display()))
        .arg(&clone);
    run_ok(&mut cmd, "git clone into the mount");
    g(&clone, &["fsck", "--full", "--strict"]);
    let status = g(&clone, &["status", "--porcelain"]);
    assert_eq!(
        status.stdout, "",
        "a fresh clone in the mount is clean\n{status}"
    );
    assert_eq!(g(&clone, &["rev-parse", "HEAD"]).stdout, head);

    // A commit made in the mount: index.lock, loose objects, ref updates by rename.
    fs::write(clone.join("src/a.txt"), b"one\ntwo\nthree\n").unwrap();
    g(&clone, &["commit", "-q", "-a", "-m", "four"]);
    g(&clone, &["fsck", "--full", "--strict"]);
    let status = g(&clone, &["status", "--porcelain"]);
    assert_eq!(
        status.stdout, "",
        "clean after a commit in the mount\n{status}"
    );
    let new_head = g(&clone, &["rev-parse", "HEAD"]).stdout;

    // The server's disk holds a valid repository too.
    let on_disk = env.share("clone");
    g(&on_disk, &["fsck", "--full", "--strict"]);
    assert_eq!(g(&on_disk, &["rev-parse", "HEAD"]).stdout, new_head);
    assert_file_is(
        &on_disk.join("src/a.txt"),
        b"one\ntwo\nthree\n",
        "a.txt on the server",
    );
    assert_no_temp_files(&env.share(""));
    assert_clean_unmount(mount);
});

/// The editor's save: write a temp file, fsync it, rename it over the original.
const EDITOR_SAVE: &str = r#"
import os, sys, time
path, src = sys.argv[1], sys.argv[2]
tmp = path + ".ferry-test-swp"
data = open(src, "rb").read()
fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
step = max(1, len(data) // 8)
for i in range(0, len(data), step):
    view = memoryview(data)[i:i + step]
    while view:
        view = view[os.write(fd, view):]
    time.sleep(0.05)
os.fsync(fd)
os.close(fd)
os.rename(tmp, path)
"#;

mount_test!(editor_style_save_replaces_the_file_whole, |env| {
    if skip_without_tool("editor_style_save_replaces_the_file_whole", "python3") {
        return;
    }
    let old = Arc::new(random_bytes(scaled(3 * MIB, MIB) as usize + 11, 51));
    let new = Arc::new(random_bytes(scaled(2 * MIB, MIB / 2) as usize + 5, 52));
    fs::write(env.share("doc.txt"), &*old).unwrap();
    fs::write(env.local("new"), &*new).unwrap();
    let writer = mount_rw(&env);
    let reader = mount_reader(&env);
    let stop = Arc::new(AtomicBool::new(false));
    let checker = spawn_whole_file_checker(
        reader.join("doc.txt"),
        old.clone(),
        new.clone(),
        stop.clone(),
    );
    let save = run_tool(
        &mut python(
            EDITOR_SAVE,
            [
                writer.join("doc.txt").as_os_str(),
                env.local("new").as_os_str(),
            ],
        ),
        tool_limit(),
    );
    stop.store(true, Ordering::SeqCst);
    let (saw_old, saw_new) = join_checker(checker, "a reader on the second mount");
    save.assert_success("the editor-style save");
    eprintln!("reader: {saw_old} reads of the old content, {saw_new} of the new");
    assert!(
        saw_new >= 1,
        "the reader's last read must see the new content"
    );
    assert_file_is(&env.share("doc.txt"), &new, "doc.txt on the server");
    assert_file_is(
        &writer.join("doc.txt"),
        &new,
        "doc.txt on the writer's mount",
    );
    assert!(
        !env.share("doc.txt.ferry-test-swp").exists(),
        "the renamed temp file is gone"
    );
    ferry_tests::assert_entries(&env.share(""), &["doc.txt"]);
    assert_no_temp_files(&env.share(""));
    drop(reader);
    assert_clean_unmount(writer);
});

mount_test!(appends_from_processes_in_turn, |env| {
    let mount = mount_rw(&env);
    let f = mount.join("log.txt");
    let mut expected = String::new();
    for round in 0..6 {
        for who in ["a", "b"] {
            let line = format!("{who}{round}");
            run_ok(
                sh("echo \"$1\" >> \"$2\"").arg(&line).arg(&f),
                "echo >> log.txt",
            );
            expected.push_str(&line);
            expected.push('\n');
        }
    }
    assert_file_is(
        &env.share("log.txt"),
        expected.as_bytes(),
        "log.txt on the server",
    );
    assert_file_is(&f, expected.as_bytes(), "log.txt through the mount");
    assert_clean_unmount(mount);
});

mount_test!(dd_notrunc_overwrites_the_middle_of_a_64_mib_file, |env| {
    let path = env.share("big.bin");
    write_random_file(&path, 64 * MIB, 61);
    let patch = random_bytes(4 * MIB as usize, 62);
    fs::write(env.local("patch"), &patch).unwrap();
    // The expected result, built on the local side.
    let expected = env.local("expected");
    fs::copy(&path, &expected).unwrap();
    pwrite(
        &OpenOptions::new().write(true).open(&expected).unwrap(),
        &patch,
        20 * MIB,
    )
    .unwrap();

    let mount = mount_rw(&env);
    run_ok(
        Command::new("dd")
            .arg(format!("if={}", env.local("patch").display()))
            .arg(format!("of={}", mount.join("big.bin").display()))
            .args(["bs=1M", "seek=20", "count=4", "conv=notrunc", "status=none"]),
        "dd conv=notrunc",
    );
    assert_eq!(
        fs::metadata(&path).unwrap().len(),
        64 * MIB,
        "size on the server"
    );
    assert_files_equal(&expected, &path);
    // Read back through the mount around the patch.
    let file = File::open(mount.join("big.bin")).unwrap();
    let got = pread(&file, 19 * MIB, 6 * MIB as usize).unwrap();
    let want = fs::read(&expected).unwrap();
    assert_same_bytes(
        &want[19 * MIB as usize..25 * MIB as usize],
        &got,
        "19..25 MiB read back through the mount",
    );
    drop(file);
    assert_no_temp_files(&env.share(""));
    assert_clean_unmount(mount);
});

mount_test!(truncate_up_and_down_and_a_sparse_write, |env| {
    let orig = random_bytes(MIB as usize + 7, 71);
    fs::write(env.share("f"), &orig).unwrap();
    let mount = mount_rw(&env);
    let m = mount.join("f");
    let check = |expected: &[u8], what: &str| {
        assert_eq!(
            fs::metadata(env.share("f")).unwrap().len(),
            expected.len() as u64,
            "{what}: size on the server"
        );
        assert_file_is(&env.share("f"), expected, &format!("{what}: on the server"));
        assert_eq!(
            fs::metadata(&m).unwrap().len(),
            expected.len() as u64,
            "{what}: size through the mount"
        );
        assert_file_is(&m, expected, &format!("{what}: through the mount"));
    };

    run_ok(
        Command::new("truncate").args(["-s", "3M"]).arg(&m),
        "truncate -s 3M",
    );
    let mut expected = orig.clone();
    expected.resize(3 * MIB as usize, 0);
    check(&expected, "grown to 3 MiB");

    run_ok(
        Command::new("truncate").args(["-s", "100000"]).arg(&m),
        "truncate -s 100000",
    );
    expected.truncate(100_000);
    check(&expected, "shrunk to 100000");

    // 10 KiB written 1200 blocks of 4 KiB in: a hole from 100000 to 4915200.
    let tail = random_bytes(10 << 10, 72);
    fs::write(env.local("tail"), &tail).unwrap();
    run_ok(
        Command::new("dd")
            .arg(format!("if={}", env.local("tail").display()))
            .arg(format!("of={}", m.display()))
            .args(["bs=4096", "seek=1200", "conv=notrunc", "status=none"]),
        "dd past the end",
    );
    expected.resize(1200 * 4096, 0);
    expected.extend_from_slice(&tail);
    check(&expected, "after a write past the end");

    run_ok(
        Command::new("truncate").args(["-s", "0"]).arg(&m),
        "truncate -s 0",
    );
    check(&[], "truncated to 0");
    assert_no_temp_files(&env.share(""));
    assert_clean_unmount(mount);
});

/// Patches a file through a shared, writable mapping: `PATH OFFSET:HEX...`.
const MMAP_PATCH: &str = r#"
import mmap, sys
path = sys.argv[1]
with open(path, "r+b") as f:
    m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    for arg in sys.argv[2:]:
        off, data = arg.split(":")
        off, data = int(off), bytes.fromhex(data)
        m[off:off + len(data)] = data
    m.flush()
    m.close()
"#;

mount_test!(mmap_shared_writes_reach_the_server, |env| {
    if skip_without_tool("mmap_shared_writes_reach_the_server", "python3") {
        return;
    }
    let size = 300_001usize;
    let mut expected = random_bytes(size, 81);
    fs::write(env.share("m.bin"), &expected).unwrap();
    let mount = mount_rw(&env);
    let patches: Vec<(usize, Vec<u8>)> = vec![
        (0, b"HEAD".to_vec()),
        (4095, b"<page boundary>".to_vec()),
        (150_000, vec![0xa5; 5000]),
        (size - 3, b"END".to_vec()),
    ];
    let mut cmd = python(MMAP_PATCH, [mount.join("m.bin")]);
    for (off, data) in &patches {
        let hex: String = data.iter().map(|b| format!("{b:02x}")).collect();
        cmd.arg(format!("{off}:{hex}"));
        expected[*off..off + data.len()].copy_from_slice(data);
    }
    let out = run_tool(&mut cmd, tool_limit());
    out.assert_success(
        "writing through a MAP_SHARED mapping (if the mount refuses shared writable \
         mappings, the errno is below)",
    );
    assert_file_is(
        &env.share("m.bin"),
        &expected,
        "m.bin on the server after close",
    );
    assert_file_is(&mount.join("m.bin"), &expected, "m.bin through the mount");
    assert_clean_unmount(mount);
});

mount_test!(sqlite_database_in_the_mount, |env| {
    if skip_without_tool("sqlite_database_in_the_mount", "sqlite3") {
        return;
    }
    let mut sql = String::from(
        "CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT NOT NULL, pad BLOB);\nBEGIN;\n",
    );
    for i in 1..=1000 {
        sql.push_str(&format!(
            "INSERT INTO t VALUES({i}, 'row-{i}', randomblob({}));\n",
            100 + i % 400
        ));
    }
    sql.push_str("COMMIT;\n");
    fs::write(env.local("fill.sql"), sql).unwrap();
    let writer = mount_rw(&env);
    let db = writer.join("test.db");
    run_ok(
        Command::new("sqlite3")
            .arg(&db)
            .arg(format!(".read {}", env.local("fill.sql").display())),
        "sqlite3: 1000 inserts in one transaction",
    );
    let check = |path: &Path, readonly: bool, rows: u32, what: &str| {
        let mut cmd = Command::new("sqlite3");
        if readonly {
            cmd.arg("-readonly");
        }
        cmd.arg(path)
            .arg("PRAGMA integrity_check; SELECT count(*) FROM t;");
        let out = run_ok(&mut cmd, what);
        assert_eq!(
            out.stdout,
            format!("ok\n{rows}\n"),
            "{what}: integrity_check and count\n{out}"
        );
    };
    check(&db, false, 1000, "the writer's mount");
    let reader = mount_reader(&env);
    check(&reader.join("test.db"), true, 1000, "a second mount");
    check(&env.share("test.db"), true, 1000, "the server's disk");

    // A second transaction changes pages in place.
    run_ok(
        Command::new("sqlite3").arg(&db).arg(
            "BEGIN; UPDATE t SET name = 'changed' WHERE id <= 10; \
             DELETE FROM t WHERE id > 990; COMMIT;",
        ),
        "sqlite3: update and delete",
    );
    check(
        &reader.join("test.db"),
        true,
        990,
        "a second mount after the update",
    );
    check(
        &env.share("test.db"),
        true,
        990,
        "the server's disk after the update",
    );
    ferry_tests::assert_entries(&env.share(""), &["test.db"]);
    assert_no_temp_files(&env.share(""));
    drop(reader);
    assert_clean_unmount(writer);
});

// ---------------------------------------------------------------- operations

mount_test!(ops_mkdir_rmdir_unlink, |env| {
    let mount = mount_rw(&env);
    let m = |rel: &str| mount.join(rel);
    fs::create_dir(m("d")).unwrap();
    assert!(env.share("d").is_dir(), "mkdir reaches the server");
    assert_fails(
        fs::create_dir(m("d")),
        &[EEXIST],
        "mkdir of an existing dir",
    );
    fs::create_dir_all(m("d/e/f")).unwrap();
    fs::write(m("d/file"), b"x").unwrap();
    assert_fails(
        fs::remove_dir(m("d")),
        &[ENOTEMPTY],
        "rmdir of a non-empty dir",
    );
    assert!(
        env.share("d/file").is_file(),
        "a failed rmdir removes nothing"
    );
    fs::remove_file(m("d/file")).unwrap();
    assert!(!env.share("d/file").exists(), "unlink reaches the server");
    assert_fails(
        fs::remove_file(m("d/file")),
        &[ENOENT],
        "unlink of a missing file",
    );
    assert_fails(fs::metadata(m("d/file")), &[ENOENT], "stat after unlink");
    fs::remove_dir(m("d/e/f")).unwrap();
    fs::remove_dir(m("d/e")).unwrap();
    fs::remove_dir(m("d")).unwrap();
    assert!(!env.share("d").exists(), "rmdir reaches the server");
    ferry_tests::assert_entries(&env.share(""), &[]);
    assert_clean_unmount(mount);
});

mount_test!(ops_symlink_and_hard_link, |env| {
    fs::write(env.share("a"), b"alpha").unwrap();
    let mount = mount_rw(&env);
    let m = |rel: &str| mount.join(rel);
    symlink("dir/../a", m("sl")).unwrap();
    assert_eq!(
        fs::read_link(env.share("sl")).unwrap(),
        Path::new("dir/../a"),
        "symlink target on the server"
    );
    assert_eq!(fs::read_link(m("sl")).unwrap(), Path::new("dir/../a"));

    fs::hard_link(m("a"), m("b")).unwrap();
    let (sa, sb) = (
        fs::metadata(env.share("a")).unwrap(),
        fs::metadata(env.share("b")).unwrap(),
    );
    assert_eq!(sa.ino(), sb.ino(), "a and b are one inode on the server");
    assert_eq!(sa.nlink(), 2, "nlink on the server");
    assert_eq!(
        fs::metadata(m("a")).unwrap().nlink(),
        2,
        "nlink through the mount"
    );
    assert_file_is(&m("b"), b"alpha", "b through the mount");
    // An in-place write through one name shows through the other.
    let file = OpenOptions::new().write(true).open(m("b")).unwrap();
    pwrite(&file, b"ALPHA", 0).unwrap();
    close(file).unwrap();
    assert_file_is(&m("a"), b"ALPHA", "a after writing through b");
    assert_file_is(
        &env.share("a"),
        b"ALPHA",
        "a on the server after writing through b",
    );
    fs::remove_file(m("a")).unwrap();
    assert!(!env.share("a").exists(), "a is unlinked on the server");
    assert_file_is(&env.share("b"), b"ALPHA", "b after unlinking a");
    assert_file_is(&m("b"), b"ALPHA", "b through the mount after unlinking a");
    assert_clean_unmount(mount);
});

mount_test!(ops_rename_over_and_noreplace, |env| {
    let mount = mount_rw(&env);
    let m = |rel: &str| mount.join(rel);
    fs::write(m("x"), b"x content").unwrap();
    fs::write(m("y"), b"y content").unwrap();
    fs::rename(m("x"), m("y")).unwrap();
    assert_file_is(&env.share("y"), b"x content", "y replaced on the server");
    assert!(!env.share("x").exists(), "x is gone on the server");
    assert_fails(fs::metadata(m("x")), &[ENOENT], "x is gone in the mount");
    assert_file_is(&m("y"), b"x content", "y through the mount");

    // RENAME_NOREPLACE onto an existing name fails and changes nothing.
    fs::write(m("p"), b"p content").unwrap();
    let noreplace = |from: &Path, to: &Path| {
        nix::fcntl::renameat2(
            None,
            from,
            None,
            to,
            nix::fcntl::RenameFlags::RENAME_NOREPLACE,
        )
        .map_err(io::Error::from)
    };
    assert_fails(
        noreplace(&m("p"), &m("y")),
        &[EEXIST],
        "renameat2(RENAME_NOREPLACE) onto y",
    );
    assert_file_is(&env.share("p"), b"p content", "p after a refused rename");
    assert_file_is(&env.share("y"), b"x content", "y after a refused rename");
    noreplace(&m("p"), &m("q")).expect("renameat2(RENAME_NOREPLACE) onto a free name");
    assert_file_is(&env.share("q"), b"p content", "q on the server");
    assert!(!env.share("p").exists());

    // A directory with contents, renamed.
    fs::create_dir_all(m("d1/sub")).unwrap();
    fs::write(m("d1/sub/f"), b"deep").unwrap();
    fs::rename(m("d1"), m("d2")).unwrap();
    assert_file_is(&env.share("d2/sub/f"), b"deep", "renamed dir on the server");
    assert_file_is(&m("d2/sub/f"), b"deep", "renamed dir through the mount");
    assert!(!env.share("d1").exists());
    ferry_tests::assert_entries(&env.share(""), &["d2", "q", "y"]);
    assert_clean_unmount(mount);
});

mount_test!(ops_chmod_chown_utimens, |env| {
    fs::write(env.share("f"), b"f").unwrap();
    fs::create_dir(env.share("d")).unwrap();
    let mount = mount_rw(&env);
    let m = |rel: &str| mount.join(rel);

    fs::set_permissions(m("f"), fs::Permissions::from_mode(0o640)).unwrap();
    assert_eq!(
        mode_of(&env.share("f")),
        0o640,
        "chmod of a file on the server"
    );
    assert_eq!(mode_of(&m("f")), 0o640, "chmod of a file through the mount");
    fs::set_permissions(m("d"), fs::Permissions::from_mode(0o711)).unwrap();
    assert_eq!(
        mode_of(&env.share("d")),
        0o711,
        "chmod of a dir on the server"
    );

    if nix::unistd::geteuid().is_root() {
        std::os::unix::fs::chown(m("f"), Some(1234), Some(5678)).unwrap();
        assert_eq!(stat_owner(&m("f")), "1234:5678", "chown through the mount");
        assert_eq!(
            stat_owner(&env.share("f")),
            "1234:5678",
            "chown on the server"
        );
        std::os::unix::fs::lchown(m("d"), None, Some(4321)).unwrap();
        assert_eq!(
            stat_owner(&env.share("d")),
            "0:4321",
            "chgrp of a dir on the server"
        );
    } else {
        eprintln!("ops_chmod_chown_utimens: chown not checked: not running as root");
    }

    run_ok(
        Command::new("touch")
            .args(["-m", "-d", "2001-02-03 04:05:06 UTC"])
            .arg(m("f")),
        "touch -d",
    );
    assert_eq!(
        mtime_of(&env.share("f")),
        981_173_106,
        "mtime on the server"
    );
    assert_eq!(mtime_of(&m("f")), 981_173_106, "mtime through the mount");
    run_ok(
        Command::new("touch")
            .args(["-d", "@1000000000"])
            .arg(m("d")),
        "touch -d on a dir",
    );
    assert_eq!(
        mtime_of(&env.share("d")),
        1_000_000_000,
        "dir mtime on the server"
    );
    run_ok(Command::new("touch").arg(m("new")), "touch of a new file");
    assert_file_is(&env.share("new"), b"", "a touched new file on the server");
    assert_file_is(
        &env.share("f"),
        b"f",
        "f's content after the attribute changes",
    );
    assert_clean_unmount(mount);
});

// Times set by path while a descriptor of this mount holds the file open for
// writing, with bytes still in its write-back cache: `fstat`/`stat` through the mount
// show the new times while the descriptor is open (it answers them), and the cached
// bytes, written before, do not move the mtime when they reach the server at close
// (`cp -p`'s order: write, set times, close).
mount_test!(
    times_set_while_open_for_writing_show_at_once_and_survive_the_close,
    |env| {
        fs::write(env.share("f"), b"old").unwrap();
        let mount = mount_rw(&env);
        let m = mount.join("f");
        let mut held = OpenOptions::new().write(true).open(&m).unwrap();
        held.write_all(b"new bytes, cached").unwrap();
        run_ok(
            Command::new("touch")
                .args(["-m", "-d", "2001-02-03 04:05:06 UTC"])
                .arg(&m),
            "touch -d while open",
        );
        assert_eq!(mtime_of(&m), 981_173_106, "stat while the writer is open");
        assert_eq!(
            held.metadata().unwrap().mtime(),
            981_173_106,
            "fstat of the writer"
        );
        drop(held);
        assert_file_is(&env.share("f"), b"new bytes, cached", "after the close");
        assert_eq!(
            mtime_of(&env.share("f")),
            981_173_106,
            "server mtime after close"
        );
        assert_eq!(mtime_of(&m), 981_173_106, "mount mtime after close");
        assert_clean_unmount(mount);
    }
);

mount_test!(ops_fallocate, |env| {
    if skip_without_tool("ops_fallocate", "fallocate") {
        return;
    }
    let mount = mount_rw(&env);
    run_ok(
        Command::new("fallocate")
            .args(["-l", "1M"])
            .arg(mount.join("fa")),
        "fallocate -l 1M",
    );
    assert_eq!(
        fs::metadata(env.share("fa")).unwrap().len(),
        MIB,
        "the server's file is 1 MiB"
    );
    assert_eq!(fs::metadata(mount.join("fa")).unwrap().len(), MIB);
    assert_file_is(&env.share("fa"), &vec![0u8; MIB as usize], "fa is zeros");
    assert_clean_unmount(mount);
});

mount_test!(the_mount_root_takes_times_and_modes, |env| {
    // `tar x` and `cp -a` into a mount's root set its times and mode last.
    let mount = mount_rw(&env);
    run_ok(
        Command::new("touch")
            .args(["-d", "2011-03-04 05:06:07"])
            .arg(mount.path()),
        "touch -d of the mount root",
    );
    run_ok(
        Command::new("chmod").arg("0750").arg(mount.path()),
        "chmod of the mount root",
    );
    let root = fs::metadata(env.share("")).unwrap();
    assert_eq!(root.mtime(), 1_299_215_167, "the share root's mtime");
    assert_eq!(root.mode() & 0o7777, 0o750, "the share root's mode");
    assert_clean_unmount(mount);
});

/// Total and available bytes of the file system holding `path`.
fn space(path: &Path) -> (u64, u64) {
    let st = nix::sys::statvfs::statvfs(path)
        .unwrap_or_else(|e| panic!("statvfs {}: {e}", path.display()));
    let unit = st.fragment_size() as u64;
    (
        st.blocks() as u64 * unit,
        st.blocks_available() as u64 * unit,
    )
}

#[test]
fn statvfs_of_the_mount_matches_the_share() {
    if skip_without_fuse("statvfs_of_the_mount_matches_the_share") {
        return;
    }
    // A share on a tmpfs of its own: its numbers change only with this test's writes.
    let on_tmpfs = Tmpfs::available().is_ok();
    let env = if on_tmpfs {
        Env::builder().tmpfs(DEFAULT_SHARE, 64 * MIB).start()
    } else {
        eprintln!("statvfs_of_the_mount_matches_the_share: no tmpfs; comparing with /tmp's file system loosely");
        Env::new()
    };
    let mount = mount_rw(&env);
    let (total, _) = space(&env.share(""));
    // Other tests write to /tmp while this runs: a looser check there.
    let tolerance = if on_tmpfs { MIB } else { total / 20 };
    let close_enough = |what: &str| {
        let (mt, ma) = space(mount.path());
        let (st, sa) = space(&env.share(""));
        let ok = mt.abs_diff(st) <= st / 100 && ma.abs_diff(sa) <= tolerance;
        if !ok {
            eprintln!("{what}: mount says total {mt} avail {ma}; share says total {st} avail {sa}");
        }
        ok
    };
    assert!(
        eventually(Duration::from_secs(3), || close_enough("at first")),
        "statvfs of the mount must match the share's file system (see above)"
    );
    if on_tmpfs {
        write_random_file(&env.share("fill.bin"), 16 * MIB, 1);
        assert!(
            eventually(Duration::from_secs(5), || close_enough(
                "after 16 MiB written"
            )),
            "the mount's free space must follow the share's (see above)"
        );
    }
    let df = run_ok(Command::new("df").arg("-P").arg(mount.path()), "df");
    assert!(
        df.stdout.contains(&*mount.path().to_string_lossy()),
        "df shows the mount\n{df}"
    );
    assert_clean_unmount(mount);
}

// ---------------------------------------------------------------- semantics

mount_test!(close_to_open_across_mounts_and_rcp, |env| {
    let writer = mount_rw(&env);
    let reader = mount_reader(&env);
    assert_fails(
        fs::metadata(reader.join("n.bin")),
        &[ENOENT],
        "n.bin before it is written",
    );

    // A new file, written and closed on one mount.
    let mut data = random_bytes(MIB as usize + 3, 121);
    let file = File::create(writer.join("n.bin")).unwrap();
    pwrite(&file, &data, 0).unwrap();
    close(file).unwrap_or_else(|e| panic!("close n.bin: {e}"));
    assert_file_is(
        &env.share("n.bin"),
        &data,
        "new file on the server after close",
    );
    assert_file_is(&reader.join("n.bin"), &data, "new file on the second mount");
    let back = env.local("n.rcp");
    env.rcp(rcp_args![env.remote("n.bin"), back])
        .assert_success();
    assert_file_is(&back, &data, "new file downloaded by rcp");

    // An in-place change of the same size (only the mtime and the bytes change).
    let patch = random_bytes(5000, 122);
    let file = OpenOptions::new()
        .write(true)
        .open(writer.join("n.bin"))
        .unwrap();
    pwrite(&file, &patch, 300_000).unwrap();
    close(file).unwrap_or_else(|e| panic!("close n.bin after the in-place write: {e}"));
    data[300_000..305_000].copy_from_slice(&patch);
    assert_file_is(&env.share("n.bin"), &data, "in-place change on the server");
    assert_file_is(
        &reader.join("n.bin"),
        &data,
        "in-place change on the second mount",
    );
    let back = env.local("n2.rcp");
    env.rcp(rcp_args![env.remote("n.bin"), back])
        .assert_success();
    assert_file_is(&back, &data, "in-place change downloaded by rcp");

    // fsync without close: on the server and visible before the writer closes.
    let patch = random_bytes(70_000, 123);
    let file = OpenOptions::new()
        .write(true)
        .open(writer.join("n.bin"))
        .unwrap();
    pwrite(&file, &patch, 1_000_000).unwrap();
    file.sync_all().unwrap_or_else(|e| panic!("fsync: {e}"));
    data.resize(1_070_000.max(data.len()), 0);
    data[1_000_000..1_070_000].copy_from_slice(&patch);
    assert_file_is(
        &env.share("n.bin"),
        &data,
        "after fsync, before close: the server",
    );
    assert_file_is(
        &reader.join("n.bin"),
        &data,
        "after fsync, before close: second mount",
    );
    close(file).unwrap();
    assert_no_temp_files(&env.share(""));
    drop(reader);
    assert_clean_unmount(writer);
});

mount_test!(a_new_file_appears_only_at_fsync_or_close, |env| {
    let writer = mount_rw(&env);
    let reader = mount_reader(&env);
    let part1 = random_bytes(MIB as usize, 131);
    let part2 = random_bytes(MIB as usize / 2 + 9, 132);
    let file = File::create(writer.join("new.bin")).unwrap();
    pwrite(&file, &part1, 0).unwrap();
    assert!(
        !env.share("new.bin").exists(),
        "before fsync or close there is no file under the final name on the server"
    );
    assert_fails(
        fs::metadata(reader.join("new.bin")),
        &[ENOENT],
        "new.bin on another mount before fsync or close",
    );
    file.sync_all().unwrap_or_else(|e| panic!("fsync: {e}"));
    assert_file_is(&env.share("new.bin"), &part1, "after fsync, on the server");
    assert_file_is(
        &reader.join("new.bin"),
        &part1,
        "after fsync, on another mount",
    );
    pwrite(&file, &part2, part1.len() as u64).unwrap();
    close(file).unwrap_or_else(|e| panic!("close: {e}"));
    let whole = [part1, part2].concat();
    assert_file_is(&env.share("new.bin"), &whole, "after close, on the server");
    assert_file_is(
        &reader.join("new.bin"),
        &whole,
        "after close, on another mount",
    );
    assert_no_temp_files(&env.share(""));
    drop(reader);
    assert_clean_unmount(writer);
});

mount_test!(
    times_and_modes_set_on_a_new_file_reach_the_server_with_its_name,
    |env| {
        // What `tar x` does for each file: create, write, futimens (and fchmod) through
        // the descriptor, close. A new file is invisible until it takes its name, so
        // the mount sends those attributes with the close (`FileFinish`); they must be
        // exactly what the server's file ends with, and what the mount shows before.
        let writer = mount_rw(&env);
        let reader = mount_reader(&env);
        let set = std::time::UNIX_EPOCH + Duration::new(1_000_000_000, 0);
        let bytes = random_bytes(100_000, 151);
        let file = File::create(writer.join("timed.bin")).unwrap();
        pwrite(&file, &bytes, 0).unwrap();
        file.set_times(fs::FileTimes::new().set_modified(set).set_accessed(set))
            .unwrap();
        file.set_permissions(fs::Permissions::from_mode(0o604))
            .unwrap();
        let shown = file.metadata().unwrap();
        assert_eq!(shown.mtime(), 1_000_000_000, "the mount shows the time set");
        assert_eq!(shown.mode() & 0o7777, 0o604, "the mount shows the mode set");
        assert!(!env.share("timed.bin").exists(), "named before close");
        close(file).unwrap_or_else(|e| panic!("close: {e}"));
        assert_file_is(
            &env.share("timed.bin"),
            &bytes,
            "after close, on the server",
        );
        assert_eq!(mtime_of(&env.share("timed.bin")), 1_000_000_000);
        assert_eq!(mode_of(&env.share("timed.bin")), 0o604);
        assert_eq!(mtime_of(&reader.join("timed.bin")), 1_000_000_000);

        // A write after the time was set makes the mtime now, as on a local disk.
        let before = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        let file = File::create(writer.join("rewritten.bin")).unwrap();
        pwrite(&file, &bytes, 0).unwrap();
        file.set_times(fs::FileTimes::new().set_modified(set))
            .unwrap();
        pwrite(&file, b"more", bytes.len() as u64).unwrap();
        close(file).unwrap_or_else(|e| panic!("close: {e}"));
        let mtime = mtime_of(&env.share("rewritten.bin"));
        assert!(
            mtime >= before - 1,
            "mtime {mtime} is older than the last write ({before})"
        );

        // fsync sends them too, before the data is made durable.
        let file = File::create(writer.join("synced.bin")).unwrap();
        pwrite(&file, &bytes, 0).unwrap();
        file.set_times(fs::FileTimes::new().set_modified(set))
            .unwrap();
        file.sync_all().unwrap();
        assert_eq!(mtime_of(&env.share("synced.bin")), 1_000_000_000);
        close(file).unwrap_or_else(|e| panic!("close: {e}"));
        assert_eq!(mtime_of(&env.share("synced.bin")), 1_000_000_000);
        assert_no_temp_files(&env.share(""));
        drop(reader);
        assert_clean_unmount(writer);
    }
);

mount_test!(
    an_exclusive_create_that_loses_a_race_fails_at_close_and_clobbers_nothing,
    |env| {
        // A file created O_EXCL is not opened on the server before its close (nobody
        // can see it until then). In a directory this mount just made, names are
        // answered missing without asking the server for `negative_timeout`, so
        // another client can take the name meanwhile: the close must fail with EEXIST
        // and leave the other file as it was.
        let writer = Mount::builder(env.remote(""))
            .opt("negative_timeout=30")
            .start();
        fs::create_dir(writer.join("fresh")).unwrap();
        fs::write(env.share("fresh/x"), b"the other client's").unwrap();
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(writer.join("fresh/x"))
            .unwrap_or_else(|e| panic!("the create is answered by the mount: {e}"));
        pwrite(&file, b"mine", 0).unwrap();
        let closed = close(file);
        assert_fails(closed, &[EEXIST], "close of a create that lost the race");
        assert_file_is(
            &env.share("fresh/x"),
            b"the other client's",
            "the other file",
        );
        assert_no_temp_files(&env.share(""));
        // The mount goes on: a name nobody took is created as usual.
        fs::write(writer.join("fresh/y"), b"y").unwrap();
        assert_file_is(&env.share("fresh/y"), b"y", "a later create");
        assert_clean_unmount(writer);
    }
);

mount_test!(
    a_close_while_a_dup_stays_open_does_not_name_the_file_the_last_close_does,
    |env| {
        // `cmd > file`: the shell opens the file, dup2s it onto 1 and closes the
        // first descriptor before the command writes a byte. That close must not
        // name the file (an empty one, then written in place for all to see).
        let old = random_bytes(300_000, 151);
        fs::write(env.share("dup.bin"), &old).unwrap();
        let writer = mount_rw(&env);
        let reader = mount_reader(&env);
        let first = OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(writer.join("dup.bin"))
            .unwrap();
        let second = first.try_clone().unwrap();
        close(first).unwrap_or_else(|e| panic!("close of the first descriptor: {e}"));
        assert_file_is(
            &env.share("dup.bin"),
            &old,
            "closed, a dup still open: the server keeps the old content",
        );
        let new = random_bytes(2 * MIB as usize + 7, 152);
        pwrite(&second, &new, 0).unwrap();
        assert_file_is(
            &reader.join("dup.bin"),
            &old,
            "written through the dup: another mount sees the old",
        );
        close(second).unwrap_or_else(|e| panic!("close of the dup: {e}"));
        assert_file_is(
            &env.share("dup.bin"),
            &new,
            "after the last close, on the server",
        );
        assert_file_is(
            &reader.join("dup.bin"),
            &new,
            "after the last close, on another mount",
        );
        // A new file written by a shell's redirection (`exec >`, then a pipeline
        // whose children write and close it too): absent until the shell is done
        // with it, then whole.
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("go");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let script = r#"exec > "$2"; read -r _ < "$1"; head -c 3000000 /dev/zero | tr '\0' x"#;
        let mut child = Command::new("sh")
            .args(["-c", script, "sh"])
            .arg(&fifo)
            .arg(writer.join("redirected.txt"))
            .spawn()
            .unwrap();
        // Opening the FIFO waits for the shell's `read`, which is after its `exec >`.
        let mut go = within(Duration::from_secs(30), "the shell's read", {
            let fifo = fifo.clone();
            move || OpenOptions::new().write(true).open(fifo)
        })
        .unwrap();
        assert!(
            !env.share("redirected.txt").exists(),
            "`exec >` named the file at its first close"
        );
        go.write_all(b"go\n").unwrap();
        drop(go);
        assert!(child.wait().unwrap().success());
        assert_file_is(
            &env.share("redirected.txt"),
            &vec![b'x'; 3_000_000],
            "the redirected output, after the shell",
        );
        assert_no_temp_files(&env.share(""));
        drop(reader);
        assert_clean_unmount(writer);
    }
);

mount_test!(
    a_streamed_new_file_patched_before_close_lands_whole,
    |env| {
        // Big sequential writes to a staged file go to the server's disk direct, the
        // small unaligned patches after them through its page cache: the file must
        // hold every write in order.
        let writer = mount_rw(&env);
        let mut want = random_bytes(24 * MIB as usize + 1234, 161);
        let file = File::create(writer.join("streamed.bin")).unwrap();
        for piece in want.chunks(MIB as usize) {
            (&file).write_all(piece).unwrap();
        }
        for (i, at) in [100usize, 5 * MIB as usize - 3, 20 * MIB as usize + 4095]
            .into_iter()
            .enumerate()
        {
            let patch = random_bytes(5000, 162 + i as u64);
            pwrite(&file, &patch, at as u64).unwrap();
            want[at..at + patch.len()].copy_from_slice(&patch);
        }
        close(file).unwrap_or_else(|e| panic!("close: {e}"));
        assert_file_is(
            &env.share("streamed.bin"),
            &want,
            "on the server, after close",
        );
        assert_file_is(&writer.join("streamed.bin"), &want, "through the mount");
        assert_no_temp_files(&env.share(""));
        assert_clean_unmount(writer);
    }
);

mount_test!(
    a_truncated_file_keeps_its_old_content_until_fsync_or_close,
    |env| {
        let old = random_bytes(MIB as usize + 100, 141);
        fs::write(env.share("t.bin"), &old).unwrap();
        let writer = mount_rw(&env);
        let reader = mount_reader(&env);
        assert_file_is(&reader.join("t.bin"), &old, "the reader's first read");
        let part1 = random_bytes(300_000, 142);
        let part2 = random_bytes(200_001, 143);
        let file = OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(writer.join("t.bin"))
            .unwrap();
        assert_file_is(
            &env.share("t.bin"),
            &old,
            "open(O_TRUNC): the server keeps the old content",
        );
        assert_file_is(
            &reader.join("t.bin"),
            &old,
            "open(O_TRUNC): another mount sees the old",
        );
        pwrite(&file, &part1, 0).unwrap();
        assert_file_is(
            &env.share("t.bin"),
            &old,
            "written, not synced: the server keeps the old",
        );
        assert_file_is(
            &reader.join("t.bin"),
            &old,
            "written, not synced: another mount sees the old",
        );
        file.sync_all().unwrap_or_else(|e| panic!("fsync: {e}"));
        assert_file_is(&env.share("t.bin"), &part1, "after fsync, on the server");
        assert_file_is(
            &reader.join("t.bin"),
            &part1,
            "after fsync, on another mount",
        );
        pwrite(&file, &part2, part1.len() as u64).unwrap();
        close(file).unwrap_or_else(|e| panic!("close: {e}"));
        let whole = [part1, part2].concat();
        assert_file_is(&env.share("t.bin"), &whole, "after close, on the server");
        assert_file_is(
            &reader.join("t.bin"),
            &whole,
            "after close, on another mount",
        );
        assert_no_temp_files(&env.share(""));
        drop(reader);
        assert_clean_unmount(writer);
    }
);

mount_test!(in_place_writes_are_on_disk_after_fsync, |env| {
    let mut data = random_bytes(2 * MIB as usize + 5, 151);
    fs::write(env.share("p.bin"), &data).unwrap();
    let mount = mount_rw(&env);
    let file = OpenOptions::new()
        .write(true)
        .open(mount.join("p.bin"))
        .unwrap();
    for (i, offset) in [0usize, 16_383, MIB as usize - 7, 2 * MIB as usize]
        .into_iter()
        .enumerate()
    {
        let patch = random_bytes(9_000, 152 + i as u64);
        pwrite(&file, &patch, offset as u64).unwrap();
        let end = offset + patch.len();
        if end > data.len() {
            data.resize(end, 0);
        }
        data[offset..end].copy_from_slice(&patch);
    }
    file.sync_all().unwrap_or_else(|e| panic!("fsync: {e}"));
    assert_file_is(
        &env.share("p.bin"),
        &data,
        "in-place writes on the server after fsync",
    );
    close(file).unwrap();
    assert_file_is(&env.share("p.bin"), &data, "after close");
    assert_clean_unmount(mount);
});

mount_test!(own_writes_are_read_back_at_once_through_any_fd, |env| {
    let mut data = random_bytes(2 * MIB as usize, 161);
    fs::write(env.share("f.bin"), &data).unwrap();
    let mount = mount_rw(&env);
    // Everything cached first, so a stale cache would show.
    assert_file_is(&mount.join("f.bin"), &data, "the first read");
    let rw = OpenOptions::new()
        .read(true)
        .write(true)
        .open(mount.join("f.bin"))
        .unwrap();
    let ro = File::open(mount.join("f.bin")).unwrap();
    let _ = pread(&ro, 0, data.len()).unwrap();

    let patch = random_bytes(40_000, 162);
    let at = MIB as usize - 20_000; // across the 1 MiB boundary
    pwrite(&rw, &patch, at as u64).unwrap();
    data[at..at + patch.len()].copy_from_slice(&patch);
    assert_same_bytes(
        &patch,
        &pread(&rw, at as u64, patch.len()).unwrap(),
        "same fd",
    );
    assert_same_bytes(
        &data,
        &pread(&ro, 0, data.len() + 1).unwrap(),
        "another open fd",
    );
    assert_file_is(&mount.join("f.bin"), &data, "a new open");

    // Grown past the end, then shrunk: sizes follow at once.
    let tail = random_bytes(5000, 163);
    pwrite(&rw, &tail, data.len() as u64 + 1000).unwrap();
    data.resize(data.len() + 1000, 0);
    data.extend_from_slice(&tail);
    assert_eq!(
        fs::metadata(mount.join("f.bin")).unwrap().len(),
        data.len() as u64
    );
    assert_same_bytes(
        &data,
        &pread(&ro, 0, data.len() + 1).unwrap(),
        "after growing",
    );
    rw.set_len(100_000).unwrap();
    data.truncate(100_000);
    assert_eq!(
        ro.metadata().unwrap().len(),
        100_000,
        "fstat of another fd after ftruncate"
    );
    assert_same_bytes(&data, &pread(&ro, 0, 200_000).unwrap(), "after shrinking");
    close(rw).unwrap_or_else(|e| panic!("close: {e}"));
    drop(ro);
    assert_file_is(&env.share("f.bin"), &data, "on the server after close");

    // A new file, not yet closed: the same mount sees it whole, by size and content.
    let g = random_bytes(300_007, 164);
    let file = File::create(mount.join("g.bin")).unwrap();
    pwrite(&file, &g, 0).unwrap();
    assert_eq!(
        fs::metadata(mount.join("g.bin")).unwrap().len(),
        g.len() as u64
    );
    assert_file_is(
        &mount.join("g.bin"),
        &g,
        "an unclosed new file, opened again",
    );
    close(file).unwrap();
    assert_file_is(&env.share("g.bin"), &g, "g.bin on the server after close");
    assert_clean_unmount(mount);
});

/// Rewrites a file with O_TRUNC in `PIECES` writes, pausing `PAUSE` seconds after each:
/// `PATH SRC PIECES PAUSE`.
const SLOW_REWRITE: &str = r#"
import sys, time
path, src, pieces, pause = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
data = open(src, "rb").read()
step = (len(data) + pieces - 1) // pieces
with open(path, "wb") as f:
    for i in range(0, len(data), step):
        f.write(data[i:i + step])
        f.flush()
        time.sleep(pause)
"#;

mount_test!(
    a_reader_on_another_mount_sees_old_or_new_never_a_mix,
    |env| {
        if skip_without_tool(
            "a_reader_on_another_mount_sees_old_or_new_never_a_mix",
            "python3",
        ) {
            return;
        }
        let size = scaled(8 * MIB, 3 * MIB) as usize;
        let old = Arc::new(random_bytes(size, 171));
        let new = Arc::new(random_bytes(size - 4096 + 17, 172));
        fs::write(env.share("v.bin"), &*old).unwrap();
        fs::write(env.local("new"), &*new).unwrap();
        let writer = mount_rw(&env);
        let reader = mount_reader(&env);
        let stop = Arc::new(AtomicBool::new(false));
        let on_mount =
            spawn_whole_file_checker(reader.join("v.bin"), old.clone(), new.clone(), stop.clone());
        let on_disk =
            spawn_whole_file_checker(env.share("v.bin"), old.clone(), new.clone(), stop.clone());
        let out = run_tool(
            &mut python(
                SLOW_REWRITE,
                [
                    writer.join("v.bin").as_os_str(),
                    env.local("new").as_os_str(),
                    "8".as_ref(),
                    "0.1".as_ref(),
                ],
            ),
            tool_limit(),
        );
        stop.store(true, Ordering::SeqCst);
        let (mo, mn) = join_checker(on_mount, "a reader on the second mount");
        let (d_old, d_new) = join_checker(on_disk, "a reader of the server's disk");
        out.assert_success("the O_TRUNC rewrite");
        eprintln!(
            "second mount: {mo} old, {mn} new reads; server's disk: {d_old} old, {d_new} new reads"
        );
        assert!(
            mn >= 1 && d_new >= 1,
            "the last reads must see the new content"
        );
        assert_no_temp_files(&env.share(""));
        drop(reader);
        assert_clean_unmount(writer);
    }
);

// ---------------------------------------------------------------- failures

/// The per-round-trip timeout of the failure tests, and the slack on top of it.
const OP_TIMEOUT_SECS: u64 = 5;
const OP_SLACK: Duration = Duration::from_secs(10);

#[test]
fn ferryd_killed_with_dirty_data_fails_the_writer_then_a_restart_works() {
    if skip_without_fuse("ferryd_killed_with_dirty_data_fails_the_writer_then_a_restart_works") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let share = dir.path().canonicalize().unwrap();
    let shares = [Share::rw("data", &share)];
    let server = Server::start(&shares);
    let addr = server.addr().to_owned();
    let mount = Mount::builder(server.remote("data", ""))
        .opt(&format!("timeout={OP_TIMEOUT_SECS}"))
        .start();
    fs::write(mount.join("before.txt"), b"before").unwrap();
    assert_file_is(
        &share.join("before.txt"),
        b"before",
        "a write before the kill",
    );

    let chunk = random_bytes(MIB as usize, 181);
    let mut file = File::create(mount.join("dirty.bin")).unwrap();
    file.write_all(&chunk).unwrap();
    server.kill();

    let start = Instant::now();
    let failed = within(
        Duration::from_secs(OP_TIMEOUT_SECS) + OP_SLACK,
        "write, fsync and close after ferryd was killed",
        move || {
            let mut failed = None;
            for _ in 0..4 {
                if let Err(e) = file.write_all(&chunk) {
                    failed = Some(format!("write: {e}"));
                    break;
                }
            }
            if failed.is_none() {
                if let Err(e) = file.sync_all() {
                    failed = Some(format!("fsync: {e}"));
                }
            }
            let closed = close(file);
            match (failed, closed) {
                (Some(f), _) => Some(f),
                (None, Err(e)) => Some(format!("close: {e}")),
                (None, Ok(())) => None,
            }
        },
    );
    match failed {
        Some(how) => eprintln!("the writer failed after {:?}: {how}", start.elapsed()),
        None => panic!(
            "write, fsync and close all succeeded although ferryd was SIGKILLed with dirty \
             data: the data was dropped silently"
        ),
    }
    assert!(
        !share.join("dirty.bin").exists(),
        "a half-written dirty.bin appeared under its final name"
    );

    // ferryd back on the same port and share: the same mount works again.
    let _restarted = Server::start_with(
        &shares,
        ServerOptions {
            listen: Some(addr),
            ..ServerOptions::default()
        },
    );
    let expected = random_bytes(200_003, 182);
    let start = Instant::now();
    let mut last_error = None;
    let mut worked = false;
    while start.elapsed() < Duration::from_secs(scaled(12, 40)) {
        let (p, data) = (mount.join("after.bin"), expected.clone());
        let result = within(
            Duration::from_secs(OP_TIMEOUT_SECS) + OP_SLACK,
            "a write and a read after the restart",
            move || fs::write(&p, &data).and_then(|()| fs::read(&p)),
        );
        match result {
            Ok(got) => {
                assert_same_bytes(&expected, &got, "after.bin read back after the restart");
                worked = true;
                break;
            }
            Err(e) => last_error = Some(e),
        }
        thread::sleep(Duration::from_millis(250));
    }
    assert!(
        worked,
        "the mount did not work again within {:?} of ferryd's restart on the same port; \
         last error: {last_error:?}",
        start.elapsed()
    );
    assert_file_is(
        &share.join("after.bin"),
        &expected,
        "after.bin on the server",
    );
    assert!(
        !share.join("dirty.bin").exists(),
        "dirty.bin appeared under its final name after the restart"
    );
    assert_clean_unmount(mount);
}

mount_test!(
    ferry_mount_killed_mid_write_leaves_no_file_and_no_temp,
    |env| {
        let mount = mount_rw(&env);
        fs::write(env.share("other.txt"), b"other").unwrap();
        let file = File::create(mount.join("staged.bin")).unwrap();
        let data = random_bytes(2 * MIB as usize, 191);
        pwrite(&file, &data, 0).unwrap();
        assert!(
            !env.share("staged.bin").exists(),
            "staged.bin is on the server before fsync or close"
        );
        assert!(
            send_signal(mount.pid(), "KILL"),
            "cannot SIGKILL ferry-mount"
        );
        assert!(
            mount.wait_for_exit(Duration::from_secs(5)).is_some(),
            "ferry-mount did not die from SIGKILL"
        );
        drop(file); // closing on a dead mount fails; nothing to check there
        let limit = Duration::from_secs(scaled(10, 30));
        let clean = eventually(limit, || {
            !env.share("staged.bin").exists() && temp_files(&env.share("")).is_empty()
        });
        assert!(
            clean,
            "{limit:?} after ferry-mount was killed: staged.bin exists on the server: {}; \
         temp files left: {:?}",
            env.share("staged.bin").exists(),
            temp_files(&env.share(""))
        );
        assert_file_is(
            &env.share("other.txt"),
            b"other",
            "other files are untouched",
        );
        env.server().assert_running();
        drop(mount); // lazily unmounts the dead mount
    }
);

#[test]
fn a_full_share_fails_with_enospc_and_leaves_nothing_half_written() {
    let test = "a_full_share_fails_with_enospc_and_leaves_nothing_half_written";
    if skip_without_fuse(test) {
        return;
    }
    if let Err(why) = Tmpfs::available() {
        eprintln!("{test}: skipped: {why}");
        return;
    }
    let env = Env::builder().tmpfs(DEFAULT_SHARE, 8 * MIB).start();
    let keep = random_bytes(MIB as usize, 201);
    fs::write(env.share("keep.bin"), &keep).unwrap();
    fs::write(env.share("note.txt"), b"note").unwrap();
    let keep_mtime = mtime_of(&env.share("keep.bin"));
    let free = env.tmpfs(DEFAULT_SHARE).free_bytes();
    let mount = mount_rw(&env);
    let chunk = random_bytes(MIB as usize, 202);

    let path = mount.join("big.bin");
    let (errno, how) = within(
        Duration::from_secs(scaled(20, 60)),
        "writing more than fits",
        move || {
            let mut file = File::create(&path).unwrap_or_else(|e| panic!("create big.bin: {e}"));
            let mut failed = None;
            for _ in 0..16 {
                if let Err(e) = file.write_all(&chunk) {
                    failed = Some((e.raw_os_error(), format!("write: {e}")));
                    break;
                }
            }
            if failed.is_none() {
                if let Err(e) = file.sync_all() {
                    failed = Some((e.raw_os_error(), format!("fsync: {e}")));
                }
            }
            let closed = close(file);
            match (failed, closed) {
                (Some(f), _) => f,
                (None, Err(e)) => (e.raw_os_error(), format!("close: {e}")),
                (None, Ok(())) => (None, "nothing failed".to_owned()),
            }
        },
    );
    assert_eq!(
        errno,
        Some(ENOSPC),
        "16 MiB written to an 8 MiB share: write, fsync or close must fail with ENOSPC; \
         got {how}"
    );
    assert!(
        !env.share("big.bin").exists(),
        "a partial big.bin is on the server under its final name"
    );
    assert_file_is(&env.share("keep.bin"), &keep, "keep.bin is untouched");
    assert_eq!(
        mtime_of(&env.share("keep.bin")),
        keep_mtime,
        "keep.bin's mtime"
    );
    assert_file_is(&env.share("note.txt"), b"note", "note.txt is untouched");
    assert!(
        eventually(Duration::from_secs(5), || temp_files(&env.share(""))
            .is_empty()),
        "the failed write's staged data is left in the share (it keeps the disk full): {:?}",
        temp_files(&env.share(""))
    );
    // Its space comes back once the writes still in flight when it failed have
    // landed (each fails, and the last one gone closes the unlinked file).
    assert!(
        eventually(Duration::from_secs(5), || env
            .tmpfs(DEFAULT_SHARE)
            .free_bytes()
            >= free),
        "the failed write still holds space: {} bytes free, {free} before it",
        env.tmpfs(DEFAULT_SHARE).free_bytes()
    );
    // The mount still works once there is room.
    fs::write(mount.join("after.txt"), b"after")
        .unwrap_or_else(|e| panic!("a small write after the ENOSPC failed: {e}"));
    assert_file_is(&env.share("after.txt"), b"after", "after.txt on the server");
    assert_clean_unmount(mount);
}

// ---------------------------------------------------------------- one-sided data

mount_test!(written_bytes_are_pulled_one_sided, |env| {
    let n = scaled(16 * MIB, 4 * MIB);
    let mount = mount_rw(&env);
    let rt = ferry_tests::runtime();
    let client = rt
        .block_on(ferry_tests::connect(env.server(), test_choice()))
        .expect("connect a counters client");
    let before = rt.block_on(client.counters()).expect("counters before");
    let data = random_bytes(n as usize, 211);
    let file = File::create(mount.join("w.bin")).unwrap();
    for (i, piece) in data.chunks(256 << 10).enumerate() {
        pwrite(&file, piece, (i * (256 << 10)) as u64).unwrap();
    }
    close(file).unwrap_or_else(|e| panic!("close: {e}"));
    let after = rt.block_on(client.counters()).expect("counters after");
    assert_file_is(&env.share("w.bin"), &data, "w.bin on the server");
    let written = after
        .file_written_bytes
        .saturating_sub(before.file_written_bytes);
    let pulled = after.read_bytes.saturating_sub(before.read_bytes);
    let ctrl = (after.ctrl_received_bytes + after.ctrl_sent_bytes)
        .saturating_sub(before.ctrl_received_bytes + before.ctrl_sent_bytes);
    let report = format!(
        "{n} bytes written through the mount: file_written_bytes +{written}, read_bytes \
         +{pulled}, control bytes +{ctrl}; before {before:?}, after {after:?}"
    );
    eprintln!("{report}");
    assert!(
        written >= n && written <= n + n / 2,
        "the server wrote about {n} bytes to disk: {report}"
    );
    assert!(
        pulled >= n,
        "the server pulled the data with one-sided READs: {report}"
    );
    assert!(
        ctrl < n / 10,
        "control messages carried far less than the data: {report}"
    );
    drop(client);
    assert_clean_unmount(mount);
});

// A name the mount cannot carry (its path from the share's root is longer than the
// protocol's MAX_PATH_BYTES, though each system call's own path is short: it is made
// through /proc/self/fd/N of an open directory) fails that call alone with
// ENAMETOOLONG: the request is never sent, so the server does not take it for a broken
// session, and every other request goes on. Before, the server closed the connection
// and the mount's other callers got ENOTCONN.
mount_test!(a_path_longer_than_the_protocol_carries_fails_alone, |env| {
    use std::os::fd::AsRawFd;

    let mount = mount_rw(&env);
    let component = "d".repeat(250);
    let within =
        |dir: &File, name: &str| PathBuf::from(format!("/proc/self/fd/{}/{name}", dir.as_raw_fd()));
    // 16 directories of 250 bytes: 16 * 251 = 4016 bytes from the share's root.
    let mut dir = File::open(mount.path()).unwrap();
    let mut made = 0;
    while (made + 1) * 251 <= 4096 {
        let next = within(&dir, &component);
        fs::create_dir(&next).unwrap_or_else(|e| panic!("mkdir at depth {made}: {e}"));
        dir = File::open(&next).unwrap();
        made += 1;
    }
    let too_long = within(&dir, &component);
    let name_too_long = [nix::libc::ENAMETOOLONG];
    assert_fails(
        fs::create_dir(&too_long),
        &name_too_long,
        "mkdir past the limit",
    );
    assert_fails(
        File::create(&too_long),
        &name_too_long,
        "create past the limit",
    );
    // Nothing can exist there: a lookup may answer ENOENT.
    let absent = [nix::libc::ENAMETOOLONG, nix::libc::ENOENT];
    assert_fails(
        fs::symlink_metadata(&too_long),
        &absent,
        "stat past the limit",
    );
    // The same session goes on: a file made at the deepest level that fits, and one at
    // the top, each read back.
    fs::write(within(&dir, "f"), b"still here").unwrap();
    assert_file_is(
        &within(&dir, "f"),
        b"still here",
        "file beside the refused name",
    );
    fs::write(mount.path().join("top"), b"top").unwrap();
    assert_file_is(
        &env.share_dir(DEFAULT_SHARE).join("top"),
        b"top",
        "top file on the server",
    );
    let lost = mount.log_lines_with(&["lost"]);
    assert!(lost.is_empty(), "the mount lost its connection: {lost:?}");
});
