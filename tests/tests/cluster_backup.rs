//! `rcp backup` to a cluster target as complete as to one node (issue 43, point 4):
//! `--list`, `--verify` (every copy of every stripe checked by the node holding it; a
//! copy damaged on one node's disk is named with its stripe, node and chunk),
//! `--dry-run` (etcd and the nodes unchanged), include/exclude rules, and a cluster
//! target beside a node target in one run.
//!
//! Every test needs root and etcd (skipped otherwise, with the reason).

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use ferry_tests::{
    assert_files_equal, assert_trees_equal, rcp, rcp_args, skip_without_cluster, write_random_file,
    Cluster, Server, Share, MIB,
};

/// The regular files under `dir` (relative paths, sorted) with their sizes and mtimes
/// in ns, skipping nothing (a node's whole store); none if `dir` does not exist.
fn files_with_times(dir: &Path) -> BTreeMap<PathBuf, (u64, i128)> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let md = std::fs::symlink_metadata(e.path()).unwrap();
            if md.is_dir() {
                dirs.push(e.path());
            } else {
                let t = md.modified().unwrap();
                let ns = t.duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as i128;
                let rel = e.path().strip_prefix(dir).unwrap().to_path_buf();
                out.insert(rel, (md.len(), ns));
            }
        }
    }
    out
}

/// The relative paths of the regular files under `dir`, sorted.
fn file_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = files_with_times(dir)
        .into_keys()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Every namespace entry of the cluster, with its etcd mod revision.
fn namespace(cluster: &Cluster) -> Vec<(String, String, i64)> {
    cluster.with_meta(|meta| async move {
        let mut all: Vec<_> = meta
            .all_entries()
            .await
            .expect("the namespace")
            .into_iter()
            .map(|(share, path, v)| (share, path, v.revision))
            .collect();
        all.sort();
        all
    })
}

/// The snapshot's name in a backup's `--json` target object (its path's last part).
fn snapshot_name(target: &serde_json::Value) -> String {
    let path = target["snapshot"].as_str().expect("a snapshot path");
    path.rsplit('/').next().unwrap().to_owned()
}

/// A cluster of `nodes` with share `data` (`replicas`, 1 MiB stripes), and a local
/// directory holding the source directory `src` with the directories `dirs`; returns
/// (cluster, local directory, source).
fn cluster_and_source(nodes: usize, replicas: u8, dirs: &[&str]) -> (Cluster, PathBuf, PathBuf) {
    let cluster = Cluster::start_with_share(nodes, "data", replicas, 1);
    let local = cluster.dir().join("local");
    let src = local.join("src");
    for d in dirs {
        std::fs::create_dir_all(src.join(d)).unwrap();
    }
    (cluster, local, src)
}

/// The JSON value (an array too) on `stdout`.
fn json_of(stdout: &str) -> serde_json::Value {
    serde_json::from_str(stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// Restores `cluster`'s snapshot `bk/NAME` of share `data` into a new directory.
fn restore(cluster: &Cluster, name: &str, into: &Path) {
    rcp(rcp_args![
        "-r",
        cluster.url("data", &format!("bk/{name}")),
        into
    ])
    .assert_success();
}

#[test]
fn cluster_snapshots_are_listed_and_verified_by_their_nodes() {
    if skip_without_cluster("cluster_snapshots_are_listed_and_verified_by_their_nodes") {
        return;
    }
    let (cluster, local, src) = cluster_and_source(3, 2, &["d"]);
    write_random_file(&src.join("big"), 2 * MIB + 5, 91);
    write_random_file(&src.join("d/small"), 700, 92);
    std::os::unix::fs::symlink("d/small", src.join("link")).unwrap();
    let target = cluster.url("data", "bk");
    let out = rcp(rcp_args!["backup", "--json", &src, &target]);
    out.assert_success();
    let name = snapshot_name(&out.json()["targets"][0]);

    // --list: the one snapshot, its files (the symlink counted, as on a node) and
    // bytes; its unique bytes are every replica of every stripe.
    let out = rcp(rcp_args!["backup", "--list", &target, "--json"]);
    out.assert_success();
    let list = json_of(&out.stdout);
    assert_eq!(list.as_array().map(Vec::len), Some(1), "{list}");
    let s = &list[0];
    assert_eq!(s["name"], name.as_str(), "{list}");
    assert_eq!(s["path"], format!("bk/{name}"), "{list}");
    assert_eq!(s["partial"], false, "{list}");
    assert_eq!(s["files"], 3, "{list}");
    assert_eq!(s["dirs"], 2, "{list}");
    let bytes = 2 * MIB + 5 + 700 + "d/small".len() as u64;
    assert_eq!(s["bytes"].as_u64(), Some(bytes), "{list}");
    assert_eq!(
        s["unique_bytes"].as_u64(),
        Some(2 * (2 * MIB + 5 + 700)),
        "{list}"
    );
    let out = rcp(rcp_args!["backup", "--list", &target]);
    out.assert_success();
    assert!(
        out.stdout.starts_with(&format!("{name}  3 files")),
        "{}",
        out.stdout
    );

    // --verify of a sound snapshot (the newest, and the one named).
    for t in [target.clone(), format!("{target}/{name}")] {
        let out = rcp(rcp_args!["backup", "--json", "--verify", &t]);
        out.assert_success();
        let j = out.json();
        assert_eq!(
            (j["files"].as_u64(), j["verified"].as_u64()),
            (Some(2), Some(2)),
            "{j}"
        );
        assert_eq!(j["damaged"].as_array().map(Vec::len), Some(0), "{j}");
        assert_eq!(j["errors"].as_array().map(Vec::len), Some(0), "{j}");
    }

    // One byte of one copy of the big file's second stripe flipped on its node's disk:
    // the node that holds it finds it, by stripe and chunk; the other copy is sound.
    let layout = cluster.layout_of("data", &format!("bk/{name}/big"));
    let node = layout.stripes[1].replicas[0].clone();
    let k: usize = node.strip_prefix('n').unwrap().parse().unwrap();
    let object = layout.object_path("data", 1);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(cluster.node_store(k).join(&object))
        .unwrap();
    let mut byte = [0u8; 1];
    f.read_exact_at(&mut byte, 4321).unwrap();
    f.write_all_at(&[byte[0] ^ 0x5a], 4321).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let out = rcp(rcp_args!["backup", "--json", "--verify", &target]);
    assert_eq!(out.code, Some(9), "damage found: {}", out.stderr);
    let j = out.json();
    assert_eq!(j["verified"].as_u64(), Some(1), "{j}");
    let damaged = j["damaged"].as_array().unwrap();
    assert_eq!(damaged.len(), 1, "{j}");
    let d = &damaged[0];
    assert_eq!(d["path"], "big", "{j}");
    assert_eq!(d["node"], node.as_str(), "{j}");
    assert_eq!(d["stripe"], 1, "{j}");
    assert_eq!(d["object"], object.as_str(), "{j}");
    assert_eq!(d["bad_chunks"], serde_json::json!([0]), "{j}");
    let out = rcp(rcp_args!["backup", "--verify", &target]);
    assert_eq!(out.code, Some(9), "{}", out.stderr);
    assert!(
        out.stderr.contains(&format!(
            "damaged: bk/{name}/big: stripe 1 on node {node} (object {object}): chunks 0 of"
        )),
        "{}",
        out.stderr
    );
    // The file still reads back whole, from the sound copy.
    let back = local.join("back");
    restore(&cluster, &name, &back);
    assert_files_equal(&src.join("big"), &back.join("big"));
}

#[test]
fn cluster_dry_runs_write_nothing_and_rules_choose_the_files() {
    if skip_without_cluster("cluster_dry_runs_write_nothing_and_rules_choose_the_files") {
        return;
    }
    let (cluster, local, src) = cluster_and_source(2, 2, &["cache", "d"]);
    write_random_file(&src.join("big"), MIB + 3, 1);
    write_random_file(&src.join("keep.log"), 100, 2);
    write_random_file(&src.join("drop.log"), 200, 3);
    write_random_file(&src.join("d/a.tmp"), 300, 4);
    write_random_file(&src.join("d/y"), 400, 5);
    write_random_file(&src.join("cache/x"), 500, 6);
    let target = cluster.url("data", "bk");
    // Of the *.log files only keep.log; no *.tmp; not the directory cache.
    let rules = rcp_args![
        "--exclude",
        "*.tmp",
        "--exclude",
        "cache/",
        "--include",
        "keep.log",
        "--exclude",
        "*.log"
    ];

    // A dry run of a first backup: nothing at all is written.
    let before = namespace(&cluster);
    let out = rcp([
        rcp_args!["backup", "--json", "--dry-run", &src, &target],
        rules.clone(),
    ]
    .concat());
    out.assert_success();
    let j = out.json();
    assert_eq!(j["dry_run"], true, "{j}");
    assert_eq!(j["files_new"], 3, "{j}");
    assert_eq!(namespace(&cluster), before, "a dry run wrote to etcd");
    assert!(file_names(&cluster.node_store(1).join("data")).is_empty());

    // The rules choose exactly big, d/y and keep.log.
    let out = rcp([rcp_args!["backup", "--json", &src, &target], rules.clone()].concat());
    out.assert_success();
    let j = out.json();
    assert_eq!(
        (j["files_scanned"].as_u64(), j["files_new"].as_u64()),
        (Some(3), Some(3)),
        "{j}"
    );
    let name = snapshot_name(&j["targets"][0]);
    let back = local.join("back");
    restore(&cluster, &name, &back);
    assert_eq!(file_names(&back), ["big", "d/y", "keep.log"]);
    for f in ["big", "d/y", "keep.log"] {
        assert_files_equal(&src.join(f), &back.join(f));
    }

    // A dry run of the next one counts what a run would do, and writes nothing: not
    // an entry (nor a revision) in etcd, not an object on a node, no shared mark.
    // (Snapshot names are UTC seconds: the next one needs the next second.)
    std::thread::sleep(std::time::Duration::from_millis(1100));
    write_random_file(&src.join("d/y"), 450, 7);
    write_random_file(&src.join("n"), 600, 8);
    std::fs::remove_file(src.join("keep.log")).unwrap();
    let before = namespace(&cluster);
    let stores: Vec<_> = (1..=2)
        .map(|k| files_with_times(&cluster.node_store(k)))
        .collect();
    let big = cluster.layout_of("data", &format!("bk/{name}/big"));
    let out = rcp([
        rcp_args!["backup", "--json", "-n", &src, &target],
        rules.clone(),
    ]
    .concat());
    out.assert_success();
    let j = out.json();
    assert_eq!(j["dry_run"], true, "{j}");
    let counts = [
        "files_scanned",
        "files_unchanged",
        "files_changed",
        "files_new",
        "files_deleted",
    ]
    .map(|k| j[k].as_u64().unwrap_or(u64::MAX));
    assert_eq!(counts, [3, 1, 1, 1, 1], "{j}");
    assert_eq!(j["bytes_sent"].as_u64(), Some(2 * (450 + 600)), "{j}");
    assert_eq!(j["targets"][0]["previous"], format!("bk/{name}"), "{j}");
    assert_eq!(namespace(&cluster), before, "a dry run wrote to etcd");
    for (k, store) in (1..=2).zip(&stores) {
        assert_eq!(
            &files_with_times(&cluster.node_store(k)),
            store,
            "node {k} changed"
        );
    }
    let shared = cluster.with_meta(|meta| async move { meta.is_shared(&big.id).await.unwrap() });
    assert!(!shared, "a dry run marked a layout shared");
    let out = rcp(rcp_args!["backup", "--json", "--list", &target]);
    assert_eq!(
        json_of(&out.stdout).as_array().map(Vec::len),
        Some(1),
        "{}",
        out.stdout
    );
}

#[test]
fn one_run_backs_up_to_a_cluster_and_a_node() {
    if skip_without_cluster("one_run_backs_up_to_a_cluster_and_a_node") {
        return;
    }
    let (cluster, local, src) = cluster_and_source(2, 1, &["d/e"]);
    write_random_file(&src.join("big"), 2 * MIB + 77, 21);
    write_random_file(&src.join("d/small"), 333, 22);
    write_random_file(&src.join("d/e/tiny"), 1, 23);
    std::os::unix::fs::symlink("../big", src.join("d/up")).unwrap();
    let node_dir = local.join("node-share");
    std::fs::create_dir_all(&node_dir).unwrap();
    let server = Server::start(&[Share::rw("bk", &node_dir)]);
    let to_cluster = cluster.url("data", "bk");
    let to_node = server.remote("bk", "snaps");

    let out = rcp(rcp_args![
        "backup",
        "--json",
        &src,
        &to_cluster,
        "--to",
        &to_node
    ]);
    out.assert_success();
    let j = out.json();
    let targets = j["targets"].as_array().unwrap();
    assert_eq!(targets.len(), 2, "{j}");
    assert!(targets.iter().all(|t| t["ok"] == true), "{j}");
    assert_eq!(targets[0]["target"], to_cluster.as_str(), "{j}");
    assert_eq!(targets[0]["files_new"], 3, "{j}");
    assert_eq!(targets[1]["files_new"], 3, "{j}");
    // One timestamp for both targets.
    let name = snapshot_name(&targets[0]);
    assert_eq!(snapshot_name(&targets[1]), name, "{j}");
    let back = local.join("back");
    restore(&cluster, &name, &back);
    assert_trees_equal(&src, &back);
    assert_trees_equal(&src, &node_dir.join("snaps").join(&name));

    // Each target lists and verifies its own snapshot.
    for t in [&to_cluster, &to_node] {
        let out = rcp(rcp_args!["backup", "--json", "--list", t]);
        out.assert_success();
        assert_eq!(
            json_of(&out.stdout)[0]["name"],
            name.as_str(),
            "{t}: {}",
            out.stdout
        );
        let out = rcp(rcp_args!["backup", "--json", "--verify", t]);
        out.assert_success();
        assert_eq!(out.json()["verified"], 3, "{t}: {}", out.stdout);
    }
}
