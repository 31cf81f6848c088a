//! etcd behind TLS and user authentication (issue 41): a real etcd serving TLS only
//! and requiring client certificates (`--client-cert-auth`, certificates made by the
//! harness with `openssl`), ferryd nodes joining it through a cluster configuration
//! file, clients refused clearly without a certificate and served with one; then
//! `ferry cluster auth-setup` turning on etcd's users and roles, and each role
//! allowed only its own keys.
//!
//! Every test needs root and etcd (skipped otherwise, with the reason; never under CI).

use std::path::Path;
use std::time::Duration;

use ferry_client::ClientError;
use ferry_cluster::etcd_config::{ClientIdentity, EtcdTls, EtcdUser};
use ferry_cluster::model::{NodeInfo, ShareConfig};
use ferry_cluster::{EtcdConfig, EtcdError, Meta};
use ferry_tests::{
    assert_files_equal, ferry, ferryd_has_cluster_mode, rcp_args, rcp_env, skip_without_cluster,
    skip_without_fuse, write_random_file, Cluster, ClusterOptions, Mount, RcpOutput, LEASE_TTL,
    MIB,
};

/// How long a refused client may take to say so (etcd-client's connect timeout is
/// 5 s; a refusal is immediate).
const REFUSAL_LIMIT: Duration = Duration::from_secs(15);

/// How long nodes may take to register.
const REGISTER_LIMIT: Duration = Duration::from_secs(20);

fn path(p: &Path) -> &str {
    p.to_str().expect("the temp dir's path is UTF-8")
}

/// Asserts that `out` failed with exit code `code` within [`REFUSAL_LIMIT`], saying
/// `needle` on stderr.
#[track_caller]
fn assert_refused(out: &RcpOutput, code: i32, needle: &str) {
    out.assert_code(code).assert_stderr_has(needle);
    assert!(
        out.elapsed < REFUSAL_LIMIT,
        "the refusal took {:?}:\n{out}",
        out.elapsed
    );
}

fn tls_cluster(nodes: usize, node_user: Option<&str>) -> Cluster {
    assert!(ferryd_has_cluster_mode(), "ferryd has no --cluster");
    Cluster::start_with(ClusterOptions {
        nodes,
        tls: true,
        node_etcd_user: node_user.map(str::to_owned),
        ..ClusterOptions::default()
    })
}

#[test]
fn etcd_over_tls_refuses_clients_without_a_certificate_and_serves_those_with_one() {
    if skip_without_cluster(
        "etcd_over_tls_refuses_clients_without_a_certificate_and_serves_those_with_one",
    ) {
        return;
    }
    // The nodes reach etcd through the cluster configuration file (--cluster-config).
    let mut cluster = tls_cluster(3, None);
    cluster.wait_nodes(3, REGISTER_LIMIT);
    let etcd = cluster.etcd_endpoint();
    let certs = cluster.certs().expect("a TLS cluster").clone();
    let status = ["cluster", "status", "--etcd", etcd.as_str()];

    // Plain HTTP to an etcd that serves TLS only.
    assert_refused(&ferry(status), 3, "serves TLS only");
    // TLS without a client certificate, and with one from a CA etcd does not trust.
    let ca_only = [&status[..], &["--etcd-ca", path(&certs.ca)]].concat();
    assert_refused(&ferry(&ca_only), 3, "client certificate required");
    let rogue = [
        &ca_only[..],
        &["--etcd-cert", path(&certs.rogue_cert)],
        &["--etcd-key", path(&certs.rogue_key)],
    ]
    .concat();
    assert_refused(
        &ferry(&rogue),
        3,
        "client certificate required or not trusted",
    );
    let local = cluster.dir().join("local");
    std::fs::create_dir(&local).unwrap();
    let refused = rcp_env(
        &[("FERRY_ETCD_CA", Some(path(&certs.ca)))],
        rcp_args![cluster.url("data", "f"), local.join("x")],
    );
    assert_refused(&refused, 3, "client certificate required");

    // With the certificate as options...
    let cert_args = [
        "--etcd-ca",
        path(&certs.ca),
        "--etcd-cert",
        path(&certs.client_cert),
        "--etcd-key",
        path(&certs.client_key),
    ];
    ferry([&status[..], &cert_args[..]].concat()).assert_code_in(&[0, 8]);
    let add = ["cluster", "add-share", "--etcd", etcd.as_str(), "data"];
    let size = ["--replicas", "2", "--stripe-mib", "1"];
    ferry([&add[..], &cert_args[..], &size[..]].concat()).assert_success();

    // ...and from the cluster configuration file ($FERRY_CLUSTER_CONFIG, then
    // --cluster-config): an upload and a download, byte for byte.
    let src = local.join("f");
    write_random_file(&src, 5 * MIB + 7, 41);
    rcp_env(
        &cluster.client_env(),
        rcp_args![&src, cluster.url("data", "f")],
    )
    .assert_success();
    let config = cluster.cluster_config().expect("a TLS cluster").to_owned();
    let back = local.join("back");
    rcp_env(
        &[],
        rcp_args!["--cluster-config", &config, cluster.url("data", "f"), &back],
    )
    .assert_success();
    assert_files_equal(&src, &back);

    // Nodes reach etcd over TLS for Replicate too: a lost node's stripes are repaired
    // node to node.
    cluster.kill_node(3);
    cluster.wait_nodes(2, LEASE_TTL * 3 + REGISTER_LIMIT);
    cluster
        .ferry(["cluster", "repair", "--etcd", &etcd, "--json"])
        .assert_success();
    let status = cluster.status();
    assert_eq!(status["under_replicated"], 0, "{status}");
    std::fs::remove_file(&back).unwrap();
    rcp_env(
        &cluster.client_env(),
        rcp_args![cluster.url("data", "f"), &back],
    )
    .assert_success();
    assert_files_equal(&src, &back);
}

/// etcd settings for `user` (password in the cluster's users directory), over the
/// cluster's TLS.
fn as_user(cluster: &Cluster, user: &str) -> EtcdConfig {
    let certs = cluster.certs().expect("a TLS cluster");
    EtcdConfig {
        endpoints: vec![cluster.etcd_endpoint()],
        tls: Some(EtcdTls {
            ca: certs.ca.clone(),
            identity: Some(ClientIdentity {
                cert: certs.client_cert.clone(),
                key: certs.client_key.clone(),
            }),
        }),
        user: Some(EtcdUser {
            name: user.to_owned(),
            password_file: cluster.etcd_users_dir().join(format!("{user}.password")),
        }),
    }
}

/// Asserts that `result` is etcd refusing `user` by its role.
#[track_caller]
fn assert_denied<T: std::fmt::Debug>(result: Result<T, ClientError>, user: &str, what: &str) {
    match result {
        Err(ClientError::Etcd(e @ EtcdError::PermissionDenied { .. })) => {
            let text = e.to_string();
            assert!(text.contains(&format!("user {user}")), "{what}: {text}");
        }
        other => panic!("{what}: expected etcd to deny {user}, got {other:?}"),
    }
}

/// What the roles allow, through the library's own writes.
fn check_roles(cluster: &Cluster) {
    let rt = ferry_tests::runtime();
    let fake = NodeInfo {
        id: "intruder".into(),
        addr: "10.255.255.1:7447".into(),
        transports: vec!["tcp".into()],
        capacity: 1 << 40,
        free: 1 << 40,
        started: 0,
        reserve: 0,
    };
    let share = ShareConfig {
        replicas: 1,
        stripe_bytes: MIB,
    };
    let entry = ferry_cluster::meta::root_entry();
    rt.block_on(async {
        let client = Meta::connect(&as_user(cluster, "ferry-client"))
            .await
            .unwrap();
        assert_denied(
            client.put_node(&fake, 0).await,
            "ferry-client",
            "a client registering a node",
        );
        assert_denied(
            client.put_share("other", &share).await,
            "ferry-client",
            "a client creating a share",
        );
        let node = Meta::connect(&as_user(cluster, "ferry-node"))
            .await
            .unwrap();
        assert_denied(
            node.commit("data", "planted", &entry, 0).await,
            "ferry-node",
            "a node writing the namespace",
        );
        assert_denied(
            node.put_share("other", &share).await,
            "ferry-node",
            "a node creating a share",
        );
        // Nothing of the refused writes is there.
        assert!(!node
            .nodes()
            .await
            .unwrap()
            .iter()
            .any(|n| n.id == "intruder"));
        assert!(node.entry("data", "planted").await.unwrap().is_none());
    });
}

#[test]
fn etcd_auth_setup_lets_each_role_write_only_its_own_keys() {
    if skip_without_cluster("etcd_auth_setup_lets_each_role_write_only_its_own_keys") {
        return;
    }
    // The nodes log in as ferry-node from the start: until auth-setup made the user
    // (and its password file) they are refused and keep trying.
    let mut cluster = tls_cluster(2, Some("ferry-node"));
    let etcd = cluster.etcd_endpoint();
    let users = cluster.etcd_users_dir();
    let setup = [
        "cluster",
        "auth-setup",
        "--etcd",
        etcd.as_str(),
        "--password-dir",
        path(&users),
    ];
    cluster.ferry(setup).assert_success();
    for user in ["root", "ferry-admin", "ferry-node", "ferry-client"] {
        assert!(
            users.join(format!("{user}.password")).is_file(),
            "{user}'s password file"
        );
    }

    // Authentication is on: anonymous clients and wrong passwords are refused.
    let status = ["cluster", "status", "--etcd", etcd.as_str()];
    assert_refused(&cluster.ferry(status), 3, "requires a user");
    let wrong = cluster.dir().join("wrong.password");
    std::fs::write(&wrong, "not the password\n").unwrap();
    let wrong_user = [
        &status[..],
        &[
            "--etcd-user",
            "ferry-client",
            "--etcd-password-file",
            path(&wrong),
        ],
    ]
    .concat();
    assert_refused(&cluster.ferry(&wrong_user), 3, "refused user ferry-client");
    // Running the setup again needs root, and changes nothing.
    let root_password = users.join("root.password");
    let as_root = [
        &setup[..],
        &[
            "--etcd-user",
            "root",
            "--etcd-password-file",
            path(&root_password),
        ],
    ]
    .concat();
    cluster.ferry(&as_root).assert_success();

    // The nodes registered as ferry-node; the admin creates the share.
    cluster.set_client_etcd_user(Some("ferry-admin"));
    cluster.wait_nodes(2, REGISTER_LIMIT);
    cluster.add_share("data", 2, 1);

    // A client writes files, and may not create shares.
    cluster.set_client_etcd_user(Some("ferry-client"));
    let local = cluster.dir().join("local");
    std::fs::create_dir(&local).unwrap();
    let src = local.join("f");
    write_random_file(&src, 3 * MIB + 1, 42);
    let env = cluster.client_env();
    rcp_env(&env, rcp_args![&src, cluster.url("data", "f")]).assert_success();
    rcp_env(
        &env,
        rcp_args![cluster.url("data", "f"), local.join("back")],
    )
    .assert_success();
    assert_files_equal(&src, &local.join("back"));
    let add = ["cluster", "add-share", "--etcd", etcd.as_str(), "other"];
    cluster
        .ferry(add)
        .assert_code(1)
        .assert_stderr_has("permission denied to user ferry-client");

    check_roles(&cluster);
}

#[test]
fn a_cluster_share_mounts_through_a_tls_etcd() {
    let name = "a_cluster_share_mounts_through_a_tls_etcd";
    if skip_without_cluster(name) || skip_without_fuse(name) {
        return;
    }
    let cluster = tls_cluster(1, None);
    cluster.wait_nodes(1, REGISTER_LIMIT);
    cluster.add_share("data", 1, 1);
    let local = cluster.dir().join("local");
    std::fs::create_dir(&local).unwrap();
    let src = local.join("f");
    write_random_file(&src, 2 * MIB + 5, 43);
    rcp_env(
        &cluster.client_env(),
        rcp_args![&src, cluster.url("data", "f")],
    )
    .assert_success();
    let certs = cluster.certs().expect("a TLS cluster").clone();
    let config = cluster.cluster_config().expect("a TLS cluster").to_owned();

    // Without the client certificate the mount is refused, saying why.
    let refused = Mount::builder(cluster.url("data", ""))
        .arg("--etcd-ca")
        .arg(&certs.ca)
        .opt("ro")
        .try_start()
        .expect_err("a mount without the client certificate");
    assert_eq!(refused.code, Some(3), "{refused}");
    assert!(
        refused.stderr.contains("client certificate required"),
        "{refused}"
    );
    assert!(refused.elapsed < REFUSAL_LIMIT, "{refused}");

    // With the cluster configuration file it mounts and reads the file back.
    let mount = Mount::builder(cluster.url("data", ""))
        .arg("--cluster-config")
        .arg(&config)
        .opt("ro")
        .start();
    assert_eq!(
        std::fs::read(mount.join("f")).unwrap(),
        std::fs::read(&src).unwrap()
    );
}
