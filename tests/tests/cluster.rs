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
    if !ferryd_has_cluster_mode() {
        eprintln!("cluster_nodes_register_and_serve_a_share: skipped: ferryd has no --cluster");
        return;
    }
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
