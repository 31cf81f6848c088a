//! The cluster's metadata saved and restored on a real cluster (etcd, ferryd nodes in
//! network namespaces): `ferry cluster etcd-snapshot FILE` saves etcd's database, the
//! namespace then changes, etcd is restored from the file into a fresh data dir with
//! `etcdctl snapshot restore` (as docs/cluster.md tells an administrator), and every
//! file of the snapshot reads back, byte for byte, the later one is gone; the cluster takes new
//! writes after. A save that cannot write its file fails with the path and leaves
//! nothing behind.
//!
//! Needs root, etcd and etcdctl (skipped otherwise, with the reason; under CI a
//! missing etcdctl fails).

use std::path::Path;

use ferry_tests::{
    assert_files_equal, assert_trees_equal, rcp, rcp_args, skip_without_cluster, write_random_file,
    Cluster, MIB,
};

fn entries_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn metadata_saved_and_restored_into_a_fresh_etcd_reads_back_every_file() {
    let test = "metadata_saved_and_restored_into_a_fresh_etcd_reads_back_every_file";
    if skip_without_cluster(test) || ferry_tests::skip_without_etcdctl(test) {
        return;
    }
    let mut cluster = Cluster::start_with_share(2, "data", 2, 1);
    let local = cluster.dir().join("local");
    let tree = local.join("tree");
    std::fs::create_dir_all(tree.join("a/b")).unwrap();
    write_random_file(&tree.join("big"), 3 * MIB + 17, 1);
    write_random_file(&tree.join("a/small"), 5000, 2);
    write_random_file(&tree.join("a/b/empty"), 0, 3);
    rcp(rcp_args!["-r", &tree, cluster.url("data", "")]).assert_success();
    let first = local.join("first");
    write_random_file(&first, 2 * MIB + 5, 4);
    rcp(rcp_args![&first, cluster.url("data", "f")]).assert_success();

    let saves = cluster.dir().join("saves");
    std::fs::create_dir(&saves).unwrap();
    let snap = saves.join("meta.db");
    let etcd = cluster.etcd_endpoint();
    let out = cluster.ferry([
        "cluster",
        "etcd-snapshot",
        "--etcd",
        &etcd,
        "--json",
        snap.to_str().unwrap(),
    ]);
    out.assert_success();
    let j = out.json();
    let bytes = std::fs::metadata(&snap).unwrap().len();
    assert_eq!(j["bytes"].as_u64(), Some(bytes), "{j}");
    assert!(bytes > 0 && j["revision"].as_i64() > Some(0), "{j}");
    assert_eq!(
        entries_in(&saves),
        ["meta.db"],
        "only the snapshot, no partial"
    );

    // After the save: a new file (its layout is not in the snapshot).
    let second = local.join("second");
    write_random_file(&second, MIB + 9, 5);
    rcp(rcp_args![&second, cluster.url("data", "later")]).assert_success();

    cluster.restore_etcd(&snap);

    // Every file as it was at the save, byte for byte.
    let back = local.join("back");
    rcp(rcp_args!["-r", cluster.url("data", "tree"), &back]).assert_success();
    assert_trees_equal(&tree, &back);
    let f = local.join("f-back");
    rcp(rcp_args![cluster.url("data", "f"), &f]).assert_success();
    assert_files_equal(&first, &f);
    let none = local.join("later-back");
    rcp(rcp_args![cluster.url("data", "later"), &none]).assert_failure();
    assert!(!none.exists());

    // The restored cluster takes writes again.
    rcp(rcp_args![&second, cluster.url("data", "after")]).assert_success();
    let after = local.join("after-back");
    rcp(rcp_args![cluster.url("data", "after"), &after]).assert_success();
    assert_files_equal(&second, &after);

    // A save into a directory that does not exist: a clear error, nothing written.
    let missing = saves.join("no/such/dir/meta.db");
    let out = cluster.ferry([
        "cluster",
        "etcd-snapshot",
        "--etcd",
        &etcd,
        missing.to_str().unwrap(),
    ]);
    out.assert_failure();
    assert!(
        out.stderr.contains("no/such/dir") && out.stderr.contains("create"),
        "{}",
        out.stderr
    );
    assert_eq!(entries_in(&saves), ["meta.db"]);
}
