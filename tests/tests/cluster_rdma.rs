//! A cluster whose etcd and nodes all run on the test host (no network namespaces),
//! so that it runs on the test transport: over TCP on the host, and in the Soft-RoCE
//! VM (`FERRY_TEST_TRANSPORT=rdma`) with every stripe moved by one-sided RDMA READ and
//! WRITE — the upload, the download around a dead node, and the repair's node-to-node
//! copies.

use std::time::{Duration, Instant};

use ferry_tests::{
    assert_files_equal, etcd_program, ferry, rcp, rcp_args, test_transport, write_random_file,
    Etcd, Server, ServerOptions, MIB,
};

/// Polls `ferry cluster status` until `n` nodes are live.
fn wait_live(etcd: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = ferry(["cluster", "status", "--etcd", etcd, "--json"]);
        if matches!(out.code, Some(0) | Some(8)) {
            let v = out.json();
            let live = v["nodes"]
                .as_array()
                .map_or(0, |a| a.iter().filter(|n| n["live"] == true).count());
            if live == n {
                return;
            }
        }
        assert!(Instant::now() < deadline, "{n} live nodes expected:\n{out}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_cluster_of_local_nodes_on_the_test_transport() {
    if !etcd_program().is_file() {
        assert!(
            std::env::var_os("CI").is_none(),
            "no etcd at {} under CI",
            etcd_program().display()
        );
        eprintln!("skipped: no etcd");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path(), format!("local-{}", std::process::id()), vec![])
        .unwrap_or_else(|e| panic!("{e}"));
    let endpoint = format!("127.0.0.1:{}", etcd.client_port());
    let nodes: Vec<Server> = (1..=3)
        .map(|k| {
            let store = dir.path().join(format!("node{k}"));
            Server::start_with(
                &[],
                ServerOptions {
                    args: [
                        "--cluster".into(),
                        format!("http://{endpoint}").into(),
                        "--node-id".into(),
                        format!("n{k}").into(),
                        "--store".into(),
                        store.into_os_string(),
                        "--lease-ttl".into(),
                        "3".into(),
                    ]
                    .to_vec(),
                    ..ServerOptions::default()
                },
            )
        })
        .collect();
    wait_live(&endpoint, 3);
    ferry([
        "cluster",
        "add-share",
        "--etcd",
        &endpoint,
        "data",
        "--replicas",
        "2",
        "--stripe-mib",
        "1",
    ])
    .assert_success();
    let src = dir.path().join("f");
    write_random_file(&src, 9 * MIB + 1, 71);
    let url = format!("cluster://{endpoint}/data/f");
    let up = rcp(rcp_args!["--json", &src, &url]);
    up.assert_success();
    assert_eq!(up.json()["transport"], test_transport(), "{}", up.stdout);
    let back = dir.path().join("back");
    let down = rcp(rcp_args!["--json", &url, &back]);
    down.assert_success();
    assert_eq!(
        down.json()["transport"],
        test_transport(),
        "{}",
        down.stdout
    );
    assert_files_equal(&src, &back);

    // A node lost: read around it, then repair node to node and read without node 2.
    nodes[0].kill();
    let back2 = dir.path().join("back2");
    rcp(rcp_args![&url, &back2]).assert_success();
    assert_files_equal(&src, &back2);
    wait_live(&endpoint, 2);
    let r = ferry(["cluster", "repair", "--etcd", &endpoint, "--json"]);
    r.assert_success();
    assert!(
        r.json()["replicas_added"].as_u64().unwrap() > 0,
        "{}",
        r.stdout
    );
    let copied = nodes[1].stderr().matches("replicated").count()
        + nodes[2].stderr().matches("replicated").count();
    assert!(copied > 0, "no node-to-node copy in the nodes' logs");
    nodes[1].kill();
    let back3 = dir.path().join("back3");
    rcp(rcp_args![&url, &back3]).assert_success();
    assert_files_equal(&src, &back3);
    drop(etcd);
}
