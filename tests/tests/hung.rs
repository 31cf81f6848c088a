//! Issue 41, hung nodes: a ferryd stopped with SIGSTOP (alive, its connections open,
//! answering nothing) part-way through a copy. On a cluster share the copy passes the
//! node over within the progress deadline and finishes whole, and the client names
//! the node as suspect; against a single server, `rcp` fails with a clear message
//! within the session's silence limit, encrypted or not. The times themselves are the
//! benchmark's (`bench/run --only cluster`); the bounds here only say "well under the
//! 30 s a silent peer used to cost".
//!
//! Every test needs root and etcd (skipped otherwise, with the reason).

use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use ferry_tests::{
    assert_files_equal, rcp, rcp_args, skip_without_cluster, spawn_rcp, write_random_file, Cluster,
    RcpChild, RcpOutput, MIB, PLAIN_SHARE,
};

/// Each node's link, each way: slow enough that a copy of the test file takes well
/// over [`FAULT_AFTER`], so the node is stopped while it runs.
const LINK_BYTES_PER_SEC: u64 = 20_000_000;

/// How long into a copy the node is stopped.
const FAULT_AFTER: Duration = Duration::from_millis(500);

/// Generous bound on a cluster copy with a node hung part-way: the old behaviour cost
/// 30 s per silent session; the progress deadline is 2 s.
const HUNG_COPY_LIMIT: Duration = Duration::from_secs(25);

/// Generous bound from the stop to a single-server rcp's failure: the silence limit
/// (10 s) and the time to notice and exit on a loaded machine.
const HUNG_SERVER_LIMIT: Duration = Duration::from_secs(25);

/// The nodes' lease: a stopped node stays registered for the whole test, so it is the
/// client's deadline, not etcd, that passes it over.
const HUNG_LEASE_TTL: Duration = Duration::from_secs(60);

/// How long a test waits for an rcp before it kills it and fails.
const RCP_LIMIT: Duration = Duration::from_secs(90);

/// A cluster of three nodes with share `data` (two replicas, 1 MiB stripes), the file
/// `f` of `size` bytes uploaded while healthy (unless `upload` is false), and every
/// link shaped to [`LINK_BYTES_PER_SEC`]. Returns the cluster and the local source.
fn shaped_cluster(size: u64, upload: bool) -> (Cluster, std::path::PathBuf) {
    let cluster = Cluster::start_with_share_ttl(3, "data", 2, 1, HUNG_LEASE_TTL);
    let local = cluster.dir().join("local");
    std::fs::create_dir_all(&local).unwrap();
    let src = local.join("f");
    write_random_file(&src, size, 41);
    if upload {
        rcp(rcp_args![&src, cluster.url("data", "f")]).assert_success();
    }
    for k in 1..=3 {
        cluster.limit_rate(k, LINK_BYTES_PER_SEC);
    }
    (cluster, src)
}

/// Waits [`FAULT_AFTER`] into `copy`, checks it still runs, and stops node `k`.
#[track_caller]
fn stop_mid_copy(cluster: &mut Cluster, copy: &mut RcpChild, k: usize) -> ferry_tests::StoppedNode {
    thread::sleep(FAULT_AFTER);
    assert!(copy.is_running(), "the copy ended before the fault");
    cluster.stop_node(k)
}

/// Checks that `out` succeeded, named node `k` suspect, and ran with the node stopped
/// to the end.
#[track_caller]
fn passed_over(cluster: &Cluster, out: &RcpOutput, k: usize) {
    out.assert_success();
    assert!(
        cluster.node_stopped(k),
        "node {k} ran again during the copy"
    );
    let named = format!("storage node n{k} is suspect");
    assert!(
        out.stderr.contains(&named),
        "the client did not pass node {k} over\n{out}"
    );
    assert!(
        out.elapsed < HUNG_COPY_LIMIT,
        "took {:?} with node {k} hung\n{out}",
        out.elapsed
    );
}

#[test]
fn issue_41_a_node_hung_mid_download_is_passed_over() {
    if skip_without_cluster("issue_41_a_node_hung_mid_download_is_passed_over") {
        return;
    }
    let (mut cluster, src) = shaped_cluster(64 * MIB, true);
    let back = cluster.dir().join("local/back");
    let mut reader = spawn_rcp(rcp_args![cluster.url("data", "f"), &back]);
    let stopped = stop_mid_copy(&mut cluster, &mut reader, 1);
    let out = reader.wait_at_most(RCP_LIMIT);
    passed_over(&cluster, &out, 1);
    assert_files_equal(&src, &back);
    stopped.cont();
}

#[test]
fn issue_41_a_node_hung_mid_upload_is_replaced() {
    if skip_without_cluster("issue_41_a_node_hung_mid_upload_is_replaced") {
        return;
    }
    let (mut cluster, src) = shaped_cluster(48 * MIB, false);
    let mut writer = spawn_rcp(rcp_args![&src, cluster.url("data", "f")]);
    let stopped = stop_mid_copy(&mut cluster, &mut writer, 1);
    let out = writer.wait_at_most(RCP_LIMIT);
    passed_over(&cluster, &out, 1);
    assert!(
        !out.stderr.contains("fewer replicas"),
        "a stripe was left short of replicas: the next node should have taken it\n{out}"
    );
    // Read back with the node still hung: every stripe has a replica elsewhere.
    let back = cluster.dir().join("local/back");
    rcp(rcp_args![cluster.url("data", "f"), &back]).assert_success();
    assert_files_equal(&src, &back);
    stopped.cont();
}

/// Uploads `src` to the single ferryd of `cluster` with `--encryption encryption`,
/// stops the ferryd part-way, and checks that rcp fails, saying the server does not
/// respond, within [`HUNG_SERVER_LIMIT`] of the stop.
fn fails_against_hung_server(cluster: &mut Cluster, src: &Path, encryption: &str) {
    let remote = format!("{}:{PLAIN_SHARE}/{encryption}", cluster.node_addr(1));
    let mut up = spawn_rcp(rcp_args!["--encryption", encryption, src, &remote]);
    let stopped = stop_mid_copy(cluster, &mut up, 1);
    let at = Instant::now();
    let out = up.wait_at_most(RCP_LIMIT);
    let after = at.elapsed();
    out.assert_failure();
    assert!(cluster.node_stopped(1), "ferryd ran again during the copy");
    assert!(
        out.stderr.contains("is not responding"),
        "--encryption {encryption}: no clear message\n{out}"
    );
    assert!(
        after < HUNG_SERVER_LIMIT,
        "--encryption {encryption}: failed {after:?} after the stop\n{out}"
    );
    stopped.cont();
}

#[test]
fn issue_41_rcp_against_a_hung_ferryd_fails_with_a_clear_message() {
    if skip_without_cluster("issue_41_rcp_against_a_hung_ferryd_fails_with_a_clear_message") {
        return;
    }
    let mut cluster = Cluster::start_plain(1);
    cluster.limit_rate(1, LINK_BYTES_PER_SEC);
    let src = cluster.dir().join("src");
    write_random_file(&src, 64 * MIB, 42);
    for encryption in ["off", "required"] {
        fails_against_hung_server(&mut cluster, &src, encryption);
    }
}

/// `Replicate` (a repair's node-to-node copy) from a node that is hung: the node asked
/// to fetch gives up on the source at the progress deadline, not at the session's
/// silence limit, names it, and names nothing in its store.
#[test]
fn issue_41_a_replicate_from_a_hung_node_fails_at_the_progress_deadline() {
    use ferry_cluster::model::STORE_SHARE;
    use ferry_common::transport::TransportChoice;
    if skip_without_cluster("issue_41_a_replicate_from_a_hung_node_fails_at_the_progress_deadline")
    {
        return;
    }
    let mut cluster = Cluster::start_with_share_ttl(2, "data", 1, 1, HUNG_LEASE_TTL);
    let src = cluster.dir().join("src");
    let size = 300_000;
    write_random_file(&src, size, 43);
    rcp(rcp_args![&src, cluster.url("data", "f")]).assert_success();
    let layout = cluster.layout_of("data", "f");
    let holder = layout.stripes[0].replicas[0].clone();
    let (from, to) = if holder == cluster.node_id(1) {
        (1, 2)
    } else {
        (2, 1)
    };
    let from_addr = cluster.node_addr(from);
    let to_addr = cluster.node_addr(to);
    let (host, port) = to_addr.rsplit_once(':').unwrap();
    let rt = ferry_tests::runtime();
    let c = rt
        .block_on(ferry_tests::connect_to(
            host,
            port.parse().unwrap(),
            TransportChoice::Tcp,
        ))
        .unwrap();
    rt.block_on(c.authenticate(STORE_SHARE)).unwrap();
    let stopped = cluster.stop_node(from);
    let object = layout.object_path("data", 0);
    let manifest = layout.manifest(0).unwrap();
    let at = Instant::now();
    let err = rt
        .block_on(c.replicate(STORE_SHARE, &object, &from_addr, size, manifest))
        .expect_err("a fetch from a hung node");
    let after = at.elapsed();
    assert!(cluster.node_stopped(from), "the source ran again");
    let text = err.to_string();
    assert!(
        text.contains(&format!("storage node {from_addr} made no progress")),
        "not the progress deadline: {text}"
    );
    assert!(after < HUNG_COPY_LIMIT, "took {after:?}: {text}");
    assert!(
        !cluster.node_store(to).join("data").exists(),
        "named something"
    );
    c.close();
    stopped.cont();
}
