//! Data at rest is checked with the hashes recorded when it was written (issue 22).
//!
//! A file is uploaded with `rcp` (ferryd records its chunk hashes at commit), then one
//! byte of it is damaged on the block device under a loop-mounted ext4, leaving its
//! inode, size, mtime and ctime as they were, as bit rot does. Every reader must now
//! fail on that chunk, naming the file, rather than get the damaged bytes: ferryd
//! sends the recorded hashes, never hashes of what it reads now. A per-file download
//! and a batch fail with rcp's integrity exit code and ferryd logs the damage; a read
//! through ferry-mount fails with EIO (the mount's small chunks are checked against
//! the record by ferryd as it hashes them, which logs the damage). Each case runs with
//! both hash algorithms, and with a reader that asks for the other algorithm than the
//! record's (`--hash`): ferryd then checks what it reads against the record itself.
//! The sources are written just before their upload, as a user's are: the record must
//! not wait for the file to age.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use ferry_common::msg::HashAlgorithm;
use ferry_tests::{
    assert_files_equal, rcp, set_mtime, write_random_file, LoopExt4, Mount, Server, Share, MIB,
};

/// rcp's exit code for an integrity error.
const INTEGRITY: i32 = 6;

/// A ferryd serving `data` from a fresh loop-mounted ext4, and a local directory.
struct Rig {
    server: Server,
    fs: LoopExt4,
    local: tempfile::TempDir,
}

/// The rig, or `None` (printed) where this machine cannot make a loop device.
fn rig() -> Option<Rig> {
    let local = tempfile::tempdir().unwrap();
    let fs = match LoopExt4::mount(&local.path().join("share"), 64) {
        Ok(fs) => fs,
        Err(e) => {
            // Root and e2fsprogs are what the suite's setup provides; anywhere else
            // say why this check did not run.
            eprintln!("skipped: cannot make a loop-mounted ext4: {e}");
            return None;
        }
    };
    let server = Server::start(&[Share::rw("data", fs.path())]);
    Some(Rig { server, fs, local })
}

impl Rig {
    fn local(&self, rel: &str) -> std::path::PathBuf {
        self.local.path().join(rel)
    }

    /// Uploads the local `rel` with `--hash alg` to the share's `rel`.
    fn upload(&self, rel: &str, alg: HashAlgorithm) {
        rcp([
            "--hash".into(),
            alg.name().into(),
            self.local(rel).into_os_string(),
            self.server.remote("data", rel).into(),
        ])
        .assert_success();
        assert_files_equal(&self.local(rel), &self.fs.path().join(rel));
    }

    /// Downloads the share's `rel` with `--json`; asserts that it fails with rcp's
    /// integrity exit code and leaves nothing under its local name. Its JSON summary.
    fn download_fails_on_rot(&self, rel: &str) -> serde_json::Value {
        let back = self.local("back");
        let out = rcp([
            "--json".into(),
            self.server.remote("data", rel).into(),
            back.clone().into_os_string(),
        ]);
        out.assert_code(INTEGRITY);
        assert!(!back.exists(), "{rel}: a damaged file under its final name");
        out.json()
    }

    /// Reads the share's `rel` through a new mount (with `--hash hash`, if given);
    /// asserts that the read fails with EIO and that ferryd logged the damage.
    fn mount_read_fails_on_rot(&self, rel: &str, hash: Option<HashAlgorithm>) {
        let mut mount = Mount::builder(self.server.remote("data", ""));
        for arg in hash_arg(hash) {
            mount = mount.arg(arg);
        }
        let mount = mount.start();
        let err = fs::read(mount.join(rel)).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(nix::libc::EIO), "{rel}: {err}");
        let base = rel.rsplit('/').next().unwrap();
        assert!(self.logged_damage(base) >= 1, "{}", self.server.stderr());
    }

    /// ferryd's log lines naming damage to `rel`.
    fn logged_damage(&self, rel: &str) -> usize {
        self.server
            .stderr()
            .lines()
            .filter(|l| l.contains("integrity error") && l.contains(rel))
            .count()
    }
}

/// A local file of `len` random bytes, written now: ferryd records its upload's hashes
/// at the commit, whose ctime comes after this mtime.
fn source(path: &Path, len: u64, seed: u64) {
    write_random_file(path, len, seed);
}

/// The message of the first error of rcp's `--json` summary.
fn first_error(json: &serde_json::Value) -> String {
    json["errors"][0]["message"].as_str().unwrap().to_string()
}

/// `--hash` for a reader that asks for `alg`, or nothing for rcp's default.
fn hash_arg(alg: Option<HashAlgorithm>) -> Vec<std::ffi::OsString> {
    alg.map(|a| vec!["--hash".into(), a.name().into()])
        .unwrap_or_default()
}

/// Uploads with `alg`, then downloads with `--hash down` (or rcp's default).
fn per_file_download_fails_on_rot(alg: HashAlgorithm, down: Option<HashAlgorithm>) {
    let Some(rig) = rig() else { return };
    source(&rig.local("big.bin"), 3 * MIB + 77, 1);
    rig.upload("big.bin", alg);
    // A clean download first: the record is used and matches.
    let back = rig.local("back.bin");
    rcp([
        rig.server.remote("data", "big.bin").into(),
        back.clone().into_os_string(),
    ])
    .assert_success();
    assert_files_equal(&rig.local("big.bin"), &back);
    fs::remove_file(&back).unwrap();

    // Damage one byte of chunk 1.
    rig.fs.rot(&rig.fs.path().join("big.bin"), MIB + 4242);
    let mut args = hash_arg(down);
    args.extend([
        "--json".into(),
        rig.server.remote("data", "big.bin").into(),
        back.clone().into_os_string(),
    ]);
    let out = rcp(args);
    out.assert_code(INTEGRITY);
    let json = out.json();
    let message = first_error(&json);
    assert!(
        message.contains("big.bin") && message.contains("chunk 1"),
        "{message}"
    );
    assert_eq!(json["errors"][0]["kind"], "integrity", "{json}");
    assert!(!back.exists(), "a damaged file under its final name");
    assert!(rig.logged_damage("big.bin") >= 1, "{}", rig.server.stderr());
}

fn batched_download_fails_on_rot(alg: HashAlgorithm, down: Option<HashAlgorithm>) {
    let Some(rig) = rig() else { return };
    let dir = rig.local("tree");
    fs::create_dir(&dir).unwrap();
    for i in 0..5 {
        source(&dir.join(format!("f{i}")), 10_000 + i, 10 + i);
    }
    set_mtime(&dir, 1_600_000_000);
    rcp([
        "-r".into(),
        "--hash".into(),
        alg.name().into(),
        dir.clone().into_os_string(),
        rig.server.remote("data", "").into(),
    ])
    .assert_success();
    rig.fs.rot(&rig.fs.path().join("tree/f3"), 5000);
    let out_dir = rig.local("out");
    let mut args = hash_arg(down);
    args.extend([
        "-r".into(),
        "--json".into(),
        rig.server.remote("data", "tree").into(),
        out_dir.clone().into_os_string(),
    ]);
    let out = rcp(args);
    out.assert_code(INTEGRITY);
    let json = out.json();
    let errors = json["errors"].as_array().unwrap();
    assert_eq!(errors.len(), 1, "{json}");
    assert!(
        errors[0]["message"].as_str().unwrap().contains("f3"),
        "{json}"
    );
    for i in [0, 1, 2, 4] {
        assert_files_equal(&dir.join(format!("f{i}")), &out_dir.join(format!("f{i}")));
    }
    assert!(
        !out_dir.join("f3").exists(),
        "a damaged file under its final name"
    );
    assert!(rig.logged_damage("f3") >= 1, "{}", rig.server.stderr());
}

/// Uploads with `alg`, then reads through a mount offering only `read`.
fn mount_read_fails_on_rot(alg: HashAlgorithm, read: HashAlgorithm) {
    let Some(rig) = rig() else { return };
    source(&rig.local("m.bin"), 2 * MIB + 5, 3);
    rig.upload("m.bin", alg);
    rig.fs.rot(&rig.fs.path().join("m.bin"), 2 * MIB + 1);
    let mount = Mount::builder(rig.server.remote("data", ""))
        .arg("--hash")
        .arg(read.name())
        .start();
    let err = fs::read(mount.join("m.bin")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(nix::libc::EIO), "{err}");
    // The mount reads in its own small chunks: ferryd checked the bytes against the
    // record (in its chunk size) as it hashed them for the mount, and logged the damage.
    assert!(rig.logged_damage("m.bin") >= 1, "{}", rig.server.stderr());
    // An undamaged file of the same share still reads.
    source(&rig.local("ok.bin"), MIB + 3, 4);
    rig.upload("ok.bin", alg);
    assert_eq!(
        fs::read(mount.join("ok.bin")).unwrap(),
        fs::read(rig.local("ok.bin")).unwrap()
    );
}

/// A file written through a read-write mount, front to back, with its mtime set before
/// its close (`keep_mtime`, as `cp -p`, `tar x` and `rsync -t` do) or not (as `cp`
/// does: the mtime is its last write's, which a kernel without multigrain timestamps
/// takes from the same clock tick as the rename's ctime), is recorded at its commit
/// from the hashes its writes carried: rot after that fails a download and a read
/// through another mount, both algorithms.
fn a_file_written_through_the_mount_is_checked_at_rest(alg: HashAlgorithm, keep_mtime: bool) {
    let Some(rig) = rig() else { return };
    let files = [
        ("w/big.bin", 3 * MIB + 77, MIB + 5),
        ("w/small.txt", 5000, 100),
    ];
    {
        let mount = Mount::builder(rig.server.remote("data", ""))
            .arg("--hash")
            .arg(alg.name())
            .start();
        fs::create_dir(mount.join("w")).unwrap();
        for (i, (name, len, _)) in files.iter().enumerate() {
            source(&rig.local("src"), *len, 40 + i as u64);
            let mut f = fs::File::create(mount.join(name)).unwrap();
            // From a plain `Vec`, not page-aligned: the kernel cuts the direct write
            // into requests that straddle chunks, which may reach the mount in any
            // order (the commit hashes the chunks written in pieces).
            std::io::Write::write_all(&mut f, &fs::read(rig.local("src")).unwrap()).unwrap();
            if keep_mtime {
                let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_600_000_000);
                f.set_modified(t).unwrap();
            }
            drop(f);
            fs::rename(rig.local("src"), rig.local(&format!("src{i}"))).unwrap();
        }
    }
    for (i, (name, _, offset)) in files.iter().enumerate() {
        let original = rig.local(&format!("src{i}"));
        assert_files_equal(&original, &rig.fs.path().join(name));
        rig.fs.rot(&rig.fs.path().join(name), *offset);
        rig.download_fails_on_rot(name);
        rig.mount_read_fails_on_rot(name, Some(alg));
    }
}

/// A share's file system mounted again under another device number (a loop image or
/// LVM volume remounted, disks found in another order at boot) keeps its records:
/// rot done while it was unmounted, before ferryd started again, fails a download
/// and a read through the mount, rather than being hashed and recorded as the truth.
#[test]
fn rot_while_unmounted_is_caught_after_a_remount_under_another_device_number() {
    let Some(mut rig) = rig() else { return };
    source(&rig.local("big.bin"), 3 * MIB + 77, 5);
    rig.upload("big.bin", B3);
    source(&rig.local("small.txt"), 5000, 6);
    rig.upload("small.txt", SHA);
    rig.server.kill();
    rig.fs.remount_on_another_device();
    rig.fs.rot(&rig.fs.path().join("big.bin"), 2 * MIB + 9);
    rig.fs.rot(&rig.fs.path().join("small.txt"), 4000);
    rig.server.restart::<&str>(&[]);
    for (name, chunk) in [("big.bin", "chunk 2"), ("small.txt", "chunk 0")] {
        let json = rig.download_fails_on_rot(name);
        let message = first_error(&json);
        assert!(
            message.contains(name) && message.contains(chunk),
            "{message}"
        );
        rig.mount_read_fails_on_rot(name, None);
    }
}

/// A share exported read-only after its files were uploaded (an archive) still reads
/// the records saved while it was writable, without writing anything: rot fails a
/// download and a read through the mount.
#[test]
fn a_share_exported_read_only_later_still_checks_its_records() {
    let Some(mut rig) = rig() else { return };
    source(&rig.local("big.bin"), 2 * MIB + 11, 9);
    rig.upload("big.bin", SHA);
    rig.server.kill();
    rig.fs.rot(&rig.fs.path().join("big.bin"), 7);
    rig.server = Server::start(&[Share::ro("data", rig.fs.path())]);
    let json = rig.download_fails_on_rot("big.bin");
    let message = first_error(&json);
    assert!(message.contains("chunk 0"), "{message}");
    rig.mount_read_fails_on_rot("big.bin", None);
}

/// A file renamed and then made executable through the mount (ferryd's `Move` and
/// `SetAttrs`, each of which moves the inode's ctime) keeps its record: rot after
/// them fails a download by the new name.
#[test]
fn a_file_renamed_and_chmodded_through_the_mount_keeps_its_record() {
    let Some(rig) = rig() else { return };
    source(&rig.local("old.bin"), 2 * MIB + 5, 12);
    rig.upload("old.bin", B3);
    let before = fs::metadata(rig.fs.path().join("old.bin")).unwrap();
    {
        let mount = Mount::builder(rig.server.remote("data", "")).start();
        fs::create_dir(mount.join("moved")).unwrap();
        fs::rename(mount.join("old.bin"), mount.join("moved/new.bin")).unwrap();
        let renamed = fs::metadata(rig.fs.path().join("moved/new.bin")).unwrap();
        fs::set_permissions(
            mount.join("moved/new.bin"),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let chmodded = fs::metadata(rig.fs.path().join("moved/new.bin")).unwrap();
        assert_eq!(chmodded.mode() & 0o777, 0o755);
        assert_ne!(
            (renamed.ctime(), renamed.ctime_nsec()),
            (chmodded.ctime(), chmodded.ctime_nsec()),
            "the chmod moved the ctime"
        );
    }
    let on_server = rig.fs.path().join("moved/new.bin");
    let after = fs::metadata(&on_server).unwrap();
    // The same inode, its ctime moved (the record's key changed).
    assert_eq!(before.ino(), after.ino());
    assert_ne!(
        (before.ctime(), before.ctime_nsec()),
        (after.ctime(), after.ctime_nsec())
    );
    rig.fs.rot(&on_server, MIB + 3);
    let json = rig.download_fails_on_rot("moved/new.bin");
    let message = first_error(&json);
    assert!(message.contains("chunk 1"), "{message}");
    assert!(rig.logged_damage("new.bin") >= 1, "{}", rig.server.stderr());
}

/// A source whose mtime lies ahead of the server's clock (a client whose clock runs
/// ahead) is still recorded at its upload's commit: rot fails the next download.
#[test]
fn an_upload_stamped_ahead_of_the_servers_clock_is_checked_at_rest() {
    let Some(rig) = rig() else { return };
    let src = rig.local("ahead.bin");
    source(&src, 2 * MIB + 3, 8);
    let ahead = std::time::SystemTime::now() + std::time::Duration::new(90, 123_457);
    fs::File::options()
        .write(true)
        .open(&src)
        .unwrap()
        .set_modified(ahead)
        .unwrap();
    rig.upload("ahead.bin", B3);
    let on_server = rig.fs.path().join("ahead.bin");
    assert_eq!(fs::metadata(&on_server).unwrap().modified().unwrap(), ahead);
    rig.fs.rot(&on_server, MIB + 1);
    rig.download_fails_on_rot("ahead.bin");
    assert!(
        rig.logged_damage("ahead.bin") >= 1,
        "{}",
        rig.server.stderr()
    );
}

/// A file written through the mount in pieces that straddle its chunks, last piece
/// first (what the kernel's requests of a direct write from a buffer that is not
/// page-aligned can look like when they arrive out of order), is still recorded at
/// its commit: ferryd hashes the chunks written in pieces from the staged file. Rot
/// after that fails a download.
fn a_file_written_through_the_mount_in_pieces_is_checked_at_rest(alg: HashAlgorithm) {
    use std::os::unix::fs::FileExt;
    let Some(rig) = rig() else { return };
    let len = 3 * MIB + 4321;
    source(&rig.local("src"), len, 50);
    let data = fs::read(rig.local("src")).unwrap();
    {
        let mount = Mount::builder(rig.server.remote("data", ""))
            .arg("--hash")
            .arg(alg.name())
            .start();
        let f = fs::File::create(mount.join("pieces.bin")).unwrap();
        let piece = 384 * 1024 + 17;
        let starts: Vec<usize> = (0..data.len()).step_by(piece).collect();
        for &at in starts.iter().rev() {
            let end = (at + piece).min(data.len());
            f.write_all_at(&data[at..end], at as u64).unwrap();
        }
        f.set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_600_000_000))
            .unwrap();
    }
    let on_server = rig.fs.path().join("pieces.bin");
    assert_files_equal(&rig.local("src"), &on_server);
    rig.fs.rot(&on_server, 2 * MIB + 100);
    let json = rig.download_fails_on_rot("pieces.bin");
    let message = first_error(&json);
    assert!(message.contains("chunk 2"), "{message}");
    assert!(
        rig.logged_damage("pieces.bin") >= 1,
        "{}",
        rig.server.stderr()
    );
}

#[test]
fn a_file_written_through_the_mount_in_pieces_is_checked_at_rest_blake3() {
    a_file_written_through_the_mount_in_pieces_is_checked_at_rest(B3);
}

#[test]
fn a_file_written_through_the_mount_in_pieces_is_checked_at_rest_sha256() {
    a_file_written_through_the_mount_in_pieces_is_checked_at_rest(SHA);
}

/// A file written underneath ferryd (no record) is recorded by the first download
/// that reads all of it, once it had settled: a second download is sent those hashes,
/// so rot after the first read fails it.
fn first_download_records_a_file_written_underneath(alg: HashAlgorithm) {
    let Some(rig) = rig() else { return };
    let on_server = rig.fs.path().join("foreign.bin");
    write_random_file(&on_server, 2 * MIB + 999, 7);
    // Settled: its ctime at least a second (CACHE_SETTLE) before the download opens.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let back = rig.local("foreign.bin");
    let download = || {
        rcp([
            "--json".into(),
            "--hash".into(),
            alg.name().into(),
            rig.server.remote("data", "foreign.bin").into(),
            back.clone().into_os_string(),
        ])
    };
    download().assert_success();
    assert_files_equal(&on_server, &back);
    fs::remove_file(&back).unwrap();

    rig.fs.rot(&on_server, 2 * MIB + 5);
    let out = download();
    out.assert_code(INTEGRITY);
    let json = out.json();
    let message = first_error(&json);
    assert!(
        message.contains("foreign.bin") && message.contains("chunk 2"),
        "{message}"
    );
    assert!(!back.exists(), "a damaged file under its final name");
    assert!(
        rig.logged_damage("foreign.bin") >= 1,
        "{}",
        rig.server.stderr()
    );
}

#[test]
fn a_file_written_underneath_is_recorded_by_its_first_download_blake3() {
    first_download_records_a_file_written_underneath(HashAlgorithm::Blake3);
}

#[test]
fn a_file_written_underneath_is_recorded_by_its_first_download_sha256() {
    first_download_records_a_file_written_underneath(HashAlgorithm::Sha256);
}

const B3: HashAlgorithm = HashAlgorithm::Blake3;
const SHA: HashAlgorithm = HashAlgorithm::Sha256;

#[test]
fn a_rotten_chunk_fails_a_download_blake3() {
    per_file_download_fails_on_rot(B3, None);
}

#[test]
fn a_rotten_chunk_fails_a_download_sha256() {
    per_file_download_fails_on_rot(SHA, None);
}

#[test]
fn a_rotten_chunk_fails_a_download_in_the_other_algorithm() {
    per_file_download_fails_on_rot(B3, Some(SHA));
    per_file_download_fails_on_rot(SHA, Some(B3));
}

#[test]
fn a_rotten_small_file_fails_a_batch_blake3() {
    batched_download_fails_on_rot(B3, None);
}

#[test]
fn a_rotten_small_file_fails_a_batch_sha256() {
    batched_download_fails_on_rot(SHA, None);
}

#[test]
fn a_rotten_small_file_fails_a_batch_in_the_other_algorithm() {
    batched_download_fails_on_rot(B3, Some(SHA));
    batched_download_fails_on_rot(SHA, Some(B3));
}

#[test]
fn a_rotten_chunk_fails_a_read_through_the_mount_blake3() {
    mount_read_fails_on_rot(B3, B3);
}

#[test]
fn a_rotten_chunk_fails_a_read_through_the_mount_sha256() {
    mount_read_fails_on_rot(SHA, SHA);
}

#[test]
fn a_rotten_chunk_fails_a_read_through_the_mount_in_the_other_algorithm() {
    mount_read_fails_on_rot(B3, SHA);
    mount_read_fails_on_rot(SHA, B3);
}

#[test]
fn a_file_written_through_the_mount_is_checked_at_rest_blake3() {
    a_file_written_through_the_mount_is_checked_at_rest(B3, true);
}

#[test]
fn a_file_written_through_the_mount_with_its_own_mtime_is_checked_at_rest() {
    a_file_written_through_the_mount_is_checked_at_rest(B3, false);
}

#[test]
fn a_file_written_through_the_mount_is_checked_at_rest_sha256() {
    a_file_written_through_the_mount_is_checked_at_rest(SHA, true);
}
