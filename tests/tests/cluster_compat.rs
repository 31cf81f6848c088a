//! A cluster written by the previous release keeps working: the fixture
//! `tests/fixtures/cluster-v1` (its etcd saved by `ferry cluster etcd-snapshot`, its
//! nodes' stores archived; see its README) is restored into a real cluster (etcd
//! restored with `etcdctl snapshot restore`, the stores unpacked under nodes `n1`
//! and `n2`), and with the current code every file and the backup snapshot read back
//! byte for byte, through rcp and through a cluster mount, a file is written beside
//! them and read back, and `ferry cluster status` finds every stripe replicated.
//!
//! Needs root, etcd, etcdctl and FUSE (skipped otherwise, with the reason; under CI
//! a missing piece fails).

use std::path::{Path, PathBuf};
use std::process::Command;

use ferry_tests::{
    rcp, rcp_args, skip_without_cluster, skip_without_fuse, write_random_file, Cluster, Mount, MIB,
};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/cluster-v1")
}

/// The fixture's file contents (its README): a line repeated to `len` bytes.
fn patterned(path: &Path, len: usize, seed: u8) {
    let line = format!("ferry cluster compatibility fixture, seed {seed}: the quick brown fox\n");
    let data: Vec<u8> = line.bytes().cycle().take(len).collect();
    std::fs::write(path, data).unwrap();
}

/// The tree the fixture's cluster holds at `data/tree` (and in its backup snapshot).
fn expected_tree(root: &Path) {
    std::fs::create_dir_all(root.join("a/b")).unwrap();
    patterned(&root.join("big"), 2 * 1024 * 1024 + 4321, 1);
    patterned(&root.join("a/small"), 5000, 2);
    patterned(&root.join("a/b/empty"), 0, 3);
    std::os::unix::fs::symlink("../big", root.join("a/link")).unwrap();
}

/// Panics unless `got` holds the fixture's tree (bytes, kinds and the link's target;
/// not times: the expected files are made now).
fn assert_fixture_tree(expected: &Path, got: &Path) {
    for f in ["big", "a/small", "a/b/empty"] {
        ferry_tests::assert_files_equal(&expected.join(f), &got.join(f));
    }
    assert!(got.join("a/b").is_dir());
    assert_eq!(
        std::fs::read_link(got.join("a/link")).unwrap(),
        Path::new("../big")
    );
    let mut names: Vec<String> = std::fs::read_dir(got)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["a", "big"], "{}", got.display());
}

/// Replaces node `k`'s store by the fixture's archive of it (the node stopped).
fn unpack_store(cluster: &Cluster, k: usize) {
    let store = cluster.node_store(k);
    std::fs::remove_dir_all(&store).unwrap();
    std::fs::create_dir(&store).unwrap();
    let archive = fixture().join(format!("node{k}.tar.gz"));
    let st = Command::new("tar")
        .arg("-xzf")
        .arg(&archive)
        .arg("-C")
        .arg(&store)
        .status()
        .unwrap();
    assert!(st.success(), "tar -xzf {}", archive.display());
}

#[test]
fn a_cluster_written_by_the_previous_release_reads_back_and_takes_writes() {
    let test = "a_cluster_written_by_the_previous_release_reads_back_and_takes_writes";
    if skip_without_cluster(test)
        || ferry_tests::skip_without_etcdctl(test)
        || skip_without_fuse(test)
    {
        return;
    }
    let mut cluster = Cluster::start_with_share(2, "data", 2, 1);
    assert_eq!(
        (cluster.node_id(1), cluster.node_id(2)),
        ("n1".into(), "n2".into())
    );
    for k in 1..=2 {
        cluster.kill_node(k);
        unpack_store(&cluster, k);
    }
    cluster.restore_etcd(&fixture().join("etcd.db"));
    for k in 1..=2 {
        cluster.start_node(k);
    }

    let local = cluster.dir().join("local");
    let tree = local.join("tree");
    expected_tree(&tree);
    let back = local.join("back");
    rcp(rcp_args!["-r", cluster.url("data", "tree"), &back]).assert_success();
    assert_fixture_tree(&tree, &back);
    let snapshot = "bk/2026-11-28T05-49-49Z";
    let snap_back = local.join("snap");
    rcp(rcp_args!["-r", cluster.url("data", snapshot), &snap_back]).assert_success();
    assert_fixture_tree(&tree, &snap_back);

    // Through a (read-only) mount too.
    let mount = Mount::builder(cluster.url("data", "")).opt("ro").start();
    assert_fixture_tree(&tree, &mount.join("tree"));
    assert_fixture_tree(&tree, &mount.join(snapshot));
    drop(mount);

    // New writes beside the old files, and the old ones replaced.
    let new = local.join("new");
    write_random_file(&new, 3 * MIB + 7, 9);
    rcp(rcp_args![&new, cluster.url("data", "tree/new")]).assert_success();
    rcp(rcp_args![&new, cluster.url("data", "tree/a/small")]).assert_success();
    let again = local.join("again");
    rcp(rcp_args!["-r", cluster.url("data", "tree"), &again]).assert_success();
    ferry_tests::assert_files_equal(&new, &again.join("new"));
    ferry_tests::assert_files_equal(&new, &again.join("a/small"));
    ferry_tests::assert_files_equal(&tree.join("big"), &again.join("big"));

    let status = cluster.status();
    assert_eq!(status["under_replicated"], 0, "{status}");
    assert_eq!(status["unavailable"], 0, "{status}");
}
