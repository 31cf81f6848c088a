//! Looking after backup prefixes (issue 5): the server's `Remove` and `DiskUsage`
//! requests, and `rcp backup --list`, `--keep`, `--keep-days`, the removal of stale
//! partial snapshots and the tidying of a resumed partial snapshot.

use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::{symlink, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ferry_client::backup::{backup, no_progress, snapshot_name, PARTIAL_PREFIX};
use ferry_client::{Client, ClientError};
use ferry_common::msg::{DiskUsage, ErrorKind};
use ferry_tests::{
    assert_trees_equal, ferrytest, make_small_tree, rcp_args, write_random_file, Env, MIB,
};

const SHARE: &str = ferry_tests::DEFAULT_SHARE;

/// Runs `f` with a client-library session to `env`'s server.
fn with_client<T>(env: &Env, f: impl AsyncFnOnce(&Client) -> T) -> T {
    ferry_tests::runtime().block_on(async {
        let c = ferry_tests::connect(env.server(), ferry_tests::test_choice())
            .await
            .unwrap();
        f(&c).await
    })
}

fn remove(env: &Env, share: &str, path: &str, recursive: bool) -> Result<(), ClientError> {
    with_client(env, async |c| c.remove(share, path, recursive).await)
}

fn kind(r: Result<(), ClientError>) -> Option<ErrorKind> {
    r.err().and_then(|e| e.remote_kind())
}

fn exists(p: &Path) -> bool {
    fs::symlink_metadata(p).is_ok()
}

/// A directory outside every share, with a file in it.
fn plant_outside(env: &Env) -> PathBuf {
    let outside = env.root().join("outside");
    fs::create_dir_all(outside.join("deep")).unwrap();
    fs::write(outside.join("keep"), b"must survive").unwrap();
    fs::write(outside.join("deep/keep"), b"must survive too").unwrap();
    outside
}

fn assert_outside_intact(outside: &Path) {
    assert_eq!(fs::read(outside.join("keep")).unwrap(), b"must survive");
    assert_eq!(
        fs::read(outside.join("deep/keep")).unwrap(),
        b"must survive too"
    );
}

ferrytest!(remove_takes_files_links_and_whole_trees, |env| {
    let outside = plant_outside(&env);
    let t = env.share("t");
    fs::create_dir_all(t.join("a/b/c")).unwrap();
    fs::create_dir_all(env.share("kept")).unwrap();
    fs::write(env.share("kept/f"), b"kept").unwrap();
    for i in 0..300 {
        fs::write(t.join(format!("a/f{i}")), b"x").unwrap();
    }
    write_random_file(&t.join("a/b/c/big"), MIB, 1);
    // Symlinks inside the tree, to places outside it: unlinked, never followed.
    symlink(&outside, t.join("a/out-dir")).unwrap();
    symlink(outside.join("keep"), t.join("a/b/out-file")).unwrap();
    symlink("../../kept", t.join("a/b/in-share")).unwrap();
    // A deep chain of directories.
    let mut deep = t.join("deep");
    for _ in 0..200 {
        deep = deep.join("d");
    }
    fs::create_dir_all(&deep).unwrap();
    fs::write(deep.join("leaf"), b"leaf").unwrap();
    fs::write(env.share("file"), b"file").unwrap();
    symlink("kept", env.share("link")).unwrap();

    // A file; a symlink named as the path is removed as a link, its target kept.
    remove(&env, SHARE, "file", false).unwrap();
    assert!(!exists(&env.share("file")));
    remove(&env, SHARE, "link", true).unwrap();
    assert!(!exists(&env.share("link")));
    assert_eq!(fs::read(env.share("kept/f")).unwrap(), b"kept");

    // A directory that is not empty needs `recursive`.
    assert_eq!(
        kind(remove(&env, SHARE, "t", false)),
        Some(ErrorKind::Exists)
    );
    assert!(t.join("a/f0").exists());
    remove(&env, SHARE, "t/a/b/c/big", false).unwrap();
    remove(&env, SHARE, "t/a/b/c", false).unwrap();
    assert!(!exists(&t.join("a/b/c")));

    remove(&env, SHARE, "t", true).unwrap();
    assert!(!exists(&t));
    assert_outside_intact(&outside);
    assert_eq!(fs::read(env.share("kept/f")).unwrap(), b"kept");
    assert_eq!(
        kind(remove(&env, SHARE, "t", true)),
        Some(ErrorKind::NotFound)
    );
});

ferrytest!(
    remove_refuses_the_root_outside_reserved_names_and_read_only_shares,
    shares = [("data", false), ("ro", true)],
    |env| {
        let outside = plant_outside(&env);
        fs::create_dir_all(env.share("sub")).unwrap();
        fs::write(env.share("sub/f"), b"f").unwrap();
        symlink(&outside, env.share("escape")).unwrap();
        symlink("../../outside", env.share("sub/up")).unwrap();
        for reserved in [
            ".ferry-tmp.0123456789abcdef",
            ".ferry-state",
            "sub/.ferry-x",
        ] {
            fs::create_dir_all(env.share(reserved)).unwrap();
        }
        symlink(".ferry-state", env.share("state-link")).unwrap();
        fs::write(env.share_dir("ro").join("f"), b"ro").unwrap();

        use ErrorKind::{InvalidPath, OutsideShare, ReadOnly};
        for (path, want) in [
            ("", InvalidPath),
            (".", InvalidPath),
            ("sub/..", OutsideShare),
            ("../outside", OutsideShare),
            ("/etc", OutsideShare),
            ("escape/keep", OutsideShare),
            ("escape/deep", OutsideShare),
            ("sub/up/keep", OutsideShare),
            (".ferry-tmp.0123456789abcdef", InvalidPath),
            (".ferry-state", InvalidPath),
            (".ferry-state/manifests", InvalidPath),
            ("sub/.ferry-x", InvalidPath),
            // Through a symlink, the reserved directory is still reserved.
            ("state-link/x", InvalidPath),
        ] {
            for recursive in [false, true] {
                let got = kind(remove(&env, SHARE, path, recursive));
                assert_eq!(got, Some(want), "{path:?} recursive={recursive}");
            }
        }
        assert_eq!(kind(remove(&env, "ro", "f", false)), Some(ReadOnly));
        assert!(env.share_dir("ro").join("f").exists());
        for reserved in [
            ".ferry-tmp.0123456789abcdef",
            ".ferry-state",
            "sub/.ferry-x",
        ] {
            assert!(env.share(reserved).is_dir(), "{reserved}");
        }
        assert_outside_intact(&outside);
        // The escaping links themselves are inside the share: removing them is fine.
        remove(&env, SHARE, "escape", true).unwrap();
        remove(&env, SHARE, "sub/up", false).unwrap();
        assert_outside_intact(&outside);
        assert!(env.share("sub/f").exists());
    }
);

ferrytest!(a_removal_racing_a_symlink_swap_stays_in_the_share, |env| {
    let outside = plant_outside(&env);
    let t = env.share("t");
    for d in 0..20 {
        for f in 0..50 {
            let dir = t.join(format!("d{d}"));
            fs::create_dir_all(&dir).unwrap();
            fs::write(dir.join(format!("f{f}")), b"x").unwrap();
        }
    }
    // While the tree is removed, `t/d7/swap` keeps turning from a directory holding
    // a file into a symlink to the outside directory and back.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let swapper = {
        let (stop, swap, outside) = (stop.clone(), t.join("d7/swap"), outside.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let _ = fs::create_dir(&swap).and_then(|()| fs::write(swap.join("keep"), b"in"));
                let _ = fs::remove_dir_all(&swap);
                let _ = symlink(&outside, &swap);
                let _ = fs::remove_file(&swap);
            }
        })
    };
    for _ in 0..3 {
        // Success, or a refusal because the tree changed under the walk: either way
        // nothing outside the share is touched.
        let _ = remove(&env, SHARE, "t", true);
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    swapper.join().unwrap();
    assert_outside_intact(&outside);
    if exists(&t) {
        remove(&env, SHARE, "t", true).unwrap();
    }
    assert!(!exists(&t));
    assert_outside_intact(&outside);
});

/// What `DiskUsage` must report for the tree at `root` (symlinks not followed),
/// computed from local metadata: `unique_bytes` counts an inode when every one of its
/// links is in the tree.
fn expected_usage(root: &Path) -> DiskUsage {
    let mut u = DiskUsage::default();
    let mut linked: HashMap<(u64, u64), (u64, u64, u64)> = HashMap::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(p) = todo.pop() {
        let m = fs::symlink_metadata(&p).unwrap();
        if m.is_dir() {
            u.dirs += 1;
            u.unique_bytes += m.blocks() * 512;
            todo.extend(fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
            continue;
        }
        u.files += 1;
        u.bytes += m.size();
        let e = linked
            .entry((m.dev(), m.ino()))
            .or_insert((0, m.nlink(), m.blocks() * 512));
        e.0 += 1;
    }
    u.unique_bytes += linked
        .values()
        .filter(|(seen, nlink, _)| seen == nlink)
        .map(|(_, _, bytes)| bytes)
        .sum::<u64>();
    u
}

ferrytest!(disk_usage_counts_a_tree_exactly, |env| {
    let outside = plant_outside(&env);
    let t = env.share("t");
    fs::create_dir_all(t.join("sub/empty")).unwrap();
    write_random_file(&t.join("f1"), 5000, 1);
    fs::hard_link(t.join("f1"), t.join("sub/f1-again")).unwrap();
    write_random_file(&t.join("g"), 100_000, 2);
    fs::create_dir_all(env.share("other")).unwrap();
    fs::hard_link(t.join("g"), env.share("other/g")).unwrap();
    write_random_file(&t.join("sub/h"), 3 * MIB, 3);
    symlink("../f1", t.join("sub/l")).unwrap();
    symlink(&outside, t.join("out")).unwrap();

    let du = |path: &str| with_client(&env, async |c| c.disk_usage(SHARE, path).await);
    let got = du("t").unwrap();
    // By hand: f1, its second link, g, h and two symlinks; t, sub and sub/empty.
    let links = ("../f1".len() + outside.as_os_str().len()) as u64;
    assert_eq!((got.files, got.dirs), (6, 3));
    assert_eq!(got.bytes, 5000 * 2 + 100_000 + 3 * MIB + links);
    assert_eq!(got, expected_usage(&t));
    // g has a link outside `t`: it does not count as unique; f1's two links are in.
    let g_bytes = fs::metadata(t.join("g")).unwrap().blocks() * 512;
    assert!(g_bytes > 0);
    fs::remove_file(env.share("other/g")).unwrap();
    let alone = du("t").unwrap();
    assert_eq!(alone.unique_bytes, got.unique_bytes + g_bytes);
    assert_eq!(alone, expected_usage(&t));
    // One file, a link (described, not followed), the whole share.
    let f = du("t/sub/h").unwrap();
    assert_eq!((f.files, f.dirs, f.bytes), (1, 0, 3 * MIB));
    let l = du("t/out").unwrap();
    assert_eq!((l.files, l.dirs), (1, 0));
    assert_eq!(du("").unwrap(), expected_usage(&env.share("")));
    let missing = du("t/none").unwrap_err();
    assert_eq!(missing.remote_kind(), Some(ErrorKind::NotFound));
    let reserved = du(".ferry-state").unwrap_err();
    assert_eq!(reserved.remote_kind(), Some(ErrorKind::InvalidPath));
});

/// Snapshots through the client library, with injected times.
mod library {
    use super::*;

    pub const PREFIX: &str = "backups/host";

    pub fn run_at(env: &Env, src: &Path, time: SystemTime) -> String {
        let report = with_client(env, async |c| {
            backup(c, src, SHARE, PREFIX, time, no_progress()).await
        })
        .unwrap();
        report.snapshot
    }

    /// A copy of `src` as it is now (what a snapshot taken now must hold).
    pub fn freeze(src: &Path, to: &Path) {
        let out = std::process::Command::new("cp")
            .arg("-a")
            .arg(src)
            .arg(to)
            .status()
            .unwrap();
        assert!(out.success());
    }

    /// Changes the source between runs: one file rewritten, one added.
    pub fn change(src: &Path, round: u64) {
        write_random_file(&src.join("a.txt"), 10 + round, 100 + round);
        fs::write(src.join(format!("new{round}")), format!("round {round}")).unwrap();
    }

    pub fn names_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    pub fn ago(days: u64) -> SystemTime {
        SystemTime::now() - Duration::from_secs(days * 86_400)
    }
}

ferrytest!(keep_2_of_4_leaves_the_two_newest_intact, |env| {
    let src = env.local("src");
    make_small_tree(&src, 7);
    // Three snapshots an hour apart in the past, the fourth by rcp now.
    let mut frozen = Vec::new();
    for round in 0..3u64 {
        library::change(&src, round);
        let name = library::run_at(
            &env,
            &src,
            library::ago(1) + Duration::from_secs(3600 * round),
        );
        let copy = env.local(&format!("frozen{round}"));
        library::freeze(&src, &copy);
        frozen.push((name, copy));
    }
    library::change(&src, 3);
    let out = env.rcp(rcp_args![
        "backup",
        "--json",
        "--keep",
        "2",
        &src,
        env.remote(library::PREFIX)
    ]);
    out.assert_success();
    let json = out.json();
    let new = json["targets"][0]["snapshot"].as_str().unwrap().to_string();
    let pruned: Vec<&str> = json["pruned"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(
        pruned,
        [frozen[0].0.as_str(), frozen[1].0.as_str()],
        "{json}"
    );
    assert_eq!(json["prune_errors"], serde_json::json!([]));
    assert_eq!(json["targets"][0]["pruned"].as_array().unwrap().len(), 2);

    let kept = library::names_in(&env.share(library::PREFIX));
    let want: Vec<String> = [&frozen[2].0, &new]
        .iter()
        .map(|p| p.rsplit('/').next().unwrap().to_string())
        .collect();
    assert_eq!(kept, want);
    // The kept snapshots share inodes with the removed ones, and still hold exactly
    // what their sources held.
    assert_trees_equal(&frozen[2].1, &env.share(&frozen[2].0));
    assert_trees_equal(&src, &env.share(&new));
    let b = fs::metadata(env.share(&new).join("sub/b.bin")).unwrap();
    assert_eq!(b.nlink(), 2, "linked in both kept snapshots only");
});

ferrytest!(keep_days_removes_only_what_every_rule_lets_go, |env| {
    let src = env.local("src");
    make_small_tree(&src, 8);
    let mut names = Vec::new();
    for (prefix, days) in [("a", [10, 5, 1]), ("b", [10, 5, 1])] {
        for d in days {
            let report = with_client(&env, async |c| {
                backup(c, &src, SHARE, prefix, library::ago(d), no_progress()).await
            })
            .unwrap();
            names.push(report.snapshot);
        }
    }
    // Only --keep-days 3: the 10- and 5-day-old snapshots go.
    let out = env.rcp(rcp_args![
        "backup",
        "--json",
        "--keep-days",
        "3",
        &src,
        env.remote("a")
    ]);
    out.assert_success();
    assert_eq!(
        out.json()["pruned"],
        serde_json::json!([names[0], names[1]])
    );
    let a = library::names_in(&env.share("a"));
    assert_eq!(a.len(), 2);
    assert_eq!(a[0], names[2].rsplit('/').next().unwrap());
    // --keep 3 and --keep-days 3: the 5-day-old one is among the 3 newest and stays.
    let out = env.rcp(rcp_args![
        "backup",
        "--json",
        "--keep",
        "3",
        "--keep-days",
        "3",
        &src,
        env.remote("b")
    ]);
    out.assert_success();
    assert_eq!(out.json()["pruned"], serde_json::json!([names[3]]));
    assert_eq!(library::names_in(&env.share("b")).len(), 3);
    for kept in &names[4..] {
        assert_trees_equal(&src, &env.share(kept));
    }
    // --keep 0 is refused before anything runs.
    let out = env.rcp(rcp_args!["backup", "--keep", "0", &src, env.remote("b")]);
    out.assert_code(2);
    assert_eq!(library::names_in(&env.share("b")).len(), 3);
});

/// The one JSON array `rcp backup --list --json` prints.
fn json_array(stdout: &str) -> Vec<serde_json::Value> {
    match serde_json::from_str(stdout.trim()) {
        Ok(serde_json::Value::Array(a)) => a,
        other => panic!("expected one JSON array, got {other:?} from {stdout:?}"),
    }
}

ferrytest!(list_shows_snapshots_sizes_and_partials, |env| {
    let src = env.local("src");
    make_small_tree(&src, 9);
    let first = library::run_at(&env, &src, library::ago(2));
    write_random_file(&src.join("sub/b.bin"), MIB + 5, 99);
    let second = library::run_at(&env, &src, library::ago(1));
    // An interrupted run's partial snapshot, made by hand.
    let partial_name = format!("{PARTIAL_PREFIX}{}", snapshot_name(library::ago(0)));
    let partial = env.share(&format!("{}/{partial_name}", library::PREFIX));
    fs::create_dir_all(&partial).unwrap();
    fs::write(partial.join("half"), b"half").unwrap();

    let out = env.rcp(rcp_args![
        "backup",
        "--list",
        env.remote(library::PREFIX),
        "--json"
    ]);
    out.assert_success();
    let list = json_array(&out.stdout);
    assert_eq!(list.len(), 3, "{list:?}");
    for (entry, path, partial) in [
        (&list[0], first.as_str(), false),
        (&list[1], second.as_str(), false),
    ] {
        let want = expected_usage(&env.share(path));
        assert_eq!(entry["path"], path);
        assert_eq!(entry["partial"], partial);
        assert_eq!(entry["files"], want.files);
        assert_eq!(entry["dirs"], want.dirs);
        assert_eq!(entry["bytes"], want.bytes);
        assert_eq!(entry["unique_bytes"], want.unique_bytes);
    }
    // Most files are shared; the changed 1 MiB file is each snapshot's own.
    assert!(list[0]["unique_bytes"].as_u64().unwrap() >= MIB);
    assert_eq!(list[2]["partial"], true);
    assert_eq!(list[2]["files"], 1);
    assert_eq!(list[2]["bytes"], 4);

    let out = env.rcp(rcp_args!["backup", "--list", env.remote(library::PREFIX)]);
    out.assert_success();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{}", out.stdout);
    assert!(lines[0].starts_with(first.rsplit('/').next().unwrap()));
    assert!(lines[1].starts_with(second.rsplit('/').next().unwrap()));
    assert!(lines[2].contains("(partial)"), "{}", lines[2]);
    assert!(lines[0].contains("  4 files  "), "{}", lines[0]);
    // A prefix with nothing in it lists nothing; --list takes no source.
    let out = env.rcp(rcp_args![
        "backup",
        "--list",
        env.remote("nothing"),
        "--json"
    ]);
    out.assert_success();
    assert!(json_array(&out.stdout).is_empty());
    let out = env.rcp(rcp_args!["backup", "--list", env.remote("x"), &src]);
    out.assert_code(2);
});

ferrytest!(stale_partials_go_after_a_successful_run, |env| {
    let src = env.local("src");
    make_small_tree(&src, 10);
    let prefix = env.share(library::PREFIX);
    let stale = prefix.join(format!(
        "{PARTIAL_PREFIX}{}",
        snapshot_name(library::ago(1))
    ));
    let future = SystemTime::now() + Duration::from_secs(86_400);
    let later = prefix.join(format!("{PARTIAL_PREFIX}{}", snapshot_name(future)));
    for p in [&stale, &later] {
        fs::create_dir_all(p.join("sub")).unwrap();
        fs::write(p.join("sub/f"), b"interrupted").unwrap();
    }
    let out = env.rcp(rcp_args![
        "backup",
        "--json",
        &src,
        env.remote(library::PREFIX)
    ]);
    out.assert_success();
    let json = out.json();
    let stale_rel = format!(
        "{}/{}",
        library::PREFIX,
        stale.file_name().unwrap().to_str().unwrap()
    );
    assert_eq!(json["pruned"], serde_json::json!([stale_rel]));
    assert!(!exists(&stale));
    // A partial newer than the new snapshot belongs to no run this one replaces.
    assert!(later.join("sub/f").exists());
    let snapshot = json["targets"][0]["snapshot"].as_str().unwrap();
    assert_trees_equal(&src, &env.share(snapshot));
});

ferrytest!(a_same_timestamp_resume_drops_what_the_source_lost, |env| {
    let src = env.local("src");
    make_small_tree(&src, 11);
    let t = UNIX_EPOCH + Duration::from_secs(1_795_257_009);
    // What an interrupted run of the same timestamp left: files since deleted from
    // the source, a directory where the source now has a file and the reverse.
    let partial = env.share(&format!(
        "{}/{PARTIAL_PREFIX}{}",
        library::PREFIX,
        snapshot_name(t)
    ));
    fs::create_dir_all(partial.join("gone-dir/deeper")).unwrap();
    fs::write(partial.join("gone-dir/deeper/x"), b"x").unwrap();
    fs::write(partial.join("gone"), b"deleted from the source").unwrap();
    fs::create_dir_all(partial.join("a.txt")).unwrap();
    fs::create_dir_all(partial.join("sub")).unwrap();
    fs::write(partial.join("sub/deeper"), b"now a directory in the source").unwrap();
    fs::write(partial.join("sub/old"), b"deleted too").unwrap();

    let snapshot = library::run_at(&env, &src, t);
    assert_trees_equal(&src, &env.share(&snapshot));
    assert!(!exists(&partial));
});
