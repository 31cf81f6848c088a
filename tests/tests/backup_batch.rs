//! `LinkBatch`: many hard links in one request, each failing alone; a backup's
//! unchanged files going to the server in batches rather than one `Link` each, and its
//! new and changed small files in `UploadBatch`es rather than one upload each (ferryd's
//! request counter proves both), each file failing alone.

use std::fs;
use std::os::unix::fs::{symlink, MetadataExt};
use std::path::Path;
use std::time::{Duration, UNIX_EPOCH};

use ferry_client::backup::{backup, no_progress, snapshot_name};
use ferry_common::msg::{ErrorKind, Request, Response, LINK_BATCH_MAX};
use ferry_tests::{
    assert_no_temp_files, assert_trees_equal, ferrytest, make_many_small_files, raw_handshake,
    raw_socket, write_random_file, Env, RawClient,
};

const SHARE: &str = ferry_tests::DEFAULT_SHARE;

fn session(env: &Env) -> RawClient {
    raw_handshake(env.server(), raw_socket(env.server()))
}

fn batch(raw: &mut RawClient, share: &str, links: &[(&str, &str)]) -> Response {
    raw.call(Request::LinkBatch {
        share: share.into(),
        links: links
            .iter()
            .map(|(f, t)| (f.to_string(), t.to_string()))
            .collect(),
    })
}

fn results(resp: Response) -> Vec<Option<ErrorKind>> {
    match resp {
        Response::LinkedBatch { results } => {
            results.into_iter().map(|r| r.map(|e| e.kind)).collect()
        }
        other => panic!("expected a LinkedBatch, got {other:?}"),
    }
}

fn same_inode(a: &Path, b: &Path) -> bool {
    let (a, b) = (fs::metadata(a).unwrap(), fs::metadata(b).unwrap());
    (a.dev(), a.ino()) == (b.dev(), b.ino())
}

ferrytest!(failed_links_of_a_batch_fail_alone, |env| {
    fs::create_dir_all(env.share("prev/d")).unwrap();
    fs::create_dir_all(env.share("next/d")).unwrap();
    for name in ["a", "b", "c", "d/e"] {
        write_random_file(&env.share(&format!("prev/{name}")), 3000, 1);
    }
    fs::write(env.share("next/taken"), b"mine").unwrap();
    fs::write(env.share("prev/.ferry-tmp.x.part"), b"partial").unwrap();
    // A symlink in the share to a file outside it.
    let outside = env.root().join("outside-file");
    fs::write(&outside, b"outside").unwrap();
    symlink(&outside, env.share("prev/escape")).unwrap();
    symlink(env.root(), env.share("prev/out-dir")).unwrap();
    let mut raw = session(&env);

    let links = [
        ("prev/a", "next/a"),
        ("prev/missing", "next/missing"),
        ("prev/b", "next/taken"),
        ("prev/b", "next/b"),
        ("prev/c", ".ferry-state/c"),
        ("prev/escape", "next/escape"),
        ("prev/out-dir/outside-file", "next/o"),
        ("prev/c", "next/c"),
        ("prev/d", "next/dir"),
        ("prev/.ferry-tmp.x.part", "next/p"),
        ("prev/c", "next/.ferry-tmp.y"),
        ("prev/d/e", "next/d/e"),
    ];
    use ErrorKind::*;
    assert_eq!(
        results(batch(&mut raw, SHARE, &links)),
        [
            None,
            Some(NotFound),
            Some(Exists),
            None,
            Some(InvalidPath),
            Some(InvalidPath),
            Some(OutsideShare),
            None,
            Some(InvalidPath),
            Some(InvalidPath),
            Some(InvalidPath),
            None,
        ]
    );
    for name in ["a", "b", "c", "d/e"] {
        let (from, to) = (
            env.share(&format!("prev/{name}")),
            env.share(&format!("next/{name}")),
        );
        assert!(same_inode(&from, &to), "{name}");
    }
    assert_eq!(fs::read(env.share("next/taken")).unwrap(), b"mine");
    for gone in ["missing", "escape", "o", "dir", "p", ".ferry-tmp.y"] {
        assert!(
            fs::symlink_metadata(env.share(&format!("next/{gone}"))).is_err(),
            "{gone}"
        );
    }
    assert!(!env.share(".ferry-state/c").exists());
    assert_eq!(fs::metadata(&outside).unwrap().nlink(), 1);

    // An empty batch is answered with no results; a whole batch of one name, with one
    // link made and the rest refused as existing.
    assert_eq!(results(batch(&mut raw, SHARE, &[])), []);
    let again: Vec<_> = (0..LINK_BATCH_MAX)
        .map(|_| ("prev/a", "next/again"))
        .collect();
    let got = results(batch(&mut raw, SHARE, &again));
    assert_eq!(got[0], None);
    assert!(got[1..].iter().all(|r| *r == Some(Exists)), "{got:?}");
    assert_eq!(fs::metadata(env.share("prev/a")).unwrap().nlink(), 3);
    // The request as a whole fails only for what concerns all its links.
    match batch(&mut raw, "nope", &links) {
        Response::Error(e) => assert_eq!(e.kind, NoSuchShare),
        other => panic!("{other:?}"),
    }
});

ferrytest!(
    a_batch_on_a_read_only_share_links_nothing,
    shares = [("data", false), ("ro", true)],
    |env| {
        fs::write(env.share_dir("ro").join("f"), b"x").unwrap();
        let mut raw = session(&env);
        assert_eq!(
            results(batch(&mut raw, "ro", &[("f", "g"), ("f", "h")])),
            [Some(ErrorKind::ReadOnly), Some(ErrorKind::ReadOnly)]
        );
        assert!(!env.share_dir("ro").join("g").exists());
    }
);

fn server_requests(env: &Env) -> u64 {
    match session(env).call(Request::Stats) {
        Response::Stats(s) => s.requests,
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_incremental_backup_links_unchanged_files_in_batches() {
    const FILES: u64 = 2000;
    let env = Env::new();
    let src = env.local("src");
    for i in 0..FILES {
        let path = src.join(format!("d{:02}/f{i:04}", i % 20));
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        write_random_file(&path, 1 + (i * 37) % 3000, i);
    }
    let t0 = 1_795_257_009;
    let at = |secs| UNIX_EPOCH + Duration::from_secs(secs);
    let run = |secs| {
        ferry_tests::runtime().block_on(async {
            let c = ferry_tests::connect(env.server(), ferry_tests::test_choice())
                .await
                .unwrap();
            backup(&c, &src, SHARE, "b/host", at(secs), no_progress())
                .await
                .unwrap()
        })
    };
    let first = run(t0);
    assert_eq!(first.files_new, FILES);
    // 1 % changed.
    let changed: Vec<_> = (0..FILES)
        .step_by(100)
        .map(|i| src.join(format!("d{:02}/f{i:04}", i % 20)))
        .collect();
    for p in &changed {
        let mut data = fs::read(p).unwrap();
        data[0] ^= 0x5a;
        fs::write(p, data).unwrap();
    }

    let before = server_requests(&env);
    let second = run(t0 + 60);
    // The Stats request that reads the count is one of them.
    let requests = server_requests(&env) - before - 1;
    assert_eq!(second.files_unchanged, FILES - changed.len() as u64);
    assert_eq!(second.files_changed, changed.len() as u64);
    // Per directory: listings, a mkdir, attributes; per changed file: an upload (open,
    // window, commit); the unchanged files: a few batches. One Link per file would be
    // over 1,980 requests.
    assert!(
        requests < 20 * 4 + changed.len() as u64 * 4 + 40,
        "{requests} requests for {FILES} files"
    );
    let snap = |secs| env.share(&format!("b/host/{}", snapshot_name(at(secs))));
    assert_trees_equal(&src, &snap(t0 + 60));
    let unchanged = "d01/f0001";
    assert!(same_inode(
        &snap(t0).join(unchanged),
        &snap(t0 + 60).join(unchanged)
    ));
    let rel = changed[0].strip_prefix(&src).unwrap();
    assert!(!same_inode(&snap(t0).join(rel), &snap(t0 + 60).join(rel)));
}

/// The backup of `src` at `secs` into `b/host`, with `progress`.
fn backup_at(
    env: &Env,
    src: &Path,
    secs: u64,
    progress: ferry_client::transfer::ProgressFn,
) -> Result<ferry_client::backup::BackupReport, ferry_client::ClientError> {
    ferry_tests::runtime().block_on(async {
        let c = ferry_tests::connect(env.server(), ferry_tests::test_choice())
            .await
            .unwrap();
        let at = UNIX_EPOCH + Duration::from_secs(secs);
        backup(&c, src, SHARE, "b/host", at, progress).await
    })
}

fn snapshot(env: &Env, secs: u64) -> std::path::PathBuf {
    let at = UNIX_EPOCH + Duration::from_secs(secs);
    env.share(&format!("b/host/{}", snapshot_name(at)))
}

/// Every regular file below `dir`, sorted.
fn files_below(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(files_below(&p));
        } else {
            out.push(p);
        }
    }
    out.sort();
    out
}

#[test]
fn a_backup_sends_new_and_changed_small_files_in_batches() {
    let env = Env::new();
    let src = env.local("src");
    let stats = make_many_small_files(&src, 5, 12, 100);
    // Small: at most 64 KiB (the edge file included); then one of 64 KiB + 1 and the
    // three big ones, which go one by one.
    let small = stats.files - 4;
    assert!(small >= 1_000, "{stats:?}");
    let dirs = stats.dirs + 1;
    let t0 = 1_795_257_009;

    let before = server_requests(&env);
    let first = backup_at(&env, &src, t0, no_progress()).unwrap();
    let requests = server_requests(&env) - before - 1;
    assert_eq!(first.files_new, stats.files, "{first:?}");
    assert_eq!(first.bytes_sent, stats.bytes, "{first:?}");
    assert_trees_equal(&src, &snapshot(&env, t0));
    assert_no_temp_files(&env.share(""));
    // Per directory: listings, a mkdir, attributes; the small files: a few batches of
    // up to 256; each of the four others: open, windows, commit. One upload per small
    // file would be over 3,000 requests.
    assert!(
        requests < dirs * 4 + small / 64 + 4 * 6 + 20,
        "{requests} requests for {} files in {dirs} directories: not batched",
        stats.files
    );

    // A quarter of the small files change (same size, other bytes), and a new
    // directory of 100 small files comes.
    let all = files_below(&src);
    let candidates: Vec<_> = all
        .iter()
        .filter(|p| {
            let len = fs::metadata(p).unwrap().len();
            len > 0 && len <= 8192
        })
        .collect();
    let changed: Vec<_> = candidates.iter().step_by(4).collect();
    let mut changed_bytes = 0;
    for p in &changed {
        let mut data = fs::read(p).unwrap();
        data[0] ^= 0x5a;
        changed_bytes += data.len() as u64;
        fs::write(p, data).unwrap();
    }
    fs::create_dir(src.join("fresh")).unwrap();
    let mut new_bytes = 0;
    for i in 0..100u64 {
        let len = 1 + (i * 97) % 6000;
        write_random_file(&src.join(format!("fresh/n{i:03}")), len, 500 + i);
        new_bytes += len;
    }
    assert!(changed.len() >= 250, "{}", changed.len());

    let before = server_requests(&env);
    let second = backup_at(&env, &src, t0 + 60, no_progress()).unwrap();
    let requests = server_requests(&env) - before - 1;
    assert_eq!(second.files_changed, changed.len() as u64, "{second:?}");
    assert_eq!(second.files_new, 100, "{second:?}");
    assert_eq!(
        second.files_unchanged,
        stats.files - changed.len() as u64,
        "{second:?}"
    );
    // Small files go whole, the unchanged ones not at all.
    assert_eq!(second.bytes_sent, changed_bytes + new_bytes, "{second:?}");
    assert_eq!(
        second.bytes_reused,
        stats.bytes - changed_bytes,
        "{second:?}"
    );
    assert_trees_equal(&src, &snapshot(&env, t0 + 60));
    assert_no_temp_files(&env.share(""));
    // Per directory: listings, a mkdir, attributes; a few batches of links and a few
    // of uploads. One upload per changed or new file would be over 1,000 requests.
    assert!(
        requests < (dirs + 1) * 4 + 30,
        "{requests} requests for {} changed and 100 new files: not batched",
        changed.len()
    );
    let rel = |p: &Path| p.strip_prefix(&src).unwrap().to_path_buf();
    let (old, new) = (snapshot(&env, t0), snapshot(&env, t0 + 60));
    let unchanged = candidates[1];
    assert!(same_inode(
        &old.join(rel(unchanged)),
        &new.join(rel(unchanged))
    ));
    let touched = changed[0];
    assert!(!same_inode(
        &old.join(rel(touched)),
        &new.join(rel(touched))
    ));
    assert_ne!(
        fs::read(old.join(rel(touched))).unwrap(),
        fs::read(new.join(rel(touched))).unwrap()
    );
}

/// 1,500 files of 3 KiB in one directory: six batches, four in flight at first, so
/// the last batch starts only after a first one committed its files.
fn make_wide_dir(src: &Path) -> Vec<std::path::PathBuf> {
    let dir = src.join("many");
    fs::create_dir_all(&dir).unwrap();
    (0..1500u64)
        .map(|i| {
            let p = dir.join(format!("f{i:04}"));
            write_random_file(&p, 3000, i);
            p
        })
        .collect()
}

/// A progress function that runs `once` at its first call.
fn at_first_progress(once: impl FnOnce() + Send + 'static) -> ferry_client::transfer::ProgressFn {
    let once = std::sync::Mutex::new(Some(once));
    std::sync::Arc::new(move |_| {
        if let Some(f) = once.lock().unwrap().take() {
            f();
        }
    })
}

#[test]
fn a_small_file_that_vanishes_mid_backup_fails_alone() {
    let env = Env::new();
    let src = env.local("src");
    let files = make_wide_dir(&src);
    let gone = files.last().unwrap().clone();
    let t0 = 1_795_257_009;
    let doomed = gone.clone();
    let err = backup_at(
        &env,
        &src,
        t0,
        at_first_progress(move || fs::remove_file(&doomed).unwrap()),
    )
    .unwrap_err();
    // The file is named, as a per-file upload of it would name it.
    match &err {
        ferry_client::ClientError::Local { path, source, .. } => {
            assert_eq!(path, &gone, "{err}");
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound, "{err}");
        }
        other => panic!("expected a local error about {}: {other}", gone.display()),
    }
    // Nothing published; every other file, those of its batch included, is in the
    // partial snapshot.
    assert!(!snapshot(&env, t0).exists());
    let partial = env.share(&format!(
        "b/host/.partial-{}",
        snapshot_name(UNIX_EPOCH + Duration::from_secs(t0))
    ));
    for p in &files[..files.len() - 1] {
        let rel = p.strip_prefix(&src).unwrap();
        assert_eq!(fs::read(partial.join(rel)).unwrap(), fs::read(p).unwrap());
    }
    assert!(!partial
        .join("many")
        .join(gone.file_name().unwrap())
        .exists());
    assert_no_temp_files(&env.share(""));

    // The next run completes without it, sending nothing again.
    let again = backup_at(&env, &src, t0, no_progress()).unwrap();
    assert_eq!(again.bytes_sent, 0, "{again:?}");
    assert_trees_equal(&src, &snapshot(&env, t0));
}

#[test]
fn a_small_file_that_grows_mid_backup_goes_on_the_per_file_path() {
    let env = Env::new();
    let src = env.local("src");
    let files = make_wide_dir(&src);
    let grown = files.last().unwrap().clone();
    let t0 = 1_795_257_009;
    let target = grown.clone();
    let report = backup_at(
        &env,
        &src,
        t0,
        at_first_progress(move || write_random_file(&target, 3010, 9999)),
    )
    .unwrap();
    assert_eq!(report.files_new, 1500, "{report:?}");
    assert_eq!(report.bytes_sent, 1500 * 3000 + 10, "{report:?}");
    assert_trees_equal(&src, &snapshot(&env, t0));
}
