//! Operating a cluster: a full node is left out of placement and `ferry cluster
//! status` says FULL; `ferry cluster drain` moves every stripe off a node before it
//! is stopped; `ferry cluster rebalance` evens the stripes out after a node is added.
//! Real etcd, real ferryd nodes in network namespaces, files compared byte for byte.
//!
//! Every test needs root and etcd (skipped otherwise, with the reason).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ferry_tests::{
    assert_files_equal, rcp, rcp_args, skip_without_cluster, write_random_file, Cluster, Tmpfs,
    LEASE_TTL, MIB,
};

/// How long a node's changed free space may take to show in etcd: it is refreshed
/// at each renewal of its lease (a third of [`LEASE_TTL`]), plus a slow machine.
const REFRESH: Duration = Duration::from_secs(20);

/// Node `id`'s entry in a `ferry cluster status --json`.
fn node<'a>(status: &'a serde_json::Value, id: &str) -> &'a serde_json::Value {
    status["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .find(|n| n["id"] == id)
        .unwrap_or_else(|| panic!("no node {id} in {status}"))
}

/// Stripe replicas that layouts place on node `id`.
fn stripes_on(status: &serde_json::Value, id: &str) -> u64 {
    node(status, id)["stripes"].as_u64().expect("a count")
}

/// Stripe objects in node `k`'s store (share `data`'s `FAN/ID.INDEX` files).
fn objects_on(cluster: &Cluster, k: usize) -> usize {
    let share = cluster.node_store(k).join("data");
    let Ok(fans) = std::fs::read_dir(share) else {
        return 0;
    };
    fans.flatten()
        .filter_map(|fan| std::fs::read_dir(fan.path()).ok())
        .flat_map(|objects| objects.flatten())
        .filter(|o| !o.file_name().to_string_lossy().starts_with(".ferry"))
        .count()
}

/// Polls `cluster status` until `ok` holds for it, at most `limit`.
#[track_caller]
fn wait_status(cluster: &Cluster, limit: Duration, ok: impl Fn(&serde_json::Value) -> bool) {
    let deadline = Instant::now() + limit;
    loop {
        let s = cluster.status();
        if ok(&s) {
            return;
        }
        assert!(Instant::now() < deadline, "not within {limit:?}: {s}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Writes files of `sizes` bytes under `dir` and uploads each to share `data`; returns
/// (local file, name in the share) pairs.
fn upload(cluster: &Cluster, dir: &Path, tag: &str, sizes: &[u64]) -> Vec<(PathBuf, String)> {
    std::fs::create_dir_all(dir).unwrap();
    sizes
        .iter()
        .enumerate()
        .map(|(i, &size)| {
            let name = format!("{tag}{i}");
            let local = dir.join(&name);
            write_random_file(&local, size, size ^ i as u64);
            rcp(rcp_args![&local, cluster.url("data", &name)]).assert_success();
            (local, name)
        })
        .collect()
}

/// Reads every file back from the cluster and compares it byte for byte.
#[track_caller]
fn read_back(cluster: &Cluster, files: &[(PathBuf, String)], into: &Path) {
    std::fs::create_dir_all(into).unwrap();
    for (local, name) in files {
        let back = into.join(name);
        rcp(rcp_args![cluster.url("data", name), &back]).assert_success();
        assert_files_equal(local, &back);
    }
}

/// Skips `test` where no cluster can run; else starts `nodes` nodes with share `data`
/// (2 replicas, stripes of 1 MiB) and returns it with its etcd endpoint and a local
/// directory for the test's files.
fn start(test: &str, nodes: usize) -> Option<(Cluster, String, PathBuf)> {
    if skip_without_cluster(test) {
        return None;
    }
    let cluster = Cluster::start_with_share(nodes, "data", 2, 1);
    let etcd = cluster.etcd_endpoint();
    let local = cluster.dir().join("local");
    Some((cluster, etcd, local))
}

#[test]
fn a_full_node_gets_no_stripes_and_status_says_full() {
    let test = "a_full_node_gets_no_stripes_and_status_says_full";
    if let Err(e) = Tmpfs::available() {
        eprintln!("{test}: skipped: {e}");
        return;
    }
    let Some((mut cluster, etcd, local)) = start(test, 3) else {
        return;
    };
    // Node 1's store moves to a 64 MiB file system of its own, then nearly fills up:
    // its free space falls below the 2 % it keeps by default (`--min-free`), yet
    // stays above one stripe, so only the reserve keeps stripes off it.
    cluster.kill_node(1);
    let small = Tmpfs::mount(&cluster.node_store(1), 64 * MIB).unwrap();
    cluster.start_node(1);
    let filler = small.path().join("filler");
    let keep = 64 * MIB * 2 / 100;
    write_random_file(&filler, small.free_bytes() - (keep - 128 * 1024), 1);
    let free = small.free_bytes();
    assert!(free < keep && free > MIB, "{free} free");
    wait_status(&cluster, REFRESH, |s| node(s, "n1")["full"] == true);
    let s = cluster.status();
    let n1 = node(&s, "n1");
    assert!(n1["free"].as_u64() <= n1["reserve"].as_u64(), "{s}");
    assert_eq!(n1["live"], true, "{s}");
    let text = cluster.ferry(["cluster", "status", "--etcd", &etcd]);
    let row = text
        .stdout
        .lines()
        .find(|l| l.starts_with("n1 "))
        .unwrap_or("");
    assert!(row.contains("FULL"), "{text}");
    assert!(text.stdout.contains("node n1: FULL"), "{text}");

    // New files go to nodes 2 and 3 only, both replicas of every stripe.
    let files = upload(&cluster, &local, "f", &[5 * MIB + 3, 2 * MIB, 4000]);
    let s = cluster.status();
    assert_eq!(stripes_on(&s, "n1"), 0, "{s}");
    assert_eq!(objects_on(&cluster, 1), 0);
    assert_eq!(stripes_on(&s, "n2"), 9, "{s}");
    assert_eq!(stripes_on(&s, "n3"), 9, "{s}");
    assert_eq!(s["under_replicated"], 0, "{s}");
    read_back(&cluster, &files, &local.join("back"));

    // Space freed on it: it takes stripes again.
    std::fs::remove_file(&filler).unwrap();
    wait_status(&cluster, REFRESH, |s| node(s, "n1")["full"] == false);
    let more = upload(&cluster, &local, "g", &[6 * MIB]);
    assert!(stripes_on(&cluster.status(), "n1") > 0);
    read_back(&cluster, &more, &local.join("back"));
    cluster.kill_node(1);
    drop(small);
}

#[test]
fn a_drained_node_holds_nothing_and_every_file_reads_without_it() {
    let test = "a_drained_node_holds_nothing_and_every_file_reads_without_it";
    let Some((mut cluster, etcd, local)) = start(test, 3) else {
        return;
    };
    let files = upload(
        &cluster,
        &local,
        "f",
        &[5 * MIB + 3, 2 * MIB, 4000, 3 * MIB],
    );
    let held = stripes_on(&cluster.status(), "n2");
    assert!(held > 0);

    let unknown = cluster.ferry(["cluster", "drain", "--etcd", &etcd, "n9"]);
    assert_eq!(unknown.code, Some(2), "{unknown}");
    assert!(unknown.stderr.contains("n9: no such node"), "{unknown}");

    let out = cluster.ferry(["cluster", "drain", "--etcd", &etcd, "n2", "--json"]);
    out.assert_success();
    let r = out.json();
    assert_eq!(r["stripes_moved"].as_u64(), Some(held), "{r}");
    assert_eq!(r["remaining"], 0, "{r}");
    assert!(r["bytes_moved"].as_u64() > Some(0), "{r}");
    let s = cluster.status();
    assert_eq!(stripes_on(&s, "n2"), 0, "{s}");
    assert_eq!(node(&s, "n2")["draining"], true, "{s}");
    assert_eq!(s["under_replicated"], 0, "{s}");
    // Node to node: the new holders fetched the copies themselves.
    let fetched = cluster.node_log(1).matches("replicated").count()
        + cluster.node_log(3).matches("replicated").count();
    assert_eq!(fetched as u64, held, "{}", cluster.logs());

    // While it drains, new files avoid it; a second run has nothing left to do.
    let on_n2 = objects_on(&cluster, 2);
    let more = upload(&cluster, &local, "g", &[4 * MIB]);
    assert_eq!(
        objects_on(&cluster, 2),
        on_n2,
        "a new stripe went to a draining node"
    );
    let again = cluster.ferry(["cluster", "drain", "--etcd", &etcd, "n2", "--json"]);
    again.assert_success();
    assert_eq!(again.json()["stripes_moved"], 0, "{again}");

    // Stopped for good: every file reads back byte for byte without it.
    cluster.kill_node(2);
    read_back(&cluster, &files, &local.join("back"));
    read_back(&cluster, &more, &local.join("back"));
}

#[test]
fn an_added_node_gets_its_share_from_rebalance() {
    let Some((mut cluster, etcd, local)) = start("an_added_node_gets_its_share_from_rebalance", 4)
    else {
        return;
    };
    // Node 4 joins only after the files are written: until then it is not running.
    cluster.kill_node(4);
    cluster.wait_nodes(3, LEASE_TTL * 3 + REFRESH);
    let files = upload(&cluster, &local, "f", &[9 * MIB, 7 * MIB + 1, 4 * MIB, 100]);
    assert_eq!(objects_on(&cluster, 4), 0);
    cluster.start_node(4);
    cluster.wait_nodes(4, REFRESH);
    let s = cluster.status();
    assert_eq!(stripes_on(&s, "n4"), 0, "{s}");
    let total: u64 = (1..=4).map(|k| stripes_on(&s, &format!("n{k}"))).sum();
    assert_eq!(total, 2 * (9 + 8 + 4 + 1), "{s}");

    let dry = cluster.ferry([
        "cluster",
        "rebalance",
        "--etcd",
        &etcd,
        "--dry-run",
        "--json",
    ]);
    dry.assert_success();
    let plan = dry.json();
    let planned = plan["plan"].as_array().expect("a plan").len() as u64;
    assert!(planned >= 9, "{plan}");
    assert_eq!(plan["stripes_moved"], 0, "{plan}");
    assert_eq!(
        stripes_on(&cluster.status(), "n4"),
        0,
        "a dry run moved something"
    );

    let out = cluster.ferry(["cluster", "rebalance", "--etcd", &etcd, "--json"]);
    out.assert_success();
    let r = out.json();
    assert_eq!(r["stripes_moved"].as_u64(), Some(planned), "{r}");
    let spread = r["allowed_spread"].as_u64().expect("a spread");
    let s = cluster.status();
    let counts: Vec<u64> = (1..=4).map(|k| stripes_on(&s, &format!("n{k}"))).collect();
    let (max, min) = (counts.iter().max().unwrap(), counts.iter().min().unwrap());
    assert!(max - min <= spread, "{counts:?}, spread {spread}: {s}");
    assert_eq!(counts.iter().sum::<u64>(), total, "{s}");
    assert_eq!(s["under_replicated"], 0, "{s}");
    assert_eq!(objects_on(&cluster, 4) as u64, counts[3]);

    // Balanced: a second run plans nothing. Every file reads back, also with node 1
    // gone (each stripe has a second copy, on node 4 for the moved ones).
    let again = cluster.ferry(["cluster", "rebalance", "--etcd", &etcd, "--json"]);
    again.assert_success();
    assert_eq!(
        again.json()["plan"].as_array().map(Vec::len),
        Some(0),
        "{again}"
    );
    read_back(&cluster, &files, &local.join("back"));
    cluster.kill_node(1);
    read_back(&cluster, &files, &local.join("back1"));
}

#[test]
fn a_file_rewritten_during_a_drain_keeps_its_new_version() {
    let test = "a_file_rewritten_during_a_drain_keeps_its_new_version";
    let Some((mut cluster, etcd, local)) = start(test, 3) else {
        return;
    };
    let files = upload(&cluster, &local, "f", &[8 * MIB]);
    let held = stripes_on(&cluster.status(), "n2");
    assert!(held >= 3, "{held}");
    // Node 2's link at 2 MB/s: moving its stripes takes seconds, long after the
    // drain read the layout, so the rewrite below lands in the middle of it.
    cluster.limit_rate(2, 2_000_000);
    let drain = ferry_tests::spawn_rcp_binary(
        &ferry_tests::bin("ferry"),
        ["cluster", "drain", "--etcd", &etcd, "n2", "--json"],
    );
    wait_status(&cluster, REFRESH, |s| node(s, "n2")["draining"] == true);
    let new = local.join("new");
    write_random_file(&new, 3 * MIB + 7, 99);
    rcp(rcp_args![&new, cluster.url("data", "f0")]).assert_success();
    let out = drain.wait_at_most(Duration::from_secs(120));
    out.assert_success();
    let r = out.json();
    // The swap failed (the fault fired) and the new version won; it was placed
    // without the draining node, so nothing of the file is left on it.
    let failed = r["failed"].to_string();
    assert!(failed.contains("data/f0: changed during the move"), "{r}");
    assert_eq!(r["remaining"], 0, "{r}");
    assert_eq!(stripes_on(&cluster.status(), "n2"), 0);
    cluster.kill_node(2);
    let back = local.join("back");
    rcp(rcp_args![cluster.url("data", "f0"), &back]).assert_success();
    assert_files_equal(&new, &back);
    assert_eq!(files.len(), 1);
}
