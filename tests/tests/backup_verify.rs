//! The persistent manifest store and `Verify` (issue 5): a restarted ferryd takes the
//! manifests of unchanged stored files from its store instead of hashing them again
//! (which its debug log says, file by file), a changed file is never taken for an
//! unchanged one, and `rcp backup --verify` finds a stored file damaged in place.

use std::fs;
use std::os::unix::fs::{symlink, FileExt};
use std::time::Duration;

use ferry_common::chunk::hash_chunk;
use ferry_common::msg::{
    ErrorKind, Hash256, HashAlgorithm, Request, Response, VerifyRecord, DEFAULT_CHUNK_BYTES,
};
use ferry_common::STATE_DIR;
use ferry_tests::{
    ferrytest, make_many_small_files, make_small_tree, mtime_of, raw_handshake, raw_socket,
    rcp_args, set_mtime, write_random_file, Env, RawClient, MIB,
};

const SHARE: &str = ferry_tests::DEFAULT_SHARE;

fn session(env: &Env) -> RawClient {
    raw_handshake(env.server(), raw_socket(env.server()))
}

fn error_kind(resp: Response) -> ErrorKind {
    match resp {
        Response::Error(e) => e.kind,
        other => panic!("expected an error, got {other:?}"),
    }
}

/// Every chunk hash of the stored `path` (files of at most 1024 chunks: one page).
fn manifest(raw: &mut RawClient, path: &str) -> Vec<Hash256> {
    let resp = raw.call(Request::Manifest {
        share: SHARE.into(),
        path: path.into(),
        chunk_bytes: DEFAULT_CHUNK_BYTES,
        first_chunk: 0,
    });
    match resp {
        Response::Manifest { hashes, .. } => hashes,
        other => panic!("manifest of {path}: {other:?}"),
    }
}

fn local_hashes(path: &std::path::Path) -> Vec<Hash256> {
    fs::read(path)
        .unwrap()
        .chunks(DEFAULT_CHUNK_BYTES as usize)
        .map(|c| hash_chunk(HashAlgorithm::Blake3, c))
        .collect()
}

/// How many times ferryd's log says the manifest of share path `path` was taken from
/// the store, and how many times it was hashed.
fn log_counts(env: &Env, path: &str) -> (usize, usize) {
    let log = env.server().stderr();
    let from_store = format!("manifest from the store file={SHARE}/{path} ");
    let hashed = format!("manifest hashed file={SHARE}/{path} ");
    (
        log.matches(&from_store).count(),
        log.matches(&hashed).count(),
    )
}

/// Panics unless [`log_counts`] of `path` is `(from_store, hashed)`.
#[track_caller]
fn assert_log_counts(env: &Env, path: &str, from_store: usize, hashed: usize) {
    let log = env.server().stderr();
    assert_eq!(
        log_counts(env, path),
        (from_store, hashed),
        "{path}; log:\n{log}"
    );
}

/// Flips one byte of `path` at `offset` in place and sets its mtime back.
fn flip_keeping_mtime(path: &std::path::Path, offset: u64) {
    let mtime = mtime_of(path);
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut byte = [0u8];
    f.read_exact_at(&mut byte, offset).unwrap();
    f.write_all_at(&[byte[0] ^ 0x5a], offset).unwrap();
    drop(f);
    set_mtime(path, u64::try_from(mtime).unwrap());
}

fn snapshot_of(json: &serde_json::Value) -> String {
    json["targets"][0]["snapshot"].as_str().unwrap().to_owned()
}

#[test]
fn a_restarted_ferryd_takes_unchanged_files_manifests_from_its_store() {
    let mut env = Env::builder().server_arg("-v").start();
    let src = env.local("src");
    make_small_tree(&src, 5);
    let big = src.join("big.bin");
    write_random_file(&big, 8 * MIB + 3, 7);
    set_mtime(&big, 1_500_000_000);
    let dest = env.remote("backups/host");
    let out = env.rcp(rcp_args!["backup", "--json", &src, &dest]);
    out.assert_success();
    let first = snapshot_of(&out.json());
    let first_big = format!("{first}/big.bin");

    // After a restart (no cache), the stored file's manifest comes from the store.
    env.server_mut().restart::<&str>(&[]);
    let mut raw = session(&env);
    assert_eq!(manifest(&mut raw, &first_big), local_hashes(&big));
    assert_log_counts(&env, &first_big, 1, 0);

    // A backup after another restart (each ferryd logs afresh), changing one chunk of
    // the big file: the server takes the previous copy's manifest (the base) from the
    // store too, and pulls only that chunk.
    env.server_mut().restart::<&str>(&[]);
    std::thread::sleep(Duration::from_millis(1100));
    let f = fs::OpenOptions::new().write(true).open(&big).unwrap();
    f.write_all_at(b"changed", 5 * MIB + 17).unwrap();
    drop(f);
    set_mtime(&big, 1_500_000_100);
    // The restarted ferryd listens on another port.
    let dest = env.remote("backups/host");
    let out = env.rcp(rcp_args!["backup", "--json", &src, &dest]);
    out.assert_success();
    let json = out.json();
    assert_eq!(json["files_changed"], 1, "{json}");
    assert_eq!(json["bytes_sent"], MIB, "{json}");
    let second = snapshot_of(&json);
    assert_log_counts(&env, &first_big, 1, 0);

    // The unchanged files were hard-linked into the second snapshot, which changed
    // their ctime; ferryd re-keyed their records as it linked, so after another
    // restart their manifests still come from the store.
    env.server_mut().restart::<&str>(&[]);
    let mut raw = session(&env);
    let linked = format!("{second}/sub/b.bin");
    let before = manifest(&mut raw, &linked);
    assert_eq!(before, local_hashes(&src.join("sub/b.bin")));
    assert_log_counts(&env, &linked, 1, 0);
    // The changed file was recorded as it was committed.
    let second_big = format!("{second}/big.bin");
    assert_eq!(manifest(&mut raw, &second_big), local_hashes(&big));
    assert_log_counts(&env, &second_big, 1, 0);

    // Changed in place on the server with its size and mtime kept: never taken for
    // unchanged (its ctime moved), hashed anew.
    flip_keeping_mtime(&env.share(&linked), 10);
    let after = manifest(&mut raw, &linked);
    assert_log_counts(&env, &linked, 1, 1);
    assert_ne!(after[0], before[0]);
    assert_eq!(after[1..], before[1..]);
}

/// A backup's small files go in upload batches: their manifests are recorded in the
/// store as they are committed, as a lone upload's commit records them, and then used:
/// after a restart, the manifest of a small file the backup changed comes from the
/// store, not from hashing it, and so does that of one the next snapshot linked (its
/// record re-keyed at the link); `--verify` finds every file recorded.
#[test]
fn a_backups_batched_small_files_are_recorded_and_their_records_used() {
    let mut env = Env::builder().server_arg("-v").start();
    let src = env.local("src");
    let stats = make_many_small_files(&src, 4, 2, 20);
    let dest = env.remote("backups/host");
    let out = env.rcp(rcp_args!["backup", "--json", &src, &dest]);
    out.assert_success();
    assert_eq!(out.json()["files_new"], stats.files, "{}", out.json());

    // One small file changes (same size), with an mtime that has settled.
    let changed = src.join("d00/f001.txt");
    let mut data = fs::read(&changed).unwrap();
    assert!(!data.is_empty() && data.len() <= 8192);
    data[0] ^= 0x5a;
    fs::write(&changed, &data).unwrap();
    set_mtime(&changed, 1_400_000_000);
    std::thread::sleep(Duration::from_millis(1100));
    let out = env.rcp(rcp_args!["backup", "--json", &src, &dest]);
    out.assert_success();
    let json = out.json();
    assert_eq!(json["files_changed"], 1, "{json}");
    assert_eq!(json["bytes_sent"], data.len(), "{json}");
    let second = snapshot_of(&json);

    env.server_mut().restart::<&str>(&[]);
    let mut raw = session(&env);
    let uploaded = format!("{second}/d00/f001.txt");
    assert_eq!(manifest(&mut raw, &uploaded), local_hashes(&changed));
    assert_log_counts(&env, &uploaded, 1, 0);
    let linked = format!("{second}/d01/f005.txt");
    assert_eq!(
        manifest(&mut raw, &linked),
        local_hashes(&src.join("d01/f005.txt"))
    );
    assert_log_counts(&env, &linked, 1, 0);

    let dest = env.remote("backups/host");
    let out = env.rcp(rcp_args!["backup", "--json", "--verify", &dest]);
    out.assert_success();
    let json = out.json();
    assert_eq!(json["snapshot"], second.as_str(), "{json}");
    assert_eq!(json["verified"], stats.files, "{json}");
    assert_eq!(json["unverifiable"], serde_json::json!([]), "{json}");
}

ferrytest!(
    verify_finds_a_byte_flipped_in_place_and_tells_it_from_no_record,
    |env| {
        let src = env.local("src");
        let stats = make_small_tree(&src, 9);
        let big = src.join("big.bin");
        write_random_file(&big, 3 * MIB + 10, 3);
        set_mtime(&big, 1_500_000_000);
        let files = stats.files + 1;
        let dest = env.remote("backups/host");
        let out = env.rcp(rcp_args!["backup", "--json", &src, &dest]);
        out.assert_success();
        let snapshot = snapshot_of(&out.json());

        // Freshly backed up: every file verifies against its record.
        let out = env.rcp(rcp_args!["backup", "--json", "--verify", &dest]);
        out.assert_success();
        let json = out.json();
        assert_eq!(json["snapshot"], snapshot.as_str(), "{json}");
        assert_eq!(json["files"], files, "{json}");
        assert_eq!(json["verified"], files, "{json}");
        assert_eq!(json["damaged"], serde_json::json!([]), "{json}");
        assert_eq!(json["unverifiable"], serde_json::json!([]), "{json}");

        // A file put into the snapshot by hand has no record: unverifiable, not damage.
        // Once it has settled (its ctime 1 s old), that Verify records what it read, so
        // the next one verifies it against that. Slept past the settle time so the
        // outcome does not hang on how slow the machine is.
        fs::write(
            env.share(&format!("{snapshot}/sub/by-hand.txt")),
            b"by hand",
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(1100));
        let out = env.rcp(rcp_args!["backup", "--json", "--verify", &dest]);
        out.assert_success();
        let json = out.json();
        assert_eq!(
            json["unverifiable"],
            serde_json::json!(["sub/by-hand.txt"]),
            "{json}"
        );
        assert_eq!(json["verified"], files, "{json}");
        let out = env.rcp(rcp_args!["backup", "--json", "--verify", &dest]);
        out.assert_success();
        let json = out.json();
        assert_eq!(json["unverifiable"], serde_json::json!([]), "{json}");
        let files = files + 1;
        assert_eq!(json["verified"], files, "{json}");

        // One byte flipped in chunk 2 of the stored big file, its mtime set back: found,
        // with the chunk, whether the snapshot is named or found as the newest.
        flip_keeping_mtime(&env.share(&format!("{snapshot}/big.bin")), 2 * MIB + 123);
        let named = env.remote(&snapshot);
        let out = env.rcp(rcp_args!["backup", "--json", "--verify", &named]);
        out.assert_code(9);
        let json = out.json();
        assert_eq!(json["ok"], false);
        assert_eq!(json["exit_code"], 9);
        assert_eq!(json["verified"], files - 1, "{json}");
        let damaged = &json["damaged"][0];
        assert_eq!(damaged["path"], "big.bin", "{json}");
        assert_eq!(damaged["bad_chunks"], serde_json::json!([2]), "{json}");
        assert_eq!(damaged["bad_count"], 1, "{json}");
        assert_eq!(damaged["chunk_bytes"], DEFAULT_CHUNK_BYTES, "{json}");
        // Written in place, ctime moved: modified after the backup, mtime kept.
        assert_eq!(damaged["record"], "stale", "{json}");
        assert_eq!(json["damaged"].as_array().unwrap().len(), 1, "{json}");
        let out = env.rcp(rcp_args!["backup", "--verify", &dest]);
        out.assert_code(9);
        out.assert_stderr_has(&format!("damaged: {snapshot}/big.bin: chunks 2 of"));
        out.assert_stderr_has("mtime kept");
        // Damage stays reported: the record is not replaced by the damaged bytes.
        env.rcp(rcp_args!["backup", "--verify", &dest])
            .assert_code(9);

        // A prefix without snapshots, and a bad target.
        let out = env.rcp(rcp_args![
            "backup",
            "--json",
            "--verify",
            env.remote("backups")
        ]);
        out.assert_code(4);
        assert_eq!(out.json()["error"]["kind"], "not_found");
        env.rcp(rcp_args!["backup", "--verify", env.remote("")])
            .assert_code(2);
        env.rcp(rcp_args!["backup", "--verify", &dest, &src, &dest])
            .assert_code(2);
    }
);

ferrytest!(
    verify_refuses_what_is_not_a_regular_file_of_the_share,
    shares = [("data", false), ("ro", true)],
    |env| {
        let outside = env.local("outside");
        fs::create_dir_all(&outside).unwrap();
        fs::write(outside.join("secret"), b"secret").unwrap();
        symlink(&outside, env.share("out")).unwrap();
        fs::create_dir_all(env.share("snap/dir")).unwrap();
        write_random_file(&env.share("snap/f"), 100, 1);
        symlink("f", env.share("snap/l")).unwrap();
        symlink("../../outside/secret", env.share("snap/rel-out")).unwrap();
        fs::create_dir_all(env.share(&format!("{STATE_DIR}/manifests"))).unwrap();
        fs::write(env.share(&format!("{STATE_DIR}/manifests/rec")), b"r").unwrap();
        let mut raw = session(&env);
        let verify = |raw: &mut RawClient, share: &str, path: &str| {
            raw.call(Request::Verify {
                share: share.into(),
                path: path.into(),
            })
        };
        for (path, kind) in [
            ("../outside/secret", ErrorKind::OutsideShare),
            ("out/secret", ErrorKind::OutsideShare),
            ("snap/l", ErrorKind::InvalidPath),
            ("snap/rel-out", ErrorKind::InvalidPath),
            ("out", ErrorKind::InvalidPath),
            ("snap/dir", ErrorKind::IsADirectory),
            ("", ErrorKind::IsADirectory),
            ("snap/none", ErrorKind::NotFound),
            (STATE_DIR, ErrorKind::InvalidPath),
            (".ferry-state/manifests/rec", ErrorKind::InvalidPath),
        ] {
            let got = error_kind(verify(&mut raw, SHARE, path));
            assert_eq!(got, kind, "Verify {path:?}");
        }
        // A file of the share that was never recorded: no record.
        match verify(&mut raw, SHARE, "snap/f") {
            Response::Verified(r) => {
                assert_eq!((r.record, r.bad_count), (VerifyRecord::Missing, 0))
            }
            other => panic!("{other:?}"),
        }
        // Read-only shares keep no records.
        fs::write(env.share_dir("ro").join("g"), b"g").unwrap();
        match verify(&mut raw, "ro", "g") {
            Response::Verified(r) => assert_eq!(r.record, VerifyRecord::Missing),
            other => panic!("{other:?}"),
        }

        // The state directory is not listed, and no request reaches into it, directly
        // or through a symlink a client made.
        match raw.call(Request::ListDir {
            share: SHARE.into(),
            path: "".into(),
            cursor: 0,
        }) {
            Response::Dir { entries, .. } => {
                assert!(entries.iter().all(|e| e.name != STATE_DIR), "{entries:?}")
            }
            other => panic!("{other:?}"),
        }
        let made = raw.call(Request::Symlink {
            share: SHARE.into(),
            path: "st".into(),
            target: STATE_DIR.into(),
        });
        assert_eq!(made, Response::Ok);
        let rec = format!("{STATE_DIR}/manifests/rec");
        for req in [
            Request::ListDir {
                share: SHARE.into(),
                path: "st/manifests".into(),
                cursor: 0,
            },
            Request::Stat {
                share: SHARE.into(),
                path: STATE_DIR.into(),
                follow: false,
            },
            Request::Link {
                share: SHARE.into(),
                from: rec.clone(),
                to: "stolen".into(),
            },
            Request::Link {
                share: SHARE.into(),
                from: "snap/f".into(),
                to: format!("{STATE_DIR}/manifests/planted"),
            },
            Request::Rename {
                share: SHARE.into(),
                from: STATE_DIR.into(),
                to: "moved".into(),
            },
            Request::Mkdir {
                share: SHARE.into(),
                path: format!("{STATE_DIR}/x"),
                mode: 0o755,
                exist_ok: true,
            },
            Request::DownloadOpen {
                share: SHARE.into(),
                path: "st/manifests/rec".into(),
            },
            Request::Manifest {
                share: SHARE.into(),
                path: rec.clone(),
                chunk_bytes: 4096,
                first_chunk: 0,
            },
        ] {
            assert_eq!(
                error_kind(raw.call(req.clone())),
                ErrorKind::InvalidPath,
                "{req:?}"
            );
        }
        assert_eq!(fs::read(env.share(&rec)).unwrap(), b"r");
        assert!(!env.share("stolen").exists() && !env.share("moved").exists());
        assert!(!env
            .share(&format!("{STATE_DIR}/manifests/planted"))
            .exists());
        assert_eq!(fs::read(outside.join("secret")).unwrap(), b"secret");
    }
);
