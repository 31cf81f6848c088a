//! `LinkBatch`: many hard links in one request, each failing alone; and a backup's
//! unchanged files going to the server in batches rather than one `Link` each.

use std::fs;
use std::os::unix::fs::{symlink, MetadataExt};
use std::path::Path;
use std::time::{Duration, UNIX_EPOCH};

use ferry_client::backup::{backup, no_progress, snapshot_name};
use ferry_common::msg::{ErrorKind, Request, Response, LINK_BATCH_MAX};
use ferry_tests::{
    assert_trees_equal, ferrytest, raw_handshake, raw_socket, write_random_file, Env, RawClient,
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
