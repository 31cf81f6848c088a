//! Directories renamed through a cluster mount (`ferry-mount cluster://...`): one etcd
//! transaction moves the directory's key and every key below it, values unchanged,
//! so no object on the nodes is written or removed; the tree reads back byte for
//! byte at the new place (rcp, a second mount), the old path is gone; rename(2)'s
//! errors (ENOTEMPTY, EINVAL into itself, EBUSY with a file below open for writing);
//! a subtree over the transaction limit gives EXDEV and `mv` moves it by copying;
//! and, on etcd directly, a key created or removed below the source after the read
//! fails the transaction.
//!
//! Needs root, etcd and FUSE (skipped otherwise, with the reason).

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ferry_cluster::meta::Commit;
use ferry_cluster::model::{Entry, EntryKind};
use ferry_cluster::tree_rename::{plan_tree_rename, MAX_TREE_ENTRIES};
use ferry_cluster::{EtcdConfig, Meta};
use ferry_tests::{
    assert_trees_equal, rcp, rcp_args, skip_without_cluster, skip_without_fuse, write_random_file,
    Cluster, Mount, MIB,
};

/// A connection to the cluster's etcd (used on the runtime that made it).
async fn meta(cluster: &Cluster) -> Meta {
    let endpoint = cluster.etcd_endpoint();
    Meta::connect(&EtcdConfig::plain(vec![endpoint]))
        .await
        .expect("etcd")
}

/// Every entry of share `data` at or below `dir`: path below `dir` -> (kind, layout
/// id).
fn entries_below(cluster: &Cluster, dir: &str) -> BTreeMap<String, (EntryKind, Option<String>)> {
    let all = ferry_tests::runtime()
        .block_on(async { meta(cluster).await.all_entries().await })
        .expect("etcd answers");
    all.into_iter()
        .filter_map(|(share, path, v)| {
            let rest = path.strip_prefix(dir)?;
            (share == "data" && (rest.is_empty() || rest.starts_with('/'))).then(|| {
                (
                    rest.to_owned(),
                    (v.entry.kind, v.entry.layout.map(|l| l.id)),
                )
            })
        })
        .collect()
}

/// Every object file on every node, with its size and mtime: what a rename must
/// leave as it is.
fn objects(cluster: &Cluster) -> BTreeMap<PathBuf, (u64, std::time::SystemTime)> {
    fn walk(dir: &Path, out: &mut BTreeMap<PathBuf, (u64, std::time::SystemTime)>) {
        let Ok(rd) = fs::read_dir(dir) else { return };
        for e in rd.flatten() {
            let md = e.metadata().unwrap();
            if md.is_dir() {
                walk(&e.path(), out);
            } else {
                out.insert(e.path(), (md.len(), md.modified().unwrap()));
            }
        }
    }
    let mut out = BTreeMap::new();
    for k in 1..=cluster.node_count() {
        walk(&cluster.node_store(k).join("data"), &mut out);
    }
    out
}

/// The errno of `r`'s error; panics if it succeeded.
#[track_caller]
fn errno_of<T: std::fmt::Debug>(r: std::io::Result<T>) -> i32 {
    r.expect_err("an error")
        .raw_os_error()
        .expect("an OS error")
}

/// A local tree: nested directories, files over a stripe (1 MiB), a symlink, an
/// empty directory.
fn make_tree(tree: &Path) {
    fs::create_dir_all(tree.join("a/b/c")).unwrap();
    fs::create_dir_all(tree.join("empty")).unwrap();
    write_random_file(&tree.join("big"), 3 * MIB + 5, 21);
    write_random_file(&tree.join("a/small"), 4000, 22);
    write_random_file(&tree.join("a/b/c/deep"), MIB + 1, 23);
    std::os::unix::fs::symlink("../big", tree.join("a/link")).unwrap();
}

#[test]
fn a_directory_renames_through_the_mount_in_one_transaction() {
    let name = "a_directory_renames_through_the_mount_in_one_transaction";
    if skip_without_cluster(name) || skip_without_fuse(name) {
        return;
    }
    let started = Instant::now();
    let cluster = Cluster::start_with_share(3, "data", 2, 1);
    let local = cluster.dir().join("local");
    let tree = local.join("src");
    make_tree(&tree);
    let mount = Mount::start(cluster.url("data", ""));
    let other = Mount::builder(cluster.url("data", ""))
        .opt("attr_timeout=0")
        .start();
    let cp = std::process::Command::new("cp")
        .arg("-a")
        .arg(&tree)
        .arg(mount.join("t"))
        .output()
        .expect("cp");
    assert!(cp.status.success(), "cp -a: {cp:?}\n{}", mount.log());
    // The second mount has looked at the tree before the rename.
    assert_trees_equal(&tree, &other.join("t"));
    let before = entries_below(&cluster, "t");
    assert_eq!(before.len(), 9, "{before:?}");
    let objects_before = objects(&cluster);
    assert!(objects_before.len() >= 2 * 6, "{objects_before:?}");
    // A descriptor open for reading across the rename reads on.
    let mut reader = fs::File::open(mount.join("t/big")).unwrap();

    fs::rename(mount.join("t"), mount.join("t2")).expect("rename a directory");

    assert_eq!(
        entries_below(&cluster, "t2"),
        before,
        "same keys, same layouts"
    );
    assert!(
        entries_below(&cluster, "t").is_empty(),
        "the old keys are gone"
    );
    assert_eq!(
        objects(&cluster),
        objects_before,
        "no object written or removed"
    );
    let mut got = Vec::new();
    reader.read_to_end(&mut got).unwrap();
    assert_eq!(got, fs::read(tree.join("big")).unwrap());
    drop(reader);
    let back = local.join("back");
    rcp(rcp_args!["-r", cluster.url("data", "t2"), &back]).assert_success();
    assert_trees_equal(&tree, &back);
    assert_trees_equal(&tree, &mount.join("t2"));
    assert!(!mount.join("t").exists());
    assert_trees_equal(&tree, &other.join("t2"));
    assert!(
        !other.join("t/a/small").exists(),
        "the other mount sees it gone"
    );

    // Onto an empty directory: replaced. Onto a non-empty one: ENOTEMPTY; onto a
    // file: ENOTDIR; into itself: EINVAL.
    fs::create_dir(mount.join("e")).unwrap();
    fs::rename(mount.join("t2"), mount.join("e")).expect("rename onto an empty dir");
    assert_trees_equal(&tree, &mount.join("e"));
    assert!(!mount.join("t2").exists());
    fs::create_dir(mount.join("full")).unwrap();
    fs::write(mount.join("full/f"), b"x").unwrap();
    let r = fs::rename(mount.join("e"), mount.join("full"));
    assert_eq!(errno_of(r), nix::libc::ENOTEMPTY);
    let r = fs::rename(mount.join("e"), mount.join("full/f"));
    assert_eq!(errno_of(r), nix::libc::ENOTDIR);
    let r = fs::rename(mount.join("e"), mount.join("e/a/inside"));
    assert_eq!(errno_of(r), nix::libc::EINVAL);
    assert_trees_equal(&tree, &mount.join("e"));

    // A file below open for writing: EBUSY until it is closed (its staged version
    // would otherwise be published under the old name).
    let mut w = fs::OpenOptions::new()
        .append(true)
        .open(mount.join("e/a/b/c/deep"))
        .unwrap();
    std::io::Write::write_all(&mut w, b"tail").unwrap();
    let r = fs::rename(mount.join("e"), mount.join("moved"));
    assert_eq!(errno_of(r), nix::libc::EBUSY);
    drop(w);
    fs::rename(mount.join("e"), mount.join("moved")).expect("rename after close");
    let mut want = fs::read(tree.join("a/b/c/deep")).unwrap();
    want.extend_from_slice(b"tail");
    assert_eq!(fs::read(other.join("moved/a/b/c/deep")).unwrap(), want);
    assert!(entries_below(&cluster, "e").is_empty());

    for m in [mount, other] {
        let stopped = m.unmount();
        assert!(stopped.graceful, "{stopped:?}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn a_directory_over_the_transaction_limit_gives_exdev_and_mv_copies_it() {
    let name = "a_directory_over_the_transaction_limit_gives_exdev_and_mv_copies_it";
    if skip_without_cluster(name) || skip_without_fuse(name) {
        return;
    }
    let started = Instant::now();
    let cluster = Cluster::start_with_share(2, "data", 1, 1);
    let mount = Mount::start(cluster.url("data", ""));
    // Symlinks: entries of their own, no objects. `fits` is the directory and
    // MAX_TREE_ENTRIES - 1 below it; `over` one more.
    for (dir, below) in [("fits", MAX_TREE_ENTRIES - 1), ("over", MAX_TREE_ENTRIES)] {
        fs::create_dir(mount.join(dir)).unwrap();
        for i in 0..below {
            std::os::unix::fs::symlink(format!("t{i}"), mount.join(&format!("{dir}/l{i}")))
                .unwrap();
        }
        assert_eq!(entries_below(&cluster, dir).len(), below + 1);
    }
    fs::rename(mount.join("fits"), mount.join("fits2")).expect("at the limit: renamed");
    assert_eq!(entries_below(&cluster, "fits2").len(), MAX_TREE_ENTRIES);
    let r = fs::rename(mount.join("over"), mount.join("over2"));
    assert_eq!(errno_of(r), nix::libc::EXDEV, "over the limit");
    assert!(
        mount.log().contains("--max-txn-ops 128"),
        "the log names the limit:\n{}",
        mount.log()
    );
    assert_eq!(entries_below(&cluster, "over").len(), MAX_TREE_ENTRIES + 1);
    let mv = std::process::Command::new("mv")
        .arg(mount.join("over"))
        .arg(mount.join("over2"))
        .output()
        .expect("mv");
    assert!(mv.status.success(), "mv: {mv:?}\n{}", mount.log());
    assert!(entries_below(&cluster, "over").is_empty());
    let moved = entries_below(&cluster, "over2");
    assert_eq!(moved.len(), MAX_TREE_ENTRIES + 1);
    assert_eq!(
        fs::read_link(mount.join("over2/l7")).unwrap(),
        Path::new("t7")
    );
    let stopped = mount.unmount();
    assert!(stopped.graceful, "{stopped:?}");
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "took {:?}",
        started.elapsed()
    );
}

/// A directory or symlink entry.
fn entry(kind: EntryKind) -> Entry {
    Entry {
        kind,
        mode: 0o755,
        mtime: ferry_common::msg::Timestamp::default(),
        size: 0,
        target: (kind == EntryKind::Symlink).then(|| "x".to_owned()),
        layout: None,
    }
}

#[test]
fn a_directory_rename_fails_when_its_subtree_changed_after_the_read() {
    let name = "a_directory_rename_fails_when_its_subtree_changed_after_the_read";
    if skip_without_cluster(name) {
        return;
    }
    let cluster = Cluster::start_with_share(1, "data", 1, 1);
    ferry_tests::runtime().block_on(async {
        let meta = meta(&cluster).await;
        let put = |p: &'static str, kind| {
            let meta = meta.clone();
            async move {
                let done = meta.commit("data", p, &entry(kind), 0).await.unwrap();
                assert!(matches!(done, Commit::Done(_)), "{p}");
            }
        };
        put("d", EntryKind::Dir).await;
        put("d/s", EntryKind::Dir).await;
        put("d/s/l", EntryKind::Symlink).await;
        let plan = |read| plan_tree_rename("data", "d", "e", &read, false).unwrap();

        // A key created below the source since the read: the range compare fails.
        let read = meta.read_tree("data", "d", "e").await.unwrap();
        assert_eq!(read.keys.len(), 3);
        put("d/s/new", EntryKind::Symlink).await;
        let stale = plan(read);
        assert_eq!(meta.apply_tree(&stale).await.unwrap(), Commit::Conflict);

        // A key removed since the read: its own compare fails.
        let read = meta.read_tree("data", "d", "e").await.unwrap();
        let v = meta.entry("data", "d/s/new").await.unwrap().unwrap();
        meta.remove("data", "d/s/new", v.revision).await.unwrap();
        assert_eq!(
            meta.apply_tree(&plan(read)).await.unwrap(),
            Commit::Conflict
        );

        // The target made since the read: its compare fails.
        let read = meta.read_tree("data", "d", "e").await.unwrap();
        put("e", EntryKind::Dir).await;
        assert_eq!(
            meta.apply_tree(&plan(read)).await.unwrap(),
            Commit::Conflict
        );

        // Read again: moved, the empty target replaced, nothing left at the old place.
        let read = meta.read_tree("data", "d", "e").await.unwrap();
        assert!(read.target.is_some());
        assert!(matches!(
            meta.apply_tree(&plan(read)).await.unwrap(),
            Commit::Done(_)
        ));
        assert!(meta.below_all("data", "d").await.unwrap().is_empty());
        assert!(meta.entry("data", "d").await.unwrap().is_none());
        let below: Vec<String> = meta
            .below_all("data", "e")
            .await
            .unwrap()
            .into_iter()
            .map(|(p, _)| p)
            .collect();
        assert_eq!(below, ["e/s", "e/s/l"]);
    });
}

/// A file renamed while it is open for writing through the mount publishes at its new
/// name at close, with every byte written before and after the rename; the old name
/// stays gone (before, the close published it again under the old name).
#[test]
fn a_file_renamed_while_open_for_writing_publishes_at_its_new_name() {
    let name = "a_file_renamed_while_open_for_writing_publishes_at_its_new_name";
    if skip_without_cluster(name) || skip_without_fuse(name) {
        return;
    }
    let cluster = Cluster::start_with_share(2, "data", 1, 1);
    let mount = Mount::start(cluster.url("data", ""));
    let mut f = fs::File::create(mount.join("log")).unwrap();
    std::io::Write::write_all(&mut f, b"before\n").unwrap();
    // Published (fsync publishes), so the rename moves an entry in etcd.
    f.sync_all().unwrap();
    fs::rename(mount.join("log"), mount.join("log.1")).unwrap();
    std::io::Write::write_all(&mut f, b"after\n").unwrap();
    drop(f);
    assert_eq!(fs::read(mount.join("log.1")).unwrap(), b"before\nafter\n");
    let back = cluster.dir().join("back");
    rcp(rcp_args![cluster.url("data", "log.1"), &back]).assert_success();
    assert_eq!(fs::read(&back).unwrap(), b"before\nafter\n");
    let old = cluster.dir().join("old");
    rcp(rcp_args![cluster.url("data", "log"), &old]).assert_failure();
    assert!(
        fs::metadata(mount.join("log")).is_err(),
        "the old name came back at close"
    );
}

/// A file created through the mount and renamed before its first close (not published
/// yet) publishes at its new name only.
#[test]
fn a_new_file_renamed_before_its_close_publishes_at_its_new_name_only() {
    let name = "a_new_file_renamed_before_its_close_publishes_at_its_new_name_only";
    if skip_without_cluster(name) || skip_without_fuse(name) {
        return;
    }
    let cluster = Cluster::start_with_share(2, "data", 1, 1);
    let mount = Mount::start(cluster.url("data", ""));
    let mut f = fs::File::create(mount.join("tmp")).unwrap();
    std::io::Write::write_all(&mut f, b"one\n").unwrap();
    fs::rename(mount.join("tmp"), mount.join("final")).unwrap();
    std::io::Write::write_all(&mut f, b"two\n").unwrap();
    drop(f);
    assert_eq!(fs::read(mount.join("final")).unwrap(), b"one\ntwo\n");
    assert!(
        fs::metadata(mount.join("tmp")).is_err(),
        "the old name exists"
    );
    let back = cluster.dir().join("back");
    rcp(rcp_args![cluster.url("data", "final"), &back]).assert_success();
    assert_eq!(fs::read(&back).unwrap(), b"one\ntwo\n");
    rcp(rcp_args![
        cluster.url("data", "tmp"),
        cluster.dir().join("old")
    ])
    .assert_failure();
}
