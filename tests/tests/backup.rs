//! Server requests for snapshot backups (issue 5): `Link` shares an unchanged file
//! with the previous snapshot, `Rename` publishes a finished snapshot without ever
//! replacing anything, `Manifest` returns a stored file's chunk hashes page by page.

use std::fs;
use std::os::unix::fs::{symlink, MetadataExt};

use ferry_common::chunk::{hash_chunk, manifest_id};
use ferry_common::msg::{
    ErrorKind, Hash256, HashAlgorithm, Request, Response, MAX_MANIFEST_PAGE_CHUNKS,
};
use ferry_tests::{ferrytest, raw_handshake, raw_socket, write_random_file, RawClient, MIB};

const SHARE: &str = ferry_tests::DEFAULT_SHARE;

fn session(env: &ferry_tests::Env) -> RawClient {
    raw_handshake(env.server(), raw_socket(env.server()))
}

fn error_kind(resp: Response) -> ErrorKind {
    match resp {
        Response::Error(e) => e.kind,
        other => panic!("expected an error, got {other:?}"),
    }
}

fn link(raw: &mut RawClient, from: &str, to: &str) -> Response {
    raw.call(Request::Link {
        share: SHARE.into(),
        from: from.into(),
        to: to.into(),
    })
}

fn rename(raw: &mut RawClient, from: &str, to: &str) -> Response {
    raw.call(Request::Rename {
        share: SHARE.into(),
        from: from.into(),
        to: to.into(),
    })
}

ferrytest!(link_shares_the_inode_and_never_replaces, |env| {
    fs::create_dir_all(env.share("snap1")).unwrap();
    fs::create_dir_all(env.share("snap2")).unwrap();
    write_random_file(&env.share("snap1/f"), 5000, 1);
    fs::write(env.share("snap2/taken"), b"x").unwrap();
    let mut raw = session(&env);

    assert_eq!(link(&mut raw, "snap1/f", "snap2/f"), Response::Ok);
    let a = fs::metadata(env.share("snap1/f")).unwrap();
    let b = fs::metadata(env.share("snap2/f")).unwrap();
    assert_eq!((a.dev(), a.ino()), (b.dev(), b.ino()));
    assert_eq!(b.nlink(), 2);

    assert_eq!(
        error_kind(link(&mut raw, "snap1/f", "snap2/taken")),
        ErrorKind::Exists
    );
    assert_eq!(fs::read(env.share("snap2/taken")).unwrap(), b"x");
    assert_eq!(
        error_kind(link(&mut raw, "snap1/none", "snap2/g")),
        ErrorKind::NotFound
    );
    // Directories and symlinks are not linked; nothing outside the share either.
    assert_eq!(
        error_kind(link(&mut raw, "snap1", "snap2/d")),
        ErrorKind::InvalidPath
    );
    symlink("f", env.share("snap1/l")).unwrap();
    assert_eq!(
        error_kind(link(&mut raw, "snap1/l", "snap2/l")),
        ErrorKind::InvalidPath
    );
    assert_eq!(
        error_kind(link(&mut raw, "../f", "snap2/h")),
        ErrorKind::OutsideShare
    );
    assert_eq!(
        error_kind(link(&mut raw, "snap1/f", "../h")),
        ErrorKind::OutsideShare
    );
    // A temporary transfer file never gains a visible name.
    fs::write(env.share("snap1/.ferry-tmp.x.part"), b"partial").unwrap();
    assert_eq!(
        error_kind(link(&mut raw, "snap1/.ferry-tmp.x.part", "snap2/p")),
        ErrorKind::InvalidPath
    );
    assert!(!env.share("snap2/p").exists());
});

ferrytest!(rename_publishes_a_directory_without_replacing, |env| {
    fs::create_dir_all(env.share("b/.partial/sub")).unwrap();
    fs::write(env.share("b/.partial/sub/f"), b"data").unwrap();
    fs::create_dir_all(env.share("b/old")).unwrap();
    let mut raw = session(&env);

    // An existing destination is never replaced, not even an empty directory.
    assert_eq!(
        error_kind(rename(&mut raw, "b/.partial", "b/old")),
        ErrorKind::Exists
    );
    assert!(env.share("b/.partial/sub/f").exists());

    assert_eq!(rename(&mut raw, "b/.partial", "b/snap"), Response::Ok);
    assert_eq!(fs::read(env.share("b/snap/sub/f")).unwrap(), b"data");
    assert!(!env.share("b/.partial").exists());

    assert_eq!(
        error_kind(rename(&mut raw, "b/none", "b/x")),
        ErrorKind::NotFound
    );
    assert_eq!(
        error_kind(rename(&mut raw, "b/snap", "../x")),
        ErrorKind::OutsideShare
    );
    assert_eq!(
        error_kind(rename(&mut raw, "", "b/x")),
        ErrorKind::InvalidPath
    );
});

ferrytest!(
    rename_is_refused_on_a_read_only_share,
    shares = [("data", false), ("ro", true)],
    |env| {
        fs::create_dir_all(env.share_dir("ro").join("a")).unwrap();
        let mut raw = session(&env);
        let resp = raw.call(Request::Rename {
            share: "ro".into(),
            from: "a".into(),
            to: "b".into(),
        });
        assert_eq!(error_kind(resp), ErrorKind::ReadOnly);
        assert!(env.share_dir("ro").join("a").exists());
    }
);

/// Every page of `path`'s manifest in chunks of `chunk_bytes`, checking that all pages
/// name the same version.
fn manifest(
    raw: &mut RawClient,
    path: &str,
    chunk_bytes: u32,
) -> (u64, u32, Hash256, Vec<Hash256>) {
    let mut all = Vec::new();
    let mut seen = None;
    loop {
        let resp = raw.call(Request::Manifest {
            share: SHARE.into(),
            path: path.into(),
            chunk_bytes,
            first_chunk: all.len() as u64,
        });
        let Response::Manifest {
            version,
            first_chunk,
            hashes,
        } = resp
        else {
            panic!("expected a manifest page, got {resp:?}");
        };
        assert_eq!(first_chunk, all.len() as u64);
        assert!(hashes.len() <= MAX_MANIFEST_PAGE_CHUNKS);
        if let Some(v) = &seen {
            assert_eq!(v, &version, "pages of one unchanged file name one version");
        }
        let done = hashes.is_empty();
        all.extend(hashes);
        seen = Some(version);
        if done {
            let v = seen.unwrap();
            return (v.size, v.chunk_bytes, v.manifest, all);
        }
    }
}

ferrytest!(manifest_pages_cover_the_file, |env| {
    // 4 KiB chunks over 9 MiB + 1 byte: 2305 chunks, three pages.
    let len = 9 * MIB + 1;
    write_random_file(&env.share("big"), len, 7);
    let data = fs::read(env.share("big")).unwrap();
    let mut raw = session(&env);

    let (size, chunk_bytes, id, hashes) = manifest(&mut raw, "big", 4096);
    assert_eq!((size, chunk_bytes), (len, 4096));
    let expected: Vec<Hash256> = data
        .chunks(4096)
        .map(|c| hash_chunk(HashAlgorithm::Blake3, c))
        .collect();
    assert_eq!(hashes.len(), 2305);
    assert_eq!(hashes, expected);
    assert_eq!(id, manifest_id(HashAlgorithm::Blake3, len, 4096, &expected));

    // The requested chunk size is clamped and rounded as for MapOpen.
    let (_, chunk_bytes, _, hashes) = manifest(&mut raw, "big", 3 << 20);
    assert_eq!(chunk_bytes, 4 << 20);
    assert_eq!(hashes.len(), 3);

    // An empty file has no chunks; a directory has no manifest.
    fs::write(env.share("empty"), b"").unwrap();
    let (size, _, _, hashes) = manifest(&mut raw, "empty", 1 << 20);
    assert_eq!((size, hashes.len()), (0, 0));
    fs::create_dir(env.share("dir")).unwrap();
    let resp = raw.call(Request::Manifest {
        share: SHARE.into(),
        path: "dir".into(),
        chunk_bytes: 1 << 20,
        first_chunk: 0,
    });
    assert!(matches!(resp, Response::Error(_)), "{resp:?}");
});

ferrytest!(manifest_follows_a_rewritten_file, |env| {
    write_random_file(&env.share("f"), 3 * MIB, 1);
    let mut raw = session(&env);
    let (_, _, first, _) = manifest(&mut raw, "f", 1 << 20);
    // Same size, new content: the manifest must change (the key includes ctime).
    write_random_file(&env.share("f"), 3 * MIB, 2);
    let (_, _, second, hashes) = manifest(&mut raw, "f", 1 << 20);
    assert_ne!(first, second);
    let data = fs::read(env.share("f")).unwrap();
    let expected: Vec<Hash256> = data
        .chunks(1 << 20)
        .map(|c| hash_chunk(HashAlgorithm::Blake3, c))
        .collect();
    assert_eq!(hashes, expected);
});

#[test]
fn the_client_library_reads_whole_manifests_and_links() {
    let env = ferry_tests::Env::new();
    let len = 5 * MIB + 77;
    write_random_file(&env.share("f"), len, 3);
    let data = fs::read(env.share("f")).unwrap();
    ferry_tests::runtime().block_on(async {
        let c = ferry_tests::connect(env.server(), ferry_tests::test_choice())
            .await
            .unwrap();
        let (version, hashes) = c.manifest(SHARE, "f", 4096).await.unwrap();
        assert_eq!(version.size, len);
        assert_eq!(version.chunk_bytes, 4096);
        let expected: Vec<Hash256> = data
            .chunks(4096)
            .map(|c| hash_chunk(HashAlgorithm::Blake3, c))
            .collect();
        assert_eq!(hashes, expected);

        c.mkdir(SHARE, ".partial", 0o755, false).await.unwrap();
        c.link(SHARE, "f", ".partial/f").await.unwrap();
        c.rename(SHARE, ".partial", "snap").await.unwrap();
        let err = c.rename(SHARE, "f", "snap").await.unwrap_err();
        assert_eq!(err.remote_kind(), Some(ErrorKind::Exists));
    });
    let a = fs::metadata(env.share("f")).unwrap();
    let b = fs::metadata(env.share("snap/f")).unwrap();
    assert_eq!(a.ino(), b.ino());
}

/// Uploads `local` to `path` with `base` through the client library.
fn upload_with_base(
    env: &ferry_tests::Env,
    local: &std::path::Path,
    path: &str,
    base: &str,
) -> Result<ferry_client::transfer::Copied, ferry_client::ClientError> {
    ferry_tests::runtime().block_on(async {
        let c = ferry_tests::connect(env.server(), ferry_tests::test_choice())
            .await
            .unwrap();
        let progress: ferry_client::transfer::ProgressFn = std::sync::Arc::new(|_| {});
        ferry_client::transfer::upload_file_with_base(&c, local, SHARE, path, base, progress).await
    })
}

ferrytest!(an_upload_with_a_base_pulls_only_changed_chunks, |env| {
    // 8 MiB + 5 in 1 MiB chunks (the server's default): chunk 3 changes, the short last
    // chunk grows by 5 bytes, so two chunks are pulled.
    fs::create_dir_all(env.share("snap1")).unwrap();
    fs::create_dir_all(env.share("snap2")).unwrap();
    write_random_file(&env.share("snap1/f"), 8 * MIB, 1);
    let mut data = fs::read(env.share("snap1/f")).unwrap();
    data[3 * MIB as usize + 17] ^= 0xff;
    data.extend_from_slice(b"tail!");
    let local = env.local("f");
    fs::write(&local, &data).unwrap();

    let copied = upload_with_base(&env, &local, "snap2/f", "snap1/f").unwrap();
    assert_eq!(copied.bytes, data.len() as u64);
    assert_eq!(copied.bytes_reused, 7 * MIB);
    assert_eq!(copied.bytes_sent, MIB + 5);
    assert_eq!(fs::read(env.share("snap2/f")).unwrap(), data);
    // The base is untouched and a separate file.
    let a = fs::metadata(env.share("snap1/f")).unwrap();
    let b = fs::metadata(env.share("snap2/f")).unwrap();
    assert_eq!(a.len(), 8 * MIB);
    assert_ne!(a.ino(), b.ino());
    ferry_tests::assert_no_temp_files(&env.share_dir(SHARE));
});

ferrytest!(a_base_is_matched_by_hash_and_checked, |env| {
    // A base with moved chunks still serves them (matched by hash, not by offset); a
    // base with nothing in common serves nothing and the file is pulled whole.
    let mut data = Vec::new();
    for seed in 0..4 {
        write_random_file(&env.local("part"), MIB, seed);
        data.push(fs::read(env.local("part")).unwrap());
    }
    let shuffled: Vec<u8> = [2, 0, 3, 1]
        .iter()
        .flat_map(|&i| data[i].iter().copied())
        .collect();
    fs::write(env.share("base"), &shuffled).unwrap();
    let local = env.local("src");
    fs::write(&local, data.concat()).unwrap();
    let copied = upload_with_base(&env, &local, "out", "base").unwrap();
    assert_eq!((copied.bytes_sent, copied.bytes_reused), (0, 4 * MIB));
    assert_eq!(fs::read(env.share("out")).unwrap(), data.concat());

    write_random_file(&env.share("other"), 4 * MIB, 99);
    let copied = upload_with_base(&env, &local, "out2", "other").unwrap();
    assert_eq!((copied.bytes_sent, copied.bytes_reused), (4 * MIB, 0));
    assert_eq!(fs::read(env.share("out2")).unwrap(), data.concat());
});

ferrytest!(a_bad_base_is_refused_before_anything_moves, |env| {
    write_random_file(&env.local("src"), MIB, 1);
    let local = env.local("src");
    let kind = |r: Result<_, ferry_client::ClientError>| r.unwrap_err().remote_kind();
    assert_eq!(
        kind(upload_with_base(&env, &local, "o", "none")),
        Some(ErrorKind::NotFound)
    );
    assert_eq!(
        kind(upload_with_base(&env, &local, "o", "../x")),
        Some(ErrorKind::OutsideShare)
    );
    fs::create_dir(env.share("d")).unwrap();
    assert!(kind(upload_with_base(&env, &local, "o", "d")).is_some());
    assert!(!env.share("o").exists());
    ferry_tests::assert_no_temp_files(&env.share_dir(SHARE));
});

mod snapshots {
    use std::fs;
    use std::os::unix::fs::MetadataExt;
    use std::path::Path;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, UNIX_EPOCH};

    use ferry_client::backup::{backup, no_progress, snapshot_name, BackupReport};
    use ferry_client::transfer::ProgressFn;
    use ferry_tests::{assert_trees_equal, make_tree, write_random_file, Env, MIB};

    use super::SHARE;

    const T0: u64 = 1_795_257_009;

    fn at(secs: u64) -> std::time::SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn run(
        env: &Env,
        src: &Path,
        secs: u64,
        progress: ProgressFn,
    ) -> Result<BackupReport, ferry_client::ClientError> {
        ferry_tests::runtime().block_on(async {
            let c = ferry_tests::connect(env.server(), ferry_tests::test_choice())
                .await
                .unwrap();
            backup(&c, src, SHARE, "backups/host", at(secs), progress).await
        })
    }

    fn snap(env: &Env, secs: u64) -> std::path::PathBuf {
        env.share(&format!("backups/host/{}", snapshot_name(at(secs))))
    }

    /// Rewrites `path` with other bytes of the same length (a new mtime too).
    fn touch_content(path: &Path, offset: usize) {
        let mut data = fs::read(path).unwrap();
        data[offset] ^= 0x5a;
        fs::write(path, data).unwrap();
    }

    #[test]
    fn a_second_backup_sends_only_what_changed() {
        let env = Env::new();
        let src = env.local("src");
        let mut stats = make_tree(&src, 5);
        write_random_file(&src.join("big"), 6 * MIB, 9);
        // Over 2,000 files in all.
        fs::create_dir(src.join("many")).unwrap();
        for i in 0..1200u64 {
            let len = 1 + (i * 37) % 4096;
            write_random_file(&src.join(format!("many/{i:04}")), len, 1000 + i);
            stats.bytes += len;
        }
        let first = run(&env, &src, T0, no_progress()).unwrap();
        assert!(first.files_scanned > 2000, "{first:?}");
        assert_eq!(first.previous, None);
        assert_eq!(first.files_new, first.files_scanned);
        assert_trees_equal(&src, &snap(&env, T0));

        // About 1 % of the small files change, one byte of the big one, one file goes,
        // one comes.
        let mut files: Vec<_> = walk_files(&src);
        files.sort();
        let small: Vec<_> = files
            .iter()
            .filter(|p| {
                let len = fs::metadata(p).unwrap().len();
                len > 0 && len <= 4096
            })
            .cloned()
            .collect();
        let changed: Vec<_> = small.iter().step_by(100).cloned().collect();
        let changed_bytes: u64 = changed.iter().map(|p| fs::metadata(p).unwrap().len()).sum();
        for p in &changed {
            touch_content(p, 0);
        }
        touch_content(&src.join("big"), 3 * MIB as usize + 5);
        fs::remove_file(&small[1]).unwrap();
        write_random_file(&src.join("fresh"), 1000, 77);

        let second = run(&env, &src, T0 + 60, no_progress()).unwrap();
        assert_eq!(second.previous.as_deref(), Some(first.snapshot.as_str()));
        assert_eq!(second.files_changed, changed.len() as u64 + 1, "{second:?}");
        assert_eq!(second.files_new, 1);
        assert_eq!(second.files_deleted, 1);
        assert_eq!(
            second.files_unchanged,
            second.files_scanned - second.files_changed - 1
        );
        // The changed small files whole, one chunk of the big one, the new file.
        assert_eq!(second.bytes_sent, changed_bytes + MIB + 1000, "{second:?}");
        assert!(second.bytes_reused >= stats.bytes - changed_bytes);
        assert_trees_equal(&src, &snap(&env, T0 + 60));

        // Unchanged files share their inode with the previous snapshot; changed ones
        // do not, and the previous snapshot still holds the old bytes.
        let rel = |p: &Path| p.strip_prefix(&src).unwrap().to_path_buf();
        let unchanged = &small[2];
        let (a, b) = (
            snap(&env, T0).join(rel(unchanged)),
            snap(&env, T0 + 60).join(rel(unchanged)),
        );
        assert_eq!(
            fs::metadata(&a).unwrap().ino(),
            fs::metadata(&b).unwrap().ino()
        );
        let (a, b) = (
            snap(&env, T0).join(rel(&changed[0])),
            snap(&env, T0 + 60).join(rel(&changed[0])),
        );
        assert_ne!(
            fs::metadata(&a).unwrap().ino(),
            fs::metadata(&b).unwrap().ino()
        );
        assert_ne!(fs::read(&a).unwrap(), fs::read(&b).unwrap());
        ferry_tests::assert_no_temp_files(&env.share_dir(SHARE));
    }

    #[test]
    fn an_interrupted_backup_publishes_nothing_and_the_next_run_continues() {
        let env = Env::new();
        let src = env.local("src");
        make_tree(&src, 6);
        for i in 0..6 {
            write_random_file(&src.join(format!("big{i}")), 2 * MIB, i);
        }
        let first = run(&env, &src, T0, no_progress()).unwrap();
        for i in 0..6 {
            touch_content(&src.join(format!("big{i}")), 100);
        }

        // The connection is cut once some bytes of the second run went through.
        let err = ferry_tests::runtime().block_on(async {
            let c = ferry_tests::connect(env.server(), ferry_tests::test_choice())
                .await
                .unwrap();
            let seen = Arc::new(AtomicU64::new(0));
            let cut = c.clone();
            let progress: ProgressFn = Arc::new(move |n| {
                if seen.fetch_add(n, Ordering::SeqCst) + n > 3 * MIB {
                    cut.close();
                }
            });
            backup(&c, &src, SHARE, "backups/host", at(T0 + 60), progress)
                .await
                .unwrap_err()
        });
        drop(err);
        assert!(!snap(&env, T0 + 60).exists());
        let partial = env.share(&format!(
            "backups/host/.partial-{}",
            snapshot_name(at(T0 + 60))
        ));
        assert!(partial.exists());
        // The previous snapshot is as it was.
        assert_eq!(
            fs::read(snap(&env, T0).join("big0")).unwrap()[100],
            fs::read(src.join("big0")).unwrap()[100] ^ 0x5a
        );

        // The next run (another timestamp) links what the interrupted one completed,
        // and its snapshot holds exactly the source (a file deleted meanwhile is not
        // carried over from the partial).
        fs::remove_file(src.join("big5")).unwrap();
        let again = run(&env, &src, T0 + 120, no_progress()).unwrap();
        assert_eq!(again.previous.as_deref(), Some(first.snapshot.as_str()));
        assert_trees_equal(&src, &snap(&env, T0 + 120));
        // Each big file differs from its base in one chunk only (and the ones the
        // interrupted run finished are linked from its partial, not sent again).
        assert!(again.bytes_sent <= 5 * MIB, "{again:?}");
        assert_eq!(again.files_changed, 5, "{again:?}");
        assert_eq!(again.files_deleted, 1, "{again:?}");

        // A run of the very timestamp that was interrupted continues its partial.
        let same = run(&env, &src, T0 + 60, no_progress()).unwrap();
        assert!(!partial.exists());
        assert_eq!(same.previous.as_deref(), Some(first.snapshot.as_str()));
        assert!(snap(&env, T0 + 60).exists());
    }

    /// The share's filesystem type (`statfs` magic).
    fn is_ext234(path: &Path) -> bool {
        use nix::sys::statfs::{statfs, EXT4_SUPER_MAGIC};
        statfs(path).is_ok_and(|s| s.filesystem_type() == EXT4_SUPER_MAGIC)
    }

    #[test]
    fn a_file_at_the_link_limit_is_copied_on_the_server_instead() {
        // ext2/3/4 allow 65,000 links per inode (EMLINK beyond); other filesystems
        // have other limits or none, and the real limit is what this test is about.
        let env = Env::new();
        if !is_ext234(&env.share_dir(SHARE)) {
            eprintln!("skipped: the share is not on ext2/3/4, whose link limit this test uses");
            return;
        }
        let src = env.local("src");
        fs::create_dir_all(src.join("d")).unwrap();
        write_random_file(&src.join("d/full"), 3 * MIB + 7, 1);
        write_random_file(&src.join("d/other"), 5000, 2);
        let first = run(&env, &src, T0, no_progress()).unwrap();
        // Fill the previous copy's inode up to the limit with links elsewhere in the share.
        let prev = snap(&env, T0).join("d/full");
        let links = env.share("links");
        fs::create_dir(&links).unwrap();
        let mut made = 0u32;
        let hit = loop {
            match fs::hard_link(&prev, links.join(made.to_string())) {
                Ok(()) => made += 1,
                Err(e) if e.raw_os_error() == Some(nix::libc::EMLINK) => break true,
                Err(e) => panic!("link {made}: {e}"),
            }
            if made > 70_000 {
                break false;
            }
        };
        assert!(hit, "ext4 took more than 70,000 links to one inode");
        // ferryd says so with its own error kind.
        let mut raw = super::session(&env);
        assert_eq!(
            super::error_kind(super::link(
                &mut raw,
                &format!("{}/d/full", first.snapshot),
                "links/x"
            )),
            ferry_common::msg::ErrorKind::TooManyLinks
        );

        let second = run(&env, &src, T0 + 60, no_progress()).unwrap();
        assert_eq!(second.files_unchanged, 2, "{second:?}");
        assert_eq!(second.bytes_sent, 0, "{second:?}");
        assert!(second.bytes_reused >= 3 * MIB + 7, "{second:?}");
        assert_trees_equal(&src, &snap(&env, T0 + 60));
        let (a, b) = (
            fs::metadata(&prev).unwrap(),
            fs::metadata(snap(&env, T0 + 60).join("d/full")).unwrap(),
        );
        assert_ne!(a.ino(), b.ino(), "a new inode, not one more link");
        // The other file is linked as usual.
        assert_eq!(
            fs::metadata(snap(&env, T0).join("d/other")).unwrap().ino(),
            fs::metadata(snap(&env, T0 + 60).join("d/other"))
                .unwrap()
                .ino()
        );
        ferry_tests::assert_no_temp_files(&env.share_dir(SHARE));
    }

    fn walk_files(dir: &Path) -> Vec<std::path::PathBuf> {
        let mut out = Vec::new();
        for e in fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let t = e.file_type().unwrap();
            if t.is_dir() {
                out.extend(walk_files(&e.path()));
            } else if t.is_file() {
                out.push(e.path());
            }
        }
        out
    }
}

mod cli {
    use std::fs;
    use std::path::{Path, PathBuf};
    use std::time::{Duration, Instant};

    use ferry_tests::{
        assert_trees_equal, ferrytest, make_small_tree, make_tree, rcp_args, spawn_rcp,
        unused_local_port, write_random_file, MIB,
    };

    ferrytest!(rcp_backup_makes_snapshots_and_reports_json, |env| {
        let src = env.local("src");
        make_small_tree(&src, 3);
        let dest = env.remote("backups/host");
        let out = env.rcp(rcp_args!["backup", "--json", &src, &dest]);
        out.assert_success();
        let first = out.json();
        assert_eq!(first["ok"], true);
        assert_eq!(first["files_new"], first["files_scanned"]);
        assert_eq!(
            first["targets"][0]["hashes"],
            serde_json::json!(["blake3"]),
            "{first}"
        );
        let snapshot = first["targets"][0]["snapshot"]
            .as_str()
            .unwrap()
            .to_string();
        assert_trees_equal(&src, &env.share(&snapshot));

        // One second later (snapshot names have second resolution), nothing changed:
        // nothing is sent.
        std::thread::sleep(std::time::Duration::from_millis(1100));
        let out = env.rcp(rcp_args!["backup", "--json", &src, &dest]);
        out.assert_success();
        let second = out.json();
        assert_eq!(second["bytes_sent"], 0, "{second}");
        assert_eq!(second["files_unchanged"], second["files_scanned"]);
        assert_eq!(second["targets"][0]["hashes"], serde_json::json!([]));
        assert_eq!(
            second["targets"][0]["previous"].as_str(),
            Some(snapshot.as_str())
        );
        let names: Vec<_> = fs::read_dir(env.share("backups/host"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    });

    ferrytest!(rcp_backup_exit_codes, |env| {
        let src = env.local("src");
        make_small_tree(&src, 3);
        // A destination without a prefix is a usage error.
        let out = env.rcp(rcp_args!["backup", &src, env.remote("")]);
        out.assert_code(2);
        // Nothing listens: exit 3, with a JSON line naming the failed target.
        let host = ferry_tests::test_host();
        let dead = format!("{host}:{}:data/b", unused_local_port());
        let out = env.rcp(rcp_args!["backup", "--json", &src, &dead]);
        out.assert_code(3);
        assert_eq!(out.json()["targets"][0]["ok"], false);
        // Two targets, one down: the live one gets its snapshot, exit 8.
        let out = env.rcp(rcp_args![
            "backup",
            "--json",
            &src,
            env.remote("two"),
            "--to",
            &dead
        ]);
        out.assert_code(8);
        let json = out.json();
        assert_eq!(json["targets"][0]["ok"], true, "{json}");
        assert_eq!(json["targets"][1]["ok"], false, "{json}");
        let snapshot = json["targets"][0]["snapshot"].as_str().unwrap();
        assert_trees_equal(&src, &env.share(snapshot));
        // Two live targets: both get the snapshot, under the same name.
        let out = env.rcp(rcp_args![
            "backup",
            "--json",
            &src,
            env.remote("one"),
            "--to",
            env.remote("other/prefix")
        ]);
        out.assert_success();
        let json = out.json();
        let a = json["targets"][0]["snapshot"].as_str().unwrap();
        let b = json["targets"][1]["snapshot"].as_str().unwrap();
        assert_eq!(a.rsplit('/').next(), b.rsplit('/').next());
        assert_trees_equal(&src, &env.share(a));
        assert_trees_equal(&src, &env.share(b));
        // A missing source directory: exit 5.
        let out = env.rcp(rcp_args!["backup", env.local("none"), env.remote("b")]);
        out.assert_code(5);
    });
    /// Every path below `root` (relative), for "nothing changed here" checks.
    /// Everything under the share `root` that clients can see: ferryd's own state
    /// (its manifest store, which reads such as a dry run's may fill) left out.
    fn paths_below(root: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let mut todo = vec![root.to_path_buf()];
        while let Some(dir) = todo.pop() {
            for e in fs::read_dir(&dir).unwrap() {
                let p = e.unwrap().path();
                if p == root.join(ferry_common::STATE_DIR) {
                    continue;
                }
                if fs::symlink_metadata(&p).unwrap().is_dir() {
                    todo.push(p.clone());
                }
                out.push(p.strip_prefix(root).unwrap().to_path_buf());
            }
        }
        out.sort();
        out
    }

    ferrytest!(include_and_exclude_rules_pick_what_is_backed_up, |env| {
        let src = env.local("src");
        fs::create_dir_all(src.join("cache/inner")).unwrap();
        fs::create_dir_all(src.join("sub/deep")).unwrap();
        for (rel, len) in [
            ("a.log", 10),
            ("keep.log", 20),
            ("x.tmp", 30),
            ("b.txt", 40),
            ("cache/c.txt", 50),
            ("cache/inner/d.txt", 60),
            ("sub/cache", 70),
            ("sub/deep/e.log", 80),
            ("sub/deep/f.tmp", 90),
            ("sub/deep/g.txt", 100),
        ] {
            write_random_file(&src.join(rel), len, len);
        }
        let dest = env.remote("backups/host");
        let rules = [
            "--include",
            "keep.log",
            "--exclude",
            "*.log",
            "--exclude",
            "cache/",
            "--exclude",
            "/sub/deep/*.tmp",
            "--exclude",
            "/x.tmp",
        ];
        let mut args = vec!["backup", "--json"];
        args.extend(rules);
        let (s, d) = (src.to_str().unwrap(), dest.as_str());
        args.extend([s, d]);
        let out = env.rcp(&args);
        out.assert_success();
        let json = out.json();
        let snapshot = json["targets"][0]["snapshot"].as_str().unwrap().to_string();
        let kept: Vec<_> = paths_below(&env.share(&snapshot));
        let want: Vec<PathBuf> = [
            "b.txt",
            "keep.log",
            "sub",
            "sub/cache",
            "sub/deep",
            "sub/deep/g.txt",
        ]
        .iter()
        .map(PathBuf::from)
        .collect();
        assert_eq!(kept, want);
        assert_eq!(json["files_scanned"], 4, "{json}");
        assert_eq!(json["files_new"], 4, "{json}");

        // Excluding a file backed up before: neither scanned nor deleted.
        std::thread::sleep(std::time::Duration::from_millis(1100));
        let mut args = vec!["backup", "--json", "--exclude", "keep.log"];
        args.extend(rules);
        args.extend([s, d]);
        let out = env.rcp(&args);
        out.assert_success();
        let json = out.json();
        assert_eq!(json["files_scanned"], 3, "{json}");
        assert_eq!(json["files_unchanged"], 3, "{json}");
        assert_eq!(json["files_deleted"], 0, "{json}");
        // A bad pattern is a usage error.
        env.rcp(rcp_args!["backup", "--exclude", "a[", &src, &dest])
            .assert_code(2);
    });

    ferrytest!(
        a_dry_run_writes_nothing_and_estimates_what_would_be_sent,
        |env| {
            let src = env.local("src");
            fs::create_dir_all(src.join("d")).unwrap();
            write_random_file(&src.join("d/small"), 3000, 1);
            write_random_file(&src.join("d/big"), 3 * MIB, 2);
            write_random_file(&src.join("d/same"), 4000, 3);
            write_random_file(&src.join("gone"), 500, 4);
            // A dry run into an empty prefix creates nothing, not even the prefix.
            let out = env.rcp(rcp_args![
                "backup",
                "--json",
                "--dry-run",
                &src,
                env.remote("b/h")
            ]);
            out.assert_success();
            let json = out.json();
            assert_eq!(json["dry_run"], true);
            assert_eq!(json["files_new"], 4, "{json}");
            assert_eq!(json["bytes_sent"], 3 * MIB + 7500, "{json}");
            assert!(!env.share("b").exists());

            let first = env.rcp(rcp_args!["backup", "--json", &src, env.remote("b/h")]);
            first.assert_success();
            std::thread::sleep(std::time::Duration::from_millis(1100));
            let mut data = fs::read(src.join("d/small")).unwrap();
            data[10] ^= 1;
            fs::write(src.join("d/small"), data).unwrap();
            let mut data = fs::read(src.join("d/big")).unwrap();
            data[MIB as usize + 3] ^= 1;
            fs::write(src.join("d/big"), data).unwrap();
            fs::remove_file(src.join("gone")).unwrap();
            write_random_file(&src.join("d/new"), 1000, 5);

            let before = paths_below(&env.share_dir(ferry_tests::DEFAULT_SHARE));
            let out = env.rcp(rcp_args!["backup", "--json", "-n", &src, env.remote("b/h")]);
            out.assert_success();
            let dry = out.json();
            assert_eq!(dry["dry_run"], true);
            assert_eq!(dry["files_scanned"], 4, "{dry}");
            assert_eq!(dry["files_unchanged"], 1, "{dry}");
            assert_eq!(dry["files_changed"], 2, "{dry}");
            assert_eq!(dry["files_new"], 1, "{dry}");
            assert_eq!(dry["files_deleted"], 1, "{dry}");
            // The small file whole, one chunk of the big one, the new file.
            assert_eq!(dry["bytes_sent"], 3000 + MIB + 1000, "{dry}");
            assert_eq!(
                before,
                paths_below(&env.share_dir(ferry_tests::DEFAULT_SHARE))
            );

            // The real run sends what the dry run said.
            let out = env.rcp(rcp_args!["backup", "--json", &src, env.remote("b/h")]);
            out.assert_success();
            let real = out.json();
            assert_eq!(real["dry_run"], false);
            assert_eq!(real["bytes_sent"], dry["bytes_sent"], "{real}");
            for k in [
                "files_unchanged",
                "files_changed",
                "files_new",
                "files_deleted",
            ] {
                assert_eq!(real[k], dry[k], "{k}: {real}");
            }
        }
    );

    ferrytest!(a_snapshot_restores_byte_identical_with_rcp_r, |env| {
        let src = env.local("src");
        make_tree(&src, 11);
        let out = env.rcp(rcp_args!["backup", "--json", &src, env.remote("b/h")]);
        out.assert_success();
        let snapshot = out.json()["targets"][0]["snapshot"]
            .as_str()
            .unwrap()
            .to_string();
        let restored = env.local("restored");
        env.rcp(rcp_args!["-r", env.remote(&snapshot), &restored])
            .assert_success();
        // Contents, modes, mtimes, symlinks.
        assert_trees_equal(&src, &restored);
    });

    ferrytest!(
        rcp_backup_killed_mid_run_publishes_nothing_and_the_rerun_completes,
        |env| {
            let src = env.local("src");
            make_small_tree(&src, 5);
            let dest = env.remote("backups/host");
            let out = env.rcp(rcp_args!["backup", "--json", &src, &dest]);
            out.assert_success();
            let first = out.json()["targets"][0]["snapshot"]
                .as_str()
                .unwrap()
                .to_string();
            // What the first snapshot holds, to check nothing touches it.
            let kept = env.local("first-copy");
            let cp = std::process::Command::new("cp")
                .arg("-a")
                .arg(env.share(&first))
                .arg(&kept)
                .status()
                .unwrap();
            assert!(cp.success());

            // 96 new files of one chunk each, sent one at a time (-j 1): the run is killed
            // once two of them are committed in the partial snapshot.
            const NEW: u64 = 96;
            fs::create_dir(src.join("new")).unwrap();
            for i in 0..NEW {
                write_random_file(&src.join(format!("new/{i:03}")), MIB, 100 + i);
            }
            std::thread::sleep(std::time::Duration::from_millis(1100));
            let mut child = spawn_rcp(rcp_args!["backup", "--json", "-j", "1", &src, &dest]);
            let prefix = env.share("backups/host");
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let committed = fs::read_dir(&prefix)
                    .unwrap()
                    .map(|e| e.unwrap().path())
                    .filter(|p| {
                        p.file_name()
                            .unwrap()
                            .to_string_lossy()
                            .starts_with(".partial-")
                    })
                    .filter_map(|p| fs::read_dir(p.join("new")).ok())
                    .flatten()
                    .filter(|e| {
                        let e = e.as_ref().unwrap();
                        !e.file_name().to_string_lossy().starts_with('.')
                            && e.metadata().unwrap().len() == MIB
                    })
                    .count();
                if committed >= 2 {
                    break;
                }
                assert!(
                    child.is_running(),
                    "the backup finished before it could be killed: {}",
                    child.wait()
                );
                assert!(Instant::now() < deadline, "no file of the backup landed");
                std::thread::sleep(Duration::from_millis(2));
            }
            let killed = child.kill();
            assert_eq!(killed.code, None, "killed by a signal: {killed}");

            // Nothing new under a snapshot name; the first snapshot is as it was.
            let names: Vec<String> = fs::read_dir(&prefix)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .filter(|n| !n.starts_with('.'))
                .collect();
            assert_eq!(names, vec![first.rsplit('/').next().unwrap().to_string()]);
            assert_trees_equal(&kept, &env.share(&first));

            let out = env.rcp(rcp_args!["backup", "--json", &src, &dest]);
            out.assert_success();
            let json = out.json();
            let second = json["targets"][0]["snapshot"].as_str().unwrap();
            assert_trees_equal(&src, &env.share(second));
            assert_trees_equal(&kept, &env.share(&first));
            // What the killed run committed was not sent again.
            let sent = json["bytes_sent"].as_u64().unwrap();
            assert!(sent <= (NEW - 2) * MIB, "{json}");
            assert_eq!(json["files_new"], NEW, "{json}");
        }
    );
}

ferrytest!(backup_requests_never_reach_outside_the_share, |env| {
    // A symlink inside the share to a directory outside it, holding a file.
    let outside = env.local("outside");
    fs::create_dir_all(&outside).unwrap();
    fs::write(outside.join("secret"), b"secret").unwrap();
    symlink(&outside, env.share("out")).unwrap();
    fs::create_dir_all(env.share("snap")).unwrap();
    write_random_file(&env.share("snap/f"), 100, 1);
    let mut raw = session(&env);

    assert_eq!(
        error_kind(link(&mut raw, "out/secret", "snap/s")),
        ErrorKind::OutsideShare
    );
    assert_eq!(
        error_kind(link(&mut raw, "snap/f", "out/f")),
        ErrorKind::OutsideShare
    );
    assert_eq!(
        error_kind(rename(&mut raw, "snap", "out/snap")),
        ErrorKind::OutsideShare
    );
    assert_eq!(
        error_kind(rename(&mut raw, "out/secret", "snap/s")),
        ErrorKind::OutsideShare
    );
    let resp = raw.call(Request::Manifest {
        share: SHARE.into(),
        path: "out/secret".into(),
        chunk_bytes: 4096,
        first_chunk: 0,
    });
    assert_eq!(error_kind(resp), ErrorKind::OutsideShare);
    write_random_file(&env.local("src"), 6, 1);
    let err = upload_with_base(&env, &env.local("src"), "snap/g", "out/secret").unwrap_err();
    assert_eq!(err.remote_kind(), Some(ErrorKind::OutsideShare));
    // Renaming the symlink itself is fine: it stays a symlink inside the share.
    assert_eq!(rename(&mut raw, "out", "out2"), Response::Ok);
    assert!(fs::symlink_metadata(env.share("out2"))
        .unwrap()
        .is_symlink());
    assert_eq!(fs::read(outside.join("secret")).unwrap(), b"secret");
    assert_eq!(fs::read_dir(&outside).unwrap().count(), 1);
    assert!(!env.share("snap/s").exists() && !env.share("snap/g").exists());
});
