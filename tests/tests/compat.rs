//! Backward compatibility: what the previous release wrote keeps working with this one
//! (issue 22, point 2).
//!
//! The previous release's `ferryd` and `rcp` are real binaries built from git history
//! by `scripts/build-prev.sh` (the commit is named there) and found in
//! `$FERRY_PREV_BIN_DIR`; without it every test here prints one line and passes. Each
//! test makes its data with the previous release (an upload, a backup snapshot, an
//! interrupted upload or download), then upgrades the server as an administrator
//! would (the old `ferryd` stopped, the current one started on the same share
//! directories, so inode-keyed records stay valid) and goes on with the current `rcp`:
//!
//! - files the old release uploaded or backed up download byte for byte, and the
//!   server's manifest records of them, made by the old release, are found and match
//!   (`Verify` says `Current`, `rcp backup --verify` verifies every file);
//! - an upload or a download the old release left half done (its partial and journal)
//!   is resumed: the chunks it journaled are not sent again;
//! - an incremental backup against an old snapshot links the unchanged files (same
//!   inodes), sends a changed file's changed chunks only, and both snapshots verify.
//!
//! Kill points depend on timing; the assertions hold for any kill point after the first
//! chunk was journaled (an attempt that killed before that, or too late, is repeated).

use std::collections::BTreeSet;
use std::fs;
use std::io::Read;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use ferry_common::msg::{Request, Response, VerifyRecord};
use ferry_tests::{
    assert_files_equal, assert_no_temp_files, assert_trees_equal, bin, raw_handshake, raw_socket,
    rcp_args, rcp_binary, set_mtime, spawn_rcp_binary, write_random_file, Env, PrevRelease,
    RcpChild, RcpOutput, DEFAULT_SHARE, MIB, PREV_BIN_DIR_VAR,
};

/// The chunk size both releases use by default (1 MiB); neither `rcp` nor `ferryd`
/// has an option to change it.
const CHUNK: u64 = MIB;
/// The size of the file an interrupted copy moves: big enough that a kill after its
/// first journaled chunks finds it still running.
const BIG: u64 = 64 * MIB + 3;
/// Journaled chunks to wait for before killing an interrupted copy.
const KILL_AFTER_CHUNKS: usize = 2;
/// How long one attempt waits for them.
const KILL_WAIT: Duration = Duration::from_secs(30);
/// Attempts at interrupting a copy after something was journaled.
const KILL_ATTEMPTS: usize = 5;
/// How long the upgraded ferryd may take to finish its startup cleanup and the
/// pruning of its manifest store (which must keep the old release's records).
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(20);

/// The previous release's binaries, or `None` (after saying so) when the tests are to
/// be skipped.
fn prev_release() -> Option<PrevRelease> {
    let prev = PrevRelease::from_env();
    if prev.is_none() {
        eprintln!("skipped: {PREV_BIN_DIR_VAR} unset (scripts/build-prev.sh builds it)");
    }
    prev
}

/// An environment whose ferryd is the previous release's.
fn old_env(prev: &PrevRelease) -> Env {
    Env::builder().server_binary(prev.ferryd()).start()
}

/// Upgrades the server: SIGKILLs the old ferryd and starts the current one on the same
/// shares, then waits until its startup cleanup and store pruning are done (so what
/// they would drop is gone before anything is checked).
fn upgrade(env: &mut Env) {
    env.server_mut()
        .restart_binary(&bin("ferryd"), &[] as &[&str]);
    for line in ["startup cleanup removed", "manifest store kept"] {
        assert!(
            env.server().wait_for_log(line, 1, CLEANUP_TIMEOUT),
            "the upgraded ferryd did not log {line:?} within {CLEANUP_TIMEOUT:?}:\n{}",
            env.server().stderr()
        );
    }
}

/// The files of the source tree: share-relative names and sizes. Multi-chunk files
/// (uploaded window by window) and small ones (uploaded in batches).
const TREE: [(&str, u64); 7] = [
    ("big.bin", 5 * MIB + 17),
    ("one.bin", MIB),
    ("small.txt", 100),
    ("sub/mid.bin", 3 * MIB - 5),
    ("sub/page.bin", 4096),
    ("sub/deep/two.bin", MIB + 1),
    ("sub/deep/medium.bin", 700 * 1024),
];

/// Writes [`TREE`] under `root` (seeded, so the same `seed` gives the same tree), with
/// mtimes long settled (records are kept only of files whose mtime lies a second
/// before their change time), directories' last.
fn make_source(root: &Path, seed: u64) -> u64 {
    fs::create_dir_all(root.join("sub/deep")).unwrap();
    for (i, (rel, len)) in TREE.iter().enumerate() {
        let path = root.join(rel);
        write_random_file(&path, *len, seed + i as u64);
        set_mtime(&path, 1_500_000_000 + i as u64);
    }
    for (i, dir) in ["sub/deep", "sub", ""].iter().enumerate() {
        set_mtime(&root.join(dir), 1_500_001_000 + i as u64);
    }
    TREE.iter().map(|(_, len)| len).sum()
}

/// The `--json` report's unsigned field `key`.
#[track_caller]
fn field(out: &RcpOutput, key: &str) -> u64 {
    let v = out.json();
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no {key} in the report: {v}\n{out}"))
}

/// The share-relative path of the snapshot a successful `rcp backup --json` made.
#[track_caller]
fn snapshot_of(out: &RcpOutput) -> String {
    let v = out.json();
    v["targets"][0]["snapshot"]
        .as_str()
        .unwrap_or_else(|| panic!("no snapshot in the report: {v}\n{out}"))
        .to_owned()
}

/// Panics unless the server verifies `path` (in [`DEFAULT_SHARE`]) against a record
/// of exactly this file version with every chunk matching.
#[track_caller]
fn assert_record_current(env: &Env, path: &str) {
    let mut raw = raw_handshake(env.server(), raw_socket(env.server()));
    match raw.call(Request::Verify {
        share: DEFAULT_SHARE.into(),
        path: path.into(),
    }) {
        Response::Verified(r) => assert_eq!(
            (r.record, r.bad_count),
            (VerifyRecord::Current, 0),
            "{path}: the record made by the previous release was not found or does not \
             match: {r:?}\n{}",
            env.server().stderr()
        ),
        other => panic!("Verify {path}: {other:?}"),
    }
}

/// Runs the current `rcp backup --json --verify` on `target` and checks that it
/// verified each of `files` files against its record.
#[track_caller]
fn assert_backup_verifies(env: &Env, target: &str, files: usize) {
    let out = env.rcp(rcp_args!["backup", "--json", "--verify", target]);
    out.assert_success();
    let json = out.json();
    assert_eq!(json["files"], files, "{json}");
    assert_eq!(json["verified"], files, "{json}");
    assert_eq!(json["damaged"], serde_json::json!([]), "{json}");
    assert_eq!(json["unverifiable"], serde_json::json!([]), "{json}");
    assert_eq!(json["errors"], serde_json::json!([]), "{json}");
}

/// Downloads `remote` (a directory) with the current `rcp -r` into a fresh local
/// directory `into` and returns where the tree landed.
fn download_tree(env: &Env, remote: &str, into: &str) -> PathBuf {
    let dir = env.local(into);
    fs::create_dir_all(&dir).unwrap();
    env.rcp(rcp_args![
        "-r",
        env.remote(remote),
        format!("{}/", dir.display())
    ])
    .assert_success();
    let name = Path::new(remote).file_name().unwrap();
    dir.join(name)
}

/// The chunks that the journals of resumable partials directly in `dir` record, read
/// in the previous release's journal format (a 64-byte header opening with
/// `FRYJRNL\0`, format version 1 and the chunk size, then 48-byte records opening
/// with the chunk index, little-endian), so this does not depend on what the current
/// code reads.
/// Indices at or beyond the chunk count of a `size`-byte file are left out.
fn old_journal_chunks(dir: &Path, size: u64) -> BTreeSet<u64> {
    const HEADER_BYTES: usize = 64;
    const RECORD_BYTES: usize = 48;
    let chunks = size.div_ceil(CHUNK);
    let mut found = BTreeSet::new();
    let Ok(entries) = fs::read_dir(dir) else {
        return found;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(stem) = name
            .strip_prefix(".ferry-tmp")
            .and_then(|n| n.strip_suffix(".journal"))
        else {
            continue;
        };
        if !dir.join(format!(".ferry-tmp{stem}.part")).is_file() {
            continue;
        }
        let mut bytes = Vec::new();
        if fs::File::open(entry.path())
            .and_then(|mut f| f.read_to_end(&mut bytes))
            .is_err()
            || bytes.len() < HEADER_BYTES
        {
            continue;
        }
        assert_eq!(&bytes[..8], b"FRYJRNL\0", "{name}: not a journal");
        assert_eq!(
            u32::from_le_bytes(bytes[8..12].try_into().unwrap()),
            1,
            "{name}: not the previous release's journal format"
        );
        assert_eq!(
            u64::from(u32::from_le_bytes(bytes[12..16].try_into().unwrap())),
            CHUNK,
            "{name}: journaled in another chunk size"
        );
        for record in bytes[HEADER_BYTES..].chunks_exact(RECORD_BYTES) {
            let index = u64::from_le_bytes(record[..8].try_into().unwrap());
            if index < chunks {
                found.insert(index);
            }
        }
    }
    found
}

/// File bytes of `chunks` of a `size`-byte file.
fn chunk_bytes(chunks: &BTreeSet<u64>, size: u64) -> u64 {
    chunks.iter().map(|&i| (size - i * CHUNK).min(CHUNK)).sum()
}

/// Starts a copy of a [`BIG`] file with `spawn` and SIGKILLs its `rcp` once the
/// partial at the destination directory `dir` has journaled [`KILL_AFTER_CHUNKS`]
/// chunks. An attempt whose copy finished first (`done` then removes what it made) or
/// that had journaled nothing is repeated, at most [`KILL_ATTEMPTS`] times.
fn interrupt(dir: &Path, spawn: impl Fn() -> RcpChild, done: impl Fn()) {
    for attempt in 1..=KILL_ATTEMPTS {
        let mut child = spawn();
        let deadline = Instant::now() + KILL_WAIT;
        while child.is_running()
            && old_journal_chunks(dir, BIG).len() < KILL_AFTER_CHUNKS
            && Instant::now() < deadline
        {
            thread::sleep(Duration::from_millis(1));
        }
        let out = child.kill();
        match out.code {
            Some(0) => {
                eprintln!("attempt {attempt}: the copy finished before the kill; again");
                done();
            }
            Some(_) => panic!("the previous release's rcp failed\n{out}"),
            None if old_journal_chunks(dir, BIG).is_empty() => {
                eprintln!("attempt {attempt}: killed before anything was journaled; again");
            }
            None => return,
        }
    }
    panic!("no copy of {KILL_ATTEMPTS} was killed after it journaled a chunk");
}

/// Checks a resumed copy of the [`BIG`] file whose partial had journaled `journaled`
/// bytes: everything sent or reused, the journaled chunks reused, less sent than the
/// file's size.
#[track_caller]
fn assert_resumed(out: &RcpOutput, journaled: u64) {
    out.assert_success();
    let (sent, reused) = (field(out, "bytes_sent"), field(out, "bytes_reused"));
    eprintln!("resumed: {journaled} bytes journaled by the previous release, {reused} reused, {sent} sent");
    assert_eq!(sent + reused, BIG, "sent + reused\n{out}");
    assert!(
        journaled > 0 && reused >= journaled,
        "{journaled} bytes were journaled by the previous release but {reused} reused\n{out}"
    );
    assert!(sent < BIG, "{sent} bytes sent of {BIG}: not resumed\n{out}");
}

#[test]
fn old_uploads_and_backups_are_read_and_verified_by_the_current_release() {
    let Some(prev) = prev_release() else {
        return;
    };
    let mut env = old_env(&prev);
    let src = env.local("tree");
    let total = make_source(&src, 1);
    fs::create_dir_all(env.share("up")).unwrap();
    let out = rcp_binary(
        &prev.rcp(),
        rcp_args!["-r", "--json", &src, env.remote("up/")],
    );
    out.assert_success();
    assert_eq!(field(&out, "bytes_sent"), total, "a fresh upload\n{out}");
    let out = rcp_binary(
        &prev.rcp(),
        rcp_args!["backup", "--json", &src, env.remote("backups/host")],
    );
    out.assert_success();
    assert_eq!(field(&out, "files_new"), TREE.len() as u64, "{out}");
    let snapshot = snapshot_of(&out);

    upgrade(&mut env);
    // The records first: nothing has read the files since the upgrade, so a record
    // found is the previous release's.
    for dir in ["up/tree", snapshot.as_str()] {
        for (rel, _) in TREE {
            assert_record_current(&env, &format!("{dir}/{rel}"));
        }
    }
    assert_backup_verifies(&env, &env.remote("backups/host"), TREE.len());

    assert_trees_equal(&src, &download_tree(&env, "up/tree", "down-up"));
    assert_trees_equal(&src, &download_tree(&env, &snapshot, "down-snapshot"));
}

#[test]
fn an_upload_the_previous_release_left_partial_is_resumed() {
    let Some(prev) = prev_release() else {
        return;
    };
    let mut env = old_env(&prev);
    let src = env.local("big.bin");
    write_random_file(&src, BIG, 21);
    let dst = env.share("big.bin");
    interrupt(
        &env.share(""),
        || {
            spawn_rcp_binary(
                &prev.rcp(),
                rcp_args!["--json", &src, env.remote("big.bin")],
            )
        },
        || fs::remove_file(&dst).unwrap(),
    );

    // What the old ferryd journaled so far (it may journal more before the upgrade
    // stops it): a lower bound of what the resumed upload reuses.
    let journaled = chunk_bytes(&old_journal_chunks(&env.share(""), BIG), BIG);

    upgrade(&mut env);
    let out = env.rcp(rcp_args!["--json", &src, env.remote("big.bin")]);
    assert_resumed(&out, journaled);
    // The resumed upload keeps the algorithm it started with (the old release's
    // SHA-256), though this rcp prefers BLAKE3, and says so.
    assert_eq!(out.json()["hash"], "sha256", "{out}");
    assert_files_equal(&src, &dst);
    assert_no_temp_files(&env.share(""));
}

#[test]
fn a_download_the_previous_release_left_partial_is_resumed() {
    let Some(prev) = prev_release() else {
        return;
    };
    let mut env = old_env(&prev);
    let src = env.share("big.bin");
    write_random_file(&src, BIG, 31);
    set_mtime(&src, 1_500_000_000);
    let dst = env.local("big.bin");
    interrupt(
        &env.local(""),
        || {
            spawn_rcp_binary(
                &prev.rcp(),
                rcp_args!["--json", env.remote("big.bin"), &dst],
            )
        },
        || fs::remove_file(&dst).unwrap(),
    );
    let journaled = chunk_bytes(&old_journal_chunks(&env.local(""), BIG), BIG);

    upgrade(&mut env);
    let out = env.rcp(rcp_args!["--json", env.remote("big.bin"), &dst]);
    assert_resumed(&out, journaled);
    assert_files_equal(&src, &dst);
    assert_no_temp_files(&env.local(""));
}

#[test]
fn an_incremental_backup_against_an_old_snapshot_sends_only_what_changed() {
    let Some(prev) = prev_release() else {
        return;
    };
    let mut env = old_env(&prev);
    let src = env.local("tree");
    make_source(&src, 41);
    let dest = env.remote("backups/host");
    let out = rcp_binary(&prev.rcp(), rcp_args!["backup", "--json", &src, &dest]);
    out.assert_success();
    let first = snapshot_of(&out);

    upgrade(&mut env);
    // Snapshot names have whole seconds.
    thread::sleep(Duration::from_millis(1100));
    // Two chunks of the big file change in part (its size stays); one file is new.
    let (changed, changed_chunks) = ("big.bin", 2);
    let f = fs::OpenOptions::new()
        .write(true)
        .open(src.join(changed))
        .unwrap();
    f.write_all_at(b"changed", CHUNK + 17).unwrap();
    f.write_all_at(b"changed too", 4 * CHUNK + 9).unwrap();
    drop(f);
    set_mtime(&src.join(changed), 1_500_000_100);
    let new_len = 2 * MIB + 9;
    write_random_file(&src.join("sub/new.bin"), new_len, 49);
    set_mtime(&src.join("sub/new.bin"), 1_500_000_200);
    set_mtime(&src.join("sub"), 1_500_002_000);
    let total: u64 = TREE.iter().map(|(_, len)| len).sum::<u64>() + new_len;

    let dest = env.remote("backups/host");
    let out = env.rcp(rcp_args!["backup", "--json", &src, &dest]);
    out.assert_success();
    let json = out.json();
    let second = snapshot_of(&out);
    assert_eq!(json["targets"][0]["previous"], first.as_str(), "{json}");
    assert_eq!(json["files_unchanged"], TREE.len() - 1, "{json}");
    assert_eq!(json["files_changed"], 1, "{json}");
    assert_eq!(json["files_new"], 1, "{json}");
    assert_eq!(json["files_deleted"], 0, "{json}");
    let (sent, reused) = (field(&out, "bytes_sent"), field(&out, "bytes_reused"));
    eprintln!("incremental backup: {sent} bytes sent, {reused} reused, of {total}");
    assert_eq!(sent + reused, total, "sent + reused\n{out}");
    // The new file is sent whole, the changed one its changed chunks only.
    assert!(
        sent > new_len && sent <= new_len + changed_chunks * CHUNK,
        "{sent} bytes sent: expected the new file's {new_len} and at most \
         {changed_chunks} chunks of the changed file\n{out}"
    );
    // Unchanged files are hard links to the old snapshot's copies.
    for (rel, _) in TREE.iter().filter(|(rel, _)| *rel != changed) {
        let ino = |snap: &str| {
            fs::metadata(env.share(&format!("{snap}/{rel}")))
                .unwrap()
                .ino()
        };
        assert_eq!(ino(&first), ino(&second), "{rel} is not linked");
    }

    // The old snapshot's records (re-keyed where its files were linked) and the new
    // one's match.
    for (rel, _) in TREE {
        assert_record_current(&env, &format!("{first}/{rel}"));
        assert_record_current(&env, &format!("{second}/{rel}"));
    }
    assert_record_current(&env, &format!("{second}/sub/new.bin"));
    assert_backup_verifies(&env, &env.remote(&first), TREE.len());
    assert_backup_verifies(&env, &env.remote(&second), TREE.len() + 1);

    assert_trees_equal(&src, &download_tree(&env, &second, "down-second"));
    let original = env.local("original");
    make_source(&original, 41);
    assert_trees_equal(&original, &download_tree(&env, &first, "down-first"));
}
