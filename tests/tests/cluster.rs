//! The multi-node harness ([`Cluster`]): plain ferryd nodes in network namespaces
//! reached from the root namespace, etcd reached from inside them, links shaped by
//! `tc`, nodes and etcd killed and started again; and, where ferryd has cluster mode,
//! nodes registering in etcd and a copy through a cluster share.
//!
//! Every test needs root and etcd (skipped otherwise, with the reason).

use std::time::{Duration, Instant};

use ferry_tests::{
    assert_files_equal, ferry, ferryd_has_cluster_mode, rcp, rcp_args, run_tool,
    skip_without_cluster, write_random_file, Cluster, LEASE_TTL, MIB, PLAIN_SHARE,
};

/// A TCP connection from inside node `k`'s namespace to `host port` that sends
/// `GET /health` and prints the answer (bash's `/dev/tcp`: no curl needed).
fn get_health_in(cluster: &Cluster, k: usize, host: &str, port: &str) -> String {
    let script =
        r#"exec 3<>"/dev/tcp/$1/$2" && printf 'GET /health HTTP/1.0\r\n\r\n' >&3 && cat <&3"#;
    let mut cmd = cluster.command_in(k, "bash");
    cmd.args(["-c", script, "get-health", host, port]);
    let out = run_tool(&mut cmd, Duration::from_secs(10));
    out.assert_success("GET /health from a node's namespace");
    out.stdout
}

/// Whether a TCP connection from inside node `k`'s namespace to `addr` (`HOST:PORT`)
/// is accepted.
fn connects_from(cluster: &Cluster, k: usize, addr: &str) -> bool {
    let (host, port) = addr.rsplit_once(':').expect("HOST:PORT");
    let mut cmd = cluster.command_in(k, "bash");
    cmd.args(["-c", r#"exec 3<>"/dev/tcp/$1/$2""#, "connect", host, port]);
    run_tool(&mut cmd, Duration::from_secs(10)).code == Some(0)
}

#[test]
fn plain_nodes_in_namespaces_serve_the_root_namespace() {
    if skip_without_cluster("plain_nodes_in_namespaces_serve_the_root_namespace") {
        return;
    }
    let cluster = Cluster::start_plain(2);
    let local = cluster.dir().join("local");
    std::fs::create_dir(&local).unwrap();
    for k in 1..=2 {
        let src = local.join(format!("up{k}"));
        let back = local.join(format!("back{k}"));
        write_random_file(&src, 3 * MIB + k as u64, k as u64);
        let remote = format!("{}:{PLAIN_SHARE}/f", cluster.node_addr(k));
        assert!(
            remote.starts_with("10.") && remote.contains(":7447:"),
            "{remote}"
        );
        rcp(rcp_args![src, remote]).assert_success();
        assert_files_equal(&src, &cluster.node_store(k).join("f"));
        rcp(rcp_args![remote, back]).assert_success();
        assert_files_equal(&src, &back);
    }
    // Each node reaches etcd on its veth's root side, and the other node through the
    // root namespace.
    for k in 1..=2 {
        let url = cluster.etcd_url_for(k);
        let hostport = url.strip_prefix("http://").expect("an http URL");
        let (host, port) = hostport.rsplit_once(':').unwrap();
        assert!(host.ends_with(".1") && host.starts_with("10."), "{url}");
        let answer = get_health_in(&cluster, k, host, port);
        assert!(
            answer.replace(' ', "").contains(r#""health":"true""#),
            "etcd's /health from node {k}'s namespace: {answer}"
        );
        let other = 3 - k;
        assert!(
            connects_from(&cluster, k, &cluster.node_addr(other)),
            "node {k} cannot reach node {other} at {}",
            cluster.node_addr(other)
        );
    }
    assert!(cluster.etcd_healthy());
    let port = cluster
        .etcd_endpoint()
        .rsplit(':')
        .next()
        .unwrap()
        .to_owned();
    assert!(cluster.etcd_url_for(1).ends_with(&format!(":{port}")));
}

#[test]
fn nodes_and_etcd_restart_and_links_are_shaped() {
    if skip_without_cluster("nodes_and_etcd_restart_and_links_are_shaped") {
        return;
    }
    let mut cluster = Cluster::start_plain(1);
    let local = cluster.dir().join("local");
    std::fs::create_dir(&local).unwrap();
    let src = local.join("f");
    write_random_file(&src, 2 * MIB, 7);
    let remote = format!("{}:{PLAIN_SHARE}/f", cluster.node_addr(1));

    cluster.kill_node(1);
    assert!(!cluster.node_running(1));
    rcp(rcp_args![src, remote]).assert_failure();
    cluster.start_node(1);
    assert!(cluster.node_running(1));
    rcp(rcp_args![src, remote]).assert_success();
    assert_files_equal(&src, &cluster.node_store(1).join("f"));
    assert_eq!(
        cluster
            .node_log(1)
            .matches("----- ferryd n1 starts -----")
            .count(),
        2
    );

    cluster.stop_etcd();
    assert!(!cluster.etcd_healthy());
    cluster.start_etcd();
    assert!(cluster.etcd_healthy());

    // 8 MiB through a 16 MB/s link takes at least 0.5 s each way (less the bucket
    // of 64 KiB): the lower bound holds however slow the machine is.
    cluster.limit_rate(1, 16_000_000);
    let big = local.join("big");
    write_random_file(&big, 8 * MIB, 8);
    let big_remote = format!("{}:{PLAIN_SHARE}/big", cluster.node_addr(1));
    let up = Instant::now();
    rcp(rcp_args![big, big_remote]).assert_success();
    let up = up.elapsed();
    let down = Instant::now();
    rcp(rcp_args![big_remote, local.join("big.back")]).assert_success();
    let down = down.elapsed();
    assert_files_equal(&big, &local.join("big.back"));
    let floor = Duration::from_millis(450);
    assert!(up >= floor, "8 MiB went to a 16 MB/s node in {up:?}");
    assert!(down >= floor, "8 MiB came from a 16 MB/s node in {down:?}");
}

/// Where ferryd has cluster mode: three nodes register, a killed one's lease runs
/// out, a restarted one comes back, and a file goes through a replicated share.
#[test]
fn cluster_nodes_register_and_serve_a_share() {
    if skip_without_cluster("cluster_nodes_register_and_serve_a_share") {
        return;
    }
    assert!(ferryd_has_cluster_mode(), "ferryd has no --cluster");
    let mut cluster = Cluster::start(3);
    let limit = Duration::from_secs(20);
    cluster.wait_nodes(3, limit);
    cluster.kill_node(3);
    cluster.wait_nodes(2, LEASE_TTL * 3 + limit);
    cluster.start_node(3);
    cluster.wait_nodes(3, limit);

    let etcd = cluster.etcd_endpoint();
    ferry([
        "cluster",
        "add-share",
        "--etcd",
        &etcd,
        "data",
        "--replicas",
        "2",
    ])
    .assert_success();
    let local = cluster.dir().join("local");
    std::fs::create_dir(&local).unwrap();
    write_random_file(&local.join("f"), 5 * MIB + 3, 3);
    rcp(rcp_args![local.join("f"), cluster.url("data", "f")]).assert_success();
    rcp(rcp_args![cluster.url("data", "f"), local.join("back")]).assert_success();
    assert_files_equal(&local.join("f"), &local.join("back"));
}

/// Starts `n` cluster nodes, waits for them, and creates share `data` with `replicas`
/// replicas and stripes of 1 MiB (so small files have several stripes).
fn cluster_with_share(n: usize, replicas: u8) -> Cluster {
    Cluster::start_with_share(n, "data", replicas, 1)
}

/// The regular files under `dir`, recursively.
fn files_under(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in rd.flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(".ferry") {
            continue;
        }
        if p.is_dir() {
            out.extend(files_under(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// Stripe objects node `k` holds.
fn objects_on(cluster: &Cluster, k: usize) -> usize {
    files_under(&cluster.node_store(k).join("data")).len()
}

fn node_stripes(status: &serde_json::Value, id: &str) -> u64 {
    status["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == id)
        .and_then(|n| n["stripes"].as_u64())
        .unwrap_or_else(|| panic!("no node {id} in {status}"))
}

#[test]
fn files_and_trees_round_trip_striped_and_replicated() {
    if skip_without_cluster("files_and_trees_round_trip_striped_and_replicated") {
        return;
    }
    let cluster = cluster_with_share(3, 2);
    let local = cluster.dir().join("local");
    let tree = local.join("tree");
    std::fs::create_dir_all(tree.join("a/b")).unwrap();
    write_random_file(&tree.join("big"), 7 * MIB + 123, 1);
    write_random_file(&tree.join("a/small"), 4000, 2);
    write_random_file(&tree.join("a/b/empty"), 0, 3);
    std::os::unix::fs::symlink("../big", tree.join("a/link")).unwrap();
    let up = rcp(rcp_args!["-r", "--json", &tree, cluster.url("data", "")]);
    up.assert_success();
    let j = up.json();
    assert_eq!(j["files"], 3, "{j}");
    assert_eq!(j["symlinks"], 1, "{j}");
    assert_eq!(j["encrypted"], true, "{j}");
    // Every byte went to two nodes: 8 stripes of the big file over all three, one of
    // the small file, none of the empty one.
    assert_eq!(
        j["bytes_sent"].as_u64(),
        Some(2 * (7 * MIB + 123 + 4000)),
        "{j}"
    );
    let spread: Vec<usize> = (1..=3).map(|k| objects_on(&cluster, k)).collect();
    assert_eq!(spread.iter().sum::<usize>(), 2 * (8 + 1), "{spread:?}");
    assert!(
        spread.iter().all(|&n| n >= 4),
        "stripes not spread: {spread:?}"
    );

    let back = local.join("back");
    rcp(rcp_args!["-r", cluster.url("data", "tree"), &back]).assert_success();
    ferry_tests::assert_trees_equal(&tree, &back);
    // A single file, into a directory.
    rcp(rcp_args![cluster.url("data", "tree/a/small"), &local]).assert_success();
    assert_files_equal(&tree.join("a/small"), &local.join("small"));

    let status = cluster.status();
    assert_eq!(status["files"], 3, "{status}");
    assert_eq!(status["under_replicated"], 0, "{status}");

    // Errors are clear: a missing file, a share that does not exist, a directory
    // without -r, a file over a directory.
    let missing = rcp(rcp_args![cluster.url("data", "nope"), &local]);
    missing.assert_failure();
    assert!(
        missing.stderr.contains("no such file"),
        "{}",
        missing.stderr
    );
    let noshare = rcp(rcp_args![tree.join("big"), cluster.url("other", "x")]);
    noshare.assert_failure();
    assert!(
        noshare.stderr.contains("no cluster share 'other'"),
        "{}",
        noshare.stderr
    );
    let dir = rcp(rcp_args![cluster.url("data", "tree"), local.join("d")]);
    dir.assert_failure();
    assert!(dir.stderr.contains("use -r"), "{}", dir.stderr);
}

#[test]
fn a_lost_node_is_read_around_avoided_and_repaired() {
    if skip_without_cluster("a_lost_node_is_read_around_avoided_and_repaired") {
        return;
    }
    let mut cluster = cluster_with_share(3, 2);
    let local = cluster.dir().join("local");
    std::fs::create_dir_all(&local).unwrap();
    let src = local.join("f");
    write_random_file(&src, 6 * MIB + 5, 11);
    rcp(rcp_args![&src, cluster.url("data", "f")]).assert_success();
    let before = objects_on(&cluster, 2);
    assert!(before > 0);

    // Read at once, before its lease runs out: the dead node is passed over.
    cluster.kill_node(2);
    let back = local.join("back");
    rcp(rcp_args![cluster.url("data", "f"), &back]).assert_success();
    assert_files_equal(&src, &back);

    cluster.wait_nodes(2, LEASE_TTL * 3 + Duration::from_secs(20));
    let status = cluster.status();
    assert!(status["under_replicated"].as_u64().unwrap() > 0, "{status}");
    assert_eq!(status["unavailable"], 0, "{status}");

    // New writes go to the live nodes only, with both replicas.
    let g = local.join("g");
    write_random_file(&g, 3 * MIB, 12);
    rcp(rcp_args![&g, cluster.url("data", "g")]).assert_success();
    assert_eq!(
        objects_on(&cluster, 2),
        before,
        "a new stripe went to the dead node"
    );
    let s1 = objects_on(&cluster, 1);
    let s3 = objects_on(&cluster, 3);
    // f's 7 stripes twice, less node 2's copies, and g's 3 stripes twice.
    assert_eq!(s1 + s3, 2 * 7 - before + 2 * 3, "{s1} {s3} {before}");

    // Repair copies the missing replicas to node 1 and 3, and status is clean.
    let etcd = cluster.etcd_endpoint();
    let repaired = ferry(["cluster", "repair", "--etcd", &etcd, "--json"]);
    repaired.assert_success();
    let r = repaired.json();
    assert_eq!(r["replicas_added"].as_u64(), Some(before as u64), "{r}");
    // Node to node: the new holders fetched the copies themselves.
    let fetched = cluster.node_log(1).matches("replicated").count()
        + cluster.node_log(3).matches("replicated").count();
    assert_eq!(fetched, before, "nodes' logs: {}", cluster.logs());
    let status = cluster.status();
    assert_eq!(status["under_replicated"], 0, "{status}");
    assert_eq!(node_stripes(&status, "n2"), 0, "{status}");

    // The node comes back with its old copies: no layout names them, so it serves
    // none of them; with node 1 gone as well, every stripe still reads from node 3's
    // or node 2's... no: from the repaired replicas.
    cluster.start_node(2);
    cluster.wait_nodes(3, Duration::from_secs(20));
    assert_eq!(node_stripes(&cluster.status(), "n2"), 0);
    cluster.kill_node(1);
    let back2 = local.join("back2");
    rcp(rcp_args![cluster.url("data", "f"), &back2]).assert_success();
    assert_files_equal(&src, &back2);
}

#[test]
fn a_node_killed_mid_write_and_mid_read() {
    if skip_without_cluster("a_node_killed_mid_write_and_mid_read") {
        return;
    }
    let mut cluster = cluster_with_share(3, 2);
    for k in 1..=3 {
        cluster.limit_rate(k, 40_000_000);
    }
    let local = cluster.dir().join("local");
    std::fs::create_dir_all(&local).unwrap();
    let src = local.join("f");
    write_random_file(&src, 48 * MIB, 21);

    // Mid-write: every stripe has two copies to make at 40 MB/s per node, so the
    // copy takes well over a second; node 1 dies half a second in.
    let mut writer = ferry_tests::spawn_rcp(rcp_args![&src, cluster.url("data", "f")]);
    std::thread::sleep(Duration::from_millis(500));
    assert!(writer.is_running(), "the upload ended before the fault");
    cluster.kill_node(1);
    let out = writer.wait();
    // Either outcome is clean: the file is whole, or there is none.
    let back = local.join("back");
    let read = rcp(rcp_args![cluster.url("data", "f"), &back]);
    if out.code == Some(0) {
        read.assert_success();
        assert_files_equal(&src, &back);
    } else {
        read.assert_failure();
        assert!(!back.exists());
    }
    cluster.start_node(1);
    cluster.wait_nodes(3, Duration::from_secs(20));
    rcp(rcp_args![&src, cluster.url("data", "f")]).assert_success();

    // Mid-read: node 2 dies while the file comes back; the other replicas serve it.
    let back2 = local.join("back2");
    let mut reader = ferry_tests::spawn_rcp(rcp_args![cluster.url("data", "f"), &back2]);
    std::thread::sleep(Duration::from_millis(300));
    assert!(reader.is_running(), "the download ended before the fault");
    cluster.kill_node(2);
    reader.wait().assert_success();
    assert_files_equal(&src, &back2);
}

#[test]
fn racing_writers_of_one_name_leave_one_whole_file() {
    if skip_without_cluster("racing_writers_of_one_name_leave_one_whole_file") {
        return;
    }
    let cluster = cluster_with_share(3, 1);
    let local = cluster.dir().join("local");
    std::fs::create_dir_all(&local).unwrap();
    let (a, b) = (local.join("a"), local.join("b"));
    write_random_file(&a, 9 * MIB, 31);
    write_random_file(&b, 9 * MIB + 7, 32);
    let mut last_is_a = false;
    for round in 0..3 {
        let wa = ferry_tests::spawn_rcp(rcp_args![&a, cluster.url("data", "same")]);
        let wb = ferry_tests::spawn_rcp(rcp_args![&b, cluster.url("data", "same")]);
        wa.wait().assert_success();
        wb.wait().assert_success();
        let back = local.join(format!("back{round}"));
        rcp(rcp_args![cluster.url("data", "same"), &back]).assert_success();
        let got = std::fs::read(&back).unwrap();
        last_is_a = got == std::fs::read(&a).unwrap();
        assert!(
            last_is_a || got == std::fs::read(&b).unwrap(),
            "round {round}: the file is neither writer's"
        );
    }
    // The losers' stripes were removed: the winner's are left (a: 9, b: 10 stripes).
    let objects: usize = (1..=3).map(|k| objects_on(&cluster, k)).sum();
    assert_eq!(objects, if last_is_a { 9 } else { 10 }, "objects left");
}

#[test]
fn etcd_lost_mid_copy_fails_cleanly() {
    if skip_without_cluster("etcd_lost_mid_copy_fails_cleanly") {
        return;
    }
    let mut cluster = cluster_with_share(2, 1);
    for k in 1..=2 {
        cluster.limit_rate(k, 20_000_000);
    }
    let local = cluster.dir().join("local");
    std::fs::create_dir_all(&local).unwrap();
    let src = local.join("f");
    write_random_file(&src, 40 * MIB, 41);
    let mut writer = ferry_tests::spawn_rcp(rcp_args![&src, cluster.url("data", "f")]);
    std::thread::sleep(Duration::from_millis(400));
    assert!(writer.is_running(), "the upload ended before the fault");
    cluster.stop_etcd();
    let out = writer.wait();
    out.assert_failure();
    assert!(out.stderr.contains("etcd"), "{}", out.stderr);
    cluster.start_etcd();
    // Nothing was published; the copy run again works.
    let back = local.join("back");
    rcp(rcp_args![cluster.url("data", "f"), &back]).assert_failure();
    rcp(rcp_args![&src, cluster.url("data", "f")]).assert_success();
    rcp(rcp_args![cluster.url("data", "f"), &back]).assert_success();
    assert_files_equal(&src, &back);
}

#[test]
fn replicate_requests_are_confined_to_live_members_and_the_store() {
    if skip_without_cluster("replicate_requests_are_confined_to_live_members_and_the_store") {
        return;
    }
    let cluster = cluster_with_share(2, 1);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let addr = cluster.node_addr(1);
    let (host, port) = addr.rsplit_once(':').unwrap();
    let refused = rt.block_on(async {
        let c = ferry_tests::connect_to(
            host,
            port.parse().unwrap(),
            ferry_common::transport::TransportChoice::Tcp,
        )
        .await
        .unwrap();
        c.authenticate("cluster").await.unwrap();
        assert!(c.negotiated().unwrap().cluster);
        let object = ferry_cluster::model::object_path("data", &"ab".repeat(16), 0);
        let outsider = c
            .replicate("cluster", &object, "127.0.0.1:1", 10, [0; 32])
            .await;
        let wrong_share = c
            .replicate("other", "x", &cluster.node_addr(2), 10, [0; 32])
            .await;
        (outsider, wrong_share)
    });
    let kind =
        |r: &Result<(), ferry_client::ClientError>| r.as_ref().err().and_then(|e| e.remote_kind());
    use ferry_common::msg::ErrorKind;
    assert_eq!(
        kind(&refused.0),
        Some(ErrorKind::PermissionDenied),
        "{:?}",
        refused.0
    );
    assert!(refused
        .0
        .unwrap_err()
        .to_string()
        .contains("not a live node"));
    assert!(
        matches!(
            kind(&refused.1),
            Some(ErrorKind::PermissionDenied | ErrorKind::NoSuchShare)
        ),
        "{:?}",
        refused.1
    );
    // Nothing was written in the store.
    assert!(!cluster.node_store(1).join("data").exists());
}

#[test]
fn an_interrupted_upload_resumes_and_an_unchanged_one_sends_nothing() {
    if skip_without_cluster("an_interrupted_upload_resumes_and_an_unchanged_one_sends_nothing") {
        return;
    }
    let cluster = cluster_with_share(2, 2);
    for k in 1..=2 {
        cluster.limit_rate(k, 30_000_000);
    }
    let local = cluster.dir().join("local");
    std::fs::create_dir_all(&local).unwrap();
    let src = local.join("f");
    let size = 40 * MIB;
    write_random_file(&src, size, 51);
    let mut first = ferry_tests::spawn_rcp(rcp_args![&src, cluster.url("data", "f")]);
    std::thread::sleep(Duration::from_millis(900));
    assert!(first.is_running(), "the upload ended before it was killed");
    first.kill();
    // Nothing is visible yet.
    rcp(rcp_args![cluster.url("data", "f"), local.join("none")]).assert_failure();

    let again = rcp(rcp_args!["--json", &src, cluster.url("data", "f")]);
    again.assert_success();
    let j = again.json();
    let reused = j["bytes_reused"].as_u64().unwrap();
    let sent = j["bytes_sent"].as_u64().unwrap();
    assert!(reused > 0, "nothing resumed: {j}");
    assert_eq!(sent + reused, 2 * size, "{j}");
    let back = local.join("back");
    rcp(rcp_args![cluster.url("data", "f"), &back]).assert_success();
    assert_files_equal(&src, &back);

    // The same unchanged file again: every stripe is found, nothing is sent.
    let same = rcp(rcp_args!["--json", &src, cluster.url("data", "f")]);
    same.assert_success();
    assert_eq!(same.json()["bytes_sent"], 0, "{}", same.stdout);
    assert_eq!(objects_on(&cluster, 1) + objects_on(&cluster, 2), 2 * 40);
}

/// The published snapshot names under `prefix` of share `data`, read back with an
/// `rcp -r` of the prefix (a listing of what a user can see).
fn snapshots(cluster: &Cluster, local: &std::path::Path, prefix: &str) -> Vec<String> {
    let out = local.join(format!("list-{}", rand::random::<u32>()));
    rcp(rcp_args!["-r", cluster.url("data", prefix), &out]).assert_success();
    let mut names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    std::fs::remove_dir_all(&out).unwrap();
    names
}

/// The name of the snapshot a backup's `--json` output reports (its path's last part).
fn snapshot_of(j: &serde_json::Value) -> String {
    let path = j["targets"][0]["snapshot"].as_str().expect("a snapshot");
    path.rsplit('/').next().unwrap().to_owned()
}

#[test]
fn backups_into_a_cluster_share_link_unchanged_files_and_keep_what_retention_says() {
    if skip_without_cluster(
        "backups_into_a_cluster_share_link_unchanged_files_and_keep_what_retention_says",
    ) {
        return;
    }
    let cluster = cluster_with_share(3, 2);
    let local = cluster.dir().join("local");
    let src = local.join("src");
    std::fs::create_dir_all(src.join("d")).unwrap();
    write_random_file(&src.join("big"), 3 * MIB + 9, 61);
    write_random_file(&src.join("d/small"), 777, 62);
    std::os::unix::fs::symlink("d/small", src.join("link")).unwrap();
    let target = cluster.url("data", "bk");

    let first = rcp(rcp_args!["backup", "--json", &src, &target]);
    first.assert_success();
    let j = first.json();
    let snap1 = snapshot_of(&j);
    assert_eq!(j["files_new"], 2, "{j}");
    let objects1: usize = (1..=3).map(|k| objects_on(&cluster, k)).sum();
    assert_eq!(objects1, 2 * (4 + 1));

    // One file changes, one is new: the unchanged one is linked, nothing of it moves.
    std::thread::sleep(Duration::from_millis(1100));
    write_random_file(&src.join("d/small"), 900, 63);
    write_random_file(&src.join("new"), 5000, 64);
    let second = rcp(rcp_args!["backup", "--json", &src, &target]);
    second.assert_success();
    let j = second.json();
    let snap2 = snapshot_of(&j);
    assert_ne!(snap1, snap2);
    assert_eq!(j["files_unchanged"], 1, "{j}");
    assert_eq!(
        (j["files_changed"].as_u64(), j["files_new"].as_u64()),
        (Some(1), Some(1)),
        "{j}"
    );
    assert_eq!(j["bytes_sent"].as_u64(), Some(2 * (900 + 5000)), "{j}");
    assert_eq!(
        snapshots(&cluster, &local, "bk"),
        vec![snap1.clone(), snap2.clone()]
    );

    // Each snapshot restores to what the source was when it was taken.
    let back2 = local.join("back2");
    rcp(rcp_args![
        "-r",
        cluster.url("data", &format!("bk/{snap2}")),
        &back2
    ])
    .assert_success();
    ferry_tests::assert_trees_equal(&src, &back2);
    let back1 = local.join("back1");
    rcp(rcp_args![
        "-r",
        cluster.url("data", &format!("bk/{snap1}")),
        &back1
    ])
    .assert_success();
    assert_eq!(std::fs::read(back1.join("d/small")).unwrap().len(), 777);
    assert!(!back1.join("new").exists());
    assert_files_equal(&src.join("big"), &back1.join("big"));

    // --keep 1: the two older snapshots go; the big file's objects stay (the newest
    // snapshot names them), the old small file's go.
    std::thread::sleep(Duration::from_millis(1100));
    let third = rcp(rcp_args!["backup", "--json", "--keep", "1", &src, &target]);
    third.assert_success();
    let j = third.json();
    let snap3 = snapshot_of(&j);
    assert_eq!(j["pruned"].as_array().unwrap().len(), 2, "{j}");
    assert_eq!(snapshots(&cluster, &local, "bk"), vec![snap3.clone()]);
    let objects3: usize = (1..=3).map(|k| objects_on(&cluster, k)).sum();
    assert_eq!(objects3, 2 * (4 + 1 + 1), "big, the new small, new");
    let back3 = local.join("back3");
    rcp(rcp_args![
        "-r",
        cluster.url("data", &format!("bk/{snap3}")),
        &back3
    ])
    .assert_success();
    ferry_tests::assert_trees_equal(&src, &back3);
}
