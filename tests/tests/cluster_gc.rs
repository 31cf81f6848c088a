//! `ferry cluster gc` on a real cluster (etcd, ferryd nodes in network namespaces):
//! the objects of an interrupted upload, of a removed file and of a removed snapshot
//! are collected once past the grace period, and only they; `--dry-run` removes
//! nothing and reports the same set; `--json` counts the bytes of what it removed; a
//! resumed copy refreshes the objects it reuses; every file left reads back.
//!
//! Every test needs root and etcd (skipped otherwise, with the reason).

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

use ferry_tests::{
    assert_files_equal, assert_trees_equal, ferry, rcp, rcp_args, skip_without_cluster,
    write_random_file, Cluster, MIB,
};

/// (node id, object path in the store share) of every stripe object on the nodes.
fn objects(cluster: &Cluster) -> BTreeMap<(String, String), u64> {
    cluster.objects()
}

/// The objects of `layout` (a file of share `data`) on their replicas.
fn layout_objects(layout: &ferry_cluster::model::Layout) -> BTreeSet<(String, String)> {
    let mut out = BTreeSet::new();
    for (i, s) in layout.stripes.iter().enumerate() {
        for node in &s.replicas {
            out.insert((node.clone(), layout.object_path("data", i)));
        }
    }
    out
}

/// `ferry cluster gc --json ARGS...`, which must succeed.
fn gc(cluster: &Cluster, args: &[&str]) -> serde_json::Value {
    let etcd = cluster.etcd_endpoint();
    let mut all = vec!["cluster", "gc", "--etcd", &etcd, "--json"];
    all.extend_from_slice(args);
    let out = ferry(all);
    out.assert_success();
    out.json()
}

/// The (node, object) pairs a gc report says it removed, and their bytes.
fn removed(report: &serde_json::Value) -> (BTreeSet<(String, String)>, u64) {
    let mut set = BTreeSet::new();
    for n in report["nodes"].as_array().unwrap() {
        for o in n["removed_objects"].as_array().unwrap() {
            set.insert((
                n["id"].as_str().unwrap().to_owned(),
                o.as_str().unwrap().to_owned(),
            ));
        }
    }
    (set, report["removed"]["bytes"].as_u64().unwrap())
}

/// Removes entries of share `data` the way a client that died between removing a
/// name and removing its objects leaves them: `path` itself and everything below.
fn remove_entries(cluster: &Cluster, path: &str) {
    cluster.with_meta(|meta| async move {
        meta.remove_below("data", path).await.expect("remove below");
        let v = meta.existing("data", path).await.expect("the entry");
        let done = meta.remove("data", path, v.revision).await.expect("remove");
        assert!(matches!(done, ferry_cluster::meta::Commit::Done(_)));
    });
}

/// Waits until node `k` has closed every client connection (the killed rcp's): a
/// commit it had sent is then done, so no object appears later.
fn wait_sessions_closed(cluster: &Cluster, k: usize) {
    let port = cluster.node_addr(k).rsplit_once(':').unwrap().1.to_owned();
    let filter = format!("( sport = :{port} )");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut ss = cluster.command_in(k, "ss");
        ss.args([
            "-Htn",
            "state",
            "established",
            "state",
            "close-wait",
            &filter,
        ]);
        let out = ferry_tests::run_tool(&mut ss, Duration::from_secs(10));
        if out.stdout.trim().is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "node {k} keeps connections: {}",
            out.stdout
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts an upload of `src` to `data/NAME` over slowed links and SIGKILLs it once
/// at least one of its objects is on a node. Returns the objects it left (the fault
/// fired: rcp was still running, objects exist, no entry was committed).
fn interrupted_upload(
    cluster: &Cluster,
    src: &Path,
    name: &str,
) -> BTreeMap<(String, String), u64> {
    let before = objects(cluster);
    for k in 1..=cluster.node_count() {
        cluster.limit_rate(k, 10_000_000);
    }
    let mut up = ferry_tests::spawn_rcp(rcp_args![src, cluster.url("data", name)]);
    let deadline = Instant::now() + Duration::from_secs(60);
    let left = loop {
        let now: BTreeMap<_, _> = objects(cluster)
            .into_iter()
            .filter(|(k, _)| !before.contains_key(k))
            .collect();
        if !now.is_empty() {
            break now;
        }
        assert!(
            up.is_running(),
            "the upload ended before any object was seen"
        );
        assert!(Instant::now() < deadline, "no object appeared in 60 s");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(up.is_running(), "the upload ended before it was killed");
    up.kill();
    for k in 1..=cluster.node_count() {
        cluster.limit_rate(k, 2_000_000_000);
        wait_sessions_closed(cluster, k);
    }
    // No entry: the download fails.
    let none = cluster.dir().join(format!("none-{name}"));
    rcp(rcp_args![cluster.url("data", name), &none]).assert_failure();
    // What the kill left, read again now that rcp is gone (a node publishes an
    // object only at the client's commit: nothing appears after the kill).
    let after: BTreeMap<_, _> = objects(cluster)
        .into_iter()
        .filter(|(k, _)| !before.contains_key(k))
        .collect();
    assert!(after.len() >= left.len(), "{after:?} {left:?}");
    after
}

#[test]
fn an_interrupted_upload_is_collected_only_past_the_grace_period() {
    if skip_without_cluster("an_interrupted_upload_is_collected_only_past_the_grace_period") {
        return;
    }
    let cluster = Cluster::start_with_share(2, "data", 2, 1);
    let local = cluster.dir().join("local");
    std::fs::create_dir_all(&local).unwrap();
    let keep = local.join("keep");
    write_random_file(&keep, 3 * MIB + 5, 71);
    rcp(rcp_args![&keep, cluster.url("data", "keep")]).assert_success();
    let kept = layout_objects(&cluster.layout_of("data", "keep"));
    let big = local.join("big");
    write_random_file(&big, 40 * MIB, 72);

    let left = interrupted_upload(&cluster, &big, "big");
    let left_set: BTreeSet<_> = left.keys().cloned().collect();
    let left_bytes: u64 = left.values().sum();

    // The default grace period keeps them: young, not removed.
    let j = gc(&cluster, &[]);
    assert_eq!(j["removed"]["objects"], 0, "{j}");
    assert_eq!(
        j["young"]["objects"].as_u64(),
        Some(left.len() as u64),
        "{j}"
    );
    assert_eq!(j["grace_secs"], 24 * 3600, "{j}");
    // repair runs gc too, with the default grace period.
    let etcd = cluster.etcd_endpoint();
    let r = ferry(["cluster", "repair", "--etcd", &etcd, "--json"]);
    r.assert_success();
    let r = r.json();
    assert_eq!(r["gc"]["removed"]["objects"], 0, "{r}");
    assert_eq!(
        r["gc"]["young"]["objects"].as_u64(),
        Some(left.len() as u64),
        "{r}"
    );
    let text = ferry(["cluster", "repair", "--etcd", &etcd]);
    text.assert_success();
    assert!(text.stdout.contains("gc (grace 86400s)"), "{}", text.stdout);

    // --dry-run with grace 0 names exactly the interrupted upload's objects, and
    // removes nothing.
    let on_disk = objects(&cluster);
    let dry = gc(&cluster, &["--grace", "0", "--dry-run"]);
    assert_eq!(dry["dry_run"], true);
    assert_eq!(removed(&dry), (left_set.clone(), left_bytes), "{dry}");
    assert_eq!(objects(&cluster), on_disk, "--dry-run removed something");

    // gc --grace 0 removes them, and only them.
    let j = gc(&cluster, &["--grace", "0"]);
    assert_eq!(removed(&j), (left_set.clone(), left_bytes), "{j}");
    let now = objects(&cluster);
    assert!(left_set.iter().all(|o| !now.contains_key(o)), "{now:?}");
    let expected: BTreeSet<_> = on_disk
        .keys()
        .filter(|o| !left_set.contains(*o))
        .cloned()
        .collect();
    assert_eq!(now.keys().cloned().collect::<BTreeSet<_>>(), expected);
    assert_eq!(expected, kept);
    eprintln!(
        "gc reclaimed {left_bytes} bytes in {} objects of an interrupted upload",
        left.len()
    );

    // Interrupted again, then resumed: the objects it reuses are refreshed (their
    // ctime moves: gc's grace starts again), and gc then finds nothing to take.
    let left = interrupted_upload(&cluster, &big, "big");
    let ctimes: BTreeMap<_, _> = left
        .keys()
        .map(|(node, o)| {
            let k = (1..=2).find(|k| &cluster.node_id(*k) == node).unwrap();
            let md = std::fs::metadata(cluster.node_store(k).join(o)).unwrap();
            ((node.clone(), o.clone()), (md.ctime(), md.ctime_nsec()))
        })
        .collect();
    let again = rcp(rcp_args!["--json", &big, cluster.url("data", "big")]);
    again.assert_success();
    assert!(
        again.json()["bytes_reused"].as_u64().unwrap() > 0,
        "{}",
        again.stdout
    );
    for ((node, o), before) in &ctimes {
        let k = (1..=2).find(|k| &cluster.node_id(*k) == node).unwrap();
        let md = std::fs::metadata(cluster.node_store(k).join(o)).unwrap();
        assert!(
            (md.ctime(), md.ctime_nsec()) > *before,
            "{node} {o} not refreshed"
        );
    }
    let j = gc(&cluster, &["--grace", "0"]);
    assert_eq!(j["removed"]["objects"], 0, "{j}");

    // Every file reads back, byte for byte.
    for (name, src) in [("keep", &keep), ("big", &big)] {
        let back = local.join(format!("back-{name}"));
        rcp(rcp_args![cluster.url("data", name), &back]).assert_success();
        assert_files_equal(src, &back);
    }
}

#[test]
fn removed_files_and_snapshots_lose_their_objects_and_the_rest_reads_back() {
    if skip_without_cluster(
        "removed_files_and_snapshots_lose_their_objects_and_the_rest_reads_back",
    ) {
        return;
    }
    let cluster = Cluster::start_with_share(3, "data", 2, 1);
    let local = cluster.dir().join("local");
    let src = local.join("src");
    std::fs::create_dir_all(src.join("d")).unwrap();
    for (name, size, seed) in [("a", 3 * MIB + 5, 81), ("b", 2 * MIB, 82)] {
        write_random_file(&local.join(name), size, seed);
        rcp(rcp_args![local.join(name), cluster.url("data", name)]).assert_success();
    }
    write_random_file(&src.join("big"), 3 * MIB + 9, 83);
    write_random_file(&src.join("d/small"), 777, 84);
    let target = cluster.url("data", "bk");
    let backup = || {
        let out = rcp(rcp_args!["backup", "--json", &src, &target]);
        out.assert_success();
        let path = out.json()["targets"][0]["snapshot"]
            .as_str()
            .unwrap()
            .to_owned();
        path.rsplit('/').next().unwrap().to_owned()
    };
    let snap1 = backup();
    let small1 = layout_objects(&cluster.layout_of("data", &format!("bk/{snap1}/d/small")));
    let big1 = layout_objects(&cluster.layout_of("data", &format!("bk/{snap1}/big")));
    // A second snapshot: the small file changed, the big one is linked (shared).
    std::thread::sleep(Duration::from_millis(1100));
    write_random_file(&src.join("d/small"), 900, 85);
    let snap2 = backup();
    assert_ne!(snap1, snap2);
    assert_eq!(
        layout_objects(&cluster.layout_of("data", &format!("bk/{snap2}/big"))),
        big1,
        "the unchanged file is linked"
    );
    let a = layout_objects(&cluster.layout_of("data", "a"));

    // File a and the first snapshot lose their entries, not their objects (a client
    // that died before removing them).
    let on_disk = objects(&cluster);
    remove_entries(&cluster, "a");
    remove_entries(&cluster, &format!("bk/{snap1}"));
    let garbage: BTreeSet<_> = a.union(&small1).cloned().collect();
    assert!(garbage.iter().all(|o| on_disk.contains_key(o)));
    let garbage_bytes: u64 = garbage.iter().map(|o| on_disk[o]).sum();

    let dry = gc(&cluster, &["--grace", "0", "--dry-run"]);
    assert_eq!(removed(&dry), (garbage.clone(), garbage_bytes), "{dry}");
    assert_eq!(objects(&cluster), on_disk, "--dry-run removed something");

    let j = gc(&cluster, &["--grace", "0"]);
    assert_eq!(removed(&j), (garbage.clone(), garbage_bytes), "{j}");
    assert_eq!(
        j["found"]["objects"].as_u64(),
        Some(on_disk.len() as u64),
        "{j}"
    );
    let expected: BTreeSet<_> = on_disk
        .keys()
        .filter(|o| !garbage.contains(*o))
        .cloned()
        .collect();
    assert_eq!(
        objects(&cluster).keys().cloned().collect::<BTreeSet<_>>(),
        expected
    );
    // The big file's objects stay: the second snapshot still names them.
    assert!(big1.iter().all(|o| expected.contains(o)));
    eprintln!(
        "gc reclaimed {garbage_bytes} bytes in {} objects of a removed file and snapshot",
        garbage.len()
    );
    // Nothing more to take.
    assert_eq!(gc(&cluster, &["--grace", "0"])["removed"]["objects"], 0);

    // What is left reads back byte for byte; what was removed is gone.
    let back = local.join("back-b");
    rcp(rcp_args![cluster.url("data", "b"), &back]).assert_success();
    assert_files_equal(&local.join("b"), &back);
    let tree = local.join("back-snap2");
    rcp(rcp_args![
        "-r",
        cluster.url("data", &format!("bk/{snap2}")),
        &tree
    ])
    .assert_success();
    assert_trees_equal(&src, &tree);
    rcp(rcp_args![cluster.url("data", "a"), local.join("back-a")]).assert_failure();
}

#[test]
fn bad_grace_is_a_usage_error() {
    let out = ferry(["cluster", "gc", "--etcd", "127.0.0.1:1", "--grace", "soon"]);
    out.assert_code(2);
}

/// Changes one byte of the local file `path` at `at` (and its mtime, as an editor's
/// write does).
fn change_byte(path: &Path, at: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .read(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x5a], at).unwrap();
}

/// Copy-on-write per stripe: a re-run `rcp` of a file whose middle stripe changed
/// sends that stripe only (to each of its replicas) and names the older version's
/// objects for the others; the replaced stripe's objects go, gc keeps every reused
/// one, and the file reads back byte for byte after each version.
#[test]
fn a_rerun_copy_sends_only_the_changed_stripe_and_gc_keeps_the_reused_ones() {
    if skip_without_cluster(
        "a_rerun_copy_sends_only_the_changed_stripe_and_gc_keeps_the_reused_ones",
    ) {
        return;
    }
    let cluster = Cluster::start_with_share(3, "data", 2, 1);
    let local = cluster.dir().join("f");
    let back = cluster.dir().join("back");
    write_random_file(&local, 5 * MIB + 7, 91);
    let up = || {
        let out = rcp(rcp_args!["--json", &local, cluster.url("data", "f")]);
        out.assert_success();
        out.json()
    };
    let reads_back = || {
        let _ = std::fs::remove_file(&back);
        rcp(rcp_args![cluster.url("data", "f"), &back]).assert_success();
        assert_files_equal(&local, &back);
    };
    let first = up();
    assert_eq!(
        (
            first["stripes_sent"].as_u64(),
            first["stripes_reused"].as_u64()
        ),
        (Some(6), Some(0)),
        "{first}"
    );
    let a = cluster.layout_of("data", "f");
    let before = objects(&cluster);

    change_byte(&local, 2 * MIB + 12345);
    let second = up();
    assert_eq!(second["stripes_sent"].as_u64(), Some(1), "{second}");
    assert_eq!(second["stripes_reused"].as_u64(), Some(5), "{second}");
    assert_eq!(
        second["bytes_sent"].as_u64(),
        Some(2 * MIB),
        "one stripe, to 2 replicas: {second}"
    );
    let b = cluster.layout_of("data", "f");
    assert_ne!(a.id, b.id);
    for i in 0..6 {
        if i == 2 {
            assert!(b.is_own(i), "the changed stripe is a new object");
        } else {
            assert_eq!(b.stripes[i].object.as_deref(), Some(a.id.as_str()));
            assert_eq!(b.object_path("data", i), a.object_path("data", i));
            assert_eq!(b.stripes[i].replicas, a.stripes[i].replicas);
        }
    }
    let after = objects(&cluster);
    let only = |layout: &ferry_cluster::model::Layout, i| -> BTreeSet<(String, String)> {
        let stripe = layout.object_path("data", i);
        layout_objects(layout)
            .into_iter()
            .filter(|(_, o)| *o == stripe)
            .collect()
    };
    let new: BTreeSet<_> = after
        .keys()
        .filter(|k| !before.contains_key(*k))
        .cloned()
        .collect();
    let gone: BTreeSet<_> = before
        .keys()
        .filter(|k| !after.contains_key(*k))
        .cloned()
        .collect();
    assert_eq!(
        new,
        only(&b, 2),
        "exactly the changed stripe's 2 replicas are new objects"
    );
    assert_eq!(
        gone,
        only(&a, 2),
        "the replaced stripe's objects are removed"
    );
    assert!(new.iter().all(|k| after[k] == MIB));
    reads_back();

    // gc with no grace keeps every named object, reused ones included.
    let report = gc(&cluster, &["--grace", "0"]);
    assert_eq!(removed(&report), (BTreeSet::new(), 0), "{report}");
    assert_eq!(objects(&cluster), after);
    reads_back();

    // A third version changes the last stripe: it names objects of both older ones.
    // The replaced stripe's object was the first version's, borrowed by the second:
    // not the second's to remove, it is left to gc, which takes it and only it.
    change_byte(&local, 5 * MIB + 3);
    let third = up();
    assert_eq!(third["stripes_sent"].as_u64(), Some(1), "{third}");
    let c = cluster.layout_of("data", "f");
    assert_eq!(c.object_path("data", 2), b.object_path("data", 2));
    assert_eq!(c.object_path("data", 0), a.object_path("data", 0));
    assert!(c.is_own(5));
    let report = gc(&cluster, &["--grace", "0"]);
    assert_eq!(removed(&report), (only(&a, 5), 2 * 7), "{report}");
    let mut named = layout_objects(&c);
    assert_eq!(
        objects(&cluster).into_keys().collect::<BTreeSet<_>>(),
        std::mem::take(&mut named)
    );
    reads_back();
    // A new name in a directory that does not exist: a clear error, not a retry loop.
    let out = rcp(rcp_args![&local, cluster.url("data", "nodir/f")]);
    assert_eq!(out.code, Some(4), "{}", out.stderr);
    assert!(out.stderr.contains("no such directory"), "{}", out.stderr);
    // Unchanged: nothing is sent at all.
    let same = up();
    assert_eq!(
        (
            same["stripes_sent"].as_u64(),
            same["stripes_reused"].as_u64()
        ),
        (Some(0), Some(6)),
        "{same}"
    );
    reads_back();
}
